"""Tokenizers for loaded checkpoints: Hugging Face `tokenizers` plus a jinja2 chat template.

`Tokenizer` wraps a `tokenizers.Tokenizer` built either from a GGUF file's metadata (BPE vocab
and merges, or SentencePiece pieces and scores) or from a Hugging Face `tokenizer.json`. Chat
templates render the way `transformers` renders them (sandboxed jinja2, `trim_blocks`,
`lstrip_blocks`, `raise_exception`, `bos_token` / `eos_token`), so prompts match token for token.
"""

from __future__ import annotations

import contextvars
import datetime
import functools
import json
import math
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from jaxspec.models.errors import CheckpointError

# GGUF token types (llama.cpp's llama_token_type).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

# Split patterns of the byte-level BPE pre-tokenizers, as in the models' own tokenizer.json.
_LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                   r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level_pre_tokenizer(pre: str | None) -> tuple[Any, Any, bool]:
  """(normalizer, pre-tokenizer, ignore_merges) for a GGUF `tokenizer.ggml.pre` name."""
  if pre in ("smollm", "starcoder", "refact"):
    # SmolLM's tokenizer.json: every digit on its own, then GPT-2's byte-level regex.
    return None, pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]), False
  if pre in (None, "default", "gpt-2", "gpt2"):
    return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True), False
  if pre in ("llama-bpe", "llama3", "llama-v3"):
    return None, pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_LLAMA3_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), True
  if pre == "qwen2":
    return normalizers.NFC(), pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]), False
  raise CheckpointError(
      f"GGUF tokenizer pre-tokenizer {pre!r} is not supported (supported: smollm, starcoder,"
      " refact, gpt-2, default, llama-bpe, qwen2): load the model from its Hugging Face directory"
      " instead, whose tokenizer.json describes the pre-tokenizer")


def _field_value(fields: Mapping[str, Any], key: str, default: Any = None) -> Any:
  """A metadata value from GGUFReader fields (ReaderField) or from a plain dict of values."""
  if key not in fields:
    return default
  value = fields[key]
  if not hasattr(value, "contents"):
    return value
  try:
    return value.contents()
  except (UnicodeDecodeError, ValueError, IndexError) as e:
    raise CheckpointError(f"GGUF metadata {key!r} is unreadable ({e}): the file is corrupt;"
                          " re-download or re-convert it") from e


def _spm_merges(pieces: Sequence[str], scores: Sequence[float],
                vocab: Mapping[str, int]) -> list[tuple[str, str]]:
  """BPE merges that reproduce SentencePiece's score-ordered merging of a piece vocabulary.

  Every piece that splits into two known pieces yields a merge ranked by the piece's score
  (higher first), which is how `transformers` converts SentencePiece models.
  """
  ranked = []
  for piece, score in zip(pieces, scores):
    local = [(piece[:i], piece[i:]) for i in range(1, len(piece))
             if piece[:i] in vocab and piece[i:] in vocab]
    local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
    ranked.extend((-score, vocab[piece], m) for m in local)
  ranked.sort(key=lambda r: (r[0], r[1]))
  return [m for _, _, m in ranked]


# Limits of one chat-template rendering. A checkpoint's template is code from the checkpoint's
# author, and `jaxspec generate` renders it by default: these bound what it can make the process
# do (real templates stay orders of magnitude below them). Past a limit, rendering stops with a
# ValueError (also a `jinja2.sandbox.SecurityError`) naming the template and the limit.
MAX_TEMPLATE_CHARS = 1 << 24  # characters of output, and of any string or list it builds
MAX_TEMPLATE_STEPS = 1_000_000  # loop iterations and range() items, together
MAX_TEMPLATE_SECONDS = 10.0  # wall-clock time of one rendering
# The most tokens a tokenizer may hold, checked before a GGUF's tokens are read: real
# vocabularies have at most 262,144, so four times that refuses only a corrupt or hostile file.
MAX_VOCAB = 1 << 20
# The largest tokenizer.json read, checked before it is parsed (a parse holds several times the
# file): real ones are at most a few tens of MB (Gemma 3's 262,144 tokens: 33 MB).
MAX_TOKENIZER_JSON_BYTES = 128 << 20


