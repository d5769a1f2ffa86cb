"""The drafters jaxspec ships: prompt lookup (`NGram`), a separate draft model (`DraftModel`)
and the `Oracle` used by benchmarks; `resolve_drafter` turns a name or path into one. The
drafter protocol they implement is `jaxspec.decoding.drafter`."""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxspec import sampling as sampling_lib
from jaxspec.models.config import LlamaConfig
from jaxspec.decoding import protocol
from jaxspec.decoding.protocol import Target
from jaxspec.models.llama import KVCache, LlamaLM, Params
from jaxspec.decoding.drafter import (DraftContext, Drafter, NoState, Proposal,  # noqa: F401
                                      position_draft_keys)
from jaxspec.models.model import Model
from jaxspec.pytree import pytree_dataclass as _pytree


def _last_tokens(ctx: DraftContext, n: int) -> jax.Array:
  """The last n tokens of every row [B, n] (clipped at the start of the sequence)."""
  idx = ctx.seq_len[:, None] - n + jnp.arange(n)[None, :]
  return jnp.take_along_axis(ctx.seq, jnp.maximum(idx, 0), axis=1)


# ----------------------------------------------------------------------------------------------
# A separate draft model.


@_pytree
@dataclasses.dataclass
class DraftModelState:
  cache: KVCache  # holds positions [0, seq_len - 2) after each commit


