"""Sampling at its edges: temperatures below float32's resolution keep finite log-probabilities
(the sampling module, the host wrappers and the functional core), and per-row keys make a
row's draws independent of the batch it is run in."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import DraftModel, NGram, Sampling, generate, speculative_generate
from jaxspec.decoding import decode, speculative_decode
from jaxspec.models import init_params, tiny_config
from jaxspec.models.model import Model
from jaxspec.sampling import probs, process_logits, row_keys, sample, token_logprobs

TINY_TEMPERATURES = (3e-38, 1e-40)  # a normal and a subnormal float32
PROMPTS = [[5, 6, 7, 5, 6, 7], [9, 10], [3, 4, 5, 3, 4], [7], [11, 12, 13, 14]]


def test_tiny_temperatures_take_their_limit_with_finite_logprobs():
  # 30 / 2e-38 overflows float32; ties at the top (row 0) share the mass, as T -> 0 gives.
  lg = jnp.asarray([[30.0, -20.0, 29.0, 30.0], [1.0, 40.0, -50.0, 3.0], [-40.0, -45.0, -41.0,
                                                                           -60.0]])
  want = np.array([[0.5, 0, 0, 0.5], [0, 1, 0, 0], [1, 0, 0, 0]], np.float32)
  for t in TINY_TEMPERATURES:
    sp = Sampling(temperature=t).arrays(3)
    np.testing.assert_array_equal(probs(lg, sp), want)
    lp = token_logprobs(lg, jnp.asarray([3, 1, 0]), sp)
    np.testing.assert_array_equal(lp, np.log([0.5, 1.0, 1.0]).astype(np.float32))
    assert set(np.asarray(sample(jax.random.split(jax.random.key(0), 3), lg, sp))[1:]) == {1, 0}
    # with filters too (top-k, top-p and min-p see the limit's one-hot)
    spf = Sampling(temperature=t, top_k=2, top_p=0.5, min_p=0.1).arrays(3)
    assert np.isfinite(token_logprobs(lg, jnp.asarray([0, 1, 0]), spf)).all()
  # A subnormal temperature may be flushed to 0 by the backend (then it is greedy): either way
  # the argmax, with finite log-probabilities.
  sp = Sampling(temperature=1e-45).arrays(3)
  assert (np.asarray(probs(lg, sp))[want == 0] == 0).all()
  assert np.isfinite(token_logprobs(lg, jnp.asarray([0, 1, 0]), sp)).all()
  # Just above the overflow the ordinary scaling gives the same distribution: no jump.
  np.testing.assert_array_equal(probs(lg, Sampling(temperature=1e-30).arrays(3)), want)
  # Normal temperatures are untouched: the scaled logits are logits / T, bit for bit.
  sp = Sampling(temperature=0.7).arrays(3)
  np.testing.assert_array_equal(process_logits(lg, sp), lg / jnp.float32(0.7))


@pytest.fixture(scope="module")
def hot_model():
  """A tiny model whose logits reach a few hundred: logits / 2e-38 overflows float32."""
  cfg = tiny_config()
  p = init_params(cfg, jax.random.key(0), scale=0.2)
  return Model(cfg, dataclasses.replace(p, lm_head=p.lm_head * 300), name="hot")


def test_tiny_temperatures_give_finite_logprobs_plain_and_speculative(hot_model):
  greedy = generate(hot_model, PROMPTS, max_new_tokens=8, stop_ids=())
  runs = {"plain": lambda sp: generate(hot_model, PROMPTS, max_new_tokens=8, sampling=sp,
                                       stop_ids=(), logprobs=True, key=1)}
  for name, drafter in (("ngram", NGram()), ("draft-model", DraftModel(hot_model))):
    runs[name] = lambda sp, d=drafter: speculative_generate(
        hot_model, d, PROMPTS, max_new_tokens=8, sampling=sp, num_draft_tokens=3, stop_ids=(),
        logprobs=True, key=1)
  for t in TINY_TEMPERATURES:
    for name, run in runs.items():
      out = run(Sampling(temperature=t))
      # The limit is the argmax: greedy's tokens, each of probability 1.
      np.testing.assert_array_equal(out.tokens, greedy.tokens, err_msg=f"{name} T={t}")
      np.testing.assert_array_equal(out.logprobs, 0.0, err_msg=f"{name} T={t}")


def test_tiny_temperatures_give_finite_logprobs_in_the_functional_core(hot_model):
  ids = jnp.asarray([p + [0] * (6 - len(p)) for p in PROMPTS], jnp.int32)
  lens = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
  greedy = decode(hot_model, ids, lens, 0, max_new_tokens=8)
  for t in TINY_TEMPERATURES:
    sp = Sampling(temperature=t)
    for out in (decode(hot_model, ids, lens, 1, max_new_tokens=8, sampling=sp),
                speculative_decode(hot_model, NGram(), ids, lens, 1, max_new_tokens=8,
                                   num_draft_tokens=3, sampling=sp)):
      np.testing.assert_array_equal(out.tokens, greedy.tokens)
      np.testing.assert_array_equal(out.logprobs, 0.0)


def _split_runs(run, key, splits):
  """Tokens of `run(prompts, key)` for PROMPTS in one batch with one key, and batch by batch
  with each row's key from `row_keys`."""
  whole = run(PROMPTS, key)
  keys = row_keys(key, len(PROMPTS))
  parts = [run(PROMPTS[i:j], keys[i:j]) for i, j in splits]
  return whole, parts


