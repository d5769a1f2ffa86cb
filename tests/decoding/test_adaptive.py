"""Adaptive speculation: the controller against the textbook optimum, exactness with "auto",
the measured cost model, bad input."""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import adaptive
from jaxspec.decoding.adaptive import AutoK, CostModel
from jaxspec.drafters import DraftModel, NGram, Oracle
from jaxspec.api import generate
from jaxspec.sampling import Sampling
from jaxspec.api import speculative_generate
from helpers import (CPU_LIKE, DRAFT_C, VERIFY, assert_first_tokens_follow, exact_joint,
                     forced_run)

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 3, 4, 5, 3, 4, 5, 3], [7]]
N_NEW = 24
KS = tuple(range(9))


@functools.partial(jax.jit, static_argnames=("steps", "decay"))
def _simulate(key, alpha, counts, costs, *, steps, decay):
  """Runs the controller against i.i.d. acceptance with probability alpha; returns chosen ks."""

  def step(counts, key):
    est = adaptive.acceptance_estimate(counts, (0.5, 0.5))
    idx, _ = adaptive.choose(est, jnp.ones((1,), bool), costs, KS)
    k = jnp.asarray(KS)[idx]
    acc = jax.random.bernoulli(key, alpha, (len(KS) - 1,))
    n_acc = jnp.sum(jnp.cumprod(acc) * (jnp.arange(len(KS) - 1) < k))
    counts = adaptive.update_counts(counts, decay, (k > 0)[None], k[None], n_acc[None])
    return counts, k

  return jax.lax.scan(step, counts, jax.random.split(key, steps))


def test_controller_settles_on_the_formula_k_and_moves_when_alpha_drops():
  cost = CostModel.from_formula(KS, DRAFT_C, VERIFY)
  costs = jnp.asarray(cost.at(KS))
  high, low = 0.9, 0.35
  best_high = adaptive.best_k_formula(high, KS, cost.seconds)
  best_low = adaptive.best_k_formula(low, KS, cost.seconds)
  assert best_high >= 3 and best_low <= 1  # the two regimes really differ

  def value(alpha, k):  # the formula's tokens per unit time
    return (1 - alpha ** (k + 1)) / (1 - alpha) / cost.at([k])[0]

  counts = adaptive.init_counts(1, len(KS) - 1)
  counts, ks1 = _simulate(jax.random.key(0), high, counts, costs, steps=600, decay=0.99)
  counts, ks2 = _simulate(jax.random.key(1), low, counts, costs, steps=600, decay=0.99)
  ks1, ks2 = np.asarray(ks1), np.asarray(ks2)
  mode1 = np.bincount(ks1[300:]).argmax()
  mode2 = np.bincount(ks2[300:]).argmax()
  assert mode1 == best_high, (mode1, best_high, np.bincount(ks1[300:]))
  assert mode2 == best_low, (mode2, best_low, np.bincount(ks2[300:]))
  # Settled: the chosen ks' throughput stays within 2% of the optimum's.
  assert np.mean([value(high, k) for k in ks1[300:]]) > 0.98 * value(high, best_high)
  assert np.mean([value(low, k) for k in ks2[300:]]) > 0.98 * value(low, best_low)
  # With the default forgetting (decay 0.95) it moves within a few dozen steps of the drop.
  counts = adaptive.init_counts(1, len(KS) - 1)
  counts, _ = _simulate(jax.random.key(2), high, counts, costs, steps=200, decay=0.95)
  _, ks3 = _simulate(jax.random.key(3), low, counts, costs, steps=100, decay=0.95)
  assert np.bincount(np.asarray(ks3)[40:]).argmax() == best_low


