"""Llama-family models, checkpoints and tokenizers.

Axis letters used in einsum strings and shape comments across jaxspec:

  B  batch (rows)              T  new tokens in this call     S  cache positions (max_len)
  D  model (embed) width       F  MLP (ffw) width             V  vocabulary
  H  query heads               G  key/value heads (groups)    R  query heads per group (H // G)
  K  head dimension            L  layers                      N  draft tokens / tree nodes
  W  ring slots of a sliding-window layer's cache (window + slack; `llama.ring_size`)
"""

from jaxspec.models.config import LlamaConfig, RopeScaling, tiny_config
from jaxspec.models.llama import (Hidden, KVCache, LayerParams, Params, forward, init_cache,
                                  init_params, logits_from_hidden, lm_head_weight)
from jaxspec.models.loading import load
from jaxspec.models.model import Model
from jaxspec.models.quant import QArray, dequantize, param_bytes, quantize, quantize_array

__all__ = ["Hidden", "KVCache", "LayerParams", "LlamaConfig", "Model", "Params", "QArray",
           "RopeScaling", "dequantize", "forward", "init_cache", "init_params", "lm_head_weight",
           "load", "logits_from_hidden", "param_bytes", "quantize", "quantize_array",
           "tiny_config"]
