"""Helpers the test modules share (fixtures live in conftest.py): the repository's paths, a tiny
checkpoint written as llama.cpp writes it, exact sampled distributions and their chi-square test,
the family switches the decoding tests run on, the tree forward's check against plain forwards,
and the fused "auto" loop run with k forced. Imported as `helpers` from every folder
(pyproject.toml puts tests/ on the path); test modules import nothing from each other."""

from __future__ import annotations

import dataclasses
import itertools
import math
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import tree as tree_lib
from jaxspec.decoding.adaptive import AutoK, CostModel
from jaxspec.models import RopeScaling, forward, init_cache, init_params, tiny_config
from jaxspec.models.hf_loader import params_to_hf
from jaxspec.sampling import Sampling, probs
from jaxspec.decoding.tree import Tree

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"
REFERENCE = SHARED / "reference" / "smollm2_hf_reference.npz"
T = gguf.GGMLQuantizationType


def shared_or_skip(path: Path) -> Path:
  if not path.exists():
    pytest.skip(f"{path} is absent (../shared is only present in CI and the dev checkout)")
  return path


# -- checkpoints ----------------------------------------------------------------------------------


def assert_params_equal(a, b, atol=0.0):
  la, tree_a = jax.tree_util.tree_flatten(a)
  lb, tree_b = jax.tree_util.tree_flatten(b)
  assert tree_a == tree_b
  for x, y in zip(la, lb):
    assert x.shape == y.shape and x.dtype == y.dtype
    np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), atol=atol,
                               rtol=0)



