"""Tiny Hugging Face models of every decoder family jaxspec must match, and what to compare with.

Not a test module: `tests/models/test_families.py` imports it. For each name in `FAMILIES` it gives

- `write_hf(name, path, seed)`: a tiny random `transformers` checkpoint (float32 safetensors)
  whose every weight, norms included, is drawn from a seeded generator at a scale that makes
  logits far from uniform, so a greedy comparison is meaningful;
- `hf_reference(path, prompts, n_new)`: Hugging Face's own prompt logits, greedy continuation,
  log-probabilities of it and the smallest top-1/top-2 margin along it (eager attention);
- `write_gguf(hf_path, gguf_path, types)`: the same checkpoint converted as llama.cpp's
  `convert_hf_to_gguf.py` converts it (tensor names, metadata keys, Llama's and Mistral's Q/K
  row permutation, Qwen2's bias tensors, Gemma's `norm + 1`, Phi-3's fused tensors and LongRoPE
  factor tensors), F32 or with chosen tensors quantized; `gguf_compatible_overrides` names the
  sibling to convert where llama.cpp cannot represent a checkpoint (Mistral's sliding window,
  Gemma 3's query_pre_attn_scalar).

Where each convention comes from is cited next to it: `conversion/<file>.py` is the converter
of llama.cpp (ggml-org/llama.cpp; newer versions split `convert_hf_to_gguf.py` into a `conversion/`
package), `llama-model.cpp` its loader; the tensor names come from the installed gguf
package's `TensorNameMap`. Hugging Face behaviours the jaxspec side must match are described at
each family's builder.

torch and transformers are imported inside the functions that need them, so importing this
module does not need them (the test module skips with a reason when they are absent).
"""

from __future__ import annotations

import fnmatch
import math
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from helpers import add_tiny_tokenizer, tiny_vocab

# Shared sizes. VOCAB must hold the tiny GGUF tokenizer (`tiny_vocab`: 3 special tokens, 256
# bytes and 5 merges); its bos / eos ids are 1 / 2 (`add_tiny_tokenizer`), the configs' too.
VOCAB = 320
HIDDEN = 64
FFN = 128
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
assert len(tiny_vocab()[0]) <= VOCAB

# Weight scales (see `write_hf`). Logits of std ~3 over 320 tokens give top-1/top-2 gaps of ~0.5
# (0.02-std random models give near-ties). With a tied head a token's own embedding, if it
# dominates the residual stream, makes greedy decoding repeat it forever; residual branches
# larger than the embedding (output projections at gain 2, Gemma's post-norms at ~3) keep the
# continuations varied (4-16 distinct tokens in 16), and the final norm at ~3 sets the scale.
EMBED_STD = 0.125
BRANCH_GAIN = 2.0  # o_proj and down_proj
NORM_STD = 0.3
FINAL_NORM = 3.0  # centre of the final norm's multiplier
GEMMA_POST_NORM = 3.0  # centre of Gemma's post-attention / post-feedforward multipliers
# Qwen2's q/k/v biases (against q/k/v entries of ~1): zeroing them moves the logits by ~6.6, far
# past the tolerance. Larger biases make greedy decoding settle on one token (V's bias is a
# constant residual offset through o_proj, which the tied head favours a token for).
BIAS_STD = 0.1


def _common(**kw) -> dict[str, Any]:
  base = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, pad_token_id=PAD_ID,
              bos_token_id=BOS_ID, eos_token_id=EOS_ID, dtype="float32")
  base.update(kw)
  return base


# -- the families ---------------------------------------------------------------------------------


