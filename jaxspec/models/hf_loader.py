"""Hugging Face checkpoint directories (config.json + safetensors) to and from jaxspec `Params`.

Supported architectures: the classes of `ARCHITECTURES` (Llama, Mistral, Qwen2, Qwen3, Gemma
1/2/3, Phi-3) and the text decoder of Gemma3ForConditionalGeneration, in one
`model.safetensors` or in shards listed by `model.safetensors.index.json`. Safetensors files are
read through the `safetensors` library (`safe_open(..., framework="numpy")`), one tensor at a
time as the loader asks for it. Its numpy framework returns bfloat16 as `ml_dtypes.bfloat16`
(it finds numpy's "bfloat16" dtype, which importing ml_dtypes registers), so no torch or jax is
involved. Before the library opens a file, its header is checked here against the file size, so
a truncated or malformed file is a `CheckpointError` naming the tensor and the fix, not the
library's bare "incomplete metadata". Pickled checkpoints (`pytorch_model.bin`) are never
loaded.

What is specific to a family (its class names, how its config.json sets `LlamaConfig`'s
switches, its tensor names where they differ from Llama's) is in its file under
`jaxspec.models.families`; this module reads the formats and asks the family.

`save_hf` writes the same layout with Hugging Face tensor names, so `transformers` can read what
jaxspec writes (a distilled draft model, or a tiny model in a test). The writer is jaxspec's own:
`safetensors.numpy.save_file` writes the same bytes except that it orders the tensors by dtype
and name, where jaxspec keeps the order it was given.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from jaxspec.checks import is_int
from jaxspec.models import families
from jaxspec.models.config import (LlamaConfig, RopeScaling, longrope_attention_factor,
                                   yarn_mscale)
from jaxspec.models.errors import CheckpointError, read_checkpoint, read_json, refuse_nonfinite
from jaxspec.models.families.base import Family, flag
from jaxspec.models.llama import Params, stack_params, stacked_layers
from jaxspec.models.model import Model

# Hugging Face class name -> jaxspec `LlamaConfig.architecture` (the families' registry).
ARCHITECTURES = families.HF_CLASSES


def text_config(config: Mapping[str, Any]) -> tuple[Mapping[str, Any], str]:
  """(the text decoder's config, the prefix of its tensor names) of a config.json: itself and
  "" for a text model; text_config and "language_model." for Gemma 3's multimodal checkpoints
  (gemma-3-4b and larger), whose text decoder runs alone."""
  archs = config.get("architectures") or []
  multimodal = families.text_of_multimodal(archs[0]) if archs else None
  if multimodal and isinstance(config.get("text_config"), dict):
    family, prefix = multimodal
    text = dict(config["text_config"], architectures=[family.hf_class])
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id", "torch_dtype", "dtype"):
      if key in config and key not in text:
        text[key] = config[key]
    return text, prefix
  return config, ""


class _Prefixed(Mapping[str, np.ndarray]):
  """Tensors under `prefix` seen by their text model names ("model.layers.0..." ->
  "language_model.model.layers.0...")."""

  def __init__(self, tensors: Mapping[str, np.ndarray], prefix: str):
    self._tensors, self._prefix = tensors, prefix

  def __getitem__(self, name: str) -> np.ndarray:
    return self._tensors[self._prefix + name]

  def __contains__(self, name: object) -> bool:
    return isinstance(name, str) and self._prefix + name in self._tensors

  def __iter__(self) -> Iterator[str]:
    n = len(self._prefix)
    return (k[n:] for k in self._tensors if k.startswith(self._prefix))

  def __len__(self) -> int:
    return sum(1 for _ in self)

_ST_DTYPES = {"F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
              "BF16": np.dtype(ml_dtypes.bfloat16), "I64": np.dtype("<i8"),
              "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
              "U8": np.dtype("u1"), "BOOL": np.dtype("?")}
_FLOAT_DTYPES = tuple(_ST_DTYPES[k] for k in ("F64", "F32", "F16", "BF16"))
# The dtypes weights can be saved in (save_hf, heads.save_head, train.export): safetensors name
# and numpy dtype.
SAVE_DTYPES = {"float32": ("F32", np.float32), "bfloat16": ("BF16", ml_dtypes.bfloat16),
               "float16": ("F16", np.float16)}
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header


# -- safetensors ----------------------------------------------------------------------------------


def _check_safetensors(path: Path) -> list[str]:
  """The tensor names of a .safetensors file in header order, after checking its header: its
  length, its JSON, and every tensor's dtype, shape and offsets against the file size."""
  size = path.stat().st_size
  with open(path, "rb") as f:
    head = f.read(8)
    if len(head) < 8:
      raise CheckpointError(f"{path} is not a safetensors file: only {size} bytes long")
    n = int.from_bytes(head, "little")
    if n > min(size - 8, _MAX_HEADER):
      raise CheckpointError(f"{path} is truncated or not a safetensors file: its header claims"
                            f" {n} bytes but the file has {size}; re-download or re-save it")
    raw = f.read(n)
  try:
    header = json.loads(raw.decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path} is not a safetensors file: its header is not JSON ({e})") from e
  if not isinstance(header, dict):
    raise CheckpointError(f"{path} is not a safetensors file: its header is not a JSON object")
  header.pop("__metadata__", None)
  start = 8 + n
  for name, info in header.items():
    if isinstance(info, dict) and isinstance(info.get("dtype"), str) and (
        info["dtype"] not in _ST_DTYPES):
      what = " (FP8)" if info["dtype"].startswith("F8") else ""
      raise CheckpointError(
          f"{path}: tensor {name!r} is stored as {info['dtype']}{what}, which jaxspec does not"
          f" read (it reads {', '.join(_ST_DTYPES)}): use the checkpoint's bfloat16, float16 or"
          " float32 release, or dequantize it first (a quantized model also loads as a GGUF)")
    try:
      dtype = _ST_DTYPES[info["dtype"]]
      shape = tuple(int(s) for s in info["shape"])
      begin, end = (int(x) for x in info["data_offsets"])
    except (KeyError, TypeError, ValueError) as e:
      raise CheckpointError(f"{path}: tensor {name!r} has a malformed header entry {info!r}"
                            f" ({type(e).__name__}: {e})") from e
    if any(s < 0 for s in shape) or not 0 <= begin <= end:
      raise CheckpointError(f"{path}: tensor {name!r} has invalid shape {shape} or offsets"
                            f" [{begin}, {end})")
    if end - begin != math.prod(shape) * dtype.itemsize:
      raise CheckpointError(f"{path}: tensor {name!r} of shape {shape} and dtype"
                            f" {info['dtype']} does not fit its {end - begin} bytes")
    if start + end > size:
      raise CheckpointError(f"{path} is truncated: tensor {name!r} needs bytes up to"
                            f" {start + end} but the file has {size}; re-download or re-save it")
  return list(header)


class SafetensorsFiles(Mapping[str, np.ndarray]):
  """The tensors of one or more .safetensors files (a checkpoint's shards), each read by the
  `safetensors` library when it is looked up, so a load holds one raw tensor at a time.

  A name in several files is read from the last. Use as a context manager, or call `close`.

  Raises:
    CheckpointError: on opening, a file whose header is malformed or disagrees with its size;
      on lookup, a tensor the library cannot read.
  """

  def __init__(self, paths: str | os.PathLike | Sequence[str | os.PathLike]):
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    from safetensors import SafetensorError, safe_open  # imported late, like gguf
    self._error = SafetensorError
    self._files: list[tuple[Path, Any]] = []
    self._where: dict[str, int] = {}
    try:
      for path in map(Path, paths):
        names = _check_safetensors(path)  # the library's errors do not name the tensor
        try:
          handle = safe_open(path, framework="numpy")
        except SafetensorError as e:  # what the checks above let through (e.g. overlaps)
          raise CheckpointError(f"{path} is not a valid safetensors file ({e}); re-download or"
                                " re-save it") from e
        self._where.update((name, len(self._files)) for name in names)
        self._files.append((path, handle))
    except BaseException:
      self.close()
      raise

  def __getitem__(self, name: str) -> np.ndarray:
    path, handle = self._files[self._where[name]]  # KeyError for a missing name
    try:
      return handle.get_tensor(name)
    except (self._error, TypeError, ValueError) as e:
      raise CheckpointError(f"{path}: tensor {name!r} cannot be read ({type(e).__name__}: {e});"
                            " re-download or re-save it") from e

  def __iter__(self) -> Iterator[str]:
    return iter(self._where)

  def __len__(self) -> int:
    return len(self._where)

  def __contains__(self, name: object) -> bool:
    return name in self._where

  def close(self) -> None:
    """Releases the files' memory maps; later lookups raise CheckpointError."""
    for _, handle in self._files:
      handle.__exit__(None, None, None)

  def __enter__(self) -> SafetensorsFiles:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
  """All tensors of one .safetensors file as numpy arrays, in header order (read by the
  `safetensors` library; bfloat16 as `ml_dtypes.bfloat16`). For a large file, iterate a
  `SafetensorsFiles` instead, which reads one tensor at a time.

  Raises:
    CheckpointError: the file is truncated, its header is malformed, or a tensor's offsets,
      shape and dtype disagree.
  """
  with SafetensorsFiles(path) as files:
    return dict(files.items())


def write_safetensors(path: str | os.PathLike, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> int:
  """Writes `tensors` (numpy arrays) as one .safetensors file; returns the bytes of data."""
  names = {v: k for k, v in _ST_DTYPES.items()}
  header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
  offset = 0
  arrays = []
  for name, value in tensors.items():
    a = np.ascontiguousarray(value)
    if a.dtype not in names:
      raise ValueError(f"tensor {name!r} has dtype {a.dtype}, which safetensors cannot store")
    a = a.astype(a.dtype.newbyteorder("<"), copy=False)
    header[name] = {"dtype": names[a.dtype], "shape": list(a.shape),
                    "data_offsets": [offset, offset + a.nbytes]}
    offset += a.nbytes
    arrays.append(a)
  raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
  raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned
  with open(path, "wb") as f:
    f.write(len(raw).to_bytes(8, "little"))
    f.write(raw)
    for a in arrays:
      f.write(a.tobytes())
  return offset


# -- config ---------------------------------------------------------------------------------------


def _ids(value: Any) -> list[int]:
  """Token ids from a config value that is None, an int or a list of ints."""
  if value is None:
    return []
  values = value if isinstance(value, list) else [value]
  if not all(is_int(v, numpy=False) for v in values):
    raise CheckpointError(f"token id {value!r} is not an integer or a list of integers")
  return list(values)


def config_from_hf(config: Mapping[str, Any], dtype: str = "float32",
                   where: str = "config.json") -> LlamaConfig:
  """A `LlamaConfig` from a Hugging Face config.json dict."""
  try:
    return _parse_config(text_config(config)[0], dtype, where)
  except CheckpointError:
    raise
  except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError,
          ZeroDivisionError, RecursionError) as e:
    raise CheckpointError(f"{where} has a malformed value ({type(e).__name__}: {e}); compare it"
                          " with the config.json that transformers writes") from e


# Activation names of Hugging Face configs -> LlamaConfig.hidden_act.
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "gelu": "gelu"}


