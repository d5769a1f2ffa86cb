"""The rejection-sampling core: draft, verify, accept (Leviathan et al. 2023, Chen et al. 2023).

  draft(drafter, params, state, ctx, k, sp, keys) -> Proposal, state
  verify(lm, params, cache, last [B], drafts [B, k], sp) -> p [B, k+1, V], hidden, cache
  rejection_sample(p, q, drafts, keys) -> n_accepted [B], emitted [B, k+1]

Pure and jit-compatible; `jaxspec.decoding.loop` builds one loop step from them.
"""

from __future__ import annotations

import dataclasses
import warnings

import jax
import jax.numpy as jnp

from jaxspec import sampling as sampling_lib
from jaxspec.decoding import protocol
from jaxspec.decoding.drafter import DraftContext, Drafter, Proposal
from jaxspec.sampling import SamplingArrays


def draft(drafter: Drafter, params, state, ctx: DraftContext, k: int, sp: SamplingArrays,
          keys: jax.Array):
  """Asks `drafter` for k tokens per row.

  Returns:
    a `Proposal` (tokens [B, k] int32; q [B, k, V] float32 draft probabilities, None for a
    deterministic drafter, meaning one-hot q; n_valid [B] real drafts per row) and the
    drafter's new state.
  """
  return drafter.propose(params, state, ctx, k, sp, keys)


def _is_lm(x) -> bool:
  """Whether `x` is a model (`CausalLM`, or a configuration registered for one), not weights."""
  return type(x) in protocol.LM_OF_CONFIG or all(hasattr(x, m) for m in protocol.REQUIRED)


def verify(lm, params, cache, last: jax.Array, drafts: jax.Array, sp: SamplingArrays, *,
           hidden_layers: tuple[int, ...] = (), write: bool = True,
           return_logits: bool = False, history: sampling_lib.TokenHistory | None = None):
  """One target pass over [last, d_1 .. d_k] for every row.

  The model comes first, as in every public function; the order before issue 49,
  verify(params, cache, last, drafts, lm, sp), still works with a DeprecationWarning.

  Args:
    lm: the target model (`jaxspec.decoding.CausalLM`; a `LlamaConfig` means jaxspec's Llama).
    params: target weights.
    cache: target cache holding every token before `last` (per-row length).
    last: [B] the last accepted token of every row.
    drafts: [B, k] proposals.
    sp: sampling arrays; p is processed with them exactly as plain decoding would.
    return_logits: also return the target's logits [B, k+1, V] (last), for log-probabilities
      (adjusted, with a history).
    history: the rows' `TokenHistory` before `last`'s successor (the loop's), when `sp` has
      penalties, a logit bias or min_new_tokens: position i is adjusted with drafts[:, :i]
      counted as generated, the context plain decoding would have had there (`jaxspec.sampling.
      adjust`), so p is the distribution the token at i is drawn from.
  Returns:
    p [B, k+1, V] float32 target distributions (p[:, i] is the distribution of the token after
    drafts[:, :i]), the target's Hidden states [B, k+1, D], and the cache with length + k + 1
    (the caller moves it back to what was accepted); with write=False the new block (jaxspec's
    Llama: keys and values [L, B, k+1, G, K]) instead, for `protocol.write_block`.
  """
  if not _is_lm(lm) and _is_lm(drafts):  # verify(params, cache, last, drafts, lm, sp)
    warnings.warn("verify(params, cache, last, drafts, lm, sp) is deprecated: pass the model"
                  " first, verify(lm, params, cache, last, drafts, sp)", DeprecationWarning,
                  stacklevel=2)
    lm, params, cache, last, drafts = drafts, lm, params, cache, last
  lm = protocol.as_lm(lm)
  tokens = jnp.concatenate([last[:, None], drafts], axis=1)
  logits, hidden, cache = protocol.forward(lm, params, tokens, cache,
                                           hidden_layers=hidden_layers, write=write)
  if history is not None:
    added, n_added = sampling_lib.chain_context(sp, drafts, logits.shape[-1])
    logits = sampling_lib.adjust(logits, sp, history, added, n_added)
  if return_logits:
    return sampling_lib.probs(logits, sp), hidden, cache, logits
  return sampling_lib.probs(logits, sp), hidden, cache


