"""`jaxspec bench`'s command line: its subparser (`add_bench_parser`, added by `jaxspec.cli`)
and `cmd_bench`."""

from __future__ import annotations

from collections.abc import Sequence

from jaxspec.bench.inputs import settings_from_args
from jaxspec.bench.methods import DEFAULT_METHODS, METHODS, BenchError
from jaxspec.bench.report import markdown
from jaxspec.bench.run import run_bench
from jaxspec.cli_options import add_compile_cache, add_sampling, add_scan_layers, count, draft_count


def add_bench_parser(sub) -> None:
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
                 help="nodes of the eagle-tree and medusa-tree methods' trees (default 8, the"
                      " fastest size on a 2-core CPU; 16 was the fastest of 8, 16 and 64 for"
                      " SmolLM2 on an H200; EAGLE-2 uses 60 for 7B+ targets on GPUs)")
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
  p.add_argument("--out", default="bench_out", help="output directory")
  p.add_argument("--no-progress", action="store_true", help="no progress bar")
  add_sampling(p)


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