def _llama(**overrides):
  """Llama: the baseline (Q/K rows permuted in GGUF, untied head).

  "llama-linear" divides every inverse frequency by the factor (HF
  `_compute_linear_scaling_rope_parameters`). "llama-dynamic" is dynamic NTK: HF recomputes the
  base only when a forward's largest position + 1 exceeds `max_position_embeddings`
  (`dynamic_rope_update`), so within that length it is exactly the unscaled rotary embedding;
  max_position_embeddings 128 covers the tests' 28 positions and the 128-slot cache jaxspec
  allocates by default, so the variant pins "dynamic == default within range" (a test checks
  HF agrees) and nothing beyond it: there HF depends on how the sequence is split into forward
  calls (one forward: every position rotated with the base for the full length; token by token:
  position p with the base for p + 1 tokens, cached keys keeping theirs).
  """
  from transformers import LlamaConfig
  kw = _common(num_hidden_layers=2, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
               max_position_embeddings=512, tie_word_embeddings=False,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
  kw.update(overrides)
  return LlamaConfig(**kw)


def _llama_linear(**overrides):
  return _llama(**{"rope_parameters": {"rope_type": "linear", "factor": 2.0,
                                       "rope_theta": 10000.0}, **overrides})


def _llama_dynamic(**overrides):
  return _llama(**{"max_position_embeddings": 128,
                   "rope_parameters": {"rope_type": "dynamic", "factor": 2.0,
                                       "rope_theta": 10000.0}, **overrides})


def _mistral(**overrides):
  """Mistral 7B v0.1 (HF `modeling_mistral`): Llama's layout (untied head, no biases, Q/K rows
  permuted in GGUF) plus a sliding window on EVERY layer (`MistralAttention` passes
  `config.sliding_window` to each layer; the mask lets query q see keys q - W < k <= q). W = 6,
  so the 12-token prompts and the 16-token continuations both cross it.

  llama.cpp converts `MistralForCausalLM` with `LlamaModel` (conversion/llama.py), arch "llama",
  and neither it nor `TextModel.set_gguf_parameters` (conversion/base.py) writes
  `sliding_window`: the GGUF runs full attention. `gguf_compatible_overrides` gives the
  windowless sibling the GGUF tests convert.
  """
  from transformers import MistralConfig
  kw = _common(num_hidden_layers=2, head_dim=HEAD_DIM, rms_norm_eps=1e-5,
               max_position_embeddings=512, tie_word_embeddings=False, sliding_window=6,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
  kw.update(overrides)
  return MistralConfig(**kw)


def _qwen2(**overrides):
  """Qwen2 / Qwen2.5 (HF `modeling_qwen2`): biases on q, k and v (always: `bias=True`, no config
  field), none on o_proj or the MLP; tied head like Qwen2.5-0.5B; rope_theta 1e6; no head_dim
  in the config (hidden / heads). `use_sliding_window` stays False (Qwen2.5's default), so every
  layer is full (`layer_types`). The biases are drawn like the other weights (`write_hf`,
  BIAS_STD); the K bias is added before the rotary embedding, so it is not a per-query constant.
  GGUF arch "qwen2": `attn_q.bias` / `attn_k.bias` / `attn_v.bias`, no permutation.
  """
  from transformers import Qwen2Config
  kw = _common(num_hidden_layers=2, rms_norm_eps=1e-6, max_position_embeddings=512,
               tie_word_embeddings=True, use_sliding_window=False,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6})
  kw.update(overrides)
  return Qwen2Config(**kw)


def _qwen3(**overrides):
  """Qwen3: head_dim 32 != hidden / heads (q/o projections are 64 <-> 128 wide), RMS q/k norms
  over each head (weights w, plain `x * w`) before the rotary embedding, no biases, tied head
  like Qwen3-0.6B..4B, rope_theta 1e6.

  "qwen3-yarn": factor 4 over original_max_position_embeddings 64 (max_position_embeddings 256,
  so HF's factor check agrees). HF (`_compute_yarn_parameters`): beta_fast 32 / beta_slow 1, the
  correction range floored/ceiled (`truncate` defaults True) and clipped to [0, dim/2 - 1]; dims
  below `low` keep their frequency, above `high` are divided by the factor, linear ramp between
  (here low 0, high 3 of 16). The attention factor 0.1 * ln(4) + 1 = 1.1386 multiplies cos AND
  sin, so q.k scores are scaled by its square (1.296). It is static: unlike dynamic/longrope,
  yarn does not depend on the sequence length.
  """
  from transformers import Qwen3Config
  kw = _common(num_hidden_layers=2, head_dim=32, rms_norm_eps=1e-6,
               max_position_embeddings=512, tie_word_embeddings=True,
               rope_parameters={"rope_type": "default", "rope_theta": 1e6})
  kw.update(overrides)
  return Qwen3Config(**kw)


def _qwen3_yarn(**overrides):
  return _qwen3(**{"max_position_embeddings": 256,
                   "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 64,
                                       "rope_theta": 1e6}, **overrides})


