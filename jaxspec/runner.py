"""The host side of a run: prompts in, compiled programs (cached, with compile timing), the
kept cache buffers, the measured cost model, the run objects that drive the fused loop and the
two-mesh loop with failover, and arrays back to numpy. The public functions that use it are in
`jaxspec.api`; what runs inside jit is in `jaxspec.decoding`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import limits, protocol
from jaxspec.decoding import loop as fused
from jaxspec.decoding import two_mesh as host
from jaxspec.decoding.limits import MAX_POSITIONS  # noqa: F401 - public here too
from jaxspec.decoding.adaptive import CostModel, isotonic
from jaxspec.decoding.drafter import DraftContext, Drafter, resolve_coupled
from jaxspec.decoding.functional import as_key, check_drafter_for, check_stop_ids, working_set
from jaxspec.decoding.plain import DecodeState
from jaxspec.decoding.loop import (Policy, SpecState, SpecStats, StepConfig, costs_array,
                                   resolve_policy)
from jaxspec.drafters import resolve_drafter
from jaxspec.models.config import LlamaConfig
from jaxspec.models.llama import LlamaLM, init_cache
from jaxspec.models.model import Model
from jaxspec.sampling import resolve_sampling
from jaxspec.sharding import placement as placement_lib
from jaxspec.sharding.placement import Placement
from jaxspec.sharding.rules import ModelSharding, place_drafter


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class PreparedPrompts:
  tokens: np.ndarray  # [B, P] int32, right-padded with 0
  lengths: np.ndarray  # [B] int32
  max_len: int


def prepare_prompts(model: Model, prompts, max_new_tokens: int, *, extra: int = 0,
                    max_len: int | None = None) -> PreparedPrompts:
  """Validates and pads prompts; sizes the cache. Raises ValueError before anything compiles.

  Args:
    prompts: a string, a list of strings (encoded with the model's tokenizer, no chat template:
      use `model.tokenizer.encode_chat` for that), or a list of token-id lists.
    max_new_tokens: new tokens per row.
    extra: cache slots needed beyond prompt + max_new_tokens (speculative verification writes
      up to k + 1 positions ahead).
    max_len: cache size; by default the padded prompt length plus what decoding needs, rounded
      up to a multiple of 64.
  """
  check_model(model)
  if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, (int, np.integer)) \
      or not 1 <= max_new_tokens <= MAX_POSITIONS:
    raise ValueError(f"max_new_tokens must be an integer in [1, {MAX_POSITIONS}], got"
                     f" {max_new_tokens!r}")
  if max_len is not None and (isinstance(max_len, bool) or not isinstance(
      max_len, (int, np.integer)) or not 1 <= max_len <= MAX_POSITIONS):
    raise ValueError(f"max_len must be an integer in [1, {MAX_POSITIONS}], got {max_len!r}")
  if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                  and isinstance(prompts[0], (int, np.integer))):
    prompts = [prompts]
  if isinstance(prompts, (np.ndarray, jax.Array)):  # token ids: [P] one prompt, [B, P] a batch
    if isinstance(prompts, jax.core.Tracer):
      raise ValueError("prompts are traced: generate / speculative_generate run on the host; inside"
                       " jax.jit use jaxspec.decoding.decode / speculative_decode")
    arr = np.asarray(prompts)
    if arr.ndim not in (1, 2) or not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"an array of prompts must hold integer token ids, [P] for one prompt or"
                       f" [B, P] for a batch (every column a token), got {arr.dtype}{arr.shape}")
    prompts = [arr.tolist()] if arr.ndim == 1 else [list(r) for r in arr.tolist()]
  if not isinstance(prompts, Sequence) or len(prompts) == 0:
    raise ValueError("prompts must be a string, a non-empty list of strings or of token-id"
                     " lists, or an integer array of token ids ([P] or [B, P])")
  rows = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if model.tokenizer is None:
        raise ValueError(f"prompt {i} is a string but the model has no tokenizer: pass token ids")
      p = model.tokenizer.encode(p)
    try:
      arr = np.asarray(p)
    except (ValueError, TypeError):  # ragged nesting, or items numpy cannot hold
      arr = None
    if arr is not None and arr.size == 0:
      raise ValueError(f"prompt {i} is empty: every row needs at least one token to condition on")
    if arr is None or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
      what = f"dtype {arr.dtype}" if arr is not None else type(p).__name__
      raise ValueError(f"prompt {i} must be a string or a list of integer token ids, got"
                       f" {what} ({str(p)[:40]}): token ids are ints, not floats or None")
    p = [int(t) for t in arr.reshape(-1)]
    bad = [t for t in p if not 0 <= t < model.cfg.vocab_size]
    if bad:
      raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary"
                       f" [0, {model.cfg.vocab_size})")
    rows.append(p)
  longest = max(len(p) for p in rows)
  padded_len = round_up(longest, 64)  # coarse buckets: fewer compilations across prompts
  need = longest + max_new_tokens + extra
  if max_len is None:
    max_len = round_up(max(need, padded_len), 128)
  elif longest > max_len - max_new_tokens - extra:
    raise ValueError(
        f"a prompt of {longest} tokens does not fit: max_len {max_len} - max_new_tokens"
        f" {max_new_tokens}{f' - {extra} speculative slots' if extra else ''} leaves"
        f" {max_len - max_new_tokens - extra}; shorten the prompt, lower max_new_tokens or raise"
        " max_len")
  padded_len = min(padded_len, max_len)
  if max_len > model.cfg.max_position_embeddings:
    pass  # rotary extrapolates; Hugging Face does not refuse either
  check_cache_fits(model, len(rows), int(max_len), prompt_len=padded_len,
                   verify_tokens=max(extra, 1))
  toks = np.zeros((len(rows), padded_len), np.int32)
  for i, p in enumerate(rows):
    toks[i, : len(p)] = p
  return PreparedPrompts(toks, np.array([len(p) for p in rows], np.int32), int(max_len))


def stop_ids_for(model: Model, stop_ids: Sequence[int] | None) -> tuple[int, ...]:
  if stop_ids is None:
    ids = set(model.cfg.eos_token_ids)
    if model.tokenizer is not None:
      ids |= set(getattr(model.tokenizer, "eos_token_ids", ()))
    return tuple(sorted(ids))
  if isinstance(stop_ids, (int, np.integer)):
    raise ValueError(f"stop_ids must be a list of token ids, got {type(stop_ids).__name__}")
  return check_stop_ids(stop_ids)


def check_cache_fits(model: Model, batch: int, max_len: int, *, prompt_len: int = 1,
                     verify_tokens: int = 1) -> None:
  """Raises ValueError (before anything compiles) when a run of `batch` rows with a [batch,
  max_len] KV cache cannot be held: past `MAX_POSITIONS` positions, or its estimated working
  set (`decoding.functional.working_set`: the cache, the loop's buffers, and the larger of the
  prefill's activations over `prompt_len` padded tokens and a step's logits over
  `verify_tokens`) larger than the device's memory."""
  limits.check_positions(max_len)
  ws = working_set(LlamaLM(model.cfg), model.params, batch, prompt_len, max_len,
                   verify_tokens=verify_tokens,
                   state_bytes=4 * 2 * batch * (max_len + verify_tokens + 2 * max_len))
  limits.check_working_set(ws, batch, max_len, "generating")


