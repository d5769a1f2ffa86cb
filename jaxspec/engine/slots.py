"""Continuous batching for plain decoding: a fixed batch of slots, each running its own job.

`jaxspec.generate` steps a batch until its longest row ends, so a batch of answers of very
different lengths spends most of its steps on rows that are already done. A `SlotDecoder` keeps
S slots busy instead (vLLM's continuous batching, without paging): the host gives a free slot a
job (tokens to append to the slot's cache, a sampling temperature and top-p, a budget of new
tokens, a PRNG key), the compiled decode loop steps every slot and returns to the host once a
few slots have finished, and the host reads their tokens and gives them new jobs.

A slot's cache outlives its job: a job either starts the slot afresh (`reset`) or appends to
what the slot already holds, so a conversation's next turn costs its new tokens, not a prefill
of the whole conversation. The job's first token is sampled from the appended tokens' last
position, the rest by `plain.decode_step` with the slot's own key folded with the token's
index, as `jaxspec.generate` samples a row: a job given row j's key of `generate`'s call
(`sampling.row_keys(key, B)[j]`) and that row's prompt draws the same tokens, up to the float
rounding of a different batch.

Two programs: `extend` (gathers the rows it appends to, runs them through the model, scatters
them back; compiled once per chunk width and number of rows, a power of four or S) and
`decode` (the `lax.while_loop`). The cache is allocated for `max_len` plus the widest chunk.
Only jaxspec's own models (block models with a `KVCache`) are served; sliding-window layers
kept in rings need a slack of at least the widest chunk (the default's is 288).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxspec import sampling as sampling_lib
from jaxspec.checks import check_int
from jaxspec.decoding import plain, protocol
from jaxspec.decoding.plain import DecodeState
from jaxspec.engine import io
from jaxspec.pytree import pytree_dataclass as _pytree

# Appended chunks are padded to one of these widths (tokens), so a run compiles `extend` a few
# times; a longer one is appended in pieces of the widest. The cache keeps `max(CHUNKS)`
# positions of slack past max_len, so a padded chunk always fits.
CHUNKS = (16, 128)


@_pytree
@dataclasses.dataclass
class SlotState:
  """Every slot's cache and its current job (a pytree; S slots, N the widest job)."""

  cache: Any  # a KVCache of S rows
  tokens: jax.Array  # [S, N] int32 the job's new tokens (-1 = empty)
  n_out: jax.Array  # [S] int32 new tokens so far
  done: jax.Array  # [S] bool: finished, or no job
  last: jax.Array  # [S] int32 the last new token (the next step's input)
  keys: jax.Array  # [S] PRNG keys of the jobs
  budget: jax.Array  # [S] int32 the jobs' budgets of new tokens
  temperature: jax.Array  # [S] float32, 0 = greedy
  top_p: jax.Array  # [S] float32, 1 = off
  stops: jax.Array  # [S, K] int32 the jobs' stop tokens (-1: none)
  steps: jax.Array  # [] int32 decode steps run so far


def _sampling(temperature, top_p) -> sampling_lib.SamplingArrays:
  zeros = jnp.zeros(temperature.shape, jnp.int32)
  return sampling_lib.SamplingArrays(temperature=temperature, top_k=zeros, top_p=top_p,
                                     min_p=jnp.zeros(temperature.shape, jnp.float32))


def init_slots(lm, params, num_slots: int, max_len: int, capacity: int,
               max_stops: int) -> SlotState:
  """S idle slots with empty caches of `max_len` positions, room for `capacity` new tokens and
  `max_stops` stop tokens per job."""
  cache = protocol.init_cache(lm, params, num_slots, max_len)
  s = num_slots
  return SlotState(cache=cache, tokens=jnp.full((s, capacity), -1, jnp.int32),
                   n_out=jnp.zeros((s,), jnp.int32), done=jnp.ones((s,), bool),
                   last=jnp.zeros((s,), jnp.int32), keys=jax.random.split(jax.random.key(0), s),
                   budget=jnp.zeros((s,), jnp.int32), temperature=jnp.zeros((s,), jnp.float32),
                   top_p=jnp.ones((s,), jnp.float32),
                   stops=jnp.full((s, max_stops), -1, jnp.int32), steps=jnp.zeros((), jnp.int32))


def _rows(cache, rows):
  """The cache's rows `rows` [R] (clipped into range): every array with a batch axis."""
  take = lambda x, axis: jnp.take(x, rows, axis=axis, mode="clip")  # noqa: E731
  out = dataclasses.replace(cache, k=take(cache.k, 1), v=take(cache.v, 1),
                            length=take(cache.length, 0))
  if cache.k_ring is not None:
    out = dataclasses.replace(out, k_ring=take(cache.k_ring, 1), v_ring=take(cache.v_ring, 1))
  return out


