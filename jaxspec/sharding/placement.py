"""Placement: the target on one mesh, the drafter on another, and the host between them.

JAX cannot put two platforms in one mesh or one jitted program, so a drafter on other devices
(a sub-mesh, or another backend such as the host CPU beside a GPU target) runs a
host-orchestrated loop. Each step is three jitted programs and two small transfers:

  draft   (drafter mesh)  the drafter proposes k_max-padded drafts (and q) for the chosen k
  -> device_put of the proposal to the target mesh
  verify  (target mesh)   verify + rejection sampling + roll back, the next step's k chosen
  -> device_put of the accepted sequence (and the target's hidden states for a head) back
  commit  (drafter mesh)  the drafter takes the accepted tokens

JAX dispatches asynchronously, so the host enqueues the verify, the transfer back and the
commit without waiting; it waits once a step, for the proposal, which the verify needs anyway
(the chain algorithm is serial: the next draft depends on what this verify accepts). Waiting
there is also what makes failover safe: a drafter that fails (an exception from its
computation, out-of-memory included) fails before the target consumes anything, so the
generation goes on with plain target steps from the intact target state, keeping every token
already emitted, and the statistics record it.

The draft, verify and commit programs reuse the fused loop's pieces (`_verify_branch`,
`_finish_step`), so a host-orchestrated run computes exactly what the fused loop computes:
same tokens under greedy decoding, same keys under sampling.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh

from jaxspec import adaptive
from jaxspec.drafters import DraftContext, Drafter, DraftModel, NoState, Proposal
from jaxspec.generate import _as_key, compiled
from jaxspec.models.model import Model
from jaxspec.speculative import (_Run, _costs_array, _finish_step, _room, _shardings_of,
                                 _slice_proposal, _spec_prefill, _step_inputs, _verify_branch,
                                 draft, step_keys)
from jaxspec.sharding.rules import (DEFAULT_RULES, ModelSharding, ShardingRules, place_drafter,
                                    shard_model, submesh)

from jaxspec.pytree import pytree_dataclass as _pytree  # noqa: E402


def as_mesh(where, what: str) -> Mesh:
  """A Mesh from a Mesh, a device, a list of devices or of indices into jax.devices()."""
  if isinstance(where, Mesh):
    return where
  if isinstance(where, jax.Device):
    where = [where]
  if isinstance(where, (list, tuple)) and where:
    try:
      return submesh(where)
    except ValueError as e:
      raise ValueError(f"the {what} placement: {e}") from None
  raise ValueError(f"the {what} placement must be a jax Mesh, a device or a list of devices"
                   f" (or indices into jax.devices()), got {where!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
  """Where the target and the drafter run.

  Args:
    target: a Mesh (or devices) for the target; its weights are laid out by `rules`.
    drafter: a Mesh (or devices) for the drafter. The same mesh as the target: the fused
      single-jit loop. Other devices (a sub-mesh, another backend): the host-orchestrated loop.
    rules: logical-axis sharding rules for both meshes.
    drafter_precision: "int8" / "bfloat16" / None (as loaded): the precision the drafter's
      model is converted to on its mesh (a draft model only).
    target_precision: the same for the target (weight-only int8 or bf16 on a device that
      prefers them).
  """

  target: Any
  drafter: Any = None
  rules: ShardingRules = DEFAULT_RULES
  drafter_precision: str | None = None
  target_precision: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "target", as_mesh(self.target, "target"))
    object.__setattr__(self, "drafter", self.target if self.drafter is None
                       else as_mesh(self.drafter, "drafter"))
    for field in ("drafter_precision", "target_precision"):
      if getattr(self, field) not in (None, "int8", "bfloat16", "float32"):
        raise ValueError(f"{field} must be None, 'int8', 'bfloat16' or 'float32', got"
                         f" {getattr(self, field)!r}")

  @property
  def fused(self) -> bool:
    """Both on the same mesh: the single-jit loop runs."""
    return self.target == self.drafter

  def describe(self) -> dict[str, Any]:
    devs = lambda m: [str(d) for d in m.devices.flat]
    return dict(mode="fused" if self.fused else "host", target=devs(self.target),
                drafter=devs(self.drafter),
                target_mesh=dict(self.target.shape), drafter_mesh=dict(self.drafter.shape))


def place_target(target: Model, placement: Placement) -> Model:
  """The target laid out on the placement's target mesh (unchanged when it already is)."""
  if placement.target_precision is not None:
    from jaxspec.models import quant
    if not (placement.target_precision == "int8" and quant.is_quantized(target.params)):
      target = quant.quantize(target, placement.target_precision)
  sh = target.sharding
  if sh is not None and sh.mesh == placement.target and sh.rules == placement.rules:
    return target
  return shard_model(target, placement.target, placement.rules)


