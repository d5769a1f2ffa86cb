"""What a model family is: the `Family` record one family file fills in, its defaults (the plain
Llama layout), and the config-reading helpers the families share.

A family is everything that is specific to one decoder architecture: how its Hugging Face
config.json and its GGUF metadata set `LlamaConfig`'s switches, and what its tensors are called
where they differ from Llama's names (fused projections to split, rows to un-permute). The
loaders read formats (safetensors, GGUF) and ask the family for the rest; every field below
defaults to Llama's behaviour, so a family file names only what differs.

Hooks receive plain values (the config.json dict, a GGUF metadata reader, a tensor getter) and
return plain values, so a family file imports nothing from the loaders.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxspec.models.config import LlamaConfig
from jaxspec.models.errors import CheckpointError

# A tensor getter: (name, expected numpy shape) -> float32 array, refusing a missing tensor, a
# wrong shape or non-finite values with a CheckpointError naming it.
Getter = Callable[[str, tuple[int, ...]], np.ndarray]
# (q, k, v, gate, up) weights, each [out, in] as Hugging Face stores linear layers.
Projections = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]


# -- config.json values ---------------------------------------------------------------------------


def flag(config: Mapping[str, Any], name: str, default: bool, where: str) -> bool:
  """A boolean field: JSON true/false only (the string "false" is not False)."""
  value = config.get(name, default)
  if value is None:
    return default
  if not isinstance(value, bool):
    raise CheckpointError(f"{where}: {name} must be true or false, got {value!r}")
  return value


def number(config: Mapping[str, Any], name: str) -> float | None:
  """A float field, None when absent or null."""
  return None if config.get(name) is None else float(config[name])


def listed_layer_types(config: Mapping[str, Any], n_layers: int, where: str
                       ) -> tuple[str, ...] | None:
  """Per-layer "sliding"/"full" attention from config.json's `layer_types` (None: absent)."""
  types = config.get("layer_types")
  if types is None:
    return None
  if not isinstance(types, list) or len(types) != n_layers:
    raise CheckpointError(f"{where}: layer_types must list one entry per layer ({n_layers})")
  names = {"sliding_attention": "sliding", "full_attention": "full"}
  if any(t not in names for t in types):
    raise CheckpointError(f"{where}: layer_types {sorted(set(types))} has kinds jaxspec does"
                          " not run; it supports 'sliding_attention' and 'full_attention'")
  return tuple(names[t] for t in types)


def every_nth_full(n_layers: int, every: int) -> tuple[str, ...]:
  """Layer i slides unless (i + 1) % every == 0 (Gemma 2: every 2nd layer full, Gemma 3: 6th)."""
  return tuple("sliding" if (i + 1) % every else "full" for i in range(n_layers))


# -- the Llama layout: every hook's default -------------------------------------------------------


def hf_activation(config: Mapping[str, Any]) -> str:
  """config.json's activation name: `hidden_act`, SiLU when absent."""
  return config.get("hidden_act", "silu")


def no_switches(*_args: Any) -> dict[str, Any]:
  """A family that keeps every switch at Llama's default."""
  return {}


def hf_projections(get: Getter, prefix: str, cfg: LlamaConfig) -> Projections:
  """q, k, v, gate and up of one layer under Hugging Face Llama names."""
  d, f, h, g, k = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim)
  return (get(prefix + "self_attn.q_proj.weight", (h * k, d)),
          get(prefix + "self_attn.k_proj.weight", (g * k, d)),
          get(prefix + "self_attn.v_proj.weight", (g * k, d)),
          get(prefix + "mlp.gate_proj.weight", (f, d)),
          get(prefix + "mlp.up_proj.weight", (f, d)))


def gguf_projection_names(has: Callable[[str], bool]) -> tuple[str, ...]:
  """The GGUF names (within a block) of q, k, v, gate and up under llama.cpp's Llama names."""
  return ("attn_q.weight", "attn_k.weight", "attn_v.weight", "ffn_gate.weight", "ffn_up.weight")


def gguf_projections(get: Getter, has: Callable[[str], bool], prefix: str,
                     cfg: LlamaConfig) -> Projections:
  """q, k, v, gate and up of one block under llama.cpp's names ([out, in], as Hugging Face)."""
  d, f, h, g, k = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim)
  return (get(prefix + "attn_q.weight", (h * k, d)), get(prefix + "attn_k.weight", (g * k, d)),
          get(prefix + "attn_v.weight", (g * k, d)), get(prefix + "ffn_gate.weight", (f, d)),
          get(prefix + "ffn_up.weight", (f, d)))


