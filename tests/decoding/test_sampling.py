"""The sampling module: filters against a numpy reference, argument validation."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.sampling import Sampling, probs, sample, sampling_arrays


def _ref_probs(logits, t, k, p, m):
  """Hugging Face warper order: temperature, top-k, top-p, min-p."""
  x = logits.astype(np.float64) / t
  if k > 0:
    kth = np.sort(x)[::-1][k - 1]
    x = np.where(x >= kth, x, -np.inf)
  if p < 1:
    order = np.argsort(-x, kind="stable")
    pr = np.exp(x[order] - x[order][0])
    pr /= pr.sum()
    before = np.cumsum(pr) - pr
    drop = order[before >= p]
    x[drop] = -np.inf
  if m > 0:
    pr = np.exp(x - x.max())
    pr /= pr.sum()
    x = np.where(pr >= m * pr.max(), x, -np.inf)
  pr = np.exp(x - x.max())
  return pr / pr.sum()


@pytest.mark.parametrize("t,k,p,m", [(1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.6, 0.0),
                                     (1.0, 0, 1.0, 0.2), (0.9, 10, 0.8, 0.05)])
def test_probs_match_reference(t, k, p, m):
  logits = jax.random.normal(jax.random.key(0), (3, 40)) * 3
  sp = Sampling(temperature=t, top_k=k, top_p=p, min_p=m).arrays(3)
  got = np.asarray(probs(logits, sp))
  for r in range(3):
    np.testing.assert_allclose(got[r], _ref_probs(np.asarray(logits[r]), t, k, p, m), atol=1e-6)


def _tied_logits(rows, v, seed):
  """Logits with many exact ties: values on a coarse grid, so top-k's k-th value and top-p's
  edge fall inside runs of equal logits."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(-6, 6, (rows, v)).astype(np.float32) * 0.5)


@pytest.mark.parametrize("t,k,p,m", [(1.0, 5, 1.0, 0.0), (1.0, 0, 0.5, 0.0), (0.8, 7, 0.7, 0.1),
                                     (1.0, 0, 1.0, 0.3)])
def test_probs_match_reference_with_ties(t, k, p, m):
  """top-k keeps the whole run tied at the k-th value; top-p keeps exactly the smallest prefix
  of the descending order (lower token id first among ties) reaching top_p."""
  logits = _tied_logits(4, 32, seed=int(10 * t + k + 100 * p))
  sp = Sampling(temperature=t, top_k=k, top_p=p, min_p=m).arrays(4)
  got = np.asarray(probs(logits, sp))
  for r in range(4):
    np.testing.assert_allclose(got[r], _ref_probs(np.asarray(logits[r]), t, k, p, m), atol=1e-6)


def test_cpu_bisection_filter_keeps_the_sorted_filters_tokens():
  """On the CPU `probs` filters by bisection (`_filter_bisect`, XLA's CPU sort being slow); it
  keeps exactly the tokens the sorting filter keeps, with exact ties at top-k's k-th value and
  top-p's edge, -inf logits, -0 beside +0, every row its own k, p and min-p, batches where no
  row uses top-k or top-p, and [B, K, V] logits. A bisection that keeps every token tied at
  top-p's edge fails it."""
  from jaxspec.sampling import _filter_bisect, _filter_sorted
  rng = np.random.default_rng(7)
  fs, fb = jax.jit(_filter_sorted), jax.jit(_filter_bisect)
  for trial in range(60):
    v = (5, 33, 64)[trial % 3]
    x = (rng.integers(-6, 6, (4, v)) * 0.5 if trial % 2 else rng.normal(size=(4, v)) * 3
         ).astype(np.float32)
    x[trial % 4, rng.integers(0, v)] = -np.inf
    x[0, 0], x[0, -1] = -0.0, 0.0
    sp = Sampling(temperature=1.0).arrays(4)
    sp.top_k = jnp.asarray(rng.integers(0, v + 3, 4), jnp.int32)
    sp.top_p = jnp.asarray(rng.choice([1.0, 0.3, 0.5, 0.7, 0.95], 4), jnp.float32)
    sp.min_p = jnp.asarray(rng.choice([0.0, 0.0, 0.1, 0.5], 4), jnp.float32)
    if trial % 5 == 0:  # no row uses top-k: its bisection is skipped
      sp.top_k = jnp.zeros(4, jnp.int32)
    elif trial % 5 == 1:  # no row uses top-p: its bisection is skipped
      sp.top_p = jnp.ones(4, jnp.float32)
    want = np.isfinite(np.asarray(fs(jnp.asarray(x), sp)))
    np.testing.assert_array_equal(np.isfinite(np.asarray(fb(jnp.asarray(x), sp))), want)
  x = jnp.asarray(rng.normal(size=(2, 3, 50)).astype(np.float32) * 2)
  sp = Sampling(temperature=1.0, top_k=7, top_p=0.8, min_p=0.05).arrays(2)
  np.testing.assert_array_equal(np.isfinite(_filter_bisect(x, sp)),
                                np.isfinite(_filter_sorted(x, sp)))


