"""bfloat16 weights with float32 arithmetic (`LlamaConfig.compute_dtype="float32"`): what it
computes, and that greedy speculative output then equals plain greedy output on SmolLM2."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from helpers import SHARED, shared_or_skip
from jaxspec.api import generate, speculative_generate
from jaxspec.drafters import NGram, resolve_drafter
from jaxspec.models import init_params, tiny_config
from jaxspec.models.llama import forward, init_cache
from jaxspec.models.loading import with_compute_dtype
from jaxspec.models.model import Model
from jaxspec.models.quant import quantize
from jaxspec.drafters import self_drafter

T = 5  # a verify block of k = 4 drafts


def _bf16_tiny(**over):
  cfg = tiny_config(dtype="bfloat16", **over)
  return cfg, init_params(cfg, jax.random.key(3), scale=0.2)


# The tiny model's forward jitted, one program per block width (op by op it dispatched every
# primitive alone); SmolLM2's stays op by op (its 30 unrolled layers compile for longer).
_forward_jit = jax.jit(forward, static_argnums=3, static_argnames="fresh")


def _logits(cfg, params, ids, steps, fwd=forward):
  """Logits [n, V] of the last sum(steps) tokens of `ids`, run as blocks of `steps` tokens on
  top of a prefill of the rest, each by `fwd`."""
  n = len(ids) - sum(steps)
  cache = init_cache(cfg, 1, len(ids))
  _, _, cache = fwd(params, jnp.array([ids[:n]]), cache, cfg, fresh=True)
  out = []
  for s in steps:
    lg, _, cache = fwd(params, jnp.array([ids[n:n + s]]), cache, cfg)
    out.append(np.asarray(lg[0]))
    n += s
  return np.concatenate(out)


@pytest.mark.parametrize("bad", ["bfloat16", "float16", 32, jnp.float32])
def test_compute_dtype_is_validated(bad):
  with pytest.raises(ValueError, match="compute_dtype"):
    tiny_config(compute_dtype=bad)
  # Before any file is read: a missing path would be a CheckpointError.
  with pytest.raises(ValueError, match="compute_dtype"):
    jaxspec.load("/nonexistent/model.gguf", compute_dtype=bad)


def test_float32_compute_is_the_float32_model_of_the_rounded_weights():
  """bfloat16 weights with compute_dtype="float32" give, bit for bit, what a float32 model
  with those (bfloat16-rounded) weights gives, in a prefill and in one-token and verify
  steps; the KV cache is float32 and hidden states leave in the weights' dtype."""
  cfg, params = _bf16_tiny(tie_embeddings=True)
  mixed = dataclasses.replace(cfg, compute_dtype="float32")
  f32 = dataclasses.replace(cfg, dtype="float32")
  params32 = jax.tree.map(lambda a: a.astype(jnp.float32), params)
  ids = [5, 9, 17, 3, 88, 41, 7, 63, 12, 30, 101, 2]
  for steps in ([1] * T, [T], [2, 3]):
    np.testing.assert_array_equal(_logits(mixed, params, ids, steps, _forward_jit),
                                  _logits(f32, params32, ids, steps, _forward_jit))
  assert init_cache(mixed, 1, 8).k.dtype == jnp.float32
  _, hidden, cache = forward(params, jnp.array([ids]), init_cache(mixed, 1, 16), mixed,
                             hidden_layers=(0,), fresh=True)
  assert hidden.final.dtype == hidden.layers.dtype == jnp.bfloat16
  assert cache.k.dtype == jnp.float32


@pytest.fixture(scope="module")
def smollm2_bf16_f32(smollm2):
  return with_compute_dtype(quantize(smollm2, "bfloat16"), "float32")


@pytest.fixture(scope="module")
def chat_prompts(smollm2):
  """Three MT-bench prompts on which bfloat16 arithmetic's speculative and batched outputs
  departed from plain greedy decoding of each prompt alone (SmolLM2, 64 tokens)."""
  path = shared_or_skip(SHARED / "data" / "spec_bench_dev.jsonl")
  rows = [json.loads(line) for line in path.read_text().splitlines()[:4]]
  return [smollm2.tokenizer.encode_chat(r["turns"][0]) for r in rows[1:4]]


def test_one_token_and_verify_logits_on_smollm2(smollm2_bf16_f32, chat_prompts):
  """SmolLM2's one-token steps and a T-token verify pass over the same prefix: in bfloat16
  arithmetic their logits differ by bfloat16 roundings grown through 30 layers (0.3-0.6 here,
  as large as the top-2 margins of many steps); in float32 arithmetic over the same weights,
  by float32 summation order (about 5e-5)."""
  mixed = smollm2_bf16_f32
  ids = chat_prompts[0]
  gap = lambda cfg: float(np.abs(_logits(cfg, mixed.params, ids, [1] * T)
                                 - _logits(cfg, mixed.params, ids, [T])).max())
  assert gap(mixed.cfg) < 1e-3
  assert gap(dataclasses.replace(mixed.cfg, compute_dtype=None)) > 0.1


# slow (about 2 minutes of the real-model pass, its longest test): what greedy equality on these
# prompts rests on stays fast, the float32-compute model being bit for bit a float32 model (above)
# and, on SmolLM2, one-token and verify logits within 1e-3 (above); greedy speculative equals
# plain for float32 models with every drafter (test_speculative, test_heads, test_quant).
@pytest.mark.slow
def test_bfloat16_speculative_equals_plain_with_float32_compute(smollm2_bf16_f32, chat_prompts):
  model = smollm2_bf16_f32
  assert model.params.embed.dtype == jnp.bfloat16
  plain = generate(model, chat_prompts, max_new_tokens=64, stop_ids=[2])
  want = [plain.row(i) for i in range(len(chat_prompts))]
  alone = [generate(model, [p], max_new_tokens=64, stop_ids=[2]).row(0) for p in chat_prompts]
  assert alone == want
  for drafter, k in ((NGram(), 4), (self_drafter(model), 3), (resolve_drafter(model, "eagle"), 3)):
    out = speculative_generate(model, drafter, chat_prompts, max_new_tokens=64, stop_ids=[2],
                               num_draft_tokens=k)
    assert [out.row(i) for i in range(len(chat_prompts))] == want, type(drafter).__name__
