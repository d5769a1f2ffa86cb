"""Parity with Hugging Face transformers across decoder families and rope-scaling variants.

For every family of `tests/families.py` (Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2, Gemma 3
text, Phi-3 and their rope variants) a tiny random checkpoint is written with `transformers`,
and:

- Hugging Face's side is checked first, without jaxspec: its reference is meaningful (logits far
  from uniform, greedy margins well above float32 noise, its cached loop equal to its cache-free
  forward), each variant's feature moves HF's logits by far more than the tolerance (so the
  parity below can fail), and the GGUF the llama.cpp-style converter writes holds the layout and
  metadata llama.cpp's conventions prescribe (read back with gguf's own reader);
- then jaxspec's: prompt logits (float32, atol 1e-4) and the greedy continuation token for token,
  with its log-probabilities, from the Hugging Face directory, from the F32 GGUF and from a GGUF
  with Q8_0 matrices (against HF run on exactly the dequantized weights); greedy speculative
  decoding with `NGram()` (and, for the base families, `DraftModel` of a smaller
  same-family model: Gemma 3 and Mistral by default, the others under -m slow) equal to plain.

jaxspec tests of one family run together (a module-scoped parametrized fixture); the HF-only
tests of all families run before any of them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="the Hugging Face parity tests need torch (pip install"
                    " jaxspec[compare])")
pytest.importorskip("transformers", reason="the Hugging Face parity tests need transformers"
                    " (pip install jaxspec[compare])")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import families as F  # noqa: E402
import jaxspec  # noqa: E402
from jaxspec.drafters import DraftModel, NGram  # noqa: E402
from jaxspec.models.llama import forward, forward_jit, init_cache  # noqa: E402
from jaxspec.models.loading import load  # noqa: E402
from helpers import tiny_vocab  # noqa: E402

B, T, N_NEW, K = 2, 12, 16, 3  # prompts [B, T] (no padding), new tokens, drafts per step
MAX_LEN = 128  # the cache of the prompt-logits forward: jaxspec's default size for these calls
ATOL = 1e-4  # float32 logits
MIN_MARGIN = 1e-3  # greedy top-1/top-2 gaps below this would make token equality luck
BASE_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "phi3")
PROMPTS = np.random.default_rng(1).integers(3, F.VOCAB, (B, T))


@dataclasses.dataclass
class Case:
  """One family's checkpoints and Hugging Face references (written once per session).

  `gguf_hf` is the checkpoint the GGUF files convert (the family's own, or its GGUF-compatible
  sibling); `ref_gguf` its reference; `q8_hf` / `ref_q8` the checkpoint holding exactly the
  Q8_0 file's dequantized weights and its reference.
  """

  name: str
  hf: Path
  config: Any
  ref: dict[str, np.ndarray]
  gguf_hf: Path
  ref_gguf: dict[str, np.ndarray]
  f32: Path
  q8: Path
  q8_hf: Path
  ref_q8: dict[str, np.ndarray]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
  return tmp_path_factory.mktemp("families")


def _write_case(name: str, root: Path) -> Case:
  hf = root / name
  config = F.write_hf(name, hf, seed=0)
  ref = F.hf_reference(hf, PROMPTS, N_NEW)
  gguf_hf, ref_gguf = hf, ref
  if compat := F.gguf_compatible_overrides(config):
    gguf_hf = root / f"{name}-gguf-compatible"
    F.write_hf(name, gguf_hf, seed=0, **compat)
    ref_gguf = F.hf_reference(gguf_hf, PROMPTS, N_NEW)
  f32, q8 = root / f"{name}.f32.gguf", root / f"{name}.q8_0.gguf"
  held = F.write_gguf(gguf_hf, f32)
  held_q8 = F.write_gguf(gguf_hf, q8, types=F.Q8_MATMULS)
  # The F32 file holds the checkpoint itself (norm + 1 and permutations undone).
  original = _safetensors(gguf_hf)
  assert held.keys() == original.keys()
  for k in held:
    np.testing.assert_array_equal(held[k], original[k], err_msg=k)
  q8_hf = root / f"{name}-q8_0-dequantized"
  F.write_hf_tensors(gguf_hf, q8_hf, held_q8)
  return Case(name, hf, config, ref, gguf_hf, ref_gguf, f32, q8, q8_hf,
              F.hf_reference(q8_hf, PROMPTS, N_NEW))


@pytest.fixture(scope="module")
def cases(workdir):
  """name -> `Case`, each written once per module run (shared by the HF-only tests, which run
  for all families first, and the per-family jaxspec tests)."""
  memo: dict[str, Case] = {}

  def get(name: str) -> Case:
    if name not in memo:
      memo[name] = _write_case(name, workdir)
    return memo[name]

  return get


def _safetensors(path: Path) -> dict[str, np.ndarray]:
  from safetensors.numpy import load_file
  return load_file(path / "model.safetensors")


# -- Hugging Face's side, every family (no jaxspec) -----------------------------------------------


@pytest.mark.parametrize("name", list(F.FAMILIES))
def test_hf_reference_is_meaningful(name, cases):
  """Logits far from uniform, greedy margins far above float32 noise, varied continuations."""
  c = cases(name)
  for ref in (c.ref, c.ref_gguf, c.ref_q8):
    assert ref["logits"].shape == (B, T, F.VOCAB) and ref["logits"].dtype == np.float32
    assert ref["greedy"].shape == (B, N_NEW)
    assert np.isfinite(ref["logits"]).all() and ref["logits"].std() > 1.0
    assert ref["min_margin"] > MIN_MARGIN, (
        f"{name}: a greedy step has top-1/top-2 margin {ref['min_margin']:.2e}; change the seed")
    for row in ref["greedy"]:
      assert len(set(row.tolist())) >= 3, f"{name}: greedy repeats itself: {row.tolist()}"


@pytest.mark.parametrize("name,feature", [(n, f) for n in F.FEATURES for f in F.FEATURES[n]])
def test_hf_variant_feature_matters(name, feature, cases, workdir):
  """Taking the variant's feature away (same weights) moves HF's logits by far more than ATOL,
  so the parity tests can fail; for llama-dynamic it must not move them at all."""
  c = cases(name)
  path = workdir / f"{name}-without-{feature.replace(' ', '_').replace('/', '_')}"
  F.write_hf(name, path, seed=0, **F.FEATURES[name][feature])
  without = F.hf_reference(path, PROMPTS, 1)["logits"]
  moved = float(np.abs(without - c.ref["logits"]).max())
  if name in F.NEUTRAL:
    assert moved == 0.0, f"{name}: {feature}: HF moved by {moved}"
  else:
    assert moved > 100 * ATOL, f"{name}: removing {feature} moves HF's logits only {moved}"


def _expected_metadata(hp: dict[str, Any], arch: str) -> dict[str, Any]:
  """The metadata llama.cpp's converter writes (conversion/*.py), stated independently of
  `families.write_gguf`: key (without the arch prefix) -> value."""
  rope = hp["rope_parameters"]
  want = {"block_count": hp["num_hidden_layers"], "context_length": hp["max_position_embeddings"],
          "embedding_length": hp["hidden_size"], "feed_forward_length": hp["intermediate_size"],
          "attention.head_count": hp["num_attention_heads"],
          "attention.head_count_kv": hp["num_key_value_heads"],
          "attention.layer_norm_rms_epsilon": np.float32(hp["rms_norm_eps"])}
  if arch in ("llama", "qwen2", "qwen3"):  # Mistral is "llama": no sliding_window key
    want["rope.freq_base"] = rope["rope_theta"]
    if hp.get("head_dim") is not None:  # Qwen2's config has none: no key/value length
      want.update({"attention.key_length": hp["head_dim"],
                   "attention.value_length": hp["head_dim"]})
    if rope["rope_type"] == "linear":
      want.update({"rope.scaling.type": "linear", "rope.scaling.factor": rope["factor"]})
    if rope["rope_type"] == "yarn":
      want.update({"rope.scaling.type": "yarn", "rope.scaling.factor": rope["factor"],
                   "rope.scaling.original_context_length":
                   rope["original_max_position_embeddings"]})
    if arch == "llama":
      want.update({"vocab_size": hp["vocab_size"], "rope.dimension_count": hp["head_dim"]})
  elif arch == "gemma":  # conversion/gemma.py `GemmaModel`: no rope key, no window, no caps
    want.update({"attention.key_length": hp["head_dim"],
                 "attention.value_length": hp["head_dim"]})
  elif arch == "gemma2":
    want.update({"attention.key_length": hp["head_dim"],
                 "attention.value_length": hp["head_dim"],
                 "attn_logit_softcapping": hp["attn_logit_softcapping"],
                 "final_logit_softcapping": hp["final_logit_softcapping"],
                 "attention.sliding_window": hp["sliding_window"]})
  elif arch == "gemma3":
    full = rope["full_attention"]
    want.update({"rope.freq_base": full["rope_theta"],
                 "rope.freq_base_swa": rope["sliding_attention"]["rope_theta"],
                 "attention.key_length": hp["head_dim"],
                 "attention.value_length": hp["head_dim"],
                 "attention.sliding_window": hp["sliding_window"]})
    if full["rope_type"] == "linear":
      want.update({"rope.scaling.type": "linear", "rope.scaling.factor": full["factor"]})
  elif arch == "phi3":
    partial = rope.get("partial_rotary_factor", 1.0)
    orig = rope.get("original_max_position_embeddings", hp["original_max_position_embeddings"])
    want.update({"rope.freq_base": rope["rope_theta"], "attention.sliding_window": 0,
                 "rope.dimension_count": int(hp["hidden_size"] * partial)
                 // hp["num_attention_heads"],
                 "rope.scaling.original_context_length": orig})
    if rope["rope_type"] == "longrope":
      s = hp["max_position_embeddings"] / orig
      want["rope.scaling.attn_factor"] = np.float32(np.sqrt(1 + np.log(s) / np.log(orig)))
  return want


@pytest.mark.parametrize("name", list(F.FAMILIES))
def test_gguf_follows_llama_cpp_conventions(name, cases):
  """The F32 GGUF read back with gguf.GGUFReader: architecture, every metadata key and value
  (and no scaling or window key where llama.cpp writes none), tensor names, Llama's and
  Mistral's Q/K pair order, Qwen2's biases, Gemma's norm + 1, Phi-3's fused layouts and LongRoPE
  factors, the tokenizer."""
  c = cases(name)
  from transformers import AutoConfig
  hp = AutoConfig.from_pretrained(c.gguf_hf).to_dict()
  arch = {"gemma3_text": "gemma3", "mistral": "llama"}.get(hp["model_type"], hp["model_type"])
  meta, tensors = F.read_gguf(c.f32)
  assert meta["general.architecture"] == arch
  got = {k[len(arch) + 1:]: v for k, v in meta.items() if k.startswith(arch + ".")}
  want = _expected_metadata(hp, arch)
  assert got.keys() == want.keys(), f"extra {got.keys() - want.keys()}, missing" \
                                    f" {want.keys() - got.keys()}"
  for k, v in want.items():
    assert got[k] == (v if isinstance(v, (str, int)) else pytest.approx(float(v), rel=1e-6)), k
  assert meta["tokenizer.ggml.tokens"] == tiny_vocab()[0]
  assert meta["tokenizer.ggml.eos_token_id"] == F.EOS_ID == hp["eos_token_id"]
  assert meta["tokenizer.ggml.bos_token_id"] == F.BOS_ID == hp["bos_token_id"]

  hf = _safetensors(c.gguf_hf)
  d, nh, nkv = hp["hidden_size"], hp["num_attention_heads"], hp["num_key_value_heads"]
  hd = hp.get("head_dim") or d // nh
  # Gemma 1's post_attention_layernorm is the pre-MLP norm (ffn_norm, as Llama's); Gemma 2/3's
  # normalises the attention output (post_attention_norm). Every Gemma stores norm + 1.
  gemma = arch in ("gemma", "gemma2", "gemma3")
  post_norms = arch in ("gemma2", "gemma3")
  names = {"embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
           "input_layernorm": "attn_norm", "q_proj": "attn_q", "k_proj": "attn_k",
           "v_proj": "attn_v", "o_proj": "attn_output", "qkv_proj": "attn_qkv",
           "q_norm": "attn_q_norm", "k_norm": "attn_k_norm",
           "post_attention_layernorm": "post_attention_norm" if post_norms else "ffn_norm",
           "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
           "gate_proj": "ffn_gate", "up_proj": "ffn_up", "gate_up_proj": "ffn_up",
           "down_proj": "ffn_down"}
  expected_names = set()
  for hf_name, x in hf.items():
    parts = hf_name.split(".")
    short = "model.norm" if hf_name == "model.norm.weight" else parts[-2]
    g = (f"blk.{parts[2]}." if parts[1] == "layers" else "") + f"{names[short]}.{parts[-1]}"
    expected_names.add(g)
    qtype, y = tensors[g]
    assert qtype == "F32" and y.shape == x.shape, g
    if gemma and hf_name.endswith("norm.weight"):
      np.testing.assert_array_equal(y, x + np.float32(1), err_msg=g)  # stored 1 + w
    elif arch == "llama" and short in ("q_proj", "k_proj"):  # no biases here (checked below)
      # rows of head h: HF (first half j, second half j) -> llama.cpp pairs (2j, 2j + 1)
      heads = nh if short == "q_proj" else nkv
      xh, yh = x.reshape(heads, hd, d), y.reshape(heads, hd, d)
      np.testing.assert_array_equal(yh[:, 0::2], xh[:, :hd // 2], err_msg=g)
      np.testing.assert_array_equal(yh[:, 1::2], xh[:, hd // 2:], err_msg=g)
    else:
      np.testing.assert_array_equal(y, x, err_msg=g)  # fused Phi-3 tensors: HF's row order
  rope = hp["rope_parameters"]
  if rope.get("rope_type") == "longrope":
    expected_names |= {"rope_factors_long.weight", "rope_factors_short.weight"}
    np.testing.assert_array_equal(tensors["rope_factors_long.weight"][1],
                                  np.float32(rope["long_factor"]))
    np.testing.assert_array_equal(tensors["rope_factors_short.weight"][1],
                                  np.float32(rope["short_factor"]))
  assert set(tensors) == expected_names
  if arch == "phi3":  # fused: qkv rows q | k | v; ffn_up rows gate | up
    assert tensors["blk.0.attn_qkv.weight"][1].shape == ((nh + 2 * nkv) * hd, d)
    assert tensors["blk.0.ffn_up.weight"][1].shape == (2 * hp["intermediate_size"], d)
  if hp.get("tie_word_embeddings"):
    assert "output.weight" not in tensors
  biases = {g for g in tensors if g.endswith(".bias")}
  if arch == "qwen2":  # q/k/v biases in every block, none on attn_output
    assert biases == {f"blk.{i}.attn_{p}.bias" for i in range(hp["num_hidden_layers"])
                      for p in "qkv"}
  else:
    assert not biases
  # The Q8_0 file: exactly the matrices inside the blocks quantized (norms, biases stay F32).
  _, q8 = F.read_gguf(c.q8)
  assert q8.keys() == tensors.keys()
  for g, (qtype, y) in q8.items():
    inside = g.startswith("blk.") and y.ndim == 2
    assert qtype == ("Q8_0" if inside else "F32"), g


# -- jaxspec against Hugging Face, one family at a time -------------------------------------------


@pytest.fixture(scope="module", params=list(F.FAMILIES))
def case(request, cases) -> Case:
  return cases(request.param)


@pytest.fixture(scope="module")
def model(case):
  return load(case.hf, "float32", scan_layers=True)


@pytest.fixture(scope="module")
def plain(case, model):
  """jaxspec's greedy continuation (no stop tokens: `stop_ids=[]` stops on nothing)."""
  return jaxspec.generate(model, [list(r) for r in PROMPTS], max_new_tokens=N_NEW, stop_ids=[],
                          logprobs=True)


