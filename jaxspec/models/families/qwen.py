"""Qwen2 / Qwen2.5 and Qwen3.

Qwen2: q, k and v biases always (transformers' class has no switch for them). Qwen3: RMS norms
over each query and key head before the rotation, no biases. Both: sliding windows only with
`use_sliding_window`, on the layers from `max_window_layers` on (or as `layer_types` say).
GGUF architectures "qwen2" and "qwen3": Hugging Face's rotate-half rows, nothing permuted; Qwen3's
q/k norms are found by their tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxspec.models.config import LlamaConfig
from jaxspec.models.families.base import Family, listed_layer_types


def _layer_types(config: Mapping[str, Any], n_layers: int, where: str
                 ) -> tuple[str, ...] | None:
  if not config.get("use_sliding_window"):
    return None  # transformers drops the window then, whatever layer_types say
  listed = listed_layer_types(config, n_layers, where)
  if listed is not None:
    return listed
  first = int(config.get("max_window_layers", 28))  # transformers' default
  return tuple("sliding" if i >= first else "full" for i in range(n_layers))


def _save_qwen2(cfg: LlamaConfig) -> dict[str, Any]:
  sliding = cfg.sliding_window is not None
  out: dict[str, Any] = dict(use_sliding_window=sliding, sliding_window=cfg.sliding_window,
                             max_window_layers=0 if sliding else cfg.num_layers)
  if cfg.layer_types is not None:
    out.update(layer_types=[f"{t}_attention" for t in cfg.layer_types],
               max_window_layers=cfg.layer_types.index("sliding"))
  return out


def _save_zeros_qwen2(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
  # transformers' Qwen2 always has q/k/v biases: a model without them saves zeros.
  if cfg.attention_bias:
    return {}
  h, g, k = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  return {"self_attn.q_proj.bias": (h * k,), "self_attn.k_proj.bias": (g * k,),
          "self_attn.v_proj.bias": (g * k,)}


QWEN2 = Family(
    architecture="qwen2", hf_class="Qwen2ForCausalLM", hf_model_type="qwen2",
    hf_attention_bias=True, hf_layer_types=_layer_types, hf_save=_save_qwen2,
    hf_save_zeros=_save_zeros_qwen2, gguf_architecture="qwen2")

def _switches_qwen3(config: Mapping[str, Any], fields: Mapping[str, Any], where: str
                    ) -> dict[str, Any]:
  return dict(qk_norm=True)


QWEN3 = Family(
    architecture="qwen3", hf_class="Qwen3ForCausalLM", hf_model_type="qwen3",
    hf_layer_types=_layer_types, hf_switches=_switches_qwen3, gguf_architecture="qwen3")

FAMILIES = (QWEN2, QWEN3)