_CACHE_POOL: dict[Any, tuple[jax.Array, jax.Array]] = {}


def _pool_key(cfg: LlamaConfig, batch_size: int, max_len: int, dtype) -> tuple:
  return (cfg, batch_size, max_len, str(dtype))


def take_cache_buffers(cfg: LlamaConfig, batch_size: int,
                       max_len: int) -> tuple[jax.Array, jax.Array]:
  """(k, v) buffers [L, B, G, max_len, K] for a prefill to donate: the kept ones of the last
  call when the shapes match, else `init_cache`'s zeros (the kept ones are freed first)."""
  bufs = _CACHE_POOL.pop(_pool_key(cfg, batch_size, max_len, cfg.act_dtype), None)
  _CACHE_POOL.clear()
  if bufs is not None and not any(b.is_deleted() for b in bufs):
    return bufs
  cache = init_cache(cfg, batch_size, max_len)
  return cache.k, cache.v


def keep_cache_buffers(cfg: LlamaConfig, k: jax.Array, v: jax.Array) -> None:
  """Keeps a finished call's cache arrays for the next call of the same shapes."""
  _CACHE_POOL.clear()
  _CACHE_POOL[_pool_key(cfg, k.shape[1], k.shape[3], k.dtype)] = (k, v)


def release_cache_buffers() -> int:
  """Frees the kept cache buffers; returns the bytes released."""
  n = sum(a.nbytes for bufs in _CACHE_POOL.values() for a in bufs)
  _CACHE_POOL.clear()
  return n


_COMPILED: collections.OrderedDict[Any, Any] = collections.OrderedDict()  # least recent first


# An unrolled 30-layer speculative loop for SmolLM2 keeps about 6,000-7,500 memory mappings while
# its executable lives (XLA CPU maps each kernel's code and data), and Linux refuses new mappings
# past vm.max_map_count (default 65,530) with LLVM's "Cannot allocate memory" mid-compilation,
# however much RAM is free. Past this fraction of the limit, the least recently used programs
# are released before compiling another (the rest leaves room for two such loops).
MAP_PRESSURE = 0.75


RELEASED = 0  # programs released so far (by release_compiled), for reports


_WARNED_RELEASE = False


def programs_released() -> int:
  """How many compiled programs this process has released so far (`release_compiled`)."""
  return RELEASED


def map_usage() -> tuple[int, int] | None:
  """(memory mappings of this process, vm.max_map_count) on Linux; None where unknown."""
  try:
    with open("/proc/sys/vm/max_map_count", encoding="ascii") as f:
      limit = int(f.read())
    with open("/proc/self/maps", "rb") as f:
      used = sum(1 for _ in f)
  except (OSError, ValueError):
    return None
  return used, limit


def release_compiled(keep: int = 0) -> int:
  """Drops all but the `keep` most recently used compiled programs, and JAX's own caches (which
  hold the same executables), so their memory and mappings are returned; a later call
  compiles again. Returns the number dropped."""
  global RELEASED
  n = max(len(_COMPILED) - keep, 0)
  RELEASED += n
  for _ in range(n):
    _COMPILED.popitem(last=False)
  jax.clear_caches()
  gc.collect()
  return n


def _over_pressure(usage: tuple[int, int] | None) -> bool:
  return usage is not None and usage[0] > MAP_PRESSURE * usage[1]


def _relieve_map_pressure() -> None:
  global _WARNED_RELEASE
  if not _over_pressure(map_usage()):
    return
  keep, total = len(_COMPILED) // 2, 0
  while True:
    dropped = release_compiled(keep)
    total += dropped
    usage = map_usage()
    if not _over_pressure(usage) or keep == 0:
      break
    keep //= 2
  if _over_pressure(usage):
    warnings.warn(
        f"this process holds {usage[0]} memory mappings of vm.max_map_count={usage[1]} even after"
        f" releasing jaxspec's compiled programs (the last release dropped {dropped}); compiling"
        " more may fail with LLVM's 'Cannot allocate memory'. Raise the limit (`sudo sysctl -w"
        " vm.max_map_count=262144`) or drop references to old outputs and executables.",
        RuntimeWarning, stacklevel=3)
  elif usage is not None and not _WARNED_RELEASE:  # once: they compile again when next used
    _WARNED_RELEASE = True
    warnings.warn(
        f"released {total} compiled programs: this process neared vm.max_map_count="
        f"{usage[1]} (XLA CPU maps every kernel of a program); they compile again when next"
        " used. To keep them, raise the limit (`sudo sysctl -w vm.max_map_count=262144`).",
        RuntimeWarning, stacklevel=3)