def _rope_scaling(rope: Mapping[str, Any], config: Mapping[str, Any], where: str,
                  family: Family) -> RopeScaling | None:
  """`RopeScaling` from one rope_parameters / rope_scaling dict (None: unscaled)."""
  rope_type = rope.get("rope_type", rope.get("type"))
  if rope_type in (None, "default"):
    return None
  if isinstance(rope_type, str):  # names the family's class reads as another type
    rope_type = family.hf_rope_aliases.get(rope_type, rope_type)
  max_pos = int(config.get("max_position_embeddings", 2048))
  # Where transformers takes the pretraining length from: beside the rope dict (Phi-3), in it,
  # else the family's default or max_position_embeddings.
  orig = int(config.get("original_max_position_embeddings")
             or rope.get("original_max_position_embeddings")
             or family.hf_original_context or max_pos)
  if rope_type == "llama3":
    return RopeScaling(
        factor=float(rope["factor"]), low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
        high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(rope.get("original_max_position_embeddings", 8192)))
  if rope_type == "linear":
    return RopeScaling(rope_type="linear", factor=float(rope["factor"]))
  if rope_type == "dynamic":  # transformers scales from the config's max_position_embeddings
    return RopeScaling(rope_type="dynamic", factor=float(rope["factor"]),
                       original_max_position_embeddings=max_pos)
  if rope_type in ("yarn", "longrope", "su"):
    # Without a factor they extend the original context to max_position_embeddings.
    factor = rope.get("factor")
    factor = float(max_pos / orig if factor is None else factor)
    attn = rope.get("attention_factor")
  if rope_type == "yarn":
    if attn is None:
      m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
      attn = (yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all
              else yarn_mscale(factor))
    return RopeScaling(rope_type="yarn", factor=factor, original_max_position_embeddings=orig,
                       attention_factor=float(attn),
                       beta_fast=float(rope.get("beta_fast") or 32),
                       beta_slow=float(rope.get("beta_slow") or 1),
                       truncate=bool(rope.get("truncate", True)))
  if rope_type in ("longrope", "su"):
    if attn is None:
      attn = longrope_attention_factor(factor, orig)
    return RopeScaling(rope_type="longrope", factor=max(factor, 1.0),
                       original_max_position_embeddings=orig, attention_factor=float(attn),
                       short_factor=tuple(float(x) for x in rope["short_factor"]),
                       long_factor=tuple(float(x) for x in rope["long_factor"]))
  raise CheckpointError(f"{where}: rope scaling type {rope_type!r} is not supported; jaxspec"
                        " supports unscaled rotary embeddings and the 'llama3', 'linear',"
                        " 'dynamic', 'yarn' and 'longrope' scalings")


