"""Exact speculative decoding: draft, verify in one target pass, rejection-sample, roll back.

The building blocks are pure and jit-compatible:

  draft(drafter, params, state, ctx, k, sp, keys) -> drafts [B, k], q [B, k, V] | None, state
  verify(params, cache, last [B], drafts [B, k], cfg, sp) -> p [B, k+1, V], hidden, cache
  rejection_sample(p, q, drafts, keys) -> n_accepted [B], emitted [B, k+1]

and `speculative_generate` runs prefill plus the whole draft -> verify -> accept -> roll back
loop as one `jax.jit` around a `lax.while_loop`. Every row accepts its own number of tokens:
its target and draft cache lengths move by its own count, rejected entries are rolled back by
the length alone, and finished rows stop growing while shapes stay static.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxspec import sampling as sampling_lib
from jaxspec import adaptive
from jaxspec.adaptive import AutoK, CostModel
from jaxspec.drafters import DraftContext, Drafter, Proposal, resolve_coupled, resolve_drafter
from jaxspec.generate import (GenerateOutput, _as_key, _resolve_sampling, _stream_loop,
                              check_chunk, check_model, compiled, decode_texts, is_stop,
                              keep_cache_buffers, prefill,
                              prepare_prompts, put_global, stop_ids_for, take_cache_buffers,
                              to_host)
from jaxspec.models.config import LlamaConfig
from jaxspec.models.llama import Hidden, KVCache, forward, init_cache, write_cache
from jaxspec.models.model import Model
from jaxspec.sampling import position_keys  # noqa: F401 - public here too
from jaxspec.sampling import Sampling, SamplingArrays


from jaxspec.pytree import pytree_dataclass as _pytree  # noqa: E402


# ----------------------------------------------------------------------------------------------
# Building blocks.


def draft(drafter: Drafter, params, state, ctx: DraftContext, k: int, sp: SamplingArrays,
          keys: jax.Array):
  """Asks `drafter` for k tokens per row.

  Returns:
    a `Proposal` (tokens [B, k] int32; q [B, k, V] float32 draft probabilities, None for a
    deterministic drafter, meaning one-hot q; n_valid [B] real drafts per row) and the
    drafter's new state.
  """
  return drafter.propose(params, state, ctx, k, sp, keys)


def verify(params, cache: KVCache, last: jax.Array, drafts: jax.Array, cfg: LlamaConfig,
           sp: SamplingArrays, *, hidden_layers: tuple[int, ...] = (), write: bool = True):
  """One target pass over [last, d_1 .. d_k] for every row.

  Args:
    params: target weights.
    cache: target cache holding every token before `last` (per-row length).
    last: [B] the last accepted token of every row.
    drafts: [B, k] proposals.
    cfg: target configuration.
    sp: sampling arrays; p is processed with them exactly as plain decoding would.
  Returns:
    p [B, k+1, V] float32 target distributions (p[:, i] is the distribution of the token after
    drafts[:, :i]), the target's Hidden states [B, k+1, D], and the cache with length + k + 1
    (the caller moves it back to what was accepted); with write=False the new block's keys and
    values (k_new, v_new) [L, B, k+1, G, K] instead, for `write_cache`.
  """
  tokens = jnp.concatenate([last[:, None], drafts], axis=1)
  logits, hidden, cache = forward(params, tokens, cache, cfg, hidden_layers=hidden_layers,
                                  write=write)
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
      one-hot residual, and an all-greedy batch draws no random numbers over the vocabulary.
  Returns:
    n_accepted [B] int32 in 0..k, and emitted [B, k+1] int32: the accepted drafts followed by
    the correction or bonus token at index n_accepted (entries after it are -1).
  """
  b, k1, _ = p.shape
  k = k1 - 1
  rows = jnp.arange(b)
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


# ----------------------------------------------------------------------------------------------
# The fused loop.


@dataclasses.dataclass(frozen=True)
class Policy:
  """How the loop picks k (static: part of the compiled program).

  buckets: the compiled draft counts, ascending, starting with 0 (a plain decode step).
  auto: choose among them from the acceptance and cost models; otherwise use the largest,
    falling back to a plain step when no live row has a real draft.
  """

  buckets: tuple[int, ...]
  auto: bool = False
  decay: float = 0.95
  prior: tuple[float, float] = (0.5, 0.5)
  margin: float = 0.0

  @property
  def k_max(self) -> int:
    return self.buckets[-1]

  @classmethod
  def fixed(cls, k: int) -> Policy:
    return cls(buckets=(0, k))

  @classmethod
  def from_auto(cls, a: AutoK) -> Policy:
    return cls(buckets=a.resolved_buckets(), auto=True, decay=a.decay, prior=tuple(a.prior),
               margin=a.margin)


@_pytree
@dataclasses.dataclass
class SpecStats:
  """Device-side counters, summed over the loop."""

  target_passes: jax.Array  # [] verify passes (the prefill is not counted)
  drafted: jax.Array  # [B] tokens drafted per row
  accepted: jax.Array  # [B] drafts accepted per row
  emitted: jax.Array  # [B] tokens emitted by verify steps per row
  row_steps: jax.Array  # [B] target passes in which the row was live
  spec_row_steps: jax.Array  # [B] of those, the passes that verified drafts (not plain steps)
  accepted_at: jax.Array  # [K] live row-steps whose draft i was accepted
  reached_at: jax.Array  # [K] live row-steps that verified a real draft i after i-1 accepts
  k_history: jax.Array  # [max_steps] k verified at each step (0: a plain step, nothing drafted)


@_pytree
@dataclasses.dataclass
class SpecState:
  seq: jax.Array  # [B, S] prompt + emitted tokens
  seq_len: jax.Array  # [B]
  prompt_len: jax.Array  # [B]
  done: jax.Array  # [B] bool
  cache: KVCache  # target cache: positions [0, seq_len - 1)
  draft_state: Any
  keys: jax.Array  # [B]
  counts: adaptive.AcceptanceCounts  # the controller's acceptance model
  stats: SpecStats


@_pytree
@dataclasses.dataclass
class Deferred:
  """The draft state of a `defer_commit` drafter in the fused loop with "auto": the drafter's
  own state, and what plain steps emitted since its last commit (caught up in one pass)."""

  inner: Any  # the drafter's state as of `pending` tokens ago
  pending: jax.Array  # [B] int32 tokens (from plain steps) the drafter has not committed
  hidden: Hidden | None  # [B, W, D] (layers [n, B, W, D]) their target features, in order


def _defers(drafter: Drafter, policy: Policy) -> bool:
  """Whether the fused loop defers this drafter's commits over plain steps."""
  return bool(drafter.defer_commit and not drafter.free_proposals and policy.auto
              and drafter.tree is None and policy.k_max > 0)


def _pending_ctx(s: SpecState, pending: jax.Array, hidden: Hidden | None) -> DraftContext:
  """The context of a deferred commit: the pending tokens as one step that emitted them all."""
  return DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len, hidden=hidden,
                      hidden_pos=jnp.maximum(pending - 1, 0), n_new=pending)


