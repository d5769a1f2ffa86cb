"""From raw runs to the report's numbers: per cell (method x category x batch size) tokens/s,
speedups, tau, acceptance, latency percentiles, the cost model's predicted speedup, and the
goals."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from jaxspec.bench.methods import Settings


def _percentiles(xs: Sequence[float]) -> dict[str, float] | None:
  if not len(xs):
    return None
  a = np.asarray(xs, np.float64) * 1e3
  return dict(p50=float(np.percentile(a, 50)), p95=float(np.percentile(a, 95)),
              p99=float(np.percentile(a, 99)), mean=float(a.mean()), n=int(a.size))


def latency_samples(chunks: Sequence[tuple[float, int]]) -> tuple[float | None, list[float]]:
  """(time to first token, per-token latency samples) from row 0's (seconds since the start,
  tokens received) chunks: every later chunk's wall time split evenly over its tokens (the
  first chunk's tokens are covered by the time to first token)."""
  if not chunks:
    return None, []
  out: list[float] = []
  for (t0, _), (t1, n) in zip(chunks, chunks[1:]):
    out += [(t1 - t0) / n] * n
  return chunks[0][0], out


def expected_tokens_by_k(alpha: Sequence[float], k_max: int) -> np.ndarray:
  """E(k) for k = 0..k_max: `jaxspec.decoding.adaptive.expected_tokens` (the controller's own
  formula) for measured per-position acceptance alpha (positions beyond those measured: 0)."""
  import jax.numpy as jnp

  from jaxspec.decoding.adaptive import expected_tokens as controller_expected
  a = np.zeros((1, max(k_max, 1)), np.float32)
  n = min(len(alpha), k_max)
  a[0, :n] = np.asarray(alpha[:n], np.float32)
  return np.asarray(controller_expected(jnp.asarray(a), tuple(range(k_max + 1))))[0]


def expected_tokens(alpha: Sequence[float], k: int) -> float:
  """E(k) = 1 + sum_{j<=k} prod_{i<=j} alpha_i (alpha beyond the measured positions: 0)."""
  return float(expected_tokens_by_k(alpha, k)[k])


def predicted_times(run: dict[str, Any], prefill_s: float | None) -> dict[str, float] | None:
  """The cost model's times for a speculative run: (plain, speculative, decode-only ratio)."""
  st = run.get("stats", {})
  cm, ks = st.get("cost_model"), st.get("k_per_step")
  if not cm or not ks:
    return None
  from jaxspec.decoding.adaptive import CostModel
  # `CostModel.to_dict`'s form; results written before it hold {k: seconds}.
  model = CostModel.from_dict(cm) if "ks" in cm else CostModel.from_ratios(
      {int(k): float(v) for k, v in cm.items()})
  alpha = st.get("conditional_acceptance_per_position") or []
  c = model.at(list(ks))
  c0 = float(model.at([0])[0])
  e_bar = float(expected_tokens_by_k(alpha, max(ks))[np.asarray(ks, int)].mean())
  c_bar = float(sum(c)) / len(ks)
  n = max(run["lengths"])
  p = prefill_s or 0.0
  return dict(plain=p + (n - 1) * c0, spec=p + n * c_bar / e_bar, decode=c0 * e_bar / c_bar,
              e_bar=e_bar, c_bar=c_bar, c0=c0)


def _pool(runs: list[dict[str, Any]], key: str) -> list[float] | None:
  """A per-position list pooled over runs, weighted by their drafting passes."""
  vs, ws = [], []
  for r in runs:
    st = r.get("stats", {})
    v = st.get(key)
    if v is None:
      continue
    w = max(int(st.get("target_passes") or 0) - int(st.get("plain_steps") or 0), 0)
    vs.append(np.asarray(v, np.float64))
    ws.append(w)
  if not vs or sum(ws) == 0:
    return None
  return (np.sum([v * w for v, w in zip(vs, ws)], 0) / sum(ws)).round(4).tolist()


