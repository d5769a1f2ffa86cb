"""Checkpoint integrity and bounded resources (issue 50, items 1, 2, 3 and 7): GGUF tensor byte
ranges, non-finite weights (GGUF and safetensors, with the opt-out, on one device and on a
mesh), metadata arrays no tokenizer reads, vocabulary size, and chat templates that try to
exhaust the process."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import time
import tracemalloc

import gguf
import jax
import numpy as np
import pytest

import jaxspec
from jaxspec.models import tokenizer as tokenizer_module
from jaxspec.models.errors import CheckpointError
from jaxspec.models.gguf_loader import load_gguf
from jaxspec.models.hf_loader import load_hf, save_hf
from jaxspec.models.loading import load
from jaxspec.models.tokenizer import MAX_VOCAB, Tokenizer
from helpers import ROOT, tiny_checkpoint, write_tiny_gguf

# -- helpers: edit a valid tiny GGUF --------------------------------------------------------------


def _tiny_gguf(path, **kw):
  write_tiny_gguf(path, *tiny_checkpoint(), **kw)
  return path


def _tensor_fields(path) -> dict[str, tuple[int, int, int, int]]:
  """name -> (file position of its type id, of its data offset; the type id, the offset), as
  gguf's own reader finds them in the tensor info of a valid file."""
  out = {}
  for t in gguf.GGUFReader(path).tensors:
    f = t.field
    type_pos = f.offset + 8 + len(f.parts[1]) + 4 + 8 * int(f.parts[2][0])
    out[t.name] = (type_pos, type_pos + 4, int(f.parts[4][0]), int(f.parts[5][0]))
  return out


def _patched(src, dst, edits: dict[int, tuple[str, int]]):
  """A copy of `src` with little-endian values written at file positions: {pos: (fmt, v)}."""
  data = bytearray(src.read_bytes())
  for pos, (fmt, value) in edits.items():
    struct.pack_into(fmt, data, pos, value)
  dst.write_bytes(bytes(data))
  return dst


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
  k = key.encode()
  return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def _with_metadata(src, dst, entries: list[bytes]):
  """`src` with metadata entries (from `_kv`) added after the existing ones; the tensor data
  section is moved to the next aligned position, its tensor offsets unchanged."""
  data = src.read_bytes()
  reader = gguf.GGUFReader(src)
  n_tensors, n_kv = struct.unpack_from("<QQ", data, 8)
  kv_end = min(t.field.offset for t in reader.tensors)
  info_end = max(t.field.offset + sum(p.nbytes for p in t.field.parts) for t in reader.tensors)
  head = (data[:8] + struct.pack("<QQ", n_tensors, n_kv + len(entries)) + data[24:kv_end]
          + b"".join(entries) + data[kv_end:info_end])
  head += b"\0" * (-len(head) % 32)
  dst.write_bytes(head + data[reader.data_offset:])
  return dst


def _array(itype: int, count: int, raw: bytes) -> bytes:
  return struct.pack("<IQ", itype, count) + raw


def _timed_error(path, match, **kw) -> float:
  start = time.perf_counter()
  with pytest.raises(CheckpointError, match=match):
    load_gguf(path, **kw)
  return time.perf_counter() - start


# -- item 1: tensor byte ranges -------------------------------------------------------------------


def test_valid_tiny_gguf_loads(tmp_path):
  """The control for the cases below: the unedited file loads."""
  load_gguf(_tiny_gguf(tmp_path / "ok.gguf"))