def _catch_up(drafter, dparams, s: SpecState, dw: Deferred, width: int):
  """The drafter's state with the pending tokens committed (unchanged when none are)."""
  ctx = _pending_ctx(s, dw.pending, dw.hidden)
  return lax.cond(jnp.any(dw.pending > 0),
                  lambda st: drafter.catch_up(dparams, st, ctx, width), lambda st: st, dw.inner)


def _write_tokens(seq, seq_len, emitted, n_emit):
  """Writes emitted[:, :n_emit] at seq_len (per row); entries past n_emit are not written."""
  b, w = emitted.shape
  pos = seq_len[:, None] + jnp.arange(w)[None, :]
  pos = jnp.where(jnp.arange(w)[None, :] < n_emit[:, None], pos, seq.shape[1])  # dropped
  return seq.at[jnp.arange(b)[:, None], pos].set(emitted, mode="drop")


def _spec_init(tparams, dparams, prompt, prompt_len, sp, key, buffers=None, *, cfg, drafter,
               max_len, seq_cap, policy, max_new_tokens, stop_ids, max_steps):
  """Prefill, the first new token and the drafter's state after it; with `buffers` (donated,
  `take_cache_buffers`) the target's cache is written into them."""
  s, ctx = _spec_prefill(tparams, dparams, prompt, prompt_len, sp, key, cfg=cfg, drafter=drafter,
                         max_len=max_len, seq_cap=seq_cap, policy=policy,
                         max_new_tokens=max_new_tokens, stop_ids=stop_ids, max_steps=max_steps,
                         buffers=buffers)
  if _defers(drafter, policy):  # the first token is a plain step: kept pending too
    hidden = ctx.hidden if drafter.uses_target_hidden else None
    return dataclasses.replace(s, draft_state=Deferred(inner=s.draft_state, pending=ctx.n_new,
                                                       hidden=hidden))
  return dataclasses.replace(s, draft_state=drafter.commit(dparams, s.draft_state, ctx))


def _spec_prefill(tparams, dparams, prompt, prompt_len, sp, key, *, cfg, drafter, max_len,
                  seq_cap, policy, max_new_tokens, stop_ids, max_steps, buffers=None):
  """The prefill and the first new token, sampled from its logits as plain decoding does (no
  extra target pass: the prefill computed them). Returns the state, whose draft_state is the
  drafter's `init` (after the prompt), and the `DraftContext` of the first token, the plain
  step the prefill amounts to, which the drafter's `commit` takes next. Neither the statistics
  nor the acceptance model count it."""
  b, pw = prompt.shape
  want_hidden = drafter.uses_target_hidden
  logits, hidden, cache = prefill(tparams, prompt, prompt_len, cfg, max_len,
                                  hidden_layers=drafter.hidden_layers if want_hidden else (),
                                  buffers=buffers)
  keys = sampling_lib.row_keys(key, b)
  seq = jnp.zeros((b, seq_cap), jnp.int32).at[:, :pw].set(prompt)
  dstate = drafter.init(dparams, prompt, prompt_len, max_len,
                        hidden=hidden if want_hidden else None)
  z = lambda *s: jnp.zeros(s, jnp.int32)
  k = policy.k_max
  stats = SpecStats(target_passes=z(), drafted=z(b), accepted=z(b), emitted=z(b), row_steps=z(b),
                    spec_row_steps=z(b), accepted_at=z(k), reached_at=z(k), k_history=z(max_steps))
  # The cache holds the whole prompt; the step below keeps x_{P-1} as if a plain step had just
  # written it.
  s = SpecState(seq=seq, seq_len=prompt_len, prompt_len=prompt_len,
                done=jnp.zeros((b,), bool), cache=dataclasses.replace(cache, length=prompt_len - 1),
                draft_state=dstate, keys=keys, counts=adaptive.init_counts(b, k), stats=stats)
  # New token 0 of every row, drawn with its position's key as `generate` draws it.
  first = sampling_lib.sample(position_keys(keys, jnp.zeros_like(prompt_len), 1)[:, 0], logits,
                              sp)
  idx = (prompt_len - 1)[:, None, None]
  final = jnp.take_along_axis(hidden.final, idx, axis=1)  # [B, 1, D]: f_{P-1}
  layers = None
  if hidden.layers is not None:
    layers = jnp.take_along_axis(hidden.layers, idx[None], axis=2)  # [n, B, 1, D]
  out = _plain_outcome(first, Hidden(final=final, layers=layers), None, k)
  new, ctx = _finish_step(s, out, policy=policy, max_new_tokens=max_new_tokens,
                          stop_ids=stop_ids)
  return dataclasses.replace(new, stats=stats, counts=s.counts), ctx


def _plain_block(tok: jax.Array, kmax: int) -> jax.Array:
  """A plain step's emitted block [B, kmax + 1]: the token, then -1."""
  return jnp.full((tok.shape[0], kmax + 1), -1, jnp.int32).at[:, 0].set(tok)


def _plain_outcome(tok: jax.Array, hidden: Hidden, kv_new, kmax: int):
  """A plain step's outcome in `_finish_step`'s form: nothing drafted or accepted, the token
  [B] emitted, its target features padded to kmax + 1, and kv_new (the new cache entries, or
  None when they are written already)."""
  z = jnp.zeros((tok.shape[0],), jnp.int32)
  return (z, _plain_block(tok, kmax), _pad_hidden(hidden, kmax + 1), kv_new, z, jnp.int32(0))


def _pad_axis(x, axis, width):
  """Zero-pads `axis` of x to `width`."""
  return jnp.pad(x, [(0, width - x.shape[axis]) if i == axis else (0, 0) for i in range(x.ndim)])


def _pad_hidden(h: Hidden, width: int) -> Hidden:
  """Pads the token axis of a verify pass's Hidden (final [B, T, D]; layers [n, B, T, D])."""
  return Hidden(final=_pad_axis(h.final, 1, width),
                layers=None if h.layers is None else _pad_axis(h.layers, 2, width))


def _pad_to(x, width, value):
  """Pads axis 1 of x to `width`."""
  return jnp.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2),
                 constant_values=value)


def step_keys(keys: jax.Array, seq_len: jax.Array):
  """The step's per-row draft and verify keys [B] each, from the row keys and lengths (a
  drafter on another mesh derives the same draft keys from its copies)."""
  folded = jax.vmap(jax.random.fold_in)(keys, seq_len)
  kd, kv = jax.vmap(lambda kk: jax.random.split(kk, 2), out_axes=1)(folded)
  return kd, kv


def _step_inputs(s: SpecState, width: int = 1):
  """What every step derives from the state: live rows, the step's draft keys [B], the keys of
  the next `width` token positions [B, width] (`position_keys`: the target's draws) and the
  last accepted token."""
  kd, _ = step_keys(s.keys, s.seq_len)
  kv = position_keys(s.keys, s.seq_len - s.prompt_len, width)
  last = jnp.take_along_axis(s.seq, (s.seq_len - 1)[:, None], axis=1)[:, 0]
  return ~s.done, kd, kv, last


