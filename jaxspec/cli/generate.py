"""`jaxspec generate "PROMPT"` (or `--prompts FILE`): generate text (speculatively by default),
streaming one prompt's text as it comes, or running a file's prompts in batches.

Output conventions: stdout holds only what was generated (the text and its final newline; a
blank line between a file's texts; with --json one JSON object per prompt), so
`jaxspec generate "..." > out.txt` keeps just the text; the line of stats and every other
message go to stderr.
"""

from __future__ import annotations

import json
import re
import resource
import sys
import time
from pathlib import Path

from jaxspec.cli_options import (CACHE_EVENTS, add_compile_cache, add_penalties, add_sampling,
                                 add_scan_layers, command_layout, count, draft_count)

# The names --draft takes (besides a path). "eagle3" is the bundled EAGLE head under the name
# its drafter reports (an EAGLE-3 head), so every drafter name the CLI prints is one it takes;
# `jaxspec.drafters.resolve_drafter` knows it as "eagle".
DRAFT_NAMES = ("default", "none", "ngram", "eagle", "eagle3", "medusa", "mlp")
_DRAFT_ALIASES = {"eagle3": "eagle"}
# Prompt files read as JSON lines; any other file holds one prompt per line.
_JSONL_SUFFIXES = (".jsonl", ".ndjson")


def add_generate_parser(sub) -> None:
  """The `generate` subcommand's parser, added to `sub` (argparse subparsers)."""
  g = sub.add_parser(
      "generate", help="generate text (speculatively by default) and print stats",
      description="Generate text (speculatively by default). stdout holds only the generated"
                  " text (or, with --json, one JSON object per prompt); the stats line and"
                  " other messages go to stderr.")
  g.add_argument("prompt", nargs="?", default=None,
                 help="the user message (or raw text with --no-chat); leave it out with --prompts")
  g.add_argument("--prompts", default=None, metavar="FILE",
                 help="generate for every prompt of FILE, --batch-size at a time, printed in"
                      " file order (texts separated by a blank line; a header per prompt goes to"
                      " stderr): a text file of one prompt per line, or a .jsonl file of objects"
                      " with a 'prompt' field (or Spec-Bench's 'turns': the first turn is the"
                      " prompt); blank lines are skipped. Rows are independent: under greedy"
                      " decoding each text is the one the prompt alone gives; sampled, prompt i"
                      " of the file draws from --seed and i, whatever --batch-size)")
  g.add_argument("--batch-size", type=count, default=8,
                 help="prompts of --prompts generated together, in one call (default 8; the"
                      " last batch may be smaller)")
  g.add_argument("--json", action="store_true",
                 help="print one JSON object per prompt (JSON Lines) on stdout instead of the"
                      " text: prompt, text, token_ids (the new tokens, a stop token included),"
                      " new_tokens, and stats (tokens_per_second, seconds, compile_seconds,"
                      " cost_seconds, cost_source, load_seconds, model, drafter, batch_size; k,"
                      " mean_k, plain_steps, target_passes, tau, drafted, accepted, acceptance when speculative, else"
                      " null; timings and tau are its batch's, drafted/accepted/acceptance the"
                      " prompt's own); the stats line still goes to stderr")
  g.add_argument("--model", default=None,
                 help="a .gguf file, a Hugging Face directory, or a bundled name"
                      " (default: the bundled SmolLM2-135M-Instruct)")
  chat = g.add_mutually_exclusive_group()
  chat.add_argument("--chat", dest="chat", action="store_const", const=True, default=None,
                    help="render each prompt as a user message through the model's chat"
                         " template (an error without one); by default the template is used"
                         " where the model has one, as jaxspec.generate(chat=None) does")
  chat.add_argument("--no-chat", dest="chat", action="store_const", const=False,
                    help="encode each prompt as it is (jaxspec.generate(chat=False))")
  g.add_argument("--max-new-tokens", type=count, default=128)
  g.add_argument("--draft", default="default",
                 help=f"{' | '.join(DRAFT_NAMES)} | a head directory | PATH of a draft model"
                      " (.gguf or HF directory); default: the bundled EAGLE-3 head (eagle and"
                      " eagle3 both name it) when the model is the bundled SmolLM2, else ngram")
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
  g.add_argument("--dtype", default=None, choices=["float32", "bfloat16"],
                 help="parameter dtype (default: the checkpoint's: bfloat16 for a bfloat16"
                 " checkpoint, float32 otherwise)")
  add_scan_layers(g)
  g.add_argument("--chunk", type=count, default=8,
                 help="decode steps between printed chunks (one prompt, text output)")
  add_compile_cache(g)
  add_sampling(g)
  add_penalties(g)


