"""`jaxspec train-data`: the target writes a self-distillation corpus (multi-turn conversations,
every answer its own) to a token budget, as token-id shards; rerunning continues it."""

from __future__ import annotations

import argparse
import signal
import sys

from jaxspec.checks import parse_int
from jaxspec.cli_options import (add_compile_cache, add_scan_layers, command_layout, count, count0,
                                 minutes)

_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9}


def token_count(text: str) -> int:
  """An argparse type: a positive token count, with an optional k / M / G suffix (2M)."""
  t = text.strip().lower()
  scale = _SUFFIX.get(t[-1:], 1)
  if scale > 1:
    t = t[:-1]
  try:
    n = float(t) * scale if "." in t else parse_int(t, 1, 2**40) * scale
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected a token count such as 500000 or 2M, got"
                                     f" {text!r}") from None
  if not 1 <= n <= 2**40 or n != int(n):
    raise argparse.ArgumentTypeError(f"expected a whole token count in [1, 2**40], got {text!r}")
  return int(n)


def _interrupt(signum, frame):
  raise KeyboardInterrupt


def add_train_data_parser(sub) -> None:
  """The `train-data` subcommand's parser, added to `sub` (argparse subparsers)."""
  t = sub.add_parser(
      "train-data", help="have the target write a self-distillation corpus (token-id shards)",
      description="The target writes multi-turn conversations (it answers every turn, and"
                  " writes the follow-up user turns and, for a share of them, the first one:"
                  " Magpie) until the corpus in --out holds --tokens answer tokens. Rerun the"
                  " same command to continue an interrupted or finished run (with a larger"
                  " --tokens to grow it). Train on it with jaxspec.train.corpus.PackedCorpus.")
  t.add_argument("--out", required=True, help="the corpus directory (created, or continued)")
  t.add_argument("--tokens", type=token_count, required=True, metavar="N",
                 help="token budget: stop once the corpus holds N answer tokens (e.g. 2M)")
  t.add_argument("--prompts", nargs="*", default=[], metavar="FILE",
                 help="JSON-lines prompt files for the first user turns (e.g."
                      " ../shared/data/gsm8k_train.jsonl); evaluation sets are refused")
  t.add_argument("--model", default=None, help="the target (default: the bundled SmolLM2-135M)")
  t.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  add_scan_layers(t)
  add_compile_cache(t)  # a rerun, which continues the corpus, loads its programs
  t.add_argument("--turns", type=count, default=2,
                 help="answers per conversation (the target writes each follow-up user turn)")
  t.add_argument("--max-new-tokens", type=count, default=1024, help="tokens per answer")
  t.add_argument("--max-user-tokens", type=count, default=128,
                 help="longest target-written user turn")
  t.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7],
                 help="answers are written at each of these (0 = greedy), batch by batch")
  t.add_argument("--magpie-fraction", type=float, default=0.25,
                 help="share of batches whose first user turn the target writes (Magpie);"
                      " all of them once the prompts are used up (0: stop then)")
  t.add_argument("--gen-batch-size", type=count, default=16,
                 help="conversations per batch, and the slots they are written on at once"
                      " (continuous batching)")
  t.add_argument("--max-prompt-len", type=count, default=512,
                 help="longer prompts (after the chat template) are skipped")
  t.add_argument("--max-len", type=count, default=4096, help="longest conversation (tokens)")
  t.add_argument("--max-prompts", type=count, default=None,
                 help="use at most this many prompts, drawn evenly from the files")
  t.add_argument("--shard-tokens", type=count, default=1 << 18,
                 help="tokens per shard (a shard is the unit a rerun resumes from)")
  t.add_argument("--max-batches", type=count0, default=None,
                 help="stop after this many batches in this run")
  t.add_argument("--max-minutes", type=minutes, default=None, metavar="M",
                 help="start no batch after M minutes of this run (a time-boxed run stores"
                      " every finished batch; rerun to go on)")
  t.add_argument("--seed", type=int, default=0)
  t.add_argument("--no-chat", action="store_true",
                 help="no chat template (needs --turns 1 --magpie-fraction 0)")
  t.add_argument("--allow-eval-prompts", action="store_true",
                 help="allow an evaluation set (spec_bench) among --prompts: contaminates it")
  t.add_argument("--progress-every", type=float, default=30.0, metavar="SECONDS",
                 help="without a terminal, a progress line every this many seconds")
  t.add_argument("--no-progress", action="store_true", help="no progress output")


def cmd_train_data(args) -> int:
  """Runs `jaxspec train-data`: writes or continues the corpus, then prints a summary line."""
  from pathlib import Path

  from jaxspec.models.loading import load
  from jaxspec.train.corpus import CorpusConfig, write_corpus
  from jaxspec.train.data import read_prompts

  cfg = CorpusConfig(turns=args.turns, max_new_tokens=args.max_new_tokens,
                     max_user_tokens=args.max_user_tokens,
                     temperatures=tuple(args.temperature), magpie_fraction=args.magpie_fraction,
                     batch_size=args.gen_batch_size, max_prompt_len=args.max_prompt_len,
                     max_len=args.max_len, shard_tokens=args.shard_tokens,
                     chat=not args.no_chat, seed=args.seed)
  prompts, files = [], []
  if args.prompts:
    prompts, _, files = read_prompts(args.prompts, max_prompts=args.max_prompts, seed=args.seed,
                                     allow_eval=args.allow_eval_prompts, with_files=True,
                                     all_turns=True)
  # A corpus compiles a program for every chunk width and number of slots starting a turn
  # together: stacked layers compile several times faster (on a CPU a batch-16 decode step is
  # about 10% slower).
  target = load(args.model, dtype=args.dtype, scan_layers=command_layout(args.scan_layers))
  # A polite stop (kill PID, a job scheduler's SIGTERM) keeps the finished batches, as Ctrl-C does.
  previous = signal.signal(signal.SIGTERM, _interrupt)
  try:
    s = write_corpus(target, prompts, args.out, cfg, token_budget=args.tokens,
                     sources=[Path(p).name for p in args.prompts], prompt_sources=files,
                     max_batches=args.max_batches,
                     time_limit=None if args.max_minutes is None else 60 * args.max_minutes,
                     progress=not args.no_progress,
                     progress_every=args.progress_every)
  finally:
    signal.signal(signal.SIGTERM, previous)
  state = ("complete (every prompt answered at every temperature)" if s.complete else
           "budget reached" if s.loss_tokens >= args.tokens else
           "stopped early: rerun the same command to continue")
  print(f"[jaxspec] corpus {s.path}: {s.conversations} conversations, {s.loss_tokens:,} answer"
        f" tokens of {s.tokens:,} in {s.shards} shards, next batch {s.next_batch};"
        f" {s.tokens_per_second:.1f} answer tokens/s this run; {state}", file=sys.stdout,
        flush=True)
  return 0