def _prompt_logits(m) -> np.ndarray:
  cache = init_cache(m.cfg, B, MAX_LEN)
  return np.asarray(forward_jit(m.params, jnp.asarray(PROMPTS, jnp.int32), cache, m.cfg)[0])


def _assert_matches(m, ref, out=None):
  np.testing.assert_allclose(_prompt_logits(m), ref["logits"], atol=ATOL, rtol=0)
  if out is None:
    out = jaxspec.generate(m, [list(r) for r in PROMPTS], max_new_tokens=N_NEW, stop_ids=[],
                           logprobs=True)
  np.testing.assert_array_equal(out.tokens, ref["greedy"])
  np.testing.assert_array_equal(out.lengths, N_NEW)
  np.testing.assert_allclose(out.logprobs, ref["greedy_logprobs"], atol=ATOL, rtol=0)


def test_hf_directory(case, model, plain):
  _assert_matches(model, case.ref, plain)


def test_gguf_f32(case):
  """The F32 GGUF against HF on the checkpoint it converts (Gemma 3: the head_dim-scaled
  sibling; Mistral: the windowless one, as llama.cpp drops the window;
  `families.gguf_compatible_overrides`)."""
  _assert_matches(load(case.f32, "float32", scan_layers=True), case.ref_gguf)


