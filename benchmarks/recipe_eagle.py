"""The recipe of the bundled EAGLE-3 head's second round: more and more varied data, the first
round's head trained further on it.

    .venv/bin/python benchmarks/recipe_eagle.py --out /tmp/heads8 \
        [--file-prompts 700] [--self-instructions 1000] [--steps 400] [--lr 4e-4]

Stages (each skipped when its output is there, so an interrupted run is rerun as is):
1. the target (the bundled SmolLM2-135M) writes `--self-instructions` user requests itself
   (Magpie: sampled after its chat template's bare user-turn prefix), kept in instructions.json;
2. it answers them and `--file-prompts` prompts drawn evenly from the three training files of
   ../shared/data (never the Spec-Bench evaluation prompts), greedy and at T 0.7, 128 tokens at
   most, stored with its hidden states (`jaxspec.train.data.write_dataset`) in OUT/data;
3. the bundled EAGLE-3 head (round one when round two ran: 582 rows, 59k tokens, 600 steps) is
   trained on it for `--steps` steps of 8 rows cropped to 128-token windows
   (`jaxspec.train.train_head(..., head=...)`; the CLI's `jaxspec train eagle --init eagle` does
   the same), saved in OUT/eagle.

What it cost and gave is in the head's config.json (meta) and docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from common import ROOT
from jaxspec import load
from jaxspec.heads import head_kind
from jaxspec.heads.io import load_head_model, save_head
from jaxspec.train import train_head
from jaxspec.train.data import (SELF_INSTRUCTIONS, DataConfig, Dataset, make_progress,
                                read_prompts, target_instructions, write_dataset)

FILES = ("gsm8k_train.jsonl", "humaneval.jsonl", "self_instruct_seed_tasks.jsonl")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
  ap.add_argument("--file-prompts", type=int, default=700)
  ap.add_argument("--self-instructions", type=int, default=1000)
  ap.add_argument("--steps", type=int, default=400)
  ap.add_argument("--lr", type=float, default=4e-4)
  ap.add_argument("--seed", type=int, default=8)
  args = ap.parse_args()
  out = Path(args.out)
  out.mkdir(parents=True, exist_ok=True)
  target = load()
  _, head, config = load_head_model(target, "eagle")
  layers = tuple(head.cfg.layers)
  data_dir = out / "data"
  if not (data_dir / "meta.json").is_file():
    prompts, counts = read_prompts([Path(args.data_dir) / f for f in FILES],
                                   max_prompts=args.file_prompts, seed=args.seed)
    own, secs = own_instructions(target, out, args.self_instructions, args.seed)
    seconds = {} if secs is None else {"instructions": secs}
    counts[SELF_INSTRUCTIONS] = len(own)
    cfg = DataConfig(max_new_tokens=128, temperatures=(0.0, 0.7), batch_size=48,
                     hidden_layers=layers, seed=args.seed)
    write_dataset(target, prompts + own, data_dir, cfg, prompt_files=counts, seconds=seconds,
                  progress="lines")
  ds = Dataset(data_dir, layers=layers, window=128)
  train_and_save(target, head, ds, out, steps=args.steps, lr=args.lr, eval_every=50, meta={
      "data": str(data_dir),
      # Round one when round two ran; whichever head is bundled when this runs.
      "init": head_origin("eagle", config),
      "data_seconds": round(sum(ds.meta.get("seconds", {}).values()), 1),
      "data_prompt_files": ds.meta.get("prompt_files"),
      "data_temperatures": ds.meta.get("generation", {}).get("temperatures"),
      "recipe": recipe_line("benchmarks/recipe_eagle.py", args, ("out", "data_dir"))})


def head_origin(name: str, config: dict) -> str:
  """A trained head's starting point for its record: `name` and the recipe line of the head it
  names (from its config.json's meta)."""
  return f"{name} ({config.get('meta', {}).get('recipe', 'no recipe recorded')})"


def recipe_line(script: str, args, skip=()) -> str:
  """The command line that reruns `script` with `args` (an argparse namespace), leaving out
  the options in `skip` (paths of this machine)."""
  return script + " " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items()
                                 if k not in skip)


