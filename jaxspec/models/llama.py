"""A decoder of the Llama lineage as pure functions over dataclass pytrees.

Covers Llama 2/3 (plain, Llama-3, linear, dynamic and YaRN scaled rotary), Mistral (optional
sliding window), Qwen2 (q/k/v biases), Qwen3 (q/k norms), Gemma 2/3 (GeGLU, sandwich norms,
embedding scaling, soft-capping, alternating sliding-window and global layers with their own
rotary bases), Phi-3/4 (LongRoPE, partial rotary) and SmolLM: RMSNorm, rotary embeddings in the
Hugging Face "rotate half" layout, grouped-query attention, gated MLP, tied or untied LM head;
`LlamaConfig`'s family switches select the variant. Layers are either stacked on a
leading axis and run with `lax.scan`, or held one set per layer and unrolled (`with_scan_layers`);
unrolled on one CPU device, the matmul weights are held output-major (`OutputMajor`), which
XLA's CPU matmul multiplies by a few rows without repacking the weight.

The KV cache holds a *per-row* length: speculative decoding accepts a different number of
tokens in every row, so every row writes at, and attends up to, its own position. Rolling a row
back is moving its length back; entries past the length are never read. Sliding-window layers
keep ring buffers of window + `RING_SLACK` slots where that is less than the cache's positions
(`KVCache`, `ring_size`), so their memory follows the window rather than max_len.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import jax
import jax.numpy as jnp
from jax import lax

from jaxspec.checks import check_int
from jaxspec.lm import Hidden, register_config
from jaxspec.models.config import ATTENTION_KERNELS, LlamaConfig
from jaxspec.models.weights import LAYER_WEIGHTS, WEIGHT, WEIGHTS, QArray
from jaxspec.pytree import pytree_dataclass


_pytree = pytree_dataclass


@_pytree
@dataclasses.dataclass
class LayerParams:
  """Decoder layer weights, stacked on a leading layer axis L (or, in `Params.layers`' unrolled
  layout, one LayerParams per layer without that axis: `with_scan_layers`). Each field's shape,
  logical axes, initializer and the switch that adds an optional one are declared once, in
  `jaxspec.models.weights.WEIGHTS`. The matmul weights may be int8 `QArray`s
  (`jaxspec.models.quant`) or, unrolled, `OutputMajor`; norms and biases are always float."""

  attn_norm: jax.Array
  wq: jax.Array | QArray
  wk: jax.Array | QArray
  wv: jax.Array | QArray
  wo: jax.Array | QArray
  mlp_norm: jax.Array
  w_gate: jax.Array | QArray
  w_up: jax.Array | QArray
  w_down: jax.Array | QArray
  bq: jax.Array | None = None  # Qwen2 (cfg.attention_bias)
  bk: jax.Array | None = None
  bv: jax.Array | None = None
  q_norm: jax.Array | None = None  # Qwen3, Gemma 3 (cfg.qk_norm)
  k_norm: jax.Array | None = None
  post_attn_norm: jax.Array | None = None  # Gemma 2/3 (cfg.post_norms)
  post_mlp_norm: jax.Array | None = None


@_pytree
@dataclasses.dataclass
class Params:
  """All weights of a Llama-family model (declared in `jaxspec.models.weights.WEIGHTS`)."""

  embed: jax.Array | QArray
  layers: LayerParams | tuple[LayerParams, ...]  # stacked, or one per layer (unrolled)
  final_norm: jax.Array
  lm_head: jax.Array | QArray | None = None  # None when tied to `embed`.


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["k", "v", "length", "k_ring", "v_ring"],
                   meta_fields=["ring_layers"])
@dataclasses.dataclass
class KVCache:
  """Preallocated keys and values with a per-row length.

  Row b holds valid entries at positions [0, length[b]); everything past is garbage that is
  never attended to, which is what makes `length = length - n` a complete rollback.

  Sliding-window layers may keep a ring buffer instead (`init_cache`, `ring_size`): W =
  window + slack slots, position p in slot p mod W, so their memory follows the window, not
  max_len. Then `k`/`v` stack only the full-attention layers and `k_ring`/`v_ring` the sliding
  ones (`ring_layers`, in layer order). A ring slot holds the latest position written to it;
  attention maps slot s of a row of length n to the position n - 1 - ((n - 1 - s) mod W) and
  masks by that. The slack keeps rollback a matter of the length alone: a rejected write at
  position q >= n overwrote position q - W, which lies before every window still read as long
  as no write reaches further than the slack past the kept length (`RING_SLACK`).
  """

  k: jax.Array  # [L, B, G, S, K]; heads before positions so attention is a plain batched matmul
  v: jax.Array  # [L, B, G, S, K] (L: the full-attention layers only when there is a ring)
  length: jax.Array  # [B] int32
  k_ring: jax.Array | None = None  # [Lr, B, G, W, K] the sliding layers' rings, or None
  v_ring: jax.Array | None = None  # [Lr, B, G, W, K]
  ring_layers: tuple[int, ...] = ()  # the layers held in the rings (static)

  @property
  def max_len(self) -> int:
    return self.k.shape[3]

  @property
  def batch_size(self) -> int:
    return self.k.shape[1]

  @property
  def ring_len(self) -> int | None:
    """W, the slots of each sliding layer's ring; None without rings."""
    return None if self.k_ring is None else self.k_ring.shape[3]

  def slot(self, layer: int) -> tuple[bool, int]:
    """(in the ring, index in its stack) of decoder layer `layer`."""
    if layer in self.ring_layers:
      return True, self.ring_layers.index(layer)
    return False, layer - sum(1 for r in self.ring_layers if r < layer)


@functools.partial(jax.tree_util.register_dataclass, data_fields=["w"], meta_fields=["n_out"])
@dataclasses.dataclass
class OutputMajor:
  """A float matmul weight stored output-major: a logical [*in, *out] weight (wq's [D, H, K],
  wo's [H, K, D], ...) held as [*out, *in], the layout of PyTorch's Linear. The unrolled
  layer layout on CPU holds its matmul weights so (`with_scan_layers`), because a verify pass
  or a small batch multiplies a few rows by each weight, and XLA's CPU matmul for a few rows
  repacks a row-major [in, out] right-hand side at every call, reading it twice from memory;
  as blocks of 64 output rows of an [out, in] weight (a free reshape) the repacking stays in
  cache. Indexing, `.shape` and `.dtype` see the logical weight."""

  w: jax.Array  # [*out, *in]
  n_out: int  # how many leading axes of `w` are output axes

  @classmethod
  def from_logical(cls, w: jax.Array, n_out: int) -> OutputMajor:
    """A logical [*in, *out] weight with `n_out` output axes, stored output-major."""
    n_in = w.ndim - n_out
    return cls(jnp.transpose(w, (*range(n_in, w.ndim), *range(n_in))), n_out)

  def logical(self) -> jax.Array:
    """The weight in the [*in, *out] layout (a transposed copy)."""
    n = self.w.ndim
    return jnp.transpose(self.w, (*range(self.n_out, n), *range(self.n_out)))

  @property
  def shape(self) -> tuple[int, ...]:
    return (*self.w.shape[self.n_out:], *self.w.shape[:self.n_out])

  @property
  def dtype(self):
    return self.w.dtype

  @property
  def ndim(self) -> int:
    return self.w.ndim

  def __getitem__(self, idx):
    return self.logical()[idx]

  def __array__(self, dtype=None, copy=None):
    import numpy as np
    return np.asarray(self.logical(), dtype)


# The LayerParams weights the unrolled layout may hold output-major (`Weight.output_major`).
_OUTPUT_MAJOR = tuple(w.name for w in LAYER_WEIGHTS if w.output_major)


def as_logical(w):
  """A weight in its logical layout: an `OutputMajor` one transposed back, any other as is."""
  return w.logical() if isinstance(w, OutputMajor) else w


def _to_output_major(lp: LayerParams, names: tuple[str, ...] = _OUTPUT_MAJOR) -> LayerParams:
  """One unrolled layer's float matmul weights `names` as `OutputMajor` (int8 `QArray`s
  stay)."""
  def conv(name):
    w = getattr(lp, name)
    if isinstance(w, (OutputMajor, QArray)):
      return w
    return OutputMajor.from_logical(w, WEIGHT[name].n_out)
  return dataclasses.replace(lp, **{name: conv(name) for name in names})


def _to_input_major(lp: LayerParams) -> LayerParams:
  """The inverse of `_to_output_major`: every matmul weight in its logical layout."""
  return dataclasses.replace(lp, **{name: as_logical(getattr(lp, name))
                                    for name in _OUTPUT_MAJOR})


