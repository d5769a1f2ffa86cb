"""One speculative step, shared by the fused loop (`fused.py`) and the two-mesh loop (`host.py`).

The loop state (`SpecState`), the policy that picks k (`Policy`), the statistics, and the
pieces of a step: choose k (`choose_k`), verify a branch (`verify_branch`), commit the outcome
to the target side (`finish_step`: write the block, roll back by length, append, count) and to
the drafter (`commit_step`). Every row accepts its own number of tokens: its target and draft
cache lengths move by its own count, rejected entries are rolled back by the length alone, and
finished rows stop growing while shapes stay static.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxspec import sampling as sampling_lib
from jaxspec.decoding import adaptive, protocol
from jaxspec.decoding.adaptive import AutoK, CostModel
from jaxspec.decoding.drafter import DraftContext, Drafter, Proposal
from jaxspec.decoding.plain import is_stop
from jaxspec.decoding.rejection import draft, in_vocabulary, rejection_sample, verify
from jaxspec.models.llama import Hidden
from jaxspec.pytree import pytree_dataclass as _pytree
from jaxspec.sampling import position_keys


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
  # Keep the target's log-probability of every emitted token (`SpecState.logp`).
  logprobs: bool = False

  @property
  def k_max(self) -> int:
    return self.buckets[-1]

  @classmethod
  def fixed(cls, k: int, logprobs: bool = False) -> Policy:
    return cls(buckets=(0, k), logprobs=logprobs)

  @classmethod
  def from_auto(cls, a: AutoK, logprobs: bool = False) -> Policy:
    return cls(buckets=a.resolved_buckets(), auto=True, decay=a.decay, prior=tuple(a.prior),
               margin=a.margin, logprobs=logprobs)


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


def costs_array(policy: Policy, cost: CostModel | None) -> jax.Array:
  """[2, len(buckets)]: each bucket's step seconds at an empty cache and per cached position
  (`CostModel.arrays`); the controller weighs them at the batch's current length."""
  if cost is None:
    return jnp.stack([jnp.ones((len(policy.buckets),), jnp.float32),
                      jnp.zeros((len(policy.buckets),), jnp.float32)])
  return jnp.asarray(cost.arrays(policy.buckets))


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
  cache: Any  # target cache: positions [0, seq_len - 1) (its .length)
  draft_state: Any
  keys: jax.Array  # [B]
  counts: adaptive.AcceptanceCounts  # the controller's acceptance model
  stats: SpecStats
  # [B, S] float32 the target's log-probability of each emitted token, at its place in seq
  # (Policy.logprobs; None otherwise).
  logp: jax.Array | None = None


@_pytree
@dataclasses.dataclass
class Deferred:
  """The draft state of a `defer_commit` drafter in the fused loop with "auto": the drafter's
  own state, and what plain steps emitted since its last commit (caught up in one pass)."""

  inner: Any  # the drafter's state as of `pending` tokens ago
  pending: jax.Array  # [B] int32 tokens (from plain steps) the drafter has not committed
  hidden: Hidden | None  # [B, W, D] (layers [n, B, W, D]) their target features, in order


def defers(drafter: Drafter, policy: Policy) -> bool:
  """Whether the fused loop defers this drafter's commits over plain steps."""
  return bool(drafter.defer_commit and not drafter.free_proposals and policy.auto
              and drafter.tree is None and policy.k_max > 0)


def pending_ctx(s: SpecState, pending: jax.Array, hidden: Hidden | None) -> DraftContext:
  """The context of a deferred commit: the pending tokens as one step that emitted them all."""
  return DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len, hidden=hidden,
                      hidden_pos=jnp.maximum(pending - 1, 0), n_new=pending)


def catch_up_pending(drafter, dparams, s: SpecState, dw: Deferred, width: int):
  """The drafter's state with the pending tokens committed (unchanged when none are)."""
  ctx = pending_ctx(s, dw.pending, dw.hidden)
  return lax.cond(jnp.any(dw.pending > 0),
                  lambda st: drafter.catch_up(dparams, st, ctx, width), lambda st: st, dw.inner)