def test_gguf_q8_0(case):
  """Q8_0 matrices against HF on exactly their dequantized values: the same tolerance."""
  _assert_matches(load(case.q8, "float32", scan_layers=True), case.ref_q8)


def test_speculative_equals_plain(case, model, plain):
  """Greedy speculative decoding (k = 3) with `NGram()` emits plain decoding's tokens, for every
  family. The rope variants differ from their base only inside the target's forward, which
  NGram's verify steps exercise."""
  out = jaxspec.speculative_generate(model, NGram(), [list(r) for r in PROMPTS],
                                     max_new_tokens=N_NEW, num_draft_tokens=K, stop_ids=[])
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  np.testing.assert_array_equal(out.tokens, case.ref["greedy"])
  assert sum(out.stats["drafted_per_row"]) > 0  # verify steps ran


# Gemma 3 (sliding and global layers, q/k norms, two rope bases) and Mistral (a sliding window in
# every layer) by default, the other base families under -m slow: a draft model's own cache and
# rollback go through the same family switches as the target's forward, which the NGram test
# above and test_hf_directory check for every family.
@pytest.mark.parametrize("name", [
    n if n in ("gemma3", "mistral") else pytest.param(n, marks=pytest.mark.slow)
    for n in BASE_FAMILIES])
def test_draft_model_speculative_equals_plain(name, cases, workdir):
  """Greedy speculative decoding (k = 3) with `DraftModel` of a smaller model of the same family
  (another seed, one layer, same vocabulary) emits HF's greedy tokens (which test_hf_directory
  shows plain jaxspec decoding emits)."""
  case = cases(name)
  path = workdir / f"{name}-draft"
  if not path.exists():
    F.write_hf(name, path, seed=1, num_hidden_layers=1)
  out = jaxspec.speculative_generate(load(case.hf, "float32", scan_layers=True),
                                     DraftModel(load(path, "float32", scan_layers=True)),
                                     [list(r) for r in PROMPTS], max_new_tokens=N_NEW,
                                     num_draft_tokens=K, stop_ids=[])
  np.testing.assert_array_equal(out.tokens, case.ref["greedy"])


