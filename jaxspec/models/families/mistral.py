"""Mistral (`MistralForCausalLM`): Llama's layout with a sliding window on every layer.

Hugging Face: `sliding_window` applies to every layer (transformers' Mistral has no
`layer_types`); Mistral 3's multimodal checkpoints are refused (their decoder's tensors sit
beside a vision tower jaxspec would have to skip). GGUF: llama.cpp converts Mistral as "llama"
(and drops the window), so GGUF files load through the Llama family.
"""

from __future__ import annotations

from typing import Any

from jaxspec.models.config import LlamaConfig
from jaxspec.models.families.base import Family


def _layer_types(config, n_layers, where) -> None:
  return None  # transformers' Mistral slides every layer, whatever layer_types say


def _save(cfg: LlamaConfig) -> dict[str, Any]:
  if cfg.attention_bias:
    raise ValueError("MistralForCausalLM has no attention biases: save this model with"
                     " architecture 'llama' or 'qwen2'")
  if cfg.layer_types is not None:
    raise ValueError("MistralForCausalLM slides every layer: per-layer windows save as 'qwen2'")
  return dict(sliding_window=cfg.sliding_window)


MISTRAL = Family(
    architecture="mistral", hf_class="MistralForCausalLM", hf_model_type="mistral",
    hf_refused=("Mistral3ForConditionalGeneration",), hf_layer_types=_layer_types,
    hf_window_everywhere=True, hf_save=_save)

FAMILIES = (MISTRAL,)
