"""The model and its cache: consistency, rollback, ragged rows, rotary scaling, variants."""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import (LlamaConfig, RopeScaling, forward, init_cache, init_params,
                            tiny_config)
from jaxspec.models.llama import rope_inv_freq

fwd = jax.jit(forward, static_argnames=("cfg", "hidden_layers", "logits"))


def _model(**over):
  cfg = tiny_config(**over)
  return cfg, init_params(cfg, jax.random.key(1), scale=0.2)


@pytest.mark.parametrize("variant", [{}, {"attention_bias": True},
                                     {"sliding_window": 5}, {"tie_embeddings": True},
                                     {"rope_scaling": RopeScaling(factor=8.0,
                                                                  original_max_position_embeddings=64)}])
def test_token_by_token_equals_full_forward(variant):
  cfg, params = _model(**variant)
  toks = jax.random.randint(jax.random.key(2), (2, 12), 0, cfg.vocab_size)
  full, _, c = fwd(params, toks, init_cache(cfg, 2, 32), cfg)
  np.testing.assert_array_equal(c.length, [12, 12])
  cache = init_cache(cfg, 2, 32)
  steps = []
  for t in range(12):
    lg, _, cache = fwd(params, toks[:, t:t + 1], cache, cfg)
    steps.append(lg)
  np.testing.assert_allclose(np.concatenate(steps, 1), full, atol=2e-5)


def test_rollback_is_complete():
  """Entries written past the length and rolled back are never read: 8 junk tokens, rolled
  back, then 4 real ones (positions 10-13 still hold junk keys and values)."""
  cfg, params = _model()
  toks = jax.random.randint(jax.random.key(3), (1, 10), 0, cfg.vocab_size)
  junk = jax.random.randint(jax.random.key(4), (1, 8), 0, cfg.vocab_size)
  _, _, c = fwd(params, toks[:, :6], init_cache(cfg, 1, 32), cfg)
  _, _, c_junk = fwd(params, junk, c, cfg)  # written past...
  c_back = dataclasses.replace(c_junk, length=c_junk.length - 8)  # ...and rolled back
  l_back, _, _ = fwd(params, toks[:, 6:], c_back, cfg)
  l_ref, _, _ = fwd(params, toks[:, 6:], c, cfg)
  np.testing.assert_allclose(l_back, l_ref, atol=1e-6)


def test_ragged_rows_match_rows_alone():
  cfg, params = _model()
  a = jax.random.randint(jax.random.key(5), (1, 9), 0, cfg.vocab_size)
  b = jax.random.randint(jax.random.key(6), (1, 4), 0, cfg.vocab_size)
  # Prefill both rows padded to 9, roll row 1 back to its true length 4.
  batch = jnp.concatenate([a, jnp.pad(b, ((0, 0), (0, 5)))], 0)
  _, _, c = fwd(params, batch, init_cache(cfg, 2, 32), cfg)
  c = dataclasses.replace(c, length=jnp.array([9, 4], jnp.int32))
  nxt = jax.random.randint(jax.random.key(7), (2, 3), 0, cfg.vocab_size)
  lb, _, c2 = fwd(params, nxt, c, cfg)
  np.testing.assert_array_equal(c2.length, [12, 7])
  for row, pre in enumerate([a, b]):
    _, _, ci = fwd(params, pre, init_cache(cfg, 1, 32), cfg)
    li, _, _ = fwd(params, nxt[row:row + 1], ci, cfg)
    np.testing.assert_allclose(lb[row], li[0], atol=2e-5)


def test_hidden_layers_are_layer_outputs():
  cfg, params = _model(num_layers=3)
  toks = jax.random.randint(jax.random.key(8), (1, 5), 0, cfg.vocab_size)
  _, h, _ = fwd(params, toks, init_cache(cfg, 1, 16), cfg, hidden_layers=(0, 2))
  assert h.layers.shape == (2, 1, 5, cfg.hidden_size)
  from jaxspec.models.llama import rms_norm
  np.testing.assert_allclose(rms_norm(h.layers[1], params.final_norm, cfg.rms_norm_eps), h.final,
                             atol=1e-5)
  one = dataclasses.replace(cfg, num_layers=1)
  p1 = dataclasses.replace(params, layers=jax.tree.map(lambda x: x[:1], params.layers))
  _, h1, _ = fwd(p1, toks, init_cache(one, 1, 16), one, hidden_layers=(0,))
  np.testing.assert_allclose(h1.layers[0], h.layers[0], atol=1e-5)
  # Repeats and negative indices (from the last layer), scanned and unrolled: only the layers
  # asked for are kept (not every layer's output stacked), in the order asked. Unrolled layers
  # are other programs, which may round differently (1.4e-5 seen on a unit-sized entry).
  from jaxspec.models.llama import with_scan_layers
  for p in (params, with_scan_layers(params, False)):
    _, hr, _ = fwd(p, toks, init_cache(cfg, 1, 16), cfg, hidden_layers=(2, 0, 2, -3))
    np.testing.assert_allclose(hr.layers, h.layers[jnp.array([1, 0, 1, 0])], rtol=1e-4, atol=1e-4)