def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character map used by byte-level BPE vocabularies."""
  bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
      range(ord("®"), ord("ÿ") + 1))
  cs = bs[:]
  n = 0
  for b in range(256):
    if b not in bs:
      bs.append(b)
      cs.append(256 + n)
      n += 1
  return dict(zip(bs, map(chr, cs)))


TINY_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_MERGES = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w"), ("o", "r")]
TINY_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
  """(tokens, token types, merges) of a tiny byte-level BPE vocabulary (262 + merges)."""
  tokens = TINY_SPECIAL + [_bytes_to_unicode()[b] for b in range(256)]
  tokens += ["".join(m) for m in TINY_MERGES]
  types = [3] * len(TINY_SPECIAL) + [1] * (len(tokens) - len(TINY_SPECIAL))
  return tokens, types, [" ".join(m) for m in TINY_MERGES]


def _permute(w, n_head):
  """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute."""
  return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
      w.shape)


# ggml type of each tensor in the tiny GGUF: covers every type with jaxspec's own kernel (the
# types decoded by gguf.quants are in tests/models/test_kquants.py).
TINY_TYPES = {"token_embd": "Q8_0", "output": "F16", "attn_q": "F16", "attn_k": "Q8_0",
              "attn_v": "Q4_1", "attn_output": "Q4_0", "ffn_gate": "BF16", "ffn_up": "Q8_0",
              "ffn_down": "F32", "norm": "F32", "bias": "F32"}


def add_tiny_tokenizer(w, vocab_size: int) -> None:
  """The tiny byte-level BPE tokenizer and chat template, as GGUF metadata of writer `w`."""
  tokens, token_types, merges = tiny_vocab()
  assert len(tokens) <= vocab_size
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  w.add_token_list(tokens)
  w.add_token_types(token_types)
  w.add_token_merges(merges)
  w.add_bos_token_id(1)
  w.add_eos_token_id(2)
  w.add_add_bos_token(False)
  w.add_chat_template(TINY_TEMPLATE)


def write_tiny_gguf(path, cfg, params, *, arch="llama", types=None, rope_factors=None,
                    tokenizer=True):
  """Writes `params` as llama.cpp would; returns the HF-named tensors as dequantized."""
  types = {**TINY_TYPES, **(types or {})}
  hf = params_to_hf(params, cfg)
  w = gguf.GGUFWriter(str(path), arch)
  w.add_name("tiny")
  w.add_block_count(cfg.num_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_rope_dimension_count(cfg.head_dim)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  if tokenizer:
    add_tiny_tokenizer(w, cfg.vocab_size)
  expected = {}

  def add(gguf_name, hf_name, kind, n_head=None):
    x = hf[hf_name]
    if n_head is not None and arch == "llama":
      x = _permute(x, n_head)
    q = gguf.quants.quantize(np.ascontiguousarray(x, np.float32), T[types[kind]])
    w.add_tensor(gguf_name, q, raw_dtype=T[types[kind]])
    # Quantization works on blocks within a row, so dequantizing the permuted rows and undoing
    # the permutation equals quantizing the original: compare against that, permutation-free.
    expected[hf_name] = gguf.quants.dequantize(
        gguf.quants.quantize(np.ascontiguousarray(hf[hf_name], np.float32), T[types[kind]]),
        T[types[kind]]).reshape(hf[hf_name].shape)

  add("token_embd.weight", "model.embed_tokens.weight", "token_embd")
  add("output_norm.weight", "model.norm.weight", "norm")
  if not cfg.tie_embeddings:
    add("output.weight", "lm_head.weight", "output")
  if rope_factors is not None:
    w.add_tensor("rope_freqs.weight", np.asarray(rope_factors, np.float32))
  for i in range(cfg.num_layers):
    p, b = f"model.layers.{i}.", f"blk.{i}."
    add(b + "attn_norm.weight", p + "input_layernorm.weight", "norm")
    add(b + "attn_q.weight", p + "self_attn.q_proj.weight", "attn_q", cfg.num_heads)
    add(b + "attn_k.weight", p + "self_attn.k_proj.weight", "attn_k", cfg.num_kv_heads)
    add(b + "attn_v.weight", p + "self_attn.v_proj.weight", "attn_v")
    add(b + "attn_output.weight", p + "self_attn.o_proj.weight", "attn_output")
    if cfg.attention_bias:
      add(b + "attn_q.bias", p + "self_attn.q_proj.bias", "bias", cfg.num_heads)
      add(b + "attn_k.bias", p + "self_attn.k_proj.bias", "bias", cfg.num_kv_heads)
      add(b + "attn_v.bias", p + "self_attn.v_proj.bias", "bias")
    add(b + "ffn_norm.weight", p + "post_attention_layernorm.weight", "norm")
    add(b + "ffn_gate.weight", p + "mlp.gate_proj.weight", "ffn_gate")
    add(b + "ffn_up.weight", p + "mlp.up_proj.weight", "ffn_up")
    add(b + "ffn_down.weight", p + "mlp.down_proj.weight", "ffn_down")
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return expected


def tiny_checkpoint(arch="llama", **overrides):
  cfg = tiny_config(vocab_size=272, architecture=arch, bos_token_id=1, eos_token_ids=(2,),
                    rms_norm_eps=1e-5, **overrides)
  params = init_params(cfg, jax.random.key(0), scale=0.1)
  # Non-trivial norms, so a norm read from the wrong tensor cannot pass.
  layers = dataclasses.replace(
      params.layers, attn_norm=1 + 0.1 * jax.random.normal(jax.random.key(1), (2, 64)),
      mlp_norm=1 + 0.1 * jax.random.normal(jax.random.key(2), (2, 64)))
  return cfg, dataclasses.replace(params, layers=layers)


# -- exact sampling -------------------------------------------------------------------------------


def chi2_critical(df, z=3.719):
  """Wilson-Hilferty approximation of the chi-square quantile; z = 3.719 is the 1e-4 tail."""
  return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def exact_joint(target, prompt, sp):
  """P(t1, t2, t3) = p(t1) p(t2 | t1) p(t3 | t1 t2) [V, V, V] under the processed target
  distribution. The first token comes from the prefill; t2 and t3 are the first verify pass's
  two draft positions."""
  v = target.cfg.vocab_size
  seqs = jnp.array([prompt + [a, c] for a in range(v) for c in range(v)])
  lg, _, _ = forward(target.params, seqs, init_cache(target.cfg, v * v, 16), target.cfg)
  arr = sp.arrays(v * v)
  p1 = np.asarray(probs(lg[:1, -3], sampling_arrays_row(arr, 1)))[0]
  p2 = np.asarray(probs(lg[::v, -2], sampling_arrays_row(arr, v)))  # [a, t2]
  p3 = np.asarray(probs(lg[:, -1], arr)).reshape(v, v, v)  # [a, c, t3]
  return p1[:, None, None] * p2[:, :, None] * p3


def exact_tables(target, prompt, sp):
  """The target's conditionals after the prompt: [V] p(t1), [V, V] p(t2 | t1), [V, V, V]
  p(t3 | t1 t2), [V]*4 p(t4 | t1..t3) and [V]*5 p(t5 | t1..t4)."""
  v = target.cfg.vocab_size
  seqs = np.array([list(prompt) + list(t) for t in itertools.product(range(v), repeat=4)])
  n = seqs.shape[0]
  lg, _, _ = forward(target.params, jnp.asarray(seqs, jnp.int32),
                     init_cache(target.cfg, n, seqs.shape[1]), target.cfg)
  arr = sp.arrays(n)
  p = np.asarray(jax.vmap(lambda x: probs(x, arr), in_axes=1, out_axes=1)(lg), np.float64)
  p = p.reshape((v,) * 4 + p.shape[1:])  # [t1, t2, t3, t4, position, V]
  lp = len(prompt)
  return (p[0, 0, 0, 0, lp - 1], p[:, 0, 0, 0, lp], p[:, :, 0, 0, lp + 1],
          p[:, :, :, 0, lp + 2], p[:, :, :, :, lp + 3])


def padded(prompts, width=16):
  """Prompts (lists of ids) right-padded with 0 to `width`: (ids [B, width], lengths [B])."""
  ids = np.zeros((len(prompts), width), np.int32)
  for i, p in enumerate(prompts):
    ids[i, :len(p)] = p
  return jnp.asarray(ids), jnp.asarray([len(p) for p in prompts], jnp.int32)


_forward_jit = jax.jit(forward, static_argnums=3)


def padded_logits(params, cfg, seqs, cache_len=None) -> jax.Array:
  """Logits [B, W, V] of one forward over `seqs` (lists of ids of any lengths) right-padded with
  0 to the longest, W (`padded`), into a cache of `cache_len` positions (default W). The forward
  is causal, so a row's logits at its real positions do not see its padding: one jitted program
  where a forward per row would run op by op at every length."""
  width = max(map(len, seqs))
  ids, _ = padded(seqs, width)
  return _forward_jit(params, ids, init_cache(cfg, len(seqs), cache_len or width), cfg)[0]


def suffix_sampling_case(target):
  """The suffix drafters' later-position sampling case: two rows of the prompt 1 2 3 4 (row 1
  drafts from row 0), a corpus of 12 earlier samples drawn exactly, the sampling settings, their
  `exact_tables` and the drafter options every variant shares. Returns (sp, tables, corpus, ids,
  lens, options)."""
  from jaxspec.drafters import corpus_from
  from jaxspec.sampling import Sampling
  v = target.cfg.vocab_size
  sp = Sampling(temperature=0.9, top_k=6, top_p=0.95)
  prompt = [1, 2, 3, 4]
  tables = exact_tables(target, prompt, sp)
  corpus = corpus_from(sample_continuations(prompt, tables, 12), v, 96)
  ids, lens = padded([prompt, prompt], 4)
  options = dict(vocab=v, corpus_size=96, max_match=4, min_prob=0.0, spec_offset=2)
  return sp, tables, corpus, ids, lens, options


def sample_continuations(prompt, tables, n, seed=0):
  """n sequences prompt + t1..t5, each t drawn from `exact_tables`' conditionals (a corpus of
  earlier samples for the drafters that read one)."""
  p1, *rest = tables
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    t = [rng.choice(p1.shape[0], p=p1 / p1.sum())]
    for table in rest:
      q = table[tuple(t)]
      t.append(rng.choice(q.shape[0], p=q / q.sum()))
    out.append(list(prompt) + [int(x) for x in t])
  return out


def assert_tokens_4_5_follow(tokens, tables):
  """Chi-square of the 4th and 5th new tokens [n, 2] against their exact joint, P(t4, t5) = the
  sum over t1..t3 of the chain of `exact_tables`' conditionals."""
  p1, p2, p3, p4, p5 = tables
  joint = np.einsum("a,ab,abc,abcd,abcde->de", p1, p2, p3, p4, p5)  # [V, V] of (t4, t5)
  assert abs(joint.sum() - 1) < 1e-4
  assert_first_tokens_follow(np.asarray(tokens), joint, what="the target's support")


