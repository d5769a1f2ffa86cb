"""Loading llama.cpp GGUF checkpoints into jaxspec `Params`: architectures `llama` (Llama,
Mistral, SmolLM), `qwen2`, `qwen3`, `gemma`, `gemma2`, `gemma3` and `phi3`.

Metadata and tensor locations are read here (`_read_gguf`); `gguf` supplies the type tables and
the decoders of the types below that jaxspec has no kernel for. F32, F16, BF16, Q8_0, Q4_0 and
Q4_1 tensors are decoded here in vectorised numpy: equal to `gguf.quants` bit for bit, and 2 to
3 times faster than it on a 2048x2048 Q8_0, Q4_0, Q4_1 or BF16 matrix. Every other type that
`gguf.quants.dequantize` implements (the K-quants Q2_K..Q6_K, Q5_0, Q5_1, the IQ types, TQ1_0,
TQ2_0, MXFP4, ...) is decoded by it. Quantized weights are dequantized to float32 once at load
time and then cast to the requested dtype.

`_read_gguf` walks the header with bounds checks: a truncated or corrupt file is reported as a
`CheckpointError` instead of a huge allocation or an endless loop over a garbage array length.
Every tensor's byte range is checked before any tensor is read (aligned to `general.alignment`,
inside the data section, not overlapping another, of the size its type and shape need); arrays
of numbers in the metadata stay views of the memory-mapped file, so the arrays a tokenizer does
not read (a `gpt2` tokenizer's `tokenizer.ggml.scores`) cost nothing; arrays of strings are
bounded before their first item is read (`MAX_VOCAB` tokens and merges). Each weight is
refused when it decodes to a NaN or an infinity (`allow_nonfinite=True` loads it anyway).

llama.cpp's `llama` architecture applies rotary embeddings to interleaved pairs, so
`convert_hf_to_gguf.py` permutes the rows of the Q and K projections of Hugging Face checkpoints;
jaxspec uses Hugging Face's rotate-half layout, so the loader undoes that permutation. The other
architectures use the rotate-half ("neox") layout and are not permuted.

What llama.cpp's converter changes per family, and the settings a GGUF does not record
(llama.cpp's fixed ones), are in each family's file under `jaxspec.models.families` (Gemma's
1 + w norms, Phi-3's fused tensors, Gemma 2/3's sliding patterns and query scaling); this module
reads the format and asks the family. LongRoPE's divisors (`rope_factors_short` /
`rope_factors_long` tensors) and Llama-3's (`rope_freqs`) are read for any architecture.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import mmap
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np

from jaxspec.checks import is_int
from jaxspec.models import families
from jaxspec.models.config import (LlamaConfig, RopeScaling, longrope_attention_factor,
                                   yarn_mscale)
from jaxspec.models.errors import CheckpointError, read_checkpoint, refuse_nonfinite
from jaxspec.models.families.base import every_nth_full
from jaxspec.models.llama import Params, rope_inv_freq, stack_params
from jaxspec.models.model import Model
from jaxspec.models.tokenizer import MAX_VOCAB

SUPPORTED_ARCHITECTURES = families.GGUF_ARCHITECTURES  # general.architecture values it loads
# Types decoded by jaxspec's own kernels; `supported_types()` adds those `gguf.quants` decodes.
OWN_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32
# GGUF metadata value types: id -> struct format (and numpy dtype) of scalars.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _quant_sizes() -> dict[int, tuple[str, int, int]]:
  """ggml type id -> (name, block size in elements, block size in bytes)."""
  from gguf.constants import GGML_QUANT_SIZES
  return {int(t): (t.name, bs, ts) for t, (bs, ts) in GGML_QUANT_SIZES.items()}


@functools.cache
def _gguf_dequantizes(type_id: int) -> bool:
  """Whether the installed `gguf.quants` implements dequantization of this ggml type: it raises
  NotImplementedError for the others (Q8_1, Q8_K, the integer types, F64 in gguf 0.19), so one
  zero block is tried; that costs well under a millisecond per type."""
  import gguf
  _, _, block_bytes = _quant_sizes()[type_id]
  try:
    gguf.quants.dequantize(np.zeros((1, block_bytes), np.uint8),
                           gguf.GGMLQuantizationType(type_id))
  except NotImplementedError:
    return False
  return True


def supported_types() -> tuple[str, ...]:
  """The ggml tensor types jaxspec loads: its own six, then those `gguf.quants` dequantizes."""
  extra = [name for type_id, (name, _, _) in _quant_sizes().items()
           if name not in OWN_TYPES and _gguf_dequantizes(type_id)]
  return OWN_TYPES + tuple(extra)


def _unsupported(names: str) -> str:
  return (f"ggml tensor type {names} is not supported (supported: {', '.join(supported_types())}"
          "): re-quantize the model to one of those, e.g. with llama.cpp's llama-quantize")


# -- dequantization -------------------------------------------------------------------------------


def _f16(b: np.ndarray) -> np.ndarray:
  """float32 from little-endian float16 bytes [..., 2] -> [..., 1]."""
  return b.view("<f2").astype(np.float32)  # a strided view: the last axis is contiguous


def _dequant_q8_0(blocks: np.ndarray) -> np.ndarray:
  # block: f16 scale d, 32 x int8 q; x = q * d
  return blocks[:, 2:].view(np.int8).astype(np.float32) * _f16(blocks[:, :2])


def _nibbles(qs: np.ndarray) -> np.ndarray:
  # Low nibbles hold elements 0..15 of a block, high nibbles elements 16..31.
  return np.concatenate([qs & np.uint8(0x0F), qs >> np.uint8(4)], axis=-1)


def _dequant_q4_0(blocks: np.ndarray) -> np.ndarray:
  # block: f16 scale d, 16 bytes of 4-bit q; x = d * (q - 8)
  q = _nibbles(blocks[:, 2:]).astype(np.int8) - np.int8(8)
  return _f16(blocks[:, :2]) * q.astype(np.float32)


def _dequant_q4_1(blocks: np.ndarray) -> np.ndarray:
  # block: f16 scale d, f16 minimum m, 16 bytes of 4-bit q; x = d * q + m
  q = _nibbles(blocks[:, 4:]).astype(np.float32)
  return _f16(blocks[:, :2]) * q + _f16(blocks[:, 2:4])


_BLOCK_DEQUANT = {"Q8_0": _dequant_q8_0, "Q4_0": _dequant_q4_0, "Q4_1": _dequant_q4_1}

# Blocks `gguf.quants` decodes at once: its temporaries are several times the float32 output
# (K-quant scales, unpacked bits), so a large embedding is decoded in slices of 2^24 elements.
_GGUF_CHUNK_ELEMENTS = 1 << 24


def _dequant_with_gguf(blocks: np.ndarray, type_id: int, block: int) -> np.ndarray:
  """float32 [n_blocks, block] from the bytes [n_blocks, block_bytes] of any type gguf decodes."""
  import gguf
  qtype = gguf.GGMLQuantizationType(type_id)
  out = np.empty((blocks.shape[0], block), np.float32)
  step = max(1, _GGUF_CHUNK_ELEMENTS // block)
  for i in range(0, blocks.shape[0], step):
    # gguf decodes [..., k * block_bytes] bytes to [..., k * block] values: one block a row.
    out[i:i + step] = gguf.quants.dequantize(blocks[i:i + step], qtype)
  return out


def dequantize(raw: np.ndarray, qtype: Any, shape: tuple[int, ...]) -> np.ndarray:
  """Decodes one GGUF tensor's data to float32.

  The six `OWN_TYPES` use the kernels above; any other type that `gguf.quants` dequantizes goes
  through it, block by block.

  Args:
    raw: the tensor's bytes (any shape or dtype; only its buffer is read), little-endian.
    qtype: ggml type as a name ("Q4_1"), an int id, or a `gguf.GGMLQuantizationType`.
    shape: the numpy shape of the decoded tensor (GGUF's dims reversed, rows last).
  Returns:
    float32 array of `shape`.
  """
  sizes = _quant_sizes()
  if isinstance(qtype, str):
    ids = {name: type_id for type_id, (name, _, _) in sizes.items()}
    if qtype not in ids:
      raise CheckpointError(f"unknown ggml tensor type {qtype!r}")
    type_id = ids[qtype]
  else:
    type_id = int(qtype)
    if type_id not in sizes:
      raise CheckpointError(f"unknown ggml tensor type id {type_id}")
  name, block, block_bytes = sizes[type_id]
  if name not in OWN_TYPES and not _gguf_dequantizes(type_id):
    raise CheckpointError(_unsupported(name))
  n = math.prod(shape)
  if n % block:
    raise CheckpointError(f"{n} elements of type {name} are not whole blocks of {block}")
  buf = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
  if buf.size != n // block * block_bytes:
    raise CheckpointError(f"{name} tensor of shape {tuple(shape)} needs"
                          f" {n // block * block_bytes} bytes, got {buf.size}")
  if name == "F32":
    out = buf.view("<f4").astype(np.float32, copy=False)
  elif name == "F16":
    out = buf.view("<f2").astype(np.float32)
  elif name == "BF16":
    out = (buf.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
  elif name in _BLOCK_DEQUANT:
    out = _BLOCK_DEQUANT[name](buf.reshape(-1, block_bytes))
  else:
    out = _dequant_with_gguf(buf.reshape(-1, block_bytes), type_id, block)
  return out.reshape(shape)


# -- header and metadata --------------------------------------------------------------------------


class _Cursor:
  """Bounds-checked little-endian reads over a memory-mapped file."""

  def __init__(self, buf, size: int, path: Path):
    self.buf, self.size, self.path, self.pos = buf, size, path, 0

  def need(self, n: int, what: str):
    if n < 0 or self.pos + n > self.size:
      raise CheckpointError(
          f"{self.path} is truncated or corrupt: {what} needs {n} bytes at offset {self.pos}"
          f" but the file has {self.size} bytes; re-download or re-convert it")

  def u32(self, what: str) -> int:
    self.need(4, what)
    (v,) = struct.unpack_from("<I", self.buf, self.pos)
    self.pos += 4
    return v

  def u64(self, what: str) -> int:
    self.need(8, what)
    (v,) = struct.unpack_from("<Q", self.buf, self.pos)
    self.pos += 8
    return v

  def string(self, what: str) -> bytes:
    n = self.u64(f"{what} length")
    self.need(n, what)
    s = self.buf[self.pos:self.pos + n]
    self.pos += n
    return s


# Metadata arrays are bounded before their first item is read: outside tokenizer.* (where
# jaxspec reads only per-layer settings) by this; tokenizer.* arrays of strings (tokens, merges)
# by the vocabulary limit. Arrays of numbers cost nothing until read: they stay views of the
# memory-mapped file, so a tokenizer's arrays that its model does not read (a gpt2 tokenizer's
# scores) are never touched.
MAX_UNNEEDED_ARRAY = 65536


def _decode(raw: bytes, key: str, path: Path) -> str:
  try:
    return raw.decode("utf-8")
  except UnicodeDecodeError as e:
    raise CheckpointError(f"{path} is corrupt: metadata {key!r} is not UTF-8 text ({e});"
                          " re-download or re-convert it") from None


def _read_value(cur: _Cursor, vtype: int, key: str, depth: int = 0) -> Any:
  """One metadata value: a Python scalar (float32 kept as np.float32, which `_Meta.float`
  prints shortest), a str, a read-only numpy view for an array of numbers, a list otherwise."""
  if vtype in _SCALAR_FORMATS:
    fmt = _SCALAR_FORMATS[vtype]
    cur.need(struct.calcsize(fmt), f"value of {key!r}")
    (v,) = struct.unpack_from(fmt, cur.buf, cur.pos)
    cur.pos += struct.calcsize(fmt)
    return np.float32(v) if vtype == 6 else v
  if vtype == _STRING:
    return _decode(cur.string(f"string value of {key!r}"), key, cur.path)
  if vtype != _ARRAY or depth >= 4:
    raise CheckpointError(f"{cur.path} is corrupt: metadata {key!r} has unknown value type"
                          f" {vtype}; re-download or re-convert it")
  itype = cur.u32(f"array type of {key!r}")
  count = cur.u64(f"array length of {key!r}")
  tokenizer = key.startswith("tokenizer.")
  limit = MAX_VOCAB if tokenizer else MAX_UNNEEDED_ARRAY
  if count > limit and tokenizer and itype not in _SCALAR_FORMATS:
    raise CheckpointError(
        f"{cur.path}: metadata array {key!r} has {count} items, more than jaxspec's vocabulary"
        f" limit of {MAX_VOCAB} (real vocabularies have at most 262,144 tokens); the file is"
        " corrupt: re-download or re-convert it")
  if count > limit and not tokenizer:
    raise CheckpointError(
        f"{cur.path}: metadata array {key!r} has {count} items; jaxspec reads no such array and"
        f" bounds them at {MAX_UNNEEDED_ARRAY} to keep loading fast: remove it (gguf's"
        " gguf_new_metadata.py --remove-metadata) and load again")
  if itype in _SCALAR_FORMATS:
    dtype = np.dtype(_SCALAR_FORMATS[itype])
    cur.need(count * dtype.itemsize, f"array {key!r} of {count} items")
    view = np.frombuffer(cur.buf, dtype, count, cur.pos)
    cur.pos += count * dtype.itemsize
    return view
  # Each string or nested array takes at least 8 bytes: a garbage count fails here, at once.
  cur.need(count * 8, f"array {key!r} of {count} items")
  if itype != _STRING:
    return [_read_value(cur, itype, key, depth + 1) for _ in range(count)]
  buf, pos, size, out = cur.buf, cur.pos, cur.size, []
  unpack = struct.Struct("<Q").unpack_from
  for i in range(count):  # the loop over a vocabulary: kept to the bare reads
    if pos + 8 > size:
      cur.pos = pos
      cur.need(8, f"item {i} of array {key!r}")
    (n,) = unpack(buf, pos)
    pos += 8
    if pos + n > size:
      cur.pos = pos
      cur.need(n, f"item {i} of array {key!r}")
    out.append(buf[pos:pos + n])
    pos += n
  cur.pos = pos
  try:
    return [b.decode("utf-8") for b in out]
  except UnicodeDecodeError:
    bad = next(i for i, b in enumerate(out) if not _utf8(b))
    raise CheckpointError(f"{cur.path} is corrupt: item {bad} of metadata {key!r} is not UTF-8"
                          " text; re-download or re-convert it") from None


def _utf8(b: bytes) -> bool:
  try:
    b.decode("utf-8")
  except UnicodeDecodeError:
    return False
  return True


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
  """One tensor of a GGUF file, after its byte range was checked.

  Attributes:
    name: the tensor's GGUF name ("blk.0.attn_q.weight").
    shape: GGUF dimensions, innermost (the row) first: reversed numpy order.
    tensor_type: its `gguf.GGMLQuantizationType`.
    data: its bytes, a read-only uint8 view of the memory-mapped file (nothing is read yet).
  """

  name: str
  shape: tuple[int, ...]
  tensor_type: Any
  data: np.ndarray


def _read_gguf(path: Path) -> tuple[dict[str, Any], dict[str, GGUFTensor]]:
  """Metadata values and tensors of a GGUF file, with every size, offset and range checked
  before anything is allocated from it.

  Tensor ranges are checked as llama.cpp's reader checks them, and more: each offset is a
  multiple of `general.alignment` (default 32), each range lies inside the file's data section,
  no two ranges overlap, and each range's size is what the tensor's type and shape need. So a
  wrong offset, a wrong type id or a cut file is a `CheckpointError` naming the tensor, before
  any tensor is decoded.

  Returns:
    (metadata key -> value as `_read_value` gives it, tensor name -> `GGUFTensor`), in file
    order.
  """
  size = path.stat().st_size
  if size < 24:
    raise CheckpointError(f"{path} is not a GGUF file: only {size} bytes long")
  with open(path, "rb") as f:
    # Not closed here: the numpy views of metadata arrays and tensors keep the map alive.
    buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
  if buf[:4] != _GGUF_MAGIC:
    raise CheckpointError(f"{path} is not a GGUF file: it starts with {bytes(buf[:4])!r}, not"
                          " b'GGUF' (pass a .gguf file from llama.cpp's converter)")
  cur = _Cursor(buf, size, path)
  cur.pos = 4
  version = cur.u32("version")
  if version & 0xFFFF == 0:
    raise CheckpointError(f"{path} is a big-endian GGUF file, which is not supported:"
                          " convert it with llama.cpp's little-endian converter")
  if version not in (2, 3):
    raise CheckpointError(f"{path} is GGUF version {version}; only versions 2 and 3 are"
                          " supported: re-convert it with a recent llama.cpp")
  n_tensors = cur.u64("tensor count")
  n_kv = cur.u64("metadata count")
  # A metadata entry takes >= 13 bytes and a tensor entry >= 24, so garbage counts fail here.
  if n_kv * 13 + n_tensors * 24 > size:
    raise CheckpointError(f"{path} is truncated or corrupt: it claims {n_kv} metadata entries"
                          f" and {n_tensors} tensors but has only {size} bytes")
  fields: dict[str, Any] = {}
  for _ in range(n_kv):
    key = _decode(cur.string("metadata key"), "metadata key", path)
    vtype = cur.u32(f"type of {key!r}")
    if key in fields:
      raise CheckpointError(f"{path} is corrupt: metadata {key!r} appears twice")
    fields[key] = _read_value(cur, vtype, key)
  alignment = fields.get("general.alignment", _DEFAULT_ALIGNMENT)
  if (not is_int(alignment, numpy=False) or alignment <= 0
      or alignment & (alignment - 1)):
    raise CheckpointError(f"{path} is corrupt: general.alignment {alignment!r} is not a power of"
                          " two")
  sizes = _quant_sizes()
  infos = []
  for _ in range(n_tensors):
    name = _decode(cur.string("tensor name"), "tensor name", path)
    n_dims = cur.u32(f"rank of tensor {name!r}")
    if n_dims > 8:
      raise CheckpointError(f"{path} is corrupt: tensor {name!r} has rank {n_dims}")
    dims = tuple(cur.u64(f"shape of tensor {name!r}") for _ in range(n_dims))
    type_id = cur.u32(f"type of tensor {name!r}")
    offset = cur.u64(f"offset of tensor {name!r}")
    if type_id not in sizes:
      raise CheckpointError(
          f"{path}: tensor {name!r} has unknown ggml type id {type_id}; the file is corrupt or"
          " from a newer llama.cpp than the installed gguf package knows")
    type_name, block, block_bytes = sizes[type_id]
    if dims and dims[0] % block:
      raise CheckpointError(f"{path} is corrupt: tensor {name!r} rows of {dims[0]} are not"
                            f" whole {type_name} blocks of {block}")
    infos.append((name, dims, type_id, offset, math.prod(dims) // block * block_bytes))
  data_start = -(-cur.pos // alignment) * alignment
  fix = "the file is corrupt: re-download or re-convert it"
  for name, dims, type_id, offset, n_bytes in infos:
    what = f"tensor {name!r} ({sizes[type_id][0]}, shape {list(dims)}, {n_bytes} bytes)"
    if offset % alignment:
      raise CheckpointError(f"{path}: {what} starts at data offset {offset}, which is not a"
                            f" multiple of general.alignment {alignment}; {fix}")
    if data_start + offset + n_bytes > size:
      raise CheckpointError(
          f"{path} is truncated: tensor {name!r} needs bytes up to"
          f" {data_start + offset + n_bytes} ({n_bytes} bytes of {sizes[type_id][0]}, shape"
          f" {list(dims)}) but the file has {size}: it is cut short, or the tensor's type, shape"
          " or offset is wrong; re-download or re-convert it")
  # Sorted by start, the first overlap is between neighbours; empty tensors hold no bytes and are
  # left out (one between two overlapping tensors hid their overlap).
  by_start = sorted((t for t in infos if t[4]), key=lambda t: (t[3], t[4]))
  for a, b in zip(by_start, by_start[1:]):
    if a[3] + a[4] > b[3]:
      raise CheckpointError(
          f"{path}: tensor {a[0]!r} ({sizes[a[2]][0]}, {a[4]} bytes from data offset {a[3]})"
          f" overlaps tensor {b[0]!r} (from data offset {b[3]}): a tensor's type or offset is"
          f" wrong; {fix}")
  import gguf  # the type enum only; imported late like everywhere in this module
  tensors: dict[str, GGUFTensor] = {}
  for name, dims, type_id, offset, n_bytes in infos:
    if name in tensors:
      raise CheckpointError(f"{path} is corrupt: tensor {name!r} appears twice")
    tensors[name] = GGUFTensor(name=name, shape=dims,
                               tensor_type=gguf.GGMLQuantizationType(type_id),
                               data=np.frombuffer(buf, np.uint8, n_bytes, data_start + offset))
  return fields, tensors


# -- metadata -> config ---------------------------------------------------------------------------

_REQUIRED = object()


class _Meta:
  """Typed access to metadata values (`_read_gguf`'s), with errors that name the key."""

  def __init__(self, fields: dict[str, Any], path: Path):
    self.fields, self.path = fields, path

  def get(self, key: str, default: Any = _REQUIRED) -> Any:
    if key not in self.fields:
      if default is _REQUIRED:
        raise CheckpointError(f"{self.path}: metadata {key!r} is missing; the file is incomplete"
                              " (re-convert it with llama.cpp's convert_hf_to_gguf.py)")
      return default
    v = self.fields[key]
    if isinstance(v, np.ndarray):  # a view of the file until a key jaxspec reads asks for it
      if v.size > MAX_UNNEEDED_ARRAY:
        raise CheckpointError(f"{self.path}: metadata {key!r} has {v.size} values, more than"
                              f" the {MAX_UNNEEDED_ARRAY} jaxspec accepts; the file is corrupt")
      return v.tolist()
    return v

  def int(self, key: str, default: Any = _REQUIRED) -> int | None:
    v = self.get(key, default)
    if v is None and default is None:
      return None
    if isinstance(v, list):  # per-layer values (e.g. head_count_kv) must agree
      if not v or len(set(v)) != 1:
        raise CheckpointError(f"{self.path}: per-layer {key!r} = {v} differs across layers,"
                              " which jaxspec does not support")
      v = v[0]
    if not is_int(v):
      raise CheckpointError(f"{self.path}: metadata {key!r} = {v!r} is not an integer")
    return int(v)

  def float(self, key: str, default: Any = _REQUIRED) -> float | None:
    v = self.get(key, default)
    if v is None and default is None:
      return None
    if isinstance(v, bool) or not isinstance(v, (int, float, np.number)):
      raise CheckpointError(f"{self.path}: metadata {key!r} = {v!r} is not a number")
    if isinstance(v, np.float32):
      # The shortest decimal that rounds to the stored float32: 1e-05, not 9.999999747e-06.
      return float(str(v))
    return float(v)


def llama3_rope_factors(scaling: RopeScaling, theta: float, head_dim: int) -> np.ndarray:
  """The `rope_freqs.weight` tensor llama.cpp writes for Llama-3 scaling ([K/2] divisors)."""
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  wavelen = 2 * math.pi / inv
  orig = scaling.original_max_position_embeddings
  smooth = (orig / wavelen - scaling.low_freq_factor) / (
      scaling.high_freq_factor - scaling.low_freq_factor)
  mid = 1 / ((1 - smooth) / scaling.factor + smooth)
  out = np.where(wavelen < orig / scaling.high_freq_factor, 1.0,
                 np.where(wavelen > orig / scaling.low_freq_factor, scaling.factor, mid))
  return out.astype(np.float32)


def _scaling_from_rope_factors(factors: np.ndarray, theta: float, head_dim: int,
                               path: Path) -> RopeScaling | None:
  """Recovers Llama-3 rope scaling parameters from llama.cpp's per-frequency divisors.

  In the blended band, 1/f is linear in the inverse frequency; the band's two edges fix
  (original context, low, high) up to a common scale, so low_freq_factor = 1 is taken and the
  others follow. The result is checked to reproduce every divisor.
  """
  f = factors.astype(np.float64).reshape(-1)
  inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  bad = CheckpointError(f"{path}: rope_freqs.weight does not follow Llama-3 rope scaling, the"
                        " only per-frequency scaling jaxspec supports")
  if f.shape != inv.shape or not np.all(np.isfinite(f)) or f.min() < 1 - 1e-4:
    raise bad
  factor = float(f.max())
  if factor < 1 + 1e-4:
    return None
  smooth = (1 / f - 1 / factor) / (1 - 1 / factor)  # 0 at the low band edge, 1 at the high
  mid = (smooth > 1e-4) & (smooth < 1 - 1e-4)
  if mid.sum() >= 2:
    a, b = np.linalg.lstsq(np.stack([inv[mid], -np.ones(mid.sum())], 1), smooth[mid],
                           rcond=None)[0]
  elif mid.sum() == 1:  # one point of the band: take Llama 3's band width (high/low = 4)
    b = 1 / 3
    a = (smooth[mid][0] + b) / inv[mid][0]
  else:  # no blended band to fit: put its edges midway (in log) between neighbouring entries
    low, high = inv[smooth <= 1e-4], inv[smooth >= 1 - 1e-4]
    if not low.size or not high.size:
      raise bad
    inv0, inv1 = math.sqrt(low.max() * inv[inv > low.max()].min()), math.sqrt(
        high.min() * inv[inv < high.min()].max())
    a = 1 / (inv1 - inv0)
    b = a * inv0
  if not (a > 0 and b > 0):
    raise bad
  orig = 2 * math.pi * a / b
  scaling = RopeScaling(factor=factor, low_freq_factor=1.0, high_freq_factor=1.0 + 1.0 / b,
                        original_max_position_embeddings=max(1, round(orig)))
  cfg = LlamaConfig(vocab_size=1, hidden_size=head_dim, intermediate_size=1, num_layers=1,
                    num_heads=1, num_kv_heads=1, head_dim=head_dim, rope_theta=theta,
                    rope_scaling=scaling)
  if not np.allclose(np.asarray(rope_inv_freq(cfg), np.float64), inv / f, rtol=1e-3, atol=0):
    raise bad
  return scaling


# -- tensors --------------------------------------------------------------------------------------


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
  """Inverts convert_hf_to_gguf's `permute`, which interleaves each head's two rotary halves.

  permute: w.reshape(n_head, 2, K//2, *rest).swapaxes(1, 2).reshape(w.shape)
  """
  k = w.shape[0] // n_head
  return w.reshape(n_head, k // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def load_gguf(path: str | os.PathLike, dtype: str | None = None, *, place=None,
              scan: bool = True, allow_nonfinite: bool = False) -> Model:
  """Loads a llama.cpp GGUF checkpoint, tokenizer included (see `_load_gguf`); whatever a
  malformed file makes the readers raise comes out as a `CheckpointError` naming the file."""
  if dtype not in (None, "float32", "bfloat16"):
    raise ValueError(f"dtype {dtype!r} is not supported: use 'float32', 'bfloat16' or None (the"
                     " checkpoint's)")
  return read_checkpoint(path, _load_gguf, path, dtype, place, scan, allow_nonfinite)


def _load_gguf(path: str | os.PathLike, dtype: str | None = None, place=None,
               scan: bool = True, allow_nonfinite: bool = False) -> Model:
  """Loads a llama.cpp GGUF checkpoint, tokenizer included.

  Args:
    path: a `.gguf` file of architecture `llama` (Llama, Mistral, SmolLM) or `qwen2`, with
      tensors of any type in `supported_types()` (dequantized at load): F32, F16, BF16, the
      Q4/Q5/Q8 block types, the K-quants Q2_K..Q6_K and the IQ types.
    dtype: parameter dtype, "float32" or "bfloat16"; default the file's: bfloat16 when its
      matrices are BF16, float32 otherwise (quantized and F16 values are exact in float32).
    place, scan: as `jaxspec.models.llama.stack_params` (each device receives its shards).
    allow_nonfinite: load weights that hold NaN or infinite values instead of refusing them.
  Returns:
    `Model` with config, params, tokenizer and the file's `general.name`.
  Raises:
    CheckpointError: missing, truncated or malformed file (a tensor's byte range misaligned,
      outside the data section, overlapping another or of the wrong size for its type and
      shape); unsupported architecture or tensor type (both named in the message); a weight
      with NaN or infinite values (named), unless `allow_nonfinite`.
  """
  path = Path(path)
  if not path.exists():
    raise CheckpointError(f"GGUF file {path} does not exist: check the path")
  if not path.is_file():
    raise CheckpointError(f"{path} is not a file: pass a .gguf file (load Hugging Face"
                          " directories with load_hf)")
  fields, tensors = _read_gguf(path)
  meta = _Meta(fields, path)
  arch = meta.get("general.architecture")
  family = families.by_gguf_architecture(arch)
  if family is None:
    raise CheckpointError(
        f"{path}: GGUF architecture {arch!r} is not supported (supported:"
        f" {', '.join(SUPPORTED_ARCHITECTURES)}); jaxspec runs Llama-family decoders only")

  experts = meta.int(f"{arch}.expert_count", None)
  if experts:
    raise CheckpointError(f"{path}: a mixture-of-experts model ({experts} experts) is not"
                          " supported; jaxspec runs dense decoders")

  n_layers = meta.int(f"{arch}.block_count")
  per_block = family.gguf_min_block_tensors
  if n_layers > len(tensors) // per_block:
    raise CheckpointError(
        f"{path}: block_count {n_layers} is more than its {len(tensors)} tensors can hold"
        f" ({per_block} per block); the file is corrupt: re-download or re-convert it")
  d = meta.int(f"{arch}.embedding_length")
  n_heads = meta.int(f"{arch}.attention.head_count")
  n_kv = meta.int(f"{arch}.attention.head_count_kv", n_heads)
  head_dim = meta.int(f"{arch}.attention.key_length", d // n_heads if n_heads else 0)
  value_dim = meta.int(f"{arch}.attention.value_length", head_dim)
  rope_dim = meta.int(f"{arch}.rope.dimension_count", head_dim)
  ff = meta.int(f"{arch}.feed_forward_length")
  if min(n_layers, d, n_heads, n_kv, head_dim, ff) <= 0:
    raise CheckpointError(
        f"{path}: model sizes (block_count {n_layers}, embedding_length {d}, head_count"
        f" {n_heads}, head_count_kv {n_kv}, head size {head_dim}, feed_forward_length {ff})"
        " must all be positive; the file is corrupt")
  if value_dim != head_dim or not 0 < rope_dim <= head_dim or rope_dim % 2:
    raise CheckpointError(
        f"{path}: key_length {head_dim}, value_length {value_dim} and rope.dimension_count"
        f" {rope_dim}: jaxspec needs equal key and value head sizes and an even rotary size of"
        " at most the head size")
  if "token_embd.weight" not in tensors:
    raise CheckpointError(f"{path}: tensor 'token_embd.weight' is missing; the file is"
                          " incomplete")
  if len(tensors["token_embd.weight"].shape) != 2:
    raise CheckpointError(f"{path}: tensor 'token_embd.weight' is not a matrix; the file is"
                          " corrupt")
  vocab = int(tensors["token_embd.weight"].shape[1])  # GGUF dims are [D, V]
  tokens = meta.get("tokenizer.ggml.tokens", None)
  if tokens is not None and len(tokens) > vocab:
    raise CheckpointError(f"{path}: the tokenizer has {len(tokens)} tokens but the embedding"
                          f" only {vocab} rows; the file is inconsistent")
  theta = meta.float(f"{arch}.rope.freq_base", 10000.0)
  if not math.isfinite(theta) or theta <= 0:
    raise CheckpointError(f"{path}: rope.freq_base {theta} must be a finite number > 0; the file"
                          " is corrupt")

  scaling = None
  scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
  factor = meta.float(f"{arch}.rope.scaling.factor", 1.0)
  orig_ctx = meta.int(f"{arch}.rope.scaling.original_context_length", None)
  max_pos = meta.int(f"{arch}.context_length", 8192)
  if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
    # Phi-3 LongRoPE: per-frequency divisors; the attention factor as llama.cpp's converter
    # writes it (rope.scaling.attn_factor), else from the context extension as transformers.
    def factors(name):
      if name not in tensors:
        raise CheckpointError(f"{path}: tensor {name!r} is missing beside its LongRoPE pair")
      t = tensors[name]
      return tuple(float(x) for x in dequantize(t.data, t.tensor_type, (int(t.shape[0]),)))
    orig = orig_ctx or max_pos
    ext = max_pos / orig
    try:  # (their count against rope.dimension_count is LlamaConfig's check, below)
      scaling = RopeScaling(rope_type="longrope", factor=max(ext, 1.0),
                            original_max_position_embeddings=orig,
                            attention_factor=meta.float(f"{arch}.rope.scaling.attn_factor",
                                                        longrope_attention_factor(ext, orig)),
                            short_factor=factors("rope_factors_short.weight"),
                            long_factor=factors("rope_factors_long.weight"))
    except ValueError as e:
      raise CheckpointError(f"{path}: invalid LongRoPE factors: {e}") from e
  elif scaling_type == "linear" and factor != 1.0:
    scaling = RopeScaling(rope_type="linear", factor=factor)
  elif scaling_type == "yarn":
    # ggml's YaRN scales cos/sin by rope.scaling.attn_factor (default 1) times
    # 1 + 0.1 ln(factor) (`rope_yarn` in ggml), transformers' default attention factor.
    try:
      scaling = RopeScaling(
          rope_type="yarn", factor=factor, original_max_position_embeddings=orig_ctx or max_pos,
          attention_factor=(meta.float(f"{arch}.rope.scaling.attn_factor", 1.0)
                            * yarn_mscale(factor)),
          beta_fast=meta.float(f"{arch}.rope.scaling.yarn_beta_fast", 32.0),
          beta_slow=meta.float(f"{arch}.rope.scaling.yarn_beta_slow", 1.0))
    except ValueError as e:
      raise CheckpointError(f"{path}: invalid YaRN rope scaling: {e}") from e
  elif "rope_freqs.weight" in tensors:
    t = tensors["rope_freqs.weight"]
    factors = dequantize(t.data, t.tensor_type, tuple(int(x) for x in reversed(t.shape)))
    try:
      scaling = _scaling_from_rope_factors(factors, theta, head_dim, path)
    except (ValueError, ZeroDivisionError, FloatingPointError, OverflowError) as e:
      if isinstance(e, CheckpointError):
        raise
      raise CheckpointError(f"{path}: tensor 'rope_freqs.weight' is not a Llama-3 rope scaling"
                            f" ({type(e).__name__}: {e}); the file is corrupt") from e
  elif scaling_type not in ("none", None, "linear"):
    raise CheckpointError(
        f"{path}: rope scaling type {scaling_type!r} (factor"
        f" {meta.get(f'{arch}.rope.scaling.factor', None)}) is not supported; jaxspec supports"
        " unscaled rotary embeddings, linear and YaRN scaling, Llama-3 scaling (a rope_freqs"
        " tensor) and LongRoPE (rope_factors tensors)")

  # Sliding-window layers: the file's attention.sliding_window_pattern, else the family's fixed
  # pattern (llama.cpp's: Gemma 2 alternates, Gemma 3 has every sixth layer global), else a
  # window slides everywhere (Phi-3, Mistral-style files). A family may give a window where the
  # file records none (Gemma 2 files written before the key existed).
  window = meta.int(f"{arch}.attention.sliding_window", family.gguf_default_window)
  layer_types = None
  pattern = meta.get(f"{arch}.attention.sliding_window_pattern", None)
  if window:
    if isinstance(pattern, (list, tuple)):
      if len(pattern) != n_layers:
        raise CheckpointError(f"{path}: attention.sliding_window_pattern lists {len(pattern)}"
                              f" layers, block_count is {n_layers}; the file is inconsistent")
      layer_types = tuple("sliding" if p else "full" for p in pattern)
    elif family.gguf_sliding_pattern is not None:
      every = int(pattern) if pattern else family.gguf_sliding_pattern
      layer_types = every_nth_full(n_layers, every)
    if layer_types is not None and "full" not in layer_types:
      layer_types = None
    if layer_types is not None and "sliding" not in layer_types:
      layer_types, window = None, None
  # The rotated share of each head as a factor whose int(head_dim * factor) is rope_dim.
  partial = rope_dim / head_dim
  if int(head_dim * partial) != rope_dim:
    partial = (rope_dim + 0.5) / head_dim

  if dtype is None:
    kinds = [t.tensor_type.name for t in tensors.values() if len(t.shape) == 2]
    dtype = "bfloat16" if kinds and kinds.count("BF16") * 2 > len(kinds) else "float32"
  eos_ids = tuple(dict.fromkeys(
      i for i in (meta.int(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom"))
      if i is not None))
  # Switches a tensor's presence shows; the family adds what its metadata (or llama.cpp's fixed
  # settings) say.
  try:
    cfg_fields = dict(
        vocab_size=vocab, hidden_size=d, intermediate_size=ff,
        num_layers=n_layers, num_heads=n_heads, num_kv_heads=n_kv, head_dim=head_dim,
        rope_theta=theta, rope_scaling=scaling,
        rms_norm_eps=meta.float(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5),
        tie_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        sliding_window=window or None, max_position_embeddings=max_pos,
        bos_token_id=meta.int("tokenizer.ggml.bos_token_id", None), eos_token_ids=eos_ids or (2,),
        dtype=dtype, architecture=family.architecture,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
        post_norms="blk.0.post_ffw_norm.weight" in tensors,
        layer_types=layer_types, partial_rotary_factor=partial)
    cfg_fields.update(family.gguf_switches(meta, cfg_fields))
    cfg = LlamaConfig(**cfg_fields)
  except ValueError as e:
    raise CheckpointError(f"{path}: invalid or inconsistent model metadata: {e}") from e

  params = _read_params(tensors, cfg, path, place, scan, allow_nonfinite)
  from jaxspec.models.tokenizer import Tokenizer
  tokenizer = Tokenizer.from_gguf(fields, source=str(path)) if tokens is not None else None
  return Model(cfg=cfg, params=params, tokenizer=tokenizer,
               name=str(meta.get("general.name", path.stem)))


# Block types whose values are float16 scales (and minimums) times small integers: finite scales
# give finite values, so checking the scales (1/9 to 1/17 of the bytes) checks the tensor.
_SCALE_BYTES = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4}


def _scales_finite(t: GGUFTensor) -> bool:
  """True when `t`'s values are certainly finite from its block scales alone; False means look
  at the decoded values (another type, or a non-finite scale)."""
  name = t.tensor_type.name
  if name not in _SCALE_BYTES:
    return False
  block_bytes = _quant_sizes()[int(t.tensor_type)][2]
  bits = t.data.reshape(-1, block_bytes)[:, :_SCALE_BYTES[name]].view("<u2")
  # A float16 is a NaN or an infinity exactly when its exponent bits are all ones.
  return bool((bits & np.uint16(0x7C00)).max(initial=0) < 0x7C00)


def _read_params(tensors: dict, cfg: LlamaConfig, path: Path, place=None, scan: bool = True,
                 allow_nonfinite: bool = False) -> Params:
  """Dequantizes and reshapes every weight into jaxspec's layout (each refused, unless
  `allow_nonfinite`, when it decodes to a NaN or an infinity)."""
  d, f, h, g, k = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim)
  names = ["token_embd.weight", "output_norm.weight"]
  names += [] if cfg.tie_embeddings else ["output.weight"]
  family = families.family(cfg.architecture)
  has = tensors.__contains__
  layer_names = ["attn_norm.weight", "attn_output.weight", "ffn_norm.weight", "ffn_down.weight"]
  layer_names += family.gguf_projection_names(has)
  if cfg.qk_norm:
    layer_names += ["attn_q_norm.weight", "attn_k_norm.weight"]
  if cfg.post_norms:
    layer_names += ["post_attention_norm.weight", "post_ffw_norm.weight"]
  if cfg.attention_bias:
    layer_names += ["attn_q.bias", "attn_k.bias", "attn_v.bias"]
  names += [f"blk.{i}.{n}" for i in range(cfg.num_layers) for n in layer_names]
  missing = [n for n in names if n not in tensors]
  if missing:
    raise CheckpointError(f"{path}: tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}"
                          " are missing; the file is incomplete")
  unsupported = {}
  for n in names:
    t = tensors[n].tensor_type
    if t.name not in OWN_TYPES and not _gguf_dequantizes(int(t)):
      unsupported.setdefault(t.name, n)
  if unsupported:  # found before anything is decoded
    listed = ", ".join(f"{t} (e.g. {n})" for t, n in unsupported.items())
    raise CheckpointError(f"{path}: {_unsupported(listed)}")

  def get(name, shape):
    t = tensors[name]
    got = tuple(int(x) for x in reversed(t.shape))  # GGUF lists dims innermost first
    if got != shape:
      raise CheckpointError(f"{path}: tensor {name!r} has shape {got}, expected {shape} from"
                            " the metadata; the file is inconsistent")
    with np.errstate(invalid="ignore", over="ignore"):  # non-finite values: refused below
      out = dequantize(t.data, t.tensor_type, shape)
    if not (allow_nonfinite or _scales_finite(t)):
      refuse_nonfinite(out, name, path)
    return out

  permute = family.gguf_permuted_qk  # the converter interleaved rotary pairs (Llama)

  def layer(i):
    p = f"blk.{i}."
    wq, wk, wv, w_gate, w_up = family.gguf_projections(get, has, p, cfg)  # [out, in]
    if permute:
      wq, wk = _unpermute_rows(wq, h), _unpermute_rows(wk, g)
    out = dict(
        attn_norm=get(p + "attn_norm.weight", (d,)),
        wq=wq.T.reshape(d, h, k), wk=wk.T.reshape(d, g, k), wv=wv.T.reshape(d, g, k),
        wo=get(p + "attn_output.weight", (d, h * k)).T.reshape(h, k, d),
        mlp_norm=get(p + "ffn_norm.weight", (d,)), w_gate=w_gate.T, w_up=w_up.T,
        w_down=get(p + "ffn_down.weight", (d, f)).T)
    if cfg.qk_norm:
      out.update(q_norm=get(p + "attn_q_norm.weight", (k,)),
                 k_norm=get(p + "attn_k_norm.weight", (k,)))
    if cfg.post_norms:
      out.update(post_attn_norm=get(p + "post_attention_norm.weight", (d,)),
                 post_mlp_norm=get(p + "post_ffw_norm.weight", (d,)))
    if cfg.attention_bias:
      bq, bk = get(p + "attn_q.bias", (h * k,)), get(p + "attn_k.bias", (g * k,))
      if permute:
        bq, bk = _unpermute_rows(bq, h), _unpermute_rows(bk, g)
      out.update(bq=bq.reshape(h, k), bk=bk.reshape(g, k),
                 bv=get(p + "attn_v.bias", (g * k,)).reshape(g, k))
    return out

  lm_head = None if cfg.tie_embeddings else lambda: get("output.weight", (cfg.vocab_size, d)).T
  return stack_params(cfg, layer, lambda: get("token_embd.weight", (cfg.vocab_size, d)),
                      lambda: get("output_norm.weight", (d,)), lm_head, place=place, scan=scan)
