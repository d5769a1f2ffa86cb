"""Ring buffers for sliding-window layers (`jaxspec.models.llama.init_cache`, `write_cache`).

A sliding layer keeps window + slack slots instead of max_len positions, position p in slot
p mod W, and attention masks by the position each slot holds. Shown here: the layout and its
bytes (a Gemma-3-shaped model at 32k), writes that wrap the ring and prefills longer than it
(right-padded rows keep their own last W positions), the forward over a ring equal to the
forward over the full cache (whole and blocked reads, stacked and unrolled layers, small
slacks), greedy speculative decoding equal to plain decoding for every kind of drafter with
prompts longer than the ring, the memory estimate counting the ring, and the engine's kept
buffers. The Hugging Face parity past the window is in `tests/models/test_families.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec import heads
from jaxspec.decoding import protocol
from jaxspec.decoding.adaptive import MAX_K
from jaxspec.decoding.functional import decode, speculative_decode, working_set
from jaxspec.decoding.tree import MAX_NODES
from jaxspec.drafters import DraftModel, NGram, SuffixDecoding, self_drafter
from jaxspec.models import init_params, llama, tiny_config
from jaxspec.models.llama import (RING_SLACK, KVCache, LlamaLM, forward, init_cache, ring_size,
                                  write_cache)
from jaxspec.models.model import Model
from helpers import FAMILIES, PATHS

# Gemma 3's pattern in small: two sliding layers (window 4) and a global one.
GEMMA3 = dict(architecture="gemma3", **FAMILIES["gemma3"])


def _cfg(**kw):
  return tiny_config(**{**GEMMA3, "max_position_embeddings": 4096, **kw})


def test_layout_and_bytes_of_a_gemma3_shaped_model_at_32k():
  """Five sliding layers to one global (Gemma 3 4B's 34 layers, window 1024): the sliding
  layers hold window + RING_SLACK slots, the global ones max_len; bytes as computed by hand."""
  types = tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(34))
  cfg = tiny_config(num_layers=34, num_heads=8, num_kv_heads=4, head_dim=256,
                    sliding_window=1024, layer_types=types, max_position_embeddings=32768)
  b, s = 1, 32768
  ring = jax.eval_shape(lambda: init_cache(cfg, b, s))
  full = jax.eval_shape(lambda: init_cache(cfg, b, s, ring_slack=None))
  n_full, n_ring = types.count("full"), types.count("sliding")
  assert (n_full, n_ring) == (5, 29)
  assert ring.ring_layers == tuple(i for i, t in enumerate(types) if t == "sliding")
  assert ring.k.shape == (n_full, b, 4, s, 256) and ring.max_len == s
  assert ring.k_ring.shape == (n_ring, b, 4, 1024 + RING_SLACK, 256)
  nbytes = lambda c: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(c))
  per_slot = 2 * b * 4 * 256 * 4  # k and v, float32
  assert nbytes(full) == 34 * s * per_slot + 4 * b
  assert nbytes(ring) == (n_full * s + n_ring * (1024 + RING_SLACK)) * per_slot + 4 * b
  assert nbytes(full) / nbytes(ring) > 5.3  # 34 / (5 + 29 * 1312 / 32768) = 5.4
  # The decoding call's memory estimate counts the smaller cache.
  lm = LlamaLM(cfg)
  params = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))
  est = working_set(lm, params, b, 16, s, verify_tokens=5, state_bytes=0)
  est_full = working_set(LlamaLM(cfg, ring_slack=None), params, b, 16, s, verify_tokens=5,
                         state_bytes=0)
  assert (est.cache, est_full.cache) == (nbytes(ring), nbytes(full))


def test_ring_only_where_smaller():
  cfg = _cfg()
  assert ring_size(cfg, 4 + RING_SLACK) is None  # the ring would not be smaller
  assert ring_size(cfg, 5 + RING_SLACK) == 4 + RING_SLACK
  assert ring_size(cfg, 100, slack=None) is None
  assert ring_size(tiny_config(), 10_000) is None  # no sliding layer
  assert init_cache(cfg, 2, 64).k_ring is None
  c = init_cache(cfg, 2, 64, ring_slack=8)
  assert (c.ring_layers, c.k.shape[0], c.k_ring.shape, c.ring_len) == ((0, 1), 1,
                                                                        (2, 2, 2, 12, 16), 12)
  assert [c.slot(i) for i in range(3)] == [(True, 0), (True, 1), (False, 0)]
  # Every layer slides (Mistral): the full stack is empty and keeps max_len in its shape.
  m = init_cache(tiny_config(sliding_window=4), 2, 64, ring_slack=8)
  assert m.k.shape == (0, 2, 2, 64, 16) and m.max_len == 64 and m.ring_layers == (0, 1)
  with pytest.raises(ValueError, match="ring_slack"):
    init_cache(cfg, 2, 64, ring_slack=0)


def test_slack_covers_the_widest_write():
  """The default slack covers the loop's widest write past a row's kept length: a verify of
  k + 1 tokens (k <= MAX_K) or a tree of MAX_NODES nodes, and a draft model's k + 1."""
  assert RING_SLACK >= max(MAX_K + 1, MAX_NODES)


def _held(cache: KVCache, layer_in_ring: int):
  """The ring's slots as a dict row -> {position: key vector} of the positions they hold."""
  out = []
  w = cache.ring_len
  for b, n in enumerate(np.asarray(cache.length)):
    slots = {}
    for s in range(w):
      p = n - 1 - ((n - 1 - s) % w)
      if p >= 0:
        slots[int(p)] = np.asarray(cache.k_ring[layer_in_ring, b, :, s])
    out.append(slots)
  return out


@pytest.mark.parametrize("batch", [2, 65], ids=["per-row", "scatter"])
def test_writes_wrap_the_ring(batch):
  """Writes of T <= W tokens wrap the ring's end; a write of more than W tokens (a long
  prompt) keeps each row's last W positions before its valid end, not the padding's."""
  cfg = _cfg()
  w = 4 + 8
  cache = init_cache(cfg, batch, 200, ring_slack=8)
  rng = np.random.default_rng(0)
  new = lambda t: jnp.asarray(rng.normal(size=(3, batch, t, 2, 16)), jnp.float32)
  truth = [dict() for _ in range(batch)]  # row -> position -> key of layer 0

  def write(c, t, start, end=None):
    kn = new(t)
    c = write_cache(c, kn, kn, positions_start=start, valid_end=end)
    for b in range(batch):
      e = int(start[b]) + t if end is None else int(end[b])
      for p in range(int(start[b]), e):
        truth[b][p] = np.asarray(kn[0, b, p - int(start[b])])
    return c

  # A prompt of 30 tokens (> W) whose rows end at 30, 17 (padding after) and 5.
  ends = jnp.asarray(([30, 17, 5] * batch)[:batch], jnp.int32)
  cache = write(cache, 30, jnp.zeros((batch,), jnp.int32), ends)
  cache = dataclasses.replace(cache, length=ends)
  for t in (5, 1, 12, 7, 3):  # widths up to W, each starting where the last left off
    cache = write(cache, t, cache.length)
  for b, held in enumerate(_held(cache, 0)):
    n = int(cache.length[b])
    assert sorted(held) == list(range(max(0, n - w), n))
    for p, key in held.items():
      np.testing.assert_array_equal(key, truth[b][p])


def _forward_steps(cfg, params, prompts, lens, n_steps, width, slack, scan):
  """Logits of a prefill and then `n_steps` forwards of `width` tokens each, every row rolled
  back to keep one token less than it wrote (a rejected draft), on a cache of 200 positions."""
  p = llama.with_scan_layers(params, scan)
  cache = init_cache(cfg, prompts.shape[0], 200, ring_slack=slack)
  f = jax.jit(lambda p, t, c, fresh, n: forward(p, t, c, cfg, fresh=fresh, seq_lengths=n),
              static_argnames="fresh")
  logits, _, cache = f(p, prompts, cache, True, lens)
  cache = dataclasses.replace(cache, length=lens)
  out = [np.asarray(logits[jnp.arange(len(lens)), lens - 1])]
  rng = np.random.default_rng(1)
  for _ in range(n_steps):
    toks = jnp.asarray(rng.integers(3, cfg.vocab_size, (prompts.shape[0], width)), jnp.int32)
    logits, _, cache = f(p, toks, cache, False, None)
    cache = dataclasses.replace(cache, length=cache.length - (width > 1))
    out.append(np.asarray(logits))
  return out


# Each layout and each read of the ring by default (stacked layers read block by block, unrolled
# layers read whole); the other two pairings under -m slow.
@pytest.mark.parametrize("scan,block", [
    pytest.param(True, 8, id="stacked-blocked"), pytest.param(False, None, id="unrolled-whole"),
    pytest.param(True, None, id="stacked-whole", marks=pytest.mark.slow),
    pytest.param(False, 8, id="unrolled-blocked", marks=pytest.mark.slow)])
def test_forward_over_the_ring_equals_the_full_cache(scan, block, monkeypatch):
  """Right-padded prompts longer than the ring, then verify-like writes of 3 tokens rolled
  back by one: the same logits as over the full cache, at the smallest slack the writes need
  (3) and at a larger one; the ring read whole (W <= ATTENTION_BLOCK) and block by block."""
  if block is not None:
    monkeypatch.setattr(llama, "ATTENTION_BLOCK", block)
  cfg = _cfg()
  params = init_params(cfg, jax.random.key(3), scale=0.3)
  prompts = jnp.asarray(np.random.default_rng(2).integers(3, 128, (3, 40)), jnp.int32)
  lens = jnp.asarray([40, 23, 9], jnp.int32)
  want = _forward_steps(cfg, params, prompts, lens, 20, 3, None, scan)
  for slack in (3, 21):
    got = _forward_steps(cfg, params, prompts, lens, 20, 3, slack, scan)
    for i, (a, b) in enumerate(zip(got, want)):
      np.testing.assert_allclose(a, b, atol=2e-5, rtol=0, err_msg=f"slack {slack} step {i}")


def test_ring_slack_too_small_is_wrong():
  """The slack is what keeps rolled-back writes away from the window: writes of 8 tokens
  rolled back by 7 over a ring with slack 1 overwrite positions the window still reads (so
  the test above can fail)."""
  cfg = _cfg()
  params = init_params(cfg, jax.random.key(3), scale=0.3)
  prompts = jnp.asarray(np.random.default_rng(2).integers(3, 128, (3, 40)), jnp.int32)
  lens = jnp.asarray([40, 23, 9], jnp.int32)

  # One program per slack (op by op, every forward's primitives were dispatched one at a time).
  @functools.partial(jax.jit, static_argnums=1)
  def run(p, slack):
    cache = init_cache(cfg, 3, 200, ring_slack=slack)
    _, _, cache = forward(p, prompts, cache, cfg, fresh=True, seq_lengths=lens)
    cache = dataclasses.replace(cache, length=lens)
    out = []
    for _ in range(4):
      toks = jnp.full((3, 8), 5, jnp.int32)
      logits, _, cache = forward(p, toks, cache, cfg)
      cache = dataclasses.replace(cache, length=cache.length - 7)
      out.append(logits)
    return jnp.stack(out)

  p = llama.with_scan_layers(params, True)
  full = np.asarray(run(p, None))
  assert np.abs(np.asarray(run(p, 1)) - full).max() > 1e-3
  np.testing.assert_allclose(run(p, 8), full, atol=2e-5, rtol=0)


# -- the decoding loop: greedy speculative == plain, prompts longer than the ring -------------

N_NEW = 24
LONG = RING_SLACK + 20  # prompts longer than the default ring (window 4 + RING_SLACK)


def _prompts(lengths, seed=0):
  rng = np.random.default_rng(seed)
  # Repeating phrases, so n-gram and suffix drafts are accepted (the rollback path runs).
  phrase = rng.integers(3, 100, 11)
  rows = [np.resize(phrase, n) for n in lengths]
  ids = np.zeros((len(rows), max(lengths)), np.int32)
  for i, r in enumerate(rows):
    ids[i, :len(r)] = r
  return jnp.asarray(ids), jnp.asarray(lengths, jnp.int32)


@pytest.fixture(scope="module")
def gemma3():
  cfg = _cfg()
  return Model(cfg=cfg, params=init_params(cfg, jax.random.key(7), scale=0.2), name="gemma3")


@pytest.fixture(scope="module")
def long_plain(gemma3):
  ids, lens = _prompts([LONG, LONG - 30, 7])
  key = jax.random.key(0)
  out = decode(gemma3, ids, lens, key, max_new_tokens=N_NEW, stop_ids=())
  full = decode(protocol.Target(LlamaLM(gemma3.cfg, ring_slack=None), gemma3.params), ids,
                lens, key, max_new_tokens=N_NEW, stop_ids=())
  # The ring's plain decoding is the full cache's (the loop's max_len exceeds the ring here).
  assert ring_size(gemma3.cfg, LONG + N_NEW) is not None
  np.testing.assert_array_equal(out.tokens, full.tokens)
  assert len(set(np.asarray(out.tokens).ravel().tolist())) > 4
  return ids, lens, out


def _drafter(name, model):
  """(drafter, k) of one kind: n-gram, suffix, a draft model with its own ring, the int8 copy,
  Medusa on a tree, MLP speculator, EAGLE."""
  rngs = nnx.Rngs(0)
  if name == "ngram":
    return NGram(max_ngram=3), 4
  if name == "suffix":
    return SuffixDecoding(vocab=model.cfg.vocab_size, corpus_size=128), 4
  if name == "draft-model":  # a sliding layer and a global one: a ring of its own
    small = dataclasses.replace(model.cfg, num_layers=2, layer_types=("sliding", "full"))
    return DraftModel(Model(cfg=small, params=init_params(small, jax.random.key(9),
                                                          scale=0.2))), 3
  if name == "self-draft-int8":
    return self_drafter(model), 3
  if name == "medusa-tree":
    medusa = heads.HEADS["medusa"].create(model.cfg, rngs=rngs, num_heads=3)
    return heads.HEADS["medusa"].drafter(medusa, model).with_tree(PATHS), None
  if name == "mlp":
    mlp = heads.HEADS["mlp"].create(model.cfg, rngs=rngs, n_predict=3)
    return heads.HEADS["mlp"].drafter(mlp, model), 3
  eagle = heads.HEADS["eagle"].create(model.cfg, rngs=rngs, ttt_steps=1)
  return heads.HEADS["eagle"].drafter(eagle, model), 2


# By default the drafters with a cache of their own, whose rings roll back too: the draft model
# and EAGLE. slow: "ngram" and "medusa-tree", whose rollbacks are the target's ring only, which
# test_speculative_equals_plain_at_the_smallest_slack runs for the same two drafters (prompts of
# 40 tokens, longer than that ring, and every rolled-back write wrapping it); "suffix" and "mlp"
# (no cache of their own either); "self-draft-int8", one more draft model with a ring of its own
# ("draft-model" keeps that ring's rollback, tests/models/test_quant.py the int8 copy's greedy
# equality).
@pytest.mark.parametrize("name", [
    pytest.param("ngram", marks=pytest.mark.slow), pytest.param("suffix", marks=pytest.mark.slow),
    "draft-model", pytest.param("self-draft-int8", marks=pytest.mark.slow),
    pytest.param("medusa-tree", marks=pytest.mark.slow),
    pytest.param("mlp", marks=pytest.mark.slow), "eagle"])
def test_speculative_equals_plain_past_the_ring(name, gemma3, long_plain):
  ids, lens, plain = long_plain
  drafter, k = _drafter(name, gemma3)
  kw = {"num_draft_tokens": "auto" if k is None else k}  # a tree sets its own width
  out = speculative_decode(gemma3, drafter, ids, lens, jax.random.key(0), max_new_tokens=N_NEW,
                           stop_ids=(), **kw)
  np.testing.assert_array_equal(out.tokens, plain.tokens, err_msg=name)


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_speculative_equals_plain_at_the_smallest_slack(tree, gemma3):
  """A ring whose slack is exactly the widest write (k + 1, or the tree's nodes + 1 with its
  root): the rolled-back drafts wrap the ring every few steps and never reach a position a
  window still reads."""
  ids, lens = _prompts([40, 23, 9], seed=3)
  if tree:
    drafter, _ = _drafter("medusa-tree", gemma3)
    slack, kw = len(PATHS) + 1, {"num_draft_tokens": "auto"}
  else:
    drafter, slack, kw = NGram(max_ngram=3), 5, {"num_draft_tokens": 4}
  target = protocol.Target(LlamaLM(gemma3.cfg, ring_slack=slack), gemma3.params)
  plain = decode(gemma3, ids, lens, jax.random.key(0), max_new_tokens=40, stop_ids=())
  out = speculative_decode(target, drafter, ids, lens, jax.random.key(0), max_new_tokens=40,
                           stop_ids=(), **kw)
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  if not tree:  # n-gram drafts were accepted (and the rest rolled back)
    assert int(out.stats.accepted.sum()) > 10


def test_engine_buffers_hold_the_full_layers_and_fresh_rings(gemma3, long_plain):
  """The engine keeps a finished call's (k, v) buffers for the next; with rings those are the
  global layers' (the rings, window-sized, come fresh), and the next call equals the first."""
  from jaxspec.engine.core import Engine
  ids, lens, plain = long_plain
  eng = Engine()
  prompts = [list(np.asarray(r[:n])) for r, n in zip(ids, lens)]
  for _ in range(2):  # the second call prefills into the first one's kept buffers
    out = eng.generate(gemma3, prompts, max_new_tokens=N_NEW, stop_ids=())
    np.testing.assert_array_equal(out.tokens, plain.tokens)
  kept = [a for bufs in eng.buffers.values() for a in bufs]
  assert [a.shape[0] for a in kept] == [1, 1]  # the global layer's k and v only
  k, v = eng.take_cache_buffers(gemma3.cfg, 2, LONG + 40)
  assert k.shape == (1, 2, 2, LONG + 40, 16)
  lm = LlamaLM(gemma3.cfg)
  c = lm.cache_from_buffers((k, v), 2)
  assert c.k_ring.shape == (2, 2, 2, 4 + RING_SLACK, 16) and c.ring_layers == (0, 1)
  with pytest.raises(ValueError, match="full-attention layers"):
    lm.cache_from_buffers((jnp.zeros((3, 2, 2, LONG + 40, 16)),) * 2, 2)


def test_sharded_ring_equals_unsharded():
  """On a data x model mesh (8 fake devices) the rings are laid out by the cache's axes
  (`sharding.rules.state_shardings`) and the tokens are the unsharded model's."""
  from jaxspec.api import generate, speculative_generate
  from jaxspec.sharding import make_mesh, shard_model
  cfg = _cfg(num_heads=8, num_kv_heads=4, head_dim=8)
  model = Model(cfg=cfg, params=init_params(cfg, jax.random.key(7), scale=0.2), name="g3")
  ids, lens = _prompts([LONG, LONG - 30], seed=5)
  prompts = [list(np.asarray(r[:n])) for r, n in zip(ids, lens)]
  want = generate(model, prompts, max_new_tokens=16, stop_ids=())
  sharded = shard_model(model, make_mesh({"data": 2, "model": 4}))
  out = speculative_generate(sharded, NGram(max_ngram=3), prompts, max_new_tokens=16,
                             num_draft_tokens=3, stop_ids=())
  np.testing.assert_array_equal(out.tokens, want.tokens)
