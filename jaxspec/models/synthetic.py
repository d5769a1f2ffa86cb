"""Random-weight models of published shapes, for timing at realistic sizes.

Decode speed depends on the shapes and dtypes of the weights and caches, not on their values, so
a random model of a checkpoint's exact configuration times like the checkpoint. `SHAPES` holds
the configurations (from the models' published `config.json`s); `random_model` builds one on the
default device.

Random weights give logits whose top two are often close; in bfloat16 a verify pass over k+1
tokens and a one-token step round differently and then disagree on such near-ties now and
then, so a bfloat16 model's speculative greedy output may depart from its plain greedy output
(float32 agrees token for token). `random_model(..., peak=...)` builds a *peaked* model of the
same shapes instead, whose next token wins by a wide margin, so bfloat16 timings of speculative
decoding keep the acceptance they were given (`peaked_params`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.models.config import LlamaConfig, RopeScaling
from jaxspec.models.llama import (DEFAULT_OUTPUT_MAJOR, OutputMajorPolicy, Params,
                                  init_params, with_scan_layers)
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


# How much the peaked model scales each layer's two output projections: small enough that the
# residual stream stays the token's embedding plus a few percent (see `peaked_params`).
_PEAK_LAYER_SCALE = 1e-3


def peaked_params(params: Params, cfg: LlamaConfig, peak: float) -> Params:
  """Random weights (`init_params`, logical layout) changed so that the next token is the
  current one and wins by `peak` logits.

  A decode step reads and computes exactly what a random model's does (the same shapes and
  dtypes; values do not change timing), but near-ties are gone: each layer's output
  projections (`wo`, `w_down`) are scaled by 1e-3, so the residual stream stays the input
  token's embedding e (plus a few percent), and the logits are e_v . g * norm(e): with s the
  embedding's root mean square, the token's own logit is g * s * hidden_size, any other's about
  g * s * sqrt(hidden_size) * N(0, 1). The final norm's weight g sets the former to `peak`. An
  untied LM head is made the embedding transposed (its own array, read as before). So greedy
  decoding repeats the last prompt token, bfloat16 verify passes and decode steps agree on it,
  and the `Oracle` drafter's tau is the one its alpha implies. `peak` sets the distribution's entropy: with a 128k vocabulary, 12
  gives the top token about 0.5 of the mass at temperature 1, 16 about 0.98.
  """
  if isinstance(params.layers, tuple):
    raise ValueError("peaked_params takes init_params' stacked layers: apply it before"
                     " with_scan_layers")
  if not peak > 0:
    raise ValueError(f"peak must be a positive number of logits, got {peak!r}")
  lp = params.layers
  lp = dataclasses.replace(lp, wo=(lp.wo * _PEAK_LAYER_SCALE).astype(lp.wo.dtype),
                           w_down=(lp.w_down * _PEAK_LAYER_SCALE).astype(lp.w_down.dtype))
  rms = jnp.sqrt(jnp.mean(jnp.square(params.embed.astype(jnp.float32))))
  final_norm = jnp.full_like(params.final_norm, peak / (rms * cfg.hidden_size))
  lm_head = None if params.lm_head is None else params.embed.T.astype(params.lm_head.dtype)
  return dataclasses.replace(params, layers=lp, final_norm=final_norm, lm_head=lm_head)


def random_model(name_or_cfg: str | LlamaConfig, dtype: str = "float32", *, seed: int = 0,
                 scan_layers: bool | None = None,
                 output_major: OutputMajorPolicy = DEFAULT_OUTPUT_MAJOR,
                 peak: float | None = None) -> Model:
  """A random-weight `Model` (no tokenizer) of a named shape or a given configuration.

  Args:
    name_or_cfg: a key of `SHAPES` or a `LlamaConfig` (its dtype is then replaced by `dtype`).
    dtype: "float32" or "bfloat16".
    seed: the weights' PRNG seed.
    scan_layers: the layer layout; None takes the backend's default (`default_scan_layers`).
    output_major: where the unrolled layout holds its matmul weights output-major
      (`jaxspec.models.llama.with_scan_layers`).
    peak: None for plain random weights; a number of logits for a peaked model of the same
      shapes (`peaked_params`), whose greedy output survives bfloat16 rounding.
  """
  from jaxspec.models.llama import default_scan_layers
  cfg = (shape_config(name_or_cfg, dtype) if isinstance(name_or_cfg, str)
         else dataclasses.replace(name_or_cfg, dtype=dtype))
  params = jax.jit(init_params, static_argnums=0)(cfg, jax.random.key(seed))
  if peak is not None:
    params = jax.jit(peaked_params, static_argnums=(1, 2))(params, cfg, float(peak))
  scan = default_scan_layers() if scan_layers is None else scan_layers
  params = with_scan_layers(params, scan, output_major=output_major)
  name = name_or_cfg if isinstance(name_or_cfg, str) else "random"
  kind = "random" if peak is None else f"peaked{peak:g}"
  return Model(cfg=cfg, params=params, tokenizer=None, name=f"{name}-{kind}-{dtype}")
