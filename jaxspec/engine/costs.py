"""The measured cost model of "auto": the compiled loop forced to each k and timed from the
prefilled state (`measure_costs`), at the prompt's length and at a short cache
(`state_at_length`) so that the model follows the cache's growth.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import protocol
from jaxspec.decoding.adaptive import CostModel, isotonic
from jaxspec.decoding.loop import Policy, SpecState, costs_array
from jaxspec.engine.io import to_host


def measure_costs(loop_exe, tparams, dparams, state: SpecState, sp, policy: Policy, *,
                  steps: int = 4, warmup: int = 2, rounds: int = 3,
                  batch_size: int | None = None, short_state=None) -> CostModel:
  """Times the compiled loop forced to each k in `policy.buckets`, from copies of `state`.

  The loop executable is the one that then generates, so this costs no compilation and times
  exactly what will run (drafting, verify, acceptance, bookkeeping). The k's are timed in
  `rounds` interleaved rounds (k = 0, 1, .. then again), so a slow spell of a shared machine
  hits every k rather than one; each k's cost is its median ratio to the plain step of the
  same round, times the fastest plain step. A round runs `warmup` untimed
  steps from a fresh copy of the post-prefill state (the first steps on freshly copied buffers
  are slow), then `steps` timed ones; rows that finish early shorten the count.

  With `short_state` (the same state with a short cache, `state_at_length`), every k is timed
  at both lengths in the same rounds, and the cost model grows with the cache by the
  difference (`CostModel.per_token`): where attention reads only the cached positions a long
  prompt makes every verify dearer, and a wide verify more so than a decode step.
  """
  n = len(policy.buckets)
  costs = jnp.asarray(costs_array(policy, None))
  states = [state] if short_state is None else [state, short_state]
  times = np.zeros((rounds, len(states), n))
  for r in range(rounds):
    for j, start in enumerate(states):
      for i in range(n):
        st = jax.block_until_ready(jax.tree.map(jnp.copy, start))
        t0 = time.perf_counter()
        st = jax.block_until_ready(loop_exe(tparams, dparams, st, sp, costs, jnp.int32(warmup),
                                            jnp.int32(i)))
        first = time.perf_counter() - t0
        done0 = int(st.stats.target_passes)
        t0 = time.perf_counter()
        st = jax.block_until_ready(loop_exe(tparams, dparams, st, sp, costs,
                                            jnp.int32(warmup + steps), jnp.int32(i)))
        dt = time.perf_counter() - t0
        ran = int(st.stats.target_passes) - done0
        times[r, j, i] = dt / ran if ran > 0 else first / max(done0, 1)
        del st
  # Each k relative to the plain step timed just before it in the same round (a slow spell of
  # a shared machine hits both), the median over rounds, times the fastest plain step: a
  # single lucky or unlucky timing of one k cannot make drafting look free.
  ratio = np.median(times / times[:, :, :1], axis=0)  # [lengths, n]
  best = ratio * times[:, :, 0].min(axis=0)[:, None]
  length = longest(state)
  if short_state is None:
    return CostModel.from_measurements(policy.buckets, best[0], length=length,
                                       batch_size=batch_size, source="measured")
  # Timed at the short length as `seconds` and grown to the prompt's: a difference under
  # NOISE_FRACTION of the step is timing noise (the same program timed twice), not growth.
  short_len = longest(short_state)
  near, far = isotonic(best[1]), isotonic(best[0])
  grown = [f if f - s_ > NOISE_FRACTION * s_ else s_ for s_, f in zip(near, far)]
  return CostModel.from_measurements(policy.buckets, best[1], longer=grown, length=short_len,
                                     longer_length=length, batch_size=batch_size,
                                     source="measured")


# Two timings of one step that differ by less than this fraction are taken as equal.
NOISE_FRACTION = 0.03

# The shortest span of cache lengths the growth of the costs is timed over (shorter prompts
# give a difference smaller than the timing noise).
MIN_COST_SPAN = 256


def longest(state) -> int:
  """The longest row's length (prompt + emitted) of a loop state: where the costs are weighed."""
  st = getattr(state, "t", state)
  return int(to_host(st.seq_len).max())  # gathered first on a multi-host mesh


def state_at_length(state: SpecState, length: int) -> SpecState:
  """A copy of a post-prefill state whose rows look `length` tokens long (for timing only): the
  target cache and the sequence cut back to `length`, each row's room to generate unchanged.
  The drafter's state is left as it is (its lengths only move its own reads and writes)."""
  shift = jnp.maximum(state.seq_len - length, 0)
  seq_len = state.seq_len - shift
  return dataclasses.replace(
      state, seq_len=seq_len, prompt_len=jnp.maximum(state.prompt_len - shift, 1),
      cache=protocol.with_length(state.cache, jnp.maximum(state.cache.length - shift, 0)))
