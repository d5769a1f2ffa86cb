"""The cost of the host-orchestrated loop: fused vs drafter-on-other-devices, side by side.

SmolLM2-135M target, float32, greedy, EOS-stopping, batch 1. Both runs use the same devices'
speed (on CPU the simulated devices share the same cores), so the difference is the
orchestration alone: three jitted programs and two transfers per step, and the host's wait for
the proposal. Drafters: n-gram (drafting costs nothing, so the overhead shows most) and an int8
copy of the target and the float target itself (self-speculation). The planner's prediction for both placements, from
profiles measured in the same run and the measured acceptance, is printed beside them. With
`--target-backend gpu` the target runs on the GPU and the drafter on it or on the host CPU. Every (prompt, drafter) is run fused then host, after a
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
from jaxspec.sharding import (DrafterSpec, ModelProfile, Placement, plan, profile,  # noqa: E402
                              profile_link)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--per-category", type=int, default=1)
  ap.add_argument("--categories", default="writing,coding,math,summarization")
  ap.add_argument("--max-new-tokens", type=int, default=64)
  ap.add_argument("--k", type=int, default=3)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--drafters", default="ngram,self,int8-self")
  ap.add_argument("--target-backend", default="cpu",
                  help="cpu (two simulated host devices) or gpu / tpu: the target on the"
                       " accelerator, the drafter on it (fused) or on the host CPU (host)")
  ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "placement.json")
  args = ap.parse_args()
  if args.target_backend == "cpu":
    devs = jax.devices("cpu")
    if len(devs) < 2:
      raise SystemExit("needs two devices: XLA_FLAGS=--xla_force_host_platform_device_count=2")
    t_dev, d_devs = devs[0], {"same": devs[0], "other": devs[1]}
  else:  # an accelerator target; the drafter on the same accelerator or on the host CPU
    t_dev = jax.devices(args.target_backend)[0]
    d_devs = {"same": t_dev, "other": jax.devices("cpu")[0]}
  model = load()
  groups = by_category(load_spec_bench(), args.per_category,
                       categories=tuple(args.categories.split(",")))
  rows = [r for lst in groups.values() for r in lst]
  prompts = chat_prompts(model, rows)
  fused = Placement(target=[t_dev], drafter=[d_devs["same"]])
  host = Placement(target=[t_dev], drafter=[d_devs["other"]])
  int8 = quantize(model, "int8")
  drafters = {"ngram": NGram(), "int8-self": DraftModel(int8), "self": DraftModel(model)}
  # Profiles measured in this run, for the planner's prediction beside each measurement.
  mesh_t, mesh_d = fused.target, host.drafter
  t0 = time.perf_counter()
  prof_t = profile(model, mesh_t, tokens=(1, 2, args.k + 1), batch_sizes=(1,))
  prof_d = {"same": profile(int8, mesh_t, tokens=(1, 2), batch_sizes=(1,)),
            "other": profile(int8, mesh_d, tokens=(1, 2), batch_sizes=(1,))}
  link = profile_link(mesh_t, mesh_d)
  print(f"profiles measured in {time.perf_counter() - t0:.1f} s: target T=1"
        f" {prof_t.latency(1, 1) * 1e3:.1f} ms, T={args.k + 1}"
        f" {prof_t.latency(1, args.k + 1) * 1e3:.1f} ms; int8 draft T=1"
        f" {prof_d['same'].latency(1, 1) * 1e3:.1f} / {prof_d['other'].latency(1, 1) * 1e3:.1f}"
        f" ms (same / other); link {link.latency * 1e6:.0f} us + {link.bandwidth / 1e9:.1f} GB/s")
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
                              passes=best.stats["target_passes"], tau=best.stats["tau"],
                              acceptance=best.stats["acceptance_rate"]))
    tot = {m: sum(r["seconds"] for r in per[m]) for m in per}
    toks = sum(r["tokens"] for r in per["fused"])
    steps = sum(r["passes"] for r in per["fused"])
    overhead = tot["host"] / tot["fused"] - 1
    per_step_ms = (tot["host"] - tot["fused"]) / steps * 1e3
    ratios = [h["seconds"] / f["seconds"] for f, h in zip(per["fused"], per["host"])]
    # The planner's prediction at the measured acceptance, for this k, fused and host.
    alpha = min(max(statistics.mean(r["acceptance"] for r in per["fused"]), 0.0), 1.0)
    if name == "ngram":
      spec = DrafterSpec(name="draft", kind="ngram")
      d_prof = {g: ModelProfile.per_token(0.0) for g in ("same", "other")}
    elif name == "self":
      spec = DrafterSpec(name="draft", kind="model", vocab_size=model.cfg.vocab_size)
      d_prof = {"same": prof_t, "other": prof_t}  # the same float model on either device
    else:
      spec = DrafterSpec(name="draft", kind="model", vocab_size=model.cfg.vocab_size)
      d_prof = prof_d
    pl = plan("target", spec, ["same", "other"], {"target": {"same": prof_t}, "draft": d_prof},
              alpha, k_max=args.k, links={("same", "other"): link})
    pred = {("fused" if c.drafter_group == "same" else "host"): c.tokens_per_s
            for c in pl.candidates if c.k == args.k}
    measured_steps = {m: tot[m] / steps for m in tot}
    results.append(dict(drafter=name, k=args.k, prompts=len(prompts), tokens=toks,
                        alpha=alpha, predicted_tok_s=pred, planner_choice=pl.best.describe(),
                        measured_step_ms={m: v * 1e3 for m, v in measured_steps.items()},
                        target_passes=steps, fused_tok_s=toks / tot["fused"],
                        host_tok_s=toks / tot["host"], overhead=overhead,
                        overhead_per_step_ms=per_step_ms,
                        per_prompt_ratio_median=statistics.median(ratios), runs=per))
    print(f"{name:10s} k={args.k}: fused {toks / tot['fused']:6.1f} tok/s, host"
          f" {toks / tot['host']:6.1f} tok/s, overhead {overhead * 100:+.1f}%"
          f" ({per_step_ms:+.2f} ms per step, {steps} steps; median per-prompt host/fused"
          f" {statistics.median(ratios):.3f})")
    print(f"{'':10s} planner at alpha={alpha:.2f}: fused {pred['fused']:6.1f} tok/s, host"
          f" {pred['host']:6.1f} tok/s predicted (the i.i.d. model's tokens per step;"
          f" measured tau {statistics.mean(r['tau'] for r in per['fused']):.2f});"
          f" it would choose: {pl.best.describe()}")
  write_json(args.out, dict(machine=machine(), max_new_tokens=args.max_new_tokens,
                            categories=args.categories, results=results,
                            when=time.strftime("%Y-%m-%d %H:%M")))


if __name__ == "__main__":
  main()
