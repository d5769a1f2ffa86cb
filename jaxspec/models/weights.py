"""One declaration per weight of a Llama-family model.

Every weight of `Params` and `LayerParams` (`jaxspec.models.llama`) is declared once, in
`WEIGHTS`: its logical axes (which give its shape for a configuration and, through
`jaxspec.sharding.rules.ShardingRules`, its sharding), whether it is one per decoder layer, the
axes a matrix product contracts (int8 quantization's per-channel axes, and the output-major
layout's input axes), its initializer, whether it is a norm scale, and the configuration switch
that adds it. The sharding rules, the unrolled output-major layout (`llama.OutputMajor`), int8
quantization (`jaxspec.models.quant`), `llama.init_params` and `llama.stack_params` (the
loaders' common path) all read this table; none of them restates a weight's shape or axes.

A stored weight is a float array, or an int8 `QArray` (declared here so the model and the
quantizer both import it from below them), or in the unrolled layout on one device an
`llama.OutputMajor` one; every form has the declared logical shape.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.models.config import LlamaConfig
from jaxspec.pytree import pytree_dataclass

INITIALIZERS = ("normal", "ones")


def axis_sizes(cfg: LlamaConfig) -> dict[str, int]:
  """The size of every logical axis a weight has, for `cfg` (the vocabulary of
  `jaxspec.sharding.rules`)."""
  return dict(heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, ffw=cfg.intermediate_size,
              vocab=cfg.vocab_size, embed=cfg.hidden_size, head_dim=cfg.head_dim,
              layers=cfg.num_layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Weight:
  """The declaration of one weight.

  Attributes:
    name: its field in `LayerParams` (for `layer` weights) or `Params`.
    axes: its logical axes, in the order of its dimensions, without the layer axis; they give
      its shape (`shape`) and its sharding.
    layer: one per decoder layer: stacked on a leading "layers" axis, or one per layer in the
      unrolled layout.
    contract: the axes a matrix product contracts (its input axes). A weight with any is a
      matmul weight: `quantize` stores it as int8 with one scale per output channel (the other
      axes); () for weights read elementwise (norms, biases), which stay float.
    output_major: the unrolled layout may hold it output-major (`llama.OutputMajor`, where the
      `llama.OutputMajorPolicy` allows): its contracted axes must lead.
    init: `init_params`' initializer: "normal" (scale * N(0, 1), drawn in float32 from the next
      of its keys, in the order of `WEIGHTS`) or "ones".
    norm: a norm scale: with Gemma's `norm_offset` a loaded one stays float32 (`dtype`).
    when: the `LlamaConfig` switch that adds it ("qk_norm"), or "not <switch>" for one a switch
      removes (the untied LM head); None: every configuration has it.
  """

  name: str
  axes: tuple[str, ...]
  layer: bool = True
  contract: tuple[int, ...] = ()
  output_major: bool = False
  init: str = "normal"
  norm: bool = False
  when: str | None = None

  def __post_init__(self):
    if self.init not in INITIALIZERS:
      raise ValueError(f"weight {self.name!r}: init {self.init!r} is not one of {INITIALIZERS}")
    if self.output_major and self.contract != tuple(range(len(self.contract))):
      raise ValueError(f"weight {self.name!r}: an output-major weight's contracted axes must"
                       f" lead, got {self.contract}")

  @property
  def stacked_axes(self) -> tuple[str, ...]:
    """Its logical axes in the stacked layout (the layer axis first for `layer` weights)."""
    return ("layers", *self.axes) if self.layer else self.axes

  @property
  def n_out(self) -> int:
    """How many trailing axes are a matmul weight's output axes."""
    return len(self.axes) - len(self.contract)

  def contract_axes(self, stacked: bool) -> tuple[int, ...]:
    """The contracted axes of the weight as stored: shifted past the layer axis when
    `stacked` (a layer weight of the stacked layout)."""
    shift = 1 if stacked and self.layer else 0
    return tuple(a + shift for a in self.contract)

  def present(self, cfg: LlamaConfig) -> bool:
    """Whether a model of `cfg` has this weight."""
    if self.when is None:
      return True
    negate = self.when.startswith("not ")
    return bool(getattr(cfg, self.when.removeprefix("not "))) != negate

  def shape(self, cfg: LlamaConfig, stacked: bool = True) -> tuple[int, ...]:
    """Its shape for `cfg`; a layer weight's with the leading layer axis when `stacked`."""
    sizes = axis_sizes(cfg)
    return tuple(sizes[a] for a in (self.stacked_axes if stacked else self.axes))

  def dtype(self, cfg: LlamaConfig) -> Any:
    """The dtype a loaded checkpoint holds it in: the configuration's, except Gemma's (1 + w)
    norm scales, which stay float32 as Gemma computes them (rounded to bfloat16 they would
    scale every norm by up to 0.4% off). `init_params` makes every weight in the
    configuration's dtype."""
    return jnp.dtype(jnp.float32) if self.norm and cfg.norm_offset else cfg.jnp_dtype


