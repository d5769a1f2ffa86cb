"""The bundled EAGLE-3 head's third round: more target-written rows, made in chunks so that an
interrupted or time-boxed run keeps what it wrote, then the head trained further on them.

    .venv/bin/python benchmarks/recipe_eagle_round3.py --out OUT --worker 0 &   # see below
    .venv/bin/python benchmarks/recipe_eagle_round3.py --out OUT --worker 1 &
    .venv/bin/python benchmarks/recipe_eagle_round3.py --out OUT --pack
    .venv/bin/python benchmarks/recipe_eagle_round3.py --out OUT --train 300 [--lr 3e-4]

Rows (every response is the target's own, chat-templated, at most --max-new-tokens tokens):
1. the 1,000 Magpie instructions of round two (their token ids in data/heads/, round two's
   prompt_index >= 674) answered again at T 0.7 with another seed, now up to 256 tokens;
2. --self-instructions new Magpie instructions (seed 9) answered greedy and at T 0.7;
3. --gsm8k GSM8K training questions round two did not use, answered greedy and at T 0.7.
Each chunk of prompts (144, or 96 for list 2) at one temperature is a tokens-only dataset in
OUT/chunks/NAME (`write_dataset(..., store_hidden=False)`), skipped when already there, so a
command is rerun as is; no chunk is started after --deadline-minutes. On a 2-core CPU one
process keeps about one core busy, so two run side by side: `--worker 0` writes the new
instructions and answers them, `--worker 1` answers lists 1 and 3.

`--pack` writes every finished chunk's rows into OUT/rows.npz (the committed format of
data/heads/, see its README). `--train STEPS` recomputes the hidden states of round two's rows
and these (OUT/data; with no chunks in OUT, the committed rows of data/heads/) and trains the
`--init` head on them (default the bundled EAGLE-3 head: round two when this ran) for STEPS
steps of 8 rows cropped to 128-token windows, saving it in OUT/eagle with its record
(config.json meta).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from common import ROOT
from jaxspec import load
from jaxspec.heads.io import load_head_model
from jaxspec.train.data import DataConfig, Dataset, read_prompts, write_dataset
from recipe_eagle import head_origin, own_instructions, train_and_save

DATA = ROOT.parent / "shared" / "data"
ROUND2 = ROOT / "data" / "heads" / "smollm2-135m-eagle-round2" / "rows.npz"
ROUND3 = ROOT / "data" / "heads" / "smollm2-135m-eagle-round3" / "rows.npz"  # this run's rows
FIRST_MAGPIE = 674  # round two's prompt_index of its first target-written instruction
CHUNK = 144  # prompts per chunk (three batches of 48)


def round2_prompts() -> dict[tuple[int, ...], int]:
  """{prompt ids: prompt_index} of round two's rows, in row order (its first row of each)."""
  z = np.load(ROUND2)  # each z[name] reads and decompresses that array again: once each here
  tokens, prompt_lengths, prompt_index = z["tokens"], z["prompt_lengths"], z["prompt_index"]
  index = {}
  for i in range(len(prompt_lengths)):
    index.setdefault(tuple(tokens[i, :prompt_lengths[i]].tolist()), int(prompt_index[i]))
  return index


def round2_magpie_prompts() -> list[list[int]]:
  return [list(k) for k, p in round2_prompts().items() if p >= FIRST_MAGPIE]


def _rows(path: Path) -> list[tuple[list[int], list[int]]]:
  """(prompt ids, response ids) of every row of a rows.npz."""
  z = np.load(path)
  t, n, pl = z["tokens"].astype(np.int64), z["lengths"], z["prompt_lengths"]
  return [(t[i, :pl[i]].tolist(), t[i, pl[i]:n[i]].tolist()) for i in range(len(n))]


def pack(out: Path) -> None:
  """OUT/rows.npz and OUT/meta.json: every finished chunk's rows (the format of data/heads/:
  uint16 tokens, lengths, prompt_lengths, prompt_index, and each row's temperature). A prompt
  round two answered keeps its round-two prompt_index; new prompts are numbered after them."""
  index = round2_prompts()
  nxt = max(index.values()) + 1
  rows, temps, metas = [], [], {}
  for d in sorted((out / "chunks").iterdir()):
    if not (d / "meta.json").is_file():
      continue
    m = metas[d.name] = json.loads((d / "meta.json").read_text())
    t, n, pl = (np.load(d / f) for f in ("tokens.npy", "lengths.npy", "prompt_lengths.npy"))
    (temp,) = m["generation"]["temperatures"]
    for i in range(len(n)):
      key = tuple(t[i, :pl[i]].tolist())
      if key not in index:
        index[key], nxt = nxt, nxt + 1
      rows.append((key, t[i, :n[i]]))
      temps.append(temp)
  width = max(len(r) for _, r in rows)
  tokens = np.zeros((len(rows), width), np.uint16)
  for i, (_, r) in enumerate(rows):
    assert r.max() < 2**16
    tokens[i, :len(r)] = r
  np.savez_compressed(out / "rows.npz", tokens=tokens,
                      lengths=np.array([len(r) for _, r in rows], np.int32),
                      prompt_lengths=np.array([len(k) for k, _ in rows], np.int32),
                      prompt_index=np.array([index[k] for k, _ in rows], np.int32),
                      temperature=np.array(temps, np.float32))
  sources = {}  # rows (not prompts: a new instruction has a greedy and a T 0.7 row)
  for m in metas.values():
    (src,) = m["prompt_files"]
    sources[src] = sources.get(src, 0) + m["num_examples"]
  inst = out / "instructions_seconds.txt"
  record = {
      "rows": len(rows), "width": width, "chunks": sorted(metas),
      "rows_by_source": sources, "prompts": len({k for k, _ in rows}),
      "response_tokens": sum(m["response_tokens"] for m in metas.values()),
      "stopped_rows": sum(m["stopped_rows"] for m in metas.values()),
      "max_new_tokens": next(iter(metas.values()))["generation"]["max_new_tokens"],
      # Process seconds, summed over the chunks (two workers ran side by side).
      "seconds": {"instructions": float(inst.read_text()) if inst.is_file() else None,
                  "generate": round(sum(m["seconds"]["generate"] for m in metas.values()), 1)},
      "target": next(iter(metas.values()))["target"]["fingerprint"],
  }
  (out / "meta.json").write_text(json.dumps(record, indent=1) + "\n")
  print(json.dumps(record), flush=True)


