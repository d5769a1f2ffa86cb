"""The speculative loop: its static configuration, its state, one step, and the fused loop.

`spec_init` (prefill and first token) and `spec_loop` (a `lax.while_loop` of steps) are the
single-jit program; the two-mesh loop (`two_mesh.py`) runs the same pieces as separate programs.
One step, `spec_step`, reads top to bottom:

  choose k      `choose_k`: the controller's bucket ("auto") or the fixed k
  draft         the drafter proposes k tokens (`Drafter.propose`)
  verify        one target pass over them and rejection sampling (`verify_branch`), inside a
                `lax.switch` over the compiled draft counts, returning a `StepOutcome`
  accept        `finish_step`: write the new cache block, roll back by length, append the
                emitted tokens, count; then the drafter commits (`commit_step`)

Every row accepts its own number of tokens: its target and draft cache lengths move by its own
count, rejected entries are rolled back by the length alone, and finished rows stop growing
while shapes stay static. Everything static is in one `StepConfig`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxspec import sampling as sampling_lib
from jaxspec.checks import is_int
from jaxspec.decoding import adaptive, protocol
from jaxspec.decoding import tree as tree_lib
from jaxspec.decoding.adaptive import AutoK, CostModel
from jaxspec.decoding.drafter import DraftContext, Drafter, Proposal
from jaxspec.decoding.rejection import in_vocabulary, rejection_sample, verify
from jaxspec.lm import Hidden
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
  # With logprobs: also the N most likely tokens at every emitting position (`SpecState.top_ids`).
  top_logprobs: int = 0
  # `AutoK.carry`: read by the host wrappers only, so it is not part of the program's identity.
  carry: bool = dataclasses.field(default=False, compare=False)

  @property
  def k_max(self) -> int:
    return self.buckets[-1]

  @classmethod
  def fixed(cls, k: int, logprobs: bool = False) -> Policy:
    return cls(buckets=(0, k), logprobs=logprobs)

  @classmethod
  def from_auto(cls, a: AutoK, logprobs: bool = False) -> Policy:
    return cls(buckets=a.resolved_buckets(), auto=True, decay=a.decay, prior=tuple(a.prior),
               margin=a.margin, logprobs=logprobs, carry=bool(a.carry))


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
  if not is_int(num_draft_tokens) or not 1 <= num_draft_tokens <= MAX_DRAFT_TOKENS:
    raise ValueError(f"num_draft_tokens must be \"auto\" or an integer in [1,"
                     f" {MAX_DRAFT_TOKENS}], got {num_draft_tokens!r}")
  if auto is not None:
    raise ValueError(f"auto= configures num_draft_tokens=\"auto\" but num_draft_tokens is"
                     f" {num_draft_tokens}: pass num_draft_tokens=\"auto\" or drop auto=")
  if limit is not None and num_draft_tokens > limit:
    raise ValueError(f"{what} a step: num_draft_tokens must be <= {limit}, got"
                     f" {num_draft_tokens}")
  return Policy.fixed(int(num_draft_tokens))


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

  def summary(self) -> dict[str, Any]:
    """The statistics a host call reports, as Python numbers and lists: tau (tokens emitted
    per target pass of a live row), acceptance rate, acceptance per draft position
    (unconditional, as vLLM reports, and conditional), drafted/accepted per row, plain steps
    and the k of every step. Reads the counters to the host (a multi-host mesh's arrays must
    be gathered first, e.g. with `multihost_utils.process_allgather`)."""
    st = jax.tree.map(np.asarray, self)
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
        # Unconditional (as vLLM reports): fraction of the live row-steps that verified drafts
        # in which draft i was accepted (a step verifying fewer than i drafts counts as a miss).
        acceptance_per_position=(acc_at / spec_steps).tolist(),
        # Conditional: accepted at i given a real draft i was verified after i-1 accepts.
        conditional_acceptance_per_position=np.divide(
            acc_at, np.maximum(st.reached_at, 1)).tolist(),
        # tau: tokens emitted per target pass of a live row, counting the bonus/correction
        # token (plain steps, where nothing was drafted, count as passes emitting one token).
        tau=float(st.emitted.sum() / total_row_steps),
        plain_steps=int((hist == 0).sum()),
        k_per_step=hist.tolist(),
        mean_k=float(hist.mean()) if passes else 0.0,
    )


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
  # What penalties, logit_bias and min_new_tokens read of the context (`TokenHistory`); None
  # when the sampling has none of them, so the loop without them carries nothing more.
  history: sampling_lib.TokenHistory | None = None
  # [B, S, N] int32 / float32 the N most likely tokens at each emitted token's position and
  # their log-probabilities (Policy.top_logprobs = N; None otherwise).
  top_ids: jax.Array | None = None
  top_lp: jax.Array | None = None


@_pytree
@dataclasses.dataclass
class Deferred:
  """The draft state of a `defer_commit` drafter in the fused loop with "auto": the drafter's
  own state, and what plain steps emitted since its last commit (caught up in one pass)."""

  inner: Any  # the drafter's state as of `pending` tokens ago
  pending: jax.Array  # [B] int32 tokens (from plain steps) the drafter has not committed
  hidden: Hidden | None  # [B, W, D] (layers [n, B, W, D]) their target features, in order


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
  """Everything static about a speculative loop, as one hashable object: the compiled prefill
  and loop take it as their one static argument (as gemma's sampler loop does), and every
  piece of a step reads it instead of a row of keyword arguments.

  lm: the target model (`CausalLM`). drafter: the `Drafter`. policy: how k is chosen.
  max_new_tokens: new tokens per row: an int, or in `speculative_decode` a traced [] int32
    (the config is then built inside the trace and never hashed).
  max_len: the target cache's positions. max_steps: the length of `SpecStats.k_history` (the
  target passes recorded). stop_ids: tokens that end a row.
  """

  lm: Any
  drafter: Drafter
  policy: Policy
  max_new_tokens: Any
  max_len: int
  max_steps: int
  stop_ids: tuple[int, ...] = ()

  @property
  def hidden_layers(self) -> tuple[int, ...]:
    """The target layers a verify pass returns: the drafter's, when it reads the target."""
    return self.drafter.hidden_layers if self.drafter.uses_target_hidden else ()

  @property
  def defers(self) -> bool:
    """Whether the fused loop defers the drafter's commits over plain steps (`Deferred`)."""
    d, p = self.drafter, self.policy
    return bool(d.defer_commit and not d.free_proposals and p.auto and d.tree is None
                and p.k_max > 0)


