"""Self-distillation data: the target writes the responses, and its hidden states are stored.

Draft models and heads learn to predict what *the target* would say, so the training responses
are the target's own generations for a set of prompts (greedy, and optionally sampled), not the
prompt files' reference answers. `write_dataset` runs the target once: batched `generate` for the
responses, then one `forward` over prompt + response per batch for the hidden states a head
reads. Everything lands in a directory of `.npy` arrays that `Dataset` memory-maps, so training
epochs never rerun the target:

  meta.json            what was stored and how (target fingerprint, layers, files, settings);
                       written last, so a directory without it is an interrupted run
  tokens.npy           [N, T] int32    prompt then response, 0-padded
  loss_mask.npy        [N, T] uint8    1 where tokens[i, t] is a response token (the stop
                                       token included), 0 on the prompt and the padding
  lengths.npy          [N] int32       prompt + response tokens per row
  prompt_lengths.npy   [N] int32
  prompt_index.npy     [N] int32       the prompt a row answers (one row per temperature)
  hidden_final.npy     [N, T, D] float16      the target's final-normed hidden state after
                                              reading tokens[i, :t + 1] (what its LM head reads)
  hidden_layers.npy    [N, T, n, D] float16   outputs of the target decoder layers listed in
                                              meta["hidden_layers"], in that order
  responses.jsonl      prompt and response text per row, for reading (when there is a tokenizer)

Hidden states of padding positions are zero. Axis letters: N rows, T stored width, D the
target's model width, n stored layers, B a batch of rows.

Prompt files are JSON lines; each line is one object holding a prompt in one of the fields
`prompt_ids` (token ids, used as is), `turns` (Spec-Bench: the first turn), `question` (GSM8K),
`instruction` (self-instruct, plus the first instance's input), `prompt` (plain, or HumanEval,
wrapped in a request to complete the function).

Given responses (`write_dataset(..., responses=...)`, `jaxspec train --responses given`): the
rows hold the files' own answers instead of the target's, teacher-forced, as EAGLE trains on
fixed dialogues; the labels are still the target's (heads read the target's hidden states and
distribution at every position), and only the hidden-state forward runs, about five times
faster per token than generation on a CPU. Answers come from `response_ids` (token ids), or the
text fields `response`, `completion`, `answer` (GSM8K: its `<<...>>` calculator notes removed
and the closing `#### N` written as "The answer is N."), `canonical_solution` (HumanEval: the
stub and its body in a Python code block) or `output` / the first instance's `output`
(self-instruct).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import re
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Union

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checks import check_int, is_int
from jaxspec.models.llama import is_scanned
from jaxspec.models.model import Model

FORMAT = "jaxspec-distill-data"
VERSION = 1
# A prompt is a user message (chat-templated before generation) or token ids (used as is).
Prompt = Union[str, list[int]]


class DataError(ValueError):
  """A prompt file or a stored dataset that cannot be used; the message says how to fix it."""


# ----------------------------------------------------------------------------------------------
# Prompt files.


def _line_ids(obj: dict, field: str, where: str) -> list[int]:
  """obj[field] checked to be a non-empty list of token ids."""
  ids = obj[field]
  if (not isinstance(ids, list) or not ids
      or not all(is_int(i, numpy=False) and i >= 0 for i in ids)):
    raise DataError(f"{where}: {field!r} must be a non-empty list of token ids (ints >= 0)")
  return list(ids)


def line_prompt(obj: Any, where: str, *, all_turns: bool = False) -> Prompt | list[str]:
  """The prompt of one parsed JSON line (see the module docstring for the fields).

  With `all_turns`, a `turns` line of several user turns gives them all (a list of strings:
  the target answers each in turn, `jaxspec.train.corpus`); otherwise only the first.
  """
  if not isinstance(obj, dict):
    raise DataError(f"{where}: expected a JSON object, got {type(obj).__name__}")
  if "prompt_ids" in obj:
    return _line_ids(obj, "prompt_ids", where)
  if "turns" in obj:
    turns = obj["turns"]
    if all_turns and isinstance(turns, list) and len(turns) > 1:
      bad = [i for i, t in enumerate(turns) if not isinstance(t, str) or not t.strip()]
      if bad:
        raise DataError(f"{where}: field 'turns[{bad[0]}]' must be a non-empty string")
      return list(turns)
    text = turns[0] if isinstance(turns, list) and turns else None
    field = "turns[0]"
  elif "question" in obj:
    text, field = obj["question"], "question"
  elif "instruction" in obj:
    text, field = obj["instruction"], "instruction"
    inst = obj.get("instances")
    extra = inst[0].get("input") if isinstance(inst, list) and inst and isinstance(
        inst[0], dict) else None
    if isinstance(text, str) and isinstance(extra, str) and extra.strip():
      text = f"{text}\n\n{extra}"
  elif "prompt" in obj:
    text, field = obj["prompt"], "prompt"
    if isinstance(text, str) and "task_id" in obj and "entry_point" in obj:
      # HumanEval: a bare function stub; a chat model is asked to complete it.
      text = f"Complete the following Python function.\n\n```python\n{text}```"
  else:
    raise DataError(f"{where}: no prompt field: each line needs one of 'prompt', 'question',"
                    f" 'instruction', 'turns' or 'prompt_ids' (keys found: {sorted(obj)[:6]})")
  if not isinstance(text, str) or not text.strip():
    raise DataError(f"{where}: field {field!r} must be a non-empty string")
  return text


def _line_answer(obj: dict, where: str) -> Prompt:
  """The given response of one parsed JSON line (see the module docstring for the fields)."""
  if "response_ids" in obj:
    return _line_ids(obj, "response_ids", where)
  inst = obj.get("instances")
  first = inst[0] if isinstance(inst, list) and inst and isinstance(inst[0], dict) else {}
  for field in ("response", "completion", "answer", "canonical_solution", "output"):
    if field in obj:
      text = obj[field]
      break
  else:
    field, text = "instances[0].output", first.get("output")
    if "output" not in first:
      raise DataError(f"{where}: no answer field for given responses: each line needs one of"
                      " 'response', 'completion', 'answer', 'canonical_solution', 'output',"
                      " 'instances[0].output' or 'response_ids', or let the target write the"
                      " responses (--responses target)")
  if not isinstance(text, str) or not text.strip():
    raise DataError(f"{where}: field {field!r} must be a non-empty string")
  if field == "answer":  # GSM8K: drop the calculator notes, spell out the final answer
    text = re.sub(r"<<[^>]*>>", "", text).strip()
    text = re.sub(r"\n?#### *(.+)$", lambda m: f"\nThe answer is {m.group(1).strip()}.", text)
  elif field == "canonical_solution" and isinstance(obj.get("prompt"), str):
    text = f"```python\n{obj['prompt']}{text.rstrip()}\n```"
  return text


def is_eval_file(path: str | os.PathLike) -> bool:
  """Whether `path` is one of the evaluation prompt sets (Spec-Bench), never to be trained on."""
  return "spec_bench" in Path(path).name.lower()


def json_lines(path: Path, expected: str, error: type[Exception] | None = None):
  """(where, parsed object) for every non-blank line of a JSON-lines file, where = "path:line".

  Raises:
    `error` (default DataError): a line is not UTF-8 or not valid JSON (nested too deeply to
    parse included); the message names it (and ends with `expected` for JSON).
  """
  error = DataError if error is None else error
  with open(path, "rb") as f:  # line by line, so that a decoding error names its line
    for lineno, raw in enumerate(f, 1):
      where = f"{path}:{lineno}"
      try:
        line = raw.decode("utf-8")
      except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line): save"
                    " the file as UTF-8") from None
      if not line.strip():
        continue
      try:
        obj = json.loads(line)
      except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e.msg} at column {e.colno}): {expected}")\
            from None
      except RecursionError:
        raise error(f"{where}: not valid JSON (nested too deeply to parse): {expected}")\
            from None
      yield where, obj


def read_prompt_file(path: str | os.PathLike, *, answers: bool = False,
                     all_turns: bool = False) -> list:
  """All prompts of one JSON-lines file, in file order (blank lines are skipped).

  Args:
    answers: return (prompt, given response) pairs (see the module docstring for the fields).
    all_turns: every user turn of a multi-turn line (`line_prompt`).
  Raises:
    DataError: the file is missing, holds no prompts, or a line is not a JSON object with a
      prompt field (or, with `answers`, an answer field); the message names the file and line.
  """
  path = Path(path)
  if not path.is_file():
    what = "is a directory" if path.is_dir() else "does not exist"
    raise DataError(f"prompt file {path} {what}: pass JSON-lines files (training prompts are in"
                    " ../shared/data/: gsm8k_train.jsonl, humaneval.jsonl,"
                    " self_instruct_seed_tasks.jsonl)")
  prompts = [(line_prompt(obj, where), _line_answer(obj, where)) if answers
             else line_prompt(obj, where, all_turns=all_turns)
             for where, obj in json_lines(path, "every line must be one JSON object")]
  if not prompts:
    raise DataError(f"prompt file {path} is empty: it needs one JSON object per line")
  return prompts


def read_prompts(paths: Sequence[str | os.PathLike], *, max_prompts: int | None = None,
                 seed: int = 0, allow_eval: bool = False, answers: bool = False,
                 with_files: bool = False, all_turns: bool = False) -> tuple:
  """Prompts of several files, interleaved so that `max_prompts` draws evenly from each.

  Each file's prompts are shuffled (deterministically from `seed`) and the files are taken
  round-robin, so a cap keeps the mix of tasks; a file that runs out leaves its share to the
  others.

  Args:
    paths: JSON-lines prompt files.
    max_prompts: keep at most this many (None: all).
    seed: shuffling seed.
    allow_eval: allow evaluation prompt sets (Spec-Bench); training on them makes every
      benchmark number on them meaningless.
    answers: return (prompt, given response) pairs (`read_prompt_file`).
    with_files: also return, for each prompt, the index of its file in `paths`.
    all_turns: every user turn of multi-turn lines (`line_prompt`).
  Returns:
    (prompts, {file: prompts taken from it}), and with `with_files` the file indices.
  """
  if not paths:
    raise DataError("no prompt files given: pass --prompts FILE... (e.g."
                    " ../shared/data/gsm8k_train.jsonl)")
  if max_prompts is not None and max_prompts < 1:
    raise DataError(f"max_prompts must be >= 1, got {max_prompts}")
  per_file = []
  for i, p in enumerate(paths):
    if is_eval_file(p):
      if not allow_eval:
        raise DataError(f"{p} is an evaluation prompt set: training on it would contaminate"
                        " every benchmark on it. Use the training files (gsm8k_train,"
                        " humaneval, self_instruct_seed_tasks), or force it with"
                        " --allow-eval-prompts")
      warnings.warn(f"TRAINING ON THE EVALUATION SET {p}: benchmark results on it are no longer"
                    " a fair measure", stacklevel=2)
    prompts = read_prompt_file(p, answers=answers, all_turns=all_turns)
    order = np.random.default_rng([seed, i]).permutation(len(prompts))
    per_file.append((str(p), [prompts[j] for j in order]))
  out: list[Prompt] = []
  files: list[int] = []
  counts = {name: 0 for name, _ in per_file}
  limit = sum(len(ps) for _, ps in per_file) if max_prompts is None else max_prompts
  pos = 0
  while len(out) < limit and any(pos < len(ps) for _, ps in per_file):
    for f, (name, ps) in enumerate(per_file):
      if pos < len(ps) and len(out) < limit:
        out.append(ps[pos])
        files.append(f)
        counts[name] += 1
    pos += 1
  return (out, counts, files) if with_files else (out, counts)


def encode_prompts(target: Model, prompts: Sequence[Prompt], *, chat: bool = True,
                   ) -> list[list[int]]:
  """Token ids of every prompt: strings through the target's chat template (or plain encoding
  with chat=False), token-id lists as they are."""
  out = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if target.tokenizer is None:
        raise DataError(f"prompt {i} is text but the target {target.name!r} has no tokenizer:"
                        " load it with its tokenizer, or give prompts as 'prompt_ids'")
      p = target.tokenizer.encode_chat(p) if chat else target.tokenizer.encode(p)
    out.append(_in_vocab(p, f"prompt {i}", target))
  return out


def _in_vocab(ids, what: str, target: Model) -> list[int]:
  """ids as a list of ints, checked to lie inside the target's vocabulary."""
  ids = [int(t) for t in ids]
  bad = [t for t in ids if not 0 <= t < target.cfg.vocab_size]
  if bad:
    raise DataError(f"{what} has token id {bad[0]} outside the target's vocabulary"
                    f" [0, {target.cfg.vocab_size})")
  return ids