def _corruptions(fields):
  """(case, edits, the tensor the error must name) for each structural defect of the review."""
  names = list(fields)  # file order
  mid = names[len(names) // 2]
  by_offset = sorted(names, key=lambda n: fields[n][3])
  first, second = by_offset[0], by_offset[1]
  half = (fields[first][3] + fields[second][3]) // 2 // 32 * 32  # aligned, overlapping `first`
  quantized = next(n for n in names if fields[n][2] == int(gguf.GGMLQuantizationType.Q8_0)
                   and n != by_offset[-1])
  return [
      ("every tensor at offset 0", {fields[n][1]: ("<Q", 0) for n in names}, None),
      ("a tensor overlapping the next by half", {fields[second][1]: ("<Q", half)}, first),
      ("a middle tensor's offset moved by 4 bytes",
       {fields[mid][1]: ("<Q", fields[mid][3] + 4)}, mid),
      ("every offset moved by 1 byte",
       {fields[n][1]: ("<Q", fields[n][3] + 1) for n in names}, names[0]),
      ("a quantized tensor's type changed to F32",
       {fields[quantized][0]: ("<I", int(gguf.GGMLQuantizationType.F32))}, quantized),
  ]


def test_structurally_wrong_tensor_ranges_are_refused(tmp_path):
  """Each defect the review found loading "ok" (item 1) is a CheckpointError naming a tensor
  (the one the defect is in where it is one tensor), within a second."""
  src = _tiny_gguf(tmp_path / "ok.gguf")
  fields = _tensor_fields(src)
  for i, (case, edits, tensor) in enumerate(_corruptions(fields)):
    bad = _patched(src, tmp_path / f"bad{i}.gguf", edits)
    start = time.perf_counter()
    with pytest.raises(CheckpointError) as err:
      load_gguf(bad)
    elapsed = time.perf_counter() - start
    message = str(err.value)
    assert (f"tensor '{tensor}'" if tensor else "tensor '") in message, (case, message)
    assert "alignment" in message or "overlaps" in message or "truncated" in message, (
        case, message)
    assert elapsed < 1.0, (case, elapsed)


def test_overlap_and_alignment_messages(tmp_path):
  """The messages say which rule a range breaks: alignment (with the file's alignment),
  overlap (both tensors named) and the data section's end."""
  src = _tiny_gguf(tmp_path / "ok.gguf")
  fields = _tensor_fields(src)
  cases = dict((c, (e, t)) for c, e, t in _corruptions(fields))
  edits, tensor = cases["a middle tensor's offset moved by 4 bytes"]
  with pytest.raises(CheckpointError, match=rf"tensor '{tensor}' .* not a multiple of"
                                            " general.alignment 32"):
    load_gguf(_patched(src, tmp_path / "a.gguf", edits))
  edits, tensor = cases["a tensor overlapping the next by half"]
  with pytest.raises(CheckpointError, match=rf"tensor '{tensor}' .* overlaps tensor '"):
    load_gguf(_patched(src, tmp_path / "b.gguf", edits))
  # The last tensor of the data section moved on by an aligned 1 MB: past the end of the file.
  last = max(fields, key=lambda n: fields[n][3])
  with pytest.raises(CheckpointError, match=rf"truncated: tensor '{last}' needs bytes up to"):
    load_gguf(_patched(src, tmp_path / "c.gguf", {fields[last][1]: ("<Q", 1 << 20)}))


def test_an_empty_tensor_between_overlapping_ones_hides_nothing(tmp_path):
  """Two tensors overlap with an empty one (a zero dimension) starting between them: the overlap
  is still found (neighbours were compared, and a pair with an empty tensor skipped)."""
  src = _tiny_gguf(tmp_path / "ok.gguf")
  fields = _tensor_fields(src)
  cases = dict((c, (e, t)) for c, e, t in _corruptions(fields))
  edits, first = cases["a tensor overlapping the next by half"]
  ((pos, (_, half)),) = edits.items()
  assert half - fields[first][3] >= 64
  empty = sorted(fields, key=lambda n: fields[n][3])[2]
  n_dims = next(len(t.shape) for t in gguf.GGUFReader(src).tensors if t.name == empty)
  edits = dict(edits)
  edits[fields[empty][0] - 8 * n_dims] = ("<Q", 0)  # its first dimension: 0 elements
  edits[fields[empty][1]] = ("<Q", fields[first][3] + 32)  # inside `first`, before `half`
  with pytest.raises(CheckpointError, match=rf"tensor '{first}' .* overlaps tensor '"):
    load_gguf(_patched(src, tmp_path / "e.gguf", edits))


def test_general_alignment_is_honoured(tmp_path):
  """A file written with general.alignment 64 loads; an offset that is a multiple of 32 but not
  of 64 is refused, naming 64."""
  cfg, params = tiny_checkpoint()
  src = tmp_path / "a64.gguf"
  orig_init = gguf.GGUFWriter.__init__

  def init(self, *a, **kw):
    orig_init(self, *a, **kw)
    self.data_alignment = 64
    self.add_custom_alignment(64)

  with pytest.MonkeyPatch.context() as mp:
    mp.setattr(gguf.GGUFWriter, "__init__", init)
    write_tiny_gguf(src, cfg, params)
  load_gguf(src)
  fields = _tensor_fields(src)
  name = max(fields, key=lambda n: fields[n][3])
  with pytest.raises(CheckpointError, match=rf"'{name}' .* general.alignment 64"):
    load_gguf(_patched(src, tmp_path / "b.gguf", {fields[name][1]: ("<Q", fields[name][3] + 32)}))


# -- item 2: non-finite weights -------------------------------------------------------------------


def _nan_norm_gguf(tmp_path):
  """The tiny GGUF with every `output_norm` weight NaN (an F32 tensor: its bytes patched)."""
  src = _tiny_gguf(tmp_path / "ok.gguf")
  reader = gguf.GGUFReader(src)
  t = next(t for t in reader.tensors if t.name == "output_norm.weight")
  assert t.tensor_type == gguf.GGMLQuantizationType.F32
  data = bytearray(src.read_bytes())
  data[t.data_offset:t.data_offset + t.n_bytes] = np.full(t.n_elements, np.nan,
                                                          "<f4").tobytes()
  bad = tmp_path / "nan.gguf"
  bad.write_bytes(bytes(data))
  return bad


def test_nonfinite_gguf_weights_are_refused_unless_allowed(tmp_path):
  bad = _nan_norm_gguf(tmp_path)
  for loader in (load_gguf, load, jaxspec.load):
    with pytest.raises(CheckpointError,
                       match=r"tensor 'output_norm.weight' holds 64 non-finite values of 64 .*"
                             r"allow_nonfinite=True"):
      loader(bad)
  model = jaxspec.load(bad, allow_nonfinite=True)
  assert np.isnan(np.asarray(model.params.final_norm)).all()


@pytest.mark.parametrize("tensor,qtype,at,value", [
    ("blk.1.attn_k.weight", "Q8_0", 34 + 0, b"\x00\x7c"),  # block 1's scale: +inf
    ("blk.0.attn_v.weight", "Q4_1", 20 + 2, b"\x00\x7e"),  # block 1's minimum: NaN
    ("blk.1.attn_output.weight", "Q4_0", 18 * 5, b"\x00\xfc"),  # block 5's scale: -inf
])
def test_nonfinite_in_a_quantized_tensor_is_found(tmp_path, tensor, qtype, at, value):
  """A non-finite float16 block scale or minimum decodes to non-finite values: refused, named
  (the loader checks these types by their scales)."""
  src = _tiny_gguf(tmp_path / "ok.gguf")
  t = next(t for t in gguf.GGUFReader(src).tensors if t.name == tensor)
  assert t.tensor_type.name == qtype
  data = bytearray(src.read_bytes())
  data[t.data_offset + at:t.data_offset + at + 2] = value
  (tmp_path / "bad.gguf").write_bytes(bytes(data))
  with pytest.raises(CheckpointError, match=rf"tensor '{tensor}' holds \d+ non-finite"):
    load_gguf(tmp_path / "bad.gguf")
  load_gguf(tmp_path / "bad.gguf", allow_nonfinite=True)


def _nan_hf_dir(tmp_path):
  cfg, params = tiny_checkpoint()
  save_hf((cfg, params), tmp_path / "hf")
  from safetensors.numpy import load_file, save_file
  f = tmp_path / "hf" / "model.safetensors"
  tensors = load_file(f)
  w = tensors["model.layers.1.mlp.down_proj.weight"]
  w[3, 5] = np.inf
  save_file(tensors, f)
  return tmp_path / "hf"


def test_nonfinite_safetensors_weights_are_refused_unless_allowed(tmp_path):
  hf = _nan_hf_dir(tmp_path)
  for loader in (load_hf, load, jaxspec.load):
    with pytest.raises(CheckpointError,
                       match=r"tensor 'model.layers.1.mlp.down_proj.weight' holds 1 non-finite"
                             r" values of \d+ \(inf at index \[3, 5\]\).*allow_nonfinite=True"):
      loader(hf)
  model = load_hf(hf, allow_nonfinite=True)
  assert np.isinf(np.asarray(model.params.layers.w_down if not isinstance(
      model.params.layers, tuple) else model.params.layers[1].w_down)).sum() == 1


def test_nonfinite_refused_on_a_mesh_and_loaded_when_allowed(tmp_path):
  """The mesh loader refuses the same way and passes the opt-out through; with the opt-out,
  every device still holds only its shard."""
  from jax.sharding import Mesh
  devices = np.array(jax.devices()[:4]).reshape(2, 2)
  mesh = Mesh(devices, ("data", "model"))
  bad = _nan_norm_gguf(tmp_path)
  with pytest.raises(CheckpointError, match="'output_norm.weight' holds 64 non-finite"):
    jaxspec.load(bad, mesh=mesh)
  model = jaxspec.load(bad, mesh=mesh, allow_nonfinite=True)
  assert np.isnan(np.asarray(model.params.final_norm)).all()
  embed = model.params.embed
  shard_rows = {s.data.shape for s in embed.addressable_shards}
  assert all(np.prod(s) < np.prod(embed.shape) for s in shard_rows), shard_rows


def test_finite_check_passes_large_finite_values():
  """A tensor whose sum overflows float32 but whose values are all finite is accepted (the
  check's fast path is a sum; it must not refuse what it cannot prove non-finite)."""
  from jaxspec.models.errors import refuse_nonfinite
  refuse_nonfinite(np.full(1000, 3e38, np.float32), "big", "here")
  with pytest.raises(CheckpointError, match=r"'big' holds 1 non-finite values of 1000 \(nan"):
    x = np.full(1000, 3e38, np.float32)
    x[7] = np.nan
    refuse_nonfinite(x, "big", "here")


# -- item 3: metadata arrays nothing reads --------------------------------------------------------


def _peak_and_time(fn):
  tracemalloc.start()
  start = time.perf_counter()
  try:
    result = fn()
  finally:
    elapsed = time.perf_counter() - start
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
  return result, elapsed, peak


def test_unread_scores_array_costs_nothing(tmp_path):
  """20,000,000 tokenizer.ggml.scores in a file whose tokenizer is gpt2 (which reads no
  scores): the load takes under 2 s and under 100 MB, and the model is the same."""
  src = _tiny_gguf(tmp_path / "ok.gguf")
  n = 20_000_000
  scores = np.arange(n, dtype="<f4").tobytes()
  big = _with_metadata(src, tmp_path / "scores.gguf",
                       [_kv("tokenizer.ggml.scores", 9, _array(6, n, scores))])
  del scores
  assert big.stat().st_size > 80_000_000
  model, elapsed, peak = _peak_and_time(lambda: load_gguf(big))
  assert elapsed < 2.0, elapsed
  assert peak < 100 << 20, peak
  ref = load_gguf(src)
  assert model.cfg == ref.cfg
  assert model.tokenizer.encode("hello world") == ref.tokenizer.encode("hello world")


def test_unneeded_string_array_is_refused_quickly(tmp_path):
  """A string array outside tokenizer.* is bounded before its items are read."""
  src = _tiny_gguf(tmp_path / "ok.gguf")
  n = 3_000_000
  big = _with_metadata(src, tmp_path / "tags.gguf",
                       [_kv("general.tags", 9, _array(8, n, struct.pack("<Q", 0) * n))])
  _, elapsed, peak = _peak_and_time(lambda: _timed_error(
      big, r"metadata array 'general.tags' has 3000000 items; jaxspec reads no such array and"
           r" bounds them at 65536"))
  assert elapsed < 2.0 and peak < 50 << 20, (elapsed, peak)


# -- item 7: vocabulary size ----------------------------------------------------------------------


def test_huge_vocabulary_is_refused_before_it_is_read(tmp_path):
  """4,000,000 tokenizer tokens (a 35 MB file): refused within seconds, under 200 MB."""
  src = _tiny_gguf(tmp_path / "ok.gguf", tokenizer=False)
  n = 4_000_000
  tokens = (struct.pack("<Q", 1) + b"a") * n
  big = _with_metadata(src, tmp_path / "vocab.gguf", [
      _kv("tokenizer.ggml.model", 8, struct.pack("<Q", 4) + b"gpt2"),
      _kv("tokenizer.ggml.tokens", 9, _array(8, n, tokens))])
  del tokens
  assert big.stat().st_size > 35_000_000
  _, elapsed, peak = _peak_and_time(lambda: _timed_error(
      big, rf"'tokenizer.ggml.tokens' has 4000000 items, more than jaxspec's vocabulary limit"
           rf" of {MAX_VOCAB}"))
  assert elapsed < 2.0 and peak < 200 << 20, (elapsed, peak)


@pytest.mark.parametrize("key", ["tokenizer.ggml.token_type", "tokenizer.ggml.scores"])
def test_a_numeric_tokenizer_array_of_the_wrong_length_is_refused_unread(key):
  """A token-type or score array far longer than the vocabulary (a view into the file): refused
  on its length, before it becomes a list (50M items were a 400 MB list first)."""
  long = np.zeros(50_000_000, np.float32 if key.endswith("scores") else np.int32)
  fields = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["<unk>", "a", "b"],
            "tokenizer.ggml.scores": np.zeros(3, np.float32), key: long}
  _, elapsed, peak = _peak_and_time(lambda: pytest.raises(
      CheckpointError, Tokenizer.from_gguf, fields))
  assert peak < 20 << 20 and elapsed < 2.0, (peak, elapsed)


