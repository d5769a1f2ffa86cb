"""Logical-axis sharding: one rules object maps the model's logical axes to mesh axes.

The model code never names a mesh axis. Every weight and cache array has a fixed tuple of
logical axes (below); a `ShardingRules` maps each logical axis to a mesh axis (or None:
replicated), which gives the array's `PartitionSpec`. The default rules are tensor-parallel over
"model" (attention heads, MLP hidden, vocabulary) and data-parallel over "data" (the batch).

Logical axes (a weight's are declared with it, in `jaxspec.models.weights.WEIGHTS`):
  batch      rows of a batch (prompts, caches, sequence buffers)
  layers     the stacked decoder-layer axis (never sharded by the default rules)
  embed      the model width D
  heads      query heads H
  kv_heads   key/value heads G (grouped-query attention)
  head_dim   K
  ffw        the MLP hidden width F
  vocab      the vocabulary V (embedding rows and LM-head columns: vocab-parallel logits)
  cache_seq  the KV cache's position axis S
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from jaxspec.models import loading
from jaxspec.models.config import LlamaConfig
from jaxspec.models.errors import LayoutError
from jaxspec.models.llama import (KVCache, LayerParams, OutputMajor, Params, default_scan_layers,
                                  input_major)
from jaxspec.models.model import Model
from jaxspec.models.weights import WEIGHT, axis_sizes

CACHE_AXES = ("layers", "batch", "kv_heads", "cache_seq", "head_dim")  # KVCache.k / .v


@dataclasses.dataclass(frozen=True, kw_only=True)
class ShardingRules:
  """Logical axis -> mesh axis name (None: replicated along that dimension).

  The defaults shard the model tensor-parallel over "model" and the batch over "data"; a mesh
  without one of those axes simply does not shard along it.
  """

  batch: str | None = "data"
  layers: str | None = None
  embed: str | None = None
  heads: str | None = "model"
  kv_heads: str | None = "model"
  head_dim: str | None = None
  ffw: str | None = "model"
  vocab: str | None = "model"
  cache_seq: str | None = None

  def axis(self, logical: str | None, mesh: Mesh | None = None) -> str | None:
    """The mesh axis for one logical axis (None where the mesh has no such axis)."""
    if logical is None:
      return None
    name = getattr(self, logical)
    if name is not None and mesh is not None and name not in mesh.axis_names:
      return None
    return name

  def spec(self, logical: Sequence[str | None], mesh: Mesh | None = None) -> P:
    """The PartitionSpec of an array with these logical axes."""
    return P(*(self.axis(a, mesh) for a in logical))


DEFAULT_RULES = ShardingRules()


def make_mesh(shape: dict[str, int] | Sequence[int], axis_names: Sequence[str] | None = None, *,
              devices: Sequence[jax.Device] | None = None,
              axis_types: tuple[AxisType, ...] | None = None) -> Mesh:
  """A device mesh, e.g. `make_mesh({"data": 2, "model": 4})`.

  Args:
    shape: axis name -> size (ordered), or sizes with `axis_names`.
    devices: the devices to use, in order (default the first prod(shape) of `jax.devices()`);
      a sub-mesh is a mesh over part of the devices (see `submesh`).
    axis_types: jax.sharding.AxisType per axis; default Auto for every axis (the compiler
      propagates shardings from the jitted functions' in_shardings/out_shardings).
  """
  if isinstance(shape, dict):
    if axis_names is not None:
      raise ValueError("give the mesh shape as a dict {axis: size} or as sizes with axis_names,"
                       " not both")
    axis_names, sizes = tuple(shape), tuple(int(v) for v in shape.values())
  else:
    sizes = tuple(int(v) for v in shape)
    if axis_names is None or len(axis_names) != len(sizes):
      raise ValueError(f"mesh sizes {sizes} need one name each, got axis_names={axis_names!r}")
    axis_names = tuple(axis_names)
  if any(s < 1 for s in sizes):
    raise ValueError(f"mesh axis sizes must be >= 1, got {dict(zip(axis_names, sizes))}")
  n = int(np.prod(sizes))
  if devices is None:
    avail = jax.devices()
    if n > len(avail):
      raise ValueError(
          f"a mesh of {dict(zip(axis_names, sizes))} needs {n} devices but"
          f" {len(avail)} exist ({avail[0].platform}); on CPU simulate more with"
          f" XLA_FLAGS=--xla_force_host_platform_device_count={n} before importing jax")
    devices = avail[:n]
  devices = list(devices)
  if len(devices) != n:
    raise ValueError(f"a mesh of {dict(zip(axis_names, sizes))} needs {n} devices, got"
                     f" {len(devices)}")
  check_devices(devices)
  if axis_types is None:
    axis_types = (AxisType.Auto,) * len(sizes)
  return jax.make_mesh(sizes, axis_names, axis_types=axis_types, devices=devices)


def check_devices(devices: Sequence[Any]) -> None:
  """Raises ValueError for entries that are not existing jax devices (or repeat)."""
  known = {(d.platform, d.id): d for d in jax.devices()}
  for backend in ("cpu",):  # the host CPU is always there, even with an accelerator default
    try:
      known.update({(d.platform, d.id): d for d in jax.devices(backend)})
    except RuntimeError:
      pass
  seen = set()
  for d in devices:
    if not isinstance(d, jax.Device) or (d.platform, d.id) not in known:
      raise ValueError(f"{d!r} is not a device of this process: use entries of jax.devices()"
                       f" ({len(known)} known: {sorted({k[0] for k in known})})")
    if d in seen:
      raise ValueError(f"device {d} appears twice: a mesh uses each device once")
    seen.add(d)


def submesh(devices: Sequence[jax.Device] | Sequence[int], shape: dict[str, int] | None = None
            ) -> Mesh:
  """A mesh over some devices (given as devices or as indices into `jax.devices()`); by default
  every device on the "model" axis (tensor-parallel) with a "data" axis of size 1, so the
  default rules apply unchanged."""
  devs = list(devices)
  if devs and all(isinstance(d, (int, np.integer)) for d in devs):
    avail = jax.devices()
    bad = [i for i in devs if not 0 <= i < len(avail)]
    if bad:
      raise ValueError(f"device index {bad[0]} does not exist: this process has {len(avail)}"
                       f" devices (0..{len(avail) - 1})")
    devs = [avail[i] for i in devs]
  if not devs:
    raise ValueError("a sub-mesh needs at least one device")
  if shape is None:
    shape = {"data": 1, "model": len(devs)}
  return make_mesh(shape, devices=devs)


def mesh_axis_size(mesh: Mesh, name: str | None) -> int:
  return 1 if name is None or name not in mesh.axis_names else int(mesh.shape[name])


def check_fits(cfg: LlamaConfig, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES, *,
               batch_size: int | None = None) -> None:
  """Raises ValueError, naming the fix, when the mesh does not divide what it shards."""
  sizes = axis_sizes(cfg)
  if batch_size is not None:
    sizes["batch"] = batch_size
  for logical, n in sizes.items():
    name = rules.axis(logical, mesh)
    m = mesh_axis_size(mesh, name)
    if n % m:
      what = {"batch": f"a batch of {n} rows", "heads": f"{n} attention heads",
              "kv_heads": f"{n} key/value heads"}.get(logical, f"{logical} size {n}")
      fix = ("pad the batch to a multiple of the axis size or use a mesh with a smaller"
             f" {name!r} axis" if logical == "batch" else
             f"use a {name!r} axis size that divides {n}, or map {logical!r} to None in the"
             " ShardingRules")
      raise ValueError(f"the mesh's {name!r} axis of size {m} does not divide {what}: {fix}")


def param_shardings(params: Params, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> Params:
  """A pytree of NamedShardings matching `params` (quantized weights shard like their values;
  per-channel scales follow the value's spec where their dimension is not 1)."""

  def for_field(name, leaf, unrolled=False):
    if leaf is None:
      return None
    axes = WEIGHT[name].axes if unrolled else WEIGHT[name].stacked_axes
    if isinstance(leaf, OutputMajor):  # stored [*out, *in]: the same names, permuted
      n_in = len(axes) - leaf.n_out
      axes = (*axes[n_in:], *axes[:n_in])
    return jax.tree.map(lambda x: NamedSharding(mesh, _spec_for(x.shape, axes, rules, mesh)),
                        leaf)

  def for_layers(lp, unrolled):
    return LayerParams(**{f.name: for_field(f.name, getattr(lp, f.name), unrolled)
                          for f in dataclasses.fields(LayerParams)})

  if isinstance(params.layers, tuple):  # unrolled: each layer's specs without the layer axis
    layers = tuple(for_layers(lp, True) for lp in params.layers)
  else:
    layers = for_layers(params.layers, False)
  return Params(embed=for_field("embed", params.embed), layers=layers,
                final_norm=for_field("final_norm", params.final_norm),
                lm_head=for_field("lm_head", params.lm_head))


def _spec_for(shape, axes, rules, mesh) -> P:
  """The spec for `axes`, replicating dimensions of size 1 (broadcast scales)."""
  names = [rules.axis(a, mesh) if i < len(shape) and shape[i] != 1 else None
           for i, a in enumerate(axes)]
  return P(*names[:len(shape)])


def fit_spec(shape, spec: P, mesh: Mesh) -> P:
  """`spec` with the dimensions that its mesh axis does not divide replicated instead (a
  drafter's cache with fewer key/value heads than the target's "model" axis)."""
  out = []
  for i, name in enumerate(tuple(spec) + (None,) * (len(shape) - len(spec))):
    out.append(name if name is None or shape[i] % mesh_axis_size(mesh, name) == 0 else None)
  return P(*out)


def cache_sharding(mesh: Mesh, rules: ShardingRules = DEFAULT_RULES) -> KVCache:
  """NamedShardings for a KVCache (k/v [L, B, G, S, K], length [B])."""
  kv = NamedSharding(mesh, rules.spec(CACHE_AXES, mesh))
  return KVCache(k=kv, v=kv, length=NamedSharding(mesh, rules.spec(("batch",), mesh)))


def batch_sharding(mesh: Mesh, ndim: int, rules: ShardingRules = DEFAULT_RULES) -> NamedSharding:
  """Rows over the batch axis, everything else replicated."""
  return NamedSharding(mesh, P(rules.axis("batch", mesh), *([None] * (ndim - 1))))


def state_shardings(tree, batch_size: int, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
  """Shardings for a decoding-loop state (shapes from `jax.eval_shape`): KV caches by the cache
  axes, arrays whose first dimension is the batch over the batch axis, the rest replicated.

  A non-batch array that happens to have `batch_size` leading entries gets batch-sharded too:
  that changes where it lives, never what is computed.
  """
  rep = NamedSharding(mesh, P())

  def one(x):
    if isinstance(x, KVCache):
      kv = NamedSharding(mesh, fit_spec(x.k.shape, rules.spec(CACHE_AXES, mesh), mesh))
      # Sliding layers' rings (`KVCache.k_ring`) by the same axes, their slots as cache_seq.
      ring = None if x.k_ring is None else NamedSharding(
          mesh, fit_spec(x.k_ring.shape, rules.spec(CACHE_AXES, mesh), mesh))
      return dataclasses.replace(x, k=kv, v=kv, k_ring=ring, v_ring=ring,
                                 length=NamedSharding(mesh, fit_spec(
                                     x.length.shape, rules.spec(("batch",), mesh), mesh)))
    if hasattr(x, "shape") and len(x.shape) >= 1 and x.shape[0] == batch_size:
      return NamedSharding(mesh, fit_spec(x.shape, batch_sharding(mesh, len(x.shape),
                                                                  rules).spec, mesh))
    return rep

  return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, KVCache))


@dataclasses.dataclass(frozen=True)
class ModelSharding:
  """Where a model's weights live: a mesh and the rules that laid them out."""

  mesh: Mesh
  rules: ShardingRules = DEFAULT_RULES

  def __hash__(self):
    return hash(self._key())

  def __eq__(self, other):
    return isinstance(other, ModelSharding) and self._key() == other._key()

  def _key(self):
    return (tuple(self.mesh.axis_names), tuple(self.mesh.devices.shape),
            tuple((d.platform, d.id) for d in self.mesh.devices.flat), self.rules)

  def __repr__(self):
    return (f"ModelSharding({dict(self.mesh.shape)} over"
            f" {[str(d) for d in self.mesh.devices.flat]}, {self.rules})")

  @property
  def data_size(self) -> int:
    return mesh_axis_size(self.mesh, self.rules.axis("batch", self.mesh))

  def replicated(self) -> NamedSharding:
    return NamedSharding(self.mesh, P())

  def batch(self, ndim: int) -> NamedSharding:
    return batch_sharding(self.mesh, ndim, self.rules)

  def state(self, tree, batch_size: int):
    return state_shardings(tree, batch_size, self.mesh, self.rules)

  def check_batch(self, batch_size: int) -> None:
    m = self.data_size
    if batch_size % m:
      raise ValueError(f"a batch of {batch_size} rows does not divide over the mesh's"
                       f" {self.rules.batch!r} axis of size {m}: pass a multiple of {m} prompts"
                       f" or shard the model on a mesh with a smaller {self.rules.batch!r} axis")


def shard_params(params: Params, cfg: LlamaConfig, mesh: Mesh,
                 rules: ShardingRules = DEFAULT_RULES) -> Params:
  """`params` placed on `mesh` by `rules` (checked to divide first). Unrolled layers held
  output-major for one CPU device (`jaxspec.models.llama.OutputMajor`) go back to the logical
  layout on a mesh of several devices."""
  check_fits(cfg, mesh, rules)
  if mesh.size > 1:
    params = input_major(params)
  return jax.device_put(params, param_shardings(params, mesh, rules))


def place_drafter(drafter, sharding: ModelSharding):
  """The drafter's weights on `sharding.mesh`: a draft model sharded by the rules where the
  mesh divides it (replicated otherwise); for other drafters, arrays already on the mesh (a
  head's frozen embedding and LM head, shared with a target sharded there) keep their layout
  and the rest are replicated."""
  dparams = drafter.params
  if dparams is None:
    return None
  mesh = sharding.mesh
  on_mesh = lambda x: (isinstance(getattr(x, "sharding", None), NamedSharding)
                       and x.sharding.mesh == mesh)
  rep = NamedSharding(mesh, P())
  draft_model = getattr(drafter, "model", None)
  if isinstance(draft_model, Model):
    if all(on_mesh(x) for x in jax.tree.leaves(dparams)):
      return dparams
    try:
      return shard_params(dparams, draft_model.cfg, mesh, sharding.rules)
    except ValueError:  # the mesh does not divide the draft model: replicate it
      return jax.device_put(dparams, rep)
  return jax.tree.map(lambda x: x if on_mesh(x) else jax.device_put(x, rep), dparams)


def shard_model(model, mesh: Mesh, rules: ShardingRules = DEFAULT_RULES):
  """A copy of `model` whose weights are laid out on `mesh` by `rules`.

  `generate` and `speculative_generate` then compile for that mesh, with the batch sharded over
  the rules' batch axis (the number of prompts must divide it).
  """
  if not isinstance(model, Model):
    raise ValueError(f"shard_model takes a jaxspec Model, got {type(model).__name__}")
  params = shard_params(model.params, model.cfg, mesh, rules)
  cfg = model.cfg
  if mesh.size > 1 and cfg.attention_kernel == "auto":
    # XLA cannot partition a Pallas kernel's custom call: it would gather the whole cache onto
    # every device for it. A sharded model reads its cache by XLA's blocks (the CPU's program).
    cfg = dataclasses.replace(cfg, attention_kernel="xla")
  return dataclasses.replace(model, cfg=cfg, params=params, sharding=ModelSharding(mesh, rules))


def model_sharding(model) -> ModelSharding | None:
  return getattr(model, "sharding", None)


@dataclasses.dataclass(frozen=True)
class Placer:
  """Lays weights out on a mesh as a loader reads them (`jaxspec.models.llama.stack_params`'s
  `place`): each host array goes to the devices with `jax.make_array_from_callback`, which hands
  every device only its slice, so no device ever holds a full unsharded weight and nothing is
  staged on one device first."""

  mesh: Mesh
  rules: ShardingRules = DEFAULT_RULES

  def check(self, cfg: LlamaConfig) -> None:
    """Before any weight is read: the mesh must divide what it shards."""
    try:
      check_fits(cfg, self.mesh, self.rules)
    except ValueError as e:
      raise LayoutError(str(e)) from None

  def sharding(self, name: str, shape, layer_axis: bool = False) -> NamedSharding:
    axes = WEIGHT[name].axes if layer_axis else WEIGHT[name].stacked_axes
    return NamedSharding(self.mesh, _spec_for(shape, axes, self.rules, self.mesh))

  def put(self, name: str, x: np.ndarray, layer_axis: bool = False) -> jax.Array:
    """Host array `x` of weight `name` (one layer's, without the layer axis, for layer_axis)
    sharded by the rules: every device receives its own slice of `x`."""
    sharding = self.sharding(name, x.shape, layer_axis)
    return jax.make_array_from_callback(x.shape, sharding, lambda index: x[index])

  def empty_stacked(self, name: str, shape, dtype) -> jax.Array:
    """Zeros [L, ...] for weight `name`, created sharded on the devices (`set_layer` fills it)."""
    return _zeros(tuple(shape), np.dtype(dtype), self.sharding(name, shape))()

  def set_layer(self, name: str, stacked: jax.Array, x: np.ndarray, i: int) -> jax.Array:
    """`stacked` with layer i set to host array `x`: `x` reaches each device as its shard
    (`put`) and is written into the donated stacked array in place, so a device holds the
    stacked weight plus one layer's shard at a time."""
    layer = self.put(name, x, layer_axis=True)
    return _set_layer(stacked.sharding)(stacked, layer, np.int32(i))


@functools.lru_cache(maxsize=64)
def _zeros(shape, dtype, sharding: NamedSharding):
  return jax.jit(lambda: jax.numpy.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=64)
def _set_layer(sharding: NamedSharding):
  return jax.jit(lambda s, x, i: jax.lax.dynamic_update_index_in_dim(s, x, i, 0),
                 out_shardings=sharding, donate_argnums=0)


def load_sharded(name_or_path, mesh, *, dtype: str | None = None,
                 rules: ShardingRules | None = None, scan_layers: bool | None = None,
                 allow_nonfinite: bool = False):
  """`jaxspec.models.load` with the weights laid out on `mesh` by `rules` (default tensor x
  data parallel) as they are read: every device receives only its shard of each weight,
  converted to the dtype one tensor at a time on the host (`Placer`). The checkpoint's
  configuration is checked against the mesh (`Placer.check`) before any weight is read, and
  each weight for NaN and infinite values on the host, before it is placed (unless
  `allow_nonfinite`)."""
  rules = DEFAULT_RULES if rules is None else rules
  if scan_layers is None:
    scan_layers = default_scan_layers()
  if mesh.size == 1:  # one device: the single-device layouts (output-major weights on a CPU)
    return shard_model(loading.load(name_or_path, dtype, scan_layers=scan_layers,
                                    allow_nonfinite=allow_nonfinite), mesh, rules)
  model = loading.load(name_or_path, dtype, scan_layers=scan_layers, place=Placer(mesh, rules),
                       allow_nonfinite=allow_nonfinite)
  return dataclasses.replace(model, sharding=ModelSharding(mesh, rules))