def _room(s: SpecState, max_new_tokens: int) -> jax.Array:
  return max_new_tokens - (s.seq_len - s.prompt_len)  # [B] tokens each row may still emit


def _verify_branch(tparams, cache, last, prop: Proposal | None, k: int, sp, kv, live, forced, *,
                   cfg, drafter, kmax, known_drafts=False):
  """Verifies k drafts (k = 0 or prop None: a plain one-token step) and rejection-samples.

  Reads the target cache only; returns (n_acc [B], emitted [B, kmax+1], hidden padded to
  kmax+1, (k_new, v_new) padded to kmax+1, n_valid [B], k verified []) so every branch of the
  caller's `lax.switch` has the same shapes and the one cache write happens after it.
  """
  b = last.shape[0]
  greedy = sp.temperature == 0
  hidden_layers = drafter.hidden_layers if drafter.uses_target_hidden else ()
  pad_kv = lambda kv_new: jax.tree.map(lambda x: _pad_axis(x, 2, kmax + 1), kv_new)

  def plain(cache):  # as `generate`'s decode step: sampled from the logits, no [B, V] one-hot
    logits, hidden, kv_new = forward(tparams, last[:, None], cache, cfg,
                                     hidden_layers=hidden_layers, write=False)
    return _plain_outcome(sampling_lib.sample(kv[:, 0], logits[:, 0], sp), hidden,
                          pad_kv(kv_new), kmax)

  if k == 0 or prop is None:
    return plain(cache)
  prop = in_vocabulary(prop, cfg.vocab_size)
  n_valid = prop.n_valid

  def verify_drafts(cache):
    p, hidden, kv_new = verify(tparams, cache, last, prop.tokens, cfg, sp,
                               hidden_layers=hidden_layers, write=False)
    n_acc, emitted = rejection_sample(p, prop.q, prop.tokens, kv[:, :k + 1], n_valid, greedy)
    return (n_acc, _pad_to(emitted, kmax + 1, -1), _pad_hidden(hidden, kmax + 1),
            pad_kv(kv_new), n_valid, jnp.int32(k))

  if known_drafts:
    # A fixed k chosen after seeing these proposals (`_choose`): some live row has a real
    # draft, or the step is forced. A conditional would only add a host round trip on GPUs.
    return verify_drafts(cache)
  # No live row has a real draft: a one-token pass costs less than verifying filler.
  return lax.cond(forced | jnp.any(live & (n_valid > 0)), verify_drafts, plain, cache)


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


def _slice_proposal(prop: Proposal, k: int, n_valid_all: jax.Array) -> Proposal:
  """The first k of k_max proposed drafts."""
  return Proposal(tokens=prop.tokens[:, :k], q=None if prop.q is None else prop.q[:, :k],
                  n_valid=jnp.minimum(n_valid_all, k))


def _finish_step(s: SpecState, out, *, policy, max_new_tokens, stop_ids, shadow_draft=None):
  """Commits one verify pass's outcome to the target side of the state.

  Writes the new block to the cache and rolls it back to what was accepted, appends the emitted
  tokens (cut at a stop token and at max_new_tokens), updates the acceptance counts and the
  statistics. Returns the new state (draft_state untouched) and the `DraftContext` the
  drafter's `commit` reads. shadow_draft [B] (or None): each row's deterministic first draft
  (-1: none) when drafts were proposed before the choice; a plain step then still tells the
  acceptance model whether that draft would have been accepted.
  """
  n_acc, emitted, hidden, kv_new, n_valid, k_used = out
  kmax = policy.k_max
  live = ~s.done
  room = _room(s, max_new_tokens)
  old_len = s.cache.length
  cache = s.cache
  if kv_new is not None:  # None: the block is in the cache already (the prefill wrote it)
    cache = write_cache(cache, *kv_new, positions_start=old_len)
  n_emit = n_acc + 1
  # A stop token inside the accepted run ends the row there.
  i1 = jnp.arange(kmax + 1)[None, :]
  stop_hit = is_stop(emitted, stop_ids) & (i1 < n_emit[:, None])
  first_stop = jnp.argmax(stop_hit, axis=1)
  has_stop = stop_hit.any(axis=1)
  n_emit = jnp.where(has_stop, first_stop + 1, n_emit)
  n_emit = jnp.where(live, jnp.minimum(n_emit, room), 0)
  seq = _write_tokens(s.seq, s.seq_len, emitted, n_emit)
  seq_len = s.seq_len + n_emit
  # Roll back: the cache keeps every emitted token but the newest (the next pass's input).
  cache = dataclasses.replace(cache, length=jnp.where(live, old_len + n_emit, old_len))
  done = s.done | (live & has_stop) | (seq_len - s.prompt_len >= max_new_tokens)
  ctx = DraftContext(seq=seq, seq_len=seq_len, prompt_len=s.prompt_len, hidden=hidden,
                     hidden_pos=jnp.maximum(n_emit - 1, 0), n_new=n_emit)
  verified = live & (k_used > 0)
  n_real = jnp.where(verified, jnp.minimum(n_valid, k_used), 0)
  shadow = hit = None
  if shadow_draft is not None:
    shadow = live & (k_used == 0) & (shadow_draft >= 0)
    hit = emitted[:, 0] == shadow_draft
  counts = adaptive.update_counts(s.counts, policy.decay, verified, n_real, n_acc, shadow, hit)
  acc_eff = jnp.where(live, jnp.minimum(n_acc, n_emit), 0)
  st = s.stats
  steps = st.target_passes
  i = jnp.arange(kmax)[None, :]
  reached = (i < jnp.minimum(jnp.minimum(n_acc, n_real) + 1, n_real)[:, None]) & verified[:, None]
  stats = SpecStats(
      target_passes=steps + 1,
      drafted=st.drafted + n_real,
      accepted=st.accepted + acc_eff,
      emitted=st.emitted + n_emit,
      row_steps=st.row_steps + live,
      spec_row_steps=st.spec_row_steps + verified,
      accepted_at=st.accepted_at + jnp.sum((i < n_acc[:, None]) & verified[:, None], 0),
      reached_at=st.reached_at + jnp.sum(reached, 0),
      k_history=st.k_history.at[steps].set(k_used, mode="drop"))
  new = SpecState(seq=seq, seq_len=seq_len, prompt_len=s.prompt_len, done=done, cache=cache,
                  draft_state=s.draft_state, keys=s.keys, counts=counts, stats=stats)
  return new, ctx


