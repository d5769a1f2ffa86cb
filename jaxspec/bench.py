"""`jaxspec bench`: every method on a prompt set, beside plain decoding and peer libraries.

    jaxspec bench --prompts ../shared/data/spec_bench_dev.jsonl --categories mt-bench \\
        --methods none,ngram,medusa,mlp,eagle,eagle-tree,draft-model --batch-sizes 1,8 \\
        --peers transformers,transformers-prompt-lookup --out bench_out

For every batch size, category and batch of prompts, all methods (jaxspec's and the peers')
run back to back in an order that alternates from one batch to the next, so a slow spell of a
shared machine hits every method alike; speedups divide tokens/s measured in the same
invocation. Per method, category and batch size it reports tokens/s, the speedup over plain
`generate` (a peer: over its own library's plain decoding), τ, acceptance per draft position,
the k the adaptive controller chose, per-token latency percentiles, time to first token,
compile time (apart), and the speedup the cost model predicts from the measured acceptance and
step costs. It writes bench.json (every raw number, the machine, versions, git commit and
command), bench.md (tables) and four plots into --out.

A method is one entry of `METHODS` (a peer one of `jaxspec.peers.PEERS`); adding one is adding
an entry. Definitions of every number are in `DEFINITIONS` and in the JSON.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA = "jaxspec-bench/1"
MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
            "humanities")
DEMO_PROMPTS = Path(__file__).resolve().parent / "assets" / "bench_prompts.jsonl"
DEFAULT_METHODS = "none,ngram,eagle"


class BenchError(ValueError):
  """Bad input to the benchmark; the message says what to change."""


# ----------------------------------------------------------------------------------------------
# The method registry.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Method:
  """One jaxspec method.

  Attributes:
    description: one line for the tables.
    make: (target, settings) -> (drafter, what it is); None: plain `generate`.
    options: extra keyword arguments of `speculative_generate` / `speculative_stream`.
  """

  description: str
  make: Callable[[Any, "Settings"], tuple[Any, str]] | None = None
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _named(spec: str, what: str):
  def make(target, s):
    from jaxspec.drafters import resolve_drafter
    return resolve_drafter(target, spec), what
  return make


def _tree(spec: str, what: str):
  """A head drafting a tree of `--tree-size` nodes (`jaxspec.tree.default_tree`: EAGLE-2's
  dynamic tree for EAGLE, the best static tree from the measured top-k accuracies for Medusa)."""
  def make(target, s):
    from jaxspec.drafters import resolve_drafter
    from jaxspec.tree import default_tree
    drafter = resolve_drafter(target, spec)
    tree = default_tree(drafter, s.tree_size)
    return drafter.with_tree(tree), f"{what}, {tree.describe()}"
  return make


def _draft_model(target, s):
  if s.draft_model:
    from jaxspec.drafters import resolve_drafter
    return resolve_drafter(target, s.draft_model), f"draft model {s.draft_model}"
  from jaxspec.models.quant import self_drafter
  return self_drafter(target, "int8"), ("the target in int8 (self-speculation; no"
                                        " --draft-model given)")


METHODS: dict[str, Method] = {
    "none": Method(description="plain `generate` (the baseline of every jaxspec speedup)"),
    "ngram": Method(description="prompt lookup (NGram)", make=_named("ngram", "NGram()")),
    "medusa": Method(description="Medusa head",
                     make=_named("medusa", "bundled Medusa head (jaxspec/assets/heads/medusa)")),
    "mlp": Method(description="MLP speculator",
                  make=_named("mlp", "bundled MLP speculator (jaxspec/assets/heads/mlp)")),
    "eagle": Method(description="EAGLE-3 head",
                    make=_named("eagle", "bundled EAGLE-3 head (jaxspec/assets/heads/eagle)")),
    "eagle-tree": Method(description="EAGLE-3 head, EAGLE-2 dynamic tree (--tree-size nodes)",
                         make=_tree("eagle", "bundled EAGLE-3 head")),
    "medusa-tree": Method(description="Medusa head, static tree (--tree-size nodes)",
                          make=_tree("medusa", "bundled Medusa head")),
    "draft-model": Method(description="draft model (--draft-model; default the int8 target)",
                          make=_draft_model),
}

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  """What one `jaxspec bench` invocation measures."""

  model: str | None = None
  scan_layers: bool | None = None  # the layer layout (None: the backend's default)
  prompts: str | None = None
  categories: tuple[str, ...] | None = None
  per_category: int = 1
  methods: tuple[str, ...] = ("none",)
  peers: tuple[str, ...] = ()
  batch_sizes: tuple[int, ...] = (1,)
  max_new_tokens: int = 64
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int = 0
  num_draft_tokens: int | str = "auto"
  k_max: int | None = None
  tree_size: int = 8
  draft_model: str | None = None
  lookup_tokens: int = 10
  chat: bool = True
  latency: bool = True
  out: str = "bench_out"
  progress: bool = True


# ----------------------------------------------------------------------------------------------
# Input checks (all before any model is loaded or anything compiles).


def parse_methods(text: str) -> tuple[str, ...]:
  names = tuple(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
  unknown = [m for m in names if m not in METHODS]
  if unknown or not names:
    raise BenchError(f"unknown method {', '.join(map(repr, unknown)) or '(none given)'}: the"
                     f" known methods are {', '.join(METHODS)} (peer libraries go in --peers:"
                     f" {', '.join(_peer_names())})")
  return names


def _peer_names():
  from jaxspec.peers import PEERS
  return list(PEERS)


def parse_peers(text: str) -> tuple[str, ...]:
  """Peer names; a speculative peer brings its library's plain run (its speedup's baseline).
  Raises BenchError for an unknown peer or one whose package is missing (naming the extra)."""
  from jaxspec.peers import PEERS, missing_packages
  names = tuple(dict.fromkeys(p.strip() for p in text.split(",") if p.strip()))
  unknown = [p for p in names if p not in PEERS]
  if unknown:
    raise BenchError(f"unknown peer {', '.join(map(repr, unknown))}: the known peers are"
                     f" {', '.join(PEERS)}")
  for p in names:
    missing = missing_packages(p)
    if missing:
      raise BenchError(f"peer {p!r} needs {', '.join(missing)}, which is not installed: run"
                       f" `{PEERS[p].install}`")
  out = []
  for p in names:
    base = PEERS[p].baseline
    if base not in out:
      out.append(base)
    if p not in out:
      out.append(p)
  return tuple(out)


def parse_batch_sizes(text: str) -> tuple[int, ...]:
  try:
    sizes = tuple(int(x) for x in text.split(",") if x.strip())
  except ValueError:
    raise BenchError(f"--batch-sizes must be integers separated by commas, got {text!r}") from None
  if not sizes or any(b < 1 for b in sizes):
    raise BenchError(f"--batch-sizes must be integers >= 1, got {text!r}")
  return tuple(sorted(set(sizes)))


def read_prompts(path: str | os.PathLike | None) -> list[tuple[str, Any]]:
  """(category, prompt) for every line of a JSON-lines prompt file (the built-in demo set when
  None). A line is a JSON object with a prompt field ('prompt', 'turns' (Spec-Bench: the first
  turn), 'question', 'instruction' or 'prompt_ids') and optionally 'category' (default
  "default")."""
  from jaxspec.train.data import _line_prompt, json_lines
  path = DEMO_PROMPTS if path is None else Path(path)
  if not path.is_file():
    raise BenchError(f"prompt file {path} does not exist: pass a JSON-lines file (e.g."
                     " ../shared/data/spec_bench_dev.jsonl) or leave --prompts out for the"
                     " built-in set")
  expected = ("expected one JSON object per line with a prompt field ('prompt', 'turns',"
              " 'question', 'instruction' or 'prompt_ids') and optionally 'category'")
  rows = []
  for where, obj in json_lines(path, expected, BenchError):
    try:
      prompt = _line_prompt(obj, where)
    except ValueError as e:
      raise BenchError(f"{e}; {expected}") from None
    cat = obj.get("category", "default")
    if not isinstance(cat, str) or not cat:
      raise BenchError(f"{where}: 'category' must be a non-empty string, got {cat!r}")
    rows.append((cat, prompt))
  if not rows:
    raise BenchError(f"prompt file {path} holds no prompts: {expected}")
  return rows


def select(rows: list[tuple[str, Any]], categories: Sequence[str] | None,
           per_category: int) -> dict[str, list[Any]]:
  """The first `per_category` prompts of every category (file order), optionally filtered."""
  out: dict[str, list[Any]] = {}
  for cat, p in rows:
    if categories and cat not in categories:
      continue
    lst = out.setdefault(cat, [])
    if len(lst) < per_category:
      lst.append(p)
  if categories:
    missing = [c for c in categories if c not in out]
    if missing:
      have = sorted(dict.fromkeys(c for c, _ in rows))
      raise BenchError(f"no prompts of categories {missing} in the file: it has {have}")
    out = {c: out[c] for c in categories}
  return out


def parse_categories(text: str | None) -> tuple[str, ...] | None:
  if not text:
    return None
  cats: list[str] = []
  for c in text.split(","):
    c = c.strip()
    cats += list(MT_BENCH) if c.lower() == "mt-bench" else [c] if c else []
  return tuple(dict.fromkeys(cats))


def settings_from_args(args) -> Settings:
  """Settings from parsed arguments; every check that needs no model."""
  if args.max_new_tokens < 1:
    raise BenchError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
  if args.per_category < 1:
    raise BenchError(f"--per-category must be >= 1, got {args.per_category}")
  from jaxspec.tree import MAX_NODES
  if not 1 <= args.tree_size < MAX_NODES:
    raise BenchError(f"--tree-size must be a number of tree nodes in 1..{MAX_NODES - 1}, got"
                     f" {args.tree_size}")
  methods = parse_methods(args.methods)
  if "none" not in methods:  # every speedup needs the plain run of the same invocation
    methods = ("none",) + methods
  peers = parse_peers(args.peers) if args.peers else ()
  if args.draft_model and not os.path.exists(args.draft_model):
    raise BenchError(f"--draft-model {args.draft_model} does not exist: pass a draft model"
                     " directory (Hugging Face layout, e.g. from `jaxspec train draft-model`)"
                     " or a .gguf file")
  from jaxspec.cli import _SCAN_LAYERS
  return Settings(model=args.model, scan_layers=_SCAN_LAYERS[args.scan_layers],
                  prompts=args.prompts,
                  categories=parse_categories(args.categories), per_category=args.per_category,
                  methods=methods, peers=peers, batch_sizes=parse_batch_sizes(args.batch_sizes),
                  max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, min_p=args.min_p, seed=args.seed,
                  num_draft_tokens=args.num_draft_tokens, k_max=args.k_max,
                  tree_size=args.tree_size, draft_model=args.draft_model,
                  lookup_tokens=args.lookup_tokens,
                  chat=not args.no_chat, latency=not args.no_latency, out=args.out,
                  progress=not args.no_progress)


# ----------------------------------------------------------------------------------------------
# Machine, versions, commit.


def machine() -> dict[str, Any]:
  """CPU model, cores, memory, accelerator and the JAX backend."""
  import jax
  cpu = platform.processor() or ""
  try:
    for line in open("/proc/cpuinfo", encoding="utf-8"):
      if line.startswith("model name"):
        cpu = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  mem = None
  try:
    for line in open("/proc/meminfo", encoding="utf-8"):
      if line.startswith("MemTotal"):
        mem = round(int(line.split()[1]) / 2**20, 1)
        break
  except OSError:
    pass
  devs = jax.devices()
  acc = sorted({f"{d.platform}: {getattr(d, 'device_kind', '')}" for d in devs
                if d.platform != "cpu"})
  return dict(cpu=cpu, cores=os.cpu_count(), usable_cores=threads(), memory_gib=mem,
              accelerator=", ".join(acc) or "none", jax_backend=jax.default_backend(),
              jax_devices=len(devs), os=platform.platform())


def _loadavg() -> list[float] | None:
  """1, 5 and 15-minute load averages: other processes' share of a shared machine."""
  try:
    return [round(x, 2) for x in os.getloadavg()]
  except OSError:
    return None


