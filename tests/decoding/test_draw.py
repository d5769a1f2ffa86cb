"""`sampling.draw`, the one categorical draw (a two-level Gumbel-max): its frequencies over
100,000 keys against p by chi-square, zeros never drawn (filtered distributions, the ends of
the vocabulary and of its blocks), tiny masses beside one of 1 - eps, bfloat16 input, and the
same token for a key whatever the shape of the batch it is drawn in."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.sampling import Sampling, draw, probs, sample, sample_from_probs, sample_positions
from helpers import chi2_critical

N = 100_000  # keys per distribution
# Each test runs its programs over 100,000 keys: `make test` runs them with XLA's default
# optimization (its second pass), where they run about 4x faster than at -O0.
pytestmark = pytest.mark.optimized


@functools.partial(jax.jit, static_argnums=2)
def _draws(key, p, n):
  """n tokens drawn from one p [V] with n independent keys (p is not copied n times)."""
  return jax.vmap(lambda k: draw(k, p))(jax.random.split(key, n))


def _counts(p, seed=0, n=N):
  toks = np.asarray(_draws(jax.random.key(seed), jnp.asarray(p), n))
  return np.bincount(toks, minlength=p.shape[-1]).astype(np.float64)


def _assert_follows(obs, p, what):
  """No token of probability 0, and a chi-square at the suite's 1e-4 tail over the tokens
  expected at least 5 times (the rest pooled into one cell)."""
  p = np.asarray(p, np.float64) / np.sum(np.asarray(p, np.float64))
  assert obs[p == 0].sum() == 0, f"{what}: drew tokens {np.flatnonzero((p == 0) & (obs > 0))}"
  exp = p * obs.sum()
  keep = exp >= 5
  o = np.append(obs[keep], obs[~keep].sum())
  e = np.append(exp[keep], exp[~keep].sum())
  o, e = o[e > 0], e[e > 0]
  chi2 = float(((o - e) ** 2 / e).sum())
  assert chi2 < chi2_critical(len(e) - 1), (what, chi2, len(e))


# V = 1000: three full blocks of 256 and a partial one (its padding must never be drawn).
@pytest.mark.parametrize("kw", [dict(top_k=40), dict(top_p=0.8), dict(min_p=0.02),
                                dict(top_k=300, top_p=0.95, min_p=0.001), {}])
def test_frequencies_match_filtered_distributions(kw):
  """Filtered distributions have many exact zeros, scattered over every block: none is ever
  drawn, and the kept tokens follow p."""
  logits = jax.random.normal(jax.random.key(7), (1, 1000)) * 2.5
  p = np.asarray(probs(logits, Sampling(temperature=0.8, **kw).arrays(1)))[0]
  if kw:
    assert (p == 0).sum() >= 100, (p == 0).sum()
  _assert_follows(_counts(p, seed=len(kw)), p, kw)


def test_zeros_at_the_ends_of_the_vocabulary_and_its_blocks():
  """Mass only at block edges (tokens 255 | 256, 511 | 512), with the first and last blocks and
  the vocabulary's first and last tokens at 0: each edge token drawn by its share."""
  v = 1000
  p = np.zeros(v, np.float32)
  p[[255, 256, 511, 512, 767]] = [0.1, 0.2, 0.3, 0.15, 0.25]
  obs = _counts(p, seed=3)
  _assert_follows(obs, p, "block edges")
  q = np.zeros(v, np.float32)
  q[[0, v - 1]] = [0.5, 0.5]  # only the two ends
  obs = _counts(q, seed=4)
  assert set(np.flatnonzero(obs)) == {0, v - 1}
  _assert_follows(obs, q, "vocabulary ends")
  one = np.zeros(v, np.float32)
  one[v - 1] = 1e-30  # a single positive entry, however small, is the only token drawn
  assert set(np.flatnonzero(_counts(one, seed=5, n=2000))) == {v - 1}


