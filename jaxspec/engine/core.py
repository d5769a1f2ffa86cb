"""The `Engine`: what jaxspec keeps between calls on the host (compiled programs, the last call's
cache buffers, drafter weights copied onto a target's mesh, measured cost models, its compiler
options and progress listeners), and the four calls that use it. `DEFAULT` is the one the
public functions of `jaxspec.api` use; `Engine()` is a fresh one (a test's, a benchmark's with
other compiler options).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import gc
import os
import time
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checks import check_int
from jaxspec.decoding import loop
from jaxspec.decoding import plain
from jaxspec.decoding.functional import as_key, check_logprobs
from jaxspec.decoding.plain import DecodeState
from jaxspec.decoding.loop import SpecState
from jaxspec.decoding.score import score
from jaxspec.engine import costs
from jaxspec.engine import io
from jaxspec.engine.runs import SpecRun, placed_run
from jaxspec.models.llama import init_cache
from jaxspec.models.model import Model
from jaxspec.sampling import resolve_sampling
from jaxspec.sharding.rules import place_drafter


@dataclasses.dataclass
class GenerateOutput:
  """What `generate` and `speculative_generate` return. B is the caller's rows: the prompts,
  each repeated n times (prompt-major) with `n=`; a bucket's pad rows never appear.

  Attributes:
    tokens: [B, max_new_tokens] int32 new tokens; -1 past each row's length.
    lengths: [B] number of new tokens per row (a stop token, when hit, is included).
    prompt_lengths: [B] prompt tokens per row.
    texts: decoded new text per row (stop tokens skipped), when the model has a tokenizer
      or one is given (`tokenizer=`).
    stats: timing and, for speculative decoding, acceptance statistics.
    logprobs: [B, max_new_tokens] float32 (with logprobs=True or N) the target's
      log-probability of each new token under the sampling parameters (log_softmax of the
      processed logits; greedy rows unscaled); 0 past each row's length.
    top_ids: [B, max_new_tokens, N] int32 (with logprobs=N) the N most likely tokens of the
      distribution each new token was drawn from (the target's processed one at its position,
      under speculation too), most likely first; -1 past each row's length.
    top_logprobs: [B, max_new_tokens, N] float32 their log-probabilities (-inf for tokens the
      filters drop); 0 past each row's length.
    prompt_logprobs: [B, P] float32 (with prompt_logprobs=True) the log-probability of each
      prompt token given the tokens before it, under the same processing as `logprobs`
      (`jaxspec.decoding.score` of the prompts); 0 at position 0 (no prefix) and past each
      prompt's length, so `.sum(1)` is each prompt's log-likelihood after its first token.
    stop_reasons: [B] (with stop=...) the stop string that ended each row, or None for a row
      that ended otherwise (a stop token, max_new_tokens).
  """

  tokens: np.ndarray
  lengths: np.ndarray
  prompt_lengths: np.ndarray
  texts: list[str] | None = None
  stats: dict[str, Any] = dataclasses.field(default_factory=dict)
  logprobs: np.ndarray | None = None
  top_ids: np.ndarray | None = None
  top_logprobs: np.ndarray | None = None
  prompt_logprobs: np.ndarray | None = None
  stop_reasons: list[str | None] | None = None

  def row(self, b: int) -> list[int]:
    """Row b's new tokens as a list."""
    return self.tokens[b, : self.lengths[b]].tolist()


# An unrolled 30-layer speculative loop for SmolLM2 keeps about 6,000-7,500 memory mappings while
# its executable lives (XLA CPU maps each kernel's code and data), and Linux refuses new mappings
# past vm.max_map_count (default 65,530) with LLVM's "Cannot allocate memory" mid-compilation,
# however much RAM is free. Past this fraction of the limit, the least recently used programs
# are released before compiling another (the rest leaves room for two such loops).
MAP_PRESSURE = 0.75


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


def _over_pressure(usage: tuple[int, int] | None) -> bool:
  return usage is not None and usage[0] > MAP_PRESSURE * usage[1]


# The host wrappers' programs of plain decoding: each row's budget of new tokens ([B] int32:
# the call's max_new_tokens, 0 for the pad rows of a bucketed batch) is an argument and the
# output width (`capacity`) is static, so a batch of 3 or 4 rows and 17 or 20 new tokens run
# one compiled program (`io.bucket_rows`, `io.bucket_new_tokens`).


def generate_program(params, prompt, lengths, sp, key, budget, buffers=None, *, lm, max_len,
                     capacity, stop_ids, logprobs=False, top_logprobs=0):
  """`plain.generate_program` with per-row budgets [B] below a static `capacity`; the last
  output is None, or with `top_logprobs` the (ids, log-probabilities) [B, capacity, n]."""
  s = plain.init_decode(params, prompt, lengths, sp, key, lm, max_len, budget, stop_ids, buffers,
                        capacity=capacity, logprobs=logprobs, top_logprobs=top_logprobs)
  s = plain.decode_loop(params, s, sp, jnp.max(budget), lm, budget, stop_ids)
  return (s.tokens, s.n_out, s.steps, (None if buffers is None else (s.cache.k, s.cache.v)),
          s.logprobs, None if s.top_ids is None else (s.top_ids, s.top_lp))


