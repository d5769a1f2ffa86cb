"""`jaxspec bench`'s command line: its subparser (`add_bench_parser`, added by `jaxspec.cli`)
and `cmd_bench`."""

from __future__ import annotations

from collections.abc import Sequence

from jaxspec.bench.inputs import parse_batch_sizes, settings_from_args
from jaxspec.bench.methods import DEFAULT_METHODS, METHODS, BenchError
from jaxspec.bench.report import markdown
from jaxspec.bench.run import run_bench
from jaxspec.cli_options import (SCAN_LAYERS, add_compile_cache, add_sampling, add_scan_layers,
                                 count, draft_count)


def add_bench_parser(sub) -> None:
  from jaxspec.peers import PEERS
  p = sub.add_parser(
      "bench", help="measure methods side by side (and peer libraries) on a prompt set",
      description="Runs every method on every prompt batch back to back (interleaved, order"
                  " alternating), and writes bench.json, bench.md and plots into --out.")
  p.add_argument("--workload", choices=("prompts", "rollout"), default="prompts",
                 help="prompts (default): every method on a prompt set; rollout: --samples"
                      " sampled continuations of gsm8k and humaneval prompts per"
                      " --temperatures, as one batch and as consecutive calls carrying the"
                      " suffix corpus (methods none, ngram, suffix)")
  p.add_argument("--prompts", default=None, metavar="FILE",
                 help="JSON-lines prompts: Spec-Bench rows ('category', 'turns') or"
                      " {'prompt': ...} (optional 'category'); default: a built-in set of 2"
                      " prompts for each MT-bench category")
  p.add_argument("--categories", default=None,
                 help="comma-separated categories to keep ('mt-bench' = its 8); default all")
  p.add_argument("--per-category", type=count, default=1, help="prompts per category")
  p.add_argument("--methods", default=DEFAULT_METHODS,
                 help=f"comma-separated, of: {', '.join(METHODS)} (none, plain decoding, is"
                      f" always run: it is every speedup's baseline); default {DEFAULT_METHODS}")
  p.add_argument("--peers", default="",
                 help=f"comma-separated peer libraries run on the same model and prompts:"
                      f" {', '.join(PEERS)} (needs `pip install 'jaxspec[compare]'`)")
  p.add_argument("--batch-sizes", default="1", help="e.g. 1,8,32 (prompts repeat to fill a"
                                                    " batch)")
  p.add_argument("--max-new-tokens", type=count, default=64)
  p.add_argument("--num-draft-tokens", type=draft_count, default="auto",
                 help="k, or 'auto' (default; the cost model's prediction needs it)")
  p.add_argument("--k-max", type=count, default=None,
                 help="the most drafts per step with 'auto' (default 8, capped at a head's"
                      " limit)")
  p.add_argument("--tree-size", type=int, default=8,
                 help="nodes of the eagle-tree, medusa-tree and (rollout) suffix-tree methods'"
                      " trees (default 8, EAGLE's fastest size on a 2-core CPU; 16 was the"
                      " fastest of 8, 16 and 64 for SmolLM2 on an H200; EAGLE-2 uses 60 for 7B+"
                      " targets on GPUs)")
  p.add_argument("--model", default=None, help="default: the bundled SmolLM2-135M-Instruct")
  add_scan_layers(p)
  add_compile_cache(p, on=False)
  p.add_argument("--draft-model", default=None, metavar="PATH",
                 help="draft model (Hugging Face directory or .gguf) for the draft-model"
                      " method and transformers' assisted generation; default: the target in"
                      " int8 for jaxspec, and no assisted generation")
  p.add_argument("--lookup-tokens", type=count, default=10,
                 help="prompt-lookup tokens of the peers (prompt_lookup_num_tokens)")
  p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
  p.add_argument("--no-latency", action="store_true",
                 help="skip the streamed runs (no latency, no TTFT, predictions without"
                      " the prefill)")
  r = p.add_argument_group("rollout workload (--workload rollout)")
  r.add_argument("--data-dir", default="../shared/data",
                 help="the folder holding gsm8k_train.jsonl and humaneval.jsonl")
  r.add_argument("--prompts-per-set", type=count, default=8,
                 help="prompts from gsm8k and from humaneval each (default 8: 16 prompts)")
  r.add_argument("--samples", type=count, default=8, help="continuations per prompt (n)")
  r.add_argument("--temperatures", default="0.8,1.0", help="comma-separated, each > 0")
  r.add_argument("--corpus-size", type=count, default=8192,
                 help="token slots of the suffix drafter's corpus")
  p.add_argument("--out", default="bench_out", help="output directory")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  add_sampling(p)


def rollout_settings_from_args(args):
  """`RolloutSettings` from parsed arguments (--methods default: none,ngram,suffix)."""
  from jaxspec.bench.rollout import RolloutSettings, check_rollout
  try:
    temps = tuple(float(t) for t in args.temperatures.split(",") if t.strip())
  except ValueError:
    raise BenchError(f"--temperatures must be numbers separated by commas, got"
                     f" {args.temperatures!r}") from None
  methods = ("none", "ngram", "suffix") if args.methods == DEFAULT_METHODS else tuple(
      dict.fromkeys(m.strip() for m in args.methods.split(",") if m.strip()))
  if "none" not in methods:  # every speedup's baseline
    methods = ("none",) + methods
  s = RolloutSettings(model=args.model, scan_layers=SCAN_LAYERS[args.scan_layers],
                      data_dir=args.data_dir, prompts_per_set=args.prompts_per_set,
                      samples=args.samples, temperatures=temps,
                      batch_sizes=parse_batch_sizes(args.batch_sizes),
                      max_new_tokens=args.max_new_tokens, methods=methods,
                      num_draft_tokens=args.num_draft_tokens, k_max=args.k_max or 8,
                      corpus_size=args.corpus_size, tree_size=args.tree_size, seed=args.seed,
                      chat=not args.no_chat,
                      out=args.out, progress=not args.no_progress)
  check_rollout(s)
  return s


def cmd_bench(args, argv: Sequence[str] | None = None) -> int:
  if args.workload == "rollout":
    from jaxspec.bench.rollout import rollout_markdown, run_rollout
    try:
      report = run_rollout(rollout_settings_from_args(args), argv)
    except BenchError as e:
      raise SystemExit(f"error: {e}")
    print(rollout_markdown(report), end="")
    print(f"[jaxspec] wrote rollout.json, rollout.md into {args.out}"
          f" ({report['wall_seconds']:.0f} s)", flush=True)
    return 0
  try:
    s = settings_from_args(args)
    report = run_bench(s, argv)
  except BenchError as e:
    raise SystemExit(f"error: {e}")
  print(markdown(report), end="")
  print(f"[jaxspec] wrote {', '.join(report['files'])} into {s.out}"
        f" ({report['wall_seconds']:.0f} s)", flush=True)
  return 0