def read_prompt_lines(path: str) -> list:
  """The prompts of a --prompts file, in file order: one per line of a text file, or the
  'prompt' / 'turns' (first turn) / ... field of every line of a .jsonl file (a 'prompt_ids'
  field gives token ids, used as they are); blank lines are skipped.

  Raises:
    SystemExit("error: ..."): the file is missing, not UTF-8, malformed or holds no prompt.
  """
  p = Path(path)
  if not p.is_file():
    what = "is a directory" if p.is_dir() else "does not exist"
    raise SystemExit(f"error: --prompts {path} {what}: pass a text file of one prompt per line"
                     " or a .jsonl file of {\"prompt\": ...} objects")
  jsonl = p.suffix.lower() in _JSONL_SUFFIXES
  try:
    if jsonl:
      from jaxspec.train.data import json_lines, line_prompt
      expected = ("every line must be one JSON object with a 'prompt' field (or Spec-Bench's"
                  " 'turns')")
      prompts = [line_prompt(obj, where) for where, obj in json_lines(p, expected)]
    else:
      with open(p, encoding="utf-8") as f:
        prompts = [line.rstrip("\r\n") for line in f if line.strip()]
  except UnicodeDecodeError as e:
    raise SystemExit(f"error: --prompts {path} is not UTF-8 text ({e.reason} at byte"
                     f" {e.start}): save it as UTF-8") from None
  except ValueError as e:  # DataError: a line that is not JSON or has no prompt field
    raise SystemExit(f"error: --prompts: {e}") from None
  if not prompts:
    raise SystemExit(f"error: --prompts {path} holds no prompts: write one prompt per line"
                     + (" (a JSON object with a 'prompt' field)" if jsonl else ""))
  return prompts


def _make_drafter(spec: str, target, dtype: str):
  from jaxspec.drafters import resolve_drafter
  from jaxspec.models.errors import CheckpointError
  if spec == "none":
    return None
  if spec == "default":  # the bundled EAGLE head when it fits the target, else prompt lookup
    from jaxspec.heads import bundled_head_for
    spec = bundled_head_for(target) or "ngram"
  try:
    drafter = resolve_drafter(target, _DRAFT_ALIASES.get(spec, spec), dtype)
  except ValueError as e:
    raise SystemExit(f"error: --draft: {e}")
  except CheckpointError as e:  # a head for another target, corrupted files
    raise SystemExit(f"error: --draft {spec!r}: {e}")
  if spec in _DRAFT_ALIASES and drafter.name != spec:
    raise SystemExit(f"error: --draft {spec}: the bundled {_DRAFT_ALIASES[spec]} head is a"
                     f" {drafter.name} head: pass --draft {_DRAFT_ALIASES[spec]}")
  return drafter


def draft_label(spec: str, drafter) -> str:
  """The drafter's name as the CLI prints it: a value --draft takes that names this drafter
  ('none', its name for a bundled one, else the path the user gave)."""
  if drafter is None:
    return "none"
  if spec in DRAFT_NAMES:
    return drafter.name.removesuffix("-tree")  # the tree is printed on its own
  return spec