@_pytree
@dataclasses.dataclass
class StepOutcome:
  """One target pass's result, every token axis padded to k_max + 1 (`outcome`), so the
  branches of a step's `lax.switch` agree in shape and the one cache write follows them."""

  n_acc: jax.Array  # [B] int32 drafts accepted
  emitted: jax.Array  # [B, k_max + 1] int32 the accepted drafts, then the target's token; -1
  hidden: Hidden  # the pass's target features (final [B, k_max + 1, D])
  block: Any  # the pass's new cache entries (padded), or None when the pass wrote them already
  n_valid: jax.Array  # [B] int32 real drafts verified
  k: jax.Array  # [] int32 drafts verified (0: a plain step)
  logp: jax.Array | None  # [B, k_max + 1] float32 each emitted token's log-probability, or None
  top_ids: jax.Array | None = None  # [B, k_max + 1, N] int32 the top-N at each position, or None
  top_lp: jax.Array | None = None  # [B, k_max + 1, N] float32 their log-probabilities, or None


def outcome(cfg: StepConfig, *, n_acc, emitted, hidden: Hidden, block, n_valid, k, logits,
            sp) -> StepOutcome:
  """A `StepOutcome` with its token axes padded to k_max + 1 (emitted with -1, the rest with 0);
  the one place an outcome is built.

  It keeps what the loop keeps of the distributions that emitted the tokens `emitted` [B, W]
  (`logits` [B, W, V], each token's position's): with `policy.logprobs` their log-probabilities
  [B, W], and with `policy.top_logprobs` N the ids and log-probabilities [B, W, N] of the N most
  likely tokens (one log-softmax after XLA's CSE); nothing is computed without them.
  """
  width = cfg.policy.k_max + 1
  logp = top = None
  if cfg.policy.logprobs:
    logp = sampling_lib.token_logprobs(logits, jnp.maximum(emitted, 0), sp)
    if cfg.policy.top_logprobs:
      top = sampling_lib.top_logprobs(logits, sp, cfg.policy.top_logprobs)
  pad = lambda x, axis, value=0: jnp.pad(
      x, [(0, width - x.shape[axis]) if i == axis else (0, 0) for i in range(x.ndim)],
      constant_values=value)
  return StepOutcome(
      n_acc=n_acc, emitted=pad(emitted, 1, -1),
      hidden=Hidden(final=pad(hidden.final, 1),
                    layers=None if hidden.layers is None else pad(hidden.layers, 2)),
      block=None if block is None else protocol.pad_block(cfg.lm, block, width),
      n_valid=n_valid, k=jnp.int32(k), logp=None if logp is None else pad(logp, 1),
      top_ids=None if top is None else pad(top[0], 1),
      top_lp=None if top is None else pad(top[1], 1))