# -- Sliding layers in ring buffers, past the window ---------------------------------------------

RING_SLACK = K + 1  # the widest write of the speculative loop below (k + 1 tokens)


# slow: "gemma3-linear" is Gemma 3's ring (its sliding layers keep the local rope) with linear
# scaling on the full layers, which its parity tests above check; "gemma3" keeps the ring.
@pytest.mark.parametrize("name", ["mistral", "gemma2", "gemma3",
                                  pytest.param("gemma3-linear", marks=pytest.mark.slow)])
def test_ring_cache_past_the_window(name, cases):
  """The sliding layers in ring buffers of window + k + 1 slots (`init_cache(ring_slack=)`):
  the prompt (longer than the ring, so its write wraps), HF's greedy continuation token for
  token with its log-probabilities, and greedy speculative decoding with NGram, 28 positions
  in all against a window of 6 (`families.py`)."""
  from jaxspec.decoding import protocol
  from jaxspec.decoding.functional import decode, speculative_decode
  from jaxspec.models.llama import LlamaLM
  case = cases(name)
  m = load(case.hf, "float32", scan_layers=True)
  w = m.cfg.sliding_window
  cache = init_cache(m.cfg, B, MAX_LEN, ring_slack=RING_SLACK)
  assert cache.ring_len == w + RING_SLACK < T < T + N_NEW  # the prompt wraps the ring
  logits = forward_jit(m.params, jnp.asarray(PROMPTS, jnp.int32), cache, m.cfg)[0]
  np.testing.assert_allclose(np.asarray(logits), case.ref["logits"], atol=ATOL, rtol=0)
  target = protocol.Target(LlamaLM(m.cfg, ring_slack=RING_SLACK), m.params)
  ids, lens = jnp.asarray(PROMPTS, jnp.int32), jnp.full((B,), T, jnp.int32)
  out = decode(target, ids, lens, jax.random.key(0), max_new_tokens=N_NEW, stop_ids=())
  np.testing.assert_array_equal(out.tokens, case.ref["greedy"])
  np.testing.assert_allclose(out.logprobs, case.ref["greedy_logprobs"], atol=ATOL, rtol=0)
  spec = speculative_decode(target, NGram(), ids, lens, jax.random.key(0),
                            max_new_tokens=N_NEW, num_draft_tokens=K, stop_ids=())
  np.testing.assert_array_equal(spec.tokens, case.ref["greedy"])
  assert int(spec.stats.drafted.sum()) > 0  # verify steps wrote k + 1 tokens into the ring