# ----------------------------------------------------------------------------------------------
# Instructions the target writes itself (Magpie).

_SENTINEL = "\x00jaxspec-user-message\x00"
# The name meta.json's prompt_files gives the target-written instructions.
SELF_INSTRUCTIONS = "<instructions written by the target (Magpie)>"


def user_turn_prefix(tokenizer) -> tuple[list[int], int]:
  """(ids of the chat template up to where a user message starts, the end-of-turn token id).

  The template is rendered around a sentinel user message: what precedes the sentinel is the
  prefix (system prompt and user header included), and the first token of what follows it ends
  a user turn (SmolLM2: `<|im_end|>`).
  """
  if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
    raise DataError("target-written instructions need the target's chat template: load a"
                    " checkpoint whose tokenizer has one, or pass --prompts files instead")
  text = tokenizer.apply_chat_template([{"role": "user", "content": _SENTINEL}],
                                       add_generation_prompt=False)
  if text.count(_SENTINEL) != 1:
    raise DataError("the target's chat template does not place a user message verbatim, so"
                    " the user-turn prefix cannot be found: pass --prompts files instead")
  head, tail = text.split(_SENTINEL)
  end = tokenizer.encode(tail, add_bos=False)
  if not end:
    raise DataError("the target's chat template ends a user turn with nothing, so a"
                    " target-written instruction would never stop: pass --prompts files instead")
  return tokenizer.encode(head, add_bos=False), int(end[0])