def stack_params(cfg: LlamaConfig, layer, embed, final_norm, lm_head=None, *, place=None,
                 scan: bool = True) -> Params:
  """Builds `Params` from host arrays: `layer(i)` returns layer i's LayerParams fields as numpy
  arrays; `embed`, `final_norm` and `lm_head` are arrays or functions returning them (called
  one at a time, so no two large tensors wait on the host together).

  Without `place`, the layers go straight into stacked [L, ...] arrays of cfg's dtype (one copy
  per weight) on the default device. With `place` (`jaxspec.sharding.rules.Placer`: a mesh and
  sharding rules), each tensor is converted to cfg's dtype alone and every device receives only
  its shard of it (`place.put`), so host memory holds about one layer in float32 at a time and
  no device ever holds a full unsharded weight; layers come stacked (`scan`: each layer written
  into its slot of the stacked array in place) or one per layer. Every weight takes the dtype
  its declaration gives (`Weight.dtype`: Gemma's norm scales stay float32), and every layer
  must hold exactly the weights `cfg` declares, in their declared shapes.
  """
  import numpy as np
  dtype_of = lambda key: np.dtype(WEIGHT[key].dtype(cfg))
  fetch = lambda x: x() if callable(x) else x

  def layer_arrays(i):
    arrays = {key: fetch(value) for key, value in layer(i).items()}
    _check_layer_arrays(cfg, i, arrays)
    return arrays.items()

  if place is not None:
    place.check(cfg)
    host = lambda key, x: np.ascontiguousarray(fetch(x), dtype_of(key))
    per_layer: dict[str, list] = {}
    stacked: dict[str, jax.Array] = {}
    for i in range(cfg.num_layers):
      for key, value in layer_arrays(i):
        x = host(key, value)
        if scan:  # written into its slot of the stacked array, which is updated in place
          if key not in stacked:
            stacked[key] = place.empty_stacked(key, (cfg.num_layers, *x.shape), x.dtype)
          stacked[key] = place.set_layer(key, stacked[key], x, i)
        else:
          per_layer.setdefault(key, []).append(place.put(key, x, layer_axis=True))
    if scan:
      layers = LayerParams(**stacked)
    else:
      layers = tuple(LayerParams(**{k: v[i] for k, v in per_layer.items()})
                     for i in range(cfg.num_layers))
    embed_a = place.put("embed", host("embed", embed))
    norm_a = place.put("final_norm", host("final_norm", final_norm))
    head = fetch(lm_head)
    return Params(embed=embed_a, layers=layers, final_norm=norm_a,
                  lm_head=None if head is None else place.put("lm_head", host("lm_head", head)))
  to_jax = lambda key, x: jax.device_put(np.ascontiguousarray(fetch(x), dtype_of(key)))
  stacked = {}
  for i in range(cfg.num_layers):
    for key, value in layer_arrays(i):
      if key not in stacked:
        stacked[key] = np.empty((cfg.num_layers, *value.shape), dtype_of(key))
      stacked[key][i] = value
  params = Params(embed=to_jax("embed", embed),
                  layers=LayerParams(**{k: jax.device_put(v) for k, v in stacked.items()}),
                  final_norm=to_jax("final_norm", final_norm), lm_head=None)
  head = fetch(lm_head)
  return dataclasses.replace(params, lm_head=None if head is None else to_jax("lm_head", head))


def _check_layer_arrays(cfg: LlamaConfig, i: int, arrays: dict) -> None:
  """A loader's layer i holds exactly the layer weights `cfg` declares, in their shapes."""
  import numpy as np
  want = {w.name: w.shape(cfg, stacked=False) for w in LAYER_WEIGHTS if w.present(cfg)}
  got = {k: tuple(np.shape(v)) for k, v in arrays.items()}
  if got != want:
    diff = sorted(k for k in want.keys() | got.keys() if want.get(k) != got.get(k))
    raise ValueError(
        f"layer {i} of the loaded weights does not match the configuration's declarations:"
        + "".join(f" {k} is {got.get(k, 'missing')}, declared {want.get(k, 'absent')};"
                  for k in diff)
        + " the loader must give every weight `jaxspec.models.weights.WEIGHTS` declares for"
        " this configuration (`Weight.present`, `Weight.shape`)")


# ----------------------------------------------------------------------------------------------
# Layer layout. `Params.layers` is either one `LayerParams` stacked on a leading layer axis
# (`forward` runs a `lax.scan` over it) or a tuple of per-layer `LayerParams` without that axis
# (`forward` unrolls the layers). Unrolled compiles several times slower, but on XLA's CPU
# backend a scan copies every layer's weights out of the stacked arrays at every step (a
# dynamic slice is materialised before each matmul), so an unrolled step reads the weights once
# instead of three times (measurements: docs/lab-notes/code-notes-moved.md). MaxText calls the
# same choice `scan_layers`.


def is_scanned(params: Params) -> bool:
  """Whether `params.layers` is stacked (run by `lax.scan`) rather than one tree per layer."""
  return not isinstance(params.layers, tuple)


def stacked_layers(params: Params) -> LayerParams:
  """The layers stacked on a leading axis, whichever the layout (a stacked copy when unrolled)."""
  if is_scanned(params):
    return params.layers
  return _stack_layers(params.layers)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutputMajorPolicy:
  """Where the unrolled layout holds its float matmul weights output-major (`OutputMajor`):
  on one device of a listed platform, for the dtypes listed for it. A sharded model keeps the
  logical layout, which the sharding rules and XLA's partitioner expect.

  Attributes:
    platforms: (platform, dtypes) pairs: on a device of `platform` ("cpu", "gpu") the matmul
      weights whose dtype is in `dtypes` (names such as "float32"; None: every float dtype)
      are held output-major. A platform not listed keeps the logical layout.
    weights: the names of the layer weights held so (a subset of `wq`, `wk`, `wv`, `wo`,
      `w_gate`, `w_up`, `w_down`); None: all of them. One product can lower better in one
      layout and the rest in the other (`benchmarks/bench_synthetic.py --output-major wo`).
  """

  platforms: tuple[tuple[str, frozenset[str] | None], ...] = ()
  weights: frozenset[str] | None = None

  def __post_init__(self):
    if self.weights is not None:
      unknown = sorted(set(self.weights) - set(_OUTPUT_MAJOR))
      if unknown:
        raise ValueError(f"OutputMajorPolicy.weights names {unknown}, not layer matmul weights:"
                         f" choose from {', '.join(_OUTPUT_MAJOR)}")
      object.__setattr__(self, "weights", frozenset(self.weights))

  @property
  def names(self) -> tuple[str, ...]:
    """The layer weights this policy holds output-major, in the table's order."""
    return tuple(n for n in _OUTPUT_MAJOR if self.weights is None or n in self.weights)

  def applies(self, tree) -> bool:
    """Whether every weight of `tree` is a concrete array on one device where this policy holds
    its dtype output-major."""
    allowed = dict(self.platforms)
    leaves = jax.tree.leaves(tree)
    if not leaves:
      return False
    for x in leaves:
      if not isinstance(x, jax.Array) or isinstance(x, jax.core.Tracer):
        return False
      devices = x.devices()
      if len(devices) != 1:
        return False
      platform = next(iter(devices)).platform
      if platform not in allowed:
        return False
      dtypes = allowed[platform]
      if dtypes is not None and x.ndim > 1 and str(x.dtype) not in dtypes:
        return False
    return True


# The default: on the CPU every float matmul weight (see `OutputMajor`); on GPUs float32 ones
# only. There a float32 decode step's matrix-vector products (full float32 precision) lower to
# reductions, and XLA's row reduction over the contiguous input axis reads a weight at close to
# the memory's bandwidth where the column reduction of the logical [in, out] layout does not.
# bfloat16 weights stay logical on GPUs, the layout of the fastest bfloat16 steps measured;
# `benchmarks/bench_synthetic.py --output-major on|off` compares (measurements:
# docs/lab-notes/code-notes-moved.md).
DEFAULT_OUTPUT_MAJOR = OutputMajorPolicy(
    platforms=(("cpu", None), ("gpu", frozenset({"float32"}))))
# The logical layout everywhere (what a sharded model keeps).
NO_OUTPUT_MAJOR = OutputMajorPolicy()


def with_scan_layers(params: Params, scan: bool, *,
                     output_major: OutputMajorPolicy = DEFAULT_OUTPUT_MAJOR) -> Params:
  """`params` in the stacked (scan=True) or per-layer (scan=False) layout; the same object
  when already so. Converting copies the layer weights once (the old arrays can then be
  freed); values are unchanged. Where `output_major` applies (by default on the CPU backend)
  the per-layer layout holds the float matmul weights output-major (`OutputMajor`), whose
  few-row products sum in another order: outputs then agree with the stacked layout's up to
  float rounding; with `NO_OUTPUT_MAJOR` they are bit-identical."""
  if scan == is_scanned(params) or params.layers is None:
    return params
  if scan:
    return dataclasses.replace(params, layers=stacked_layers(params))
  n = jax.tree.leaves(params.layers)[0].shape[0]
  if output_major.applies(params.layers):
    names = output_major.names
    layers = tuple(_take_layer_output_major(params.layers, i, names) for i in range(n))
  else:
    layers = tuple(_take_layer(params.layers, i) for i in range(n))
  return dataclasses.replace(params, layers=layers)


def input_major(params: Params) -> Params:
  """`params` with every `OutputMajor` weight back in its logical layout (the same object when
  none is output-major)."""
  if is_scanned(params) or params.layers is None or not any(
      isinstance(getattr(lp, n), OutputMajor) for lp in params.layers for n in _OUTPUT_MAJOR):
    return params
  return dataclasses.replace(params, layers=tuple(_to_input_major(lp) for lp in params.layers))


# One compiled slice for every layer and conversion: its outputs are fresh buffers, so no view
# keeps the stacked arrays alive.
_take_layer = jax.jit(lambda tree, i: jax.tree.map(lambda a: a[i], tree))
_take_layer_output_major = jax.jit(lambda tree, i, names: _to_output_major(
    jax.tree.map(lambda a: a[i], tree), names), static_argnums=2)
_stack_layers = jax.jit(lambda layers: jax.tree.map(
    lambda *a: jnp.stack(a), *(_to_input_major(lp) for lp in layers)))


# The layer layout `jaxspec.load` picks per backend (`default_scan_layers`), from measurements
# (docs/lab-notes/code-notes-moved.md):
#   cpu: unrolled. A scan copies every layer's weights out of the stacked arrays at every step.
#   gpu: unrolled. The same copies happen on GPUs.
#   tpu: stacked, unmeasured here (MaxText's default; TPU XLA fuses the per-layer slice into
#     the matmul). Compile time stays flat in depth.
DEFAULT_SCAN_LAYERS = {"cpu": False, "gpu": False, "cuda": False, "rocm": False, "tpu": True}


