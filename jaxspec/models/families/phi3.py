"""Phi-3 / Phi-3.5 / Phi-4-mini (`Phi3ForCausalLM`): Llama's layer with fused projections.

Hugging Face: `qkv_proj` holds the rows [q; k; v] and `gate_up_proj` the rows [gate; up]
(`up * silu(gate)`), split here at load; no attention biases. Rotary scaling: transformers'
Phi-3 reads the older rope types "su" and "yarn" as LongRoPE, and its pretraining length
defaults to 4096 when config.json names none; a `sliding_window` applies to every layer;
`partial_rotary_factor` (Phi-4-mini) is read by the loader like any family's.

GGUF architecture "phi3": llama.cpp keeps the fused `attn_qkv` (older files: separate
`attn_q/k/v`) and a fused `ffn_up` of [gate; up] rows, both split here, and LongRoPE's divisors
as `rope_factors_short` / `rope_factors_long` tensors (read by the loader like any file's).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from jaxspec.models.config import LlamaConfig
from jaxspec.models.errors import CheckpointError
from jaxspec.models.families.base import Family, Getter, Projections


def _split_qkv(qkv: np.ndarray, cfg: LlamaConfig) -> tuple[np.ndarray, ...]:
  h, g, k = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  return tuple(np.split(qkv, [h * k, (h + g) * k]))


# -- Hugging Face ---------------------------------------------------------------------------------


def _switches(config: Mapping[str, Any], fields: Mapping[str, Any], where: str
              ) -> dict[str, Any]:
  if fields["attention_bias"]:
    raise CheckpointError(f"{where}: Phi-3 attention biases are not supported")
  return {}


def _hf_projections(get: Getter, prefix: str, cfg: LlamaConfig) -> Projections:
  d, f, h, g, k = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim)
  q, k_w, v = _split_qkv(get(prefix + "self_attn.qkv_proj.weight", ((h + 2 * g) * k, d)), cfg)
  gate_up = get(prefix + "mlp.gate_up_proj.weight", (2 * f, d))
  return q, k_w, v, gate_up[:f], gate_up[f:]


# -- GGUF -----------------------------------------------------------------------------------------


def _fused(has: Callable[[str], bool]) -> bool:
  return has("blk.0.attn_qkv.weight")


def _gguf_projection_names(has: Callable[[str], bool]) -> tuple[str, ...]:
  qkv = ("attn_qkv.weight",) if _fused(has) else ("attn_q.weight", "attn_k.weight",
                                                  "attn_v.weight")
  return qkv + ("ffn_up.weight",)  # ffn_up holds [gate; up] rows


def _gguf_projections(get: Getter, has: Callable[[str], bool], prefix: str,
                      cfg: LlamaConfig) -> Projections:
  d, f, h, g, k = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim)
  if _fused(has):
    q, k_w, v = _split_qkv(get(prefix + "attn_qkv.weight", ((h + 2 * g) * k, d)), cfg)
  else:
    q, k_w, v = (get(prefix + "attn_q.weight", (h * k, d)),
                 get(prefix + "attn_k.weight", (g * k, d)),
                 get(prefix + "attn_v.weight", (g * k, d)))
  gate_up = get(prefix + "ffn_up.weight", (2 * f, d))
  return q, k_w, v, gate_up[:f], gate_up[f:]


PHI3 = Family(
    architecture="phi3", hf_class="Phi3ForCausalLM", hf_model_type="phi3",
    hf_rope_aliases={"su": "longrope", "yarn": "longrope"}, hf_original_context=4096,
    hf_window_everywhere=True, hf_switches=_switches, hf_projections=_hf_projections,
    gguf_architecture="phi3", gguf_min_block_tensors=6,
    gguf_projection_names=_gguf_projection_names, gguf_projections=_gguf_projections)

FAMILIES = (PHI3,)
