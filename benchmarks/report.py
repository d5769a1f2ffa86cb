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


if __name__ == "__main__":
  main()
