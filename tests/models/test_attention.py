"""Attention whose work follows the cached length (`jaxspec.models.llama.attention`).

A cache larger than `ATTENTION_BLOCK` positions is read block by block up to the batch's longest
row (an online softmax in a `lax.while_loop` with a traced trip count), a small one whole. The
blocked path must equal the whole read (float32 tolerance) for ragged rows, sliding windows
(static and traced per layer), soft-capping and tree masks, in every family; greedy speculative
decoding must still equal plain decoding; and the compiled decode step must hold no operation
over the cache's full positions axis outside that loop.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.api import generate, speculative_generate
from jaxspec.drafters import NGram
from jaxspec.models import forward, init_cache, init_params, llama, tiny_config
from jaxspec.models.model import Model
from helpers import FAMILIES


def _attend(cfg, block, monkeypatch, *, sliding=None, tree=False, seed=0):
  rng = np.random.default_rng(seed)
  b, t, h, g, k, n_layers, s = 3, 5, 4, 2, 16, 2, 1300
  q = jnp.asarray(rng.normal(size=(b, t, h, k)), jnp.float32)
  kn, vn = (jnp.asarray(rng.normal(size=(b, t, g, k)), jnp.float32) for _ in range(2))
  kc, vc = (jnp.asarray(rng.normal(size=(n_layers, b, g, s, k)), jnp.float32)
            for _ in range(2))
  length = jnp.array([3, 700, 1290])  # ragged: one row inside the first block, one near the end
  pos = length[:, None] + jnp.arange(t)[None]
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  if tree:  # an ancestor-like mask: each token sees itself and some earlier ones
    mask = (mask & jnp.asarray(rng.random((b, t, t)) < 0.6)) | jnp.eye(t, dtype=bool)[None]
  monkeypatch.setattr(llama, "ATTENTION_BLOCK", block)
  f = jax.jit(lambda *a: llama.attention(*a, cfg, sliding=sliding, layer=1))
  return np.asarray(f(q, kn, vn, kc, vc, length, pos, mask))


BASE = dict(num_heads=4, num_kv_heads=2, head_dim=16)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("variant", ["plain", "softcap", "sliding", "sliding-traced-on",
                                     "sliding-traced-off"])
def test_blocked_equals_whole_read(variant, tree, monkeypatch):
  extra = dict(attn_softcap=5.0) if variant == "softcap" else {}
  if variant.startswith("sliding"):
    extra = dict(sliding_window=600)
  cfg = tiny_config(**BASE, **extra)
  sliding = {"sliding-traced-on": jnp.bool_(True),
             "sliding-traced-off": jnp.bool_(False)}.get(variant)
  whole = _attend(cfg, 4096, monkeypatch, sliding=sliding, tree=tree)
  # 512 divides neither 1300 nor the window (the last block is read ending at the cache's end);
  # 100 makes 13 blocks, several of them invisible to the short row.
  for block in (512, 100):
    np.testing.assert_allclose(_attend(cfg, block, monkeypatch, sliding=sliding, tree=tree),
                               whole, atol=2e-6, rtol=1e-5)


def test_window_reads_only_its_blocks(monkeypatch):
  """A sliding layer starts at the block holding the oldest position a window still sees:
  poisoning every cache position before it leaves the output unchanged."""
  cfg = tiny_config(**BASE, sliding_window=200)
  monkeypatch.setattr(llama, "ATTENTION_BLOCK", 128)
  rng = np.random.default_rng(1)
  b, t, s = 2, 3, 2048
  q = jnp.asarray(rng.normal(size=(b, t, 4, 16)), jnp.float32)
  kn, vn = (jnp.asarray(rng.normal(size=(b, t, 2, 16)), jnp.float32) for _ in range(2))
  kc, vc = (rng.normal(size=(1, b, 2, s, 16)).astype(np.float32) for _ in range(2))
  length = jnp.array([1500, 1900])
  pos = length[:, None] + jnp.arange(t)[None]
  mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  f = jax.jit(lambda kc, vc: llama.attention(q, kn, vn, kc, vc, length, pos, mask, cfg,
                                             sliding=True, layer=0))
  out = np.asarray(f(jnp.asarray(kc), jnp.asarray(vc)))
  first = (1500 - 200 + 1) // 128 * 128  # the first block read
  kc[..., :first, :] = np.nan
  vc[..., :first, :] = np.nan
  np.testing.assert_array_equal(np.asarray(f(jnp.asarray(kc), jnp.asarray(vc))), out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_families_blocked_forward(family, monkeypatch):
  """Every family switch (windows, soft-caps, per-layer rotary bases, q/k norms) through the
  whole forward: a 40-token prompt, then 3 tokens over it, blocked (8 positions a block) and
  whole, in both layer layouts."""
  cfg = tiny_config(architecture=family.split("-")[0], **FAMILIES[family])
  params = init_params(cfg, jax.random.key(3), scale=0.2)
  rng = np.random.default_rng(0)
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 40)), jnp.int32)
  more = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 3)), jnp.int32)

  def run(block, scan):
    monkeypatch.setattr(llama, "ATTENTION_BLOCK", block)
    p = llama.with_scan_layers(params, scan)
    cache = init_cache(cfg, 2, 64)
    _, _, cache = jax.jit(lambda p, c: forward(p, prompt, c, cfg, fresh=True))(p, cache)
    cache = dataclasses.replace(cache, length=jnp.array([40, 31]))  # ragged rows
    logits, _, _ = jax.jit(lambda p, c: forward(p, more, c, cfg))(p, cache)
    return np.asarray(logits)

  for scan in (True, False):
    np.testing.assert_allclose(run(8, scan), run(4096, scan), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("scan", [True, False], ids=["stacked", "unrolled"])
def test_speculative_equals_plain_blocked(scan, monkeypatch):
  """Greedy speculative output equals plain output with the cache read in blocks of 16."""
  monkeypatch.setattr(llama, "ATTENTION_BLOCK", 16)
  cfg = tiny_config()
  model = Model(cfg=cfg, params=llama.with_scan_layers(
      init_params(cfg, jax.random.key(5), scale=0.3), scan), name="tiny")
  prompts = [[5, 6, 7, 8, 9, 5, 6, 7] * 5, [10, 11, 12], [7] * 23]
  plain = generate(model, prompts, max_new_tokens=40, stop_ids=())
  spec = speculative_generate(model, NGram(), prompts, max_new_tokens=40, num_draft_tokens=3,
                              stop_ids=())
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  assert spec.stats["tau"] > 1.0  # drafts were accepted: the verify path ran over blocks


_SHAPE = re.compile(r"\b[a-z0-9]+\[([0-9,]*)\]")
_INSTRUCTION = re.compile(r"^(ROOT )?%[\w.\-]+ = (.*)$")


def _full_axis_ops(hlo: str, s_len: int) -> list[str]:
  """Instructions of an optimized HLO module whose result has an axis of `s_len`, other than
  those that pass the cache through (parameters, tuples, loops) or update it in place."""
  passthrough = ("parameter(", "get-tuple-element(", "tuple(", "while(", "bitcast(",
                 "dynamic-update-slice(", "copy-start(", "copy-done(", "opt-barrier(")
  bad = []
  for line in hlo.splitlines():
    m = _INSTRUCTION.match(line.strip())
    if m is None:  # computation headers, braces, metadata
      continue
    rhs = m.group(2)
    result_type = rhs.split("(", 1)[0] if "(" in rhs else rhs
    if not any(str(s_len) in dims.split(",") for dims in _SHAPE.findall(result_type)):
      continue
    # An in-place update is a dynamic-update-slice or a fusion rooted in one (named after it).
    if any(p in rhs for p in passthrough) or "dynamic-update-slice" in line.split("=", 1)[0]:
      continue
    bad.append(line.strip()[:160])
  return bad


def _decode_step_hlo(scan: bool, s_len: int) -> str:
  cfg = tiny_config()
  params = llama.with_scan_layers(init_params(cfg, jax.random.key(0)), scan)
  cache = dataclasses.replace(init_cache(cfg, 2, s_len), length=jnp.array([100, 7]))
  step = jax.jit(lambda p, tok, c: forward(p, tok, c, cfg), donate_argnums=2)
  return step.lower(params, jnp.zeros((2, 1), jnp.int32), cache).compile().as_text()


@pytest.mark.parametrize("scan", [True, False], ids=["stacked", "unrolled"])
def test_decode_step_reads_no_full_cache(scan, monkeypatch):
  """The compiled one-token step over a cache of 4,099 positions (a size no other axis has):
  no instruction yields an array over all 4,099 positions besides the cache passing through
  and its in-place update. The same check finds the whole read when the block is made larger
  than the cache (so it can fail)."""
  s_len = 4099
  assert _full_axis_ops(_decode_step_hlo(scan, s_len), s_len) == []
  monkeypatch.setattr(llama, "ATTENTION_BLOCK", 8192)
  assert _full_axis_ops(_decode_step_hlo(scan, s_len), s_len) != []