# XLA options for the programs `compiled` builds, by backend (`compiler_options`); a caller may
# replace an entry, e.g. to measure another setting. Per program, so a user's own programs and
# flags are untouched.
COMPILER_OPTIONS: dict[str, dict[str, Any]] = {}


# ----------------------------------------------------------------------------------------------
# Progress: what a run is doing while the user waits (compiling, measuring), for a status line.

_LISTENERS: list[Callable[[str | None], None]] = []
_PROGRAMS = {"spec-init": "the prefill", "spec-loop": "the speculative loop",
             "stream-init": "the prefill", "stream-loop": "the decode loop",
             None: "the decode loop", "host-verify": "the target's verify program"}


@contextlib.contextmanager
def progress(listener: Callable[[str | None], None]):
  """Calls `listener(phase)` as runs start a slow phase ("compiling the speculative loop",
  "measuring the step cost of each k") and `listener(None)` when it ends, inside the block."""
  _LISTENERS.append(listener)
  try:
    yield
  finally:
    _LISTENERS.remove(listener)


def _report(phase: str | None) -> None:
  for listener in list(_LISTENERS):
    listener(phase)


def _program_name(key_extra) -> str:
  name = key_extra[0] if isinstance(key_extra, tuple) else key_extra
  return _PROGRAMS.get(name, f"the {name} program" if isinstance(name, str) else "a program")


def compiler_options() -> dict[str, Any]:
  """The XLA options `compiled` passes for the default backend (empty: XLA's defaults)."""
  return dict(COMPILER_OPTIONS.get(jax.default_backend(), {}))


def compiled(fn, key_extra, *args, jit_kwargs: dict | None = None, **static):
  """AOT-compiles `fn` for these argument shapes once; returns (executable, compile seconds).

  With `jit_kwargs` (in_shardings, out_shardings, donate_argnums for a sharded model), `fn` is
  the plain function and is jitted with them; `key_extra` must then name the layout (the
  `ModelSharding`), which is part of the cache key.

  The programs are kept for reuse, least recently used first out: when the process nears
  Linux's vm.max_map_count (`MAP_PRESSURE`), older programs are released before compiling
  (`release_compiled`), so a long session that compiles many loops recompiles instead of failing.
  """
  leaves, treedef = jax.tree.flatten(args)
  options = compiler_options()
  sig = (fn, key_extra, tuple(sorted(options.items())), treedef,
         tuple((a.shape, str(a.dtype)) if hasattr(a, "shape") else a for a in leaves),
         tuple(sorted(static.items())))
  try:
    hash(sig)
  except TypeError:
    sig = repr(sig)
  if sig in _COMPILED:
    _COMPILED.move_to_end(sig)
    return _COMPILED[sig], 0.0
  _relieve_map_pressure()
  _report(f"compiling {_program_name(key_extra)}")
  t0 = time.perf_counter()
  try:
    if jit_kwargs is not None:  # jit with shardings takes no keyword arguments: bind them
      exe = jax.jit(functools.partial(fn, **static), **jit_kwargs).lower(*args).compile(
          compiler_options=options or None)
    else:
      exe = fn.lower(*args, **static).compile(compiler_options=options or None)
  finally:
    _report(None)
  dt = time.perf_counter() - t0
  _COMPILED[sig] = exe
  return exe, dt


def decode_texts(model: Model, tokens: np.ndarray, lengths: np.ndarray) -> list[str] | None:
  if model.tokenizer is None:
    return None
  return [model.tokenizer.decode(tokens[b, : lengths[b]].tolist()) for b in range(len(lengths))]


def to_host(tree):
  """numpy copies of a pytree's arrays; an array spread over several processes' devices (a
  multi-host mesh) is gathered from all of them first."""
  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      from jax.experimental import multihost_utils
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
  return jax.tree.map(one, tree)


def put_global(tree, shardings):
  """`tree` placed by `shardings` (a matching pytree), as global arrays: on a multi-host mesh
  every process passes the same host values (prompts, sampling values, the PRNG key), which
  go through numpy so that each process contributes its own devices' shards."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)

  def one(x, sh):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return x  # already global
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = jax.device_put(np.asarray(jax.random.key_data(x)), sh)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x), sh)

  return jax.tree.map(one, tree, shardings)


def in_shardings_for(sh, args):
  """in_shardings for (params, *batch arrays, key, ...) on a sharded model's mesh: the params
  keep their layout; every other array is batch-sharded when its first dimension is the batch,
  replicated otherwise (PRNG keys, scalars)."""
  params, rest = args[0], args[1:]
  b = args[1].shape[0]
  return (jax.tree.map(lambda x: x.sharding, params),
          *(sh.state(jax.eval_shape(lambda t: t, r), b) for r in rest))


def check_chunk(chunk) -> int:
  """A stream's chunk: an integer >= 1 (0 would never advance)."""
  if isinstance(chunk, bool) or not isinstance(chunk, (int, np.integer)) or chunk < 1:
    raise ValueError(f"chunk must be an integer >= 1 (steps between yields), got {chunk!r}")
  return int(chunk)


def check_model(model) -> None:
  """Raises ValueError unless `model` is a jaxspec `Model`."""
  if not isinstance(model, Model):
    raise ValueError(f"the model must be a jaxspec Model (jaxspec.load(path) or"
                     f" Model(cfg, params)), got {type(model).__name__}")


def stream_loop(step_fn: Callable, view: Callable, state, chunk: int, t0: float):
  """Yields (newly emitted tokens of row 0, info) after the prefill and after every chunk.

  `view(state)` -> (all new tokens of row 0 so far, every row done?, steps so far).
  """
  emitted = 0
  first_s = time.perf_counter() - t0
  while True:
    toks, done, steps = view(state)
    new, emitted = toks[emitted:].tolist(), len(toks)
    yield new, dict(first_chunk_seconds=first_s, seconds=time.perf_counter() - t0, state=state)
    if done:
      return
    state = jax.block_until_ready(step_fn(state, jnp.int32(steps + chunk)))