def _tree_step(tparams, dparams, s: SpecState, sp, *, cfg, drafter, policy, max_new_tokens,
               stop_ids):
  """One tree step: the drafter's tree, one target pass over all its nodes, the tree rule,
  and the accepted path committed as a chain of the same length would be."""
  from jaxspec import tree as tree_lib
  _, kd, kv, last = _step_inputs(s, policy.k_max + 1)
  ctx = DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len,
                     row_keys=s.keys)
  prop, dstate = drafter.propose_tree(dparams, s.draft_state, ctx, sp, kd)
  # A node outside the vocabulary is never accepted, and runs through the target as token 0
  # (an out-of-range id would read a NaN embedding into the pass and the cache).
  in_vocab = (prop.tokens >= 0) & (prop.tokens < cfg.vocab_size)
  tokens = jnp.where(in_vocab, prop.tokens, 0).at[:, 0].set(last)
  depth = policy.k_max
  hidden_layers = drafter.hidden_layers if drafter.uses_target_hidden else ()
  p, hidden, kv_new = tree_lib.verify_tree(tparams, s.cache, tokens, prop.parents, prop.depth,
                                           cfg, sp, max_depth=depth, hidden_layers=hidden_layers)
  n_acc, emitted, path = tree_lib.tree_accept(p, tokens, prop.parents, kv, depth,
                                              greedy=sp.temperature == 0, valid=in_vocab,
                                              depth=prop.depth)
  hidden, kv_path = tree_lib.gather_path(path, hidden, kv_new)
  b = last.shape[0]
  out = (n_acc, emitted, hidden, kv_path, jnp.full((b,), depth, jnp.int32), jnp.int32(depth))
  new, ctx = _finish_step(s, out, policy=policy, max_new_tokens=max_new_tokens,
                          stop_ids=stop_ids)
  return dataclasses.replace(new, draft_state=drafter.commit(dparams, dstate, ctx))


@_pytree
@dataclasses.dataclass
class _Choice:
  """A step's choice of k, made before the step: the bucket index, and for a drafter whose
  proposals cost nothing its k_max proposals (which the choice read) and state after them."""

  idx: jax.Array  # [] int32 index into policy.buckets
  prop: Proposal | None
  dstate: Any
  n_valid: jax.Array  # [B] real drafts per row (k_max when not known before drafting)


def _choose(dparams, s: SpecState, sp, costs, force_idx, *, drafter, policy,
            max_new_tokens) -> _Choice:
  """Picks the step's bucket: the controller's choice ("auto"), the largest bucket when some
  live row has a real draft (a fixed k), or force_idx when >= 0."""
  b = s.seq.shape[0]
  kmax = policy.k_max
  live, kd, _, _ = _step_inputs(s)
  full = jnp.full((b,), kmax, jnp.int32)
  # A drafter whose proposals cost next to nothing (n-gram lookup) proposes k_max up front, so
  # the choice of k knows which rows have real drafts; a model drafter drafts inside the branch.
  if drafter.free_proposals:
    ctx = DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len,
                     row_keys=s.keys)
    prop, dstate = draft(drafter, dparams, s.draft_state, ctx, kmax, sp, kd)
    nv_all = full if prop.n_valid is None else prop.n_valid
    known = nv_all
  else:
    prop = dstate = None
    nv_all, known = full, None
  if policy.auto:
    alpha = adaptive.acceptance_estimate(s.counts, policy.prior)
    idx, _ = adaptive.choose(alpha, live, costs, policy.buckets, known,
                             _room(s, max_new_tokens), policy.margin)
  else:
    idx = jnp.where(jnp.any(live & (nv_all > 0)), len(policy.buckets) - 1, 0).astype(jnp.int32)
  idx = jnp.where(force_idx >= 0, force_idx, idx)
  return _Choice(idx=idx, prop=prop, dstate=dstate, n_valid=nv_all)


def _shadow_draft(choice: _Choice, drafter, policy):
  """[B] each row's deterministic first draft (-1: none), which a plain step still scores for
  the acceptance model, or None when the drafts are not known before the choice."""
  if policy.auto and drafter.free_proposals and choice.prop.q is None and policy.k_max > 0:
    return jnp.where(choice.n_valid > 0, choice.prop.tokens[:, 0], -1)
  return None


def _spec_step(tparams, dparams, s: SpecState, sp, costs, force_idx, *, cfg, drafter, policy,
               max_new_tokens, stop_ids):
  """One draft -> verify -> accept -> roll back step.

  The draft count is chosen among `policy.buckets`, each a branch of a `lax.switch` compiled
  with its own static width. force_idx >= 0 (a traced int) takes that bucket and verifies even
  filler: the cost model times the real loop that way, with no extra compilation.
  """
  if drafter.tree is not None:
    return _tree_step(tparams, dparams, s, sp, cfg=cfg, drafter=drafter, policy=policy,
                      max_new_tokens=max_new_tokens, stop_ids=stop_ids)
  kmax = policy.k_max
  live, kd, kv, last = _step_inputs(s, kmax + 1)
  ctx = DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len,
                     row_keys=s.keys)
  choice = _choose(dparams, s, sp, costs, force_idx, drafter=drafter, policy=policy,
                   max_new_tokens=max_new_tokens)
  idx, prop_all, dstate_all, nv_all = choice.idx, choice.prop, choice.dstate, choice.n_valid
  forced = force_idx >= 0
  vb = functools.partial(_verify_branch, cfg=cfg, drafter=drafter, kmax=kmax,
                         known_drafts=drafter.free_proposals and not policy.auto)

  # Branches only read the target cache and return the new block's keys and values padded to
  # k_max + 1; the one write after the switch keeps XLA from passing the whole cache through
  # (and copying it in) every branch.
  defer = _defers(drafter, policy)
  own_state = s.draft_state.inner if defer else s.draft_state

  def branch(k):
    def run(cache):
      if k == 0:
        dstate = dstate_all if drafter.free_proposals else own_state
        return vb(tparams, cache, last, None, 0, sp, kv, live, forced), dstate
      if drafter.free_proposals:
        prop, dstate = _slice_proposal(prop_all, k, nv_all), dstate_all
      else:
        current = _catch_up(drafter, dparams, s, s.draft_state, kmax + 1) if defer else own_state
        prop, dstate = draft(drafter, dparams, current, ctx, k, sp, kd)
      return vb(tparams, cache, last, prop, k, sp, kv, live, forced), dstate
    return run

  out, dstate = lax.switch(idx, [branch(k) for k in policy.buckets], s.cache)
  new, ctx = _finish_step(s, out, policy=policy, max_new_tokens=max_new_tokens,
                          stop_ids=stop_ids, shadow_draft=_shadow_draft(choice, drafter, policy))
  return _commit(drafter, dparams, policy, s, new, dstate, ctx, idx == 0)


def _commit(drafter, dparams, policy, s: SpecState, new: SpecState, dstate, ctx, plain_chosen):
  """The new state with the drafter's state updated by the step's outcome."""
  if _defers(drafter, policy):
    return dataclasses.replace(new, draft_state=_commit_or_defer(
        drafter, dparams, new, s.draft_state, dstate, ctx, plain_chosen, policy.k_max + 1))
  return dataclasses.replace(new, draft_state=drafter.commit(dparams, dstate, ctx))


