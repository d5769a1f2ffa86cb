"""Loading straight onto a mesh, the checkpoint's dtype by default, and draft/target vocabularies.

`jaxspec.load(path, mesh=...)` must hand every device only its shard of each weight, read from
the checkpoint one tensor at a time: the tests watch `jax.make_array_from_callback` (every
slice it receives is one device's shard), forbid `jax.device_put` during the load (the old path
staged each full weight on one device), compare each parameter's sharding with the rules', and
bound the host's peak allocation (tracemalloc sees numpy's buffers) by a few single tensors,
well under the whole model in float32.
"""

from __future__ import annotations

import dataclasses
import gc
import tracemalloc

import jax
import numpy as np
import pytest
import tokenizers

import jaxspec
from jaxspec.drafters import DraftModel
from jaxspec.models import init_params, tiny_config
from jaxspec.models.errors import LayoutError
from jaxspec.models.hf_loader import save_hf
from jaxspec.models.llama import input_major
from jaxspec.models.model import Model
from jaxspec.models.tokenizer import Tokenizer
from jaxspec.sharding import rules as sharding_rules
from jaxspec.sharding.rules import make_mesh, param_shardings
from helpers import write_tiny_gguf

# Sixteen layers, so the whole model in float32 (64 MB) is many times one layer (3.9 MB) or the
# largest tensor (the 256 x 1024 MLP matrices, 1 MB), and far above the Python objects that a
# load allocates besides (a few MB in a busy test process, which tracemalloc counts too).
CFG = tiny_config(vocab_size=512, hidden_size=256, intermediate_size=1024, num_layers=16,
                  num_heads=8, num_kv_heads=4, head_dim=32, eos_token_ids=(2,))
MESH_SHAPE = {"data": 2, "model": 4}


def _f32_bytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * 4 for x in jax.tree.leaves(tree))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  params = init_params(CFG, jax.random.key(3), scale=0.1)
  root = tmp_path_factory.mktemp("mesh")
  save_hf((CFG, params), root / "hf", dtype="float32")
  save_hf((CFG, params), root / "hf_bf16", dtype="bfloat16")
  write_tiny_gguf(root / "tiny.gguf", CFG, params, types={k: "F32" for k in (
      "token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
      "ffn_up", "ffn_down", "norm")}, tokenizer=False)
  return root, params


@pytest.mark.parametrize("kind", ["hf", "gguf"])
@pytest.mark.parametrize("scan", [True, False])
def test_load_onto_mesh_places_only_shards(checkpoints, monkeypatch, kind, scan):
  root, _ = checkpoints
  path = root / ("hf" if kind == "hf" else "tiny.gguf")
  mesh = make_mesh(MESH_SHAPE)
  reference = jaxspec.load(path, "float32", scan_layers=scan)

  handed = []  # (global shape, sharding, shape of every slice a device received)
  real = jax.make_array_from_callback

  def watched(shape, sharding, callback, *args, **kwargs):
    def cb(index):
      out = callback(index)
      handed.append((tuple(shape), sharding, tuple(np.shape(out))))
      return out
    return real(shape, sharding, cb, *args, **kwargs)

  def no_device_put(*args, **kwargs):
    raise AssertionError("jax.device_put staged a whole array during a mesh load")

  monkeypatch.setattr(jax, "make_array_from_callback", watched)
  monkeypatch.setattr(jax, "device_put", no_device_put)
  gc.collect()
  tracemalloc.start()
  try:
    model = jaxspec.load(path, "float32", mesh=mesh, scan_layers=scan)
    current, peak = tracemalloc.get_traced_memory()
  finally:
    tracemalloc.stop()
    monkeypatch.undo()

  # Every slice handed to a device is that device's shard, never the full weight of a sharded
  # one; and every parameter ends with the rules' sharding.
  assert handed
  for shape, sharding, got in handed:
    assert got == sharding.shard_shape(shape)
  sharded = [h for h in handed if h[1].shard_shape(h[0]) != h[0]]
  assert len(sharded) >= 7 * CFG.num_layers  # wq, wk, wv, wo, gate, up, down of every layer
  expected = param_shardings(model.params, mesh)
  for (path_, x), want in zip(jax.tree_util.tree_leaves_with_path(model.params),
                              jax.tree.leaves(expected)):
    assert x.sharding.is_equivalent_to(want, x.ndim), jax.tree_util.keystr(path_)
  assert model.scan_layers == scan and model.sharding.mesh == mesh
  for a, b in zip(jax.tree.leaves(model.params),
                  jax.tree.leaves(input_major(reference.params))):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # Host memory: one layer's tensors in float32 at a time (plus the tensor being converted),
  # far below the whole model in float32. On the CPU a "device" array may alias the numpy
  # memory it was made from (zero-copy), so what stays allocated after the load is device
  # memory, bounded by the shards the devices hold; the staging beyond it is bounded by layers.
  layer_bytes = _f32_bytes(jax.tree.map(lambda x: x[0], reference.params.layers)
                           if scan else input_major(reference.params).layers[0])
  whole = _f32_bytes(reference.params)
  shards = sum(s.data.nbytes for x in jax.tree.leaves(model.params) for s in x.addressable_shards)
  assert current < shards + 2**20, (current, shards)
  assert peak - current < 3 * layer_bytes + 2 * 2**20, (peak, current, layer_bytes, whole)
  assert peak - current < whole / 4

  if not scan:
    return
  # The sharded model generates what the single-device one does (float32).
  prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
  want = jaxspec.generate(reference, prompts, max_new_tokens=6, stop_ids=[])
  got = jaxspec.generate(model, prompts, max_new_tokens=6, stop_ids=[])
  np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))