def view_decode(s: DecodeState):
  n = int(np.asarray(s.n_out)[0])
  return np.asarray(s.tokens)[0, :n], bool(np.asarray(s.done).all()), int(s.steps)


def _describe(model: Model) -> str:
  return f"{model.name} ({model.cfg.architecture}, vocabulary of {model.cfg.vocab_size})"


def check_draft_vocabulary(target: Model, draft: Model) -> None:
  """Raises ValueError, naming both models, unless a draft model proposes the target's token
  ids: equal vocabulary sizes and, where both have tokenizers, the same piece for every id both
  vocabularies hold (drafting across families works where they share a tokenizer: a Qwen3
  draft for a Qwen3 target; a Mistral draft for a Llama 2 target has the same 32000 ids for
  other pieces). Added and special tokens are not compared (releases rename reserved ones,
  llama.cpp pads GGUF vocabularies with placeholders); exactness never depends on it, only the
  acceptance rate does."""
  if draft.cfg.vocab_size != target.cfg.vocab_size:
    raise ValueError(
        f"the draft model {_describe(draft)} and the target {_describe(target)} have different"
        " vocabularies: a draft model must propose the target's token ids, so use a draft of"
        " the target's family that shares its tokenizer (the same vocabulary size and tokens)")
  ta, tb = target.tokenizer, draft.tokenizer
  if ta is None or tb is None or ta is tb:
    return
  tid = _first_different_id(ta, tb)
  if tid is None:
    return
  raise ValueError(
      f"the draft model {_describe(draft)} and the target {_describe(target)} have different"
      f" tokenizers: id {tid} is {ta.id_to_token(tid)!r} for the target and"
      f" {tb.id_to_token(tid)!r} for the draft, so the draft's proposals would be other tokens:"
      " use a draft model that shares the target's tokenizer")


@functools.lru_cache(maxsize=16)  # tokenizers hash by identity: one comparison per pair
def _first_different_id(ta, tb) -> int | None:
  base_a = ta.backend.get_vocab(with_added_tokens=False)
  base_b = tb.backend.get_vocab(with_added_tokens=False)
  added = set(ta.backend.get_added_tokens_decoder()) | set(tb.backend.get_added_tokens_decoder())
  ia = {i: t for t, i in base_a.items() if i not in added}
  ib = {i: t for t, i in base_b.items() if i not in added}
  differ = [i for i in ia.keys() & ib.keys() if ia[i] != ib[i]]
  return min(differ) if differ else None


def check_drafter(target: Model, drafter: Drafter) -> None:
  """Raises ValueError for a drafter that cannot serve this target."""
  draft = getattr(drafter, "model", None)
  if isinstance(draft, Model):
    check_draft_vocabulary(target, draft)
  check_drafter_for(target.cfg.vocab_size, drafter)
  dparams = drafter.params
  if dparams is not None and target.sharding is None:  # a sharded target gets them copied
    tdev = _devices(target.params)
    ddev = _devices(dparams)
    if tdev and ddev and tdev != ddev:
      raise ValueError(
          f"the drafter's weights are on {sorted(map(str, ddev))} but the target's are on"
          f" {sorted(map(str, tdev))}: move both to the same devices (jax.device_put) for the"
          " fused loop, or give them separate meshes with a Placement")


def _devices(tree) -> set:
  out = set()
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      out |= set(leaf.devices())
  return out


def measure_costs(loop_exe, tparams, dparams, state: SpecState, sp, policy: Policy, *,
                  steps: int = 4, warmup: int = 2, rounds: int = 3,
                  batch_size: int | None = None, short_state=None) -> CostModel:
  """Times the compiled loop forced to each k in `policy.buckets`, from copies of `state`.

  The loop executable is the one that then generates, so this costs no compilation and times
  exactly what will run (drafting, verify, acceptance, bookkeeping). The k's are timed in
  `rounds` interleaved rounds (k = 0, 1, .. then again), so a slow spell of a shared machine
  hits every k rather than one; each k's cost is its median ratio to the plain step of the
  same round, times the fastest plain step. A round runs `warmup` untimed
  steps from a fresh copy of the post-prefill state (the first steps on freshly copied buffers
  are slow), then `steps` timed ones; rows that finish early shorten the count.

  With `short_state` (the same state with a short cache, `state_at_length`), every k is timed
  at both lengths in the same rounds, and the cost model grows with the cache by the
  difference (`CostModel.per_token`): where attention reads only the cached positions a long
  prompt makes every verify dearer, and a wide verify more so than a decode step.
  """
  n = len(policy.buckets)
  costs = jnp.asarray(costs_array(policy, None))
  states = [state] if short_state is None else [state, short_state]
  times = np.zeros((rounds, len(states), n))
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
        times[r, j, i] = dt / ran if ran > 0 else first / max(done0, 1)
        del st
  # Each k relative to the plain step timed just before it in the same round (a slow spell of
  # a shared machine hits both), the median over rounds, times the fastest plain step: a
  # single lucky or unlucky timing of one k cannot make drafting look free.
  ratio = np.median(times / times[:, :, :1], axis=0)  # [lengths, n]
  best = ratio * times[:, :, 0].min(axis=0)[:, None]
  length = _longest(state)
  if short_state is None:
    return CostModel.from_measurements(policy.buckets, best[0], length=length,
                                       batch_size=batch_size, source="measured")
  # Timed at the short length as `seconds` and grown to the prompt's: a difference under
  # NOISE_FRACTION of the step is timing noise (the same program timed twice), not growth.
  short_len = _longest(short_state)
  near, far = isotonic(best[1]), isotonic(best[0])
  grown = [f if f - s_ > NOISE_FRACTION * s_ else s_ for s_, f in zip(near, far)]
  return CostModel.from_measurements(policy.buckets, best[1], longer=grown, length=short_len,
                                     longer_length=length, batch_size=batch_size,
                                     source="measured")


