"""The memory check: the estimate of a run's whole working set against what XLA's compiled
programs allocate, and refusals before anything compiles (the functional core as the host
wrappers)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import generate
from jaxspec.decoding import functional as F
from jaxspec.decoding import limits, protocol
from jaxspec.decoding.loop import costs_array, resolve_policy
from jaxspec.drafters import NGram
from jaxspec.models import init_params, tiny_config
from jaxspec.models.model import Model
from jaxspec.sampling import sampling_arrays


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
                   max_len=p + n, stop_ids=(), pad_id=0, logprobs=True)
  assert 0.75 < est.total / got < 1.25, (est, got)
  policy = dataclasses.replace(resolve_policy(k, None, NGram()), logprobs=True)
  ml = p + n + k + 1
  est = F.spec_working_set(tgt, NGram(), None, policy, b, p, n, ml)
  got = _allocated(F._speculative_jit, tgt, None, prompt, lens, key, jnp.int32(n), sp,
                   costs_array(policy, None), drafter=NGram(), policy=policy, capacity=n,
                   max_len=ml, stop_ids=(), pad_id=0)
  assert 0.75 < est.total / got < 1.25, (est, got)


@pytest.fixture
def no_compile(monkeypatch):
  """The functional core's jitted programs fail the test if they are reached."""
  def fail(*a, **k):
    raise AssertionError("compiled before the size check")
  monkeypatch.setattr(F, "_decode_jit", fail)
  monkeypatch.setattr(F, "_speculative_jit", fail)


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