def sampling_arrays_row(arr, n):
  return jax.tree.map(lambda x: x[:n], arr)


def assert_first_tokens_follow(tokens, joint, what="top-k/top-p"):
  """Chi-square of the rows' tokens [n, m] (the first m, or any m positions the joint is of)
  against the exact joint [V] * m at the 1e-4 tail; cells with expectations under 5 are pooled into one, and tokens of zero probability
  fail."""
  v, m = joint.shape[0], joint.ndim
  assert tokens.shape[1] == m, (tokens.shape, joint.shape)
  joint = joint.reshape(-1)
  n = tokens.shape[0]
  cell = np.zeros(n, np.int64)
  for j in range(m):
    cell = cell * v + tokens[:, j]
  obs = np.bincount(cell, minlength=v ** m)
  assert obs[joint == 0].sum() == 0, f"a token outside {what} was emitted"
  keep = joint * n >= 5
  o = np.append(obs[keep], obs[~keep].sum()).astype(np.float64)
  exp = np.append(joint[keep] * n, joint[~keep].sum() * n)
  if exp[-1] < 5:
    o, exp = o[:-1], exp[:-1]
  chi2 = float(((o - exp) ** 2 / exp).sum())
  assert chi2 < chi2_critical(len(exp) - 1), (chi2, len(exp))


