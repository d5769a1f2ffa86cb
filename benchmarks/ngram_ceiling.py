"""How far prompt lookup can go on a prompt set: tau of the n-gram rule and of an oracle lookup.

For every prompt the target's greedy continuation (EOS-stopping, up to --max-new-tokens) is
generated once; then drafting is replayed offline over it. At each step a drafter proposes k
tokens from the prompt and the text so far, the accepted count is the proposal's common prefix
with the real continuation, and the step emits that plus one. Rules compared:

* `recent`: jaxspec's `NGram` (longest suffix of max_ngram..min_ngram tokens, most recent match),
* `oracle`: among every earlier match of that longest suffix, the one whose continuation turns out
  longest: an upper bound for any rule that copies a continuation of the longest match (and so
  for a tree of all of them verified at no extra cost).

It then bounds the speedup: time = prefill + steps x decode step x verify(k)/decode, with the
prefill and the decode step measured here per prompt and verify(k)/decode measured here too
(batch 1, `--context` cached tokens, as bench_speculative.py measures it), at the best k for
each rule. No drafter that copies the longest match does better than the oracle at that cost.

    .venv/bin/python benchmarks/ngram_ceiling.py [--categories summarization,rag] [--per-category 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from common import ROOT, by_category, chat_prompts, load_spec_bench, machine, write_json
from bench_speculative import verify_cost
from jaxspec import NGram, generate, load


def _accepted(cont: np.ndarray, future: np.ndarray) -> int:
  n = min(len(cont), len(future))
  neq = np.nonzero(cont[:n] != future[:n])[0]
  return int(neq[0]) if len(neq) else n


def replay(prompt: np.ndarray, out: np.ndarray, k: int, rule: str, max_ngram: int = 3,
           min_ngram: int = 1) -> tuple[int, int]:
  """(emitted tokens, target passes) for drafting `out` after `prompt` with `rule`."""
  full = np.concatenate([prompt, out])
  t, passes = 0, 0
  while t < len(out):
    n = len(prompt) + t  # known tokens
    seq = full[:n]
    acc = 0
    for g in range(max_ngram, min_ngram - 1, -1):
      if n <= g:
        continue
      win = np.lib.stride_tricks.sliding_window_view(seq[:n - 1], g)  # starts j, j+g <= n-1
      starts = np.nonzero((win == seq[n - g:]).all(axis=1))[0]
      if len(starts) == 0:
        continue
      future = out[t:t + k]
      if rule == "recent":
        starts = starts[-1:]
      acc = max(_accepted(full[j + g:min(j + g + k, n)], future) for j in starts)
      break
    acc = min(acc, len(out) - t - 1)
    t += acc + 1
    passes += 1
  return len(out), passes


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--categories", default="summarization,rag")
  ap.add_argument("--per-category", type=int, default=3)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--ks", default="1,2,3,4,5,6,7,8")
  ap.add_argument("--context", type=int, default=768,
                  help="cached tokens for the verify-cost pass (these prompts' length)")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ngram_ceiling.json"))
  args = ap.parse_args()
  model = load()
  ks = [int(k) for k in args.ks.split(",")]
  cost = verify_cost(model, batch_sizes=(1,), ks=ks, context=args.context)[1]["verify_over_decode"]
  d = NGram()
  cats = by_category(load_spec_bench(), args.per_category,
                     tuple(c for c in args.categories.split(",") if c) or None)
  result = dict(machine=machine(), max_new_tokens=args.max_new_tokens, context=args.context,
                verify_cost=cost,
                categories={})
  for cat, rows in cats.items():
    per_rule = {r: {k: [0, 0] for k in ks} for r in ("recent", "oracle")}
    times = []
    for p in chat_prompts(model, rows):
      # EOS-stopping: generate's default stop ids are the model's EOS ids
      generate(model, [p], max_new_tokens=1)
      generate(model, [p], max_new_tokens=args.max_new_tokens)  # compile both first
      t1 = min(generate(model, [p], max_new_tokens=1).stats["seconds"] for _ in range(2))
      o = min((generate(model, [p], max_new_tokens=args.max_new_tokens) for _ in range(2)),
              key=lambda o: o.stats["seconds"])
      out = np.asarray(o.row(0))
      step = (o.stats["seconds"] - t1) / max(len(out) - 1, 1)
      prompt = np.asarray(p)
      rec = dict(prompt_tokens=len(p), new_tokens=len(out), prefill_seconds=t1,
                 decode_step_seconds=step, plain_seconds=o.stats["seconds"])
      # The first token comes from the prefill; drafting covers the rest.
      for r in per_rule:
        for k in ks:
          e, n = replay(np.concatenate([prompt, out[:1]]), out[1:], k, r, d.max_ngram,
                        d.min_ngram)
          per_rule[r][k][0] += e
          per_rule[r][k][1] += n
          rec[f"{r}_k{k}_seconds"] = t1 + n * step * cost[k]
      times.append(rec)
    plain = sum(x["plain_seconds"] for x in times)
    res = dict(prompts=len(times), new_tokens=sum(x["new_tokens"] for x in times),
               prefill_share=sum(x["prefill_seconds"] for x in times) / plain, rules={})
    for r in per_rule:
      best = min(ks, key=lambda k: sum(x[f"{r}_k{k}_seconds"] for x in times))
      res["rules"][r] = dict(
          tau={k: e / max(n, 1) for k, (e, n) in per_rule[r].items()}, best_k=best,
          speedup_bound=plain / sum(x[f"{r}_k{best}_seconds"] for x in times))
    result["categories"][cat] = dict(res, prompts_detail=times)
    print(f"{cat:14s} prefill share {res['prefill_share']:.2f}; "
          + "; ".join(f"{r}: tau(k=4) {v['tau'][4]:.2f}, tau(k=8) {v['tau'][8]:.2f},"
                      f" bound {v['speedup_bound']:.2f}x at k={v['best_k']}"
                      for r, v in res["rules"].items() if 4 in v["tau"] and 8 in v["tau"]),
          flush=True)
  write_json(Path(args.out), result)


if __name__ == "__main__":
  main()