def test_controller_weighs_the_rows_that_decide_the_finish():
  ks = (0, 1, 2, 4)
  costs = jnp.asarray([1.0, 1.2, 1.35, 1.6])
  good = jnp.full((4,), 0.9)  # a row whose drafts are accepted 90% of the time
  alpha = jnp.stack([good, good])
  live = jnp.array([True, True])
  # Both rows with drafts and equal remaining work: speculating pays for the whole batch.
  idx, _ = adaptive.choose(alpha, live, costs, ks, jnp.array([4, 4]), jnp.array([50, 50]))
  assert ks[int(idx)] > 0
  # Row 1 has no draft this step and as much left to do: the batch finishes no sooner, so no
  # draft is verified (the sum over rows would still speculate for row 0's sake).
  idx, _ = adaptive.choose(alpha, live, costs, ks, jnp.array([4, 0]), jnp.array([50, 50]))
  assert ks[int(idx)] == 0
  idx_sum, _ = adaptive.choose(alpha, live, costs, ks, jnp.array([4, 0]))
  assert ks[int(idx_sum)] > 0
  # Row 1 is far ahead: only row 0 decides the finish, and it has a good draft.
  idx, _ = adaptive.choose(alpha, live, costs, ks, jnp.array([4, 0]), jnp.array([50, 10]))
  assert ks[int(idx)] > 0
  # A finished row does not count.
  idx, _ = adaptive.choose(alpha, jnp.array([True, False]), costs, ks, jnp.array([4, 0]),
                           jnp.array([50, 50]))
  assert ks[int(idx)] > 0
  # At batch 1 the objective is the row's expected tokens per second, as without `remaining`.
  _, r1 = adaptive.choose(alpha[:1], live[:1], costs, ks, None, jnp.array([50]))
  _, r0 = adaptive.choose(alpha[:1], live[:1], costs, ks)
  np.testing.assert_allclose(np.asarray(r1), np.asarray(r0), rtol=1e-6)


def test_estimate_and_expected_tokens():
  counts = adaptive.init_counts(2, 4)
  # Row 0: drafts always accepted; row 1: always rejected at the first position.
  for _ in range(50):
    counts = adaptive.update_counts(counts, 0.95, jnp.array([True, True]), jnp.array([4, 4]),
                                    jnp.array([4, 0]))
  est = np.asarray(adaptive.acceptance_estimate(counts, (0.5, 0.5)))
  assert est[0].min() > 0.95 and est[1, 0] < 0.05
  e = np.asarray(adaptive.expected_tokens(jnp.asarray(est), (0, 2, 4)))
  assert e[:, 0].tolist() == [1.0, 1.0]
  assert e[0, 2] > 4.7 and e[1, 2] < 1.1
  # A row with only 1 real draft cannot expect more than 2 tokens.
  e = np.asarray(adaptive.expected_tokens(jnp.asarray(est), (4,), jnp.array([1, 4])))
  assert e[0, 0] <= 2.0


def test_margin_keeps_break_even_drafts_out():
  ks, costs, one = (0, 1, 2), jnp.asarray([1.0, 1.6, 2.0]), jnp.array([True])
  alpha = jnp.full((1, 2), 0.62)  # k = 1 predicted 1.25% faster than a plain step
  assert ks[int(adaptive.choose(alpha, one, costs, ks)[0])] == 1
  assert ks[int(adaptive.choose(alpha, one, costs, ks, margin=0.05)[0])] == 0
  alpha = jnp.full((1, 2), 0.9)  # a clear win (1.36x at k = 2) still drafts
  assert ks[int(adaptive.choose(alpha, one, costs, ks, margin=0.05)[0])] == 2
  assert AutoK().margin == 0.05
  with pytest.raises(ValueError, match="AutoK.margin"):
    AutoK(margin=1.0)


def test_controller_takes_smaller_k_as_the_cache_makes_verify_dear():
  """A cost model whose verify grows with the cache (attention over the cached positions, a
  (k+1)-token verify faster than a decode step): at a short cache the controller drafts deep,
  at a long one shallower, and past the break-even it takes plain steps; the costs it weighs
  are `CostModel.at` the longest live row's length."""
  ks = (0, 1, 2, 4, 8)
  # seconds at an empty cache; per cached position a decode step gains 1e-4 s, k drafts 3e-4 k.
  cost = CostModel(ks=ks, seconds=(1.0, 1.05, 1.1, 1.2, 1.4),
                   per_token=tuple(1e-4 + 3e-4 * k for k in ks), length=0)
  arrays = jnp.asarray(cost.arrays(ks))
  alpha, one = jnp.full((1, 8), 0.8), jnp.array([True])
  chosen = {}
  for length in (10, 500, 1500, 3000, 8000):
    idx, rate = adaptive.choose(alpha, one, arrays, ks, length=jnp.array([length]))
    chosen[length] = ks[int(idx)]
    # The same choice from the costs at that length as a plain [nk] array.
    idx1, rate1 = adaptive.choose(alpha, one, jnp.asarray(cost.at(ks, length)), ks)
    assert int(idx1) == int(idx)
    np.testing.assert_allclose(np.asarray(rate), np.asarray(rate1), rtol=1e-5)
  assert chosen == {10: 8, 500: 4, 1500: 2, 3000: 1, 8000: 0}, chosen
  # Only live rows' lengths count: a finished long row does not make the step dear.
  two = jnp.array([True, False])
  idx, _ = adaptive.choose(jnp.full((2, 8), 0.8), two, arrays, ks,
                           length=jnp.array([10, 8000]))
  assert ks[int(idx)] == 8
  # Without per_token the costs do not move with the length.
  flat = jnp.asarray(dataclasses.replace(cost, per_token=None).arrays(ks))
  assert ks[int(adaptive.choose(alpha, one, flat, ks, length=jnp.array([8000]))[0])] == 8
  with pytest.raises(ValueError, match="length="):
    adaptive.choose(alpha, one, arrays, ks)