def drafter_in_precision(drafter: Drafter, precision: str | None) -> Drafter:
  """A draft model converted to `precision` ("int8", "bfloat16"); other drafters unchanged."""
  if precision is None:
    return drafter
  if not isinstance(drafter, DraftModel):
    raise ValueError(f"drafter_precision={precision!r} converts a draft model's weights, but"
                     f" the drafter is {drafter.name!r}: drop drafter_precision")
  from jaxspec.models import quant
  return dataclasses.replace(drafter, model=quant.quantize(drafter.model, precision))


# ----------------------------------------------------------------------------------------------
# The host-orchestrated loop.


@_pytree
@dataclasses.dataclass
class HostState:
  """Both halves of a host-orchestrated generation."""

  t: Any  # SpecState on the target mesh (its draft_state unused: NoState)
  d: Any  # the drafter's state on the drafter mesh
  ctx: DraftContext  # the drafter's copy of the sequence and target features (drafter mesh)
  keys: jax.Array  # [B] the drafter's copy of the per-row keys (drafter mesh)
  idx: jax.Array  # [] the next step's bucket index, chosen on the target mesh

  @property
  def stats(self):
    return self.t.stats


def _host_draft(dparams, dstate, ctx: DraftContext, keys, sp, *, drafter, k, kmax):
  """Drafter mesh: propose k drafts (k static: one program per draft count, so the drafter's
  cache is updated in place rather than carried through a switch), padded to k_max."""
  b = ctx.seq.shape[0]
  kd, _ = step_keys(keys, ctx.seq_len)
  ctx = dataclasses.replace(ctx, row_keys=keys)  # the drafter's copy of the rows' keys
  prop, new = draft(drafter, dparams, dstate, ctx, k, sp, kd)
  n_valid = jnp.full((b,), k, jnp.int32) if prop.n_valid is None else prop.n_valid
  pad = lambda x: jnp.pad(x, [(0, 0), (0, kmax - k)] + [(0, 0)] * (x.ndim - 2))
  return Proposal(tokens=pad(prop.tokens), q=None if prop.q is None else pad(prop.q),
                  n_valid=n_valid), new


def _host_verify(tparams, s, prop: Proposal, idx, sp, costs, force_idx, *, cfg, drafter, policy,
                 max_new_tokens, stop_ids):
  """Target mesh: verify the proposal for bucket `idx`, accept, roll back, choose the next k.

  Returns (new target state, the context the drafter commits, the next bucket index)."""
  kmax = policy.k_max
  live, _, kv, last = _step_inputs(s, kmax + 1)
  forced = force_idx >= 0
  vb = functools.partial(_verify_branch, cfg=cfg, drafter=drafter, kmax=kmax)
  nv_all = prop.n_valid

  def branch(k):
    def run(cache):
      if k == 0:
        return vb(tparams, cache, last, None, 0, sp, kv, live, forced)
      return vb(tparams, cache, last, _slice_proposal(prop, k, nv_all), k, sp, kv, live, forced)
    return run

  def step(s):
    out = lax.switch(idx, [branch(k) for k in policy.buckets], s.cache)
    return _finish_step(s, out, policy=policy, max_new_tokens=max_new_tokens,
                        stop_ids=stop_ids)

  def idle(s):  # every row is done: nothing runs, nothing is counted
    b = s.seq.shape[0]
    hidden = jax.eval_shape(lambda c: branch(0)(c)[2], s.cache)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), hidden)
    z = jnp.zeros((b,), jnp.int32)
    return s, DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len, hidden=zeros,
                           hidden_pos=z, n_new=z)

  new, ctx = lax.cond(jnp.any(live), step, idle, s)
  nxt = _choose(new, costs, policy=policy, max_new_tokens=max_new_tokens)
  return new, ctx, nxt


def _choose(s, costs, *, policy, max_new_tokens):
  """The next step's bucket index: the controller's choice ("auto", without knowing which rows
  have real drafts before drafting), or the largest bucket for a fixed k."""
  if not policy.auto:
    return jnp.int32(len(policy.buckets) - 1)
  alpha = adaptive.acceptance_estimate(s.counts, policy.prior)
  idx, _ = adaptive.choose(alpha, ~s.done, costs, policy.buckets, None,
                           _room(s, max_new_tokens), policy.margin)
  return idx.astype(jnp.int32)


