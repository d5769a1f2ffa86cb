"""Running the benchmark: every method (jaxspec's and the peers') back to back on each batch of
prompts, in an order that alternates between batches, then the report written out."""

from __future__ import annotations

import dataclasses
import math
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from jaxspec.bench.aggregate import aggregate, goals
from jaxspec.bench.inputs import DEMO_PROMPTS, read_prompts, select
from jaxspec.bench.machine import git_commit, loadavg, machine, threads, versions
from jaxspec.bench.methods import METHODS, BenchError, Method, Settings
from jaxspec.bench.report import DEFINITIONS, SCHEMA, markdown, plots, to_json


def _sampling(s: Settings):
  from jaxspec.sampling import Sampling
  return Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)


def _spec_kwargs(s: Settings, drafter, method: Method) -> dict[str, Any]:
  """num_draft_tokens (and AutoK) for a drafter: k and k_max capped at its own limit (a
  Medusa head with 4 heads drafts at most 4)."""
  from jaxspec.decoding.adaptive import AutoK
  limit = getattr(drafter, "max_draft_tokens", None)
  kw: dict[str, Any] = dict(method.options)
  if getattr(drafter, "tree", None) is not None:
    return kw  # the tree sets how far it drafts (num_draft_tokens stays "auto")
  if s.num_draft_tokens == "auto":
    k_max = s.k_max if s.k_max is not None else AutoK().k_max
    kw.update(num_draft_tokens="auto", auto=AutoK(k_max=min(k_max, limit or k_max)))
  else:
    kw["num_draft_tokens"] = min(int(s.num_draft_tokens), limit or int(s.num_draft_tokens))
  return kw


def _run_jaxspec(target, drafter, method: Method, prompts, s: Settings) -> dict[str, Any]:
  """One timed run (a run that compiled is repeated and the repeat timed), and the streamed
  run its latencies come from."""
  from jaxspec.api import generate, generate_stream
  from jaxspec.api import speculative_generate, speculative_stream
  common = dict(max_new_tokens=s.max_new_tokens, sampling=_sampling(s), key=s.seed)
  kw = {} if drafter is None else _spec_kwargs(s, drafter, method)

  def once():
    if drafter is None:
      return generate(target, prompts, **common)
    return speculative_generate(target, drafter, prompts, **common, **kw)

  out = once()
  compile_s = out.stats.get("compile_seconds", 0.0) + out.stats.get("cost_seconds", 0.0)
  if compile_s > 0:
    out = once()
  st = out.stats
  rec: dict[str, Any] = dict(
      lengths=[int(n) for n in out.lengths], seconds=float(st["seconds"]),
      compile_seconds=float(compile_s),
      rows=[out.row(b) for b in range(len(out.lengths))])
  if drafter is not None:
    keep = ("tau", "target_passes", "plain_steps", "mean_k", "k_per_step", "k_max",
            "acceptance_rate", "acceptance_per_position", "conditional_acceptance_per_position",
            "cost_model", "num_draft_tokens", "drafter")
    rec["stats"] = {k: st[k] for k in keep if k in st}
    if rec["stats"].get("cost_model") is not None:  # JSON holds plain data
      rec["stats"]["cost_model"] = rec["stats"]["cost_model"].to_dict()
  else:
    rec["stats"] = dict(target_passes=st.get("target_passes"))
  if s.latency:
    def stream():
      if drafter is None:
        it = generate_stream(target, prompts, chunk=1, **common)
      else:
        it = speculative_stream(target, drafter, prompts, chunk=1, **common, **kw)
      chunks, c = [], 0.0
      for new, info in it:
        c = info.get("compile_seconds", 0.0) + info.get("cost_seconds", 0.0)
        if new[0]:  # row 0's tokens, as the peers' chunks count them
          chunks.append((round(float(info["seconds"]), 6), len(new[0])))
      return chunks, c

    chunks, c = stream()
    if c > 0:  # the streamed programs compiled (plain decoding streams with its own)
      rec["compile_seconds"] += c
      chunks, _ = stream()
    rec["chunks"] = chunks
  return rec


