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
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec import adaptive
from jaxspec.drafters import DraftContext, Drafter, Proposal
from jaxspec.models.model import Model
from jaxspec.sharding.rules import (DEFAULT_RULES, ModelSharding, ShardingRules, make_mesh,
                                    shard_model, shard_params)

from jaxspec.models.llama import pytree_dataclass as _pytree  # noqa: E402


def as_mesh(where, what: str) -> Mesh:
  """A Mesh from a Mesh, a device, a list of devices or of indices into jax.devices()."""
  if isinstance(where, Mesh):
    return where
  if isinstance(where, jax.Device):
    where = [where]
  if isinstance(where, (list, tuple)) and where:
    devs = list(where)
    if all(isinstance(d, (int, np.integer)) for d in devs):
      avail = jax.devices()
      bad = [i for i in devs if not 0 <= i < len(avail)]
      if bad:
        raise ValueError(f"the {what} placement names device index {bad[0]}, but this process"
                         f" has {len(avail)} devices (0..{len(avail) - 1})")
      devs = [avail[i] for i in devs]
    return make_mesh({"data": 1, "model": len(devs)}, devices=devs)
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


def place_drafter(drafter: Drafter, target_params, sharding: ModelSharding):
  """The drafter's weights on `sharding.mesh`: a draft model sharded by the rules where the
  mesh divides it (replicated otherwise), arrays shared with the target (a head's frozen
  embedding and LM head) kept in the target's layout when on the same mesh, the rest
  replicated."""
  dparams = drafter.params
  if dparams is None:
    return None
  mesh = sharding.mesh
  on_mesh = lambda x: (isinstance(getattr(x, "sharding", None), NamedSharding)
                       and x.sharding.mesh == mesh)
  rep = NamedSharding(mesh, P())
  draft_model = getattr(drafter, "model", None)
  if isinstance(draft_model, Model):
    if all(on_mesh(x) for x in jax.tree.leaves(dparams)):
      return dparams
    try:
      return shard_params(dparams, draft_model.cfg, mesh, sharding.rules)
    except ValueError:  # the mesh does not divide the draft model: replicate it
      return jax.device_put(dparams, rep)
  shared = {id(x) for x in jax.tree.leaves(target_params)}
  return jax.tree.map(lambda x: x if on_mesh(x) or id(x) in shared and on_mesh(x)
                      else jax.device_put(x, rep), dparams)


def drafter_in_precision(drafter: Drafter, precision: str | None) -> Drafter:
  """A draft model converted to `precision` ("int8", "bfloat16"); other drafters unchanged."""
  if precision is None:
    return drafter
  from jaxspec.drafters import DraftModel
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
  done: jax.Array  # [B] the drafter's copy of the finished rows (drafter mesh)
  keys: jax.Array  # [B] the drafter's copy of the per-row keys (drafter mesh)
  idx: jax.Array  # [] the next step's bucket index, chosen on the target mesh

  @property
  def stats(self):
    return self.t.stats


def _host_draft(dparams, dstate, ctx: DraftContext, keys, sp, *, drafter, k, kmax):
  """Drafter mesh: propose k drafts (k static: one program per draft count, so the drafter's
  cache is updated in place rather than carried through a switch), padded to k_max."""
  from jaxspec.speculative import draft
  b = ctx.seq.shape[0]
  step_keys = jax.vmap(jax.random.fold_in)(keys, ctx.seq_len)
  kd = jax.vmap(lambda kk: jax.random.split(kk, 2), out_axes=1)(step_keys)[0]
  prop, new = draft(drafter, dparams, dstate, ctx, k, sp, kd)
  n_valid = jnp.full((b,), k, jnp.int32) if prop.n_valid is None else prop.n_valid
  pad = lambda x: jnp.pad(x, [(0, 0), (0, kmax - k)] + [(0, 0)] * (x.ndim - 2))
  return Proposal(tokens=pad(prop.tokens), q=None if prop.q is None else pad(prop.q),
                  n_valid=n_valid), new