def _family(config: Mapping[str, Any], where: str) -> Family:
  """The family of a (text) config.json: by its class, else by its model_type."""
  archs = config.get("architectures") or []
  arch_name = archs[0] if archs else None
  family = families.by_hf_class(arch_name)
  if family is None and arch_name is None:
    family = families.by_model_type(config.get("model_type"))
  refused_for = families.refusing(arch_name)
  if refused_for is not None:
    raise CheckpointError(f"{where}: {arch_name} is a multimodal checkpoint; jaxspec runs text"
                          f" decoders: load a text-only {refused_for.hf_class} checkpoint")
  if family is None:
    raise CheckpointError(
        f"{where}: architecture {arch_name or config.get('model_type')!r} is not supported"
        f" (supported: {', '.join(ARCHITECTURES)})")
  return family


_REQUIRED = object()


def _int_field(config: Mapping[str, Any], name: str, where: str, default: Any = _REQUIRED, *,
               zero_is_unset: bool = False) -> int:
  """config[name] as an int; a CheckpointError naming the field for anything but an integer (an
  integral float too is taken). Absent or null (or 0, with `zero_is_unset`: as transformers
  reads `head_dim` and `num_key_value_heads`) takes `default`; without one the field is
  required."""
  value = config.get(name)
  if default is not _REQUIRED and (value is None or (zero_is_unset and value == 0)):
    return default
  if name not in config:
    raise CheckpointError(f"{where}: required field {name!r} is missing")
  if isinstance(value, float) and value.is_integer():
    value = int(value)
  if not is_int(value, numpy=False):
    raise CheckpointError(f"{where}: {name} must be an integer, got {value!r}")
  return value