def stream_init(params, prompt, lengths, sp, key, budget, *, lm, max_len, capacity, stop_ids,
                logprobs=False, top_logprobs=0):
  return plain.init_decode(params, prompt, lengths, sp, key, lm, max_len, budget, stop_ids,
                           capacity=capacity, logprobs=logprobs, top_logprobs=top_logprobs)


def stream_loop(params, s: DecodeState, sp, until, budget, *, lm, stop_ids):
  return plain.decode_loop(params, s, sp, until, lm, budget, stop_ids)


generate_jit = jax.jit(generate_program, donate_argnums=(6,), static_argnames=(
    "lm", "max_len", "capacity", "stop_ids", "logprobs", "top_logprobs"))
stream_init_jit = jax.jit(stream_init, static_argnames=(
    "lm", "max_len", "capacity", "stop_ids", "logprobs", "top_logprobs"))
stream_loop_jit = jax.jit(stream_loop, static_argnames=("lm", "stop_ids"), donate_argnums=(1,))


# What a status line calls each program while it compiles (`Engine.progress`).
_PROGRAMS = {"spec-init": "the prefill", "spec-loop": "the speculative loop",
             "stream-init": "the prefill", "stream-loop": "the decode loop",
             None: "the decode loop", "host-verify": "the target's verify program"}