def _run_peer(runner, name: str, prompts, stops, s: Settings) -> dict[str, Any]:
  r = runner.run(name, prompts, max_new_tokens=s.max_new_tokens, stop_ids=stops,
                 temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, seed=s.seed)
  chunks = r.chunk_times
  n0 = len(r.tokens[0])
  kept, seen = [], 0  # row 0's tokens only (a finished row of a batch still gets padding)
  for t, n in chunks:
    if seen >= n0:
      break
    kept.append((round(t, 6), min(n, n0 - seen)))
    seen += kept[-1][1]
  return dict(lengths=[len(t) for t in r.tokens], seconds=float(r.seconds), rows=r.tokens,
              chunks=kept, compile_seconds=0.0, stats={})


def _groups(prompts: list[Any], b: int) -> list[list[Any]]:
  """Batches of b prompts (cycling through the category's prompts to fill the last one)."""
  n = math.ceil(len(prompts) / b)
  return [[prompts[(g * b + i) % len(prompts)] for i in range(b)] for g in range(n)]


def _units(encoded: Mapping[str, list[Any]], batch_sizes: Sequence[int]) -> list[tuple]:
  """The (batch size, category, group index, prompts) units in the order they run: by batch
  size, then by the prompt length the programs are compiled for (`generate`'s 64-token
  buckets), then in category order. Every method runs on a unit back to back, so the methods
  still share the machine's slow spells; ordered this way each compiled loop is needed for one
  stretch of the run, so when the process nears vm.max_map_count the programs released are
  those of finished lengths rather than ones compiled again for the next unit."""
  from jaxspec.engine.io import round_up
  units = [(b, cat, g, group) for b in batch_sizes for cat, ps in encoded.items()
           for g, group in enumerate(_groups(ps, b))]
  return sorted(units, key=lambda u: (batch_sizes.index(u[0]),
                                      round_up(max(len(p) for p in u[3]), 64)))


