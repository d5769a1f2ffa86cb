"""Plain autoregressive decoding: the baseline every speculative number is measured against.

`generate` is one `jax.jit` around prefill plus a `lax.while_loop` over decode steps, so no
token goes back to the host until the whole batch is done. `generate_stream` runs the same
prefill and loop body in chunks of steps for interactive printing.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import gc
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxspec import sampling as sampling_lib
from jaxspec.models.config import LlamaConfig
from jaxspec.models.llama import KVCache, forward, init_cache, logits_from_hidden
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling, SamplingArrays


from jaxspec.pytree import pytree_dataclass as _pytree  # noqa: E402


@dataclasses.dataclass
class GenerateOutput:
  """What `generate` and `speculative_generate` return.

  Attributes:
    tokens: [B, max_new_tokens] int32 new tokens; -1 past each row's length.
    lengths: [B] number of new tokens per row (a stop token, when hit, is included).
    prompt_lengths: [B] prompt tokens per row.
    texts: decoded new text per row (stop tokens skipped), when the model has a tokenizer.
    stats: timing and, for speculative decoding, acceptance statistics.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  prompt_lengths: np.ndarray
  texts: list[str] | None = None
  stats: dict[str, Any] = dataclasses.field(default_factory=dict)

  def row(self, b: int) -> list[int]:
    """Row b's new tokens as a list."""
    return self.tokens[b, : self.lengths[b]].tolist()


@_pytree
@dataclasses.dataclass
class DecodeState:
  """The `lax.while_loop` state of plain decoding."""

  tokens: jax.Array  # [B, N] int32 output buffer (-1 = empty)
  n_out: jax.Array  # [B] int32 tokens emitted per row
  done: jax.Array  # [B] bool
  last: jax.Array  # [B] int32 last emitted token, the next forward's input
  cache: KVCache
  keys: jax.Array  # [B] per-row PRNG keys
  steps: jax.Array  # [] int32 decode forward passes so far


# ----------------------------------------------------------------------------------------------
# Input preparation (shared with speculative decoding).


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
  if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
    prompts = [list(r) for r in prompts]
  if not isinstance(prompts, Sequence) or len(prompts) == 0:
    raise ValueError("prompts must be a non-empty list of strings or of token-id lists")
  rows = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if model.tokenizer is None:
        raise ValueError(f"prompt {i} is a string but the model has no tokenizer: pass token ids")
      p = model.tokenizer.encode(p)
    p = [int(t) for t in np.asarray(p).reshape(-1)]
    if not p:
      raise ValueError(f"prompt {i} is empty: every row needs at least one token to condition on")
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
  check_cache_fits(model.cfg, len(rows), int(max_len))
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
  if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, (Sequence, np.ndarray)):
    raise ValueError(f"stop_ids must be a list of token ids, got {type(stop_ids).__name__}")
  out = []
  for t in stop_ids:
    if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not 0 <= t < 2**31:
      raise ValueError(f"stop_ids must be token ids in [0, 2**31), got {t!r}")
    out.append(int(t))
  return tuple(out)


# The largest cache, in positions per row, that any call may ask for: far beyond any model's
# context, still a shape XLA accepts (its shape checks abort the process on overflow).
MAX_POSITIONS = 2**24


def _memory_budget() -> int | None:
  """Bytes the default device may hold: its allocator's limit where it reports one (GPUs,
  TPUs), the host's physical memory for the CPU; None where unknown."""
  try:
    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
      return int(stats["bytes_limit"])
  except Exception:  # noqa: BLE001 - backends without memory stats
    pass
  try:
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def check_cache_fits(cfg: LlamaConfig, batch: int, max_len: int) -> None:
  """Raises ValueError (before anything compiles) when a [batch, max_len] KV cache cannot be
  held: past `MAX_POSITIONS` positions, or larger than the device's memory."""
  if max_len > MAX_POSITIONS:
    raise ValueError(f"a cache of {max_len} positions per row is past jaxspec's limit of"
                     f" {MAX_POSITIONS}: lower max_new_tokens or max_len")
  need = 2 * cfg.num_layers * batch * cfg.num_kv_heads * max_len * cfg.head_dim \
      * cfg.jnp_dtype.itemsize
  budget = _memory_budget()
  if budget is not None and need > budget:
    raise ValueError(f"the KV cache for {batch} rows of {max_len} positions needs"
                     f" {need / 2**30:.1f} GiB, more than the device's {budget / 2**30:.1f} GiB:"
                     " lower max_new_tokens, max_len or the batch")