def _proposes_q(drafter, dparams, dstate, ctx, sp, kd, kmax) -> int:
  """The vocabulary size of the drafter's q, 0 for a deterministic drafter (from shapes)."""
  from jaxspec.speculative import draft
  out = jax.eval_shape(lambda: draft(drafter, dparams, dstate, ctx, 1, sp, kd)[0])
  return 0 if out.q is None else out.q.shape[-1]


def _host_verify(tparams, s, prop: Proposal, idx, sp, costs, force_idx, *, cfg, drafter, policy,
                 max_new_tokens, stop_ids):
  """Target mesh: verify the proposal for bucket `idx`, accept, roll back, choose the next k.

  Returns (new target state, the context the drafter commits, the next bucket index)."""
  from jaxspec.speculative import _finish_step, _room, _slice_proposal, _step_inputs, \
      _verify_branch
  kmax = policy.k_max
  live, _, kv, last = _step_inputs(s)
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
  from jaxspec.speculative import _room
  if not policy.auto:
    return jnp.int32(len(policy.buckets) - 1)
  alpha = adaptive.acceptance_estimate(s.counts, policy.prior)
  idx, _ = adaptive.choose(alpha, ~s.done, costs, policy.buckets, None,
                           _room(s, max_new_tokens))
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


class HostRun:
  """The compiled programs of a host-orchestrated generation and its loop (the counterpart of
  `speculative._Run`, with the same start / loop / stats interface)."""

  def __init__(self, target: Model, drafter: Drafter, placement: Placement, prep, sp_user,
               policy, stops, max_new_tokens: int, key, cost):
    from jaxspec.generate import _as_key, compiled
    from jaxspec.speculative import _costs_array, _spec_init, _shardings_of
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
    self.dparams = place_drafter(drafter, target.params, self.dsh)
    self.sp_t = jax.device_put(sp_user.arrays(b), self.tsh.state(sp_user.arrays(b), b))
    self.sp_d = jax.device_put(sp_user.arrays(b), self.dsh.state(sp_user.arrays(b), b))
    self.cost_key = ("host", target.cfg, drafter, b, prep.tokens.shape[1], prep.max_len,
                     policy.buckets, repr(sp_user), self.tsh, self.dsh)
    static = dict(cfg=target.cfg, drafter=drafter, policy=policy, max_new_tokens=max_new_tokens,
                  stop_ids=stops)
    init_static = dict(max_len=prep.max_len, seq_cap=prep.max_len + policy.k_max + 1,
                       max_steps=self.max_steps, **static)
    tok, lens = jnp.asarray(prep.tokens), jnp.asarray(prep.lengths)
    key = _as_key(key)
    t0 = time.perf_counter()
    # Target side: the fused prefill with a stateless stand-in drafter that only collects the
    # hidden states the real drafter's init needs.
    self.tinit_args = (self.tparams, None, tok, lens, self.sp_t, key)
    stand_in = _HiddenOnly(drafter.uses_target_hidden, drafter.hidden_layers)
    tstatic = dict(init_static, drafter=stand_in)
    tstate0 = jax.eval_shape(functools.partial(_spec_init, **tstatic), *self.tinit_args)
    t_sh = self.tsh.state(tstate0, b)
    hid_shape = jax.eval_shape(functools.partial(_target_init, **tstatic), *self.tinit_args)[1]
    rep_t = self.tsh.replicated()
    self.tinit_exe, _ = compiled(
        _target_init, ("host-tinit", self.tsh), *self.tinit_args,
        jit_kwargs=dict(in_shardings=(_shardings_of(self.tparams), None, self.tsh.batch(2),
                                      self.tsh.batch(1), self.tsh.state(self.sp_t, b), rep_t),
                        out_shardings=(t_sh, self.tsh.state(hid_shape, b))),
        **tstatic)
    # Drafter side: its init from the prompt (and the target's prefill features).
    hid0 = _shapes(self.tinit_exe.out_info[1])
    self.dinit_exe, _ = compiled(
        _drafter_init, ("host-dinit", self.dsh), self.dparams, tok, lens, hid0,
        jit_kwargs=dict(in_shardings=(_shardings_of(self.dparams), self.dsh.batch(2),
                                      self.dsh.batch(1), self.dsh.state(hid0, b))),
        drafter=drafter, max_len=prep.max_len)
    self.key = key
    self._tok, self._lens = tok, lens
    tstate0 = _shapes(self.tinit_exe.out_info[0])
    dstate0 = _shapes(self.dinit_exe.out_info)
    self.costs = _costs_array(policy, cost)
    kmax = policy.k_max
    # The drafter's copy of the context, as the verify program returns it.
    prop0 = None
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
    self.draft_exe = self.draft_exes[policy.k_max]
    prop0 = _shapes(self.draft_exe.out_info[0])
    self.prop_sh_t = self.tsh.state(prop0, b)
    verify_args = (self.tparams, tstate0, prop0, jnp.int32(0), self.sp_t, self.costs,
                   jnp.int32(-1))
    self.verify_exe, c4 = compiled(
        _host_verify, ("host-verify", self.tsh), *verify_args,
        jit_kwargs=dict(in_shardings=(_shardings_of(self.tparams), t_sh, self.prop_sh_t, rep_t,
                                      self.tsh.state(self.sp_t, b), rep_t, rep_t),
                        out_shardings=(t_sh, None, rep_t), donate_argnums=(1,)),
        **static)
    ctx_full = _shapes(self.verify_exe.out_info[1])
    self.ctx_sh_d = d_sh.state(ctx_full, b)
    self.commit_exe, c5 = compiled(
        _host_commit, ("host-commit", d_sh), self.dparams, dstate0, ctx_full,
        jit_kwargs=dict(in_shardings=(_shardings_of(self.dparams), d_sh.state(dstate0, b),
                                      self.ctx_sh_d), donate_argnums=(1,)),
        drafter=drafter)
    self.prop_zero = jax.device_put(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), prop0),
                                    self.prop_sh_t)
    self.d_batch1 = d_sh.batch(1)
    self.d_rep = d_sh.replicated()
    self.t_rep = rep_t
    self.compile_seconds = time.perf_counter() - t0

  # -- running

  def start(self) -> HostState:
    from jaxspec.speculative import measure_costs
    tstate, hidden = self.tinit_exe(*self.tinit_args)
    hid_d = jax.device_put(hidden, self.dsh.state(hidden, self.prep.tokens.shape[0]))
    dstate = self.dinit_exe(self.dparams, self._tok, self._lens, hid_d)
    ctx = DraftContext(seq=tstate.seq, seq_len=tstate.seq_len, prompt_len=tstate.prompt_len)
    ctx = jax.device_put(ctx, self.dsh.state(ctx, self.prep.tokens.shape[0]))
    idx = _choose_jit(tstate, self.costs, policy=self.policy,
                      max_new_tokens=int(self.max_steps - 1))
    state = HostState(t=tstate, d=dstate, ctx=ctx,
                      done=jax.device_put(tstate.done, self.d_batch1),
                      keys=jax.device_put(tstate.keys, self.d_batch1), idx=idx)
    if self.policy.auto and self.cost is None:
      from jaxspec.speculative import _COSTS, _costs_array
      self.cost = _COSTS.get(self.cost_key)
      if self.cost is None:
        state = jax.block_until_ready(state)
        t0 = time.perf_counter()
        self.cost = measure_costs(self._loop_for_costs, self.tparams, self.dparams, state,
                                  self.sp_t, self.policy, batch_size=self.prep.tokens.shape[0])
        _COSTS[self.cost_key] = self.cost
        self.profile_seconds = time.perf_counter() - t0
      self.costs = _costs_array(self.policy, self.cost)
      state = dataclasses.replace(state, idx=_choose_jit(
          state.t, self.costs, policy=self.policy, max_new_tokens=int(self.max_steps - 1)))
    return state

  def target_state(self, state: HostState):
    return state.t

  def _loop_for_costs(self, tparams, dparams, state, sp, costs, until, force_idx):
    return self._run(state, int(until), int(force_idx), costs, may_fail_over=False)

  def loop(self, state: HostState, until) -> HostState:
    return self._run(state, int(until), -1, self.costs, may_fail_over=True)

  def _run(self, state: HostState, until: int, force_idx: int, costs, *, may_fail_over: bool):
    force = jnp.int32(force_idx)
    n = int(state.t.stats.target_passes)
    while n < until and not bool(np.asarray(state.t.done).all()):
      if self.failover is not None and may_fail_over:
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
          if not may_fail_over:
            raise
          self.failover = Failover(step=n, error=_short_error(e))
          state = self._plain_step(state, costs)
          n += 1
          continue
        prop_t = jax.device_put(prop, self.prop_sh_t)
        tstate, ctx, nxt = self.verify_exe(self.tparams, state.t, prop_t, idx_t, self.sp_t, costs,
                                           force)
        ctx_d = jax.device_put(ctx, self.ctx_sh_d)
        dstate = self.commit_exe(self.dparams, dstate, ctx_d)
        state = HostState(t=tstate, d=dstate,
                          ctx=DraftContext(seq=ctx_d.seq, seq_len=ctx_d.seq_len,
                                           prompt_len=ctx_d.prompt_len),
                          done=jax.device_put(tstate.done, self.d_batch1), keys=state.keys,
                          idx=nxt)
      n += 1
    return state

  def _plain_step(self, state: HostState, costs) -> HostState:
    """After a failover: a plain target step, the drafter's half of the state left behind."""
    tstate, _, _ = self.verify_exe(self.tparams, state.t, self.prop_zero, jnp.int32(0), self.sp_t,
                                   costs, jnp.int32(0))
    return dataclasses.replace(state, t=tstate)

  def stats(self, st) -> dict[str, Any]:
    from jaxspec.speculative import summarize_stats
    out = summarize_stats(st, self.policy.k_max)
    out.update(compile_seconds=self.compile_seconds, profile_seconds=self.profile_seconds,
               batch_size=self.prep.tokens.shape[0],
               num_draft_tokens="auto" if self.policy.auto else self.policy.k_max,
               k_max=self.policy.k_max, drafter=self.drafter.name,
               placement=self.placement.describe(),
               failover=None if self.failover is None else dataclasses.asdict(self.failover))
    if self.policy.auto:
      out["cost_model"] = dict(zip(map(str, self.cost.ks), self.cost.seconds))
    return out


