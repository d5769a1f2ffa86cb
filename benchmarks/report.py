"""Markdown tables from benchmarks/results/*.json (pasted into the README's performance section).

    .venv/bin/python benchmarks/report.py
"""

import json
from pathlib import Path

RES = Path(__file__).resolve().parent / "results"


def main():
  g = json.loads((RES / "generate.json").read_text())
  m = g["machine"]
  print(f"Machine: {m['cpu']}, {m['cores']} cores, {m['backend']}; jax {m['jax']}; commit"
        f" {m['git_commit']}; {m['date']}.\n")
  b1 = g["batch1"]
  print("**Plain decoding** (`benchmarks/bench_generate.py`: greedy, 128 new tokens, first 10"
        " Spec-Bench prompts, compile excluded, best of 2 runs per prompt)\n")
  print("| batch | tokens/s | note |\n|---|---|---|")
  print(f"| 1 | {b1['tokens_per_second']:.1f} | {b1['fraction_of_bound']:.0%} of the bandwidth"
        f" bound ({g['weight_bytes'] / 1e6:.0f} MB of weights per token at"
        f" {g['bandwidth']['bound_gbs']:.1f} GB/s measured copy bandwidth ="
        f" {b1['bound_tokens_per_second']:.1f} tokens/s) |")
  for key in sorted((k for k in g if k.startswith("batch") and k != "batch1"),
                    key=lambda k: int(k[5:])):
    print(f"| {key[5:]} | {g[key]['tokens_per_second']:.1f} | |")
  s = json.loads((RES / "speculative.json").read_text())
  print(f"\n**N-gram speculation vs plain decoding** (`benchmarks/bench_speculative.py"
        f" --per-category {s['per_category']} --repeats {s.get('repeats', 1)}`: batch 1,"
        f" greedy, EOS-stopping, up to {s['max_new_tokens']} new tokens, k ="
        f" {s['num_draft_tokens']}, max_ngram {s['max_ngram']}; the first"
        f" {s['per_category']} prompts of every category; time includes the prefill)\n")
  print("| category | τ | acceptance by position | plain tok/s | speculative tok/s | speedup |")
  print("|---|---|---|---|---|---|")
  for cat, r in s["categories"].items():
    acc = " ".join(f"{a:.2f}" for a in r["acceptance_per_position"])
    print(f"| {cat} | {r['tau']:.2f} | {acc} | {r['plain_tokens_per_second']:.1f} |"
          f" {r['spec_tokens_per_second']:.1f} | {r['speedup']:.2f}× |")
  print(f"| **all** | | | | | {s['overall']['speedup']:.2f}× |")
  vc_path = RES / "verify_cost.json"
  vc = json.loads(vc_path.read_text())["verify_cost"] if vc_path.exists() else s.get("verify_cost")
  if vc:
    ks = sorted(next(iter(vc.values()))["verify_over_decode"], key=int)
    print("\n**Cost of one verify pass of k+1 tokens relative to one decode step** (256 cached"
          " tokens; `bench_speculative.py --verify-cost-only`)\n")
    print("| batch | decode step | " + " | ".join(f"k={k}" for k in ks) + " |")
    print("|---|---|" + "---|" * len(ks))
    for b, r in vc.items():
      print(f"| {b} | {r['decode_step_seconds'] * 1e3:.1f} ms | "
            + " | ".join(f"{r['verify_over_decode'][k]:.2f}" for k in ks) + " |")

  for name in ("adaptive.json", "adaptive_sweep.json", "adaptive_eagle.json",
               "adaptive_medusa.json", "adaptive_mlp.json", "adaptive_draft_model.json"):
    if (RES / name).exists():
      adaptive(json.loads((RES / name).read_text()))
  if (RES / "heads.json").exists():
    heads(json.loads((RES / "heads.json").read_text()))