def test_vocabulary_limit_applies_to_plain_metadata():
  with pytest.raises(CheckpointError, match=f"vocabulary limit of {MAX_VOCAB}"):
    Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2",
                         "tokenizer.ggml.tokens": ["a"] * (MAX_VOCAB + 1)})


# -- item 7: chat templates -----------------------------------------------------------------------


def _backend():
  """A two-token word-level `tokenizers.Tokenizer`."""
  import tokenizers
  from tokenizers import models
  return tokenizers.Tokenizer(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>"))


def _tok(template) -> Tokenizer:
  return Tokenizer(_backend(), chat_template=template, template_source="test template")


HOSTILE_TEMPLATES = {
    "string repetition": ("{{ 'a' * 10**10 }}", "characters or items per output, string or list"),
    "nested range loops": ("{% for i in range(100000) %}{% for j in range(100000) %}"
                           "{% endfor %}{% endfor %}", "loop iterations and range"),
    "nested loops over a string": ("{% set s = 'a' * 100000 %}{% for i in s %}{% for j in s %}"
                                   "{% endfor %}{% endfor %}", "loop iterations"),
    "doubling concatenation": ("{% set ns = namespace(s='ab') %}{% for i in range(60) %}"
                               "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
                               "a ~ concatenation"),
    "list doubling": ("{% set ns = namespace(l=[1]) %}{% for i in range(60) %}"
                      "{% set ns.l = ns.l + ns.l %}{% endfor %}", "a concatenation"),
    "huge power": ("{{ 7 ** 10000000000 }}", "4096-bit integers"),
    "padding": ("{{ 'a'.ljust(10**10) }}", "str.ljust"),
    "join of repeated strings": ("{{ ([('a' * 1000000)] * 1000)|join }}", "a join"),
    "output size": ("{% for i in range(300) %}{{ 'a' * 100000 }}{% endfor %}", "the output"),
    "range past the limit": ("{{ range(10**12)|length }}", "loop iterations and range"),
    "endless recursion": ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "RecursionError"),
    # Formatting, filters and methods whose result outgrows their input: each is refused before
    # it is built (these would allocate gigabytes, or hundreds of terabytes).
    "printf width": ("{{ '%1000000000s' % 'a' }}", "a % format"),
    "printf width from the values": ("{{ '%*d' % (1000000000, 1) }}", "a % format"),
    "printf fields reading one long value": (
        "{{ ('%(a)s' * 1000000) % {'a': 'a' * 10000000} }}", "a % format"),
    "format filter": ("{{ '%1000000000d'|format(1) }}", "a % format"),
    "str.format width": ("{{ '{:>1000000000}'.format('a') }}", "str.format"),
    "str.format width from the values": ("{{ '{:{w}}'.format('a', w=1000000000) }}",
                                         "str.format"),
    "str.format fields reading one long value": (
        "{{ ('{0}' * 1000000).format('a' * 10000000) }}", "str.format"),
    "str.format_map": ("{{ '{a:1000000000}'.format_map({'a': 1}) }}", "str.format_map"),
    "replace filter": ("{{ 'aaaa'|replace('a', 'b' * 10000000) }}", "a replace"),
    "str.replace": ("{{ 'aaaa'.replace('a', 'b' * 10000000) }}", "str.replace"),
    "str.translate": ("{{ 'abc'.translate({97: 'x' * 10000000}) }}", "str.translate"),
    "str.join separator": ("{{ ('b' * 10000000).join(['a'] * 1000) }}", "str.join"),
    "tojson indent": ("{{ [1]|tojson(indent=1000000000) }}", "a tojson"),
    "printed list of one string many times": ("{{ [('a' * 10000000)] * 10000000 }}",
                                              "a printed value"),
    "string filter": ("{{ ([('a' * 10000000)] * 10000000)|string }}", "a string"),
    "pprint filter": ("{{ ([('a' * 10000000)] * 10000000)|pprint }}", "a pprint"),
    "concatenated list": ("{{ ([('a' * 10000000)] * 10000000) ~ '' }}", "a ~ concatenation"),
    "sum of lists": ("{{ ([['a'] * 10000000] * 100000)|sum(start=[]) }}", "a sum"),
    "batch filled": ("{{ [1]|batch(10000000000, fill_with=0)|list }}", "a batch"),
    "slice": ("{{ [1]|slice(100000000)|list }}", "loop iterations"),
    "wordwrap": ("{{ 'a b'|wordwrap(1, wrapstring='c' * 10000000) }}", "a wordwrap"),
    "bytes padding": ("{{ 'a'.encode().ljust(10000000000) }}", "str.ljust"),
    "int.to_bytes": ("{{ (1).to_bytes(10000000000, 'big') }}", "int.to_bytes"),
    "integer squaring": ("{% set ns = namespace(x=2 ** 4000) %}{% for i in range(40) %}"
                         "{% set ns.x = ns.x * ns.x %}{% endfor %}", "4096-bit integers"),
    "set block built and dropped": ("{% set x %}{% for i in range(100000) %}{{ 'a' * 10000000 }}"
                                    "{% endfor %}{% endset %}", "characters printed per rendering"),
    "lipsum": ("{{ lipsum(100000000) }}", "loop iterations"),
    "trim of a list of one string many times": (
        "{% set l = [('x' * 1000000)] * 100 %}{{ l|trim|length }}", "the trim filter's input"),
    "format filter on a list": ("{% set l = [('x' * 1000000)] * 100 %}{{ l|format|length }}",
                                "the format filter's input"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_TEMPLATES))
