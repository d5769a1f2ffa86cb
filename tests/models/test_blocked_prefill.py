"""The blocked prefill: attention within a new block longer than `ATTENTION_BLOCK` (a prefill,
`forward(fresh=True)`) tile by tile under an online softmax (`llama._blocked_prefill`).

It must equal the dense [T, T] product (float32 tolerance) for ragged rows, arbitrary masks
(packed documents), sliding windows (static and traced per layer), soft-capping, GQA ratios and
lengths that are not a multiple of the block; skip the key blocks above the causal diagonal and
outside a window; keep greedy decoding's tokens and the gradients of the dense path; and leave a
short prefill's program as it was. The block is made small (monkeypatched) so prompts stay small.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import decode, functional
from jaxspec.models import forward, init_cache, init_params, llama, tiny_config
from jaxspec.models.model import Model
from helpers import FAMILIES

DENSE = 1 << 20  # a threshold above every test's length: the dense product


def _inputs(cfg, b, t, seed=0):
  rng = np.random.default_rng(seed)
  h, g, k = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  q = rng.normal(size=(b, t, h, k)).astype(np.float32)
  kn, vn = (rng.normal(size=(b, t, g, k)).astype(np.float32) for _ in range(2))
  return q, kn, vn


def _prefill_attention(cfg, block, q, kn, vn, mask, monkeypatch, sliding=None):
  """`attention` over an empty cache (a prefill) with `block` positions a block."""
  b, t = q.shape[:2]
  monkeypatch.setattr(llama, "ATTENTION_BLOCK", block)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  f = jax.jit(lambda q, kn, vn, mask: llama.attention(
      q, kn, vn, None, None, jnp.zeros((b,), jnp.int32), pos, mask, cfg, sliding=sliding))
  return np.asarray(f(jnp.asarray(q), jnp.asarray(kn), jnp.asarray(vn), jnp.asarray(mask)))


def _causal(b, t):
  return np.broadcast_to(np.tril(np.ones((t, t), bool)), (b, t, t))


@pytest.mark.parametrize("variant", ["plain", "softcap", "sliding", "sliding-traced-on",
                                     "sliding-traced-off", "gqa1", "gqa6", "packed"])
@pytest.mark.parametrize("t", [64, 75], ids=["multiple", "not-multiple"])
def test_blocked_equals_dense(variant, t, monkeypatch):
  """Blocks of 16 (and of 40: a last block read ending at T) against the dense product."""
  heads = dict(gqa1=dict(num_heads=2, num_kv_heads=2), gqa6=dict(num_heads=6, num_kv_heads=1))
  extra = heads.get(variant, dict(num_heads=4, num_kv_heads=2))
  if variant == "softcap":
    extra["attn_softcap"] = 5.0
  if variant.startswith("sliding"):
    extra["sliding_window"] = 20
  cfg = tiny_config(head_dim=16, **extra)
  sliding = {"sliding-traced-on": jnp.bool_(True),
             "sliding-traced-off": jnp.bool_(False)}.get(variant)
  b = 3
  q, kn, vn = _inputs(cfg, b, t)
  mask = _causal(b, t)
  if variant == "packed":  # documents packed in a row: causal within each, ragged per row
    doc = np.stack([np.arange(t) // 23, np.arange(t) // 50, np.zeros(t, int)])
    mask = mask & (doc[:, :, None] == doc[:, None, :])
  dense = _prefill_attention(cfg, DENSE, q, kn, vn, mask, monkeypatch, sliding)
  for block in (16, 40):
    np.testing.assert_allclose(
        _prefill_attention(cfg, block, q, kn, vn, mask, monkeypatch, sliding), dense,
        atol=2e-6, rtol=1e-5)


def test_skips_blocks_above_the_diagonal_and_outside_the_window(monkeypatch):
  """Poisoned (NaN) keys and values in the key blocks a query block never sees leave its
  output unchanged; the dense product, which multiplies every value, is poisoned by them (so
  the check can fail)."""
  cfg = tiny_config(num_heads=4, num_kv_heads=2, head_dim=16, sliding_window=20)
  b, t, block = 2, 96, 16
  q, kn, vn = _inputs(cfg, b, t, seed=1)
  mask = _causal(b, t)

  def poisoned(lo, hi):
    k2, v2 = kn.copy(), vn.copy()
    k2[:, lo:hi], v2[:, lo:hi] = np.nan, np.nan
    return k2, v2

  # Causal: the last key block is read by the last query block only.
  clean = _prefill_attention(cfg, block, q, kn, vn, mask, monkeypatch, sliding=False)
  out = _prefill_attention(cfg, block, q, *poisoned(t - block, t), mask, monkeypatch,
                           sliding=False)
  np.testing.assert_array_equal(out[:, :t - block], clean[:, :t - block])
  assert np.isnan(out[:, t - block:]).all()
  # A window of 20: query block [80, 96) sees keys from 61 on, blocks [48, 96) only.
  clean = _prefill_attention(cfg, block, q, kn, vn, mask, monkeypatch, sliding=True)
  out = _prefill_attention(cfg, block, q, *poisoned(0, 48), mask, monkeypatch, sliding=True)
  np.testing.assert_array_equal(out[:, 80:], clean[:, 80:])
  dense = _prefill_attention(cfg, DENSE, q, *poisoned(0, 48), mask, monkeypatch, sliding=True)
  assert np.isnan(dense[:, 80:]).all()


WINDOWED = ["gemma2", "gemma3"]


# Every family with stacked layers (the sliding switch traced in the scan), and Gemma 3 (sliding
# and global layers, q/k norms) unrolled too (the switch static per layer); the other families'
# unrolled forms under -m slow: the blocked attention inside a layer is the same code either way.
@pytest.mark.parametrize("family,scan", [
    pytest.param(f, s, id=f"{f}-{'stacked' if s else 'unrolled'}",
                 marks=() if s or f == "gemma3" else pytest.mark.slow)
    for f in ["llama"] + WINDOWED + ["mistral"] for s in (True, False)])
def test_forward_prefill_equals_dense(family, scan, monkeypatch):
  """A right-padded ragged prefill of 45 positions through the whole forward (mixed sliding
  and global layers, soft-caps, q/k norms): every position's logits and the written cache equal
  the dense prefill's, blocks of 16."""
  extra = dict(FAMILIES.get(family, {}))
  if family == "mistral":
    extra = dict(sliding_window=7)
  arch = "llama" if family == "mistral" else family
  cfg = tiny_config(architecture=arch, **extra)
  params = llama.with_scan_layers(init_params(cfg, jax.random.key(3), scale=0.2), scan)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 45)), jnp.int32)
  lens = jnp.array([45, 12], jnp.int32)

  def run(block):
    monkeypatch.setattr(llama, "ATTENTION_BLOCK", block)
    logits, _, cache = jax.jit(lambda p, tok: forward(
        p, tok, init_cache(cfg, 2, 64), cfg, fresh=True, seq_lengths=lens))(params, tokens)
    return np.asarray(logits), np.asarray(cache.k), np.asarray(cache.v)

  for got, want in zip(run(16), run(DENSE)):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_greedy_decode_with_a_long_prompt_unchanged(family, monkeypatch):
  """Greedy tokens after ragged prompts of 70 and 33 tokens, prefilled (and the cache read) in
  blocks of 16, equal the dense path's."""
  cfg = tiny_config(architecture=family, **FAMILIES.get(family, {}))
  model = Model(cfg=cfg, params=init_params(cfg, jax.random.key(5), scale=0.3), name="tiny")
  rng = np.random.default_rng(2)
  prompt = jnp.asarray(rng.integers(3, cfg.vocab_size, (2, 70)), jnp.int32)
  lens = jnp.array([70, 33], jnp.int32)

  def run(block):
    monkeypatch.setattr(llama, "ATTENTION_BLOCK", block)
    # The block is read while tracing, and decode's program is cached by its arguments alone:
    # without this the second run would reuse the first's program.
    functional._decode_jit.clear_cache()
    return np.asarray(decode(model, prompt, lens, 0, max_new_tokens=24, stop_ids=()).tokens)

  blocked, dense = run(16), run(DENSE)
  np.testing.assert_array_equal(blocked, dense)
  assert len(set(blocked[0].tolist())) > 3  # a varied continuation, not one repeated token


