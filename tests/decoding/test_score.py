"""`jaxspec.decoding.score` (the loop's log-probabilities of given tokens, teacher-forced, with
gradients), the error that differentiating the loops raises, and `n` samples per prompt with
keys that follow a prompt wherever it sits in the batch."""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.decoding import Target, as_target, decode, join_tokens, score, speculative_decode
from jaxspec.drafters import DraftModel, NGram
from jaxspec.models import forward, init_cache, init_params, tiny_config
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling, row_keys, sample_keys, sampling_arrays
from helpers import FAMILIES

IDS = jnp.asarray([[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12, 0, 0, 0, 0, 0]], jnp.int32)
LENS = jnp.asarray([8, 3], jnp.int32)
N_NEW = 10
FILTERED = Sampling(temperature=[0.7, 1.3], top_k=[20, 0], top_p=[1.0, 0.9], min_p=[0.0, 0.02])


@pytest.fixture(scope="module")
def target(tiny_target):
  return tiny_target


@pytest.fixture(scope="module")
def draft():
  cfg = tiny_config(num_layers=1)
  return Model(cfg, init_params(cfg, jax.random.key(1), scale=0.3), name="score-draft")


def _tiled(x, n):
  return jnp.repeat(x, n, axis=0)


def _scored_continuation(target, out, ids, lens, sampling, width):
  """score of (prompt + the loop's output), read back in the loop's layout [B, width]."""
  tokens, lengths = join_tokens(ids, lens, out.tokens, out.lengths)
  lp = score(target, tokens, lengths, sampling=sampling, prompt_lengths=lens)
  cols = lens[:, None] + jnp.arange(width)[None, :]
  got = jnp.take_along_axis(lp, jnp.minimum(cols, lp.shape[1] - 1), axis=1)
  return np.asarray(jnp.where(jnp.arange(width)[None, :] < out.lengths[:, None], got, 0.0))


# ----------------------------------------------------------------------------------------------
# score equals the loop's log-probabilities


@pytest.mark.parametrize("sampling", [None, FILTERED], ids=["greedy", "sampled-filtered"])
def test_score_equals_the_loops_logprobs(target, draft, sampling):
  sp2 = jax.tree.map(lambda x: _tiled(x, 2), sampling_arrays(sampling, 2))
  ids2, lens2 = _tiled(IDS, 2), _tiled(LENS, 2)
  runs = {
      "decode": decode(target, IDS, LENS, 4, max_new_tokens=N_NEW, sampling=sampling, n=2,
                       stop_ids=()),
      "speculative": speculative_decode(target, DraftModel(draft), IDS, LENS, 4,
                                        max_new_tokens=N_NEW, num_draft_tokens=3,
                                        sampling=sampling, n=2, stop_ids=()),
  }
  for name, out in runs.items():
    assert int(out.lengths.min()) == N_NEW
    got = _scored_continuation(target, out, ids2, lens2, sp2, N_NEW)
    np.testing.assert_allclose(got, np.asarray(out.logprobs), atol=2e-5, err_msg=name)
    assert (got < 0).all()  # every token scored (not a 0 left over)
  if sampling is not None:  # per-row settings differ: the processing is per row
    assert not np.allclose(got, _scored_continuation(target, out, ids2, lens2, None, N_NEW))


@pytest.mark.parametrize("family", ["phi4", "llama-dynamic", "gemma2"])
def test_score_on_families(family):
  """Length-dependent rotary scalings (LongRoPE, dynamic NTK) crossing their original context
  inside the continuation, and soft-capped logits: score still equals the loop."""
  cfg = tiny_config(architecture=family.split("-")[0], **FAMILIES[family])
  model = Model(cfg=cfg, params=init_params(cfg, jax.random.key(7), scale=0.2), name=family)
  # helpers.ORIGINAL = 12: row 0's prompt is past it, row 1 crosses it while decoding.
  ids = jnp.asarray([list(range(3, 17)), [10, 11, 12] + [0] * 11], jnp.int32)
  lens = jnp.asarray([14, 3], jnp.int32)
  sp = Sampling(temperature=0.9, top_k=30)
  out = decode(model, ids, lens, 1, max_new_tokens=N_NEW, sampling=sp)
  got = _scored_continuation(model, out, ids, lens, sp, N_NEW)
  np.testing.assert_allclose(got, np.asarray(out.logprobs), atol=2e-5)


