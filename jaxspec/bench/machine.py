"""The machine a benchmark ran on, the versions of its software and the git commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import numpy as np


def machine() -> dict[str, Any]:
  """CPU model, cores, memory, accelerator and the JAX backend."""
  import jax
  cpu = platform.processor() or ""
  try:
    for line in open("/proc/cpuinfo", encoding="utf-8"):
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  mem = None
  try:
    for line in open("/proc/meminfo", encoding="utf-8"):
      if line.startswith("MemTotal"):
        mem = round(int(line.split()[1]) / 2**20, 1)
        break
  except OSError:
    pass
  devs = jax.devices()
  acc = sorted({f"{d.platform}: {getattr(d, 'device_kind', '')}" for d in devs
                if d.platform != "cpu"})
  return dict(cpu=cpu, cores=os.cpu_count(), usable_cores=threads(), memory_gib=mem,
              accelerator=", ".join(acc) or "none", jax_backend=jax.default_backend(),
              jax_devices=len(devs), os=platform.platform())


def loadavg() -> list[float] | None:
  """1, 5 and 15-minute load averages: other processes' share of a shared machine."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def threads() -> int:
  """CPU cores this process may use (what XLA's CPU thread pool sizes itself to)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def versions() -> dict[str, str]:
  import flax
  import jax
  import jaxlib

  import jaxspec
  return dict(python=platform.python_version(), jaxspec=jaxspec.__version__,
              jax=jax.__version__, jaxlib=jaxlib.__version__, flax=flax.__version__,
              numpy=np.__version__)


def git_commit() -> dict[str, Any]:
  root = Path(__file__).resolve().parents[2]  # the repository (or site-packages)
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, text=True,
                          capture_output=True, timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           text=True, capture_output=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return dict(commit=None, dirty=None)
  return dict(commit=head or None, dirty=bool(dirty) if head else None)