class _Budget:
  """What one rendering has spent: steps (loop iterations and range items) and time."""

  def __init__(self, source: str):
    self.source, self.steps = source, 0
    self.deadline = time.monotonic() + MAX_TEMPLATE_SECONDS

  def exceeded(self, what: str):
    from jinja2.sandbox import SecurityError
    return SecurityError(f"the chat template of {self.source} exceeded {what}")

  def charge(self, n: int) -> None:
    self.steps += n
    if self.steps > MAX_TEMPLATE_STEPS:
      raise self.exceeded(f"the limit of {MAX_TEMPLATE_STEPS:,} loop iterations and range()"
                          " items per rendering")
    if time.monotonic() > self.deadline:
      raise self.exceeded(f"the limit of {MAX_TEMPLATE_SECONDS:g} s per rendering")

  def size(self, n: int, what: str) -> None:
    if n > MAX_TEMPLATE_CHARS:
      raise self.exceeded(f"the limit of {MAX_TEMPLATE_CHARS:,} characters or items per"
                          f" output, string or list ({what} of {n:,})")


# The budget of the rendering in progress (one per thread or task; None outside a rendering).
_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar("_BUDGET", default=None)


def _budget() -> _Budget:
  return _BUDGET.get() or _Budget("this tokenizer")


def _charged(iterable):
  """`iterable`'s items, each charged one step of the rendering's budget."""
  budget = _budget()
  for x in iterable:
    budget.charge(1)
    yield x


def _length(x: Any) -> int | None:
  return len(x) if isinstance(x, (str, bytes, list, tuple)) else None


@functools.cache
def _bounded_environment_class():
  """An `ImmutableSandboxedEnvironment` whose templates cannot exhaust the process: loops and
  range() draw on a per-rendering step budget (the template's For loops are rewritten to iterate
  through `_charged`; `range` is `_chat_environment`'s), and the operators, methods and
  filters that multiply sizes (`*`, `+`, `~`, `**`, `join`, padding, `center`, `indent`) check
  the size of their result before building it."""
  from jinja2 import nodes
  from jinja2.sandbox import ImmutableSandboxedEnvironment
  from jinja2.visitor import NodeTransformer

  class Bound(NodeTransformer):
    def visit_For(self, node):
      self.generic_visit(node)
      node.iter = nodes.Call(nodes.EnvironmentAttribute("_charged"), [node.iter], [], None,
                             None, lineno=node.lineno)
      return node

    def visit_Concat(self, node):
      self.generic_visit(node)
      return nodes.Call(nodes.EnvironmentAttribute("_concat"), list(node.nodes), [], None, None,
                        lineno=node.lineno)

  class BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "**"})

    def _parse(self, source, name, filename):
      tree = Bound().visit(super()._parse(source, name, filename))
      tree.set_environment(self)
      return tree

    _charged = staticmethod(_charged)

    def _concat(self, *parts):
      budget = _budget()
      strs = [str(p) for p in parts]  # as jinja2's str_join
      budget.size(sum(map(len, strs)), "a ~ concatenation")
      return "".join(strs)

    def call_binop(self, context, operator, left, right):
      budget = _budget()
      if operator == "*":
        for seq, n in ((left, right), (right, left)):
          if _length(seq) is not None and isinstance(n, int):
            budget.size(_length(seq) * max(n, 0), "a repetition")
      elif operator == "+" and _length(left) is not None and _length(right) is not None:
        budget.size(_length(left) + _length(right), "a concatenation")
      elif (operator == "**" and isinstance(left, int) and isinstance(right, int)
            and abs(left) > 1 and right > 0 and right * math.log2(abs(left)) > 4096):
        raise budget.exceeded(f"the limit of 4096-bit integers ({left} ** {right})")
      return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
      budget = _budget()
      method = getattr(__obj, "__name__", None)
      if isinstance(getattr(__obj, "__self__", None), str):
        if method in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
          budget.size(args[0], f"str.{method}")
        elif method == "join" and args and isinstance(args[0], (list, tuple)):
          budget.size(sum(len(x) for x in args[0] if isinstance(x, str)), "str.join")
        elif method == "expandtabs":
          budget.size(len(__obj.__self__) * (args[0] if args and isinstance(args[0], int)
                                             else 8), "str.expandtabs")
      return super().call(__context, __obj, *args, **kwargs)

  return BoundedEnvironment