def _put_rows(cache, rows, part):
  """`cache` with rows `rows` [R] replaced by `part`'s (rows out of range are dropped)."""
  put = lambda x, y: x.at[:, rows].set(y, mode="drop")  # noqa: E731
  out = dataclasses.replace(cache, k=put(cache.k, part.k), v=put(cache.v, part.v),
                            length=cache.length.at[rows].set(part.length, mode="drop"))
  if cache.k_ring is not None:
    out = dataclasses.replace(out, k_ring=put(cache.k_ring, part.k_ring),
                              v_ring=put(cache.v_ring, part.v_ring))
  return out


def extend(params, s: SlotState, rows, chunk, n, reset, keys, budget, temperature, top_p, stops,
           *, lm) -> SlotState:
  """New jobs for slots `rows` [R] (a row of S or more: padding, ignored): each appends its
  first n[r] tokens of chunk [R, T] to the slot's cache (emptied first where reset[r]), samples
  its first new token there (key fold_in(keys[r], 0)) and runs with budget[r] new tokens at
  temperature[r], top_p[r], until one of the K ids of stops[r] (-1: none)."""
  part = _rows(s.cache, rows)
  part = dataclasses.replace(part, length=jnp.where(reset, 0, part.length))
  start = part.length
  _, hidden, part = protocol.forward(lm, params, chunk, part, logits=False)
  part = dataclasses.replace(part, length=start + n)
  last = jnp.take_along_axis(hidden.final, (n - 1)[:, None, None], axis=1)[:, 0]
  logits = lm.logits_from_hidden(params, last)  # as plain.init_decode samples its first
  sp = _sampling(temperature, top_p)
  first = sampling_lib.sample(jax.vmap(jax.random.fold_in)(keys, jnp.zeros_like(n)), logits, sp)
  cap = s.tokens.shape[1]
  new_tokens = jnp.full((rows.shape[0], cap), -1, jnp.int32).at[:, 0].set(first)
  done = plain.is_stop(first, stops) | (budget <= 1)
  put = lambda x, y: x.at[rows].set(y, mode="drop")  # noqa: E731
  return SlotState(cache=_put_rows(s.cache, rows, part), tokens=put(s.tokens, new_tokens),
                   n_out=put(s.n_out, jnp.ones_like(n)), done=put(s.done, done),
                   last=put(s.last, first), keys=put(s.keys, keys), budget=put(s.budget, budget),
                   temperature=put(s.temperature, temperature), top_p=put(s.top_p, top_p),
                   stops=put(s.stops, stops), steps=s.steps)


def decode(params, s: SlotState, until, wake, busy, *, lm) -> SlotState:
  """Steps every running slot until `wake` [] int32 of the slots with a job (`busy` [S] bool)
  have finished (those that finished at their first token included), none is running, or
  `until` [] int32 steps have run."""
  sp = _sampling(s.temperature, s.top_p)
  start = s.steps

  def step(s: SlotState) -> SlotState:
    d = DecodeState(tokens=s.tokens, n_out=s.n_out, done=s.done, last=s.last, cache=s.cache,
                    keys=s.keys, steps=s.steps)
    d = plain.decode_step(params, d, sp, lm, s.budget, s.stops)  # each slot's own stops
    return dataclasses.replace(s, tokens=d.tokens, n_out=d.n_out, done=d.done, last=d.last,
                               cache=d.cache, steps=d.steps)

  def more(s: SlotState):
    finished = jnp.sum(s.done & busy)
    return jnp.any(~s.done) & (finished < wake) & (s.steps - start < until)

  return lax.while_loop(more, step, s)


_extend_jit = jax.jit(extend, static_argnames=("lm",), donate_argnums=(1,))
_decode_jit = jax.jit(decode, static_argnames=("lm",), donate_argnums=(1,))


@dataclasses.dataclass(frozen=True)
class Job:
  """What a slot runs: `tokens` appended to its cache (after emptying it when `reset`), then up
  to `max_new_tokens` new tokens sampled at `temperature` (0: greedy) and `top_p` with `key`,
  ending early at one of `stop_ids` (None: the decoder's)."""

  tokens: Sequence[int]
  max_new_tokens: int
  key: jax.Array
  temperature: float = 0.0
  top_p: float = 1.0
  reset: bool = True
  stop_ids: Sequence[int] | None = None