def test_scored_positions_and_the_rest(target):
  """Position t of row b holds log p(tokens[b, t] | tokens[b, :t]) for prompt_lengths[b] <= t <
  lengths[b] and 0 elsewhere; without prompt_lengths every token after the first is scored.
  The reference is a plain forward over each row alone."""
  toks = jnp.asarray([[3, 9, 4, 4, 7, 1, 50, 50], [8, 2, 6, 11, 0, 0, 0, 0]], jnp.int32)
  lengths = jnp.asarray([8, 4], jnp.int32)
  plens = jnp.asarray([3, 2], jnp.int32)
  sp = Sampling(temperature=0.8)
  got = np.asarray(score(target, toks, lengths, sampling=sp, prompt_lengths=plens))
  full = np.asarray(score(target, toks, lengths, sampling=sp))
  for b in range(2):
    n = int(lengths[b])
    logits, _, _ = forward(target.params, toks[b:b + 1, :n],
                           init_cache(target.cfg, 1, n), target.cfg)
    ref = jax.nn.log_softmax(logits[0, :-1] / 0.8, axis=-1)
    ref = np.take_along_axis(np.asarray(ref), np.asarray(toks[b, 1:n])[:, None], 1)[:, 0]
    np.testing.assert_allclose(full[b, 1:n], ref, atol=2e-5)
    np.testing.assert_allclose(got[b, int(plens[b]):n], ref[int(plens[b]) - 1:], atol=2e-5)
    assert (got[b, :int(plens[b])] == 0).all() and (got[b, n:] == 0).all()
    assert full[b, 0] == 0 and (full[b, n:] == 0).all()


@dataclasses.dataclass(frozen=True)
class PlainLM:
  """jaxspec's Llama seen through the bare `CausalLM` protocol (no block interface): the loop
  and score keep its lengths themselves (`LengthCache`)."""

  cfg: object

  @property
  def vocab_size(self):
    return self.cfg.vocab_size

  def init_cache(self, params, batch_size, max_len):
    return init_cache(self.cfg, batch_size, max_len)

  def forward(self, params, tokens, cache, lengths, *, hidden_layers=()):
    logits, _, cache = forward(params, tokens, dataclasses.replace(cache, length=lengths),
                               self.cfg)
    return logits, None, cache


def test_score_of_a_protocol_model_and_its_gradient(target):
  """A model that only meets `CausalLM`: score equals decode's log-probabilities, and its
  gradient equals central finite differences along a random direction (float32)."""
  lm = PlainLM(target.cfg)
  tg = Target(lm, target.params)
  sp = Sampling(temperature=[0.9, 1.2], top_k=[40, 0], top_p=[1.0, 0.95])
  out = decode(tg, IDS, LENS, 2, max_new_tokens=N_NEW, sampling=sp)
  np.testing.assert_allclose(_scored_continuation(tg, out, IDS, LENS, sp, N_NEW),
                             np.asarray(out.logprobs), atol=2e-5)
  tokens, lengths = join_tokens(IDS, LENS, out.tokens, out.lengths)
  filtered = jax.grad(lambda p: score(Target(lm, p), tokens, lengths, sampling=sp,
                                      prompt_lengths=LENS).sum())(target.params)
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(filtered))
  # Finite differences with the temperatures alone: top-k / top-p make the score a step
  # function where a sampled token sits at a filter's edge (a shift of eps can drop it: -inf).
  sp_t = Sampling(temperature=[0.9, 1.2])
  loss = jax.jit(lambda p: score(Target(lm, p), tokens, lengths, sampling=sp_t,
                                 prompt_lengths=LENS).sum())
  g = jax.grad(loss)(target.params)
  leaves = jax.tree.leaves(g)
  assert all(bool(jnp.isfinite(x).all()) for x in leaves)
  assert sum(float(jnp.abs(x).sum()) for x in leaves) > 0
  keys = jax.random.split(jax.random.key(0), len(leaves))
  d = jax.tree.unflatten(jax.tree.structure(g), [jax.random.normal(k, x.shape, x.dtype)
                                                 for k, x in zip(keys, leaves)])
  eps = 1e-3
  shift = lambda s: jax.tree.map(lambda p, v: p + s * eps * v, target.params, d)
  fd = (float(loss(shift(1.0))) - float(loss(shift(-1.0)))) / (2 * eps)
  dot = sum(float(jnp.vdot(a, b)) for a, b in zip(leaves, jax.tree.leaves(d)))
  assert abs(fd - dot) <= 2e-2 * abs(dot), (fd, dot)


# ----------------------------------------------------------------------------------------------
# Differentiating the loop: an error that names score