def acceptance(p: jax.Array, q: jax.Array | None, drafts: jax.Array, u: jax.Array,
               n_valid: jax.Array | None = None):
  """The deterministic half of rejection sampling, given the uniforms u [B, k] in [0, 1).

  Draft i is accepted iff u_i * q_i(x_i) < p_i(x_i), i.e. with probability min(1, p/q) (the
  division-free form accepts q = 0 with p > 0, and never accepts p = 0, u = 0 included).
  With n_valid [B], a row's drafts from n_valid on are not proposals: the row behaves exactly
  as if it had drafted n_valid tokens (its token at n_valid comes from p itself).

  Returns:
    n_accepted [B] int32 in 0..k, and the unnormalised distribution [B, V] of the token that
    follows the accepted drafts: max(p - q, 0) at the first rejection, p_{k+1} when all k were
    accepted (p itself where rounding left no residual mass).
  """
  b, k1, v = p.shape
  k = k1 - 1
  p = p.astype(jnp.float32)
  if k == 0:  # nothing drafted: a plain step samples from p_1
    return jnp.zeros((b,), jnp.int32), p[:, 0]
  p_x = jnp.take_along_axis(p[:, :k], drafts[:, :, None], axis=2)[..., 0]  # [B, k]
  if q is None:
    q_x = jnp.ones_like(p_x)
  else:
    q_x = jnp.take_along_axis(q.astype(jnp.float32), drafts[:, :, None], axis=2)[..., 0]
  accept = u * q_x < p_x
  limit = jnp.full((b,), k, jnp.int32) if n_valid is None else jnp.clip(n_valid, 0, k)
  accept = accept & (jnp.arange(k)[None, :] < limit[:, None])
  n_acc = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)  # [B]
  rows = jnp.arange(b)
  p_j = p[rows, n_acc]  # [B, V]
  rejected = n_acc < limit  # else: past the last real draft, the token comes from p itself
  if q is None:
    # max(p - onehot(x), 0) zeroes x's entry (p <= 1); there is no q at the bonus position.
    x_j = drafts[rows, jnp.minimum(n_acc, k - 1)]
    hit = (jnp.arange(v)[None, :] == x_j[:, None]) & rejected[:, None]
    resid = jnp.where(hit, 0.0, p_j)
  else:
    q_j = q.astype(jnp.float32)[rows, jnp.minimum(n_acc, k - 1)]
    resid = jnp.where(rejected[:, None], jnp.maximum(p_j - q_j, 0.0), p_j)
  # p == q leaves no residual mass; a rejection then has probability zero in exact arithmetic,
  # so falling back to p only matters under rounding.
  resid = jnp.where(resid.sum(-1, keepdims=True) > 0, resid, p_j)
  return n_acc.astype(jnp.int32), resid


