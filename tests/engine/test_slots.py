"""`SlotDecoder` (continuous batching): each job draws what `jaxspec.generate` draws for its row,
whichever slot it runs on and whatever runs beside it, and a job that appends to its slot's
cache continues the sequence the slot holds."""

import jax
import numpy as np
import pytest

import jaxspec
from jaxspec.engine.slots import CHUNKS, Job, SlotDecoder
from jaxspec.sampling import Sampling, row_keys


def _prompts(n, seed=0, lo=3, hi=30):
  rng = np.random.default_rng(seed)
  return [rng.integers(3, 120, rng.integers(lo, hi)).tolist() for _ in range(n)]


def _drain(dec, jobs):
  """Runs `jobs` (a list) through the free slots, refilling as slots finish; returns each job's
  new tokens and the slots they ran on."""
  todo, where, got, slots = list(range(len(jobs))), {}, {}, {}
  while todo or dec.busy.any() or dec.pending:
    for s in dec.free:
      if todo:
        j = todo.pop(0)
        where[s], slots[j] = j, s
        dec.start(s, jobs[j])
    for s, row in dec.run().items():
      got[where[s]] = row
  return [got[j] for j in range(len(jobs))], slots


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_jobs_draw_generates_rows(tiny_target, temperature):
  """Nine prompts of different lengths and budgets on three slots (so slots are refilled while
  others run): every job's tokens equal generate's row for the same prompt and row key."""
  prompts = _prompts(9)
  budgets = [5, 17, 9, 30, 2, 12, 25, 1, 8]
  key = jax.random.key(4)
  sp = Sampling(temperature=temperature, top_p=0.9 if temperature else 1.0)
  ref = jaxspec.generate(tiny_target, prompts, max_new_tokens=30, sampling=sp, key=key,
                         max_len=64)
  keys = row_keys(key, len(prompts))
  dec = SlotDecoder(tiny_target, num_slots=3, max_len=64, capacity=30,
                    stop_ids=tiny_target.cfg.eos_token_ids, wake=1)
  got, slots = _drain(dec, [Job(p, b, keys[j], temperature, sp.top_p)
                            for j, (p, b) in enumerate(zip(prompts, budgets))])
  assert len(set(slots.values())) == 3
  for j, b in enumerate(budgets):
    assert got[j] == ref.row(j)[:b], j
  assert dec.steps < sum(len(g) for g in got)  # slots stepped side by side


def test_a_job_appends_to_its_slots_cache(tiny_target):
  """A second job on the same slot (reset=False) appends a few tokens after what the first
  left: greedy, it continues as generate does from the whole sequence, and the slot's count of
  cached tokens is the sequence but its last emitted token."""
  prompts = _prompts(4, seed=1)
  key = jax.random.key(0)
  dec = SlotDecoder(tiny_target, num_slots=2, max_len=96, capacity=16, stop_ids=(), wake=1)
  first, slots = _drain(dec, [Job(p, 10, key) for p in prompts[:2]])
  for j in range(2):
    assert dec.cached(slots[j]) == len(prompts[j]) + len(first[j]) - 1
  extra = [[7, 8, 9], [11]]
  for j in range(2):
    dec.start(slots[j], Job([first[j][-1]] + extra[j], 12, key, reset=False))
  second = {}
  while len(second) < 2:
    second |= dec.run()
  whole = [prompts[j] + first[j] + extra[j] for j in range(2)]
  ref = jaxspec.generate(tiny_target, whole, max_new_tokens=12, max_len=96, stop_ids=())
  for j in range(2):
    assert second[slots[j]] == ref.row(j)


def test_a_long_prompt_is_appended_in_pieces(tiny_target):
  """A prompt longer than the widest chunk runs in pieces of it and samples after the last."""
  rng = np.random.default_rng(3)
  long = rng.integers(3, 120, max(CHUNKS) + 37).tolist()
  ref = jaxspec.generate(tiny_target, [long], max_new_tokens=6, max_len=400, stop_ids=())
  dec = SlotDecoder(tiny_target, num_slots=2, max_len=400, capacity=8, stop_ids=())
  got, _ = _drain(dec, [Job(long, 6, jax.random.key(0))])
  assert got[0] == ref.row(0)


