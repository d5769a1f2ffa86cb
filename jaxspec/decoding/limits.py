"""Size limits checked before anything is traced: positions per row and the KV cache's bytes
against the device's memory."""

from __future__ import annotations

import os

import jax

# The most positions a row's cache may hold (2**24: far past any model's context, and small
# enough that a mistyped size fails here rather than in an allocation).
MAX_POSITIONS = 2**24


def memory_budget() -> int | None:
  """Bytes the default device may hold: its allocator's limit where it reports one (GPUs,
  TPUs), the host's physical memory for the CPU; None where unknown."""
  try:
    stats = jax.devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
      return int(stats["bytes_limit"])
  except Exception:  # noqa: BLE001 - backends without memory stats
    pass
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def check_cache(need: int, batch: int, max_len: int) -> None:
  """Raises ValueError when a cache of `need` bytes for [batch, max_len] cannot be held: past
  `MAX_POSITIONS` positions, or larger than the device's memory."""
  if max_len > MAX_POSITIONS:
    raise ValueError(f"a cache of {max_len} positions per row is past jaxspec's limit of"
                     f" {MAX_POSITIONS}: lower max_new_tokens or max_len")
  budget = memory_budget()
  if budget is not None and need > budget:
    raise ValueError(f"the KV cache for {batch} rows of {max_len} positions needs"
                     f" {need / 2**30:.1f} GiB, more than the device's {budget / 2**30:.1f} GiB:"
                     " lower max_new_tokens, max_len or the batch")