def draft_keys(keys: jax.Array, seq_len: jax.Array) -> jax.Array:
  """The step's per-row draft keys [B], from the row keys and lengths (a drafter on another
  mesh derives the same ones from its copies)."""
  folded = jax.vmap(jax.random.fold_in)(keys, seq_len)
  return jax.vmap(lambda key: jax.random.split(key, 2)[0])(folded)


def step_inputs(s: SpecState, width: int = 1):
  """What every step derives from the state: live rows [B], the draft keys [B], the keys of the
  next `width` token positions [B, width] (`position_keys`: the target's draws) and the last
  accepted token [B]."""
  keys = position_keys(s.keys, s.seq_len - s.prompt_len, width)
  last = jnp.take_along_axis(s.seq, (s.seq_len - 1)[:, None], axis=1)[:, 0]
  return ~s.done, draft_keys(s.keys, s.seq_len), keys, last


def write_tokens(seq, seq_len, emitted, n_emit):
  """Writes emitted[:, :n_emit] at seq_len (per row); entries past n_emit are not written."""
  b, w = emitted.shape[:2]
  pos = seq_len[:, None] + jnp.arange(w)[None, :]
  pos = jnp.where(jnp.arange(w)[None, :] < n_emit[:, None], pos, seq.shape[1])  # dropped
  return seq.at[jnp.arange(b)[:, None], pos].set(emitted, mode="drop")


# ----------------------------------------------------------------------------------------------
# The prefill.


def spec_prefill(tparams, dparams, prompt, prompt_len, sp, key, cfg: StepConfig, buffers=None):
  """The prefill and the first new token, sampled from its logits as plain decoding does (no
  extra target pass: the prefill computed them). Returns the state, whose draft_state is the
  drafter's `init` (after the prompt), and the `DraftContext` of the first token, the plain
  step the prefill amounts to, which the drafter's `commit` takes next. Neither the statistics
  nor the acceptance model count it."""
  b, pw = prompt.shape
  drafter, k = cfg.drafter, cfg.policy.k_max
  want_hidden = drafter.uses_target_hidden
  logits, hidden, cache = protocol.prefill(cfg.lm, tparams, prompt, prompt_len, cfg.max_len,
                                           hidden_layers=cfg.hidden_layers, buffers=buffers)
  keys = sampling_lib.row_keys(key, b)
  seq_cap = cfg.max_len + k + 1  # prompt + outputs, and the k + 1 slots a step may write past
  seq = jnp.zeros((b, seq_cap), jnp.int32).at[:, :pw].set(prompt)
  dstate = drafter.init(dparams, prompt, prompt_len, cfg.max_len,
                        hidden=hidden if want_hidden else None)
  z = lambda *shape: jnp.zeros(shape, jnp.int32)
  stats = SpecStats(target_passes=z(), drafted=z(b), accepted=z(b), emitted=z(b), row_steps=z(b),
                    spec_row_steps=z(b), accepted_at=z(k), reached_at=z(k),
                    k_history=z(cfg.max_steps))
  # The cache holds the whole prompt; the step below keeps x_{P-1} as if a plain step had just
  # written it.
  # None when the sampling has no penalty, bias or min_new_tokens: nothing below reads it then.
  history = (sampling_lib.start_history(sp, prompt, prompt_len, cfg.lm.vocab_size, cfg.stop_ids)
             if sp.adjusts else None)
  s = SpecState(seq=seq, seq_len=prompt_len, prompt_len=prompt_len,
                done=jnp.zeros((b,), bool),
                cache=dataclasses.replace(cache, length=prompt_len - 1), draft_state=dstate,
                keys=keys, counts=adaptive.init_counts(b, k), stats=stats,
                logp=jnp.zeros((b, seq_cap), jnp.float32) if cfg.policy.logprobs else None,
                history=history)
  n_top = cfg.policy.top_logprobs if cfg.policy.logprobs else 0
  if n_top:
    s = dataclasses.replace(s, top_ids=jnp.zeros((b, seq_cap, n_top), jnp.int32),
                            top_lp=jnp.zeros((b, seq_cap, n_top), jnp.float32))
  if history is not None:
    logits = sampling_lib.adjust(logits, sp, history)
  # New token 0 of every row, drawn with its position's key as `generate` draws it.
  first = sampling_lib.sample(position_keys(keys, jnp.zeros_like(prompt_len), 1)[:, 0], logits,
                              sp)
  idx = (prompt_len - 1)[:, None, None]
  final = jnp.take_along_axis(hidden.final, idx, axis=1)  # [B, 1, D]: f_{P-1}
  layers = None
  if hidden.layers is not None:
    layers = jnp.take_along_axis(hidden.layers, idx[None], axis=2)  # [n, B, 1, D]
  zb = jnp.zeros((b,), jnp.int32)
  out = outcome(cfg, n_acc=zb, emitted=first[:, None], hidden=Hidden(final=final, layers=layers),
                block=None, n_valid=zb, k=0, logits=logits[:, None], sp=sp)
  new, ctx = finish_step(s, out, cfg)
  return dataclasses.replace(new, stats=stats, counts=s.counts), ctx