def _gemma(**overrides):
  """Gemma 1 (`GemmaForCausalLM`, HF `modeling_gemma`): as Gemma 2 without its additions:

  - embeddings times sqrt(hidden) (a tensor in the weight dtype), (1 + w) RMSNorms in float32,
    GeGLU with the tanh GELU (`hidden_act` gelu_pytorch_tanh: `GemmaConfig` itself turns the
    legacy "gelu" of the original releases into it), tied head, head_dim given;
  - two norms per layer (input, and post_attention_layernorm before the MLP, as Llama's): NO
    post-attention / post-feedforward norms, no soft-capping, no sliding window;
  - scores scaled by head_dim ** -0.5, rope_theta 10 000;
  - one key/value head (multi-query attention, as gemma-2b).

  GGUF arch "gemma" (conversion/gemma.py `GemmaModel`): norms stored as w + 1, key/value length,
  no rope.freq_base (llama.cpp's default 10 000 is Gemma's theta).
  """
  from transformers import GemmaConfig
  kw = _common(num_hidden_layers=2, head_dim=HEAD_DIM, num_key_value_heads=1,
               rms_norm_eps=1e-6, max_position_embeddings=512, tie_word_embeddings=True,
               hidden_act="gelu_pytorch_tanh",
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
  kw.update(overrides)
  return GemmaConfig(**kw)


def _gemma2(**overrides):
  """Gemma 2 (HF `modeling_gemma2`):

  - embeddings times sqrt(hidden) as a tensor cast to the weight dtype (8.0 here, exact; in
    bfloat16 checkpoints sqrt(3584) = 59.87 rounds to 59.75 before the multiply);
  - RMSNorm `x * rsqrt(mean(x^2) + eps) * (1 + w)` in float32, weights stored as w;
  - four norms per layer: input, post-attention (on the attention output, before the residual
    add), pre-feedforward, post-feedforward (on the MLP output, before the add);
  - GeGLU with the tanh GELU (`gelu_pytorch_tanh`);
  - scores scaled by query_pre_attn_scalar ** -0.5 (not head_dim), then soft-capped
    `cap * tanh(s / cap)` BEFORE the mask is added; the final logits capped the same way;
  - layer i slides (window W: query q sees keys k with q - W < k <= q, W keys including
    itself) when i is even, attends fully when odd;
  - tied head.

  Caps 10 (attention) and 5 (final) are smaller than Gemma 2's 50 / 30 so that both clearly
  change the values (the test checks removing either moves logits by far more than the
  tolerance). query_pre_attn_scalar equals head_dim here: llama.cpp cannot store another value
  (it scales by 1/sqrt(head_dim), `llama-model.cpp`), so this family's GGUF is exact; Gemma 3
  tests the scalar.
  """
  from transformers import Gemma2Config
  kw = _common(num_hidden_layers=2, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
               max_position_embeddings=512, tie_word_embeddings=True,
               query_pre_attn_scalar=HEAD_DIM, sliding_window=6,
               attn_logit_softcapping=10.0, final_logit_softcapping=5.0,
               hidden_activation="gelu_pytorch_tanh",
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
  kw.update(overrides)
  return Gemma2Config(**kw)


def _gemma3(**overrides):
  """Gemma 3 text (`Gemma3ForCausalLM`, model_type gemma3_text), HF `modeling_gemma3`:

  - as Gemma 2 (embedding scale, (1 + w) norms, four norms per layer, GeGLU tanh, tied head),
  - plus q/k RMS norms over each head, also (1 + w), applied before the rotary embedding;
  - NO attention soft-capping (the config field exists but `Gemma3Attention` never passes it)
    and final_logit_softcapping None;
  - layer i slides unless (i + 1) % 6 == 0: with 6 layers, layers 0-4 slide, layer 5 is full;
  - rotary parameters per layer type (`config.rope_parameters` is a dict keyed by
    "sliding_attention" / "full_attention"): theta 10 000 on sliding layers, 1 000 000 on full
    ones; "gemma3-linear" scales the full layers only, by 8 (gemma-3-4b..27b), leaving sliding
    layers unscaled;
  - scores scaled by query_pre_attn_scalar ** -0.5 = 24 ** -0.5, not head_dim 16 ** -0.5.

  llama.cpp has no key for query_pre_attn_scalar (1/sqrt(head_dim) except for the 27B layer
  count, `llama-model.cpp`): `gguf_compatible_overrides` gives the head_dim-scaled sibling the
  GGUF tests convert.
  """
  from transformers import Gemma3TextConfig
  kw = _common(num_hidden_layers=6, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
               max_position_embeddings=512, tie_word_embeddings=True,
               query_pre_attn_scalar=24, sliding_window=6,
               hidden_activation="gelu_pytorch_tanh",
               rope_parameters={"sliding_attention": {"rope_type": "default",
                                                      "rope_theta": 10000.0},
                                "full_attention": {"rope_type": "default",
                                                   "rope_theta": 1e6}})
  kw.update(overrides)
  return Gemma3TextConfig(**kw)


def _gemma3_linear(**overrides):
  return _gemma3(**{"rope_parameters": {
      "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
      "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}},
      **overrides})


# LongRoPE rescale factors, one per rotated frequency: distinct, so a wrong order shows.
def _factors(n: int, lo: float, hi: float) -> list[float]:
  return [round(float(x), 4) for x in np.geomspace(lo, hi, n)]


def _phi3(**overrides):
  """Phi-3 (HF `modeling_phi3`): fused `qkv_proj` (rows q | k | v) and `gate_up_proj` (rows
  gate | up, `up * silu(gate)`), head_dim = hidden / heads, untied head, no sliding window.

  "phi3-longrope" (Phi-3.5-mini style): inverse frequencies 1 / (factor_i * theta^(2i/d)) with
  short_factor while the forward's largest position + 1 <= original_max_position_embeddings,
  long_factor beyond, for EVERY position of that forward (`longrope_frequency_update`: one set
  per call, not per position). `generate` keeps that whole-sequence rule across the boundary:
  `Phi3ForCausalLM.prepare_inputs_for_generation` drops the KV cache when the sequence first
  exceeds the original length, so the whole sequence is recomputed with the long factors. The
  attention factor sqrt(1 + ln(s) / ln(original)) with s = max_position_embeddings / original
  (512 / 128 = 4: 1.1339) multiplies cos and sin (scores by its square) with either set, from
  the first token (the rope config has no `factor`; with one, s = factor).
  original_max_position_embeddings is 128: the tests' 28 positions and jaxspec's default
  128-slot cache both stay within it, so "short by sequence length" (HF) and "by context size"
  (llama.cpp: long when n_ctx > original) agree; a separate test feeds a prompt longer than
  128, where HF rotates all positions, the first 128 included, with the long factors.

  "phi3-partial" (Phi-4-mini style): partial_rotary_factor 0.75: only the first 12 of 16 dims
  of each head rotate (rotate-half within those 12), the last 4 pass through; the factor lists
  have 6 entries.
  """
  from transformers import Phi3Config
  kw = _common(num_hidden_layers=2, rms_norm_eps=1e-5, max_position_embeddings=512,
               original_max_position_embeddings=512, tie_word_embeddings=False,
               sliding_window=None,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
  kw.update(overrides)
  return Phi3Config(**kw)


def _longrope(partial: float) -> dict[str, Any]:
  n = int(HEAD_DIM * partial) // 2
  return {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": partial,
          "short_factor": _factors(n, 1.0, 3.0), "long_factor": _factors(n, 1.5, 24.0)}


def _phi3_longrope(**overrides):
  return _phi3(**{"original_max_position_embeddings": 128,
                  "rope_parameters": _longrope(1.0), **overrides})


def _phi3_partial(**overrides):
  return _phi3(**{"original_max_position_embeddings": 128,
                  "rope_parameters": _longrope(0.75), **overrides})


FAMILIES: dict[str, Callable[..., Any]] = {
    "llama": _llama,
    "llama-linear": _llama_linear,
    "llama-dynamic": _llama_dynamic,
    "mistral": _mistral,
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "qwen3-yarn": _qwen3_yarn,
    "gemma": _gemma,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "gemma3-linear": _gemma3_linear,
    "phi3": _phi3,
    "phi3-longrope": _phi3_longrope,
    "phi3-partial": _phi3_partial,
}

# What each variant adds, as `write_hf` overrides that take it away again (config fields, or
# `bias_std` for Qwen2's biases, which no config field turns off): with the same seed (the same
# weights otherwise), Hugging Face's logits must move by far more than the parity tolerance, or
# the variant would not test what it claims. For the NEUTRAL ones the opposite: HF must not move at
# all (dynamic NTK within its original range is the plain rotary embedding).
FEATURES: dict[str, dict[str, dict[str, Any]]] = {
    "llama-linear": {"linear rope": {"rope_parameters": {"rope_type": "default",
                                                         "rope_theta": 10000.0}}},
    "llama-dynamic": {"nothing within range (== default rope)": {
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}},
    "mistral": {"sliding window": {"sliding_window": None}},
    "qwen2": {"q/k/v biases": {"bias_std": 0.0}},
    "qwen3-yarn": {"yarn": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}},
    # Gemma 1's embedding scale and (1 + w) norms have no switch in HF; its activation has
    # (GemmaConfig maps "gelu" to the tanh form, so SiLU is the alternative that shows).
    "gemma": {"GeGLU (vs SwiGLU)": {"hidden_act": "silu"}},
    "gemma2": {"attention softcap": {"attn_logit_softcapping": None},
               "final softcap": {"final_logit_softcapping": None},
               "sliding window": {"sliding_window": 512}},
    "gemma3": {"query_pre_attn_scalar": {"query_pre_attn_scalar": HEAD_DIM},
               "sliding window": {"sliding_window": 512}},
    "gemma3-linear": {"linear rope on full layers": {"rope_parameters": {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "default", "rope_theta": 1e6}}}},
    "phi3-longrope": {"longrope": {"rope_parameters": {"rope_type": "default",
                                                       "rope_theta": 10000.0}}},
    "phi3-partial": {"partial rotary": {"rope_parameters": _longrope(1.0)}},
}
# Features whose absence must leave the logits unchanged (see FEATURES).
NEUTRAL = {"llama-dynamic"}


def gguf_compatible_overrides(config) -> dict[str, Any]:
  """Config overrides that make `config` expressible in GGUF (empty when it already is).

  Mistral: llama.cpp's converter drops `sliding_window` (`MistralForCausalLM` is converted by
  `LlamaModel`, conversion/llama.py, which like `TextModel`, conversion/base.py, writes no
  `llama.attention.sliding_window`), so the GGUF of a windowed Mistral attends fully: the GGUF
  tests convert the sibling with sliding_window None, which is what that file computes.

  llama.cpp scales Gemma 2/3 attention scores by 1/sqrt(head_dim) (1/sqrt(hidden/heads) for the
  27B layer counts) and has no metadata key for query_pre_attn_scalar (`llama-model.cpp`,
  `LLM_ARCH_GEMMA2` / `LLM_ARCH_GEMMA3` hparams), so a checkpoint whose scalar differs cannot be
  converted faithfully: the GGUF tests convert the sibling with scalar = head_dim.
  """
  if config.model_type == "mistral" and config.sliding_window is not None:
    return {"sliding_window": None}
  scalar = getattr(config, "query_pre_attn_scalar", None)
  if scalar is not None and scalar != config.head_dim:
    return {"query_pre_attn_scalar": config.head_dim}
  return {}


# -- Hugging Face checkpoint and reference --------------------------------------------------------


def _is_gemma(config) -> bool:
  return config.model_type in ("gemma", "gemma2", "gemma3_text")


def write_hf(name: str, path, seed: int = 0, bias_std: float | None = None, **overrides):
  """Writes a tiny random checkpoint of family `name` to directory `path`; returns its config.

  Every parameter is redrawn from a `torch.Generator` seeded with `seed`, in sorted name order
  (deterministic for a seed and config): matrices N(0, g^2 / fan_in) with gain g = BRANCH_GAIN
  for o_proj / down_proj and 1 otherwise (the LM head too), the embedding N(0, EMBED_STD^2), and
  every RMSNorm weight, q/k norms included, a multiplier c + N(0, NORM_STD^2): c = FINAL_NORM
  for the final norm, GEMMA_POST_NORM for Gemma's post-attention / post-feedforward norms, 1
  otherwise. Gemma stores the multiplier as w with output x * (1 + w), so there w = c - 1 + noise
  (not zeros, HF's initialisation): a loader that forgets or doubles the + 1 scales every norm
  output by a wrong ~0-3 and fails. Biases (Qwen2's q/k/v) are N(0, bias_std^2), BIAS_STD by
  default; bias_std 0 zeroes them and leaves every other weight as drawn (the noise is drawn in
  the same order). `overrides` are config fields (e.g. num_hidden_layers=1 for a draft model).
  """
  import torch
  from transformers import AutoModelForCausalLM

  config = FAMILIES[name](**overrides)
  torch.manual_seed(seed)  # from_config's own initialisation, all overwritten below
  model = AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                           dtype=torch.float32).eval()
  gen = torch.Generator().manual_seed(seed)
  gemma = _is_gemma(config)
  post = ("post_attention_layernorm.weight", "post_feedforward_layernorm.weight")
  with torch.no_grad():
    for pname, p in sorted(model.named_parameters()):
      noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
      if pname.endswith("norm.weight"):
        centre = (FINAL_NORM if pname == "model.norm.weight"
                  else GEMMA_POST_NORM if gemma and pname.endswith(post) else 1.0)
        value = NORM_STD * noise + (centre - 1.0 if gemma else centre)
      elif pname.endswith("embed_tokens.weight"):
        value = EMBED_STD * noise
      elif p.ndim == 2:
        gain = BRANCH_GAIN if pname.endswith(("o_proj.weight", "down_proj.weight")) else 1.0
        value = noise * (gain / math.sqrt(p.shape[1]))
      elif pname.endswith(".bias"):
        value = noise * (BIAS_STD if bias_std is None else bias_std)
      else:
        raise AssertionError(f"{name}: parameter {pname} {tuple(p.shape)} has no rule")
      p.copy_(value)
  path = Path(path)
  model.save_pretrained(path)  # safetensors (the only format transformers 5 writes)
  return config


def hf_reference(path, prompts: np.ndarray, n_new: int) -> dict[str, np.ndarray]:
  """Hugging Face's outputs for equal-length `prompts` [B, T] of the checkpoint at `path`.

  Returns float32 `logits` [B, T, V] of one forward over the prompts (no padding, no mask),
  `greedy` [B, n_new] int64 from a greedy loop over HF's forward with its KV cache (argmax of
  the raw logits: no logits processor, no stop token), `greedy_logprobs` [B, n_new] the
  log-softmax of each greedy token at its step, `step_logits` [B, n_new, V] and `min_margin`,
  the smallest top-1 minus top-2 logit along the greedy path. The loop is checked against one
  cache-free forward over prompt + continuation (HF agreeing with itself: the sliding-window
  caches, position ids and length-dependent rope types all behave), except for dynamic NTK past
  the original context, whose rotation follows the sequence length by design.
  """
  import torch
  from transformers import AutoModelForCausalLM

  torch.set_num_threads(1)
  model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                               attn_implementation="eager").eval()
  ids = torch.as_tensor(np.asarray(prompts), dtype=torch.long)
  b, t = ids.shape
  rope = model.config.rope_parameters
  if rope.get("rope_type") == "longrope":
    orig = rope["original_max_position_embeddings"]
    if t <= orig < t + n_new:  # `generate` would drop and recompute the cache there; we don't
      raise ValueError(f"{path}: a continuation crossing original_max_position_embeddings"
                       f" {orig} has no cached-loop reference; keep it on one side")
  with torch.no_grad():
    out = model(input_ids=ids, use_cache=True)
    logits = out.logits.float()
    cache, last = out.past_key_values, logits[:, -1]
    tokens, steps = [], []
    for i in range(n_new):
      steps.append(last)
      nxt = last.argmax(-1)
      tokens.append(nxt)
      if i + 1 < n_new:
        pos = torch.full((b, 1), t + i, dtype=torch.long)
        out = model(input_ids=nxt[:, None], position_ids=pos, past_key_values=cache,
                    use_cache=True)
        cache, last = out.past_key_values, out.logits[:, -1].float()
    greedy = torch.stack(tokens, 1)
    step_logits = torch.stack(steps, 1)
    full = model(input_ids=torch.cat([ids, greedy[:, :-1]], 1)).logits.float()[:, t - 1:]
  # Dynamic NTK past the original context rotates by the current length, so by design one
  # forward over the whole sequence differs from the cached loop: nothing to cross-check there.
  dynamic_past = (rope.get("rope_type") == "dynamic"
                  and t + n_new > model.config.max_position_embeddings)
  if not dynamic_past and not (torch.equal(full.argmax(-1), greedy)
                               and torch.allclose(full, step_logits, atol=1e-4, rtol=0)):
    raise AssertionError(f"{path}: Hugging Face's cached greedy loop disagrees with its own"
                         f" cache-free forward (max diff {(full - step_logits).abs().max()})")
  top2 = step_logits.topk(2, dim=-1).values
  logprobs = torch.log_softmax(step_logits, -1).gather(-1, greedy[..., None])[..., 0]
  return dict(logits=logits.numpy(), greedy=greedy.numpy(), greedy_logprobs=logprobs.numpy(),
              step_logits=step_logits.numpy(),
              min_margin=np.float32((top2[..., 0] - top2[..., 1]).min()))


