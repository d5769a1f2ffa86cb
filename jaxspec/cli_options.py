"""Command-line options shared by the subcommands (`jaxspec generate`, `train` and `bench`):
sampling, the layer layout, the persistent compilation cache, argparse types for counts, and
the draft-tree spec (`parse_tree`).
(a layer below both `jaxspec.cli` and `jaxspec.bench`, which use it)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from jaxspec.checks import int_range, parse_int


SCAN_LAYERS = {"auto": None, "yes": True, "no": False}


def add_scan_layers(p: argparse.ArgumentParser) -> None:
  """--scan-layers auto|yes|no (`SCAN_LAYERS` maps the choice to `load(scan_layers=...)`)."""
  p.add_argument("--scan-layers", default="auto", choices=list(SCAN_LAYERS),
                 help="run the layers as one lax.scan (yes: compiles fast) or unrolled (no:"
                      " faster plain steps, several times slower compiles); auto (default):"
                      " the backend's default (unrolled on CPUs and GPUs, scanned on TPUs),"
                      " except that `jaxspec generate` and `jaxspec train-data` scan them on"
                      " the CPU, where they spend much of their time compiling")


def command_layout(choice: str) -> bool | None:
  """`--scan-layers` for `generate` and `train-data`: "auto" stacks the layers on the CPU
  backend, where a command's short run spends most of its time compiling (the bundled SmolLM2
  with its EAGLE head: the loop compiles in about 40 s stacked against 130 s unrolled on 2
  cores; a corpus compiles a program per cache size and answer length), and takes
  the backend's default elsewhere (`jaxspec.models.llama.DEFAULT_SCAN_LAYERS`)."""
  import jax
  if choice == "auto" and jax.default_backend() == "cpu":
    return True
  return SCAN_LAYERS[choice]


def default_compile_cache() -> str:
  """Where the CLI keeps compiled programs between runs: $JAXSPEC_COMPILE_CACHE (a directory, or
  'none' for no cache), else $XDG_CACHE_HOME/jaxspec/xla (~/.cache/jaxspec/xla)."""
  env = os.environ.get("JAXSPEC_COMPILE_CACHE")
  if env:
    return env
  base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
  return str(Path(base) / "jaxspec" / "xla")


def add_compile_cache(p: argparse.ArgumentParser, *, on: bool = True) -> None:
  """--compile-cache DIR; on=False makes 'none' the default (a benchmark measures compiles)."""
  if on:
    default, what = None, (f"default: $JAXSPEC_COMPILE_CACHE or {default_compile_cache()},"
                           " unless JAX_COMPILATION_CACHE_DIR already names one")
  else:
    default, what = "none", "default: none (off, so the compile column measures compilation)"
  p.add_argument("--compile-cache", default=default, metavar="DIR",
                 help="keep compiled programs in DIR (at most 2 GiB, least recently used"
                      " dropped), so a later run with the same model, shapes and settings loads"
                      " them instead of compiling (on the 2-core CPU the default demo's compile"
                      " and cost measurement went 112 -> 100 s: tracing, loading the programs"
                      " and the cost measurement remain; the stats line counts the programs"
                      " loaded);"
                      f" 'none' turns it off; {what}")


def enable_compile_cache(spec: str | None) -> str | None:
  """Turns on JAX's persistent compilation cache for this process; returns the directory (None
  when off). Call before the first compilation. A directory the user already gave JAX
  (JAX_COMPILATION_CACHE_DIR, jax.config) wins over the default; `spec` 'none' turns that one
  off too."""
  import jax
  current = jax.config.jax_compilation_cache_dir
  if spec is None and current:
    return current
  given = spec is not None
  spec = default_compile_cache() if spec is None else spec
  if spec.lower() in ("none", "off", ""):
    if given and current:  # --compile-cache none: also JAX_COMPILATION_CACHE_DIR's directory
      from jax._src import compilation_cache
      jax.config.update("jax_compilation_cache_dir", None)
      compilation_cache.reset_cache()
    return None
  path = Path(spec).expanduser()
  try:
    path.mkdir(parents=True, exist_ok=True)
  except OSError as e:
    raise SystemExit(f"error: --compile-cache {str(path)!r}: {e.strerror}; pass a writable"
                     " directory or --compile-cache none")
  jax.config.update("jax_compilation_cache_dir", str(path))
  # The programs worth keeping take seconds to compile; the many small ones are cheaper to
  # compile than to look up. JAXSPEC_COMPILE_CACHE_MIN_SECONDS changes the threshold (0 keeps
  # every program: what a test needs, since which programs pass 1 s depends on the load).
  try:
    min_secs = float(os.environ.get("JAXSPEC_COMPILE_CACHE_MIN_SECONDS", "1.0"))
  except ValueError:
    raise SystemExit("error: JAXSPEC_COMPILE_CACHE_MIN_SECONDS must be a number of seconds,"
                     f" got {os.environ['JAXSPEC_COMPILE_CACHE_MIN_SECONDS']!r}") from None
  jax.config.update("jax_persistent_cache_min_compile_time_secs", max(min_secs, 0.0))
  if jax.config.jax_compilation_cache_max_size < 0:  # unbounded by default: keep 2 GiB at most
    jax.config.update("jax_compilation_cache_max_size", 2 << 30)
  if not CACHE_EVENTS:
    CACHE_EVENTS.update(loaded=0, written=0)
    jax.monitoring.register_event_listener(_count_cache_event)
  return str(path)