def test_refuses_what_does_not_fit(tiny_target):
  dec = SlotDecoder(tiny_target, num_slots=2, max_len=32, capacity=8, stop_ids=())
  key = jax.random.key(0)
  with pytest.raises(ValueError, match="at least one token"):
    dec.start(0, Job([], 4, key))
  with pytest.raises(ValueError, match="pass max_len 32"):
    dec.start(0, Job(list(range(3, 30)), 8, key))
  with pytest.raises(ValueError, match="max_new_tokens"):
    dec.start(0, Job([5, 6], 9, key))
  with pytest.raises(ValueError, match="slot"):
    dec.start(2, Job([5, 6], 4, key))
  with pytest.raises(ValueError, match=r"token ids in \[0, 128\)"):
    dec.start(0, Job([5, 128], 4, key))
  with pytest.raises(ValueError, match="top_p in"):
    dec.start(0, Job([5, 6], 4, key, temperature=1.0, top_p=0.0))
  with pytest.raises(ValueError, match="temperature >= 0"):
    dec.start(0, Job([5, 6], 4, key, temperature=-1.0))
  dec.start(0, Job([5, 6], 4, key))
  with pytest.raises(ValueError, match="slot 0 is busy"):
    dec.start(0, Job([5, 6], 4, key))
  with pytest.raises(ValueError, match="wake"):
    SlotDecoder(tiny_target, num_slots=2, max_len=32, capacity=8, stop_ids=(), wake=3)
  with pytest.raises(ValueError, match="jaxspec Model"):
    SlotDecoder(object(), num_slots=2, max_len=32, capacity=8, stop_ids=())


def test_each_job_stops_at_its_own_stop_tokens(tiny_target):
  """Two jobs side by side, one ending at a token the other must run past."""
  prompts = _prompts(2, seed=5)
  ref = jaxspec.generate(tiny_target, prompts, max_new_tokens=12, max_len=64, stop_ids=())
  stop = ref.row(0)[4]
  first = ref.row(0).index(stop)
  dec = SlotDecoder(tiny_target, num_slots=2, max_len=64, capacity=12, stop_ids=(), wake=2)
  key = jax.random.key(0)
  got, _ = _drain(dec, [Job(prompts[0], 12, key, stop_ids=[stop]), Job(prompts[1], 12, key)])
  assert got[0] == ref.row(0)[:first + 1]
  assert got[1] == ref.row(1)  # no stop of its own


def test_sliding_window_rings():
  """A model whose sliding layers keep rings (window 8, cache far longer): a padded chunk stays
  within the rings' slack, so jobs, appended ones included, equal generate's rows."""
  import dataclasses
  from jaxspec.models import init_params, tiny_config
  from jaxspec.models.model import Model
  cfg = dataclasses.replace(tiny_config(), sliding_window=8)
  model = Model(cfg, init_params(cfg, jax.random.key(2), scale=0.2), name="tiny-sliding")
  prompts = _prompts(3, seed=7)
  ref = jaxspec.generate(model, prompts, max_new_tokens=20, max_len=512, stop_ids=())
  dec = SlotDecoder(model, num_slots=2, max_len=512, capacity=20, stop_ids=(), wake=1)
  assert dec.state.cache.k_ring is not None
  got, slots = _drain(dec, [Job(p, 20, jax.random.key(0)) for p in prompts])
  assert got == [ref.row(j) for j in range(3)]
  j = 2  # its slot appends more, far past the window
  dec.start(slots[j], Job([got[j][-1], 5, 6, 7], 20, jax.random.key(0), reset=False))
  more = {}
  while not more:
    more = dec.run()
  whole = prompts[j] + got[j] + [5, 6, 7]
  assert more[slots[j]] == jaxspec.generate(model, [whole], max_new_tokens=20, max_len=512,
                                            stop_ids=()).row(0)
