"""Checkpoints: GGUF dequantizers, GGUF and Hugging Face round trips, bad input, HF parity."""

from __future__ import annotations

import dataclasses
import json
import math

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jaxspec.models import forward, init_cache, init_params, tiny_config
from jaxspec.models.config import RopeScaling
from jaxspec.models.llama import default_scan_layers, stacked_layers
from jaxspec.models.errors import CheckpointError
from jaxspec.models.gguf_loader import dequantize, llama3_rope_factors, load_gguf
from jaxspec.models.hf_loader import (config_from_hf, load_hf, params_from_hf, params_to_hf,
                                      read_safetensors, save_hf)
from jaxspec.models.llama import rope_inv_freq
from jaxspec.models.loading import bundled_gguf_path, load
from jaxspec.models.model import Model
from helpers import (REFERENCE, assert_params_equal, tiny_checkpoint, tiny_vocab,
                     write_tiny_gguf)

T = gguf.GGMLQuantizationType


_forward = jax.jit(forward, static_argnums=3)


def _logits(params, cfg, tokens):
  """float32 logits [T, V] of one row of tokens through a fresh cache."""
  tokens = jnp.asarray(tokens, jnp.int32)[None]
  logits, _, _ = _forward(params, tokens, init_cache(cfg, 1, tokens.shape[1]), cfg)
  return np.asarray(logits[0])


# -- dequantizers ---------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"])
def test_dequantize_matches_gguf(qtype):
  rng = np.random.default_rng(0)
  x = (rng.standard_normal((7, 96)) * rng.uniform(0.01, 10, (7, 1))).astype(np.float32)
  x[0, :32] = 0.0  # an all-zero block (scale 0)
  x[1, :32] = 3.0  # a constant block (Q4_1 range 0)
  q = gguf.quants.quantize(x, T[qtype])
  ours = dequantize(q, qtype, x.shape)
  assert ours.dtype == np.float32 and ours.shape == x.shape
  np.testing.assert_array_equal(ours, gguf.quants.dequantize(q, T[qtype]).reshape(x.shape))
  # and it is the tensor that was quantized, within the type's precision (relative to a row)
  tol = {"F32": 0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 1e-2, "Q4_0": 0.13, "Q4_1": 0.07}[qtype]
  assert np.all(np.abs(ours - x) <= tol * np.abs(x).max(axis=1, keepdims=True))


def test_dequantize_rejects_wrong_sizes_and_types():
  with pytest.raises(CheckpointError, match="needs 68 bytes"):
    dequantize(np.zeros(60, np.uint8), "Q8_0", (64,))
  # Q5_K is decoded by gguf.quants now (models/test_kquants.py); Q8_K is a type gguf cannot decode
  with pytest.raises(CheckpointError, match="Q8_K is not supported"):
    dequantize(np.zeros(292, np.uint8), "Q8_K", (256,))


# -- GGUF round trip ------------------------------------------------------------------------------


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("llama", {"tie_embeddings": True}),
    ("qwen2", {"attention_bias": True, "tie_embeddings": True}),
])
def test_tiny_gguf_round_trip(tmp_path, arch, overrides):
  cfg, params = tiny_checkpoint(arch, **overrides)
  expected = write_tiny_gguf(tmp_path / "tiny.gguf", cfg, params, arch=arch)
  model = load_gguf(tmp_path / "tiny.gguf")
  assert model.cfg == cfg
  assert model.name == "tiny"
  # Exactly the dequantized originals, with llama.cpp's Q/K row permutation undone.
  assert_params_equal(model.params, params_from_hf(expected, cfg), atol=1e-6)
  # ... which are the originals up to quantization error.
  assert_params_equal(model.params, params, atol=0.05)
  tokens = np.arange(3, 40)
  np.testing.assert_allclose(_logits(model.params, cfg, tokens),
                             _logits(params_from_hf(expected, cfg), cfg, tokens), atol=1e-4)
  # Against the unquantized model only roughly: 4-bit weights move logits by ~0.3.
  corr = np.corrcoef(_logits(model.params, cfg, tokens).ravel(),
                     _logits(params, cfg, tokens).ravel())[0, 1]
  assert corr > 0.95