def _parse_config(config: Mapping[str, Any], dtype: str, where: str) -> LlamaConfig:
  family = _family(config, where)
  act_name = family.hf_activation(config)
  if act_name not in _ACTIVATIONS:
    raise CheckpointError(f"{where}: hidden activation {act_name!r} is not supported (supported:"
                          f" {', '.join(_ACTIVATIONS)})")
  if config.get("mlp_bias"):
    raise CheckpointError(f"{where}: mlp_bias is true; jaxspec's MLP has no biases")
  d = _int_field(config, "hidden_size", where)
  n_heads = _int_field(config, "num_attention_heads", where)
  n_layers = _int_field(config, "num_hidden_layers", where)
  ff = _int_field(config, "intermediate_size", where)
  vocab = _int_field(config, "vocab_size", where)
  head_dim = _int_field(config, "head_dim", where, d // max(n_heads, 1), zero_is_unset=True)
  n_kv = _int_field(config, "num_key_value_heads", where, n_heads, zero_is_unset=True)

  # Rotary parameters: transformers 5 keeps them in rope_parameters (Gemma 3: one dict per
  # layer kind), 4.x in rope_theta + rope_scaling (Gemma 3: rope_local_base_freq, read by its
  # family).
  rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
  switches: dict[str, Any] = {}  # the fields the family reads on top of these
  local_scaling = None
  if "full_attention" in rope or "sliding_attention" in rope:
    local = rope.get("sliding_attention") or {}
    rope = rope.get("full_attention") or {}
    if local:
      if "rope_theta" in local:
        switches["sliding_rope_theta"] = local["rope_theta"]
      local_scaling = _rope_scaling(local, config, where, family)
  theta = float(rope.get("rope_theta") or config.get("rope_theta") or 10000.0)
  scaling = _rope_scaling(rope, config, where, family)
  if local_scaling is not None:
    raise CheckpointError(f"{where}: rope scaling of the sliding-window layers is not supported;"
                          " jaxspec scales the global layers' rotary embedding only")
  partial = float(rope.get("partial_rotary_factor") or config.get("partial_rotary_factor")
                  or 1.0)

  layer_types = family.hf_layer_types(config, n_layers, where)
  window = config.get("sliding_window")
  if layer_types is not None:
    if "sliding" not in layer_types or window is None:
      layer_types, window = None, None
    elif "full" not in layer_types:
      layer_types = None  # every layer slides: the Mistral form
  elif not family.hf_window_everywhere:
    window = None  # this family slides only where layer_types say so
  attention_bias = (family.hf_attention_bias if family.hf_attention_bias is not None
                    else flag(config, "attention_bias", False, where))
  tie = flag(config, "tie_word_embeddings", family.hf_tie_default, where)

  eos = _ids(config.get("eos_token_id"))
  bos = config.get("bos_token_id")
  if isinstance(bos, list):
    bos = bos[0] if bos else None
  try:
    fields = dict(
        vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_layers=n_layers,
        num_heads=n_heads, num_kv_heads=n_kv, head_dim=head_dim, rope_theta=theta,
        rope_scaling=scaling, rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
        tie_embeddings=tie, attention_bias=attention_bias,
        sliding_window=None if window is None else _int_field(config, "sliding_window", where),
        max_position_embeddings=_int_field(config, "max_position_embeddings", where, 2048),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(eos) if eos else LlamaConfig.__dataclass_fields__[
            "eos_token_ids"].default,
        dtype=dtype, architecture=family.architecture, hidden_act=_ACTIVATIONS[act_name],
        layer_types=layer_types, partial_rotary_factor=partial, **switches)
    fields.update(family.hf_switches(config, fields, where))
    if fields.get("sliding_rope_theta") is not None:
      fields["sliding_rope_theta"] = float(fields["sliding_rope_theta"])
    return LlamaConfig(**fields)
  except CheckpointError:
    raise  # a family's refusal names its own fix
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{where}: inconsistent configuration: {e}") from e


def config_to_hf(cfg: LlamaConfig, dtype: str) -> dict[str, Any]:
  """The config.json dict `transformers` reads for `cfg`."""
  check_savable(cfg)
  family = families.family(cfg.architecture)
  own = family.hf_save(cfg)  # the family's keys, or ValueError for what its class lacks
  out: dict[str, Any] = {
      "architectures": [family.hf_class], "model_type": family.hf_model_type,
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
      "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
      "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
      "head_dim": cfg.head_dim, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
      "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
      "bos_token_id": cfg.bos_token_id,
      "eos_token_id": (cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1
                       else list(cfg.eos_token_ids)),
      "attention_dropout": 0.0, "initializer_range": 0.02, "use_cache": True,
      "torch_dtype": dtype, "rope_scaling": rope_scaling_to_hf(cfg.rope_scaling),
  }
  out.update(own)
  return out


def hf_class_name(architecture: str) -> str:
  """The transformers class of a jaxspec architecture ("gemma3" -> "Gemma3ForCausalLM")."""
  return {v: k for k, v in ARCHITECTURES.items()}[architecture]


def rope_scaling_to_hf(s: RopeScaling | None) -> dict[str, Any] | None:
  """The rope_scaling dict transformers reads for `s` (None: unscaled)."""
  if s is None:
    return None
  out: dict[str, Any] = {"rope_type": s.rope_type, "factor": s.factor}
  if s.rope_type == "llama3":
    out.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor,
               original_max_position_embeddings=s.original_max_position_embeddings)
  elif s.rope_type == "yarn":
    out.update(original_max_position_embeddings=s.original_max_position_embeddings,
               attention_factor=s.attention_factor, beta_fast=s.beta_fast,
               beta_slow=s.beta_slow, truncate=s.truncate)
  elif s.rope_type == "longrope":
    out.update(original_max_position_embeddings=s.original_max_position_embeddings,
               attention_factor=s.attention_factor, short_factor=list(s.short_factor),
               long_factor=list(s.long_factor))
  return out