def spec_init(tparams, dparams, prompt, prompt_len, sp, key, budget=None, buffers=None, *,
              cfg: StepConfig):
  """Prefill, the first new token and the drafter's state after it; with `buffers` (donated,
  `take_cache_buffers`) the target's cache is written into them. `budget` ([B] int32, traced),
  when given, is each row's count of new tokens in place of cfg.max_new_tokens (the host
  engine's: cfg, compiled for the output width, is then the same for every budget below it)."""
  if budget is not None:
    cfg = dataclasses.replace(cfg, max_new_tokens=budget)
  s, ctx = spec_prefill(tparams, dparams, prompt, prompt_len, sp, key, cfg, buffers=buffers)
  if cfg.defers:  # the first token is a plain step: kept pending too
    hidden = ctx.hidden if cfg.drafter.uses_target_hidden else None
    return dataclasses.replace(s, draft_state=Deferred(inner=s.draft_state, pending=ctx.n_new,
                                                       hidden=hidden))
  return dataclasses.replace(s, draft_state=cfg.drafter.commit(dparams, s.draft_state, ctx))


# ----------------------------------------------------------------------------------------------
# One step: choose k, draft, verify, accept.


@_pytree
@dataclasses.dataclass
class Choice:
  """A step's choice of k, made before the step: the bucket index, and for a drafter whose
  proposals cost nothing its k_max proposals (which the choice read) and state after them."""

  idx: jax.Array  # [] int32 index into policy.buckets
  prop: Proposal | None
  dstate: Any
  n_valid: jax.Array  # [B] real drafts per row (k_max when not known before drafting)
  # [B] each row's deterministic first draft (-1: none), which a plain step still scores for the
  # acceptance model ("auto" with proposals known before the choice); None otherwise.
  shadow: jax.Array | None


def choose_k(dparams, s: SpecState, sp, costs, force_idx, cfg: StepConfig) -> Choice:
  """Picks the step's bucket: the controller's choice ("auto"), the largest bucket when some
  live row has a real draft (a fixed k), or force_idx when >= 0."""
  drafter, policy = cfg.drafter, cfg.policy
  b = s.seq.shape[0]
  kmax = policy.k_max
  live, draft_key, _, _ = step_inputs(s)
  full = jnp.full((b,), kmax, jnp.int32)
  # A drafter whose proposals cost next to nothing (n-gram lookup) proposes k_max up front, so
  # the choice of k knows which rows have real drafts; a model drafter drafts inside the branch.
  shadow = None
  if drafter.free_proposals:
    ctx = DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len, row_keys=s.keys,
                       history=s.history)
    with jax.named_scope("draft"):
      prop, dstate = drafter.propose(dparams, s.draft_state, ctx, kmax, sp, draft_key)
    nv_all = full if prop.n_valid is None else prop.n_valid
    known = nv_all
    if policy.auto and prop.q is None and kmax > 0:
      shadow = jnp.where(nv_all > 0, prop.tokens[:, 0], -1)
  else:
    prop = dstate = None
    nv_all, known = full, None
  if policy.auto:
    alpha = adaptive.acceptance_estimate(s.counts, policy.prior)
    room = cfg.max_new_tokens - (s.seq_len - s.prompt_len)
    idx, _ = adaptive.choose(alpha, live, costs, policy.buckets, known, room, policy.margin,
                             length=s.seq_len)
  else:
    idx = jnp.where(jnp.any(live & (nv_all > 0)), len(policy.buckets) - 1, 0).astype(jnp.int32)
  idx = jnp.where(force_idx >= 0, force_idx, idx)
  return Choice(idx=idx, prop=prop, dstate=dstate, n_valid=nv_all, shadow=shadow)


def slice_proposal(prop: Proposal, k: int, n_valid_all: jax.Array) -> Proposal:
  """The first k of k_max proposed drafts."""
  return Proposal(tokens=prop.tokens[:, :k], q=None if prop.q is None else prop.q[:, :k],
                  n_valid=jnp.minimum(n_valid_all, k))


