"""`jaxspec train KIND`: have the target answer prompts (self-distillation data), then train a
draft head (medusa, mlp, eagle) or a draft model on them and save it."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from jaxspec.cli_options import count, count0, minutes


TRAIN_KINDS = ("medusa", "mlp", "eagle", "draft-model", "pard")
# Defaults sized for the bundled SmolLM2-135M on a 2-core CPU, the recipe of the bundled heads
# (what the data and a step take there: docs/lab-notes/code-notes-moved.md). Medusa and MLP steps
# cost most: their losses run the full LM head for every head at every position.
TRAIN_DEFAULTS = {
    "draft-model": dict(steps=200, lr=5e-4, batch_size=8),
    "pard": dict(steps=200, lr=1e-3, batch_size=8),
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


def add_train_parser(sub) -> None:
  """The `train` subcommand's parser, added to `sub` (argparse subparsers)."""
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
  t.add_argument("--corpus", default=None, metavar="DIR",
                 help="train on a corpus written by `jaxspec train-data`: its conversations"
                      " (one a row) and the target's hidden states are stored in --out/data"
                      " first (the offline path)")
  t.add_argument("--corpus-seq-len", type=count, default=1024,
                 help="with --corpus: tokens per row (longer conversations are cut)")
  t.add_argument("--corpus-conversations", type=count, default=None,
                 help="with --corpus: use the first N conversations only")
  t.add_argument("--resume", action="store_true",
                 help="continue an interrupted run in --out from its latest checkpoint")
  t.add_argument("--steps", type=count, default=None, help="optimizer steps (default per kind)")
  t.add_argument("--batch-size", type=count, default=None)
  t.add_argument("--lr", type=float, default=None, help="peak learning rate")
  t.add_argument("--warmup", type=count0, default=None, help="warmup steps (default steps / 10)")
  t.add_argument("--weight-decay", type=float, default=0.01)
  t.add_argument("--clip-norm", type=float, default=1.0)
  t.add_argument("--save-every", type=count, default=50)
  t.add_argument("--keep-last", type=count, default=2, help="checkpoints kept")
  t.add_argument("--max-minutes", type=minutes, default=None, metavar="M",
                 help="stop optimising after M minutes (data writing not counted): the last"
                      " step is evaluated, saved and the head written; --resume goes on with"
                      " the same schedule (the learning rate follows --steps)")
  t.add_argument("--eval-every", type=count, default=100,
                 help="held-out evaluation every this many steps (and at the end)")
  t.add_argument("--eval-batches", type=count, default=4, help="held-out batches per evaluation")
  t.add_argument("--seed", type=int, default=0)
  t.add_argument("--window", type=count0, default=128,
                 help="tokens per training row: each row is cropped to a window over its"
                      " response, so the LM head runs on fewer positions (0 = whole rows)")
  t.add_argument("--max-prompts", type=count, default=320,
                 help="prompts the target answers, drawn evenly from the files")
  t.add_argument("--self-instructions", type=int, default=0, metavar="N",
                 help="also have the target write N user instructions itself (Magpie: sampled"
                      " after its chat template's bare user-turn prefix) and answer them")
  t.add_argument("--turns", type=count, default=1,
                 help="answers per conversation: above 1, the target writes a follow-up user"
                      " turn after each answer and answers it (every answer its own), and"
                      " --self-instructions N starts N conversations with a user turn it"
                      " writes; the conversations are kept in --out/corpus")
  t.add_argument("--responses", choices=["target", "given"], default="target",
                 help="target (default): the target writes the responses (self-distillation);"
                      " given: the prompt files' own answers, teacher-forced (GSM8K 'answer',"
                      " HumanEval 'canonical_solution', self-instruct 'output', 'response'),"
                      " the target's hidden states and distribution still the labels; only a"
                      " forward runs, no generation")
  t.add_argument("--max-new-tokens", type=count, default=128, help="response tokens per prompt")
  t.add_argument("--max-prompt-len", type=count, default=256,
                 help="longer prompts (after the chat template) are skipped")
  t.add_argument("--temperature", type=float, nargs="+", default=[0.0, 0.7],
                 help="one response per prompt per value (0 = greedy)")
  t.add_argument("--gen-batch-size", type=count, default=32, help="rows per generate call")
  t.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
  t.add_argument("--allow-eval-prompts", action="store_true",
                 help="allow training on an evaluation set (spec_bench): contaminates it")
  t.add_argument("--num-layers", type=count, default=4,
                 help="draft-model, pard: target layers the draft keeps")
  t.add_argument("--option", type=_option, action="append", default=[], metavar="KEY=VALUE",
                 help="head option (JSON value), e.g. --option num_heads=3; defaults: eagle"
                      " version=3 ttt_steps=3 draft_vocab_size=4096 (large vocabularies), mlp"
                      " tie_to_target=true; pard: jaxspec.train.pard.PardObjective's fields"
                      " (mask_id, required; k, anchors, keep, positions, labels)")
  t.add_argument("--init", metavar="HEAD",
                 help="medusa, mlp, eagle: start from this saved head (a directory or a bundled"
                      " head's name, e.g. eagle) instead of a new one, to go on training it on"
                      " other data; its options are kept (no --option)")
  t.add_argument("--save-dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
  t.add_argument("--no-progress", action="store_true",
                 help="plain progress lines (every 30 s and at the end of each stage) instead of"
                      " bars; without a terminal they are lines anyway")


def _stopped(last: dict, cfg) -> str:
  """What the summary line adds when --max-minutes ended the run (its last record says so)."""
  if last.get("stopped") != "time_limit":
    return ""
  return (f", stopped at step {last['step']} of {cfg.steps} by --max-minutes (--resume goes on"
          " from there)")


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
                     eval_every=args.eval_every, eval_batches=args.eval_batches,
                     time_limit=None if args.max_minutes is None else 60 * args.max_minutes)


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
  if args.corpus:
    from jaxspec.train.corpus import write_corpus_dataset
    write_corpus_dataset(target, args.corpus, data_dir, seq_len=args.corpus_seq_len,
                         hidden_layers=layers, max_conversations=args.corpus_conversations,
                         progress=progress)
    return Dataset(data_dir, layers=layers, window=args.window or None)
  cfg = DataConfig(max_prompt_len=args.max_prompt_len, max_new_tokens=args.max_new_tokens,
                   temperatures=tuple(args.temperature), batch_size=args.gen_batch_size,
                   hidden_layers=tuple(layers), chat=not args.no_chat, seed=args.seed)
  prompts, counts, seconds, responses, files = [], {}, {}, None, []
  if args.prompts:
    prompts, counts, files = read_prompts(args.prompts, max_prompts=args.max_prompts,
                                          seed=args.seed, allow_eval=args.allow_eval_prompts,
                                          answers=args.responses == "given", with_files=True,
                                          all_turns=args.turns > 1)
    if args.responses == "given":
      prompts, responses = [p for p, _ in prompts], [r for _, r in prompts]
  if args.turns > 1:
    return _multi_turn_data(args, target, layers, prompts, files, data_dir, progress)
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


