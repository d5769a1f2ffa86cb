"""The benchmark's outputs: `DEFINITIONS` of every number, the markdown tables, the four plots
and the JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA = "jaxspec-bench/1"

DEFINITIONS = {
    "tokens_per_second": "new tokens generated (per row up to and including its first stop"
                         " token, summed over rows and runs) over the seconds of those runs;"
                         " jaxspec: stats['seconds'] of generate / speculative_generate, which"
                         " include the prefill and exclude compilation and the cost-model"
                         " timing; peers: wall time of their generate call",
    "speedup": "tokens_per_second over the baseline's tokens_per_second for the same category"
               " and batch size in this invocation (jaxspec methods: plain `generate`, method"
               " 'none'; peers: their own library's plain decoding)",
    "vs_jaxspec_plain": "tokens_per_second over jaxspec plain `generate`'s in the same cell",
    "tau": "tokens emitted per target pass of a live row, counting the bonus/correction token"
           " (pooled: total tokens over total row passes)",
    "acceptance_per_position": "fraction of the drafting verify passes in which draft i was"
                               " accepted (unconditional, as vLLM reports), pooled over runs"
                               " weighted by their drafting passes",
    "conditional_acceptance_per_position": "acceptance of draft i given drafts 1..i-1 were"
                                           " accepted, pooled likewise",
    "mean_k": "mean drafts verified per step (0 = a plain step), the adaptive controller's"
              " choice with num_draft_tokens='auto'",
    "latency_ms": "per-token latency: in a separate streamed run of the same batch (one step"
                  " per chunk), each step's wall time divided by the tokens row 0 received in"
                  " it, one sample per token after the first; p50/p95/p99 over the cell's"
                  " tokens. Peers: the same, from a streamer's callbacks in the timed run",
    "ttft_ms": "time to first token of row 0 in the streamed run (prefill included: every"
               " method samples the first token from the prefill's logits)",
    "compile_seconds": "compilation (and, with 'auto', timing the cost model) of the cell's"
                       " first runs, excluded from tokens_per_second: a run that compiled is"
                       " run again and the second run is the one timed",
    "predicted_speedup": "the cost model's prediction from the measured acceptance and costs:"
                         " per run, E(k) = 1 + sum_{j<=k} prod_{i<=j} alpha_i with alpha the"
                         " run's measured conditional acceptance per position, averaged over"
                         " the k the controller chose at each step (Ē), and the cost model's"
                         " step time c(k) averaged likewise (C̄); a run of N tokens (its"
                         " longest row) is predicted to take P + (N - 1) c(0) plainly and"
                         " P + N C̄ / Ē speculatively, with P the plain run's measured time to"
                         " first token; the cell's prediction is the ratio of the summed times",
    "predicted_decode_speedup": "the same without the prefill: c(0) Ē / C̄",
    "achieved_over_predicted": "speedup / predicted_speedup",
    "matches_plain": "greedy only: fraction of rows whose tokens equal jaxspec plain"
                     " decoding's for the same prompts (exactness check; peers run other"
                     " kernels, so rounding may change a later token)",
}


def _f(x, fmt="{:.2f}", none="–"):
  return none if x is None else fmt.format(x)


def markdown(report: dict[str, Any]) -> str:
  s, res = report["settings"], report["results"]
  m, v = report["machine"], report["versions"]
  lines = ["# jaxspec bench", "", f"`{report['command']}`", "",
           f"Machine: {m['cpu']}, {m['cores']} cores, accelerator {m['accelerator']}; jax"
           f" {v['jax']}, flax {v['flax']}"
           + "".join(f", {k} {v[k]}" for k in ("torch", "transformers", "llama_cpp_python")
                     if k in v)
           + f"; commit {(report['git']['commit'] or '?')[:10]}"
           + (" (uncommitted changes)" if report["git"].get("dirty") else "")
           + f"; {report['date']}."
           + (f" Load average (1 min) {m['load_average_at_start'][0]} at the start,"
              f" {m['load_average_at_end'][0]} at the end."
              if m.get("load_average_at_start") and m.get("load_average_at_end") else ""), "",
           f"Prompts: {s['prompts']} ({', '.join(report['categories'])}; {s['per_category']}"
           f" per category); {s['max_new_tokens']} new tokens;"
           f" temperature {s['temperature']}; num_draft_tokens {s['num_draft_tokens']}"
           + ("" if s.get("scan_layers") is None else
              f"; target layers {'scanned' if s['scan_layers'] else 'unrolled'}") + ".", ""]
  for name, why in report["skipped"].items():
    lines.append(f"- **{name}** not run: {why}")
  for name, what in report["drafters"].items():
    lines.append(f"- {name}: {what}")
  if report.get("programs_released"):
    lines.append(f"- {report['programs_released']} compiled programs were released near the"
                 " process's vm.max_map_count (one needed again compiles again; compile time is"
                 " never in the timings; raising the limit keeps them)")
  if report.get("peer_threads"):
    lines.append(f"- peers run on {report['peer_threads']} CPU threads"
                 f" (torch.set_num_threads), as many as JAX's CPU backend uses")
  lines.append("")
  for b, by_m in res.items():
    lines += [f"## Batch {b}", "",
              "| method | tok/s | speedup | vs jaxspec plain | τ | acceptance by position |"
              " mean k | latency p50/p95/p99 ms | TTFT ms | compile s | predicted |"
              " achieved / predicted | matches plain |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, cells in by_m.items():
      c = cells["all"]
      acc = " ".join(f"{a:.2f}" for a in (c.get("acceptance_per_position") or [])[:5])
      lat = c.get("latency_ms")
      lat_s = "–" if not lat else f"{lat['p50']:.0f}/{lat['p95']:.0f}/{lat['p99']:.0f}"
      speed = _f(c["speedup"], "{:.2f}×")
      if c["baseline"] != "none":
        speed += f" (over {c['baseline']})"
      lines.append(
          f"| {name} | {_f(c['tokens_per_second'], '{:.1f}')} | {speed} |"
          f" {_f(c['vs_jaxspec_plain'], '{:.2f}×')} | {_f(c.get('tau'))} | {acc or '–'} |"
          f" {_f(c.get('mean_k'))} | {lat_s} |"
          f" {_f((c.get('ttft_ms') or {}).get('mean'), '{:.0f}')} |"
          f" {_f(c['compile_seconds'], '{:.1f}')} | {_f(c.get('predicted_speedup'), '{:.2f}×')} |"
          f" {_f(c.get('achieved_over_predicted'))} | {_f(c.get('matches_plain'))} |")
    cats = [k for k in next(iter(by_m.values())) if k != "all"]
    if len(cats) > 1:
      lines += ["", f"Speedup by category (batch {b}):", "",
                "| method | " + " | ".join(cats) + " | all |",
                "|---|" + "---|" * (len(cats) + 1)]
      for name, cells in by_m.items():
        if name in ("none", "transformers", "llama.cpp"):
          continue
        lines.append(f"| {name} | " + " | ".join(
            _f(cells.get(cat, {}).get("speedup"), "{:.2f}×") for cat in cats + ["all"]) + " |")
    lines.append("")
  g = report.get("goals") or {}
  if g:
    lines += ["## Goals (batch 1, all categories)", ""]
    if "plain_vs_transformers_plain" in g:
      x = g["plain_vs_transformers_plain"]
      lines.append(f"- jaxspec plain / transformers plain: {x['value']:.2f}× (goal ≥"
                   f" {x['goal']}×): {'met' if x['met'] else 'NOT met'}")
    if "best_vs_transformers_best" in g:
      x = g["best_vs_transformers_best"]
      lines.append(f"- jaxspec's best speculative method ({x['jaxspec']}) / transformers' best"
                   f" ({x['transformers']}): {x['value']:.2f}× (goal ≥ {x['goal']}×):"
                   f" {'met' if x['met'] else 'NOT met'}")
    if "plain_vs_transformers_best" in g:
      x = g["plain_vs_transformers_best"]
      lines.append(f"- jaxspec plain / transformers' best ({x['transformers']}):"
                   f" {x['value']:.2f}×")
    if "achieved_over_predicted" in g:
      x = g["achieved_over_predicted"]
      per = ", ".join(f"{k} {_f(val)}" for k, val in x["per_method"].items())
      lines.append(f"- achieved / predicted speedup: {per} (goal ≥ {x['goal']} for each):"
                   f" {'met' if x['met'] else 'NOT met'}")
    lines.append("")
  lines.append("Definitions: see `definitions` in bench.json.")
  return "\n".join(lines) + "\n"


def plots(report: dict[str, Any], out: Path) -> list[str]:
  """The four PNGs; returns their file names."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  res = report["results"]
  b0 = str(min(int(b) for b in res))
  by_m = res[b0]
  files = []

  def save(fig, ax, title, name, **legend):
    ax.set_title(title, fontsize=10)
    if ax.get_legend_handles_labels()[0]:
      ax.legend(**legend)
    fig.tight_layout()
    fig.savefig(out / name)
    plt.close(fig)
    files.append(name)

  # 1. Speedup by category and method (smallest batch).
  names = [n for n in by_m if n not in ("none", "transformers", "llama.cpp")]
  cats = [c for c in next(iter(by_m.values())) if c != "all"] + ["all"]
  fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(cats) + 2), 3.8), dpi=100)
  w = 0.8 / max(len(names), 1)
  for i, n in enumerate(names):
    ys = [by_m[n].get(c, {}).get("speedup") or 0 for c in cats]
    ax.bar(np.arange(len(cats)) + (i - (len(names) - 1) / 2) * w, ys, w, label=n,
           hatch="//" if n in report["peers_run"] else None)
  ax.axhline(1, color="k", lw=0.8)
  ax.set_xticks(np.arange(len(cats)), cats, rotation=30, ha="right")
  ax.set_ylabel("speedup over own plain decoding")
  save(fig, ax, f"Speedup by category, batch {b0} (hatched: peers, over their own plain)",
       "speedup_by_category.png", fontsize=7, ncol=2)

  # 2. Acceptance by draft position.
  fig, ax = plt.subplots(figsize=(6, 3.8), dpi=100)
  for n, cells in by_m.items():
    acc = cells["all"].get("acceptance_per_position")
    if acc:
      ax.plot(np.arange(1, len(acc) + 1), acc, marker="o", label=n)
  ax.set_xlabel("draft position")
  ax.set_ylabel("acceptance (unconditional)")
  ax.set_ylim(0, 1)
  save(fig, ax, f"Acceptance by draft position (batch {b0}, all categories)",
       "acceptance_by_position.png", fontsize=8)

  # 3. Throughput vs batch size.
  fig, ax = plt.subplots(figsize=(6, 3.8), dpi=100)
  allnames = list(dict.fromkeys(n for by in res.values() for n in by))
  for n in allnames:
    pts = [(int(b), by[n]["all"]["tokens_per_second"]) for b, by in res.items() if n in by]
    xs, ys = zip(*sorted(pts))
    ax.plot(xs, ys, marker="o", label=n, ls="--" if n in report["peers_run"] else "-")
  ax.set_xscale("log", base=2)
  sizes = sorted(int(b) for b in res)
  ax.set_xticks(sizes, [str(b) for b in sizes])
  ax.minorticks_off()
  ax.set_ylim(bottom=0)
  ax.set_xlabel("batch size")
  ax.set_ylabel("tokens/s")
  save(fig, ax, "Throughput vs batch size (all categories)", "throughput_vs_batch.png",
       fontsize=7)

  # 4. Achieved vs predicted speedup, one point per method and category.
  fig, ax = plt.subplots(figsize=(5, 4.5), dpi=100)
  lo, hi = 1.0, 1.0
  for b, by in res.items():
    for n, cells in by.items():
      pts = [(c.get("predicted_speedup"), c.get("speedup")) for k, c in cells.items()
             if k != "all" and c.get("predicted_speedup") and c.get("speedup")]
      if pts:
        xs, ys = zip(*pts)
        ax.scatter(xs, ys, s=18, label=f"{n} (b={b})")
        lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
  grid = np.linspace(lo * 0.9, hi * 1.1, 2)
  ax.plot(grid, grid, "k-", lw=0.8, label="achieved = predicted")
  ax.plot(grid, 0.85 * grid, "k:", lw=0.8, label="0.85 × predicted")
  ax.set_xlabel("predicted speedup (cost model)")
  ax.set_ylabel("achieved speedup")
  save(fig, ax, "Achieved vs predicted speedup (per category)", "achieved_vs_predicted.png",
       fontsize=7)
  return files


def to_json(report: dict[str, Any]) -> str:
  """The report as JSON: indented, except one line per raw run (their step timings are long)."""
  head = {k: v for k, v in report.items() if k != "runs"}
  text = json.dumps(head, indent=1, default=float)
  runs = ",\n  ".join(json.dumps(r, default=float) for r in report["runs"])
  return text[:-2] + ',\n "runs": [\n  ' + runs + '\n ]\n}\n'