def write_tokens(seq, seq_len, emitted, n_emit):
  """Writes emitted[:, :n_emit] at seq_len (per row); entries past n_emit are not written."""
  b, w = emitted.shape
  pos = seq_len[:, None] + jnp.arange(w)[None, :]
  pos = jnp.where(jnp.arange(w)[None, :] < n_emit[:, None], pos, seq.shape[1])  # dropped
  return seq.at[jnp.arange(b)[:, None], pos].set(emitted, mode="drop")


def spec_prefill(tparams, dparams, prompt, prompt_len, sp, key, *, lm, drafter, max_len,
                 seq_cap, policy, max_new_tokens, stop_ids, max_steps, buffers=None):
  """The prefill and the first new token, sampled from its logits as plain decoding does (no
  extra target pass: the prefill computed them). Returns the state, whose draft_state is the
  drafter's `init` (after the prompt), and the `DraftContext` of the first token, the plain
  step the prefill amounts to, which the drafter's `commit` takes next. Neither the statistics
  nor the acceptance model count it."""
  b, pw = prompt.shape
  want_hidden = drafter.uses_target_hidden
  logits, hidden, cache = protocol.prefill(
      lm, tparams, prompt, prompt_len, max_len,
      hidden_layers=drafter.hidden_layers if want_hidden else (), buffers=buffers)
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
                done=jnp.zeros((b,), bool), cache=protocol.with_length(cache, prompt_len - 1),
                draft_state=dstate, keys=keys, counts=adaptive.init_counts(b, k), stats=stats,
                logp=jnp.zeros((b, seq_cap), jnp.float32) if policy.logprobs else None)
  # New token 0 of every row, drawn with its position's key as `generate` draws it.
  first = sampling_lib.sample(position_keys(keys, jnp.zeros_like(prompt_len), 1)[:, 0], logits,
                              sp)
  idx = (prompt_len - 1)[:, None, None]
  final = jnp.take_along_axis(hidden.final, idx, axis=1)  # [B, 1, D]: f_{P-1}
  layers = None
  if hidden.layers is not None:
    layers = jnp.take_along_axis(hidden.layers, idx[None], axis=2)  # [n, B, 1, D]
  lp = sampling_lib.token_logprobs(logits, first, sp) if policy.logprobs else None
  out = plain_outcome(first, Hidden(final=final, layers=layers), None, k, lp)
  new, ctx = finish_step(s, out, lm=lm, policy=policy, max_new_tokens=max_new_tokens,
                         stop_ids=stop_ids)
  return dataclasses.replace(new, stats=stats, counts=s.counts), ctx


def _plain_block(tok: jax.Array, kmax: int) -> jax.Array:
  """A plain step's emitted block [B, kmax + 1]: the token, then -1."""
  return jnp.full((tok.shape[0], kmax + 1), -1, jnp.int32).at[:, 0].set(tok)


def plain_outcome(tok: jax.Array, hidden: Hidden, kv_new, kmax: int, lp=None):
  """A plain step's outcome in `finish_step`'s form: nothing drafted or accepted, the token
  [B] emitted, its target features padded to kmax + 1, kv_new (the new cache entries, or
  None when they are written already), and its log-probability [B] (or None)."""
  z = jnp.zeros((tok.shape[0],), jnp.int32)
  return (z, _plain_block(tok, kmax), pad_hidden(hidden, kmax + 1), kv_new, z, jnp.int32(0),
          lp_block(lp, kmax))


def lp_block(lp, kmax: int):
  """A plain step's log-probability [B] as a [B, kmax + 1] block (None stays None)."""
  if lp is None:
    return None
  return jnp.zeros((lp.shape[0], kmax + 1), jnp.float32).at[:, 0].set(lp)


def pad_axis(x, axis, width):
  """Zero-pads `axis` of x to `width`."""
  return jnp.pad(x, [(0, width - x.shape[axis]) if i == axis else (0, 0) for i in range(x.ndim)])


def pad_hidden(h: Hidden, width: int) -> Hidden:
  """Pads the token axis of a verify pass's Hidden (final [B, T, D]; layers [n, B, T, D])."""
  return Hidden(final=pad_axis(h.final, 1, width),
                layers=None if h.layers is None else pad_axis(h.layers, 2, width))


def pad_to(x, width, value):
  """Pads axis 1 of x to `width`."""
  return jnp.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2),
                 constant_values=value)


