"""Per-model precision: weight-only int8 and bfloat16 copies of a model, and int8 self-drafting.

int8 is weight-only and per output channel, symmetric: every weight is stored as int8 values
`q` and a float32 `scale` that has the weight's shape with the contracted (input) axes set to
1, so `w ~= q * scale` and each output channel keeps its own range. `forward` dequantizes a
weight inside the jitted pass, where it reads it; only the int8 values (and the small scales)
are stored. Norms and biases stay in float.

Contracted axes per weight (stacked layouts, letters as in `jaxspec.models`):

  wq [L, D, H, K], wk / wv [L, D, G, K]   contract D        scale [L, 1, H|G, K]
  wo [L, H, K, D]                         contract H, K     scale [L, 1, 1, D]
  w_gate / w_up [L, D, F]                 contract D        scale [L, 1, F]
  w_down [L, F, D]                        contract F        scale [L, 1, D]
  lm_head [D, V]                          contract D        scale [1, V]
  embed [V, D]                            contract D        scale [V, 1]: one scale per row,
                                          which is per channel both for the embedding gather
                                          (a row is a token's vector) and for the tied LM head
                                          (embed.T's output channel v is row v)

The scales of layer weights keep the leading L axis, so `lax.scan` over layers slices a
`QArray` like any other leaf.

Self-speculation, `DraftModel(quantize(target, "int8"))`, is `jaxspec.self_draft.self_drafter`:
it needs `jaxspec.drafters`, which sits above this package.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.models.llama import Params, as_logical, is_scanned
from jaxspec.pytree import pytree_dataclass
from jaxspec.models.model import Model

PRECISIONS = ("int8", "bfloat16", "float32")

# Contracted axes of every quantized weight (see the module docstring); other fields (norms,
# biases) stay in float.
_LAYER_AXES = {"wq": (1,), "wk": (1,), "wv": (1,), "wo": (1, 2), "w_gate": (1,), "w_up": (1,),
               "w_down": (1,)}
_EMBED_AXES = (1,)
_LM_HEAD_AXES = (0,)


@pytree_dataclass
@dataclasses.dataclass
class QArray:
  """A weight-only int8 weight with per-output-channel float32 scales: w ~= q * scale."""

  q: jax.Array  # the weight's shape, int8 in [-127, 127]
  scale: jax.Array  # the weight's shape with the contracted axes set to 1, float32

  @property
  def shape(self) -> tuple[int, ...]:
    return self.q.shape

  @property
  def dtype(self) -> Any:
    return self.q.dtype

  def dequantize(self, dtype=jnp.float32) -> jax.Array:
    """The float weight in `dtype` (the product is formed in float32: one rounding)."""
    return (self.q.astype(jnp.float32) * self.scale.astype(jnp.float32)).astype(dtype)

  def take_rows(self, idx: jax.Array, dtype) -> jax.Array:
    """Rows `idx` of a [V, D] weight with per-row scales [V, 1], as [..., D] in `dtype`:
    gathers int8 rows and their scales, never dequantizing the whole table."""
    if self.scale.ndim != 2 or self.scale.shape[1] != 1:
      raise ValueError(f"take_rows needs per-row scales [V, 1], got {self.scale.shape}: only"
                       " the embedding table is quantized per row")
    rows = jnp.take(self.q, idx, axis=0).astype(jnp.float32)  # [..., D]
    return (rows * jnp.take(self.scale, idx, axis=0)).astype(dtype)  # scales [..., 1]


@functools.partial(jax.jit, static_argnames=("axes",))
def quantize_array(w: jax.Array, axes: tuple[int, ...]) -> QArray:
  """Symmetric int8 with one scale per output channel: scale = max|w| / 127 over the
  contracted `axes` (kept as size-1 axes), q = round(w / scale) clipped to [-127, 127].

  Args:
    w: a float weight of any shape.
    axes: its contracted (input) axes.
  Returns:
    `QArray` with q [w.shape] int8 and scale [w.shape with `axes` set to 1] float32. An
    all-zero channel gets scale 0 and q 0.
  """
  wf = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(wf), axis=axes, keepdims=True)
  scale = amax / 127.0
  q = jnp.round(wf / jnp.where(scale > 0, scale, 1.0))
  return QArray(q=jnp.clip(q, -127, 127).astype(jnp.int8), scale=scale)


def dequantize(x, dtype=jnp.float32):
  """A `QArray` as a float array in `dtype`; any other array is returned unchanged."""
  return x.dequantize(dtype) if isinstance(x, QArray) else x


def is_quantized(params) -> bool:
  """Whether any weight of `params` (or a `Model`'s) is a `QArray`."""
  params = params.params if isinstance(params, Model) else params
  leaves = jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QArray))
  return any(isinstance(x, QArray) for x in leaves)