# Two timings of one step that differ by less than this fraction are taken as equal.
NOISE_FRACTION = 0.03

# The shortest span of cache lengths the growth of the costs is timed over (shorter prompts
# give a difference smaller than the timing noise).
MIN_COST_SPAN = 256


def _longest(state) -> int:
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


_COSTS: dict[Any, CostModel] = {}


def prepare_spec(target, drafter, prompts, max_new_tokens, sampling, num_draft_tokens, auto, cost,
                 max_len, temperature, logprobs=False):
  """Everything `speculative_generate` checks before compiling; the drafter resolved by name."""
  check_model(target)
  drafter = resolve_drafter(target, drafter)
  if temperature is not None:
    sampling = dataclasses.replace(resolve_sampling(sampling), temperature=temperature)
  sp_user = resolve_sampling(sampling)
  check_drafter(target, drafter)
  policy = dataclasses.replace(resolve_policy(num_draft_tokens, auto, drafter),
                               logprobs=bool(logprobs))
  # A drafter that samples its drafts is coupled with the target's draws under "auto" (unless
  # it says otherwise), so a timed k schedule cannot change the text.
  drafter = resolve_coupled(drafter, policy.auto)
  if cost is not None and not isinstance(cost, CostModel):
    raise ValueError(f"cost must be a jaxspec CostModel, got {type(cost).__name__}")
  try:
    prep = prepare_prompts(target, prompts, max_new_tokens, extra=policy.k_max + 1,
                           max_len=max_len)
  except ValueError as e:
    if policy.auto and "does not fit" in str(e):
      raise ValueError(f"{e} (with num_draft_tokens=\"auto\" the cache also holds k_max ="
                       f" {policy.k_max} drafts: lower AutoK(k_max=...))") from None
    raise
  return drafter, sp_user, policy, prep


_PLACED: dict[Any, Any] = {}


def place_drafter_params(target: Model, drafter: Drafter):
  """The drafter's weights on the target's mesh, for the fused loop of a sharded target
  (`jaxspec.sharding.rules.place_drafter`), copied once per (drafter weights, mesh) and reused."""
  dparams, sh = drafter.params, target.sharding
  if dparams is None or sh is None:
    return dparams
  key = (id(dparams), sh)
  hit = _PLACED.get(key)
  if hit is not None and hit[0] is dparams:
    return hit[1]
  placed = place_drafter(drafter, sh)
  if len(_PLACED) >= 8:
    _PLACED.clear()
  _PLACED[key] = (dparams, placed)
  return placed


def shardings_of(tree):
  return jax.tree.map(lambda x: x.sharding, tree)


def make_run(target, drafter, prep, sp_user, policy, stops, max_new_tokens, key, cost,
             placement):
  """The fused `SpecRun`, or the host-orchestrated run of a Placement over two meshes."""
  if placement is None:
    return SpecRun(target, drafter, prep, sp_user, policy, stops, max_new_tokens, key, cost)
  if not isinstance(placement, placement_lib.Placement):
    raise ValueError(f"placement must be a jaxspec.sharding.Placement, got"
                     f" {type(placement).__name__}")
  if drafter.tree is not None and not placement.fused:
    raise ValueError(f"the {drafter.name} drafter drafts a tree, which runs in the fused loop"
                     " only: place the drafter on the target's mesh (Placement(target=mesh,"
                     " drafter=mesh)) or use drafter.with_tree(None) for chains")
  target = placement_lib.place_target(target, placement)
  target.sharding.check_batch(prep.tokens.shape[0])
  drafter = placement_lib.drafter_in_precision(drafter, placement.drafter_precision)
  if placement.fused:
    run = SpecRun(target, drafter, prep, sp_user, policy, stops, max_new_tokens, key, cost)
    run.placement = placement
    return run
  return HostRun(target, drafter, placement, prep, sp_user, policy, stops,
                               max_new_tokens, key, cost)


