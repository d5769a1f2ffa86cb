"""The `jaxspec` command line: `jaxspec generate "PROMPT"`, `jaxspec train KIND` and
`jaxspec bench`."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from jaxspec.bench import add_bench_parser, cmd_bench


_SCAN_LAYERS = {"auto": None, "yes": True, "no": False}


def _add_scan_layers(p: argparse.ArgumentParser) -> None:
  p.add_argument("--scan-layers", default="auto", choices=list(_SCAN_LAYERS),
                 help="run the layers as one lax.scan (yes: compiles fast) or unrolled (no:"
                      " about 1.4x faster steps on CPU, several times slower compiles);"
                      " auto (default): unrolled on the CPU backend, scanned elsewhere")


def default_compile_cache() -> str:
  """Where the CLI keeps compiled programs between runs: $JAXSPEC_COMPILE_CACHE (a directory, or
  'none' for no cache), else $XDG_CACHE_HOME/jaxspec/xla (~/.cache/jaxspec/xla)."""
  env = os.environ.get("JAXSPEC_COMPILE_CACHE")
  if env:
    return env
  base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
  return str(Path(base) / "jaxspec" / "xla")


def add_compile_cache(p: argparse.ArgumentParser, *, on: bool = True) -> None:
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
  (JAX_COMPILATION_CACHE_DIR, jax.config) wins over the default."""
  import jax
  current = jax.config.jax_compilation_cache_dir
  if spec is None and current:
    return current
  spec = default_compile_cache() if spec is None else spec
  if spec.lower() in ("none", "off", ""):
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
_CACHE_EVENT_NAMES = {"/jax/compilation_cache/cache_hits": "loaded",
                      "/jax/compilation_cache/cache_misses": "written"}  # JAX records a miss on write


def _count_cache_event(event: str, **_) -> None:
  if (name := _CACHE_EVENT_NAMES.get(event)) is not None:
    CACHE_EVENTS[name] += 1


def _add_sampling(p: argparse.ArgumentParser) -> None:
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  p.add_argument("--top-k", type=int, default=0, help="0 = off")
  p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
  p.add_argument("--seed", type=int, default=0)


def _draft_count(text: str):
  if text == "auto":
    return text
  try:
    k = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 1, got {text!r}") from None
  if k < 1:
    raise argparse.ArgumentTypeError(f"expected 'auto' or an integer >= 1, got {k}")
  return k


def _count(text: str) -> int:
  """An argparse type: an integer in [1, 2**24] (sizes past that cannot be held anyway)."""
  try:
    n = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
  if not 1 <= n <= 2**24:
    raise argparse.ArgumentTypeError(f"expected an integer in [1, {2**24}], got {n}")
  return n


def _count0(text: str) -> int:
  """An argparse type: an integer in [0, 2**24]."""
  return 0 if text.strip() == "0" else _count(text)


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="jaxspec", description="Exact speculative decoding in JAX.")
  sub = ap.add_subparsers(dest="command", required=True)
  g = sub.add_parser("generate", help="generate text (speculatively by default) and print stats")
  g.add_argument("prompt", help="the user message (or raw text with --no-chat)")
  g.add_argument("--model", default=None,
                 help="a .gguf file, a Hugging Face directory, or a bundled name"
                      " (default: the bundled SmolLM2-135M-Instruct)")
  g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
  g.add_argument("--max-new-tokens", type=_count, default=128)
  g.add_argument("--draft", default="default",
                 help="default | none | ngram | eagle | medusa | mlp | a head directory | PATH of"
                      " a draft model (.gguf or HF directory); default: the bundled EAGLE head"
                      " when the model is the bundled SmolLM2, else ngram")
  g.add_argument("--num-draft-tokens", type=_draft_count, default="auto",
                 help="k, drafts per step, or 'auto' (default: chosen every step from measured"
                      " acceptance and cost, 0 = a plain step)")
  g.add_argument("--k-max", type=_count, default=None,
                 help="the most drafts per step with 'auto' (default 8, or fewer when the"
                      " drafter proposes fewer: a Medusa head drafts at most its head count)")
  g.add_argument("--tree", default=None, metavar="SPEC",
                 help="draft a tree each step (a Medusa or EAGLE head): N (a tree of N nodes:"
                      " EAGLE-2's dynamic tree, or Medusa's best static tree from the head's"
                      " measured accuracies), dynamic:DEPTH,TOPK,TOTAL, a JSON list of paths"
                      " ([[0],[1],[0,0]]) or a .json file of one")
  g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  _add_scan_layers(g)
  g.add_argument("--chunk", type=_count, default=8, help="decode steps between printed chunks")
  add_compile_cache(g)
  _add_sampling(g)
  _add_train_parser(sub)
  add_bench_parser(sub)
  return ap


