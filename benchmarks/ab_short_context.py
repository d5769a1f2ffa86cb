"""Short-context A/B of two checkouts: plain and n-gram (k = 4) tokens/s on the bundled SmolLM2,
batch 1, greedy, 128 new tokens, one chat-formatted MT-bench prompt per category (the first of
each in ../shared/data/spec_bench_dev.jsonl). Issue 45's "no regression at short contexts".

    # one side per process, alternating, e.g. the commit before issue 45 (794a171) in a worktree:
    git worktree add --detach /tmp/base 794a171 && ln -s $PWD/.venv /tmp/base/.venv
    for r in 1 2 3; do for side in /tmp/base $PWD; do   # reverse the order on even rounds
      .venv/bin/python benchmarks/ab_short_context.py $side OUT_$(basename $side)_$r.json
    done; done
    .venv/bin/python benchmarks/ab_short_context.py --compare OUT_base_*.json -- OUT_main_*.json

The prompt ids are encoded once by this checkout and written beside the outputs (prompts.json),
so both sides decode the same ids; each side imports jaxspec from its own checkout.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time


def _prompts(path: str) -> list[list[int]]:
  if os.path.exists(path):
    return json.load(open(path))
  here = os.path.dirname(os.path.abspath(__file__))
  sys.path.insert(0, here)
  from common import MT_BENCH, by_category, chat_prompts, load_spec_bench
  from jaxspec import load
  rows = [r for c in by_category(load_spec_bench(), 1, tuple(MT_BENCH)).values() for r in c]
  ids = [list(map(int, x)) for x in chat_prompts(load("smollm2-135m"), rows)]
  json.dump(ids, open(path, "w"))
  return ids


def run(root: str, out: str) -> None:
  prompts_path = os.path.join(os.path.dirname(os.path.abspath(out)), "prompts.json")
  prompts = _prompts(prompts_path)  # encoded by this checkout, before switching
  sys.path.insert(0, root)
  for name in [m for m in sys.modules if m == "jaxspec" or m.startswith("jaxspec.")]:
    del sys.modules[name]
  import numpy as np
  import jaxspec
  from jaxspec import generate, load, speculative_generate
  from jaxspec.drafters import NGram
  if not jaxspec.__file__.startswith(os.path.abspath(root)):
    raise SystemExit(f"imported {jaxspec.__file__}, not {root}'s jaxspec")
  m = load("smollm2-135m")
  methods = {"plain": lambda ids: generate(m, [ids], max_new_tokens=128),
             "ngram": lambda ids: speculative_generate(m, NGram(), [ids], max_new_tokens=128,
                                                       num_draft_tokens=4)}
  res = {}
  for name, fn in methods.items():
    fn(prompts[0])  # compile outside the timing
    toks, secs, outs = 0, 0.0, []
    for ids in prompts:
      t = time.perf_counter()
      o = fn(ids)
      secs += time.perf_counter() - t
      toks += int(np.asarray(o.lengths).sum())
      outs.append(np.asarray(o.tokens)[0].tolist())
    res[name] = dict(tokens=toks, seconds=secs, tok_s=toks / secs, outs=outs)
    print(name, round(toks / secs, 2), flush=True)
  json.dump(dict(root=root, commit=os.popen(f"git -C {root} rev-parse --short HEAD").read().strip(),
                 results=res), open(out, "w"))


def compare(a: list[str], b: list[str]) -> dict:
  """Median tokens/s of each side and their ratio (b / a); outputs equal across every run."""
  ra = [json.load(open(p))["results"] for p in a]
  rb = [json.load(open(p))["results"] for p in b]
  out = {}
  for k in ra[0]:
    ma = statistics.median(r[k]["tok_s"] for r in ra)
    mb = statistics.median(r[k]["tok_s"] for r in rb)
    same = all(r[k]["outs"] == ra[0][k]["outs"] for r in ra + rb)
    out[k] = dict(a=[r[k]["tok_s"] for r in ra], b=[r[k]["tok_s"] for r in rb],
                  median_ratio=mb / ma, same_tokens=same)
    print(f"{k}: {ma:.2f} -> {mb:.2f} tokens/s (median of {len(ra)}/{len(rb)}), ratio"
          f" {mb / ma:.3f}, tokens equal: {same}")
  return out


if __name__ == "__main__":
  if sys.argv[1] == "--compare":
    i = sys.argv.index("--")
    compare(sys.argv[2:i], sys.argv[i + 1:])
  else:
    run(sys.argv[1], sys.argv[2])