def test_cost_model_growth_from_two_lengths_and_ratios():
  ks = (0, 1, 2)
  # Timed at 100 and 1100 positions: +0.1 s for a plain step, +0.3 s for k = 2; k = 1's
  # longer timing is noise below k = 0's (pooled by the isotonic fit).
  cm = CostModel.from_measurements(ks, [1.0, 1.2, 1.3], longer=[1.1, 1.05, 1.6], length=100,
                                   longer_length=1100, source="measured")
  assert cm.length == 100 and cm.seconds == (1.0, 1.2, 1.3)
  np.testing.assert_allclose(cm.per_token, [0.0, 0.0, 3e-4], atol=1e-12)
  np.testing.assert_allclose(cm.at(ks, 1100), [1.0, 1.2, 1.6], rtol=1e-6)
  np.testing.assert_allclose(cm.at(ks), cm.seconds, rtol=1e-6)
  base, slope = cm.arrays(ks)
  np.testing.assert_allclose(base + slope * 600, cm.at(ks, 600), rtol=1e-6)
  # Ratios with string keys (as JSON gives them back) and its growth make the same costs.
  again = CostModel.from_ratios({str(k): v for k, v in zip(cm.ks, cm.seconds)},
                                {str(k): v for k, v in zip(cm.ks, cm.per_token)}, cm.length)
  np.testing.assert_allclose(again.at(ks, 900), cm.at(ks, 900), rtol=1e-6)
  # to_dict is plain data; through JSON, from_dict rebuilds the same model.
  text = json.dumps(cm.to_dict())
  assert CostModel.from_dict(json.loads(text)) == cm
  with pytest.raises(ValueError, match="from_ratios"):
    CostModel.from_dict({"0": 1.0, "1": 1.3})  # step times: from_ratios's form
  with pytest.raises(ValueError, match="passed as it is"):
    CostModel.from_ratios(cm)
  rel = CostModel.from_ratios({0: 1.0, 4: 1.9, 1: 1.3})
  assert rel.ks == (0, 1, 4) and rel.seconds == (1.0, 1.3, 1.9) and rel.per_token is None
  for bad in ({}, [1.0, 2.0], {"a": 1.0}):
    with pytest.raises(ValueError, match="from_ratios"):
      CostModel.from_ratios(bad)


def test_auto_follows_a_cost_that_grows_with_the_cache(tiny_target):
  """The fused loop weighs the costs at its rows' lengths: a repetitive prompt's n-gram drafts
  are verified while verify is cheap at its length, and never once verify is dear there (a
  slope of 1 s per cached position for k = 4), and the tokens are generate's either way."""
  prompt = [PROMPTS[2]]
  ref = generate(tiny_target, prompt, max_new_tokens=N_NEW, stop_ids=())
  cheap = CostModel(ks=(0, 4), seconds=(1.0, 1.0))
  dear = CostModel(ks=(0, 4), seconds=(1.0, 1.0), per_token=(0.0, 1.0), length=0)
  outs = [speculative_generate(tiny_target, NGram(), prompt, max_new_tokens=N_NEW,
                               num_draft_tokens="auto", auto=AutoK(k_max=4, buckets=(0, 4)),
                               cost=c, stop_ids=()) for c in (cheap, dear)]
  for out in outs:
    np.testing.assert_array_equal(out.tokens, ref.tokens)
  assert outs[0].stats["plain_steps"] < outs[0].stats["target_passes"]
  assert outs[1].stats["plain_steps"] == outs[1].stats["target_passes"]


