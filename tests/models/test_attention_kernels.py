"""The Pallas kernels behind `llama.attention` (`jaxspec.models.attention_kernels`).

Each kernel, run in Pallas' interpreter on this CPU, must equal XLA's blocked read (float32
tolerance) for ragged rows, grouped queries, sliding windows (static and traced per layer),
soft-capping and tree masks; a shape a kernel does not take must fall back to XLA's read; the
decode and speculative programs exported from this CPU for TPUs and CUDA GPUs must carry the
kernels' custom calls; and the CPU's compiled program must be the one XLA's read gives.
"""

from __future__ import annotations

import collections
import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from jaxspec.api import generate, speculative_generate
from jaxspec.decoding import decode, speculative_decode
from jaxspec.drafters import NGram
from jaxspec.models import forward, init_cache, init_params, llama, tiny_config
from jaxspec.models.hf_loader import check_savable
from jaxspec.models.model import Model
from jaxspec.sharding.rules import make_mesh, shard_model

TRITON_CALL = "__gpu$xla.gpu.triton"
MOSAIC_CALL = "tpu_custom_call"
BASE = dict(num_heads=4, num_kv_heads=2, head_dim=16)


def _inputs(k=16, s=700, t=5, tree=False, seed=0):
  rng = np.random.default_rng(seed)
  b, h, g, n_layers = 3, 4, 2, 2
  q = jnp.asarray(rng.normal(size=(b, t, h, k)), jnp.float32)
  kn, vn = (jnp.asarray(rng.normal(size=(b, t, g, k)), jnp.float32) for _ in range(2))
  kc, vc = (jnp.asarray(rng.normal(size=(n_layers, b, g, s, k)), jnp.float32)
            for _ in range(2))
  # Ragged: an empty row, one in the middle, one a few positions short of the cache's end.
  length = jnp.array([0, 300, s - t - 3])
  pos = length[:, None] + jnp.arange(t)[None]
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  if tree:  # an ancestor-like mask: each token sees itself and some earlier ones
    mask = (mask & jnp.asarray(rng.random((b, t, t)) < 0.6)) | jnp.eye(t, dtype=bool)[None]
  return q, kn, vn, kc, vc, length, pos, mask


def _attend(cfg, kernel, args, sliding=None):
  f = jax.jit(lambda *a: llama.attention(*a, cfg, sliding=sliding, layer=1, kernel=kernel))
  return np.asarray(f(*args))


@pytest.mark.parametrize("kernel", ["triton_interpret", "mosaic_interpret"])
@pytest.mark.parametrize("variant", ["chain", "softcap-tree", "sliding", "sliding-traced-on",
                                     "sliding-traced-off", "decode"])
def test_kernel_equals_xla_read(kernel, variant):
  """700 positions: the Triton kernel walks 11 blocks of 64 in 11 splits, the Mosaic kernel two
  blocks of 512, the second past the cache's end."""
  extra = {"softcap-tree": dict(attn_softcap=5.0)}.get(variant, {})
  if variant.startswith("sliding"):
    extra = dict(sliding_window=200)  # row 3 sees its last 200 positions only
  cfg = tiny_config(**BASE, **extra)
  sliding = {"sliding-traced-on": jnp.bool_(True),
             "sliding-traced-off": jnp.bool_(False)}.get(variant)
  args = _inputs(tree=variant == "softcap-tree", t=1 if variant == "decode" else 5)
  np.testing.assert_allclose(_attend(cfg, kernel, args, sliding),
                             _attend(cfg, "xla", args, sliding), atol=2e-6, rtol=1e-5)