def adaptive(a):
  """Tables of benchmarks/bench_adaptive.py."""
  m = a["machine"]
  where = f"commit {m['git_commit']}, {m['date']}"
  if "batch_sweep" in a:
    print(f"\n**Batch sweep, `auto` vs plain `generate`** (`{a['command']}`; drafter"
          f" {a['drafter']}; mixed categories, prompts ≤ 256 tokens, greedy; {where})\n")
    print("| batch | plain tok/s | auto tok/s | auto / plain | mean k | τ |\n|---|---|---|---|---|---|")
    for b, r in a["batch_sweep"].items():
      print(f"| {b} | {r['plain']['tokens_per_second']:.1f} | {r['auto']['tokens_per_second']:.1f}"
            f" | {r['ratio']:.2f}× | {r['auto']['mean_k']:.2f} | {r['auto']['tau']:.2f} |")
  if "batch1" in a:
    b1 = a["batch1"]
    methods = list(b1)
    print(f"\n**Batch 1, every fixed k vs `auto`** (`{a['command']}`; drafter {a['drafter']};"
          f" speedup over plain `generate` in the same run; {where})\n")
    names = {"plain": "plain", "auto": "auto", "masked": "auto, one masked width"}
    print("| category | " + " | ".join(names.get(x, f"k={x}") for x in methods[1:]) + " |")
    print("|---|" + "---|" * (len(methods) - 1))
    for cat in b1["plain"]["per_category"]:
      print(f"| {cat} | " + " | ".join(
          f"{b1[x]['per_category'][cat]['speedup']:.2f}×" for x in methods[1:]) + " |")
    print("| **all** | " + " | ".join(f"**{b1[x]['speedup']:.2f}×**" for x in methods[1:])
          + " |")
    print(f"\nauto / best fixed k (k={a['batch1_best_fixed_k']}):"
          f" {a['batch1_auto_vs_best_fixed']:.3f}")


def heads(h):
  """Tables of benchmarks/bench_heads.py."""
  m = h["machine"]
  methods = [x for x in h["mt_bench"] if x != "plain"]
  print(f"\n**Draft heads** (`{h['command']}`; batch 1, greedy, EOS-stopping, k ="
        f" {h['num_draft_tokens']} chain; commit {m['git_commit']}, {m['date']})\n")
  print("| | " + " | ".join(methods) + " |\n|---|" + "---|" * len(methods))
  mt, al = h["mt_bench"], h["all_categories"]
  print("| τ, MT-bench categories | " + " | ".join(f"**{mt[x]['tau']:.2f}**" for x in methods)
        + " |")
  print("| speedup, MT-bench categories | "
        + " | ".join(f"**{mt[x]['speedup']:.2f}×**" for x in methods) + " |")
  print("| acceptance by position (MT-bench) | " + " | ".join(
      " ".join(f"{v:.2f}" for v in mt[x].get("acceptance_per_position", [])) for x in methods)
        + " |")
  print("| τ, all categories | " + " | ".join(f"{al[x]['tau']:.2f}" for x in methods) + " |")
  print("| speedup, all categories | " + " | ".join(f"{al[x]['speedup']:.2f}×" for x in methods)
        + " |")
  for cat in h["per_category"]["plain"]:
    print(f"| {cat} | " + " | ".join(
        f"τ {h['per_category'][x][cat]['tau']:.2f}, {h['per_category'][x][cat]['speedup']:.2f}×"
        for x in methods) + " |")
  info = h.get("heads") or {}
  if info:
    print("\n| head | training steps | training time | data (rows, response tokens) |"
          " data time | offline τ (held out) |\n|---|---|---|---|---|---|")
    for name, d in info.items():
      if d:
        tau = d.get("offline_tau")
        print(f"| {name} | {d.get('steps')} | {(d.get('train_seconds') or 0) / 60:.0f} min |"
              f" {d.get('train_rows')}, {d.get('train_tokens')} |"
              f" {(d.get('data_seconds') or 0) / 60:.0f} min |"
              f" {'' if tau is None else f'{tau:.2f}'} |")


if __name__ == "__main__":
  main()