# Programs this process loaded from / wrote to the persistent cache (empty while it is off).
CACHE_EVENTS: dict[str, int] = {}
# JAX records a miss when it writes a program.
_CACHE_EVENT_NAMES = {"/jax/compilation_cache/cache_hits": "loaded",
                      "/jax/compilation_cache/cache_misses": "written"}


def _count_cache_event(event: str, **_) -> None:
  if (name := _CACHE_EVENT_NAMES.get(event)) is not None:
    CACHE_EVENTS[name] += 1


def add_sampling(p: argparse.ArgumentParser) -> None:
  """--temperature, --top-k, --top-p, --min-p and --seed (`jaxspec.sampling.Sampling`'s)."""
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  p.add_argument("--top-k", type=int, default=0, help="0 = off")
  p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
  p.add_argument("--seed", type=int, default=0)


def add_penalties(p: argparse.ArgumentParser) -> None:
  """--repetition-penalty, --presence-penalty, --frequency-penalty, --min-new-tokens and
  --logit-bias (`jaxspec.sampling.Sampling`'s)."""
  p.add_argument("--repetition-penalty", type=float, default=1.0,
                 help="> 0; divides the logits of the context's tokens (1 = off)")
  p.add_argument("--presence-penalty", type=float, default=0.0,
                 help="subtracted from the logits of generated tokens (0 = off)")
  p.add_argument("--frequency-penalty", type=float, default=0.0,
                 help="times a generated token's count, subtracted from its logit (0 = off)")
  p.add_argument("--min-new-tokens", type=lambda t: parse_int(
      t, 0, error=argparse.ArgumentTypeError), default=0,
                 help="no stop token (EOS) before this many new tokens (0 = off)")
  p.add_argument("--logit-bias", type=token_bias, action="append", default=[],
                 metavar="ID=BIAS", help="add BIAS to token ID's logit (repeatable; -inf bans it)")


def token_bias(text: str) -> tuple[int, float]:
  """An argparse type: 'ID=BIAS' (a token id and the bias added to its logit)."""
  tok, sep, bias = text.partition("=")
  try:
    if not sep:
      raise ValueError
    return parse_int(tok.strip(), 0), float(bias)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected ID=BIAS (a token id >= 0 and a number, e.g."
                                     f" 13=-5.0), got {text!r}") from None


def draft_count(text: str):
  """An argparse type: 'auto' or an integer >= 1 (drafts per step)."""
  if text == "auto":
    return text
  try:
    return parse_int(text, 1)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected 'auto' or {int_range(1)}, got {text!r}") from None


def count(text: str) -> int:
  """An argparse type: an integer in [1, 2**24] (sizes past that cannot be held anyway)."""
  return parse_int(text, 1, 2**24, error=argparse.ArgumentTypeError)


def count0(text: str) -> int:
  """An argparse type: an integer in [0, 2**24]."""
  return parse_int(text, 0, 2**24, error=argparse.ArgumentTypeError)


def minutes(text: str) -> float:
  """An argparse type: a positive, finite number of minutes (a time-boxed run's limit)."""
  try:
    v = float(text)
  except ValueError:
    v = float("nan")
  if not 0 < v < float("inf"):
    raise argparse.ArgumentTypeError(f"expected minutes > 0 such as 30 or 0.5, got {text!r}")
  return v


def parse_tree(spec: str, drafter):
  """The CLI's --tree: N (a tree of N nodes, `jaxspec.decoding.tree.default_tree`),
  dynamic:DEPTH,TOPK,TOTAL (EAGLE-2), a JSON list of paths, or a .json file holding one."""
  # Imported here: the subcommands' --help and argument parsing do not load JAX.
  from jaxspec.decoding.tree import DynamicTree, as_tree, default_tree
  text = spec.strip()
  try:
    if text.isdigit():
      return default_tree(drafter, int(text))
    if text.startswith("dynamic:"):
      parts = text.removeprefix("dynamic:").split(",")
      if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"--tree {spec!r}: expected dynamic:DEPTH,TOPK,TOTAL, e.g."
                         " dynamic:5,8,32")
      return DynamicTree(*map(int, parts))
    if text.startswith("["):
      paths = json.loads(text)
    elif os.path.isfile(text):
      paths = json.loads(open(text).read())
    else:
      raise ValueError(f"--tree {spec!r}: expected a number of nodes, dynamic:DEPTH,TOPK,TOTAL,"
                       " a JSON list of paths like [[0],[1],[0,0]], or a .json file of one")
  except json.JSONDecodeError as e:
    raise ValueError(f"--tree {spec!r} is not valid JSON: {e}") from None
  return as_tree(paths, max_depth=getattr(drafter, "max_draft_tokens", None))
