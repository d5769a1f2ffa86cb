"""A separate draft model drafting for the target: `DraftModel`, with its own KV cache."""

from __future__ import annotations

import dataclasses
import numbers

import jax
import jax.numpy as jnp
from jax import lax

from jaxspec import sampling as sampling_lib
from jaxspec.decoding import protocol
from jaxspec.decoding.drafter import Drafter, Proposal, split_draft_keys
from jaxspec.decoding.protocol import Target
from jaxspec.drafters.ngram import last_tokens
from jaxspec.models.config import LlamaConfig
from jaxspec.models.llama import KVCache, LlamaLM, Params
from jaxspec.models.model import Model
from jaxspec.pytree import pytree_dataclass as _pytree


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
    two = last_tokens(ctx, 2)  # [B, 2]: the token before last, and last
    # A row holding a single token has no "token before last": it feeds [last, last], reads the
    # logits of the first and keeps only that one entry.
    single = ctx.seq_len < 2
    start = state.cache.length
    logits, _, cache = protocol.forward(lm, params, two, state.cache)
    cache = protocol.with_length(cache, start + jnp.where(single, 1, 2))
    step_keys = split_draft_keys(self, keys, ctx, k)  # [B, k]
    v = lm.vocab_size

    def pick(logits_i, key_i, hist):
      # q is processed as the target's p at this position: the penalties, logit bias and
      # min_new_tokens read the context with the drafts before this one (`hist`).
      q = sampling_lib.probs(sampling_lib.adjust(logits_i, sp, hist), sp)
      # Coupled, key_i is the target's key for this token: the same Gumbel-max draw then
      # shares the target's noise.
      tok = sampling_lib.sample_from_probs(key_i, q, sampling_lib.greedy_rows(sp))
      # Whether this draft is proposed is decided before it is drawn: from the draft model's
      # top probability (llama.cpp's --draft-p-min), not the drawn token's, whose use would
      # select against unlikely draws and bias a sampled output. Greedy: the same value.
      conf = jnp.max(jax.nn.softmax(logits_i.astype(jnp.float32), -1), axis=-1)
      hist = sampling_lib.extend_history(hist, tok)
      return tok, q, conf >= self.p_min, hist

    d0, q0, ok0, hist = pick(jnp.where(single[:, None], logits[:, 0], logits[:, 1]),
                             step_keys[:, 0], ctx.history)
    drafts = jnp.zeros((b, k), jnp.int32).at[:, 0].set(d0)
    qs = jnp.zeros((b, k, v), jnp.float32).at[:, 0].set(q0)
    n_valid = ok0.astype(jnp.int32)

    def cond(c):
      i, _, _, _, alive, _, _ = c
      return (i < k) & jnp.any(alive)

    def body(c):
      i, drafts, qs, n_valid, alive, cache, hist = c
      tok = lax.dynamic_index_in_dim(drafts, i - 1, axis=1, keepdims=False)
      logits, _, cache = protocol.forward(lm, params, tok[:, None], cache)
      key_i = lax.dynamic_index_in_dim(step_keys, i, axis=1, keepdims=False)
      nxt, q, ok, hist = pick(logits[:, 0], key_i, hist)
      drafts = lax.dynamic_update_index_in_dim(drafts, nxt, i, axis=1)
      qs = lax.dynamic_update_index_in_dim(qs, q, i, axis=1)
      alive = alive & ok
      return i + 1, drafts, qs, n_valid + alive, alive, cache, hist

    if self.p_min > 0:
      _, drafts, qs, n_valid, _, cache, _ = lax.while_loop(
          cond, body, (jnp.int32(1), drafts, qs, n_valid, ok0, cache, hist))
      return Proposal(tokens=drafts, q=None if self.coupled else qs,
                      n_valid=n_valid), DraftModelState(cache)

    def scan_body(carry, key_i):  # a fixed trip count: outputs stacked, no early exit
      tok, cache, hist = carry
      logits, _, cache = protocol.forward(lm, params, tok[:, None], cache)
      nxt, q, _, hist = pick(logits[:, 0], key_i, hist)
      return (nxt, cache, hist), (nxt, q)

    if k > 1:
      (_, cache, _), (toks, qs) = lax.scan(scan_body, (d0, cache, hist),
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