def _chat_environment():
  """The sandboxed jinja2 environment `transformers` renders chat templates with."""
  import jinja2
  from jinja2 import nodes, pass_eval_context
  from jinja2.ext import Extension
  from jinja2.filters import do_center, do_indent, do_join

  class GenerationTag(Extension):
    # `{% generation %}...{% endgeneration %}` marks assistant text for training masks in
    # transformers; for rendering it is a no-op around its body.
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
      return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
      return caller()

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)

  def strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)

  def bounded_range(*args):
    r = range(*args)
    try:
      n = len(r)
    except OverflowError:  # more than sys.maxsize items
      n = MAX_TEMPLATE_STEPS + 1
    _budget().charge(n)
    return r

  @pass_eval_context
  def join(eval_ctx, value, d="", attribute=None):
    items = list(_charged(value))
    _budget().size(sum(len(x) for x in items if isinstance(x, str)) + len(d) * len(items),
                   "a join")
    return do_join(eval_ctx, items, d, attribute)

  def center(value, width=80):
    _budget().size(width if isinstance(width, int) else 0, "a center width")
    return do_center(value, width)

  def indent(s, width=4, first=False, blank=False):
    lines = str(s).count("\n") + 1
    _budget().size(len(str(s)) + lines * (width if isinstance(width, int) else len(str(width))),
                   "an indent")
    return do_indent(s, width, first, blank)

  env = _bounded_environment_class()(trim_blocks=True, lstrip_blocks=True,
                                     extensions=[GenerationTag, jinja2.ext.loopcontrols])
  env.filters.update(tojson=tojson, join=join, center=center, indent=indent)
  env.globals["range"] = bounded_range
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env


_CHAT_TEMPLATE_ERRORS: dict[type, type] = {}


def _chat_template_error(e: Exception, message: str) -> Exception:
  """`e` as a ValueError (the documented type of bad input) that is still an instance of its
  jinja2 class (a template's own raise_exception gives a TemplateError, an unsafe template a
  SecurityError, as in transformers), with `message` as its text."""
  cls = _CHAT_TEMPLATE_ERRORS.get(type(e))
  if cls is None:
    cls = type("ChatTemplateError", (ValueError, type(e)), {
        "__init__": lambda self, msg: ValueError.__init__(self, msg),
        "__str__": lambda self: ValueError.__str__(self)})
    _CHAT_TEMPLATE_ERRORS[type(e)] = cls
  err = cls(message)
  err.__dict__.update({k: v for k, v in vars(e).items() if k != "args"})
  return err


def _template_failed(e: Exception) -> str:
  return (f"the model's chat template failed: {type(e).__name__}: {e}; fix the checkpoint's"
          " chat_template, or pass a plain prompt (--no-chat)")


def _short(value: Any) -> str:
  text = repr(value)
  return text if len(text) <= 60 else text[:57] + "..."


def _as_list(value: Any) -> list:
  """A metadata array as a list: GGUFReader fields give lists, `_read_gguf` numpy views."""
  return value.tolist() if isinstance(value, np.ndarray) else list(value)


