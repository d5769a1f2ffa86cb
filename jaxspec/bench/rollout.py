"""The rollout workload of `jaxspec bench --workload rollout`: n sampled continuations of each
prompt (RL rollouts in GRPO-style groups, best-of-n), run through the functional API so that
a drafter's params (a `SuffixDecoding` corpus) are carried from one call to the next.

    jaxspec bench --workload rollout --temperatures 0.8,1.0 --batch-sizes 1,8 --samples 8 \\
        --max-new-tokens 256 --methods none,ngram,suffix --out benchmarks/results/rollout

The prompts are the first `--prompts-per-set` questions of gsm8k_train.jsonl and prompts of
humaneval.jsonl (under `--data-dir`, default ../shared/data). At batch size b, the n samples of a
prompt run as n / b consecutive calls of b rows (b = n: one batch whose rows draft from each
other; b = 1: n calls, each drafting from the corpus of the calls before), the prompts one after
the other, every call continuing from the corpus the last returned. Row i of a prompt's group
draws with `jaxspec.sampling.row_keys(key, n)[i]` whatever the batch size, so plain decoding
writes the same samples at every b and every method samples the same distribution.

Every method runs every prompt's group back to back, in an order that alternates from prompt to
prompt (a slow spell of a shared machine hits all of them); each program is compiled (and, with
"auto", its cost model measured once by the engine) before anything is timed. Per temperature,
batch size and method: tokens/s, τ, the speedup over plain decoding and over `NGram`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxspec.bench.methods import BenchError

ROLLOUT_METHODS = {
    "none": "plain `decode`",
    "ngram": "prompt lookup in the row's own context (NGram())",
    "suffix": "suffix decoding over the batch's rows and the carried corpus (SuffixDecoding)",
    "suffix-sampled": "suffix decoding with drafts drawn from the candidates' continuation"
                      " shares and that q verified by the rejection rule"
                      " (SuffixDecoding(sample_drafts=True))",
    "suffix-tree": "suffix decoding drafting a speculation tree of --tree-size nodes, the"
                   " candidates' most frequent continuations (SuffixDecoding(tree=...))",
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutSettings:
  """What one rollout benchmark measures."""

  model: str | None = None
  scan_layers: bool | None = None
  data_dir: str = "../shared/data"
  prompts_per_set: int = 8  # from gsm8k and from humaneval each
  samples: int = 8  # n continuations of each prompt
  temperatures: tuple[float, ...] = (0.8, 1.0)
  batch_sizes: tuple[int, ...] = (1, 8)
  max_new_tokens: int = 256
  methods: tuple[str, ...] = ("none", "ngram", "suffix")
  num_draft_tokens: int | str = "auto"
  k_max: int = 8
  corpus_size: int = 8192
  tree_size: int = 8  # nodes of suffix-tree's tree
  seed: int = 0
  chat: bool = True
  out: str = "bench_out"
  progress: bool = True


def check_rollout(s: RolloutSettings, data: bool = True) -> None:
  """Raises BenchError for settings that cannot run (before a model is loaded); with `data`,
  also where the prompt files are missing."""
  unknown = [m for m in s.methods if m not in ROLLOUT_METHODS]
  if unknown:
    raise BenchError(f"unknown rollout method {', '.join(map(repr, unknown))}: the rollout"
                     f" workload runs {', '.join(ROLLOUT_METHODS)}")
  for b in s.batch_sizes:
    if s.samples % b:
      raise BenchError(f"--batch-sizes {b} does not divide --samples {s.samples}: the samples"
                       " of a prompt run as samples / b calls of b rows")
  if "suffix-tree" in s.methods and not 1 <= s.tree_size <= 255:
    raise BenchError(f"--tree-size must be in [1, 255] for suffix-tree, got {s.tree_size}")
  if not s.temperatures or any(t <= 0 for t in s.temperatures):
    raise BenchError(f"--temperatures must be positive (rollouts are sampled), got"
                     f" {s.temperatures}")
  for name in ("gsm8k_train.jsonl", "humaneval.jsonl") if data else ():
    if not (Path(s.data_dir) / name).is_file():
      raise BenchError(f"{Path(s.data_dir) / name} does not exist: pass --data-dir, the folder"
                       " holding gsm8k_train.jsonl and humaneval.jsonl")


def rollout_prompts(s: RolloutSettings) -> list[tuple[str, str]]:
  """(set, text) of the prompts: gsm8k questions and humaneval prompts, interleaved."""
  def first(name, field, n):
    out = []
    with open(Path(s.data_dir) / name, encoding="utf-8") as f:
      for line in f:
        if line.strip() and len(out) < n:
          out.append(json.loads(line)[field])
    return out
  gsm = first("gsm8k_train.jsonl", "question", s.prompts_per_set)
  code = first("humaneval.jsonl", "prompt", s.prompts_per_set)
  code = [f"Complete this Python function.\n\n{p}" for p in code]
  out = []
  for a, b in zip(gsm, code):
    out += [("gsm8k", a), ("humaneval", b)]
  return out


def group_keys(seed: int, prompt_index: int, n: int):
  """[n] the row keys of prompt `prompt_index`'s n samples: row i draws with the i-th whatever
  the batch size (`benchmarks/suffix_ceiling.py` regenerates the same samples with them)."""
  import jax

  from jaxspec.sampling import row_keys
  return row_keys(jax.random.fold_in(jax.random.key(seed), prompt_index), n)


def _drafter(name: str, target, s: RolloutSettings):
  from jaxspec.drafters import NGram, SuffixDecoding
  if name == "ngram":
    return NGram()
  if name == "suffix":
    return SuffixDecoding(vocab=target.cfg.vocab_size, corpus_size=s.corpus_size)
  if name == "suffix-sampled":
    return SuffixDecoding(vocab=target.cfg.vocab_size, corpus_size=s.corpus_size,
                          sample_drafts=True)
  if name == "suffix-tree":
    return SuffixDecoding(vocab=target.cfg.vocab_size, corpus_size=s.corpus_size,
                          tree=s.tree_size)
  return None


def _cost(target, drafter, ids, b: int, s: RolloutSettings, sampling):
  """The engine's measured cost model for this drafter at batch b ("auto"), or None (a fixed k,
  or a tree: its shape fixes the step)."""
  if s.num_draft_tokens != "auto" or drafter.tree is not None:
    return None
  from jaxspec.api import speculative_generate
  from jaxspec.decoding.adaptive import AutoK
  out = speculative_generate(target, drafter, [ids] * b, max_new_tokens=8, sampling=sampling,
                             auto=AutoK(k_max=s.k_max))
  return out.stats["cost_model"]


def run_rollout(s: RolloutSettings, argv: Sequence[str] | None = None, *, target=None,
                prompt_ids: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
  """Runs the rollout workload; writes rollout.json and rollout.md into `s.out`.

  Args:
    s: the settings.
    argv: the command line, for the report.
    target, prompt_ids: a loaded `Model` instead of `s.model`, and token-id prompts instead of
      the data files' (a model without a tokenizer needs them).
  Returns:
    the report (what rollout.json holds).
  """
  import shlex

  import jax
  import jax.numpy as jnp
  import numpy as np

  from jaxspec.bench.machine import git_commit, loadavg, machine, versions
  from jaxspec.decoding.adaptive import AutoK
  from jaxspec.decoding.functional import decode, speculative_decode
  from jaxspec.engine.io import stop_ids_for
  from jaxspec.models.loading import load
  from jaxspec.sampling import Sampling
  from jaxspec.train.data import encode_prompts, make_progress

  check_rollout(s, data=prompt_ids is None)
  out_dir = Path(s.out)
  out_dir.mkdir(parents=True, exist_ok=True)
  command = "jaxspec " + shlex.join(["bench"] if argv is None else argv)
  load_start, git, t_start = loadavg(), git_commit(), time.perf_counter()
  if target is None:
    target = load(s.model, scan_layers=s.scan_layers)
  if prompt_ids is None:
    prompts = rollout_prompts(s)
    try:
      encoded = encode_prompts(target, [p for _, p in prompts], chat=s.chat)
    except ValueError as e:
      raise BenchError(str(e)) from None
  else:
    encoded = [list(map(int, p)) for p in prompt_ids]
    prompts = [("prompt_ids", None)] * len(encoded)
  stops = tuple(stop_ids_for(target, None))
  width = -(-max(len(p) for p in encoded) // 64) * 64  # one padded width: one program each
  n = s.samples
  keys_of = [group_keys(s.seed, i, n) for i in range(len(encoded))]
  drafters = {m: _drafter(m, target, s) for m in s.methods}

  def padded(ids, b):
    arr = np.zeros((b, width), np.int32)
    arr[:, :len(ids)] = ids
    return jnp.asarray(arr), jnp.full((b,), len(ids), jnp.int32)

  def call(name, ids, lens, keys, sampling, corpus, cost):
    d = drafters[name]
    if d is None:
      return decode(target, ids, lens, keys, max_new_tokens=s.max_new_tokens, sampling=sampling,
                    stop_ids=stops, logprobs=False), corpus
    kw = (dict(num_draft_tokens="auto", auto=AutoK(k_max=s.k_max), cost=cost)
          if s.num_draft_tokens == "auto" else dict(num_draft_tokens=int(s.num_draft_tokens)))
    if d.tree is not None:  # the tree sets the draft's shape
      kw = dict(num_draft_tokens="auto")
    out = speculative_decode(target, d, ids, lens, keys, max_new_tokens=s.max_new_tokens,
                             sampling=sampling, stop_ids=stops, logprobs=False,
                             drafter_params=corpus, **kw)
    return out, (corpus if out.drafter_params is None else out.drafter_params)

  cells: list[dict[str, Any]] = []
  total = len(s.temperatures) * sum(n // b for b in s.batch_sizes) * len(encoded) \
      * len(s.methods)
  with make_progress(s.progress) as bar:
    task = bar.add_task("rollout", total=total, info="")
    for temp in s.temperatures:
      sampling = Sampling(temperature=temp)
      for b in s.batch_sizes:
        costs = {m: None if d is None else _cost(target, d, encoded[0], b, s, sampling)
                 for m, d in drafters.items()}
        corpus = {m: None if d is None else d.params for m, d in drafters.items()}
        rec = {m: dict(seconds=0.0, tokens=0, row_steps=0, emitted=0, drafted=0, accepted=0,
                       calls=0, target_passes=0, spec_row_steps=0, accepted_at=None)
               for m in s.methods}
        ids0, lens0 = padded(encoded[0], b)
        for m in s.methods:  # compile (a throwaway corpus: the timed runs start empty)
          jax.block_until_ready(call(m, ids0, lens0, keys_of[0][:b], sampling, corpus[m],
                                     costs[m])[0].tokens)
        flip = False
        for i, ids in enumerate(encoded):
          order = list(s.methods)[::-1] if flip else list(s.methods)
          flip = not flip
          pid, plen = padded(ids, b)
          for m in order:
            for g in range(n // b):
              bar.update(task, description=f"T={temp} b={b} prompt {i}", info=m)
              t0 = time.perf_counter()
              out, corpus[m] = call(m, pid, plen, keys_of[i][g * b:(g + 1) * b], sampling,
                                    corpus[m], costs[m])
              jax.block_until_ready((out.tokens, corpus[m]))
              r = rec[m]
              r["seconds"] += time.perf_counter() - t0
              r["tokens"] += int(out.lengths.sum())
              r["calls"] += 1
              r["target_passes"] += int(out.target_passes)
              if out.stats is not None:
                st = out.stats
                r["row_steps"] += int(st.row_steps.sum())
                r["emitted"] += int(st.emitted.sum())
                r["drafted"] += int(st.drafted.sum())
                r["accepted"] += int(st.accepted.sum())
                r["spec_row_steps"] += int(st.spec_row_steps.sum())
                at = np.asarray(st.accepted_at, np.int64)
                r["accepted_at"] = (at if r["accepted_at"] is None else r["accepted_at"] + at)
              bar.advance(task)
        plain = rec.get("none")
        for m, r in rec.items():
          tps = r["tokens"] / r["seconds"] if r["seconds"] else None
          at = r["accepted_at"]
          cell = dict(temperature=temp, batch_size=b, method=m, tokens_per_second=tps,
                      **{**r, "accepted_at": None if at is None else at.tolist()})
          # Per draft position i: the share of drafting row-steps whose draft i was accepted.
          cell["acceptance_per_position"] = (None if at is None or not r["spec_row_steps"]
                                             else (at / r["spec_row_steps"]).tolist())
          cell["tau"] = r["emitted"] / r["row_steps"] if r["row_steps"] else None
          cell["acceptance_rate"] = r["accepted"] / r["drafted"] if r["drafted"] else None
          cell["cost_model"] = None if costs[m] is None else costs[m].to_dict()
          cells.append(cell)
        by = {c["method"]: c for c in cells if c["temperature"] == temp
              and c["batch_size"] == b}
        for c in by.values():
          for base, key in (("none", "speedup"), ("ngram", "speedup_over_ngram")):
            ref = by.get(base)
            c[key] = (c["tokens_per_second"] / ref["tokens_per_second"]
                      if ref and plain and ref["tokens_per_second"] else None)
  report = dict(
      schema="jaxspec-bench-rollout/1", command=command,
      date=time.strftime("%Y-%m-%d %H:%M:%S"),
      machine=dict(machine(), load_average_at_start=load_start, load_average_at_end=loadavg()),
      versions=versions(), git=git, model=target.name, settings=dataclasses.asdict(s),
      prompts=[dict(set=k, prompt_tokens=len(e)) for (k, _), e in zip(prompts, encoded)],
      padded_prompt_width=width, stop_ids=list(stops), methods=ROLLOUT_METHODS,
      definitions=ROLLOUT_DEFINITIONS, results=cells, goals=rollout_goals(cells),
      wall_seconds=time.perf_counter() - t_start)
  (out_dir / "rollout.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
  (out_dir / "rollout.md").write_text(rollout_markdown(report), encoding="utf-8")
  return report


ROLLOUT_DEFINITIONS = {
    "tokens_per_second": "new tokens (up to and including a stop token) of every call of the"
                         " cell over their wall time, each call timed to its results on the"
                         " host (prefill included, compilation and the cost model's timing"
                         " excluded)",
    "tau": "tokens emitted per target pass of a live row, the bonus token counted (the first"
           " token, sampled from the prefill's logits, not counted)",
    "speedup": "tokens_per_second over plain decoding's in the same temperature and batch size",
    "speedup_over_ngram": "tokens_per_second over NGram's in the same temperature and batch"
                          " size",
    "acceptance_rate": "accepted drafts over real drafts verified",
    "acceptance_per_position": "per draft position i, the live row-steps that verified drafts"
                               " and accepted draft i over all live row-steps that verified"
                               " drafts (unconditional, as vLLM reports)",
}


def rollout_goals(cells: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """The issue's goals at temperature 0.8, batch 1: suffix τ >= 2.0 and speedup >= 1.25 (for
  each suffix method run: chains and trees)."""
  out = []
  for c in cells:
    m = c["method"]
    if m.startswith("suffix") and c["temperature"] == 0.8 and c["batch_size"] == 1:
      out.append(dict(goal=f"{m} tau >= 2.0 at T=0.8, batch 1", value=c["tau"],
                      met=c["tau"] is not None and c["tau"] >= 2.0))
      out.append(dict(goal=f"{m} speedup >= 1.25x over plain at T=0.8, batch 1",
                      value=c["speedup"], met=c["speedup"] is not None and c["speedup"] >= 1.25))
  return out


def rollout_markdown(report: dict[str, Any]) -> str:
  s, m = report["settings"], report["machine"]
  f = lambda x, fmt="{:.2f}": "–" if x is None else fmt.format(x)
  tree = f", suffix tree {s.get('tree_size')} nodes" if "suffix-tree" in s["methods"] else ""
  lines = ["# jaxspec bench: rollouts", "", f"`{report['command']}`", "",
           f"Machine: {m['cpu']}, {m['cores']} cores; load average {m['load_average_at_start']}"
           f" at the start, {m['load_average_at_end']} at the end; {report['date']}.", "",
           f"{len(report['prompts'])} prompts (gsm8k and humaneval), {s['samples']} samples"
           f" each, {s['max_new_tokens']} new tokens, num_draft_tokens {s['num_draft_tokens']}"
           f" (k_max {s['k_max']}), suffix corpus {s['corpus_size']} tokens{tree}; model"
           f" {report['model']}.", "",
           "| T | batch | method | tokens/s | τ | acceptance | speedup | vs ngram |"
           " acceptance per position |",
           "|---|---|---|---|---|---|---|---|---|"]
  for c in report["results"]:
    at = c.get("acceptance_per_position")
    lines.append(f"| {c['temperature']} | {c['batch_size']} | {c['method']} |"
                 f" {f(c['tokens_per_second'], '{:.1f}')} | {f(c['tau'])} |"
                 f" {f(c['acceptance_rate'])} | {f(c['speedup'])} |"
                 f" {f(c['speedup_over_ngram'])} |"
                 f" {'–' if at is None else ' '.join(f'{x:.2f}' for x in at)} |")
  lines.append("")
  for g in report["goals"]:
    lines.append(f"- {g['goal']}: {f(g['value'])} ({'met' if g['met'] else 'not met'})")
  return "\n".join(lines) + "\n"
