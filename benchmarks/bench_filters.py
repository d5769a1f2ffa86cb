"""What top-k / top-p filtering costs on this backend: the sorting filter (`_filter_sorted`, the
default off the CPU) against the bisection (`_filter_bisect`, the CPU's), interleaved, and a
sampled `generate` of the bundled SmolLM2-135M with top_p 0.95 under each.

    .venv/bin/python benchmarks/bench_filters.py [--batches 1,8,32] [--out FILE]

The filter alone: jitted on [B, 49152] float32 logits (SmolLM2's vocabulary), best of --rounds
rounds of 5 calls each. `generate`: B prompts of 120 random tokens, 64 new tokens at T 1.0 and
top_p 0.95 (no stop token) and without a filter, best of --rounds; `process_logits` picks the filter
when the program is traced, so each filter gets its own programs (compiled before timing).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from common import ROOT, machine, write_json
from jaxspec import sampling
from jaxspec.sampling import Sampling

FILTERS = {"sorted": sampling._filter_sorted, "bisect": sampling._filter_bisect}


def filter_ms(b: int, v: int, rounds: int) -> dict[str, float]:
  x = jnp.asarray(np.random.default_rng(0).normal(size=(b, v)).astype(np.float32) * 3)
  sp = Sampling(temperature=1.0, top_k=50, top_p=0.95).arrays(b)
  fns = {n: jax.jit(f) for n, f in FILTERS.items()}
  out = {n: float("inf") for n in fns}
  for n, f in fns.items():
    f(x, sp).block_until_ready()
  for _ in range(rounds):
    for n, f in fns.items():
      t = time.perf_counter()
      for _ in range(5):
        f(x, sp).block_until_ready()
      out[n] = min(out[n], (time.perf_counter() - t) / 5 * 1e3)
  return out


def generate_s(model, b: int, rounds: int) -> dict[str, float]:
  from jaxspec.engine.core import Engine
  prompts = np.random.default_rng(1).integers(100, 4000, (b, 120)).tolist()
  runs = {"none": (sampling._filter_bisect, Sampling(temperature=1.0))}  # no filter at all
  runs |= {n: (f, Sampling(temperature=1.0, top_p=0.95)) for n, f in FILTERS.items()}
  engines = {n: Engine() for n in runs}  # each its own compiled programs
  best = {n: float("inf") for n in runs}
  real = sampling._filter_bisect
  try:
    for r in range(rounds + 1):
      for n, (f, sp) in runs.items():
        sampling._filter_bisect = f  # what process_logits traces on the CPU
        if not r:
          jax.clear_caches()  # trace again: the other filter's program is not reused
        t = time.perf_counter()
        engines[n].generate(model, prompts, key=jax.random.key(r), sampling=sp, max_new_tokens=64,
                            max_len=256)
        if r:  # round 0 compiles
          best[n] = min(best[n], time.perf_counter() - t)
  finally:
    sampling._filter_bisect = real
  return best


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batches", default="1,8,32")
  ap.add_argument("--generate-batch", type=int, default=32)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--vocab", type=int, default=49152)
  ap.add_argument("--no-generate", action="store_true")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "filters.json"))
  args = ap.parse_args(argv)
  res = {"machine": machine(), "filter_ms": {}, "generate_s": None}
  for b in (int(x) for x in args.batches.split(",")):
    r = res["filter_ms"][b] = filter_ms(b, args.vocab, args.rounds)
    print(f"filter [{b}, {args.vocab}]: sorted {r['sorted']:.1f} ms, bisect {r['bisect']:.1f} ms"
          f" ({r['sorted'] / r['bisect']:.1f}x)", flush=True)
  if not args.no_generate:
    from jaxspec import load
    g = res["generate_s"] = generate_s(load(), args.generate_batch, args.rounds)
    res["generate_batch"] = args.generate_batch
    print(f"generate, batch {args.generate_batch}, 64 tokens at T 1.0: no filter {g['none']:.1f} s;"
          f" top_p 0.95: sorted {g['sorted']:.1f} s, bisect {g['bisect']:.1f} s"
          f" ({g['sorted'] / g['bisect']:.1f}x)", flush=True)
  write_json(Path(args.out), res)
  return res


if __name__ == "__main__":
  main()