def write_hf_tensors(src, dst, tensors: Mapping[str, np.ndarray]) -> None:
  """Copies the checkpoint directory `src` to `dst` with its weights replaced by `tensors`
  (Hugging Face names; e.g. the dequantized weights `write_gguf` returns)."""
  from safetensors.numpy import save_file
  src, dst = Path(src), Path(dst)
  dst.mkdir(parents=True, exist_ok=True)
  for f in src.iterdir():
    if f.suffix != ".safetensors":
      shutil.copy(f, dst / f.name)
  save_file({k: np.ascontiguousarray(v, np.float32) for k, v in tensors.items()},
            dst / "model.safetensors", metadata={"format": "pt"})


# -- GGUF -----------------------------------------------------------------------------------------

# HF model_type -> GGUF architecture. Mistral is written as "llama" (conversion/llama.py
# registers MistralForCausalLM on `LlamaModel`; conversion/mistral.py's `MistralModel` is for
# Mistral's own consolidated format, and uses "llama" there too unless llama_4_scaling is set).
GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "mistral": gguf.MODEL_ARCH.LLAMA,
             "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
             "gemma": gguf.MODEL_ARCH.GEMMA, "gemma2": gguf.MODEL_ARCH.GEMMA2,
             "gemma3_text": gguf.MODEL_ARCH.GEMMA3, "phi3": gguf.MODEL_ARCH.PHI3}