def _make_drafter(spec: str, target, dtype: str):
  from jaxspec.drafters import resolve_drafter
  from jaxspec.models.errors import CheckpointError
  if spec == "none":
    return None
  if spec == "default":  # the bundled EAGLE head when it fits the target, else prompt lookup
    from jaxspec.heads import bundled_head_for
    spec = bundled_head_for(target) or "ngram"
  try:
    return resolve_drafter(target, spec, dtype)
  except ValueError as e:
    raise SystemExit(f"error: --draft: {e}")
  except CheckpointError as e:  # a head for another target, corrupted files
    raise SystemExit(f"error: --draft {spec!r}: {e}")


def cmd_generate(args) -> int:
  from jaxspec.generate import generate_stream
  from jaxspec.models.loading import load
  from jaxspec.sampling import Sampling
  from jaxspec.speculative import speculative_stream

  try:
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        min_p=args.min_p)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  t_load = time.perf_counter()
  model = load(args.model, dtype=args.dtype, scan_layers=_SCAN_LAYERS[args.scan_layers])
  drafter = _make_drafter(args.draft, model, args.dtype)
  if args.tree is not None:
    from jaxspec.tree import parse_tree
    if drafter is None:
      raise SystemExit("error: --tree needs a drafter: a Medusa or EAGLE head (--draft eagle)")
    if args.num_draft_tokens != "auto":
      raise SystemExit("error: --tree sets how far the drafter drafts: drop --num-draft-tokens")
    if not hasattr(drafter, "with_tree"):
      raise SystemExit(f"error: --tree: the {drafter.name} drafter drafts chains only: tree"
                       " drafting needs a Medusa or EAGLE head (--draft eagle or medusa)")
    try:
      drafter = drafter.with_tree(parse_tree(args.tree, drafter))
    except ValueError as e:
      raise SystemExit(f"error: --tree: {e}")
  load_s = time.perf_counter() - t_load
  tok = model.tokenizer
  if tok is None:
    raise SystemExit(f"error: {args.model} has no tokenizer (tokenizer.json or GGUF tokenizer"
                     " metadata): the CLI takes text; use the Python API with token ids")
  ids = tok.encode(args.prompt) if args.no_chat else tok.encode_chat(args.prompt)
  common = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, key=args.seed)
  try:
    if drafter is None:
      stream = generate_stream(model, [ids], chunk=args.chunk, **common)
    else:
      from jaxspec.adaptive import AutoK
      auto = (AutoK(k_max=args.k_max)
              if args.num_draft_tokens == "auto" and args.k_max is not None else None)
      stream = speculative_stream(model, drafter, [ids], num_draft_tokens=args.num_draft_tokens,
                                  auto=auto, chunk=max(1, args.chunk // 2), **common)
    from jaxspec.models.tokenizer import StreamDecoder
    dec = StreamDecoder(tok)
    n, info = 0, {}
    for new, info in stream:
      n += len(new)
      sys.stdout.write(dec.push(new))
      sys.stdout.flush()
    sys.stdout.write(dec.flush() + "\n")
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  secs = info.get("seconds", 0.0)
  line = (f"[jaxspec] {n} new tokens, {n / secs if secs else 0:.1f} tokens/s,"
          f" compile {info.get('compile_seconds', 0.0) + info.get('profile_seconds', 0.0):.1f} s"
          + (f" ({CACHE_EVENTS['loaded']} programs loaded from the cache,"
             f" {CACHE_EVENTS['written']} written)," if CACHE_EVENTS else ",") +
          f" load {load_s:.1f} s,"
          f" model {model.name}, draft {drafter.name if drafter is not None else 'none'}")
  st = info.get("stats")
  if st:
    k = (f"auto (mean {st['mean_k']:.1f}, {st['plain_steps']} plain steps)"
         if args.num_draft_tokens == "auto" else args.num_draft_tokens)
    if st.get("tree"):
      k = st["tree"]
    line += (f", {'' if st.get('tree') else 'k='}{k}, tau {st['tau']:.2f},"
             f" acceptance {st['acceptance_rate']:.2f}")
  print(line, flush=True)
  return 0


# ----------------------------------------------------------------------------------------------
# jaxspec train


TRAIN_KINDS = ("medusa", "mlp", "eagle", "draft-model")
# Defaults sized for the bundled SmolLM2-135M on a 2-core CPU, the recipe of the bundled heads:
# writing the data (320 prompts, greedy and T=0.7 responses of up to 128 tokens, hidden states)
# takes about 18 minutes, then a step of a batch of 8 rows cropped to 128-token windows about 2 s
# (draft-model; eagle 1.25 s on the Intel Xeon VM, its soft labels computed over the 4096-token
# draft vocabulary only) or 6-8 s (medusa, mlp: their losses run the 49k-token LM head for every
# head at every position).
TRAIN_DEFAULTS = {
    "draft-model": dict(steps=200, lr=5e-4, batch_size=8),
    "eagle": dict(steps=600, lr=8e-4, batch_size=8),
    "medusa": dict(steps=120, lr=1e-3, batch_size=8),
    "mlp": dict(steps=120, lr=2e-3, batch_size=8),
}
# Head options unless --option says otherwise: EAGLE-3 with training-time test, and an MLP
# speculator tied to the target's embedding and LM head (its own [V, D] tables would be 56 MB a
# stage for SmolLM2).
HEAD_DEFAULTS = {"eagle": dict(version=3, ttt_steps=3), "mlp": dict(tie_to_target=True)}
# EAGLE-3's reduced draft vocabulary for targets with a large one (the LM head is a large share
# of a small draft's cost): the most frequent response tokens.
EAGLE_DRAFT_VOCAB = 4096


def head_options(kind: str, given: dict, vocab_size: int) -> dict:
  """The options a head is created with: HEAD_DEFAULTS overridden by --option."""
  out = dict(HEAD_DEFAULTS.get(kind, {}))
  if kind == "eagle" and given.get("version", 3) == 3 and vocab_size >= 4 * EAGLE_DRAFT_VOCAB:
    out["draft_vocab_size"] = EAGLE_DRAFT_VOCAB
  out.update(given)
  return out


def _option(text: str) -> tuple[str, object]:
  import json
  key, sep, value = text.partition("=")
  if not sep or not key:
    raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
  try:
    return key, json.loads(value)
  except json.JSONDecodeError:
    return key, value


def _add_train_parser(sub) -> None:
  t = sub.add_parser("train", help="train a draft head or a draft model on the target's own"
                                   " responses (self-distillation)",
                     description="Has the target answer the prompts (unless --data-dir), then"
                                 " trains a draft and saves it in --out.")
  t.add_argument("kind", choices=TRAIN_KINDS,
                 help="what to train (put it before --prompts, which takes several files)")
  t.add_argument("--prompts", nargs="+", default=[], metavar="FILE",
                 help="JSON-lines prompt files (e.g. ../shared/data/gsm8k_train.jsonl)")
  t.add_argument("--out", required=True, help="output directory (the trained draft, training/"
                                              " checkpoints and, unless --data-dir, data/)")
  t.add_argument("--model", default=None, help="the target (default: the bundled SmolLM2-135M)")
  t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  t.add_argument("--data-dir", default=None,
                 help="reuse a dataset written earlier (skips running the target)")
  t.add_argument("--resume", action="store_true",
                 help="continue an interrupted run in --out from its latest checkpoint")
  t.add_argument("--steps", type=_count, default=None, help="optimizer steps (default per kind)")
  t.add_argument("--batch-size", type=_count, default=None)
  t.add_argument("--lr", type=float, default=None, help="peak learning rate")
  t.add_argument("--warmup", type=_count0, default=None, help="warmup steps (default steps / 10)")
  t.add_argument("--weight-decay", type=float, default=0.01)
  t.add_argument("--clip-norm", type=float, default=1.0)
  t.add_argument("--save-every", type=_count, default=50)
  t.add_argument("--keep-last", type=_count, default=2, help="checkpoints kept")
  t.add_argument("--eval-every", type=_count, default=100,
                 help="held-out evaluation every this many steps (and at the end)")
  t.add_argument("--eval-batches", type=_count, default=4, help="held-out batches per evaluation")
  t.add_argument("--seed", type=int, default=0)
  t.add_argument("--window", type=_count0, default=128,
                 help="tokens per training row: each row is cropped to a window over its"
                      " response, so the LM head runs on fewer positions (0 = whole rows)")
  t.add_argument("--max-prompts", type=_count, default=320,
                 help="prompts the target answers, drawn evenly from the files")
  t.add_argument("--self-instructions", type=int, default=0, metavar="N",
                 help="also have the target write N user instructions itself (Magpie: sampled"
                      " after its chat template's bare user-turn prefix) and answer them")
  t.add_argument("--responses", choices=["target", "given"], default="target",
                 help="target (default): the target writes the responses (self-distillation);"
                      " given: the prompt files' own answers, teacher-forced (GSM8K 'answer',"
                      " HumanEval 'canonical_solution', self-instruct 'output', 'response'),"
                      " the target's hidden states and distribution still the labels; only a"
                      " forward runs, no generation")
  t.add_argument("--max-new-tokens", type=_count, default=128, help="response tokens per prompt")
  t.add_argument("--max-prompt-len", type=_count, default=256,
                 help="longer prompts (after the chat template) are skipped")
  t.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7],
                 help="one response per prompt per value (0 = greedy)")
  t.add_argument("--gen-batch-size", type=_count, default=32, help="rows per generate call")
  t.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
  t.add_argument("--allow-eval-prompts", action="store_true",
                 help="allow training on an evaluation set (spec_bench): contaminates it")
  t.add_argument("--num-layers", type=_count, default=4,
                 help="draft-model: target layers the draft keeps")
  t.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                 help="head option (JSON value), e.g. --option num_heads=3; defaults: eagle"
                      " version=3 ttt_steps=3 draft_vocab_size=4096 (large vocabularies), mlp"
                      " tie_to_target=true")
  t.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
  t.add_argument("--no-progress", action="store_true", help="no progress bars")


