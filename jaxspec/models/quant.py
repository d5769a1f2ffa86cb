"""Per-model precision: weight-only int8 and bfloat16 copies of a model, and int8 self-drafting.

int8 is weight-only and per output channel, symmetric: every weight is stored as int8 values
`q` and a float32 `scale` that has the weight's shape with the contracted (input) axes set to
1, so `w ~= q * scale` and each output channel keeps its own range. `forward` dequantizes a
weight inside the jitted pass, where it reads it; only the int8 values (and the small scales)
are stored. Norms and biases stay in float.

The weights quantized, and the axes each contracts, are their declarations' (`Weight.contract`
in `jaxspec.models.weights`): wo [L, H, K, D] contracts H and K (scale [L, 1, 1, D]), w_down
[L, F, D] contracts F, the other layer matmuls and the untied LM head contract D. The embedding
[V, D] contracts D too (scale [V, 1]): one scale per row, which is per channel both for the
embedding gather (a row is a token's vector) and for the tied LM head (embed.T's output
channel v is row v).

The scales of layer weights keep the leading L axis, so `lax.scan` over layers slices a
`QArray` like any other leaf.

Self-speculation, `DraftModel(quantize(target, "int8"))`, is `jaxspec.drafters.self_drafter`:
it needs `jaxspec.drafters`, which sits above this package.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxspec.models.llama import Params, as_logical, is_scanned
from jaxspec.models.model import Model
from jaxspec.models.weights import LAYER_WEIGHTS, MODEL_WEIGHTS, QArray

PRECISIONS = ("int8", "bfloat16", "float32")


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


def _quantize_fields(tree, weights, stacked: bool):
  """`tree`'s matmul weights among `weights` (those that contract axes) in int8; norms, biases
  and absent weights as they are."""
  def one(w):
    x = getattr(tree, w.name)
    return quantize_array(as_logical(x), w.contract_axes(stacked)) if x is not None else None
  return dataclasses.replace(tree, **{w.name: one(w) for w in weights if w.contract})


def _quantize_params(params: Params) -> Params:
  layers = params.layers
  if layers is not None:  # channels are per layer, so each unrolled layer quantizes alone
    layers = (_quantize_fields(layers, LAYER_WEIGHTS, stacked=True) if is_scanned(params)
              else tuple(_quantize_fields(lp, LAYER_WEIGHTS, stacked=False) for lp in layers))
  return dataclasses.replace(_quantize_fields(params, MODEL_WEIGHTS, stacked=False),
                             layers=layers)


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