def test_grad_through_the_loops_names_score(target):
  tg = as_target(target)
  for name, run in (
      ("decode", lambda t: decode(t, IDS, LENS, 0, max_new_tokens=4)),
      ("speculative_decode", lambda t: speculative_decode(t, NGram(), IDS, LENS, 0,
                                                          max_new_tokens=4, num_draft_tokens=2))):
    loss = lambda p: run(Target(tg.lm, p)).logprobs.sum()
    for how in (jax.grad(loss), jax.jit(jax.grad(loss)), jax.grad(jax.jit(loss))):
      with pytest.raises(ValueError, match=f"^{name} cannot be differentiated.*"
                         "jaxspec.decoding.score"):
        how(tg.params)
  # Sampling with the weights held constant, then scoring: the policy-gradient pattern.
  def objective(p):
    out = decode(Target(tg.lm, jax.lax.stop_gradient(p)), IDS, LENS, 0, max_new_tokens=4,
                 sampling=Sampling(temperature=1.0))
    tokens, lengths = join_tokens(IDS, LENS, out.tokens, out.lengths)
    lp = score(Target(tg.lm, p), tokens, lengths, sampling=Sampling(temperature=1.0),
               prompt_lengths=LENS)
    return lp.sum(), (lp, out.logprobs)

  g, (lp, loop_lp) = jax.jit(jax.grad(objective, has_aux=True))(tg.params)
  assert all(bool(jnp.isfinite(x).all()) for x in jax.tree.leaves(g))
  np.testing.assert_allclose(np.asarray(lp.sum(1)), np.asarray(loop_lp.sum(1)), atol=5e-5)


# ----------------------------------------------------------------------------------------------
# n samples per prompt, and keys that follow a prompt


def test_n_equals_hand_tiling(target):
  """n = 3 is the batch of three copies of each prompt with the samples' keys
  (`sample_keys`), and sample 0 is what n = 1 draws; speculative decoding's n = 3 draws the
  same samples (a deterministic drafter takes the coupled rule: its sampled text is decode's
  for the same keys, `test_sampled_text_is_generates_with_deterministic_drafters`)."""
  sp = Sampling(temperature=[1.0, 0.8], top_k=[0, 16])
  key = jax.random.key(5)
  keys = sample_keys(row_keys(key, 2), 3)
  sp3 = jax.tree.map(lambda x: _tiled(x, 3), sampling_arrays(sp, 2))
  run = lambda ids, lens, k, s, **kw: decode(target, ids, lens, k, max_new_tokens=N_NEW,  # noqa: E731
                                             sampling=s, **kw)
  out = run(IDS, LENS, key, sp, n=3)
  hand = run(_tiled(IDS, 3), _tiled(LENS, 3), keys, sp3)
  assert out.tokens.shape == (6, N_NEW)
  np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(hand.tokens))
  np.testing.assert_array_equal(np.asarray(out.logprobs), np.asarray(hand.logprobs))
  one = np.asarray(run(IDS, LENS, key, sp).tokens)
  np.testing.assert_array_equal(np.asarray(out.tokens)[::3], one)
  toks = np.asarray(out.tokens)
  assert len({tuple(r) for r in toks[3:]}) == 3  # prompt 1's samples differ (T = 0.8)
  spec = speculative_decode(target, NGram(), IDS, LENS, key, max_new_tokens=N_NEW,
                            num_draft_tokens=3, sampling=sp, n=3)
  np.testing.assert_array_equal(np.asarray(spec.tokens), toks)
  np.testing.assert_allclose(np.asarray(spec.logprobs), np.asarray(out.logprobs), atol=2e-5)
  assert int(np.asarray(spec.stats.drafted).sum()) > 0  # tokens came from verify passes


@pytest.mark.slow  # test_host_wrapper_takes_per_row_seeds, test_n_equals_hand_tiling and
# tests/engine/test_host_any_model.py's n-samples test (per-prompt seeds, order, alone)
def test_a_prompts_samples_follow_its_seed_not_its_position(target):
  """The same prompt with the same seed draws the same n samples alone or at any position of a
  batch (per-row seeds, or per-prompt keys); alone, seed s is key=s."""
  sp = Sampling(temperature=1.0)
  prompt = IDS[1:2, :3]
  others = jnp.asarray([[9, 8, 7], [1, 2, 3]], jnp.int32)
  batch = jnp.concatenate([others[:1], prompt, others[1:]])
  blens = jnp.asarray([3, 3, 3], jnp.int32)
  for name, run in (
      ("decode", lambda ids, lens, k: decode(target, ids, lens, k, max_new_tokens=N_NEW,
                                               sampling=sp, n=4).tokens),
      ("speculative", lambda ids, lens, k: speculative_decode(
          target, NGram(), ids, lens, k, max_new_tokens=N_NEW, num_draft_tokens=3,
          sampling=sp, n=4).tokens)):
    alone = np.asarray(run(prompt, blens[:1], 17))
    assert len({tuple(r) for r in alone}) == 4
    np.testing.assert_array_equal(np.asarray(run(prompt, blens[:1], [17])), alone)
    in_batch = np.asarray(run(batch, blens, [3, 17, 4]))
    np.testing.assert_array_equal(in_batch[4:8], alone, err_msg=name)
    traced = jax.jit(run)(batch, blens, jnp.asarray([3, 17, 4], jnp.int32))
    np.testing.assert_array_equal(np.asarray(traced), in_batch, err_msg=name)
    keys = jax.random.split(jax.random.key(0), 3)
    a = np.asarray(run(batch, blens, keys))
    b = np.asarray(run(batch[::-1], blens, keys[::-1]))
    np.testing.assert_array_equal(a, b.reshape(3, 4, -1)[::-1].reshape(12, -1), err_msg=name)
    assert not np.array_equal(a[4:8], in_batch[4:8])  # another key, other samples