def test_hostile_templates_end_in_a_documented_error_quickly(case):
  template, limit = HOSTILE_TEMPLATES[case]
  tok = _tok(template)
  start = time.perf_counter()
  with pytest.raises(ValueError, match=rf"chat template of test template exceeded .*{limit}") as e:
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
  assert time.perf_counter() - start < 5.0
  import jinja2.sandbox
  assert isinstance(e.value, jinja2.sandbox.SecurityError)


def test_python_errors_inside_a_template_are_value_errors():
  """A template that fails in Python's own operations (not jinja2's) gives the documented
  ValueError naming the failure, as a jinja2 TemplateError too."""
  import jinja2
  for template, message in (("{{ 1 + 'a' }}", "TypeError: unsupported operand"),
                            ("{{ '%d' % 'a' }}", "TypeError: %d format"),
                            ("{{ '{0}'.format() }}", "IndexError: "),
                            ("{{ 1 // 0 }}", "ZeroDivisionError: ")):
    with pytest.raises(ValueError, match=f"chat template failed: {message}") as e:
      _tok(template).apply_chat_template([{"role": "user", "content": "hi"}])
    assert isinstance(e.value, jinja2.TemplateError)


def test_template_limits_leave_formatting_alone():
  """The size checks of formatting, filters and methods let ordinary uses through unchanged."""
  from jinja2.sandbox import ImmutableSandboxedEnvironment
  template = ("{{ '%s: %5.2f%%' % ('rate', 12.345) }}|{{ '%(a)s-%(b)03d' % {'a': 'x', 'b': 7} }}|"
              "{{ '{} {:>6} {name!r}'.format(1, 'ab', name='n') }}|{{ '{a}'.format_map({'a': 2}) }}|"
              "{{ 'a-b-c'|replace('-', '+') }}|{{ 'a-b'.replace('-', '', 1) }}|"
              "{{ messages|tojson(indent=2) }}|{{ messages|tojson }}|{{ [1, [2, 3]]|string }}|"
              "{{ [[1], [2]]|sum(start=[]) }}|{{ [1, 2, 3]|batch(2, fill_with=0)|list }}|"
              "{{ [1, 2, 3]|slice(2)|list }}|{{ 'ab cd ef'|wordwrap(2) }}|{{ ', '.join(['a', 'b']) }}|"
              "{{ 'abc'.translate({97: 'xy'}) }}|{{ (258).to_bytes(2, 'big') }}|{{ 3 * 4 }}|"
              "{{ {'k': [1, 'v']} }}|{{ 7 % 3 }}|{{ '%x' % 255 }}|{{ 'a' ~ [1] ~ none }}|"
              # a large value beside a small width read from the values
              "{{ '{:{}}'.format(20000000, 2) }}|{{ '%*d' % (3, 20000000) }}|"
              "{{ [' a ']|trim }}|{{ messages|tojson(separators=(',', ':')) }}")
  messages = [{"role": "user", "content": "hi"}]
  text = _tok(template).apply_chat_template(messages, add_generation_prompt=False)
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  env.filters["tojson"] = lambda x, indent=None, separators=None: json.dumps(
      x, ensure_ascii=False, indent=indent, separators=separators)
  assert text == env.from_string(template).render(messages=messages)


