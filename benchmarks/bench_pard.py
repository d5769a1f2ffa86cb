"""Parallel drafting (PARD) against the same draft model run sequentially, side by side.

One PARD draft (a directory written by `jaxspec train pard`, or any PARD-format checkpoint) drafts
for SmolLM2-135M (float32) in two ways at equal k:

  parallel    `ParallelDraft`: one pass over [before last, last, mask x (k - 1)]
  sequential  `DraftModel` of the same weights: a pass over two tokens, then k - 1 one-token
              passes (how a draft model drafts without the mask objective)

and reports:

  draft step  seconds of one jitted `propose` (k drafts) per drafter, on the dev prompts' rows
              (batch 1 and the batch of all prompts), timed interleaved, best of --reps;
              goal: parallel <= 0.4 x sequential
  tau         tokens per target pass of greedy `speculative_generate` over --prompts dev
              prompts (spec_bench_dev.jsonl, first turns, chat template), --new tokens each;
              goal: parallel tau >= 0.85 x sequential tau; with the speedup over plain decoding
              (best of --rounds, interleaved)

    .venv/bin/python benchmarks/bench_pard.py --draft DIR [--k 4] [--prompts 4] [--new 64]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from common import ROOT, chat_prompts, load_spec_bench, machine, write_json
from jaxspec import DraftModel, Sampling, generate, load, speculative_generate
from jaxspec.decoding.drafter import DraftContext
from jaxspec.drafters import load_pard


def _rows(prompts, width):
  ids = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  return jnp.asarray(ids), jnp.asarray([len(p) for p in prompts], jnp.int32)


def draft_step(drafter, prompts, k, max_len):
  """A function timing one `propose` of k drafts on the rows (after their prompts)."""
  ids, lens = _rows(prompts, max_len)
  params = drafter.params
  state = drafter.init(params, ids, lens, max_len)
  ctx = DraftContext(seq=ids, seq_len=lens, prompt_len=lens)
  sp = Sampling(temperature=0.0).arrays(len(prompts))
  keys = jax.random.split(jax.random.key(0), len(prompts))
  fn = jax.jit(lambda p, s: drafter.propose(p, s, ctx, k, sp, keys)[0].tokens)
  jax.block_until_ready(fn(params, state))  # compile

  def run():
    t = time.perf_counter()
    jax.block_until_ready(fn(params, state))
    return time.perf_counter() - t
  return run


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--draft", required=True, help="a PARD draft directory")
  ap.add_argument("--k", type=int, default=4)
  ap.add_argument("--prompts", type=int, default=4)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--reps", type=int, default=20)
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "pard.json"))
  args = ap.parse_args()
  target = load()
  par = load_pard(args.draft, target)
  seq = DraftModel(par.model)
  rows = load_spec_bench()[:args.prompts]
  prompts = chat_prompts(target, rows)
  max_len = max(map(len, prompts)) + args.new + 2 * args.k + 8
  summary = Path(args.draft) / "summary.json"
  result = dict(machine=machine(), target="SmolLM2-135M-Instruct float32",
                draft=dict(path=str(args.draft), layers=par.cfg.num_layers,
                           mask_id=par.mask_id, trained_k=par.trained_k,
                           training=json.loads(summary.read_text()) if summary.is_file()
                           else None),
                k=args.k, prompts=len(prompts), prompt_tokens=[len(p) for p in prompts],
                new_tokens=args.new, reps=args.reps, draft_step={}, generation={})

  # Draft step: batch 1 (each prompt in turn, the median over prompts of the best of reps) and
  # the batch of all prompts; the two drafters interleaved.
  for name, batches in (("batch1", [[p] for p in prompts]), (f"batch{len(prompts)}", [prompts])):
    best = {"parallel": [], "sequential": []}
    for b in batches:
      fns = {"parallel": draft_step(par, b, args.k, max_len),
             "sequential": draft_step(seq, b, args.k, max_len)}
      times = {n: [] for n in fns}
      for r in range(args.reps):
        for n in (list(fns) if r % 2 == 0 else list(fns)[::-1]):
          times[n].append(fns[n]())
      for n in fns:
        best[n].append(min(times[n]))
    row = {n: float(np.median(v)) for n, v in best.items()}
    row["ratio"] = row["parallel"] / row["sequential"]
    result["draft_step"][name] = row
    print(f"draft step {name}: parallel {row['parallel'] * 1e3:.2f} ms, sequential"
          f" {row['sequential'] * 1e3:.2f} ms, ratio {row['ratio']:.3f}", flush=True)
    write_json(Path(args.out), result)

  # Generation: greedy, the batch of prompts, tau and wall time against plain decoding.
  kw = dict(max_new_tokens=args.new, max_len=max_len)
  calls = {"plain": lambda: generate(target, prompts, **kw),
           "parallel": lambda: speculative_generate(target, par, prompts, num_draft_tokens=args.k,
                                                    **kw),
           "sequential": lambda: speculative_generate(target, seq, prompts,
                                                      num_draft_tokens=args.k, **kw)}
  outs = {n: f() for n, f in calls.items()}  # compile (and the tokens to compare)
  for n in ("parallel", "sequential"):
    np.testing.assert_array_equal(outs[n].tokens, outs["plain"].tokens, err_msg=n)
  secs = {n: [] for n in calls}
  for r in range(args.rounds):
    for n in (list(calls) if r % 2 == 0 else list(calls)[::-1]):
      t = time.perf_counter()
      calls[n]()
      secs[n].append(time.perf_counter() - t)
  gen = {n: dict(seconds=min(v)) for n, v in secs.items()}
  for n in ("parallel", "sequential"):
    st = outs[n].stats
    gen[n].update(tau=st["tau"], acceptance_rate=st["acceptance_rate"],
                  acceptance_per_position=st["acceptance_per_position"],
                  speedup=gen["plain"]["seconds"] / gen[n]["seconds"])
  gen["tau_ratio"] = gen["parallel"]["tau"] / gen["sequential"]["tau"]
  result["generation"] = gen
  print(f"tau: parallel {gen['parallel']['tau']:.3f}, sequential {gen['sequential']['tau']:.3f},"
        f" ratio {gen['tau_ratio']:.3f}; speedup over plain: parallel"
        f" {gen['parallel']['speedup']:.2f}x, sequential {gen['sequential']['speedup']:.2f}x",
        flush=True)
  write_json(Path(args.out), result)


if __name__ == "__main__":
  main()
