"""Sliding-window layers in ring buffers: cache bytes and ms per step, ring against full cache.

1. Bytes (from shapes only, `jax.eval_shape(init_cache)`): a Gemma-3-4B-shaped model (34
   layers, 5 sliding to 1 global, window 1024, 4 kv heads of 256, bfloat16), one row, at
   several `max_len`, with rings (window + `RING_SLACK` slots) and without (`ring_slack=None`).
2. ms per step: a random Gemma-3-patterned model (`bench_attention.CFG` with 6 layers, 5
   sliding to 1 global, window 1024), prompts of 2,048 tokens (past the ring, so the prefill
   wraps it), plain `decode` and `speculative_decode` (k = 4, the `Oracle` drafter: every step
   verifies 5 positions) at max_len 8,192 and 32,768, with and without rings, timed round-robin
   (`bench_attention.time_rounds`: the prefill cancels out).

    .venv/bin/python benchmarks/bench_ring.py [--out benchmarks/results/ring.json]
"""

from __future__ import annotations

import argparse

import jax

from bench_attention import CFG, make_run, time_rounds
from common import ROOT, machine, write_json
from jaxspec.decoding.protocol import Target
from jaxspec.models.config import tiny_config
from jaxspec.models.llama import RING_SLACK, LlamaLM, init_cache
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


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--max-lens", default="8192,32768")
  ap.add_argument("--prompt", type=int, default=2048)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=5)
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
  model = random_model(cfg)
  targets = {"full": Target(LlamaLM(cfg, ring_slack=None), model.params),
             "ring": Target(LlamaLM(cfg), model.params)}
  for spec in (False, True):
    new = args.new * (4 if spec else 1)
    runs = {}
    for max_len in max_lens:
      for name, target in targets.items():
        runs[f"{name}/{max_len}"] = make_run(target, args.batch, args.prompt, new, max_len, spec)
    ms = time_rounds(runs, new, 0.2 if spec else 1.0, args.repeats)
    kind = "speculative k=4" if spec else "plain"
    result["ms_per_step"][kind] = ms
    for max_len in max_lens:
      b = {n: cache_bytes(cfg, args.batch, max_len, None if n == "full" else RING_SLACK)
           for n in targets}
      print(f"{kind:>16} max_len {max_len:>6}: full {ms[f'full/{max_len}']:7.2f} ms"
            f" ({b['full'] / 2**20:.1f} MiB)  ring {ms[f'ring/{max_len}']:7.2f} ms"
            f" ({b['ring'] / 2**20:.1f} MiB)")
  write_json(args.out, result)


if __name__ == "__main__":
  main()
