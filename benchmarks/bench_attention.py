"""Decode cost against the allocated cache (`max_len`) and the cached length.

A random model of `tiny_config(hidden_size=256, intermediate_size=512, num_layers=4,
num_heads=8, num_kv_heads=4, head_dim=32, vocab_size=512)`, greedy: plain
`jaxspec.decoding.decode`, and `speculative_decode` with k = 4 and the `Oracle` drafter proposing
the target's own continuation (every step verifies 5 positions and emits 5 tokens).

Tables (ms per step, the prefill excluded: see `time_rounds`):
  1. 80 cached tokens (16-token prompts, 64 new tokens; speculative 256) for each `max_len`;
  2. against the cached length (prompts of P tokens, max_len fixed at the largest);
  3. a ragged batch (rows of 100 and 8,000 tokens) against two rows of 8,000 and two of 100;
  4. (`--tables prefill`, not in the default) the prefill itself: seconds and XLA's temporary
     memory (`compiled.memory_analysis()`) of one `forward(fresh=True)` over prompts of
     `--prefill-lens` tokens (batch 1) and over rows of 100 and 8,000 tokens, with the
     attention within the prompt as one [T, T] product ("dense", `ATTENTION_BLOCK` raised
     above T), tile by tile ("blocked", the default for T > `ATTENTION_BLOCK`), or as chunks of
     `ATTENTION_BLOCK` tokens each attending to the cache the chunks before wrote ("chunked",
     the alternative design: it cannot take a mask spanning chunks or be differentiated).

Every configuration is compiled first, then they are timed round-robin (`--repeats` rounds; the
median per configuration), so machine noise falls on all of them alike.

`--kernel` picks how attention reads the cache (`LlamaConfig.attention_kernel`): "auto" (the
platform's Pallas kernel on a GPU or TPU, XLA's blocked read on the CPU), "xla", or a list
("xla,auto" on a GPU: the Triton kernel against XLA's blocks, timed side by side in the same
rounds). "triton_interpret" / "mosaic_interpret" run the kernels in Pallas' interpreter: a dry
run on the CPU at small shapes, not a timing.

    .venv/bin/python benchmarks/bench_attention.py [--out benchmarks/results/attention.json]
    python3 benchmarks/bench_attention.py --kernel xla,auto --batches 1,8   # on a GPU
    .venv/bin/python benchmarks/bench_attention.py --kernel triton_interpret,mosaic_interpret \
      --tables max_len --batches 1 --max-lens 80,600 --new 8 --repeats 1   # CPU dry run
    .venv/bin/python benchmarks/bench_attention.py --tables prefill --repeats 2 \
      --out benchmarks/results/attention_prefill.json
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from common import ROOT, machine, write_json
from jaxspec.decoding import decode, speculative_decode
from jaxspec.drafters import Oracle
from jaxspec.models import llama
from jaxspec.models.config import ATTENTION_KERNELS, tiny_config
from jaxspec.models.synthetic import random_model

SPEC_TOKENS = 4  # the speculative runs generate 4x the plain runs' tokens: as many steps
CFG = dict(hidden_size=256, intermediate_size=512, num_layers=4, num_heads=8, num_kv_heads=4,
           head_dim=32, vocab_size=512, max_position_embeddings=70000)


def make_run(model, batch: int, prompt_len: int, new: int, max_len: int, spec: bool,
             lengths=None):
  """A compiled generation of up to `new` tokens: a function of the number of new tokens (a
  traced value, so one program serves both lengths `time_rounds` runs)."""
  rng = np.random.default_rng(0)
  lengths = np.full((batch,), prompt_len, np.int32) if lengths is None else np.asarray(
      lengths, np.int32)
  p = int(lengths.max())
  ids = jnp.asarray(rng.integers(1, CFG["vocab_size"], (batch, p)), jnp.int32)
  lens = jnp.asarray(lengths)
  if spec:
    # The oracle proposes the target's own greedy continuation, every draft kept: every draft
    # is accepted, each step verifies k + 1 = 5 positions and emits 5 tokens.
    ref = decode(model, ids, lens, 0, max_new_tokens=new + 8, logprobs=False,
                 stop_ids=()).tokens
    drafter = Oracle(reference=ref, alpha=1.0, vocab=CFG["vocab_size"])
    fn = jax.jit(lambda params, dp, ids, lens, n: speculative_decode(
        model, drafter, ids, lens, 0, max_new_tokens=n, capacity=new, num_draft_tokens=4,
        max_len=max_len, logprobs=False, target_params=params, drafter_params=dp,
        stop_ids=()).lengths)
    args = (model.params, drafter.params, ids, lens)
  else:
    fn = jax.jit(lambda params, ids, lens, n: decode(
        model, ids, lens, 0, max_new_tokens=n, capacity=new, max_len=max_len, logprobs=False,
        target_params=params, stop_ids=()).lengths)
    args = (model.params, ids, lens)
  return lambda n: fn(*args, jnp.int32(n))


def time_rounds(runs: dict, new: int, steps_per_token: float, repeats: int) -> dict:
  """ms per decoding step of each run: (time of `new` tokens - time of `new // 8`) over the
  steps between, so the prefill (whose cost grows with the prompt) cancels out. The runs are
  timed round-robin; each length takes its fastest time (this shared machine's noise only ever
  slows a run down)."""
  short = new // 8
  for fn in runs.values():
    jax.block_until_ready(fn(new))
  times = {name: {new: [], short: []} for name in runs}
  for _ in range(repeats):
    for name, fn in runs.items():
      for n in (new, short):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(n))
        times[name][n].append(time.perf_counter() - t0)
  steps = (new - short) * steps_per_token
  return {name: 1e3 * (min(ts[new]) - min(ts[short])) / steps for name, ts in times.items()}


PREFILL_MODES = ("dense", "blocked", "chunked")


def make_prefill(model, lengths, mode: str):
  """A compiled prefill of prompts of `lengths` (right-padded to the longest) under `mode`:
  (a function of no arguments returning the hidden states and cache, XLA's temporary bytes)."""
  cfg = model.cfg
  lengths = np.asarray(lengths, np.int32)
  b, t = len(lengths), int(lengths.max())
  ids = jnp.asarray(np.random.default_rng(0).integers(1, CFG["vocab_size"], (b, t)), jnp.int32)
  lens = jnp.asarray(lengths)
  blk = llama.ATTENTION_BLOCK

  def prefill(params, ids, lens):
    cache = llama.init_cache(cfg, b, t)
    if mode != "chunked":
      _, hidden, cache = llama.forward(params, ids, cache, cfg, logits=False, fresh=True,
                                       seq_lengths=lens)
      return hidden.final, cache
    finals = []
    for c in range(0, t, blk):
      _, hidden, cache = llama.forward(params, ids[:, c:c + blk], cache, cfg, logits=False,
                                       fresh=c == 0)
      finals.append(hidden.final)
    return jnp.concatenate(finals, axis=1), cache

  # The threshold is read when the program is traced: raised above T, the dense product.
  llama.ATTENTION_BLOCK = t + 1 if mode == "dense" else blk
  try:
    compiled = jax.jit(prefill).lower(model.params, ids, lens).compile()
  finally:
    llama.ATTENTION_BLOCK = blk
  temp = compiled.memory_analysis().temp_size_in_bytes
  return lambda: compiled(model.params, ids, lens), temp


def prefill_table(model, shapes: dict, repeats: int) -> dict:
  """Seconds (fastest of `repeats`, round-robin) and temporary MiB of each shape's prefill in
  each mode."""
  runs, rows = {}, {}
  for name, lengths in shapes.items():
    for mode in PREFILL_MODES:
      runs[name, mode], temp = make_prefill(model, lengths, mode)
      rows.setdefault(name, {})[mode] = dict(temp_mib=temp / 2**20)
  for fn in runs.values():
    jax.block_until_ready(fn())
  for _ in range(repeats):
    for (name, mode), fn in runs.items():
      t0 = time.perf_counter()
      jax.block_until_ready(fn())
      s = time.perf_counter() - t0
      row = rows[name][mode]
      row["seconds"] = min(row.get("seconds", s), s)
  for name, row in rows.items():
    print(f"prefill {name}:", {m: f"{v['seconds']:.3f} s, {v['temp_mib']:.0f} MiB"
                               for m, v in row.items()})
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--max-lens", default="80,1024,8192,32768")
  ap.add_argument("--cached", default="128,1024,4096,16384")
  ap.add_argument("--batches", default="1,4")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--new", type=int, default=64)
  ap.add_argument("--tables", default="max_len,cached,ragged",
                  help="any of max_len, cached, ragged, prefill (separated by commas)")
  ap.add_argument("--prefill-lens", default="512,2048,8192")
  ap.add_argument("--kernel", default="auto",
                  help="attention_kernel, or several separated by commas: "
                       + ", ".join(ATTENTION_KERNELS))
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "attention.json"))
  args = ap.parse_args()
  kernels = args.kernel.split(",")
  for k in kernels:
    if k not in ATTENTION_KERNELS:
      ap.error(f"--kernel {k!r} is not one of {', '.join(ATTENTION_KERNELS)}")
  base_model = random_model(tiny_config(**CFG))
  # The same weights under each kernel: only the configuration's attention_kernel differs.
  models = {k: dataclasses.replace(base_model, cfg=dataclasses.replace(base_model.cfg,
                                                                       attention_kernel=k))
            for k in kernels}
  new = args.new
  result = dict(machine=machine(), config=CFG, new_tokens=new, repeats=args.repeats,
                kernels=kernels, tables={})
  # With one kernel the tables keep their names; with several, each name gets the kernel.
  label = lambda k, name: name if len(kernels) == 1 else f"{k}/{name}"

  tables = args.tables.split(",")
  # 1. The allocated size alone changes: 16-token prompts, 64 new tokens (speculative: 256,
  # so that as many steps as plain decoding's stand out of the timing noise).
  for batch in [int(b) for b in args.batches.split(",")] if "max_len" in tables else []:
    for spec in (False, True):
      runs = {}
      n = SPEC_TOKENS * new if spec else new
      for k, model in models.items():
        for ml in [int(x) for x in args.max_lens.split(",")]:
          ml = max(ml, 16 + n + (6 if spec else 0))
          runs[k, ml] = make_run(model, batch, 16, n, ml, spec)
      med = time_rounds(runs, n, 0.2 if spec else 1.0, args.repeats)
      for k in kernels:
        mine = {ml: ms for (kk, ml), ms in med.items() if kk == k}
        base = min(mine)
        rows = {str(ml): dict(ms_per_step=ms, ratio=ms / mine[base]) for ml, ms in mine.items()}
        name = label(k, f"max_len/{'spec_k4' if spec else 'plain'}/batch{batch}")
        result["tables"][name] = rows
        print(name, {k: f"{v['ms_per_step']:.2f} ms ({v['ratio']:.2f}x)" for k, v in rows.items()})

  # 2. The cached length changes, max_len fixed at the largest.
  cached = [int(x) for x in args.cached.split(",")]
  top = max(cached) + SPEC_TOKENS * new + 8
  for batch in [int(b) for b in args.batches.split(",")] if "cached" in tables else []:
    for spec in (False, True):
      n = SPEC_TOKENS * new if spec else new
      runs = {(k, c): make_run(model, batch, c, n, top, spec) for k, model in models.items()
              for c in cached}
      med = time_rounds(runs, n, 0.2 if spec else 1.0, args.repeats)
      for k in kernels:
        rows = {str(c): dict(ms_per_step=ms) for (kk, c), ms in med.items() if kk == k}
        name = label(k, f"cached/{'spec_k4' if spec else 'plain'}/batch{batch}")
        result["tables"][name] = dict(max_len=top, rows=rows)
        print(name, f"max_len {top}:", {k: f"{v['ms_per_step']:.2f} ms" for k, v in rows.items()})

  # 3. Ragged rows: 100 and 8,000 tokens against two rows of 8,000 and two of 100.
  ml = 8000 + new + 8 + 24000
  rows_of = {"100+8000": [100, 8000], "8000+8000": [8000, 8000], "100+100": [100, 100]}
  runs = {} if "ragged" not in tables else {
      (k, name): make_run(model, 2, 0, new, ml, False, lengths=lengths)
      for k, model in models.items() for name, lengths in rows_of.items()}
  if runs:
    med = time_rounds(runs, new, 1.0, args.repeats)
    for k in kernels:
      rows = {name: dict(ms_per_step=ms) for (kk, name), ms in med.items() if kk == k}
      result["tables"][label(k, "ragged/plain/batch2")] = dict(max_len=ml, rows=rows)
      print(label(k, "ragged"), f"max_len {ml}:",
            {k: f"{v['ms_per_step']:.2f} ms" for k, v in rows.items()})

  # 4. The prefill: dense, blocked and chunked attention within the prompt.
  if "prefill" in tables:
    shapes = {f"batch1/{p}": [p] for p in map(int, args.prefill_lens.split(","))}
    shapes["batch2/100+8000"] = [100, 8000]
    result["tables"]["prefill"] = dict(attention_block=llama.ATTENTION_BLOCK,
                                       rows=prefill_table(models[kernels[0]], shapes,
                                                          args.repeats))
  write_json(Path(args.out), result)


if __name__ == "__main__":
  main()