def threads() -> int:
  """CPU cores this process may use (what XLA's CPU thread pool sizes itself to)."""
  try:
    return len(os.sched_getaffinity(0))
  except AttributeError:
    return os.cpu_count() or 1


def versions() -> dict[str, str]:
  import flax
  import jax
  import jaxlib

  import jaxspec
  return dict(python=platform.python_version(), jaxspec=jaxspec.__version__,
              jax=jax.__version__, jaxlib=jaxlib.__version__, flax=flax.__version__,
              numpy=np.__version__)


def git_commit() -> dict[str, Any]:
  root = Path(__file__).resolve().parents[1]
  try:
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, text=True,
                          capture_output=True, timeout=10).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                           text=True, capture_output=True, timeout=10).stdout.strip()
  except (OSError, subprocess.SubprocessError):
    return dict(commit=None, dirty=None)
  return dict(commit=head or None, dirty=bool(dirty) if head else None)


# ----------------------------------------------------------------------------------------------
# Running one batch.


def _sampling(s: Settings):
  from jaxspec.sampling import Sampling
  return Sampling(temperature=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=s.min_p)


def _spec_kwargs(s: Settings, drafter, method: Method) -> dict[str, Any]:
  """num_draft_tokens (and AutoK) for a drafter: k and k_max capped at its own limit (a
  Medusa head with 4 heads drafts at most 4)."""
  from jaxspec.adaptive import AutoK
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
  from jaxspec.generate import generate, generate_stream
  from jaxspec.speculative import speculative_generate, speculative_stream
  common = dict(max_new_tokens=s.max_new_tokens, sampling=_sampling(s), key=s.seed)
  kw = {} if drafter is None else _spec_kwargs(s, drafter, method)

  def once():
    if drafter is None:
      return generate(target, prompts, **common)
    return speculative_generate(target, drafter, prompts, **common, **kw)

  out = once()
  compile_s = out.stats.get("compile_seconds", 0.0) + out.stats.get("profile_seconds", 0.0)
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
        c = info.get("compile_seconds", 0.0) + info.get("profile_seconds", 0.0)
        if new:
          chunks.append((round(float(info["seconds"]), 6), len(new)))
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