def step_keys(keys: jax.Array, seq_len: jax.Array):
  """The step's per-row draft and verify keys [B] each, from the row keys and lengths (a
  drafter on another mesh derives the same draft keys from its copies)."""
  folded = jax.vmap(jax.random.fold_in)(keys, seq_len)
  kd, kv = jax.vmap(lambda kk: jax.random.split(kk, 2), out_axes=1)(folded)
  return kd, kv


def step_inputs(s: SpecState, width: int = 1):
  """What every step derives from the state: live rows, the step's draft keys [B], the keys of
  the next `width` token positions [B, width] (`position_keys`: the target's draws) and the
  last accepted token."""
  kd, _ = step_keys(s.keys, s.seq_len)
  kv = position_keys(s.keys, s.seq_len - s.prompt_len, width)
  last = jnp.take_along_axis(s.seq, (s.seq_len - 1)[:, None], axis=1)[:, 0]
  return ~s.done, kd, kv, last


def room(s: SpecState, max_new_tokens: int) -> jax.Array:
  return max_new_tokens - (s.seq_len - s.prompt_len)  # [B] tokens each row may still emit


def verify_branch(tparams, cache, last, prop: Proposal | None, k: int, sp, kv, live, forced, *,
                  lm, drafter, kmax, known_drafts=False, logprobs=False):
  """Verifies k drafts (k = 0 or prop None: a plain one-token step) and rejection-samples.

  Reads the target cache only; returns (n_acc [B], emitted [B, kmax+1], hidden padded to
  kmax+1, (k_new, v_new) padded to kmax+1, n_valid [B], k verified []) so every branch of the
  caller's `lax.switch` has the same shapes and the one cache write happens after it.
  """
  greedy = sp.temperature == 0
  hidden_layers = drafter.hidden_layers if drafter.uses_target_hidden else ()
  pad_kv = lambda kv_new: protocol.pad_block(lm, kv_new, kmax + 1)

  def plain(cache):  # as `generate`'s decode step: sampled from the logits, no [B, V] one-hot
    logits, hidden, kv_new = protocol.forward(lm, tparams, last[:, None], cache,
                                              hidden_layers=hidden_layers, write=False)
    tok = sampling_lib.sample(kv[:, 0], logits[:, 0], sp)
    lp = sampling_lib.token_logprobs(logits[:, 0], tok, sp) if logprobs else None
    return plain_outcome(tok, hidden, pad_kv(kv_new), kmax, lp)

  if k == 0 or prop is None:
    return plain(cache)
  prop = in_vocabulary(prop, lm.vocab_size)
  n_valid = prop.n_valid

  def verify_drafts(cache):
    p, hidden, kv_new, logits = verify(tparams, cache, last, prop.tokens, lm, sp,
                                       hidden_layers=hidden_layers, write=False,
                                       return_logits=True)
    n_acc, emitted = rejection_sample(p, prop.q, prop.tokens, kv[:, :k + 1], n_valid, greedy)
    lp = None
    if logprobs:  # every emitted token i was drawn from the target's logits at position i
      lp = pad_to(sampling_lib.token_logprobs(logits, jnp.maximum(emitted, 0), sp), kmax + 1, 0)
    return (n_acc, pad_to(emitted, kmax + 1, -1), pad_hidden(hidden, kmax + 1),
            pad_kv(kv_new), n_valid, jnp.int32(k), lp)

  if known_drafts:
    # A fixed k chosen after seeing these proposals (`choose_k`): some live row has a real
    # draft, or the step is forced. A conditional would only add a host round trip on GPUs.
    return verify_drafts(cache)
  # No live row has a real draft: a one-token pass costs less than verifying filler.
  return lax.cond(forced | jnp.any(live & (n_valid > 0)), verify_drafts, plain, cache)


def slice_proposal(prop: Proposal, k: int, n_valid_all: jax.Array) -> Proposal:
  """The first k of k_max proposed drafts."""
  return Proposal(tokens=prop.tokens[:, :k], q=None if prop.q is None else prop.q[:, :k],
                  n_valid=jnp.minimum(n_valid_all, k))


