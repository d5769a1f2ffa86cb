"""The measured cost model of "auto": the compiled loop forced to each k and timed from the
prefilled state (`measure_costs`), at the prompt's length and at a short cache
(`state_at_length`) so that the model follows the cache's growth; and kept on disk between
processes (`cost_cache_dir`, `load_cost`, `save_cost`, `clear_cost_cache`), so that a second
process with the same model, drafter, shapes and device does not time it again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import protocol
from jaxspec.decoding.adaptive import CostModel, isotonic
from jaxspec.decoding.loop import Policy, SpecState, costs_array
from jaxspec.engine.io import to_host


# Loop steps each k is timed over per round (after WARMUP_STEPS untimed ones).
TIMED_STEPS, WARMUP_STEPS = 4, 2


def measure_costs(loop_exe, tparams, dparams, state: SpecState, sp, policy: Policy, *,
                  steps: int = TIMED_STEPS, warmup: int = WARMUP_STEPS, rounds: int = 3,
                  batch_size: int | None = None, short_state=None) -> CostModel:
  """Times the compiled loop forced to each k in `policy.buckets`, from copies of `state`.

  The loop executable is the one that then generates, so this costs no compilation and times
  exactly what will run (drafting, verify, acceptance, bookkeeping). The k's are timed in
  `rounds` interleaved rounds (k = 0, 1, .. then again), so a slow spell of a shared machine
  hits every k rather than one; each k's cost is its median ratio to the plain step of the
  same round, times the fastest plain step. A round runs `warmup` untimed
  steps from a fresh copy of the post-prefill state (the first steps on freshly copied buffers
  are slow), then `steps` timed ones; rows that finish early shorten the count, and the model's
  `steps` says the fewest any k was timed over (the engine gives the rows room first:
  `SpecRun.timing_state`).

  With `short_state` (the same state with a short cache, `state_at_length`), every k is timed
  at both lengths in the same rounds, and the cost model grows with the cache by the
  difference (`CostModel.per_token`): where attention reads only the cached positions a long
  prompt makes every verify dearer, and a wide verify more so than a decode step.
  """
  n = len(policy.buckets)
  costs = jnp.asarray(costs_array(policy, None))
  states = [state] if short_state is None else [state, short_state]
  times = np.zeros((rounds, len(states), n))
  fewest = steps
  for r in range(rounds):
    for j, start in enumerate(states):
      for i in range(n):
        st = jax.block_until_ready(jax.tree.map(jnp.copy, start))
        t0 = time.perf_counter()
        st = jax.block_until_ready(loop_exe(tparams, dparams, st, sp, costs, jnp.int32(warmup),
                                            jnp.int32(i)))
        first = time.perf_counter() - t0
        done0 = int(st.stats.target_passes)
        t0 = time.perf_counter()
        st = jax.block_until_ready(loop_exe(tparams, dparams, st, sp, costs,
                                            jnp.int32(warmup + steps), jnp.int32(i)))
        dt = time.perf_counter() - t0
        ran = int(st.stats.target_passes) - done0
        fewest = min(fewest, ran)
        times[r, j, i] = dt / ran if ran > 0 else first / max(done0, 1)
        del st
  # Each k relative to the plain step timed just before it in the same round (a slow spell of
  # a shared machine hits both), the median over rounds, times the fastest plain step: a
  # single lucky or unlucky timing of one k cannot make drafting look free.
  ratio = np.median(times / times[:, :, :1], axis=0)  # [lengths, n]
  best = ratio * times[:, :, 0].min(axis=0)[:, None]
  length = longest(state)
  if short_state is None:
    return CostModel.from_measurements(policy.buckets, best[0], length=length,
                                       batch_size=batch_size, source="measured", steps=fewest)
  # Timed at the short length as `seconds` and grown to the prompt's: a difference under
  # NOISE_FRACTION of the step is timing noise (the same program timed twice), not growth.
  short_len = longest(short_state)
  near, far = isotonic(best[1]), isotonic(best[0])
  grown = [f if f - s_ > NOISE_FRACTION * s_ else s_ for s_, f in zip(near, far)]
  return CostModel.from_measurements(policy.buckets, best[1], longer=grown, length=short_len,
                                     longer_length=length, batch_size=batch_size,
                                     source="measured", steps=fewest)


# Two timings of one step that differ by less than this fraction are taken as equal.
NOISE_FRACTION = 0.03

# The shortest span of cache lengths the growth of the costs is timed over (shorter prompts
# give a difference smaller than the timing noise).
MIN_COST_SPAN = 256


def longest(state) -> int:
  """The longest row's length (prompt + emitted) of a loop state: where the costs are weighed."""
  st = getattr(state, "t", state)
  return int(to_host(st.seq_len).max())  # gathered first on a multi-host mesh


def state_at_length(state: SpecState, length: int) -> SpecState:
  """A copy of a post-prefill state whose rows look `length` tokens long (for timing only): the
  target cache and the sequence cut back to `length`, each row's room to generate unchanged.
  The drafter's state is left as it is (its lengths only move its own reads and writes)."""
  shift = jnp.maximum(state.seq_len - length, 0)
  seq_len = state.seq_len - shift
  return dataclasses.replace(
      state, seq_len=seq_len, prompt_len=jnp.maximum(state.prompt_len - shift, 1),
      cache=protocol.with_length(state.cache, jnp.maximum(state.cache.length - shift, 0)))


