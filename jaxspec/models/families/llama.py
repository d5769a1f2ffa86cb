"""Llama (Llama 2/3, SmolLM, and any `LlamaForCausalLM`): the layout every other family is
described against, so it sets almost nothing.

Hugging Face: a sliding window only where `layer_types` gives one; `attention_bias` biases q, k
and v, and in transformers o_proj too (written as zeros on save, refused when nonzero on load).
GGUF: architecture "llama", which llama.cpp also uses for Mistral and SmolLM; its converter
permutes the Q and K rows for interleaved rotary pairs (undone at load).
"""

from __future__ import annotations

from typing import Any

from jaxspec.models.config import LlamaConfig
from jaxspec.models.families.base import Family


def _save(cfg: LlamaConfig) -> dict[str, Any]:
  if cfg.sliding_window is not None:
    raise ValueError("LlamaForCausalLM has no sliding window: save this model with architecture"
                     " 'mistral' (or 'qwen2' with biases)")
  return dict(attention_bias=cfg.attention_bias, mlp_bias=False)


def _save_zeros(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
  # transformers' Llama `attention_bias` also biases o_proj, which jaxspec does not have.
  return {"self_attn.o_proj.bias": (cfg.hidden_size,)} if cfg.attention_bias else {}


LLAMA = Family(
    architecture="llama", hf_class="LlamaForCausalLM", hf_model_type="llama",
    hf_save=_save, hf_save_zeros=_save_zeros,
    gguf_architecture="llama", gguf_permuted_qk=True)

FAMILIES = (LLAMA,)