def run_bench(s: Settings, argv: Sequence[str] | None = None) -> dict[str, Any]:
  """Runs the benchmark and writes bench.json, bench.md and the plots into `s.out`.

  Returns:
    the report (what bench.json holds).
  Raises:
    BenchError: bad input (before any model is loaded).
  """
  rows = read_prompts(s.prompts)
  chosen = select(rows, s.categories, s.per_category)
  from jaxspec.peers import PEERS
  skipped: dict[str, str] = {}
  peers = list(s.peers)
  for p in list(peers):
    if PEERS[p].needs_draft_model and not s.draft_model:
      skipped[p] = ("assisted generation needs a draft model in Hugging Face layout: pass"
                    " --draft-model DIR (e.g. from `jaxspec train draft-model`)")
      peers.remove(p)
  out_dir = Path(s.out)
  out_dir.mkdir(parents=True, exist_ok=True)

  from jaxspec.engine import programs_released
  from jaxspec.engine.io import stop_ids_for
  from jaxspec.models.errors import CheckpointError
  from jaxspec.models.loading import load
  from jaxspec.train.data import encode_prompts, make_progress
  command = "jaxspec " + shlex.join(["bench"] if argv is None else argv)
  t_start = time.perf_counter()
  load_start, git = loadavg(), git_commit()  # as the run starts
  target = load(s.model, scan_layers=s.scan_layers)
  drafters: dict[str, Any] = {}
  notes: dict[str, str] = {}
  for name in s.methods:
    meth = METHODS[name]
    if meth.make is None:
      drafters[name] = None
      continue
    try:
      drafters[name], notes[name] = meth.make(target, s)
    except (ValueError, CheckpointError) as e:
      raise BenchError(f"method {name!r}: {e}") from None
  try:
    encoded = {c: encode_prompts(target, ps, chat=s.chat) for c, ps in chosen.items()}
  except ValueError as e:
    raise BenchError(str(e)) from None
  stops = list(stop_ids_for(target, None))
  nthreads = threads()
  runners: dict[str, Any] = {}
  libs = sorted({PEERS[p].library for p in peers})
  if "transformers" in libs:
    from jaxspec.peers import TransformersRunner
    runners["transformers"] = TransformersRunner(s.model, s.draft_model, threads=nthreads,
                                                 lookup_tokens=s.lookup_tokens)
  if "llama.cpp" in libs:
    from jaxspec.peers import LlamaCppRunner
    longest = max(len(p) for ps in encoded.values() for p in ps)
    runners["llama.cpp"] = LlamaCppRunner(
        s.model, [p for p in peers if PEERS[p].library == "llama.cpp"], threads=nthreads,
        n_ctx=longest + s.max_new_tokens + 64, lookup_tokens=s.lookup_tokens)
  for p in list(peers):
    if not PEERS[p].batched and max(s.batch_sizes) > 1:
      skipped.setdefault(f"{p} at batch > 1", f"{PEERS[p].description} decodes one row at a"
                                              " time; it runs at batch 1 only")

  units = _units(encoded, s.batch_sizes)
  names_at = {b: list(s.methods) + [p for p in peers if PEERS[p].batched or b == 1]
              for b in s.batch_sizes}
  total = sum(len(names_at[b]) for b, *_ in units)
  runs: list[dict[str, Any]] = []
  warmed: set = set()
  flip = False
  released0 = programs_released()
  try:
    with make_progress(s.progress) as bar:
      task = bar.add_task("bench", total=total, info="")
      for unit_i, (b, cat, g, group) in enumerate(units):
        order = names_at[b][::-1] if flip else names_at[b]
        flip = not flip
        unit_runs = {}
        for name in order:
          bar.update(task, description=f"b={b} {cat} #{g}", info=name)
          if name in PEERS:
            runner = runners[PEERS[name].library]
            if (name, b) not in warmed:  # the first call of a library at a batch size is slow
              _run_peer(runner, name, group, stops, s)
              warmed.add((name, b))
            rec = _run_peer(runner, name, group, stops, s)
            rec["kind"] = "peer"
          else:
            rec = _run_jaxspec(target, drafters[name], METHODS[name], group, s)
            rec["kind"] = "jaxspec"
          rec.update(method=name, batch_size=b, category=cat, group=g, unit=unit_i,
                     prompt_lengths=[len(p) for p in group])
          unit_runs[name] = rec
          runs.append(rec)
          bar.advance(task)
        plain = unit_runs["none"]["rows"]
        for name, rec in unit_runs.items():
          if name != "none" and s.temperature == 0:
            rec["matches_plain"] = sum(a == p for a, p in zip(rec["rows"], plain)) / len(plain)
        for rec in unit_runs.values():
          del rec["rows"]  # the tokens themselves: not kept in the report
  except BaseException as e:  # an interrupt or a crash: keep the finished runs
    if runs:
      partial = out_dir / "bench.partial.json"
      partial.write_text(to_json(dict(
          schema=SCHEMA, incomplete=f"{type(e).__name__}: {e}", command=command,
          date=time.strftime("%Y-%m-%d %H:%M:%S"), git=git, settings=dataclasses.asdict(s),
          runs=runs)), encoding="utf-8")
      print(f"jaxspec bench stopped ({type(e).__name__}); the {len(runs)} finished runs are in"
            f" {partial}", file=sys.stderr)
    raise
  wall = time.perf_counter() - t_start

  cats = list(encoded)
  results = aggregate(runs, s, cats)
  vers = versions()
  if libs:
    from jaxspec.peers import versions as peer_versions
    vers.update(peer_versions(libs))
  settings = dataclasses.asdict(s)
  settings["prompts"] = s.prompts or f"built-in demo set ({DEMO_PROMPTS.name})"
  settings["scan_layers"] = target.scan_layers  # the layout used (auto resolved)
  report = dict(
      schema=SCHEMA, command=command,
      date=time.strftime("%Y-%m-%d %H:%M:%S"),
      machine=dict(machine(), load_average_at_start=load_start, load_average_at_end=loadavg()),
      versions=vers,
      git=git, settings=settings, model=target.name, categories=cats,
      methods={n: METHODS[n].description for n in s.methods},
      drafters=notes, peers_run=peers,
      peer_descriptions={p: PEERS[p].description for p in peers},
      peer_threads=nthreads if peers else None, skipped=skipped, stop_ids=stops,
      programs_released=programs_released() - released0,
      wall_seconds=wall, definitions=DEFINITIONS, results=results, goals=None, runs=runs,
      files=[])
  report["goals"] = goals(results, s)
  report["files"] = ["bench.json", "bench.md"] + plots(report, out_dir)
  (out_dir / "bench.md").write_text(markdown(report), encoding="utf-8")
  (out_dir / "bench.json").write_text(to_json(report), encoding="utf-8")
  return report