def test_mesh_that_does_not_divide_is_refused_before_reading(checkpoints, monkeypatch):
  root, _ = checkpoints
  mesh = make_mesh({"model": 8})  # 4 key/value heads cannot split 8 ways
  reads = []
  monkeypatch.setattr(sharding_rules.Placer, "put",
                      lambda *a, **k: reads.append(a) or pytest.fail("a weight was placed"))
  for path in (root / "hf", root / "tiny.gguf"):
    with pytest.raises(ValueError, match="does not divide 4 key/value heads") as info:
      jaxspec.load(path, mesh=mesh)
    assert "malformed" not in str(info.value)
  with pytest.raises(LayoutError):
    jaxspec.load(root / "tiny.gguf", mesh=mesh)
  assert not reads


def test_dtype_defaults_to_the_checkpoints(checkpoints):
  root, params = checkpoints
  assert jaxspec.load(root / "hf", scan_layers=True).cfg.dtype == "float32"
  bf16 = jaxspec.load(root / "hf_bf16", scan_layers=True)
  assert bf16.cfg.dtype == "bfloat16"
  assert bf16.params.embed.dtype == jax.numpy.bfloat16
  assert jaxspec.load(root / "tiny.gguf", scan_layers=True).cfg.dtype == "float32"
  # An explicit dtype still wins.
  assert jaxspec.load(root / "hf_bf16", "float32", scan_layers=True).cfg.dtype == "float32"
  mesh = make_mesh(MESH_SHAPE)
  assert jaxspec.load(root / "hf_bf16", mesh=mesh).params.embed.dtype == jax.numpy.bfloat16


def _word_tokenizer(words: list[str]) -> Tokenizer:
  backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(
      {w: i for i, w in enumerate(words)}, unk_token=words[0]))
  return Tokenizer(backend, eos_token=words[2])


def test_draft_model_vocabulary_must_match_the_target(checkpoints):
  _, params = checkpoints
  words = [f"w{i}" for i in range(CFG.vocab_size)]
  target = Model(cfg=CFG, params=params, tokenizer=_word_tokenizer(words), name="target-llama")
  small = dataclasses.replace(CFG, num_layers=1, architecture="qwen3")
  same = Model(cfg=small, params=init_params(small, jax.random.key(4)),
               tokenizer=_word_tokenizer(words), name="draft-qwen3")
  out = jaxspec.speculative_generate(target, DraftModel(same), [[5, 6, 7]], max_new_tokens=4,
                                     num_draft_tokens=2, stop_ids=[])
  assert int(out.lengths[0]) == 4  # a draft of another family with the same tokenizer drafts

  other = dataclasses.replace(small, vocab_size=640)
  wide = Model(cfg=other, params=init_params(other, jax.random.key(5)), name="draft-wide")
  with pytest.raises(ValueError, match=r"draft model draft-wide \(qwen3, vocabulary of 640\) and"
                     r" the target target-llama \(llama, vocabulary of 512\) have different"
                     " vocabularies"):
    jaxspec.speculative_generate(target, DraftModel(wide), [[5, 6, 7]], max_new_tokens=4)

  renamed = words.copy()
  renamed[300] = "elsewhere"
  mixed = dataclasses.replace(same, tokenizer=_word_tokenizer(renamed), name="draft-other")
  with pytest.raises(ValueError, match="different tokenizers: id 300 is 'w300' for the target"
                     " and 'elsewhere' for the draft"):
    jaxspec.speculative_generate(target, DraftModel(mixed), [[5, 6, 7]], max_new_tokens=4)


def test_draft_tokenizer_check_skips_added_and_missing_ids(checkpoints):
  """Releases rename reserved special tokens and llama.cpp pads GGUF vocabularies with
  placeholders: neither makes a draft propose other tokens, so neither is refused."""
  _, params = checkpoints
  words = [f"w{i}" for i in range(CFG.vocab_size)]
  target_tok = _word_tokenizer(words[:500])
  target_tok.backend.add_special_tokens(["<|reserved_a|>"])  # id 500
  draft_tok = _word_tokenizer(words[:500])
  draft_tok.backend.add_special_tokens(["<|eot|>"])  # id 500, renamed
  target = Model(cfg=CFG, params=params, tokenizer=target_tok, name="target")
  small = dataclasses.replace(CFG, num_layers=1)
  draft = Model(cfg=small, params=init_params(small, jax.random.key(4)), tokenizer=draft_tok,
                name="draft")
  out = jaxspec.speculative_generate(target, DraftModel(draft), [[5, 6, 7]], max_new_tokens=3,
                                     num_draft_tokens=2, stop_ids=[])
  assert int(out.lengths[0]) == 3