class Engine:
  """Compiles, keeps and runs the programs of `generate` and `speculative_generate`.

  Everything jaxspec keeps between calls is held here, so a fresh `Engine()` starts from
  nothing and `reset` returns one to that: the compiled programs (least recently used first
  out), the cache buffers of the last call (donated to the next call of the same shapes), the
  drafter weights copied onto a target's mesh, and the cost models measured for "auto".

  Args:
    compiler_options: XLA options for the programs it compiles, by backend name
      ({"cpu": {"xla_cpu_...": ...}}); per program, so a user's own programs and flags are
      untouched. Default: XLA's defaults.
    buckets: pad batches and new-token counts to buckets (`jaxspec.engine.io.bucket_rows`,
      `bucket_new_tokens`), so that a batch of 3 or 4 prompts, or 17 or 20 new tokens, run one
      compiled program (default); False compiles for every exact size. Outputs and statistics
      are the same either way.
    cost_cache: where the cost models measured for "auto" are also kept between processes:
      True (default) `jaxspec.engine.costs.cost_cache_dir()` ($JAXSPEC_COST_CACHE, else beside
      JAX's persistent compilation cache when one is on, else nowhere), False nowhere, or a
      directory.
  """

  def __init__(self, *, compiler_options: Mapping[str, Mapping[str, Any]] | None = None,
               buckets: bool = True, cost_cache: bool | str | os.PathLike = True):
    self.compiler_options = {b: dict(o) for b, o in (compiler_options or {}).items()}
    self.buckets = bool(buckets)
    if cost_cache is None or (isinstance(cost_cache, str) and cost_cache.strip().lower() in (
        "none", "off")):
      cost_cache = False  # as $JAXSPEC_COST_CACHE reads "none" and "off"
    if not isinstance(cost_cache, (bool, str, os.PathLike)) or cost_cache == "":
      raise ValueError(f"cost_cache must be True (the default place), False or None (none), or"
                       f" a directory, got {cost_cache!r}")
    self.cost_cache = cost_cache
    self.programs: collections.OrderedDict[Any, Any] = collections.OrderedDict()
    self.buffers: dict[Any, tuple[jax.Array, jax.Array]] = {}
    self.placed: dict[Any, Any] = {}
    self.cost_models: dict[Any, Any] = {}
    # "auto"'s pooled acceptance (tried, accepted) where the last call of a target, drafter and
    # sampling ended (`AutoK.carry`).
    self.acceptance: dict[Any, tuple[float, float]] = {}
    self.listeners: list[Callable[[str | None], None]] = []
    self.released = 0  # programs released so far (`release_compiled`), for reports
    self.warned_release = False

  def cost_cache_dir(self) -> Path | None:
    """The directory this engine keeps measured cost models in between processes (None: none;
    `cost_cache`)."""
    if self.cost_cache is True:
      return costs.cost_cache_dir()
    return None if self.cost_cache is False else Path(self.cost_cache).expanduser()

  def reset(self) -> None:
    """Drops everything kept in memory (programs, buffers, placed weights, cost models and
    carried acceptance; the cost models on disk stay: `jaxspec.engine.clear_cost_cache`)."""
    self.release_compiled()
    self.release_cache_buffers()
    self.placed.clear()
    self.cost_models.clear()
    self.acceptance.clear()

  # -- compiled programs

  def options(self) -> dict[str, Any]:
    """The XLA options `compile` passes for the default backend (empty: XLA's defaults)."""
    return dict(self.compiler_options.get(jax.default_backend(), {}))

  def compile(self, fn, key_extra, *args, jit_kwargs: dict | None = None, **static):
    """AOT-compiles `fn` for these argument shapes once; returns (executable, compile seconds).

    With `jit_kwargs` (in_shardings, out_shardings, donate_argnums for a sharded model), `fn`
    is the plain function and is jitted with them; `key_extra` must then name the layout (the
    `ModelSharding`), which is part of the cache key.

    The programs are kept for reuse, least recently used first out: when the process nears
    Linux's vm.max_map_count (`MAP_PRESSURE`), older programs are released before compiling
    (`release_compiled`), so a long session that compiles many loops recompiles instead of
    failing.
    """
    leaves, treedef = jax.tree.flatten(args)
    options = self.compiler_options.get(jax.default_backend(), {})
    # An array's devices are part of the key: a program compiled for weights on one device
    # refuses arrays on another (a model copied to a second device compiles its own).
    sig = (fn, key_extra, tuple(sorted(options.items())), treedef,
           tuple((a.shape, str(a.dtype), a.sharding if isinstance(a, jax.Array) else None)
                 if hasattr(a, "shape") else a for a in leaves),
           tuple(sorted(static.items())))
    try:
      hash(sig)
    except TypeError:
      sig = repr(sig)
    if sig in self.programs:
      self.programs.move_to_end(sig)
      return self.programs[sig], 0.0
    self._relieve_map_pressure()
    name = key_extra[0] if isinstance(key_extra, tuple) else key_extra
    self.report("compiling " + _PROGRAMS.get(
        name, f"the {name} program" if isinstance(name, str) else "a program"))
    t0 = time.perf_counter()
    try:
      if jit_kwargs is not None:  # jit with shardings takes no keyword arguments: bind them
        exe = jax.jit(functools.partial(fn, **static), **jit_kwargs).lower(*args).compile(
            compiler_options=options or None)
      else:
        exe = fn.lower(*args, **static).compile(compiler_options=options or None)
    finally:
      self.report(None)
    self.programs[sig] = exe
    return exe, time.perf_counter() - t0

  def release_compiled(self, keep: int = 0) -> int:
    """Drops all but the `keep` most recently used compiled programs, and JAX's own caches
    (which hold the same executables), so their memory and mappings are returned; a later call
    compiles again. Returns the number dropped."""
    check_int("keep", keep, 0, why="the most recently used programs kept")
    n = max(len(self.programs) - keep, 0)
    self.released += n
    for _ in range(n):
      self.programs.popitem(last=False)
    jax.clear_caches()
    gc.collect()
    return n

  def _relieve_map_pressure(self) -> None:
    if not _over_pressure(map_usage()):
      return
    keep, total = len(self.programs) // 2, 0
    while True:
      dropped = self.release_compiled(keep)
      total += dropped
      usage = map_usage()
      if not _over_pressure(usage) or keep == 0:
        break
      keep //= 2
    if _over_pressure(usage):
      warnings.warn(
          f"this process holds {usage[0]} memory mappings of vm.max_map_count={usage[1]} even"
          f" after releasing jaxspec's compiled programs (the last release dropped {dropped});"
          " compiling more may fail with LLVM's 'Cannot allocate memory'. Raise the limit (`sudo"
          " sysctl -w vm.max_map_count=262144`) or drop references to old outputs and"
          " executables.", RuntimeWarning, stacklevel=3)
    elif usage is not None and not self.warned_release:  # once: they compile again when used
      self.warned_release = True
      warnings.warn(
          f"released {total} compiled programs: this process neared vm.max_map_count="
          f"{usage[1]} (XLA CPU maps every kernel of a program); they compile again when next"
          " used. To keep them, raise the limit (`sudo sysctl -w vm.max_map_count=262144`).",
          RuntimeWarning, stacklevel=3)

  # -- kept buffers and weights

  def take_cache_buffers(self, cfg, batch_size: int, max_len: int, params=None
                         ) -> tuple[jax.Array, jax.Array]:
    """(k, v) buffers [L, B, G, max_len, K] for a prefill to donate: the kept ones of the last
    call when the shapes match and they are on the devices of `params` (the weights the
    program reads, when given), else `init_cache`'s zeros (the kept ones are freed first).
    Where sliding-window layers keep rings (`jaxspec.models.llama.ring_size`), L counts the
    full-attention layers only; the window-sized rings are made fresh by
    `LlamaLM.cache_from_buffers`."""
    bufs = self.buffers.pop((cfg, batch_size, max_len, str(cfg.act_dtype)), None)
    self.buffers.clear()
    if (bufs is not None and not any(b.is_deleted() for b in bufs)
        and io.devices_of(params) in (set(), bufs[0].sharding.device_set)):
      return bufs
    cache = init_cache(cfg, batch_size, max_len)
    return cache.k, cache.v

  def keep_cache_buffers(self, cfg, k: jax.Array, v: jax.Array) -> None:
    """Keeps a finished call's cache arrays for the next call of the same shapes."""
    self.buffers.clear()
    self.buffers[(cfg, k.shape[1], k.shape[3], str(k.dtype))] = (k, v)

  def held_bytes(self) -> int:
    """Bytes of the kept cache buffers: the next call reuses or frees them, so its memory check
    counts them as free."""
    return sum(a.nbytes for bufs in self.buffers.values() for a in bufs if not a.is_deleted())

  def _held(self, model, reuses: bool = True) -> int:
    """Bytes of kept cache buffers the next run's memory check may count as free: those it
    reuses (an unsharded jaxspec Model's cache, `take_cache_buffers`); on runs that make their
    own cache (streams of plain decoding, own models, sharded and two-mesh runs) they are freed
    here instead, as counting them free while held would count that memory twice."""
    if reuses and isinstance(model, Model) and io.sharding_of(model) is None:
      return self.held_bytes()
    self.release_cache_buffers()
    return 0

  def release_cache_buffers(self) -> int:
    """Frees the kept cache buffers; returns the bytes released."""
    n = sum(a.nbytes for bufs in self.buffers.values() for a in bufs)
    self.buffers.clear()
    return n

  def place_drafter_params(self, target: Model, drafter):
    """The drafter's weights on the target's mesh, for the fused loop of a sharded target
    (`jaxspec.sharding.rules.place_drafter`), copied once per (drafter weights, mesh) and
    reused."""
    dparams, sh = drafter.params, target.sharding
    if dparams is None or sh is None:
      return dparams
    key = (id(dparams), sh)
    hit = self.placed.get(key)
    if hit is not None and hit[0] is dparams:
      return hit[1]
    placed = place_drafter(drafter, sh)
    if len(self.placed) >= 8:
      self.placed.clear()
    self.placed[key] = (dparams, placed)
    return placed

  # -- progress: what a call is doing while the user waits (compiling, measuring)

  @contextlib.contextmanager
  def progress(self, listener: Callable[[str | None], None]):
    """Calls `listener(phase)` as calls start a slow phase ("compiling the speculative loop",
    "measuring the step cost of each k") and `listener(None)` when it ends, inside the block."""
    self.listeners.append(listener)
    try:
      yield
    finally:
      self.listeners.remove(listener)

  def report(self, phase: str | None) -> None:
    for listener in list(self.listeners):
      listener(phase)

  # -- the calls (`jaxspec.api` documents their arguments)

  def generate(self, model, prompts, *, max_new_tokens: int, sampling=None, key=None,
               stop_ids=None, max_len: int | None = None, temperature: float | None = None,
               logprobs: bool | int = False, prompt_logprobs: bool = False, stop=None,
               tokenizer=None, chat: bool | None = None, prompt_lengths=None,
               n: int = 1) -> GenerateOutput:
    """`jaxspec.generate`: plain decoding of a batch, one compiled program (with stop strings,
    the stream's programs run in chunks of `STOP_CHECK_STEPS`). `model`: a jaxspec `Model` or a
    `Target` of an own `CausalLM`."""
    tgt = io.as_host_target(model)
    io.check_prompt_logprobs(prompt_logprobs)
    tok = io.tokenizer_of(model, tokenizer)
    if temperature is not None:
      sampling = dataclasses.replace(resolve_sampling(sampling), temperature=temperature)
    if stop is not None and check_stop_strings(tok, stop):
      return _last_output(self.generate_stream(
          model, prompts, max_new_tokens=max_new_tokens, chunk=STOP_CHECK_STEPS,
          sampling=sampling, key=key, stop_ids=stop_ids, max_len=max_len, logprobs=logprobs,
          prompt_logprobs=prompt_logprobs, stop=stop, tokenizer=tokenizer, chat=chat,
          prompt_lengths=prompt_lengths, n=n))
    sp_user = resolve_sampling(sampling)
    sh = io.sharding_of(model)
    keep_lp, top_n = check_logprobs(logprobs, tgt.lm.vocab_size)
    prep = io.prepare_prompts(model, prompts, max_new_tokens, max_len=max_len,
                              held=self._held(model), tokenizer=tokenizer, chat=chat,
                              prompt_lengths=prompt_lengths, n=n, bucket=self.buckets,
                              rows_multiple=1 if sh is None else sh.data_size)
    stops = io.stop_ids_for(model, stop_ids)
    b, rows = prep.tokens.shape[0], prep.rows
    args = (tgt.params, jnp.asarray(prep.tokens), jnp.asarray(prep.lengths),
            io.pad_rows(io.sampling_rows(sp_user, prep, tgt.lm.vocab_size, max_new_tokens), b),
            io.pad_rows(as_key(io.key_rows(key, prep), rows), b),
            jnp.asarray(prep.row_budgets(max_new_tokens)))
    static = dict(lm=tgt.lm, max_len=prep.max_len, capacity=prep.capacity,
                  stop_ids=stops, logprobs=keep_lp, top_logprobs=top_n)
    if sh is None:  # a Model's cache in the previous call's buffers (`take_cache_buffers`)
      args += (self.take_cache_buffers(model.cfg, b, prep.max_len, tgt.params)
               if isinstance(model, Model) else None,)
      exe, compile_s = self.compile(generate_jit, None, *args, **static)
    else:  # the weights' mesh: batch rows data-parallel, outputs batch-sharded
      sh.check_batch(b)
      in_sh = io.in_shardings_for(sh, args)
      jit_kwargs = dict(in_shardings=in_sh,
                        out_shardings=(sh.batch(2), sh.batch(1), sh.replicated(), None,
                                       sh.batch(2) if keep_lp else None,
                                       (sh.batch(3), sh.batch(3)) if top_n else None))
      exe, compile_s = self.compile(generate_program, sh, *args, jit_kwargs=jit_kwargs,
                                    **static)
      # Global arrays on the mesh (on several hosts every process passes the same prompts).
      args = io.put_global(args, in_sh)
    t0 = time.perf_counter()
    tokens, n_out, steps, bufs, lp, top = jax.block_until_ready(exe(*args))
    dt = time.perf_counter() - t0
    if bufs is not None:
      self.keep_cache_buffers(model.cfg, *bufs)
    top_ids, top_lp = (None, None) if top is None else top
    tokens, n_out, lp, top_ids, top_lp = _real_rows(
        io.to_host((tokens, n_out, lp, top_ids, top_lp)), rows, max_new_tokens)
    stats = dict(seconds=dt, compile_seconds=compile_s, target_passes=int(steps) + 1,
                 batch_size=rows)
    snap = _Rows(tokens=tokens, lengths=n_out, done=np.ones(rows, bool), steps=int(steps),
                 logprobs=lp, top_ids=top_ids, top_lp=top_lp)
    return _output(tok, prep, snap, stats, None,
                   _prompt_logprobs(tgt, prep, sp_user) if prompt_logprobs else None)

  def generate_stream(self, model, prompts, *, max_new_tokens: int, chunk: int,
                      sampling=None, key=None, stop_ids=None, max_len: int | None = None,
                      logprobs: bool | int = False, prompt_logprobs: bool = False,
                      stop=None, tokenizer=None, chat: bool | None = None, prompt_lengths=None,
                      n: int = 1) -> Iterator[tuple[list[list[int]], dict[str, Any]]]:
    """`jaxspec.generate_stream`: plain decoding, yielding every row's new tokens every `chunk`
    steps."""
    sp_user = resolve_sampling(sampling)
    chunk = io.check_chunk(chunk)
    tgt = io.as_host_target(model)
    io.check_prompt_logprobs(prompt_logprobs)
    keep_lp, top_n = check_logprobs(logprobs, tgt.lm.vocab_size)
    tok = io.tokenizer_of(model, tokenizer)
    stopper = _stopper(tok, stop)
    prep = io.prepare_prompts(model, prompts, max_new_tokens, max_len=max_len,
                              held=self._held(model, reuses=False), tokenizer=tokenizer,
                              chat=chat, prompt_lengths=prompt_lengths, n=n,
                              bucket=self.buckets)
    stops = io.stop_ids_for(model, stop_ids)
    b, rows = prep.tokens.shape[0], prep.rows
    sp = io.pad_rows(io.sampling_rows(sp_user, prep, tgt.lm.vocab_size, max_new_tokens), b)
    budget = jnp.asarray(prep.row_budgets(max_new_tokens))
    init_args = (tgt.params, jnp.asarray(prep.tokens), jnp.asarray(prep.lengths), sp,
                 io.pad_rows(as_key(io.key_rows(key, prep), rows), b), budget)
    init_static = dict(lm=tgt.lm, max_len=prep.max_len, capacity=prep.capacity,
                       stop_ids=stops, logprobs=keep_lp, top_logprobs=top_n)
    init_exe, c1 = self.compile(stream_init_jit, "stream-init", *init_args, **init_static)
    state0 = jax.eval_shape(functools.partial(stream_init_jit, **init_static), *init_args)
    loop_exe, c2 = self.compile(stream_loop_jit, "stream-loop", tgt.params, state0, sp,
                                jnp.int32(0), budget, lm=tgt.lm, stop_ids=stops)
    prompt_lp = _prompt_logprobs(tgt, prep, sp_user) if prompt_logprobs else None
    t0 = time.perf_counter()
    state = jax.block_until_ready(init_exe(*init_args))
    view = functools.partial(_view_decode, rows=rows, width=int(max_new_tokens))
    chunks = _chunks(lambda s, until: loop_exe(tgt.params, s, sp, until, budget), view,
                     _with_done, state, chunk, stopper)
    for new, info in _stream(chunks, t0):
      info["compile_seconds"] = c1 + c2
      info["stats"] = dict(target_passes=info.pop("steps") + 1, batch_size=rows)
      if info["done"].all():
        st = dict(info["stats"], seconds=info["seconds"], compile_seconds=c1 + c2)
        info["output"] = _output(tok, prep, info.pop("rows"), st, stopper, prompt_lp)
      _public(info)
      yield new, info

  def speculative_generate(self, target, drafter, prompts, *, max_new_tokens: int,
                           num_draft_tokens, placement=None, prompt_logprobs: bool = False,
                           stop=None, **options) -> GenerateOutput:
    """`jaxspec.speculative_generate`: the fused loop, or the two-mesh loop of a `Placement`
    (with stop strings, in chunks of `STOP_CHECK_PASSES` verify steps). `options` are
    `io.prepare_spec`'s."""
    io.as_host_target(target)  # the documented ValueError before the tokenizer is read
    io.check_prompt_logprobs(prompt_logprobs)
    tok = io.tokenizer_of(target, options.get("tokenizer"))  # checked before the other options
    stopper = _stopper(tok, stop)
    # Bucketed in the fused loop; a two-mesh run compiles for the exact sizes.
    req = io.prepare_spec(target, drafter, prompts, max_new_tokens=max_new_tokens,
                          num_draft_tokens=num_draft_tokens,
                          held=self._held(target, reuses=placement is None),
                          bucket=self.buckets and placement is None, **options)
    run = SpecRun(self, req) if placement is None else placed_run(self, req, placement)
    prompt_lp = _prompt_logprobs(req.target, req.prep, req.sampling) if prompt_logprobs else None
    if stopper is not None:
      return _last_output(self._spec_chunks(run, req, STOP_CHECK_PASSES, stopper, prompt_lp))
    t0 = time.perf_counter()
    state = run.start()
    state = run.target_state(run.loop(state, run.max_steps))
    outs = jax.block_until_ready(loop.outputs_jit(state, req.prep.capacity))
    dt = time.perf_counter() - t0 - run.cost_seconds
    run.finish(state)
    rows = req.prep.rows
    toks, n_out, lp, top_ids, top_lp = _real_rows(io.to_host(outs), rows, req.max_new_tokens)
    stats = run.stats(state.stats)
    stats.update(seconds=dt)
    snap = _Rows(tokens=toks, lengths=n_out, done=np.ones(len(n_out), bool),
                 steps=stats["target_passes"], logprobs=lp, top_ids=top_ids, top_lp=top_lp)
    return _output(req.tokenizer, req.prep, snap, stats, None, prompt_lp)

  def speculative_stream(self, target, drafter, prompts, *, max_new_tokens: int,
                         num_draft_tokens, chunk: int, prompt_logprobs: bool = False, stop=None,
                         **options):
    """`jaxspec.speculative_stream`: the fused loop run in chunks of `chunk` verify steps,
    yielding every row's new tokens. `options` are `io.prepare_spec`'s."""
    chunk = io.check_chunk(chunk)
    io.as_host_target(target)
    io.check_prompt_logprobs(prompt_logprobs)
    tok = io.tokenizer_of(target, options.get("tokenizer"))  # checked before the other options
    stopper = _stopper(tok, stop)
    req = io.prepare_spec(target, drafter, prompts, max_new_tokens=max_new_tokens,
                          num_draft_tokens=num_draft_tokens, held=self._held(target),
                          bucket=self.buckets, **options)
    run = SpecRun(self, req)
    prompt_lp = _prompt_logprobs(req.target, req.prep, req.sampling) if prompt_logprobs else None
    return self._spec_chunks(run, req, chunk, stopper, prompt_lp)

  def _spec_chunks(self, run: SpecRun, req, chunk: int, stopper: _StopStrings | None,
                   prompt_lp):
    """A speculative run (fused or two-mesh) in chunks of `chunk` verify steps: `_stream`'s
    yields, each with the statistics so far, the last with the call's `GenerateOutput`."""
    rows, width = req.prep.rows, req.max_new_tokens

    def view(state) -> _Rows:
      s = run.target_state(state)
      toks, n_out, lp, top_ids, top_lp, done = _real_rows(io.to_host(
          (*loop.outputs_jit(s, req.prep.capacity), s.done)), rows, width)
      return _Rows(tokens=toks, lengths=n_out, done=done,
                   steps=int(io.to_host(s.stats.target_passes)), logprobs=lp, top_ids=top_ids,
                   top_lp=top_lp)

    def with_done(state, done):
      if isinstance(state, SpecState):
        return _with_done(state, done)
      return dataclasses.replace(state, t=_with_done(state.t, done))  # a two-mesh HostState

    t0 = time.perf_counter()
    state = jax.block_until_ready(run.start())
    t0 += run.cost_seconds
    for new, info in _stream(_chunks(run.loop, view, with_done, state, chunk, stopper), t0):
      state = info.pop("state")
      info["stats"] = run.stats(run.target_state(state).stats)
      info.pop("steps")
      info["compile_seconds"] = run.compile_seconds
      info["cost_seconds"] = run.cost_seconds
      info["cost_source"] = run.cost_source
      if info["done"].all():
        run.finish(run.target_state(state))
        st = dict(info["stats"], seconds=info["seconds"])
        info["output"] = _output(req.tokenizer, req.prep, info.pop("rows"), st, stopper,
                                 prompt_lp)
      _public(info)
      yield new, info