def run_stats(info: dict, spec: dict | None, new_tokens: int, *, load_s: float, model: str,
              drafter: str, num_draft_tokens, batch_size: int, peak_bytes: int = 0) -> dict:
  """The run's statistics, as --json prints them (and the stats line shows).

  Args:
    info: the run's timings (`seconds`, `compile_seconds`, `cost_seconds`) and, with "auto",
      where its cost model came from (`cost_source`).
    spec: the speculative statistics (`drafted_per_row`, `tau`, ...), None for plain decoding.
    new_tokens: new tokens of all rows.
  Returns:
    tokens_per_second, seconds, compile_seconds, cost_seconds (timing the cost model of
    "auto") and cost_source ("measured", "cached", "disk", "given"; None without "auto"),
    load_seconds,
    peak_memory_bytes (the process's peak resident memory), model, drafter, batch_size,
    new_tokens; k ('auto', an int or the tree), mean_k,
    plain_steps ('auto' only), target_passes, tau, drafted, accepted and acceptance (None when
    nothing was drafted) when speculative, else None.
  """
  secs = info.get("seconds", 0.0)
  out = dict(new_tokens=new_tokens, tokens_per_second=new_tokens / secs if secs else 0.0,
             seconds=secs,
             compile_seconds=info.get("compile_seconds", 0.0),
             cost_seconds=info.get("cost_seconds", 0.0), cost_source=info.get("cost_source"),
             load_seconds=load_s, peak_memory_bytes=peak_bytes, model=model, drafter=drafter,
             batch_size=batch_size, k=None,
             mean_k=None, plain_steps=None, target_passes=None, tau=None, drafted=None,
             accepted=None, acceptance=None)
  if spec:
    drafted, accepted = int(sum(spec["drafted_per_row"])), int(sum(spec["accepted_per_row"]))
    auto = num_draft_tokens == "auto"
    out.update(k=spec.get("tree") or num_draft_tokens,
               mean_k=spec["mean_k"] if auto else None,
               plain_steps=spec["plain_steps"] if auto else None,
               target_passes=spec["target_passes"], tau=spec["tau"],
               drafted=drafted, accepted=accepted,
               # accepted / drafted means nothing when nothing was drafted
               acceptance=accepted / drafted if drafted else None)
  return out


def merge_stats(runs: list[dict]) -> dict:
  """The statistics of several runs (`run_stats` dicts, one per batch) as one: times, tokens,
  drafts and plain steps summed, mean_k weighted by target passes, and tau (tokens per live
  row-step) as the total tokens over the total row-steps, each batch's being tokens / tau."""
  if len(runs) == 1:
    return runs[0]
  out = dict(runs[0])
  for key in ("new_tokens", "seconds", "compile_seconds", "cost_seconds"):
    out[key] = sum(r[key] for r in runs)
  out["tokens_per_second"] = out["new_tokens"] / out["seconds"] if out["seconds"] else 0.0
  out["batch_size"] = max(r["batch_size"] for r in runs)
  out["peak_memory_bytes"] = max(r["peak_memory_bytes"] for r in runs)
  if out["tau"] is not None:
    for key in ("drafted", "accepted", "target_passes"):
      out[key] = sum(r[key] for r in runs)
    out["acceptance"] = out["accepted"] / out["drafted"] if out["drafted"] else None
    steps = sum(r["new_tokens"] / r["tau"] for r in runs if r["tau"])
    out["tau"] = out["new_tokens"] / steps if steps else 0.0
    if out["mean_k"] is not None:
      out["plain_steps"] = sum(r["plain_steps"] for r in runs)
      out["mean_k"] = (sum(r["mean_k"] * r["target_passes"] for r in runs)
                       / max(out["target_passes"], 1))
  return out


def stats_line(st: dict, *, prompts: int = 1) -> str:
  """The one line of stats printed to stderr after a run (`run_stats`'s dict)."""
  line = ("[jaxspec] " + (f"{prompts} prompts, " if prompts > 1 else "") +
          f"{st['new_tokens']} new tokens, {st['tokens_per_second']:.1f} tokens/s,"
          f" compile {st['compile_seconds']:.1f} s"
          + (f" ({CACHE_EVENTS['loaded']} programs loaded from the cache,"
             f" {CACHE_EVENTS['written']} written)," if CACHE_EVENTS else ",") +
          (f" cost model {st['cost_seconds']:.1f} s ({st['cost_source']}),"
           if st.get("cost_source") else "") +
          f" load {st['load_seconds']:.1f} s,"
          f" peak memory {st['peak_memory_bytes'] / 2**30:.2f} GiB,"
          f" model {st['model']}, draft {st['drafter']}")
  if st["tau"] is not None:
    if st["mean_k"] is not None and st["k"] == "auto":
      k = f"k=auto (mean {st['mean_k']:.1f}, {st['plain_steps']} plain steps)"
    else:
      k = st["k"] if isinstance(st["k"], str) and st["k"] != "auto" else f"k={st['k']}"
    line += f", {k}, tau {st['tau']:.2f}"
  acc = st["acceptance"]
  return line + f", acceptance {'n/a' if acc is None else f'{acc:.2f}'}"


