"""Device profiles: how long a model's forward pass takes on a device group, and a link between two.

The planner (`jaxspec.sharding.planner`) chooses where the target and the drafter run and how
many tokens to draft from these numbers alone, so a profile can be measured here (`profile`,
`profile_link`) or described from an accelerator's data sheet (`ModelProfile.from_numbers`) on a
machine that does not have it, and shipped as JSON (`save_profiles` / `load_profiles`).

A `ModelProfile` is a table of seconds per forward pass of T new tokens (T = 1 is a decode step,
T = k + 1 a verify of k drafts, T = 2 a draft model's catch-up pass) at a few batch sizes B, on a
grid `batch_sizes x tokens`. Between grid points it interpolates linearly in each of B and T
(bilinear); below the grid it takes the edge value (a smaller pass is not assumed to be any
cheaper than the smallest one measured); above the grid it extends the last segment's slope,
never downwards (a larger pass never costs less).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

_FORMAT = "jaxspec.profiles/1"
_SOURCES = ("measured", "given")


def _ints(name: str, values: Sequence[int]) -> tuple[int, ...]:
  out = tuple(int(v) for v in values)
  if not out or any(v < 1 for v in out) or list(out) != sorted(set(out)):
    raise ValueError(f"{name} must be ascending distinct integers >= 1, got {tuple(values)!r}")
  return out


def _seconds_ok(x: float) -> bool:
  return isinstance(x, (int, float, np.floating, np.integer)) and math.isfinite(x) and x >= 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelProfile:
  """Seconds of one forward pass of T new tokens at batch B, for one model on one device group.

  Attributes:
    batch_sizes: the B of the grid rows, ascending.
    tokens: the T of the grid columns, ascending (1 .. k_max + 1 covers every verify width).
    seconds: `[len(batch_sizes)][len(tokens)]` seconds per pass; >= 0 (0: a free drafter).
    platform: "cpu", "gpu", "tpu", "npu", ... (informational).
    devices: what the device group is, in words ("2 x cpu (ids 0, 1)", "1 x H100 SXM").
    source: "measured" (by `profile`) or "given" (numbers from a data sheet or a user).
    vocab_size: the model's vocabulary V (sizes the q [B, k, V] a drafter sends), when known.
  """

  batch_sizes: tuple[int, ...]
  tokens: tuple[int, ...]
  seconds: tuple[tuple[float, ...], ...]  # [len(batch_sizes), len(tokens)]
  platform: str = "unknown"
  devices: str = ""
  source: str = "given"
  vocab_size: int | None = None

  def __post_init__(self):
    object.__setattr__(self, "batch_sizes", _ints("ModelProfile.batch_sizes", self.batch_sizes))
    object.__setattr__(self, "tokens", _ints("ModelProfile.tokens", self.tokens))
    rows = tuple(tuple(float(s) for s in row) for row in self.seconds)
    if len(rows) != len(self.batch_sizes) or any(len(r) != len(self.tokens) for r in rows):
      raise ValueError(
          f"ModelProfile.seconds must be a [len(batch_sizes)={len(self.batch_sizes)}]"
          f"[len(tokens)={len(self.tokens)}] grid, got {[len(r) for r in rows]} rows: give one"
          " time per (batch, T) pair (`ModelProfile.from_table` checks a dict for gaps)")
    bad = [(b, t, s) for b, row in zip(self.batch_sizes, rows)
           for t, s in zip(self.tokens, row) if not _seconds_ok(s)]
    if bad:
      raise ValueError(f"ModelProfile.seconds must be finite and >= 0, got {bad[0][2]} at"
                       f" (batch={bad[0][0]}, T={bad[0][1]})")
    object.__setattr__(self, "seconds", rows)
    if self.source not in _SOURCES:
      raise ValueError(f"ModelProfile.source must be one of {_SOURCES}, got {self.source!r}")
    if self.vocab_size is not None and int(self.vocab_size) < 1:
      raise ValueError(f"ModelProfile.vocab_size must be >= 1 or None, got {self.vocab_size}")

  # -- construction -----------------------------------------------------------------------------

  @classmethod
  def from_table(cls, table: Mapping[tuple[int, int], float], **meta) -> ModelProfile:
    """A profile from `{(batch, T): seconds}` covering a full grid of batches x T."""
    bs = sorted({int(b) for b, _ in table})
    ts = sorted({int(t) for _, t in table})
    missing = [(b, t) for b in bs for t in ts if (b, t) not in table]
    if missing:
      raise ValueError(f"the table has no time for (batch, T) = {missing[0]}: a profile is a full"
                       f" grid of batch sizes {bs} x T {ts}; add the missing entries")
    return cls(batch_sizes=tuple(bs), tokens=tuple(ts),
               seconds=tuple(tuple(table[b, t] for t in ts) for b in bs), **meta)

  @classmethod
  def from_numbers(cls, *, params: float, bandwidth: float, peak_flops: float,
                   overhead: float = 0.0, weight_bytes: float | None = None,
                   batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
                   tokens: Sequence[int] = tuple(range(1, 10)), platform: str = "unknown",
                   devices: str = "", vocab_size: int | None = None) -> ModelProfile:
    """A roofline profile of an accelerator described by its numbers (no device needed).

    seconds(B, T) = max(weight_bytes / bandwidth, 2 * params * B * T / peak_flops) + overhead:
    a pass streams every weight once (memory-bound at small B * T) or does a multiply-add per
    weight per token (compute-bound at large B * T), plus a fixed per-pass cost (launches,
    host dispatch, collectives). The KV cache's reads are not modelled (short contexts).

    Args:
      params: parameter count of the model.
      bandwidth: memory bandwidth in bytes/s the weights stream at (e.g. 3.35e12 for an H100).
      peak_flops: achievable FLOP/s in the weights' dtype.
      overhead: seconds per pass independent of its size.
      weight_bytes: bytes of the weights; default 2 * params (bfloat16).
      batch_sizes, tokens: the grid the table is written on.
    """
    for name, v in (("params", params), ("bandwidth", bandwidth), ("peak_flops", peak_flops)):
      if not (math.isfinite(v) and v > 0):
        raise ValueError(f"ModelProfile.from_numbers: {name} must be a positive number, got {v}")
    if not _seconds_ok(overhead):
      raise ValueError(f"ModelProfile.from_numbers: overhead must be seconds >= 0, got {overhead}")
    wb = 2.0 * params if weight_bytes is None else float(weight_bytes)
    bs, ts = _ints("batch_sizes", batch_sizes), _ints("tokens", tokens)
    seconds = tuple(tuple(max(wb / bandwidth, 2.0 * params * b * t / peak_flops) + overhead
                          for t in ts) for b in bs)
    return cls(batch_sizes=bs, tokens=ts, seconds=seconds, platform=platform, devices=devices,
               source="given", vocab_size=vocab_size)

  @classmethod
  def per_token(cls, seconds: float, **meta) -> ModelProfile:
    """A drafter whose pass costs `seconds` per token whatever the batch (n-gram lookup: ~0)."""
    if not _seconds_ok(seconds):
      raise ValueError(f"ModelProfile.per_token: seconds must be finite and >= 0, got {seconds}")
    return cls(batch_sizes=(1,), tokens=(1, 2), seconds=((seconds, 2.0 * seconds),), **meta)

  # -- lookup -----------------------------------------------------------------------------------

  @property
  def table(self) -> dict[tuple[int, int], float]:
    """{(batch, T): seconds} for every grid point."""
    return {(b, t): s for b, row in zip(self.batch_sizes, self.seconds)
            for t, s in zip(self.tokens, row)}

  def latency(self, batch: int, tokens: int) -> float:
    """Seconds of one pass of `tokens` new tokens per row for `batch` rows (see module doc)."""
    grid = np.asarray(self.seconds, np.float64)  # [nB, nT]
    along_t = np.array([_interp(self.tokens, row, tokens) for row in grid])  # [nB]
    return float(_interp(self.batch_sizes, along_t, batch))

  # -- JSON -------------------------------------------------------------------------------------

  def to_dict(self) -> dict[str, Any]:
    return dict(kind="model", batch_sizes=list(self.batch_sizes), tokens=list(self.tokens),
                seconds=[list(r) for r in self.seconds], platform=self.platform,
                devices=self.devices, source=self.source, vocab_size=self.vocab_size)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ModelProfile:
    if d.get("kind", "model") != "model":
      raise ValueError(f"not a model profile (kind={d.get('kind')!r})")
    return cls(batch_sizes=tuple(d["batch_sizes"]), tokens=tuple(d["tokens"]),
               seconds=tuple(tuple(r) for r in d["seconds"]),
               platform=d.get("platform", "unknown"), devices=d.get("devices", ""),
               source=d.get("source", "given"), vocab_size=d.get("vocab_size"))


def _interp(xs: Sequence[int], ys: np.ndarray, x: float) -> float:
  """Linear in x inside [xs[0], xs[-1]]; the first value below; the last slope (>= 0) above."""
  xs = np.asarray(xs, np.float64)
  ys = np.asarray(ys, np.float64)
  if len(xs) == 1 or x <= xs[-1]:
    return float(np.interp(x, xs, ys))
  slope = max((ys[-1] - ys[-2]) / (xs[-1] - xs[-2]), 0.0)
  return float(ys[-1] + slope * (x - xs[-1]))


@dataclasses.dataclass(frozen=True, kw_only=True)
class LinkProfile:
  """Moving bytes from one device group to another: latency + nbytes / bandwidth seconds.

  Within one group nothing moves (the planner charges no transfer); a link is only needed
  between two different groups.

  Attributes:
    latency: seconds per transfer, whatever its size.
    bandwidth: bytes per second.
    description: what the link is ("PCIe 4 x16", "host memcpy").
    source: "measured" (by `profile_link`) or "given".
  """

  latency: float
  bandwidth: float
  description: str = ""
  source: str = "given"

  def __post_init__(self):
    if not _seconds_ok(self.latency):
      raise ValueError(f"LinkProfile.latency must be seconds >= 0, got {self.latency}")
    if not (math.isfinite(self.bandwidth) and self.bandwidth > 0):
      raise ValueError(f"LinkProfile.bandwidth must be positive bytes/s, got {self.bandwidth}")
    if self.source not in _SOURCES:
      raise ValueError(f"LinkProfile.source must be one of {_SOURCES}, got {self.source!r}")

  def seconds(self, nbytes: float) -> float:
    """Seconds to move `nbytes` (0 bytes: nothing is sent, no latency)."""
    return 0.0 if nbytes <= 0 else self.latency + nbytes / self.bandwidth

  def to_dict(self) -> dict[str, Any]:
    return dict(kind="link", latency=self.latency, bandwidth=self.bandwidth,
                description=self.description, source=self.source)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> LinkProfile:
    if d.get("kind", "link") != "link":
      raise ValueError(f"not a link profile (kind={d.get('kind')!r})")
    return cls(latency=d["latency"], bandwidth=d["bandwidth"],
               description=d.get("description", ""), source=d.get("source", "given"))


# ----------------------------------------------------------------------------------------------
# JSON files: {"format", "models": {model: {group: profile}}, "links": [{"from", "to", ...}]}.


def save_profiles(path: str | Path, profiles: Mapping[str, Mapping[str, ModelProfile]],
                  links: Mapping[tuple[str, str], LinkProfile] | None = None) -> None:
  """Writes model profiles ({model name: {device group: ModelProfile}}) and links
  ({(group a, group b): LinkProfile}) to one JSON file."""
  doc = dict(format=_FORMAT,
             models={m: {g: p.to_dict() for g, p in per.items()} for m, per in profiles.items()},
             links=[dict(**{"from": a, "to": b}, **lp.to_dict())
                    for (a, b), lp in (links or {}).items()])
  Path(path).write_text(json.dumps(doc, indent=1))


def load_profiles(path: str | Path) -> tuple[dict[str, dict[str, ModelProfile]],
                                             dict[tuple[str, str], LinkProfile]]:
  """Reads a `save_profiles` file: (model profiles, link profiles)."""
  doc = json.loads(Path(path).read_text())
  if doc.get("format") != _FORMAT:
    raise ValueError(f"{path} is not a jaxspec profile file (format {doc.get('format')!r},"
                     f" expected {_FORMAT!r}): write it with jaxspec.sharding.save_profiles")
  models = {m: {g: ModelProfile.from_dict(p) for g, p in per.items()}
            for m, per in doc.get("models", {}).items()}
  links = {(d["from"], d["to"]): LinkProfile.from_dict(d) for d in doc.get("links", [])}
  return models, links


# ----------------------------------------------------------------------------------------------
# Measuring.


def _describe(mesh) -> tuple[str, str]:
  devs = list(mesh.devices.flat)
  platform = devs[0].platform
  kinds = sorted({getattr(d, "device_kind", platform) for d in devs})
  ids = ", ".join(str(d.id) for d in devs)
  return platform, f"{len(devs)} x {'/'.join(kinds)} (ids {ids}), mesh {dict(mesh.shape)}"


def _best_time(fn, repeats: int) -> float:
  best = math.inf
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    best = min(best, time.perf_counter() - t0)
  return best


def profile(model, mesh, *, tokens: Sequence[int] = (1, 2, 3, 5, 9),
            batch_sizes: Sequence[int] = (1, 4), cache_len: int = 128,
            repeats: int = 3) -> ModelProfile:
  """Measures a model's forward latency on a mesh: one jitted pass per (batch, T) over a cache.

  The model is laid out on the mesh (`shard_model` when it has several devices, else put on its
  one device); every pass attends to a cache of `cache_len` positions filled up to
  `cache_len - max(tokens)` and writes its T new entries in place (the cache is donated), as a
  decode or verify step does. Each shape is compiled, run once to warm up, then timed
  `repeats` times; the best time is kept (noise only ever adds time).

  Args:
    model: a `jaxspec.models.model.Model`.
    mesh: a `jax.sharding.Mesh` (e.g. `submesh([0])`, `make_mesh({"data": 1, "model": 2})`).
    tokens: the T to measure. The default, 1, 2, 3, 5, 9, covers a plain decode step, a draft
      model's catch-up pass and verify widths up to k = 8, with one compile per (batch, T) (about
      a second each on a CPU); the table interpolates between them. Pass
      `tokens=range(1, k_max + 2)` to measure every verify width.
    batch_sizes: the batch sizes B to measure (each must divide the mesh's "data" axis).
    cache_len: the cache size S every pass attends over.
    repeats: timed runs per shape.
  Returns:
    A ModelProfile with source "measured".
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  from jaxspec.models.llama import KVCache, forward, init_cache
  from jaxspec.models.model import Model
  from jaxspec.sharding import rules

  if not isinstance(model, Model):
    raise ValueError(f"profile takes a jaxspec Model, got {type(model).__name__}")
  ts, bs = _ints("tokens", tokens), _ints("batch_sizes", batch_sizes)
  if cache_len <= ts[-1]:
    raise ValueError(f"cache_len={cache_len} must exceed the largest T={ts[-1]}: the pass writes"
                     " T new entries after a non-empty prefix; raise cache_len")
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  cfg = model.cfg
  n_dev = mesh.devices.size
  for b in bs:  # raise before anything is placed or compiled
    rules.check_fits(cfg, mesh, batch_size=b)
  if n_dev > 1:
    params = rules.shard_model(model, mesh).params
    cache_sh = rules.cache_sharding(mesh)
    batch_sh = lambda ndim: rules.batch_sharding(mesh, ndim)
  else:
    dev = mesh.devices.flat[0]
    params = jax.device_put(model.params, dev)
    single = NamedSharding(mesh, P())
    cache_sh = KVCache(k=single, v=single, length=single)
    batch_sh = lambda ndim: single

  def step(params, tok, k, v, length):
    cache = KVCache(k=k, v=v, length=length)
    logits, _, cache = forward(params, tok, cache, cfg)
    return logits, cache.k, cache.v

  # Donating k and v lets XLA write the new entries in place; length is not donated, so every
  # timed pass starts from the same prefix.
  fwd = jax.jit(step, donate_argnums=(2, 3))
  prefix = cache_len - ts[-1]
  seconds = []
  for b in bs:
    # One stack of every layer (no sliding-layer rings): the step rebuilds the cache from k, v.
    cache = init_cache(cfg, b, cache_len, ring_slack=None)
    k = jax.device_put(cache.k, cache_sh.k)
    v = jax.device_put(cache.v, cache_sh.v)
    length = jax.device_put(jnp.full((b,), prefix, jnp.int32), cache_sh.length)
    row = []
    for t in ts:
      tok = jax.device_put(jnp.zeros((b, t), jnp.int32), batch_sh(2))
      state = [k, v]

      def run():
        logits, state[0], state[1] = fwd(params, tok, state[0], state[1], length)
        jax.block_until_ready((logits, state[0], state[1]))

      run()  # compile + warm up
      row.append(_best_time(run, repeats))
      k, v = state
    seconds.append(tuple(row))
  platform, devices = _describe(mesh)
  return ModelProfile(batch_sizes=bs, tokens=ts, seconds=tuple(seconds), platform=platform,
                      devices=f"{devices}; {getattr(model, 'name', 'model')}, cache {cache_len}",
                      source="measured", vocab_size=cfg.vocab_size)


def profile_link(mesh_a, mesh_b, *, nbytes: int = 4096, nbytes_large: int = 1 << 20,
                 repeats: int = 5) -> LinkProfile:
  """Measures `jax.device_put` from one mesh to another (arrays replicated on each).

  Two sizes are timed (best of `repeats`): the small one, about what a step sends (drafts and
  accepted tokens), and a large one; the line through both gives latency and bandwidth.
  """
  import jax
  import jax.numpy as jnp
  from jax.sharding import NamedSharding, PartitionSpec as P

  if not 0 < nbytes < nbytes_large:
    raise ValueError(f"need 0 < nbytes < nbytes_large, got {nbytes} and {nbytes_large}")
  src, dst = NamedSharding(mesh_a, P()), NamedSharding(mesh_b, P())

  def timed(n):
    x = jax.device_put(jnp.zeros((max(n // 4, 1),), jnp.float32), src)
    jax.block_until_ready(x)
    go = lambda: jax.block_until_ready(jax.device_put(x, dst))
    go()  # warm up
    return _best_time(go, repeats), 4 * max(n // 4, 1)

  (t_s, n_s), (t_l, n_l) = timed(nbytes), timed(nbytes_large)
  if t_l > t_s:
    bandwidth = (n_l - n_s) / (t_l - t_s)
    latency = max(t_s - n_s / bandwidth, 0.0)
  else:  # noise swamped the size difference: all of it is latency, bandwidth bounded below
    bandwidth, latency = n_l / t_l, t_s
  _, da = _describe(mesh_a)
  _, db = _describe(mesh_b)
  return LinkProfile(latency=latency, bandwidth=bandwidth, source="measured",
                     description=f"device_put {da} -> {db}")
