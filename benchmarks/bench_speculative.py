"""Speculative vs plain decoding on Spec-Bench categories, measured side by side in one run.

SmolLM2-135M target, float32, batch 1, greedy, EOS-stopping, up to 128 new tokens; for every
prompt plain `generate` and `speculative_generate` run back to back (interleaved, so machine
drift cancels), both warmed up first so compile time is excluded. Reports per category tau,
acceptance per draft position and speedup; and the cost of one verify pass of k+1 tokens
relative to one decode step for k = 1..8 at batch 1, 8, 32 (the adaptive controller's input).

    .venv/bin/python benchmarks/bench_speculative.py [--per-category 4] [--drafter ngram]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from common import (ROOT, by_category, chat_prompts, forward_costs, load_spec_bench, machine,
                    write_json)
from jaxspec import NGram, generate, load, speculative_generate


def verify_cost(model, batch_sizes=(1, 8, 32), ks=range(1, 9), context=256, iters=8, rounds=4):
  """Seconds of one target pass over T = k+1 tokens relative to T = 1, with `context` cached
  tokens per row and the cache written in place (as in the loop)."""
  out = {}
  for b in batch_sizes:
    widths = [1] + [k + 1 for k in ks]
    times = forward_costs(model, b, context, widths, iters, rounds)
    out[b] = {"decode_step_seconds": times[1],
              "verify_over_decode": {k: times[k + 1] / times[1] for k in ks}}
    print(f"batch {b}: decode step {times[1] * 1e3:.1f} ms; verify(k)/decode: "
          + " ".join(f"k={k}:{times[k + 1] / times[1]:.2f}" for k in ks))
  return out


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--per-category", type=int, default=4)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--num-draft-tokens", type=int, default=4)
  ap.add_argument("--max-ngram", type=int, default=3)
  ap.add_argument("--min-ngram", type=int, default=1)
  ap.add_argument("--categories", default="", help="comma-separated subset (default: all)")
  ap.add_argument("--repeats", type=int, default=2,
                  help="runs of each method per prompt, interleaved; the fastest counts")
  ap.add_argument("--skip-verify-cost", action="store_true")
  ap.add_argument("--verify-cost-only", action="store_true",
                  help="only measure verify/decode cost (written to results/verify_cost.json)")
  ap.add_argument("--context", type=int, default=256, help="cached tokens for the cost pass")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "speculative.json"))
  args = ap.parse_args()
  model = load()
  if args.verify_cost_only:
    write_json(ROOT / "benchmarks" / "results" / "verify_cost.json",
               dict(machine=machine(), context=args.context,
                    verify_cost=verify_cost(model, context=args.context)))
    return
  drafter = NGram(max_ngram=args.max_ngram, min_ngram=args.min_ngram)
  n, k = args.max_new_tokens, args.num_draft_tokens
  cats = by_category(load_spec_bench(), args.per_category,
                     tuple(c for c in args.categories.split(",") if c) or None)
  result = dict(machine=machine(), max_new_tokens=n, num_draft_tokens=k, drafter=drafter.name,
                repeats=args.repeats,
                max_ngram=args.max_ngram, min_ngram=args.min_ngram, per_category=args.per_category, categories={})
  all_plain = all_spec = 0.0
  all_tokens = 0
  for cat, rows in cats.items():
    prompts = chat_prompts(model, rows)
    t_plain = t_spec = 0.0
    tokens, emitted, passes = 0, 0.0, 0.0
    acc_pos = np.zeros(k)
    for p in prompts:
      kw = dict(max_new_tokens=n)  # EOS-stopping: the default stop ids are the model's EOS ids
      generate(model, [p], **kw)  # warm-up compiles (cached per shape)
      speculative_generate(model, drafter, [p], num_draft_tokens=k, **kw)
      plains, specs = [], []
      for _ in range(args.repeats):  # interleaved; this shared machine's noise only slows runs
        plains.append(generate(model, [p], **kw))
        specs.append(speculative_generate(model, drafter, [p], num_draft_tokens=k, **kw))
      plain = min(plains, key=lambda o: o.stats["seconds"])
      spec = min(specs, key=lambda o: o.stats["seconds"])
      assert spec.row(0) == plain.row(0), "speculative greedy output differs from generate"
      t_plain += plain.stats["seconds"]
      t_spec += spec.stats["seconds"]
      tokens += int(plain.lengths[0])
      st = spec.stats
      passes += st["target_passes"]
      emitted += st["tau"] * st["target_passes"]
      acc_pos += np.array(st["acceptance_per_position"]) * st["target_passes"]
    res = dict(prompts=len(prompts), new_tokens=tokens,
               plain_tokens_per_second=tokens / t_plain, spec_tokens_per_second=tokens / t_spec,
               speedup=t_plain / t_spec, tau=emitted / passes,
               acceptance_per_position=(acc_pos / passes).tolist())
    result["categories"][cat] = res
    all_plain, all_spec, all_tokens = all_plain + t_plain, all_spec + t_spec, all_tokens + tokens
    print(f"{cat:15s} tau {res['tau']:.2f}  speedup {res['speedup']:.2f}x  plain"
          f" {res['plain_tokens_per_second']:.1f} tok/s  spec {res['spec_tokens_per_second']:.1f}"
          f" tok/s  acc/pos {' '.join(f'{a:.2f}' for a in res['acceptance_per_position'])}")
  result["overall"] = dict(speedup=all_plain / all_spec, new_tokens=all_tokens)
  print(f"overall speedup {all_plain / all_spec:.2f}x over {all_tokens} tokens")
  if not args.skip_verify_cost:
    result["verify_cost"] = verify_cost(model, context=args.context)
  write_json(Path(args.out), result)


if __name__ == "__main__":
  main()
