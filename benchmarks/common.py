"""Shared benchmark helpers: machine facts, prompts, bandwidth, JSON output."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from collections import OrderedDict
from pathlib import Path

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
SPEC_BENCH = SHARED / "data" / "spec_bench_dev.jsonl"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
            "humanities")


def machine() -> dict:
  cpu = platform.processor() or ""
  try:
    for line in open("/proc/cpuinfo"):
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                            capture_output=True).stdout.strip()
  except OSError:
    commit = ""
  # A copy of the tree sent elsewhere (the GPU machine's) names its commit in GIT_COMMIT: its
  # .git, where it has one, can be older than the tree.
  commit = os.environ.get("GIT_COMMIT") or commit
  import flax
  return dict(cpu=cpu, cores=os.cpu_count(), devices=[str(d) for d in jax.devices()],
              device_kind=jax.devices()[0].device_kind,
              backend=jax.default_backend(), python=platform.python_version(),
              jax=jax.__version__, flax=flax.__version__, numpy=np.__version__,
              git_commit=commit, date=time.strftime("%Y-%m-%d %H:%M:%S"))


def load_spec_bench(path: Path = SPEC_BENCH) -> list[dict]:
  if not path.exists():
    raise SystemExit(f"{path} not found: the benchmarks need ../shared/data (see README)")
  return [json.loads(line) for line in open(path) if line.strip()]


def chat_prompts(model, rows: list[dict]) -> list[list[int]]:
  """First turn of every row, chat-formatted with the model's template."""
  return [model.tokenizer.encode_chat(r["turns"][0]) for r in rows]


def by_category(rows: list[dict], per_category: int | None,
                categories: tuple[str, ...] | None = None) -> "OrderedDict[str, list[dict]]":
  out: OrderedDict[str, list[dict]] = OrderedDict()
  for r in rows:
    if categories and r["category"] not in categories:
      continue
    lst = out.setdefault(r["category"], [])
    if per_category is None or len(lst) < per_category:
      lst.append(r)
  return out


def copy_bandwidth_gbs() -> dict:
  """Measured memory bandwidth (STREAM "copy" convention: bytes read + bytes written per s),
  single-threaded numpy and XLA (all cores); the larger is the bound we compare against."""
  n = 256 * 1024 * 1024 // 4  # 1 GiB of float32
  a = np.ones(n, np.float32)
  b = np.empty_like(a)
  best_np = 0.0
  for _ in range(4):
    t = time.perf_counter()
    np.copyto(b, a)
    best_np = max(best_np, 2 * a.nbytes / (time.perf_counter() - t))
  x = jnp.ones(n, jnp.float32)
  f = jax.jit(lambda x: x * 1.0001)
  f(x).block_until_ready()
  best_xla = 0.0
  for _ in range(4):
    t = time.perf_counter()
    f(x).block_until_ready()
    best_xla = max(best_xla, 2 * x.nbytes / (time.perf_counter() - t))
  del a, b, x
  return dict(numpy_copy_gbs=best_np / 1e9, xla_copy_gbs=best_xla / 1e9,
              bound_gbs=max(best_np, best_xla) / 1e9)


def write_json(path: Path, data: dict) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(data, indent=1, default=float))
  print(f"wrote {path}")


def forward_costs(model, batch, context, widths, iters, rounds):
  """Seconds of one target pass over T tokens (cache written in place, rolled back), for every
  T in `widths`, interleaved over `rounds`, best round each."""
  from jaxspec.models.llama import forward, init_cache
  cfg = model.cfg

  @functools.partial(jax.jit, static_argnums=(2,), donate_argnums=(1,))
  def passes(params, cache, t):
    toks = jnp.ones((cache.batch_size, t), jnp.int32)

    def body(i, carry):
      c, acc = carry
      logits, _, c2 = forward(params, toks + i, c, cfg)
      return dataclasses.replace(c2, length=c.length), acc + logits.argmax(-1).sum()
    return lax.fori_loop(0, iters, body, (cache, jnp.int32(0)))

  caches = {}
  for t in widths:
    cache = init_cache(cfg, batch, context + max(widths) + 8)
    cache = dataclasses.replace(cache, length=jnp.full((batch,), context, jnp.int32))
    caches[t] = jax.block_until_ready(passes(model.params, cache, t))[0]
  best = {t: float("inf") for t in widths}
  for _ in range(rounds):
    for t in widths:
      t0 = time.perf_counter()
      caches[t] = jax.block_until_ready(passes(model.params, caches[t], t))[0]
      best[t] = min(best[t], (time.perf_counter() - t0) / iters)
  return best
