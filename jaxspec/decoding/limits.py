"""Size limits checked before anything is traced: positions per row, and the decoding loop's
working set (the KV cache and everything else a run allocates) against the device's memory."""

from __future__ import annotations

import dataclasses
import os

import jax

# The most positions a row's cache may hold (2**24: far past any model's context, and small
# enough that a mistyped size fails here rather than in an allocation).
MAX_POSITIONS = 2**24


def memory_budget(device=None, meminfo: str = "/proc/meminfo") -> int | None:
  """Bytes a new call may still allocate on `device` (default: the first device): its
  allocator's limit less what it holds now where it reports both (GPUs, TPUs: the weights and
  any live buffers are in use already), the host's available memory on the CPU (`MemAvailable`,
  which counts reclaimable page cache, else the free pages); None where unknown."""
  try:
    stats = (device or jax.devices()[0]).memory_stats() or {}
    if stats.get("bytes_limit"):
      return max(0, int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
  except Exception:  # noqa: BLE001 - backends without memory stats
    pass
  try:
    with open(meminfo, encoding="ascii") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024  # the kernel reports kB
  except (OSError, ValueError, IndexError):
    pass
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def check_positions(max_len: int) -> None:
  """Raises ValueError for a cache past `MAX_POSITIONS` positions per row."""
  if max_len > MAX_POSITIONS:
    raise ValueError(f"a cache of {max_len} positions per row is past jaxspec's limit of"
                     f" {MAX_POSITIONS}: lower max_new_tokens or max_len")


# Buffers of a verify pass's [B, T, V] shape live at its peak, each float32: the logits, their
# processed copy (temperature, top-k/top-p masks), the softmax, its sort and cumulative sum for
# top-p, the log-softmax of the log-probabilities, the rejection rule's ratios. Counted from
# XLA's buffer assignment of the compiled loop (CPU; `memory_analysis`), which reuses the rest.
LOGIT_BUFFERS = 9
# The same for an all-greedy loop (`SamplingArrays.all_greedy`): no processed copy, softmax,
# filters or ratios: the logits, their one-hot and the log-softmax (2.1-2.5 measured).
GREEDY_LOGIT_BUFFERS = 3
# The same for a sampled loop without filters (`SamplingArrays.unfiltered`): no sort, cumulative
# sum or masks of top-k/top-p/min-p.
UNFILTERED_LOGIT_BUFFERS = 5
# [B, V] buffers of the prefill's first token (one position, the same processing and the
# sampling arrays' own).
PREFILL_LOGIT_BUFFERS = 10


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkingSet:
  """The bytes one decoding call allocates on the device beyond the weights it is given (which
  are resident already), by part. The cache and the loop's own state live throughout; the
  prefill's activations, its first token's logits and a step's logits live at different times
  (XLA reuses one buffer for them), so the peak holds the largest.

  Attributes:
    cache: the target's KV cache (and the drafter's state: a draft model's cache), allocated
      once to max_len, as the model's `init_cache` shapes it: a jaxspec model's sliding-window
      layers keep rings of window + slack slots there, not max_len positions.
    state: the loop's sequence, log-probability and output buffers.
    prefill: the prefill's peak: its attention scores [B, H, P, P], activations [B, P, D + F]
      and one layer's weights sliced from stacked ones; or its first token's
      `PREFILL_LOGIT_BUFFERS` [B, V] buffers ([B, P, V] logits for a model without the block
      interface), whichever is larger.
    step: a step's peak, `LOGIT_BUFFERS` buffers [B, T, V] of the widest verify (T = k + 1,
      or the tree's nodes; 1 for a decode step); `GREEDY_LOGIT_BUFFERS` when every row is
      greedy.
  """

  cache: int
  state: int
  prefill: int
  step: int

  @property
  def total(self) -> int:
    return self.cache + self.state + max(self.prefill, self.step)

  def describe(self) -> str:
    gib = lambda n: f"{n / 2**30:.2f} GiB"
    return (f"{gib(self.total)} (KV cache {gib(self.cache)}, loop buffers {gib(self.state)},"
            f" and the larger of the prefill's activations {gib(self.prefill)} and a step's"
            f" logits {gib(self.step)})")


def working_set(*, batch: int, prompt_len: int, max_len: int, vocab: int, cache_bytes: int,
                state_bytes: int, verify_tokens: int, heads: int = 0, hidden: int = 0,
                ffw: int = 0, layer_bytes: int = 0, prefill_logits_tokens: int = 1,
                greedy: bool = False, unfiltered: bool = False) -> WorkingSet:
  """The estimate of a decoding call's allocations (`WorkingSet`) from its shapes; within 25%
  of the compiled programs' `memory_analysis()` (tests/decoding/test_memory.py).

  Args:
    batch, prompt_len, max_len: B, the padded prompt width P, the cache's positions.
    vocab: V. cache_bytes: every KV cache's bytes. state_bytes: the loop's other buffers.
    verify_tokens: T of the widest pass a step runs (k_max + 1, or tree nodes; 1: plain).
    heads, hidden, ffw: the target's attention heads, D and F (0 where unknown).
    layer_bytes: one layer's weights when the layers are stacked (a scan slices a copy).
    prefill_logits_tokens: positions whose logits the prefill computes (P for a model without
      the block interface, whose forward returns every position's logits).
    greedy: the program decodes every row greedily (`SamplingArrays.all_greedy`): a step
      holds `GREEDY_LOGIT_BUFFERS` logit buffers, not `LOGIT_BUFFERS`.
    unfiltered: no row filters (`SamplingArrays.unfiltered`): `UNFILTERED_LOGIT_BUFFERS`.
  """
  f32 = 4
  attention = (batch * heads * prompt_len * prompt_len + batch * prompt_len * (hidden + ffw)) \
      * f32 + layer_bytes
  first = batch * vocab * f32 * (PREFILL_LOGIT_BUFFERS + prefill_logits_tokens - 1)
  buffers = GREEDY_LOGIT_BUFFERS if greedy else (
      UNFILTERED_LOGIT_BUFFERS if unfiltered else LOGIT_BUFFERS)
  step = buffers * batch * verify_tokens * vocab * f32
  del max_len  # the cache's positions are in cache_bytes
  return WorkingSet(cache=int(cache_bytes), state=int(state_bytes),
                    prefill=int(max(attention, first)), step=int(step))


def check_working_set(ws: WorkingSet, batch: int, max_len: int, what: str = "decoding", *,
                      held: int = 0) -> None:
  """Raises ValueError when a run's estimated allocations exceed the device's free memory plus
  `held`, the bytes of buffers the caller frees or reuses for this run (the host engine's kept
  cache)."""
  budget = memory_budget()
  if budget is not None:
    budget += held
  if budget is not None and ws.total > budget:
    raise ValueError(f"{what} {batch} rows with a cache of {max_len} positions needs about"
                     f" {ws.describe()}, more than the {budget / 2**30:.1f} GiB the device has free: lower"
                     " the batch, max_new_tokens (capacity) or max_len")