@dataclasses.dataclass(frozen=True, eq=False)
class DraftModel(Drafter):
  """A separate draft model with its own KV cache: a jaxspec `Model`, or `Target(lm, params)` of
  any model meeting `jaxspec.decoding.CausalLM` (a flax NNX module behind an adapter, say).

  The draft cache is kept one token behind the target's (it holds [0, seq_len - 2)), so every
  proposal starts with a two-token forward over the last two tokens: that re-feeds the last
  accepted draft (or, when all k were accepted, the one draft the draft model never ran on) and
  keeps shapes static without tracking which case a row is in.
  """

  model: Model | Target
  p_min: float = 0.0
  name: str = "draft-model"
  # Draw draft j with the noise the target draws token j with (a Gumbel-max over log q with
  # token j's key), and propose it as a deterministic draft (q None): the loop then accepts it
  # iff it equals the target's own draw, so the sampled text is `generate`'s for the key
  # whatever k, "auto" or batch. It accepts somewhat less often than the standard rule (in a
  # synthetic check 0.87 / 0.61 / 0.33 against 0.90 / 0.68 / 0.39); greedy is the same.
  # None (the default): coupled exactly when k is chosen by "auto", whose timed schedule would
  # otherwise make the text differ between processes; False: the standard rule always.
  coupled: bool | None = None
  defer_commit = True  # a plain step's commit is a forward of the draft model

  def __post_init__(self):
    if isinstance(self.model, Target):
      protocol.check_lm(self.model.lm, "draft")
    elif not isinstance(self.model, Model):
      raise ValueError(f"DraftModel takes a jaxspec Model or a jaxspec.decoding.Target(lm, params),"
                       f" got {type(self.model).__name__}: wrap a CausalLM as Target(lm, params)")
    if isinstance(self.p_min, bool) or not isinstance(self.p_min, numbers.Real) \
        or not 0.0 <= self.p_min < 1.0:
      raise ValueError(f"p_min must be a number in [0, 1) (0 = never stop early), got"
                       f" {self.p_min!r}")
    if self.coupled is not None and not isinstance(self.coupled, bool):
      raise ValueError(f"coupled must be True, False or None (coupled under \"auto\"), got"
                       f" {self.coupled!r}")

  def _key(self):
    # The weights' structure and dtypes belong to the identity: an int8 copy of a model keeps
    # its cfg but is a different drafter (another compiled program, another cost model).
    # The actual class: a subclass (another propose, say) is another compiled program.
    leaves = tuple(f"{x.dtype}{x.shape}" for x in jax.tree.leaves(self.params))
    return (type(self), self.lm, self.p_min, self.coupled, leaves,
            str(jax.tree.structure(self.params)))

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return type(other) is type(self) and other._key() == self._key()

  @property
  def lm(self):
    """The draft model as the loop runs it (`jaxspec.decoding.CausalLM`)."""
    if isinstance(self.model, Target):
      return self.model.lm
    return LlamaLM(self.model.cfg)

  @property
  def cfg(self) -> LlamaConfig:
    """The configuration of a jaxspec draft model."""
    return self.model.cfg

  @property
  def params(self) -> Params:
    return self.model.params

  @property
  def vocab_size(self) -> int:
    return self.lm.vocab_size

  def init(self, params, prompt, prompt_len, max_len, hidden=None) -> DraftModelState:
    lm = self.lm
    cache = protocol.init_cache(lm, params, prompt.shape[0], max_len)
    _, _, cache = protocol.forward(lm, params, prompt, cache, logits=False, fresh=True,
                                   seq_lengths=prompt_len)
    # The prompt is right-padded; the draft cache stays one behind the target's, which holds
    # every prompt token but the last: it keeps [0, prompt_len - 2).
    return DraftModelState(dataclasses.replace(cache, length=jnp.maximum(prompt_len - 2, 0)))

  def propose(self, params, state: DraftModelState, ctx, k, sp, keys):
    """k drafts per row; with p_min > 0 a row stops (n_valid) at the first position whose
    most likely token, under the draft model's own softmax, has probability below p_min, and
    drafting ends as soon as no row is still confident (llama.cpp's --draft-p-min)."""
    lm = self.lm
    b = ctx.seq.shape[0]
    two = _last_tokens(ctx, 2)  # [B, 2]: the token before last, and last
    # A row holding a single token has no "token before last": it feeds [last, last], reads the
    # logits of the first and keeps only that one entry.
    single = ctx.seq_len < 2
    start = state.cache.length
    logits, _, cache = protocol.forward(lm, params, two, state.cache)
    cache = protocol.with_length(cache, start + jnp.where(single, 1, 2))
    if self.coupled:
      step_keys = position_draft_keys(ctx, k, self.name)
    else:
      step_keys = jax.vmap(lambda kk: jax.random.split(kk, k))(keys)  # [B, k]
    v = lm.vocab_size

    def pick(logits_i, key_i):
      q = sampling_lib.probs(logits_i, sp)
      # Coupled, key_i is the target's key for this token: the same Gumbel-max draw then
      # shares the target's noise.
      tok = sampling_lib.sample_from_probs(key_i, q, sp.temperature == 0)
      # Whether this draft is proposed is decided before it is drawn: from the draft model's
      # top probability (llama.cpp's --draft-p-min), not the drawn token's, whose use would
      # select against unlikely draws and bias a sampled output. Greedy: the same value.
      conf = jnp.max(jax.nn.softmax(logits_i.astype(jnp.float32), -1), axis=-1)
      return tok, q, conf >= self.p_min

    d0, q0, ok0 = pick(jnp.where(single[:, None], logits[:, 0], logits[:, 1]), step_keys[:, 0])
    drafts = jnp.zeros((b, k), jnp.int32).at[:, 0].set(d0)
    qs = jnp.zeros((b, k, v), jnp.float32).at[:, 0].set(q0)
    n_valid = ok0.astype(jnp.int32)

    def cond(c):
      i, _, _, _, alive, _ = c
      return (i < k) & jnp.any(alive)

    def body(c):
      i, drafts, qs, n_valid, alive, cache = c
      tok = lax.dynamic_index_in_dim(drafts, i - 1, axis=1, keepdims=False)
      logits, _, cache = protocol.forward(lm, params, tok[:, None], cache)
      key_i = lax.dynamic_index_in_dim(step_keys, i, axis=1, keepdims=False)
      nxt, q, ok = pick(logits[:, 0], key_i)
      drafts = lax.dynamic_update_index_in_dim(drafts, nxt, i, axis=1)
      qs = lax.dynamic_update_index_in_dim(qs, q, i, axis=1)
      alive = alive & ok
      return i + 1, drafts, qs, n_valid + alive, alive, cache

    if self.p_min > 0:
      _, drafts, qs, n_valid, _, cache = lax.while_loop(
          cond, body, (jnp.int32(1), drafts, qs, n_valid, ok0, cache))
      return Proposal(tokens=drafts, q=None if self.coupled else qs,
                      n_valid=n_valid), DraftModelState(cache)

    def scan_body(carry, key_i):  # a fixed trip count: outputs stacked, no early exit
      tok, cache = carry
      logits, _, cache = protocol.forward(lm, params, tok[:, None], cache)
      nxt, q, _ = pick(logits[:, 0], key_i)
      return (nxt, cache), (nxt, q)

    if k > 1:
      (_, cache), (toks, qs) = lax.scan(scan_body, (d0, cache),
                                        jnp.swapaxes(step_keys[:, 1:], 0, 1))
      drafts = jnp.concatenate([d0[:, None], toks.T], axis=1)
      qs = jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
    else:
      drafts, qs = d0[:, None], q0[:, None]
    return Proposal(tokens=drafts, q=None if self.coupled else qs), DraftModelState(cache)

  def commit(self, params, state: DraftModelState, ctx) -> DraftModelState:
    """Moves the draft cache to [0, seq_len - 2). After a drafting step it already holds those
    positions (and rejected drafts past them, dropped by the length). After a plain step (the
    controller chose k = 0, or nothing was drafted) the draft model never saw the newest token:
    it runs one token, the one at position `length`, so the cache has no hole."""
    want = jnp.maximum(ctx.seq_len - 2, 0)
    cache = state.cache
    behind = cache.length < want  # by one token at most: a plain step emits one
    lm = self.lm
    if not protocol.is_block_lm(lm):  # the cache passes through the conditional
      cache = lax.cond(jnp.any(behind), lambda c: self._advance(params, c, ctx.seq, 1),
                       lambda c: c, cache)
      return DraftModelState(protocol.with_length(cache, want))

    def catch_up(_):
      return self._block_from_length(params, cache, ctx.seq, 1)

    def skip(_):
      return lm.empty_block(cache.batch_size, 1, cache.k.dtype)

    # Written outside the cond (so the cache is not passed through it). A row that is not
    # behind gets a write at its `length`, at or past `want`: outside what the length keeps.
    block = lax.cond(jnp.any(behind), catch_up, skip, None)
    cache = protocol.write_block(lm, cache, block, cache.length)
    return DraftModelState(protocol.with_length(cache, want))

  def catch_up(self, params, state: DraftModelState, ctx, width: int) -> DraftModelState:
    """After plain steps the cache is behind by ctx.n_new (<= width) tokens: one forward over
    the `width` tokens from its length (the ones past `want` are scratch, dropped by the length),
    so the cache holds [0, seq_len - 2) again."""
    cache = self._advance(params, state.cache, ctx.seq, width)
    return DraftModelState(protocol.with_length(cache, jnp.maximum(ctx.seq_len - 2, 0)))

  @staticmethod
  def _tokens_from_length(cache, seq, width: int):
    """The `width` tokens of seq [B, S] from each row's cache length on (clipped at its end)."""
    idx = cache.length[:, None] + jnp.arange(width)[None, :]
    return jnp.take_along_axis(seq, jnp.minimum(idx, seq.shape[1] - 1), axis=1)

  def _advance(self, params, cache, seq, width: int):
    """The cache with the `width` tokens from each row's length written (length + width)."""
    lm = self.lm
    if protocol.is_block_lm(lm):
      block = self._block_from_length(params, cache, seq, width)
      return protocol.write_block(lm, cache, block, cache.length)
    toks = self._tokens_from_length(cache, seq, width)
    return protocol.forward(lm, params, toks, cache, logits=False)[2]

  def _block_from_length(self, params, cache, seq, width: int):
    """A block model's keys and values of the `width` tokens from each row's length, computed
    over the cache, not written."""
    toks = self._tokens_from_length(cache, seq, width)
    return protocol.forward(self.lm, params, toks, cache, logits=False, write=False)[2]