def param_bytes(params) -> int:
  """Bytes of all weights of `params` (or a `Model`'s): int8 values and scales included."""
  params = params.params if isinstance(params, Model) else params
  return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))


def _quantize_layers(lp, skip: int):
  """A LayerParams' matmul weights in int8; skip=1 for one unrolled layer (no layer axis)."""
  return dataclasses.replace(
      lp, **{name: quantize_array(as_logical(getattr(lp, name)), tuple(a - skip for a in axes))
             for name, axes in _LAYER_AXES.items()})


def _quantize_params(params: Params) -> Params:
  layers = params.layers
  if layers is not None:  # channels are per layer, so each unrolled layer quantizes alone
    layers = (_quantize_layers(layers, 0) if is_scanned(params)
              else tuple(_quantize_layers(lp, 1) for lp in layers))
  return dataclasses.replace(
      params, embed=quantize_array(params.embed, _EMBED_AXES), layers=layers,
      lm_head=None if params.lm_head is None else quantize_array(params.lm_head, _LM_HEAD_AXES))


def _cast_params(params: Params, dtype) -> Params:
  return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x,
                      params)


def quantize(model_or_params: Model | Params, precision: str) -> Model | Params:
  """A copy of a model (or its params) at another weight precision.

  Args:
    model_or_params: a float `Model` or `Params` (float32 or bfloat16 weights).
    precision: "int8" (weight-only, per output channel; activations, norms and biases stay in
      the model's dtype, which is also the compute dtype), "bfloat16" or "float32" (every float
      weight cast; a Model's cfg.dtype follows, so activations and the KV cache use it too,
      unless its cfg.compute_dtype names another, which is kept).
  Returns:
    A new `Model` (same tokenizer, name suffixed "-int8" / "-bfloat16" / "-float32") or
    `Params`, as given. The input is not modified.
  """
  if precision not in PRECISIONS:
    raise ValueError(f"precision {precision!r} is not supported: use one of"
                     f" {', '.join(map(repr, PRECISIONS))}")
  model = model_or_params if isinstance(model_or_params, Model) else None
  params = model.params if model is not None else model_or_params
  if not isinstance(params, Params):
    raise ValueError(f"quantize takes a jaxspec Model or Params, got"
                     f" {type(model_or_params).__name__}")
  if is_quantized(params):
    raise ValueError("these weights are already int8: quantize the float model instead (int8"
                     " cannot be re-quantized or cast back without the original weights)")
  if precision == "int8":
    new_params = _quantize_params(params)
  else:
    new_params = _cast_params(params, jnp.dtype(precision))
  if model is None:
    return new_params
  cfg = model.cfg if precision == "int8" else dataclasses.replace(model.cfg, dtype=precision)
  return Model(cfg, new_params, tokenizer=model.tokenizer, name=f"{model.name}-{precision}")



__all__ = ["PRECISIONS", "QArray", "dequantize", "is_quantized", "param_bytes", "quantize",
           "quantize_array"]