def test_tiny_gguf_tokenizer(tmp_path):
  cfg, params = tiny_checkpoint()
  write_tiny_gguf(tmp_path / "tiny.gguf", cfg, params)
  tok = load_gguf(tmp_path / "tiny.gguf").tokenizer
  ids = tok.encode("hello world<|im_end|>")
  inv = {t: i for i, t in enumerate(tiny_vocab()[0])}
  assert ids == [inv["hell"], inv["o"], inv["Ġw"], inv["or"], inv["l"], inv["d"], 2]
  assert tok.decode(ids) == "hello world"
  assert tok.decode(ids, skip_special_tokens=False) == "hello world<|im_end|>"
  assert tok.eos_token_ids == (2,) and tok.vocab_size == len(inv)
  assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("scaling", [
    RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=8.0,
                original_max_position_embeddings=1000),  # two blended frequencies: fitted
    RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192),  # Llama 3.1's values; one blended
])
def test_gguf_rope_freqs_become_llama3_scaling(tmp_path, scaling):
  cfg, params = tiny_checkpoint()
  factors = llama3_rope_factors(scaling, cfg.rope_theta, cfg.head_dim)
  write_tiny_gguf(tmp_path / "tiny.gguf", cfg, params, rope_factors=factors)
  loaded = load_gguf(tmp_path / "tiny.gguf").cfg
  assert loaded.rope_scaling is not None
  np.testing.assert_allclose(rope_inv_freq(loaded),
                             rope_inv_freq(dataclasses.replace(cfg, rope_scaling=scaling)),
                             rtol=1e-5)


def test_bundled_model_config(smollm):
  cfg = smollm.cfg
  assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
          cfg.vocab_size) == (30, 576, 9, 3, 64, 49152)
  assert cfg.tie_embeddings and smollm.params.lm_head is None
  assert cfg.eos_token_ids == (2,) and cfg.rope_theta == 100000.0
  assert stacked_layers(smollm.params).wq.shape == (30, 576, 9, 64)

def test_bundled_model_in_both_layouts(smollm, smollm_default_layout):
  # The session's copy is stacked (conftest); load's CPU default (unrolled) holds the same weights.
  un = smollm_default_layout
  assert smollm.scan_layers and un.scan_layers == default_scan_layers()
  np.testing.assert_array_equal(stacked_layers(un.params).wq, stacked_layers(smollm.params).wq)


# -- Hugging Face round trip ----------------------------------------------------------------------


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}),
    ("llama", {"attention_bias": True, "rope_scaling": RopeScaling(factor=4.0)}),
    ("mistral", {"sliding_window": 5, "tie_embeddings": True}),
    ("qwen2", {"attention_bias": True, "tie_embeddings": True}),
    # Every rope scaling and per-layer windows survive save_hf (read back as written).
    ("llama", {"rope_scaling": RopeScaling(rope_type="linear", factor=2.0)}),
    ("llama", {"rope_scaling": RopeScaling(rope_type="dynamic", factor=2.0,
                                           original_max_position_embeddings=512)}),
    ("llama", {"rope_scaling": RopeScaling(rope_type="yarn", factor=4.0, attention_factor=1.2,
                                           original_max_position_embeddings=64)}),
    ("llama", {"rope_scaling": RopeScaling(
        rope_type="longrope", factor=4.0, original_max_position_embeddings=128,
        attention_factor=1.1, short_factor=tuple(1.0 + 0.1 * i for i in range(8)),
        long_factor=tuple(2.0 + i for i in range(8)))}),
    ("qwen2", {"attention_bias": True, "sliding_window": 5, "layer_types": ("full", "sliding")}),
])
def test_hf_round_trip(tmp_path, arch, overrides):
  cfg, params = tiny_checkpoint(arch, **overrides)
  save_hf((cfg, params), tmp_path)
  model = load_hf(tmp_path)
  assert model.cfg == cfg
  assert_params_equal(model.params, params)
  tokens = np.arange(3, 20)
  np.testing.assert_array_equal(_logits(model.params, cfg, tokens), _logits(params, cfg, tokens))
  # transformers' own reader (the safetensors package) agrees with ours on the file
  from safetensors.numpy import load_file
  theirs = load_file(tmp_path / "model.safetensors")
  ours = read_safetensors(tmp_path / "model.safetensors")
  assert theirs.keys() == ours.keys()
  for k in theirs:
    np.testing.assert_array_equal(theirs[k], ours[k])
  config = json.loads((tmp_path / "config.json").read_text())
  assert config["architectures"] == [{"llama": "LlamaForCausalLM",
                                      "mistral": "MistralForCausalLM",
                                      "qwen2": "Qwen2ForCausalLM"}[arch]]


