"""Prompt-lookup drafting: `NGram` copies what followed an earlier occurrence of the last tokens."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.checks import check_int
from jaxspec.decoding.drafter import DraftContext, Drafter, NoState, Proposal


def last_tokens(ctx: DraftContext, n: int) -> jax.Array:
  """The last n tokens of every row [B, n] (clipped at the start of the sequence)."""
  idx = ctx.seq_len[:, None] - n + jnp.arange(n)[None, :]
  return jnp.take_along_axis(ctx.seq, jnp.maximum(idx, 0), axis=1)


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
    for name in ("min_ngram", "max_ngram"):  # Python ints: the drafter is a static argument
      check_int(f"NGram.{name}", getattr(self, name), numpy=False)
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
      suffix = last_tokens(ctx, g)  # [B, g]
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