# -- the family switches the decoding tests run on ------------------------------------------------


ORIGINAL = 12  # the length-dependent scalings' original context: generation crosses it

FAMILIES = {
    # Gemma 3: GeGLU, (1 + w) norms held as scales, embedding scaling, sandwich norms, q/k
    # norms, two sliding layers then a global one with its own rotary base and linear scaling.
    "gemma3": dict(hidden_act="gelu_tanh", norm_offset=1.0, embed_scale=True, post_norms=True,
                   qk_norm=True, sliding_window=4, layer_types=("sliding", "sliding", "full"),
                   num_layers=3, rope_theta=1e6, sliding_rope_theta=1e4,
                   query_pre_attn_scalar=24.0,
                   rope_scaling=RopeScaling(rope_type="linear", factor=4.0)),
    # Gemma 2: soft-capped attention scores and logits, alternating windows.
    "gemma2": dict(hidden_act="gelu_tanh", norm_offset=1.0, embed_scale=True, post_norms=True,
                   attn_softcap=5.0, final_softcap=3.0, sliding_window=5,
                   layer_types=("sliding", "full")),
    # Phi-4-mini: partial rotary with LongRoPE (short factors, then long past ORIGINAL).
    "phi4": dict(partial_rotary_factor=0.75, rope_scaling=RopeScaling(
        rope_type="longrope", factor=4.0, original_max_position_embeddings=ORIGINAL,
        attention_factor=1.2, short_factor=(1.0, 1.3, 1.7, 2.0, 2.5, 3.0),
        long_factor=(1.0, 2.0, 4.0, 8.0, 12.0, 16.0))),
    # A Llama with dynamic NTK crossing its original context (the static scalings, YaRN and
    # linear, change frequencies only; linear runs in "gemma3").
    "llama-dynamic": dict(rope_scaling=RopeScaling(
        rope_type="dynamic", factor=2.0, original_max_position_embeddings=ORIGINAL)),
}


