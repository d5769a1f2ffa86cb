"""The `jaxspec` command line: `jaxspec generate "PROMPT"`."""

from __future__ import annotations

import argparse
import os
import sys
import time


def _add_sampling(p: argparse.ArgumentParser) -> None:
  p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
  p.add_argument("--top-k", type=int, default=0, help="0 = off")
  p.add_argument("--top-p", type=float, default=1.0, help="1 = off")
  p.add_argument("--min-p", type=float, default=0.0, help="0 = off")
  p.add_argument("--seed", type=int, default=0)


def _parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="jaxspec", description="Exact speculative decoding in JAX.")
  sub = ap.add_subparsers(dest="command", required=True)
  g = sub.add_parser("generate", help="generate text (speculatively by default) and print stats")
  g.add_argument("prompt", help="the user message (or raw text with --no-chat)")
  g.add_argument("--model", default=None,
                 help="a .gguf file, a Hugging Face directory, or a bundled name"
                      " (default: the bundled SmolLM2-135M-Instruct)")
  g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
  g.add_argument("--max-new-tokens", type=int, default=128)
  g.add_argument("--draft", default="ngram",
                 help="none | ngram | PATH of a draft model (.gguf or HF directory)")
  g.add_argument("--num-draft-tokens", type=int, default=4, help="k, drafts per step")
  g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  g.add_argument("--chunk", type=int, default=8, help="decode steps between printed chunks")
  _add_sampling(g)
  return ap


def _make_drafter(spec: str, target, dtype: str):
  from jaxspec.drafters import DraftModel, NGram
  from jaxspec.models.loading import load
  if spec == "none":
    return None
  if spec == "ngram":
    return NGram()
  if os.path.exists(spec):
    return DraftModel(load(spec, dtype=dtype))
  raise SystemExit(f"error: --draft {spec!r} is not 'none', 'ngram' or an existing path of a"
                   " draft model (.gguf file or Hugging Face directory)")


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
  model = load(args.model, dtype=args.dtype)
  drafter = _make_drafter(args.draft, model, args.dtype)
  load_s = time.perf_counter() - t_load
  tok = model.tokenizer
  ids = tok.encode(args.prompt) if args.no_chat else tok.encode_chat(args.prompt)
  common = dict(max_new_tokens=args.max_new_tokens, sampling=sampling, key=args.seed)
  try:
    if drafter is None:
      stream = generate_stream(model, [ids], chunk=args.chunk, **common)
    else:
      stream = speculative_stream(model, drafter, [ids], num_draft_tokens=args.num_draft_tokens,
                                  chunk=max(1, args.chunk // 2), **common)
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
          f" compile {info.get('compile_seconds', 0.0):.1f} s, load {load_s:.1f} s,"
          f" model {model.name}, draft {args.draft}")
  st = info.get("stats")
  if st:
    line += (f", k={args.num_draft_tokens}, tau {st['tau']:.2f},"
             f" acceptance {st['acceptance_rate']:.2f}")
  print(line, flush=True)
  return 0


def main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if args.command == "generate":
    return cmd_generate(args)
  return 2


if __name__ == "__main__":
  sys.exit(main())
