"""Training throughput with the target's hidden states stored (offline) or computed in the step
(online), same head, same batches.

SmolLM2-135M target (float32 unless --dtype), an EAGLE-3 head with the CLI's options (3
training-time-test steps, the fused layers, a 4096-token draft vocabulary), rows of
`--width` tokens (a prompt and a given response, as `--responses given` stores them), batches of
`--batch-size`. Offline: `write_dataset` stores the hidden states once (float16 memmaps, timed
too) and every step reads a batch of them; online: a dataset of token ids only, and the target's
forward runs inside the jitted step (`jaxspec.train.online`). Runs alternate (offline, online,
offline, online, ...) so that machine drift cancels; each run is `--steps` steps, of which the
first `--warmup` (compilation) are not timed. Prints and writes tokens/s per mode.

    .venv/bin/python benchmarks/bench_train_hidden.py [--steps 12] [--warmup 2] [--repeats 2]
        [--batch-size 8] [--width 128] [--rows 64] [--head eagle]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import optax

from common import ROOT, machine, write_json
from jaxspec import load
from jaxspec.heads import HEADS
from jaxspec.train import DataConfig, Dataset, train_head, write_dataset

OPTIONS = {"eagle": dict(version=3, ttt_steps=3, draft_vocab_size=4096),
           "medusa": dict(num_heads=3), "mlp": dict(n_predict=3, tie_to_target=True)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--head", default="eagle", choices=sorted(OPTIONS))
  ap.add_argument("--steps", type=int, default=12)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--repeats", type=int, default=2)
  ap.add_argument("--batch-size", type=int, default=8)
  ap.add_argument("--width", type=int, default=128)
  ap.add_argument("--rows", type=int, default=64)
  ap.add_argument("--dtype", default="float32")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_hidden.json"))
  args = ap.parse_args()

  target = load(dtype=args.dtype)
  options = OPTIONS[args.head]
  layers = tuple(HEADS[args.head].required_layers(target.cfg, options))
  rng = np.random.default_rng(0)
  v = target.cfg.vocab_size
  half = args.width // 4
  prompts = [rng.integers(10, v, size=half).tolist() for _ in range(args.rows)]
  responses = [rng.integers(10, v, size=args.width - half).tolist() for _ in range(args.rows)]
  work = Path(tempfile.mkdtemp(prefix="bench-train-hidden-"))
  base = dict(max_prompt_len=half, max_new_tokens=args.width - half, chat=False,
              hidden_layers=layers, hidden_batch_size=args.batch_size)
  t0 = time.perf_counter()
  write_dataset(target, prompts, work / "stored", DataConfig(**base), responses=responses,
                progress=False)
  store_s = time.perf_counter() - t0
  write_dataset(target, prompts, work / "ids", DataConfig(**dict(base, store_hidden=False,
                                                                  hidden_layers=())),
                responses=responses, progress=False)
  stored = Dataset(work / "stored", layers=layers, eval_fraction=0)
  ids = Dataset(work / "ids", eval_fraction=0)
  counts = np.bincount(rng.integers(0, v, 10000), minlength=v)
  opts = dict(options, token_counts=counts) if args.head == "eagle" else options

  def run(mode: str) -> float:
    seconds = {}
    train_head(target, args.head, stored if mode == "offline" else ids, options=opts,
               steps=args.steps, batch_size=args.batch_size, hidden=mode,
               optimizer=optax.adamw(1e-3), eval_every=0, log_every=1,
               callbacks=[lambda step, rec: seconds.__setitem__(step, rec["seconds"])])
    timed = args.steps - args.warmup
    return timed * args.batch_size * args.width / (seconds[args.steps] - seconds[args.warmup])

  results = {"offline": [], "online": []}
  for r in range(args.repeats):
    for mode in ("offline", "online"):
      results[mode].append(run(mode))
      print(f"repeat {r}: {mode:7s} {results[mode][-1]:8.1f} tokens/s", flush=True)
  best = {m: max(x) for m, x in results.items()}
  stored_tokens = args.rows * args.width
  print(f"{args.head}, batch {args.batch_size} x {args.width} tokens: offline {best['offline']:.0f}"
        f" tokens/s, online {best['online']:.0f} tokens/s (online / offline"
        f" {best['online'] / best['offline']:.2f}); storing the hidden states of"
        f" {stored_tokens} tokens took {store_s:.1f} s ({stored_tokens / store_s:.0f} tokens/s,"
        " compilation included)")
  write_json(Path(args.out), {"machine": machine(), "head": args.head, "options": options,
                              "batch_size": args.batch_size, "width": args.width,
                              "steps": args.steps, "warmup": args.warmup, "dtype": args.dtype,
                              "tokens_per_s": results, "best": best,
                              "store_seconds": store_s, "stored_tokens": stored_tokens})


if __name__ == "__main__":
  main()