def test_plain_steps_observe_a_free_first_draft():
  """A plain step still says whether an n-gram's first draft would have been accepted: the
  estimate follows with no verify spent on probing, and the controller acts on it."""
  ks, costs = (0, 1, 2), jnp.asarray([1.0, 1.6, 2.0])
  none, zero = jnp.array([False, False]), jnp.array([0, 0])
  counts = adaptive.init_counts(2, 2)
  alpha = adaptive.acceptance_estimate(counts, (0.5, 0.5))
  # At the prior (alpha 0.5) drafts do not pay for a 1.6x or 2x step: nothing is verified...
  assert int(adaptive.choose(alpha[:1], none[:1] | True, costs, ks)[0]) == 0
  # ... but plain steps show row 0's first draft would have been right every time, row 1's never.
  for _ in range(30):
    counts = adaptive.update_counts(counts, 0.95, none, zero, zero, shadow=jnp.array([True, True]),
                                    shadow_hit=jnp.array([True, False]))
  est = np.asarray(adaptive.acceptance_estimate(counts, (0.5, 0.5)))
  assert est[0, 0] > 0.9 and est[1, 0] < 0.1
  assert est[0, 1] > 0.8  # the untried second position follows the row's pooled rate
  one = jnp.array([True])
  assert ks[int(adaptive.choose(jnp.asarray(est[:1]), one, costs, ks)[0])] == 2
  assert ks[int(adaptive.choose(jnp.asarray(est[1:]), one, costs, ks)[0])] == 0
  # A row without a shadow observation only decays.
  same = adaptive.update_counts(counts, 0.95, none, zero, zero, shadow=jnp.array([False, False]),
                                shadow_hit=jnp.array([True, True]))
  np.testing.assert_allclose(np.asarray(same.tried), 0.95 * np.asarray(counts.tried))
  np.testing.assert_allclose(np.asarray(same.accepted), 0.95 * np.asarray(counts.accepted))


# ----------------------------------------------------------------------------------------------
# Exactness with "auto".

FLAT = CostModel(ks=(0, 8), seconds=(1.0, 1.0))  # every k costs the same: drafting is free


@pytest.fixture(scope="module")
def reference(tiny_target):
  return generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, stop_ids=())


def _oracle(target, reference, alpha=0.7):
  """The target's own greedy text, each draft kept with probability alpha (no model pass)."""
  return Oracle(reference=np.asarray(reference.tokens), alpha=alpha,
                vocab=target.cfg.vocab_size)


# The oracle (each draft the target's own token with probability 0.7, proposals free) is the
# default keeper: under helpers.CPU_LIKE the controller drafts, moves k and sees drafts accepted
# and rejected. The n-gram under -m slow: on this tiny model some row has no match at almost
# every step, and since a batch finishes with its slowest row the controller then chooses plain
# steps (with timed costs too), so the case checks only that "auto" leaves the text alone. The
# draft models under -m slow: test_deferred_commits_catch_up_exactly runs one under "auto"
# steps, and the controller tests above check where k settles and that it drops with alpha.
@pytest.mark.parametrize("name", ["oracle", pytest.param("ngram", marks=pytest.mark.slow),
                                  pytest.param("poor-draft", marks=pytest.mark.slow),
                                  pytest.param("self-draft", marks=pytest.mark.slow)])