def default_scan_layers(backend: str | None = None) -> bool:
  """Whether `jaxspec.load` stacks the layers (`lax.scan`) on `backend` (default: JAX's default
  backend): see `DEFAULT_SCAN_LAYERS`. A backend not listed gets the stacked layout. The
  environment variable JAXSPEC_SCAN_LAYERS=stacked|unrolled overrides it (stacked compiles
  several times faster, for short runs and examples)."""
  env = os.environ.get("JAXSPEC_SCAN_LAYERS", "").strip().lower()
  if env:
    if env not in ("stacked", "unrolled"):
      raise ValueError(f"JAXSPEC_SCAN_LAYERS must be 'stacked' or 'unrolled', got {env!r}")
    return env == "stacked"
  return DEFAULT_SCAN_LAYERS.get(backend or jax.default_backend(), True)


# Ring slots a sliding layer keeps beyond its window (`init_cache`): at least the widest write
# the decoding loop makes past a row's kept length (a verify of k + 1 <= 257 tokens, a tree of
# at most 256 nodes, a draft model's k + 1 positions past its length), so that a rolled-back
# write never overwrites a position some window still reads. A multiple of 32 past 257.
RING_SLACK = 288


def ring_size(cfg: LlamaConfig, max_len: int, slack: int | None = RING_SLACK) -> int | None:
  """The slots W of each sliding layer's ring buffer in a cache of `max_len` positions:
  window + slack when that is smaller than max_len, else None (every layer keeps max_len
  positions, as without windows). slack None: no rings."""
  if slack is None or cfg.sliding_window is None:
    return None
  if not any(cfg.is_sliding(i) for i in range(cfg.num_layers)):
    return None
  size = cfg.sliding_window + slack
  return size if size < max_len else None


def init_cache(cfg: LlamaConfig, batch_size: int, max_len: int, dtype=None, *,
               ring_slack: int | None = RING_SLACK) -> KVCache:
  """An empty cache for `batch_size` rows of up to `max_len` positions, in the compute dtype
  (`LlamaConfig.act_dtype`) unless `dtype` is given. Sliding-window layers keep rings of
  window + `ring_slack` slots where that is less than max_len (`ring_size`; `ring_slack`
  must cover the widest write past a row's kept length: `RING_SLACK`); None: never."""
  dtype = cfg.act_dtype if dtype is None else dtype
  length = jnp.zeros((batch_size,), jnp.int32)
  if ring_slack is not None:
    check_int("ring_slack", ring_slack, 1, 1 << 24)
  size = ring_size(cfg, max_len, ring_slack)
  dims = (batch_size, cfg.num_kv_heads)
  if size is None:
    shape = (cfg.num_layers, *dims, max_len, cfg.head_dim)
    return KVCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype), length=length)
  ring = tuple(i for i in range(cfg.num_layers) if cfg.is_sliding(i))
  full = (cfg.num_layers - len(ring), *dims, max_len, cfg.head_dim)
  rshape = (len(ring), *dims, size, cfg.head_dim)
  return KVCache(k=jnp.zeros(full, dtype), v=jnp.zeros(full, dtype), length=length,
                 k_ring=jnp.zeros(rshape, dtype), v_ring=jnp.zeros(rshape, dtype),
                 ring_layers=ring)


def init_params(cfg: LlamaConfig, key: jax.Array, scale: float = 0.02) -> Params:
  """Random weights for tests and distillation starts: every weight `cfg` declares
  (`jaxspec.models.weights.WEIGHTS`), in its declared shape and cfg's dtype, normal with std
  `scale` or ones (norms) as its declaration says. The "normal" weights draw, in the table's
  order, from 16 keys split from `key`."""
  dt = cfg.jnp_dtype
  keys = iter(jax.random.split(key, 16))

  def make(w):
    if not w.present(cfg):
      return None
    if w.init == "ones":
      return jnp.ones(w.shape(cfg), dt)
    return (scale * jax.random.normal(next(keys), w.shape(cfg), jnp.float32)).astype(dt)

  arrays = {w.name: make(w) for w in WEIGHTS}
  return Params(layers=LayerParams(**{w.name: arrays.pop(w.name) for w in LAYER_WEIGHTS}),
                **arrays)


def rms_norm(x: jax.Array, w: jax.Array, eps: float, scale_f32: bool = False) -> jax.Array:
  """RMSNorm computed in float32, cast back to x's dtype (as Hugging Face's LlamaRMSNorm); with
  `scale_f32` the scale multiplies before the cast (Gemma's order)."""
  xf = x.astype(jnp.float32)
  xf = xf * lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
  if scale_f32:
    return (xf * w.astype(jnp.float32)).astype(x.dtype)
  return w * xf.astype(x.dtype)