def _shapes(tree):
  """Shape/dtype structs (without shardings) of a compiled program's outputs."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


_choose_jit = jax.jit(_choose, static_argnames=("policy", "max_new_tokens"))


@dataclasses.dataclass(frozen=True)
class _HiddenOnly(Drafter):
  """Stand-in drafter of the target-side prefill: no state, only the hidden-state request."""

  uses_target_hidden: bool = False
  hidden_layers: tuple[int, ...] = ()
  name: str = "host"

  def init(self, params, prompt, prompt_len, max_len, hidden=None):
    from jaxspec.drafters import NoState
    return NoState()

  def commit(self, params, state, ctx):
    return state


def _target_init(tparams, dparams, prompt, prompt_len, sp, key, **static):
  """The fused loop's prefill on the target mesh; also returns the prefill's hidden states
  (None unless the drafter reads them) for the drafter's init."""
  from jaxspec.generate import prefill
  from jaxspec.speculative import _spec_init
  stand_in = static["drafter"]
  s = _spec_init(tparams, dparams, prompt, prompt_len, sp, key, **static)
  hidden = None
  if stand_in.uses_target_hidden:
    # Recomputing the prefill's features would double the prompt's cost: _spec_init keeps them
    # in the stand-in's (empty) state, so run the prefill once here instead.
    _, hidden, _ = prefill(tparams, prompt, prompt_len, static["cfg"], static["max_len"],
                           logits=False, hidden_layers=stand_in.hidden_layers)
  return s, hidden


def _drafter_init(dparams, prompt, prompt_len, hidden, *, drafter, max_len):
  return drafter.init(dparams, prompt, prompt_len, max_len, hidden=hidden)
