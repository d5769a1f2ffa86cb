"""Multi-sample rollouts: `n` samples per prompt against the rows tiled by hand and against
`jax.vmap` over keys, on SmolLM2-135M (float32), sampled at T = 0.8, 32 new tokens.

Three ways to draw n = 8 samples of one prompt with `speculative_decode` (n-gram drafter, k = 4)
and, with --loops spec,plain, with `decode`:

  n       decode(..., n=8): the rows tiled inside the call, sample keys from the prompt's key
  hand    the same call on jnp.repeat(ids, 8) with those keys passed as per-row keys
  vmap    jax.vmap over 8 keys of the one-row call (the loop's conds become selects)

Each is compiled first, then the three are timed in interleaved rounds, each in a rotated
order (best of --rounds: this shared machine's noise only ever slows a run down), and the ratios
come from that one run.
n's and hand's tokens must be equal (the same program on the same keys).

    .venv/bin/python benchmarks/bench_rollouts.py [--new 32] [--samples 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from common import ROOT, machine, write_json
from jaxspec import NGram, Sampling, load
from jaxspec.decoding import as_target, decode, speculative_decode
from jaxspec.sampling import row_keys, sample_keys

PROMPT = "Write a Python function that checks whether a number is prime, then explain it."


def _variants(loop, tgt, ids, lens, samples, new, sampling):
  """name -> a function of (params, key) giving tokens [samples, new]."""
  kw = dict(max_new_tokens=new, sampling=sampling, stop_ids=())  # every row `new` tokens
  if loop == "spec":
    call = lambda p, i, l, k, **x: speculative_decode(tgt, NGram(), i, l, k, target_params=p,
                                                      num_draft_tokens=4, **kw, **x)
  else:
    call = lambda p, i, l, k, **x: decode(tgt, i, l, k, target_params=p, **kw, **x)
  tiled_ids, tiled_lens = jnp.repeat(ids, samples, 0), jnp.repeat(lens, samples)
  return {
      "n": lambda p, k: call(p, ids, lens, k, n=samples).tokens,
      "hand": lambda p, k: call(p, tiled_ids, tiled_lens,
                                sample_keys(row_keys(k, 1), samples)).tokens,
      "vmap": jax.jit(lambda p, k: jax.vmap(
          lambda kk: call(p, ids, lens, kk).tokens[0])(jax.random.split(k, samples))),
  }


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--new", type=int, default=32)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--loops", default="spec")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "rollouts.json"))
  args = ap.parse_args()
  model = load()
  tgt = as_target(model)
  prompt = model.tokenizer.encode_chat(PROMPT)
  ids = jnp.asarray([prompt], jnp.int32)
  lens = jnp.asarray([len(prompt)], jnp.int32)
  sampling = Sampling(temperature=0.8)
  key = jax.random.key(0)
  result = dict(machine=machine(), model="SmolLM2-135M-Instruct float32", prompt_tokens=len(prompt),
                new_tokens=args.new, samples=args.samples, rounds=args.rounds,
                sampling=dict(temperature=0.8), loops={})
  for loop in args.loops.split(","):
    fns = _variants(loop, tgt, ids, lens, args.samples, args.new, sampling)
    compile_s, toks = {}, {}
    for name, f in fns.items():
      t = time.perf_counter()
      toks[name] = np.asarray(jax.block_until_ready(f(tgt.params, key)))
      compile_s[name] = time.perf_counter() - t
      print(f"[{loop}] {name}: first call (compile + run) {compile_s[name]:.1f} s", flush=True)
    np.testing.assert_array_equal(toks["n"], toks["hand"])
    assert toks["vmap"].shape == toks["n"].shape == (args.samples, args.new)
    times = {name: [] for name in fns}
    names = list(fns)
    for r in range(args.rounds):  # interleaved: each round runs all three, in a rotated order
      for name in names[r % 3:] + names[:r % 3]:
        f, k = fns[name], jax.random.key(r + 1)
        t = time.perf_counter()
        jax.block_until_ready(f(tgt.params, k))
        times[name].append(time.perf_counter() - t)
      print(f"[{loop}] round {r}: " + ", ".join(f"{n} {v[-1]:.2f} s" for n, v in times.items()),
            flush=True)
      best = {name: min(v) for name, v in times.items()}
      row = dict(seconds=times, best_seconds=best, first_call_seconds=compile_s,
                 rounds_done=r + 1, n_over_hand=best["n"] / best["hand"],
                 n_over_vmap=best["n"] / best["vmap"], vmap_over_hand=best["vmap"] / best["hand"])
      result["loops"][loop] = row
      # Written after every round: vmap's per-key copies of the weights make this the run a
      # memory-starved shared machine kills first.
      write_json(Path(args.out), result)
    print(f"[{loop}] n/hand {row['n_over_hand']:.3f}, n/vmap {row['n_over_vmap']:.3f},"
          f" vmap/hand {row['vmap_over_hand']:.2f}", flush=True)


if __name__ == "__main__":
  main()
