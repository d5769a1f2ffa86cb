"""The `Oracle` drafter: a known continuation, each draft kept with probability alpha, for
measuring the speculative loop itself (benchmarks)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.checks import check_int
from jaxspec.decoding.drafter import Drafter, NoState, Proposal
from jaxspec.pytree import pytree_dataclass as _pytree


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
    check_int("vocab", self.vocab, 2, why="the target's vocabulary size", numpy=False)
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