def test_auto_greedy_equals_generate(tiny_target, poor_draft, reference, name):
  drafter = {"oracle": _oracle(tiny_target, reference), "ngram": NGram(),
             "poor-draft": DraftModel(poor_draft), "self-draft": DraftModel(tiny_target)}[name]
  out = speculative_generate(tiny_target, drafter, PROMPTS, max_new_tokens=N_NEW,
                             num_draft_tokens="auto", auto=AutoK(k_max=4), cost=CPU_LIKE,
                             stop_ids=())
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  np.testing.assert_array_equal(out.lengths, reference.lengths)
  ks = out.stats["k_per_step"]
  assert len(ks) == out.stats["target_passes"] and out.stats["num_draft_tokens"] == "auto"
  if name == "oracle":  # it drafts, k moves, and drafts are both accepted and rejected
    drafted, accepted = sum(out.stats["drafted_per_row"]), sum(out.stats["accepted_per_row"])
    assert len(set(ks)) >= 2 and 0 < accepted < drafted, (ks, drafted, accepted)
  if name == "self-draft":  # always accepted: it settles where the formula puts alpha = 1
    best = adaptive.best_k_formula(1.0, range(5), CPU_LIKE.seconds[:5])
    assert best >= 3 and np.bincount(ks).argmax() == best, ks
  if name == "poor-draft":  # always rejected: it soon stops drafting (k = 0, plain steps)
    assert out.stats["plain_steps"] >= len(ks) // 2


def test_deferred_commits_catch_up_exactly(tiny_target, reference):
  """A draft model's commits are deferred over plain steps (`defer_commit`) and caught up in
  one pass before it drafts again, or when k_max + 1 tokens are pending. Seven plain steps (a
  full buffer of 5 caught up at the fourth, 3 pending after the seventh), then k = 4: the
  target drafting for itself must still have every draft accepted, which it only does if the
  catch-up left its cache exactly as eager commits would (a hole or a shifted entry makes it
  propose other tokens)."""
  assert DraftModel.defer_commit
  tokens, st = forced_run(tiny_target, DraftModel(tiny_target), PROMPTS, [(0, 7), (4, None)],
                          n_new=N_NEW)
  np.testing.assert_array_equal(tokens, reference.tokens)
  assert st["k_per_step"][:7] == [0] * 7 and set(st["k_per_step"][7:]) == {4}
  np.testing.assert_allclose(st["acceptance_per_position"], 1.0)
  # Plain steps after drafting, then drafting again: the second catch-up starts mid-sequence.
  tokens, st = forced_run(tiny_target, DraftModel(tiny_target), PROMPTS,
                          [(4, 1), (0, 2), (4, 1), (0, 6), (4, None)], n_new=N_NEW)
  np.testing.assert_array_equal(tokens, reference.tokens)
  np.testing.assert_allclose(st["acceptance_per_position"], 1.0)


def test_auto_measures_costs_once(tiny_target, reference):
  """Without a cost model, "auto" times every bucket on this batch once and caches it."""
  auto = AutoK(k_max=4)  # the loop of test_auto_greedy_equals_generate[oracle]: one compilation
  out = speculative_generate(tiny_target, _oracle(tiny_target, reference), PROMPTS,
                             max_new_tokens=N_NEW, num_draft_tokens="auto", auto=auto, stop_ids=())
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  cm = out.stats["cost_model"]
  assert isinstance(cm, CostModel) and cm.source == "measured"
  assert cm.ks == (0, 1, 2, 3, 4) and all(v > 0 for v in cm.seconds)
  assert out.stats["cost_seconds"] > 0 and out.stats["cost_source"] == "measured"
  again = speculative_generate(tiny_target, _oracle(tiny_target, reference), PROMPTS,
                               max_new_tokens=N_NEW, num_draft_tokens="auto", auto=auto,
                               stop_ids=())
  assert again.stats["cost_seconds"] == 0.0 and again.stats["cost_source"] == "cached"
  assert again.stats["cost_model"] == cm
  # Another program (log-probabilities kept): its steps are timed, not the first one's reused
  # (the in-memory key left the policy's other settings out; the one on disk has them).
  lp = speculative_generate(tiny_target, _oracle(tiny_target, reference), PROMPTS,
                            max_new_tokens=N_NEW, num_draft_tokens="auto", auto=auto,
                            stop_ids=(), logprobs=True)
  assert lp.stats["cost_source"] == "measured"


def test_auto_without_drafts_is_plain_decoding(tiny_target, reference):
  """buckets=(0,): k_max 0, so the n-gram proposes nothing and there is no first draft to
  observe on plain steps; every step is a plain one."""
  out = speculative_generate(tiny_target, NGram(), PROMPTS, max_new_tokens=N_NEW,
                             num_draft_tokens="auto", auto=AutoK(k_max=1, buckets=(0,)),
                             cost=FLAT, stop_ids=())
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  assert out.stats["plain_steps"] == out.stats["target_passes"]