def _row_record(prompt, ids: list[int], text: str, stats: dict, spec: dict | None,
                row: int) -> dict:
  """One --json line: the run's stats with drafted / accepted / acceptance of this row."""
  st = {k: v for k, v in stats.items() if k != "new_tokens"}
  if spec:
    d, a = int(spec["drafted_per_row"][row]), int(spec["accepted_per_row"][row])
    st.update(drafted=d, accepted=a, acceptance=a / d if d else None)
  return dict(prompt=prompt, text=text, token_ids=ids, new_tokens=len(ids), stats=st)


def cmd_generate(args) -> int:
  """Runs `jaxspec generate`: the text (streamed for one prompt) or JSON lines to stdout, then
  one line of stats to stderr."""
  from jaxspec.sampling import Sampling

  if args.prompts is not None and args.prompt is not None:
    raise SystemExit(f"error: got both a prompt ({args.prompt[:40]!r}) and --prompts"
                     f" {args.prompts}: pass one of them")
  if args.prompts is None and args.prompt is None:
    raise SystemExit("error: no prompt: pass the text (jaxspec generate \"Hello\") or a file of"
                     " prompts (--prompts FILE)")
  prompts = read_prompt_lines(args.prompts) if args.prompts is not None else [args.prompt]
  try:
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                        min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                        presence_penalty=args.presence_penalty,
                        frequency_penalty=args.frequency_penalty,
                        min_new_tokens=args.min_new_tokens, logit_bias=dict(args.logit_bias))
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  from jaxspec import engine
  from jaxspec.cli.status import StatusLine
  with StatusLine() as status, engine.progress(status.phase):
    return _generate(args, prompts, sampling, status)


def peak_memory_bytes() -> int:
  """The process's peak resident memory so far (Linux reports it in KiB, macOS in bytes)."""
  peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return int(peak if sys.platform == "darwin" else peak * 1024)