# Steps between the host's checks of stop strings (`generate` and `speculative_generate` with
# stop=...): each check is one round trip and a decode of the rows' text, so a row runs at most
# this many steps past its stop string.
STOP_CHECK_STEPS = 16
STOP_CHECK_PASSES = 8


@dataclasses.dataclass
class _Rows:
  """Host copies of every row's new tokens so far (and what rides with them)."""

  tokens: np.ndarray  # [B, W] int32, -1 past each row's length
  lengths: np.ndarray  # [B]
  done: np.ndarray  # [B] bool: the row emits nothing more
  steps: int  # target passes after the prefill
  logprobs: np.ndarray | None = None  # [B, W]
  top_ids: np.ndarray | None = None  # [B, W, N]
  top_lp: np.ndarray | None = None  # [B, W, N]

  def __post_init__(self):  # writable copies (`cut`), not read-only views of device arrays
    for f in ("tokens", "lengths", "done", "logprobs", "top_ids", "top_lp"):
      if getattr(self, f) is not None:
        setattr(self, f, np.array(getattr(self, f)))

  def cut(self, b: int, n: int) -> None:
    """Row b ends after its first n new tokens."""
    self.lengths[b] = n
    self.tokens[b, n:] = -1
    if self.logprobs is not None:
      self.logprobs[b, n:] = 0.0
    if self.top_ids is not None:
      self.top_ids[b, n:] = -1
      self.top_lp[b, n:] = 0.0