def test_auto_stream_stops_plain_runs_at_each_chunk(tiny_target, poor_draft, reference):
  """Steps the controller gives k = 0 run in an inner loop; it too stops at the chunk's bound,
  so a stream yields every `chunk` passes, and the tokens are still generate's."""
  from jaxspec.api import speculative_stream
  chunk, toks, passes = 3, [], []
  for new, info in speculative_stream(tiny_target, DraftModel(poor_draft), PROMPTS[0],
                                      max_new_tokens=N_NEW, auto=AutoK(k_max=4), cost=CPU_LIKE,
                                      stop_ids=(), chunk=chunk):
    toks += new[0]
    passes.append(info["stats"]["target_passes"])
  assert toks == reference.row(0)
  assert all(p == chunk * i for i, p in enumerate(passes[:-1])), passes
  assert info["stats"]["plain_steps"] >= len(info["stats"]["k_per_step"]) // 2


# slow: under "auto" the draft model is coupled, and test_speculative's
# test_coupled_draft_model_gives_generates_text checks its text under "auto" token for token and
# the same joint of a coupled draft model by chi-square.
@pytest.mark.slow
def test_auto_sampling_distribution(small_vocab):  # noqa: F811
  """The first three tokens' joint under "auto" with a poor draft: chi-square at the 1e-4 tail."""
  target, draft = small_vocab
  sp = Sampling(temperature=0.9, top_k=6, top_p=0.9)
  prompt, n = [1, 2, 3, 4], 20000
  out = speculative_generate(target, DraftModel(draft), [prompt] * n, max_new_tokens=3,
                             sampling=sp, num_draft_tokens="auto", auto=AutoK(k_max=2),
                             cost=FLAT, key=99, max_len=16)  # a small cache for 20000 rows
  assert out.stats["k_per_step"][0] == 2  # free drafts: it verified two at first
  assert_first_tokens_follow(out.tokens[:, :3], exact_joint(target, prompt, sp))


def test_draft_confidence_early_stop(tiny_target, poor_draft, reference):
  """p_min: a draft model stops drafting a row once its own confidence drops below it."""
  out = speculative_generate(tiny_target, DraftModel(poor_draft, p_min=0.99), PROMPTS,
                             max_new_tokens=N_NEW, num_draft_tokens=3, stop_ids=())
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  # k = 3: the loop test_speculative's test_greedy_equals_generate_batch4 compiles for this draft.
  base = speculative_generate(tiny_target, DraftModel(poor_draft), PROMPTS,
                              max_new_tokens=N_NEW, num_draft_tokens=3, stop_ids=())
  assert sum(out.stats["drafted_per_row"]) < sum(base.stats["drafted_per_row"])
  assert out.stats["plain_steps"] > 0  # no row confident: a plain step instead of a verify


# ----------------------------------------------------------------------------------------------
# Bad input.


def test_bad_auto_input(tiny_target):
  for k in ("fast", "AUTO", 0, 2.5, True, None):
    with pytest.raises(ValueError, match="num_draft_tokens must be \"auto\" or an integer"):
      speculative_generate(tiny_target, NGram(), PROMPTS, max_new_tokens=4, num_draft_tokens=k)
  with pytest.raises(ValueError, match="k_max"):
    speculative_generate(tiny_target, NGram(), PROMPTS, max_new_tokens=40, max_len=64,
                         num_draft_tokens="auto", auto=AutoK(k_max=16), cost=FLAT)
  with pytest.raises(ValueError, match="AutoK.k_max"):
    AutoK(k_max=0)
  with pytest.raises(ValueError, match="buckets"):
    AutoK(k_max=4, buckets=(0, 6))
  with pytest.raises(ValueError, match="auto= configures"):
    speculative_generate(tiny_target, NGram(), PROMPTS, max_new_tokens=4, num_draft_tokens=3,
                         auto=AutoK())
  with pytest.raises(ValueError, match="CostModel"):
    speculative_generate(tiny_target, NGram(), PROMPTS, max_new_tokens=4, cost={0: 1.0})
  with pytest.raises(ValueError, match="positive"):
    CostModel(ks=(0, 1), seconds=(1.0, -1.0))
  with pytest.raises(ValueError, match="p_min"):
    DraftModel(tiny_target, p_min=1.5)


