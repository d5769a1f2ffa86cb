"""GGUF tensor types beyond jaxspec's own six kernels: K-quants, Q5_0/Q5_1, IQ and ternary types
are decoded through `gguf.quants`, and a model made of them loads with exactly gguf's values.

gguf 0.19's `gguf.quants.quantize` implements F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0,
TQ1_0, TQ2_0 and MXFP4 only: the K-quants (Q2_K..Q6_K) and IQ types have no quantizer there. So
tensors of a type gguf can quantize are quantized from random weights, and tensors of the others
are random blocks whose f16 scales are set to give weights of about 0.1 (`_random_blocks`). The
test's claim does not depend on where the bytes came from: the loaded parameters equal
`gguf.quants.dequantize` of the very bytes in the file, bit for bit, in float32.
"""

from __future__ import annotations

import itertools

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.models import forward, init_cache, tiny_config
from jaxspec.models.errors import CheckpointError
from jaxspec.models import gguf_loader
from jaxspec.models.gguf_loader import OWN_TYPES, dequantize, load_gguf, supported_types
from jaxspec.models.hf_loader import params_from_hf
from jaxspec.models.llama import stacked_layers
from jaxspec.models.loading import load
from helpers import add_tiny_tokenizer, assert_params_equal

T = gguf.GGMLQuantizationType
SIZES = gguf.constants.GGML_QUANT_SIZES

# Byte offsets of the f16 scales (d, dmin) inside one block, from ggml's block structs.
F16_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
              "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ3_S": (0,)}
# One of each family: the K-quants, IQ types, the 5-bit legacy types, ternary, MXFP4.
MIXED = ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS", "IQ2_XXS", "Q5_0", "Q5_1",
         "TQ2_0", "MXFP4", "IQ3_S", "IQ2_XS"]


def _can_quantize(qtype: str) -> bool:
  try:
    gguf.quants.quantize(np.zeros((1, SIZES[T[qtype]][0]), np.float32), T[qtype])
  except NotImplementedError:
    return False
  return True