# ----------------------------------------------------------------------------------------------
# Prompt lookup (n-gram) drafting.




# The longest n-gram NGram looks up: the lookup is unrolled over the lengths (quadratic in it).
MAX_NGRAM = 64


@dataclasses.dataclass(frozen=True)
class NGram(Drafter):
  """Prompt-lookup decoding: copy what followed the most recent earlier occurrence of the
  sequence's last n tokens (n from `max_ngram` down to `min_ngram`), searching the prompt and
  everything generated so far. Deterministic (one-hot q); costs no model pass.

  A row with no match proposes nothing (n_valid = 0); a match with fewer than k known tokens
  after it proposes those (the rest are filler the loop may still verify).
  """

  max_ngram: int = 3
  min_ngram: int = 1
  name: str = "ngram"
  free_proposals = True  # a lookup, not a model pass

  def __post_init__(self):
    for name in ("min_ngram", "max_ngram"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"NGram.{name} must be an integer, got {v!r}")
    if not 1 <= self.min_ngram <= self.max_ngram <= MAX_NGRAM:
      raise ValueError(f"need 1 <= min_ngram <= max_ngram <= {MAX_NGRAM}, got min_ngram="
                       f"{self.min_ngram}, max_ngram={self.max_ngram} (the lookup is traced"
                       " once per n-gram length)")

  def init(self, params, prompt, prompt_len, max_len, hidden=None):
    return NoState()

  def commit(self, params, state, ctx):
    return state

  def propose(self, params, state, ctx, k, sp, keys):
    seq, n = ctx.seq, ctx.seq_len
    b, s = seq.shape
    pos = jnp.arange(s)[None, :]  # candidate match starts j
    found = jnp.zeros((b,), bool)
    start = jnp.zeros((b,), jnp.int32)  # index of the first token after the match
    for g in range(self.max_ngram, self.min_ngram - 1, -1):
      suffix = _last_tokens(ctx, g)  # [B, g]
      match = jnp.ones((b, s), bool)
      for i in range(g):
        shifted = jnp.roll(seq, -i, axis=1)  # shifted[:, j] = seq[:, j + i]
        match = match & (shifted == suffix[:, i:i + 1])
      # The match must end before the suffix itself: j + g <= seq_len - 1, and the row must be
      # long enough to hold the suffix and something before it.
      match = match & (pos + g <= n[:, None] - 1) & (n[:, None] > g)
      has = match.any(axis=1)
      last_j = (s - 1) - jnp.argmax(match[:, ::-1], axis=1)  # most recent match start
      take = has & ~found
      start = jnp.where(take, last_j + g, start)
      found = found | has
    idx = start[:, None] + jnp.arange(k)[None, :]
    # Tokens past the end of the known sequence are unknown: repeat the last known one.
    idx = jnp.minimum(idx, n[:, None] - 1)
    drafts = jnp.take_along_axis(seq, idx, axis=1)
    n_valid = jnp.where(found, jnp.clip(n - start, 0, k), 0).astype(jnp.int32)
    return Proposal(tokens=drafts.astype(jnp.int32), n_valid=n_valid), state