def target_instructions(target: Model, n: int, *, seed: int = 0, temperature: float = 1.0,
                        top_p: float = 0.95, max_tokens: int = 48, min_tokens: int = 4,
                        batch_size: int = 32, max_batches: int | None = None,
                        progress=None) -> list[str]:
  """`n` user instructions written by the target itself (Magpie, Xu et al. 2024).

  The target samples a user turn after the bare user-turn prefix of its chat template. A row is
  kept when it ends the turn within `max_tokens` tokens, has at least `min_tokens` and is not a
  repeat; the rest (run-on text) is dropped. Responses to these instructions are then the target's
  own answers to the requests it finds likely, which resemble a chat benchmark's writing, advice
  and knowledge questions more than task datasets do.

  Args:
    target: the model (with a tokenizer and chat template).
    n: instructions wanted.
    seed: sampling seed (batch b uses fold_in(key(seed), b)).
    temperature, top_p: sampling of the instructions.
    max_tokens: longest instruction kept (tokens).
    min_tokens: shortest kept.
    batch_size: rows per `generate` call.
    max_batches: give up after this many calls (default 4 n / batch_size + 4).
    progress: a `make_progress` bar (optional).
  Returns:
    The instruction texts, at most n (fewer, with a warning, when max_batches runs out).
  """
  from jaxspec.api import generate
  from jaxspec.sampling import Sampling

  if n < 1:
    raise DataError(f"target-written instructions: n must be >= 1, got {n}")
  if not 1 <= min_tokens <= max_tokens:
    raise DataError(f"need 1 <= min_tokens ({min_tokens}) <= max_tokens ({max_tokens})")
  prefix, end = user_turn_prefix(target.tokenizer)
  limit = max_batches if max_batches is not None else 4 * n // batch_size + 4
  stops = sorted({end, *target.cfg.eos_token_ids})
  out: list[str] = []
  seen: set[str] = set()
  task = None if progress is None else progress.add_task(
      "target writes instructions", total=n, info="")
  tried = 0
  for b in range(limit):
    if len(out) >= n:
      break
    res = generate(target, [prefix] * batch_size, max_new_tokens=max_tokens + 1,
                   sampling=Sampling(temperature=temperature, top_p=top_p),
                   key=jax.random.fold_in(jax.random.key(seed), b), stop_ids=stops)
    tried += batch_size
    for j in range(batch_size):
      row = res.row(j)
      if not row or row[-1] != end or not min_tokens <= len(row) - 1 <= max_tokens:
        continue
      text = target.tokenizer.decode(row[:-1]).strip()
      if text and text not in seen and len(out) < n:
        seen.add(text)
        out.append(text)
    if task is not None:
      progress.update(task, completed=len(out), info=f"{len(out)} of {tried} kept")
  if len(out) < n:
    warnings.warn(f"the target wrote {len(out)} usable instructions of the {n} asked in {tried}"
                  f" tries (a row must end its turn within {max_tokens} tokens)", stacklevel=2)
  return out


# ----------------------------------------------------------------------------------------------
# Writing a dataset.


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
  """How `write_dataset` has the target write its responses and what it stores.

  Attributes:
    max_prompt_len: prompts longer than this many tokens (after the chat template) are skipped.
    max_new_tokens: response tokens per prompt (a row stops earlier at a stop token).
    temperatures: one response per prompt per entry; 0 is greedy. (0.0, 0.7) stores a greedy
      and a sampled response for every prompt.
    batch_size: rows per `generate` call (prompts are sorted by length into batches).
    hidden_batch_size: rows per hidden-state forward.
    store_hidden: store `hidden_final` (heads and draft-model KL need it).
    hidden_layers: target decoder layers whose outputs to store as `hidden_layers`.
    chat: apply the target's chat template to text prompts.
    seed: sampling seed.
  """

  max_prompt_len: int = 256
  max_new_tokens: int = 128
  temperatures: tuple[float, ...] = (0.0,)
  batch_size: int = 16
  hidden_batch_size: int = 8
  store_hidden: bool = True
  hidden_layers: tuple[int, ...] = ()
  chat: bool = True
  seed: int = 0

  def __post_init__(self):
    for name in ("max_prompt_len", "max_new_tokens", "batch_size", "hidden_batch_size"):
      check_int(f"DataConfig.{name}", getattr(self, name), 1, numpy=False, error=DataError)
    if not self.temperatures or any(t < 0 for t in self.temperatures):
      raise DataError(f"temperatures {self.temperatures} must be a non-empty tuple of values"
                      " >= 0 (0 = greedy)")