class _StopStrings:
  """Stop strings matched in each row's decoded text between chunks of the loop.

  A row stops at the first token whose text (the decoding of the row's new tokens up to and
  including it) holds a stop string: its tokens end with that token, its text ends before the
  stop string's first occurrence. Only rows with new tokens since the last check are decoded.
  """

  def __init__(self, tokenizer, stops: tuple[str, ...]):
    self.tokenizer, self.stops = tokenizer, stops
    self.checked: np.ndarray | None = None  # [B] leading tokens known to hold no stop string
    self.ends: np.ndarray | None = None  # [B] tokens kept by a stopped row, -1: not stopped
    self.texts: list[str | None] = []
    self.reasons: list[str | None] = []

  def _find(self, ids: list[int]) -> tuple[str, int, str] | None:
    text = io.decode_text(self.tokenizer, ids)  # as the output's text: no special tokens
    hits = [(text.find(s), i) for i, s in enumerate(self.stops) if s in text]
    if not hits:
      return None
    pos, i = min(hits)
    return text, pos, self.stops[i]

  def apply(self, rows: _Rows) -> _Rows:
    """Finds the rows that reached a stop string and cuts them (every stopped row's tokens end
    with the one that completed its stop string); marks them done."""
    b = len(rows.lengths)
    if self.checked is None:
      self.checked, self.ends = np.zeros(b, np.int64), np.full(b, -1, np.int64)
      self.texts, self.reasons = [None] * b, [None] * b
    for r in range(b):
      n = int(rows.lengths[r])
      if self.ends[r] < 0 and n > self.checked[r]:
        ids = rows.tokens[r, :n].tolist()
        if self._find(ids) is not None:
          # The first token that completes one: each shorter prefix is decoded, from the
          # tokens known clean (a stop string may span tokens).
          for j in range(int(self.checked[r]) + 1, n + 1):
            hit = self._find(ids[:j])
            if hit is not None:
              self.ends[r], self.texts[r], self.reasons[r] = j, hit[0][:hit[1]], hit[2]
              break
        self.checked[r] = n
      if self.ends[r] >= 0:
        rows.cut(r, int(self.ends[r]))
    rows.done = rows.done | (self.ends >= 0)
    return rows