def finish_step(s: SpecState, out, *, lm, policy, max_new_tokens, stop_ids, shadow_draft=None):
  """Commits one verify pass's outcome to the target side of the state.

  Writes the new block to the cache and rolls it back to what was accepted, appends the emitted
  tokens (cut at a stop token and at max_new_tokens), updates the acceptance counts and the
  statistics. Returns the new state (draft_state untouched) and the `DraftContext` the
  drafter's `commit` reads. shadow_draft [B] (or None): each row's deterministic first draft
  (-1: none) when drafts were proposed before the choice; a plain step then still tells the
  acceptance model whether that draft would have been accepted.
  """
  n_acc, emitted, hidden, kv_new, n_valid, k_used, lp = out
  kmax = policy.k_max
  live = ~s.done
  left = room(s, max_new_tokens)
  old_len = s.cache.length
  cache = s.cache
  if kv_new is not None:  # None: the block is in the cache already (the prefill wrote it)
    cache = protocol.write_block(lm, cache, kv_new, old_len)
  n_emit = n_acc + 1
  # A stop token inside the accepted run ends the row there.
  i1 = jnp.arange(kmax + 1)[None, :]
  stop_hit = is_stop(emitted, stop_ids) & (i1 < n_emit[:, None])
  first_stop = jnp.argmax(stop_hit, axis=1)
  has_stop = stop_hit.any(axis=1)
  n_emit = jnp.where(has_stop, first_stop + 1, n_emit)
  n_emit = jnp.where(live, jnp.minimum(n_emit, left), 0)
  seq = write_tokens(s.seq, s.seq_len, emitted, n_emit)
  logp = s.logp if lp is None else write_tokens(s.logp, s.seq_len, lp, n_emit)
  seq_len = s.seq_len + n_emit
  # Roll back: the cache keeps every emitted token but the newest (the next pass's input).
  cache = protocol.with_length(cache, jnp.where(live, old_len + n_emit, old_len))
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
                  draft_state=s.draft_state, keys=s.keys, counts=counts, stats=stats, logp=logp)
  return new, ctx


@_pytree
@dataclasses.dataclass
class Choice:
  """A step's choice of k, made before the step: the bucket index, and for a drafter whose
  proposals cost nothing its k_max proposals (which the choice read) and state after them."""

  idx: jax.Array  # [] int32 index into policy.buckets
  prop: Proposal | None
  dstate: Any
  n_valid: jax.Array  # [B] real drafts per row (k_max when not known before drafting)


def choose_k(dparams, s: SpecState, sp, costs, force_idx, *, drafter, policy,
             max_new_tokens) -> Choice:
  """Picks the step's bucket: the controller's choice ("auto"), the largest bucket when some
  live row has a real draft (a fixed k), or force_idx when >= 0."""
  b = s.seq.shape[0]
  kmax = policy.k_max
  live, kd, _, _ = step_inputs(s)
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
                             room(s, max_new_tokens), policy.margin, length=s.seq_len)
  else:
    idx = jnp.where(jnp.any(live & (nv_all > 0)), len(policy.buckets) - 1, 0).astype(jnp.int32)
  idx = jnp.where(force_idx >= 0, force_idx, idx)
  return Choice(idx=idx, prop=prop, dstate=dstate, n_valid=nv_all)


def shadow_draft(choice: Choice, drafter, policy):
  """[B] each row's deterministic first draft (-1: none), which a plain step still scores for
  the acceptance model, or None when the drafts are not known before the choice."""
  if policy.auto and drafter.free_proposals and choice.prop.q is None and policy.k_max > 0:
    return jnp.where(choice.n_valid > 0, choice.prop.tokens[:, 0], -1)
  return None


def commit_step(drafter, dparams, policy, s: SpecState, new: SpecState, dstate, ctx, plain_chosen):
  """The new state with the drafter's state updated by the step's outcome."""
  if defers(drafter, policy):
    return dataclasses.replace(new, draft_state=commit_or_defer(
        drafter, dparams, new, s.draft_state, dstate, ctx, plain_chosen, policy.k_max + 1))
  return dataclasses.replace(new, draft_state=drafter.commit(dparams, dstate, ctx))


def commit_or_defer(drafter, dparams, new: SpecState, dw: Deferred, dstate, ctx: DraftContext,
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
              lambda st: drafter.catch_up(dparams, st, pending_ctx(new, pend, hid), width)]
  inner = lax.switch(which, branches, dstate)
  return Deferred(inner=inner, pending=jnp.where(which == 0, pend, 0), hidden=hid)