def test_llama3_rope_scaling_matches_reference_formula():
  s = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                  original_max_position_embeddings=8192)
  cfg = LlamaConfig(vocab_size=8, hidden_size=128, intermediate_size=8, num_layers=1,
                    num_heads=1, num_kv_heads=1, head_dim=128, rope_theta=500000.0,
                    rope_scaling=s)
  # Hugging Face's _compute_llama3_parameters, written out in numpy.
  base = 1.0 / (500000.0 ** (np.arange(0, 128, 2, dtype=np.float64) / 128))
  low_wl, high_wl = 8192 / 1.0, 8192 / 4.0
  out = []
  for f in base:
    wl = 2 * math.pi / f
    if wl < high_wl:
      out.append(f)
    elif wl > low_wl:
      out.append(f / 8.0)
    else:
      sm = (8192 / wl - 1.0) / (4.0 - 1.0)
      out.append((1 - sm) * f / 8.0 + sm * f)
  np.testing.assert_allclose(rope_inv_freq(cfg), np.array(out), rtol=1e-5)


def test_bfloat16_close_to_float32():
  cfg, params = _model()
  cfg16 = dataclasses.replace(cfg, dtype="bfloat16")
  p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
  toks = jax.random.randint(jax.random.key(9), (1, 8), 0, cfg.vocab_size)
  l32, _, _ = fwd(params, toks, init_cache(cfg, 1, 16), cfg)
  l16, _, c16 = fwd(p16, toks, init_cache(cfg16, 1, 16), cfg16)
  assert c16.k.dtype == jnp.bfloat16 and l16.dtype == jnp.float32
  # bfloat16 keeps ~3 significant digits: relative error of a few percent of the logit scale.
  err = np.abs(np.asarray(l16) - np.asarray(l32)).max() / np.abs(np.asarray(l32)).max()
  assert err < 0.05, err


def test_config_rejects_bad_gqa_and_dtype():
  with pytest.raises(ValueError, match="num_kv_heads"):
    tiny_config(num_heads=4, num_kv_heads=3)
  with pytest.raises(ValueError, match="dtype"):
    tiny_config(dtype="float16")


# -- layer layout: stacked (lax.scan) or unrolled (one set of weights per layer) --------------------
@pytest.mark.parametrize("output_major", [False, True])
def test_unrolled_layers_match_scanned(output_major):
  # Unrolled with the logical weight layout: bit-identical to the scan. With the output-major
  # layout the CPU backend uses by default: the same weights, outputs equal up to rounding.
  from jaxspec.models.llama import (DEFAULT_OUTPUT_MAJOR, NO_OUTPUT_MAJOR, OutputMajor,
                                    is_scanned, stacked_layers, with_scan_layers)
  cfg, params = _model(num_layers=3, attention_bias=True)
  un = with_scan_layers(params, False,
                        output_major=DEFAULT_OUTPUT_MAJOR if output_major else NO_OUTPUT_MAJOR)
  assert not is_scanned(un) and len(un.layers) == 3 and un.layers[1].wq.shape == (64, 4, 16)
  assert isinstance(un.layers[1].wo, OutputMajor) == output_major
  if output_major:
    assert un.layers[1].wo.w.shape == (64, 4, 16) and un.layers[1].w_down.w.shape == (64, 128)
    np.testing.assert_array_equal(un.layers[1].wo[2, 3], params.layers.wo[1, 2, 3])
  np.testing.assert_array_equal(un.layers[2].w_down, params.layers.w_down[2])
  assert with_scan_layers(un, False) is un
  np.testing.assert_array_equal(stacked_layers(un).wk, params.layers.wk)
  check = (np.testing.assert_array_equal if not output_major else
           functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-4))
  toks = jax.random.randint(jax.random.key(2), (2, 7), 0, cfg.vocab_size)
  cache = init_cache(cfg, 2, 16)
  a = fwd(params, toks, cache, cfg, hidden_layers=(0, 2))
  b = fwd(un, toks, cache, cfg, hidden_layers=(0, 2))
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    check(x, y)
  # a decode step on the filled cache, and the read-only variant a verify branch uses
  step = jnp.array([[3], [5]])
  check(fwd(params, step, a[2], cfg)[0], fwd(un, step, b[2], cfg)[0])
  ro = jax.jit(functools.partial(forward, cfg=cfg, write=False))
  for x, y in zip(jax.tree.leaves(ro(params, step, a[2])), jax.tree.leaves(ro(un, step, b[2]))):
    check(x, y)
  back = with_scan_layers(un, True)
  assert is_scanned(back)
  for name in ("wq", "wo", "w_gate", "w_down", "bq"):
    np.testing.assert_array_equal(getattr(back.layers, name), getattr(params.layers, name))


