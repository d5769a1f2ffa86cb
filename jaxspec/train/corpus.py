"""Self-distillation corpora at scale: multi-turn conversations the target writes, stored as
token-id shards, read back as a stream of packed training batches.

`write_corpus` has the target regenerate every assistant turn of its conversations, greedy and
sampled, by continuous batching (`ConversationWriter` on a `jaxspec.engine.slots.SlotDecoder`:
each conversation keeps a slot and its cache for all its turns): a conversation starts from a
prompt file's user message, or from a user message the target writes itself after its chat
template's bare user-turn prefix (Magpie, Xu et al. 2024); after each answer comes the prompt's
next user turn when the prompt file gives several, else one the target writes the same way
(after the template's "end of assistant turn, start of user turn"), and the target answers it,
up to `CorpusConfig.turns` answers. Generation runs to a token budget and is resumable: the
work is a fixed sequence of batches (batch i's prompts, temperature and random keys are a
function of i; batches are handed back in order however their conversations share the slots),
shards are written at batch boundaries, and index.json records the next batch, so a rerun
continues where the last one stopped and writes the conversations an uninterrupted run writes.

A corpus directory:

  index.json          format, version, target (name, fingerprint), config (CorpusConfig),
                      sources (the prompt files, then the Magpie name), prompts (count and a
                      hash of their token ids), next_batch (the cursor), shards [{file,
                      conversations, tokens, loss_tokens}], totals and seconds; replaced
                      atomically after every shard, so it always describes complete shards
  shard-00000.npz     one compressed shard of C conversations, S tokens:
                        tokens [S] uint16 (int32 for vocabularies over 65,536): the
                          conversations' token ids, concatenated
                        loss_mask [S] uint8: 1 on the tokens of assistant turns the target
                          wrote (each turn's closing stop token included), 0 elsewhere
                        offsets [C + 1] int64: conversation c is tokens[offsets[c]:offsets[c+1]]
                        source [C] int16: index into index.json's sources
                        prompt [C] int64: the prompt's index within the prompt list (file
                          prompts), or the conversation's own number (Magpie)
                        temperature [C] float32, turns [C] int16: answers in the conversation

`Corpus` opens a directory; `PackedCorpus` reads it as training batches, never holding more than
one shard's arrays (or `shuffle_window` shards', whose rows it mixes): conversations are packed
(first-fit decreasing, per shard) into rows of `seq_len` tokens, and a batch is a dict of numpy
arrays

  tokens [B, T] int32          conversations side by side, 0-padded
  loss_mask [B, T] float32     the stored loss mask (0 on padding)
  segment_ids [B, T] int32     1, 2, ... per conversation in the row, 0 on padding
  positions [B, T] int32       each token's position inside its own conversation

A model that reads a packed row must keep conversations apart: attention inside a segment only
(`packed_attention_mask`, the target's `forward(..., positions=, block_mask=)`), and a label
d positions ahead only from the same segment (`same_segment_ahead`). `PackedCorpus(...,
pack=False)` puts one conversation per row instead (a single segment, truncated to seq_len),
which any consumer of plain rows can read. Batches are a pure function of (seed, step), the
`TrainData` protocol of `jaxspec.train.trainer`, so training on a corpus resumes exactly.
`write_corpus_dataset` stores a corpus with the target's hidden states instead, one
conversation a row, for the offline path (`jaxspec.train.data.Dataset`).
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import math
import os
import sys
import time
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from jaxspec.checks import check_int
from jaxspec.heads.common import packed_attention_mask, same_segment_ahead  # noqa: F401 (public here)
from jaxspec.models.model import Model
from jaxspec.train import data as _data
from jaxspec.train.data import (SELF_INSTRUCTIONS, DataConfig, DataError, Prompt,
                                check_time_limit, encode_prompts, fingerprint_matches,
                                make_progress, store_hidden_states, target_fingerprint)

FORMAT = "jaxspec-corpus"
VERSION = 1
_SHARD = "shard-{:05d}.npz"
# The seed stream of `PackedCorpus`'s window shuffle, apart from the per-shard ones (a shard id).
_WINDOW_STREAM = 2**31 - 1


# ----------------------------------------------------------------------------------------------
# The chat template's turn boundaries.

_U1, _A1, _U2 = "\x00jaxspec-u1\x00", "\x00jaxspec-a1\x00", "\x00jaxspec-u2\x00"


@dataclasses.dataclass(frozen=True)
class ChatTurns:
  """Token ids of a chat template's turn boundaries (SmolLM2 in the comments).

  Attributes:
    user_prefix: everything before the first user message (system prompt, user header).
    user_to_assistant: from the end of a user message to the start of the answer
      (`<|im_end|>\\n<|im_start|>assistant\\n`); its first token ends a user turn.
    assistant_to_user: from the end of an answer to the start of the next user message
      (`<|im_end|>\\n<|im_start|>user\\n`); its first token ends an assistant turn.
  """

  user_prefix: tuple[int, ...]
  user_to_assistant: tuple[int, ...]
  assistant_to_user: tuple[int, ...]

  @property
  def user_end(self) -> int:
    return self.user_to_assistant[0]

  @property
  def assistant_end(self) -> int:
    return self.assistant_to_user[0]


def chat_turns(tokenizer) -> ChatTurns:
  """The turn boundaries of the tokenizer's chat template, found by rendering a two-turn
  conversation around sentinel messages and encoding what lies between them."""
  if tokenizer is None or getattr(tokenizer, "chat_template", None) is None:
    raise DataError("multi-turn conversations and target-written user turns need the target's"
                    " chat template: load a checkpoint whose tokenizer has one, or use"
                    " turns=1 with prompt files and chat=False")
  text = tokenizer.apply_chat_template(
      [{"role": "user", "content": _U1}, {"role": "assistant", "content": _A1},
       {"role": "user", "content": _U2}], add_generation_prompt=True)
  if any(text.count(s) != 1 for s in (_U1, _A1, _U2)):
    raise DataError("the target's chat template does not place every message verbatim, so its"
                    " turn boundaries cannot be found: pass prompt files with turns=1")
  head, rest = text.split(_U1)
  u2a, rest = rest.split(_A1)
  a2u, _ = rest.split(_U2)
  enc = lambda s: tuple(tokenizer.encode(s, add_bos=False))  # noqa: E731
  turns = ChatTurns(enc(head), enc(u2a), enc(a2u))
  if not turns.user_to_assistant or not turns.assistant_to_user:
    raise DataError("the target's chat template ends a turn with nothing, so a target-written"
                    " turn would never stop: pass prompt files with turns=1")
  return turns


# ----------------------------------------------------------------------------------------------
# Settings and the batch schedule.


@dataclasses.dataclass(frozen=True, kw_only=True)
class CorpusConfig:
  """How `write_corpus` has the target write its conversations.

  Attributes:
    turns: assistant answers per conversation; after each answer but the last the target
      writes a follow-up user turn (Magpie) and answers it. A conversation ends early when an
      answer or a user turn does not finish, or the next turn would pass `max_len`.
    max_new_tokens: tokens per answer (an answer stops earlier at a stop token).
    max_user_tokens: longest target-written user turn; a longer one ends the conversation
      (a Magpie first turn: drops it).
    min_user_tokens: shortest target-written user turn kept.
    temperatures: answers are sampled at these temperatures (0 = greedy), batch by batch: every
      prompt is answered once at each.
    user_temperature, user_top_p: sampling of target-written user turns.
    magpie_fraction: share of the batches whose first user turn the target writes; once every
      prompt is answered at every temperature, all batches are Magpie batches (with 0 the
      corpus is then complete).
    batch_size: conversations per batch of the schedule, and the slots they are written on
      (a finished conversation's slot takes the next one at once).
    max_prompt_len: prompts longer than this (after the chat template) are skipped.
    max_len: longest conversation in tokens (the KV-cache size bound).
    shard_tokens: a shard is written once it holds this many tokens (at a batch boundary).
    chat: apply the chat template to text prompts (turns > 1 and Magpie need it).
    seed: the seed of every random choice (batch i samples with fold_in(key(seed), i)).
  """

  turns: int = 2
  max_new_tokens: int = 1024
  max_user_tokens: int = 128
  min_user_tokens: int = 4
  temperatures: tuple[float, ...] = (0.0, 0.7)
  user_temperature: float = 1.0
  user_top_p: float = 0.95
  magpie_fraction: float = 0.25
  batch_size: int = 16
  max_prompt_len: int = 512
  max_len: int = 4096
  shard_tokens: int = 1 << 18
  chat: bool = True
  seed: int = 0

  def __post_init__(self):
    for name, lo in dict(turns=1, max_new_tokens=1, max_user_tokens=1, min_user_tokens=1,
                         batch_size=1, max_prompt_len=1, max_len=2, shard_tokens=1,
                         seed=0).items():
      check_int(f"CorpusConfig.{name}", getattr(self, name), lo, numpy=False, error=DataError)
    if self.min_user_tokens > self.max_user_tokens:
      raise DataError(f"CorpusConfig.min_user_tokens {self.min_user_tokens} exceeds"
                      f" max_user_tokens {self.max_user_tokens}")
    if not self.temperatures or any(not 0 <= t < math.inf for t in self.temperatures):
      raise DataError(f"temperatures {self.temperatures} must be a non-empty tuple of values"
                      " >= 0 (0 = greedy)")
    if not 0 <= self.magpie_fraction <= 1:
      raise DataError(f"magpie_fraction must be in [0, 1], got {self.magpie_fraction}")
    if not (self.user_temperature > 0 and 0 < self.user_top_p <= 1):
      raise DataError("user_temperature must be > 0 and user_top_p in (0, 1]: target-written"
                      " user turns are sampled")
    if self.max_prompt_len + self.max_new_tokens > self.max_len:
      raise DataError(f"max_len {self.max_len} cannot hold a prompt of max_prompt_len"
                      f" {self.max_prompt_len} and an answer of max_new_tokens"
                      f" {self.max_new_tokens}: raise max_len")

  def to_json(self) -> dict[str, Any]:
    return {**dataclasses.asdict(self), "temperatures": list(self.temperatures)}


@dataclasses.dataclass(frozen=True)
class BatchPlan:
  """What batch i does: Magpie (the target writes the first user turns) or the prompts at
  `prompts` (indices into the prompt list), answered at temperatures[temperature_index]."""

  index: int
  magpie: bool
  temperature_index: int
  prompts: tuple[int, ...] = ()


def batch_plan(i: int, num_prompts: int, cfg: CorpusConfig) -> BatchPlan | None:
  """Batch i of the fixed schedule (None: the schedule is over).

  Magpie batches are spread evenly (batch i is one when floor((i + 1) f) > floor(i f), f the
  magpie fraction); the others walk the prompt list in chunks of batch_size, once per
  temperature. After the last prompt chunk every batch is a Magpie batch (none when f = 0).
  """
  f = cfg.magpie_fraction if num_prompts else 1.0
  nt = len(cfg.temperatures)
  chunks = -(-num_prompts // cfg.batch_size)
  if math.floor((i + 1) * f) > math.floor(i * f):
    return BatchPlan(i, True, i % nt)
  j = i - math.floor(i * f)  # prompt batches before this one
  if j < chunks * nt:
    c = j % chunks
    idx = range(c * cfg.batch_size, min((c + 1) * cfg.batch_size, num_prompts))
    return BatchPlan(i, False, j // chunks, tuple(idx))
  return BatchPlan(i, True, i % nt) if f > 0 else None


# ----------------------------------------------------------------------------------------------
# The conversations of the batches, on slots (continuous batching).


@dataclasses.dataclass
class Conversation:
  """A conversation being written: token ids, loss mask (1 on target-written answers),
  answers so far, whether it can go on, and the user turns a prompt file gives for later."""

  tokens: list[int]
  mask: list[int]
  prompt: int
  answers: int = 0
  open: bool = True
  given: list[list[int]] = dataclasses.field(default_factory=list)  # later user turns


@dataclasses.dataclass
class _Live:
  """A conversation on a slot: its batch, its row j there, the phase it is in (phase p of
  batch i samples row j with row_keys(fold_in(fold_in(key(seed), i), p), batch_size)[j]),
  whether the slot writes a user turn (else an answer), and the tokens before that user turn
  (not in `conv.tokens` until the turn is kept)."""

  conv: Conversation
  batch: int
  j: int
  phase: int
  user: bool = False
  lead: tuple[int, ...] = ()


class ConversationWriter:
  """Writes the conversations of batches start, start + 1, ... of the schedule (`batch_plan`)
  on `cfg.batch_size` slots of a `SlotDecoder`, and hands them back batch by batch, in order.

  Each conversation lives on one slot from its first user turn to its last answer: a phase
  (a target-written user turn, or an answer) appends to the slot's cache only the tokens since
  the last one, and a slot whose conversation ends takes the next conversation, of the same
  batch or of the next one admitted, at once. So no step waits for a batch's longest row, and
  no turn prefills the conversation again. What a conversation holds depends only on its batch
  and row (the keys above): the same as the batches run one at a time, up to the float rounding
  of other rows in the decode batch.

  A conversation's phases, as the batch writer's were: the first user turn (a prompt's, or the
  target's after `user_prefix`: Magpie), then up to cfg.turns answers, each but the last
  followed by the prompt file's next user turn (`later_ids[p]`) or one the target writes. A
  target-written user turn is kept when it ends within max_user_tokens, has min_user_tokens and
  leaves room for an answer of max_new_tokens; an answer that does not stop, or leaves no room
  for another turn, ends the conversation. An answer may run to max_new_tokens or to max_len.
  """

  def __init__(self, target: Model, prompt_ids: Sequence[Sequence[int]], cfg: CorpusConfig,
               turns: ChatTurns | None, *, later_ids: Sequence[Sequence[Sequence[int]]] = (),
               start: int = 0, on_run=None):
    from jaxspec.engine.slots import SlotDecoder
    self.prompt_ids, self.later, self.cfg, self.turns = prompt_ids, later_ids, cfg, turns
    self.answer_stops = set(target.cfg.eos_token_ids) | set(
        getattr(target.tokenizer, "eos_token_ids", ()) or ())
    self.user_stops = set(target.cfg.eos_token_ids)
    if turns is not None:
      self.answer_stops.add(turns.assistant_end)
      self.user_stops.add(turns.user_end)
    self.dec = SlotDecoder(target, cfg.batch_size, cfg.max_len,
                           max(cfg.max_new_tokens, cfg.max_user_tokens + 1),
                           sorted(self.answer_stops),
                           max_stops=max(8, len(self.answer_stops), len(self.user_stops)))
    self.next_batch = start
    self.exhausted = False  # the schedule is over
    self.waiting: list[_Live] = []  # admitted, not on a slot yet
    self.on_slot: dict[int, _Live] = {}
    # Admitted batches not handed back yet: a batch is done once none of its conversations is
    # open (waiting, or on a slot).
    self.batches: dict[int, tuple[BatchPlan, list[Conversation]]] = {}
    self._base = jax.random.key(cfg.seed)
    self.on_run = on_run  # called after every return of the decode loop (progress)

  # The keys and jobs of one phase.
  def _key(self, live: _Live) -> jax.Array:
    from jaxspec.sampling import row_keys
    k = jax.random.fold_in(jax.random.fold_in(self._base, live.batch), live.phase)
    return row_keys(k, self.cfg.batch_size)[live.j]

  def _start(self, slot: int, live: _Live, reset: bool) -> None:
    from jaxspec.engine.slots import Job
    cfg, c = self.cfg, live.conv
    held = 0 if reset else self.dec.cached(slot)
    if live.user:
      job = Job((c.tokens + list(live.lead))[held:], cfg.max_user_tokens + 1, self._key(live),
                cfg.user_temperature, cfg.user_top_p, reset, sorted(self.user_stops))
    else:
      plan = self.batches[live.batch][0]
      room = min(cfg.max_new_tokens, cfg.max_len - len(c.tokens))
      job = Job(c.tokens[held:], room, self._key(live),
                cfg.temperatures[plan.temperature_index], 1.0, reset)
    self.on_slot[slot] = live
    self.dec.start(slot, job)

  def _admit(self) -> bool:
    """Queues the next batch's conversations; False when the schedule is over."""
    plan = batch_plan(self.next_batch, len(self.prompt_ids), self.cfg)
    if plan is None:
      self.exhausted = True
      return False
    cfg, turns = self.cfg, self.turns
    if plan.magpie:
      if turns is None:
        raise DataError("Magpie batches need the target's chat template (magpie_fraction=0"
                        " without one)")
      convs = [Conversation(list(turns.user_prefix), [0] * len(turns.user_prefix),
                            plan.index * cfg.batch_size + j) for j in range(cfg.batch_size)]
      lives = [_Live(c, plan.index, j, 0, user=True) for j, c in enumerate(convs)]
    else:
      convs = [Conversation(list(self.prompt_ids[p]), [0] * len(self.prompt_ids[p]), p,
                            given=[list(t) for t in self.later[p]] if self.later else [])
               for p in plan.prompts]
      lives = [_Live(c, plan.index, j, 0) for j, c in enumerate(convs)]
    self.batches[plan.index] = (plan, convs)
    self.waiting += lives
    self.next_batch += 1
    return True

  def _next_phase(self, live: _Live) -> bool:
    """After an answer: the next user turn set up (a given one appended, or a target-written
    one to write); False when the conversation ends."""
    cfg, turns, c = self.cfg, self.turns, live.conv
    live.phase += 1
    lead = tuple(turns.assistant_to_user[1:])
    if c.given:  # a prompt file's next user turn, as the template writes a user message
      add = list(lead) + c.given.pop(0) + list(turns.user_to_assistant)
      if len(c.tokens) + len(add) + cfg.max_new_tokens > cfg.max_len:
        return False
      c.tokens += add
      c.mask += [0] * len(add)
      live.phase += 1  # the answer's phase
      live.user = False
    else:
      live.user, live.lead = True, lead
    return True

  def _finished(self, slot: int, row: list[int]) -> bool:
    """Takes a slot's finished phase into its conversation; True when the conversation goes
    on (its next phase started on the same slot)."""
    cfg, turns = self.cfg, self.turns
    live = self.on_slot.pop(slot)
    c = live.conv
    if live.user:
      add = list(live.lead) + row + list(turns.user_to_assistant[1:])
      if (not row or row[-1] != turns.user_end
          or not cfg.min_user_tokens <= len(row) - 1 <= cfg.max_user_tokens
          or len(c.tokens) + len(add) + cfg.max_new_tokens > cfg.max_len):
        return False
      c.tokens += add
      c.mask += [0] * len(add)
      live.user, live.lead = False, ()
      live.phase += 1
    else:
      c.tokens += row
      c.mask += [1] * len(row)
      c.answers += 1
      more = (turns is not None and c.answers < cfg.turns and row
              and row[-1] == turns.assistant_end
              and len(c.tokens) + len(turns.assistant_to_user) + cfg.max_user_tokens
              + len(turns.user_to_assistant) + cfg.max_new_tokens <= cfg.max_len)
      if not more or not self._next_phase(live):
        return False
    self._start(slot, live, reset=False)
    return True

  def answer_tokens(self) -> int:
    """Answer tokens the conversations of unfinished batches hold so far (progress)."""
    return sum(sum(c.mask) for _, convs in self.batches.values() for c in convs)

  def next(self, admit=lambda batch: True) -> tuple[BatchPlan, list[Conversation]] | None:
    """Writes until the oldest unfinished batch is done and returns it (its conversations that
    hold an answer, in the batch's order); None when no batch is left: the schedule is over
    (`exhausted`), or `admit(i)` refused batch i and every admitted one has been returned.
    `admit` is asked before a batch's conversations are queued for free slots."""
    while True:
      if self.batches:
        oldest = min(self.batches)
        plan, convs = self.batches[oldest]
        if not any(c.open for c in convs):
          del self.batches[oldest]
          return plan, [c for c in convs if c.answers]
      for slot in self.dec.free:
        if not self.waiting and (self.exhausted or not admit(self.next_batch)
                                 or not self._admit()):
          break
        self._start(slot, self.waiting.pop(0), reset=True)
      if not self.on_slot:
        if not self.batches:
          return None
        raise AssertionError("unfinished batches with no conversation on a slot")
      for slot, row in self.dec.run().items():
        live = self.on_slot[slot]
        if not self._finished(slot, row):
          live.conv.open = False
      if self.on_run is not None:
        self.on_run()


# ----------------------------------------------------------------------------------------------
# Progress: tokens/s and an ETA, as a bar on a terminal or a plain line every N seconds.


@dataclasses.dataclass
class RateMeter:
  """Tokens per second and the time left to a token budget, over this process's run, or to a
  time limit's `deadline` (a `time.monotonic` reading) when that comes first."""

  total: int
  done: int = 0
  start_done: int = 0
  t0: float = dataclasses.field(default_factory=time.monotonic)
  deadline: float | None = None

  def rate(self, now: float | None = None) -> float:
    dt = (time.monotonic() if now is None else now) - self.t0
    return (self.done - self.start_done) / dt if dt > 0 else 0.0

  def eta_seconds(self, now: float | None = None) -> float | None:
    now = time.monotonic() if now is None else now
    r = self.rate(now)
    eta = max(self.total - self.done, 0) / r if r > 0 else None
    if self.deadline is not None:
      limit = max(self.deadline - now, 0.0)
      eta = limit if eta is None else min(eta, limit)
    return eta

  def line(self, now: float | None = None, extra: str = "") -> str:
    now = time.monotonic() if now is None else now
    eta = self.eta_seconds(now)
    left = "?" if eta is None else _hms(eta)
    if self.deadline is not None and eta is not None and eta >= self.deadline - now:
      left += " (time limit)"
    pct = 100.0 * self.done / self.total if self.total else 100.0
    return (f"[jaxspec] corpus: {self.done:,} / {self.total:,} tokens ({pct:.1f}%),"
            f" {self.rate(now):.1f} tok/s, eta {left}{extra}")


def _hms(s: float) -> str:
  s = int(round(s))
  return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else \
      f"{s // 60}m{s % 60:02d}s"


class _Progress:
  """A rich bar when stderr is a terminal, else a plain `RateMeter.line` every `every` seconds
  (logs of background runs stay readable); nothing when disabled."""

  def __init__(self, meter: RateMeter, enabled: bool, every: float, stream=None):
    self.meter, self.every, self.stream = meter, every, stream or sys.stderr
    self.enabled = enabled
    self.bar = self.task = None
    self.last = -math.inf
    if enabled and getattr(self.stream, "isatty", lambda: False)():
      self.bar = make_progress(True)
      self.bar.__enter__()
      self.task = self.bar.add_task("target writes the corpus", total=meter.total,
                                    completed=meter.done, info="")

  def update(self, extra: str = "", force: bool = False) -> None:
    if not self.enabled:
      return
    if self.bar is not None:
      self.bar.update(self.task, completed=min(self.meter.done, self.meter.total),
                      info=f"{self.meter.rate():.0f} tok/s{extra}")
      return
    now = time.monotonic()
    if force or now - self.last >= self.every:
      self.last = now
      print(self.meter.line(extra=extra), file=self.stream, flush=True)

  def close(self) -> None:
    if self.bar is not None:
      self.bar.__exit__(None, None, None)


# ----------------------------------------------------------------------------------------------
# Writing a corpus.


def _prompts_hash(prompt_ids: Sequence[Sequence[int]]) -> str:
  h = hashlib.sha256()
  for p in prompt_ids:
    h.update(np.asarray(p, np.int64).tobytes())
    h.update(b"|")
  return h.hexdigest()[:16]


def _write_json(path: Path, obj) -> None:
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
  os.replace(tmp, path)  # atomic: a reader sees the old or the new index, never a torn one


def token_dtype(vocab_size: int) -> np.dtype:
  """uint16 when every id fits (half the disk of int32), else int32."""
  return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.int32)


def write_shard(path: Path, convs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
                source: Sequence[int], prompt: Sequence[int], temperature: Sequence[float],
                turns: Sequence[int], vocab_size: int) -> dict[str, int]:
  """Writes one shard (see the module docstring) atomically; returns its index entry."""
  lengths = np.array([len(t) for t, _ in convs], np.int64)
  offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
  tokens = np.concatenate([np.asarray(t, np.int64) for t, _ in convs]) if convs else \
      np.zeros(0, np.int64)
  if tokens.size and not (0 <= tokens.min() and tokens.max() < vocab_size):
    raise DataError(f"a conversation holds a token id outside [0, {vocab_size})")
  mask = np.concatenate([np.asarray(m, np.uint8) for _, m in convs]) if convs else \
      np.zeros(0, np.uint8)
  tmp = path.with_name(path.name + ".tmp.npz")
  np.savez_compressed(tmp, tokens=tokens.astype(token_dtype(vocab_size)), loss_mask=mask,
                      offsets=offsets, source=np.asarray(source, np.int16),
                      prompt=np.asarray(prompt, np.int64),
                      temperature=np.asarray(temperature, np.float32),
                      turns=np.asarray(turns, np.int16))
  os.replace(tmp, path)
  return {"file": path.name, "conversations": len(convs), "tokens": int(tokens.size),
          "loss_tokens": int(mask.sum())}


@dataclasses.dataclass(frozen=True)
class CorpusSummary:
  """What a `write_corpus` call left on disk (totals over every run of the directory)."""

  path: Path
  shards: int
  conversations: int
  tokens: int
  loss_tokens: int
  next_batch: int
  complete: bool
  tokens_per_second: float  # target-written answer tokens per second, this call


def write_corpus(target: Model, prompts: Sequence[Prompt], out_dir: str | os.PathLike,
                 cfg: CorpusConfig = CorpusConfig(), *, token_budget: int,
                 sources: Sequence[str] = (), prompt_sources: Sequence[int] | None = None,
                 max_batches: int | None = None, time_limit: float | None = None,
                 progress: bool = True, progress_every: float = 30.0) -> CorpusSummary:
  """Has the target write conversations until the corpus holds `token_budget` answer tokens.

  Resumable: a directory that already holds a corpus of the same target, settings and prompts
  is continued from its next batch (the budget and shard_tokens may differ); the batches
  already stored are not written again. A KeyboardInterrupt stores the finished batches before
  it propagates.

  Args:
    target: the model whose behaviour is distilled.
    prompts: first user turns (text, chat-templated when cfg.chat; or token ids), or every
      user turn of a conversation (a list of strings: the target answers each, and writes the
      follow-ups past the last), in a fixed order (e.g. `read_prompts(..., all_turns=True)`);
      may be empty when cfg.magpie_fraction > 0.
    out_dir: the corpus directory (created, or continued).
    cfg: generation settings.
    token_budget: stop once the corpus holds this many loss-masked (answer) tokens.
    sources: names of the prompt files (recorded; the Magpie name is appended).
    prompt_sources: for each prompt, its index in `sources` (default 0).
    max_batches: stop after this many batches in this call (tests, time-boxed runs).
    time_limit: start no batch after this many seconds of this call (a time-boxed run: the
      batches already on slots finish and are stored; rerun to go on).
    progress: show progress on stderr (a bar on a terminal, else a line every
      `progress_every` seconds).
  Returns:
    A `CorpusSummary`.
  Raises:
    DataError: bad settings or prompts, or a directory holding a different corpus; raised
      before the target runs.
  """
  check_int("token_budget", token_budget, 1, numpy=False, error=DataError)
  check_time_limit("time_limit", time_limit, error=DataError)
  out = Path(out_dir)
  # A multi-turn prompt (a list of user messages): the first opens the conversation, the
  # others follow the target's answers.
  multi = [isinstance(p, list) and bool(p) and isinstance(p[0], str) for p in prompts]
  if any(multi) and (not cfg.chat or target.tokenizer is None):
    raise DataError("multi-turn prompts need the target's tokenizer and chat template")
  firsts = [p[0] if m else p for p, m in zip(prompts, multi)]
  prompt_ids = encode_prompts(target, firsts, chat=cfg.chat) if prompts else []
  later = [[target.tokenizer.encode(t, add_bos=False) for t in p[1:]] if m else []
           for p, m in zip(prompts, multi)]
  keep = [i for i, p in enumerate(prompt_ids) if len(p) <= cfg.max_prompt_len]
  if prompt_ids and len(keep) < len(prompt_ids):
    warnings.warn(f"skipped {len(prompt_ids) - len(keep)} of {len(prompt_ids)} prompts longer"
                  f" than max_prompt_len {cfg.max_prompt_len} tokens", stacklevel=2)
  src_of = list(prompt_sources) if prompt_sources is not None else [0] * len(prompt_ids)
  if len(src_of) != len(prompt_ids):
    raise DataError(f"{len(src_of)} prompt_sources for {len(prompt_ids)} prompts")
  prompt_ids = [prompt_ids[i] for i in keep]
  later = [later[i] for i in keep]
  src_of = [src_of[i] for i in keep]
  if not prompt_ids and cfg.magpie_fraction == 0:
    raise DataError("no prompts and magpie_fraction 0: pass prompt files, or let the target"
                    " write its own (magpie_fraction > 0)")
  turns = None
  if cfg.chat and target.tokenizer is not None and getattr(target.tokenizer, "chat_template",
                                                           None) is not None:
    turns = chat_turns(target.tokenizer)
  if turns is None and (cfg.turns > 1 or cfg.magpie_fraction > 0):
    if not cfg.chat:
      raise DataError("turns > 1 and Magpie batches need the chat template: drop chat=False"
                      " (--no-chat), or use turns=1 and magpie_fraction=0")
    chat_turns(target.tokenizer)  # raises the message
  sources = list(sources) or ["<prompts>"]
  magpie_source = len(sources)
  index = {
      "format": FORMAT, "version": VERSION,
      "target": {"name": target.name, "fingerprint": target_fingerprint(target)},
      "config": cfg.to_json(), "sources": sources + [SELF_INSTRUCTIONS],
      "prompts": {"count": len(prompt_ids),
                  "hash": _prompts_hash(prompt_ids + [t for ts in later for t in ts])},
      "next_batch": 0, "complete": False, "shards": [],
      "totals": {"conversations": 0, "tokens": 0, "loss_tokens": 0},
      "seconds": 0.0, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
  }
  index_file = out / "index.json"
  if index_file.is_file():
    old = Corpus(out).index
    # shard_tokens only decides where shards end: a rerun may change it.
    same = lambda d: {k: v for k, v in d.items() if k != "shard_tokens"}  # noqa: E731
    # A corpus stamped by the fingerprint rule of before the unification is the target's too.
    if fingerprint_matches(old["target"]["fingerprint"], target):
      index["target"] = old["target"]
    for key in ("target", "config", "sources", "prompts"):
      if (same(old[key]) if key == "config" else old[key]) != (
          same(index[key]) if key == "config" else index[key]):
        raise DataError(f"{out} holds a corpus with a different {key} ({_brief(old[key])} !="
                        f" {_brief(index[key])}): continue it with its own settings, or choose"
                        " another directory")
    index = dict(old, config=index["config"])
  out.mkdir(parents=True, exist_ok=True)
  for stale in out.glob("*.tmp*"):  # an interrupted shard or index write
    stale.unlink()
  tot = index["totals"]
  meter = RateMeter(total=token_budget, done=tot["loss_tokens"], start_done=tot["loss_tokens"])
  bar = _Progress(meter, progress, progress_every)
  pending: list[Conversation] = []
  meta: dict[str, list] = {"source": [], "temperature": []}
  t0 = time.perf_counter()

  def flush():
    if not pending:
      return
    entry = write_shard(out / _SHARD.format(len(index["shards"])),
                        [(c.tokens, c.mask) for c in pending], source=meta["source"],
                        prompt=[c.prompt for c in pending], temperature=meta["temperature"],
                        turns=[c.answers for c in pending], vocab_size=target.cfg.vocab_size)
    index["shards"].append(entry)
    for k in ("conversations", "tokens", "loss_tokens"):
      tot[k] += entry[k]
    pending.clear()
    meta["source"].clear()
    meta["temperature"].clear()

  def save(next_batch):
    index["next_batch"] = next_batch
    index["seconds"] = round(index["seconds"] + time.perf_counter() - save.t, 2)
    save.t = time.perf_counter()
    _write_json(index_file, index)

  save.t = t0
  if not index_file.is_file():
    save(0)
  i = i0 = index["next_batch"]
  buffered = lambda: sum(len(c.tokens) for c in pending)  # noqa: E731
  buffered_loss = lambda: sum(sum(c.mask) for c in pending)  # noqa: E731

  def admit(batch: int) -> bool:  # whether batch `batch` may start
    return ((max_batches is None or batch < i0 + max_batches)
            and (deadline is None or time.monotonic() < deadline)
            and tot["loss_tokens"] + buffered_loss() < token_budget)

  def on_run():
    meter.done = tot["loss_tokens"] + buffered_loss() + writer.answer_tokens()
    bar.update(f", batch {i} ({len(writer.on_slot)} conversations on slots),"
               f" {len(index['shards'])} shards")

  # The slots (their caches are large) only when a batch is to be written; allocating them does
  # not count against time_limit, so a time-boxed run always starts its first batch.
  writer = None
  if not index["complete"] and tot["loss_tokens"] < token_budget:
    writer = ConversationWriter(target, prompt_ids, cfg, turns, later_ids=later, start=i,
                                on_run=on_run)
  deadline = None if time_limit is None else time.monotonic() + time_limit
  meter.deadline = deadline
  try:
    while tot["loss_tokens"] + buffered_loss() < token_budget and not index["complete"]:
      done = writer.next(admit)
      if done is None:
        index["complete"] = writer.exhausted
        break
      plan, convs = done
      temp = cfg.temperatures[plan.temperature_index]
      for c in convs:
        pending.append(c)
        meta["source"].append(magpie_source if plan.magpie else src_of[c.prompt])
        meta["temperature"].append(temp)
      i += 1
      meter.done = tot["loss_tokens"] + buffered_loss()
      if buffered() >= cfg.shard_tokens:
        flush()
        save(i)
      bar.update(f", batch {i}, {len(index['shards'])} shards")
  except KeyboardInterrupt:
    # The finished batches are kept (those on slots are not): a rerun goes on from i.
    flush()
    save(i)
    bar.update(f", batch {i}, {len(index['shards'])} shards (interrupted; saved)", force=True)
    raise
  else:
    flush()
    save(i)
    bar.update(f", batch {i}, {len(index['shards'])} shards (saved)", force=True)
  finally:
    bar.close()
  dt = time.perf_counter() - t0
  return CorpusSummary(out, len(index["shards"]), tot["conversations"], tot["tokens"],
                       tot["loss_tokens"], index["next_batch"], bool(index["complete"]),
                       (tot["loss_tokens"] - meter.start_done) / dt if dt > 0 else 0.0)


def _brief(v) -> str:
  s = json.dumps(v, sort_keys=True)
  return s if len(s) <= 80 else s[:77] + "..."


# ----------------------------------------------------------------------------------------------
# Reading a corpus.


class Corpus:
  """A corpus directory (see the module docstring): its index, and its shards one at a time."""

  def __init__(self, path: str | os.PathLike):
    self.path = Path(path)
    f = self.path / "index.json"
    if not f.is_file():
      raise DataError(f"{self.path} holds no corpus (no index.json): write one with"
                      " `jaxspec train-data --out DIR` or `write_corpus`")
    try:
      self.index = json.loads(f.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
      raise DataError(f"{f} is not valid JSON ({e}): write the corpus again") from None
    if self.index.get("format") != FORMAT or self.index.get("version") != VERSION:
      raise DataError(f"{self.path} is not a {FORMAT} v{VERSION} corpus: write it again")
    for s in self.index["shards"]:
      if not (self.path / s["file"]).is_file():
        raise DataError(f"{self.path} lacks {s['file']}, listed in its index.json: copy the"
                        " whole directory, or write the corpus again")

  @property
  def num_shards(self) -> int:
    return len(self.index["shards"])

  @property
  def sources(self) -> list[str]:
    return list(self.index["sources"])

  def check_target(self, target: Model) -> None:
    """Raises DataError unless this corpus was written by `target`."""
    got, want = self.index["target"]["fingerprint"], target_fingerprint(target)
    if not fingerprint_matches(got, target):
      raise DataError(f"{self.path} was written by target {self.index['target']['name']!r}"
                      f" (fingerprint {got}), not by {target.name!r} ({want}): write a corpus"
                      " for this target")

  def shard_info(self, s: int) -> dict[str, np.ndarray]:
    """Shard s's small arrays (offsets, source, prompt, temperature, turns), without its
    tokens: an .npz member is read only when asked for."""
    with np.load(self.path / self.index["shards"][s]["file"]) as z:
      return {k: z[k] for k in ("offsets", "source", "prompt", "temperature", "turns")}

  def load_shard(self, s: int) -> dict[str, np.ndarray]:
    """Every array of shard s (tokens as int32)."""
    with np.load(self.path / self.index["shards"][s]["file"]) as z:
      out = {k: z[k] for k in z.files}
    out["tokens"] = out["tokens"].astype(np.int32)
    return out

  def conversations(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(tokens [n] int32, loss_mask [n] uint8) of every conversation, in stored order, one
    shard in memory at a time."""
    for s in range(self.num_shards):
      z = self.load_shard(s)
      o = z["offsets"]
      for c in range(len(o) - 1):
        yield z["tokens"][o[c]:o[c + 1]], z["loss_mask"][o[c]:o[c + 1]]


def held_out(source: np.ndarray, prompt: np.ndarray, fraction: float, seed: int) -> np.ndarray:
  """[C] bool: whether each conversation is held out for evaluation, by a hash of (seed,
  source, prompt): the answers to one prompt at every temperature fall on one side, and a
  conversation's side never depends on the rest of the corpus."""
  if fraction <= 0:
    return np.zeros(len(source), bool)
  key = (np.asarray(source, np.uint64) * np.uint64(0x9E3779B97F4A7C15)
         ^ np.asarray(prompt, np.int64).astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
         ^ np.full(len(source), seed, np.uint64) * np.uint64(0x94D049BB133111EB))
  key ^= key >> np.uint64(31)
  key *= np.uint64(0xD6E8FEB86659FD93)
  key ^= key >> np.uint64(32)
  return (key % np.uint64(1 << 20)).astype(np.float64) < fraction * (1 << 20)


def pack_conversations(lengths: Sequence[int], seq_len: int) -> list[list[int]]:
  """First-fit decreasing: the conversations (indices into `lengths`) of each row of `seq_len`
  tokens. A conversation longer than seq_len fills a row alone (it is truncated). Deterministic:
  ties keep index order."""
  order = sorted(range(len(lengths)), key=lambda c: (-min(lengths[c], seq_len), c))
  rows: list[list[int]] = []
  free: list[int] = []
  for c in order:
    n = min(int(lengths[c]), seq_len)
    for r, room in enumerate(free):
      if n <= room:
        rows[r].append(c)
        free[r] -= n
        break
    else:
      rows.append([c])
      free.append(seq_len - n)
  return rows


def pack_rows(tokens: np.ndarray, loss_mask: np.ndarray, offsets: np.ndarray,
              rows: Sequence[Sequence[int]], seq_len: int) -> dict[str, np.ndarray]:
  """The packed rows `rows` (conversation indices each) of one shard's arrays: tokens,
  loss_mask, segment_ids, positions [R, seq_len] (see the module docstring)."""
  r = len(rows)
  out = {"tokens": np.zeros((r, seq_len), np.int32),
         "loss_mask": np.zeros((r, seq_len), np.float32),
         "segment_ids": np.zeros((r, seq_len), np.int32),
         "positions": np.zeros((r, seq_len), np.int32)}
  for i, convs in enumerate(rows):
    at = 0
    for seg, c in enumerate(convs, 1):
      lo, hi = int(offsets[c]), int(offsets[c + 1])
      n = min(hi - lo, seq_len - at)
      out["tokens"][i, at:at + n] = tokens[lo:lo + n]
      out["loss_mask"][i, at:at + n] = loss_mask[lo:lo + n]
      out["segment_ids"][i, at:at + n] = seg
      out["positions"][i, at:at + n] = np.arange(n)
      at += n
  return out


class PackedCorpus:
  """A corpus read as training batches of packed rows (see the module docstring), one shard in
  memory at a time: the `TrainData` protocol of `jaxspec.train.trainer`, and an iterator.

  Packing and the train / held-out split are planned per shard from its offsets, sources and
  prompts only (the token arrays are not read to plan). Epoch e visits the shards in the order
  `default_rng([seed, e]).permutation`, and inside each shard its training rows in the order
  `default_rng([seed, e, shard]).permutation`: batch `step` is a pure function of (seed, step),
  and a pass over an epoch reads every shard once.

  With `shuffle_window=W > 1`, the shards in that order are taken W at a time and the training
  rows of each window are shuffled together (`default_rng([seed, e, _WINDOW_STREAM,
  window]).permutation`), so a batch mixes rows of W shards: of corpora written one after the
  other, or of a corpus's greedy, sampled and Magpie batches, which lie in different shards. Up
  to W shards are held in memory (the least recently used goes first), and an epoch still reads
  each shard once.
  """

  def __init__(self, corpus: Corpus | str | os.PathLike, seq_len: int, *, pack: bool = True,
               eval_fraction: float = 0.02, split_seed: int = 0, shuffle_window: int = 1):
    """
    Args:
      corpus: a `Corpus` or its directory.
      seq_len: tokens per row (T).
      pack: several conversations per row (False: one, truncated to seq_len).
      eval_fraction: share of prompts held out (by hash; see `held_out`).
      split_seed: seed of the split.
      shuffle_window: shards whose training rows are shuffled together, and held in memory at
        once (1: one shard at a time, each shard's rows shuffled alone).
    """
    check_int("seq_len", seq_len, 2, numpy=False, error=DataError)
    check_int("shuffle_window", shuffle_window, 1, numpy=False, error=DataError)
    if not 0 <= eval_fraction < 1:
      raise DataError(f"eval_fraction must be in [0, 1), got {eval_fraction}")
    self.corpus = corpus if isinstance(corpus, Corpus) else Corpus(corpus)
    if self.corpus.num_shards == 0:
      raise DataError(f"{self.corpus.path} holds no shards yet: let `jaxspec train-data` write"
                      " some (a shard is written every shard_tokens tokens)")
    self.seq_len, self.pack, self.shuffle_window = seq_len, pack, shuffle_window
    self.train_rows: list[list[list[int]]] = []  # [shard][row] -> conversation indices
    self.eval_rows: list[list[list[int]]] = []
    for s in range(self.corpus.num_shards):
      info = self.corpus.shard_info(s)
      lengths = np.diff(info["offsets"])
      held = held_out(info["source"], info["prompt"], eval_fraction, split_seed)
      for side, rows in ((~held, self.train_rows), (held, self.eval_rows)):
        idx = np.flatnonzero(side)
        plan = (pack_conversations(lengths[idx].tolist(), seq_len) if self.pack
                else [[j] for j in range(len(idx))])
        rows.append([[int(idx[j]) for j in r] for r in plan])
    self.loads = 0  # shards read so far (a test's measure of streaming)
    # The shards in memory, least recently used first: at most shuffle_window of them.
    self._cached: collections.OrderedDict[int, dict[str, np.ndarray]] = collections.OrderedDict()

  @property
  def num_train_rows(self) -> int:
    return sum(len(r) for r in self.train_rows)

  @property
  def num_eval_rows(self) -> int:
    return sum(len(r) for r in self.eval_rows)

  def _shard(self, s: int) -> dict[str, np.ndarray]:
    """Shard s's arrays; past shuffle_window shards in memory, the least recently used goes."""
    if s in self._cached:
      self._cached.move_to_end(s)
      return self._cached[s]
    while len(self._cached) >= self.shuffle_window:  # drop before reading the new one
      self._cached.popitem(last=False)
    self._cached[s] = self.corpus.load_shard(s)
    self.loads += 1
    return self._cached[s]

  def signature(self) -> dict[str, Any]:
    """What decides the batches beside the seed (`TrainData`): a resume checks it (a corpus
    that gained shards since the run started reads other batches)."""
    return dict(kind="PackedCorpus", shards=self.corpus.num_shards,
                train_rows=self.num_train_rows, eval_rows=self.num_eval_rows,
                seq_len=self.seq_len, pack=self.pack, shuffle_window=self.shuffle_window)

  def steps_per_epoch(self, batch_size: int) -> int:
    n = self.num_train_rows
    if batch_size > n:
      raise DataError(f"batch size {batch_size} exceeds the {n} training rows of"
                      f" {self.corpus.path} at seq_len {self.seq_len}: lower the batch size or"
                      " write more corpus")
    return n // batch_size

  def epoch_order(self, epoch: int, seed: int) -> np.ndarray:
    """[R, 2] (shard, row) of every training row, in the order epoch `epoch` visits them."""
    parts = []
    for s in np.random.default_rng([seed, epoch]).permutation(self.corpus.num_shards):
      n = len(self.train_rows[s])
      rows = np.random.default_rng([seed, epoch, int(s)]).permutation(n)
      parts.append(np.stack([np.full(n, s), rows], axis=1))
    if self.shuffle_window > 1:
      w = self.shuffle_window
      parts = [np.concatenate(parts[i:i + w]) for i in range(0, len(parts), w)]
      parts = [p[np.random.default_rng([seed, epoch, _WINDOW_STREAM, j]).permutation(len(p))]
               for j, p in enumerate(parts)]
    return np.concatenate(parts).astype(np.int64)

  def _rows(self, pairs: np.ndarray, table) -> dict[str, np.ndarray]:
    """The packed rows at (shard, row) pairs, in order, reading each shard once per call."""
    out: dict[str, list] = {}
    where = []  # the pairs' indices, in the order their rows are packed
    for s in dict.fromkeys(pairs[:, 0].tolist()):  # shards in order of first appearance
      sel = np.flatnonzero(pairs[:, 0] == s)
      z = self._shard(s)
      part = pack_rows(z["tokens"], z["loss_mask"], z["offsets"],
                       [table[s][int(r)] for r in pairs[sel, 1]], self.seq_len)
      del z  # a later shard may replace this one: keep no second reference to it
      for k, v in part.items():
        out.setdefault(k, []).append(v)
      where.append(sel)
    back = np.argsort(np.concatenate(where), kind="stable") if where else np.zeros(0, np.int64)
    return {k: np.concatenate(v)[back] for k, v in out.items()}

  def train_batch(self, step: int, batch_size: int, seed: int) -> dict[str, np.ndarray]:
    """Training batch `step` (0-based): a pure function of (step, batch_size, seed)."""
    per = self.steps_per_epoch(batch_size)
    epoch, pos = divmod(step, per)
    order = self._epoch_cache(epoch, seed)
    return self._rows(order[pos * batch_size:(pos + 1) * batch_size], self.train_rows)

  def _epoch_cache(self, epoch: int, seed: int) -> np.ndarray:
    key = (epoch, seed)
    if getattr(self, "_order_key", None) != key:
      self._order_key, self._order = key, self.epoch_order(epoch, seed)
    return self._order

  def train_batches(self, batch_size: int, seed: int = 0, start_step: int = 0,
                    ) -> Iterator[dict[str, np.ndarray]]:
    """Training batches from `start_step` on, endlessly (epoch after epoch)."""
    return _data.endless_batches(self, batch_size, seed, start_step)

  def eval_batches(self, batch_size: int, max_batches: int | None = None,
                   ) -> Iterator[dict[str, np.ndarray]]:
    """Held-out batches in stored order; the last is filled up by wrapping around."""
    pairs = np.array([(s, r) for s in range(self.corpus.num_shards)
                      for r in range(len(self.eval_rows[s]))], np.int64).reshape(-1, 2)
    for pick in _data.wrapped_batches(len(pairs), batch_size, max_batches):
      yield self._rows(pairs[pick], self.eval_rows)


# ----------------------------------------------------------------------------------------------
# The offline path: a hidden-state store (`jaxspec.train.data.Dataset`) from a corpus.


def write_corpus_dataset(target: Model, corpus: Corpus | str | os.PathLike,
                         out_dir: str | os.PathLike, *, seq_len: int = 1024,
                         hidden_layers: Sequence[int] = (), max_conversations: int | None = None,
                         hidden_batch_size: int = 8, progress: bool = True) -> Path:
  """Stores a corpus's conversations with the target's hidden states, one conversation a row
  (truncated to seq_len), in the layout `Dataset` reads: the offline path of head training
  (`jaxspec train KIND --corpus DIR`). Conversations are read in stored order, one shard at a
  time; the rows answering one prompt share a `prompt_index`, so the held-out split keeps them
  together.

  Args:
    target: the target that wrote the corpus.
    corpus: a `Corpus` or its directory.
    out_dir: the dataset directory to create.
    seq_len: tokens per row at most (longer conversations are cut).
    hidden_layers: target layers whose outputs to store (those the head reads).
    max_conversations: store at most this many (the first ones).
    hidden_batch_size: rows per hidden-state forward.
  Returns:
    out_dir as a Path.
  """
  check_int("seq_len", seq_len, 2, numpy=False, error=DataError)
  if max_conversations is not None:
    check_int("max_conversations", max_conversations, 1, numpy=False, error=DataError)
  corpus = corpus if isinstance(corpus, Corpus) else Corpus(corpus)
  corpus.check_target(target)
  out = Path(out_dir)
  if (out / "meta.json").exists():
    raise DataError(f"{out} already holds a dataset: reuse it (--data-dir {out}) or choose"
                    " another directory")
  nl = target.cfg.num_layers
  layers = tuple(dict.fromkeys(int(i) for i in hidden_layers))
  bad = [i for i in layers if not 0 <= i < nl]
  if bad:
    raise DataError(f"hidden layer {bad[0]} does not exist: the target has {nl} layers"
                    f" (0..{nl - 1})")
  rows, groups, group_of, temps = [], [], {}, set()
  for s in range(corpus.num_shards):
    z = corpus.load_shard(s)
    o = z["offsets"]
    for c in range(len(o) - 1):
      if max_conversations is not None and len(rows) >= max_conversations:
        break
      toks = z["tokens"][o[c]:o[c + 1]][:seq_len]
      mask = z["loss_mask"][o[c]:o[c + 1]][:seq_len]
      if not mask.any():  # cut before its first answer: nothing to learn
        continue
      key = (int(z["source"][c]), int(z["prompt"][c]))
      groups.append(group_of.setdefault(key, len(group_of)))
      temps.add(float(z["temperature"][c]))
      rows.append((toks, mask))
  if not rows:
    raise DataError(f"{corpus.path} holds no conversation with an answer within {seq_len}"
                    " tokens: raise seq_len or write more corpus")
  n = len(rows)
  lengths = np.array([len(t) for t, _ in rows], np.int32)
  width = int(lengths.max())
  tokens = np.zeros((n, width), np.int32)
  mask = np.zeros((n, width), np.uint8)
  for r, (t, m) in enumerate(rows):
    tokens[r, :len(t)] = t
    mask[r, :len(m)] = m
  out.mkdir(parents=True, exist_ok=True)
  np.save(out / "tokens.npy", tokens)
  np.save(out / "loss_mask.npy", mask)
  np.save(out / "lengths.npy", lengths)
  np.save(out / "prompt_lengths.npy", np.array([int(np.argmax(m)) for _, m in rows], np.int32))
  np.save(out / "prompt_index.npy", np.array(groups, np.int32))
  dcfg = DataConfig(hidden_layers=layers, hidden_batch_size=hidden_batch_size)
  with make_progress(progress) as bar:
    hidden_s = store_hidden_states(target, out, tokens, lengths, dcfg, bar)
  cc = corpus.index["config"]
  sources = corpus.sources
  counts: dict[str, int] = {}
  for (src, _), _g in group_of.items():
    counts[sources[src]] = counts.get(sources[src], 0) + 1
  meta = {
      "format": _data.FORMAT, "version": _data.VERSION,
      "target": {"name": target.name, "fingerprint": target_fingerprint(target),
                 "config": dataclasses.asdict(target.cfg)},
      "num_examples": n, "num_prompts": len(group_of), "skipped_long_prompts": 0,
      "seq_len": width, "hidden_size": target.cfg.hidden_size,
      "hidden_final": True, "hidden_layers": list(layers), "hidden_dtype": "float16",
      "prompt_files": counts, "responses": "target",
      "generation": {"max_prompt_len": cc["max_prompt_len"],
                     "max_new_tokens": cc["max_new_tokens"], "temperatures": sorted(temps),
                     "batch_size": cc["batch_size"], "chat": cc["chat"], "seed": cc["seed"],
                     "turns": cc["turns"]},
      "response_tokens": int(mask.sum()), "stopped_rows": None,
      "corpus": {"path": str(corpus.path), "conversations": n, "seq_len": seq_len},
      "seconds": {"generate": float(corpus.index.get("seconds", 0.0)),
                  "hidden": round(hidden_s, 2)},
      "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
  }
  _write_json(out / "meta.json", meta)  # last, and atomic: it marks a complete dataset
  return out