# Gemma 2 (soft-caps, sliding layers) with stacked layers and Llama unrolled by default, the other
# two under -m slow: each layout and the windowed attention's gradient stay in the default run.
@pytest.mark.parametrize("family,scan", [
    ("gemma2", True), ("llama", False),
    pytest.param("llama", True, marks=pytest.mark.slow),
    pytest.param("gemma2", False, marks=pytest.mark.slow)],
    ids=["gemma2-stacked", "llama-unrolled", "llama-stacked", "gemma2-unrolled"])
def test_gradients_equal_dense(family, scan, monkeypatch):
  """jax.grad of a next-token loss through a 50-token prefill-like forward (as the training
  code differentiates) equals the dense path's, for every weight."""
  cfg = tiny_config(architecture=family, **FAMILIES.get(family, {}))
  params = llama.with_scan_layers(init_params(cfg, jax.random.key(7), scale=0.2), scan)
  rng = np.random.default_rng(3)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 50)), jnp.int32)

  def loss(p):
    logits, _, _ = forward(p, tokens[:, :-1], init_cache(cfg, 2, 49), cfg, fresh=True)
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], -1).mean()

  def run(block):
    monkeypatch.setattr(llama, "ATTENTION_BLOCK", block)
    return jax.jit(jax.value_and_grad(loss))(params)

  (l_blk, g_blk), (l_dense, g_dense) = run(16), run(DENSE)
  np.testing.assert_allclose(l_blk, l_dense, rtol=1e-6)
  for got, want in zip(jax.tree.leaves(g_blk), jax.tree.leaves(g_dense)):
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=1e-4)


