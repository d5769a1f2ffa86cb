"""The cost of the host-orchestrated loop: fused vs drafter-on-other-devices, side by side.

SmolLM2-135M target, float32, greedy, EOS-stopping, batch 1. Both runs use the same devices'
speed (on CPU the simulated devices share the same cores), so the difference is the
orchestration alone: three jitted programs and two transfers per step, and the host's wait for
the proposal. Drafters: n-gram (drafting costs nothing, so the overhead shows most) and an int8
copy of the target (self-speculation). Every (prompt, drafter) is run fused then host, after a
warm-up of both, `--repeats` times, interleaved; each keeps its fastest run.

    XLA_FLAGS=--xla_force_host_platform_device_count=2 \
      .venv/bin/python benchmarks/bench_placement.py [--per-category 1] [--max-new-tokens 64]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402

from common import ROOT, by_category, chat_prompts, load_spec_bench, machine, write_json  # noqa
from jaxspec import DraftModel, NGram, load, speculative_generate  # noqa: E402
from jaxspec.models import quantize  # noqa: E402
from jaxspec.sharding import Placement  # noqa: E402


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--per-category", type=int, default=1)
  ap.add_argument("--categories", default="writing,coding,math,summarization")
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--k", type=int, default=3)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--drafters", default="ngram,int8-self")
  ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "placement.json")
  args = ap.parse_args()
  devs = jax.devices()
  if len(devs) < 2:
    raise SystemExit("needs two devices: XLA_FLAGS=--xla_force_host_platform_device_count=2")
  model = load()
  groups = by_category(load_spec_bench(), args.per_category,
                       categories=tuple(args.categories.split(",")))
  rows = [r for lst in groups.values() for r in lst]
  prompts = chat_prompts(model, rows)
  fused = Placement(target=[devs[0]], drafter=[devs[0]])
  host = Placement(target=[devs[0]], drafter=[devs[1]])
  drafters = {"ngram": NGram(), "int8-self": DraftModel(quantize(model, "int8"))}
  results = []
  for name in args.drafters.split(","):
    drafter = drafters[name]
    per = {"fused": [], "host": []}
    for p in prompts:
      runs = {}
      for mode, pl in (("fused", fused), ("host", host)):  # warm-up: compile both
        speculative_generate(model, drafter, [p], max_new_tokens=args.max_new_tokens,
                             num_draft_tokens=args.k, placement=pl)
      for _ in range(args.repeats):
        for mode, pl in (("fused", fused), ("host", host)):
          out = speculative_generate(model, drafter, [p], max_new_tokens=args.max_new_tokens,
                                     num_draft_tokens=args.k, placement=pl)
          runs.setdefault(mode, []).append(out)
      assert runs["fused"][0].row(0) == runs["host"][0].row(0), "host and fused tokens differ"
      for mode in runs:
        best = min(runs[mode], key=lambda o: o.stats["seconds"])
        per[mode].append(dict(seconds=best.stats["seconds"], tokens=int(best.lengths[0]),
                              passes=best.stats["target_passes"], tau=best.stats["tau"]))
    tot = {m: sum(r["seconds"] for r in per[m]) for m in per}
    toks = sum(r["tokens"] for r in per["fused"])
    steps = sum(r["passes"] for r in per["fused"])
    overhead = tot["host"] / tot["fused"] - 1
    per_step_ms = (tot["host"] - tot["fused"]) / steps * 1e3
    ratios = [h["seconds"] / f["seconds"] for f, h in zip(per["fused"], per["host"])]
    results.append(dict(drafter=name, k=args.k, prompts=len(prompts), tokens=toks,
                        target_passes=steps, fused_tok_s=toks / tot["fused"],
                        host_tok_s=toks / tot["host"], overhead=overhead,
                        overhead_per_step_ms=per_step_ms,
                        per_prompt_ratio_median=statistics.median(ratios), runs=per))
    print(f"{name:10s} k={args.k}: fused {toks / tot['fused']:6.1f} tok/s, host"
          f" {toks / tot['host']:6.1f} tok/s, overhead {overhead * 100:+.1f}%"
          f" ({per_step_ms:+.2f} ms per step, {steps} steps; median per-prompt host/fused"
          f" {statistics.median(ratios):.3f})")
  write_json(args.out, dict(machine=machine(), max_new_tokens=args.max_new_tokens,
                            categories=args.categories, results=results,
                            when=time.strftime("%Y-%m-%d %H:%M")))


if __name__ == "__main__":
  main()