# ----------------------------------------------------------------------------------------------
# An oracle drafter for measuring the loop itself.


@_pytree
@dataclasses.dataclass
class OracleParams:
  reference: jax.Array  # [B, R] int32 row b's reference tokens after its prompt
  alpha: jax.Array  # [] float32 probability that a draft is kept


@dataclasses.dataclass(frozen=True, eq=False)
class Oracle(Drafter):
  """Proposes a known reference continuation, each draft kept with probability `alpha` and
  otherwise replaced by another token of the vocabulary; costs no model pass.

  For benchmarks of the speculative machinery: with the target's own greedy continuation as the
  reference ([B, R] token ids, row b's tokens after its prompt), greedy decoding accepts draft
  i exactly when drafts 1..i were all kept, so the acceptance at every position is `alpha` and
  the mean tokens per verify pass is tau = (1 - alpha^(k+1)) / (1 - alpha), while drafting
  costs nothing. Any other target or sampling setting still gets exact output (a deterministic
  drafter: one-hot q); only the acceptance changes.

  Whether a draft is kept is drawn from the step's draft key (a function of the row's key and
  its length), so a run is reproducible. Past the reference's end a row proposes nothing.
  The reference and alpha are parameters (arrays), so new values reuse the compiled loop.
  """

  reference: Any  # [B, R] int array
  alpha: float = 1.0
  vocab: int = 0  # the target's vocabulary size (corrupted drafts stay inside it)
  name: str = "oracle"
  free_proposals = True  # a lookup, not a model pass

  def __post_init__(self):
    if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not (
        0.0 <= self.alpha <= 1.0):
      raise ValueError(f"alpha must be in [0, 1] (the probability a draft is kept), got"
                       f" {self.alpha!r}")
    if isinstance(self.vocab, bool) or not isinstance(self.vocab, int) or self.vocab < 2:
      raise ValueError(f"vocab must be the target's vocabulary size (an integer >= 2), got"
                       f" {self.vocab!r}")
    shape = getattr(self.reference, "shape", None)
    if shape is None or len(shape) != 2 or shape[1] < 1:
      raise ValueError(f"reference must be a [B, R] array of token ids (R >= 1), got shape"
                       f" {shape}")

  def _key(self):
    return (type(self), self.vocab, tuple(self.reference.shape))

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return type(other) is type(self) and other._key() == self._key()

  @property
  def params(self) -> OracleParams:
    return OracleParams(reference=jnp.asarray(self.reference, jnp.int32),
                        alpha=jnp.float32(self.alpha))

  @property
  def vocab_size(self) -> int:
    return self.vocab

  def init(self, params, prompt, prompt_len, max_len, hidden=None):
    return NoState()

  def commit(self, params, state, ctx):
    return state

  def propose(self, params: OracleParams, state, ctx, k, sp, keys):
    ref = params.reference
    b, r = ref.shape
    start = ctx.seq_len - ctx.prompt_len  # [B] tokens emitted so far: the next one's index
    idx = start[:, None] + jnp.arange(k)[None, :]  # [B, k]
    drafts = jnp.take_along_axis(ref, jnp.minimum(idx, r - 1), axis=1)
    u = jax.vmap(lambda kk: jax.random.uniform(kk, (k,)))(keys)  # [B, k]
    shift = jax.vmap(lambda kk: jax.random.randint(jax.random.fold_in(kk, 1), (k,), 1,
                                                   self.vocab))(keys)
    wrong = (drafts + shift) % self.vocab  # never the reference token (shift in 1..V-1)
    drafts = jnp.where(u < params.alpha, drafts, wrong).astype(jnp.int32)
    n_valid = jnp.clip(r - start, 0, k).astype(jnp.int32)
    return Proposal(tokens=drafts, n_valid=n_valid), state