def test_a_long_message_through_tojson_with_separators_renders():
  """A 6M-character message through tojson(separators=(',', ':')) (Kimi K2's template dumps its
  tools so): the estimate counts the separators per item, not per character (it was refused
  as 18M)."""
  messages = [{"role": "user", "content": "x" * 6_000_000}]
  text = _tok("{{ messages|tojson(separators=(',', ':')) }}").apply_chat_template(messages)
  assert text == json.dumps(messages, separators=(",", ":")) and len(text) > 6_000_000


def test_messages_that_are_not_mappings_are_named_as_such():
  """Not the template's fault: a message list of non-mappings is a ValueError saying so."""
  with pytest.raises(ValueError, match=r"messages must be a list of \{'role'"):
    _tok("{{ messages }}").apply_chat_template([1, 2])


def test_template_limits_leave_real_templates_alone():
  """A long conversation (2 MB of text) through the tiny template renders as jinja2's own
  sandbox renders it."""
  from jinja2.sandbox import ImmutableSandboxedEnvironment
  from helpers import TINY_TEMPLATE
  messages = [{"role": "user" if i % 2 else "assistant", "content": f"{i}" * 1000}
              for i in range(2000)]
  text = _tok(TINY_TEMPLATE).apply_chat_template(messages)
  plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True).from_string(
      TINY_TEMPLATE).render(messages=messages, add_generation_prompt=True)
  assert text == plain and len(text) > 2_000_000