def _host_commit(dparams, dstate, ctx, *, drafter):
  """Drafter mesh: the drafter takes the accepted tokens (and the target's features)."""
  return drafter.commit(dparams, dstate, ctx)


@dataclasses.dataclass
class Failover:
  step: int
  error: str
  action: str = "plain target decoding"


def _short_error(e: BaseException) -> str:
  """The exception's type, first line and (for a runtime error wrapping a traceback) its cause,
  the last line."""
  lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
  if not lines:
    return type(e).__name__
  text = lines[0][:200]
  if len(lines) > 1:
    text += " ... " + lines[-1][:200]
  return f"{type(e).__name__}: {text}"


def _forget_failed_runs(devices) -> None:
  """JAX keeps the runtime token of the last computation with host callbacks on each device and
  waits on it at interpreter exit; the drafter's failed one would print its (already handled)
  error again there. The drafter's devices run nothing more after a failover, so their tokens are
  dropped. A private JAX structure: where it is missing nothing is dropped (only the message)."""
  try:
    from jax._src import dispatch
    tokens = dispatch.runtime_tokens.output_runtime_tokens
  except (ImportError, AttributeError):
    return
  for d in devices:
    tokens.pop(d, None)


class HostRun(_Run):
  """The compiled programs of a host-orchestrated generation and its loop: `speculative._Run`'s
  start / loop / stats interface (its cost measurement and statistics are inherited), with
  programs on two meshes instead of one fused loop."""

  def __init__(self, target: Model, drafter: Drafter, placement: Placement, prep, sp_user,
               policy, stops, max_new_tokens: int, key, cost):
    self.target, self.drafter, self.prep, self.policy = target, drafter, prep, policy
    self.placement = placement
    b = prep.tokens.shape[0]
    self.tsh = target.sharding
    self.dsh = ModelSharding(placement.drafter, placement.rules)
    self.tsh.check_batch(b)
    self.dsh.check_batch(b)
    self.max_steps = max_new_tokens + 1
    self.cost = cost
    self.profile_seconds = 0.0
    self.failover: Failover | None = None
    self.tparams = target.params
    self.dparams = place_drafter(drafter, self.dsh)
    self.sp_t = jax.device_put(sp_user.arrays(b), self.tsh.state(sp_user.arrays(b), b))
    self.sp_d = jax.device_put(sp_user.arrays(b), self.dsh.state(sp_user.arrays(b), b))
    self.cost_key = ("host", target.cfg, drafter, b, prep.tokens.shape[1], prep.max_len,
                     policy.buckets, repr(sp_user), self.tsh, self.dsh)
    static = dict(cfg=target.cfg, drafter=drafter, policy=policy, max_new_tokens=max_new_tokens,
                  stop_ids=stops)
    init_static = dict(max_len=prep.max_len, seq_cap=prep.max_len + policy.k_max + 1,
                       max_steps=self.max_steps, **static)
    tok, lens = jnp.asarray(prep.tokens), jnp.asarray(prep.lengths)
    t0 = time.perf_counter()
    # Target side: the fused loop's prefill, with a stand-in drafter that keeps the prefill's
    # hidden states (when the real drafter reads them) as its state, for the drafter's init.
    self.tinit_args = (self.tparams, None, tok, lens, self.sp_t, _as_key(key))
    tstatic = dict(init_static, drafter=_HiddenOnly(drafter.uses_target_hidden,
                                                    drafter.hidden_layers))
    tstate0, hid0, fctx0 = jax.eval_shape(functools.partial(_target_init, **tstatic),
                                          *self.tinit_args)
    t_sh = self.tsh.state(tstate0, b)
    rep_t = self.tsh.replicated()
    self.tinit_exe, _ = compiled(
        _target_init, ("host-tinit", self.tsh), *self.tinit_args,
        jit_kwargs=dict(in_shardings=(_shardings_of(self.tparams), None, self.tsh.batch(2),
                                      self.tsh.batch(1), self.tsh.state(self.sp_t, b), rep_t),
                        out_shardings=(t_sh, self.tsh.state(hid0, b),
                                       self.tsh.state(fctx0, b))),
        **tstatic)
    # Drafter side: its init from the prompt (and the target's prefill features).
    self.dinit_exe, _ = compiled(
        _drafter_init, ("host-dinit", self.dsh), self.dparams, tok, lens, hid0,
        jit_kwargs=dict(in_shardings=(_shardings_of(self.dparams), self.dsh.batch(2),
                                      self.dsh.batch(1), self.dsh.state(hid0, b))),
        drafter=drafter, max_len=prep.max_len)
    self._tok, self._lens = tok, lens
    dstate0 = _shapes(self.dinit_exe.out_info)
    self.costs = _costs_array(policy, cost)
    kmax = policy.k_max
    # The drafter's copy of the context, as the verify program returns it.
    ctx0 = DraftContext(seq=tstate0.seq, seq_len=tstate0.seq_len, prompt_len=tstate0.prompt_len)
    d_sh = self.dsh
    ctx_sh = d_sh.state(ctx0, b)
    self.draft_exes = {}
    for k in policy.buckets:
      if k == 0:
        continue
      draft_args = (self.dparams, dstate0, ctx0, tstate0.keys, self.sp_d)
      self.draft_exes[k], _ = compiled(
          _host_draft, ("host-draft", d_sh), *draft_args,
          jit_kwargs=dict(in_shardings=(_shardings_of(self.dparams), d_sh.state(dstate0, b),
                                        ctx_sh, d_sh.batch(1), d_sh.state(self.sp_d, b)),
                          # The drafter's cache is written in place (after a failure it is
                          # not needed again).
                          donate_argnums=(1,)),
          drafter=drafter, k=k, kmax=kmax)
    prop0 = _shapes(self.draft_exes[kmax].out_info[0])
    self.prop_sh_t = self.tsh.state(prop0, b)
    verify_args = (self.tparams, tstate0, prop0, jnp.int32(0), self.sp_t, self.costs,
                   jnp.int32(-1))
    self.verify_exe, _ = compiled(
        _host_verify, ("host-verify", self.tsh), *verify_args,
        jit_kwargs=dict(in_shardings=(_shardings_of(self.tparams), t_sh, self.prop_sh_t, rep_t,
                                      self.tsh.state(self.sp_t, b), rep_t, rep_t),
                        out_shardings=(t_sh, None, rep_t), donate_argnums=(1,)),
        **static)
    ctx_full = _shapes(self.verify_exe.out_info[1])
    self.ctx_sh_d = d_sh.state(ctx_full, b)
    self.commit_exe, _ = compiled(
        _host_commit, ("host-commit", d_sh), self.dparams, dstate0, ctx_full,
        jit_kwargs=dict(in_shardings=(_shardings_of(self.dparams), d_sh.state(dstate0, b),
                                      self.ctx_sh_d), donate_argnums=(1,)),
        drafter=drafter)
    self.prop_zero = jax.device_put(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), prop0),
                                    self.prop_sh_t)
    self.d_batch1 = d_sh.batch(1)
    self.compile_seconds = time.perf_counter() - t0

  # -- running

  def start(self) -> HostState:
    tstate, hidden, first = self.tinit_exe(*self.tinit_args)
    b = self.prep.tokens.shape[0]
    ctx = DraftContext(seq=tstate.seq, seq_len=tstate.seq_len, prompt_len=tstate.prompt_len)
    try:  # the drafter's half: a failure here falls back to plain steps too
      hid_d = jax.device_put(hidden, self.dsh.state(hidden, b))
      dstate = self.dinit_exe(self.dparams, self._tok, self._lens, hid_d)
      dstate = jax.block_until_ready(
          self.commit_exe(self.dparams, dstate, jax.device_put(first, self.ctx_sh_d)))
      ctx = jax.device_put(ctx, self.dsh.state(ctx, b))
    except Exception as e:  # noqa: BLE001 - any failure of the drafter's computation
      self._fail_over(0, e)
      dstate = None
    # idx is chosen below, once the costs are known (timing forces every bucket itself).
    state = HostState(t=tstate, d=dstate, ctx=ctx, keys=jax.device_put(tstate.keys, self.d_batch1),
                      idx=jnp.int32(0))
    self._ensure_costs(state, self._loop_for_costs, self.sp_t)
    return dataclasses.replace(state, idx=_choose_jit(
        state.t, self.costs, policy=self.policy, max_new_tokens=int(self.max_steps - 1)))

  def target_state(self, state: HostState):
    return state.t

  def _loop_for_costs(self, tparams, dparams, state, sp, costs, until, force_idx):
    # A drafter that fails while the cost model is timed fails over as in the loop: the
    # generation then runs plain steps, and the timings (of plain steps) go unused.
    return self._run(state, int(until), int(force_idx), costs)

  def _fail_over(self, step: int, e: BaseException) -> None:
    """Records the drafter's failure; from now on every step is a plain target step."""
    if self.failover is None:
      self.failover = Failover(step=step, error=_short_error(e))
      _forget_failed_runs(set(self.dsh.mesh.devices.flat) - set(self.tsh.mesh.devices.flat))

  def loop(self, state: HostState, until) -> HostState:
    return self._run(state, int(until), -1, self.costs)

  def _run(self, state: HostState, until: int, force_idx: int, costs):
    force = jnp.int32(force_idx)
    n = int(state.t.stats.target_passes)
    while n < until and not bool(np.asarray(state.t.done).all()):
      if self.failover is not None:
        state = self._plain_step(state, costs)
      else:
        # The bucket is read on the host (the verify that chose it has finished: the drafter's
        # state depends on it), so each draft count runs its own program.
        i = int(state.idx) if force_idx < 0 else force_idx
        k = self.policy.buckets[i]
        idx_t = jnp.int32(i)
        try:
          # The one wait of a step: the verify needs the proposal anyway, and a drafter that
          # failed fails here, before the target has consumed anything.
          if k == 0:
            prop, dstate = self.prop_zero, state.d
          else:
            prop, dstate = jax.block_until_ready(self.draft_exes[k](
                self.dparams, state.d, state.ctx, state.keys, self.sp_d))
        except Exception as e:  # noqa: BLE001 - any failure of the drafter's computation
          self._fail_over(n, e)
          state = self._plain_step(state, costs)
          n += 1
          continue
        prop_t = jax.device_put(prop, self.prop_sh_t)
        tstate, ctx, nxt = self.verify_exe(self.tparams, state.t, prop_t, idx_t, self.sp_t, costs,
                                           force)
        try:  # the commit's dispatch can fail too: the verified tokens are kept either way
          ctx_d = jax.device_put(ctx, self.ctx_sh_d)
          dstate = self.commit_exe(self.dparams, dstate, ctx_d)
        except Exception as e:  # noqa: BLE001 - any failure of the drafter's computation
          self._fail_over(n + 1, e)
          state = dataclasses.replace(state, t=tstate)
          n += 1
          continue
        state = HostState(t=tstate, d=dstate,
                          ctx=DraftContext(seq=ctx_d.seq, seq_len=ctx_d.seq_len,
                                           prompt_len=ctx_d.prompt_len),
                          keys=state.keys, idx=nxt)
      n += 1
    return state

  def _plain_step(self, state: HostState, costs) -> HostState:
    """After a failover: a plain target step, the drafter's half of the state left behind."""
    tstate, _, _ = self.verify_exe(self.tparams, state.t, self.prop_zero, jnp.int32(0), self.sp_t,
                                   costs, jnp.int32(0))
    return dataclasses.replace(state, t=tstate)