def add_online_training_args(ap: argparse.ArgumentParser, *, train_minutes: float, steps: int,
                             batch_size: int, seq_len: int, eval_every: int) -> None:
  """The options of a recipe that trains the head online on packed corpus rows (these
  defaults), and --work / --out."""
  ap.add_argument("--work", required=True, help="the corpus and checkpoints (not returned)")
  ap.add_argument("--out", required=True, help="the trained head and its record")
  ap.add_argument("--train-minutes", type=float, default=train_minutes)
  ap.add_argument("--steps", type=int, default=steps)
  ap.add_argument("--batch-size", type=int, default=batch_size)
  ap.add_argument("--seq-len", type=int, default=seq_len)
  ap.add_argument("--lr", type=float, default=3e-4)
  ap.add_argument("--eval-every", type=int, default=eval_every)
  ap.add_argument("--shuffle-window", type=int, default=8,
                  help="corpus shards whose rows are shuffled together (PackedCorpus): batches"
                       " mix the greedy, sampled and Magpie batches and the corpora mixed in")
  ap.add_argument("--init", default="eagle",
                  help="the head to train further (dir or name; its kind is the kind trained)")


def parse_with_dirs(ap: argparse.ArgumentParser, argv) -> tuple[argparse.Namespace, Path, Path]:
  """`ap`'s arguments, and its --work and --out directories (created)."""
  args = ap.parse_args(argv)
  work, out = Path(args.work), Path(args.out)
  work.mkdir(parents=True, exist_ok=True)
  out.mkdir(parents=True, exist_ok=True)
  return args, work, out


def train_online(target, head, data, args, work: Path, *, warmup_steps: int,
                 eval_batches: int, log_every: int) -> tuple[Any, dict, float]:
  """Trains `head` on `data` (packed rows) with the target's hidden states computed in the
  step, as `args` says (add_online_training_args), checkpoints in WORK/train; prints a summary
  line. Returns the run, its last history record and the seconds it took. The head's kind
  (EAGLE-3, Medusa or the MLP speculator) is `head`'s."""
  t = time.time()
  run = train_head(target, head_kind(head), data, head=head, hidden="online",
                   out_dir=work / "train", steps=args.steps, batch_size=args.batch_size,
                   lr=args.lr, warmup_steps=warmup_steps, save_every=args.steps,
                   eval_every=args.eval_every, eval_batches=eval_batches, log_every=log_every,
                   time_limit=60 * args.train_minutes, progress="lines")
  seconds = time.time() - t
  last = run.history[-1] if run.history else {}
  done = int(last.get("step", 0))
  print(f"[recipe] trained {done} of {args.steps} steps in {seconds:.0f} s"
        f" ({done * args.batch_size * args.seq_len / max(seconds, 1e-9):,.0f} row tokens/s,"
        f" compilation included); held-out first-draft accuracy"
        f" {last.get('eval_acc_0', float('nan')):.4f}", flush=True)
  return run, last, seconds


def own_instructions(target, out: Path, n: int, seed: int) -> tuple[list[str], float | None]:
  """The target's `n` Magpie instructions, kept in OUT/instructions.json (read back when there),
  and the seconds writing them took (None when read back)."""
  f = out / "instructions.json"
  if f.is_file():
    return json.loads(f.read_text()), None
  t = time.time()
  with make_progress("lines") as bar:
    own = target_instructions(target, n, seed=seed, batch_size=32, progress=bar)
  f.write_text(json.dumps(own))
  return own, time.time() - t


def train_and_save(target, head, ds: Dataset, out: Path, *, steps: int, lr: float,
                   eval_every: int, meta: dict) -> dict:
  """Trains `head` on `ds` (8 rows cropped to 128-token windows per step, resumable in
  OUT/eagle-train) and saves it in OUT/eagle with `meta` and the run's record; returns that."""
  t0 = time.time()
  run = train_head(target, "eagle", ds, head=head, hidden="offline", out_dir=out / "eagle-train",
                   resume=(out / "eagle-train").is_dir(), steps=steps, lr=lr, warmup_steps=20,
                   save_every=50, eval_every=eval_every, eval_batches=16, progress="lines")
  rows = ds.train_indices
  meta = {"steps": steps, "lr": lr, "batch_size": 8, "window": 128, **meta,
          "final": run.history[-1] if run.history else None,
          "train_seconds": round(time.time() - t0, 1), "train_rows": int(len(rows)),
          "train_tokens": int(np.asarray(ds.loss_mask[rows]).sum()),
          "options": dict(run.options)}
  save_head(out / "eagle", "eagle", run.model, target.cfg, meta=meta, target_params=target.params)
  print(json.dumps(meta, indent=1, default=str), flush=True)
  return meta


if __name__ == "__main__":
  main()