def test_time_limit(monkeypatch):
  """Past MAX_TEMPLATE_SECONDS (made tiny here) rendering stops with the limit named."""
  monkeypatch.setattr(tokenizer_module, "MAX_TEMPLATE_SECONDS", 0.0)
  with pytest.raises(ValueError, match=r"exceeded the limit of 0 s per rendering"):
    _tok("{% for i in range(10) %}{% endfor %}").apply_chat_template([])


@pytest.mark.parametrize("template", [7, {"a": 1}, [{"name": "default", "template": 5}], [5]])
def test_non_string_templates_are_checkpoint_errors(tmp_path, template):
  """From tokenizer_config.json, at load time: a CheckpointError naming the file."""
  _backend().save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  with pytest.raises(CheckpointError, match=r"tokenizer_config.json.*chat_template.* not"):
    Tokenizer.from_hf_dir(tmp_path)
  with pytest.raises(CheckpointError, match="not a string"):
    Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"],
                         "tokenizer.ggml.merges": [], "tokenizer.chat_template": 7})


def test_cli_non_string_and_hostile_templates_exit_2(tmp_path):
  """`jaxspec generate` on a model whose template is not a string, or is hostile: one error
  line and exit code 2, no traceback."""
  exe = shutil.which("jaxspec", path=os.path.dirname(sys.executable)) or shutil.which("jaxspec")
  assert exe, "the jaxspec console script is not installed"
  cfg, params = tiny_checkpoint()
  hf = tmp_path / "hf"
  save_hf((cfg, params), hf)
  gguf_tok = load_gguf(_tiny_gguf(tmp_path / "tiny.gguf")).tokenizer
  gguf_tok.backend.save(str(hf / "tokenizer.json"))
  root = str(ROOT)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {
      "JAXSPEC_COMPILE_CACHE": "none",  # and this checkout's jaxspec, not the installed one's
      "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
  for name, template in [("int", 7), ("list entry", [{"name": "default", "template": 5}]),
                         ("hostile", "{{ 'a' * 10**10 }}")]:
    (hf / "tokenizer_config.json").write_text(json.dumps({"chat_template": template,
                                                          "eos_token": "<|im_end|>"}))
    start = time.perf_counter()
    out = subprocess.run([exe, "generate", "hi", "--model", str(hf), "--max-new-tokens", "2"],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 2, (name, out.returncode, out.stderr[-1500:])
    assert "Traceback" not in out.stderr, (name, out.stderr[-1500:])
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, (name, out.stderr[-1500:])
    assert "tokenizer_config.json: chat_template" in errors[0], errors[0]
    assert time.perf_counter() - start < 120, name


def _patch_metadata(data: bytes, key: str, fmt: str, value) -> bytes:
  """The GGUF bytes with metadata `key`'s scalar value replaced (same type and width)."""
  k = key.encode()
  at = data.index(struct.pack("<Q", len(k)) + k) + 8 + len(k) + 4  # past the key and its type
  return data[:at] + struct.pack(fmt, value) + data[at + struct.calcsize(fmt):]


def test_gguf_metadata_that_used_to_load_and_misbehave(tmp_path):
  src = tmp_path / "tiny.gguf"
  write_tiny_gguf(src, *tiny_checkpoint())
  data = src.read_bytes()
  cases = {"block_count": ("llama.block_count", "<I", 2**31, "block_count"),
           "nan freq_base": ("llama.rope.freq_base", "<f", float("nan"), "freq_base"),
           "negative eps": ("llama.attention.layer_norm_rms_epsilon", "<f", -1.0, "rms_norm_eps"),
           "zero context": ("llama.context_length", "<I", 0, "max_position_embeddings")}
  for name, (key, fmt, value, match) in cases.items():
    path = tmp_path / f"{name.replace(' ', '_')}.gguf"
    path.write_bytes(_patch_metadata(data, key, fmt, value))
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=match):
      load(path)
    assert time.perf_counter() - t0 < 5, name


def test_gguf_huge_unneeded_metadata_array_is_refused_fast(tmp_path):
  """A 1,000,000-element metadata array the loader does not read (the gguf package's reader
  walks it element by element: 34 s and 950 MB) is refused at once, naming the key."""
  path = tmp_path / "junk.gguf"
  write_tiny_gguf(path, *tiny_checkpoint())
  data = path.read_bytes()
  key = b"general.junk"
  n = 1_000_000
  # key, type ARRAY (9), item type INT32 (5), count, items; spliced in as the first entry.
  kv = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 5, n) + bytes(4 * n)
  n_kv = struct.unpack_from("<Q", data, 16)[0]
  path.write_bytes(data[:16] + struct.pack("<Q", n_kv + 1) + kv + data[24:])
  t0 = time.perf_counter()
  with pytest.raises(CheckpointError, match="general.junk"):
    load(path)
  assert time.perf_counter() - t0 < 5