class Tokenizer:
  """Text <-> token ids for one model, with its chat template and end-of-sequence ids.

  Attributes:
    backend: the wrapped `tokenizers.Tokenizer`.
    chat_template: jinja2 source of the chat template, or None.
    template_source: where the template came from (a file, a GGUF key), for error messages.
    bos_token, eos_token: their strings (template variables), or None.
    bos_token_id: id of the BOS token, or None.
    eos_token_ids: ids that end a generation.
    add_bos: whether `encode` prepends BOS (the model's own setting; chat templates write BOS
      themselves).
  """

  def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None = None,
               bos_token: str | None = None, eos_token: str | None = None,
               eos_token_ids: Iterable[int] = (), add_bos: bool = False,
               extra_template_vars: Mapping[str, Any] | None = None,
               template_source: str | None = None):
    self.template_source = template_source or "this tokenizer"
    if chat_template is not None and not isinstance(chat_template, str):
      raise CheckpointError(
          f"{self.template_source}: the chat template is not a string of jinja2 source but"
          f" {type(chat_template).__name__} {_short(chat_template)}; fix or remove it in the"
          " checkpoint")
    self.backend = backend
    self.chat_template = chat_template
    self.bos_token = bos_token
    self.eos_token = eos_token
    self.bos_token_id = None if bos_token is None else backend.token_to_id(bos_token)
    ids = list(eos_token_ids)
    eos_id = None if eos_token is None else backend.token_to_id(eos_token)
    if eos_id is not None and eos_id not in ids:
      ids.insert(0, eos_id)
    self.eos_token_ids = tuple(int(i) for i in ids)
    self.add_bos = bool(add_bos) and self.bos_token_id is not None
    self._template_vars = dict(extra_template_vars or {})
    self._compiled = None

  def __repr__(self) -> str:
    return (f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids},"
            f" add_bos={self.add_bos}, chat_template={self.chat_template is not None})")

  @property
  def vocab_size(self) -> int:
    """Number of token ids, added tokens included."""
    return self.backend.get_vocab_size(with_added_tokens=True)

  def token_to_id(self, token: str) -> int | None:
    return self.backend.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self.backend.id_to_token(int(token_id))

  # -- encoding -------------------------------------------------------------------------------

  def encode(self, text: str, *, add_bos: bool | None = None) -> list[int]:
    """Token ids of `text`; BOS is prepended only when `add_bos` (default: the model's)."""
    ids = self.backend.encode(text, add_special_tokens=False).ids
    if (self.add_bos if add_bos is None else add_bos) and self.bos_token_id is not None:
      ids = [self.bos_token_id] + ids
    return ids

  def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
    """Text of `ids` (any int iterable, e.g. a numpy row)."""
    return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]],
                          add_generation_prompt: bool = True, **kwargs: Any) -> str:
    """Renders `messages` ([{"role": ..., "content": ...}, ...]) with the model's template.

    Extra keyword arguments become template variables (e.g. `tools`, `enable_thinking`).
    Rendering is sandboxed and bounded: at most `MAX_TEMPLATE_CHARS` characters of output (and
    per string or list the template builds), `MAX_TEMPLATE_STEPS` loop iterations and range()
    items, and `MAX_TEMPLATE_SECONDS` seconds.

    Raises:
      ValueError: the template fails, raises, or passes a limit (the message names the
        template and the limit); the error is also an instance of the jinja2 error behind it
        (`jinja2.TemplateError`, `jinja2.sandbox.SecurityError` for a limit).
    """
    if self.chat_template is None:
      raise ValueError("this tokenizer has no chat template: pass a plain prompt string to"
                       " `encode`, or load a checkpoint whose metadata has one")
    import jinja2
    budget = _Budget(self.template_source)
    token = _BUDGET.set(budget)
    try:
      if self._compiled is None:
        self._compiled = _chat_environment().from_string(self.chat_template)
      variables = dict(self._template_vars)
      variables.update(bos_token=self.bos_token or "", eos_token=self.eos_token or "",
                       tools=None, documents=None)
      variables.update(kwargs)
      chunks, n = [], 0
      for chunk in self._compiled.generate(messages=[dict(m) for m in messages],
                                           add_generation_prompt=add_generation_prompt,
                                           **variables):
        n += len(chunk)
        budget.size(n, "the output")
        chunks.append(chunk)
      return "".join(chunks)
    except (MemoryError, RecursionError, OverflowError) as e:  # what the limits do not foresee
      limit = budget.exceeded(f"what a rendering may do ({type(e).__name__}: {e})")
      raise _chat_template_error(limit, _template_failed(limit)) from e
    except jinja2.TemplateError as e:  # a broken template, a limit, or its own raise_exception
      raise _chat_template_error(e, _template_failed(e)) from e
    finally:
      _BUDGET.reset(token)

  def encode_chat(self, prompt_or_messages: str | Sequence[Mapping[str, Any]],
                  add_generation_prompt: bool = True) -> list[int]:
    """Prompt ids for a user message string or a message list, via the chat template.

    The rendered template carries its own BOS where the model wants one, so none is added.
    Without a chat template a plain string is encoded as is.
    """
    if isinstance(prompt_or_messages, str):
      if self.chat_template is None:
        return self.encode(prompt_or_messages)
      messages = [{"role": "user", "content": prompt_or_messages}]
    else:
      messages = list(prompt_or_messages)
    text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return self.encode(text, add_bos=False)

  # -- streaming ------------------------------------------------------------------------------

  def stream_decoder(self, skip_special_tokens: bool = True) -> "StreamDecoder":
    return StreamDecoder(self, skip_special_tokens=skip_special_tokens)

  def decode_stream(self, ids: Iterable[int], skip_special_tokens: bool = True) -> Iterator[str]:
    """Yields the text of `ids` in complete pieces as they arrive (no split UTF-8 characters)."""
    stream = StreamDecoder(self, skip_special_tokens=skip_special_tokens)
    for i in ids:
      piece = stream.push(i)
      if piece:
        yield piece
    tail = stream.flush()
    if tail:
      yield tail

  # -- constructors ---------------------------------------------------------------------------

  @classmethod
  def from_gguf(cls, fields: Mapping[str, Any], *, source: str | None = None) -> "Tokenizer":
    """Builds the tokenizer described by GGUF metadata.

    Args:
      fields: `gguf.GGUFReader(...).fields`, or a dict of plain metadata values (arrays as
        lists or numpy arrays).
      source: where the metadata came from, for error messages (the file's path).
    Raises:
      CheckpointError: no tokenizer, an unsupported one, more than `MAX_VOCAB` tokens, or a
        chat template that is not a string.
    """
    model = _field_value(fields, "tokenizer.ggml.model")
    tokens = _field_value(fields, "tokenizer.ggml.tokens")
    if model is None or tokens is None:
      raise CheckpointError("GGUF file has no tokenizer (tokenizer.ggml.model / tokens metadata"
                            " missing): load the model's Hugging Face directory instead")
    if len(tokens) > MAX_VOCAB:
      raise CheckpointError(f"{source or 'GGUF tokenizer'}: {len(tokens)} tokens, more than"
                            f" jaxspec's vocabulary limit of {MAX_VOCAB}; the file is corrupt")
    types = _field_value(fields, "tokenizer.ggml.token_type")
    types = [_NORMAL] * len(tokens) if types is None else _as_list(types)
    if len(types) != len(tokens):
      raise CheckpointError(f"GGUF tokenizer has {len(tokens)} tokens but {len(types)} token"
                            " types: the file's metadata is corrupt")
    vocab = {}
    for i, t in enumerate(tokens):
      vocab.setdefault(t, i)

    def token(key):
      i = _field_value(fields, key)
      return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    bos, eos = token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id")
    unk = token("tokenizer.ggml.unknown_token_id")
    eos_ids = [i for i in (_field_value(fields, f"tokenizer.ggml.{k}_token_id")
                           for k in ("eos", "eot", "eom")) if i is not None]
    if model == "gpt2":
      merges = _field_value(fields, "tokenizer.ggml.merges")
      if merges is None:
        raise CheckpointError("GGUF BPE tokenizer has no tokenizer.ggml.merges: the file is"
                              " incomplete; re-convert it with llama.cpp's convert_hf_to_gguf")
      pairs = []
      for m in merges:
        a, sep, b = m.partition(" ")
        if not sep:
          raise CheckpointError(f"GGUF merge {m!r} is not two tokens separated by a space")
        pairs.append((a, b))
      normalizer, pre, ignore_merges = _byte_level_pre_tokenizer(
          _field_value(fields, "tokenizer.ggml.pre"))
      backend = tokenizers.Tokenizer(models.BPE(vocab, pairs, ignore_merges=ignore_merges))
      if normalizer is not None:
        backend.normalizer = normalizer
      backend.pre_tokenizer = pre
      backend.decoder = decoders.ByteLevel()
      default_add_bos = False
    elif model == "llama":
      scores = _field_value(fields, "tokenizer.ggml.scores")
      scores = None if scores is None else _as_list(scores)
      if scores is None or len(scores) != len(tokens):
        raise CheckpointError("GGUF SentencePiece tokenizer needs one tokenizer.ggml.scores"
                              " entry per token: the file's metadata is incomplete")
      backend = tokenizers.Tokenizer(models.BPE(
          vocab, _spm_merges(tokens, scores, vocab), unk_token=unk, fuse_unk=True,
          byte_fallback=True))
      prefix = _field_value(fields, "tokenizer.ggml.add_space_prefix", True)
      steps = [normalizers.Prepend("▁")] if prefix else []
      backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "▁")])
      dec = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
      if prefix:
        dec.append(decoders.Strip(content=" ", left=1, right=0))
      backend.decoder = decoders.Sequence(dec)
      default_add_bos = True
    else:
      raise CheckpointError(
          f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2' byte-level BPE,"
          " 'llama' SentencePiece): load the model's Hugging Face directory instead")
    special = [AddedToken(t, special=True, normalized=False)
               for t, ty in zip(tokens, types) if ty == _CONTROL]
    user = [AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == _USER_DEFINED]
    if special:
      backend.add_special_tokens(special)
    if user:
      backend.add_tokens(user)
    return cls(backend, chat_template=_field_value(fields, "tokenizer.chat_template"),
               bos_token=bos, eos_token=eos, eos_token_ids=eos_ids,
               add_bos=_field_value(fields, "tokenizer.ggml.add_bos_token", default_add_bos),
               extra_template_vars={"unk_token": unk or ""},
               template_source=(f"{source}: tokenizer.chat_template" if source else
                                "GGUF metadata tokenizer.chat_template"))

  @classmethod
  def from_hf_dir(cls, path: str | Path, eos_token_ids: Iterable[int] = ()) -> "Tokenizer":
    """Loads `tokenizer.json` (+ `tokenizer_config.json`, `chat_template.jinja`) from `path`.

    Args:
      path: a Hugging Face model directory.
      eos_token_ids: extra end-of-sequence ids (from config.json / generation_config.json).
    """
    path = Path(path)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
      raise CheckpointError(f"{path} has no tokenizer.json: save the tokenizer with"
                            " `tokenizer.save_pretrained` (a fast tokenizer) into that directory")
    size = tok_file.stat().st_size
    if size > MAX_TOKENIZER_JSON_BYTES:
      raise CheckpointError(
          f"{tok_file} is {size / 2**20:.0f} MiB, past jaxspec's limit of"
          f" {MAX_TOKENIZER_JSON_BYTES >> 20} MiB for a tokenizer.json (real ones are at most a"
          " few tens of MB): the file is corrupt or not a tokenizer; save it again with"
          " `tokenizer.save_pretrained`")
    try:
      backend = tokenizers.Tokenizer.from_file(str(tok_file))
    except Exception as e:  # tokenizers raises plain Exception subclasses for bad JSON.
      raise CheckpointError(f"{tok_file} is not a valid tokenizers file: {e}") from e
    if backend.get_vocab_size(with_added_tokens=True) > MAX_VOCAB:
      raise CheckpointError(
          f"{tok_file} holds {backend.get_vocab_size(with_added_tokens=True)} tokens, past"
          f" jaxspec's vocabulary limit of {MAX_VOCAB}; the file is corrupt")
    config = {}
    config_file = path / "tokenizer_config.json"
    if config_file.is_file():
      try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
      except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config_file} is not valid JSON: {e}") from e

    def token_str(value):
      if isinstance(value, dict):
        value = value.get("content")
      return value if isinstance(value, str) else None

    template = config.get("chat_template")
    source = f"{config_file}: chat_template"
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
      for i, t in enumerate(template):
        if not (isinstance(t, dict) and isinstance(t.get("template"), str)):
          raise CheckpointError(
              f"{config_file}: chat_template entry {i} ({_short(t)}) is not"
              ' {"name": ..., "template": "<jinja2 source>"}; fix or remove it, or pass a plain'
              " prompt (--no-chat)")
      named = {t.get("name"): t["template"] for t in template}
      template = named.get("default", next(iter(named.values()), None))
    jinja_file = path / "chat_template.jinja"
    if template is None and jinja_file.is_file():
      template = jinja_file.read_text(encoding="utf-8")
      source = str(jinja_file)
    bos, eos = token_str(config.get("bos_token")), token_str(config.get("eos_token"))
    add_bos = config.get("add_bos_token")
    if add_bos is None and bos is not None:
      # No explicit setting: follow the tokenizer.json post-processor (Llama's adds <s>).
      bos_id = backend.token_to_id(bos)
      with_special = backend.encode("a", add_special_tokens=True).ids
      add_bos = bool(with_special) and with_special[0] == bos_id and (
          backend.encode("a", add_special_tokens=False).ids[:1] != [bos_id])
    extra = {k: token_str(config.get(k)) or "" for k in ("unk_token", "pad_token")}
    return cls(backend, chat_template=template, bos_token=bos, eos_token=eos,
               eos_token_ids=eos_token_ids, add_bos=bool(add_bos), extra_template_vars=extra,
               template_source=source)