def _wq_corner(p) -> jax.Array:
  """wq[:, :2, :1, :4] of every layer, in either layer layout (no stacked copy of the rest)."""
  if is_scanned(p):
    return p.layers.wq[:, :2, :1, :4]
  return jnp.stack([lp.wq[:2, :1, :4] for lp in p.layers])


def target_fingerprint(target: Model) -> str:
  """The target's fingerprint (`jaxspec.heads.io.target_fingerprint`, the one rule for heads and
  data): data written by one target must not train a head for another."""
  from jaxspec.heads.io import target_fingerprint as fingerprint
  return fingerprint(target)


# The config fields the old rule hashed: frozen, so a field LlamaConfig gains later (its
# `attention_kernel` came hours after the unification) does not orphan what the rule stamped.
_V1_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
              "tie_embeddings", "attention_bias", "sliding_window", "max_position_embeddings",
              "bos_token_id", "eos_token_ids", "dtype", "compute_dtype", "architecture",
              "hidden_act", "qk_norm", "post_norms", "norm_offset", "embed_scale",
              "attn_softcap", "final_softcap", "query_pre_attn_scalar", "layer_types",
              "sliding_rope_theta", "partial_rotary_factor")


def _fingerprint_v1(target: Model) -> str:
  """The rule datasets and corpora were stamped with before the fingerprint was unified (the
  config of that day, dtype included, and float32 weights): still accepted, so they stay
  usable."""
  cfg = dataclasses.asdict(target.cfg)
  h = hashlib.sha256(json.dumps({k: cfg[k] for k in _V1_FIELDS if k in cfg}, sort_keys=True,
                                default=str).encode())
  p = target.params
  for a in (p.final_norm, p.embed[:4, :16], _wq_corner(p)):
    h.update(np.ascontiguousarray(np.asarray(a, np.float32)).tobytes())
  return h.hexdigest()[:16]


def fingerprint_matches(stamp: str, target: Model) -> bool:
  """Whether data stamped `stamp` was written by `target` (today's rule or the old one)."""
  return stamp == target_fingerprint(target) or stamp == _fingerprint_v1(target)


def check_time_limit(name: str, value: Any, *, numpy: bool = True,
                     error: type[Exception] = ValueError) -> None:
  """Raises `error` unless `value` is None (no limit) or a finite number of seconds > 0 (a
  Python int or float, and with `numpy` a numpy scalar; never a bool): a time-boxed run's
  limit (`write_corpus(time_limit=)`, `TrainConfig.time_limit`)."""
  kinds = (int, float, np.integer, np.floating) if numpy else (int, float)
  if value is None or (isinstance(value, kinds) and not isinstance(value, bool)
                       and 0 < value < float("inf")):
    return
  raise error(f"{name} is seconds > 0 (or None: no limit), got {value!r}")


def make_progress(enabled: bool | str = True, every: float = 30.0):
  """Progress on stderr: a rich bar on a terminal; without one (a log file, CI) or with
  `enabled="lines"`, a plain line at most every `every` seconds and at the end of each task;
  nothing with `enabled=False`."""
  if not enabled:
    return _NoProgress()
  if enabled == "lines" or not sys.stderr.isatty():
    return _LineProgress(every)
  from rich.console import Console
  from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                             TimeElapsedColumn, TimeRemainingColumn)
  return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TextColumn("eta"), TimeRemainingColumn(),
                  TextColumn("{task.fields[info]}"), console=Console(stderr=True))


class _LineProgress(contextlib.AbstractContextManager):
  """`make_progress`'s plain form: `[jaxspec] training: 120 / 600 (20%), 41 s, eta 2m44s, loss
  2.1` lines, the rate counted from this process's start of each task (a resumed task's earlier
  part does not count)."""

  def __init__(self, every: float):
    self.every, self.tasks = every, []

  def __exit__(self, *exc):
    return None

  def add_task(self, description, total=None, completed=0, info="", **_):
    now = time.perf_counter()
    self.tasks.append(dict(description=description, total=total, completed=completed,
                           start_done=completed, info=info, t0=now, shown=now))
    return len(self.tasks) - 1

  def advance(self, task, advance=1):
    self.update(task, advance=advance)

  def update(self, task, completed=None, advance=None, info=None, **_):
    t = self.tasks[task]
    if completed is not None:
      t["completed"] = completed
    if advance is not None:
      t["completed"] += advance
    if info is not None:
      t["info"] = info
    now = time.perf_counter()
    finished = t["total"] is not None and t["completed"] >= t["total"]
    if now - t["shown"] < self.every and not finished:
      return
    t["shown"] = now
    dt, done = now - t["t0"], t["completed"] - t["start_done"]
    line = f"[jaxspec] {t['description']}: {t['completed']}"
    if t["total"]:
      line += f" / {t['total']} ({100 * t['completed'] / t['total']:.0f}%)"
    line += f", {dt:.0f} s"
    if t["total"] and done > 0 and not finished:
      left = (t["total"] - t["completed"]) * dt / done
      line += f", eta {int(left // 60)}m{int(left % 60):02d}s"
    if t["info"]:
      line += f", {t['info']}"
    print(line, file=sys.stderr, flush=True)