def check_stop_strings(tokenizer, stop) -> tuple[str, ...]:
  """Stop strings as a tuple (None: none; one string: that one). Raises ValueError for anything
  but non-empty strings, and for stop strings without a `tokenizer` (the call's, `io.tokenizer_of`:
  they are matched in the decoded text)."""
  if stop is None:
    return ()
  if isinstance(stop, str):
    stop = (stop,)
  if not isinstance(stop, (list, tuple)) or not all(isinstance(x, str) for x in stop):
    raise ValueError(f"stop must be a string or a list of strings (matched in the decoded text),"
                     f" got {stop!r}: for token ids use stop_ids=[...]")
  if any(x == "" for x in stop):
    raise ValueError("stop strings must be non-empty (an empty one would stop every row at"
                     " once): drop it from stop=")
  if stop and tokenizer is None:
    raise ValueError("stop strings are matched in the decoded text, but the model has no"
                     " tokenizer: pass stop_ids=[...] (token ids) instead, or a tokenizer"
                     " (tokenizer=..., or a model with one)")
  return tuple(stop)


def _stopper(tokenizer, stop) -> _StopStrings | None:
  """The matcher of the stop strings `stop`; None without any (their checks are not entered)."""
  if stop is None:
    return None
  stops = check_stop_strings(tokenizer, stop)
  return _StopStrings(tokenizer, stops) if stops else None