def _multi_turn_data(args, target, layers, prompts, files, data_dir, progress):
  """--turns > 1: the target writes multi-turn conversations (`write_corpus`) for every prompt
  at every temperature and --self-instructions conversations of its own (Magpie batches of
  --gen-batch-size), into --out/corpus; they are stored as the dataset with hidden states."""
  from pathlib import Path

  from jaxspec.train.corpus import CorpusConfig, write_corpus, write_corpus_dataset
  from jaxspec.train.data import Dataset
  b = args.gen_batch_size
  prompt_batches = -(-len(prompts) // b) * len(args.temperature)
  magpie = -(-args.self_instructions // b)
  total = prompt_batches + magpie
  cfg = CorpusConfig(turns=args.turns, max_new_tokens=args.max_new_tokens,
                     temperatures=tuple(args.temperature), batch_size=b,
                     max_prompt_len=args.max_prompt_len,
                     # Exactly `magpie` of the first `total` batches are Magpie batches
                     # (batch_plan: floor(total * fraction) of them), the rest every prompt
                     # at every temperature.
                     magpie_fraction=min(1.0, (magpie + 0.5) / total) if magpie else 0.0,
                     max_len=args.max_prompt_len + args.turns * (args.max_new_tokens + 256),
                     chat=not args.no_chat, seed=args.seed)
  corpus = write_corpus(target, prompts, Path(args.out) / "corpus", cfg, token_budget=2**40,
                        sources=[str(p) for p in args.prompts], prompt_sources=files,
                        max_batches=total, progress=progress)
  write_corpus_dataset(target, corpus.path, data_dir, seq_len=cfg.max_len, hidden_layers=layers,
                       progress=progress)
  return Dataset(data_dir, layers=layers, window=args.window or None)


def cmd_train(args) -> int:
  """Runs `jaxspec train`: data (written or reused), training, the saved draft, summary.json."""
  import json
  from pathlib import Path

  from jaxspec.models.errors import CheckpointError
  from jaxspec.models.loading import load

  t0 = time.perf_counter()
  progress = "lines" if args.no_progress else True
  options = dict(args.option)
  try:
    cfg = _train_config(args)
    if args.kind == "pard":
      return _train_pard(args, cfg, options, progress, t0)
    if args.kind != "draft-model" and options.get("draft_vocab") is not None:
      raise ValueError("--option draft_vocab is not supported on the command line: use"
                       " draft_vocab_size=N (the N most frequent response tokens)")
    if not 0 <= args.self_instructions <= 2**20:
      raise ValueError(f"--self-instructions must be >= 0 (and at most {2**20}), got"
                       f" {args.self_instructions}")
    if args.self_instructions and args.responses == "given":
      raise ValueError("--self-instructions has no given responses to go with --responses"
                       " given: the target answers its own instructions (--responses target)")
    if args.turns > 1 and args.responses == "given":
      raise ValueError("--turns above 1 has the target write the follow-up turns: use"
                       " --responses target")
    if args.corpus and (args.prompts or args.self_instructions or args.data_dir):
      raise ValueError("--corpus is the training data: drop --prompts, --self-instructions"
                       " and --data-dir")
    if not (args.prompts or args.self_instructions or args.data_dir or args.corpus
            or (Path(args.out) / "data" / "meta.json").is_file()):
      raise ValueError("no training data: pass --prompts FILE... (the target answers them),"
                       " --self-instructions N (the target writes N instructions and answers"
                       " them) or --data-dir DIR (a dataset written earlier)")
    target = load(args.model, dtype=args.dtype)
    if args.init and args.kind not in ("medusa", "mlp", "eagle"):
      raise ValueError(f"--init continues a saved head (medusa, mlp, eagle), not {args.kind}")
    if args.kind == "draft-model":
      if options:
        raise ValueError(f"draft-model takes no --option (got {sorted(options)}): use"
                         " --num-layers")
      from jaxspec.models.hf_loader import check_savable
      from jaxspec.train.distill import draft_from_target
      # --num-layers, and that the draft's family can be saved, before any work.
      check_savable(draft_from_target(target, args.num_layers).cfg)
      layers = ()
    else:
      from jaxspec.heads import HEADS
      spec = HEADS[args.kind]
      init = None
      if args.init:
        init = _init_head(args, options, target)
        layers = tuple(init.cfg.layers or ()) if args.kind == "eagle" else ()
      else:
        options = head_options(args.kind, options, target.cfg.vocab_size)
        layers = tuple(spec.required_layers(target.cfg, options))
    ds = _training_data(args, target, layers, progress)
    out = Path(args.out)
    start = _checkpointed_step(out / "training") if args.resume else 0
    summary = {"kind": args.kind, "target": target.name, "data": str(ds.path),
               "train_rows": int(len(ds.train_indices)), "eval_rows": int(len(ds.eval_indices)),
               "config": cfg.to_json()}
    if args.kind == "draft-model":
      from jaxspec.train.distill import distill
      _, history = distill(target, ds, out, cfg, num_layers=args.num_layers, resume=args.resume,
                           save_dtype=args.save_dtype, progress=progress)
    else:
      history, tau = _train_head(args, spec, options, target, ds, cfg, out, progress, init)
      summary["offline_tau"] = tau
  except (ValueError, CheckpointError, FloatingPointError) as e:  # DataError: a ValueError
    raise SystemExit(f"error: {e}")
  summary["final"] = history[-1] if history else None
  summary["seconds"] = round(time.perf_counter() - t0, 1)
  (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
  last = history[-1] if history else {}
  # A resumed run reports its own steps: the history also holds the records before the kill.
  ours = [r for r in history if r["step"] > start]
  if ours:
    end = last.get("step", cfg.steps)
    what = (f"{end - start} steps (resumed at step {start} of {cfg.steps})" if start
            else f"{end} steps")
    what += _stopped(last, cfg)
    line = (f"[jaxspec] trained {args.kind} for {what} in {summary['seconds']:.0f} s:"
            f" loss {ours[0]['loss']:.4f} -> {last.get('loss', float('nan')):.4f}")
  else:
    line = f"[jaxspec] {args.kind}: nothing to train (the run had finished all {cfg.steps} steps)"
  if "eval_loss" in last:
    line += f", held-out loss {last['eval_loss']:.4f}"
  if summary.get("offline_tau") is not None:
    line += f", offline tau {summary['offline_tau']:.2f}"
  print(line + f"; saved to {out}", flush=True)
  return 0


def _train_pard(args, cfg, options, progress, t0) -> int:
  """`jaxspec train pard`: a draft cut from the target (--num-layers) trained with PARD's
  mask-token objective on a corpus (`jaxspec train-data`), read as packed rows with the target's
  states computed in the step; saved with its mask token in config.json."""
  import json
  from pathlib import Path

  from jaxspec.models.loading import load
  from jaxspec.train.corpus import PackedCorpus
  from jaxspec.train.distill import distill, draft_from_target
  from jaxspec.train.pard import PardObjective
  if not args.corpus or args.prompts or args.data_dir or args.self_instructions:
    raise ValueError("pard trains on a corpus written by `jaxspec train-data`: pass --corpus DIR"
                     " (and no --prompts, --data-dir or --self-instructions)")
  if "mask_id" not in options:
    raise ValueError("pard needs its mask token: --option mask_id=ID, an id of the target's"
                     " vocabulary that its text never holds (16, <empty_output>, for SmolLM2)")
  fields = {f.name for f in dataclasses.fields(PardObjective)}
  unknown = sorted(set(options) - fields)
  if unknown:
    raise ValueError(f"pard takes --option {', '.join(sorted(fields))}; got {unknown}")
  objective = PardObjective(**options)
  target = load(args.model, dtype=args.dtype)
  from jaxspec.models.hf_loader import check_savable
  check_savable(draft_from_target(target, args.num_layers).cfg)
  data = PackedCorpus(args.corpus, args.corpus_seq_len)
  out = Path(args.out)
  _, history = distill(target, data, out, cfg, num_layers=args.num_layers, resume=args.resume,
                       save_dtype=args.save_dtype, progress=progress, objective=objective,
                       hidden="online")
  last = history[-1] if history else {}
  summary = {"kind": "pard", "target": target.name, "data": str(args.corpus),
             "seq_len": args.corpus_seq_len, "train_rows": data.num_train_rows,
             "objective": dataclasses.asdict(objective), "config": cfg.to_json(),
             "final": last or None, "seconds": round(time.perf_counter() - t0, 1)}
  (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")
  depths = ", ".join(f"{last[f'top1_d{d}']:.2f}" for d in range(1, objective.k + 1)
                     if f"top1_d{d}" in last)
  what = f"{last.get('step', cfg.steps)} steps" + _stopped(last, cfg)
  print(f"[jaxspec] trained pard for {what} in {summary['seconds']:.0f} s: loss"
        f" {history[0]['loss']:.4f} -> {last.get('loss', float('nan')):.4f}, top-1 by depth"
        f" {depths}; saved to {out}", flush=True)
  return 0


def _checkpointed_step(train_dir) -> int:
  """The step of the latest checkpoint in a training directory (0: none), where a resumed run
  starts."""
  ckpt = train_dir / "checkpoints"
  steps = [int(p.name) for p in ckpt.iterdir() if p.name.isdigit()] if ckpt.is_dir() else []
  return max(steps, default=0)


def _init_head(args, options, target):
  """The saved head --init names, as a module to go on training: of --kind's kind, for this
  target, its options its own."""
  from jaxspec.heads.io import load_head_model
  if options:
    raise ValueError(f"--init {args.init} keeps that head's options: drop --option"
                     f" ({', '.join(sorted(options))})")
  kind, head, _ = load_head_model(target, args.init)
  if kind != args.kind:
    raise ValueError(f"--init {args.init} is a {kind} head, not {args.kind}: train {kind} or"
                     f" start from a {args.kind} head")
  return head


def _train_head(args, spec, options, target, ds, cfg, out, progress, init=None):
  """Trains (`jaxspec.train.train_head`; `init`: the head module to start from) and saves a
  head; returns (history, offline tau on held-out batches)."""
  import jax.numpy as jnp
  import numpy as np

  from jaxspec.heads import save_head
  from jaxspec.train import train_head
  t0 = time.perf_counter()
  # The stored hidden states (the rows are cropped to --window on the host, after the target
  # read them whole); EAGLE-3's draft vocabulary is counted from the training rows.
  run = train_head(target, args.kind, ds, options=options, head=init, config=cfg,
                   hidden="offline", out_dir=out / "training", resume=args.resume,
                   progress=progress, seed=args.seed)
  model, history = run.model, run.history
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
          "options": dict(run.options), "init": args.init,
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