_FROM_WIDTH = dict(contract=(0,), output_major=True)  # [D, *out]: a product over the model width

# The order is `LayerParams`' fields, then `Params`' (tests/test_weights.py checks it), and
# decides which of `init_params`' keys each "normal" weight draws.
WEIGHTS: tuple[Weight, ...] = (
    Weight(name="attn_norm", axes=("embed",), init="ones", norm=True),
    Weight(name="wq", axes=("embed", "heads", "head_dim"), **_FROM_WIDTH),
    Weight(name="wk", axes=("embed", "kv_heads", "head_dim"), **_FROM_WIDTH),
    Weight(name="wv", axes=("embed", "kv_heads", "head_dim"), **_FROM_WIDTH),
    Weight(name="wo", axes=("heads", "head_dim", "embed"), contract=(0, 1), output_major=True),
    Weight(name="mlp_norm", axes=("embed",), init="ones", norm=True),
    Weight(name="w_gate", axes=("embed", "ffw"), **_FROM_WIDTH),
    Weight(name="w_up", axes=("embed", "ffw"), **_FROM_WIDTH),
    Weight(name="w_down", axes=("ffw", "embed"), contract=(0,), output_major=True),
    Weight(name="bq", axes=("heads", "head_dim"), when="attention_bias"),  # Qwen2
    Weight(name="bk", axes=("kv_heads", "head_dim"), when="attention_bias"),
    Weight(name="bv", axes=("kv_heads", "head_dim"), when="attention_bias"),
    Weight(name="q_norm", axes=("head_dim",), init="ones", norm=True, when="qk_norm"),  # Qwen3
    Weight(name="k_norm", axes=("head_dim",), init="ones", norm=True, when="qk_norm"),
    Weight(name="post_attn_norm", axes=("embed",), init="ones", norm=True,
           when="post_norms"),  # Gemma 2/3
    Weight(name="post_mlp_norm", axes=("embed",), init="ones", norm=True, when="post_norms"),
    # The embedding's product (the tied LM head) contracts the width: one scale per row.
    Weight(name="embed", axes=("vocab", "embed"), layer=False, contract=(1,)),
    Weight(name="final_norm", axes=("embed",), layer=False, init="ones", norm=True),
    Weight(name="lm_head", axes=("embed", "vocab"), layer=False, contract=(0,),
           when="not tie_embeddings"),
)

WEIGHT: dict[str, Weight] = {w.name: w for w in WEIGHTS}
LAYER_WEIGHTS: tuple[Weight, ...] = tuple(w for w in WEIGHTS if w.layer)
MODEL_WEIGHTS: tuple[Weight, ...] = tuple(w for w in WEIGHTS if not w.layer)


@pytree_dataclass
@dataclasses.dataclass
class QArray:
  """A weight-only int8 weight with per-output-channel float32 scales: w ~= q * scale
  (`jaxspec.models.quant.quantize`)."""

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


__all__ = ["LAYER_WEIGHTS", "MODEL_WEIGHTS", "QArray", "WEIGHT", "WEIGHTS", "Weight",
           "axis_sizes"]