def _plain_step(tparams, dparams, s: SpecState, choice: _Choice, sp, *, cfg, drafter, policy,
                max_new_tokens, stop_ids):
  """A step the controller gave k = 0, as `generate`'s decode step runs it: the forward writes
  its one new cache entry in place. The same tokens, statistics and acceptance updates as the
  switch's plain branch, whose read-only forward and separate write of a k_max + 1 block (with
  the switch around them) made a batch-16 step of SmolLM2 96 ms against `generate`'s 90."""
  _, _, kv, last = _step_inputs(s)
  hidden_layers = drafter.hidden_layers if drafter.uses_target_hidden else ()
  logits, hidden, written = forward(tparams, last[:, None], s.cache, cfg,
                                    hidden_layers=hidden_layers)
  out = _plain_outcome(sampling_lib.sample(kv[:, 0], logits[:, 0], sp), hidden, None,
                       policy.k_max)
  # The entry is written; _finish_step rolls the length back from the old one.
  s1 = dataclasses.replace(s, cache=dataclasses.replace(written, length=s.cache.length))
  new, ctx = _finish_step(s1, out, policy=policy, max_new_tokens=max_new_tokens,
                          stop_ids=stop_ids, shadow_draft=_shadow_draft(choice, drafter, policy))
  own = s.draft_state.inner if _defers(drafter, policy) else s.draft_state
  dstate = choice.dstate if drafter.free_proposals else own
  return _commit(drafter, dparams, policy, s, new, dstate, ctx, jnp.bool_(True))