def is_stop(tokens: jax.Array, stop_ids: tuple[int, ...]) -> jax.Array:
  if not stop_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.isin(tokens, jnp.array(stop_ids, jnp.int32))


def prefill(params, prompt: jax.Array, lengths: jax.Array, cfg: LlamaConfig, max_len: int,
            *, hidden_layers: tuple[int, ...] = (), logits: bool = True,
            buffers: tuple[jax.Array, jax.Array] | None = None):
  """Runs the prompt [B, P] through the model; returns (last logits [B, V], Hidden, cache).

  Padding positions are written but the cache length is set to each row's prompt length, so
  they are rolled back. The LM head runs only on each row's last prompt position (and not at
  all with logits=False, which returns None for them).

  With `buffers` (k, v) [L, B, G, max_len, K] (a donated earlier cache, `take_cache_buffers`)
  the prompt's keys and values are written into them in place and nothing else of them is
  read: every read of a cache is masked to positions below the row's length.
  """
  b = prompt.shape[0]
  if buffers is None:
    cache = init_cache(cfg, b, max_len)
  else:
    cache = KVCache(k=buffers[0], v=buffers[1], length=jnp.zeros((b,), jnp.int32))
  _, hidden, cache = forward(params, prompt, cache, cfg, logits=False, hidden_layers=hidden_layers,
                            fresh=True)
  last = jnp.take_along_axis(hidden.final, (lengths - 1)[:, None, None], axis=1)[:, 0]
  cache = dataclasses.replace(cache, length=lengths)
  return (logits_from_hidden(params, last) if logits else None), hidden, cache


# ----------------------------------------------------------------------------------------------
# A reused cache buffer.
#
# A cache that a program allocates is filled with zeros and its pages are faulted in on first
# touch at every call: at batch 64 and 256 positions SmolLM2's cache is 755 MB, and a prefill
# into a fresh one took 0.9 s longer (21.6 against 20.7 s on the 2-core AMD EPYC VM) than one
# into the buffers of the previous call, donated, where only the prompt's entries are written. So
# `generate` and `speculative_generate` (unsharded) hand their final cache back here and the
# next call of the same shapes prefills into it. Only the most recent call's buffers are kept
# (a call of other shapes frees them before allocating its own), so between calls this holds
# at most one cache; `release_cache_buffers()` frees it.

_CACHE_POOL: dict[Any, tuple[jax.Array, jax.Array]] = {}


def _pool_key(cfg: LlamaConfig, batch_size: int, max_len: int, dtype) -> tuple:
  return (cfg, batch_size, max_len, str(dtype))


def take_cache_buffers(cfg: LlamaConfig, batch_size: int,
                       max_len: int) -> tuple[jax.Array, jax.Array]:
  """(k, v) buffers [L, B, G, max_len, K] for a prefill to donate: the kept ones of the last
  call when the shapes match, else `init_cache`'s zeros (the kept ones are freed first)."""
  bufs = _CACHE_POOL.pop(_pool_key(cfg, batch_size, max_len, cfg.jnp_dtype), None)
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


# ----------------------------------------------------------------------------------------------
# The jitted loop.


def _init_state(params, prompt, lengths, sp, key, cfg, max_len, max_new_tokens, stop_ids,
                buffers=None):
  b = prompt.shape[0]
  logits, _, cache = prefill(params, prompt, lengths, cfg, max_len, buffers=buffers)
  keys = sampling_lib.row_keys(key, b)
  first = sampling_lib.sample(jax.vmap(jax.random.fold_in)(keys, jnp.zeros(b, jnp.int32)),
                              logits, sp)
  tokens = jnp.full((b, max_new_tokens), -1, jnp.int32).at[:, 0].set(first)
  done = is_stop(first, stop_ids) | (max_new_tokens <= 1)
  return DecodeState(tokens=tokens, n_out=jnp.ones((b,), jnp.int32), done=done, last=first,
                     cache=cache, keys=keys, steps=jnp.zeros((), jnp.int32))


def _decode_step(params, s: DecodeState, sp: SamplingArrays, cfg, max_new_tokens, stop_ids):
  logits, _, cache = forward(params, s.last[:, None], s.cache, cfg)
  tok = sampling_lib.sample(jax.vmap(jax.random.fold_in)(s.keys, s.n_out), logits[:, 0], sp)
  live = ~s.done
  rows = jnp.arange(tok.shape[0])
  tokens = s.tokens.at[rows, jnp.where(live, s.n_out, max_new_tokens)].set(tok, mode="drop")
  n_out = s.n_out + live
  length = jnp.where(live, cache.length, s.cache.length)  # finished rows stop growing
  cache = dataclasses.replace(cache, length=length)
  full = length + 1 > cache.max_len
  done = s.done | (live & is_stop(tok, stop_ids)) | (n_out >= max_new_tokens) | full
  return DecodeState(tokens=tokens, n_out=n_out, done=done, last=jnp.where(live, tok, s.last),
                     cache=cache, keys=s.keys, steps=s.steps + 1)