# The LlamaConfig fields a saved config.json records: those `config_to_hf` writes for every
# savable family, those the families' `hf_save` write, and the ones that are no checkpoint's
# (dtype is save_hf's argument, compute_dtype and attention_kernel run-time choices). Every
# other field is a switch the savable classes (Llama, Mistral, Qwen2) cannot express and must
# keep its default, so a switch added to LlamaConfig is refused on save until a writer records
# it.
_SAVED = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
          "num_kv_heads", "head_dim", "rope_theta", "rope_scaling", "rms_norm_eps",
          "tie_embeddings", "max_position_embeddings", "bos_token_id", "eos_token_ids",
          "architecture", "attention_bias", "sliding_window", "layer_types", "dtype",
          "compute_dtype", "attention_kernel")


def _unsavable(cfg: LlamaConfig) -> dict[str, Any]:
  """The switches of `cfg`'s class that a saved checkpoint cannot hold, with their defaults."""
  return {f.name: f.default for f in dataclasses.fields(cfg) if f.name not in _SAVED}


def check_savable(cfg: LlamaConfig) -> None:
  """Raises ValueError, before any work, when `save_hf` cannot write a model of `cfg` (a
  family whose Hugging Face class jaxspec does not write, or a switch those classes lack)."""
  if cfg.architecture not in families.SAVABLE:
    raise ValueError(f"saving architecture {cfg.architecture!r} is not supported (jaxspec loads"
                     f" it, but writes only {', '.join(sorted(families.SAVABLE))} checkpoints)")
  for name, value in _unsavable(cfg).items():
    if getattr(cfg, name) != value:
      raise ValueError(f"a {cfg.architecture} checkpoint cannot hold {name}="
                       f"{getattr(cfg, name)!r}: save_hf writes Llama, Mistral and Qwen2"
                       " checkpoints only")


# -- weights --------------------------------------------------------------------------------------


