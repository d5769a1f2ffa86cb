"""Random-weight models of published shapes, for timing at realistic sizes.

Decode speed depends on the shapes and dtypes of the weights and caches, not on their values, so
a random model of a checkpoint's exact configuration times like the checkpoint. `SHAPES` holds
the configurations (from the models' published `config.json`s); `random_model` builds one on the
default device.

Random weights give logits whose top two are often close; in bfloat16 a verify pass over k+1
tokens and a one-token step round differently and then disagree on such near-ties now and
then, so a bfloat16 model's speculative greedy output may depart from its plain greedy output
(float32 agrees token for token).
"""

from __future__ import annotations

import dataclasses

import jax

from jaxspec.models.config import LlamaConfig, RopeScaling
from jaxspec.models.llama import (DEFAULT_OUTPUT_MAJOR, OutputMajorPolicy, init_params,
                                  with_scan_layers)
from jaxspec.models.model import Model

SHAPES: dict[str, LlamaConfig] = {
    "smollm2-135m": LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, tie_embeddings=True,
        max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,)),
    "llama-3.2-1b": LlamaConfig(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
        num_heads=32, num_kv_heads=8, head_dim=64, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        tie_embeddings=True, max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009)),
    "llama-3.1-8b": LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
        num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=500000.0,
        rope_scaling=RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                 original_max_position_embeddings=8192),
        tie_embeddings=False, max_position_embeddings=131072, bos_token_id=128000,
        eos_token_ids=(128001, 128008, 128009)),
    "qwen2.5-1.5b": LlamaConfig(
        vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28,
        num_heads=12, num_kv_heads=2, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6,
        tie_embeddings=True, attention_bias=True, max_position_embeddings=32768,
        bos_token_id=None, eos_token_ids=(151645, 151643), architecture="qwen2"),
    # A small shape of the same family for CPU smoke runs and tests.
    "tiny": LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2, head_dim=16, tie_embeddings=True, max_position_embeddings=4096,
        eos_token_ids=(2,)),
}

def shape_config(name: str, dtype: str = "float32") -> LlamaConfig:
  """The configuration of a named shape in `dtype`."""
  if name not in SHAPES:
    raise ValueError(f"unknown shape {name!r}: choose one of {', '.join(SHAPES)}")
  return dataclasses.replace(SHAPES[name], dtype=dtype)


def random_model(name_or_cfg: str | LlamaConfig, dtype: str = "float32", *, seed: int = 0,
                 scan_layers: bool | None = None,
                 output_major: OutputMajorPolicy = DEFAULT_OUTPUT_MAJOR) -> Model:
  """A random-weight `Model` (no tokenizer) of a named shape or a given configuration.

  Args:
    name_or_cfg: a key of `SHAPES` or a `LlamaConfig` (its dtype is then replaced by `dtype`).
    dtype: "float32" or "bfloat16".
    seed: the weights' PRNG seed.
    scan_layers: the layer layout; None takes the backend's default (`default_scan_layers`).
    output_major: where the unrolled layout holds its matmul weights output-major
      (`jaxspec.models.llama.with_scan_layers`).
  """
  from jaxspec.models.llama import default_scan_layers
  cfg = (shape_config(name_or_cfg, dtype) if isinstance(name_or_cfg, str)
         else dataclasses.replace(name_or_cfg, dtype=dtype))
  params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(seed))
  scan = default_scan_layers() if scan_layers is None else scan_layers
  params = with_scan_layers(params, scan, output_major=output_major)
  name = name_or_cfg if isinstance(name_or_cfg, str) else "random"
  return Model(cfg=cfg, params=params, tokenizer=None, name=f"{name}-random-{dtype}")