def train(out: Path, args) -> None:
  target = load()
  _, head, config = load_head_model(target, args.init)
  layers = tuple(head.cfg.layers)
  rows_file = out / "rows.npz"
  if not rows_file.is_file():
    if any((d / "meta.json").is_file() for d in (out / "chunks").iterdir()):
      pack(out)
    else:  # nothing generated here: the committed rows
      rows_file = ROUND3
  data_dir = out / "data"
  if not (data_dir / "meta.json").is_file():
    rows = _rows(ROUND2) + _rows(rows_file)
    prompts, responses = [p for p, _ in rows], [r for _, r in rows]
    cfg = DataConfig(max_prompt_len=512, max_new_tokens=args.max_new_tokens, chat=False,
                     hidden_layers=layers)
    write_dataset(target, prompts, data_dir, cfg, responses=responses, progress="lines")
  ds = Dataset(data_dir, layers=layers, window=128)
  meta = {"data": "data/heads/smollm2-135m-eagle-round2 and -round3 (their token ids; the hidden"
                  " states were recomputed from them)",
          "init": head_origin(args.init, config),
          "recipe": f"benchmarks/recipe_eagle_round3.py --train {args.train} --lr {args.lr}"}
  train_and_save(target, head, ds, out, steps=args.train, lr=args.lr, eval_every=200, meta=meta)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", required=True)
  ap.add_argument("--self-instructions", type=int, default=500)
  ap.add_argument("--max-new-tokens", type=int, default=256)
  ap.add_argument("--deadline-minutes", type=float, default=60.0)
  ap.add_argument("--gsm8k", type=int, default=288)
  ap.add_argument("--worker", type=int, choices=(0, 1), default=0)
  ap.add_argument("--seed", type=int, default=9)
  ap.add_argument("--pack", action="store_true", help="only pack the chunks into OUT/rows.npz")
  ap.add_argument("--train", type=int, default=0, metavar="STEPS",
                  help="train the bundled head on OUT/rows.npz for STEPS steps")
  ap.add_argument("--lr", type=float, default=3e-4)
  ap.add_argument("--init", default="eagle",
                  help="the head trained further (a directory or a bundled name)")
  args = ap.parse_args()
  out = Path(args.out)
  (out / "chunks").mkdir(parents=True, exist_ok=True)
  if args.pack:
    pack(out)
    return
  if args.train:
    train(out, args)
    return
  t_start = time.time()
  target = load()
  jobs = []
  if args.worker == 0:
    new, secs = own_instructions(target, out, args.self_instructions, args.seed)
    if secs is not None:
      (out / "instructions_seconds.txt").write_text(f"{secs:.1f}\n")
    # Greedy and T 0.7 answers in chunks of their own (96 prompts: two batches): at most a few
    # minutes of work are lost when the run is stopped. Every chunk has one temperature (the
    # temperature `pack` records for its rows).
    jobs += [(f"new{i:02d}-t{t:g}", new[s:s + 96], (t,), "new Magpie instructions")
             for i, s in enumerate(range(0, len(new), 96)) for t in (0.0, 0.7)]
  else:
    old = round2_magpie_prompts()
    jobs += [(f"old{i:02d}", old[s:s + CHUNK], (0.7,), "round-two Magpie instructions")
             for i, s in enumerate(range(0, len(old), CHUNK))]
    # Round two drew its first 361 GSM8K questions from this order (file 0, seed 8).
    gsm, _ = read_prompts([DATA / "gsm8k_train.jsonl"], seed=8)
    gsm = gsm[361:361 + args.gsm8k]
    jobs += [(f"gsm{i:02d}-t{t:g}", gsm[s:s + CHUNK], (t,), "gsm8k_train.jsonl")
             for i, s in enumerate(range(0, len(gsm), CHUNK)) for t in (0.0, 0.7)]
  for n, (name, prompts, temps, source) in enumerate(jobs):
    d = out / "chunks" / name
    if (d / "meta.json").is_file():
      continue
    if time.time() - t_start > 60 * args.deadline_minutes:
      print(f"deadline: {len(jobs) - n} chunks not started", flush=True)
      break
    cfg = DataConfig(max_new_tokens=args.max_new_tokens, temperatures=temps, batch_size=48,
                     store_hidden=False, seed=args.seed * 1000 + 100 * args.worker + n)
    write_dataset(target, prompts, d, cfg, progress="lines", prompt_files={source: len(prompts)})
    m = json.loads((d / "meta.json").read_text())
    print(f"chunk {d.name}: {m['num_examples']} rows, {m['response_tokens']} tokens,"
          f" {m['seconds']['generate']:.0f} s", flush=True)


if __name__ == "__main__":
  main()
