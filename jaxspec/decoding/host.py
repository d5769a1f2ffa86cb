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

The draft, verify and commit programs reuse the fused loop's pieces (`_verify_branch`,
`_finish_step`), so a host-orchestrated run computes exactly what the fused loop computes:
same tokens under greedy decoding, same keys under sampling.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxspec.decoding import adaptive
from jaxspec.decoding.drafter import DraftContext, Drafter, NoState, Proposal
from jaxspec.decoding.rejection import draft
from jaxspec.decoding.step import (finish_step, room, slice_proposal, spec_prefill, step_inputs,
                                   step_keys, verify_branch)
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
  kd, _ = step_keys(keys, ctx.seq_len)
  ctx = dataclasses.replace(ctx, row_keys=keys)  # the drafter's copy of the rows' keys
  prop, new = draft(drafter, dparams, dstate, ctx, k, sp, kd)
  n_valid = jnp.full((b,), k, jnp.int32) if prop.n_valid is None else prop.n_valid
  pad = lambda x: jnp.pad(x, [(0, 0), (0, kmax - k)] + [(0, 0)] * (x.ndim - 2))
  return Proposal(tokens=pad(prop.tokens), q=None if prop.q is None else pad(prop.q),
                  n_valid=n_valid), new


def host_verify(tparams, s, prop: Proposal, idx, sp, costs, force_idx, *, lm, drafter, policy,
                max_new_tokens, stop_ids):
  """Target mesh: verify the proposal for bucket `idx`, accept, roll back, choose the next k.

  Returns (new target state, the context the drafter commits, the next bucket index)."""
  kmax = policy.k_max
  live, _, kv, last = step_inputs(s, kmax + 1)
  forced = force_idx >= 0
  vb = functools.partial(verify_branch, lm=lm, drafter=drafter, kmax=kmax,
                         logprobs=policy.logprobs)
  nv_all = prop.n_valid

  def branch(k):
    def run(cache):
      if k == 0:
        return vb(tparams, cache, last, None, 0, sp, kv, live, forced)
      return vb(tparams, cache, last, slice_proposal(prop, k, nv_all), k, sp, kv, live, forced)
    return run

  def step(s):
    out = lax.switch(idx, [branch(k) for k in policy.buckets], s.cache)
    return finish_step(s, out, lm=lm, policy=policy, max_new_tokens=max_new_tokens,
                       stop_ids=stop_ids)

  def idle(s):  # every row is done: nothing runs, nothing is counted
    b = s.seq.shape[0]
    hidden = jax.eval_shape(lambda c: branch(0)(c)[2], s.cache)
    zeros = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), hidden)
    z = jnp.zeros((b,), jnp.int32)
    return s, DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len, hidden=zeros,
                           hidden_pos=z, n_new=z)

  new, ctx = lax.cond(jnp.any(live), step, idle, s)
  nxt = host_choose(new, costs, policy=policy, max_new_tokens=max_new_tokens)
  return new, ctx, nxt


def host_choose(s, costs, *, policy, max_new_tokens):
  """The next step's bucket index: the controller's choice ("auto", without knowing which rows
  have real drafts before drafting), or the largest bucket for a fixed k."""
  if not policy.auto:
    return jnp.int32(len(policy.buckets) - 1)
  alpha = adaptive.acceptance_estimate(s.counts, policy.prior)
  idx, _ = adaptive.choose(alpha, ~s.done, costs, policy.buckets, None,
                           room(s, max_new_tokens), policy.margin, length=s.seq_len)
  return idx.astype(jnp.int32)


def host_commit(dparams, dstate, ctx, *, drafter):
  """Drafter mesh: the drafter takes the accepted tokens (and the target's features)."""
  return drafter.commit(dparams, dstate, ctx)


def shapes_of(tree):
  """Shape/dtype structs (without shardings) of a compiled program's outputs."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


host_choose_jit = jax.jit(host_choose, static_argnames=("policy", "max_new_tokens"))


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


def host_target_init(tparams, dparams, prompt, prompt_len, sp, key, **static):
  """The fused loop's prefill and first token on the target mesh; returns the state (without
  the stand-in's state), the prefill's hidden states for the drafter's init, from the one
  prefill, and the first token's context, which the drafter commits after its init."""
  s, ctx = spec_prefill(tparams, dparams, prompt, prompt_len, sp, key, **static)
  return dataclasses.replace(s, draft_state=NoState()), s.draft_state, ctx


def host_drafter_init(dparams, prompt, prompt_len, hidden, *, drafter, max_len):
  return drafter.init(dparams, prompt, prompt_len, max_len, hidden=hidden)