def _prefill_text(cfg, t, compiled=False):
  params = init_params(cfg, jax.random.key(0))
  tokens = jnp.zeros((2, t), jnp.int32)
  low = jax.jit(lambda p, tok: forward(p, tok, init_cache(cfg, 2, t), cfg, fresh=True)
                ).lower(params, tokens)
  return low.compile().as_text() if compiled else low.as_text()


def test_short_prefill_program_is_the_dense_one(monkeypatch):
  """A prefill of at most `ATTENTION_BLOCK` tokens lowers to the very program of the dense
  product; a longer one adds two loops."""
  cfg = tiny_config()
  monkeypatch.setattr(llama, "ATTENTION_BLOCK", 32)
  short, long = _prefill_text(cfg, 32), _prefill_text(cfg, 33)
  monkeypatch.setattr(llama, "ATTENTION_BLOCK", DENSE)
  assert short == _prefill_text(cfg, 32)
  loops = lambda text: text.count("stablehlo.while")
  # The layers are stacked (one scan body): one loop over query blocks, one over key blocks.
  assert loops(long) == loops(short) + 2


_SHAPE = re.compile(r"\[([0-9,]+)\]")


def test_long_prefill_holds_no_square_scores(monkeypatch):
  """The compiled blocked prefill of 1,000 positions (a size no other axis has) holds no
  array with two axes of at least 1,000 (a [T, T] score or probability array); the dense one
  does (so the check can fail)."""
  cfg = tiny_config()
  t = 1000

  def square(text):
    return [d for d in _SHAPE.findall(text)
            if sum(int(x) >= t for x in d.split(",")) >= 2]

  monkeypatch.setattr(llama, "ATTENTION_BLOCK", 128)
  assert square(_prefill_text(cfg, t, compiled=True)) == []
  monkeypatch.setattr(llama, "ATTENTION_BLOCK", DENSE)
  assert square(_prefill_text(cfg, t, compiled=True)) != []


def test_gradient_memory_follows_the_tiles(monkeypatch):
  """Differentiated, the blocked prefill recomputes each tile's scores in the backward pass
  rather than keeping them: the compiled gradient of a 1,024-token forward needs under a
  quarter of the dense one's temporary memory (35 MiB against 323; keeping every tile's
  probabilities needs about as much as the dense product)."""
  cfg = tiny_config()
  params = init_params(cfg, jax.random.key(0))
  tokens = jnp.zeros((2, 1024), jnp.int32)

  def temp(block):
    monkeypatch.setattr(llama, "ATTENTION_BLOCK", block)
    loss = lambda p: forward(p, tokens, init_cache(cfg, 2, 1024), cfg, fresh=True,
                             logits=False)[1].final.sum()
    compiled = jax.jit(jax.grad(loss)).lower(params).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  blocked, dense = temp(128), temp(DENSE)
  assert blocked < dense / 4, (blocked, dense)