def verify_branch(tparams, cache, last, prop: Proposal | None, k: int, sp, keys, live, forced,
                  cfg: StepConfig, known_drafts: bool = False,
                  history: sampling_lib.TokenHistory | None = None) -> StepOutcome:
  """Verifies k drafts (k = 0 or prop None: a plain one-token step) and rejection-samples.

  Reads the target cache only (the new block is in the outcome, written after the caller's
  `lax.switch`). keys: [B, k_max + 1] the position keys of the step's tokens. history: the
  state's `TokenHistory` (None: sp adjusts nothing).
  """
  greedy = sampling_lib.greedy_rows(sp)

  def plain(cache):  # as `generate`'s decode step: sampled from the logits, no [B, V] one-hot
    with jax.named_scope("verify"):
      logits, hidden, block = protocol.forward(cfg.lm, tparams, last[:, None], cache,
                                               hidden_layers=cfg.hidden_layers, write=False)
      if history is not None:
        logits = sampling_lib.adjust(logits, sp, history)
      tok = sampling_lib.sample(keys[:, 0], logits[:, 0], sp)
    z = jnp.zeros((tok.shape[0],), jnp.int32)
    return outcome(cfg, n_acc=z, emitted=tok[:, None], hidden=hidden, block=block, n_valid=z,
                   k=0, logits=logits[:, :1], sp=sp)

  if k == 0 or prop is None:
    return plain(cache)
  prop = in_vocabulary(prop, cfg.lm.vocab_size)
  n_valid = prop.n_valid

  def verify_drafts(cache):
    with jax.named_scope("verify"):
      p, hidden, block, logits = verify(cfg.lm, tparams, cache, last, prop.tokens, sp,
                                        hidden_layers=cfg.hidden_layers, write=False,
                                        return_logits=True, history=history)
    with jax.named_scope("accept"):
      n_acc, emitted = rejection_sample(p, prop.q, prop.tokens, keys[:, :k + 1], n_valid, greedy)
    # Every emitted token i was drawn from the target's logits at position i (a correction
    # from the residual, but its position's distribution is still the target's p_i).
    return outcome(cfg, n_acc=n_acc, emitted=emitted, hidden=hidden, block=block,
                   n_valid=n_valid, k=k, logits=logits, sp=sp)

  if known_drafts:
    # A fixed k chosen after seeing these proposals (`choose_k`): some live row has a real
    # draft, or the step is forced. A conditional would only add a host round trip on GPUs.
    return verify_drafts(cache)
  # No live row has a real draft: a one-token pass costs less than verifying filler.
  return lax.cond(forced | jnp.any(live & (n_valid > 0)), verify_drafts, plain, cache)


def finish_step(s: SpecState, out: StepOutcome, cfg: StepConfig, shadow_draft=None):
  """Commits one verify pass's outcome to the target side of the state.

  Writes the new block to the cache and rolls it back to what was accepted, appends the emitted
  tokens (cut at a stop token and at max_new_tokens), updates the acceptance counts and the
  statistics. Returns the new state (draft_state untouched) and the `DraftContext` the
  drafter's `commit` reads. shadow_draft [B] (or None): each row's deterministic first draft
  (-1: none) when drafts were proposed before the choice; a plain step then still tells the
  acceptance model whether that draft would have been accepted.
  """
  n_acc, emitted, n_valid, k_used = out.n_acc, out.emitted, out.n_valid, out.k
  kmax = cfg.policy.k_max
  live = ~s.done
  left = cfg.max_new_tokens - (s.seq_len - s.prompt_len)  # [B] tokens each row may still emit
  old_len = s.cache.length
  cache = s.cache
  if out.block is not None:  # None: the block is in the cache already
    cache = protocol.write_block(cfg.lm, cache, out.block, old_len)
  n_emit = n_acc + 1
  # A stop token inside the accepted run ends the row there.
  i1 = jnp.arange(kmax + 1)[None, :]
  stops = jnp.isin(emitted, jnp.array(cfg.stop_ids, jnp.int32)) if cfg.stop_ids else False
  stop_hit = stops & (i1 < n_emit[:, None])
  first_stop = jnp.argmax(stop_hit, axis=1)
  has_stop = stop_hit.any(axis=1)
  n_emit = jnp.where(has_stop, first_stop + 1, n_emit)
  n_emit = jnp.where(live, jnp.minimum(n_emit, left), 0)
  seq = write_tokens(s.seq, s.seq_len, emitted, n_emit)
  logp = s.logp if out.logp is None else write_tokens(s.logp, s.seq_len, out.logp, n_emit)
  history = (None if s.history is None else
             sampling_lib.extend_history(s.history, emitted, n_emit))
  top_ids, top_lp = s.top_ids, s.top_lp
  if out.top_ids is not None:
    top_ids = write_tokens(top_ids, s.seq_len, out.top_ids, n_emit)
    top_lp = write_tokens(top_lp, s.seq_len, out.top_lp, n_emit)
  seq_len = s.seq_len + n_emit
  # Roll back: the cache keeps every emitted token but the newest (the next pass's input).
  cache = dataclasses.replace(cache, length=jnp.where(live, old_len + n_emit, old_len))
  done = s.done | (live & has_stop) | (seq_len - s.prompt_len >= cfg.max_new_tokens)
  ctx = DraftContext(seq=seq, seq_len=seq_len, prompt_len=s.prompt_len, hidden=out.hidden,
                     hidden_pos=jnp.maximum(n_emit - 1, 0), n_new=n_emit)
  verified = live & (k_used > 0)
  n_real = jnp.where(verified, jnp.minimum(n_valid, k_used), 0)
  counts = s.counts  # the acceptance model: read by "auto" only (a fixed k leaves it as it is)
  if cfg.policy.auto:
    shadow = hit = None
    if shadow_draft is not None:
      shadow = live & (k_used == 0) & (shadow_draft >= 0)
      hit = emitted[:, 0] == shadow_draft
    counts = adaptive.update_counts(counts, cfg.policy.decay, verified, n_real, n_acc, shadow,
                                    hit)
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
                  draft_state=s.draft_state, keys=s.keys, counts=counts, stats=stats, logp=logp,
                  history=history, top_ids=top_ids, top_lp=top_lp)
  return new, ctx