class _NoProgress(contextlib.AbstractContextManager):
  def __exit__(self, *exc):
    return None

  def add_task(self, *args, **kwargs):
    return 0

  def update(self, *args, **kwargs):
    pass

  def advance(self, *args, **kwargs):
    pass


def _round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def _generate_responses(target: Model, prompt_ids: list[list[int]], cfg: DataConfig,
                        progress) -> tuple[list[tuple[int, int, list[int]]], dict[str, Any]]:
  """(prompt index, temperature index, response ids) for every prompt and temperature."""
  from jaxspec.api import generate
  from jaxspec.sampling import Sampling

  order = sorted(range(len(prompt_ids)), key=lambda i: (len(prompt_ids[i]), i))
  batches = [order[s:s + cfg.batch_size] for s in range(0, len(order), cfg.batch_size)]
  # One cache size for every batch: prompt-length buckets are then the only recompilations.
  max_len = _round_up(cfg.max_prompt_len + cfg.max_new_tokens, 128)
  out, tokens, t0 = [], 0, time.perf_counter()
  task = progress.add_task("target writes responses", total=len(batches) * len(cfg.temperatures),
                           info="")
  for ti, temp in enumerate(cfg.temperatures):
    for bi, rows in enumerate(batches):
      # The last batch is padded with copies of its first row: one batch shape for all.
      padded = rows + [rows[0]] * (cfg.batch_size - len(rows))
      key = jax.random.fold_in(jax.random.key(cfg.seed), ti * 1_000_003 + bi)
      res = generate(target, [prompt_ids[i] for i in padded], max_new_tokens=cfg.max_new_tokens,
                     sampling=Sampling(temperature=float(temp)), key=key, max_len=max_len)
      for j, i in enumerate(rows):
        out.append((i, ti, res.row(j)))
        tokens += int(res.lengths[j])
      dt = time.perf_counter() - t0
      progress.update(task, advance=1, info=f"{tokens / max(dt, 1e-9):.0f} tok/s")
  return out, dict(response_tokens=tokens, generate_seconds=time.perf_counter() - t0)


def _hidden_fn(cfg, layers: tuple[int, ...]):
  from jaxspec.models.llama import forward, init_cache

  @jax.jit
  def run(params, tokens, lengths):
    b, t = tokens.shape
    cache = init_cache(cfg, b, t)
    _, hidden, _ = forward(params, tokens, cache, cfg, hidden_layers=layers, logits=False,
                           fresh=True)
    valid = (jnp.arange(t)[None, :] < lengths[:, None])[..., None]  # [B, T, 1]
    final = jnp.where(valid, hidden.final, 0).astype(jnp.float16)  # [B, T, D]
    per_layer = None
    if layers:
      per_layer = jnp.where(valid[:, :, None], jnp.transpose(hidden.layers, (1, 2, 0, 3)),
                            0).astype(jnp.float16)  # [B, T, n, D]
    return final, per_layer

  return run