def _plain_run(tparams, dparams, s: SpecState, sp, costs, until, force_idx, *, cfg, drafter,
               policy, max_new_tokens, stop_ids):
  """Plain steps for as long as the choice stays k = 0: a `lax.while_loop` inside the loop's
  body, so they run at `generate`'s speed (a `lax.cond` around an in-place step would copy the
  cache). Ends with every row done, `until` passes run, or a choice of k > 0, which the
  next `_spec_step` makes again from the same state."""
  if drafter.tree is not None or not (policy.auto or drafter.free_proposals):
    return s  # a tree, or a fixed k with drafts made in the branch: k = 0 is never chosen
  pick = functools.partial(_choose, dparams, sp=sp, costs=costs, force_idx=force_idx,
                           drafter=drafter, policy=policy, max_new_tokens=max_new_tokens)

  def go_on(c):
    st, choice = c
    return (choice.idx == 0) & jnp.any(~st.done) & (st.stats.target_passes < until)

  def body(c):
    st, choice = c
    st = _plain_step(tparams, dparams, st, choice, sp, cfg=cfg, drafter=drafter, policy=policy,
                     max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    return st, pick(s=st)

  return lax.while_loop(go_on, body, (s, pick(s=s)))[0]


def _commit_or_defer(drafter, dparams, new: SpecState, dw: Deferred, dstate, ctx: DraftContext,
                     plain_chosen, width: int) -> Deferred:
  """After a step of a deferring drafter: a drafting step commits as usual (its pending tokens
  were caught up before it drafted); a plain step (k = 0 chosen) adds its token to the pending
  ones, caught up now only when some row has `width` pending."""
  pend = dw.pending + ctx.n_new
  hid = dw.hidden
  if hid is not None:  # the step's feature goes to slot `pending` of each row
    sel = jnp.arange(width)[None, :] == dw.pending[:, None]  # [B, W]
    layers = None
    if hid.layers is not None:
      layers = jnp.where(sel[None, :, :, None], ctx.hidden.layers[:, :, :1], hid.layers)
    hid = Hidden(final=jnp.where(sel[:, :, None], ctx.hidden.final[:, :1], hid.final),
                 layers=layers)
  which = jnp.where(plain_chosen, jnp.where(jnp.any(pend >= width), 2, 0), 1)
  branches = [lambda st: st,
              lambda st: drafter.commit(dparams, st, ctx),
              lambda st: drafter.catch_up(dparams, st, _pending_ctx(new, pend, hid), width)]
  inner = lax.switch(which, branches, dstate)
  return Deferred(inner=inner, pending=jnp.where(which == 0, pend, 0), hidden=hid)


def _spec_loop(tparams, dparams, s, sp, costs, until, force_idx, **static):
  """Steps until every row is done or `until` target passes have run: each iteration is one
  `_spec_step`, then the plain steps that follow while the choice stays k = 0."""
  def body(s):
    s = _spec_step(tparams, dparams, s, sp, costs, force_idx, **static)
    return _plain_run(tparams, dparams, s, sp, costs, until, force_idx, **static)

  return lax.while_loop(lambda s: jnp.any(~s.done) & (s.stats.target_passes < until), body, s)


def _outputs(s: SpecState, max_new_tokens: int):
  """New tokens [B, N] (-1 padded) and their count [B], gathered from the sequence buffer."""
  n_out = s.seq_len - s.prompt_len
  idx = s.prompt_len[:, None] + jnp.arange(max_new_tokens)[None, :]
  toks = jnp.take_along_axis(s.seq, jnp.minimum(idx, s.seq.shape[1] - 1), axis=1)
  return jnp.where(jnp.arange(max_new_tokens)[None, :] < n_out[:, None], toks, -1), n_out


_STATIC = ("cfg", "drafter", "max_len", "seq_cap", "policy", "max_new_tokens", "stop_ids",
           "max_steps")
_LOOP_STATIC = ("cfg", "drafter", "policy", "max_new_tokens", "stop_ids")
_spec_init_jit = jax.jit(_spec_init, static_argnames=_STATIC, donate_argnums=(6,))
_spec_loop_jit = jax.jit(_spec_loop, static_argnames=_LOOP_STATIC, donate_argnums=(2,))
_outputs_jit = jax.jit(_outputs, static_argnums=(1,))


# ----------------------------------------------------------------------------------------------
# The public entry point.


def check_drafter(target: Model, drafter: Drafter) -> None:
  """Raises ValueError for a drafter that cannot serve this target."""
  if not isinstance(drafter, Drafter):
    raise ValueError(f"drafter must be a jaxspec Drafter (NGram, DraftModel, ...), got"
                     f" {type(drafter).__name__}")
  dv = drafter.vocab_size
  if dv is not None and dv != target.cfg.vocab_size:
    raise ValueError(f"draft vocab {dv} != target vocab {target.cfg.vocab_size}: drafts must"
                     " share the target's tokenizer")
  dparams = drafter.params
  if dparams is not None and target.sharding is None:  # a sharded target gets them copied
    tdev = _devices(target.params)
    ddev = _devices(dparams)
    if tdev and ddev and tdev != ddev:
      raise ValueError(
          f"the drafter's weights are on {sorted(map(str, ddev))} but the target's are on"
          f" {sorted(map(str, tdev))}: move both to the same devices (jax.device_put) for the"
          " fused loop, or give them separate meshes with a Placement")


def _devices(tree) -> set:
  out = set()
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      out |= set(leaf.devices())
  return out


# The most drafts one step may verify: a verify pass is one forward over k + 1 tokens with a
# [k+1, k+1] mask, traced and compiled per k; past a few hundred no drafter gains anything.
MAX_DRAFT_TOKENS = adaptive.MAX_K


def resolve_policy(num_draft_tokens, auto: AutoK | None = None, drafter=None) -> Policy:
  """`num_draft_tokens` (an integer k >= 1 or "auto") as the loop's static policy.

  A drafter with a limit (`max_draft_tokens`: a Medusa head with K heads, an MLP speculator
  with K stages) caps the default AutoK's k_max and refuses a larger k.
  """
  tree = getattr(drafter, "tree", None)
  if tree is not None:  # the tree fixes the draft's shape; the depth sizes the buffers
    if num_draft_tokens != "auto" or auto is not None:
      raise ValueError(f"the {drafter.name} drafter drafts a {tree.describe()}, which sets how"
                       f" far it drafts: leave num_draft_tokens at \"auto\" (got"
                       f" {num_draft_tokens!r}{', auto=' + repr(auto) if auto else ''}), or use"
                       " drafter.with_tree(None) for chains")
    return Policy.fixed(tree.depth)
  limit = getattr(drafter, "max_draft_tokens", None)
  what = f"this {getattr(drafter, 'name', 'drafter')} drafter proposes at most {limit} tokens"
  if isinstance(num_draft_tokens, str):
    if num_draft_tokens != "auto":
      raise ValueError(f"num_draft_tokens must be \"auto\" or an integer >= 1, got"
                       f" {num_draft_tokens!r}")
    if auto is None:
      auto = AutoK() if limit is None else AutoK(k_max=min(AutoK().k_max, limit))
    elif limit is not None and auto.k_max > limit:
      raise ValueError(f"{what} a step, but AutoK(k_max={auto.k_max}): use"
                       f" AutoK(k_max={limit}) or less")
    return Policy.from_auto(auto)
  if isinstance(num_draft_tokens, bool) or not isinstance(num_draft_tokens, (int, np.integer)) \
      or not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
    raise ValueError(f"num_draft_tokens must be \"auto\" or an integer in [1,"
                     f" {MAX_DRAFT_TOKENS}], got {num_draft_tokens!r}")
  if auto is not None:
    raise ValueError(f"auto= configures num_draft_tokens=\"auto\" but num_draft_tokens is"
                     f" {num_draft_tokens}: pass num_draft_tokens=\"auto\" or drop auto=")
  if limit is not None and num_draft_tokens > limit:
    raise ValueError(f"{what} a step: num_draft_tokens must be <= {limit}, got"
                     f" {num_draft_tokens}")
  return Policy.fixed(int(num_draft_tokens))


def check_num_draft_tokens(k) -> int:
  """Validates an integer k (kept for callers that only take fixed k)."""
  return resolve_policy(k).k_max


# ----------------------------------------------------------------------------------------------
# The cost model, measured on the actual batch, cache size and drafter.

_COSTS: dict[Any, CostModel] = {}


def measure_costs(loop_exe, tparams, dparams, state: SpecState, sp, policy: Policy, *,
                  steps: int = 4, warmup: int = 2, rounds: int = 3,
                  batch_size: int | None = None) -> CostModel:
  """Times the compiled loop forced to each k in `policy.buckets`, from copies of `state`.

  The loop executable is the one that then generates, so this costs no compilation and times
  exactly what will run (drafting, verify, acceptance, bookkeeping). The k's are timed in
  `rounds` interleaved rounds (k = 0, 1, .. then again), so a slow spell of a shared machine
  hits every k rather than one; each k keeps its fastest round. A round runs `warmup` untimed
  steps from a fresh copy of the post-prefill state (the first steps on freshly copied buffers
  are slow), then `steps` timed ones; rows that finish early shorten the count.
  """
  n = len(policy.buckets)
  costs = jnp.ones((n,), jnp.float32)
  best = [float("inf")] * n
  for _ in range(rounds):
    for i in range(n):
      st = jax.block_until_ready(jax.tree.map(jnp.copy, state))
      t0 = time.perf_counter()
      st = jax.block_until_ready(loop_exe(tparams, dparams, st, sp, costs, jnp.int32(warmup),
                                          jnp.int32(i)))
      first = time.perf_counter() - t0
      done0 = int(st.stats.target_passes)
      t0 = time.perf_counter()
      st = jax.block_until_ready(loop_exe(tparams, dparams, st, sp, costs,
                                          jnp.int32(warmup + steps), jnp.int32(i)))
      dt = time.perf_counter() - t0
      ran = int(st.stats.target_passes) - done0
      best[i] = min(best[i], dt / ran if ran > 0 else first / max(done0, 1))
      del st
  return CostModel.from_measurements(policy.buckets, best, batch_size=batch_size,
                                     source="measured")


def _costs_array(policy: Policy, cost: CostModel | None) -> jax.Array:
  if cost is None:
    return jnp.ones((len(policy.buckets),), jnp.float32)
  return jnp.asarray(cost.at(policy.buckets))


def _prepare(target, drafter, prompts, max_new_tokens, sampling, num_draft_tokens, auto, cost,
             max_len, temperature):
  """Everything `speculative_generate` checks before compiling; the drafter resolved by name."""
  check_model(target)
  drafter = resolve_drafter(target, drafter)
  if temperature is not None:
    sampling = dataclasses.replace(_resolve_sampling(sampling), temperature=temperature)
  sp_user = _resolve_sampling(sampling)
  check_drafter(target, drafter)
  policy = resolve_policy(num_draft_tokens, auto, drafter)
  # A drafter that samples its drafts is coupled with the target's draws under "auto" (unless
  # it says otherwise), so a timed k schedule cannot change the text.
  drafter = resolve_coupled(drafter, policy.auto)
  if cost is not None and not isinstance(cost, CostModel):
    raise ValueError(f"cost must be a jaxspec CostModel, got {type(cost).__name__}")
  try:
    prep = prepare_prompts(target, prompts, max_new_tokens, extra=policy.k_max + 1,
                           max_len=max_len)
  except ValueError as e:
    if policy.auto and "does not fit" in str(e):
      raise ValueError(f"{e} (with num_draft_tokens=\"auto\" the cache also holds k_max ="
                       f" {policy.k_max} drafts: lower AutoK(k_max=...))") from None
    raise
  return drafter, sp_user, policy, prep


def speculative_generate(target: Model, drafter: Drafter, prompts, *, max_new_tokens: int = 128,
                         sampling: Sampling | None = None, num_draft_tokens: int | str = "auto",
                         key: jax.Array | int | None = None,
                         stop_ids: Sequence[int] | None = None, max_len: int | None = None,
                         temperature: float | None = None, auto: AutoK | None = None,
                         cost: CostModel | None = None, placement=None) -> GenerateOutput:
  """Speculative decoding whose output distribution is exactly the target's.

  Prefill and the whole draft -> verify -> accept -> roll back loop run as one jitted
  `lax.while_loop`; rows accept different numbers of tokens.

  Args:
    target: the target `Model`.
    drafter: a `Drafter` (`NGram()`, `DraftModel(small_model)`, `load_head(dir, target)`), or
      a name: "ngram", "eagle" / "medusa" / "mlp" (the heads bundled for SmolLM2), a head
      directory or a draft model's path (see `jaxspec.drafters.resolve_drafter`).
    prompts: a string, list of strings, or list of token-id lists.
    max_new_tokens: tokens to generate per row.
    sampling: `Sampling(temperature, top_k, top_p, min_p)`; default greedy.
    num_draft_tokens: k, drafts per step, or "auto" (default): every step chooses k in
      0..k_max from the measured acceptance and step costs (k = 0 is a plain decode step).
    key: PRNG key or int seed.
    stop_ids: tokens that end a row; default the target's EOS ids.
    max_len: cache size; default just enough (prompt + max_new_tokens + k + 1).
    temperature: shorthand for `sampling=Sampling(temperature=...)`.
    auto: `AutoK(k_max, buckets, decay, prior, margin)` for num_draft_tokens="auto".
    cost: a `CostModel` of step time per k; with "auto" and none given, it is measured once
      for this batch, cache size and drafter (cached for later calls).
    placement: a `jaxspec.sharding.Placement(target=mesh_a, drafter=mesh_b)`. The target is
      laid out on mesh_a; with mesh_b the same mesh the fused loop runs there, otherwise the
      host-orchestrated loop (draft on mesh_b, verify on mesh_a, small arrays handed across).
      Default: the fused loop where the target's weights are (on their mesh when the target
      was sharded with `jaxspec.sharding.shard_model`).
  Returns:
    `GenerateOutput`; `stats` adds target_passes, drafted/accepted per row, acceptance rate per
    draft position, the mean acceptance length tau (tokens emitted per verify pass, counting
    the bonus token) and the k chosen at every step.
  """
  drafter, sp_user, policy, prep = _prepare(target, drafter, prompts, max_new_tokens, sampling,
                                            num_draft_tokens, auto, cost, max_len, temperature)
  run = _make_run(target, drafter, prep, sp_user, policy, stop_ids_for(target, stop_ids),
                  int(max_new_tokens), key, cost, placement)
  t0 = time.perf_counter()
  state = run.start()
  state = run.target_state(run.loop(state, run.max_steps))
  toks, n_out = jax.block_until_ready(_outputs_jit(state, int(max_new_tokens)))
  dt = time.perf_counter() - t0 - run.profile_seconds
  run.finish(state)
  toks, n_out = to_host((toks, n_out))
  stats = run.stats(state.stats)
  new = int(n_out.sum())
  stats.update(seconds=dt, new_tokens=new, tokens_per_second=new / dt if dt > 0 else float("inf"))
  return GenerateOutput(tokens=toks, lengths=n_out, prompt_lengths=prep.lengths,
                        texts=decode_texts(target, toks, n_out), stats=stats)


_PLACED: dict[Any, Any] = {}


def place_drafter_params(target: Model, drafter: Drafter):
  """The drafter's weights on the target's mesh, for the fused loop of a sharded target
  (`jaxspec.sharding.rules.place_drafter`), copied once per (drafter weights, mesh) and reused."""
  dparams, sh = drafter.params, target.sharding
  if dparams is None or sh is None:
    return dparams
  key = (id(dparams), sh)
  hit = _PLACED.get(key)
  if hit is not None and hit[0] is dparams:
    return hit[1]
  from jaxspec.sharding.rules import place_drafter
  placed = place_drafter(drafter, sh)
  if len(_PLACED) >= 8:
    _PLACED.clear()
  _PLACED[key] = (dparams, placed)
  return placed


def _shardings_of(tree):
  return jax.tree.map(lambda x: x.sharding, tree)


def _make_run(target, drafter, prep, sp_user, policy, stops, max_new_tokens, key, cost,
              placement):
  """The fused `_Run`, or the host-orchestrated run of a Placement over two meshes."""
  if placement is None:
    return _Run(target, drafter, prep, sp_user, policy, stops, max_new_tokens, key, cost)
  from jaxspec.sharding import placement as placement_lib
  if not isinstance(placement, placement_lib.Placement):
    raise ValueError(f"placement must be a jaxspec.sharding.Placement, got"
                     f" {type(placement).__name__}")
  if drafter.tree is not None and not placement.fused:
    raise ValueError(f"the {drafter.name} drafter drafts a tree, which runs in the fused loop"
                     " only: place the drafter on the target's mesh (Placement(target=mesh,"
                     " drafter=mesh)) or use drafter.with_tree(None) for chains")
  target = placement_lib.place_target(target, placement)
  target.sharding.check_batch(prep.tokens.shape[0])
  drafter = placement_lib.drafter_in_precision(drafter, placement.drafter_precision)
  if placement.fused:
    run = _Run(target, drafter, prep, sp_user, policy, stops, max_new_tokens, key, cost)
    run.placement = placement
    return run
  return placement_lib.HostRun(target, drafter, placement, prep, sp_user, policy, stops,
                               max_new_tokens, key, cost)


class _Run:
  """The compiled prefill and loop of one call, and the cost model for "auto".

  For a target sharded with `jaxspec.sharding.shard_model`, both are compiled with
  in_shardings/out_shardings on its mesh: rows over the batch axis, caches by the rules.
  """

  placement = None  # the Placement that chose this run, when one did
  failover = None  # what went wrong, when a host-orchestrated run fell back to plain steps
  pooled = False  # the target's cache goes into kept buffers (unsharded fused runs)

  def __init__(self, target, drafter, prep, sp_user, policy, stops, max_new_tokens, key, cost):
    self.target, self.drafter, self.prep, self.policy = target, drafter, prep, policy
    b = prep.tokens.shape[0]
    self.sp = sp_user.arrays(b)
    self.max_steps = max_new_tokens + 1
    self.cost = cost
    self.profile_seconds = 0.0
    sh = target.sharding
    self.tparams, self.dparams = target.params, place_drafter_params(target, drafter)
    self.cost_key = (target.cfg, drafter, b, prep.tokens.shape[1], prep.max_len, policy.buckets,
                     repr(sp_user), sh)
    static = dict(cfg=target.cfg, drafter=drafter, policy=policy, max_new_tokens=max_new_tokens,
                  stop_ids=stops)
    self.init_args = (self.tparams, self.dparams, jnp.asarray(prep.tokens),
                      jnp.asarray(prep.lengths), self.sp, _as_key(key))
    # The sequence buffer holds prompt + outputs, plus k + 1 slots a step may write past.
    init_static = dict(max_len=prep.max_len, seq_cap=prep.max_len + policy.k_max + 1,
                       max_steps=self.max_steps, **static)
    # Unsharded, the target's cache is written into the previous call's buffers (donated):
    # `take_cache_buffers` at start, `keep_cache_buffers` when the call ends.
    self.pooled = sh is None
    bufs = None
    if self.pooled:
      c = jax.eval_shape(functools.partial(init_cache, target.cfg, b, prep.max_len))
      bufs = (c.k, c.v)
    state0 = jax.eval_shape(functools.partial(_spec_init_jit, **init_static), *self.init_args,
                            bufs)
    self.costs = _costs_array(policy, cost)
    loop_args = (self.tparams, self.dparams, state0, self.sp, self.costs, jnp.int32(0),
                 jnp.int32(-1))
    if sh is None:
      self.init_exe, c1 = compiled(_spec_init_jit, "spec-init", *self.init_args, bufs,
                                   **init_static)
      self.loop_exe, c2 = compiled(_spec_loop_jit, "spec-loop", *loop_args, **static)
    else:
      sh.check_batch(b)
      st_sh = sh.state(state0, b)
      p_sh = (_shardings_of(self.tparams), _shardings_of(self.dparams))
      rep = sh.replicated()
      init_in = (*p_sh, sh.batch(2), sh.batch(1), sh.state(self.sp, b), rep)
      self.init_exe, c1 = compiled(_spec_init, ("spec-init", sh), *self.init_args,
                                   jit_kwargs=dict(in_shardings=init_in, out_shardings=st_sh),
                                   **init_static)
      # Global arrays on the mesh (on several hosts every process passes the same prompts).
      self.init_args = put_global(self.init_args, init_in)
      self.sp = self.init_args[4]
      loop_in = (*p_sh, st_sh, sh.state(self.sp, b), rep, rep, rep)
      self.loop_exe, c2 = compiled(_spec_loop, ("spec-loop", sh), *loop_args,
                                   jit_kwargs=dict(in_shardings=loop_in, out_shardings=st_sh,
                                                   donate_argnums=(2,)), **static)
    self.compile_seconds = c1 + c2

  def start(self) -> SpecState:
    """Prefill; with "auto" and no cost model, times every k from the prefilled state once
    (cached per shapes), excluded from the generation time."""
    if self.pooled:
      b, ml = self.prep.tokens.shape[0], self.prep.max_len
      state = self.init_exe(*self.init_args, take_cache_buffers(self.target.cfg, b, ml))
    else:
      state = self.init_exe(*self.init_args)
    self._ensure_costs(state, self.loop_exe, self.sp)
    return state

  def finish(self, state: SpecState) -> None:
    """Keeps the finished call's target cache for the next call of the same shapes."""
    if self.pooled:
      keep_cache_buffers(self.target.cfg, state.cache.k, state.cache.v)

  def _ensure_costs(self, state, loop, sp) -> None:
    """With "auto" and no cost model given: the cached one for these shapes, or `loop` (the
    `measure_costs` signature) timed from `state` once; `self.costs` is then its array."""
    if not self.policy.auto or self.cost is not None:
      return
    self.cost = _COSTS.get(self.cost_key)
    if self.cost is None:
      state = jax.block_until_ready(state)
      t0 = time.perf_counter()
      self.cost = measure_costs(loop, self.tparams, self.dparams, state, sp, self.policy,
                                batch_size=self.prep.tokens.shape[0])
      _COSTS[self.cost_key] = self.cost
      self.profile_seconds = time.perf_counter() - t0
    self.costs = _costs_array(self.policy, self.cost)

  def target_state(self, state: SpecState) -> SpecState:
    return state

  def loop(self, state: SpecState, until: int | jax.Array) -> SpecState:
    return self.loop_exe(self.tparams, self.dparams, state, self.sp, self.costs,
                         jnp.int32(until), jnp.int32(-1))

  def stats(self, st: SpecStats) -> dict[str, Any]:
    out = summarize_stats(st, self.policy.k_max)
    out.update(compile_seconds=self.compile_seconds, profile_seconds=self.profile_seconds,
               batch_size=self.prep.tokens.shape[0],
               num_draft_tokens="auto" if self.policy.auto else self.policy.k_max,
               k_max=self.policy.k_max, drafter=self.drafter.name)
    if self.drafter.tree is not None:
      out["tree"] = self.drafter.tree.describe()
      out["tree_nodes"] = self.drafter.tree.num_nodes - 1
    if self.policy.auto:
      out["cost_model"] = dict(zip(map(str, self.cost.ks), self.cost.seconds))
    if self.placement is not None:
      out.update(placement=self.placement.describe(),
                 failover=None if self.failover is None else dataclasses.asdict(self.failover))
    return out


def speculative_stream(target: Model, drafter: Drafter, prompt, *, max_new_tokens: int = 128,
                       sampling: Sampling | None = None, num_draft_tokens: int | str = "auto",
                       key=None, stop_ids: Sequence[int] | None = None, chunk: int = 4,
                       auto: AutoK | None = None, cost: CostModel | None = None):
  """Speculative decoding of one prompt, yielding (new tokens, info) every `chunk` verify steps.

  The same prefill and loop body as `speculative_generate`, run in chunks so a CLI can print
  text as it is produced; `info["stats"]` holds the statistics once the row is done.
  """
  chunk = check_chunk(chunk)
  drafter, sp_user, policy, prep = _prepare(target, drafter, prompt, max_new_tokens, sampling,
                                            num_draft_tokens, auto, cost, None, None)
  run = _Run(target, drafter, prep, sp_user, policy, stop_ids_for(target, stop_ids),
             int(max_new_tokens), key, cost)
  t0 = time.perf_counter()
  state = jax.block_until_ready(run.start())
  t0 += run.profile_seconds

  def view(s: SpecState):
    p0, n0 = int(np.asarray(s.prompt_len)[0]), int(np.asarray(s.seq_len)[0])
    return (np.asarray(s.seq)[0, p0:n0], bool(np.asarray(s.done).all()),
            int(s.stats.target_passes))

  for new, info in _stream_loop(run.loop, view, state, chunk, t0):
    s = info.pop("state")
    info["stats"] = run.stats(s.stats)
    info["compile_seconds"] = run.compile_seconds
    info["profile_seconds"] = run.profile_seconds
    yield new, info
  run.finish(s)


def summarize_stats(st: SpecStats, k: int) -> dict[str, Any]:
  """Host-side statistics from the device counters."""
  st = to_host(st)
  passes = int(st.target_passes)
  total_row_steps = max(float(st.row_steps.sum()), 1.0)
  spec_steps = max(float(st.spec_row_steps.sum()), 1.0)
  acc_at = st.accepted_at.astype(np.float64)
  hist = st.k_history[:passes]
  return dict(
      target_passes=passes,
      drafted_per_row=st.drafted.tolist(),
      accepted_per_row=st.accepted.tolist(),
      acceptance_rate=float(st.accepted.sum() / max(st.drafted.sum(), 1)),
      # Unconditional (as vLLM reports): fraction of the live row-steps that verified drafts in
      # which draft i was accepted (a step verifying fewer than i drafts counts as a miss).
      acceptance_per_position=(acc_at / spec_steps).tolist(),
      # Conditional: accepted at i given a real draft i was verified after i-1 accepts.
      conditional_acceptance_per_position=np.divide(
          acc_at, np.maximum(st.reached_at, 1)).tolist(),
      # tau: tokens emitted per target pass of a live row, counting the bonus/correction token
      # (plain steps, where nothing was drafted, count as passes emitting one token).
      tau=float(st.emitted.sum() / total_row_steps),
      plain_steps=int((hist == 0).sum()),
      k_per_step=hist.tolist(),
      mean_k=float(hist.mean()) if passes else 0.0,
  )
