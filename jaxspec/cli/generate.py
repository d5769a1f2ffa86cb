"""`jaxspec generate "PROMPT"`: generate text (speculatively by default), streaming it, and print
a line of stats."""

from __future__ import annotations

import sys
import time

from jaxspec.cli_options import (CACHE_EVENTS, SCAN_LAYERS, add_compile_cache, add_sampling,
                                 add_scan_layers, count, draft_count)


def add_generate_parser(sub) -> None:
  """The `generate` subcommand's parser, added to `sub` (argparse subparsers)."""
  g = sub.add_parser("generate", help="generate text (speculatively by default) and print stats")
  g.add_argument("prompt", help="the user message (or raw text with --no-chat)")
  g.add_argument("--model", default=None,
                 help="a .gguf file, a Hugging Face directory, or a bundled name"
                      " (default: the bundled SmolLM2-135M-Instruct)")
  g.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
  g.add_argument("--max-new-tokens", type=count, default=128)
  g.add_argument("--draft", default="default",
                 help="default | none | ngram | eagle | medusa | mlp | a head directory | PATH of"
                      " a draft model (.gguf or HF directory); default: the bundled EAGLE head"
                      " when the model is the bundled SmolLM2, else ngram")
  g.add_argument("--num-draft-tokens", type=draft_count, default="auto",
                 help="k, drafts per step, or 'auto' (default: chosen every step from measured"
                      " acceptance and cost, 0 = a plain step)")
  g.add_argument("--k-max", type=count, default=None,
                 help="the most drafts per step with 'auto' (default 8, or fewer when the"
                      " drafter proposes fewer: a Medusa head drafts at most its head count)")
  g.add_argument("--tree", default=None, metavar="SPEC",
                 help="draft a tree each step (a Medusa or EAGLE head): N (a tree of N nodes:"
                      " EAGLE-2's dynamic tree, or Medusa's best static tree from the head's"
                      " measured accuracies), dynamic:DEPTH,TOPK,TOTAL, a JSON list of paths"
                      " ([[0],[1],[0,0]]) or a .json file of one")
  g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
  add_scan_layers(g)
  g.add_argument("--chunk", type=count, default=8, help="decode steps between printed chunks")
  add_compile_cache(g)
  add_sampling(g)


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
  """Runs `jaxspec generate`: streams the text to stdout, then one line of stats."""
  from jaxspec.api import generate_stream
  from jaxspec.models.loading import load
  from jaxspec.sampling import Sampling
  from jaxspec.api import speculative_stream

  try:
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        min_p=args.min_p)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  t_load = time.perf_counter()
  model = load(args.model, dtype=args.dtype, scan_layers=SCAN_LAYERS[args.scan_layers])
  drafter = _make_drafter(args.draft, model, args.dtype)
  if args.tree is not None:
    from jaxspec.decoding.tree import parse_tree
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
      from jaxspec.decoding.adaptive import AutoK
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