def store_hidden_states(target: Model, out: Path, tokens: np.ndarray, lengths: np.ndarray,
                        cfg: DataConfig, progress) -> float:
  """Writes hidden_final.npy (and hidden_layers.npy of cfg.hidden_layers) into `out` with one
  forward per cfg.hidden_batch_size rows of tokens [N, T] (lengths [N]); returns the seconds.
  `progress` is a `make_progress` bar."""
  n, t = tokens.shape
  d = target.cfg.hidden_size
  layers = tuple(cfg.hidden_layers)
  final_mm = np.lib.format.open_memmap(out / "hidden_final.npy", "w+", np.float16, (n, t, d))
  layers_mm = None
  if layers:
    layers_mm = np.lib.format.open_memmap(out / "hidden_layers.npy", "w+", np.float16,
                                          (n, t, len(layers), d))
  run = _hidden_fn(target.cfg, layers)
  order = np.argsort(lengths, kind="stable")
  bs = cfg.hidden_batch_size
  t0, done_tokens = time.perf_counter(), 0
  task = progress.add_task("target hidden states", total=-(-n // bs), info="")
  for s in range(0, n, bs):
    rows = order[s:s + bs]
    # Widths in buckets of 64 (one compilation each); the batch is padded to full size.
    width = min(_round_up(int(lengths[rows].max()), 64), _round_up(t, 64))
    idx = np.concatenate([rows, np.full(bs - len(rows), rows[0])])
    toks = np.zeros((bs, width), np.int32)
    keep = min(width, t)
    toks[:, :keep] = tokens[idx, :keep]
    final, per_layer = run(target.params, jnp.asarray(toks), jnp.asarray(lengths[idx]))
    final = np.asarray(final)[: len(rows)]
    for j, r in enumerate(rows):
      final_mm[r, :keep] = final[j, :keep]
      final_mm[r, keep:] = 0
      if layers_mm is not None:
        layers_mm[r, :keep] = np.asarray(per_layer[j, :keep])
        layers_mm[r, keep:] = 0
    done_tokens += int(lengths[rows].sum())
    progress.update(task, advance=1,
                    info=f"{done_tokens / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
  final_mm.flush()
  if layers_mm is not None:
    layers_mm.flush()
  del final_mm, layers_mm
  return time.perf_counter() - t0


def _given_responses(target: Model, responses: Sequence[Prompt], keep: list[int],
                     cfg: DataConfig) -> list[tuple[int, int, list[int]]]:
  """(prompt index, 0, response ids) of the given responses: text encoded and closed by the
  token that ends an assistant turn (what the target's own rows end with), cut at
  cfg.max_new_tokens; token-id responses are used as they are (cut the same way)."""
  end = None
  if any(isinstance(r, str) for r in responses):
    if target.tokenizer is None:
      raise DataError(f"given responses are text but the target {target.name!r} has no"
                      " tokenizer: load it with its tokenizer, or give 'response_ids'")
    if cfg.chat and getattr(target.tokenizer, "chat_template", None) is not None:
      end = user_turn_prefix(target.tokenizer)[1]  # the end of a turn (SmolLM2: <|im_end|>)
    else:
      stops = tuple(target.cfg.eos_token_ids) or tuple(target.tokenizer.eos_token_ids)
      end = stops[0] if stops else None
  out = []
  for j, i in enumerate(keep):
    r = responses[i]
    if isinstance(r, str):
      r = target.tokenizer.encode(r, add_bos=False) + ([end] if end is not None else [])
    ids = _in_vocab(r, f"given response {i}", target)
    if not ids:
      raise DataError(f"given response {i} is empty: give at least one token")
    out.append((j, 0, ids[:cfg.max_new_tokens]))
  return out


def write_dataset(target: Model, prompts: Sequence[Prompt], out_dir: str | os.PathLike,
                  cfg: DataConfig = DataConfig(), *, responses: Sequence[Prompt] | None = None,
                  prompt_files: dict[str, int] | None = None,
                  seconds: dict[str, float] | None = None, progress: bool = True) -> Path:
  """Has the target answer `prompts` and stores tokens, loss masks and hidden states.

  Args:
    target: the model whose behaviour is distilled.
    prompts: user messages (chat-templated when cfg.chat) or token-id lists.
    out_dir: directory to create (must not already hold a dataset).
    cfg: generation and storage settings.
    responses: given responses, one per prompt (text or token ids): stored instead of the
      target's own (one row per prompt, cfg.temperatures unused), teacher-forced; the target
      only computes the hidden states over them (see the module docstring).
    prompt_files: {file: prompts taken from it}, recorded in meta.json.
    seconds: {stage: seconds} the caller spent making the prompts (e.g. the target writing
      instructions), recorded in meta.json beside the generate and hidden-state times.
    progress: show rich progress bars on stderr.
  Returns:
    out_dir as a Path. Open it with `Dataset(out_dir)`.
  Raises:
    DataError: bad settings or prompts, raised before the target runs.
  """
  out = Path(out_dir)
  if responses is not None and len(responses) != len(prompts):
    raise DataError(f"{len(responses)} given responses for {len(prompts)} prompts: give one"
                    " response per prompt")
  if (out / "meta.json").exists():
    raise DataError(f"{out} already holds a dataset: reuse it (--data-dir {out}) or choose"
                    " another directory")
  nl = target.cfg.num_layers
  # Each layer is stored once (EAGLE-3's defaults repeat layers on shallow targets); batches
  # select and repeat them (`Dataset(layers=...)`).
  cfg = dataclasses.replace(cfg, hidden_layers=tuple(dict.fromkeys(cfg.hidden_layers)))
  bad = [i for i in cfg.hidden_layers if not 0 <= i < nl]
  if bad:
    raise DataError(f"hidden layer {bad[0]} does not exist: the target has {nl} layers"
                    f" (0..{nl - 1})")
  if cfg.hidden_layers and not cfg.store_hidden:
    raise DataError("hidden_layers need store_hidden=True")
  all_ids = encode_prompts(target, prompts, chat=cfg.chat)
  keep = [i for i, p in enumerate(all_ids) if len(p) <= cfg.max_prompt_len]
  skipped = len(all_ids) - len(keep)
  if not keep:
    raise DataError(f"all {len(all_ids)} prompts are longer than max_prompt_len"
                    f" {cfg.max_prompt_len} tokens: raise --max-prompt-len")
  if skipped:
    warnings.warn(f"skipped {skipped} of {len(all_ids)} prompts longer than"
                  f" {cfg.max_prompt_len} tokens", stacklevel=2)
  prompt_ids = [all_ids[i] for i in keep]
  given = None if responses is None else _given_responses(target, responses, keep, cfg)
  out.mkdir(parents=True, exist_ok=True)
  for stale in ("meta.json", "hidden_final.npy", "hidden_layers.npy"):
    (out / stale).unlink(missing_ok=True)

  with make_progress(progress) as bar:
    if given is None:
      rows, gen_stats = _generate_responses(target, prompt_ids, cfg, bar)
    else:
      rows = given
      gen_stats = dict(response_tokens=sum(len(r) for _, _, r in given), generate_seconds=0.0)
    rows.sort(key=lambda r: (r[0], r[1]))
    n = len(rows)
    lengths = np.array([len(prompt_ids[p]) + len(r) for p, _, r in rows], np.int32)
    prompt_lengths = np.array([len(prompt_ids[p]) for p, _, _ in rows], np.int32)
    width = int(lengths.max())
    tokens = np.zeros((n, width), np.int32)
    mask = np.zeros((n, width), np.uint8)
    for row, (p, _, r) in enumerate(rows):
      pl = len(prompt_ids[p])
      tokens[row, :pl] = prompt_ids[p]
      tokens[row, pl:pl + len(r)] = r
      mask[row, pl:pl + len(r)] = 1
    np.save(out / "tokens.npy", tokens)
    np.save(out / "loss_mask.npy", mask)
    np.save(out / "lengths.npy", lengths)
    np.save(out / "prompt_lengths.npy", prompt_lengths)
    np.save(out / "prompt_index.npy", np.array([p for p, _, _ in rows], np.int32))
    hidden_s = 0.0
    if cfg.store_hidden:
      hidden_s = store_hidden_states(target, out, tokens, lengths, cfg, bar)

  stops = set(target.cfg.eos_token_ids) | set(getattr(target.tokenizer, "eos_token_ids", ()) or ())
  stopped = sum(1 for _, _, r in rows if r and r[-1] in stops)
  if target.tokenizer is not None:
    with open(out / "responses.jsonl", "w", encoding="utf-8") as f:
      for row, (p, ti, r) in enumerate(rows):
        f.write(json.dumps({"row": row,
                            "temperature": None if given else cfg.temperatures[ti],
                            "prompt": target.tokenizer.decode(prompt_ids[p],
                                                              skip_special_tokens=False),
                            "response": target.tokenizer.decode(r)}, ensure_ascii=False) + "\n")
  meta = {
      "format": FORMAT, "version": VERSION,
      "target": {"name": target.name, "fingerprint": target_fingerprint(target),
                 "config": dataclasses.asdict(target.cfg)},
      "num_examples": n, "num_prompts": len(prompt_ids), "skipped_long_prompts": skipped,
      "seq_len": width, "hidden_size": target.cfg.hidden_size,
      "hidden_final": cfg.store_hidden, "hidden_layers": list(cfg.hidden_layers),
      "hidden_dtype": "float16", "prompt_files": dict(prompt_files or {}),
      # "target": the target wrote the responses; "given": the prompt files' own, teacher-forced.
      "responses": "target" if given is None else "given",
      "generation": {"max_prompt_len": cfg.max_prompt_len, "max_new_tokens": cfg.max_new_tokens,
                     "temperatures": list(cfg.temperatures) if given is None else None,
                     "batch_size": cfg.batch_size, "chat": cfg.chat, "seed": cfg.seed},
      "response_tokens": int(gen_stats["response_tokens"]), "stopped_rows": stopped,
      "seconds": {**{k: round(v, 2) for k, v in (seconds or {}).items()},
                  "generate": round(gen_stats["generate_seconds"], 2),
                  "hidden": round(hidden_s, 2)},
      "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
  }
  tmp = out / "meta.json.tmp"
  tmp.write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
  os.replace(tmp, out / "meta.json")  # last, and atomic: its presence marks a complete dataset
  return out


# ----------------------------------------------------------------------------------------------
# Reading a dataset.


class Dataset:
  """A stored self-distillation dataset, memory-mapped, with a train / held-out split.

  The split is by prompt (rows answering the same prompt at several temperatures stay on one
  side), fixed by `split_seed`. Training batches are a pure function of (seed, step): epoch e
  visits the training rows in the order `np.random.default_rng([seed, e]).permutation`, so a
  run resumed at step s sees exactly the batches an uninterrupted run would.

  Batches are dicts of numpy arrays:
    tokens [B, T] int32, loss_mask [B, T] float32, hidden_final [B, T, D] float32 (when stored),
    hidden_layers [B, T, n, D] float32 (when layers are stored).
  """

  def __init__(self, path: str | os.PathLike, *, layers: Sequence[int] | None = None,
               eval_fraction: float = 0.05, max_eval_prompts: int = 64, split_seed: int = 0,
               window: int | None = None):
    """Opens the dataset at `path`.

    Args:
      layers: the target layers batches hold in `hidden_layers`, in this order (repeats
        allowed); None: every stored layer, in stored order.
      eval_fraction: fraction of the prompts held out for evaluation (at least one prompt when
        positive and there are several; at most `max_eval_prompts`).
      split_seed: seed of the train / held-out split.
      window: when set, every batch row is cropped to this many tokens, a window placed over
        the row's response (at a position drawn from (seed, step)): the LM head of a draft
        head then runs on window positions instead of the padded row, the main cost of
        training on a CPU. Heads attend only inside the window.
    """
    if window is not None:
      check_int("window", window, 4, why="tokens per cropped row", numpy=False, error=DataError)
    self.window = window
    self.path = Path(path)
    meta_file = self.path / "meta.json"
    if not meta_file.is_file():
      what = ("is an unfinished dataset (its writing was interrupted): delete it and write it"
              " again" if (self.path / "tokens.npy").exists() else
              "holds no dataset (no meta.json): write one with `jaxspec train ... --out` or"
              " `write_dataset`")
      raise DataError(f"{self.path} {what}")
    try:
      self.meta = json.loads(meta_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
      raise DataError(f"{meta_file} is not valid JSON ({e}): write the dataset again") from None
    if self.meta.get("format") != FORMAT or self.meta.get("version") != VERSION:
      raise DataError(f"{self.path} is not a {FORMAT} v{VERSION} dataset: write it again")

    def load(name, required=True):
      f = self.path / name
      if not f.is_file():
        if required:
          raise DataError(f"{self.path} lacks {name}: the dataset is incomplete; write it again")
        return None
      return np.load(f, mmap_mode="r")

    self.tokens = load("tokens.npy")  # [N, T]
    self.loss_mask = load("loss_mask.npy")  # [N, T]
    self.lengths = np.asarray(load("lengths.npy"))  # [N]
    self.prompt_lengths = np.asarray(load("prompt_lengths.npy"))  # [N]
    self.prompt_index = np.asarray(load("prompt_index.npy"))  # [N]
    self.hidden_final = load("hidden_final.npy", self.meta["hidden_final"])  # [N, T, D]
    self.hidden_layers_arr = load("hidden_layers.npy", bool(self.meta["hidden_layers"]))
    n = self.tokens.shape[0]
    if n != self.meta["num_examples"] or self.loss_mask.shape != self.tokens.shape:
      raise DataError(f"{self.path}: array shapes disagree with meta.json: write it again")
    if not 0 <= eval_fraction < 1:
      raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    prompts = np.unique(self.prompt_index)
    n_eval = min(int(round(eval_fraction * len(prompts))), max_eval_prompts)
    if eval_fraction > 0 and len(prompts) > 1:
      n_eval = max(n_eval, 1)
    n_eval = min(n_eval, len(prompts) - 1)
    held = np.random.default_rng(split_seed).permutation(prompts)[:n_eval]
    is_eval = np.isin(self.prompt_index, held)
    self.train_indices = np.flatnonzero(~is_eval)
    self.eval_indices = np.flatnonzero(is_eval)
    self.layers = None
    if layers is not None:
      self._check_layers(layers)
      self.layers = tuple(int(i) for i in layers)

  # -- properties -------------------------------------------------------------------------------

  def __len__(self) -> int:
    return int(self.tokens.shape[0])

  @property
  def seq_len(self) -> int:
    return int(self.tokens.shape[1])

  @property
  def hidden_layers(self) -> tuple[int, ...]:
    """Target layers stored in `hidden_layers`, in order."""
    return tuple(self.meta["hidden_layers"])

  @property
  def max_new_tokens(self) -> int:
    return int(self.meta["generation"]["max_new_tokens"])

  def check_target(self, target: Model, layers: Sequence[int] = (), hidden: bool = True) -> None:
    """Raises DataError unless this data was written by `target` and stores what is needed.

    Args:
      layers: target layers whose outputs must be stored.
      hidden: whether hidden_final must be stored.
    """
    want = target_fingerprint(target)
    got = self.meta["target"]["fingerprint"]
    if not fingerprint_matches(got, target):  # today's rule, or the one before unification
      raise DataError(f"{self.path} was written by target {self.meta['target']['name']!r}"
                      f" (fingerprint {got}), not by {target.name!r} ({want}): write new data"
                      " for this target (drop --data-dir)")
    if hidden and not self.meta["hidden_final"]:
      raise DataError(f"{self.path} stores no hidden states: write it again with hidden states")
    self._check_layers(layers)

  def _check_layers(self, layers: Sequence[int]) -> None:
    missing = [i for i in layers if i not in self.hidden_layers]
    if missing:
      raise DataError(f"{self.path} stores target layers {list(self.hidden_layers)} but layers"
                      f" {missing} are needed: write new data with those layers (drop"
                      " --data-dir)")

  # -- batches ----------------------------------------------------------------------------------

  def gather(self, idx: np.ndarray, layers: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """The batch of rows `idx` (see the class docstring); `layers` (default the dataset's
    `layers`) selects and orders the stored layers."""
    layers = self.layers if layers is None else layers
    idx = np.asarray(idx, np.int64)
    # Memory-mapped fancy indexing reads rows in the order given; sorted reads are sequential.
    order = np.argsort(idx, kind="stable")
    inv = np.argsort(order, kind="stable")
    sidx = idx[order]
    batch = {"tokens": np.asarray(self.tokens[sidx], np.int32)[inv],
             "loss_mask": np.asarray(self.loss_mask[sidx], np.float32)[inv]}
    if self.hidden_final is not None:
      batch["hidden_final"] = np.asarray(self.hidden_final[sidx], np.float32)[inv]
    if self.hidden_layers_arr is not None and (layers is None or len(layers)):
      arr = np.asarray(self.hidden_layers_arr[sidx])[inv]
      if layers is not None:
        arr = arr[:, :, [self.hidden_layers.index(i) for i in layers]]
      batch["hidden_layers"] = arr.astype(np.float32)
    return batch

  def signature(self) -> dict[str, Any]:
    """What decides the batches beside the seed (`TrainData`): a resume checks it."""
    return dict(kind="Dataset", rows=len(self), train_rows=len(self.train_indices),
                eval_rows=len(self.eval_indices), seq_len=self.seq_len, window=self.window,
                layers=None if self.layers is None else list(self.layers))

  def steps_per_epoch(self, batch_size: int) -> int:
    n = len(self.train_indices)
    if batch_size > n:
      raise DataError(f"batch size {batch_size} exceeds the {n} training rows of {self.path}:"
                      " lower --batch-size or write data for more prompts")
    return n // batch_size

  def epoch_order(self, epoch: int, seed: int) -> np.ndarray:
    """Training rows in the order epoch `epoch` visits them."""
    return np.random.default_rng([seed, epoch]).permutation(self.train_indices)

  def batch_indices(self, step: int, batch_size: int, seed: int) -> np.ndarray:
    """Rows of training batch `step` (0-based): a pure function of (step, batch_size, seed)."""
    per = self.steps_per_epoch(batch_size)
    epoch, pos = divmod(step, per)
    return self.epoch_order(epoch, seed)[pos * batch_size:(pos + 1) * batch_size]

  def train_batch(self, step: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
    batch = self.gather(self.batch_indices(step, batch_size, seed))
    return self._crop(batch, np.random.default_rng([seed, step, 1]))

  def _crop(self, batch: dict[str, np.ndarray], rng: np.random.Generator):
    """Crops every row to `window` tokens over its response (no-op without a window)."""
    w = self.window
    t = batch["tokens"].shape[1]
    if w is None or w >= t:
      return batch
    mask = batch["loss_mask"] > 0
    starts = []
    for row in mask:
      resp = np.flatnonzero(row)
      if len(resp) == 0:
        starts.append(0)
        continue
      # Keep a little context before the response start; never run past the row's end.
      lo = max(0, int(resp[0]) - w // 8)
      hi = max(lo, min(int(resp[-1]) + 1, t) - w)
      starts.append(int(rng.integers(lo, hi + 1)))
    starts = np.minimum(np.asarray(starts), t - w)
    idx = starts[:, None] + np.arange(w)[None, :]
    rows = np.arange(len(starts))[:, None]
    return {k: v[rows, idx] for k, v in batch.items()}

  def train_batches(self, batch_size: int, seed: int, start_step: int = 0,
                    ) -> Iterator[dict[str, np.ndarray]]:
    return endless_batches(self, batch_size, seed, start_step)

  def eval_batches(self, batch_size: int, max_batches: int | None = None,
                   ) -> Iterator[dict[str, np.ndarray]]:
    """Held-out batches in a fixed order; the last is filled up by wrapping around."""
    for b, pick in enumerate(wrapped_batches(len(self.eval_indices), batch_size, max_batches)):
      batch = self.gather(self.eval_indices[pick])
      yield self._crop(batch, np.random.default_rng([b, 2]))


def endless_batches(data, batch_size: int, seed: int, start_step: int = 0,
                    ) -> Iterator[dict[str, np.ndarray]]:
  """A `TrainData`'s training batches from `start_step` on, epoch after epoch."""
  step = start_step
  while True:
    yield data.train_batch(step, batch_size, seed)
    step += 1


def wrapped_batches(n: int, batch_size: int, max_batches: int | None = None,
                    ) -> Iterator[np.ndarray]:
  """Positions into n held-out items, batch after batch in stored order, the last batch filled
  up by wrapping around (at most `max_batches`; none when n is 0)."""
  if n == 0:
    return
  count = -(-n // batch_size)
  if max_batches is not None:
    count = min(count, max_batches)
  for b in range(count):
    yield np.resize(np.roll(np.arange(n), -b * batch_size), batch_size)
