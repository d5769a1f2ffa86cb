"""Sliding-window layers in ring buffers: cache bytes and ms per step, ring against full cache.

1. Bytes (from shapes only, `jax.eval_shape(init_cache)`): a Gemma-3-4B-shaped model (34
   layers, 5 sliding to 1 global, window 1024, 4 kv heads of 256, bfloat16), one row, at
   several `max_len`, with rings (window + `RING_SLACK` slots) and without (`ring_slack=None`).
2. ms per step: a random Gemma-3-patterned model (`bench_attention.CFG` with 6 layers, 5
   sliding to 1 global, window 1024), one jitted forward of 1 token (a decode step) and of 5
   (a k = 4 verify) on a cache holding 2,048 positions per row (past the ring: every slot
   read), at max_len 8,192 and 32,768, with and without rings; the cache is donated as in the
   loop; all configurations alternate call by call (`--repeats` calls each, the median).

    .venv/bin/python benchmarks/bench_ring.py [--out benchmarks/results/ring.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench_attention import CFG
from common import ROOT, machine, write_json
from jaxspec.models.config import tiny_config
from jaxspec.models.llama import RING_SLACK, forward, init_cache, with_scan_layers
from jaxspec.models.synthetic import random_model

PATTERN = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(6))
GEMMA3_4B = dict(vocab_size=262144, hidden_size=2560, intermediate_size=10240, num_layers=34,
                 num_heads=8, num_kv_heads=4, head_dim=256, sliding_window=1024,
                 layer_types=tuple("full" if (i + 1) % 6 == 0 else "sliding"
                                   for i in range(34)),
                 max_position_embeddings=131072, dtype="bfloat16")


def cache_bytes(cfg, batch: int, max_len: int, slack) -> int:
  shapes = jax.eval_shape(lambda: init_cache(cfg, batch, max_len, ring_slack=slack))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def make_step(cfg, params, batch: int, max_len: int, slack, t: int, cached: int):
  """A timed call: one forward of t tokens at `cached` positions (the cache donated)."""
  fwd = jax.jit(lambda p, tok, c: forward(p, tok, c, cfg)[2], donate_argnums=2)
  tok = jnp.ones((batch, t), jnp.int32)
  state = [dataclasses.replace(init_cache(cfg, batch, max_len, ring_slack=slack),
                               length=jnp.full((batch,), cached, jnp.int32))]

  def call():
    cache = state[0]
    t0 = time.perf_counter()
    out = jax.block_until_ready(fwd(params, tok, cache))
    state[0] = dataclasses.replace(out, length=jnp.full((batch,), cached, jnp.int32))
    return time.perf_counter() - t0

  call()  # compile
  return call


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--max-lens", default="8192,32768")
  ap.add_argument("--cached", type=int, default=2048)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--repeats", type=int, default=200)
  ap.add_argument("--scan", action="store_true", help="stacked layers (default: unrolled)")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ring.json"))
  args = ap.parse_args()
  max_lens = [int(x) for x in args.max_lens.split(",")]
  result = dict(machine=machine(), ring_slack=RING_SLACK, bytes={}, ms_per_step={})

  g3 = tiny_config(**GEMMA3_4B)
  print(f"cache bytes, Gemma-3-4B shape, bfloat16, one row (window {g3.sliding_window}, "
        f"{RING_SLACK} slack):")
  for max_len in (8192, 32768, 131072):
    full, ring = cache_bytes(g3, 1, max_len, None), cache_bytes(g3, 1, max_len, RING_SLACK)
    result["bytes"][max_len] = dict(full=full, ring=ring, ratio=full / ring)
    print(f"  max_len {max_len:>6}: full {full / 2**20:8.1f} MiB  ring {ring / 2**20:7.1f} MiB"
          f"  ({full / ring:.2f}x less)")

  cfg = tiny_config(**{**CFG, "num_layers": 6, "sliding_window": 1024, "layer_types": PATTERN})
  model = with_scan_layers(random_model(cfg).params, args.scan)
  # One jitted forward of T tokens (1: a decode step; 5: a k = 4 verify) on a cache holding
  # `--cached` positions per row, the cache donated and written in place as in the loop; the
  # configurations alternate call by call and each keeps its median.
  steps = {}
  for t in (1, 5):
    for max_len in max_lens:
      for name, slack in (("full", None), ("ring", RING_SLACK)):
        steps[(t, max_len, name)] = make_step(cfg, model, args.batch, max_len, slack, t,
                                              args.cached)
  times = {key: [] for key in steps}
  for _ in range(args.repeats):
    for key, step in steps.items():
      times[key].append(step())
  for t in (1, 5):
    kind = "decode (T=1)" if t == 1 else "verify (T=5)"
    for max_len in max_lens:
      ms = {n: 1e3 * float(np.median(times[(t, max_len, n)])) for n in ("full", "ring")}
      b = {n: cache_bytes(cfg, args.batch, max_len, None if n == "full" else RING_SLACK)
           for n in ms}
      result["ms_per_step"][f"{kind} max_len {max_len}"] = dict(ms=ms, bytes=b)
      print(f"{kind} max_len {max_len:>6}: full {ms['full']:6.2f} ms ({b['full'] / 2**20:.1f}"
            f" MiB)  ring {ms['ring']:6.2f} ms ({b['ring'] / 2**20:.1f} MiB)")
  write_json(Path(args.out), result)


if __name__ == "__main__":
  main()