# -- trees ----------------------------------------------------------------------------------------


PATHS = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]


def assert_tree_forward_matches_plain_forward(model):
  """Every node's probabilities from `tree_lib.verify_tree` on `PATHS` equal those of a plain
  causal forward of `model` over prompt + the node's path, with rows of different cached
  lengths."""
  cfg = model.cfg
  tree = Tree.from_paths(PATHS)
  parents, depths, _ = tree.arrays()
  rng = np.random.default_rng(0)
  prompts = [[3, 4, 5, 6, 7, 8], [9, 10, 11]]
  b, n = len(prompts), tree.num_nodes
  tokens = rng.integers(0, cfg.vocab_size, (b, n)).astype(np.int32)
  pw = max(map(len, prompts))
  cache = init_cache(cfg, b, 32)
  prompt = np.zeros((b, pw), np.int32)
  for i, p in enumerate(prompts):
    prompt[i, :len(p)] = p
  _, _, cache = forward(model.params, jnp.asarray(prompt), cache, cfg)
  cache = dataclasses.replace(cache, length=jnp.asarray([len(p) for p in prompts], jnp.int32))
  bc = lambda a: jnp.broadcast_to(jnp.asarray(a), (b, n))
  sp = Sampling(temperature=1.0).arrays(b)
  p_tree, _, _ = tree_lib.verify_tree(model.params, cache, jnp.asarray(tokens), bc(parents),
                                      bc(depths), cfg, sp, max_depth=tree.depth)
  # Every node's path as one right-padded batch (causal: the padding after it is never read).
  seqs, ends = [], []
  for i, pr in enumerate(prompts):
    for j in range(n):
      path, node = [], j
      while node >= 0:
        path.append(int(tokens[i, node]))
        node = int(parents[node])
      seqs.append(pr + path[::-1])
      ends.append(len(seqs[-1]) - 1)
  width = max(map(len, seqs))
  batch = jnp.asarray([q + [0] * (width - len(q)) for q in seqs], jnp.int32)
  lg, _, _ = forward(model.params, batch, init_cache(cfg, len(seqs), width), cfg)
  want = jax.nn.softmax(lg[jnp.arange(len(seqs)), jnp.asarray(ends)], axis=-1).reshape(b, n, -1)
  np.testing.assert_allclose(np.asarray(p_tree), np.asarray(want), atol=1e-5)


# -- "auto" with k forced -------------------------------------------------------------------------


# Verify cost growing with k as on a CPU, plus a per-token draft cost: the formula's c and v(k).
DRAFT_C, VERIFY = 0.02, (lambda k: 1.0 + 0.02 * k + 0.05 * k * k)
CPU_LIKE = CostModel.from_formula(range(9), 0.1, VERIFY)


def forced_run(target, drafter, prompts, schedule, *, n_new, k_max=4, sampling=None, key=0):
  """The fused "auto" loop with k forced: schedule [(k, steps), ...] (the last runs to the end).

  Returns (tokens [B, n_new], statistics)."""
  from jaxspec.decoding import loop
  from jaxspec.engine import DEFAULT, io, runs
  req = io.prepare_spec(target, drafter, prompts, max_new_tokens=n_new, sampling=sampling,
                        num_draft_tokens="auto", auto=AutoK(k_max=k_max), cost=CPU_LIKE,
                        stop_ids=(), key=key)
  run, policy = runs.SpecRun(DEFAULT, req), req.policy
  s = run.start()  # the prefill (the cost model is given: nothing is timed)
  passes = 0
  for i, (k, steps) in enumerate(schedule):
    passes = 10 * n_new if i == len(schedule) - 1 else passes + steps
    s = run.loop_exe(run.tparams, run.dparams, s, run.sp, run.costs, jnp.int32(passes),
                     jnp.int32(policy.buckets.index(k)), run.budget)
  tokens = loop.outputs_jit(s, n_new)[0]
  return np.asarray(tokens), run.stats(s.stats)