def test_hf_sharded_bf16_round_trip(tmp_path):
  cfg, params = tiny_checkpoint()
  save_hf((cfg, params), tmp_path, dtype="bfloat16", max_shard_bytes=40_000)
  index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
  shards = sorted(tmp_path.glob("model-*-of-*.safetensors"))
  assert len(shards) > 2 and set(index["weight_map"].values()) == {s.name for s in shards}
  assert not (tmp_path / "model.safetensors").exists()
  assert read_safetensors(shards[0])["model.embed_tokens.weight"].dtype == ml_dtypes.bfloat16
  assert load_hf(tmp_path).cfg.dtype == "bfloat16"  # the checkpoint's dtype by default
  model = load_hf(tmp_path, "float32")  # float32 params from bf16 storage: the rounded weights
  as_bf16 = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
  assert_params_equal(model.params, as_bf16)
  model16 = load(str(tmp_path), dtype="bfloat16")
  assert model16.cfg.dtype == "bfloat16" and model16.params.embed.dtype == jnp.bfloat16
  tokens = np.arange(3, 20)
  np.testing.assert_array_equal(_logits(model.params, cfg, tokens),
                                _logits(as_bf16, cfg, tokens))


def test_hf_reads_safetensors_written_by_the_library(tmp_path):
  from safetensors.numpy import save_file
  cfg, params = tiny_checkpoint()
  save_hf((cfg, params), tmp_path)
  save_file(read_safetensors(tmp_path / "model.safetensors") | {}, tmp_path / "other.safetensors")
  ours = read_safetensors(tmp_path / "other.safetensors")
  assert_params_equal(params_from_hf(ours, cfg), params)


def test_hf_model_with_tokenizer_round_trip(tmp_path, monkeypatch):
  cfg, params = tiny_checkpoint()
  write_tiny_gguf(tmp_path / "tiny.gguf", cfg, params)
  model = load(str(tmp_path / "tiny.gguf"))
  # jaxspec.load's layout on this backend when none is asked for (unrolled on CPU), and the
  # environment's override
  assert model.scan_layers == default_scan_layers()
  monkeypatch.setenv("JAXSPEC_SCAN_LAYERS", "unrolled" if model.scan_layers else "stacked")
  assert load(str(tmp_path / "tiny.gguf")).scan_layers != model.scan_layers
  monkeypatch.delenv("JAXSPEC_SCAN_LAYERS")
  save_hf(model, tmp_path / "hf")
  back = load_hf(tmp_path / "hf")
  text = "hello world <|im_start|>x"
  assert back.tokenizer.encode(text) == model.tokenizer.encode(text)
  msgs = [{"role": "user", "content": "hi"}]
  assert back.tokenizer.apply_chat_template(msgs) == model.tokenizer.apply_chat_template(msgs)
  assert back.cfg.eos_token_ids == (2,) and back.tokenizer.eos_token_ids == (2,)


