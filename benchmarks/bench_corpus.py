"""How fast `write_corpus` has the bundled SmolLM2-135M write a self-distillation corpus here:
answer tokens per second, compilation excluded.

    .venv/bin/python benchmarks/bench_corpus.py [--batches 2] [--gen-batch-size 16] \
        [--max-new-tokens 256] [--turns 2] [--magpie-fraction 0.5] [--label NAME] [--out FILE]

A warm-up call writes the same batches into a throwaway corpus first, so the timed call (a
fresh corpus, the same settings) finds every program it runs compiled. The prompts are the
training prompt files of ../shared/data (never the evaluation set), at most --max-prompts of
them. The same script runs on an older checkout (`git worktree add`) for a side-by-side
number: it only calls `write_corpus`. Prints one line and, with --out, writes it as JSON with
the machine.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import time
from pathlib import Path

from common import ROOT, machine, write_json

DATA = ROOT.parent / "shared" / "data"
FILES = ("gsm8k_train.jsonl", "humaneval.jsonl", "self_instruct_seed_tasks.jsonl")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batches", type=int, default=2)
  ap.add_argument("--gen-batch-size", type=int, default=16)
  ap.add_argument("--max-new-tokens", type=int, default=256)
  ap.add_argument("--max-len", type=int, default=1024)
  ap.add_argument("--turns", type=int, default=2)
  ap.add_argument("--magpie-fraction", type=float, default=0.5)
  ap.add_argument("--max-prompts", type=int, default=256)
  ap.add_argument("--seed", type=int, default=5)
  ap.add_argument("--work", default="/tmp/bench_corpus")
  ap.add_argument("--label", default="")
  ap.add_argument("--out", default=None)
  args = ap.parse_args()

  from jaxspec import load
  from jaxspec.train.corpus import CorpusConfig, write_corpus
  from jaxspec.train.data import read_prompts

  work = Path(args.work) / (args.label or "run")
  if work.exists():
    shutil.rmtree(work)
  target = load(scan_layers=True)  # what `jaxspec train-data` loads on a CPU
  prompts, _, files = read_prompts([DATA / f for f in FILES], max_prompts=args.max_prompts,
                                   seed=args.seed, with_files=True, all_turns=True)
  cfg = CorpusConfig(turns=args.turns, max_new_tokens=args.max_new_tokens,
                     magpie_fraction=args.magpie_fraction, batch_size=args.gen_batch_size,
                     max_len=args.max_len, max_prompt_len=min(512, args.max_len // 2),
                     seed=args.seed)
  kw = dict(token_budget=10**9, sources=list(FILES), prompt_sources=files, progress=False)
  t = time.perf_counter()
  write_corpus(target, prompts, work / "warm", cfg, max_batches=args.batches, **kw)
  warm_s = time.perf_counter() - t
  t = time.perf_counter()
  s = write_corpus(target, prompts, work / "timed", cfg, max_batches=args.batches, **kw)
  dt = time.perf_counter() - t
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, text=True,
                          capture_output=True).stdout.strip()
  row = {"label": args.label, "commit": commit, "seconds": round(dt, 1),
         "warm_up_seconds": round(warm_s, 1), "batches": args.batches,
         "conversations": s.conversations, "answer_tokens": s.loss_tokens, "tokens": s.tokens,
         "answer_tokens_per_second": round(s.loss_tokens / dt, 2),
         "settings": {k: v for k, v in vars(args).items() if k not in ("work", "out", "label")}}
  print(f"[bench_corpus] {args.label or commit}: {s.conversations} conversations,"
        f" {s.loss_tokens:,} answer tokens in {dt:.0f} s: {s.loss_tokens / dt:.1f} answer"
        f" tokens/s (warm-up with compilation {warm_s:.0f} s)", flush=True)
  if args.out:
    write_json(Path(args.out), {"machine": machine(), "rows": [row]})


if __name__ == "__main__":
  main()