def _base_inv_freq(theta, dim: int) -> jax.Array:
  """1 / theta^(2i/dim) for the dim/2 rotated pairs (theta may be an array of bases)."""
  return 1.0 / (theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def _longrope_inv_freq(theta, factors, dim: int) -> jax.Array:
  """LongRoPE's 1 / (factor_i * theta^(2i/dim)), in Hugging Face's order of operations."""
  return 1.0 / (jnp.asarray(factors, jnp.float32)
                * theta ** (jnp.arange(0, dim, 2, dtype=jnp.float32) / dim))


def _scaling_for(cfg: LlamaConfig, sliding: bool):
  """(rotary base, scaling) of a layer: Gemma 3's sliding layers have their own, unscaled."""
  if sliding and cfg.sliding_rope_theta is not None:
    return cfg.sliding_rope_theta, None
  return cfg.rope_theta, cfg.rope_scaling


def rope_inv_freq(cfg: LlamaConfig, sliding: bool = False) -> jax.Array:
  """Inverse frequencies [R/2] of the rotated dimensions R (`cfg.rotary_dim`) with the
  configured scaling; for "dynamic" and "longrope" those of positions within the original
  context (`rope_tables_for` switches past it)."""
  dim = cfg.rotary_dim
  theta, s = _scaling_for(cfg, sliding)
  inv = _base_inv_freq(theta, dim)
  if s is None or s.rope_type == "dynamic":
    return inv
  if s.rope_type == "linear":
    return inv / s.factor
  if s.rope_type == "longrope":
    return _longrope_inv_freq(theta, s.short_factor, dim)
  if s.rope_type == "yarn":
    # YaRN (Peng et al. 2023) as Hugging Face computes it: frequencies that turn fewer than
    # beta_slow times over the original context are interpolated, those turning more than
    # beta_fast times kept, and a linear ramp between.
    def correction_dim(rotations):
      return (dim * math.log(s.original_max_position_embeddings / (rotations * 2 * math.pi))
              / (2 * math.log(theta)))
    low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
    if s.truncate:
      low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
      high += 0.001
    ramp = jnp.clip((jnp.arange(dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp
    return (inv / s.factor) * (1 - keep) + inv * keep
  low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
  high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
  wavelen = 2 * math.pi / inv
  smooth = ((s.original_max_position_embeddings / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor))
  scaled = jnp.where(wavelen > low_wavelen, inv / s.factor, inv)
  mid = (1 - smooth) * inv / s.factor + smooth * inv
  is_mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
  return jnp.where(is_mid, mid, scaled)


def rope_tables_for(cfg: LlamaConfig, positions: jax.Array, sliding: bool = False,
                    seq_lengths: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """cos and sin [B, T, 1, R/2] at positions [B, T] for a (sliding or global) layer of `cfg`,
  scaled by the YaRN/LongRoPE attention factor.

  "dynamic" and "longrope" depend on the sequence length, as in Hugging Face, where a forward
  over a sequence of n tokens uses the long factors (or the NTK base for n) once n exceeds the
  original context: a prefill (`seq_lengths`: each row's prompt length) rotates all its
  positions by its row's length, and every later position p by length p + 1, the length when
  it is decoded. Each position keeps one rotation, so speculative and plain decoding agree
  (see `RopeScaling` for the one case that differs from Hugging Face)."""
  theta, s = _scaling_for(cfg, sliding)
  inv = rope_inv_freq(cfg, sliding)
  if s is None or s.rope_type not in ("dynamic", "longrope"):
    cos, sin = rope_tables(positions, inv)
  else:
    dim = cfg.rotary_dim
    n = positions[:, :, None] + 1
    if seq_lengths is not None:
      n = jnp.broadcast_to(seq_lengths[:, None, None], n.shape)
    beyond = n > s.original_max_position_embeddings
    if s.rope_type == "longrope":
      far = _longrope_inv_freq(theta, s.long_factor, dim)
    else:  # the NTK base for a sequence of n tokens, per position [B, T, 1]
      ratio = s.factor * n.astype(jnp.float32) / s.original_max_position_embeddings - (
          s.factor - 1)
      far = _base_inv_freq(theta * jnp.maximum(ratio, 1.0) ** (dim / (dim - 2)), dim)
    freqs = jnp.where(beyond, far, inv)  # [B, T, R/2]
    angles = positions.astype(jnp.float32)[:, :, None] * freqs
    cos, sin = jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]
  if s is not None and s.rope_type in ("yarn", "longrope") and s.attention_factor != 1.0:
    cos, sin = cos * s.attention_factor, sin * s.attention_factor
  return cos, sin


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos and sin [B, T, 1, K/2] of the rotary angles at positions [B, T]: computed once per
  forward and shared by every layer (a decode step otherwise ran two small kernels per layer
  for them)."""
  angles = positions.astype(jnp.float32)[:, :, None] * inv_freq[None, None, :]  # [B, T, K/2]
  return jnp.cos(angles)[:, :, None, :], jnp.sin(angles)[:, :, None, :]


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array,
               tables: tuple[jax.Array, jax.Array] | None = None) -> jax.Array:
  """Rotates x [B, T, N, K] by positions [B, T] in the rotate-half layout (`tables`: the
  positions' `rope_tables`, when already computed). With R/2 frequencies for R < K (partial
  rotary), the first R dimensions rotate and the rest pass through."""
  cos, sin = rope_tables(positions, inv_freq) if tables is None else tables
  xf = x.astype(jnp.float32)
  rd = 2 * cos.shape[-1]
  x1, x2 = jnp.split(xf[..., :rd], 2, axis=-1)
  parts = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]
  if rd < x.shape[-1]:
    parts.append(xf[..., rd:])
  return jnp.concatenate(parts, axis=-1).astype(x.dtype)


def mlp_activation(cfg: LlamaConfig):
  """The gated MLP's activation: SwiGLU's silu, or GeGLU's gelu (tanh or exact form)."""
  if cfg.hidden_act == "silu":
    return jax.nn.silu
  return functools.partial(jax.nn.gelu, approximate=cfg.hidden_act == "gelu_tanh")


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
  """cap * tanh(x / cap) (Gemma 2's soft-capping); x unchanged for cap None."""
  return x if cap is None else jnp.tanh(x / cap) * cap


# Positions of the cache read per step of the blocked attention (`attention`): a cache of at
# most this many positions is read whole (one product, no loop); a larger one block by block,
# up to the batch's longest row only, so a step costs what is cached rather than what was
# allocated. A prefill (an empty cache) of more than this many tokens attends within its block
# in tiles of this many queries by this many keys (`_blocked_prefill`), a shorter one in one
# product.
ATTENTION_BLOCK = 512


def attention(q, k_new, v_new, k_cache, v_cache, length, positions, block_mask, cfg,
              sliding=None, layer=None, kernel: str | None = None, ring: bool = False):
  """Attention of T new queries over the row's cached prefix plus the new block.

  The cached part ([0, length[b])) and the new block are scored separately and normalised by one
  softmax, so the cache is only read inside this function and written once after all layers.
  A cache of more than `ATTENTION_BLOCK` positions is read in blocks of that many, from the
  first block a row may see (the oldest position inside a sliding window) to the block holding
  the batch's longest row, under an online softmax (a `lax.while_loop` with a traced trip
  count): the work follows the cached length, not the allocated one. With an empty cache (a
  prefill) of more than `ATTENTION_BLOCK` new tokens, the new block attends to itself tile by
  tile under an online softmax, skipping the tiles its mask hides (above the causal diagonal,
  outside a window): no [T, T] scores (`_blocked_prefill`).

  Args:
    q: [B, T, H, K] rotated queries.
    k_new, v_new: [B, T, G, K] the new block's keys (rotated) and values.
    k_cache, v_cache: [B, G, S, K] this layer's cache, or with `layer` the whole
      [L, B, G, S, K] cache (only `layer`'s blocks are read: no per-layer copy of the cache).
    length: [B] valid cache entries per row.
    positions: [B, T] absolute position of every new token.
    block_mask: [B, T, T] bool, which new tokens each new token may attend to; None: causal
      (key index <= query index; a long prefill then builds no [B, T, T] mask).
    sliding: whether this layer attends within `cfg.sliding_window` only (a Python bool, or a
      traced one inside a scan over mixed layers); None: as every layer of `cfg` does when its
      layers are alike (`LlamaConfig.is_sliding`).
    layer: with a whole [L, ...] cache, this layer's index (an int or a traced scalar).
    kernel: how the cache is read: "auto" (by the platform the program is lowered for: a Pallas
      Triton kernel on CUDA GPUs, a Pallas Mosaic kernel on TPUs, the XLA blocks above
      elsewhere; `attention_kernels`), "xla" (the XLA blocks everywhere), "triton" or "mosaic"
      (that kernel whatever the platform), "triton_interpret" or "mosaic_interpret" (that
      kernel in Pallas' interpreter, on any backend); None: `cfg.attention_kernel`. A shape a
      kernel does not take (`attention_kernels.SUPPORTS`) is read by the XLA blocks.
    ring: the cache is a sliding layer's ring buffer (`KVCache.k_ring`: slot s of a row of
      length n holds position n - 1 - ((n - 1 - s) mod W)); `sliding` must be True. Read by
      the XLA blocks (the kernels assume slot = position), every slot up to min(longest row, W).
  Returns:
    [B, T, H, K]
  """
  impl = cfg.attention_kernel if kernel is None else kernel
  if ring and sliding is not True:
    raise ValueError(f"a ring-buffer cache belongs to a sliding-window layer, but sliding is"
                     f" {sliding!r}: pass sliding=True with ring=True")
  if k_cache is None or impl == "xla" or ring:
    return _attention(q, k_new, v_new, k_cache, v_cache, length, positions, block_mask, cfg,
                      sliding, layer, "xla" if ring else impl, ring=ring)
  # A Pallas kernel has no differentiation rule: the derivative is XLA's read's, which computes
  # the same function, so `jax.grad` through a model works whatever the platform's kernel. The
  # traced arguments go through the custom_jvp explicitly (it may not close over tracers);
  # Python values (a static `sliding` or `layer`) stay closed over, their checks static.
  dyn = dict(q=q, k_new=k_new, v_new=v_new, k_cache=k_cache, v_cache=v_cache, length=length,
             positions=positions, block_mask=block_mask)
  static = {}
  for name, value in (("sliding", sliding), ("layer", layer)):
    (dyn if isinstance(value, jax.Array) else static)[name] = value
  names = tuple(dyn)

  def run(read, *values):
    return _attention(cfg=cfg, kernel=read, **static, **dict(zip(names, values)))

  read = jax.custom_jvp(functools.partial(run, impl))
  read.defjvp(lambda primals, tangents: jax.jvp(functools.partial(run, "xla"), primals,
                                                tangents))
  return read(*dyn.values())


def _attention(q, k_new, v_new, k_cache, v_cache, length, positions, block_mask, cfg,
               sliding=None, layer=None, kernel: str | None = None, ring: bool = False):
  """`attention`'s body (the kernel chosen, no derivative rule of its own)."""
  b, t, h, kd = q.shape
  g = cfg.num_kv_heads
  r = h // g
  fresh = k_cache is None  # an empty cache (prefill): attend within the new block only
  if not fresh and layer is None:  # one layer's cache: the same reads with a leading axis of 1
    k_cache, v_cache, layer = k_cache[None], v_cache[None], 0
  s_len = 0 if fresh else k_cache.shape[3]
  # Queries grouped by kv head, with (R, T) folded into one matmul row axis and (B, G) into one
  # batch axis: XLA's CPU backend runs such plain batched matmuls several times faster than the
  # five-letter einsum.
  qg = jnp.transpose(q.reshape(b, t, g, r, kd), (0, 2, 3, 1, 4)).reshape(b * g, r * t, kd)
  scalar = kd if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar
  scale = 1.0 / math.sqrt(scalar)
  bdot = lambda x, y, cx, cy: lax.dot_general(x, y, (((cx,), (cy,)), ((0,), (0,))),
                                              precision=_precision(x, y),
                                              preferred_element_type=jnp.float32)
  cap = cfg.attn_softcap
  score_of = lambda qs, keys: softcap(bdot(qs, keys, 2, 2) * scale, cap)  # [BG, RT, S]
  score = functools.partial(score_of, qg)
  if sliding is None:
    sliding = not cfg.mixed_layers and cfg.is_sliding(0)
  windowed = cfg.sliding_window is not None and sliding is not False
  w = cfg.sliding_window

  def cache_mask(pos):
    """[B, T or 1, n] which of the cache slots `pos` [n] each query may see."""
    if ring:
      # The position a ring slot holds: the latest p < length with p = slot (mod W); negative
      # where the row never reached it. Its window decides, as for any cached position.
      # With r = length mod W, slots below r hold length - r + s, the others one turn earlier
      # (a select per slot, no division).
      r = jnp.mod(length, s_len)[:, None]
      held = (length[:, None] - r) + pos[None, :] - jnp.where(pos[None, :] < r, 0, s_len)
      return (held >= 0)[:, None, :] & (held[:, None, :] > positions[:, :, None] - w)
    m = pos[None, None, :] < length[:, None, None]
    if windowed:
      inside = pos[None, None, :] > positions[:, :, None] - w
      m = m & (inside if sliding is True else inside | ~sliding)
    return m

  # Masks [B, T or 1, n] -> [BG, RT, n] in the (b, g) x (r, t) order of the scores.
  expand = lambda m: jnp.broadcast_to(m[:, None, None], (b, g, r, t, m.shape[-1])).reshape(
      b * g, r * t, m.shape[-1])
  neg = jnp.float32(-1e30)
  kn = jnp.transpose(k_new, (0, 2, 1, 3)).reshape(b * g, t, kd)
  vn = jnp.transpose(v_new, (0, 2, 1, 3)).reshape(b * g, t, kd)
  if fresh and t > ATTENTION_BLOCK:  # a long prefill: tile by tile, never the [T, T] scores
    out = _blocked_prefill(qg, kn, vn, block_mask, positions, (w, sliding) if windowed else None,
                           score_of, g, r)
    return _finish(out, b, t, h, kd, q.dtype)
  if block_mask is None:
    block_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  if windowed:
    in_block = positions[:, None, :] > positions[:, :, None] - w
    block_mask = block_mask & (in_block if sliding is True else in_block | ~sliding)
  # The new block first: every query sees itself, so its running maximum is a real score and a
  # cache block with nothing visible adds exp(-1e30 - max) = 0.
  s_new = jnp.where(expand(block_mask), score(kn), neg)  # [BG, RT, T]
  m_new = s_new.max(-1, keepdims=True)
  if fresh:
    p_new = jnp.exp(s_new - m_new)
    out = bdot(p_new.astype(vn.dtype), vn, 2, 1) / p_new.sum(-1, keepdims=True)
    return _finish(out, b, t, h, kd, q.dtype)

  # Imported here, not with the module: Pallas' TPU and Triton front ends add about a second
  # to `import jaxspec`, and a prefill or a CPU-only user never needs them.
  from jaxspec.models import attention_kernels  # noqa: PLC0415

  def xla_cache():
    """The cache read by XLA: whole when small, else block by block."""
    m = m_new
    if s_len <= ATTENTION_BLOCK:  # a small cache: read whole, one softmax over both parts
      kc = lax.dynamic_index_in_dim(k_cache, layer, keepdims=False).reshape(b * g, s_len, kd)
      vc = lax.dynamic_index_in_dim(v_cache, layer, keepdims=False).reshape(b * g, s_len, kd)
      s_cache = jnp.where(expand(cache_mask(jnp.arange(s_len))), score(kc), neg)
      m = jnp.maximum(m, s_cache.max(-1, keepdims=True))
      p_cache, p_new = jnp.exp(s_cache - m), jnp.exp(s_new - m)
      denom = p_cache.sum(-1, keepdims=True) + p_new.sum(-1, keepdims=True)
      out = (bdot(p_cache.astype(vc.dtype), vc, 2, 1)
             + bdot(p_new.astype(vn.dtype), vn, 2, 1)) / denom  # [BG, RT, K]
    else:
      blk = ATTENTION_BLOCK
      p_new = jnp.exp(s_new - m)
      init = (m, p_new.sum(-1, keepdims=True), bdot(p_new.astype(vn.dtype), vn, 2, 1))
      # Blocks [first, last): up to the longest row, from the oldest position a sliding window
      # of the batch still sees. A ring: every slot a row has reached, up to all W.
      if ring:
        last = (jnp.minimum(jnp.max(length), s_len) + blk - 1) // blk
      else:
        last = (jnp.max(length) + blk - 1) // blk
      first = jnp.int32(0)
      if windowed and not ring:
        oldest = jnp.maximum(jnp.min(positions) - w + 1, 0) // blk
        first = oldest if sliding is True else jnp.where(sliding, oldest, 0)

      def body(carry):
        i, m, l, acc = carry
        # A last block that would run past the cache is read ending at its end; the positions it
        # shares with the block before are masked out.
        start = jnp.minimum(i * blk, s_len - blk)
        read = lambda c: lax.dynamic_slice(c, (layer, 0, 0, start, 0), (1, b, g, blk, kd)
                                           ).reshape(b * g, blk, kd)
        pos = start + jnp.arange(blk)
        vis = cache_mask(pos) & (pos >= i * blk)[None, None, :]
        s = jnp.where(expand(vis), score(read(k_cache)), neg)  # [BG, RT, blk]
        m2 = jnp.maximum(m, s.max(-1, keepdims=True))
        p = jnp.exp(s - m2)
        c = jnp.exp(m - m2)
        vb = read(v_cache)
        return (i + 1, m2, l * c + p.sum(-1, keepdims=True),
                acc * c + bdot(p.astype(vb.dtype), vb, 2, 1))

      _, m, l, acc = lax.while_loop(lambda c: c[0] < last, body, (first,) + init)
      out = acc / l
    return out

  def with_kernel(name, interpret=False):
    """The cache read by a Pallas kernel (`attention_kernels`), merged with the new block."""
    # Each query row's oldest visible cache position, in the (r, t) order of the rows.
    qlo = jnp.zeros_like(positions)
    if windowed:
      oldest = jnp.maximum(positions - w + 1, 0)
      qlo = oldest if sliding is True else jnp.where(sliding, oldest, 0)
    qlo = jnp.tile(qlo.astype(jnp.int32), (1, r))  # [B, R * T]
    idx = jnp.reshape(jnp.asarray(layer, jnp.int32), (1,))
    out = attention_kernels.cached_attention(
        qg.reshape(b, g, r * t, kd), k_cache, v_cache, idx, length.astype(jnp.int32), qlo,
        s_new.reshape(b, g, r * t, t), vn.reshape(b, g, t, kd), kernel=name,
        interpret=interpret, scale=scale, cap=cap)
    return out.reshape(b * g, r * t, kd)

  impl = cfg.attention_kernel if kernel is None else kernel
  if impl not in ATTENTION_KERNELS:
    raise ValueError(f"attention kernel {impl!r} is not one of "
                     + ", ".join(map(repr, ATTENTION_KERNELS)))
  name, interpret = impl.removesuffix("_interpret"), impl.endswith("_interpret")
  takes = lambda name: attention_kernels.SUPPORTS[name](kd, s_len)
  if impl == "auto":
    per_platform = {}
    if takes("triton"):
      per_platform["cuda"] = lambda: with_kernel("triton")
    if takes("mosaic"):
      per_platform["tpu"] = lambda: with_kernel("mosaic")
    # Lowered for the CPU (or any platform without a kernel) only `xla_cache` is emitted.
    out = lax.platform_dependent(default=xla_cache, **per_platform)
  elif name in attention_kernels.KERNELS and takes(name):
    out = with_kernel(name, interpret)
  else:  # "xla", or a shape the kernel does not take
    out = xla_cache()
  return _finish(out, b, t, h, kd, q.dtype)


def _blocked_prefill(qg, kn, vn, block_mask, positions, window, score, g: int, r: int
                     ) -> jax.Array:
  """Attention within a long new block (a prefill), query block by key block.

  The same function as `_attention`'s dense product over the new block, with the scores held
  one [B*G, R*blk, blk] tile at a time under an online softmax, and only the key blocks a query
  block may see read: from its oldest to its newest visible key over the batch (below the
  causal diagonal, inside a sliding window). No [T, T] array is built: each query block's mask
  rows are made (or sliced from `block_mask`) inside the loop. A loop over query blocks
  (`lax.map`) of a loop over every key block whose skipped blocks are a `lax.cond` passing the
  softmax through: both loops have static trip counts, so `jax.grad` differentiates them (a
  `lax.while_loop` with a traced trip count would not), and both are checkpointed, so the
  backward pass recomputes tiles instead of keeping T x T probabilities (flash-attention
  style). A T not a multiple of blk ends with a block read ending at T, its positions shared
  with the block before masked out (as keys) or taken from the block before (as queries).
  Assumes, as the dense softmax does, that every query sees at least one key (itself, in every
  mask jaxspec builds).

  Args:
    qg: [B*G, R*T, K] queries in `_attention`'s (b, g) x (r, t) order.
    kn, vn: [B*G, T, K] the block's keys and values.
    block_mask: [B, T, T] bool, which keys each query may see; None: causal (key <= query).
    positions: [B, T] each token's position, for the window.
    window: (W, sliding) for a sliding layer (sliding True, or a traced bool), else None.
    score: ([B*G, n, K], [B*G, m, K]) -> [B*G, n, m] float32 scaled, soft-capped scores.
  Returns:
    [B*G, R*T, K] float32, in the order of `qg`.
  """
  bg, rt, kd = qg.shape
  b, t = positions.shape
  blk = ATTENTION_BLOCK
  n = -(-t // blk)  # blocks per axis, the last one ending at T
  idx = jnp.arange(t, dtype=jnp.int32)
  q4 = qg.reshape(bg, r, t, kd)
  neg = jnp.float32(-1e30)
  bdot = lambda x, y: lax.dot_general(x, y, (((2,), (1,)), ((0,), (0,))),
                                      precision=_precision(x, y),
                                      preferred_element_type=jnp.float32)

  def query_block(i):
    qs = jnp.minimum(i * blk, t - blk)
    qi = lax.dynamic_slice_in_dim(q4, qs, blk, axis=2).reshape(bg, r * blk, kd)
    if block_mask is None:
      vis = idx[None, None, :] <= (qs + jnp.arange(blk, dtype=jnp.int32))[None, :, None]
    else:
      vis = lax.dynamic_slice_in_dim(block_mask, qs, blk, axis=1)
    if window is not None:
      w, sliding = window
      qpos = lax.dynamic_slice_in_dim(positions, qs, blk, axis=1)
      inside = positions[:, None, :] > qpos[:, :, None] - w
      vis = vis & (inside if sliding is True else inside | ~sliding)
    vis = jnp.broadcast_to(vis, (b, blk, t))  # [B, blk, T] this query block's mask rows
    # The key blocks holding this query block's oldest and newest visible key over the batch.
    cols = vis.any(axis=(0, 1))
    first = jnp.min(jnp.where(cols, idx, t)) // blk
    last = jnp.max(jnp.where(cols, idx, -1)) // blk

    def key_block(carry, j):
      def read(carry):
        m, l, acc = carry
        ks = jnp.minimum(j * blk, t - blk)
        tile = lax.dynamic_slice_in_dim(vis, ks, blk, axis=2)
        tile = tile & (ks + jnp.arange(blk) >= j * blk)[None, None, :]  # [B, blk, blk]
        tile = jnp.broadcast_to(tile[:, None, None], (b, g, r, blk, blk)).reshape(
            bg, r * blk, blk)
        s = jnp.where(tile, score(qi, lax.dynamic_slice_in_dim(kn, ks, blk, axis=1)), neg)
        m2 = jnp.maximum(m, s.max(-1, keepdims=True))
        p = jnp.exp(s - m2)
        c = jnp.exp(m - m2)
        vb = lax.dynamic_slice_in_dim(vn, ks, blk, axis=1)
        return m2, l * c + p.sum(-1, keepdims=True), acc * c + bdot(p.astype(vb.dtype), vb)

      return lax.cond((j >= first) & (j <= last), read, lambda c: c, carry), None

    init = (jnp.full((bg, r * blk, 1), neg), jnp.zeros((bg, r * blk, 1), jnp.float32),
            jnp.zeros((bg, r * blk, kd), jnp.float32))
    # Differentiated, a tile's scores are recomputed rather than kept for the backward pass.
    (_, l, acc), _ = lax.scan(jax.checkpoint(key_block, prevent_cse=False), init,
                              jnp.arange(n, dtype=jnp.int32))
    return (acc / l).reshape(bg, r, blk, kd)

  # (Checkpointed too: the backward pass keeps no query block's key-block statistics either.)
  outs = lax.map(jax.checkpoint(query_block, prevent_cse=False),
                 jnp.arange(n, dtype=jnp.int32))  # [n, B*G, R, blk, K]
  # The last block's rows that the block before already holds are dropped.
  tail = outs[-1][:, :, (n - 1) * blk - (t - blk):]
  out = jnp.concatenate([jnp.moveaxis(outs[:-1], 0, 2).reshape(bg, r, (n - 1) * blk, kd),
                         tail], axis=2)
  return out.reshape(bg, rt, kd)


def _finish(out, b, t, h, kd, dtype):
  """[BG, RT, K] in the (b, g) x (r, t) order of the scores -> [B, T, H, K]."""
  g = out.shape[0] // b
  r = h // g
  out = jnp.transpose(out.reshape(b, g, r, t, kd), (0, 3, 1, 2, 4))
  return out.reshape(b, t, h, kd).astype(dtype)


def _precision(*operands) -> lax.Precision | None:
  """The precision of a product: full float32 (HIGHEST) when an operand is float32, the
  backend's default otherwise.

  XLA's default for float32 products on GPUs from Ampere on (and on TPUs) is a faster,
  rounded form (TF32 or bfloat16 passes), whose error grows with the operands rather than
  staying at float32's. A verify pass over k+1 tokens and a one-token decode step run
  differently shaped products, so under that default greedy speculative decoding departed from
  `generate` (seen on an H200; docs/lab-notes/code-notes-moved.md). A float32 model now means
  float32 arithmetic on every backend, as in PyTorch, whose float32 matmuls do not use TF32 by
  default; for the fast form, load the model in bfloat16. XLA's CPU backend computes float32
  products in float32 either way.
  """
  if any(getattr(x, "dtype", None) == jnp.float32 for x in operands):
    return lax.Precision.HIGHEST
  return None


def _weight(w, dtype) -> jax.Array:
  """A weight as read by a matmul: an int8 `QArray` is dequantized here, inside the jitted
  pass, so only int8 is stored; a plain array is returned as is (no cast). (`OutputMajor`
  weights never come here: `_dense` multiplies them in their own layout.)"""
  return w.dequantize(dtype) if isinstance(w, QArray) else w


# Rows (batch x positions) up to which an output-major weight is multiplied block by block; a
# prefill's many rows run one matmul, where the blocked form is slower.
_DENSE_BLOCK = 64
_DENSE_BLOCKED_MAX_ROWS = 64


def _dense(x: jax.Array, w, n_in: int, spec: str, dtype) -> jax.Array:
  """x [..., *in] times a logical [*in, *out] weight -> [..., *out].

  `spec` names the product for readers (the weight's logical layout); it runs as one
  [rows, I] x [I, O] matrix product (plain arrays, or int8 ones dequantized to `dtype`), or as
  [rows, I] x [O, I] for an `OutputMajor` weight, on the CPU in blocks of 64 output rows for up
  to 64 rows. Products return the operands' dtype: a bfloat16 decode step whose products
  returned float32 (`preferred_element_type`) ran slower on GPUs, its matrix-vector kernels
  reading the weights below the memory's bandwidth. The blocked CPU form keeps XLA's Eigen
  matmuls from repacking the weight per call (with YNNPACK dots both forms cost the same).
  Measurements: docs/lab-notes/code-notes-moved.md."""
  if not isinstance(w, OutputMajor):
    wd = _weight(w, dtype)
    lead = x.shape[:x.ndim - n_in]
    i = math.prod(x.shape[x.ndim - n_in:])
    out_shape = wd.shape[n_in:]
    # One contracting and one output axis (free reshapes of contiguous axes): XLA GPU turned
    # the two-axis contraction of wo into a materialised product plus a reduction (three
    # passes over the weight) where one matrix product reads it once.
    y = jnp.dot(x.reshape(-1, i), wd.reshape(i, -1), precision=_precision(x, wd))
    return y.reshape(*lead, *out_shape)
  wt = w.w  # [*out, *in]
  out_shape = wt.shape[:w.n_out]
  lead = x.shape[:x.ndim - n_in]
  o, i = math.prod(out_shape), math.prod(wt.shape[w.n_out:])
  rows = math.prod(lead)
  x2 = x.reshape(rows, i)
  w2 = wt.reshape(o, i)
  if (rows <= _DENSE_BLOCKED_MAX_ROWS and o % _DENSE_BLOCK == 0 and o > _DENSE_BLOCK
      and jax.default_backend() == "cpu"):
    y = jnp.einsum("xi,nci->nxc", x2, w2.reshape(o // _DENSE_BLOCK, _DENSE_BLOCK, i),
                   precision=_precision(x2, w2))
    y = jnp.swapaxes(y, 0, 1)
  else:
    y = jnp.einsum("xi,oi->xo", x2, w2, precision=_precision(x2, w2))
  return y.reshape(*lead, *out_shape)


def embed_tokens(embed, tokens: jax.Array, dtype) -> jax.Array:
  """Embedding rows [B, T, D] of tokens [B, T]: an int8 table gathers int8 rows and scales
  only those, never dequantizing the whole [V, D] table."""
  if isinstance(embed, QArray):
    return embed.take_rows(tokens, dtype)
  return jnp.take(embed, tokens, axis=0)


def lm_head_weight(params: Params) -> jax.Array:
  """The [D, V] output projection (the transposed embedding when tied); int8 weights come
  back dequantized to float32."""
  if params.lm_head is None:
    return _weight(params.embed, jnp.float32).T
  return _weight(params.lm_head, jnp.float32)


# The tied LM head on a few rows (a verify pass, a small batch) as a batched matmul over
# vocabulary blocks: see `logits_from_hidden`.
_VOCAB_BLOCK = 2048
_BLOCKED_ROWS = (2, 32)  # rows (batch x positions) for which the blocked form is used
_BLOCKED_MIN_WEIGHTS = 1 << 22  # vocabulary x width: only tables well beyond the caches


def _blocked_head(v: int, d: int, rows: int) -> bool:
  return (_BLOCKED_ROWS[0] <= rows <= _BLOCKED_ROWS[1] and v % _VOCAB_BLOCK == 0
          and v * d >= _BLOCKED_MIN_WEIGHTS and jax.default_backend() == "cpu")


def logits_from_hidden(params: Params, hidden: jax.Array) -> jax.Array:
  """float32 logits [..., V] from final hidden states [..., D].

  With a tied head ([V, D] embedding) and 2..32 rows on the CPU backend, the product runs as
  a batched matmul over blocks of 2048 vocabulary rows (a free reshape of the table): XLA's
  CPU matmul for a few rows repacks the whole right-hand side per call, which for a table
  far larger than the caches costs about as much again as reading it; block by block the
  repacking stays in cache (measurements: docs/lab-notes/code-notes-moved.md). Same values up
  to float rounding (summation order).
  """
  if params.lm_head is None:
    w = _weight(params.embed, hidden.dtype)
    v, d = w.shape
    lead = hidden.shape[:-1]
    rows = math.prod(lead)
    if _blocked_head(v, d, rows):
      out = jnp.einsum("xd,ncd->nxc", hidden.reshape(rows, d),
                       w.reshape(v // _VOCAB_BLOCK, _VOCAB_BLOCK, d),
                       precision=_precision(hidden, w), preferred_element_type=jnp.float32)
      return jnp.swapaxes(out, 0, 1).reshape(*lead, v)
    return jnp.einsum("...d,vd->...v", hidden, w, precision=_precision(hidden, w),
                      preferred_element_type=jnp.float32)
  w = _weight(params.lm_head, hidden.dtype)
  return jnp.einsum("...d,dv->...v", hidden, w, precision=_precision(hidden, w),
                    preferred_element_type=jnp.float32)


def _after(x: jax.Array, i: int) -> jax.Array:
  """The layer index i, as a value XLA must compute after `x` (always exactly i).

  Unrolled, each layer's attention reads a slice of the [L, ...] caches, which XLA copies out.
  Those copies depend on nothing but the caches, so XLA CPU's default (concurrency-optimized)
  scheduler runs all 2L of them before the first layer: at large batches and caches they are
  written to and read back from memory instead of from cache. Slicing at an index that depends
  on the layer's input keeps each copy just before its use, as a scan does (the same as
  `--xla_cpu_enable_concurrency_optimized_scheduler=false`, which per-program compiler options
  do not reach; measurements: docs/lab-notes/code-notes-moved.md)."""
  nan = jnp.isnan(x.reshape(-1)[0]).astype(jnp.int32)  # 0 or 1: min(i, i + nan) == i
  return jnp.minimum(jnp.int32(i), i + nan)


def forward(params: Params, tokens: jax.Array, cache: KVCache, cfg: LlamaConfig, *,
            positions: jax.Array | None = None, block_mask: jax.Array | None = None,
            hidden_layers: tuple[int, ...] = (), logits: bool = True, fresh: bool = False,
            write: bool = True, seq_lengths: jax.Array | None = None
            ) -> tuple[jax.Array | None, Hidden, KVCache]:
  """One forward pass of T new tokens per row on top of each row's cached prefix.

  Row b's tokens are written to the cache at positions length[b] .. length[b]+T-1 and attend
  causally to everything before them. The new cache's length is length + T; callers that keep
  fewer tokens (rejected drafts, prompt padding) move it back.

  Args:
    params: model weights.
    tokens: [B, T] int32 token ids.
    cache: KV cache with per-row `length` [B].
    cfg: static model configuration.
    positions: [B, T] rotary positions; default length[:, None] + arange(T). Tree verification
      passes length + depth.
    block_mask: [B, T, T] bool attention among the new tokens; default causal. Tree
      verification passes an ancestor-only mask.
    hidden_layers: indices (0-based) of decoder layers whose outputs to return in `hidden.layers`.
    logits: when False, skip the LM head and return None for the logits.
    fresh: the cache is known to be empty (a prefill): skip attention over it. Besides the
      work, this keeps XLA from constant-folding attention over a cache of constant zeros.
    write: when False, the cache is only read and the new block's keys and values come back
      instead of a new cache, as `(k_new, v_new)` [L, B, T, G, K] for `write_cache`: a caller
      inside a `lax.cond`/`lax.switch` then writes outside it, so the branch never has to pass
      (and XLA never copies) the whole cache.
    seq_lengths: [B] for a prefill, each row's prompt length: length-dependent rotary scaling
      ("dynamic", "longrope") then rotates the whole prompt by it (`rope_tables_for`).
  Returns:
    (logits [B, T, V] float32 or None, Hidden, new cache with length + T (or the new block's
    keys and values with write=False)).
  """
  b, t = tokens.shape
  length = cache.length
  _check_params_match(params, cfg)
  if positions is None:
    positions = length[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]
  if block_mask is None and not (fresh and t > ATTENTION_BLOCK):
    # (A long prefill's attention makes its causal mask tile by tile: no [B, T, T] array.)
    block_mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  tables = rope_tables_for(cfg, positions, seq_lengths=seq_lengths)
  # Gemma 3's sliding layers rotate with their own base: a second set of tables.
  local_tables = (rope_tables_for(cfg, positions, sliding=True, seq_lengths=seq_lengths)
                  if cfg.sliding_rope_theta is not None and cfg.sliding_window is not None
                  else tables)
  act_dtype = cfg.act_dtype
  x = embed_tokens(params.embed, tokens, act_dtype).astype(act_dtype)  # [B, T, D]
  if cfg.embed_scale:
    x = x * jnp.asarray(math.sqrt(cfg.hidden_size), x.dtype)
  eps = cfg.rms_norm_eps
  norm = functools.partial(rms_norm, eps=eps, scale_f32=bool(cfg.norm_offset))
  act = mlp_activation(cfg)
  want = tuple(int(i) + (cfg.num_layers if i < 0 else 0) for i in hidden_layers)

  def layer(x, xs, sliding=None):
    lp, idx = xs[:2]
    if len(xs) > 2:  # a scan over mixed layers: this layer's kind as a traced bool
      sliding = xs[2]
    # Named scopes label the two halves of a layer in profiles and HLO metadata only.
    with jax.named_scope("attention"):
      h = norm(x, lp.attn_norm)
      dt = h.dtype
      q = _dense(h, lp.wq, 1, "btd,dhk->bthk", dt)
      k = _dense(h, lp.wk, 1, "btd,dgk->btgk", dt)
      v = _dense(h, lp.wv, 1, "btd,dgk->btgk", dt)
      if lp.bq is not None:
        q, k, v = q + lp.bq, k + lp.bk, v + lp.bv
      if lp.q_norm is not None:
        q, k = norm(q, lp.q_norm), norm(k, lp.k_norm)
      if sliding is None or local_tables is tables:
        tab = tables
      elif isinstance(sliding, bool):
        tab = local_tables if sliding else tables
      else:
        tab = jax.tree.map(lambda a, b_: jnp.where(sliding, a, b_), local_tables, tables)
      q = apply_rope(q, positions, None, tab)
      k = apply_rope(k, positions, None, tab)
      attend = functools.partial(attention, q, k, v, length=length, positions=positions,
                                 block_mask=block_mask, cfg=cfg, layer=idx)
      if fresh:
        attn = attend(None, None, sliding=sliding)
      elif cache.k_ring is None:
        attn = attend(cache.k, cache.v, sliding=sliding)
      elif isinstance(sliding, bool):  # `idx` indexes this layer's own stack
        attn = (attend(cache.k_ring, cache.v_ring, sliding=True, ring=True) if sliding
                else attend(cache.k, cache.v, sliding=False))
      else:  # a scan over mixed layers: the layer's kind picks its stack at run time
        attn = lax.cond(sliding,
                        lambda: attend(cache.k_ring, cache.v_ring, sliding=True, ring=True),
                        lambda: attend(cache.k, cache.v, sliding=False))
      o = _dense(attn, lp.wo, 2, "bthk,hkd->btd", dt)
      x = x + (o if lp.post_attn_norm is None else norm(o, lp.post_attn_norm))
    with jax.named_scope("mlp"):
      h = norm(x, lp.mlp_norm)
      gate = _dense(h, lp.w_gate, 1, "btd,df->btf", dt)
      up = _dense(h, lp.w_up, 1, "btd,df->btf", dt)
      m = _dense(act(gate) * up, lp.w_down, 1, "btf,fd->btd", dt)
      x = x + (m if lp.post_mlp_norm is None else norm(m, lp.post_mlp_norm))
    return x, (k, v, x)

  if not is_scanned(params):  # one tree per layer (`with_scan_layers`): unrolled
    outs = [None] * len(params.layers)
    on_cpu = jax.default_backend() == "cpu"
    for i, lp in enumerate(params.layers):
      # On the CPU, reading the cache at an index computed after the layer's input keeps XLA
      # from copying out every layer's cache before the first layer (`_after`); elsewhere a
      # static index reads the cache in place.
      i_stack = cache.slot(i)[1]  # the layer's index in its own stack (the ring's or not)
      j = _after(x, i_stack) if on_cpu else i_stack
      x, outs[i] = layer(x, (lp, j), sliding=cfg.is_sliding(i))
    k_new, v_new = (jnp.stack([o[n] for o in outs]) for n in (0, 1))
    # Only the layers asked for: stacking every layer's [B, T, D] output to pick a few wrote
    # and read L of them (on a 1,187-token prompt of a 30-layer model, 82 MB).
    layers_out = jnp.stack([outs[i][2] for i in want]) if want else None
    # The new keys and values as values computed after the last layer: writing them into the
    # cache then waits for every layer's read of it, so XLA updates the cache in place instead
    # of copying the whole [L, B, S, G, K] cache (twice per step inside a decode loop).
    # Always exactly k_new, v_new.
    keep = _after(x, 0) == 0
    k_new, v_new = jnp.where(keep, k_new, 0), jnp.where(keep, v_new, 0)
  else:
    # The cache is read inside each layer at the scan's layer index (not scanned over as a
    # per-layer input, which would copy each layer's whole cache out).
    xs = (params.layers, jnp.array([cache.slot(i)[1] for i in range(cfg.num_layers)],
                                   jnp.int32))
    if cfg.mixed_layers:
      xs += (jnp.array([cfg.is_sliding(i) for i in range(cfg.num_layers)]),)
      step = layer
    else:
      step = functools.partial(layer, sliding=cfg.is_sliding(0))
    # The layers asked for go into a carried buffer, one slot per distinct layer plus a scratch
    # slot the others write to, not out of the scan as every layer's [B, T, D] output.
    uniq = sorted(set(want))
    xs += (jnp.array([uniq.index(i) if i in uniq else len(uniq)
                      for i in range(cfg.num_layers)], jnp.int32),)

    def scan_step(carry, xs):
      x, buf = carry
      x, (k, v, out) = step(x, xs[:-1])
      if buf is not None:
        buf = lax.dynamic_update_index_in_dim(buf, out.astype(buf.dtype), xs[-1], 0)
      return (x, buf), (k, v)

    buf0 = jnp.zeros((len(uniq) + 1,) + x.shape, x.dtype) if want else None
    (x, buf), (k_new, v_new) = lax.scan(scan_step, (x, buf0), xs)
    layers_out = buf[jnp.array([uniq.index(i) for i in want])] if want else None
  final = norm(x, params.final_norm)
  out_logits = softcap(logits_from_hidden(params, final), cfg.final_softcap) if logits else None
  # Hidden states leave in the weights' dtype, whatever the compute dtype: drafting heads and
  # draft states are typed by the model's dtype.
  final = final.astype(cfg.jnp_dtype)
  layers_out = None if layers_out is None else layers_out.astype(cfg.jnp_dtype)
  if not write:
    return out_logits, Hidden(final=final, layers=layers_out), (k_new, v_new)
  # A prefill keeps each row's prompt: a ring longer prompt keeps its last W positions.
  new_cache = write_cache(cache, k_new, v_new, positions_start=length,
                          valid_end=length + seq_lengths if fresh and seq_lengths is not None
                          else None)
  return out_logits, Hidden(final=final, layers=layers_out), new_cache


def _check_params_match(params: Params, cfg: LlamaConfig) -> None:
  """At trace time: the weights hold the norms and biases the configuration's switches say."""
  if params.layers is None:
    return
  lp = params.layers if is_scanned(params) else params.layers[0]
  for name, field, want in (("qk_norm", "q_norm", cfg.qk_norm),
                            ("post_norms", "post_attn_norm", cfg.post_norms)):
    if want != (getattr(lp, field) is not None):
      raise ValueError(f"cfg.{name} is {want} but the params {'lack' if want else 'have'}"
                       f" {field}: load the weights with the configuration they belong to")


def write_cache(cache: KVCache, k_new: jax.Array, v_new: jax.Array,
                positions_start: jax.Array, valid_end: jax.Array | None = None) -> KVCache:
  """Writes k/v [L, B, T, G, K] at per-row offsets; length becomes positions_start + T.

  Every write must fit: `max_len` >= positions_start + T (callers size the cache for the
  prompt, the new tokens and the verify width; an out-of-range start would be clamped). The
  sliding layers' rings (`KVCache.k_ring`) take position p at slot p mod W; a write of more
  than W tokens keeps the last W of each row's positions before `valid_end` [B] (default:
  all T; a prefill passes each row's prompt end, so right padding does not push the prompt's
  own positions out).
  """
  if cache.k_ring is None:
    k, v = _write_linear(cache.k, cache.v, k_new, v_new, positions_start)
    return KVCache(k=k, v=v, length=positions_start + k_new.shape[2])
  ring = list(cache.ring_layers)
  full = [i for i in range(k_new.shape[0]) if i not in cache.ring_layers]
  k, v = cache.k, cache.v
  if full:
    k, v = _write_linear(k, v, _layers(k_new, full), _layers(v_new, full), positions_start)
  kr, vr = _write_ring(cache.k_ring, cache.v_ring, _layers(k_new, ring), _layers(v_new, ring),
                       positions_start, valid_end)
  return dataclasses.replace(cache, k=k, v=v, k_ring=kr, v_ring=vr,
                             length=positions_start + k_new.shape[2])


def _layers(x: jax.Array, idx: list[int]) -> jax.Array:
  """x[idx] for static layer indices, as static slices of their consecutive runs (Gemma 3's
  five sliding layers between global ones), not a gather."""
  runs, first = [], 0
  for n in range(1, len(idx) + 1):
    if n == len(idx) or idx[n] != idx[n - 1] + 1:
      runs.append(x[idx[first]:idx[n - 1] + 1])
      first = n
  return runs[0] if len(runs) == 1 else jnp.concatenate(runs)


def _write_linear(k, v, k_new, v_new, positions_start):
  """k/v [L, B, G, S, K] with k_new/v_new [L, B, T, G, K] at per-row positions."""
  t = k_new.shape[2]
  b_size = k.shape[1]
  kn = jnp.swapaxes(k_new, 2, 3).astype(k.dtype)  # [L, B, G, T, K]
  vn = jnp.swapaxes(v_new, 2, 3).astype(v.dtype)
  if b_size <= 64:
    # One dynamic-update-slice per row: XLA updates those in place, where the equivalent
    # scatter became a pass over the whole cache every step on CPU.
    zero = jnp.int32(0)
    for b in range(b_size):
      start = (zero, jnp.int32(b), zero, positions_start[b].astype(jnp.int32), zero)
      k = lax.dynamic_update_slice(k, kn[:, b:b + 1], start)
      v = lax.dynamic_update_slice(v, vn[:, b:b + 1], start)
  else:  # very large batches: one scatter rather than thousands of unrolled updates
    rows = jnp.arange(b_size)[:, None]  # [B, 1]
    pos = positions_start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :]  # [B, T]
    # Advanced indices on axes 1 and 3 put their [B, T] shape first: updates are [B, T, L, G, K].
    upd = lambda x: jnp.transpose(x, (1, 3, 0, 2, 4))
    k = k.at[:, rows, :, pos].set(upd(kn), mode="promise_in_bounds")
    v = v.at[:, rows, :, pos].set(upd(vn), mode="promise_in_bounds")
  return k, v


def _write_ring(k, v, k_new, v_new, positions_start, valid_end):
  """Rings k/v [Lr, B, G, W, K] with k_new/v_new [Lr, B, T, G, K] written at slots
  (positions_start + t) mod W; see `write_cache`."""
  t, w_len, b_size = k_new.shape[2], k.shape[3], k.shape[1]
  start = positions_start.astype(jnp.int32)
  kn = jnp.swapaxes(k_new, 2, 3).astype(k.dtype)  # [Lr, B, G, T, K]
  vn = jnp.swapaxes(v_new, 2, 3).astype(v.dtype)
  if t > w_len:
    # More tokens than slots (a long prompt): slot s takes the row's latest token
    # (before valid_end) that lands on it, or keeps what it held.
    end = start + t if valid_end is None else valid_end.astype(jnp.int32)
    n = jnp.clip(end - start, 0, t)[:, None]  # [B, 1]
    slots = jnp.arange(w_len, dtype=jnp.int32)[None, :]
    src = n - 1 - jnp.mod(start[:, None] + n - 1 - slots, w_len)  # [B, W]
    take = (src >= 0)[None, :, None, :, None]
    idx = jnp.maximum(src, 0)[None, :, None, :, None]
    pick = lambda new, old: jnp.where(take, jnp.take_along_axis(new, idx, axis=3), old)
    return pick(kn, k), pick(vn, v)
  if b_size > 64:  # as `_write_linear`: one scatter; T <= W slots never collide
    rows = jnp.arange(b_size)[:, None]
    slots = jnp.mod(start[:, None] + jnp.arange(t, dtype=jnp.int32)[None, :], w_len)
    upd = lambda x: jnp.transpose(x, (1, 3, 0, 2, 4))
    return (k.at[:, rows, :, slots].set(upd(kn), mode="promise_in_bounds"),
            v.at[:, rows, :, slots].set(upd(vn), mode="promise_in_bounds"))
  # Per row, two in-place updates of T slots: one ending by the ring's end, one from slot 0;
  # each slot of a window takes the token landing on it, or keeps what it held. Without
  # wrapping the first covers every token and the second rewrites what the first wrote.
  zero = jnp.int32(0)
  j = jnp.arange(t, dtype=jnp.int32)

  def window(buf, new, b, a):
    src = jnp.mod(a + j - start[b], w_len)  # the token landing on slot a + j
    at = (zero, jnp.int32(b), zero, a, zero)
    old = lax.dynamic_slice(buf, at, (buf.shape[0], 1, buf.shape[2], t, buf.shape[4]))
    val = jnp.where((src < t)[None, None, None, :, None],
                    jnp.take(new[:, b:b + 1], jnp.minimum(src, t - 1), axis=3), old)
    return lax.dynamic_update_slice(buf, val, at)

  for b in range(b_size):
    if t == 1:  # one token never wraps: a plain in-place update at its slot
      at = (zero, jnp.int32(b), zero, jnp.mod(start[b], w_len), zero)
      k = lax.dynamic_update_slice(k, kn[:, b:b + 1], at)
      v = lax.dynamic_update_slice(v, vn[:, b:b + 1], at)
      continue
    for a in (jnp.minimum(jnp.mod(start[b], w_len), w_len - t), zero):
      k, v = window(k, kn, b, a), window(v, vn, b, a)
  return k, v


@functools.partial(jax.jit, static_argnames=("cfg",))
def forward_jit(params, tokens, cache, cfg):
  """A jitted plain forward (logits, hidden, cache) for tests and tools."""
  return forward(params, tokens, cache, cfg)


@dataclasses.dataclass(frozen=True)
class LlamaLM:
  """jaxspec's Llama as a target or draft model of the decoding loop: the
  `jaxspec.decoding.CausalLM` protocol (`vocab_size`, `init_cache`, `forward`) plus the block
  interface the loop uses where a model offers it (`forward_block`, `write_block`, `pad_block`,
  tree attention): a verify branch inside a `lax.switch` then only reads the cache and returns
  the new keys and values, which are written once after it, so XLA never copies the cache.

  Static and hashable (it holds the configuration only); the weights are passed separately.
  """

  cfg: LlamaConfig
  # Ring slots of the sliding layers beyond their window (`init_cache`); None: no rings.
  ring_slack: int | None = RING_SLACK

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size

  @property
  def eos_token_ids(self) -> tuple[int, ...]:
    """The protocol's optional end-of-sequence ids: decoding stops at them by default."""
    return self.cfg.eos_token_ids

  def init_cache(self, params, batch_size: int, max_len: int) -> KVCache:
    del params
    return init_cache(self.cfg, batch_size, max_len, ring_slack=self.ring_slack)

  def forward(self, params, tokens, cache: KVCache, lengths, *, hidden_layers=()):
    """The protocol's forward: tokens [B, T] at positions lengths[b] + t, written there."""
    return forward(params, tokens, dataclasses.replace(cache, length=lengths), self.cfg,
                   hidden_layers=hidden_layers)

  # The block interface: the cache carries its own per-row length.
  def cache_from_buffers(self, buffers, batch_size: int) -> KVCache:
    """A cache over donated (k, v) buffers of an earlier call (`KVCache.k`, `.v`: the
    full-attention layers' when the sliding layers keep rings), with every row empty; the
    rings, small, come fresh (or from buffers[2:4] where given)."""
    k, v = buffers[0], buffers[1]
    cache = KVCache(k=k, v=v, length=jnp.zeros((batch_size,), jnp.int32))
    if ring_size(self.cfg, k.shape[3], self.ring_slack) is None:
      return cache
    shape = jax.eval_shape(lambda: init_cache(self.cfg, batch_size, k.shape[3], k.dtype,
                                              ring_slack=self.ring_slack))
    if k.shape != shape.k.shape:
      raise ValueError(f"cache buffers of shape {k.shape} do not hold this model's"
                       f" full-attention layers {shape.k.shape}: take them from"
                       " `init_cache` of the same configuration and ring_slack")
    rings = buffers[2:4] if len(buffers) >= 4 else (
        jnp.zeros(shape.k_ring.shape, k.dtype), jnp.zeros(shape.v_ring.shape, v.dtype))
    return dataclasses.replace(cache, k_ring=rings[0], v_ring=rings[1],
                               ring_layers=shape.ring_layers)

  def forward_block(self, params, tokens, cache: KVCache, *, hidden_layers=(), logits=True,
                    fresh=False, write=True, positions=None, block_mask=None,
                    seq_lengths=None):
    return forward(params, tokens, cache, self.cfg, hidden_layers=hidden_layers, logits=logits,
                   fresh=fresh, write=write, positions=positions, block_mask=block_mask,
                   seq_lengths=seq_lengths)

  def write_block(self, cache: KVCache, block, start) -> KVCache:
    return write_cache(cache, *block, positions_start=start)

  @staticmethod
  def pad_block(block, width: int):
    """The new block's keys and values [L, B, T, G, K] zero-padded to T = width."""
    return jax.tree.map(lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, width - x.shape[2]),
                                              (0, 0), (0, 0)]), block)

  def empty_block(self, batch_size: int, width: int, dtype):
    shape = (self.cfg.num_layers, batch_size, width, self.cfg.num_kv_heads, self.cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)

  def logits_from_hidden(self, params, hidden):
    return softcap(logits_from_hidden(params, hidden), self.cfg.final_softcap)


register_config(LlamaConfig, LlamaLM)