def _decode_loop(params, s: DecodeState, sp, until, cfg, max_new_tokens, stop_ids):
  """Decodes until every row is done or `until` steps ([] int32, traced) have run."""
  return lax.while_loop(
      lambda s: jnp.any(~s.done) & (s.steps < until),
      lambda s: _decode_step(params, s, sp, cfg, max_new_tokens, stop_ids), s)


def _generate_fn(params, prompt, lengths, sp, key, buffers=None, *, cfg, max_len,
                 max_new_tokens, stop_ids):
  """Prefill and decode loop in one program; with `buffers` (donated, `take_cache_buffers`)
  the cache lives in them and comes back as the last output, for the next call."""
  s = _init_state(params, prompt, lengths, sp, key, cfg, max_len, max_new_tokens, stop_ids,
                  buffers)
  s = _decode_loop(params, s, sp, jnp.int32(max_new_tokens), cfg, max_new_tokens, stop_ids)
  return s.tokens, s.n_out, s.steps, (None if buffers is None else (s.cache.k, s.cache.v))


_generate_jit = jax.jit(_generate_fn, static_argnames=("cfg", "max_len", "max_new_tokens",
                                                       "stop_ids"), donate_argnums=(5,))


_prefill_jit = jax.jit(_init_state, static_argnums=(5, 6, 7, 8))
_decode_jit = jax.jit(_decode_loop, static_argnums=(4, 5, 6), donate_argnums=(1,))


# ----------------------------------------------------------------------------------------------
# Compilation cache with compile timing.

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
  t0 = time.perf_counter()
  if jit_kwargs is not None:  # jit with shardings takes no keyword arguments: bind them
    exe = jax.jit(functools.partial(fn, **static), **jit_kwargs).lower(*args).compile(
        compiler_options=options or None)
  else:
    exe = fn.lower(*args, **static).compile(compiler_options=options or None)
  dt = time.perf_counter() - t0
  _COMPILED[sig] = exe
  return exe, dt


def _resolve_sampling(sampling) -> Sampling:
  if sampling is None:
    return sampling_lib.GREEDY
  if isinstance(sampling, dict):
    return Sampling(**sampling)
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a jaxspec.Sampling, got {type(sampling).__name__}")
  return sampling


def decode_texts(model: Model, tokens: np.ndarray, lengths: np.ndarray) -> list[str] | None:
  if model.tokenizer is None:
    return None
  return [model.tokenizer.decode(tokens[b, : lengths[b]].tolist()) for b in range(len(lengths))]


def generate(model: Model, prompts, *, max_new_tokens: int = 128,
             sampling: Sampling | None = None, key: jax.Array | int | None = None,
             stop_ids: Sequence[int] | None = None, max_len: int | None = None,
             temperature: float | None = None) -> GenerateOutput:
  """Plain autoregressive decoding of a batch of prompts, entirely on device.

  Args:
    model: a loaded `Model` (see `jaxspec.models.load`).
    prompts: a string, list of strings, or list of token-id lists (rows may differ in length).
    max_new_tokens: tokens to generate per row.
    sampling: `Sampling(temperature, top_k, top_p, min_p)`; default greedy. Values are passed as
      arrays, so changing them does not recompile.
    key: PRNG key or int seed for sampling (row b's randomness depends only on key and b).
    stop_ids: tokens that end a row (included in the output); default the model's EOS ids.
    max_len: KV-cache size; default just enough for the longest prompt plus max_new_tokens.
    temperature: shorthand for `sampling=Sampling(temperature=...)`.
  Returns:
    `GenerateOutput` with tokens [B, max_new_tokens], lengths [B], texts and stats (seconds,
    compile seconds, tokens/s).
  """
  if temperature is not None:
    sampling = dataclasses.replace(_resolve_sampling(sampling), temperature=temperature)
  sp_user = _resolve_sampling(sampling)
  prep = prepare_prompts(model, prompts, max_new_tokens, max_len=max_len)
  stops = stop_ids_for(model, stop_ids)
  b = prep.tokens.shape[0]
  key = _as_key(key)
  args = (model.params, jnp.asarray(prep.tokens), jnp.asarray(prep.lengths),
          sp_user.arrays(b), key)
  static = dict(cfg=model.cfg, max_len=prep.max_len, max_new_tokens=int(max_new_tokens),
                stop_ids=stops)
  sh = model.sharding
  if sh is None:  # the cache in the previous call's buffers (`take_cache_buffers`)
    args += (take_cache_buffers(model.cfg, b, prep.max_len),)
    exe, compile_s = compiled(_generate_jit, None, *args, **static)
  else:  # the weights' mesh: batch rows data-parallel, outputs batch-sharded
    sh.check_batch(b)
    in_sh = in_shardings_for(sh, args)
    jit_kwargs = dict(in_shardings=in_sh,
                      out_shardings=(sh.batch(2), sh.batch(1), sh.replicated(), None))
    exe, compile_s = compiled(_generate_fn, sh, *args, jit_kwargs=jit_kwargs, **static)
    # Global arrays on the mesh (on several hosts every process passes the same prompts).
    args = put_global(args, in_sh)
  t0 = time.perf_counter()
  tokens, n_out, steps, bufs = jax.block_until_ready(exe(*args))
  dt = time.perf_counter() - t0
  if bufs is not None:
    keep_cache_buffers(model.cfg, *bufs)
  tokens, n_out = to_host((tokens, n_out))
  new = int(n_out.sum())
  stats = dict(seconds=dt, compile_seconds=compile_s, new_tokens=new,
               tokens_per_second=new / dt if dt > 0 else float("inf"),
               target_passes=int(steps) + 1, batch_size=b)
  return GenerateOutput(tokens=tokens, lengths=n_out, prompt_lengths=prep.lengths,
                        texts=decode_texts(model, tokens, n_out), stats=stats)


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