def test_tokenizer_json_size_and_vocabulary_bounded(tmp_path, monkeypatch):
  """A tokenizer.json past MAX_TOKENIZER_JSON_BYTES is refused from its size, before it is
  parsed (a sparse file: nothing is read); one holding more than MAX_VOCAB tokens is refused
  after parsing. Both CheckpointErrors name the file and the limit."""
  import tokenizers
  from tokenizers import models
  big = tmp_path / "big"
  big.mkdir()
  with open(big / "tokenizer.json", "wb") as f:
    f.truncate(tokenizer_module.MAX_TOKENIZER_JSON_BYTES + 1)
  t0 = time.perf_counter()
  with pytest.raises(CheckpointError, match=r"tokenizer.json is 128 MiB, past .* limit of 128"):
    Tokenizer.from_hf_dir(big)
  assert time.perf_counter() - t0 < 1.0
  backend = tokenizers.Tokenizer(models.WordLevel({f"t{i}": i for i in range(40)} | {"<unk>": 40},
                                                  unk_token="<unk>"))
  backend.save(str(tmp_path / "tokenizer.json"))
  assert Tokenizer.from_hf_dir(tmp_path).backend.get_vocab_size() == 41
  monkeypatch.setattr(tokenizer_module, "MAX_VOCAB", 40)
  with pytest.raises(CheckpointError, match=r"tokenizer.json holds 41 tokens, past .* 40"):
    Tokenizer.from_hf_dir(tmp_path)


@pytest.mark.parametrize("content", [b"[1, 2]", b"[" * 100_000, b"\xff\xfe"])
def test_checkpoint_json_files_that_are_not_objects_are_checkpoint_errors(tmp_path, content,
                                                                          tiny_target):
  """tokenizer_config.json and a head's config.json that are a list, nest too deeply or are not
  UTF-8 (were AttributeError / RecursionError / UnicodeDecodeError): a CheckpointError naming
  the file (`jaxspec.models.errors.read_json`, which every checkpoint JSON file is read by)."""
  from jaxspec.heads import load_head
  _backend().save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_bytes(content)
  with pytest.raises(CheckpointError, match=r"tokenizer_config\.json (holds a JSON list|is not"
                                            r" valid JSON)"):
    Tokenizer.from_hf_dir(tmp_path)
  (head := tmp_path / "head").mkdir()
  (head / "config.json").write_bytes(content)
  with pytest.raises(CheckpointError, match=r"head.config\.json (holds a JSON list|is not valid"
                                            r" JSON)"):
    load_head(tiny_target, head)
