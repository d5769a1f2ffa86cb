"""The runs of a speculative call: `SpecRun` compiles and drives the fused loop (one program on
the target's devices or mesh), `HostRun` the two-mesh loop of a `Placement` (the drafter's
programs on one mesh, the target's on another, the host handing small arrays across, and a
drafter that fails handing the rest of the generation to plain target steps: `Failover`);
`SpecStats.summary` turns the loop's counters into the statistics a call returns.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import loop
from jaxspec.decoding import two_mesh
from jaxspec.decoding.drafter import DraftContext
from jaxspec.decoding.functional import as_key
from jaxspec.decoding.loop import SpecState, SpecStats, StepConfig, costs_array
from jaxspec.engine.costs import (MIN_COST_SPAN, TIMED_STEPS, cost_key, load_cost, longest,
                                  measure_costs, save_cost, state_at_length)
from jaxspec.engine.io import (SpecRequest, pad_rows, put_global, sampling_rows, sharding_of,
                               shardings_of, to_host)
from jaxspec.models.llama import init_cache
from jaxspec.models.model import Model
from jaxspec.sharding import placement as placement_lib
from jaxspec.sharding.placement import Placement
from jaxspec.sharding.rules import ModelSharding, place_drafter


# The per-row counters of `SpecStats` (pad rows' entries are dropped before the summary).
_ROW_STATS = ("drafted", "accepted", "emitted", "row_steps", "spec_row_steps")


def placed_run(engine, req: SpecRequest, placement: Placement) -> SpecRun:
  """The run a Placement chooses: the target laid out on its mesh, the drafter in its precision;
  the fused loop where both meshes are one, else the host-orchestrated `HostRun`."""
  if not isinstance(placement, Placement):
    raise ValueError(f"placement must be a jaxspec.sharding.Placement, got"
                     f" {type(placement).__name__}")
  if not isinstance(req.target, Model):
    raise ValueError("placement= lays a jaxspec Model's weights out on a mesh by its sharding"
                     " rules; an own model's weights stay where you put them: drop placement=,"
                     " and jax.device_put its params (the fused loop runs where they are)")
  if req.drafter.tree is not None and not placement.fused:
    raise ValueError(f"the {req.drafter.name} drafter drafts a tree, which runs in the fused loop"
                     " only: place the drafter on the target's mesh (Placement(target=mesh,"
                     " drafter=mesh)) or use drafter.with_tree(None) for chains")
  target = placement_lib.place_target(req.target, placement)
  target.sharding.check_batch(req.prep.tokens.shape[0])
  req = dataclasses.replace(req, target=target, drafter=placement_lib.drafter_in_precision(
      req.drafter, placement.drafter_precision))
  return (SpecRun if placement.fused else HostRun)(engine, req, placement)


class SpecRun:
  """The compiled prefill and loop of one call (its `SpecRequest`), and the cost model for
  "auto", on `engine` (a `jaxspec.engine.Engine`: its compiled programs, kept buffers and cost
  models).

  For a target sharded with `jaxspec.sharding.shard_model`, both programs are compiled with
  in_shardings/out_shardings on its mesh: rows over the batch axis, caches by the rules.
  `HostRun` shares this construction and compiles its own programs (`_compile`).
  """

  pooled = False  # the target's cache goes into kept buffers (unsharded fused runs)

  def __init__(self, engine, req: SpecRequest, placement: Placement | None = None):
    self.engine, self.placement = engine, placement  # the Placement that chose it, if one did
    self.target, self.drafter, self.prep, self.policy = (req.target, req.drafter, req.prep,
                                                         req.policy)
    self.batch = req.prep.tokens.shape[0]  # the bucketed batch the programs run
    self.rows = req.prep.rows  # the caller's rows, the rest pad rows (`io.bucket_rows`)
    self.max_steps = req.max_new_tokens + 1
    self.budget = jnp.asarray(req.prep.row_budgets(req.max_new_tokens))
    self.cost = req.cost
    self.costs = costs_array(req.policy, req.cost)
    self.cost_seconds = 0.0  # timing the cost model (`_measure_costs`), apart from compiling
    # Where the cost model of "auto" came from: "given" by the caller, "measured" now, "cached"
    # (this engine measured it for these shapes before), "disk" (another process did,
    # `costs.load_cost`); None without "auto".
    self.cost_source = ("given" if req.cost is not None else None) if req.policy.auto else None
    self.failover: Failover | None = None  # a two-mesh run's fall back to plain steps
    # The pooled acceptance (tried, accepted) this call started from (`seed_acceptance`).
    self.acceptance_carried: tuple[float, float] | None = None
    # Each row's budget while the costs are timed (`timing_state`).
    self._timing_budget = self.budget
    # The static configuration holds the output width (`capacity`), not the call's count, which
    # the fused programs take per row (`loop.spec_init`'s budget); the two-mesh programs,
    # compiled for the exact sizes, read it from here (capacity == max_new_tokens for them).
    self.static = dict(cfg=StepConfig(
        lm=req.lm, drafter=req.drafter, policy=req.policy,
        max_new_tokens=req.prep.capacity, stop_ids=req.stop_ids, max_len=req.prep.max_len,
        max_steps=req.prep.capacity + 1))
    self.req = req
    self.carry = self.carry_key()  # where the pooled acceptance is carried, None: not carried
    self.compile_seconds = self._compile(req)

  def _compile(self, req: SpecRequest) -> float:
    """Compiles the fused prefill and loop; returns the seconds spent compiling."""
    target, prep, b = req.target, req.prep, self.batch
    sh = sharding_of(target)
    # One value or one per prompt, each prompt's n samples sharing its settings.
    self.sp = pad_rows(sampling_rows(req.sampling, prep, req.lm.vocab_size, req.max_new_tokens), b)
    self.tparams = target.params
    # Sharded, the drafter's weights are copied onto the target's mesh (once, by the engine).
    self.dparams = (req.drafter.params if sh is None else
                    self.engine.place_drafter_params(target, req.drafter))
    self.init_args = (self.tparams, self.dparams, jnp.asarray(prep.tokens),
                      jnp.asarray(prep.lengths), self.sp,
                      pad_rows(as_key(req.key, self.rows), b), self.budget)
    # Unsharded, the target's cache is written into the previous call's buffers (donated):
    # `take_cache_buffers` at start, `keep_cache_buffers` when the call ends.
    self.pooled = sh is None and isinstance(target, Model)
    bufs = None
    if self.pooled:
      c = jax.eval_shape(functools.partial(init_cache, target.cfg, b, prep.max_len))
      bufs = (c.k, c.v)
    state0 = jax.eval_shape(functools.partial(loop.spec_init_jit, **self.static),
                            *self.init_args, bufs)
    loop_args = (self.tparams, self.dparams, state0, self.sp, self.costs, jnp.int32(0),
                 jnp.int32(-1), self.budget)
    compile = self.engine.compile
    if sh is None:
      self.init_exe, c1 = compile(loop.spec_init_jit, "spec-init", *self.init_args, bufs,
                                  **self.static)
      self.loop_exe, c2 = compile(loop.spec_loop_jit, "spec-loop", *loop_args, **self.static)
      return c1 + c2
    sh.check_batch(b)
    st_sh = sh.state(state0, b)
    p_sh = (shardings_of(self.tparams), shardings_of(self.dparams))
    rep = sh.replicated()
    init_in = (*p_sh, sh.batch(2), sh.batch(1), sh.state(self.sp, b), rep, sh.batch(1))
    self.init_exe, c1 = compile(loop.spec_init, ("spec-init", sh), *self.init_args,
                                jit_kwargs=dict(in_shardings=init_in, out_shardings=st_sh),
                                **self.static)
    # Global arrays on the mesh (on several hosts every process passes the same prompts).
    self.init_args = put_global(self.init_args, init_in)
    self.sp, self.budget = self.init_args[4], self.init_args[6]
    loop_in = (*p_sh, st_sh, sh.state(self.sp, b), rep, rep, rep, sh.batch(1))
    self.loop_exe, c2 = compile(loop.spec_loop, ("spec-loop", sh), *loop_args,
                                jit_kwargs=dict(in_shardings=loop_in, out_shardings=st_sh,
                                                donate_argnums=(2,)), **self.static)
    return c1 + c2

  def start(self) -> SpecState:
    """Prefill; with "auto" and no cost model, times every k from the prefilled state once
    (kept by the engine per shapes), excluded from the generation time."""
    if self.pooled:
      state = self.init_exe(*self.init_args, self.engine.take_cache_buffers(
          self.target.cfg, self.batch, self.prep.max_len, self.init_args[0]))
    elif sharding_of(self.target) is None:  # an own model: compiled with no buffers
      state = self.init_exe(*self.init_args, None)
    else:
      state = self.init_exe(*self.init_args)
    if self.policy.auto and self.cost is None:
      self._measure_costs(state, self._loop_for_costs, self.sp)
    return state if self.carry is None else self.seed_acceptance(state)

  def carry_key(self):
    """Where the pooled acceptance of this call is carried to the next (`AutoK.carry`), or
    None: only where the emitted text cannot depend on the k's chosen (every row greedy, or a
    coupled drafter), unsharded."""
    req = self.req
    if not (self.policy.auto and self.policy.carry) or sharding_of(req.target) is not None \
        or not (req.sampling.greedy or getattr(req.drafter, "coupled", False) is True):
      return None
    return (req.lm, req.drafter, repr(req.sampling))

  def seed_acceptance(self, state: SpecState) -> SpecState:
    """The state with each row's pooled acceptance counts where the engine's last call of this
    target, drafter and sampling ended (`AutoK.carry`; `self.carry` is not None)."""
    self.acceptance_carried = self.engine.acceptance.get(self.carry)
    if self.acceptance_carried is None:
      return state
    tried, accepted = self.acceptance_carried
    c = state.counts
    return dataclasses.replace(state, counts=dataclasses.replace(
        c, row_tried=jnp.full_like(c.row_tried, tried),
        row_accepted=jnp.full_like(c.row_accepted, accepted)))

  def _loop_for_costs(self, tparams, dparams, state, sp, costs, until, force_idx):
    return self.loop_exe(tparams, dparams, state, sp, costs, until, force_idx,
                         self._timing_budget)

  def timing_state(self, state: SpecState) -> SpecState:
    """The post-prefill state the costs are timed from: each of the caller's rows live, with a
    budget (`_loop_for_costs`) of as many new tokens as the compiled width and the cache leave
    room for, whatever this call's own max_new_tokens. A call of one new token (its rows done
    at the prefill) would otherwise time no step at all, and the engine would keep that model
    for later calls of the same shapes. Sharded, the state is left as it is (its arrays may
    span hosts), and a timing cut short is not kept (`_measure_costs`)."""
    if sharding_of(self.target) is not None:
      return state
    k1 = self.policy.k_max + 1
    room = jnp.clip(self.prep.max_len - state.prompt_len - k1, 0, self.prep.capacity)
    self._timing_budget = jnp.where(self.budget > 0, room, 0).astype(self.budget.dtype)
    done = (self.budget <= 0) | (state.seq_len - state.prompt_len >= self._timing_budget)
    return dataclasses.replace(state, done=done)

  def finish(self, state: SpecState) -> None:
    """Keeps the finished call's target cache for the next call of the same shapes, and where
    its pooled acceptance ended (the mean over the caller's rows) for the next call of the same
    target, drafter and sampling (`AutoK.carry`)."""
    if self.pooled:
      self.engine.keep_cache_buffers(self.target.cfg, state.cache.k, state.cache.v)
    if self.carry is not None:
      c = to_host(state.counts)
      self.engine.acceptance[self.carry] = (float(np.mean(c.row_tried[:self.rows])),
                                     float(np.mean(c.row_accepted[:self.rows])))

  def _measure_costs(self, state, run_loop, sp) -> None:
    """The engine's cost model for these shapes, else the one a process saved on disk for them
    (`costs.load_cost`), else `run_loop` (the `measure_costs` signature) timed from `state`
    once and saved; `self.costs` is then its array and `cost_source` says which."""
    # The disk's key (the shapes, settings and layouts a step's time depends on), in memory
    # with the model and drafter objects too (an own model's is described by its type only).
    key = cost_key(self.disk_key_parts())
    mem_key = (key, self.req.lm, self.req.drafter)
    self.cost, self.cost_source = self.engine.cost_models.get(mem_key), "cached"
    disk = self.engine.cost_cache_dir() if self.cost is None else None
    if disk is not None:
      self.cost, self.cost_source = load_cost(disk, key, self.policy.buckets), "disk"
    if self.cost is None:
      state = self.timing_state(jax.block_until_ready(state))
      self.engine.report("measuring the step cost of each k")
      t0 = time.perf_counter()
      try:
        self.cost = measure_costs(run_loop, self.tparams, self.dparams, state, sp, self.policy,
                                  batch_size=self.batch, short_state=self.short_state(state))
      finally:
        self.engine.report(None)
      self.cost_seconds = time.perf_counter() - t0
      self.cost_source = "measured"
      # Timed over fewer steps than asked (rows with no room left), or a drafter that failed
      # while it was timed (the timings are of plain steps): this call uses it, later calls of
      # these shapes measure again.
      if (self.cost.steps is not None and self.cost.steps < TIMED_STEPS
          or self.failover is not None):
        self.costs = costs_array(self.policy, self.cost)
        return
      if disk is not None:
        save_cost(disk, key, self.cost)
    self.engine.cost_models[mem_key] = self.cost
    self.costs = costs_array(self.policy, self.cost)

  def disk_key_parts(self) -> dict[str, Any]:
    """What a cost model saved on disk is keyed by (`costs.cost_key`): the target (config,
    name, the layout of its weights), the drafter (kind, settings and weights' layout), the
    bucketed shapes, the k's and sampling, the target's mesh."""
    req = self.req
    return dict(target=req.target, drafter=req.drafter, batch=self.batch,
                prompt_width=req.prep.tokens.shape[1], max_len=req.prep.max_len,
                policy=req.policy, sampling=repr(req.sampling), sharding=sharding_of(req.target),
                run=type(self).__name__, placement=self.placement)

  def short_state(self, state: SpecState) -> SpecState | None:
    """The state to time the costs at a short cache too, or None when the prompt is too short
    for the difference to show (`measure_costs`). Unsharded runs only: the compiled loop of a
    sharded one takes its state in the layout it was compiled for."""
    short = self.policy.k_max + 2
    if sharding_of(self.target) is not None or longest(state) - short < MIN_COST_SPAN:
      return None
    return state_at_length(state, short)

  def target_state(self, state: SpecState) -> SpecState:
    return state

  def loop(self, state: SpecState, until: int | jax.Array) -> SpecState:
    return self.loop_exe(self.tparams, self.dparams, state, self.sp, self.costs,
                         jnp.int32(until), jnp.int32(-1), self.budget)

  def stats(self, st: SpecStats) -> dict[str, Any]:
    st = to_host(st)
    # Pad rows were never live: they add nothing to the sums, and their own entries go.
    out = dataclasses.replace(st, **{f: getattr(st, f)[:self.rows] for f in _ROW_STATS}).summary()
    out.update(compile_seconds=self.compile_seconds, cost_seconds=self.cost_seconds,
               cost_source=self.cost_source, batch_size=self.rows,
               num_draft_tokens="auto" if self.policy.auto else self.policy.k_max,
               k_max=self.policy.k_max, drafter=self.drafter.name)
    if self.drafter.tree is not None:
      out["tree"] = self.drafter.tree.describe()
      out["tree_nodes"] = self.drafter.tree.num_nodes - 1
    if self.policy.auto:  # the model itself: `cost=` of a later call (`to_dict` for JSON)
      out["cost_model"] = self.cost
      carried = self.acceptance_carried
      out["acceptance_carried"] = None if carried is None else dict(
          tried=carried[0], accepted=carried[1])
    if self.placement is not None:
      out.update(placement=self.placement.describe(),
                 failover=None if self.failover is None else dataclasses.asdict(self.failover))
    return out


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


class HostRun(SpecRun):
  """The compiled programs of a host-orchestrated generation and its loop: `SpecRun`'s
  start / loop / stats interface (its construction, cost measurement and statistics are
  inherited), with programs on two meshes instead of one fused loop."""

  def _compile(self, req: SpecRequest) -> float:
    """Compiles the target's prefill and verify, the drafter's init, draft (one per k) and
    commit; returns the seconds spent (compiling and laying out)."""
    target, drafter, prep, policy, b = req.target, req.drafter, req.prep, req.policy, self.batch
    self.tsh = target.sharding
    self.dsh = ModelSharding(self.placement.drafter, self.placement.rules)
    self.tsh.check_batch(b)
    self.dsh.check_batch(b)
    self.tparams = target.params
    self.dparams = place_drafter(drafter, self.dsh)
    sp = pad_rows(sampling_rows(req.sampling, prep, target.cfg.vocab_size, req.max_new_tokens),
                  b)
    self.sp_t = jax.device_put(sp, self.tsh.state(sp, b))
    self.sp_d = jax.device_put(sp, self.dsh.state(sp, b))
    compile = self.engine.compile
    tok, lens = jnp.asarray(prep.tokens), jnp.asarray(prep.lengths)
    t0 = time.perf_counter()
    # Target side: the fused loop's prefill, with a stand-in drafter that keeps the prefill's
    # hidden states (when the real drafter reads them) as its state, for the drafter's init.
    self.tinit_args = (self.tparams, None, tok, lens, self.sp_t, as_key(req.key, b))
    tstatic = dict(cfg=dataclasses.replace(self.static["cfg"], drafter=two_mesh.HiddenOnly(
        drafter.uses_target_hidden, drafter.hidden_layers)))
    tstate0, hid0, fctx0 = jax.eval_shape(functools.partial(two_mesh.host_target_init, **tstatic),
                                          *self.tinit_args)
    t_sh = self.tsh.state(tstate0, b)
    rep_t = self.tsh.replicated()
    self.tinit_exe, _ = compile(
        two_mesh.host_target_init, ("host-tinit", self.tsh), *self.tinit_args,
        jit_kwargs=dict(in_shardings=(shardings_of(self.tparams), None, self.tsh.batch(2),
                                      self.tsh.batch(1), self.tsh.state(self.sp_t, b), rep_t),
                        out_shardings=(t_sh, self.tsh.state(hid0, b),
                                       self.tsh.state(fctx0, b))),
        **tstatic)
    # Drafter side: its init from the prompt (and the target's prefill features).
    self.dinit_exe, _ = compile(
        two_mesh.host_drafter_init, ("host-dinit", self.dsh), self.dparams, tok, lens, hid0,
        jit_kwargs=dict(in_shardings=(shardings_of(self.dparams), self.dsh.batch(2),
                                      self.dsh.batch(1), self.dsh.state(hid0, b))),
        drafter=drafter, max_len=prep.max_len)
    self._tok, self._lens = tok, lens
    dstate0 = two_mesh.shapes_of(self.dinit_exe.out_info)
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
      self.draft_exes[k], _ = compile(
          two_mesh.host_draft, ("host-draft", d_sh), *draft_args,
          jit_kwargs=dict(in_shardings=(shardings_of(self.dparams), d_sh.state(dstate0, b),
                                        ctx_sh, d_sh.batch(1), d_sh.state(self.sp_d, b)),
                          # The drafter's cache is written in place (after a failure it is
                          # not needed again).
                          donate_argnums=(1,)),
          drafter=drafter, k=k, kmax=kmax)
    prop0 = two_mesh.shapes_of(self.draft_exes[kmax].out_info[0])
    self.prop_sh_t = self.tsh.state(prop0, b)
    verify_args = (self.tparams, tstate0, prop0, jnp.int32(0), self.sp_t, self.costs,
                   jnp.int32(-1))
    self.verify_exe, _ = compile(
        two_mesh.host_verify, ("host-verify", self.tsh), *verify_args,
        jit_kwargs=dict(in_shardings=(shardings_of(self.tparams), t_sh, self.prop_sh_t, rep_t,
                                      self.tsh.state(self.sp_t, b), rep_t, rep_t),
                        out_shardings=(t_sh, None, rep_t), donate_argnums=(1,)),
        **self.static)
    ctx_full = two_mesh.shapes_of(self.verify_exe.out_info[1])
    self.ctx_sh_d = d_sh.state(ctx_full, b)
    self.commit_exe, _ = compile(
        two_mesh.host_commit, ("host-commit", d_sh), self.dparams, dstate0, ctx_full,
        jit_kwargs=dict(in_shardings=(shardings_of(self.dparams), d_sh.state(dstate0, b),
                                      self.ctx_sh_d), donate_argnums=(1,)),
        drafter=drafter)
    self.prop_zero = jax.device_put(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), prop0),
                                    self.prop_sh_t)
    self.d_batch1 = d_sh.batch(1)
    return time.perf_counter() - t0

  # -- running

  def start(self) -> two_mesh.HostState:
    tstate, hidden, first = self.tinit_exe(*self.tinit_args)
    b = self.batch
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
    state = two_mesh.HostState(t=tstate, d=dstate, ctx=ctx,
                           keys=jax.device_put(tstate.keys, self.d_batch1), idx=jnp.int32(0))
    if self.policy.auto and self.cost is None:
      self._measure_costs(state, self._loop_for_costs, self.sp_t)
    return dataclasses.replace(state, idx=two_mesh.host_choose_jit(state.t, self.costs,
                                                               **self.static))

  def target_state(self, state: two_mesh.HostState):
    return state.t

  def short_state(self, state: two_mesh.HostState) -> None:
    return None  # two meshes: timed at the prompt's length only

  def timing_state(self, state: two_mesh.HostState) -> two_mesh.HostState:
    return state  # its programs are compiled for the call's own count of new tokens

  def carry_key(self) -> None:
    return None  # two meshes: each call starts from the prior

  def _loop_for_costs(self, tparams, dparams, state, sp, costs, until, force_idx):
    # A drafter that fails while the cost model is timed fails over as in the loop: the
    # generation then runs plain steps, and the timings (of plain steps) go unused.
    return self._run(state, int(until), int(force_idx), costs)

  def _fail_over(self, step: int, e: BaseException) -> None:
    """Records the drafter's failure; from now on every step is a plain target step."""
    if self.failover is None:
      self.failover = Failover(step=step, error=_short_error(e))
      _forget_failed_runs(set(self.dsh.mesh.devices.flat) - set(self.tsh.mesh.devices.flat))

  def loop(self, state: two_mesh.HostState, until) -> two_mesh.HostState:
    return self._run(state, int(until), -1, self.costs)

  def _run(self, state: two_mesh.HostState, until: int, force_idx: int, costs):
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
        state = two_mesh.HostState(t=tstate, d=dstate,
                               ctx=DraftContext(seq=ctx_d.seq, seq_len=ctx_d.seq_len,
                                                prompt_len=ctx_d.prompt_len),
                               keys=state.keys, idx=nxt)
      n += 1
    return state

  def _plain_step(self, state: two_mesh.HostState, costs) -> two_mesh.HostState:
    """After a failover: a plain target step, the drafter's half of the state left behind."""
    tstate, _, _ = self.verify_exe(self.tparams, state.t, self.prop_zero, jnp.int32(0), self.sp_t,
                                   costs, jnp.int32(0))
    return dataclasses.replace(state, t=tstate)