# -- LongRoPE past the original context -----------------------------------------------------------

LONG_T = 136  # > original_max_position_embeddings 128 of the longrope families


@pytest.mark.parametrize("name", ["phi3-longrope", "phi3-partial", "llama-dynamic"])
def test_length_dependent_rope_past_original_context(name, cases, workdir):
  """A prompt longer than the original context (128 positions). LongRoPE: HF's forward rotates
  EVERY position, the first 128 included, with long_factor (one set per forward, chosen by its
  length; every later step is past the original length too, and `generate` agrees), with the
  same attention factor. Dynamic NTK: the prompt's forward rotates every position with the base
  for the prompt's length, and each later decode step with the base for its own length p + 1
  (transformers recomputes the frequencies as the sequence grows, never the cache). The
  unscaled rotation throughout moves HF's logits far past the tolerance (checked here), so this
  pins the scaling of the first 128 positions too, not only from position 128 on."""
  c = cases(name)
  prompts = np.random.default_rng(7).integers(3, F.VOCAB, (1, LONG_T))
  ref = F.hf_reference(c.hf, prompts, 8)
  rope = dict(c.config.rope_parameters)
  unscaled = workdir / f"{name}-unscaled"
  if rope["rope_type"] == "longrope":
    F.write_hf(name, unscaled, seed=0,
               rope_parameters={**rope, "long_factor": list(rope["short_factor"])})
  else:
    F.write_hf(name, unscaled, seed=0, rope_parameters={"rope_type": "default",
                                                        "rope_theta": rope["rope_theta"]})
  moved = np.abs(F.hf_reference(unscaled, prompts, 1)["logits"] - ref["logits"]).max()
  assert moved > 100 * ATOL
  assert ref["min_margin"] > MIN_MARGIN
  m = load(c.hf, "float32", scan_layers=True)
  cache = init_cache(m.cfg, 1, 2 * MAX_LEN)
  # A prefill passes each row's prompt length (the decoding loop's prefill does), which the
  # length-dependent rotary scalings read; greedy decoding then continues past it.
  prefill = jax.jit(lambda p, t, c: forward(p, t, c, m.cfg, seq_lengths=jnp.full((1,), LONG_T)))
  logits = prefill(m.params, jnp.asarray(prompts, jnp.int32), cache)[0]
  np.testing.assert_allclose(np.asarray(logits), ref["logits"], atol=ATOL, rtol=0)
  out = jaxspec.generate(m, [list(prompts[0])], max_new_tokens=8, stop_ids=[])
  np.testing.assert_array_equal(out.tokens, ref["greedy"])