def test_probs_per_row_settings_match_each_row_alone():
  """Rows with different settings in one batch: each row gets what it gets alone, and a row
  with top_p = 1 beside filtering rows keeps all of its mass (no cumulative-sum rounding)."""
  settings = [(1.0, 0, 1.0, 0.0), (0.7, 4, 0.9, 0.0), (1.3, 0, 0.5, 0.05), (1.0, 9, 1.0, 0.2)]
  logits = jnp.concatenate([_tied_logits(2, 48, seed=3),
                            jax.random.normal(jax.random.key(4), (2, 48)) * 4])
  t, k, p, m = zip(*settings)
  sp = Sampling(temperature=t, top_k=k, top_p=p, min_p=m).arrays(4)
  got = np.asarray(probs(logits, sp))
  for r, (t, k, p, m) in enumerate(settings):
    alone = np.asarray(probs(logits[r:r + 1], Sampling(temperature=t, top_k=k, top_p=p,
                                                           min_p=m).arrays(1)))[0]
    np.testing.assert_array_equal(got[r], alone)
    np.testing.assert_allclose(got[r], _ref_probs(np.asarray(logits[r]), t, k, p, m), atol=1e-6)
  np.testing.assert_array_equal(got[0], np.asarray(jax.nn.softmax(logits[0])))
  assert (got[0] > 0).all()


def test_greedy_is_one_hot_and_rows_can_differ():
  logits = jax.random.normal(jax.random.key(1), (2, 16))
  sp = Sampling(temperature=(0.0, 1.0)).arrays(2)
  assert not sp.all_greedy
  pr = np.asarray(probs(logits, sp))
  assert pr[0].max() == 1.0 and pr[0].argmax() == int(logits[0].argmax())
  np.testing.assert_allclose(pr[1], jax.nn.softmax(logits[1]), atol=1e-6)
  keys = jax.random.split(jax.random.key(2), 2)
  assert int(sample(keys, logits, sp)[0]) == int(logits[0].argmax())


def test_all_greedy_compiles_no_sampling_and_gives_the_per_row_programs_tokens():
  """`Sampling.arrays` marks an all-greedy batch (static): its programs take the argmax without
  compiling the draws and filters, and give exactly what the per-row program gives greedy rows."""
  logits = jax.random.normal(jax.random.key(5), (3, 64)) * 3
  keys = jax.random.split(jax.random.key(6), 3)
  fast = Sampling().arrays(3)
  per_row = dataclasses.replace(fast, all_greedy=False)
  assert fast.all_greedy and not Sampling(temperature=(0.0, 0.0, 0.5)).arrays(3).all_greedy
  np.testing.assert_array_equal(sample(keys, logits, fast), sample(keys, logits, per_row))
  np.testing.assert_array_equal(probs(logits, fast), probs(logits, per_row))
  size = lambda sp: len(jax.jit(sample).lower(keys, logits, sp).as_text())
  assert size(fast) < size(per_row) / 2
  with pytest.raises(ValueError, match="all_greedy"):
    sampling_arrays(dataclasses.replace(Sampling(temperature=0.5).arrays(3), all_greedy=True), 3)


def test_unfiltered_compiles_no_filter_and_gives_the_per_row_programs_tokens():
  """`Sampling.arrays` marks a batch whose top-k, top-p and min-p are off in every row (static):
  its programs compile no filter, and give exactly what the per-row program gives."""
  logits = jax.random.normal(jax.random.key(7), (3, 64)) * 3
  keys = jax.random.split(jax.random.key(8), 3)
  fast = Sampling(temperature=(0.0, 0.7, 1.3)).arrays(3)
  per_row = dataclasses.replace(fast, unfiltered=False)
  assert fast.unfiltered and not fast.all_greedy
  assert not Sampling(temperature=0.7, top_k=(0, 5, 0)).arrays(3).unfiltered
  assert not Sampling(temperature=0.7, top_p=0.9).arrays(3).unfiltered
  assert not Sampling(temperature=0.7, min_p=(0.0, 0.0, 0.1)).arrays(3).unfiltered
  assert Sampling(temperature=0.7, top_k=jnp.asarray(0)).arrays(3).unfiltered  # a concrete 0
  seen = []  # a traced value is not known to be off
  jax.jit(lambda k: seen.append(Sampling(temperature=0.7, top_k=k).arrays(3).unfiltered) or k)(0)
  assert seen == [False]
  np.testing.assert_array_equal(sample(keys, logits, fast), sample(keys, logits, per_row))
  np.testing.assert_array_equal(probs(logits, fast), probs(logits, per_row))
  size = lambda sp: len(jax.jit(sample).lower(keys, logits, sp).as_text())
  assert size(fast) < 0.6 * size(per_row)  # 26k against 47k characters of StableHLO
  with pytest.raises(ValueError, match="unfiltered.*top_p"):
    sampling_arrays(dataclasses.replace(Sampling(temperature=0.5, top_p=0.9).arrays(3),
                                        unfiltered=True), 3)


def test_sample_frequencies():
  logits = jnp.log(jnp.array([[0.5, 0.3, 0.2, 0.0]]))
  sp = Sampling(temperature=1.0, top_k=2).arrays(4000)
  keys = jax.random.split(jax.random.key(3), 4000)
  toks = np.asarray(sample(keys, jnp.repeat(logits, 4000, 0), sp))
  freq = np.bincount(toks, minlength=4) / 4000
  # top-k 2 renormalises {0.5, 0.3}: 0.625 / 0.375; 5 sigma of a binomial with n=4000 is 0.038.
  np.testing.assert_allclose(freq, [0.625, 0.375, 0, 0], atol=0.04)


@pytest.mark.parametrize("kw,match", [({"temperature": -0.1}, "temperature"),
                                      ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                      ({"top_k": -1}, "top_k"), ({"top_k": 2.5}, "top_k"),
                                      ({"top_k": 2**31}, "top_k"),
                                      ({"temperature": float("inf")}, "temperature"),
                                      ({"min_p": 1.5}, "min_p")])
def test_bad_sampling_values(kw, match):
  with pytest.raises(ValueError, match=match):
    Sampling(**kw)