def test_hf_config_fields(tmp_path):
  """eos lists, generation_config eos, head_dim default and Qwen2 sliding-window switch."""
  cfg, params = tiny_checkpoint("qwen2", attention_bias=True)
  save_hf((cfg, params), tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  del config["head_dim"]
  config.update(eos_token_id=[2, 5], use_sliding_window=False, sliding_window=4096,
                rope_scaling={"rope_type": "default"})
  (tmp_path / "config.json").write_text(json.dumps(config))
  (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
  loaded = load_hf(tmp_path).cfg
  assert loaded.eos_token_ids == (2, 5, 7)
  assert loaded.head_dim == 16 and loaded.sliding_window is None and loaded.rope_scaling is None


# -- bad input ------------------------------------------------------------------------------------


def test_missing_paths(tmp_path):
  with pytest.raises(CheckpointError, match="does not exist"):
    load_gguf(tmp_path / "nope.gguf")
  with pytest.raises(CheckpointError, match="does not exist"):
    load_hf(tmp_path / "nope")
  with pytest.raises(CheckpointError, match="does not exist"):
    load(str(tmp_path / "nope.gguf"))
  with pytest.raises(CheckpointError, match="smollm2-135m.*gguf.*config.json"):
    load("llama-70b")
  with pytest.raises(CheckpointError, match="no config.json"):
    load(str(tmp_path))


@pytest.mark.parametrize("fraction", [0.001, 0.01, 0.3, 0.7, 0.999])
def test_truncated_tiny_gguf(tmp_path, fraction):
  cfg, params = tiny_checkpoint()
  write_tiny_gguf(tmp_path / "tiny.gguf", cfg, params)
  data = (tmp_path / "tiny.gguf").read_bytes()
  (tmp_path / "cut.gguf").write_bytes(data[:int(len(data) * fraction)])
  with pytest.raises(CheckpointError, match="truncated|not a GGUF file"):
    load_gguf(tmp_path / "cut.gguf")


def test_truncated_bundled_gguf(tmp_path):
  with open(bundled_gguf_path(), "rb") as f:
    (tmp_path / "cut.gguf").write_bytes(f.read(40_000_000))
  with pytest.raises(CheckpointError, match="truncated: tensor 'blk.*' needs bytes up to"):
    load_gguf(tmp_path / "cut.gguf")


@pytest.mark.parametrize("seed", range(4))
def test_garbage_gguf(tmp_path, seed):
  rng = np.random.default_rng(seed)
  (tmp_path / "junk.gguf").write_bytes(rng.bytes(5000))
  with pytest.raises(CheckpointError, match="not a GGUF file"):
    load_gguf(tmp_path / "junk.gguf")
  # Valid magic and version, garbage after: huge counts and lengths must not allocate or hang.
  (tmp_path / "junk.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + rng.bytes(5000))
  with pytest.raises(CheckpointError, match="truncated or corrupt|corrupt"):
    load_gguf(tmp_path / "junk.gguf")


def test_gguf_unsupported_architecture(tmp_path):
  w = gguf.GGUFWriter(str(tmp_path / "g.gguf"), "falcon")
  w.add_block_count(1)
  w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  with pytest.raises(CheckpointError, match="architecture 'falcon' is not supported"):
    load_gguf(tmp_path / "g.gguf")


def test_gguf_quant_type_decoded_by_gguf(tmp_path):
  """Q5_0 was refused before jaxspec decoded other types through gguf.quants; it loads now. The
  clear error for a type gguf cannot decode (naming it and a tensor) is tested in
  tests/models/test_kquants.py."""
  cfg, params = tiny_checkpoint()
  expected = write_tiny_gguf(tmp_path / "tiny.gguf", cfg, params, types={"ffn_up": "Q5_0"})
  assert_params_equal(load_gguf(tmp_path / "tiny.gguf").params, params_from_hf(expected, cfg))


def test_truncated_and_malformed_safetensors(tmp_path):
  cfg, params = tiny_checkpoint()
  save_hf((cfg, params), tmp_path)
  st = tmp_path / "model.safetensors"
  data = st.read_bytes()
  st.write_bytes(data[:len(data) - 100])
  with pytest.raises(CheckpointError, match="truncated: tensor"):
    load_hf(tmp_path)
  st.write_bytes(data[:200])
  with pytest.raises(CheckpointError, match="truncated or not a safetensors file"):
    load_hf(tmp_path)
  st.write_bytes((20).to_bytes(8, "little") + b"{not json at all!!!}" + data[28:])
  with pytest.raises(CheckpointError, match="header is not JSON"):
    load_hf(tmp_path)
  st.write_bytes(b"abc")
  with pytest.raises(CheckpointError, match="not a safetensors file"):
    load_hf(tmp_path)
  # An FP8 checkpoint: the dtype named as unsupported (was "a malformed header entry").
  header = json.dumps({"model.norm.weight": {"dtype": "F8_E4M3", "shape": [4],
                                             "data_offsets": [0, 4]}}).encode()
  st.write_bytes(len(header).to_bytes(8, "little") + header + bytes(4))
  with pytest.raises(CheckpointError, match=r"'model.norm.weight' is stored as F8_E4M3 \(FP8\),"
                                            r" which jaxspec does not read"):
    load_hf(tmp_path)


def test_hf_unsupported_architecture_and_missing_files(tmp_path):
  cfg, params = tiny_checkpoint()
  save_hf((cfg, params), tmp_path)
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps(config | {"architectures": ["GPT2LMHeadModel"]}))
  with pytest.raises(CheckpointError, match="architecture 'GPT2LMHeadModel' is not supported"):
    load_hf(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(
      config | {"rope_scaling": {"rope_type": "mrope", "factor": 4.0}}))
  with pytest.raises(CheckpointError, match="rope scaling type 'mrope' is not supported"):
    load_hf(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(
      config | {"architectures": ["Mistral3ForConditionalGeneration"]}))
  with pytest.raises(CheckpointError, match="multimodal checkpoint.*MistralForCausalLM"):
    load_hf(tmp_path)
  (tmp_path / "config.json").write_text(json.dumps(config))
  (tmp_path / "model.safetensors").rename(tmp_path / "pytorch_model.bin")
  with pytest.raises(CheckpointError, match="never unpickles"):
    load_hf(tmp_path)
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
  with pytest.raises(CheckpointError, match="missing"):
    load_hf(tmp_path)
  (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
      {"weight_map": {"model.norm.weight": "../config.json"}}))
  with pytest.raises(CheckpointError, match="not a file name"):
    load_hf(tmp_path)


def test_save_hf_refuses_what_its_classes_cannot_hold(tmp_path):
  for arch, overrides in (("gemma2", {}), ("qwen3", {"qk_norm": True}),
                          ("llama", {"partial_rotary_factor": 0.5}),
                          ("llama", {"hidden_act": "gelu_tanh"})):
    cfg, params = tiny_checkpoint(arch, **overrides)
    with pytest.raises(ValueError, match="save_hf writes|saving architecture"):
      save_hf((cfg, params), tmp_path)
    assert not (tmp_path / "config.json").exists()


def test_config_checks_family_switches():
  with pytest.raises(ValueError, match="LongRoPE factors have 3 entries but the rotary"
                     " embedding has 8 frequencies"):
    tiny_config(rope_scaling=RopeScaling(rope_type="longrope", short_factor=(1.0,) * 3,
                                         long_factor=(2.0,) * 3))
  with pytest.raises(ValueError, match="sliding_rope_theta .* sliding_window is None"):
    tiny_config(sliding_rope_theta=1e4)
  with pytest.raises(ValueError, match="layer_types must be a tuple of num_layers"):
    tiny_config(sliding_window=4, layer_types=("sliding",))
  with pytest.raises(ValueError, match="hidden_act 'relu' is not supported"):
    tiny_config(hidden_act="relu")
  cfg = tiny_config(qk_norm=True)
  params = init_params(tiny_config(), jax.random.key(0))  # no q/k norm weights
  with pytest.raises(ValueError, match="cfg.qk_norm is True but the params lack q_norm"):
    forward(params, np.zeros((1, 2), np.int32), init_cache(cfg, 1, 8), cfg)


def test_gemma2_gguf_without_newer_keys_gets_llama_cpp_defaults(tmp_path):
  """Gemma 2 files converted before the soft-cap and window keys existed: llama.cpp's defaults
  (window 4096, caps 50 and 30), every other layer sliding."""
  cfg, params = tiny_checkpoint("llama", num_layers=2, tie_embeddings=True)
  write_tiny_gguf(tmp_path / "g2.gguf", cfg, params, arch="gemma2", tokenizer=False)
  got = load_gguf(tmp_path / "g2.gguf").cfg
  assert (got.attn_softcap, got.final_softcap, got.sliding_window) == (50.0, 30.0, 4096)
  assert got.layer_types == ("sliding", "full") and got.norm_offset == 1.0
  assert got.query_pre_attn_scalar == cfg.head_dim and got.hidden_act == "gelu_tanh"


def test_hf_family_configs():
  """Family switches read from config.json, the transformers 4.x spellings included."""
  base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
              num_attention_heads=4, num_key_value_heads=1, head_dim=16)
  gemma = config_from_hf(base | {"architectures": ["GemmaForCausalLM"], "hidden_act": "gelu"})
  assert gemma.hidden_act == "gelu_tanh"  # Gemma 1's "gelu" means the tanh form, as in HF
  assert gemma.norm_offset == 1.0 and gemma.embed_scale and gemma.tie_embeddings
  g3 = config_from_hf(base | {"model_type": "gemma3_text", "rope_theta": 1e6,
                              "rope_local_base_freq": 1e4, "sliding_window": 4,
                              "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
  assert g3.layer_types == ("sliding",) * 5 + ("full",) and g3.sliding_rope_theta == 1e4
  assert g3.rope_theta == 1e6 and g3.rope_scaling.rope_type == "linear" and g3.qk_norm
  phi = config_from_hf(base | {"architectures": ["Phi3ForCausalLM"], "partial_rotary_factor": 0.5,
                               "max_position_embeddings": 1024,
                               "original_max_position_embeddings": 256,
                               "rope_scaling": {"type": "longrope", "short_factor": [1.0] * 4,
                                                "long_factor": [2.0] * 4}})
  s = phi.rope_scaling
  assert phi.rotary_dim == 8 and s.rope_type == "longrope"
  assert s.original_max_position_embeddings == 256
  assert s.attention_factor == pytest.approx(math.sqrt(1 + math.log(4) / math.log(256)))
  phi_yarn = config_from_hf(base | {"architectures": ["Phi3ForCausalLM"],
                                    "rope_scaling": {"type": "yarn", "short_factor": [1.0] * 8,
                                                     "long_factor": [2.0] * 8}})
  assert phi_yarn.rope_scaling.rope_type == "longrope"  # transformers' Phi-3 reads it so
  assert phi_yarn.rope_scaling.original_max_position_embeddings == 4096  # its class default
  # Qwen2/3 slide only with use_sliding_window, from max_window_layers (default 28) on.
  qwen = base | {"architectures": ["Qwen2ForCausalLM"], "sliding_window": 4,
                 "layer_types": ["full_attention"] * 5 + ["sliding_attention"]}
  assert config_from_hf(qwen).sliding_window is None
  assert config_from_hf(qwen | {"use_sliding_window": True}).layer_types == ("full",) * 5 + (
      "sliding",)
  # Gemma 3 with only sliding layers keeps their own rotary base; Gemma 3 never caps scores.
  g3_small = config_from_hf(base | {"model_type": "gemma3_text", "num_hidden_layers": 2,
                                    "sliding_window": 4, "rope_theta": 1e6,
                                    "attn_logit_softcapping": 50.0})
  assert g3_small.layer_types is None and g3_small.sliding_window == 4
  assert g3_small.sliding_rope_theta == 1e4 and g3_small.attn_softcap is None
  with pytest.raises(CheckpointError, match="'MixtralForCausalLM' is not supported"):
    config_from_hf(base | {"architectures": ["MixtralForCausalLM"]})


def test_hf_missing_tensor(tmp_path):
  cfg, params = tiny_checkpoint()
  tensors = params_to_hf(params, cfg)
  del tensors["model.layers.1.mlp.up_proj.weight"]
  with pytest.raises(CheckpointError, match="'model.layers.1.mlp.up_proj.weight' is missing"):
    params_from_hf(tensors, cfg)


# -- parity with Hugging Face ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm(smollm2) -> Model:
  return smollm2  # the session-wide load (conftest), so the suite parses the GGUF once


@pytest.fixture(scope="module")
def smollm_default_layout(smollm) -> Model:
  """The session's SmolLM2 in `jaxspec.load`'s layout on this backend (unrolled on CPU)."""
  return smollm.with_scan_layers(default_scan_layers())


@pytest.fixture(scope="module")
def reference():
  if not REFERENCE.is_file():
    pytest.skip(f"Hugging Face reference {REFERENCE} is absent (it lives in the shared folder)")
  with np.load(REFERENCE, allow_pickle=False) as z:
    return {k: z[k] for k in z.files}


# slow: prompts 1 and 2 (prompt 0 stays; test_smollm2 compares 26 greedy continuations with
# Hugging Face's token for token).
@pytest.mark.parametrize("i", [0, pytest.param(1, marks=pytest.mark.slow),
                               pytest.param(2, marks=pytest.mark.slow)])
def test_logits_match_hugging_face(smollm_default_layout, reference, i):
  n = int(reference["prompt_len"][i])
  model = smollm_default_layout  # load's layout on this backend; the session's copy is stacked
  # Full float32 matmuls: accelerators default to TF32-like precision, which moves logits ~1e-2.
  with jax.default_matmul_precision("highest"):
    logits = _logits(model.params, model.cfg, reference["prompt_ids"][i, :n])
  np.testing.assert_allclose(logits[-8:], reference[f"logits_{i}"], atol=1e-3, rtol=0)