@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_gemma_norm_scales_stay_float32_in_bfloat16(name, cases):
  """Gemma computes its (1 + w) norm scales in float32: a bfloat16 model keeps them so, equal
  to float32(1 + w) exactly, while the matrices are bfloat16."""
  c = cases(name)
  m = load(c.hf, "bfloat16", scan_layers=True)
  hf = _safetensors(c.hf)
  lp = m.params.layers
  assert m.params.embed.dtype == jnp.bfloat16 and lp.wq.dtype == jnp.bfloat16
  for field, hf_name in (("attn_norm", "input_layernorm"),
                         ("post_attn_norm", "post_attention_layernorm"),
                         ("mlp_norm", "pre_feedforward_layernorm"),
                         ("post_mlp_norm", "post_feedforward_layernorm")):
    got = np.asarray(getattr(lp, field))
    assert got.dtype == np.float32, field
    want = np.stack([hf[f"model.layers.{i}.{hf_name}.weight"] for i in range(m.cfg.num_layers)])
    np.testing.assert_array_equal(got, want.astype(np.float32) + np.float32(1), err_msg=field)
  assert m.params.final_norm.dtype == jnp.float32
  assert jaxspec.generate(m, [list(PROMPTS[0])], max_new_tokens=4, stop_ids=[]).lengths[0] == 4