def test_host_wrapper_takes_per_row_seeds(target):
  """The host wrappers read `key` as the functional API does: seed s for a row draws what a
  batch of that row alone draws with key=s."""
  sp = Sampling(temperature=1.0)
  prompts = [[5, 6, 7], [10, 11, 12]]
  both = jaxspec.generate(target, prompts, max_new_tokens=6, sampling=sp, key=[21, 22])
  for b, s in enumerate((21, 22)):
    one = jaxspec.generate(target, [prompts[b]], max_new_tokens=6, sampling=sp, key=s)
    np.testing.assert_array_equal(both.row(b), one.row(0))


# ----------------------------------------------------------------------------------------------
# Bad arguments: ValueError before anything is traced


def test_bad_arguments_are_refused_before_tracing(target, monkeypatch):
  from jaxspec.decoding import functional
  score_mod = importlib.import_module("jaxspec.decoding.score")  # the package's score is the function

  def no_trace(*a, **k):
    raise AssertionError("traced before the arguments were checked")

  monkeypatch.setattr(functional, "_decode_jit", no_trace)
  monkeypatch.setattr(functional, "_speculative_jit", no_trace)
  monkeypatch.setattr(score_mod, "_score_jit", no_trace)
  dec = lambda **kw: decode(**{**dict(target=target, prompt_ids=IDS, prompt_lengths=LENS,
                                      key=0, max_new_tokens=4), **kw})
  spec = lambda **kw: speculative_decode(**{**dict(
      target=target, drafter=NGram(), prompt_ids=IDS, prompt_lengths=LENS, key=0,
      max_new_tokens=4, num_draft_tokens=2), **kw})
  for call in (dec, spec):
    for n in (0, -1, 2.0, True, "2", None):
      with pytest.raises(ValueError, match="^n must be an integer"):
        call(n=n)
    with pytest.raises(ValueError, match="3 per-row keys for a batch of 2 rows.*or 6, one per"
                       " sample"):
      call(n=3, key=jax.random.split(jax.random.key(0), 3))
    with pytest.raises(ValueError, match="3 per-row keys for a batch of 2 rows"):
      call(key=[1, 2, 3])
    with pytest.raises(ValueError, match="one integer seed per row"):
      call(key=[1, 2.5])
    with pytest.raises(ValueError, match="Sampling.temperature has 4 values for a batch of 2"):
      call(n=2, sampling=Sampling(temperature=[1.0] * 4))
  toks = jnp.asarray([[3, 9, 4, 4], [8, 2, 6, 0]], jnp.int32)
  sc = lambda **kw: score(**{**dict(target=target, tokens=toks,
                                    lengths=jnp.asarray([4, 3])), **kw})
  cases = [
      (dict(lengths=jnp.asarray([5, 3])), "lengths must be in \\[1, 4\\]"),
      (dict(lengths=jnp.asarray([0, 3])), "lengths must be in \\[1, 4\\]"),
      (dict(lengths=jnp.asarray([4])), "lengths has 1 rows, tokens 2"),
      (dict(prompt_lengths=jnp.asarray([2, 4])), "prompt_lengths must be in \\[1, lengths\\].*"
                                                 "row 1 of length 3"),
      (dict(prompt_lengths=jnp.asarray([0, 1])), "prompt_lengths must be in \\[1, lengths\\]"),
      (dict(tokens=toks.at[1, 2].set(128)), "tokens row 1 has id 128 at position 2"),
      (dict(tokens=toks[0]), "rank 2"),
      (dict(tokens=toks.astype(jnp.float32)), "must hold integers"),
      (dict(lengths=[4, 3]), "lengths must be an array"),
      (dict(sampling=Sampling(temperature=[1.0] * 3)), "3 values for a batch of 2"),
  ]
  for kw, msg in cases:
    with pytest.raises(ValueError, match=msg):
      sc(**kw)
  with pytest.raises(AssertionError, match="traced"):  # checked and passed: padding is any id
    score(target, toks.at[1, 3].set(-1), jnp.asarray([4, 3]))
