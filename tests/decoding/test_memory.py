"""The memory check: the estimate of a run's whole working set against what XLA's compiled
programs allocate, and refusals before anything compiles (the functional core as the host
wrappers)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import generate, generate_stream
from jaxspec.decoding import functional as F
from jaxspec.decoding import limits, protocol
from jaxspec.decoding.loop import costs_array, resolve_policy
from jaxspec.drafters import NGram
from jaxspec.models import init_params, tiny_config
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling, sampling_arrays


def _allocated(jitted, *args, **static) -> int:
  """Bytes the compiled program allocates beyond its arguments: temporaries and outputs."""
  m = jitted.lower(*args, **static).compile().memory_analysis()
  return m.temp_size_in_bytes + m.output_size_in_bytes


# (vocab, hidden, batch, prompt width, capacity, k, stacked layers): logits-bound, prompt-bound
# (the prefill's attention), cache-bound, and unrolled layers.
SHAPES = [(4096, 64, 4, 64, 128, 4, True), (4096, 64, 4, 512, 128, 4, True),
          (4096, 64, 4, 64, 1024, 4, True), (4096, 256, 4, 64, 128, 8, False)]


@pytest.mark.parametrize("shape", SHAPES, ids=["logits", "prefill", "cache", "unrolled"])
def test_working_set_estimate_within_25_percent_of_compiled_programs(shape):
  v, d, b, p, n, k, scan = shape
  cfg = tiny_config(vocab_size=v, hidden_size=d, intermediate_size=2 * d, num_heads=4,
                    num_kv_heads=2, head_dim=d // 4)
  model = Model(cfg, init_params(cfg, jax.random.key(0))).with_scan_layers(scan)
  tgt = protocol.as_target(model, None)
  prompt, lens = jnp.ones((b, p), jnp.int32), jnp.full((b,), p, jnp.int32)
  sp, key = sampling_arrays(None, b), jax.random.key(0)
  est = F.decode_working_set(tgt, b, p, n, p + n, logprobs=True)
  got = _allocated(F._decode_jit, tgt, prompt, lens, key, jnp.int32(n), sp, capacity=n,
                   max_len=p + n, stop_ids=(), pad_id=0, logprobs=True, top_logprobs=0)
  assert 0.75 < est.total / got < 1.25, (est, got)
  policy = dataclasses.replace(resolve_policy(k, None, NGram()), logprobs=True)
  ml = p + n + k + 1
  # The all-greedy program (no sampling compiled), a sampled one without filters and one whose
  # rows may filter. The sampling buffers are logits-sized: the two sampled programs are checked
  # where the logits weigh (the prompt- and cache-bound shapes check the greedy one).
  sampled = (sampling_arrays(Sampling(temperature=0.5), b),
             sampling_arrays(Sampling(temperature=0.5, top_p=0.9), b))
  logits_bound = p <= 64 and n <= 128  # "logits" and "unrolled"
  for spk in (sp, *(sampled if logits_bound else ())):
    est = F.spec_working_set(tgt, NGram(), None, policy, b, p, n, ml, greedy=spk.all_greedy,
                             unfiltered=spk.unfiltered)
    got = _allocated(F._speculative_jit, tgt, None, prompt, lens, key, jnp.int32(n), spk,
                     costs_array(policy, None), drafter=NGram(), policy=policy, capacity=n,
                     max_len=ml, stop_ids=(), pad_id=0)
    assert 0.75 < est.total / got < 1.25, (spk.all_greedy, spk.unfiltered, est, got)


def test_functional_core_refuses_what_does_not_fit_before_compiling(tiny_target, no_compile,
                                                                    monkeypatch):
  prompt, lens = jnp.array([[1, 2, 3]]), jnp.array([3])
  # Past the positions limit, before any shape is evaluated.
  with pytest.raises(ValueError, match="past jaxspec's limit"):
    F.speculative_decode(tiny_target, NGram(), prompt, lens, 0, max_new_tokens=4,
                         max_len=2**24 + 1)
  # A cache of 2**22 positions for 4,096 rows: terabytes, refused against the real budget.
  big = jnp.ones((4096, 3), jnp.int32)
  with pytest.raises(ValueError, match=r"needs about .* GiB.*KV cache.*lower the batch"):
    F.decode(tiny_target, big, jnp.full((4096,), 3), 0, max_new_tokens=4, capacity=2**22)
  with pytest.raises(ValueError, match=r"speculative decoding of 4096 rows.*GiB"):
    F.speculative_decode(tiny_target, NGram(), big, jnp.full((4096,), 3), 0,
                         max_new_tokens=4, capacity=2**22)
  # Counted beyond the cache: a budget that holds the cache but not the step's logits.
  b, n = 8, 64
  tgt = protocol.as_target(tiny_target, None)
  ws = F.decode_working_set(tgt, b, 3, n, 3 + n, logprobs=True)
  monkeypatch.setattr(limits, "memory_budget", lambda: ws.cache + ws.state + 1)
  with pytest.raises(ValueError, match="decoding 8 rows"):
    F.decode(tiny_target, jnp.ones((b, 3), jnp.int32), jnp.full((b,), 3), 0,
             max_new_tokens=n)


def test_host_wrappers_count_the_working_set(tiny_target, monkeypatch):
  """`generate`'s pre-flight check weighs the same parts: a budget above the cache alone but
  below the estimate is refused before compiling."""
  cfg = tiny_target.cfg
  b, ml = 64, 128
  cache = 2 * cfg.num_layers * b * cfg.num_kv_heads * ml * cfg.head_dim * 4
  monkeypatch.setattr(limits, "memory_budget", lambda: int(1.2 * cache))
  with pytest.raises(ValueError, match=r"generating 64 rows with a cache of 128 positions"):
    generate(tiny_target, [[1, 2, 3]] * b, max_new_tokens=8, max_len=ml)
  monkeypatch.setattr(limits, "memory_budget", lambda: 100 * cache)
  out = generate(tiny_target, [[1, 2, 3]] * 2, max_new_tokens=2, max_len=ml)
  assert np.asarray(out.lengths).tolist() == [2, 2]


class _Device:
  def __init__(self, stats):
    self.stats = stats

  def memory_stats(self):
    return self.stats


def test_memory_budget_is_what_is_free(tmp_path, monkeypatch):
  """The budget is the memory still free, not the device's size: an accelerator's limit less
  its bytes in use (the weights are resident), the host's `MemAvailable` on the CPU."""
  gib = 2**30
  assert limits.memory_budget(_Device({"bytes_limit": 80 * gib, "bytes_in_use": 60 * gib})) \
      == 20 * gib
  assert limits.memory_budget(_Device({"bytes_limit": 8 * gib, "bytes_in_use": 9 * gib})) == 0
  meminfo = tmp_path / "meminfo"
  meminfo.write_text("MemTotal:       24000000 kB\nMemFree:         1000000 kB\n"
                     "MemAvailable:    3000000 kB\n")
  assert limits.memory_budget(_Device(None), str(meminfo)) == 3000000 * 1024
  # No MemAvailable line (old kernels): the free pages, never the total.
  meminfo.write_text("MemTotal:       24000000 kB\n")
  pages = {"SC_PAGE_SIZE": 4096, "SC_AVPHYS_PAGES": 1000, "SC_PHYS_PAGES": 6000000}
  monkeypatch.setattr(limits.os, "sysconf", lambda name: pages[name])
  assert limits.memory_budget(_Device(None), str(meminfo)) == 4096 * 1000