class SpecRun:
  """The compiled prefill and loop of one call, and the cost model for "auto".

  For a target sharded with `jaxspec.sharding.shard_model`, both are compiled with
  in_shardings/out_shardings on its mesh: rows over the batch axis, caches by the rules.
  """

  placement = None  # the Placement that chose this run, when one did
  failover = None  # what went wrong, when a host-orchestrated run fell back to plain steps
  pooled = False  # the target's cache goes into kept buffers (unsharded fused runs)

  def __init__(self, target, drafter, prep, sp_user, policy, stops, max_new_tokens, key, cost):
    self.target, self.drafter, self.prep, self.policy = target, drafter, prep, policy
    b = prep.tokens.shape[0]
    self.sp = sp_user.arrays(b)
    self.max_steps = max_new_tokens + 1
    self.cost = cost
    self.profile_seconds = 0.0
    sh = target.sharding
    self.tparams, self.dparams = target.params, place_drafter_params(target, drafter)
    self.cost_key = (target.cfg, drafter, b, prep.tokens.shape[1], prep.max_len, policy.buckets,
                     repr(sp_user), sh)
    static = init_static = dict(cfg=StepConfig(
        lm=LlamaLM(target.cfg), drafter=drafter, policy=policy, max_new_tokens=max_new_tokens,
        stop_ids=stops, max_len=prep.max_len, max_steps=self.max_steps))
    self.init_args = (self.tparams, self.dparams, jnp.asarray(prep.tokens),
                      jnp.asarray(prep.lengths), self.sp, as_key(key, b))
    # Unsharded, the target's cache is written into the previous call's buffers (donated):
    # `take_cache_buffers` at start, `keep_cache_buffers` when the call ends.
    self.pooled = sh is None
    bufs = None
    if self.pooled:
      c = jax.eval_shape(functools.partial(init_cache, target.cfg, b, prep.max_len))
      bufs = (c.k, c.v)
    state0 = jax.eval_shape(functools.partial(fused.spec_init_jit, **init_static), *self.init_args,
                            bufs)
    self.costs = costs_array(policy, cost)
    loop_args = (self.tparams, self.dparams, state0, self.sp, self.costs, jnp.int32(0),
                 jnp.int32(-1))
    if sh is None:
      self.init_exe, c1 = compiled(fused.spec_init_jit, "spec-init", *self.init_args, bufs,
                                   **init_static)
      self.loop_exe, c2 = compiled(fused.spec_loop_jit, "spec-loop", *loop_args, **static)
    else:
      sh.check_batch(b)
      st_sh = sh.state(state0, b)
      p_sh = (shardings_of(self.tparams), shardings_of(self.dparams))
      rep = sh.replicated()
      init_in = (*p_sh, sh.batch(2), sh.batch(1), sh.state(self.sp, b), rep)
      self.init_exe, c1 = compiled(fused.spec_init, ("spec-init", sh), *self.init_args,
                                   jit_kwargs=dict(in_shardings=init_in, out_shardings=st_sh),
                                   **init_static)
      # Global arrays on the mesh (on several hosts every process passes the same prompts).
      self.init_args = put_global(self.init_args, init_in)
      self.sp = self.init_args[4]
      loop_in = (*p_sh, st_sh, sh.state(self.sp, b), rep, rep, rep)
      self.loop_exe, c2 = compiled(fused.spec_loop, ("spec-loop", sh), *loop_args,
                                   jit_kwargs=dict(in_shardings=loop_in, out_shardings=st_sh,
                                                   donate_argnums=(2,)), **static)
    self.compile_seconds = c1 + c2

  def start(self) -> SpecState:
    """Prefill; with "auto" and no cost model, times every k from the prefilled state once
    (cached per shapes), excluded from the generation time."""
    if self.pooled:
      b, ml = self.prep.tokens.shape[0], self.prep.max_len
      state = self.init_exe(*self.init_args, take_cache_buffers(self.target.cfg, b, ml))
    else:
      state = self.init_exe(*self.init_args)
    self._ensure_costs(state, self.loop_exe, self.sp)
    return state

  def finish(self, state: SpecState) -> None:
    """Keeps the finished call's target cache for the next call of the same shapes."""
    if self.pooled:
      keep_cache_buffers(self.target.cfg, state.cache.k, state.cache.v)

  def _ensure_costs(self, state, loop, sp) -> None:
    """With "auto" and no cost model given: the cached one for these shapes, or `loop` (the
    `measure_costs` signature) timed from `state` once; `self.costs` is then its array."""
    if not self.policy.auto or self.cost is not None:
      return
    self.cost = _COSTS.get(self.cost_key)
    if self.cost is None:
      state = jax.block_until_ready(state)
      _report("measuring the step cost of each k")
      t0 = time.perf_counter()
      try:
        self.cost = measure_costs(loop, self.tparams, self.dparams, state, sp, self.policy,
                                  batch_size=self.prep.tokens.shape[0],
                                  short_state=self.short_state(state))
      finally:
        _report(None)
      _COSTS[self.cost_key] = self.cost
      self.profile_seconds = time.perf_counter() - t0
    self.costs = costs_array(self.policy, self.cost)

  def short_state(self, state: SpecState) -> SpecState | None:
    """The state to time the costs at a short cache too, or None when the prompt is too short
    for the difference to show (`measure_costs`). Unsharded runs only: the compiled loop of a
    sharded one takes its state in the layout it was compiled for."""
    short = self.policy.k_max + 2
    if self.target.sharding is not None or _longest(state) - short < MIN_COST_SPAN:
      return None
    return state_at_length(state, short)

  def target_state(self, state: SpecState) -> SpecState:
    return state

  def loop(self, state: SpecState, until: int | jax.Array) -> SpecState:
    return self.loop_exe(self.tparams, self.dparams, state, self.sp, self.costs,
                         jnp.int32(until), jnp.int32(-1))

  def stats(self, st: SpecStats) -> dict[str, Any]:
    out = summarize_stats(st, self.policy.k_max)
    out.update(compile_seconds=self.compile_seconds, profile_seconds=self.profile_seconds,
               batch_size=self.prep.tokens.shape[0],
               num_draft_tokens="auto" if self.policy.auto else self.policy.k_max,
               k_max=self.policy.k_max, drafter=self.drafter.name)
    if self.drafter.tree is not None:
      out["tree"] = self.drafter.tree.describe()
      out["tree_nodes"] = self.drafter.tree.num_nodes - 1
    if self.policy.auto:  # CostModel.from_ratios(these three) is the same model
      out["cost_model"] = dict(zip(map(str, self.cost.ks), self.cost.seconds))
      out["cost_model_per_token"] = (None if self.cost.per_token is None else
                                     dict(zip(map(str, self.cost.ks), self.cost.per_token)))
      out["cost_model_length"] = self.cost.length
    if self.placement is not None:
      out.update(placement=self.placement.describe(),
                 failover=None if self.failover is None else dataclasses.asdict(self.failover))
    return out


def summarize_stats(st: SpecStats, k: int) -> dict[str, Any]:
  """Host-side statistics from the device counters."""
  st = to_host(st)
  passes = int(st.target_passes)
  total_row_steps = max(float(st.row_steps.sum()), 1.0)
  spec_steps = max(float(st.spec_row_steps.sum()), 1.0)
  acc_at = st.accepted_at.astype(np.float64)
  hist = st.k_history[:passes]
  return dict(
      target_passes=passes,
      drafted_per_row=st.drafted.tolist(),
      accepted_per_row=st.accepted.tolist(),
      acceptance_rate=float(st.accepted.sum() / max(st.drafted.sum(), 1)),
      # Unconditional (as vLLM reports): fraction of the live row-steps that verified drafts in
      # which draft i was accepted (a step verifying fewer than i drafts counts as a miss).
      acceptance_per_position=(acc_at / spec_steps).tolist(),
      # Conditional: accepted at i given a real draft i was verified after i-1 accepts.
      conditional_acceptance_per_position=np.divide(
          acc_at, np.maximum(st.reached_at, 1)).tolist(),
      # tau: tokens emitted per target pass of a live row, counting the bonus/correction token
      # (plain steps, where nothing was drafted, count as passes emitting one token).
      tau=float(st.emitted.sum() / total_row_steps),
      plain_steps=int((hist == 0).sum()),
      k_per_step=hist.tolist(),
      mean_k=float(hist.mean()) if passes else 0.0,
  )