# slow: "ngram" samples `generate`'s text for the key (test_speculative), so "plain" covers it;
# "draft-model" (a drafter with its own q): test_per_row_keys_in_the_functional_core splits the
# same draft's batch by per-row keys, and test_speculative's
# test_sampled_row_does_not_depend_on_the_batch runs it through this host wrapper.
@pytest.mark.parametrize("which", ["plain", pytest.param("ngram", marks=pytest.mark.slow),
                                   pytest.param("draft-model", marks=pytest.mark.slow)])
def test_per_row_keys_make_rows_independent_of_the_batch(tiny_target, poor_draft, which):
  sp = Sampling(temperature=1.0)
  if which == "plain":
    def run(prompts, key):
      return generate(tiny_target, prompts, max_new_tokens=10, sampling=sp, key=key,
                      stop_ids=())
  else:
    drafter = NGram() if which == "ngram" else DraftModel(poor_draft)

    def run(prompts, key):
      return speculative_generate(tiny_target, drafter, prompts, max_new_tokens=10,
                                  sampling=sp, key=key, num_draft_tokens=3, stop_ids=())
  key = jax.random.key(11)
  splits = [(0, 2), (2, 5)]
  whole, parts = _split_runs(run, key, splits)
  for (i, j), part in zip(splits, parts):
    for b in range(j - i):
      assert part.row(b) == whole.row(i + b), (which, i + b)
  # One key for the second batch alone draws its rows as rows 0.. of a batch: other texts.
  alone = run(PROMPTS[2:5], key)
  assert [alone.row(b) for b in range(3)] != [whole.row(2 + b) for b in range(3)]


def test_per_row_keys_in_the_functional_core(tiny_target, poor_draft):
  ids = jnp.asarray([p + [0] * (6 - len(p)) for p in PROMPTS], jnp.int32)
  lens = jnp.asarray([len(p) for p in PROMPTS], jnp.int32)
  sp = Sampling(temperature=1.0)
  key = jax.random.key(5)
  keys = row_keys(key, 5)
  for run in (lambda i, n, k: decode(tiny_target, i, n, k, max_new_tokens=8, sampling=sp),
              lambda i, n, k: speculative_decode(tiny_target, DraftModel(poor_draft), i, n, k,
                                                 max_new_tokens=8, num_draft_tokens=3,
                                                 sampling=sp)):
    whole = run(ids, lens, key)
    np.testing.assert_array_equal(run(ids, lens, keys).tokens, whole.tokens)
    top = run(ids[:2], lens[:2], keys[:2])
    np.testing.assert_array_equal(top.tokens, whole.tokens[:2])
    # raw uint32 key data [B, 2] is the same keys (two rows again: top's program)
    bottom = run(ids[3:], lens[3:], jax.random.key_data(keys[3:]))
    np.testing.assert_array_equal(bottom.tokens, whole.tokens[3:])
  with pytest.raises(ValueError, match="key holds 2 per-row keys for a batch of 5 rows"):
    decode(tiny_target, ids, lens, keys[:2], max_new_tokens=8, sampling=sp)