def test_kernels_read_only_visible_blocks():
  """Poisoning (NaN) every cache position a row cannot see, before a sliding window and past
  each row's length, leaves both kernels' outputs finite and equal to the clean cache's."""
  cfg = tiny_config(**BASE, sliding_window=200)
  q, kn, vn, kc, vc, length, pos, mask = _inputs()
  p = jnp.arange(kc.shape[3])
  oldest = jnp.maximum(pos.min(axis=1) - 200 + 1, 0)
  hidden = (p[None] >= length[:, None]) | (p[None] < oldest[:, None])  # [B, S]
  poison = lambda c: jnp.where(hidden[None, :, None, :, None], jnp.nan, c)
  for kernel in ("triton_interpret", "mosaic_interpret"):
    clean = _attend(cfg, kernel, (q, kn, vn, kc, vc, length, pos, mask), sliding=True)
    dirty = _attend(cfg, kernel, (q, kn, vn, poison(kc), poison(vc), length, pos, mask),
                    sliding=True)
    assert np.isfinite(clean).all()
    np.testing.assert_array_equal(dirty, clean)


def _uses_pallas(cfg, kernel, k):
  args = _inputs(k=k)
  jaxpr = jax.make_jaxpr(lambda *a: llama.attention(*a, cfg, layer=1, kernel=kernel))(*args)
  return "pallas_call" in str(jaxpr)


def test_shapes_the_triton_kernel_does_not_take_use_the_xla_read():
  """Triton's tiles are powers of two: a head of 24 is read by XLA (and still right); a head of
  16 by the kernel."""
  cfg24 = tiny_config(num_heads=4, num_kv_heads=2, head_dim=24)
  assert not _uses_pallas(cfg24, "triton_interpret", 24)
  assert _uses_pallas(tiny_config(**BASE), "triton_interpret", 16)
  assert _uses_pallas(cfg24, "mosaic_interpret", 24)  # Mosaic takes any head size
  args = _inputs(k=24)
  np.testing.assert_array_equal(_attend(cfg24, "triton_interpret", args),
                                _attend(cfg24, "xla", args))


def _exported(fn, args, platform: str) -> str:
  exp = export.export(jax.jit(fn), platforms=(platform,),
                      disabled_checks=[export.DisabledSafetyCheck.custom_call(TRITON_CALL)])
  return exp(*args).mlir_module()


def _programs(cfg):
  """The plain and speculative decoding programs of a tiny model, as (function, arguments)."""
  model = Model(cfg=cfg, params=init_params(cfg, jax.random.key(0)), name="tiny")
  ids = jnp.asarray([[5, 6, 7, 8, 5, 6], [9, 10, 11, 0, 0, 0]], jnp.int32)
  lens = jnp.asarray([6, 3], jnp.int32)
  # A 64-position cache: at least the 16 positions a Triton block needs.
  plain = lambda params, ids, lens: decode(model, ids, lens, 0, max_new_tokens=8, max_len=64,
                                           target_params=params).tokens
  spec = lambda params, ids, lens: speculative_decode(
      model, NGram(), ids, lens, 0, max_new_tokens=8, num_draft_tokens=3, max_len=64,
      target_params=params).tokens
  return {"decode": (plain, (model.params, ids, lens)),
          "speculative": (spec, (model.params, ids, lens))}


@pytest.mark.optimized
@pytest.mark.parametrize("program", ["decode", "speculative"])
def test_exported_programs_carry_the_platform_kernel(program):
  """Lowered from this CPU for a TPU the program holds Mosaic kernels, for CUDA Triton ones,
  for the CPU neither; with attention_kernel="xla", no platform's does."""
  fn, args = _programs(tiny_config(**BASE))[program]
  tpu, cuda, cpu = (_exported(fn, args, p) for p in ("tpu", "cuda", "cpu"))
  assert MOSAIC_CALL in tpu and TRITON_CALL not in tpu
  assert TRITON_CALL in cuda and MOSAIC_CALL not in cuda
  assert MOSAIC_CALL not in cpu and TRITON_CALL not in cpu
  assert "jaxspec_cache_attention" in tpu and "jaxspec_cache_attention" in cuda  # ours
  fn, args = _programs(tiny_config(**BASE, attention_kernel="xla"))[program]
  for p in ("tpu", "cuda"):
    text = _exported(fn, args, p)
    assert MOSAIC_CALL not in text and TRITON_CALL not in text


