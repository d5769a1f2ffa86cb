"""`jaxspec bench`'s input: the prompt file, the method, peer, batch-size and category lists,
and `Settings` from the command line, every check made before a model is loaded."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jaxspec.bench.methods import METHODS, BenchError, Settings
from jaxspec.checks import parse_int
from jaxspec.cli_options import SCAN_LAYERS

MT_BENCH = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
            "humanities")
DEMO_PROMPTS = Path(__file__).resolve().parents[1] / "assets" / "bench_prompts.jsonl"


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
    sizes = tuple(parse_int(x, 1) for x in text.split(",") if x.strip())
  except ValueError:
    raise BenchError(f"--batch-sizes must be integers >= 1 separated by commas, got"
                     f" {text!r}") from None
  if not sizes:
    raise BenchError(f"--batch-sizes must be integers >= 1 separated by commas, got {text!r}")
  return tuple(sorted(set(sizes)))


def read_prompts(path: str | os.PathLike | None) -> list[tuple[str, Any]]:
  """(category, prompt) for every line of a JSON-lines prompt file (the built-in demo set when
  None). A line is a JSON object with a prompt field ('prompt', 'turns' (Spec-Bench: the first
  turn), 'question', 'instruction' or 'prompt_ids') and optionally 'category' (default
  "default")."""
  from jaxspec.train.data import json_lines, line_prompt
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
      prompt = line_prompt(obj, where)
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
  from jaxspec.decoding.tree import MAX_NODES
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
  return Settings(model=args.model, scan_layers=SCAN_LAYERS[args.scan_layers],
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
