"""Adaptive speculation (`num_draft_tokens="auto"`) against every fixed k and plain decoding.

SmolLM2-135M target, float32, greedy, EOS-stopping, n-gram drafter, Spec-Bench dev prompts.

Part 1, batch 1: for every prompt, plain `generate`, each fixed k and "auto" run back to back
(interleaved, so machine drift cancels), all warmed up first (compile and the one-off cost
measurement excluded). Per category and overall: tokens/s, speedup, tau, mean k chosen.
Part 2, batch sweep: throughput of "auto" and plain `generate` on mixed-category batches of 1,
4, 16 and 64 rows (prompts of at most 256 tokens), interleaved: best of `--sweep-repeats` and the
median of the paired (back-to-back) ratios.
Part 3: bucketed widths (the default) vs one masked width (`AutoK(buckets=(0, k_max))`).

    .venv/bin/python benchmarks/bench_adaptive.py [--per-category 1] [--ks 1,2,3,4,6,8]
        [--batch-sizes 1,4,16,64] [--sweep-new-tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from common import ROOT, by_category, chat_prompts, load_spec_bench, machine, write_json
from jaxspec import NGram, generate, load, speculative_generate
from jaxspec.decoding.adaptive import AutoK
from jaxspec.drafters import resolve_drafter

DRAFTER = NGram()  # --drafter


def _run(model, method, prompts, n, auto):
  if method == "plain":
    return generate(model, prompts, max_new_tokens=n)
  k = "auto" if method in ("auto", "masked") else int(method)
  return speculative_generate(model, DRAFTER, prompts, max_new_tokens=n, num_draft_tokens=k,
                              auto=auto.get(method))


def part1(model, rows, methods, n, repeats, auto):
  cats = by_category(rows, None)
  res = {m: {} for m in methods}
  for cat, items in cats.items():
    prompts = chat_prompts(model, items)
    for p in prompts:
      for m in methods:  # warm-up: compile (and measure costs for "auto") outside the timing
        _run(model, m, [p], n, auto)
      best = {m: None for m in methods}
      for r in range(repeats):
        for m in (methods if r % 2 == 0 else methods[::-1]):
          out = _run(model, m, [p], n, auto)
          if best[m] is None or out.stats["seconds"] < best[m].stats["seconds"]:
            best[m] = out
      for m in methods:
        st = best[m].stats
        d = res[m].setdefault(cat, dict(tokens=0, seconds=0.0, passes=0, ks=[]))
        d["tokens"] += int(best[m].lengths.sum())
        d["seconds"] += st["seconds"]
        d["passes"] += st.get("target_passes", int(best[m].lengths.sum()))
        d["ks"] += st.get("k_per_step", [])
    line = [f"{cat:15s}"]
    for m in methods:
      d = res[m][cat]
      base = res["plain"][cat]
      line.append(f"{m}: {d['tokens'] / d['seconds']:5.1f} tok/s"
                  f" ({base['seconds'] / d['seconds']:.2f}x)")
    print("  ".join(line), flush=True)
  summary = {}
  for m in methods:
    tok = sum(d["tokens"] for d in res[m].values())
    sec = sum(d["seconds"] for d in res[m].values())
    base = sum(d["seconds"] for d in res["plain"].values())
    ks = [k for d in res[m].values() for k in d["ks"]]
    summary[m] = dict(tokens_per_second=tok / sec, speedup=base / sec,
                      tau=tok / max(sum(d["passes"] for d in res[m].values()), 1),
                      mean_k=float(np.mean(ks)) if ks else None,
                      per_category={c: dict(tokens_per_second=d["tokens"] / d["seconds"],
                                            speedup=res["plain"][c]["seconds"] / d["seconds"],
                                            tau=d["tokens"] / max(d["passes"], 1),
                                            mean_k=float(np.mean(d["ks"])) if d["ks"] else None)
                                    for c, d in res[m].items()})
  return summary


def part2(model, rows, batch_sizes, n, repeats, max_prompt_tokens=256):
  # Mixed categories, but prompts of at most max_prompt_tokens: at batch 64 the long RAG and
  # summarization prompts would make the sweep a prefill benchmark (and need gigabytes of cache).
  prompts_all = [p for p in chat_prompts(model, rows) if len(p) <= max_prompt_tokens]
  order = np.random.default_rng(0).permutation(len(prompts_all))
  out = {}
  for b in batch_sizes:
    prompts = [prompts_all[order[i % len(order)]] for i in range(b)]
    runs = {"plain": lambda: generate(model, prompts, max_new_tokens=n),
            "auto": lambda: speculative_generate(model, DRAFTER, prompts, max_new_tokens=n)}
    for f in runs.values():
      f()  # compile + cost measurement
    best = {m: float("inf") for m in runs}
    stats = {}
    paired = []  # auto / plain of the two back-to-back runs of each repeat: drift cancels
    for r in range(repeats):
      secs = {}
      for m in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
        o = runs[m]()
        secs[m] = o.stats["seconds"]
        tps = int(o.lengths.sum()) / o.stats["seconds"]
        if o.stats["seconds"] < best[m]:
          best[m] = o.stats["seconds"]
          stats[m] = dict(tokens_per_second=tps, tokens=int(o.lengths.sum()),
                          mean_k=o.stats.get("mean_k"), tau=o.stats.get("tau"),
                          cost_model=(None if o.stats.get("cost_model") is None
                                      else o.stats["cost_model"].to_dict()))
      paired.append(secs["plain"] / secs["auto"])  # same tokens (greedy): a throughput ratio
    out[b] = dict(stats, ratio=stats["auto"]["tokens_per_second"] /
                  stats["plain"]["tokens_per_second"],
                  paired_ratios=paired, paired_ratio_median=float(np.median(paired)))
    print(f"batch {b:3d}: plain {stats['plain']['tokens_per_second']:6.1f} tok/s, auto"
          f" {stats['auto']['tokens_per_second']:6.1f} tok/s ({out[b]['ratio']:.3f}x best of"
          f" {repeats}; paired median {out[b]['paired_ratio_median']:.3f}x, range"
          f" {min(paired):.3f}-{max(paired):.3f}; mean k {stats['auto']['mean_k']:.2f},"
          f" tau {stats['auto']['tau']:.2f})", flush=True)
  return out


def plot(sweep, path: Path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  bs = sorted(sweep)
  fig, ax = plt.subplots(figsize=(5, 3.2))
  for m in ("plain", "auto"):
    ax.plot(bs, [sweep[b][m]["tokens_per_second"] for b in bs], marker="o",
            label="generate" if m == "plain" else f'speculative, k="auto" ({DRAFTER.name})')
  ax.set_xscale("log", base=2)
  ax.set_xticks(bs, [str(b) for b in bs])
  ax.set_xlabel("batch size")
  ax.set_ylabel("tokens / s")
  ax.set_title("SmolLM2-135M, CPU: throughput vs batch")
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=120)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--per-category", type=int, default=1)
  ap.add_argument("--ks", default="1,2,3,4,6,8")
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--batch-sizes", default="1,4,16,64")
  ap.add_argument("--sweep-new-tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=2, help="timed runs per method, batch 1 part")
  ap.add_argument("--sweep-repeats", type=int, default=2)
  ap.add_argument("--skip", default="", help="comma list of parts to skip: 1,2")
  ap.add_argument("--drafter", default="ngram",
                  help="ngram, a bundled head (eagle, medusa, mlp) or a head/draft-model path")
  ap.add_argument("--categories", default="",
                  help="comma list of Spec-Bench categories for part 1 (default: all)")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "adaptive.json"))
  args = ap.parse_args()
  global DRAFTER
  model = load()
  DRAFTER = resolve_drafter(model, args.drafter)
  rows = load_spec_bench()
  skip = set(args.skip.split(",")) - {""}
  result = dict(machine=machine(), max_new_tokens=args.max_new_tokens, drafter=args.drafter,
                command="benchmarks/bench_adaptive.py " + " ".join(
                    f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                    if k != "out" and v != ""))
  print(result["machine"], flush=True)
  if "2" not in skip:
    bs = [int(b) for b in args.batch_sizes.split(",")]
    result["batch_sweep"] = part2(model, rows, bs, args.sweep_new_tokens, args.sweep_repeats)
    plot(result["batch_sweep"], ROOT / "benchmarks" / "results" / "adaptive_batch_sweep.png")
    write_json(Path(args.out), result)
  if "1" not in skip:
    methods = ["plain"] + args.ks.split(",") + ["auto", "masked"]
    # One width: verify the default k_max drafts (fewer for a head with fewer heads) or none.
    k_max = min(AutoK().k_max, getattr(DRAFTER, "max_draft_tokens", None) or AutoK().k_max)
    auto = {"masked": AutoK(k_max=k_max, buckets=(0, k_max))}
    cats = tuple(c for c in args.categories.split(",") if c) or None
    picked = [r for rows_c in by_category(rows, args.per_category, cats).values()
              for r in rows_c]
    summary = part1(model, picked, methods, args.max_new_tokens, args.repeats, auto)
    result["batch1"] = summary
    fixed = {m: s for m, s in summary.items() if m not in ("plain", "auto", "masked")}
    best_k = max(fixed, key=lambda m: fixed[m]["tokens_per_second"])
    result["batch1_best_fixed_k"] = best_k
    result["batch1_auto_vs_best_fixed"] = (summary["auto"]["tokens_per_second"] /
                                           fixed[best_k]["tokens_per_second"])
    print("overall:", {m: f"{s['tokens_per_second']:.1f} tok/s {s['speedup']:.2f}x"
                       for m, s in summary.items()})
    print(f"auto / best fixed k ({best_k}): {result['batch1_auto_vs_best_fixed']:.3f}")
    write_json(Path(args.out), result)


if __name__ == "__main__":
  main()