def commit_step(dparams, cfg: StepConfig, s: SpecState, new: SpecState, dstate, ctx,
                plain_chosen):
  """The new state with the drafter's state updated by the step's outcome."""
  drafter = cfg.drafter
  if cfg.defers:
    return dataclasses.replace(new, draft_state=commit_or_defer(
        drafter, dparams, new, s.draft_state, dstate, ctx, plain_chosen, cfg.policy.k_max + 1))
  return dataclasses.replace(new, draft_state=drafter.commit(dparams, dstate, ctx))


def pending_ctx(s: SpecState, pending: jax.Array, hidden: Hidden | None) -> DraftContext:
  """The context of a deferred commit: the pending tokens as one step that emitted them all."""
  return DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len, hidden=hidden,
                      hidden_pos=jnp.maximum(pending - 1, 0), n_new=pending)


def catch_up_pending(drafter, dparams, s: SpecState, dw: Deferred, width: int):
  """The drafter's state with the pending tokens committed (unchanged when none are)."""
  ctx = pending_ctx(s, dw.pending, dw.hidden)
  return lax.cond(jnp.any(dw.pending > 0),
                  lambda st: drafter.catch_up(dparams, st, ctx, width), lambda st: st, dw.inner)


def commit_or_defer(drafter, dparams, new: SpecState, dw: Deferred, dstate, ctx: DraftContext,
                    plain_chosen, width: int) -> Deferred:
  """After a step of a deferring drafter: a drafting step commits as usual (its pending tokens
  were caught up before it drafted); a plain step (k = 0 chosen) adds its token to the pending
  ones, caught up now only when some row has `width` pending. plain_chosen: [] bool, or True
  for `plain_step`, whose catch-up is the drafter's `catch_up_where` (no `lax.switch` passing
  the drafter's state through an untaken branch every plain step)."""
  pend = dw.pending + ctx.n_new
  hid = dw.hidden
  if hid is not None:  # the step's feature goes to slot `pending` of each row
    sel = jnp.arange(width)[None, :] == dw.pending[:, None]  # [B, W]
    layers = None
    if hid.layers is not None:
      layers = jnp.where(sel[None, :, :, None], ctx.hidden.layers[:, :, :1], hid.layers)
    hid = Hidden(final=jnp.where(sel[:, :, None], ctx.hidden.final[:, :1], hid.final),
                 layers=layers)
  if plain_chosen is True:  # a step of `plain_run`: the drafter's state leaves no conditional
    full = jnp.any(pend >= width)
    inner = drafter.catch_up_where(dparams, dstate, pending_ctx(new, pend, hid), width, full)
    return Deferred(inner=inner, pending=jnp.where(full, 0, pend), hidden=hid)
  which = jnp.where(plain_chosen, jnp.where(jnp.any(pend >= width), 2, 0), 1)
  branches = [lambda st: st,
              lambda st: drafter.commit(dparams, st, ctx),
              lambda st: drafter.catch_up(dparams, st, pending_ctx(new, pend, hid), width)]
  inner = lax.switch(which, branches, dstate)
  return Deferred(inner=inner, pending=jnp.where(which == 0, pend, 0), hidden=hid)


