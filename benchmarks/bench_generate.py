"""Plain decoding speed: SmolLM2-135M, float32, greedy, 128 new tokens.

Batch 1 on the first 10 chat-formatted prompts of ../shared/data/spec_bench_dev.jsonl (compile
excluded), the fraction of the memory-bandwidth bound (weight bytes read per token / measured
copy bandwidth), and batch 8 and 32 throughput.

    .venv/bin/python benchmarks/bench_generate.py [--out bench_out/generate.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax

from common import ROOT, chat_prompts, copy_bandwidth_gbs, load_spec_bench, machine, write_json
from jaxspec import generate, load


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--prompts", type=int, default=10)
  ap.add_argument("--batch-sizes", default="8,32")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "generate.json"))
  args = ap.parse_args()
  n = args.max_new_tokens
  model = load()
  prompts = chat_prompts(model, load_spec_bench()[: args.prompts])
  weight_bytes = sum(x.nbytes for x in jax.tree.leaves(model.params))
  bw = copy_bandwidth_gbs()
  bound_tps = bw["bound_gbs"] * 1e9 / weight_bytes
  print(f"weights {weight_bytes / 1e6:.0f} MB/token; copy bandwidth {bw['bound_gbs']:.1f} GB/s"
        f" -> bound {bound_tps:.1f} tokens/s")

  rows = []
  for i, p in enumerate(prompts):
    generate(model, [p], max_new_tokens=n, stop_ids=())  # compile (cached per shape)
    # Best of two runs: this shared machine's noise only ever slows a run down.
    out = min((generate(model, [p], max_new_tokens=n, stop_ids=()) for _ in range(2)),
              key=lambda o: o.stats["seconds"])
    rows.append(dict(prompt=i, prompt_tokens=len(p), seconds=out.stats["seconds"],
                     tokens_per_second=out.stats["tokens_per_second"]))
    print(f"batch 1 prompt {i} ({len(p)} tokens): {out.stats['tokens_per_second']:.1f} tokens/s")
  total_tokens = n * len(prompts)
  total_s = sum(r["seconds"] for r in rows)
  tps1 = total_tokens / total_s
  result = dict(machine=machine(), bandwidth=bw, weight_bytes=weight_bytes, max_new_tokens=n,
                batch1=dict(tokens_per_second=tps1, fraction_of_bound=tps1 / bound_tps,
                            bound_tokens_per_second=bound_tps, per_prompt=rows))
  print(f"batch 1: {tps1:.1f} tokens/s = {tps1 / bound_tps:.0%} of the bandwidth bound")
  for b in [int(x) for x in args.batch_sizes.split(",") if x]:
    batch = [prompts[i % len(prompts)] for i in range(b)]
    generate(model, batch, max_new_tokens=n, stop_ids=())
    out = generate(model, batch, max_new_tokens=n, stop_ids=())
    tps = out.stats["tokens_per_second"]
    result[f"batch{b}"] = dict(tokens_per_second=tps, seconds=out.stats["seconds"])
    print(f"batch {b}: {tps:.1f} tokens/s ({tps / tps1:.1f}x batch 1)")
  write_json(Path(args.out), result)


if __name__ == "__main__":
  main()
