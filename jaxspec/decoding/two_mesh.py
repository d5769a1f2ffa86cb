"""The two-mesh loop: the target on one mesh, the drafter on another, the host between them.

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

The programs here run inside jit; the host loop that dispatches them is `HostRun`'s, on the host side.
They reuse the fused loop's pieces (`loop.verify_branch`, `loop.finish_step`, one `StepConfig`),
so a host-orchestrated run computes exactly what the fused loop computes: same tokens under
greedy decoding, same keys under sampling.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxspec.decoding import adaptive
from jaxspec.decoding.drafter import DraftContext, Drafter, NoState, Proposal
from jaxspec.decoding.loop import (StepConfig, draft_keys, finish_step, slice_proposal,
                                   spec_prefill, step_inputs, verify_branch)
from jaxspec.decoding.rejection import draft
from jaxspec.pytree import pytree_dataclass as _pytree


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


def host_draft(dparams, dstate, ctx: DraftContext, keys, sp, *, drafter, k, kmax):
  """Drafter mesh: propose k drafts (k static: one program per draft count, so the drafter's
  cache is updated in place rather than carried through a switch), padded to k_max."""
  b = ctx.seq.shape[0]
  ctx = dataclasses.replace(ctx, row_keys=keys)  # the drafter's copy of the rows' keys
  with jax.named_scope("draft"):
    prop, new = draft(drafter, dparams, dstate, ctx, k, sp, draft_keys(keys, ctx.seq_len))
  n_valid = jnp.full((b,), k, jnp.int32) if prop.n_valid is None else prop.n_valid
  pad = lambda x: jnp.pad(x, [(0, 0), (0, kmax - k)] + [(0, 0)] * (x.ndim - 2))
  return Proposal(tokens=pad(prop.tokens), q=None if prop.q is None else pad(prop.q),
                  n_valid=n_valid), new


def host_verify(tparams, s, prop: Proposal, idx, sp, costs, force_idx, *, cfg: StepConfig):
  """Target mesh: verify the proposal for bucket `idx`, accept, roll back, choose the next k.

  Returns (new target state, the context the drafter commits, the next bucket index)."""
  live, _, keys, last = step_inputs(s, cfg.policy.k_max + 1)
  forced = force_idx >= 0

  def branch(k):
    def run(cache):
      p = None if k == 0 else slice_proposal(prop, k, prop.n_valid)
      return verify_branch(tparams, cache, last, p, k, sp, keys, live, forced, cfg,
                           history=s.history)
    return run

  def step(s):
    out = lax.switch(idx, [branch(k) for k in cfg.policy.buckets], s.cache)
    with jax.named_scope("accept"):
      return finish_step(s, out, cfg)

  def idle(s):  # every row is done: nothing runs, nothing is counted
    b = s.seq.shape[0]
    hidden = jax.eval_shape(lambda c: branch(0)(c).hidden, s.cache)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), hidden)
    z = jnp.zeros((b,), jnp.int32)
    return s, DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len, hidden=zeros,
                           hidden_pos=z, n_new=z)

  new, ctx = lax.cond(jnp.any(live), step, idle, s)
  return new, ctx, host_choose(new, costs, cfg=cfg)


def host_choose(s, costs, *, cfg: StepConfig):
  """The next step's bucket index: the controller's choice ("auto", without knowing which rows
  have real drafts before drafting), or the largest bucket for a fixed k."""
  policy = cfg.policy
  if not policy.auto:
    return jnp.int32(len(policy.buckets) - 1)
  alpha = adaptive.acceptance_estimate(s.counts, policy.prior)
  room = cfg.max_new_tokens - (s.seq_len - s.prompt_len)
  idx, _ = adaptive.choose(alpha, ~s.done, costs, policy.buckets, None, room, policy.margin,
                           length=s.seq_len)
  return idx.astype(jnp.int32)


def host_commit(dparams, dstate, ctx, *, drafter):
  """Drafter mesh: the drafter takes the accepted tokens (and the target's features)."""
  return drafter.commit(dparams, dstate, ctx)


def shapes_of(tree):
  """Shape/dtype structs (without shardings) of a compiled program's outputs."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


host_choose_jit = jax.jit(host_choose, static_argnames=("cfg",))


@dataclasses.dataclass(frozen=True)
class HiddenOnly(Drafter):
  """Stand-in drafter of the target-side prefill: its state is the prefill's hidden states
  (None when the real drafter does not read them), handed to the real drafter's init."""

  uses_target_hidden: bool = False
  hidden_layers: tuple[int, ...] = ()
  name: str = "host"

  def init(self, params, prompt, prompt_len, max_len, hidden=None):
    return hidden

  def commit(self, params, state, ctx):
    return state


def host_target_init(tparams, dparams, prompt, prompt_len, sp, key, *, cfg: StepConfig):
  """The fused loop's prefill and first token on the target mesh (cfg.drafter: the stand-in
  `HiddenOnly`); returns the state (without the stand-in's state), the prefill's hidden states
  for the drafter's init, from the one prefill, and the first token's context, which the
  drafter commits after its init."""
  s, ctx = spec_prefill(tparams, dparams, prompt, prompt_len, sp, key, cfg)
  return dataclasses.replace(s, draft_state=NoState()), s.draft_state, ctx


def host_drafter_init(dparams, prompt, prompt_len, hidden, *, drafter, max_len):
  return drafter.init(dparams, prompt, prompt_len, max_len, hidden=hidden)
