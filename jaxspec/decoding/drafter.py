"""Drafters: what proposes the k tokens that the target verifies.

A drafter is a frozen, hashable dataclass (its configuration is a static argument of the jitted
loop) whose weights, if any, are passed separately as a pytree (`drafter.params`), so a drafter
with new weights of the same shapes reuses the compiled loop. Three pure methods run inside the
loop:

  init(params, prompt, prompt_len, max_len, hidden) -> state   after the target's prefill
  propose(params, state, ctx, k, sp, keys)   -> (Proposal, state)
  commit(params, state, ctx)                 -> state     after acceptance, ctx holds the
                                                          accepted sequence and the target's
                                                          hidden states

A drafter whose `commit` costs a pass of its own (a draft model's layers, an EAGLE layer) sets
`defer_commit`: when the adaptive controller runs plain steps (k = 0), the fused loop then skips
the commit and keeps the plain steps' tokens (and hidden states) pending, and brings the drafter
up to date with one `catch_up(params, state, ctx, width)` over all of them, before it next
drafts or when `width` are pending. So not drafting costs what plain decoding costs.

A `Proposal` holds the k drafts, their distribution q processed with the same sampling
parameters as the target (None for a deterministic drafter: one-hot q, still exact), and how
many of the k are real proposals per row (an n-gram drafter with no match has none): when no
live row has any, the loop runs a plain one-token step instead of a (k+1)-token verify.

The rule that keeps a custom drafter's `n_valid` exact: whether draft i counts (i < n_valid)
may depend only on what was known before draft i was drawn (the context, drafts 1..i-1, the
distribution q_i itself), never on the drawn token x_i. The target samples position i from
p_i whenever draft i does not count, so any such rule leaves the output distribution p; a rule
that looks at x_i (say, "stop where q_i(x_i) is small") drops unlikely draws selectively and
biases sampled output. `DraftModel(p_min=...)` stops on the top probability of q_i for this
reason (for greedy drafts the two are the same).
"""


from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax import lax

from jaxspec import sampling as sampling_lib
from jaxspec.lm import Hidden
from jaxspec.pytree import pytree_dataclass as _pytree


@_pytree
@dataclasses.dataclass
class DraftContext:
  """What the loop tells a drafter: the whole token sequence so far and the target's features.

  The target's KV cache holds positions [0, seq_len - 1): every token but the last, which is the
  input of the next verify pass.
  """

  seq: jax.Array  # [B, S] int32 prompt followed by the emitted tokens
  seq_len: jax.Array  # [B] int32
  prompt_len: jax.Array  # [B] int32
  hidden: Hidden | None = None  # target hidden states of the last target pass
  hidden_pos: jax.Array | None = None  # [B] index into hidden's T axis of the newest kept token
  n_new: jax.Array | None = None  # [B] tokens appended by the last step (0 for finished rows)
  # [B] the rows' PRNG keys (the loop's; None where not given): new token j of row b is drawn
  # with fold_in(row_keys[b], j) by the target, so a drafter can draw its draft of token j
  # with the same noise (`DraftModel(coupled=True)`).
  row_keys: jax.Array | None = None
  # What the sampling's penalties, logit_bias and min_new_tokens read of the context at seq_len
  # (`jaxspec.sampling.TokenHistory`; None when it has none): a drafter adjusts its draft j's
  # logits with it and drafts 1..j-1 appended (`sampling.adjust`, `sampling.extend_history`),
  # so q is processed as the target's p is. Exactness does not depend on it (the rule only
  # needs the q the drafts were drawn from); acceptance does.
  history: Any = None


@_pytree
@dataclasses.dataclass
class Proposal:
  tokens: jax.Array  # [B, k] int32
  q: jax.Array | None = None  # [B, k, V] float32 draft probabilities; None = one-hot
  n_valid: jax.Array | None = None  # [B] int32 real drafts per row (None = all k)