# `types` for a GGUF whose matrices inside the blocks are Q8_0 (embedding, head and every 1-D
# tensor, norms and biases, stay F32). Patterns are fnmatch globs over GGUF tensor names; the
# first match wins.
Q8_MATMULS = {f"blk.*.{n}.weight": "Q8_0" for n in (
    "attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
  """conversion/llama.py `LlamaModel.permute`: each head's rows from rotate-half order (first
  half, second half) to interleaved pairs, the layout llama.cpp's `llama` graph rotates."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


def _qtype(gguf_name: str, ndim: int, types: Mapping[str, str] | None) -> str:
  if ndim < 2:  # llama.cpp keeps 1-D tensors (norms, rope factors) F32 (conversion/base.py)
    return "F32"
  for pattern, qtype in (types or {}).items():
    if fnmatch.fnmatchcase(gguf_name, pattern):
      return qtype
  return "F32"


def _metadata(w: gguf.GGUFWriter, hp: dict[str, Any], arch: str) -> None:
  """The keys llama.cpp's converter writes for `arch` from the HF config dict `hp` (what
  `AutoConfig.from_pretrained(...).to_dict()` gives, as `ModelBase.load_hparams`)."""
  rope = hp.get("rope_parameters") or {}
  n_ctx, d, ff = hp["max_position_embeddings"], hp["hidden_size"], hp["intermediate_size"]
  n_head, n_kv, eps = hp["num_attention_heads"], hp["num_key_value_heads"], hp["rms_norm_eps"]
  w.add_block_count(hp["num_hidden_layers"])
  w.add_context_length(n_ctx)
  w.add_embedding_length(d)
  w.add_feed_forward_length(ff)
  w.add_head_count(n_head)
  w.add_head_count_kv(n_kv)
  w.add_layer_norm_rms_eps(eps)
  if arch in ("llama", "qwen2", "qwen3"):
    # conversion/base.py `TextModel.set_gguf_parameters` (Qwen2 and Qwen3 add nothing for a
    # causal LM, conversion/qwen.py; Llama/Mistral below): rope type from rope_parameters
    # (linear: type + factor; yarn: type, factor, original_context_length, and attn_factor /
    # beta_fast / beta_slow / ext_factor only when the config sets them; dynamic: nothing;
    # llama3: a rope_freqs tensor), freq_base, key/value length when the config has head_dim
    # (Qwen2's has none). No sliding_window, not even for Mistral.
    w.add_rope_freq_base(rope["rope_theta"])
    kind = rope.get("rope_type", "default")
    if kind == "linear":
      w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
      w.add_rope_scaling_factor(rope["factor"])
    elif kind == "yarn":
      w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
      w.add_rope_scaling_factor(rope["factor"])
      w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
      for key, add in (("extrapolation_factor", w.add_rope_scaling_yarn_ext_factor),
                       ("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                       ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                       ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
        if rope.get(key) is not None:
          add(rope[key])
    elif kind not in ("default", "dynamic"):
      raise NotImplementedError(f"rope type {kind!r} for {arch}")
    if hp.get("head_dim") is not None:
      w.add_key_length(hp["head_dim"])
      w.add_value_length(hp["head_dim"])
    if arch == "llama":  # conversion/llama.py `LlamaModel.set_gguf_parameters`
      w.add_vocab_size(hp["vocab_size"])
      w.add_rope_dimension_count(hp.get("head_dim") or d // n_head)
  elif arch == "gemma":
    # conversion/gemma.py `GemmaModel.set_gguf_parameters` (no call to the base class): key /
    # value length only; no rope.freq_base (llama.cpp's default 10 000, Gemma's theta).
    if (rope.get("rope_type", "default"), rope.get("rope_theta")) != ("default", 10000.0):
      raise NotImplementedError(f"gemma rope {rope}: llama.cpp's Gemma GGUF records none")
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
  elif arch == "gemma2":
    # conversion/gemma.py `Gemma2Model.set_gguf_parameters` (no call to the base class: no
    # rope.freq_base, so llama.cpp uses its default 10 000, Gemma 2's theta).
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    w.add_attn_logit_softcapping(hp["attn_logit_softcapping"])
    w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])
  elif arch == "gemma3":
    # conversion/gemma.py `Gemma3Model.set_gguf_parameters` on top of the base class: rope
    # scaling from rope_parameters["full_attention"] (so "linear" + factor describes the full
    # layers only; llama.cpp runs sliding layers unscaled, rope_freq_scale_train_swa = 1),
    # freq_base = the full layers' theta, freq_base_swa = the sliding layers' theta, key/value
    # length, final_logit_softcapping only when set, sliding_window. No
    # attn_logit_softcapping (the converter asserts it is None) and no sliding-window pattern
    # key: llama.cpp hard-codes 5 sliding + 1 full (`set_swa_pattern(6)`).
    full, local = rope["full_attention"], rope["sliding_attention"]
    if full.get("rope_type") == "linear":
      w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
      w.add_rope_scaling_factor(full["factor"])
    elif full.get("rope_type", "default") != "default":
      raise NotImplementedError(f"gemma3 full-attention rope type {full['rope_type']!r}")
    w.add_rope_freq_base(full["rope_theta"])
    w.add_rope_freq_base_swa(local["rope_theta"])
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    if hp.get("final_logit_softcapping"):
      w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])
  elif arch == "phi3":
    # conversion/phi.py `Phi3MiniModel.set_gguf_parameters` (no base class call: no key/value
    # length, no rope.scaling.type): original_context_length, rope.dimension_count =
    # int(partial * hidden) // heads, freq_base, sliding_window 0 when the config has none.
    # The converter reads rope_parameters["original_max_position_embeddings"], which
    # transformers only fills in for scaled rope types; the top-level field otherwise.
    partial = rope.get("partial_rotary_factor", 1.0)
    w.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings",
                                             hp["original_max_position_embeddings"]))
    w.add_rope_dimension_count(int(partial * d) // n_head)
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_sliding_window(hp.get("sliding_window") or 0)
    if rope.get("long_factor"):
      # conversion/phi.py `Phi3MiniModel.generate_extra_tensors`: the LongRoPE attention factor
      # from s = max_position_embeddings / original (the rope factor tensors are added with the
      # weights).
      orig = rope["original_max_position_embeddings"]
      s = n_ctx / orig
      w.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(s) / math.log(orig))
                                      if s > 1.0 else 1.0)
  else:
    raise NotImplementedError(arch)


def write_gguf(hf_path, gguf_path, types: Mapping[str, str] | None = None,
               ) -> dict[str, np.ndarray]:
  """Converts the tiny checkpoint at `hf_path` to `gguf_path` the way llama.cpp does.

  Args:
    hf_path: a directory written by `write_hf`.
    gguf_path: the .gguf file to write.
    types: fnmatch patterns over GGUF tensor names -> ggml type names ("Q8_0", "F16", ...),
      first match wins; 1-D tensors and unmatched ones are F32 (`Q8_MATMULS` quantizes the
      matrices inside the blocks).
  Returns:
    The Hugging Face tensors as the file holds them, in HF names and layout (quantized ones
    dequantized; Llama's permutation undone, since blocks run along rows; Gemma norms as w, the
    value whose 1 + w in float32 is the stored F32 number): `write_hf_tensors` of them is the
    checkpoint the GGUF is exactly equivalent to.
  """
  from safetensors.numpy import load_file
  from transformers import AutoConfig

  hf_path = Path(hf_path)
  hp = AutoConfig.from_pretrained(hf_path).to_dict()
  arch_enum = GGUF_ARCH[hp["model_type"]]
  arch = gguf.MODEL_ARCH_NAMES[arch_enum]
  gemma = hp["model_type"] in ("gemma", "gemma2", "gemma3_text")
  if (hp["model_type"] in ("gemma2", "gemma3_text")
      and hp.get("query_pre_attn_scalar") != hp["head_dim"]):
    raise ValueError(f"{hf_path}: query_pre_attn_scalar {hp['query_pre_attn_scalar']} !="
                     f" head_dim {hp['head_dim']} has no GGUF form (llama.cpp scales by"
                     " 1/sqrt(head_dim)); convert the gguf_compatible_overrides sibling")
  if hp["model_type"] == "mistral" and hp.get("sliding_window") is not None:
    raise ValueError(f"{hf_path}: sliding_window {hp['sliding_window']} has no GGUF form"
                     " (llama.cpp's converter drops it and runs Mistral as full-attention"
                     " llama); convert the gguf_compatible_overrides sibling")
  n_layers, n_head, n_kv = (hp["num_hidden_layers"], hp["num_attention_heads"],
                            hp["num_key_value_heads"])
  tensors = load_file(hf_path / "model.safetensors")
  name_map = gguf.get_tensor_name_map(arch_enum, n_layers)

  w = gguf.GGUFWriter(str(gguf_path), arch)
  w.add_name(f"tiny-{hf_path.name}")
  # general.file_type: the type the matrices were asked for (llama.cpp's --outtype)
  main = next(iter((types or {}).values()), "F32")
  w.add_file_type(gguf.LlamaFileType.ALL_F32 if main == "F32"
                  else gguf.LlamaFileType[f"MOSTLY_{main}"])
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)
  _metadata(w, hp, arch)
  add_tiny_tokenizer(w, hp["vocab_size"])

  held: dict[str, np.ndarray] = {}

  def add(gguf_name: str, x: np.ndarray, hf_name: str, permute_heads: int | None = None):
    qtype = _qtype(gguf_name, x.ndim, types)
    q = gguf.quants.quantize(np.ascontiguousarray(x, np.float32), gguf.GGMLQuantizationType[qtype])
    w.add_tensor(gguf_name, q, raw_dtype=gguf.GGMLQuantizationType[qtype])
    back = gguf.quants.dequantize(q, gguf.GGMLQuantizationType[qtype]).reshape(x.shape)
    if permute_heads is not None:  # undo: the inverse of `_permute` regroups the pairs
      back = back.reshape(permute_heads, back.shape[0] // permute_heads // 2, 2,
                          *back.shape[1:]).swapaxes(1, 2).reshape(back.shape)
    held[hf_name] = back

  def key(name: str) -> tuple:
    parts = name.split(".")
    return (int(parts[2]) if parts[1] == "layers" else -1, name)

  for hf_name in sorted(tensors, key=key):
    x = tensors[hf_name].astype(np.float32)
    gguf_name = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if gguf_name is None:
      raise NotImplementedError(f"{hf_name}: no GGUF name for {arch}")
    permute_heads = None
    if arch == "llama" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
      # conversion/llama.py `modify_tensors`: q rows permuted per query head, k per kv head
      permute_heads = n_head if "q_proj" in hf_name else n_kv
      x = _permute(x, permute_heads)
    if gemma and hf_name.endswith("norm.weight"):
      # conversion/gemma.py: every tensor whose name ends in "norm.weight" is stored as w + 1
      # (Gemma 1: input/post-attention/final norms; Gemma 2: input/post-attention/pre- and
      # post-feedforward/final norms; Gemma 3 the same plus the q/k norms, `norm_shift`), so
      # llama.cpp multiplies by the stored value.
      add(gguf_name, x + np.float32(1.0), hf_name)
      held[hf_name] = tensors[hf_name].astype(np.float32)  # HF's 1 + w is the stored value
      continue
    add(gguf_name, x, hf_name, permute_heads)

  rope = hp.get("rope_parameters") or {}
  if arch == "phi3" and rope.get("long_factor"):
    # conversion/phi.py `generate_extra_tensors`: F32 [rotary_dim / 2] each.
    w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_LONG] + ".weight",
                 np.asarray(rope["long_factor"], np.float32))
    w.add_tensor(gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FACTORS_SHORT] + ".weight",
                 np.asarray(rope["short_factor"], np.float32))
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return held


def read_gguf(path) -> tuple[dict[str, Any], dict[str, tuple[str, np.ndarray]]]:
  """(metadata key -> value, tensor name -> (ggml type name, dequantized array in HF layout
  [rows, cols])) of a GGUF file, through gguf's own reader."""
  r = gguf.GGUFReader(str(path))
  meta = {}
  for k, f in r.fields.items():
    if not f.types:
      continue
    if f.types[0] == gguf.GGUFValueType.ARRAY:
      if f.types[-1] == gguf.GGUFValueType.STRING:
        meta[k] = [bytes(f.parts[i]).decode() for i in f.data]
      else:
        meta[k] = [f.parts[i].tolist()[0] for i in f.data]
    elif f.types[0] == gguf.GGUFValueType.STRING:
      meta[k] = bytes(f.parts[f.data[0]]).decode()
    else:
      meta[k] = f.parts[f.data[0]].tolist()[0]
  tensors = {}
  for t in r.tensors:
    shape = tuple(int(x) for x in reversed(t.shape))
    data = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape)
    tensors[t.name] = (t.tensor_type.name, data)
  return meta, tensors