def _shard_files(path: Path) -> list[Path]:
  single = path / "model.safetensors"
  if single.is_file():
    return [single]
  index = path / "model.safetensors.index.json"
  if index.is_file():
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
      raise CheckpointError(f"{index} has no weight_map: re-save the checkpoint")
    files = []
    for name in dict.fromkeys(weight_map.values()):
      if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise CheckpointError(f"{index} names shard {name!r}, which is not a file name in the"
                              " checkpoint directory")
      if not (path / name).is_file():
        raise CheckpointError(f"{index} lists shard {name}, which is missing from {path}:"
                              " download every shard")
      files.append(path / name)
    return files
  if any(path.glob("*.bin")) or any(path.glob("*.pt")) or any(path.glob("*.pth")):
    raise CheckpointError(f"{path} holds only PyTorch pickle weights, which jaxspec never"
                          " unpickles: convert them to safetensors (save_pretrained with"
                          " safe_serialization=True)")
  raise CheckpointError(f"{path} has no model.safetensors or model.safetensors.index.json")


def load_hf(path: str | os.PathLike, dtype: str | None = None, *, place=None,
            scan: bool = True, allow_nonfinite: bool = False) -> Model:
  """Loads a Hugging Face checkpoint directory, tokenizer included when tokenizer.json exists.

  Args:
    path: directory with config.json and model.safetensors (or shards with an index json).
    dtype: parameter dtype, "float32" or "bfloat16"; default the checkpoint's (config.json's
      torch_dtype: bfloat16 stays bfloat16, float32 and float16 load as float32).
    place: lay each weight out on a mesh as it is read (`jaxspec.sharding.rules.Placer`).
    scan: with `place`, whether the layers come stacked (else one set per layer).
    allow_nonfinite: load weights holding NaN or infinite values instead of refusing them.
  Returns:
    `Model`.
  Raises:
    CheckpointError: missing or malformed files, unsupported architecture or settings; a
      weight with NaN or infinite values (named), unless `allow_nonfinite`.
  """
  if dtype not in (None, "float32", "bfloat16"):
    raise ValueError(f"dtype {dtype!r} is not supported: use 'float32', 'bfloat16' or None (the"
                     " checkpoint's)")
  return read_checkpoint(path, _load_hf, path, dtype, place, scan, allow_nonfinite)


def checkpoint_dtype(config: Mapping[str, Any]) -> str:
  """The compute dtype for a config.json's stored dtype: "bfloat16" for bfloat16 checkpoints,
  "float32" otherwise (float16 widens losslessly; jaxspec computes in float32 or bfloat16)."""
  stored = config.get("torch_dtype") or config.get("dtype")
  if isinstance(stored, dict):  # per-module dtypes (multimodal configs)
    stored = next(iter(stored.values()), None)
  return "bfloat16" if stored == "bfloat16" else "float32"


def _load_hf(path: str | os.PathLike, dtype: str | None, place=None, scan: bool = True,
             allow_nonfinite: bool = False) -> Model:
  path = Path(path)
  if not path.exists():
    raise CheckpointError(f"checkpoint directory {path} does not exist: check the path")
  if not path.is_dir():
    raise CheckpointError(f"{path} is not a directory: pass a Hugging Face model directory"
                          " (config.json + safetensors), or a .gguf file to load_gguf")
  config_file = path / "config.json"
  if not config_file.is_file():
    raise CheckpointError(f"{path} has no config.json: it is not a Hugging Face model directory")
  config = read_json(config_file)
  if not isinstance(config, dict):
    raise CheckpointError(f"{config_file} is not a JSON object")
  cfg = config_from_hf(config, dtype or checkpoint_dtype(config), where=str(config_file))
  if place is not None:  # the mesh against the config before any other file is opened
    place.check(cfg)
  prefix = text_config(config)[1]
  shards = _shard_files(path)

  # End-of-sequence ids: config.json's, then generation_config.json's (instruct models list
  # their end-of-turn token there), else the tokenizer's.
  generation = path / "generation_config.json"
  eos = _ids(text_config(config)[0].get("eos_token_id"))
  if generation.is_file():
    gen = read_json(generation)
    eos += [i for i in _ids(gen.get("eos_token_id")) if i not in eos]
  tokenizer = None
  if (path / "tokenizer.json").is_file():
    from jaxspec.models.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_hf_dir(path, eos_token_ids=eos)
    eos = eos or list(tokenizer.eos_token_ids)
  if eos:
    cfg = dataclasses.replace(cfg, eos_token_ids=tuple(eos))
  with SafetensorsFiles(shards) as tensors:  # read one tensor at a time, as params need them
    view = _Prefixed(tensors, prefix) if prefix else tensors
    params = params_from_hf(view, cfg, where=str(path), place=place, scan=scan,
                            allow_nonfinite=allow_nonfinite)
  name = config.get("_name_or_path") or path.name
  return Model(cfg=cfg, params=params, tokenizer=tokenizer, name=str(name))