def summarize(runs: list[dict[str, Any]], prefill: dict[tuple, float]) -> dict[str, Any]:
  """The numbers of one cell (method x category x batch size, or all categories)."""
  tokens = sum(sum(r["lengths"]) for r in runs)
  secs = sum(r["seconds"] for r in runs)
  out: dict[str, Any] = dict(runs=len(runs), rows=sum(len(r["lengths"]) for r in runs),
                             tokens=tokens, seconds=secs,
                             tokens_per_second=tokens / secs if secs > 0 else None,
                             compile_seconds=sum(r["compile_seconds"] for r in runs))
  specs = [r for r in runs if "tau" in r.get("stats", {})]
  if specs:
    row_passes = sum(sum(r["lengths"]) / r["stats"]["tau"] for r in specs if r["stats"]["tau"])
    out["tau"] = sum(sum(r["lengths"]) for r in specs) / row_passes if row_passes else None
    out["acceptance_per_position"] = _pool(specs, "acceptance_per_position")
    out["conditional_acceptance_per_position"] = _pool(specs,
                                                       "conditional_acceptance_per_position")
    steps = [k for r in specs for k in r["stats"].get("k_per_step", [])]
    out["mean_k"] = sum(steps) / len(steps) if steps else None
    hist: dict[str, int] = {}
    for k in steps:
      hist[str(k)] = hist.get(str(k), 0) + 1
    out["k_histogram"] = dict(sorted(hist.items(), key=lambda kv: int(kv[0])))
    out["plain_steps"] = sum(int(r["stats"].get("plain_steps", 0)) for r in specs)
    out["target_passes"] = sum(int(r["stats"].get("target_passes", 0)) for r in specs)
    preds = [predicted_times(r, prefill.get(r["unit"])) for r in specs]
    if all(p is not None for p in preds):
      out["predicted_speedup"] = sum(p["plain"] for p in preds) / sum(p["spec"] for p in preds)
      w = [sum(r["lengths"]) for r in specs]
      out["predicted_decode_speedup"] = sum(p["decode"] * x for p, x in zip(preds, w)) / sum(w)
    else:
      out["predicted_speedup"] = out["predicted_decode_speedup"] = None
  ttfts, lats = [], []
  for r in runs:
    if "chunks" in r:
      t, xs = latency_samples(r["chunks"])
      if t is not None:
        ttfts.append(t)
      lats += xs
  out["latency_ms"] = _percentiles(lats)
  out["ttft_ms"] = _percentiles(ttfts)
  m = [r["matches_plain"] for r in runs if r.get("matches_plain") is not None]
  out["matches_plain"] = sum(m) / len(m) if m else None
  return out


def aggregate(runs: list[dict[str, Any]], s: Settings, categories: Sequence[str]):
  """Cells per (method, batch size, category) plus "all" categories, with speedups against
  the baseline of the same cell."""
  from jaxspec.peers import PEERS
  names = list(s.methods) + list(s.peers)
  # The plain run's time to first token of every batch: the prefill in the predicted times.
  prefill: dict[tuple, float] = {}
  for r in runs:
    if r["method"] == "none" and r.get("chunks"):
      prefill[r["unit"]] = r["chunks"][0][0]
  results: dict[str, dict[str, dict[str, Any]]] = {}
  for b in s.batch_sizes:
    by_b: dict[str, dict[str, Any]] = {}
    for name in names:
      cells = {}
      for cat in list(categories) + ["all"]:
        rs = [r for r in runs if r["method"] == name and r["batch_size"] == b
              and (cat == "all" or r["category"] == cat)]
        if rs:
          cells[cat] = summarize(rs, prefill)
      if cells:
        by_b[name] = cells
    for name, cells in by_b.items():
      base = PEERS[name].baseline if name in PEERS else "none"
      for cat, cell in cells.items():
        ref = by_b.get(base, {}).get(cat)
        plain = by_b.get("none", {}).get(cat)
        tps = cell["tokens_per_second"]
        cell["baseline"] = base
        cell["speedup"] = tps / ref["tokens_per_second"] if ref and tps else None
        cell["vs_jaxspec_plain"] = tps / plain["tokens_per_second"] if plain and tps else None
        pred = cell.get("predicted_speedup")
        cell["achieved_over_predicted"] = (cell["speedup"] / pred if pred and cell["speedup"]
                                           else None)
    results[str(b)] = by_b
  return results


def goals(results, s: Settings) -> dict[str, Any]:
  """Issue 8's goals on the batch-1 "all categories" cells, where the run has what they
  need."""
  b1 = results.get("1", {})
  cell = lambda m: b1.get(m, {}).get("all")
  out: dict[str, Any] = {}
  plain, hf = cell("none"), cell("transformers")
  if plain and hf:
    r = plain["tokens_per_second"] / hf["tokens_per_second"]
    out["plain_vs_transformers_plain"] = dict(goal=1.3, value=r, met=r >= 1.3)
  spec = [m for m in s.methods if m != "none" and cell(m)]
  hf_spec = [p for p in ("transformers-prompt-lookup", "transformers-assisted") if cell(p)]
  if spec and hf_spec:
    best = max(spec, key=lambda m: cell(m)["tokens_per_second"])
    hbest = max(hf_spec, key=lambda p: cell(p)["tokens_per_second"])
    r = cell(best)["tokens_per_second"] / cell(hbest)["tokens_per_second"]
    out["best_vs_transformers_best"] = dict(goal=2.0, value=r, met=r >= 2.0, jaxspec=best,
                                            transformers=hbest)
    if plain:
      r0 = plain["tokens_per_second"] / cell(hbest)["tokens_per_second"]
      out["plain_vs_transformers_best"] = dict(value=r0, transformers=hbest)
  per = {m: cell(m).get("achieved_over_predicted") for m in spec}
  if per:
    vals = [v for v in per.values() if v is not None]
    out["achieved_over_predicted"] = dict(goal=0.85, per_method=per,
                                          met=bool(vals) and min(vals) >= 0.85)
  return out