def _with_done(state, done: np.ndarray):
  """The loop's state with the caller's rows `done` marked finished (the loop stops growing
  them), the new flags laid out as the old ones; a bucket's pad rows past them keep theirs."""
  flags = np.array(io.to_host(state.done))
  flags[:len(done)] = done
  return dataclasses.replace(state, done=jax.device_put(flags, state.done.sharding))


def _chunks(step_fn: Callable, view: Callable[[Any], _Rows], with_done: Callable, state,
            chunk: int, stopper: _StopStrings | None):
  """Runs the loop `chunk` steps at a time; yields (state, rows) after the prefill and after
  every chunk, until every row is done. Rows that reach a stop string are cut and marked done on
  device, so the loop ends as soon as every row has stopped."""
  while True:
    rows = view(state)
    if stopper is not None:
      before = rows.done.copy()
      rows = stopper.apply(rows)
      if (rows.done & ~before).any():
        state = with_done(state, rows.done)
    yield state, rows
    if rows.done.all():
      return
    until = min(rows.steps + chunk, 2**31 - 1)  # a chunk past int32 runs to the end
    state = jax.block_until_ready(step_fn(state, jnp.int32(until)))


def _stream(chunks, t0: float):
  """Yields (every row's newly emitted tokens, info) for each of `chunks`' (state, rows): info
  holds the timings, the rows' flags and the new tokens' log-probabilities, and (for the
  caller, which removes them) the state, the step count and the rows."""
  emitted = None
  first_s = None
  for state, rows in chunks:
    if first_s is None:
      first_s = time.perf_counter() - t0
      emitted = np.zeros(len(rows.lengths), np.int64)
    n = rows.lengths.astype(np.int64)
    sl = [slice(int(a), int(e)) for a, e in zip(emitted, n)]
    new = [rows.tokens[r, sl[r]].tolist() for r in range(len(sl))]
    info = dict(first_chunk_seconds=first_s, seconds=time.perf_counter() - t0,
                done=rows.done.copy(), state=state, steps=rows.steps, rows=rows)
    if rows.logprobs is not None:
      info["logprobs"] = [rows.logprobs[r, sl[r]].tolist() for r in range(len(sl))]
    if rows.top_ids is not None:
      info["top_ids"] = [rows.top_ids[r, sl[r]].tolist() for r in range(len(sl))]
      info["top_logprobs"] = [rows.top_lp[r, sl[r]].tolist() for r in range(len(sl))]
    emitted = n
    yield new, info