@pytest.mark.parametrize("layout", ["scanned", "unrolled", "output-major", "int8"])
def test_float32_products_are_full_float32(layout):
  # A float32 model multiplies in float32 on every backend: every product of the forward asks
  # for HIGHEST precision, or XLA's GPU/TPU default (TF32 / bfloat16 passes) makes a verify
  # pass and a decode step round differently and greedy speculation depart from `generate`
  # (seen on an H200). Checked in the lowered program, which is the same on every backend;
  # bfloat16 models keep the backend's default.
  from jaxspec.models import llama
  cfg, params = _model(num_layers=2, tie_embeddings=True)
  unrolled = layout in ("unrolled", "output-major")
  if unrolled:
    params = llama.with_scan_layers(params, False, output_major=(
        llama.DEFAULT_OUTPUT_MAJOR if layout == "output-major" else llama.NO_OUTPUT_MAJOR))
  elif layout == "int8":  # weights dequantized to float32 inside the pass
    from jaxspec.models.quant import quantize
    params = quantize(params, "int8")
  toks = jnp.ones((1, 3), jnp.int32)  # 3 rows: the blocked LM-head and dense forms on CPU

  def dots(p, c, dtype):
    text = jax.jit(functools.partial(forward, cfg=c)).lower(p, toks, init_cache(c, 1, 8, dtype)
                                                            ).as_text()
    lines = [ln for ln in text.splitlines() if "dot_general" in ln]
    return lines, [ln for ln in lines if "HIGHEST" in ln]

  lines, highest = dots(params, cfg, jnp.float32)
  # q, k, v, o, gate, up, down and 4 attention products per layer (a scan's body once), the
  # LM head
  assert len(lines) >= 11 * (cfg.num_layers if unrolled else 1) + 1
  assert len(highest) == len(lines), [ln for ln in lines if "HIGHEST" not in ln][:2]
  if layout == "int8":
    return
  cfg16 = dataclasses.replace(cfg, dtype="bfloat16")
  p16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16) if x.dtype == jnp.float32 else x, params)
  lines16, highest16 = dots(p16, cfg16, jnp.bfloat16)
  assert lines16 and not highest16