def _shapes(tree):
  """Shape/dtype structs (without shardings) of a compiled program's outputs."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


_choose_jit = jax.jit(_choose, static_argnames=("policy", "max_new_tokens"))


@dataclasses.dataclass(frozen=True)
class _HiddenOnly(Drafter):
  """Stand-in drafter of the target-side prefill: its state is the prefill's hidden states
  (None when the real drafter does not read them), handed to the real drafter's init."""

  uses_target_hidden: bool = False
  hidden_layers: tuple[int, ...] = ()
  name: str = "host"

  def init(self, params, prompt, prompt_len, max_len, hidden=None):
    return hidden

  def commit(self, params, state, ctx):
    return state


def _target_init(tparams, dparams, prompt, prompt_len, sp, key, **static):
  """The fused loop's prefill and first token on the target mesh; returns the state (without
  the stand-in's state), the prefill's hidden states for the drafter's init, from the one
  prefill, and the first token's context, which the drafter commits after its init."""
  s, ctx = _spec_prefill(tparams, dparams, prompt, prompt_len, sp, key, **static)
  return dataclasses.replace(s, draft_state=NoState()), s.draft_state, ctx


def _drafter_init(dparams, prompt, prompt_len, hidden, *, drafter, max_len):
  return drafter.init(dparams, prompt, prompt_len, max_len, hidden=hidden)