class Drafter:
  """Base class; see the module docstring for the protocol."""

  name: str = "drafter"
  # The most drafts one step can propose (a head with K heads or stages), None: no limit.
  max_draft_tokens: int | None = None
  # Whether the drafter reads the target's hidden states: then `init` gets the prefill's and
  # `commit` each verify pass's `Hidden` (final normed states plus `hidden_layers`); otherwise
  # the target skips collecting them.
  uses_target_hidden: bool = False
  # Target decoder layers whose outputs the drafter reads (indices as in
  # `forward(hidden_layers=...)`), when uses_target_hidden.
  hidden_layers: tuple[int, ...] = ()
  # Proposing costs next to nothing (no model pass): the loop then proposes k_max tokens before
  # choosing k, so the adaptive controller knows which rows have real drafts.
  free_proposals: bool = False
  # Its commit runs a model pass: the fused loop may defer it over plain steps (`catch_up`).
  defer_commit: bool = False
  # A `jaxspec.decoding.tree.Tree` / `DynamicTree` when the drafter drafts a tree each step
  # (`propose_tree(params, state, ctx, sp, keys) -> (TreeProposal, state)`), else None.
  tree: Any = None
  # The drafter's weights (a pytree), None: it has none; a drafter with weights overrides it
  # (a property or a field), as `vocab_size`: the vocabulary its drafts come from, None: any.
  params: Any = None
  vocab_size: int | None = None

  def init(self, params, prompt: jax.Array, prompt_len: jax.Array, max_len: int,
           hidden: Hidden | None = None):
    """State after the prompt (prompt [B, P] right-padded, prompt_len [B]); max_len is the
    sequence capacity. `hidden` is the target's prefill Hidden ([B, P, D] per entry, padding
    positions included) when `uses_target_hidden`, else None. The target's cache then holds
    positions [0, prompt_len - 1), as after a step that emitted the last prompt token. The
    loop then samples the first new token from the prefill's logits and passes it to `commit`
    as a plain step's outcome (n_new 1; its Hidden block holds the target's features at the
    last prompt position), so the first `propose` already follows the first new token."""
    raise NotImplementedError

  def propose(self, params, state, ctx: DraftContext, k: int, sp, keys):
    raise NotImplementedError

  def commit(self, params, state, ctx: DraftContext):
    raise NotImplementedError

  def check_params(self, params) -> None:
    """Raises ValueError where `params` (given as `drafter_params`) cannot be this drafter's,
    before anything is traced; the structure and leaf shapes are checked besides."""

  def next_params(self, params, state, ctx: DraftContext):
    """The params the next call should take (`DecodeOutput.drafter_params`), after the loop:
    ctx holds every row's whole sequence. None (the default): the params do not change. A
    suffix drafter returns its corpus with the call's rows appended."""
    return None

  def catch_up(self, params, state, ctx: DraftContext, width: int):
    """A deferred commit (`defer_commit`): the last ctx.n_new [B] tokens of ctx.seq (at most
    `width`) came from plain steps the drafter has not seen; ctx.hidden (when the drafter uses
    the target's hidden states) holds their target features, `width` wide, as a verify pass over
    them would. The state afterwards is what committing each plain step would have given."""
    return self.commit(params, state, ctx)

  def catch_up_where(self, params, state, ctx: DraftContext, width: int, when: jax.Array):
    """`catch_up` where `when` ([] bool, traced) holds, else the state as it is: what the fused
    loop runs after every plain step (`when`: some row has `width` tokens pending). XLA copies
    the state an untaken branch passes through, every step: a drafter with a large state (a
    KV cache) overrides this so that its state stays out of the conditional."""
    return lax.cond(when, lambda st: self.catch_up(params, st, ctx, width), lambda st: st, state)


def position_draft_keys(ctx: DraftContext, k: int, who: str = "drafter") -> jax.Array:
  """[B, k] the keys the target draws the next k tokens with (`sampling.position_keys`), for a
  coupled drafter."""
  if ctx.row_keys is None:
    raise ValueError(f"a coupled {who} needs the loop's row keys in its context"
                     " (DraftContext.row_keys): use it through speculative_generate")
  return sampling_lib.position_keys(ctx.row_keys, ctx.seq_len - ctx.prompt_len, k)


def split_draft_keys(drafter, keys: jax.Array, ctx: DraftContext, k: int) -> jax.Array:
  """[B, k] the keys a drafter draws its k drafts with: each row's step draft key (`keys`
  [B]) split k ways (the standard rule), or, for a coupled drafter, the keys the target draws
  those tokens with (`position_draft_keys`)."""
  if getattr(drafter, "coupled", False):
    return position_draft_keys(ctx, k, drafter.name)
  return jax.vmap(lambda kk: jax.random.split(kk, k))(keys)


def resolve_coupled(drafter: Drafter, auto: bool) -> Drafter:
  """The drafter with `coupled` decided: where it is None, coupled exactly under "auto"."""
  if getattr(drafter, "coupled", False) is None:
    return dataclasses.replace(drafter, coupled=bool(auto))
  return drafter


@_pytree
@dataclasses.dataclass
class NoState:
  """The state of a drafter that keeps none."""