def test_auto_configs_refuse_bad_fields_naming_them():
  """Every field of AutoK and CostModel checked in the constructor: a ValueError naming the
  field, never a TypeError from a comparison deep inside."""
  cases = [
      (lambda: AutoK(prior=1), "AutoK.prior"), (lambda: AutoK(prior=("a", "b")), "AutoK.prior"),
      (lambda: AutoK(prior=(1.0, float("inf"))), "AutoK.prior"),
      (lambda: AutoK(prior=(1.0, 0.0)), "AutoK.prior"),
      (lambda: AutoK(decay="x"), "AutoK.decay"), (lambda: AutoK(decay=None), "AutoK.decay"),
      (lambda: AutoK(decay=float("nan")), "AutoK.decay"),
      (lambda: AutoK(margin="0.1"), "AutoK.margin"), (lambda: AutoK(margin=True), "AutoK.margin"),
      (lambda: AutoK(k_max="8"), "AutoK.k_max"), (lambda: AutoK(k_max=2.0), "AutoK.k_max"),
      (lambda: AutoK(buckets=3), "AutoK.buckets"), (lambda: AutoK(buckets="01"), "AutoK.buckets"),
      (lambda: AutoK(buckets=(0, None)), "AutoK.buckets"),
      (lambda: CostModel(ks=("a", "b")), "CostModel.ks"),
      (lambda: CostModel(ks=("a", "b"), seconds=(1.0, 2.0)), "CostModel.ks"),
      (lambda: CostModel(ks=3, seconds=(1.0,)), "CostModel.ks"),
      (lambda: CostModel(ks=(1, 0), seconds=(1.0, 2.0)), "CostModel.ks"),
      (lambda: CostModel(ks=(0, 1)), "CostModel.seconds"),
      (lambda: CostModel(ks=(0, 1), seconds=("a", 1.0)), "CostModel.seconds"),
      (lambda: CostModel(ks=(0, 1), seconds=(1.0, float("nan"))), "CostModel.seconds"),
      (lambda: CostModel(ks=(0,), seconds=(1.0,), batch_size="4"), "CostModel.batch_size"),
      (lambda: CostModel(ks=(0,), seconds=(1.0,), source=3), "CostModel.source"),
      (lambda: CostModel(ks=(0,), seconds=(1.0,), raw=("x",)), "CostModel.raw"),
      (lambda: CostModel(ks=(0,), seconds=(1.0,), per_token=(-1.0,)), "CostModel.per_token"),
      (lambda: CostModel(ks=(0,), seconds=(1.0,), length=-1), "CostModel.length"),
  ]
  for make, name in cases:
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
      make()


def test_auto_times_the_costs_at_two_cache_lengths(tiny_target):
  """A prompt longer than `costs.MIN_COST_SPAN`: every k is timed at the prompt's length and at
  a short cache (`costs.state_at_length`), the cost model records its growth per position (>=
  0) from the short length, and the run's tokens are still generate's."""
  from jaxspec.engine import costs
  prompt = [[(7 * i) % 100 + 3 for i in range(costs.MIN_COST_SPAN + 20)]]
  ref = generate(tiny_target, prompt, max_new_tokens=6, stop_ids=())
  # carry=False: both calls start from the prior, so only the cost model decides their k's.
  auto = AutoK(k_max=2, carry=False)
  out = speculative_generate(tiny_target, NGram(), prompt, max_new_tokens=6,
                             num_draft_tokens="auto", auto=auto, stop_ids=())
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  cm = out.stats["cost_model"]
  assert cm.length == 2 + 2  # k_max + 2 positions
  assert cm.ks == (0, 1, 2) and len(cm.per_token) == 3 and all(v >= 0 for v in cm.per_token)
  np.testing.assert_allclose(cm.at((0, 1, 2)), cm.seconds, rtol=1e-6)
  # The measured model passed back as cost= (no timing again) chooses the same k every step.
  again = speculative_generate(tiny_target, NGram(), prompt, max_new_tokens=6,
                               num_draft_tokens="auto", auto=auto, stop_ids=(), cost=cm)
  assert again.stats["cost_seconds"] == 0.0
  assert again.stats["k_per_step"] == out.stats["k_per_step"]
  np.testing.assert_array_equal(again.tokens, out.tokens)