def test_gemma3_multimodal_checkpoint_runs_its_text_decoder(cases, workdir):
  """Gemma 3 4B and larger ship as Gemma3ForConditionalGeneration (a vision tower beside the
  decoder, tensors under language_model.): jaxspec runs the text decoder alone, with the same
  logits as transformers' multimodal model on text."""
  import torch
  import transformers as T
  c = cases("gemma3")
  text = T.AutoModelForCausalLM.from_pretrained(c.hf, dtype=torch.float32)
  unused = [i for i in range(3, F.VOCAB) if i not in set(PROMPTS.ravel().tolist())][:3]
  vision = T.SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
  config = T.Gemma3Config(text_config=text.config.to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, image_token_index=unused[0],
                          boi_token_index=unused[1], eoi_token_index=unused[2])
  mm = T.Gemma3ForConditionalGeneration(config).eval()
  mm.model.language_model.load_state_dict(text.model.state_dict())
  path = workdir / "gemma3-multimodal"
  mm.save_pretrained(path)
  with torch.no_grad():
    ref = mm(input_ids=torch.as_tensor(PROMPTS)).logits.float().numpy()
  np.testing.assert_allclose(ref, c.ref["logits"], atol=ATOL, rtol=0)  # HF agrees with itself
  m = load(path, "float32", scan_layers=True)
  assert m.cfg == load(c.hf, "float32", scan_layers=True).cfg
  logits = forward_jit(m.params, jnp.asarray(PROMPTS, jnp.int32), init_cache(m.cfg, B, MAX_LEN),
                       m.cfg)[0]
  np.testing.assert_allclose(np.asarray(logits), ref, atol=ATOL, rtol=0)