class SlotDecoder:
  """S slots on the host: `start(slot, job)` gives a free slot a job, `run()` decodes until some
  have finished and returns {slot: new tokens} for each finished one (its slot is free again;
  its cache is kept for a next job that appends to it).

  Args:
    target: a jaxspec `Model` (its weights on one device).
    num_slots: S, the batch the decode loop steps.
    max_len: the most tokens a slot's cache holds (its appended tokens and new ones).
    capacity: the most new tokens a job may ask for.
    stop_ids: the stop tokens of a job that names none (`Job.stop_ids`).
    max_stops: the most stop tokens a job may name (default: 8, or more stop_ids).
    wake: the loop returns to the host once this many slots have finished (default S / 8).
    steps_per_call: and at the latest after this many steps (progress reports).
  """

  def __init__(self, target, num_slots: int, max_len: int, capacity: int,
               stop_ids: Sequence[int], *, wake: int | None = None, steps_per_call: int = 256,
               max_stops: int | None = None):
    for name, v, lo in (("num_slots", num_slots, 1), ("max_len", max_len, 2),
                        ("capacity", capacity, 1), ("steps_per_call", steps_per_call, 1)):
      check_int(name, v, lo, numpy=False)
    tgt = io.as_host_target(target)
    if not protocol.is_block_lm(tgt.lm):
      raise ValueError("SlotDecoder serves jaxspec's own models (a jaxspec Model); decode"
                       f" {type(tgt.lm).__name__} with jaxspec.generate")
    self.lm, self.params = tgt.lm, tgt.params
    self.num_slots, self.max_len, self.capacity = num_slots, max_len, capacity
    self.stop_ids = tuple(sorted({int(t) for t in stop_ids}))
    self.max_stops = max(8, len(self.stop_ids)) if max_stops is None else max_stops
    check_int("max_stops", self.max_stops, max(1, len(self.stop_ids)), numpy=False)
    self.wake = max(1, num_slots // 8) if wake is None else wake
    check_int("wake", self.wake, 1, num_slots, numpy=False)
    self.steps_per_call = steps_per_call
    self.state = init_slots(self.lm, self.params, num_slots, max_len + max(CHUNKS), capacity,
                            self.max_stops)
    self.held = np.zeros(num_slots, np.int64)  # tokens in each slot's cache (host's count)
    self.busy = np.zeros(num_slots, bool)
    self.pending: dict[int, Job] = {}
    # A padded chunk writes up to max(CHUNKS) - 1 positions past what the slot keeps: a ring's
    # slack must cover them, or they would overwrite positions a window still reads.
    slack = getattr(self.lm, "ring_slack", None)
    if self.state.cache.k_ring is not None and (slack or 0) < max(CHUNKS):
      raise ValueError(f"SlotDecoder needs sliding-window rings with a slack of at least"
                       f" {max(CHUNKS)} positions, got ring_slack {slack}: use the default"
                       " (jaxspec.models.llama.RING_SLACK) or jaxspec.generate")
    self.steps = 0  # decode steps run

  @property
  def free(self) -> list[int]:
    return [i for i in range(self.num_slots) if not self.busy[i] and i not in self.pending]

  def cached(self, slot: int) -> int:
    """Tokens the slot's cache holds (what its last job appended and emitted, the last
    emitted token excepted: it is the next append's first input)."""
    return int(self.held[slot])

  def start(self, slot: int, job: Job) -> None:
    """Queues `job` for `slot` (free); it starts at the next `run`. Raises ValueError for a
    job that does not fit (no tokens, a cache past max_len, a budget past capacity) or whose
    token ids, temperature or top-p are out of range."""
    check_int("slot", slot, 0, self.num_slots - 1, numpy=False)
    if self.busy[slot] or slot in self.pending:
      raise ValueError(f"slot {slot} is busy")
    n = len(job.tokens)
    if n < 1:
      raise ValueError("a job appends at least one token")
    ids = np.asarray(job.tokens)
    vocab = self.lm.vocab_size
    if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= vocab:
      raise ValueError(f"a job's tokens must be token ids in [0, {vocab}), got"
                       f" {str(job.tokens)[:60]}")
    if not (0 <= job.temperature < np.inf and 0 < job.top_p <= 1):
      raise ValueError(f"a job samples at temperature >= 0 (0: greedy) and top_p in (0, 1], got"
                       f" temperature {job.temperature}, top_p {job.top_p}")
    check_int("max_new_tokens", job.max_new_tokens, 1, self.capacity, numpy=False)
    if job.stop_ids is not None and len(set(job.stop_ids)) > self.max_stops:
      raise ValueError(f"a job names {len(set(job.stop_ids))} stop tokens, more than max_stops"
                       f" {self.max_stops}: pass a larger max_stops to the SlotDecoder")
    base = 0 if job.reset else int(self.held[slot])
    if base + n + job.max_new_tokens > self.max_len:
      raise ValueError(f"slot {slot}: {base} cached + {n} appended + {job.max_new_tokens} new"
                       f" tokens pass max_len {self.max_len}")
    self.pending[slot] = job

  def _launch(self) -> None:
    """Runs `extend` for the queued jobs: a job longer than the widest chunk in pieces (each
    piece but the last appends; the last samples), each round grouped by chunk width (rows
    padded to a power of four, or to S: few programs to compile)."""
    wide = max(CHUNKS)
    pieces = {slot: [dataclasses.replace(job, tokens=list(job.tokens[a:a + wide]),
                                         reset=job.reset and a == 0)
                     for a in range(0, len(job.tokens), wide)]
              for slot, job in self.pending.items()}
    for r in range(max(len(p) for p in pieces.values())):
      self._extend({slot: p[r] for slot, p in pieces.items() if r < len(p)})
    for slot, job in self.pending.items():
      self.held[slot] = (0 if job.reset else self.held[slot]) + len(job.tokens)
      self.busy[slot] = True
    self.pending.clear()

  def _stops(self, job: Job) -> np.ndarray:
    ids = sorted({int(t) for t in (self.stop_ids if job.stop_ids is None else job.stop_ids)})
    return np.array(ids + [-1] * (self.max_stops - len(ids)), np.int32)

  def _extend(self, jobs_by_slot: dict[int, Job]) -> None:
    groups: dict[int, list[int]] = {}
    for slot, job in jobs_by_slot.items():
      width = next(c for c in CHUNKS if c >= len(job.tokens))
      groups.setdefault(width, []).append(slot)
    for width, slots in sorted(groups.items()):
      r = 1
      while r < len(slots):
        r *= 4
      r = min(r, self.num_slots)
      jobs = [jobs_by_slot[i] for i in slots]
      chunk = np.zeros((r, width), np.int32)
      n = np.ones(r, np.int32)
      for j, job in enumerate(jobs):
        chunk[j, :len(job.tokens)] = job.tokens
        n[j] = len(job.tokens)
      rows = np.full(r, self.num_slots, np.int32)
      rows[:len(slots)] = slots
      pad = lambda vals, fill, dt: np.array(list(vals) + [fill] * (r - len(vals)), dt)  # noqa: E731
      keys = jnp.stack([job.key for job in jobs] + [jobs[0].key] * (r - len(jobs)))
      self.state = _extend_jit(
          self.params, self.state, jnp.asarray(rows), jnp.asarray(chunk), jnp.asarray(n),
          jnp.asarray(pad([job.reset for job in jobs], True, bool)), keys,
          jnp.asarray(pad([job.max_new_tokens for job in jobs], 1, np.int32)),
          jnp.asarray(pad([sampling_lib.normal_temperature(job.temperature)
                           for job in jobs], 0.0, np.float32)),
          jnp.asarray(pad([job.top_p for job in jobs], 1.0, np.float32)),
          jnp.asarray(np.stack([self._stops(job) for job in jobs]
                               + [self._stops(jobs[0])] * (r - len(jobs)))),
          lm=self.lm)

  def run(self) -> dict[int, list[int]]:
    """Starts the queued jobs and decodes until at least `wake` slots (or every running one)
    have finished, or `steps_per_call` steps; returns each finished job's new tokens by slot."""
    if self.pending:
      self._launch()
    if not self.busy.any():
      return {}
    wake = min(self.wake, int(self.busy.sum()))
    self.state = _decode_jit(self.params, self.state, jnp.int32(self.steps_per_call),
                             jnp.int32(wake), jnp.asarray(self.busy), lm=self.lm)
    done, n_out, steps = jax.device_get((self.state.done, self.state.n_out, self.state.steps))
    self.steps = int(steps)
    finished = [i for i in range(self.num_slots) if self.busy[i] and done[i]]
    out = {}
    if finished:
      toks = np.asarray(jax.device_get(self.state.tokens[np.asarray(finished)]))
      for j, i in enumerate(finished):
        row = toks[j, :n_out[i]].tolist()
        out[i] = row
        self.held[i] += len(row) - 1
        self.busy[i] = False
    return out