def tree_step(tparams, dparams, s: SpecState, sp, cfg: StepConfig):
  """One tree step: the drafter's tree, one target pass over all its nodes, the tree rule,
  and the accepted path committed as a chain of the same length would be."""
  drafter, depth = cfg.drafter, cfg.policy.k_max
  live, draft_key, keys, last = step_inputs(s, depth + 1)
  ctx = DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len, row_keys=s.keys,
                     history=s.history)
  with jax.named_scope("draft"):
    prop, dstate = drafter.propose_tree(dparams, s.draft_state, ctx, sp, draft_key)
  # A node outside the vocabulary is never accepted, and runs through the target as token 0
  # (an out-of-range id would read a NaN embedding into the pass and the cache).
  in_vocab = (prop.tokens >= 0) & (prop.tokens < cfg.lm.vocab_size)
  tokens = jnp.where(in_vocab, prop.tokens, 0).at[:, 0].set(last)

  def verify_nodes(cache):
    with jax.named_scope("verify"):
      p, hidden, block, logits = tree_lib.verify_tree(
          tparams, cache, tokens, prop.parents, prop.depth, cfg.lm, sp, max_depth=depth,
          hidden_layers=cfg.hidden_layers, return_logits=True, history=s.history)
    with jax.named_scope("accept"):
      n_acc, emitted, path = tree_lib.tree_accept(p, tokens, prop.parents, keys, depth,
                                                  greedy=sampling_lib.greedy_rows(sp),
                                                  valid=in_vocab, depth=prop.depth)
      hidden, block = tree_lib.gather_path(path, hidden, block)
      at_path = None
      if cfg.policy.logprobs:  # emitted token i was drawn from the target's logits at node i
        at_path = jnp.take_along_axis(logits, path[:, :, None], axis=1)
      return outcome(cfg, n_acc=n_acc, emitted=emitted, hidden=hidden, block=block,
                     n_valid=jnp.full((last.shape[0],), depth, jnp.int32), k=depth,
                     logits=at_path, sp=sp)

  def plain(cache):  # the token every position's key draws: the tree's text when it has none
    return verify_branch(tparams, cache, last, None, 0, sp, keys, live, False, cfg,
                         history=s.history)

  # No live row has a candidate node: a one-token pass costs less than verifying N filler
  # nodes, as a chain step falls back (`verify_branch`).
  out = lax.cond(jnp.any(live[:, None] & in_vocab[:, 1:]), verify_nodes, plain, s.cache)
  with jax.named_scope("accept"):
    new, ctx = finish_step(s, out, cfg)
  return dataclasses.replace(new, draft_state=drafter.commit(dparams, dstate, ctx))


def spec_step(tparams, dparams, s: SpecState, sp, costs, force_idx, cfg: StepConfig):
  """One draft -> verify -> accept -> roll back step.

  The draft count is chosen among `policy.buckets`, each a branch of a `lax.switch` compiled
  with its own static width. force_idx >= 0 (a traced int) takes that bucket and verifies even
  filler: the cost model times the real loop that way, with no extra compilation.
  """
  drafter, policy = cfg.drafter, cfg.policy
  if drafter.tree is not None:
    return tree_step(tparams, dparams, s, sp, cfg)
  live, draft_key, keys, last = step_inputs(s, policy.k_max + 1)
  ctx = DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len, row_keys=s.keys,
                     history=s.history)
  choice = choose_k(dparams, s, sp, costs, force_idx, cfg)
  forced = force_idx >= 0
  known_drafts = drafter.free_proposals and not policy.auto
  own_state = s.draft_state.inner if cfg.defers else s.draft_state

  # Branches only read the target cache and return the new block's keys and values padded to
  # k_max + 1; the one write after the switch keeps XLA from passing the whole cache through
  # (and copying it in) every branch.
  def branch(k, cache):
    if k == 0:
      dstate = choice.dstate if drafter.free_proposals else own_state
      return verify_branch(tparams, cache, last, None, 0, sp, keys, live, forced, cfg,
                           history=s.history), dstate
    if drafter.free_proposals:
      prop, dstate = slice_proposal(choice.prop, k, choice.n_valid), choice.dstate
    else:
      current = (catch_up_pending(drafter, dparams, s, s.draft_state, policy.k_max + 1)
                 if cfg.defers else own_state)
      with jax.named_scope("draft"):
        prop, dstate = drafter.propose(dparams, current, ctx, k, sp, draft_key)
    return verify_branch(tparams, cache, last, prop, k, sp, keys, live, forced, cfg,
                         known_drafts, history=s.history), dstate

  out, dstate = lax.switch(choice.idx, [functools.partial(branch, k) for k in policy.buckets],
                           s.cache)
  with jax.named_scope("accept"):
    new, ctx = finish_step(s, out, cfg, shadow_draft=choice.shadow)
    return commit_step(dparams, cfg, s, new, dstate, ctx, choice.idx == 0)