# ----------------------------------------------------------------------------------------------
# Aggregation.


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
  """E(k) for k = 0..k_max: `jaxspec.adaptive.expected_tokens` (the controller's own formula)
  for measured per-position acceptance alpha (positions beyond those measured: 0)."""
  import jax.numpy as jnp

  from jaxspec.adaptive import expected_tokens as controller_expected
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
  from jaxspec.adaptive import CostModel
  order = sorted(cm, key=int)
  model = CostModel(tuple(int(k) for k in order), tuple(float(cm[k]) for k in order))
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


# ----------------------------------------------------------------------------------------------
# Reports.


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


# ----------------------------------------------------------------------------------------------
# The benchmark.


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
  from jaxspec.generate import round_up
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

  from jaxspec.generate import programs_released, stop_ids_for
  from jaxspec.models.errors import CheckpointError
  from jaxspec.models.loading import load
  from jaxspec.train.data import encode_prompts, make_progress
  command = "jaxspec " + shlex.join(["bench"] if argv is None else argv)
  t_start = time.perf_counter()
  load_start, git = _loadavg(), git_commit()  # as the run starts
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
      machine=dict(machine(), load_average_at_start=load_start, load_average_at_end=_loadavg()),
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


def to_json(report: dict[str, Any]) -> str:
  """The report as JSON: indented, except one line per raw run (their step timings are long)."""
  head = {k: v for k, v in report.items() if k != "runs"}
  text = json.dumps(head, indent=1, default=float)
  runs = ",\n  ".join(json.dumps(r, default=float) for r in report["runs"])
  return text[:-2] + ',\n "runs": [\n  ' + runs + '\n ]\n}\n'