def params_from_hf(tensors: Mapping[str, np.ndarray], cfg: LlamaConfig,
                   where: str = "checkpoint", *, place=None, scan: bool = True,
                   allow_nonfinite: bool = False) -> Params:
  """jaxspec `Params` from Hugging Face-named tensors ([out, in] linear weights); `place` and
  `scan` as `jaxspec.models.llama.stack_params` (each device receives only its shards). Each
  tensor holding a NaN or an infinity is a CheckpointError naming it, unless
  `allow_nonfinite`."""
  d, f, h, g, k = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim)

  def get(name, shape):
    if name not in tensors:
      raise CheckpointError(f"{where}: tensor {name!r} is missing; the checkpoint is incomplete"
                            f" or not a {cfg.architecture} model")
    a = tensors[name]
    if tuple(a.shape) != shape:
      raise CheckpointError(f"{where}: tensor {name!r} has shape {tuple(a.shape)}, expected"
                            f" {shape} from config.json")
    if a.dtype not in _FLOAT_DTYPES:
      raise CheckpointError(f"{where}: tensor {name!r} has dtype {a.dtype}; weights must be"
                            " floating point (quantized safetensors are not supported)")
    a = np.asarray(a, np.float32)
    if not allow_nonfinite:  # checked as it is converted, one tensor at a time
      refuse_nonfinite(a, name, where)
    return a

  off = np.float32(cfg.norm_offset)  # Gemma stores w for a (1 + w) scale: params hold 1 + w
  sandwich = cfg.post_norms
  family = families.family(cfg.architecture)

  def layer(i):
    p = f"model.layers.{i}."
    q_w, k_w, v_w, gate_w, up_w = family.hf_projections(get, p, cfg)  # fused ones split
    out = dict(
        attn_norm=get(p + "input_layernorm.weight", (d,)) + off,
        wq=q_w.T.reshape(d, h, k), wk=k_w.T.reshape(d, g, k), wv=v_w.T.reshape(d, g, k),
        wo=get(p + "self_attn.o_proj.weight", (d, h * k)).T.reshape(h, k, d),
        w_gate=gate_w.T, w_up=up_w.T,
        w_down=get(p + "mlp.down_proj.weight", (d, f)).T)
    if sandwich:  # post_norms (Gemma 2/3): post_attention_layernorm is the attention output's norm
      out.update(post_attn_norm=get(p + "post_attention_layernorm.weight", (d,)) + off,
                 mlp_norm=get(p + "pre_feedforward_layernorm.weight", (d,)) + off,
                 post_mlp_norm=get(p + "post_feedforward_layernorm.weight", (d,)) + off)
    else:
      out.update(mlp_norm=get(p + "post_attention_layernorm.weight", (d,)) + off)
    if cfg.qk_norm:
      out.update(q_norm=get(p + "self_attn.q_norm.weight", (k,)) + off,
                 k_norm=get(p + "self_attn.k_norm.weight", (k,)) + off)
    if cfg.attention_bias:
      out.update(bq=get(p + "self_attn.q_proj.bias", (h * k,)).reshape(h, k),
                 bk=get(p + "self_attn.k_proj.bias", (g * k,)).reshape(g, k),
                 bv=get(p + "self_attn.v_proj.bias", (g * k,)).reshape(g, k))
    bo = p + "self_attn.o_proj.bias"
    if bo in tensors and np.any(np.asarray(tensors[bo], np.float32) != 0):
      raise CheckpointError(f"{where}: tensor {bo!r} is nonzero; jaxspec has no output-projection"
                            " bias")
    return out

  lm_head = None
  if not cfg.tie_embeddings:
    if "lm_head.weight" not in tensors:
      raise CheckpointError(f"{where}: tensor 'lm_head.weight' is missing but config.json has"
                            " tie_word_embeddings false; set it to true if the head is tied")
    lm_head = lambda: get("lm_head.weight", (cfg.vocab_size, d)).T
  return stack_params(cfg, layer, lambda: get("model.embed_tokens.weight", (cfg.vocab_size, d)),
                      lambda: get("model.norm.weight", (d,)) + off, lm_head, place=place,
                      scan=scan)