def plain_step(tparams, dparams, s: SpecState, choice: Choice, sp, cfg: StepConfig):
  """A step the controller gave k = 0, as `generate`'s decode step runs it: the forward writes
  its one new cache entry in place. The same tokens, statistics and acceptance updates as the
  switch's plain branch, whose read-only forward and separate write of a k_max + 1 block (with
  the switch around them) cost measurably more (docs/performance.md)."""
  _, _, keys, last = step_inputs(s)
  logits, hidden, written = protocol.forward(cfg.lm, tparams, last[:, None], s.cache,
                                             hidden_layers=cfg.hidden_layers)
  if s.history is not None:
    logits = sampling_lib.adjust(logits, sp, s.history)
  tok = sampling_lib.sample(keys[:, 0], logits[:, 0], sp)
  z = jnp.zeros((tok.shape[0],), jnp.int32)
  out = outcome(cfg, n_acc=z, emitted=tok[:, None], hidden=hidden, block=None, n_valid=z, k=0,
                logits=logits[:, :1], sp=sp)
  # The entry is written; finish_step rolls the length back from the old one.
  s1 = dataclasses.replace(s, cache=dataclasses.replace(written, length=s.cache.length))
  new, ctx = finish_step(s1, out, cfg, shadow_draft=choice.shadow)
  own = s.draft_state.inner if cfg.defers else s.draft_state
  dstate = choice.dstate if cfg.drafter.free_proposals else own
  return commit_step(dparams, cfg, s, new, dstate, ctx, True)


def plain_run(tparams, dparams, s: SpecState, sp, costs, until, force_idx, cfg: StepConfig):
  """Plain steps for as long as the choice stays k = 0: a `lax.while_loop` inside the loop's
  body, so they run at `generate`'s speed (a `lax.cond` around an in-place step would copy the
  cache). Ends with every row done, `until` passes run, or a choice of k > 0, which the
  next `spec_step` makes again from the same state."""
  if cfg.drafter.tree is not None or not (cfg.policy.auto or cfg.drafter.free_proposals):
    return s  # a tree, or a fixed k with drafts made in the branch: k = 0 is never chosen

  def go_on(c):
    st, choice = c
    return (choice.idx == 0) & jnp.any(~st.done) & (st.stats.target_passes < until)

  def body(c):
    st, choice = c
    st = plain_step(tparams, dparams, st, choice, sp, cfg)
    return st, choose_k(dparams, st, sp, costs, force_idx, cfg)

  return lax.while_loop(go_on, body, (s, choose_k(dparams, s, sp, costs, force_idx, cfg)))[0]


def spec_loop(tparams, dparams, s, sp, costs, until, force_idx, budget=None, *,
              cfg: StepConfig):
  """Steps until every row is done or `until` target passes have run: each iteration is one
  `spec_step`, then the plain steps that follow while the choice stays k = 0. `budget` as
  `spec_init`'s."""
  if budget is not None:
    cfg = dataclasses.replace(cfg, max_new_tokens=budget)

  def body(s):
    s = spec_step(tparams, dparams, s, sp, costs, force_idx, cfg)
    return plain_run(tparams, dparams, s, sp, costs, until, force_idx, cfg)

  return lax.while_loop(lambda s: jnp.any(~s.done) & (s.stats.target_passes < until), body, s)


def outputs(s: SpecState, width: int):
  """(new tokens [B, width] (-1 padded), their count [B], their log-probabilities [B, width] (0
  past each row's count; None without `logprobs`), the top-N ids [B, width, N] (-1 past the
  count) and log-probabilities [B, width, N] (0 past it; both None without `top_logprobs`)),
  gathered from the sequence buffers."""
  n_out = s.seq_len - s.prompt_len
  idx = jnp.minimum(s.prompt_len[:, None] + jnp.arange(width)[None, :], s.seq.shape[1] - 1)
  valid = jnp.arange(width)[None, :] < n_out[:, None]
  toks = jnp.where(valid, jnp.take_along_axis(s.seq, idx, axis=1), -1)
  lp = top_ids = top_lp = None
  if s.logp is not None:
    lp = jnp.where(valid, jnp.take_along_axis(s.logp, idx, axis=1), 0.0)
  if s.top_ids is not None:
    top_ids = jnp.where(valid[:, :, None], jnp.take_along_axis(s.top_ids, idx[:, :, None], axis=1),
                        -1)
    top_lp = jnp.where(valid[:, :, None], jnp.take_along_axis(s.top_lp, idx[:, :, None], axis=1),
                       0.0)
  return toks, n_out, lp, top_ids, top_lp


spec_init_jit = jax.jit(spec_init, static_argnames=("cfg",), donate_argnums=(7,))  # buffers
spec_loop_jit = jax.jit(spec_loop, static_argnames=("cfg",), donate_argnums=(2,))
outputs_jit = jax.jit(outputs, static_argnums=(1,))