def _as_key(key) -> jax.Array:
  """A PRNG key from None (seed 0), an integer seed or a key (typed, or a raw uint32 [2])."""
  if key is None:
    return jax.random.key(0)
  if isinstance(key, (int, np.integer)) and not isinstance(key, bool):
    if not -2**63 <= int(key) < 2**64:
      raise ValueError(f"key must be a PRNG key or an integer seed in [-2**63, 2**64), got {key}")
    # jax.random.key takes an int64: a seed in [2**63, 2**64) as its two's complement.
    return jax.random.key(int(key) - 2**64 if int(key) >= 2**63 else int(key))
  if isinstance(key, jax.Array) and (jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
                                     and key.shape == ()):
    return key
  if isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 and key.shape == (2,):
    return jax.random.wrap_key_data(jnp.asarray(key))
  raise ValueError(f"key must be an integer seed or a single PRNG key (jax.random.key(seed)),"
                   f" got {type(key).__name__}{getattr(key, 'shape', '')}")


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


def generate_stream(model: Model, prompt, *, max_new_tokens: int = 128,
                    sampling: Sampling | None = None, key=None,
                    stop_ids: Sequence[int] | None = None, chunk: int = 8,
                    ) -> Iterator[tuple[list[int], dict[str, Any]]]:
  """Plain decoding of one batch, yielding (new tokens of row 0, stats) every `chunk` steps.

  The loop runs on device between yields (a `lax.while_loop` bounded by a traced step count), so
  streaming costs one host round-trip per chunk, not per token.
  """
  sp_user = _resolve_sampling(sampling)
  chunk = check_chunk(chunk)
  prep = prepare_prompts(model, prompt, max_new_tokens)
  stops = stop_ids_for(model, stop_ids)
  b = prep.tokens.shape[0]
  sp = sp_user.arrays(b)
  init_args = (model.params, jnp.asarray(prep.tokens), jnp.asarray(prep.lengths), sp,
               _as_key(key), model.cfg, prep.max_len, int(max_new_tokens), stops)
  init_exe, c1 = compiled(_prefill_jit, "stream-init", *init_args)
  state0 = jax.eval_shape(_prefill_jit, *init_args)
  loop_exe, c2 = compiled(_decode_jit, "stream-loop", model.params, state0, sp, jnp.int32(0),
                          model.cfg, int(max_new_tokens), stops)
  t0 = time.perf_counter()
  state = jax.block_until_ready(init_exe(*init_args[:5]))
  for new, info in _stream_loop(lambda s, until: loop_exe(model.params, s, sp, until),
                                _view_decode, state, chunk, t0):
    info["compile_seconds"] = c1 + c2
    yield new, info


def _stream_loop(step_fn: Callable, view: Callable, state, chunk: int, t0: float):
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


def _view_decode(s: DecodeState):
  n = int(np.asarray(s.n_out)[0])
  return np.asarray(s.tokens)[0, :n], bool(np.asarray(s.done).all()), int(s.steps)
