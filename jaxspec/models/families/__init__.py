"""Model families: one file each, and the registry the loaders ask.

A family file (`llama.py`, `mistral.py`, `qwen.py`, `gemma.py`, `phi3.py`) fills in a `Family`
record (`base.py`) with everything specific to its architecture: the Hugging Face class and
model_type, how config.json and GGUF metadata set `LlamaConfig`'s switches, and its tensor names
where they differ from Llama's. `hf_loader` and `gguf_loader` read formats only and look the
family up here; adding a family is its file plus one entry in `FAMILIES` below.
"""

from __future__ import annotations

from jaxspec.models.families import gemma, llama, mistral, phi3, qwen
from jaxspec.models.families.base import Family

# In the order error messages list them.
FAMILIES: tuple[Family, ...] = (*llama.FAMILIES, *mistral.FAMILIES, *qwen.FAMILIES,
                                *gemma.FAMILIES, *phi3.FAMILIES)

_BY_ARCHITECTURE = {f.architecture: f for f in FAMILIES}
_BY_HF_CLASS = {f.hf_class: f for f in FAMILIES if f.hf_class}
_BY_MODEL_TYPE = {f.hf_model_type: f for f in FAMILIES if f.hf_model_type}
_BY_GGUF = {f.gguf_architecture: f for f in FAMILIES if f.gguf_architecture}

# Hugging Face class name -> `LlamaConfig.architecture`.
HF_CLASSES = {f.hf_class: f.architecture for f in FAMILIES if f.hf_class}
# GGUF `general.architecture` values jaxspec loads.
GGUF_ARCHITECTURES = tuple(_BY_GGUF)
# Architectures `save_hf` writes.
SAVABLE = tuple(f.architecture for f in FAMILIES if f.hf_save is not None)

assert len(_BY_ARCHITECTURE) == len(FAMILIES), "two families claim one architecture"


def family(architecture: str) -> Family:
  """The family of a `LlamaConfig.architecture`; an architecture no family registers (a config
  built in code) reads and writes the plain Llama layout, `Family`'s defaults."""
  return _BY_ARCHITECTURE.get(architecture) or Family(architecture=architecture)


def by_hf_class(name: str | None) -> Family | None:
  """The family whose transformers class is `name` (None: none)."""
  return _BY_HF_CLASS.get(name) if isinstance(name, str) else None


def by_model_type(model_type: str | None) -> Family | None:
  """The family of a config.json `model_type` (None: none)."""
  return _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None


def by_gguf_architecture(name: str | None) -> Family | None:
  """The family of a GGUF `general.architecture` (None: none)."""
  return _BY_GGUF.get(name) if isinstance(name, str) else None


def text_of_multimodal(name: str | None) -> tuple[Family, str] | None:
  """(the family, the prefix of its text model's tensor names) when `name` is a multimodal
  class whose text decoder jaxspec runs alone; None otherwise."""
  for f in FAMILIES:
    if isinstance(name, str) and name in f.hf_text_of:
      return f, f.hf_text_of[name]
  return None


def refusing(name: str | None) -> Family | None:
  """The family whose text-only class to load instead, when `name` is a multimodal class
  jaxspec refuses; None otherwise."""
  return next((f for f in FAMILIES if name in f.hf_refused), None)
