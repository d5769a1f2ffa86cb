"""The bundled EAGLE-3 head's next round on a lent GPU: the target writes a multi-turn corpus at a
large batch, then the head trains on it with the target's hidden states computed in the step,
both time-boxed so that the whole run fits one device call.

    python3 benchmarks/recipe_eagle_gpu.py --work /tmp/recipe --out $OUT \
        [--generate-minutes 3.5] [--train-minutes 2.5] [--steps 1500]

(on the GPU machine through `benchmarks/gpu_recipe.sh`, which sets the machine up; on a CPU it
runs as is, at the small sizes of its test.)

1. `jaxspec.train.write_corpus` (what `jaxspec train-data` runs): the bundled SmolLM2-135M
   answers the prompts of ../shared/data's three training files (never the Spec-Bench
   evaluation prompts; --max-prompts of them, drawn evenly) and, for --magpie-fraction of the
   batches, user turns it writes itself (Magpie), --turns answers per conversation (it writes
   the follow-up user turns), greedy and at T 0.7, --gen-batch-size conversations per batch
   written on as many slots (continuous batching), until --generate-minutes have passed
   (`time_limit`: the batches already started then finish) or --tokens answer tokens are
   written.
2. `jaxspec.train.train_head(..., hidden="online")` trains the `--init` head (default the bundled
   one) on the corpus as packed rows of --seq-len tokens (`PackedCorpus`): the frozen target's
   forward runs inside the jitted step, so no hidden state is stored. The cosine schedule is set
   by --steps; --train-minutes stops it earlier (`TrainConfig.time_limit`), evaluated and saved.
3. OUT receives what a later session needs (at most 8 files, each under 16 MiB, the device
   tool's limits): eagle/config.json and eagle/head.safetensors (the trained head, its record in
   config.json's meta), record.json (data, training, machine), history.jsonl, and the corpus's
   shards and index as corpus.tar, cut into corpus.tar.00, .01, ... when over 15 MiB.
   On this machine: `cat corpus.tar.* > corpus.tar; tar xf corpus.tar` gives the corpus
   directory `jaxspec train eagle --corpus DIR` and `PackedCorpus` read.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tarfile
import time
from pathlib import Path

import jax

from common import ROOT, machine
from jaxspec import load
from jaxspec.heads.io import load_head_model, save_head
from jaxspec.train.corpus import CorpusConfig, PackedCorpus, write_corpus
from jaxspec.train.data import read_prompts
from recipe_eagle import (add_online_training_args, head_origin, parse_with_dirs, recipe_line,
                          train_online)

FILES = ("gsm8k_train.jsonl", "humaneval.jsonl", "self_instruct_seed_tasks.jsonl")
PART = 15 << 20  # bytes per returned piece of corpus.tar (the device tool takes 16 MiB a file)


def split_file(path: Path, size: int = PART) -> list[Path]:
  """`path` as is when at most `size` bytes, else cut into path.00, path.01, ... (removed)."""
  if path.stat().st_size <= size:
    return [path]
  parts = []
  with open(path, "rb") as f:
    while chunk := f.read(size):
      part = path.with_name(f"{path.name}.{len(parts):02d}")
      part.write_bytes(chunk)
      parts.append(part)
  path.unlink()
  return parts


def main(argv=None, target=None) -> dict:
  """Runs the recipe (argv: its command line; target: the loaded target, default `load()`);
  returns record.json's content."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  add_online_training_args(ap, train_minutes=2.5, steps=1500, batch_size=16, seq_len=1024,
                           eval_every=250)
  ap.add_argument("--seed", type=int, default=10, help="of the prompts' draw and the corpus")
  ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
  ap.add_argument("--generate-minutes", type=float, default=3.5)
  ap.add_argument("--tokens", type=int, default=10**9, help="answer-token budget")
  ap.add_argument("--gen-batch-size", type=int, default=256)
  ap.add_argument("--max-new-tokens", type=int, default=512)
  ap.add_argument("--turns", type=int, default=2)
  ap.add_argument("--magpie-fraction", type=float, default=0.5)
  ap.add_argument("--max-prompts", type=int, default=1536,
                  help="file prompts, drawn evenly from the three files (GSM8K alone has 7,473:"
                       " uncapped, math would crowd out the rest)")
  ap.add_argument("--max-len", type=int, default=2048)
  args, work, out = parse_with_dirs(ap, argv)
  t_start = time.time()
  # Stacked layers: the corpus's conversations grow the cache through several sizes, each a
  # compilation, and a scanned model compiles several times faster than an unrolled one.
  target = load(scan_layers=True) if target is None else target
  print(f"[recipe] target loaded in {time.time() - t_start:.1f} s; {jax.devices()}", flush=True)
  _, head, config = load_head_model(target, args.init)

  # 1. The corpus.
  files = [Path(args.data_dir) / f for f in FILES]
  prompts, _, sources = read_prompts(files, max_prompts=args.max_prompts, seed=args.seed,
                                     with_files=True, all_turns=True)
  cfg = CorpusConfig(turns=args.turns, max_new_tokens=args.max_new_tokens,
                     temperatures=(0.0, 0.7), magpie_fraction=args.magpie_fraction,
                     batch_size=args.gen_batch_size, max_prompt_len=512, max_len=args.max_len,
                     seed=args.seed)
  t = time.time()
  summary = write_corpus(target, prompts, work / "corpus", cfg, token_budget=args.tokens,
                         sources=[f.name for f in files], prompt_sources=sources,
                         time_limit=60 * args.generate_minutes, progress_every=20.0)
  gen_seconds = time.time() - t
  print(f"[recipe] corpus: {summary.conversations} conversations, {summary.loss_tokens:,} answer"
        f" tokens of {summary.tokens:,}, {summary.shards} shards, {gen_seconds:.0f} s"
        f" ({summary.loss_tokens / gen_seconds:,.0f} answer tokens/s, compilation included)",
        flush=True)

  # 2. The head, online.
  data = PackedCorpus(work / "corpus", args.seq_len, shuffle_window=args.shuffle_window)
  run, last, train_seconds = train_online(target, head, data, args, work,
                                          warmup_steps=min(50, args.steps // 10),
                                          eval_batches=8, log_every=10)
  steps_done = int(last.get("step", 0))

  # 3. What comes back.
  recipe = recipe_line("benchmarks/recipe_eagle_gpu.py", args, ("work", "out", "data_dir"))
  record = {
      "recipe": recipe, "machine": machine(),
      "init": head_origin(args.init, config),
      "corpus": {"conversations": summary.conversations, "answer_tokens": summary.loss_tokens,
                 "tokens": summary.tokens, "shards": summary.shards,
                 "next_batch": summary.next_batch, "seconds": round(gen_seconds, 1),
                 "config": cfg.to_json()},
      "train": {"steps": steps_done, "planned_steps": args.steps,
                "stopped": last.get("stopped"), "batch_size": args.batch_size,
                "seq_len": args.seq_len, "lr": args.lr, "hidden": "online",
                "train_rows": data.num_train_rows, "seconds": round(train_seconds, 1),
                "final": last or None},
      "seconds": round(time.time() - t_start, 1),
  }
  save_head(out / "eagle", "eagle", run.model, target.cfg, target_params=target.params,
            meta={k: record[k] for k in ("recipe", "init", "corpus", "train")}
            | {"data": "the corpus in corpus.tar (token ids), written by the target on the"
                       " machine of record.json"})
  shutil.copy(work / "train" / "history.jsonl", out / "history.jsonl")
  tar = out / "corpus.tar"
  with tarfile.open(tar, "w") as f:
    f.add(work / "corpus", arcname="corpus")
  record["returned"] = [p.name for p in split_file(tar)]
  (out / "record.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
  print(json.dumps({k: record[k] for k in ("corpus", "train", "seconds", "returned")},
                   default=str), flush=True)
  return record


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