def _train_config(args):
  from jaxspec.train.trainer import TrainConfig
  d = TRAIN_DEFAULTS[args.kind]
  steps = d["steps"] if args.steps is None else args.steps
  warmup = min(50, steps // 10) if args.warmup is None else args.warmup
  return TrainConfig(steps=steps, batch_size=d["batch_size"] if args.batch_size is None
                     else args.batch_size, lr=d["lr"] if args.lr is None else args.lr,
                     warmup_steps=warmup, weight_decay=args.weight_decay,
                     clip_norm=args.clip_norm, seed=args.seed,
                     save_every=min(args.save_every, steps), keep_last_n=args.keep_last,
                     eval_every=args.eval_every, eval_batches=args.eval_batches)


def _training_data(args, target, layers, progress):
  """The dataset: --data-dir, or out/data when a finished one is there, else written now."""
  from pathlib import Path

  from jaxspec.train.data import (SELF_INSTRUCTIONS, DataConfig, Dataset, make_progress,
                                  read_prompts, target_instructions, write_dataset)
  data_dir = Path(args.data_dir) if args.data_dir else Path(args.out) / "data"
  if args.data_dir or (data_dir / "meta.json").is_file():
    ds = Dataset(data_dir)
    ds.check_target(target, layers=layers)
    ds = Dataset(data_dir, layers=layers, window=args.window or None)
    print(f"[jaxspec] reusing the {len(ds)} rows of {data_dir} (the data flags are ignored)",
          file=sys.stderr)
    return ds
  cfg = DataConfig(max_prompt_len=args.max_prompt_len, max_new_tokens=args.max_new_tokens,
                   temperatures=tuple(args.temperature), batch_size=args.gen_batch_size,
                   hidden_layers=tuple(layers), chat=not args.no_chat, seed=args.seed)
  prompts, counts, seconds, responses = [], {}, {}, None
  if args.prompts:
    prompts, counts = read_prompts(args.prompts, max_prompts=args.max_prompts, seed=args.seed,
                                   allow_eval=args.allow_eval_prompts,
                                   answers=args.responses == "given")
    if args.responses == "given":
      prompts, responses = [p for p, _ in prompts], [r for _, r in prompts]
  if args.self_instructions:
    t0 = time.perf_counter()
    with make_progress(progress) as bar:
      own = target_instructions(target, args.self_instructions, seed=args.seed,
                                batch_size=args.gen_batch_size, progress=bar)
    seconds["instructions"] = time.perf_counter() - t0
    prompts = prompts + own
    counts[SELF_INSTRUCTIONS] = len(own)
  write_dataset(target, prompts, data_dir, cfg, responses=responses, prompt_files=counts,
                seconds=seconds, progress=progress)
  return Dataset(data_dir, layers=layers, window=args.window or None)


def cmd_train(args) -> int:
  import json
  from pathlib import Path

  from jaxspec.models.errors import CheckpointError
  from jaxspec.models.loading import load

  t0 = time.perf_counter()
  progress = not args.no_progress
  options = dict(args.option)
  try:
    cfg = _train_config(args)
    if args.kind != "draft-model" and options.get("draft_vocab") is not None:
      raise ValueError("--option draft_vocab is not supported on the command line: use"
                       " draft_vocab_size=N (the N most frequent response tokens)")
    if not 0 <= args.self_instructions <= 2**20:
      raise ValueError(f"--self-instructions must be >= 0 (and at most {2**20}), got"
                       f" {args.self_instructions}")
    if args.self_instructions and args.responses == "given":
      raise ValueError("--self-instructions has no given responses to go with --responses"
                       " given: the target answers its own instructions (--responses target)")
    if not (args.prompts or args.self_instructions or args.data_dir
            or (Path(args.out) / "data" / "meta.json").is_file()):
      raise ValueError("no training data: pass --prompts FILE... (the target answers them),"
                       " --self-instructions N (the target writes N instructions and answers"
                       " them) or --data-dir DIR (a dataset written earlier)")
    target = load(args.model, dtype=args.dtype)
    if args.kind == "draft-model":
      if options:
        raise ValueError(f"draft-model takes no --option (got {sorted(options)}): use"
                         " --num-layers")
      from jaxspec.train.distill import draft_from_target
      draft_from_target(target, args.num_layers)  # checks --num-layers before any work
      layers = ()
    else:
      from jaxspec.heads import HEADS
      spec = HEADS[args.kind]
      options = head_options(args.kind, options, target.cfg.vocab_size)
      layers = tuple(spec.required_layers(target.cfg, options))
    ds = _training_data(args, target, layers, progress)
    out = Path(args.out)
    summary = {"kind": args.kind, "target": target.name, "data": str(ds.path),
               "train_rows": int(len(ds.train_indices)), "eval_rows": int(len(ds.eval_indices)),
               "config": cfg.to_json()}
    if args.kind == "draft-model":
      from jaxspec.train.distill import distill
      _, history = distill(target, ds, out, cfg, num_layers=args.num_layers, resume=args.resume,
                           save_dtype=args.save_dtype, progress=progress)
    else:
      history, tau = _train_head(args, spec, options, target, ds, cfg, out, progress)
      summary["offline_tau"] = tau
  except (ValueError, CheckpointError, FloatingPointError) as e:  # DataError: a ValueError
    raise SystemExit(f"error: {e}")
  summary["final"] = history[-1] if history else None
  summary["seconds"] = round(time.perf_counter() - t0, 1)
  (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
  last = history[-1] if history else {}
  line = (f"[jaxspec] trained {args.kind} for {cfg.steps} steps in {summary['seconds']:.0f} s:"
          f" loss {history[0]['loss']:.4f} -> {last.get('loss', float('nan')):.4f}"
          if history else f"[jaxspec] {args.kind}: nothing to train")
  if "eval_loss" in last:
    line += f", held-out loss {last['eval_loss']:.4f}"
  if summary.get("offline_tau") is not None:
    line += f", offline tau {summary['offline_tau']:.2f}"
  print(line + f"; saved to {out}", flush=True)
  return 0


def _train_head(args, spec, options, target, ds, cfg, out, progress):
  """Creates, trains and saves a head; returns (history, offline tau on held-out batches)."""
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx

  from jaxspec.heads import save_head
  from jaxspec.train.trainer import train
  if args.kind == "eagle" and options.get("draft_vocab_size") and "token_counts" not in options:
    from jaxspec.heads import token_counts
    rows = ds.train_indices
    options = dict(options, token_counts=token_counts(ds.tokens[rows], ds.loss_mask[rows],
                                                      target.cfg.vocab_size))
  model = spec.create(target.cfg, rngs=nnx.Rngs(args.seed), **options)
  t0 = time.perf_counter()
  model, history = train(model, spec.loss, ds, cfg, out / "training", frozen=target.params,
                         resume=args.resume, progress=progress)
  train_s = time.perf_counter() - t0
  k = spec.num_steps(model)
  taus = [spec.offline_chain_tau(model, {n: jnp.asarray(v) for n, v in b.items()},
                                 target.params, k)
          for b in ds.eval_batches(cfg.batch_size, cfg.eval_batches)]
  tau = sum(taus) / len(taus) if taus else None
  rows = ds.train_indices
  data_s = ds.meta.get("seconds", {})
  meta = {"data": str(ds.path), "steps": cfg.steps, "batch_size": cfg.batch_size,
          "window": args.window, "final": history[-1] if history else None,
          "offline_tau": tau, "offline_tau_k": k,
          "options": {key: v for key, v in options.items() if key != "token_counts"},
          # What it cost: the training run (this process; a resumed run counts its last part)
          # and writing the data (target-written instructions, responses and hidden states).
          "train_seconds": round(train_s, 1),
          "data_seconds": round(sum(data_s.values()), 1) if data_s else None,
          "train_rows": int(len(rows)),
          "train_tokens": int(np.asarray(ds.loss_mask[rows]).sum()),
          "data_prompt_files": ds.meta.get("prompt_files"),
          "data_temperatures": ds.meta.get("generation", {}).get("temperatures"),
          "data_responses": ds.meta.get("responses", "target"),
          "recipe": "jaxspec train " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["train"]
                    else None}
  save_head(out, args.kind, model, target.cfg, meta=meta, dtype=args.save_dtype,
            target_params=target.params)
  return history, tau


def main(argv=None) -> int:
  """Runs a command; ordinary bad input (a missing or malformed file, an impossible size, an
  unwritable path, undecodable text) raises SystemExit("error: ...") naming it."""
  try:
    return _main(argv)
  except ValueError as e:  # CheckpointError, DataError and every argument check
    raise SystemExit(f"error: {e}") from e
  except (OSError, UnicodeError, RecursionError, OverflowError, MemoryError) as e:
    raise SystemExit(f"error: {type(e).__name__}: {e}") from e


def console_main(argv=None) -> int:
  """The `jaxspec` console script: `main`, with an error as one `error:` line on stderr and
  exit code 2 (argparse's code for bad usage), never a Python traceback."""
  try:
    return main(argv)
  except SystemExit as e:
    if isinstance(e.code, str):
      print(e.code if e.code.startswith("error:") else f"error: {e.code}", file=sys.stderr)
      return 2
    raise
  except KeyboardInterrupt:
    print("error: interrupted", file=sys.stderr)
    return 130


def _main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if hasattr(args, "compile_cache"):
    enable_compile_cache(args.compile_cache)
  if args.command == "generate":
    return cmd_generate(args)
  if args.command == "train":
    return cmd_train(args)
  if args.command == "bench":
    return cmd_bench(args, sys.argv[1:] if argv is None else argv)
  return 2


if __name__ == "__main__":
  sys.exit(console_main())
