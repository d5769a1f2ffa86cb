"""Model configuration: one frozen, hashable dataclass for the whole Llama family."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Llama-3 style frequency scaling of the rotary embedding ("rope_type": "llama3")."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
  """Configuration of a Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM).

  Hashable, so it is passed to `jax.jit` as a static argument; change it with
  `dataclasses.replace`.
  """

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rope_theta: float = 10000.0
  rope_scaling: RopeScaling | None = None
  rms_norm_eps: float = 1e-5
  tie_embeddings: bool = False
  attention_bias: bool = False  # Qwen2 has biases on q, k and v.
  sliding_window: int | None = None  # Mistral; None means full causal attention.
  max_position_embeddings: int = 8192
  bos_token_id: int | None = 1
  eos_token_ids: tuple[int, ...] = (2,)
  dtype: str = "float32"  # parameter and activation dtype: "float32" or "bfloat16".
  architecture: str = "llama"

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads {self.num_heads} is not a multiple of num_kv_heads"
          f" {self.num_kv_heads}: grouped-query attention needs whole groups")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype {self.dtype!r} is not supported: use 'float32' or 'bfloat16'")

  @property
  def jnp_dtype(self) -> Any:
    return jnp.dtype(self.dtype)

  @property
  def num_params(self) -> int:
    d, f, k = self.hidden_size, self.intermediate_size, self.head_dim
    per_layer = (d * k * (self.num_heads * 2 + self.num_kv_heads * 2) + 3 * d * f + 2 * d)
    if self.attention_bias:
      per_layer += k * (self.num_heads + 2 * self.num_kv_heads)
    head = 0 if self.tie_embeddings else d * self.vocab_size
    return self.vocab_size * d + self.num_layers * per_layer + d + head


def tiny_config(**overrides) -> LlamaConfig:
  """A tiny random-weight configuration for fast tests."""
  base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
              num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
              tie_embeddings=False, max_position_embeddings=512, eos_token_ids=(2,))
  base.update(overrides)
  return LlamaConfig(**base)