def test_tiny_masses_beside_one_token_of_nearly_all():
  """One token of 1 - 1e-7 among 49,152 (SmolLM2's vocabulary) with the rest spread over all
  others: the others come up about 1e-7 of the time, never more than a few in 100,000. With
  1e-3 spread over the others instead, each about 2e-8, they come up 1e-3 of the time, all
  over the vocabulary (a Gumbel-max over all V never draws them: its float32 noise reaches
  about 16 and log(1 / 2e-8) is about 17.7; a block of 256 of them is within reach)."""
  v = 49152
  for big, seed in ((1 - 1e-7, 8), (1 - 1e-3, 9)):
    p = np.full(v, (1 - big) / (v - 1), np.float64)
    p[1] = big  # near the start: every other token's mass lies after it, or in block 0
    obs = _counts(p.astype(np.float32), seed=seed)
    rest = obs.sum() - obs[1]
    # Poisson(N * (1 - big)): 0.01 (at most 2 has probability 1 - 2e-7) and 100 (5 sigma: 50).
    if big > 1 - 1e-6:
      assert rest <= 2, rest
    else:
      assert abs(rest - N * (1 - big)) < 50, rest
      assert len(np.unique(np.flatnonzero(obs) // 256)) > 50  # from most of the 192 blocks


def test_bfloat16_and_float32_inputs():
  """A bfloat16 p is drawn as its float32 value (the same token for every key), and follows
  the distribution of its rounded values."""
  logits = jax.random.normal(jax.random.key(11), (1, 600)) * 2
  p32 = probs(logits, Sampling(temperature=1.0, top_k=100).arrays(1))[0]
  p16 = p32.astype(jnp.bfloat16)
  keys = jax.random.split(jax.random.key(12), 4000)
  np.testing.assert_array_equal(
      jax.vmap(lambda k: draw(k, p16))(keys),
      jax.vmap(lambda k: draw(k, p16.astype(jnp.float32)))(keys))
  rounded = np.asarray(p16.astype(jnp.float32))
  _assert_follows(_counts(rounded, seed=13), rounded, "bfloat16")


def test_same_token_for_a_key_in_any_shape():
  """keys [B] with p [B, V], keys [B, T] with p [B, T, V] (the speculative step's positions),
  one key alone: each key draws the same token, so `generate` (`sample`) and the loops'
  position draws (`sample_positions`, the residual's `sample_from_probs`) agree."""
  b, t, v = 4, 3, 700
  logits = jax.random.normal(jax.random.key(14), (b, t, v)) * 3
  temp = jnp.asarray([0.0, 0.7, 1.0, 1.3])
  sp = Sampling().arrays(b)
  sp.temperature, sp.top_p = temp, jnp.asarray([1.0, 0.9, 1.0, 0.5])
  p = probs(logits, sp)  # [B, T, V] greedy row 0 one-hot

  @jax.jit
  def all_forms(key):
    keys = jax.random.split(key, (b, t))
    one = jax.vmap(jax.vmap(draw))(keys, p)  # each key alone: draw(key [], p [V])
    per_pos = jnp.stack([sample(keys[:, j], logits[:, j], sp) for j in range(t)], 1)
    resid = jnp.stack([sample_from_probs(keys[:, j], p[:, j]) for j in range(t)], 1)
    return sample_positions(keys, p, temp == 0), draw(keys, p), one, per_pos, resid

  for seed in range(8):
    pos, batched, one, per_pos, resid = map(np.asarray, all_forms(jax.random.key(seed)))
    assert pos[0].tolist() == np.argmax(np.asarray(logits[0]), -1).tolist()
    np.testing.assert_array_equal(pos, per_pos)  # `sample` is `generate`'s draw
    for other in (batched, one, resid):
      np.testing.assert_array_equal(pos[1:], other[1:])


def test_row_without_mass_draws_token_zero():
  """A row with no positive entry (never a distribution) draws token 0, in range, as a
  Gumbel-max over all -inf does; the other rows are untouched."""
  p = jnp.asarray([[0.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
  keys = jax.random.split(jax.random.key(0), 2)
  assert draw(keys, p).tolist() == [0, 2]