_OP = re.compile(r"= ([a-z0-9]+\[[0-9,]*\])\S* ([a-z\-]+)\(")


def _compiled_step(kernel: str, scan: bool, s_len: int) -> collections.Counter:
  """The CPU's optimized decode step as a multiset of (result shape, operation): names, source
  lines and the order of a loop's carried tuple aside (the kernels' branches of
  `platform_dependent` can reorder the values a scan's loop carries, nothing else)."""
  cfg = tiny_config(sliding_window=200, attn_softcap=5.0, attention_kernel=kernel)
  params = llama.with_scan_layers(init_params(cfg, jax.random.key(0)), scan)
  cache = dataclasses.replace(init_cache(cfg, 2, s_len), length=jnp.array([100, 7]))
  step = jax.jit(lambda p, tok, c: forward(p, tok, c, cfg), donate_argnums=2)
  text = step.lower(params, jnp.zeros((2, 3), jnp.int32), cache).compile().as_text()
  ops = collections.Counter(_OP.findall(text))
  for skip in ("get-tuple-element", "tuple", "parameter"):
    ops = collections.Counter({k: n for k, n in ops.items() if k[1] != skip})
  return ops


@pytest.mark.parametrize("scan", [True, False], ids=["stacked", "unrolled"])
def test_cpu_program_is_xla_read(scan):
  """On the CPU "auto" compiles to XLA's read, operation for operation, for a cache read whole
  (300) and one read in blocks (700)."""
  for s_len in (300, 700):
    auto = _compiled_step("auto", scan, s_len)
    assert auto == _compiled_step("xla", scan, s_len)
    assert not any(op == "custom-call" for _, op in auto) and sum(auto.values()) > 100
    # The shapes parse: the write of the cache, or (every layer sliding, a window of 200) of
    # the ring buffers where they are smaller than the cache.
    slots = llama.ring_size(tiny_config(sliding_window=200), s_len) or s_len
    assert ("f32[2,2,2,%d,16]" % slots, "dynamic-update-slice") in auto


@pytest.mark.parametrize("kernel", ["triton_interpret", "mosaic_interpret"])
def test_speculative_equals_plain_with_kernel(kernel):
  """Greedy speculative output equals plain output with every cache read by the kernel."""
  cfg = tiny_config(attention_kernel=kernel)
  model = Model(cfg=cfg, params=init_params(cfg, jax.random.key(5), scale=0.3), name="tiny")
  prompts = [[5, 6, 7, 8, 9, 5, 6, 7] * 5, [10, 11, 12], [7] * 23]
  plain = generate(model, prompts, max_new_tokens=24, stop_ids=())
  spec = speculative_generate(model, NGram(), prompts, max_new_tokens=24, num_draft_tokens=3,
                              stop_ids=())
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  assert spec.stats["tau"] > 1.0  # drafts were accepted: the verify width went through it


def test_attention_kernel_is_checked_and_not_saved():
  with pytest.raises(ValueError, match="attention_kernel 'cuda' is not supported"):
    tiny_config(attention_kernel="cuda")
  with pytest.raises(ValueError, match="attention kernel 'fast' is not one of"):
    llama.attention(*_inputs(), tiny_config(**BASE), layer=1, kernel="fast")
  check_savable(tiny_config(attention_kernel="xla"))  # a run-time choice, like compute_dtype


def test_a_sharded_model_reads_by_xla():
  """XLA cannot partition a kernel's custom call (it would gather the cache onto every device):
  a model sharded over several devices takes XLA's read, one on a single device keeps "auto"."""
  cfg = tiny_config()
  model = Model(cfg=cfg, params=init_params(cfg, jax.random.key(0)), name="tiny")
  sharded = shard_model(model, make_mesh({"data": 4, "model": 2}))
  assert sharded.cfg == dataclasses.replace(cfg, attention_kernel="xla")
  one = shard_model(model, make_mesh({"data": 1, "model": 1}, devices=jax.devices()[:1]))
  assert one.cfg == cfg
