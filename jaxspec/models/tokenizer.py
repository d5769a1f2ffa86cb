"""Tokenizers for loaded checkpoints: Hugging Face `tokenizers` plus a jinja2 chat template.

`Tokenizer` wraps a `tokenizers.Tokenizer` built either from a GGUF file's metadata (BPE vocab
and merges, or SentencePiece pieces and scores) or from a Hugging Face `tokenizer.json`. Chat
templates render the way `transformers` renders them (sandboxed jinja2, `trim_blocks`,
`lstrip_blocks`, `raise_exception`, `bos_token` / `eos_token`), so prompts match token for token.
"""

from __future__ import annotations

import builtins
import contextvars
import datetime
import functools
import itertools
import json
import math
import re
import time
from collections import abc
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

from jaxspec.models.errors import CheckpointError, read_json

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
  (higher first), which is how `transformers` converts SentencePiece models. That tries every
  split of every piece, time quadratic in a piece's length: past `MAX_SPM_SPLIT_WORK` (the sum
  of the pieces' squared lengths; real vocabularies stay below a hundredth of it) it is a
  CheckpointError instead of minutes of work.
  """
  work = sum(len(p) ** 2 for p in pieces)
  if work > MAX_SPM_SPLIT_WORK:
    longest = max(pieces, key=len)
    raise CheckpointError(
        f"'tokenizer.ggml.tokens' holds pieces too long to convert (the longest has"
        f" {len(longest):,} characters; the sum of squared lengths is {work:,}, past jaxspec's"
        f" limit of {MAX_SPM_SPLIT_WORK:,}): the file is corrupt; re-download or re-convert it")
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
# Characters every {{ ... }} and piece of template text emit in one rendering, together: also
# what set blocks, macros and call blocks build and may drop (macros count again where their
# result is printed, so a few times the output limit).
MAX_TEMPLATE_EMITTED = 4 * MAX_TEMPLATE_CHARS
# The most tokens a tokenizer may hold, checked before a GGUF's tokens are read: real
# vocabularies have at most 262,144, so four times that refuses only a corrupt or hostile file.
MAX_VOCAB = 1 << 20
# The most work building SentencePiece merges may take: the sum of the pieces' squared lengths
# (`_spm_merges` tries every split of every piece): 262,144 pieces of 10 characters sum to about
# 3 * 10^7; 10^10 takes about a second.
MAX_SPM_SPLIT_WORK = 10 ** 10
# The largest tokenizer.json read, checked before it is parsed (a parse holds several times the
# file): real ones are at most a few tens of MB (Gemma 3's 262,144 tokens: 33 MB).
MAX_TOKENIZER_JSON_BYTES = 128 << 20


class _Budget:
  """What one rendering has spent: steps (loop iterations and range items) and time."""

  def __init__(self, source: str):
    self.source, self.steps, self.emitted = source, 0, 0
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

  def emit(self, n: int) -> None:
    self.size(n, "a printed value")
    self.emitted += n
    if self.emitted > MAX_TEMPLATE_EMITTED:
      raise self.exceeded(f"the limit of {MAX_TEMPLATE_EMITTED:,} characters printed per"
                          " rendering (in all, set blocks and macros included)")


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


_END = object()


def _text_size(x: Any, indent: int = 0, sep: int = 2) -> int:
  """An estimate, at least len(str(x)) and len(repr(x)) up to escapes (a factor of at most 6),
  of the text that printing `x` makes: containers are walked, so that a list of many references
  to one long string is measured before it is printed. `indent` adds what json's or pprint's
  indentation adds per item, `sep` the separator's characters per item. The walk stops once
  past MAX_TEMPLATE_CHARS (the value returned is then past it too), and structures nested
  deeper than 256 levels count as past it."""
  limit, total, stack = MAX_TEMPLATE_CHARS, 0, [iter((x,))]
  while stack and total <= limit:
    y = next(stack[-1], _END)
    if y is _END:
      stack.pop()
      continue
    depth = len(stack)
    total += sep + (indent * depth + 1 if indent else 0)  # a separator, a newline, its indent
    if isinstance(y, (str, bytes)):
      total += len(y)
    elif isinstance(y, (bool, float)) or y is None:
      total += 24
    elif isinstance(y, int):
      total += y.bit_length() // 3 + 2
    elif depth > 256:
      return limit + 1
    elif isinstance(y, Mapping):
      stack.append(itertools.chain.from_iterable(y.items()))
    elif isinstance(y, (list, tuple, set, frozenset, abc.MappingView)):
      stack.append(iter(y))
    elif isinstance(y, _jinja2_namespace()):
      stack.append(itertools.chain.from_iterable(object.__getattribute__(
          y, "_Namespace__attrs").items()))
    else:  # another object (Undefined, a macro, a loop): its own short text
      total += 64
  return total


@functools.cache
def _jinja2_namespace() -> type:
  from jinja2.utils import Namespace
  return Namespace


# A printf conversion: %[(key)][flags][width][.precision][length]type
_PRINTF = re.compile(r"%(?:\(([^)]*)\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)


def _check_formatting(fmt: str, fields: Iterable[tuple[Any, str, list, bool]],
                      args: Sequence[Any], kwargs: Mapping[str, Any], what: str) -> None:
  """Refuses a formatting whose result could pass MAX_TEMPLATE_CHARS, before it is built.
  `fields` gives each replacement field as (key of its value, its spec text, keys of the
  values that give its width or precision, whether those are read before the value); a key is
  an int position, a str name, or None for the next position. The bound: the format string,
  plus per field the printed size of its value (so one long value read by many fields counts
  each time) and its widths, literal or read from the values."""
  budget, sizes, auto = _budget(), {}, 0
  total = len(fmt)

  def value(key):
    return (args[key] if isinstance(key, int) and 0 <= key < len(args)
            else kwargs.get(key) if isinstance(key, str) else None)

  for key, spec, width_keys, widths_first in fields:
    order = [*width_keys, key] if widths_first else [key, *width_keys]
    resolved = []
    for k in order:
      if k is None:
        k, auto = auto, auto + 1
      resolved.append(k)
    if widths_first:
      *widths, key = resolved
    else:
      key, *widths = resolved
    if key not in sizes:
      v = value(key)
      sizes[key] = 0 if v is None else _text_size(v)
    total += sizes[key] + sum(int(d) if len(d) < 12 else 10 ** 12
                              for d in re.findall(r"\d+", spec))
    for w in map(value, widths):
      if isinstance(w, int) and not isinstance(w, bool):
        total += abs(w)
    if total > MAX_TEMPLATE_CHARS:
      budget.size(total, what)


def _joined_size(items: Sequence[Any], sep: Any) -> int:
  """At least the length of `sep` joining `items` (each printed: `_text_size` for non-strings)."""
  return (sum(len(x) if isinstance(x, str) else _text_size(x) for x in items)
          + len(sep if isinstance(sep, (str, bytes)) else str(sep)) * len(items))


def _replaced_size(s: Any, old: Any, new: Any, count: Any = -1) -> int:
  """len(s.replace(old, new, count)), counted without building it."""
  s, old, new = (x if isinstance(x, (str, bytes)) else str(x) for x in (s, old, new))
  if type(old) is not type(s):  # str.replace refuses it
    return len(s)
  n = s.count(old) if old else len(s) + 1
  if isinstance(count, int) and count >= 0:
    n = min(n, count)
  return len(s) + n * max(len(new) - len(old), 0)


def _printf_fields(fmt: str) -> Iterator[tuple[Any, str, list, bool]]:
  """The conversions of a printf format (`_check_formatting`'s fields): a `*` width or precision
  reads the next value before the converted one."""
  for m in _PRINTF.finditer(fmt):
    if m.group(4) != "%":
      width, precision = m.group(2) or "", m.group(3) or ""
      yield m.group(1), f"{width}.{precision}", [None] * (width + precision).count("*"), True


def _check_printf(fmt: str, values: Any) -> None:
  """`fmt % values` (the % operator on a string, the format filter)."""
  if isinstance(values, Mapping):
    # "%s" without a key prints the mapping itself (position 0 here)
    _check_formatting(fmt, _printf_fields(fmt), (values,), values, "a % format")
  else:
    args = values if isinstance(values, tuple) else (values,)
    _check_formatting(fmt, ((None, spec, w, first) for _, spec, w, first in _printf_fields(fmt)),
                      args, {}, "a % format")


def _format_key(name: str) -> Any:
  head = re.split(r"[.\[]", name, maxsplit=1)[0]
  return None if head == "" else int(head) if head.isdigit() else head


def _format_fields(fmt: str) -> Iterator[tuple[Any, str, list, bool]]:
  """The replacement fields of a str.format string (`_check_formatting`'s fields): a field in
  the spec ("{:{w}}") gives a width, read after the value."""
  import string
  parse = string.Formatter().parse
  for _, name, spec, _ in parse(fmt):
    if name is None:
      continue
    spec = spec or ""
    nested = [_format_key(n) for _, n, _, _ in parse(spec) if n is not None] if "{" in spec else []
    yield _format_key(name), spec, nested, False


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

    def visit_Output(self, node):  # every {{ ... }} and piece of text, wherever it is emitted
      self.generic_visit(node)
      node.nodes = [nodes.Call(nodes.EnvironmentAttribute("_emit"), [child], [], None, None,
                               lineno=child.lineno) for child in node.nodes]
      return node

  class BoundedEnvironment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"*", "+", "**", "%"})

    def _parse(self, source, name, filename):
      tree = Bound().visit(super()._parse(source, name, filename))
      tree.set_environment(self)
      return tree

    _charged = staticmethod(_charged)

    def _emit(self, value):
      _budget().emit(len(value) if isinstance(value, str) else _text_size(value))
      return value

    def _concat(self, *parts):
      budget = _budget()
      budget.size(sum(len(p) if isinstance(p, str) else _text_size(p) for p in parts),
                  "a ~ concatenation")
      strs = [str(p) for p in parts]  # as jinja2's str_join
      budget.size(sum(map(len, strs)), "a ~ concatenation")
      return "".join(strs)

    def call_binop(self, context, operator, left, right):
      budget = _budget()
      ints = (isinstance(left, int) and isinstance(right, int)
              and not isinstance(left, bool) and not isinstance(right, bool))
      if operator == "*" and ints:
        if left.bit_length() + right.bit_length() > 4096:
          raise budget.exceeded(f"the limit of 4096-bit integers (a product of"
                                f" {left.bit_length()}- and {right.bit_length()}-bit integers)")
      elif operator == "*":
        for seq, n in ((left, right), (right, left)):
          if _length(seq) is not None and isinstance(n, int):
            budget.size(_length(seq) * max(n, 0), "a repetition")
      elif operator == "+" and _length(left) is not None and _length(right) is not None:
        budget.size(_length(left) + _length(right), "a concatenation")
      elif (operator == "**" and ints
            and abs(left) > 1 and right > 0 and right * math.log2(abs(left)) > 4096):
        raise budget.exceeded(f"the limit of 4096-bit integers ({left} ** {right})")
      elif operator == "%" and isinstance(left, str):
        _check_printf(left, right)
      return super().call_binop(context, operator, left, right)

    def wrap_str_format(self, value):
      wrapper = super().wrap_str_format(value)
      if wrapper is None:
        return None
      fmt, is_map = value.__self__, value.__name__ == "format_map"

      def checked(*args, **kwargs):
        mapping = args[0] if is_map and len(args) == 1 and isinstance(args[0], Mapping) else {}
        _check_formatting(fmt, _format_fields(fmt), () if is_map else args,
                          mapping if is_map else kwargs, f"str.{value.__name__}")
        return wrapper(*args, **kwargs)
      return functools.update_wrapper(checked, wrapper)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja2's signature
      budget = _budget()
      method = getattr(__obj, "__name__", None)
      owner = getattr(__obj, "__self__", None)
      if isinstance(owner, (str, bytes)):
        if method in ("ljust", "rjust", "center", "zfill") and args and isinstance(args[0], int):
          budget.size(args[0], f"str.{method}")
        elif method == "join" and args:
          items = list(_charged(args[0]))  # read once here: it may be a generator
          args = (items, *args[1:])
          budget.size(_joined_size(items, owner), "str.join")
        elif method == "expandtabs":
          budget.size(len(owner) * (args[0] if args and isinstance(args[0], int)
                                    else 8), "str.expandtabs")
        elif method == "replace" and len(args) >= 2:
          budget.size(_replaced_size(owner, *args[:3]), "str.replace")
        elif method == "translate" and args and isinstance(args[0], Mapping):
          longest = max((len(v) for v in args[0].values() if isinstance(v, (str, bytes))),
                        default=1)
          budget.size(len(owner) * max(longest, 1), "str.translate")
      elif isinstance(owner, int) and method == "to_bytes":
        length = args[0] if args else kwargs.get("length", 1)
        if isinstance(length, int):
          budget.size(length, "int.to_bytes")
      return super().call(__context, __obj, *args, **kwargs)

  return BoundedEnvironment


def _chat_environment():
  """The sandboxed jinja2 environment `transformers` renders chat templates with."""
  import jinja2
  from jinja2 import nodes, pass_environment, pass_eval_context
  from jinja2.ext import Extension
  from jinja2.filters import (do_batch, do_center, do_format, do_indent, do_join, do_pprint,
                              do_replace, do_wordwrap, make_attrgetter, sync_do_slice)
  from markupsafe import soft_str

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
    width = indent if isinstance(indent, int) else len(indent) if isinstance(indent, str) else 0
    budget = _budget()
    sep = max([2, *(len(x) for x in separators if isinstance(x, str))]) if separators else 2
    budget.size(_text_size(x, indent=max(width, 0) + 1 if indent is not None else 0, sep=sep),
                "a tojson")
    text = json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)
    budget.size(len(text), "a tojson")  # escapes may make it longer than estimated
    return text

  # Filters whose result can be much larger than their input: each checks its size first.
  def printf(value, *args, **kwargs):
    _check_printf(str(value), kwargs or args)
    return do_format(value, *args, **kwargs)

  @pass_eval_context
  def replace(eval_ctx, s, old, new, count=None):
    _budget().size(_replaced_size(s, old, new, -1 if count is None else count), "a replace")
    return do_replace(eval_ctx, s, old, new, count)

  def pprint(value):
    _budget().size(_text_size(value, indent=1), "a pprint")
    return do_pprint(value)

  def string(value):
    _budget().size(_text_size(value), "a string")
    return soft_str(value)

  @pass_environment
  def total(environment, iterable, attribute=None, start=0):
    items = list(_charged(iterable))
    if attribute is not None:
      items = list(map(make_attrgetter(environment, attribute), items))
    if isinstance(start, (str, bytes, list, tuple)):
      _budget().size(sum(_length(x) or 0 for x in (start, *items)), "a sum")
    return sum(items, start)

  def batch(value, linecount, fill_with=None):
    if fill_with is not None and isinstance(linecount, int):
      _budget().size(linecount, "a batch")
    return do_batch(value, linecount, fill_with)

  def slice_(value, slices, fill_with=None):
    if isinstance(slices, int):
      _budget().charge(max(slices, 0))  # a list per slice
    return sync_do_slice(value, slices, fill_with)

  @pass_environment
  def wordwrap(environment, s, width=79, break_long_words=True, wrapstring=None,
               break_on_hyphens=True):
    sep = environment.newline_sequence if wrapstring is None else str(wrapstring)
    _budget().size(len(str(s)) + (len(str(s)) + 1) * len(sep), "a wordwrap")
    return do_wordwrap(environment, s, width, break_long_words, wrapstring, break_on_hyphens)

  def lipsum(n=5, html=True, min=20, max=100):  # noqa: A002 - jinja2's names
    if all(isinstance(v, int) for v in (n, min, max)):  # words per paragraph at most max
      _budget().charge(builtins.max(n, 0) * builtins.max(min, max, 1))
    return jinja2.utils.generate_lorem_ipsum(n, html, min, max)

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
    _budget().size(_joined_size(items, d), "a join")
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
  env.filters.update(tojson=tojson, join=join, center=center, indent=indent, format=printf,
                     replace=replace, pprint=pprint, string=string, sum=total, batch=batch,
                     slice=slice_, wordwrap=wordwrap)
  env.globals["range"] = bounded_range
  env.globals["lipsum"] = lipsum
  # The filters that make a string of their input measure a container's printed size first (a
  # list holding one long string many times would be printed before any other check).
  for name in ("capitalize", "center", "e", "escape", "forceescape", "format", "indent", "lower",
               "replace", "safe", "striptags", "title", "trim", "truncate", "upper",
               "urlencode", "urlize", "wordcount", "wordwrap"):  # string, pprint: above
    if name in env.filters:
      env.filters[name] = _measured_input(env.filters[name], name)
  env.globals["raise_exception"] = raise_exception
  env.globals["strftime_now"] = strftime_now
  return env


def _measured_input(f, name: str):
  """Filter `f` checking first that its input, unless a string, prints within the limits."""
  at = 0 if getattr(f, "jinja_pass_arg", None) is None else 1  # after a context or environment

  @functools.wraps(f)  # keeps jinja2's pass_* marker
  def measured(*args, **kwargs):
    if len(args) > at and not isinstance(args[at], str):
      _budget().size(_text_size(args[at]), f"the {name} filter's input")
    return f(*args, **kwargs)
  return measured


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
    try:
      messages = [dict(m) for m in messages]
    except (TypeError, ValueError) as e:
      raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} mappings,"
                       f" got {_short(messages)} ({e})") from None
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
      for chunk in self._compiled.generate(messages=messages,
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
    except Exception as e:  # noqa: BLE001 - Python's own errors inside it ({{ 1 + 'a' }})
      raise _chat_template_error(jinja2.TemplateError(str(e)), _template_failed(e)) from e
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
    # Lengths compared before a numeric array (a view into the file) becomes a list.
    if types is not None and len(types) != len(tokens):
      raise CheckpointError(f"GGUF tokenizer has {len(tokens)} tokens but {len(types)} token"
                            " types: the file's metadata is corrupt")
    types = [_NORMAL] * len(tokens) if types is None else _as_list(types)
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
      if scores is None or len(scores) != len(tokens):
        raise CheckpointError("GGUF SentencePiece tokenizer needs one tokenizer.ggml.scores"
                              " entry per token: the file's metadata is incomplete")
      scores = _as_list(scores)
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
      config = read_json(config_file)

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
