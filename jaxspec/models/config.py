"""Model configuration: one frozen, hashable dataclass for the whole Llama family."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np


# Bounds on sizes: int32 for anything that becomes an array index or id; a dimension of 2**24
# or a depth of 4096 layers is far past any checkpoint and still fails before an allocation.
_MAX_INT32 = 2**31 - 1
_MAX_DIM = 2**24
_MAX_LAYERS = 4096


def _check_int(name: str, value: Any, lo: int, hi: int) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
    raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")


def _check_positive(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
      or not math.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Llama-3 style frequency scaling of the rotary embedding ("rope_type": "llama3")."""

  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192

  def __post_init__(self):
    for name in ("factor", "low_freq_factor", "high_freq_factor"):
      _check_positive(f"rope_scaling.{name}", getattr(self, name))
    _check_int("rope_scaling.original_max_position_embeddings",
               self.original_max_position_embeddings, 1, _MAX_INT32)
    if self.high_freq_factor == self.low_freq_factor:
      raise ValueError(f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must differ"
                       " from low_freq_factor: the smooth band between them divides by their"
                       " difference")


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
    # Every field's type and range, so a checkpoint's nonsense (a NaN rope_theta, a negative
    # epsilon, an id past int32, the string "false" for a flag) fails at load, not as NaN logits.
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings"):
      _check_int(name, getattr(self, name), 1, _MAX_DIM if name != "max_position_embeddings"
                 else _MAX_INT32)
    _check_int("num_layers", self.num_layers, 1, _MAX_LAYERS)
    _check_positive("rope_theta", self.rope_theta)
    _check_positive("rms_norm_eps", self.rms_norm_eps)
    for name in ("tie_embeddings", "attention_bias"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
    if self.sliding_window is not None:
      _check_int("sliding_window", self.sliding_window, 1, _MAX_INT32)
    if self.bos_token_id is not None:
      _check_int("bos_token_id", self.bos_token_id, 0, _MAX_INT32)
    if not isinstance(self.eos_token_ids, tuple):
      raise ValueError(f"eos_token_ids must be a tuple of token ids, got {self.eos_token_ids!r}")
    for t in self.eos_token_ids:
      _check_int("eos_token_ids", t, 0, _MAX_INT32)
    if self.head_dim % 2:
      raise ValueError(f"head_dim {self.head_dim} is odd: rotary embeddings rotate pairs")
    if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
      raise ValueError(f"rope_scaling must be a RopeScaling or None, got {self.rope_scaling!r}")
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