def test_host_check_counts_the_kept_cache_as_free(tiny_target, monkeypatch):
  """The engine keeps a call's cache for the next one of its shapes, so that memory is not
  counted as taken: a budget that holds the run only with the kept buffers freed admits the
  second call, and refuses it once the buffers are released."""
  from jaxspec.engine import DEFAULT
  seen = []
  check = limits.check_working_set
  monkeypatch.setattr(limits, "check_working_set",
                      lambda ws, *a, **kw: (seen.append(ws), check(ws, *a, **kw))[1])
  prompts = [[1, 2, 3]] * 4
  generate(tiny_target, prompts, max_new_tokens=8)
  held = DEFAULT.held_bytes()
  assert 0 < held <= seen[-1].cache  # the k and v buffers; the estimate adds the lengths
  monkeypatch.setattr(limits, "memory_budget", lambda: seen[-1].total - held // 2)
  out = generate(tiny_target, prompts, max_new_tokens=8)
  assert np.asarray(out.lengths).tolist() == [8] * 4
  DEFAULT.release_cache_buffers()
  with pytest.raises(ValueError, match="generating 4 rows.*GiB the device has free"):
    generate(tiny_target, prompts, max_new_tokens=8)


def test_runs_that_make_their_own_cache_free_the_kept_one_first(tiny_target, monkeypatch):
  """A stream and an own model's run allocate their own cache: the kept buffers of the last
  call are freed before them, and their memory check does not count those bytes as free (it
  did, while they stayed held: the same memory counted twice)."""
  from jaxspec.decoding.protocol import as_target
  from jaxspec.engine import DEFAULT
  held_seen = []
  check = limits.check_working_set
  monkeypatch.setattr(limits, "check_working_set",
                      lambda ws, *a, held=0, **kw: (held_seen.append(held),
                                                    check(ws, *a, held=held, **kw))[1])
  prompts = [[1, 2, 3]] * 4
  for run in (lambda: list(generate_stream(tiny_target, prompts, max_new_tokens=8, chunk=4)),
              lambda: generate(as_target(tiny_target), prompts, max_new_tokens=8)):
    generate(tiny_target, prompts, max_new_tokens=8)
    assert DEFAULT.held_bytes() > 0
    run()
    assert held_seen[-1] == 0 and DEFAULT.held_bytes() == 0
  generate(tiny_target, prompts, max_new_tokens=8)  # reuses what it keeps: counted free
  generate(tiny_target, prompts, max_new_tokens=8)
  assert held_seen[-1] == DEFAULT.held_bytes() > 0