def test_unrolled_decode_loop_updates_the_cache_in_place():
  # Unrolled, the cache write must wait for every layer's read of the cache, or XLA copies the
  # whole [L, B, S, G, K] cache in every step of a decode loop.
  from jaxspec.models.llama import with_scan_layers
  cfg, params = _model(num_layers=3)
  un = with_scan_layers(params, False)
  b, s = 2, 24

  def loop(p, cache, tok):
    def body(_, c):
      cache, tok = c
      lg, _, cache = forward(p, tok, cache, cfg)
      return cache, jnp.argmax(lg[:, -1], -1)[:, None].astype(tok.dtype)
    return jax.lax.fori_loop(0, 4, body, (cache, tok))

  cache, tok = init_cache(cfg, b, s), jnp.ones((b, 1), jnp.int32)
  hlo = jax.jit(loop, donate_argnums=(1,)).lower(un, cache, tok).compile().as_text()
  full = f"[{cfg.num_layers},{b},{cfg.num_kv_heads},{s},{cfg.head_dim}]"
  assert cache.k.shape == (cfg.num_layers, b, cfg.num_kv_heads, s, cfg.head_dim)
  copies = [line for line in hlo.splitlines() if " copy(" in line or "copy-start(" in line]
  assert not [c for c in copies if full in c], copies
  got = jax.jit(loop)(un, init_cache(cfg, b, s), tok)[1]
  want = jax.jit(loop)(params, init_cache(cfg, b, s), tok)[1]
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("rows", [1, 5, 64, 65])
def test_output_major_dense_matches_the_logical_product(rows):
  # 1..64 rows take the product in blocks of 64 output rows, 65 and more one plain product;
  # a weight whose output size is not a multiple of 64 always the plain one.
  from jaxspec.models.llama import OutputMajor, _dense
  key = iter(jax.random.split(jax.random.key(0), 8))
  cases = [((96,), (3, 64), 1, "btd,dhk->bthk"),  # wq-like: [D, H, K], 192 outputs
           ((3, 64), (96,), 2, "bthk,hkd->btd"),  # wo-like: [H, K, D], 96 outputs
           ((40,), (130,), 1, "btd,df->btf")]  # outputs not a multiple of 64
  for in_shape, out_shape, n_in, spec in cases:
    w = jax.random.normal(next(key), (*in_shape, *out_shape), jnp.float32)
    x = jax.random.normal(next(key), (rows, 1, *in_shape), jnp.float32)
    om = OutputMajor.from_logical(w, len(out_shape))
    assert om.shape == w.shape and om.w.shape == (*out_shape, *in_shape)
    np.testing.assert_array_equal(om.logical(), w)
    got = jax.jit(_dense, static_argnums=(2, 3, 4))(x, om, n_in, spec, jnp.float32)
    want = np.einsum(spec, np.asarray(x, np.float64), np.asarray(w, np.float64))
    assert got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_unrolled_model_generates_like_scanned_and_quantizes():
  import jaxspec
  from jaxspec.models import Model
  from jaxspec.models.quant import quantize
  cfg, params = _model()
  m = Model(cfg, params)
  un = m.with_scan_layers(False)
  assert m.scan_layers and not un.scan_layers and un.with_scan_layers(False) is un
  prompts = [[1, 2, 3, 4, 5], [7, 8]]
  ref = jaxspec.generate(m, prompts, max_new_tokens=6)
  out = jaxspec.generate(un, prompts, max_new_tokens=6)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  # The oracle proposes the scanned model's own tokens: every draft is verified by the unrolled
  # layers and accepted (the n-gram found nothing to draft on these prompts).
  from jaxspec.drafters import Oracle
  oracle = Oracle(reference=np.asarray(ref.tokens), vocab=cfg.vocab_size)
  spec = jaxspec.speculative_generate(un, oracle, prompts, max_new_tokens=6, num_draft_tokens=2)
  np.testing.assert_array_equal(spec.tokens, ref.tokens)
  assert spec.stats["acceptance_rate"] == 1.0 and sum(spec.stats["drafted_per_row"]) >= 4
  q, qu = quantize(m, "int8"), quantize(un, "int8")
  assert not qu.scan_layers
  np.testing.assert_array_equal(qu.params.layers[1].wq.q, q.params.layers.wq.q[1])
  np.testing.assert_array_equal(jaxspec.generate(qu, prompts, max_new_tokens=6).tokens,
                                jaxspec.generate(q, prompts, max_new_tokens=6).tokens)


def test_a_local_directory_named_like_the_bundled_model_is_loaded(tmp_path, monkeypatch):
  """`load("SmolLM2-135M")` where a directory of that name is (a local download of the Hugging
  Face repository) loads that directory, not the bundled GGUF."""
  import jaxspec
  from jaxspec.models.hf_loader import save_hf
  from helpers import tiny_checkpoint
  save_hf(tiny_checkpoint(), tmp_path / "SmolLM2-135M")
  monkeypatch.chdir(tmp_path)
  m = jaxspec.load("SmolLM2-135M")
  assert m.cfg.vocab_size == tiny_checkpoint()[0].vocab_size != 49152


def test_load_rejects_a_bad_scan_layers():
  import jaxspec
  with pytest.raises(ValueError, match="scan_layers must be True, False or None"):
    jaxspec.load("smollm2-135m", scan_layers="yes")


@pytest.mark.parametrize("rows", [1, 2, 8, 33])
def test_blocked_tied_head_matches_plain_product(rows):
  # A table past the size threshold: 2..32 rows take the vocabulary-blocked matmul, 1 and 33
  # the plain one; all must equal the reference product up to float rounding.
  from jaxspec.models import llama
  v, d = 8192, 512
  embed = jax.random.normal(jax.random.key(0), (v, d), jnp.float32)
  params = llama.Params(embed=embed, layers=(), final_norm=jnp.ones((d,)))
  hidden = jax.random.normal(jax.random.key(1), (rows, 1, d), jnp.float32)
  assert llama._blocked_head(v, d, rows) == (2 <= rows <= 32)
  got = jax.jit(llama.logits_from_hidden)(params, hidden)
  want = np.einsum("btd,vd->btv", np.asarray(hidden, np.float64), np.asarray(embed, np.float64))
  assert got.shape == (rows, 1, v) and got.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=2e-4)
  # a vocabulary that is not a multiple of the block keeps the plain product
  assert not llama._blocked_head(v + 1, d, 8)