# Drafters built from a name, by target: loading a head or a draft model once per target.
_NAMED: dict[tuple[str, int, str | None], tuple[Model, Drafter]] = {}


def resolve_drafter(target: Model, drafter, dtype: str | None = None) -> Drafter:
  """A `Drafter`, or one named by a string.

  Names: "ngram" (`NGram()`); "eagle" (or "eagle3", the name its drafter reports), "medusa",
  "mlp" (the head bundled for the default SmolLM2 target under jaxspec/assets/heads/); a
  directory written by `jaxspec.heads.save_head` or `jaxspec train`; or the path of a draft
  model (.gguf file or Hugging Face directory), loaded as a `DraftModel` in `dtype` (default
  the target's). A named drafter is loaded once per target and reused by later calls.
  """
  if isinstance(drafter, Drafter):
    return drafter
  if not isinstance(drafter, str):
    raise ValueError(f"drafter must be a jaxspec Drafter (NGram(), DraftModel(model), ...) or a"
                     f" name (\"ngram\", \"eagle\", \"medusa\", \"mlp\", or a path), got"
                     f" {type(drafter).__name__}")
  if drafter == "ngram":
    return NGram()
  if drafter == "eagle3":  # the bundled EAGLE head under the name its drafter reports
    drafter = "eagle"
  key = (drafter, id(target), dtype)
  hit = _NAMED.get(key)
  if hit is not None and hit[0] is target:
    return hit[1]
  import os

  from jaxspec import heads as heads_lib
  if drafter in heads_lib.HEADS or heads_lib.is_head_dir(drafter):
    made = heads_lib.load_head(drafter, target)
  elif os.path.exists(drafter):
    from jaxspec.models.loading import load
    if dtype is None:
      dtype = "bfloat16" if target.params.embed.dtype == jnp.bfloat16 else "float32"
    made = DraftModel(load(drafter, dtype=dtype))
  else:
    raise ValueError(f"drafter {drafter!r} is not 'ngram', a bundled head"
                     f" ({', '.join(sorted(heads_lib.HEADS) + ['eagle3'])}), a head directory"
                     " or the path of"
                     " a draft model (.gguf file or Hugging Face directory)")
  if len(_NAMED) >= 8:
    _NAMED.clear()
  _NAMED[key] = (target, made)
  return made

