"""Parallel drafting (PARD, An et al. 2025, arXiv 2504.18583): a draft model trained with a
mask token proposes all k drafts from one forward pass.

The draft model reads the context followed by k - 1 copies of its mask token: the logits at the
last real token give draft 1 (as any causal LM's), and those at the j-th mask give draft j + 1,
a distribution over the token j + 1 places ahead that depends on the context only, not on the
earlier drafts. Drafting costs one pass over k + 1 tokens instead of `DraftModel`'s k sequential
passes. The model must have been trained for it (the mask-token objective,
`jaxspec.train.pard`); any other draft model reads the masks as text and drafts poorly, though
still exactly.

Exactness: draft j is drawn from q_j (the processed distribution of its position), fixed before
it is drawn, and q_j is what the proposal reports, so the loop's rejection rule leaves the
target's distribution as it does for every drafter; that q_j ignores drafts 1..j-1 only lowers
how often drafts are accepted.

`load_pard(path)` reads a PARD-format checkpoint: a Hugging Face dense Llama / Qwen3 directory
whose config.json names the mask token as "pard_token" (the PARD release's key) and, where
known, the largest k it was trained for as "pard_trained_k" (written by `jaxspec.train.pard`).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import jax.numpy as jnp
from jax import lax

from jaxspec import sampling as sampling_lib
from jaxspec.checks import check_int, is_int
from jaxspec.decoding import protocol
from jaxspec.decoding.drafter import Proposal, split_draft_keys
from jaxspec.drafters.draft_model import DraftModel, DraftModelState
from jaxspec.drafters.ngram import last_tokens
from jaxspec.models.errors import CheckpointError, read_json
from jaxspec.models.model import Model

# config.json keys of a PARD checkpoint: the mask token (the PARD release's name) and the
# largest number of drafts it was trained to propose (jaxspec's; optional).
MASK_KEY = "pard_token"
TRAINED_K_KEY = "pard_trained_k"


@dataclasses.dataclass(frozen=True, eq=False)
class ParallelDraft(DraftModel):
  """A PARD draft model: k drafts from one forward pass over the context and k - 1 mask tokens.

  Its cache is `DraftModel`'s (it holds [0, seq_len - 2) between steps, so `commit` and
  `catch_up` are the same): a proposal runs [token before last, last token, mask x (k - 1)],
  and only the two real tokens are kept (the length moves past them alone); the masks' keys and
  values lie past the length, never read, and are overwritten by the next step's pass, which
  runs the masks again after the newly accepted tokens.

  Args:
    model: the draft model (a jaxspec `Model` or `Target(lm, params)`), trained with the mask
      token.
    mask_id: the mask token's id, in [0, vocab_size).
    trained_k: the most drafts the model was trained to propose (`max_draft_tokens`: a larger
      num_draft_tokens, or AutoK.k_max, is refused); None: no limit known.
    p_min, coupled: as `DraftModel`'s (a row's drafts stop at the first position whose top
      probability is below p_min; coupled draws with the target's noise).
  """

  mask_id: int | None = None
  trained_k: int | None = None
  name: str = "pard"

  def __post_init__(self):
    super().__post_init__()
    v = self.lm.vocab_size
    if self.mask_id is None:
      raise ValueError("ParallelDraft needs the draft model's mask token: pass mask_id= (a PARD"
                       f" checkpoint names it in config.json as {MASK_KEY!r}; load_pard reads"
                       " it)")
    check_int("ParallelDraft.mask_id", self.mask_id, 0, v - 1,
              why=f"the mask token must be in the draft model's vocabulary of {v}")
    if self.trained_k is not None:
      check_int("ParallelDraft.trained_k", self.trained_k, 1,
                why="the most drafts the model was trained for; None: no limit")

  def _key(self):
    return super()._key() + (int(self.mask_id), self.trained_k)

  @property
  def max_draft_tokens(self) -> int | None:
    return self.trained_k

  def propose(self, params, state: DraftModelState, ctx, k, sp, keys):
    """k drafts per row from one forward pass over k + 1 tokens (see the class docstring)."""
    lm = self.lm
    b = ctx.seq.shape[0]
    two = last_tokens(ctx, 2)  # [B, 2]
    # A row holding a single token (its cache is empty) runs [last, mask x k] from position 0
    # and reads from index 0; every other row runs [before last, last, mask x (k - 1)] and
    # reads from index 1. Both are k + 1 tokens wide, so one pass serves the batch.
    single = ctx.seq_len < 2
    masks = jnp.full((b, k), self.mask_id, jnp.int32)
    toks = jnp.where(single[:, None], jnp.concatenate([two[:, 1:], masks], axis=1),
                     jnp.concatenate([two, masks[:, 1:]], axis=1))  # [B, k + 1]
    start = state.cache.length
    at = jnp.where(single, 0, 1)[:, None] + jnp.arange(k)[None, :]  # [B, k] positions read
    if hasattr(lm, "logits_from_hidden"):
      # The LM head (most of a small draft's cost) only on the k positions read.
      _, hidden, cache = protocol.forward(lm, params, toks, state.cache, logits=False)
      h = jnp.take_along_axis(hidden.final, at[:, :, None], axis=1)  # [B, k, D]
      lg = lm.logits_from_hidden(params, h).astype(jnp.float32)  # [B, k, V]
    else:
      logits, _, cache = protocol.forward(lm, params, toks, state.cache)
      lg = jnp.take_along_axis(logits, at[:, :, None], axis=1)  # [B, k, V] float32
    # Only the real tokens are kept: the masks' entries lie past the length.
    cache = protocol.with_length(cache, start + jnp.where(single, 1, 2))
    q = sampling_lib.probs(lg, sp)  # [B, k, V]
    step_keys = split_draft_keys(self, keys, ctx, k)  # [B, k]
    greedy = sampling_lib.greedy_rows(sp)
    drafts = jax.vmap(lambda kk, qq: sampling_lib.sample_from_probs(kk, qq, greedy),
                      in_axes=(1, 1), out_axes=1)(step_keys, q)  # [B, k]
    n_valid = None
    if self.p_min > 0:
      # Decided from each position's top probability before its draft is drawn (as
      # DraftModel's p_min): a row keeps its drafts up to the first unconfident position.
      conf = jnp.max(jax.nn.softmax(lg, axis=-1), axis=-1)  # [B, k]
      n_valid = jnp.sum(jnp.cumprod(conf >= self.p_min, axis=1), axis=1).astype(jnp.int32)
    return Proposal(tokens=drafts.astype(jnp.int32), q=None if self.coupled else q,
                    n_valid=n_valid), DraftModelState(cache)

  def commit(self, params, state: DraftModelState, ctx) -> DraftModelState:
    """Moves the draft cache to [0, seq_len - 2). The pass kept [0, s) (s the length before
    the step), so a step that accepted a drafts leaves it a - 1 tokens behind, the masks'
    entries in their place (a DraftModel drafts token by token and is behind by one at most):
    it runs the missing tokens one at a time until every row holds them (a row already there
    writes a real token past its kept length, which the length then drops)."""
    want = jnp.maximum(ctx.seq_len - 2, 0)
    cache = lax.while_loop(lambda c: jnp.any(c.length < want),
                           lambda c: self._advance(params, c, ctx.seq, 1), state.cache)
    return DraftModelState(protocol.with_length(cache, want))


def pard_config(path: str | os.PathLike) -> dict:
  """The PARD keys of a checkpoint's config.json: {"mask_id": int | None, "trained_k": int |
  None}.

  Raises:
    CheckpointError: config.json is missing or unreadable, or a key holds something other than
      a non-negative integer.
  """
  cfg_path = Path(path) / "config.json"
  if not cfg_path.is_file():
    raise CheckpointError(f"{cfg_path} does not exist: a PARD draft is a Hugging Face model"
                          " directory with its config.json")
  raw = read_json(cfg_path)
  out = {}
  for key, name, lo in ((MASK_KEY, "mask_id", 0), (TRAINED_K_KEY, "trained_k", 1)):
    value = raw.get(key)
    if value is not None and not (is_int(value, numpy=False) and value >= lo):
      raise CheckpointError(f"{cfg_path}: {key} must be an integer >= {lo}, got {value!r}: fix"
                            " config.json" + (" or pass mask_id=" if key == MASK_KEY else ""))
    out[name] = value
  return out


def is_pard_dir(path: str | os.PathLike) -> bool:
  """Whether `path` is a model directory whose config.json names a PARD mask token."""
  cfg_path = Path(path) / "config.json"
  if not cfg_path.is_file():
    return False
  try:
    return MASK_KEY in read_json(cfg_path)
  except CheckpointError:  # not a PARD draft's config: whoever loads it says what is wrong
    return False


def load_pard(path: str | os.PathLike, target: Model | None = None, *, mask_id: int | None = None,
              trained_k: int | None = None, dtype: str | None = None, **kwargs) -> ParallelDraft:
  """A `ParallelDraft` from a PARD-format checkpoint (a Hugging Face dense Llama / Qwen3
  directory).

  Args:
    path: the model directory.
    target: the model it drafts for: its vocabulary must be the draft's (checked here).
    mask_id: the mask token (default: config.json's "pard_token"; given, it overrides it).
    trained_k: the most drafts it proposes (default: config.json's "pard_trained_k", if any).
    dtype: parameter dtype (default the target's, else the checkpoint's).
    kwargs: `ParallelDraft`'s others (p_min, coupled).
  Returns:
    The drafter.
  Raises:
    CheckpointError: the directory or its config cannot be read, or names no mask token and
      none is given.
    ValueError: the mask id is outside the vocabulary, trained_k is not a positive integer, or
      the vocabulary differs from the target's.
  """
  from jaxspec.models.loading import load
  found = pard_config(path)
  if mask_id is None:
    mask_id = found["mask_id"]
    if mask_id is None:
      raise CheckpointError(f"{Path(path) / 'config.json'} names no {MASK_KEY}: this is not a"
                            " PARD checkpoint, or pass its mask token as mask_id=")
  if trained_k is None:
    trained_k = found["trained_k"]
  if dtype is None and target is not None:
    dtype = "bfloat16" if target.params.embed.dtype == jnp.bfloat16 else "float32"
  model = load(path, dtype=dtype)
  v = model.cfg.vocab_size
  check_int("the PARD mask id", mask_id, 0, v - 1,
            why=f"the draft's vocabulary holds {v} tokens: fix {MASK_KEY} in config.json or pass"
                " mask_id=")
  if target is not None and target.cfg.vocab_size != v:
    raise ValueError(f"draft vocab {v} != target vocab {target.cfg.vocab_size}: a PARD draft"
                     " must share the target's tokenizer (its mask token is one of the shared"
                     " vocabulary's ids)")
  return ParallelDraft(model, mask_id=mask_id, trained_k=trained_k, **kwargs)


__all__ = ["MASK_KEY", "TRAINED_K_KEY", "ParallelDraft", "is_pard_dir", "load_pard",
           "pard_config"]
