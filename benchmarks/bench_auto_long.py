"""`num_draft_tokens="auto"` against plain decoding on long prompts (1,000+ tokens).

SmolLM2-135M target, float32, greedy, batch 1, the Spec-Bench dev set's summarization and RAG
prompts of at least `--min-tokens` tokens (chat-formatted), `--new-tokens` new tokens each: with
SmolLM2's tokenizer 13 summarization prompts reach 1,000 tokens (1,002-1,508) and no RAG prompt
does (the longest is 902), so the default 4 per category takes the first 4 summarization ones.
For every prompt, plain `generate` and "auto" with each drafter (the n-gram and the bundled
EAGLE head) run back to back, interleaved (the order alternates between repeats, so a slow
spell of a shared machine hits every method), all warmed up first (compilation and the one-off
cost measurement excluded). Every method shares one cache size (`max_len`), so the loops compile
once and only the prefill recompiles per prompt width.

Per prompt the paired ratio plain seconds / auto seconds (each method's best of `--repeats`);
overall the median of the paired ratios and the ratio of summed times. "auto" promises never
to be slower than plain: every median >= 1 (within timing noise) is the pass condition.

What "auto" carries from one call to the next (`AutoK.carry`: the pooled acceptance where the
last call of the same target, drafter and sampling ended) never comes from the prompt being
timed: with `--carry previous` (the default, an evaluation loop's steady state) every call of a
prompt, warm-up included, starts from what the previous prompt's last call left (the first
prompt from nothing); with `--carry none` every call starts from the prior (a first call).

    .venv/bin/python benchmarks/bench_auto_long.py [--per-category 4] [--new-tokens 64]
        [--repeats 3] [--drafters ngram,eagle] [--carry previous|none]
        [--out benchmarks/results/auto_long.json]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from common import ROOT, chat_prompts, load_spec_bench, machine, write_json
from jaxspec import generate, load, speculative_generate
from jaxspec.drafters import resolve_drafter
from jaxspec.engine import DEFAULT
from jaxspec.engine.io import round_up


def long_prompts(model, per_category: int, min_tokens: int):
  """The first `per_category` prompts of each of summarization and RAG with >= min_tokens."""
  out = []
  for cat in ("summarization", "rag"):
    rows = [r for r in load_spec_bench() if r["category"] == cat]
    taken = 0
    for r, ids in zip(rows, chat_prompts(model, rows)):
      if len(ids) >= min_tokens and taken < per_category:
        out.append((cat, r["question_id"], ids))
        taken += 1
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--per-category", type=int, default=4)
  ap.add_argument("--min-tokens", type=int, default=1000)
  ap.add_argument("--new-tokens", type=int, default=64)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--drafters", default="ngram,eagle")
  ap.add_argument("--carry", choices=("previous", "none"), default="previous")
  ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/auto_long.json")
  args = ap.parse_args()

  model = load("smollm2-135m")
  prompts = long_prompts(model, args.per_category, args.min_tokens)
  drafters = {name: resolve_drafter(model, name) for name in args.drafters.split(",")}
  methods = ["plain"] + [f"auto-{d}" for d in drafters]
  n = args.new_tokens
  # One cache size for every prompt and method (8 slots a step may write past, rounded).
  max_len = round_up(max(len(p) for _, _, p in prompts) + n + 8 + 1, 128)

  # Per method, what the previous prompt's last "auto" call left (`AutoK.carry`), and what
  # this prompt's last call left.
  carried, latest = {}, {}

  def run(method, ids):
    if method == "plain":
      return generate(model, [ids], max_new_tokens=n, max_len=max_len)
    DEFAULT.acceptance.clear()
    DEFAULT.acceptance.update(carried.get(method, {}))
    out = speculative_generate(model, drafters[method[5:]], [ids], max_new_tokens=n,
                               num_draft_tokens="auto", max_len=max_len)
    latest[method] = dict(DEFAULT.acceptance)
    return out

  print(f"{len(prompts)} prompts of {min(len(p) for *_, p in prompts)}-"
        f"{max(len(p) for *_, p in prompts)} tokens, {n} new tokens, max_len {max_len}",
        flush=True)
  rows = []
  for cat, qid, ids in prompts:
    for m in methods:  # warm-up: compile (and time the costs for "auto") outside the timing
      run(m, ids)
    secs = {m: [] for m in methods}
    last = {}
    for r in range(args.repeats):
      for m in (methods if r % 2 == 0 else methods[::-1]):
        out = run(m, ids)
        secs[m].append(out.stats["seconds"])
        last[m] = out
    if args.carry == "previous":
      carried = dict(latest)  # the next prompt's calls start from here
    row = dict(category=cat, question_id=qid, prompt_tokens=len(ids),
               seconds={m: min(v) for m, v in secs.items()},
               all_seconds=secs, tokens=int(last["plain"].lengths[0]))
    for m in methods[1:]:
      st = last[m].stats
      row[m] = dict(ratio=row["seconds"]["plain"] / row["seconds"][m], mean_k=st["mean_k"],
                    plain_steps=st["plain_steps"], target_passes=st["target_passes"],
                    acceptance_rate=st["acceptance_rate"],
                    acceptance_carried=st["acceptance_carried"],
                    cost_model=st["cost_model"].to_dict(),
                    same_tokens=bool(np.array_equal(last[m].tokens, last["plain"].tokens)))
    rows.append(row)
    print(f"{cat:13s} q{qid:<4d} {len(ids):5d} tok  plain {row['seconds']['plain']:.2f}s  "
          + "  ".join(f"{m} {row[m]['ratio']:.3f}x (mean k {row[m]['mean_k']:.2f},"
                      f" {row[m]['plain_steps']}/{row[m]['target_passes']} plain)"
                      for m in methods[1:]), flush=True)

  summary = {}
  for m in methods[1:]:
    ratios = [r[m]["ratio"] for r in rows]
    summary[m] = dict(
        median_ratio=float(np.median(ratios)), min_ratio=float(min(ratios)),
        total_ratio=float(sum(r["seconds"]["plain"] for r in rows)
                          / sum(r["seconds"][m] for r in rows)),
        same_tokens=all(r[m]["same_tokens"] for r in rows))
    print(f"{m}: median paired ratio (plain s / auto s) {summary[m]['median_ratio']:.3f},"
          f" total {summary[m]['total_ratio']:.3f}, min {summary[m]['min_ratio']:.3f},"
          f" tokens equal to plain: {summary[m]['same_tokens']}")
  write_json(args.out, dict(machine=machine(), new_tokens=n, max_len=max_len,
                            repeats=args.repeats, carry=args.carry, summary=summary,
                            prompts=rows))


if __name__ == "__main__":
  main()