# ----------------------------------------------------------------------------------------------
# The command line.


def add_bench_parser(sub) -> None:
  from jaxspec.cli import _add_sampling, _add_scan_layers, _count, _draft_count, add_compile_cache
  from jaxspec.peers import PEERS
  p = sub.add_parser(
      "bench", help="measure methods side by side (and peer libraries) on a prompt set",
      description="Runs every method on every prompt batch back to back (interleaved, order"
                  " alternating), and writes bench.json, bench.md and plots into --out.")
  p.add_argument("--prompts", default=None, metavar="FILE",
                 help="JSON-lines prompts: Spec-Bench rows ('category', 'turns') or"
                      " {'prompt': ...} (optional 'category'); default: a built-in set of 2"
                      " prompts for each MT-bench category")
  p.add_argument("--categories", default=None,
                 help="comma-separated categories to keep ('mt-bench' = its 8); default all")
  p.add_argument("--per-category", type=_count, default=1, help="prompts per category")
  p.add_argument("--methods", default=DEFAULT_METHODS,
                 help=f"comma-separated, of: {', '.join(METHODS)} (none, plain decoding, is"
                      f" always run: it is every speedup's baseline); default {DEFAULT_METHODS}")
  p.add_argument("--peers", default="",
                 help=f"comma-separated peer libraries run on the same model and prompts:"
                      f" {', '.join(PEERS)} (needs `pip install 'jaxspec[compare]'`)")
  p.add_argument("--batch-sizes", default="1", help="e.g. 1,8,32 (prompts repeat to fill a"
                                                    " batch)")
  p.add_argument("--max-new-tokens", type=_count, default=64)
  p.add_argument("--num-draft-tokens", type=_draft_count, default="auto",
                 help="k, or 'auto' (default; the cost model's prediction needs it)")
  p.add_argument("--k-max", type=_count, default=None,
                 help="the most drafts per step with 'auto' (default 8, capped at a head's"
                      " limit)")
  p.add_argument("--tree-size", type=int, default=8,
                 help="nodes of the eagle-tree and medusa-tree methods' trees (default 8, the"
                      " fastest size on a 2-core CPU; 16 was the fastest of 8, 16 and 64 for"
                      " SmolLM2 on an H200; EAGLE-2 uses 60 for 7B+ targets on GPUs)")
  p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
  _add_scan_layers(p)
  add_compile_cache(p, on=False)
  p.add_argument("--draft-model", default=None, metavar="PATH",
                 help="draft model (Hugging Face directory or .gguf) for the draft-model"
                      " method and transformers' assisted generation; default: the target in"
                      " int8 for jaxspec, and no assisted generation")
  p.add_argument("--lookup-tokens", type=_count, default=10,
                 help="prompt-lookup tokens of the peers (prompt_lookup_num_tokens)")
  p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
  p.add_argument("--no-latency", action="store_true",
                 help="skip the streamed runs (no latency, no TTFT, predictions without"
                      " the prefill)")
  p.add_argument("--out", default="bench_out", help="output directory")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  _add_sampling(p)


def cmd_bench(args, argv: Sequence[str] | None = None) -> int:
  try:
    s = settings_from_args(args)
    report = run_bench(s, argv)
  except BenchError as e:
    raise SystemExit(f"error: {e}")
  print(markdown(report), end="")
  print(f"[jaxspec] wrote {', '.join(report['files'])} into {s.out}"
        f" ({report['wall_seconds']:.0f} s)", flush=True)
  return 0