def rejection_sample(p: jax.Array, q: jax.Array | None, drafts: jax.Array, keys: jax.Array,
                     n_valid: jax.Array | None = None, greedy: jax.Array | None = None):
  """Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023), per row.

  Draft i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the
  token is drawn from normalize(max(p_i - q_i, 0)); when all k are accepted a bonus token is
  drawn from p_{k+1}. With one-hot p (greedy) this accepts exactly while the draft equals the
  target's argmax and then emits the argmax. Float32 throughout.

  With position keys ([B, k+1]: `position_keys`, the loop's form) every draw for token j uses
  token j's key, and deterministic drafts (q None) take the coupled form of the same rule: the
  target's token y_j is drawn from p_j with that key, as `generate` would draw it, and draft j
  is accepted iff it equals y_j (probability p_j(x_j), the one-hot rule's). The emitted text is
  then `generate`'s for the same key, whatever drafted it and however many per step.

  Args:
    p: [B, k+1, V] target probabilities.
    q: [B, k, V] draft probabilities, or None for deterministic drafts (one-hot q).
    drafts: [B, k] int32.
    keys: [B, k+1] the keys of the k+1 positions (`position_keys`), or [B] one key per row for
      the step (split into the acceptance uniforms and the last draw).
    n_valid: [B] real drafts per row (None: all k); later drafts are never accepted.
    greedy: [B] bool rows decoded greedily (one-hot p): their token is the argmax of the
      one-hot residual, and an all-greedy batch draws no random numbers over the vocabulary;
      True (`sampling.greedy_rows` of an all-greedy batch): every row, and no draw compiled.
  Returns:
    n_accepted [B] int32 in 0..k, and emitted [B, k+1] int32: the accepted drafts followed by
    the correction or bonus token at index n_accepted (entries after it are -1).
  """
  b, k1, _ = p.shape
  k = k1 - 1
  rows = jnp.arange(b)
  if greedy is True and keys.ndim == 2:
    q = None  # every p one-hot: the coupled rule is the same (accept while a draft is the argmax)
  if keys.ndim == 2:
    limit = jnp.full((b,), k, jnp.int32) if n_valid is None else jnp.clip(n_valid, 0, k)
    if q is None:
      y = sampling_lib.sample_positions(keys, p.astype(jnp.float32), greedy)  # [B, k+1]
      hit = (drafts == y[:, :k]) & (jnp.arange(k)[None, :] < limit[:, None])
      n_acc = jnp.sum(jnp.cumprod(hit.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)
      final = y[rows, n_acc]
    else:
      u = jax.vmap(jax.vmap(lambda kk: jax.random.uniform(jax.random.fold_in(kk, 1))))(
          keys[:, :k])  # [B, k]
      n_acc, resid = acceptance(p, q, drafts, u, n_valid)
      # A rejection draws from the residual with its own stream; otherwise (past the drafts)
      # the token comes from p itself, drawn with the position's key as `generate` draws it.
      final = _draw_final(keys[rows, n_acc], n_acc < limit, resid, greedy)
  else:
    ku, ks = jax.vmap(lambda kk: jax.random.split(kk, 2), out_axes=1)(keys)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,), jnp.float32))(ku)  # [B, k]
    n_acc, resid = acceptance(p, q, drafts, u, n_valid)
    final = sampling_lib.sample_from_probs(ks, resid, greedy)
  idx = jnp.arange(k1)[None, :]
  d_pad = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1)
  emitted = jnp.where(idx < n_acc[:, None], d_pad,
                      jnp.where(idx == n_acc[:, None], final[:, None], -1))
  return n_acc, emitted.astype(jnp.int32)


def _draw_final(key_at: jax.Array, rejected: jax.Array, resid: jax.Array,
                greedy: jax.Array | None) -> jax.Array:
  """The token after the accepted drafts: from the residual at a rejection (the position key's
  stream 2), else from p itself with the position's key (`generate`'s draw)."""
  streamed = jax.vmap(jax.random.fold_in)(key_at, jnp.full(rejected.shape, 2, jnp.int32))
  return sampling_lib.sample_from_probs(jnp.where(rejected, streamed, key_at), resid, greedy)


def in_vocabulary(prop: Proposal, vocab_size: int) -> Proposal:
  """The proposal with every draft from the first one outside [0, vocab_size) on not counted
  (n_valid cut there) and replaced by token 0, so no drafter, however wrong, can feed the
  target an id whose embedding lookup would read NaN into the pass and the cache. Exact: a
  draft that does not count leaves its position to the target's own distribution."""
  b, k = prop.tokens.shape
  bad = (prop.tokens < 0) | (prop.tokens >= vocab_size)
  first_bad = jnp.where(jnp.any(bad, axis=1), jnp.argmax(bad, axis=1), k).astype(jnp.int32)
  n_valid = jnp.full((b,), k, jnp.int32) if prop.n_valid is None else prop.n_valid
  return dataclasses.replace(prop, tokens=jnp.where(bad, 0, prop.tokens).astype(jnp.int32),
                             n_valid=jnp.minimum(n_valid, first_bad))
