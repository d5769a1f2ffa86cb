"""Model configuration: one frozen, hashable dataclass for the whole Llama family."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

from jaxspec.checks import check_int


# Bounds on sizes: int32 for anything that becomes an array index or id; a dimension of 2**24
# or a depth of 4096 layers is far past any checkpoint and still fails before an allocation.
_MAX_INT32 = 2**31 - 1
_MAX_DIM = 2**24
_MAX_LAYERS = 4096


def _check_positive(name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) \
      or not math.isfinite(value) or value <= 0:
    raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


ROPE_TYPES = ("llama3", "linear", "dynamic", "yarn", "longrope")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
  """Scaling of the rotary embedding's frequencies, as Hugging Face's `rope_parameters` name it.

  `rope_type`:
    "llama3": Llama-3's smooth band between `low_freq_factor` and `high_freq_factor`.
    "linear": every inverse frequency divided by `factor` (position interpolation).
    "dynamic": NTK-aware base scaling once a sequence exceeds `original_max_position_embeddings`
      (the checkpoint's max_position_embeddings), with the base for its length.
    "yarn": YaRN's blend of interpolated and extrapolated frequencies (`beta_fast`,
      `beta_slow`, `truncate`) with cos/sin scaled by `attention_factor`.
    "longrope": per-frequency divisors, `short_factor` while a sequence is within
      `original_max_position_embeddings` and `long_factor` past it, with cos/sin scaled by
      `attention_factor`.

  The length-dependent two follow Hugging Face: a prompt is rotated by its own length, every
  later position p by p + 1, the length when it is decoded, so each position keeps one
  rotation (speculative and plain decoding agree). The one difference: when a generation
  crosses the original context, Hugging Face's Phi-3 drops its cache and recomputes the whole
  sequence with the long factors, where jaxspec keeps the short rotations of the positions
  before the crossing (outputs there agree exactly; after it they may differ).
  """

  rope_type: str = "llama3"
  factor: float = 8.0
  low_freq_factor: float = 1.0
  high_freq_factor: float = 4.0
  original_max_position_embeddings: int = 8192
  attention_factor: float = 1.0
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  truncate: bool = True
  short_factor: tuple[float, ...] = ()
  long_factor: tuple[float, ...] = ()

  def __post_init__(self):
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"rope_scaling.rope_type {self.rope_type!r} is not supported (supported:"
                       f" {', '.join(ROPE_TYPES)})")
    for name in ("factor", "low_freq_factor", "high_freq_factor", "attention_factor",
                 "beta_fast", "beta_slow"):
      _check_positive(f"rope_scaling.{name}", getattr(self, name))
    check_int("rope_scaling.original_max_position_embeddings",
               self.original_max_position_embeddings, 1, _MAX_INT32)
    if self.rope_type == "llama3" and self.high_freq_factor == self.low_freq_factor:
      raise ValueError(f"rope_scaling.high_freq_factor ({self.high_freq_factor}) must differ"
                       " from low_freq_factor: the smooth band between them divides by their"
                       " difference")
    for name in ("short_factor", "long_factor"):
      value = getattr(self, name)
      if not isinstance(value, tuple):
        raise ValueError(f"rope_scaling.{name} must be a tuple of numbers, got {value!r}")
      for v in value:
        _check_positive(f"rope_scaling.{name}", v)
    if self.rope_type == "longrope" and (not self.short_factor or
                                         len(self.short_factor) != len(self.long_factor)):
      raise ValueError("rope_scaling of type 'longrope' needs short_factor and long_factor of"
                       " equal, nonzero length (one divisor per rotary frequency)")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
  """YaRN's attention factor for a context extension `scale`: 0.1 * mscale * ln(scale) + 1
  (1 for no extension), transformers' and ggml's default."""
  return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def longrope_attention_factor(scale: float, original: int) -> float:
  """LongRoPE's attention factor for a context extension `scale` over an `original` context:
  sqrt(1 + ln(scale) / ln(original)) (1 for no extension), transformers' default."""
  return 1.0 if scale <= 1 else math.sqrt(1 + math.log(scale) / math.log(original))


ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
# How attention reads the KV cache (`LlamaConfig.attention_kernel`).
ATTENTION_KERNELS = ("auto", "xla", "triton", "mosaic", "triton_interpret", "mosaic_interpret")


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
  """Configuration of a decoder of the Llama lineage: Llama 2/3, Mistral, Qwen2/2.5, Qwen3,
  Gemma 2/3, Phi-3/4 and SmolLM share one layer structure (pre-norm attention and a gated MLP)
  and differ in the switches below.

  Hashable, so it is passed to `jax.jit` as a static argument; change it with
  `dataclasses.replace`.

  Family switches (defaults are Llama's; which family sets which, from which config.json or GGUF
  key, is its file in `jaxspec.models.families`):
    hidden_act: the gated MLP's activation: "silu" (SwiGLU), "gelu_tanh" (Gemma's GeGLU) or
      "gelu" (the exact erf form).
    qk_norm: an RMSNorm over each query and key head before the rotation (Qwen3, Gemma 3).
    post_norms: Gemma 2/3's extra norms on the attention and MLP outputs before each residual
      add (`LayerParams.post_attn_norm`, `post_mlp_norm`).
    norm_offset: how the checkpoint stores norm weights: Gemma stores w and scales by (1 + w)
      (offset 1.0). jaxspec's params hold the scale itself (w + offset, as llama.cpp's GGUFs
      store Gemma's norms), and with an offset the scale multiplies in float32, as Gemma does.
    embed_scale: the embeddings are multiplied by sqrt(hidden_size) (Gemma).
    attn_softcap, final_softcap: cap * tanh(x / cap) of the attention scores and of the
      logits (Gemma 2); None for none.
    query_pre_attn_scalar: attention scores scale by query_pre_attn_scalar ** -0.5 instead of
      head_dim ** -0.5 (Gemma).
    layer_types: per layer "sliding" or "full" attention (Gemma 2/3 alternate); None: every
      layer slides when `sliding_window` is set (Mistral), else none does.
    sliding_rope_theta: the rotary base of sliding layers, unscaled (Gemma 3's local layers);
      None: every layer uses `rope_theta` and `rope_scaling`.
    partial_rotary_factor: the fraction of each head's dimensions that is rotated (Phi-4-mini).

  Run-time choices (no checkpoint's):
    attention_kernel: how attention reads the KV cache (`llama.attention`): "auto" (a Pallas
      kernel where the program is lowered for a CUDA GPU or a TPU, XLA's blocked read
      elsewhere), "xla" (XLA's blocked read everywhere), "triton" or "mosaic" (that Pallas
      kernel whatever the platform: it lowers only for its own), "triton_interpret" or
      "mosaic_interpret" (that kernel in Pallas' interpreter, on any backend: tests and dry
      runs, slow).
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
  dtype: str = "float32"  # parameter dtype: "float32" or "bfloat16".
  # Activations, products and the KV cache: None (the default) computes in `dtype`; "float32"
  # keeps everything but the weights float32 (see `act_dtype`).
  compute_dtype: str | None = None
  architecture: str = "llama"
  hidden_act: str = "silu"
  qk_norm: bool = False
  post_norms: bool = False
  norm_offset: float = 0.0
  embed_scale: bool = False
  attn_softcap: float | None = None
  final_softcap: float | None = None
  query_pre_attn_scalar: float | None = None
  layer_types: tuple[str, ...] | None = None
  sliding_rope_theta: float | None = None
  partial_rotary_factor: float = 1.0
  attention_kernel: str = "auto"

  def __post_init__(self):
    # Every field's type and range, so a checkpoint's nonsense (a NaN rope_theta, a negative
    # epsilon, an id past int32, the string "false" for a flag) fails at load, not as NaN logits.
    for name in ("vocab_size", "hidden_size", "intermediate_size", "num_heads",
                 "num_kv_heads", "head_dim", "max_position_embeddings"):
      check_int(name, getattr(self, name), 1, _MAX_DIM if name != "max_position_embeddings"
                 else _MAX_INT32)
    check_int("num_layers", self.num_layers, 1, _MAX_LAYERS)
    _check_positive("rope_theta", self.rope_theta)
    _check_positive("rms_norm_eps", self.rms_norm_eps)
    for name in ("tie_embeddings", "attention_bias", "qk_norm", "post_norms", "embed_scale"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
    if self.sliding_window is not None:
      check_int("sliding_window", self.sliding_window, 1, _MAX_INT32)
    if self.bos_token_id is not None:
      check_int("bos_token_id", self.bos_token_id, 0, _MAX_INT32)
    if not isinstance(self.eos_token_ids, tuple):
      raise ValueError(f"eos_token_ids must be a tuple of token ids, got {self.eos_token_ids!r}")
    for t in self.eos_token_ids:
      check_int("eos_token_ids", t, 0, _MAX_INT32)
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
    if self.compute_dtype not in (None, "float32"):
      raise ValueError(f"compute_dtype {self.compute_dtype!r} is not supported: use None (compute"
                       " in the weights' dtype) or 'float32' (float32 arithmetic over bfloat16"
                       " weights)")
    if self.attention_kernel not in ATTENTION_KERNELS:
      raise ValueError(f"attention_kernel {self.attention_kernel!r} is not supported: use 'auto'"
                       " (a Pallas kernel on GPUs and TPUs), 'xla' (XLA's blocked read"
                       " everywhere) or one of " + ", ".join(map(repr, ATTENTION_KERNELS[2:])))
    if self.hidden_act not in ACTIVATIONS:
      raise ValueError(f"hidden_act {self.hidden_act!r} is not supported (supported:"
                       f" {', '.join(ACTIVATIONS)})")
    if self.norm_offset not in (0.0, 1.0):
      raise ValueError(f"norm_offset must be 0.0 or 1.0 (Gemma), got {self.norm_offset!r}")
    for name in ("attn_softcap", "final_softcap", "query_pre_attn_scalar", "sliding_rope_theta"):
      if getattr(self, name) is not None:
        _check_positive(name, getattr(self, name))
    if not (isinstance(self.partial_rotary_factor, (int, float))
            and 0 < self.partial_rotary_factor <= 1):
      raise ValueError(f"partial_rotary_factor must be in (0, 1], got"
                       f" {self.partial_rotary_factor!r}")
    if self.rotary_dim % 2 or self.rotary_dim == 0:
      raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} of head_dim"
                       f" {self.head_dim} rotates {self.rotary_dim} dimensions: it must be an"
                       " even, nonzero number")
    if self.layer_types is not None:
      if (not isinstance(self.layer_types, tuple) or len(self.layer_types) != self.num_layers
          or any(t not in ("sliding", "full") for t in self.layer_types)):
        raise ValueError(f"layer_types must be a tuple of num_layers ({self.num_layers}) entries"
                         f" 'sliding' or 'full', got {self.layer_types!r}")
      if "sliding" in self.layer_types and self.sliding_window is None:
        raise ValueError("layer_types has sliding layers but sliding_window is None: set the"
                         " window size")
    if self.sliding_rope_theta is not None and self.sliding_window is None:
      raise ValueError("sliding_rope_theta is the rotary base of sliding-window layers, but"
                       " sliding_window is None: set the window or drop sliding_rope_theta")
    s = self.rope_scaling
    if s is not None and s.rope_type == "longrope" and len(s.short_factor) != self.rotary_dim // 2:
      raise ValueError(f"rope_scaling's LongRoPE factors have {len(s.short_factor)} entries but"
                       f" the rotary embedding has {self.rotary_dim // 2} frequencies (rotary"
                       " dimension / 2): the factors belong to another head size")

  @property
  def rotary_dim(self) -> int:
    """How many leading dimensions of each head are rotated (Hugging Face's int(K * factor))."""
    return int(self.head_dim * self.partial_rotary_factor)

  def is_sliding(self, layer: int) -> bool:
    """Whether decoder layer `layer` attends within `sliding_window` only."""
    if self.sliding_window is None:
      return False
    return self.layer_types is None or self.layer_types[layer] == "sliding"

  @property
  def mixed_layers(self) -> bool:
    """Whether layers differ in attention window or rotary base (Gemma 2/3)."""
    kinds = {self.is_sliding(i) for i in range(self.num_layers)}
    return len(kinds) > 1

  @property
  def jnp_dtype(self) -> Any:
    """The weights' dtype (activations' and the KV cache's: `act_dtype`)."""
    return jnp.dtype(self.dtype)

  @property
  def act_dtype(self) -> Any:
    """The dtype of activations, products and the KV cache: `compute_dtype`, or `dtype` when
    None.

    "float32" over bfloat16 weights: every product reads the bfloat16 weights into float32
    arithmetic; the residual stream, norms, attention and the KV cache are float32, as in a
    float32 model whose weights were rounded to bfloat16. A one-token decode step and a
    (k+1)-token verify pass then differ by float32 summation order only, as a float32 model's
    do, where in bfloat16 each product's rounding to bfloat16 can differ between the two and
    grow through the layers (greedy speculative decoding can then pick another token at a
    near-tie: see the models guide)."""
    return jnp.dtype(self.dtype if self.compute_dtype is None else self.compute_dtype)

  @property
  def num_params(self) -> int:
    d, f, k = self.hidden_size, self.intermediate_size, self.head_dim
    per_layer = (d * k * (self.num_heads * 2 + self.num_kv_heads * 2) + 3 * d * f
                 + (4 if self.post_norms else 2) * d + (2 * k if self.qk_norm else 0))
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