# ----------------------------------------------------------------------------------------------
# The cost models kept on disk.

COST_CACHE_ENV = "JAXSPEC_COST_CACHE"
_FORMAT, _VERSION = "jaxspec-cost-model", 1


def cost_cache_dir() -> Path | None:
  """Where measured cost models are kept between processes: $JAXSPEC_COST_CACHE (a directory;
  'none' or 'off' keeps none), else beside JAX's persistent compilation cache when one is on
  (its directory with '-costs' appended: ~/.cache/jaxspec/xla-costs beside `jaxspec generate`'s
  default), else nowhere (None): a process that compiles from scratch times from scratch."""
  env = os.environ.get(COST_CACHE_ENV)
  if env is not None and env.strip():
    return None if env.strip().lower() in ("none", "off") else Path(env).expanduser()
  xla = jax.config.jax_compilation_cache_dir
  if not xla:
    return None
  xla = Path(xla).expanduser()
  return xla.with_name(xla.name + "-costs")


def describe(obj, depth: int = 0) -> Any:
  """A JSON-able description of what a cost model depends on: values of configs and settings,
  arrays by shape, dtype and layout (a step's time depends on them, never on the weights'
  values), objects without a stable description by their type."""
  if depth > 16:
    return "..."
  if obj is None or isinstance(obj, (bool, int, float, str)):
    return obj
  if isinstance(obj, (np.generic,)):
    return obj.item()
  if isinstance(obj, (jax.Array, np.ndarray, jax.ShapeDtypeStruct)):
    out = ["array", list(obj.shape), str(obj.dtype)]
    if isinstance(obj, jax.Array):
      out.append(str(obj.sharding))
    return out
  if isinstance(obj, (list, tuple)):
    return [type(obj).__name__, [describe(x, depth + 1) for x in obj]]
  if isinstance(obj, dict):
    return {str(k): describe(v, depth + 1)
            for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
  name = f"{type(obj).__module__}.{type(obj).__qualname__}"
  if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
    return [name, {f.name: describe(getattr(obj, f.name), depth + 1)
                   for f in dataclasses.fields(obj)}]
  leaves, treedef = jax.tree.flatten(obj)
  if not (len(leaves) == 1 and leaves[0] is obj):  # a registered pytree (an nnx.State)
    return [name, str(treedef), [describe(x, depth + 1) for x in leaves]]
  text = repr(obj)
  # A repr with an address, or a large one (a tokenizer's), differs between processes or says
  # nothing about speed: the type stands for it.
  return name if " at 0x" in text or len(text) > 2000 else [name, text]


def cost_key(parts: dict[str, Any]) -> str:
  """The file name (a hash) a cost model is kept under: `parts` (the run's model, drafter,
  shapes, settings: `SpecRun.disk_key_parts`) with the software and devices that timed it."""
  dev = jax.devices()[0]
  env = dict(jax=jax.__version__, jaxlib=_jaxlib_version(), backend=jax.default_backend(),
             device=dev.device_kind, devices=jax.device_count(), processes=jax.process_count(), cpus=os.cpu_count(),
             xla_flags=os.environ.get("XLA_FLAGS", ""), jaxspec=_jaxspec_version())
  text = json.dumps(describe(dict(parts, environment=env)), sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()[:40]


def _jaxlib_version() -> str | None:
  try:
    import jaxlib
    return jaxlib.__version__
  except (ImportError, AttributeError):
    return None


def _jaxspec_version() -> str | None:
  from importlib import metadata
  try:
    return metadata.version("jaxspec")
  except metadata.PackageNotFoundError:
    return None


def load_cost(directory: Path, key: str, ks) -> CostModel | None:
  """The cost model saved under `key` (source "disk"), or None when there is none or the file
  is not one this version wrote for these k's (corrupt, truncated, foreign): the caller then
  times it again and overwrites the file."""
  try:
    with open(Path(directory) / f"{key}.json", encoding="utf-8") as f:
      data = json.load(f)
    if data.get("format") != _FORMAT or data.get("version") != _VERSION or data.get("key") != key:
      return None
    cost = CostModel.from_dict(dict(data["cost"], source="disk"))
  except Exception:  # noqa: BLE001 - any unreadable file means "not saved": time it again
    return None
  return cost if tuple(cost.ks) == tuple(ks) else None


def save_cost(directory: Path, key: str, cost: CostModel) -> bool:
  """Saves a measured cost model under `key` (written whole to a temporary file, then renamed,
  so a reader never sees half a file). A directory that cannot be written keeps nothing: the
  next process times again. Returns whether it was saved."""
  data = dict(format=_FORMAT, version=_VERSION, key=key, cost=cost.to_dict())
  path = Path(directory) / f"{key}.json"
  tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
  try:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, path)
  except OSError:
    tmp.unlink(missing_ok=True)
    return False
  return True


def clear_cost_cache(directory: str | os.PathLike | None = None) -> int:
  """Deletes the cost models kept on disk in `directory` (default: `cost_cache_dir()`), so
  that the next "auto" call times again; returns the number of files deleted. Other files in
  the directory are left alone."""
  d = cost_cache_dir() if directory is None else Path(directory)
  if d is None or not d.is_dir():
    return 0
  n = 0
  for f in d.glob("*.json"):
    if len(f.stem) == 40 and all(c in "0123456789abcdef" for c in f.stem):  # `cost_key`'s
      f.unlink(missing_ok=True)
      n += 1
  return n
