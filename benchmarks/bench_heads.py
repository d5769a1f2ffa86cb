"""Acceptance and speedup of the draft heads (and any other drafter) against plain `generate`.

SmolLM2-135M target, float32, greedy, EOS-stopping, chain drafting with a fixed k (default 4,
as the heads issue asks) or "auto", on the Spec-Bench dev prompts: the MT-bench categories (the
headline tau and speedup) and every other category (tau per category). For every prompt the
methods run back to back (interleaved, order alternating between prompts, so machine drift
cancels); compilation is excluded (`stats["seconds"]`), and each method runs once on the first
prompt before timing starts.

    .venv/bin/python benchmarks/bench_heads.py [--methods plain,eagle,medusa,mlp,ngram]
        [--k 4] [--max-new-tokens 256] [--per-category 2] [--others-per-category 1]

A method is "plain", "ngram", a bundled head's name, or NAME=PATH (a head directory or a draft
model), optionally with :tree=SPEC (a tree of SPEC nodes, or dynamic:DEPTH,TOPK,TOTAL; separate
the methods with ";" when a SPEC has commas). Chains vs trees (the tree issue's benchmark):

    .venv/bin/python benchmarks/bench_heads.py --others-per-category 0 --per-category 1 \
        --max-new-tokens 128 --out benchmarks/results/tree.json --methods \
        plain,eagle,eagle:tree=8,eagle:tree=16,eagle:tree=32,eagle:tree=64,medusa,medusa:tree=8,... The training time and data size of every head come from its config.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from common import MT_BENCH, ROOT, by_category, chat_prompts, load_spec_bench, machine, write_json
from jaxspec import generate, load, speculative_generate
from jaxspec.drafters import resolve_drafter


def _methods(spec: str, target):
  """Method labels -> drafters (None: plain). An item NAME[=PATH][:tree=SPEC] drafts a tree
  (`jaxspec.cli_options.parse_tree`: a size, dynamic:DEPTH,TOPK,TOTAL or paths), e.g.
  eagle:tree=32."""
  from jaxspec.cli_options import parse_tree
  out = {}
  for item in spec.split(";" if ";" in spec else ","):
    base, _, opt = item.partition(":")
    name, _, path = base.partition("=")
    if name == "plain":
      out[item] = None
      continue
    d = resolve_drafter(target, path or name)
    if opt:
      if not opt.startswith("tree="):
        raise SystemExit(f"error: method {item!r}: the only option is :tree=SPEC")
      d = d.with_tree(parse_tree(opt.removeprefix("tree="), d))
    out[item] = d
  return out


def _head_info(name: str, path: str | None) -> dict | None:
  from jaxspec.heads import ASSETS
  p = Path(path) if path else ASSETS / name
  cfg = p / "config.json"
  if not cfg.is_file():
    return None
  c = json.loads(cfg.read_text())
  meta = c.get("meta", {})
  return {k: meta.get(k) for k in ("steps", "train_seconds", "data_seconds", "train_rows",
                                    "train_tokens", "offline_tau", "offline_tau_k", "options",
                                    "recipe")} | {"path": str(p), "kind": c.get("kind")}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--methods", default="plain,eagle,medusa,mlp")
  ap.add_argument("--k", default="4", help="drafts per step, or auto")
  ap.add_argument("--max-new-tokens", type=int, default=256)
  ap.add_argument("--per-category", type=int, default=2, help="prompts per MT-bench category")
  ap.add_argument("--others-per-category", type=int, default=1,
                  help="prompts per other Spec-Bench category (0: MT-bench only)")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "heads.json"))
  args = ap.parse_args()
  k = args.k if args.k == "auto" else int(args.k)
  target = load()
  methods = _methods(args.methods, target)
  plain = "plain"
  if plain not in methods:
    raise SystemExit("error: --methods must include plain (speedups are measured against it)")
  rows = load_spec_bench()
  cats = by_category(rows, args.per_category, MT_BENCH)
  if args.others_per_category:
    others = tuple(c for c in dict.fromkeys(r["category"] for r in rows) if c not in MT_BENCH)
    cats.update(by_category(rows, args.others_per_category, others))
  n = args.max_new_tokens

  def run(m, prompt):
    if methods[m] is None:
      return generate(target, [prompt], max_new_tokens=n)
    d = methods[m]
    limit = d.max_draft_tokens  # an MLP speculator with 3 stages drafts at most 3
    kk = k if k == "auto" or limit is None else min(k, limit)
    if d.tree is not None:  # the tree sets how far it drafts
      kk = "auto"
    return speculative_generate(target, d, [prompt], max_new_tokens=n, num_draft_tokens=kk)

  first = chat_prompts(target, next(iter(cats.values()))[:1])[0]
  for m in methods:  # compile and warm up outside the timing
    run(m, first)
  res = {m: {} for m in methods}
  flip = False
  for cat, items in cats.items():
    for prompt in chat_prompts(target, items):
      order = list(methods)[::-1] if flip else list(methods)
      flip = not flip
      for m in order:
        o = run(m, prompt)
        st = o.stats
        d = res[m].setdefault(cat, dict(tokens=0, seconds=0.0, passes=0, acc=None))
        d["tokens"] += int(o.lengths.sum())
        d["seconds"] += st["seconds"]
        d["passes"] += st.get("target_passes", int(o.lengths.sum()))
        if "acceptance_per_position" in st:  # weighted by the prompt's verify passes
          v = np.asarray(st["acceptance_per_position"], np.float64) * st["target_passes"]
          d["acc"] = v if d["acc"] is None else d["acc"] + v
    line = [f"{cat:15s}"]
    for m in methods:
      d, base = res[m][cat], res[plain][cat]
      line.append(f"{m}: tau {d['tokens'] / max(d['passes'], 1):.2f}"
                  f" {base['seconds'] / d['seconds']:.2f}x")
    print("  ".join(line), flush=True)

  def summary(m, which):
    ds = [res[m][c] for c in which if c in res[m]]
    base = sum(res[plain][c]["seconds"] for c in which if c in res[plain])
    tok, sec = sum(d["tokens"] for d in ds), sum(d["seconds"] for d in ds)
    passes = sum(d["passes"] for d in ds)
    out = dict(tokens=tok, seconds=sec, tokens_per_second=tok / sec, speedup=base / sec,
               tau=tok / max(passes, 1))
    acc = [d["acc"] for d in ds if d["acc"] is not None]
    if acc:
      out["acceptance_per_position"] = (np.sum(acc, 0) / max(passes, 1)).round(4).tolist()
    return out

  mt = [c for c in cats if c in MT_BENCH]
  result = dict(machine=machine(), max_new_tokens=n, num_draft_tokens=args.k,
                prompts_per_category=args.per_category, others_per_category=args.others_per_category,
                command="benchmarks/bench_heads.py " + " ".join(
                    f"--{key.replace('_', '-')} {v}" for key, v in vars(args).items()
                    if key != "out"),
                heads={m: _head_info(*(item.partition(":")[0].partition("=")[::2]))
                       for m, item in zip(methods, methods)
                       if item.partition(":")[0].partition("=")[0] not in ("plain", "ngram")},
                trees={m: d.tree.describe() for m, d in methods.items()
                       if d is not None and d.tree is not None},
                mt_bench={m: summary(m, mt) for m in methods},
                all_categories={m: summary(m, list(cats)) for m in methods},
                per_category={m: {c: summary(m, [c]) for c in cats} for m in methods})
  print("MT-bench:", {m: f"tau {s['tau']:.2f} {s['speedup']:.2f}x"
                      for m, s in result["mt_bench"].items()})
  write_json(Path(args.out), result)


if __name__ == "__main__":
  main()