# What a stream's info holds (`jaxspec.api.generate_stream` documents them).
STREAM_INFO = ("first_chunk_seconds", "seconds", "compile_seconds", "cost_seconds", "cost_source",
               "done", "stats", "logprobs", "top_ids", "top_logprobs", "output")


def _public(info: dict) -> None:
  """Drops everything but the documented fields (`STREAM_INFO`); `done` as a list."""
  for k in list(info):
    if k not in STREAM_INFO:
      del info[k]
  info["done"] = info["done"].tolist()


def _last_output(stream) -> GenerateOutput:
  info = {}
  for _, info in stream:
    pass
  return info["output"]


def _real_rows(outs, rows: int, width: int):
  """The caller's rows and new-token columns of a bucketed program's per-row outputs (tokens,
  counts, log-probabilities, top-N; None stays None)."""
  return tuple(None if x is None else x[:rows, :width] if x.ndim >= 2 else x[:rows]
               for x in outs)


def _view_decode(s: DecodeState, *, rows: int, width: int) -> _Rows:
  """The caller's `rows` and `width` new-token columns of a (bucketed) plain decoding state."""
  toks, n_out, done, lp, top_ids, top_lp = _real_rows(io.to_host(
      (s.tokens, s.n_out, s.done, s.logprobs, s.top_ids, s.top_lp)), rows, width)
  steps = io.to_host(s.steps)
  valid = np.arange(toks.shape[1])[None, :] < n_out[:, None]
  return _Rows(tokens=np.where(valid, toks, -1), lengths=n_out, done=done, steps=int(steps),
               logprobs=None if lp is None else np.where(valid, lp, 0.0),
               top_ids=None if top_ids is None else np.where(valid[:, :, None], top_ids, -1),
               top_lp=None if top_lp is None else np.where(valid[:, :, None], top_lp, 0.0))


def _prompt_logprobs(model, prep, sampling) -> np.ndarray:
  """[B, P] each prompt token's log-probability given the tokens before it, under the call's
  processing (`score`: one forward pass over the caller's rows, a bucket's pad rows left out);
  0 at position 0 and past a row's length. `model`: a jaxspec Model or a Target."""
  b = prep.rows
  lengths = prep.lengths[:b]
  p = int(lengths.max())  # the padding past the longest is not
  tgt = io.as_host_target(model)
  return np.asarray(score(tgt, jnp.asarray(prep.tokens[:b, :p]), jnp.asarray(lengths),
                          sampling=io.sampling_rows(sampling, prep, tgt.lm.vocab_size),
                          prompt_lengths=jnp.ones((b,), jnp.int32)))


def _output(tokenizer, prep, rows: _Rows, stats: dict, stopper: _StopStrings | None,
            prompt_lp) -> GenerateOutput:
  """The call's `GenerateOutput` from its rows (the caller's, cut at stop strings already), with
  the token counts and rate added to `stats`; texts decoded with `tokenizer` (None: none)."""
  new = int(rows.lengths.sum())
  dt = stats["seconds"]
  stats.update(new_tokens=new, tokens_per_second=new / dt if dt > 0 else float("inf"))
  texts = None if tokenizer is None else io.decode_texts(tokenizer, rows.tokens, rows.lengths)
  reasons = None
  if stopper is not None:
    reasons = list(stopper.reasons)
    texts = [t if cut is None else cut for t, cut in zip(texts, stopper.texts)]
  return GenerateOutput(tokens=rows.tokens, lengths=rows.lengths,
                        prompt_lengths=prep.lengths[:len(rows.lengths)],
                        texts=texts, stats=stats, logprobs=rows.logprobs, top_ids=rows.top_ids,
                        top_logprobs=rows.top_lp, prompt_logprobs=prompt_lp,
                        stop_reasons=reasons)


DEFAULT = Engine()  # the engine of `jaxspec.api`'s functions


def release_compiled(keep: int = 0) -> int:
  """Drops all but the `keep` most recently used compiled programs of the default engine, and
  JAX's own caches (which hold the same executables), so their memory and mappings are
  returned; a later call compiles again. Returns the number dropped."""
  return DEFAULT.release_compiled(keep)


def release_cache_buffers() -> int:
  """Frees the default engine's kept cache buffers; returns the bytes released."""
  return DEFAULT.release_cache_buffers()


def programs_released() -> int:
  """How many compiled programs the default engine has released so far (`release_compiled`)."""
  return DEFAULT.released


def progress(listener: Callable[[str | None], None]):
  """`Engine.progress` of the default engine: `listener(phase)` as its calls start a slow phase
  and `listener(None)` as it ends, inside the block."""
  return DEFAULT.progress(listener)