@dataclasses.dataclass
class Failover:
  step: int
  error: str
  action: str = "plain target decoding"


def _short_error(e: BaseException) -> str:
  """The exception's type, first line and (for a runtime error wrapping a traceback) its cause,
  the last line."""
  lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
  if not lines:
    return type(e).__name__
  text = lines[0][:200]
  if len(lines) > 1:
    text += " ... " + lines[-1][:200]
  return f"{type(e).__name__}: {text}"


def _forget_failed_runs(devices) -> None:
  """JAX keeps the runtime token of the last computation with host callbacks on each device and
  waits on it at interpreter exit; the drafter's failed one would print its (already handled)
  error again there. The drafter's devices run nothing more after a failover, so their tokens are
  dropped. A private JAX structure: where it is missing nothing is dropped (only the message)."""
  try:
    from jax._src import dispatch
    tokens = dispatch.runtime_tokens.output_runtime_tokens
  except (ImportError, AttributeError):
    return
  for d in devices:
    tokens.pop(d, None)


class HostRun(SpecRun):
  """The compiled programs of a host-orchestrated generation and its loop: `speculative._Run`'s
  start / loop / stats interface (its cost measurement and statistics are inherited), with
  programs on two meshes instead of one fused loop."""

  def __init__(self, target: Model, drafter: Drafter, placement: Placement, prep, sp_user,
               policy, stops, max_new_tokens: int, key, cost):
    self.target, self.drafter, self.prep, self.policy = target, drafter, prep, policy
    self.placement = placement
    b = prep.tokens.shape[0]
    self.tsh = target.sharding
    self.dsh = ModelSharding(placement.drafter, placement.rules)
    self.tsh.check_batch(b)
    self.dsh.check_batch(b)
    self.max_steps = max_new_tokens + 1
    self.cost = cost
    self.profile_seconds = 0.0
    self.failover: Failover | None = None
    self.tparams = target.params
    self.dparams = place_drafter(drafter, self.dsh)
    self.sp_t = jax.device_put(sp_user.arrays(b), self.tsh.state(sp_user.arrays(b), b))
    self.sp_d = jax.device_put(sp_user.arrays(b), self.dsh.state(sp_user.arrays(b), b))
    self.cost_key = ("host", target.cfg, drafter, b, prep.tokens.shape[1], prep.max_len,
                     policy.buckets, repr(sp_user), self.tsh, self.dsh)
    cfg = StepConfig(lm=LlamaLM(target.cfg), drafter=drafter, policy=policy,
                     max_new_tokens=max_new_tokens, stop_ids=stops, max_len=prep.max_len,
                     max_steps=self.max_steps)
    self.static = static = dict(cfg=cfg)
    tok, lens = jnp.asarray(prep.tokens), jnp.asarray(prep.lengths)
    t0 = time.perf_counter()
    # Target side: the fused loop's prefill, with a stand-in drafter that keeps the prefill's
    # hidden states (when the real drafter reads them) as its state, for the drafter's init.
    self.tinit_args = (self.tparams, None, tok, lens, self.sp_t, as_key(key, b))
    tstatic = dict(cfg=dataclasses.replace(cfg, drafter=host.HiddenOnly(
        drafter.uses_target_hidden, drafter.hidden_layers)))
    tstate0, hid0, fctx0 = jax.eval_shape(functools.partial(host.host_target_init, **tstatic),
                                          *self.tinit_args)
    t_sh = self.tsh.state(tstate0, b)
    rep_t = self.tsh.replicated()
    self.tinit_exe, _ = compiled(
        host.host_target_init, ("host-tinit", self.tsh), *self.tinit_args,
        jit_kwargs=dict(in_shardings=(shardings_of(self.tparams), None, self.tsh.batch(2),
                                      self.tsh.batch(1), self.tsh.state(self.sp_t, b), rep_t),
                        out_shardings=(t_sh, self.tsh.state(hid0, b),
                                       self.tsh.state(fctx0, b))),
        **tstatic)
    # Drafter side: its init from the prompt (and the target's prefill features).
    self.dinit_exe, _ = compiled(
        host.host_drafter_init, ("host-dinit", self.dsh), self.dparams, tok, lens, hid0,
        jit_kwargs=dict(in_shardings=(shardings_of(self.dparams), self.dsh.batch(2),
                                      self.dsh.batch(1), self.dsh.state(hid0, b))),
        drafter=drafter, max_len=prep.max_len)
    self._tok, self._lens = tok, lens
    dstate0 = host.shapes_of(self.dinit_exe.out_info)
    self.costs = costs_array(policy, cost)
    kmax = policy.k_max
    # The drafter's copy of the context, as the verify program returns it.
    ctx0 = DraftContext(seq=tstate0.seq, seq_len=tstate0.seq_len, prompt_len=tstate0.prompt_len)
    d_sh = self.dsh
    ctx_sh = d_sh.state(ctx0, b)
    self.draft_exes = {}
    for k in policy.buckets:
      if k == 0:
        continue
      draft_args = (self.dparams, dstate0, ctx0, tstate0.keys, self.sp_d)
      self.draft_exes[k], _ = compiled(
          host.host_draft, ("host-draft", d_sh), *draft_args,
          jit_kwargs=dict(in_shardings=(shardings_of(self.dparams), d_sh.state(dstate0, b),
                                        ctx_sh, d_sh.batch(1), d_sh.state(self.sp_d, b)),
                          # The drafter's cache is written in place (after a failure it is
                          # not needed again).
                          donate_argnums=(1,)),
          drafter=drafter, k=k, kmax=kmax)
    prop0 = host.shapes_of(self.draft_exes[kmax].out_info[0])
    self.prop_sh_t = self.tsh.state(prop0, b)
    verify_args = (self.tparams, tstate0, prop0, jnp.int32(0), self.sp_t, self.costs,
                   jnp.int32(-1))
    self.verify_exe, _ = compiled(
        host.host_verify, ("host-verify", self.tsh), *verify_args,
        jit_kwargs=dict(in_shardings=(shardings_of(self.tparams), t_sh, self.prop_sh_t, rep_t,
                                      self.tsh.state(self.sp_t, b), rep_t, rep_t),
                        out_shardings=(t_sh, None, rep_t), donate_argnums=(1,)),
        **static)
    ctx_full = host.shapes_of(self.verify_exe.out_info[1])
    self.ctx_sh_d = d_sh.state(ctx_full, b)
    self.commit_exe, _ = compiled(
        host.host_commit, ("host-commit", d_sh), self.dparams, dstate0, ctx_full,
        jit_kwargs=dict(in_shardings=(shardings_of(self.dparams), d_sh.state(dstate0, b),
                                      self.ctx_sh_d), donate_argnums=(1,)),
        drafter=drafter)
    self.prop_zero = jax.device_put(jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), prop0),
                                    self.prop_sh_t)
    self.d_batch1 = d_sh.batch(1)
    self.compile_seconds = time.perf_counter() - t0

  # -- running

  def start(self) -> host.HostState:
    tstate, hidden, first = self.tinit_exe(*self.tinit_args)
    b = self.prep.tokens.shape[0]
    ctx = DraftContext(seq=tstate.seq, seq_len=tstate.seq_len, prompt_len=tstate.prompt_len)
    try:  # the drafter's half: a failure here falls back to plain steps too
      hid_d = jax.device_put(hidden, self.dsh.state(hidden, b))
      dstate = self.dinit_exe(self.dparams, self._tok, self._lens, hid_d)
      dstate = jax.block_until_ready(
          self.commit_exe(self.dparams, dstate, jax.device_put(first, self.ctx_sh_d)))
      ctx = jax.device_put(ctx, self.dsh.state(ctx, b))
    except Exception as e:  # noqa: BLE001 - any failure of the drafter's computation
      self._fail_over(0, e)
      dstate = None
    # idx is chosen below, once the costs are known (timing forces every bucket itself).
    state = host.HostState(t=tstate, d=dstate, ctx=ctx,
                           keys=jax.device_put(tstate.keys, self.d_batch1), idx=jnp.int32(0))
    self._ensure_costs(state, self._loop_for_costs, self.sp_t)
    return dataclasses.replace(state, idx=host.host_choose_jit(state.t, self.costs,
                                                               **self.static))

  def target_state(self, state: host.HostState):
    return state.t

  def short_state(self, state: host.HostState) -> None:
    return None  # two meshes: timed at the prompt's length only

  def _loop_for_costs(self, tparams, dparams, state, sp, costs, until, force_idx):
    # A drafter that fails while the cost model is timed fails over as in the loop: the
    # generation then runs plain steps, and the timings (of plain steps) go unused.
    return self._run(state, int(until), int(force_idx), costs)

  def _fail_over(self, step: int, e: BaseException) -> None:
    """Records the drafter's failure; from now on every step is a plain target step."""
    if self.failover is None:
      self.failover = Failover(step=step, error=_short_error(e))
      _forget_failed_runs(set(self.dsh.mesh.devices.flat) - set(self.tsh.mesh.devices.flat))

  def loop(self, state: host.HostState, until) -> host.HostState:
    return self._run(state, int(until), -1, self.costs)

  def _run(self, state: host.HostState, until: int, force_idx: int, costs):
    force = jnp.int32(force_idx)
    n = int(state.t.stats.target_passes)
    while n < until and not bool(np.asarray(state.t.done).all()):
      if self.failover is not None:
        state = self._plain_step(state, costs)
      else:
        # The bucket is read on the host (the verify that chose it has finished: the drafter's
        # state depends on it), so each draft count runs its own program.
        i = int(state.idx) if force_idx < 0 else force_idx
        k = self.policy.buckets[i]
        idx_t = jnp.int32(i)
        try:
          # The one wait of a step: the verify needs the proposal anyway, and a drafter that
          # failed fails here, before the target has consumed anything.
          if k == 0:
            prop, dstate = self.prop_zero, state.d
          else:
            prop, dstate = jax.block_until_ready(self.draft_exes[k](
                self.dparams, state.d, state.ctx, state.keys, self.sp_d))
        except Exception as e:  # noqa: BLE001 - any failure of the drafter's computation
          self._fail_over(n, e)
          state = self._plain_step(state, costs)
          n += 1
          continue
        prop_t = jax.device_put(prop, self.prop_sh_t)
        tstate, ctx, nxt = self.verify_exe(self.tparams, state.t, prop_t, idx_t, self.sp_t, costs,
                                           force)
        try:  # the commit's dispatch can fail too: the verified tokens are kept either way
          ctx_d = jax.device_put(ctx, self.ctx_sh_d)
          dstate = self.commit_exe(self.dparams, dstate, ctx_d)
        except Exception as e:  # noqa: BLE001 - any failure of the drafter's computation
          self._fail_over(n + 1, e)
          state = dataclasses.replace(state, t=tstate)
          n += 1
          continue
        state = host.HostState(t=tstate, d=dstate,
                               ctx=DraftContext(seq=ctx_d.seq, seq_len=ctx_d.seq_len,
                                                prompt_len=ctx_d.prompt_len),
                               keys=state.keys, idx=nxt)
      n += 1
    return state

  def _plain_step(self, state: host.HostState, costs) -> host.HostState:
    """After a failover: a plain target step, the drafter's half of the state left behind."""
    tstate, _, _ = self.verify_exe(self.tparams, state.t, self.prop_zero, jnp.int32(0), self.sp_t,
                                   costs, jnp.int32(0))
    return dataclasses.replace(state, t=tstate)
