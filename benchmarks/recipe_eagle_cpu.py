"""A bundled head's next round on this CPU (EAGLE-3 by default; `--init medusa` or `mlp` trains
that head): a multi-turn corpus the target writes (`jaxspec train-data`, run beforehand,
resumable; several, from workers run side by side), mixed with the token ids of the earlier
rounds' rows, trains the bundled head online, time-boxed.

    jaxspec train-data --out CORPUS ...   # the corpus (the command in docs/guides/training.md)
    python3 benchmarks/recipe_eagle_cpu.py --corpus CORPUS --work /tmp/r4 --out heads/round4 \
        [--rows data/heads/smollm2-135m-eagle-round2/rows.npz ...] [--steps 80] \
        [--train-minutes 50] [--batch-size 8] [--seq-len 512] [--lr 3e-4]

1. The training corpus, WORK/mixed: every --corpus's shards (the first's linked, the others'
   copied with their sources renumbered: each corpus's sources are its own) and each --rows file
   (the `rows.npz` of `data/heads/*/`: chat-templated prompt, then the target's response)
   written as corpus shards, one conversation a row, the response its loss mask; one index.json
   lists them all. Rows of every --rows file share one source, so the answers to one prompt
   (prompt_index) fall on one side of the held-out split.
2. `jaxspec.train.train_head(..., hidden="online")` trains the --init head (default the bundled
   EAGLE-3 head; its kind is the kind trained) on packed rows of --seq-len tokens
   (`PackedCorpus`), the frozen target's forward inside the jitted step; the cosine schedule
   is set by --steps, --train-minutes stops it earlier (evaluated and saved).
3. OUT/KIND (eagle, medusa or mlp): the trained head, its record in config.json's meta (data,
   training, machine); OUT/record.json and OUT/history.jsonl beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np

from common import ROOT, machine
from jaxspec import load
from jaxspec.heads import head_kind
from jaxspec.heads.io import load_head_model, save_head
from jaxspec.train.corpus import (FORMAT, VERSION, Corpus, PackedCorpus, token_dtype,
                                  write_shard)
from jaxspec.train.data import DataError
from recipe_eagle import (add_online_training_args, head_origin, parse_with_dirs, recipe_line,
                          train_online)
from recipe_eagle_round3 import ROUND2, ROUND3, _rows

ROWS = (str(ROUND2), str(ROUND3))
ROWS_SOURCE = "<rows of earlier rounds (data/heads/*/rows.npz)>"


def rows_conversations(path: str | os.PathLike):
  """(tokens, loss_mask) of every row of a `rows.npz` of data/heads/ (prompt ids then the
  target's response; the mask marks the response), the rows' prompt_index and temperature
  (NaN where the file has none)."""
  z = np.load(path)
  convs = [(p + r, [0] * len(p) + [1] * len(r)) for p, r in _rows(Path(path))]
  temp = z["temperature"] if "temperature" in z.files else np.full(len(convs), np.nan)
  return convs, z["prompt_index"].astype(np.int64), temp


def mixed_corpus(corpora: list, rows: list[str], out: str | os.PathLike,
                 vocab_size: int, shard_rows: int = 1024) -> Corpus:
  """WORK/mixed (step 1 of the module docstring), opened; rebuilt from scratch on every call.
  `corpora`: `Corpus` objects or their directories."""
  srcs = [c if isinstance(c, Corpus) else Corpus(c) for c in corpora]
  for c in srcs[1:]:
    if c.index["target"]["fingerprint"] != srcs[0].index["target"]["fingerprint"]:
      raise DataError(f"{c.path} and {srcs[0].path} were written by different targets")
  out = Path(out)
  if out.exists():
    shutil.rmtree(out)
  out.mkdir(parents=True)
  shards, sources = [], []
  for j, src in enumerate(srcs):  # each corpus's sources as its own: their prompts differ
    z = len(sources)
    sources += [f"{name} ({src.path.name})" for name in src.sources]
    for i, s in enumerate(src.index["shards"]):
      name = f"c{j}-{s['file']}"
      if z:  # renumber the shard's sources after the earlier corpora's
        info = src.load_shard(i)
        info["source"] = info["source"] + z
        info["tokens"] = info["tokens"].astype(token_dtype(vocab_size))
        np.savez_compressed(out / name, **info)
      else:
        os.symlink((src.path / s["file"]).resolve(), out / name)
      shards.append(dict(s, file=name))
  sources += [ROWS_SOURCE] if rows else []
  k = 0
  for path in rows:
    convs, prompt, temp = rows_conversations(path)
    for i in range(0, len(convs), shard_rows):
      part = slice(i, i + shard_rows)
      n = len(convs[part])
      shards.append(write_shard(out / f"rows-{k:05d}.npz", convs[part],
                                source=[len(sources) - 1] * n, prompt=prompt[part],
                                temperature=temp[part], turns=[1] * n, vocab_size=vocab_size))
      k += 1
  totals = {"conversations": sum(s["conversations"] for s in shards),
            "tokens": sum(s["tokens"] for s in shards),
            "loss_tokens": sum(s["loss_tokens"] for s in shards)}
  index = {"format": FORMAT, "version": VERSION, "target": srcs[0].index["target"],
           "sources": sources, "shards": shards, "totals": totals,
           "mixed_from": {"corpora": [str(c.path) for c in srcs], "rows": list(rows)},
           "complete": True}
  (out / "index.json").write_text(json.dumps(index, indent=2) + "\n")
  return Corpus(out)


def main(argv=None, target=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--corpus", required=True, nargs="+",
                  help="the corpora `jaxspec train-data` wrote (one or more)")
  add_online_training_args(ap, train_minutes=50.0, steps=80, batch_size=8, seq_len=512,
                           eval_every=20)
  ap.add_argument("--rows", nargs="*", default=list(ROWS),
                  help="rows.npz files of earlier rounds to train on too (none: the corpus only)")
  ap.add_argument("--eval-batches", type=int, default=8)
  args, work, out = parse_with_dirs(ap, argv)
  t_start = time.time()
  target = load() if target is None else target
  _, head, config = load_head_model(target, args.init)
  corpora = [Corpus(c) for c in args.corpus]
  for c in corpora:
    c.check_target(target)

  mixed = mixed_corpus(corpora, args.rows, work / "mixed", target.cfg.vocab_size)
  data = PackedCorpus(mixed, args.seq_len, shuffle_window=args.shuffle_window)
  totals = mixed.index["totals"]
  corpus_tokens = sum(c.index["totals"]["loss_tokens"] for c in corpora)
  print(f"[recipe] training corpus: {totals['conversations']:,} conversations,"
        f" {totals['loss_tokens']:,} answer tokens ({corpus_tokens:,} from"
        f" {', '.join(args.corpus)}); {data.num_train_rows:,} packed rows of {args.seq_len} tokens"
        f" ({data.num_eval_rows:,} held out)", flush=True)

  run, last, train_seconds = train_online(target, head, data, args, work,
                                          warmup_steps=min(20, max(1, args.steps // 10)),
                                          eval_batches=args.eval_batches, log_every=5)
  steps_done = int(last.get("step", 0))
  rate = steps_done * args.batch_size * args.seq_len / max(train_seconds, 1e-9)

  record = {
      "recipe": recipe_line("benchmarks/recipe_eagle_cpu.py", args, ("work", "out")),
      "machine": machine(), "init": head_origin(args.init, config),
      "data": {"corpora": [{"path": str(c.path), "totals": c.index["totals"],
                            "config": c.index.get("config")} for c in corpora],
               "rows": [os.path.relpath(r, ROOT) if Path(r).is_absolute() else r
                        for r in args.rows],
               "totals": totals, "train_rows": data.num_train_rows,
               "eval_rows": data.num_eval_rows},
      "train": {"steps": steps_done, "planned_steps": args.steps,
                "stopped": last.get("stopped"), "batch_size": args.batch_size,
                "seq_len": args.seq_len, "lr": args.lr, "hidden": "online",
                "seconds": round(train_seconds, 1), "row_tokens_per_second": round(rate, 1),
                "final": last or None},
      "seconds": round(time.time() - t_start, 1),
  }
  kind = head_kind(head)
  save_head(out / kind, kind, run.model, target.cfg, target_params=target.params,
            meta={k: record[k] for k in ("recipe", "init", "data", "train")})
  shutil.copy(work / "train" / "history.jsonl", out / "history.jsonl")
  (out / "record.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
  return record


if __name__ == "__main__":
  sys.exit(0 if main() else 1)