def params_to_hf(params: Params, cfg: LlamaConfig) -> dict[str, np.ndarray]:
  """Hugging Face-named float32 numpy tensors ([out, in] linear weights) of `params`."""
  d, h, g, k = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

  def np32(x):
    return np.asarray(x).astype(np.float32)

  lp = stacked_layers(params)
  layers = {name: np32(getattr(lp, name)) for name in
            ("attn_norm", "wq", "wk", "wv", "wo", "mlp_norm", "w_gate", "w_up", "w_down")}
  biases = {name: np32(getattr(lp, name)) for name in ("bq", "bk", "bv")
            if getattr(lp, name) is not None}
  if cfg.attention_bias != bool(biases):
    raise ValueError(f"cfg.attention_bias is {cfg.attention_bias} but params"
                     f" {'have' if biases else 'lack'} q/k/v biases: make them agree")
  zeros = families.family(cfg.architecture).hf_save_zeros(cfg)
  out = {"model.embed_tokens.weight": np32(params.embed)}
  for i in range(cfg.num_layers):
    p = f"model.layers.{i}."
    out[p + "input_layernorm.weight"] = layers["attn_norm"][i]
    out[p + "self_attn.q_proj.weight"] = layers["wq"][i].reshape(d, h * k).T
    out[p + "self_attn.k_proj.weight"] = layers["wk"][i].reshape(d, g * k).T
    out[p + "self_attn.v_proj.weight"] = layers["wv"][i].reshape(d, g * k).T
    out[p + "self_attn.o_proj.weight"] = layers["wo"][i].reshape(h * k, d).T
    if biases:
      out[p + "self_attn.q_proj.bias"] = biases["bq"][i].reshape(h * k)
      out[p + "self_attn.k_proj.bias"] = biases["bk"][i].reshape(g * k)
      out[p + "self_attn.v_proj.bias"] = biases["bv"][i].reshape(g * k)
    for name, shape in zeros.items():  # what the family's class has and jaxspec does not
      out[p + name] = np.zeros(shape, np.float32)
    out[p + "post_attention_layernorm.weight"] = layers["mlp_norm"][i]
    out[p + "mlp.gate_proj.weight"] = layers["w_gate"][i].T
    out[p + "mlp.up_proj.weight"] = layers["w_up"][i].T
    out[p + "mlp.down_proj.weight"] = layers["w_down"][i].T
  out["model.norm.weight"] = np32(params.final_norm)
  if params.lm_head is not None:
    out["lm_head.weight"] = np32(params.lm_head).T
  elif not cfg.tie_embeddings:
    raise ValueError("params.lm_head is None but cfg.tie_embeddings is False: make them agree")
  return out


def save_hf(model: Model | tuple[LlamaConfig, Params], path: str | os.PathLike,
            dtype: str | None = None, *, max_shard_bytes: int | None = None) -> Path:
  """Writes a Hugging Face checkpoint directory that `load_hf` and `transformers` read.

  Args:
    model: a `Model` (its tokenizer is saved too, when it has one) or a `(cfg, params)` pair.
    path: output directory (created if needed; existing checkpoint files are overwritten).
    dtype: storage dtype, "float32", "bfloat16" or "float16"; default `cfg.dtype`.
    max_shard_bytes: when set, split the weights into shards of at most this size (one tensor
      may exceed it) named model-0000i-of-0000n.safetensors, listed in
      model.safetensors.index.json.
  Returns:
    The directory path.
  """
  if isinstance(model, Model):
    cfg, params, tokenizer = model.cfg, model.params, model.tokenizer
  else:
    (cfg, params), tokenizer = model, None
  dtype = cfg.dtype if dtype is None else dtype
  if dtype not in SAVE_DTYPES:
    raise ValueError(f"dtype {dtype!r} cannot be saved: use one of {sorted(SAVE_DTYPES)}")
  np_dtype = SAVE_DTYPES[dtype][1]
  config = config_to_hf(cfg, dtype)
  tensors = {k: v.astype(np_dtype) for k, v in params_to_hf(params, cfg).items()}
  path = Path(path)
  path.mkdir(parents=True, exist_ok=True)
  for stale in [path / "model.safetensors", path / "model.safetensors.index.json",
                *path.glob("model-*-of-*.safetensors")]:
    stale.unlink(missing_ok=True)
  (path / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
  if max_shard_bytes is None:
    write_safetensors(path / "model.safetensors", tensors)
  else:
    shards: list[dict[str, np.ndarray]] = [{}]
    used = 0
    for name, a in tensors.items():
      if shards[-1] and used + a.nbytes > max_shard_bytes:
        shards.append({})
        used = 0
      shards[-1][name] = a
      used += a.nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      total += write_safetensors(path / file, shard)
      weight_map.update({name: file for name in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n",
                                                       encoding="utf-8")
  if tokenizer is not None and hasattr(tokenizer, "backend"):
    tokenizer.backend.save(str(path / "tokenizer.json"))
    tok_config = {"bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
                  "add_bos_token": tokenizer.add_bos, "chat_template": tokenizer.chat_template,
                  "tokenizer_class": "PreTrainedTokenizerFast",
                  "model_max_length": cfg.max_position_embeddings}
    (path / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n",
                                                encoding="utf-8")
  return path