def _random_blocks(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
  """uint8 [rows, cols / block * block_bytes]: random codes, f16 scales set for |x| <= ~0.1."""
  block, block_bytes = SIZES[T[qtype]]
  raw = rng.integers(0, 256, (rows * cols // block, block_bytes), dtype=np.uint8)

  def set_scales(value):
    for off in F16_SCALES[qtype]:
      raw[:, off:off + 2] = np.full((raw.shape[0], 1), value, np.float16).view(np.uint8)

  set_scales(1.0)  # values are linear in the scales: measure at 1, then scale down
  peak = np.abs(gguf.quants.dequantize(raw, T[qtype])).max()
  set_scales(0.1 / peak)
  return raw.reshape(rows, -1)


def _tensor(qtype: str, rows: int, cols: int, rng) -> np.ndarray:
  """The GGUF bytes of a [rows, cols] weight of `qtype`."""
  if _can_quantize(qtype):
    return gguf.quants.quantize(0.05 * rng.standard_normal((rows, cols), np.float32), T[qtype])
  return _random_blocks(qtype, rows, cols, rng)


def _unpermute(w, n_head):
  """Inverse of llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (Q/K rows)."""
  return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def _cfg():
  # Rows (the hidden and ffw sizes, heads * head_dim) are whole 256-element K-quant blocks.
  return tiny_config(vocab_size=272, hidden_size=256, intermediate_size=512, num_heads=4,
                     num_kv_heads=2, head_dim=64, bos_token_id=1, eos_token_ids=(2,),
                     rms_norm_eps=1e-5)


def write_quantized_gguf(path, cfg, types: list[str], seed: int = 0,
                         zeros: dict[str, str] | None = None):
  """A `llama` GGUF whose weight matrices take `types` in turn (norms F32), except the tensors
  named in `zeros` (gguf name -> type), written as all-zero bytes of that type. Returns the
  Hugging Face-named tensors as gguf dequantizes them (Q/K rows un-permuted) and the raw
  {gguf name: (bytes, type)}."""
  rng = np.random.default_rng(seed)
  d, f, h, g, k = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim)
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_name("kquants")
  w.add_block_count(cfg.num_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(d)
  w.add_feed_forward_length(f)
  w.add_head_count(h)
  w.add_head_count_kv(g)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_rope_dimension_count(k)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  add_tiny_tokenizer(w, cfg.vocab_size)
  expected, raw = {}, {}
  turn = itertools.cycle(types)

  def matrix(gguf_name, hf_name, rows, cols, n_head=None):
    qtype = next(turn)
    if gguf_name in (zeros or {}):
      block, block_bytes = SIZES[T[zeros[gguf_name]]]
      w.add_tensor(gguf_name, np.zeros((rows, cols // block * block_bytes), np.uint8),
                   raw_dtype=T[zeros[gguf_name]])
      return
    q = _tensor(qtype, rows, cols, rng)
    w.add_tensor(gguf_name, q, raw_dtype=T[qtype])
    x = gguf.quants.dequantize(q, T[qtype]).astype(np.float32)
    assert x.shape == (rows, cols)
    expected[hf_name] = x if n_head is None else _unpermute(x, n_head)
    raw[gguf_name] = (q, qtype)

  def norm(gguf_name, hf_name):
    x = (1 + 0.1 * rng.standard_normal(d)).astype(np.float32)
    w.add_tensor(gguf_name, x)
    expected[hf_name] = x

  matrix("token_embd.weight", "model.embed_tokens.weight", cfg.vocab_size, d)
  norm("output_norm.weight", "model.norm.weight")
  matrix("output.weight", "lm_head.weight", cfg.vocab_size, d)
  for i in range(cfg.num_layers):
    b, p = f"blk.{i}.", f"model.layers.{i}."
    norm(b + "attn_norm.weight", p + "input_layernorm.weight")
    matrix(b + "attn_q.weight", p + "self_attn.q_proj.weight", h * k, d, h)
    matrix(b + "attn_k.weight", p + "self_attn.k_proj.weight", g * k, d, g)
    matrix(b + "attn_v.weight", p + "self_attn.v_proj.weight", g * k, d)
    matrix(b + "attn_output.weight", p + "self_attn.o_proj.weight", d, h * k)
    norm(b + "ffn_norm.weight", p + "post_attention_layernorm.weight")
    matrix(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", f, d)
    matrix(b + "ffn_up.weight", p + "mlp.up_proj.weight", f, d)
    matrix(b + "ffn_down.weight", p + "mlp.down_proj.weight", d, f)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return expected, raw


@pytest.mark.parametrize("types", [["Q4_K"], ["Q5_K"], ["Q6_K"], ["Q5_0"], MIXED],
                         ids=["Q4_K", "Q5_K", "Q6_K", "Q5_0", "mixed"])
def test_quantized_gguf_loads_gguf_values(tmp_path, types):
  cfg = _cfg()
  expected, raw = write_quantized_gguf(tmp_path / "q.gguf", cfg, types)
  assert {t for _, t in raw.values()} == set(types)
  model = load_gguf(tmp_path / "q.gguf")
  assert model.cfg == cfg and model.name == "kquants"
  # Every parameter is gguf's dequantization of the file's bytes, exactly (float32).
  assert_params_equal(model.params, params_from_hf(expected, cfg))
  # ... and directly, without the Hugging Face layout in between: ffn_down is [D, F] in GGUF
  # (rows of F), jaxspec's w_down [F, D].
  q, qtype = raw["blk.1.ffn_down.weight"]
  np.testing.assert_array_equal(np.asarray(stacked_layers(model.params).w_down[1]),
                                gguf.quants.dequantize(q, T[qtype]).T)
  assert np.all(np.isfinite(np.asarray(model.params.embed)))

  # Greedy generation runs on the model as `load` serves it (its default weight layout), and
  # its first token is the logits' argmax.
  model = load(str(tmp_path / "q.gguf"))
  prompt = [5, 6, 7, 8, 9]
  out = jaxspec.generate(model, [prompt], max_new_tokens=6, stop_ids=[])
  assert out.tokens.shape == (1, 6) and int(out.lengths[0]) == 6
  tokens = jnp.asarray([prompt], jnp.int32)
  logits, _, _ = jax.jit(forward, static_argnums=3)(
      model.params, tokens, init_cache(cfg, 1, len(prompt)), cfg)
  assert int(out.tokens[0, 0]) == int(jnp.argmax(logits[0, -1]))


def test_bfloat16_load_casts_gguf_values(tmp_path):
  cfg = _cfg()
  expected, _ = write_quantized_gguf(tmp_path / "q.gguf", cfg, ["Q4_K", "Q6_K"], seed=1)
  model = load_gguf(tmp_path / "q.gguf", dtype="bfloat16")
  as_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                         params_from_hf(expected, cfg))
  assert model.params.embed.dtype == jnp.bfloat16
  assert_params_equal(model.params, as_bf16)


@pytest.mark.parametrize("qtype", [t for t in supported_types() if t not in OWN_TYPES])
def test_dequantize_matches_gguf_for_every_supported_type(qtype, monkeypatch):
  """`dequantize` of random bytes (any f16 scale, NaN and inf included) is gguf's result, also
  decoded in slices (of 4 blocks here: the 6 blocks take a short last slice)."""
  block, block_bytes = SIZES[T[qtype]]
  monkeypatch.setattr(gguf_loader, "_GGUF_CHUNK_ELEMENTS", 4 * block)
  rng = np.random.default_rng(3)
  raw = rng.integers(0, 256, (3, 2 * block_bytes), dtype=np.uint8)  # 3 rows of 2 blocks
  with np.errstate(all="ignore"):
    ours = dequantize(raw, qtype, (3, 2 * block))
    theirs = gguf.quants.dequantize(raw, T[qtype])
  assert ours.dtype == np.float32 and ours.shape == (3, 2 * block)
  np.testing.assert_array_equal(ours, theirs)


def test_supported_types_list():
  types = supported_types()
  assert types[:6] == OWN_TYPES
  for t in ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL", "IQ4_XS"]:
    assert t in types
  assert "Q8_1" not in types and "Q8_K" not in types  # gguf 0.19 cannot dequantize these


def test_unsupported_type_is_a_clear_error(tmp_path):
  """A type gguf cannot dequantize (Q8_1, llama.cpp's intermediate for dot products) is refused
  before anything is decoded, naming the type, a tensor of it, and what is supported."""
  write_quantized_gguf(tmp_path / "bad.gguf", _cfg(), ["Q4_K"],
                       zeros={"blk.0.ffn_up.weight": "Q8_1", "blk.1.ffn_up.weight": "Q8_1"})
  with pytest.raises(CheckpointError, match=r"Q8_1 \(e\.g\. blk\.0\.ffn_up\.weight\) is not"
                     r" supported \(supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1, .*Q4_K"):
    load_gguf(tmp_path / "bad.gguf")
  with pytest.raises(CheckpointError, match="Q8_K is not supported"):
    dequantize(np.zeros(292, np.uint8), "Q8_K", (256,))