class StreamDecoder:
  """Turns token ids arriving one at a time into text pieces that are safe to print.

  Text is decoded over a short window of recent ids and emitted only once it no longer ends in
  U+FFFD, the mark of a UTF-8 character whose bytes have not all arrived yet (byte-level BPE
  splits characters across tokens). Decoding a window rather than single ids keeps spaces that
  SentencePiece decoders would strip from the start of a piece.
  """

  def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
    self._tok = tokenizer
    self._skip = skip_special_tokens
    self._ids: list[int] = []
    self._prefix = 0  # start of the decode window
    self._read = 0  # ids before this have been emitted

  def _text(self, start: int, end: int | None = None) -> str:
    return self._tok.decode(self._ids[start:end], skip_special_tokens=self._skip)

  def push(self, token_ids: int | Iterable[int]) -> str:
    """Adds one id (or several) and returns the newly complete text ("" if none yet)."""
    if np.ndim(token_ids) == 0:
      self._ids.append(int(token_ids))
    else:
      self._ids.extend(int(i) for i in np.asarray(token_ids).reshape(-1))
    done = self._text(self._prefix, self._read)
    text = self._text(self._prefix)
    if len(text) > len(done) and not text.endswith("\ufffd"):
      self._prefix, self._read = self._read, len(self._ids)
      return text[len(done):]
    return ""

  def flush(self) -> str:
    """Whatever is still held back (possibly an incomplete character, shown as U+FFFD)."""
    done = self._text(self._prefix, self._read)
    text = self._text(self._prefix)
    self._prefix = self._read = len(self._ids)
    return text[len(done):]
