"""Gemma 1, 2 and 3 (text).

All three: embeddings times sqrt(hidden), (1 + w) RMSNorms (params hold 1 + w, as llama.cpp's
GGUFs store them), GeGLU with the tanh GELU, a tied head, scores scaled by
query_pre_attn_scalar ** -0.5 where given. Gemma 2 and 3 add norms on the attention and MLP
outputs and alternate sliding and full layers; Gemma 2 soft-caps attention scores and logits
(Gemma 3 never caps scores: transformers ignores the setting there); Gemma 3 adds q/k norms and
a separate rotary base on its sliding layers, and its multimodal checkpoints' text decoder runs
alone.

GGUF architectures "gemma", "gemma2", "gemma3": settings a file does not record are
llama.cpp's fixed ones: Gemma 2's 4096 window and caps 50 / 30, the sliding pattern (every
2nd / 6th layer full), Gemma 3's sliding rotary base 10000, and the query scale (head_dim, or
hidden / heads for the 27B models' layer counts, llama.cpp's `f_attention_scale`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from jaxspec.models.families.base import (Family, every_nth_full, listed_layer_types,
                                          number)

# What every Gemma sets, in Hugging Face and GGUF checkpoints alike.
_COMMON = dict(norm_offset=1.0, embed_scale=True)


# -- Hugging Face ---------------------------------------------------------------------------------


def _activation(config: Mapping[str, Any]) -> str:
  return config.get("hidden_activation") or config.get("hidden_act", "gelu_pytorch_tanh")


def _activation_gemma(config: Mapping[str, Any]) -> str:
  act = _activation(config)
  if act == "gelu" and not config.get("hidden_activation"):
    # Gemma 1's config.json says "gelu" but means the tanh form: transformers rewrites it so
    # (5.x) or ignores hidden_act for Gemma (4.x).
    return "gelu_pytorch_tanh"
  return act


def _switches_gemma(config: Mapping[str, Any], fields: Mapping[str, Any], where: str
                    ) -> dict[str, Any]:
  return dict(_COMMON, final_softcap=number(config, "final_logit_softcapping"),
              query_pre_attn_scalar=number(config, "query_pre_attn_scalar"))


def _switches_gemma2(config: Mapping[str, Any], fields: Mapping[str, Any], where: str
                     ) -> dict[str, Any]:
  return dict(_switches_gemma(config, fields, where), post_norms=True,
              attn_softcap=number(config, "attn_logit_softcapping"))


def _switches_gemma3(config: Mapping[str, Any], fields: Mapping[str, Any], where: str
                     ) -> dict[str, Any]:
  # The sliding layers' rotary base: rope_parameters["sliding_attention"]'s (transformers 5,
  # read by the loader into `fields`), else rope_local_base_freq (4.x); none without a window.
  theta = None
  if fields["sliding_window"] is not None:
    theta = fields.get("sliding_rope_theta", config.get("rope_local_base_freq", 10000.0))
  return dict(_switches_gemma(config, fields, where), post_norms=True, qk_norm=True,
              sliding_rope_theta=theta)


def _layer_types_gemma2(config: Mapping[str, Any], n_layers: int, where: str
                        ) -> tuple[str, ...]:
  listed = listed_layer_types(config, n_layers, where)
  # transformers 4.x: every other layer, starting with a sliding one
  return every_nth_full(n_layers, 2) if listed is None else listed


def _layer_types_gemma3(config: Mapping[str, Any], n_layers: int, where: str
                        ) -> tuple[str, ...]:
  listed = listed_layer_types(config, n_layers, where)
  if listed is not None:
    return listed
  return every_nth_full(n_layers, int(config.get("sliding_window_pattern")
                                      or config.get("_sliding_window_pattern") or 6))


# -- GGUF -----------------------------------------------------------------------------------------


def _gguf_switches(arch: str, meta: Any, fields: Mapping[str, Any], *, attn_cap: bool,
                   cap_defaults: tuple[float, float] | None, big_layers: int | None
                   ) -> dict[str, Any]:
  """Gemma's switches from GGUF metadata under `arch`; `cap_defaults` (attention, final) where
  llama.cpp fills them in for files written before the keys existed; `big_layers` the layer
  count of the 27B model, whose queries scale by hidden / heads (llama.cpp's rule)."""
  attn_default, final_default = cap_defaults or (None, None)
  query = None
  if big_layers is not None:
    big = fields["num_layers"] == big_layers
    query = float(fields["hidden_size"] // fields["num_heads"] if big else fields["head_dim"])
  return dict(
      _COMMON, hidden_act="gelu_tanh",
      attn_softcap=(meta.float(f"{arch}.attn_logit_softcapping", attn_default) or None
                    if attn_cap else None),
      final_softcap=meta.float(f"{arch}.final_logit_softcapping", final_default) or None,
      query_pre_attn_scalar=query)


def _gguf_switches_gemma(meta: Any, fields: Mapping[str, Any]) -> dict[str, Any]:
  return _gguf_switches("gemma", meta, fields, attn_cap=True, cap_defaults=None,
                        big_layers=None)


def _gguf_switches_gemma2(meta: Any, fields: Mapping[str, Any]) -> dict[str, Any]:
  return _gguf_switches("gemma2", meta, fields, attn_cap=True, cap_defaults=(50.0, 30.0),
                        big_layers=46)


def _gguf_switches_gemma3(meta: Any, fields: Mapping[str, Any]) -> dict[str, Any]:
  out = _gguf_switches("gemma3", meta, fields, attn_cap=False, cap_defaults=None,
                       big_layers=62)
  if fields["sliding_window"]:
    out.update(sliding_rope_theta=meta.float("gemma3.rope.freq_base_swa", 10000.0))
  return out


GEMMA = Family(
    architecture="gemma", hf_class="GemmaForCausalLM", hf_model_type="gemma",
    hf_activation=_activation_gemma, hf_tie_default=True, hf_switches=_switches_gemma,
    gguf_architecture="gemma", gguf_switches=_gguf_switches_gemma)

GEMMA2 = Family(
    architecture="gemma2", hf_class="Gemma2ForCausalLM", hf_model_type="gemma2",
    hf_activation=_activation, hf_tie_default=True, hf_layer_types=_layer_types_gemma2,
    hf_switches=_switches_gemma2,
    gguf_architecture="gemma2", gguf_default_window=4096, gguf_sliding_pattern=2,
    gguf_switches=_gguf_switches_gemma2)

GEMMA3 = Family(
    architecture="gemma3", hf_class="Gemma3ForCausalLM", hf_model_type="gemma3_text",
    hf_text_of={"Gemma3ForConditionalGeneration": "language_model."},
    hf_activation=_activation, hf_tie_default=True, hf_layer_types=_layer_types_gemma3,
    hf_switches=_switches_gemma3,
    gguf_architecture="gemma3", gguf_sliding_pattern=6, gguf_switches=_gguf_switches_gemma3)

FAMILIES = (GEMMA, GEMMA2, GEMMA3)