def _generate(args, prompts, sampling, status) -> int:
  from jaxspec.models.loading import load
  if args.k_max is not None and (args.draft == "none" or args.num_draft_tokens != "auto"):
    raise SystemExit("error: --k-max is the most drafts per step of --num-draft-tokens auto, but"
                     + (" --draft none drafts nothing" if args.draft == "none" else
                        f" --num-draft-tokens is {args.num_draft_tokens}")
                     + ": drop --k-max, or use --num-draft-tokens auto with a drafter")
  t_load = time.perf_counter()
  status.phase("loading the model")
  model = load(args.model, dtype=args.dtype, scan_layers=command_layout(args.scan_layers))
  drafter = _make_drafter(args.draft, model, args.dtype or model.cfg.dtype)
  status.phase(None)
  if args.tree is not None:
    from jaxspec.cli_options import parse_tree
    if drafter is None:
      raise SystemExit("error: --tree needs a drafter: a Medusa or EAGLE head (--draft eagle)")
    if args.num_draft_tokens != "auto":
      raise SystemExit("error: --tree sets how far the drafter drafts: drop --num-draft-tokens")
    if not hasattr(drafter, "with_tree"):
      raise SystemExit(f"error: --tree: the {draft_label(args.draft, drafter)} drafter drafts"
                       " chains only: tree drafting needs a Medusa or EAGLE head (--draft eagle"
                       " or medusa)")
    try:
      drafter = drafter.with_tree(parse_tree(args.tree, drafter))
    except ValueError as e:
      raise SystemExit(f"error: --tree: {e}")
  load_s = time.perf_counter() - t_load
  tok = model.tokenizer
  if tok is None:
    raise SystemExit(f"error: {args.model} has no tokenizer (tokenizer.json or GGUF tokenizer"
                     " metadata): the CLI takes text; use the Python API with token ids")
  from jaxspec.engine.io import encode_text
  try:  # the Python wrappers' rule for strings (`chat=`), so both give the same ids
    ids = [p if not isinstance(p, str) else encode_text(tok, p, args.chat) for p in prompts]
  except ValueError as e:
    raise SystemExit(f"error: --chat: {e}")
  auto = None
  if drafter is not None and args.num_draft_tokens == "auto" and args.k_max is not None:
    from jaxspec.decoding.adaptive import AutoK
    auto = AutoK(k_max=args.k_max)
  from jaxspec.decoding.functional import as_key
  from jaxspec.sampling import row_keys
  try:
    # Prompt i of the file draws with fold_in(key(seed), i) in every batch it lands in, so its
    # text does not depend on --batch-size.
    keys = row_keys(as_key(args.seed), len(ids))
  except ValueError as e:
    raise SystemExit(f"error: --seed: {e}")
  common = dict(max_new_tokens=args.max_new_tokens, sampling=sampling)
  spec_kw = dict(num_draft_tokens=args.num_draft_tokens, auto=auto)
  label = draft_label(args.draft, drafter)
  # Batches in file order; each batch's results are printed as soon as it is done.
  size = 1 if args.prompts is None else args.batch_size
  runs = []
  for start in range(0, len(ids), size):
    try:
      if args.prompts is None:
        rows, info, spec = _stream_one(model, drafter, ids[0], dict(common, key=keys[:1]),
                                       spec_kw, args)
      else:
        rows, info, spec = _run_batch(model, drafter, ids[start:start + size],
                                      dict(common, key=keys[start:start + size]), spec_kw)
    except ValueError as e:
      if args.prompts is None:
        raise SystemExit(f"error: {e}")
      # The library numbers a batch's prompts from 0; the file's are numbered from 1, as the
      # headers printed for them (the batches before this one are printed already).
      msg = re.sub(r"\bprompt (\d+)\b", lambda m: f"prompt {start + int(m.group(1)) + 1}",
                   str(e))
      raise SystemExit(f"error: --prompts {args.prompts}: {msg}")
    runs.append(run_stats(info, spec, sum(len(r) for r, _ in rows), load_s=load_s,
                          peak_bytes=peak_memory_bytes(),
                          model=model.name, drafter=label,
                          num_draft_tokens=args.num_draft_tokens, batch_size=len(rows)))
    for b, (row, text) in enumerate(rows):
      i, prompt = start + b, prompts[start + b]
      if args.json:
        sys.stdout.write(json.dumps(_row_record(prompt, row, text, runs[-1], spec, b)) + "\n")
      elif args.prompts is not None:
        if i:  # a blank line between texts, before the next header reaches a terminal
          sys.stdout.write("\n")
          sys.stdout.flush()
        head = " ".join(prompt.split()) if isinstance(prompt, str) else f"{len(prompt)} token ids"
        print(f"[jaxspec] prompt {i + 1}/{len(prompts)}: {head[:60]}"
              + ("..." if len(head) > 60 else ""), file=sys.stderr, flush=True)
        sys.stdout.write(text + "\n")
      sys.stdout.flush()
  print(stats_line(merge_stats(runs), prompts=len(prompts)), file=sys.stderr, flush=True)
  return 0


def _stream_one(model, drafter, ids: list[int], common: dict, spec_kw: dict, args):
  """One prompt through the streaming API, its text written to stdout as it comes (unless
  --json). Returns ([(new token ids, text)], timings, speculative stats or None)."""
  from jaxspec.api import generate_stream, speculative_stream
  from jaxspec.models.tokenizer import StreamDecoder
  if drafter is None:
    stream = generate_stream(model, [ids], chunk=args.chunk, **common)
  else:
    stream = speculative_stream(model, drafter, [ids], chunk=max(1, args.chunk // 2),
                                **spec_kw, **common)
  dec = StreamDecoder(model.tokenizer)
  row, pieces, info = [], [], {}
  for new, info in stream:
    row += new[0]
    pieces.append(dec.push(new[0]))
    if not args.json:
      sys.stdout.write(pieces[-1])
      sys.stdout.flush()
  pieces.append(dec.flush())
  if not args.json:
    sys.stdout.write(pieces[-1] + "\n")
    sys.stdout.flush()
  return [(row, "".join(pieces))], info, info.get("stats") if drafter is not None else None


def _run_batch(model, drafter, ids: list[list[int]], common: dict, spec_kw: dict):
  """All prompts as one batch (rows are independent). Returns ([(new token ids, text)] in
  prompt order, timings, speculative stats or None)."""
  from jaxspec.api import generate, speculative_generate
  if drafter is None:
    out = generate(model, ids, **common)
  else:
    out = speculative_generate(model, drafter, ids, **spec_kw, **common)
  rows = [out.row(b) for b in range(len(ids))]
  texts = [model.tokenizer.decode(r, skip_special_tokens=True) for r in rows]
  return list(zip(rows, texts)), out.stats, out.stats if drafter is not None else None