def no_zeros(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
  """A Hugging Face class that expects no tensors beyond those jaxspec's params hold."""
  return {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Family:
  """One decoder family: how its checkpoints name things and which switches it sets.

  Identity:
    architecture: `LlamaConfig.architecture` of its models ("phi3").
    hf_class, hf_model_type: its transformers class and config.json `model_type` ("" for a
      family no Hugging Face class loads).
    hf_text_of: multimodal classes whose text decoder jaxspec runs alone -> the prefix of the
      text model's tensor names (Gemma 3: "language_model.").
    hf_refused: multimodal classes refused with "load a text-only `hf_class` checkpoint".
    gguf_architecture: its GGUF `general.architecture` (None: llama.cpp converts it as another
      family, e.g. Mistral as "llama"); metadata keys are prefixed with it.

  Hugging Face config.json (hooks take the config dict and `where`, the file for messages):
    hf_activation(config): the activation's Hugging Face name.
    hf_tie_default: `tie_word_embeddings` when config.json omits it.
    hf_attention_bias: True when the class always has q/k/v biases (Qwen2); None reads
      config.json's `attention_bias`.
    hf_rope_aliases: rope types this family's class reads as another ({"su": "longrope"}).
    hf_original_context: the pretraining length YaRN/LongRoPE extend when config.json names
      none (None: max_position_embeddings).
    hf_layer_types(config, n_layers, where): per-layer "sliding"/"full" as transformers assigns
      them (None: uniform).
    hf_window_everywhere: with uniform layers, `sliding_window` applies to every layer
      (Mistral) instead of being ignored.
    hf_switches(config, fields, where): the family's `LlamaConfig` switches, given the fields
      read so far (`fields` holds every LlamaConfig keyword the loader has read).
    hf_projections(get, prefix, cfg): one layer's q, k, v, gate and up from its tensors.
    hf_save(cfg): None when `save_hf` cannot write the family, else the family's config.json
      keys for `cfg` (ValueError for what its class cannot express).
    hf_save_zeros(cfg): per-layer tensors (name within a layer -> shape) its class expects that
      jaxspec's params do not hold, written as zeros.

  GGUF metadata:
    gguf_min_block_tensors: the fewest tensors one block holds (bounds block_count).
    gguf_permuted_qk: llama.cpp's converter interleaved the Q/K rows (un-permuted at load).
    gguf_default_window: the sliding window when the file records none (None: no window).
    gguf_sliding_pattern: llama.cpp's fixed pattern of full layers (every n-th) when the file
      records none as a list (None: a window applies to every layer).
    gguf_switches(meta, fields): the family's `LlamaConfig` switches from the metadata
      (`meta.float(key, default)`, `meta.int(key, default)`) and the fields read so far.
    gguf_projection_names(has), gguf_projections(get, has, prefix, cfg): as the Hugging Face
      hook, with GGUF names; `has(name)` says whether the file holds a tensor.
  """

  architecture: str
  hf_class: str = ""
  hf_model_type: str = ""
  hf_text_of: Mapping[str, str] = dataclasses.field(default_factory=dict)
  hf_refused: tuple[str, ...] = ()
  hf_activation: Callable[[Mapping[str, Any]], str] = hf_activation
  hf_tie_default: bool = False
  hf_attention_bias: bool | None = None
  hf_rope_aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)
  hf_original_context: int | None = None
  hf_layer_types: Callable[..., tuple[str, ...] | None] = listed_layer_types
  hf_window_everywhere: bool = False
  hf_switches: Callable[..., dict[str, Any]] = no_switches
  hf_projections: Callable[..., Projections] = hf_projections
  hf_save: Callable[[LlamaConfig], dict[str, Any]] | None = None
  hf_save_zeros: Callable[[LlamaConfig], dict[str, tuple[int, ...]]] = no_zeros
  gguf_architecture: str | None = None
  gguf_min_block_tensors: int = 9
  gguf_permuted_qk: bool = False
  gguf_default_window: int | None = None
  gguf_sliding_pattern: int | None = None
  gguf_switches: Callable[..., dict[str, Any]] = no_switches
  gguf_projection_names: Callable[..., tuple[str, ...]] = gguf_projection_names
  gguf_projections: Callable[..., Projections] = gguf_projections
