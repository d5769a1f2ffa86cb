"""How far suffix decoding can go on the rollout workload: tau of jaxspec's `SuffixDecoding`
replayed offline, and of oracles that copy the best continuation the corpus holds.

    .venv/bin/python benchmarks/suffix_ceiling.py [--temperatures 0.8,1.0] [--ks 3,5,8]

The rollout workload's samples (`jaxspec bench --workload rollout`: its prompts, its keys, n
samples of each prompt at each temperature, `--max-new-tokens`) are generated once by plain
decoding. Under sampling a deterministic draft is accepted exactly when it equals the token plain
sampling draws at that position with the row's key (the coupled rule keeps sampled text
`generate`'s), so drafting can be replayed offline over the fixed samples: at each step a rule
proposes up to k tokens from the corpus and the row's text so far, the accepted count is the
proposal's common prefix with the real continuation, and the step emits that plus one (the
first token, from the prefill, not counted, as the benchmark counts tau). A prompt's samples
are replayed one after the other, each with the corpus of every call before it (batch 1,
consecutive calls carrying the corpus). Rules:

* `suffix`: jaxspec's `SuffixDecoding()` itself (its jitted `propose` on the replayed row and
  corpus, `next_params` appending each finished sample): the tau that `jaxspec bench --workload
  rollout --batch-sizes 1 --num-draft-tokens k --methods suffix` measures in the same settings.
* `oracle-longest`: among every occurrence, in the same corpus and row, of the longest match of
  the row's last tokens (all of them, not only the drafter's `candidates`), the one whose
  continuation turns out longest: a bound for any chain or tree that copies a continuation of
  the longest match, as if a tree of all of them were verified at no extra cost.
* `oracle-any`: the same over every occurrence of at least the row's last token (every
  continuation the corpus holds of any suffix of the row).

It then bounds the speedup over plain decoding at batch 1: tau / (verify(k) / decode), with the
cost of a k + 1-token target pass over a one-token pass measured here (batch 1, `--context`
cached tokens; `bench_speculative.verify_cost`), drafting and prefill taken as free. No rule
that copies from the corpus does better than `oracle-any` at that cost.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench_speculative import verify_cost
from common import ROOT, machine, write_json
from jaxspec.bench.rollout import RolloutSettings, group_keys, rollout_prompts
from jaxspec.decoding.drafter import DraftContext
from jaxspec.decoding.functional import decode
from jaxspec.drafters import SuffixDecoding
from jaxspec.drafters.suffix import SEP
from jaxspec.engine.io import stop_ids_for
from jaxspec.models.loading import load
from jaxspec.sampling import Sampling
from jaxspec.train.data import encode_prompts


def rollouts(model, prompts, temperature: float, n: int, max_new: int, seed: int):
  """[prompt][sample] the new tokens of plain sampled decoding, with the rollout benchmark's
  keys (`group_keys`) and stop ids."""
  stops = tuple(stop_ids_for(model, None))
  width = -(-max(len(p) for p in prompts) // 64) * 64
  out = []
  for i, ids in enumerate(prompts):
    arr = np.zeros((n, width), np.int32)
    arr[:, :len(ids)] = ids
    o = decode(model, jnp.asarray(arr), jnp.full((n,), len(ids), jnp.int32),
               group_keys(seed, i, n),
               max_new_tokens=max_new, sampling=Sampling(temperature=temperature),
               stop_ids=stops, logprobs=False)
    toks, lens = np.asarray(o.tokens), np.asarray(o.lengths)
    out.append([toks[r, :lens[r]].tolist() for r in range(n)])
  return out


def _match(hay: np.ndarray, tail: np.ndarray, m: int) -> np.ndarray:
  """[H] how many of `tail`'s last tokens (at most m) end at each position of `hay`, 0 where
  nothing follows the position (a SEP next, or the end)."""
  h = hay.shape[0]
  run = np.ones(h, bool)
  match = np.zeros(h, np.int32)
  for i in range(min(m, len(tail))):
    shifted = np.concatenate([np.full(i, SEP - 1), hay[:h - i]])
    run &= shifted == tail[len(tail) - 1 - i]
    if not run.any():
      break
    match += run
  follows = np.concatenate([hay[1:], [SEP]]) >= 0
  return np.where(follows, match, 0)


def _oracle(hay: np.ndarray, tail: np.ndarray, future: np.ndarray, m: int, longest: bool) -> int:
  """Accepted tokens of the best continuation among the matches (see the module docstring)."""
  match = _match(hay, tail, m)
  best = match.max()
  if best < 1:
    return 0
  idx = np.nonzero(match == best if longest else match >= 1)[0]
  k = len(future)
  cont = np.concatenate([hay, np.full(k + 1, SEP)])[idx[:, None] + 1 + np.arange(k)[None, :]]
  return int(np.cumprod(cont == future[None, :], axis=1).sum(axis=1).max())


def proposer(drafter: SuffixDecoding, k: int):
  """The drafter's jitted `propose` of k tokens at batch 1: (corpus, seq [1, S], seq_len [1],
  prompt_len [1]) -> Proposal."""
  return jax.jit(lambda c, seq, n, p: drafter.propose(
      c, drafter.init(c, None, None, None), DraftContext(seq=seq, seq_len=n, prompt_len=p), k,
      None, None)[0])


def replay(drafter: SuffixDecoding, prompt: list[int], samples: list[list[int]], corpus, k: int,
           width: int, propose):
  """(passes and emitted tokens per rule, the corpus after the samples) for one prompt's samples
  replayed one after the other at batch 1; `propose` is `proposer(drafter, k)`, seq `width`
  tokens wide."""
  rules = {r: [0, 0] for r in ("suffix", "oracle-longest", "oracle-any")}
  p = len(prompt)
  for y in samples:
    seq = np.zeros((1, width), np.int32)
    seq[0, :p] = prompt
    seq[0, p:p + len(y)] = y
    ordered = np.asarray(corpus.ordered())
    for rule in rules:
      t = 1  # the first token comes from the prefill
      while t < len(y):
        kk = min(k, len(y) - t)  # as the loop: no drafts past max_new_tokens or a stop
        future = np.asarray(y[t:t + kk])
        if rule == "suffix":
          prop = propose(corpus, jnp.asarray(seq), jnp.array([p + t], jnp.int32),
                         jnp.array([p], jnp.int32))
          d = np.asarray(prop.tokens[0])[:min(int(prop.n_valid[0]), kk)]
          neq = np.nonzero(d != future[:len(d)])[0]
          acc = int(neq[0]) if len(neq) else len(d)
        else:
          ctx = np.asarray(prompt + y[:t])
          hay = np.concatenate([ordered, ctx, [SEP]])
          acc = _oracle(hay, ctx[-drafter.max_match:], future, drafter.max_match,
                        rule == "oracle-longest")
        rules[rule][0] += 1
        rules[rule][1] += min(acc + 1, len(y) - t)  # a stop or max_new_tokens ends the row
        t += acc + 1
    full = DraftContext(seq=jnp.asarray(seq), seq_len=jnp.array([p + len(y)], jnp.int32),
                        prompt_len=jnp.array([p], jnp.int32))
    corpus = drafter.next_params(corpus, None, full)
  return rules, corpus


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--temperatures", default="0.8,1.0")
  ap.add_argument("--ks", default="3,5,8")
  ap.add_argument("--prompts-per-set", type=int, default=8)
  ap.add_argument("--samples", type=int, default=8)
  ap.add_argument("--max-new-tokens", type=int, default=256)
  ap.add_argument("--corpus-size", type=int, default=8192)
  ap.add_argument("--data-dir", default=str(ROOT.parent / "shared" / "data"))
  ap.add_argument("--context", type=int, default=320,
                  help="cached tokens for the verify-cost pass (prompt + about half the output)")
  ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "suffix_ceiling.json"))
  args = ap.parse_args()
  t_start = time.perf_counter()
  s = RolloutSettings(prompts_per_set=args.prompts_per_set, data_dir=args.data_dir)
  model = load(None)
  prompts = rollout_prompts(s)
  encoded = encode_prompts(model, [p for _, p in prompts], chat=s.chat)
  ks = [int(k) for k in args.ks.split(",")]
  cost = verify_cost(model, batch_sizes=(1,), ks=ks, context=args.context)[1]
  drafter = SuffixDecoding(vocab=model.cfg.vocab_size, corpus_size=args.corpus_size)
  width = max(len(p) for p in encoded) + args.max_new_tokens + max(ks) + 1
  result = dict(machine=machine(), settings=vars(args), model=model.name,
                prompts=[dict(set=k, prompt_tokens=len(e)) for (k, _), e in zip(prompts, encoded)],
                verify_over_decode={str(k): cost["verify_over_decode"][k] for k in ks},
                decode_step_seconds=cost["decode_step_seconds"], temperatures={})
  for temp in [float(x) for x in args.temperatures.split(",")]:
    t0 = time.perf_counter()
    samples = rollouts(model, encoded, temp, args.samples, args.max_new_tokens, s.seed)
    gen_s = time.perf_counter() - t0
    cell = dict(generation_seconds=gen_s, new_tokens=sum(len(y) for g in samples for y in g),
                ks={})
    for k in ks:
      propose = proposer(drafter, k)
      corpus = drafter.params
      tot = {}
      by_set = {}
      for (kind, _), prompt, group in zip(prompts, encoded, samples):
        rules, corpus = replay(drafter, prompt, group, corpus, k, width, propose)
        for r, (passes, emitted) in rules.items():
          for d in (tot, by_set.setdefault(kind, {})):
            d.setdefault(r, [0, 0])
            d[r][0] += passes
            d[r][1] += emitted
      c = cost["verify_over_decode"][k]
      cell["ks"][str(k)] = {
          r: dict(tau=e / n, speedup_bound=e / n / c,
                  tau_by_set={kind: v[r][1] / v[r][0] for kind, v in by_set.items()})
          for r, (n, e) in tot.items()}
      print(f"T={temp} k={k} (verify/decode {c:.2f}): " + "; ".join(
          f"{r} tau {v['tau']:.2f} (bound {v['speedup_bound']:.2f}x)"
          for r, v in cell["ks"][str(k)].items()), flush=True)
    result["temperatures"][str(temp)] = cell
  result["wall_seconds"] = time.perf_counter() - t_start
  write_json(Path(args.out), result)


if __name__ == "__main__":
  main()
