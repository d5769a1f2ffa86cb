"""The speculative core: exact greedy for every drafter, exact sampling, statistics, bad input."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxspec.decoding.adaptive import AutoK
from jaxspec.drafters import DraftModel, NGram, Proposal
from jaxspec.api import generate
from jaxspec.models import init_params, tiny_config
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling
from jaxspec.decoding.rejection import acceptance
from jaxspec.api import speculative_generate
from helpers import CPU_LIKE, assert_first_tokens_follow, chi2_critical, exact_joint

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 3, 4, 5, 3, 4, 5, 3], [7]]
N_NEW = 24


@pytest.fixture(scope="module")
def reference(tiny_target):
  return generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, stop_ids=())


def _drafter(name, tiny_target, poor_draft):
  if name == "bf16-self-draft":  # the target itself at another precision
    import dataclasses
    cfg16 = dataclasses.replace(tiny_target.cfg, dtype="bfloat16")
    return DraftModel(Model(cfg16, jax.tree.map(lambda x: x.astype(jnp.bfloat16),
                                                tiny_target.params)))
  return {"ngram": NGram(max_ngram=3), "poor-draft": DraftModel(poor_draft),
          "self-draft": DraftModel(tiny_target)}[name]


# Every k with the poor draft (rejections at every width); the n-gram drafter at k = 3, its
# k = 1 and 8 under -m slow (a chain of any width is the same rule, which the poor draft runs).
@pytest.mark.parametrize("name,k", [
    ("poor-draft", 1), ("poor-draft", 3), ("poor-draft", 8), ("ngram", 3),
    pytest.param("ngram", 1, marks=pytest.mark.slow),
    pytest.param("ngram", 8, marks=pytest.mark.slow)])
def test_greedy_equals_generate_batch4(tiny_target, poor_draft, reference, name, k):
  out = speculative_generate(tiny_target, _drafter(name, tiny_target, poor_draft), PROMPTS,
                             max_new_tokens=N_NEW, num_draft_tokens=k, stop_ids=())
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  np.testing.assert_array_equal(out.lengths, reference.lengths)
  st_ = out.stats
  assert st_["target_passes"] >= math.ceil(N_NEW / (k + 1))
  assert len(st_["acceptance_per_position"]) == k
  if name == "poor-draft":  # rejections really happen
    assert st_["acceptance_rate"] < 0.5


# slow: "poor-draft" at batch 1 (its rejections run in the batch-4 test at every k; batch 1
# keeps the n-gram drafter and the two self-drafts).
@pytest.mark.parametrize("name", ["ngram", pytest.param("poor-draft", marks=pytest.mark.slow),
                                  "self-draft", "bf16-self-draft"])
def test_greedy_equals_generate_batch1(tiny_target, poor_draft, reference, name):
  for i in (0, 3):
    out = speculative_generate(tiny_target, _drafter(name, tiny_target, poor_draft), [PROMPTS[i]],
                               max_new_tokens=N_NEW, num_draft_tokens=3, stop_ids=())
    assert out.row(0) == reference.row(i)
    if name == "self-draft":  # the target drafting for itself is always accepted
      assert out.stats["acceptance_rate"] == 1.0
      assert out.stats["tau"] > 3.5


def test_stop_inside_accepted_run(tiny_target, reference):
  """The target drafting for itself (every draft accepted) at k = 8: row 0's stop token first
  occurs at its new token j >= 4, inside the first step's accepted run, which is cut there."""
  row = reference.row(0)
  j = next(j for j in range(4, 8) if row[j] not in row[:j])
  ref = generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, stop_ids=[row[j]])
  assert ref.lengths[0] == j + 1
  out = speculative_generate(tiny_target, DraftModel(tiny_target), PROMPTS, max_new_tokens=N_NEW,
                             num_draft_tokens=8, stop_ids=[row[j]])
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.lengths, ref.lengths)


# ----------------------------------------------------------------------------------------------
# Exact sampling.


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 6).flatmap(lambda v: st.tuples(
    st.lists(st.floats(0, 1), min_size=v, max_size=v).filter(lambda x: sum(x) > 0.05),
    st.lists(st.floats(0, 1), min_size=v, max_size=v).filter(lambda x: sum(x) > 0.05))))
def test_one_step_output_distribution_is_p(pq):
  """P(output = y), computed over u for every draft x ~ q, equals p(y) (k = 1)."""
  p = np.array(pq[0], np.float32) / np.sum(pq[0], dtype=np.float32)
  q = np.array(pq[1], np.float32) / np.sum(pq[1], dtype=np.float32)
  v = len(p)
  grid = (np.arange(4000, dtype=np.float32) + 0.5) / 4000  # u midpoints; error <= 1/8000 each
  n = len(grid)
  out = np.zeros(v)
  for x in range(v):
    if q[x] == 0:
      continue  # the drafter never proposes x
    pp = jnp.broadcast_to(jnp.asarray(np.stack([p, p])), (n, 2, v))  # p_1 and the bonus p_2
    qq = jnp.broadcast_to(jnp.asarray(q)[None, None], (n, 1, v))
    n_acc, resid = acceptance(pp, qq, jnp.full((n, 1), x, jnp.int32), jnp.asarray(grid)[:, None])
    n_acc, resid = np.asarray(n_acc), np.asarray(resid, np.float64)
    p_acc = n_acc.mean()
    out[x] += q[x] * p_acc
    rej = np.flatnonzero(n_acc == 0)
    if len(rej):
      r = resid[rej[0]]
      out += q[x] * (1 - p_acc) * r / r.sum()
  np.testing.assert_allclose(out, p, atol=2e-3)


def test_rejection_sample_one_hot_q_n_valid_and_bonus():
  """The loop's form of the rule (position keys) for deterministic drafts, by Monte Carlo on
  fixed p: the first token follows p_1 whatever the draft; where n_valid = 0 too; and after an
  accepted draft the next (the bonus token at k = 1) follows p_2. 200,000 rows."""
  from jaxspec.sampling import position_keys
  from jaxspec.decoding.rejection import rejection_sample
  rng = np.random.default_rng(3)
  v, n = 5, 200000
  p = rng.dirichlet(np.ones(v), size=2).astype(np.float32)  # p_1, p_2
  pp = jnp.broadcast_to(jnp.asarray(p)[None], (n, 2, v))
  drafts = jnp.asarray(rng.integers(0, v, (n, 1)), jnp.int32)
  keys = position_keys(jax.random.split(jax.random.key(8), n), jnp.zeros(n, jnp.int32), 2)
  for n_valid in (None, jnp.zeros(n, jnp.int32)):
    n_acc, emitted = jax.jit(rejection_sample)(pp, None, drafts, keys, n_valid)
    n_acc, emitted = np.asarray(n_acc), np.asarray(emitted)
    if n_valid is not None:
      assert (n_acc == 0).all()

    def check(tokens, probs_):
      obs = np.bincount(tokens, minlength=v).astype(np.float64)
      exp = probs_.astype(np.float64) * len(tokens)
      chi2 = float(((obs - exp) ** 2 / exp).sum())
      assert chi2 < chi2_critical(v - 1), (chi2, obs, exp)

    check(emitted[:, 0], p[0])
    acc = n_acc == 1
    if n_valid is None:
      assert 0.1 < acc.mean() < 0.9
      np.testing.assert_array_equal(emitted[acc, 0], np.asarray(drafts)[acc, 0])
      check(emitted[acc, 1], p[1])  # the bonus token
    assert (emitted[~acc, 1] == -1).all()


# slow: `same` (the target drafting for itself, every draft accepted): `[False]` runs the
# accept path too (its acceptance is between 0.05 and 0.9, asserted), and the residual as well.
@pytest.mark.parametrize("same", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_monte_carlo_joint_of_first_three_tokens(small_vocab, same):
  """Chi-square of 20000 rows' (t1, t2, t3) against the target's exact joint; the test's false
  failure probability is about 1e-4 (critical value at the 1e-4 tail). t1 is sampled from the
  prefill; t2 and t3 come from one verify pass of two drafts, so both draft positions of the
  rejection rule are covered."""
  target, draft = small_vocab
  drafter = DraftModel(target if same else draft)
  sp = Sampling(temperature=0.9, top_k=6, top_p=0.9)
  prompt = [1, 2, 3, 4]
  n = 20000
  # max_len=16 holds prompt + 3 tokens + k + 1 (the default pads the prompt to 64 and the cache
  # to 128: 20000 rows of that is most of the test's time).
  out = speculative_generate(target, drafter, [prompt] * n, max_new_tokens=3, sampling=sp,
                             num_draft_tokens=2, key=1234, max_len=16)
  assert_first_tokens_follow(out.tokens[:, :3], exact_joint(target, prompt, sp))
  if same:
    assert out.stats["acceptance_rate"] > 0.999
  else:  # both paths of the rejection rule ran
    assert 0.05 < out.stats["acceptance_rate"] < 0.9, out.stats["acceptance_rate"]


def test_ngram_drafts_copy_the_most_recent_match():
  from jaxspec.drafters import DraftContext
  seq = jnp.array([[1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3, 0, 0, 0, 0]])
  ctx = DraftContext(seq=seq, seq_len=jnp.array([12]), prompt_len=jnp.array([12]))
  prop, _ = NGram(max_ngram=3).propose(None, None, ctx, 3, None, None)
  assert prop.q is None
  np.testing.assert_array_equal(prop.tokens, [[7, 8, 1]])  # after the later "1 2 3", not the first
  np.testing.assert_array_equal(prop.n_valid, [3])
  ctx = DraftContext(seq=seq, seq_len=jnp.array([5]), prompt_len=jnp.array([5]))
  prop, _ = NGram(max_ngram=3).propose(None, None, ctx, 4, None, None)
  # "1" matched at 0; the following tokens 2 3 9 1 are all known.
  np.testing.assert_array_equal(prop.tokens, [[2, 3, 9, 1]])
  np.testing.assert_array_equal(prop.n_valid, [4])
  ctx = DraftContext(seq=seq, seq_len=jnp.array([4]), prompt_len=jnp.array([4]))
  prop, _ = NGram(max_ngram=3).propose(None, None, ctx, 4, None, None)
  np.testing.assert_array_equal(prop.n_valid, [0])  # "9" never occurred before: no proposal
  seq2 = jnp.array([[4, 5, 6, 4, 5, 0, 0, 0]])
  ctx = DraftContext(seq=seq2, seq_len=jnp.array([5]), prompt_len=jnp.array([5]))
  prop, _ = NGram(max_ngram=3).propose(None, None, ctx, 4, None, None)
  np.testing.assert_array_equal(prop.n_valid, [3])  # "4 5" -> 6 4 5, then the sequence ends
  np.testing.assert_array_equal(prop.tokens[0, :3], [6, 4, 5])


def test_draft_model_cache_has_no_hole_after_plain_steps(tiny_target):
  """With "auto" a step may be plain (k = 0): the draft model does not propose, and its commit
  must still bring the draft cache up to the new token, or its later drafts are computed over
  a cache with holes (exact output, but acceptance collapses: the self-draft below would stop
  matching the target). Regression: plain steps used to move only the length."""
  from jaxspec.drafters import DraftContext
  from jaxspec.sampling import GREEDY, row_keys
  prompt = [5, 6, 7, 8, 9, 5, 6, 7]
  full = prompt + generate(tiny_target, [prompt], max_new_tokens=10, stop_ids=()).row(0)
  d, n, size = DraftModel(tiny_target), len(prompt), 48
  seq = lambda toks: jnp.zeros((1, size), jnp.int32).at[0, :len(toks)].set(jnp.array(toks))
  ctx = lambda m: DraftContext(seq=seq(full[:m]), seq_len=jnp.array([m]),
                               prompt_len=jnp.array([n]))
  sp, keys = GREEDY.arrays(1), row_keys(jax.random.key(0), 1)
  commit = jax.jit(d.commit)
  state = jax.jit(d.init, static_argnums=3)(d.params, seq(prompt), jnp.array([n]), size)
  for m in range(n + 1, n + 6):  # five plain steps: one new token each, no proposal
    state = commit(d.params, state, ctx(m))
  prop, _ = jax.jit(d.propose, static_argnums=3)(d.params, state, ctx(n + 5), 4, sp, keys)
  # The target drafting for itself proposes exactly what the target then generates.
  assert prop.tokens[0].tolist() == full[n + 5:n + 9]


# ----------------------------------------------------------------------------------------------
# Bad input.


def test_bad_drafter_and_k(tiny_target):
  other = tiny_config(vocab_size=64)
  with pytest.raises(ValueError, match=r"draft model model \(llama, vocabulary of 64\) and the"
                     r" target tiny-target \(llama, vocabulary of 128\) have different"):
    speculative_generate(tiny_target,
                         DraftModel(Model(other, init_params(other, jax.random.key(0)))),
                         PROMPTS, max_new_tokens=4)
  for k in (0, -2, 1.5, "4"):
    with pytest.raises(ValueError, match="num_draft_tokens"):
      speculative_generate(tiny_target, NGram(), PROMPTS, max_new_tokens=4, num_draft_tokens=k)
  with pytest.raises(ValueError, match="speculative slots"):
    speculative_generate(tiny_target, NGram(), PROMPTS, max_new_tokens=40, num_draft_tokens=16,
                         max_len=64)
  with pytest.raises(ValueError, match="Drafter"):
    speculative_generate(tiny_target, object(), PROMPTS, max_new_tokens=4)


def test_drafter_on_other_devices_needs_a_placement(tiny_target):
  devs = jax.devices()
  if len(devs) < 2:
    pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  moved = Model(tiny_target.cfg, jax.device_put(tiny_target.params, devs[1]))
  with pytest.raises(ValueError, match="Placement"):
    speculative_generate(tiny_target, DraftModel(moved), PROMPTS, max_new_tokens=4)


@pytest.mark.parametrize("name", ["ngram", "poor-draft"])
def test_kept_cache_buffers_change_no_token(tiny_target, poor_draft, reference, garbage_cache_pool,
                                            name):
  """The target's cache goes into the previous call's buffers (donated); rejected drafts and
  earlier calls leave entries past each row's length there, and none of them changes a token,
  greedy or sampled (the draft model's own cache is allocated per call)."""
  from jaxspec.engine import DEFAULT
  from jaxspec.engine.io import prepare_prompts
  d = _drafter(name, tiny_target, poor_draft)
  ml = prepare_prompts(tiny_target, PROMPTS, N_NEW, extra=3 + 1).max_len
  kw = dict(max_new_tokens=N_NEW, num_draft_tokens=3, stop_ids=())
  hot = dict(sampling=Sampling(temperature=1.0, top_p=0.9), key=5)
  sampled = speculative_generate(tiny_target, d, PROMPTS, **hot, **kw)
  for seed, extra, want in ((1, {}, reference.tokens), (2, hot, sampled.tokens)):
    kept = garbage_cache_pool(tiny_target, len(PROMPTS), ml, seed)
    out = speculative_generate(tiny_target, d, PROMPTS, **extra, **kw)
    assert all(a.is_deleted() for a in kept)  # donated, not copied
    np.testing.assert_array_equal(out.tokens, want)
  (k, _), = DEFAULT.buffers.values()  # kept for the next call
  assert k.shape[1] == len(PROMPTS) and k.shape[3] == ml


# ----------------------------------------------------------------------------------------------
# Reproducibility: a row's randomness is a function of (key, row, position).


# n-gram with k = 5 under -m slow: k = 2 keeps it. "auto" runs the oracle with helpers.CPU_LIKE
# given: the n-gram under "auto" drafts nothing on this tiny model (some row has no match at
# almost every step, and a batch finishes with its slowest row, so the controller chooses plain
# steps) and would check nothing.
@pytest.mark.parametrize("name", ["ngram k=2", pytest.param("ngram k=5", marks=pytest.mark.slow),
                                  "oracle auto", "oracle k=4"])
def test_sampled_text_is_generates_with_deterministic_drafters(tiny_target, name):
  """A deterministic drafter (n-gram, the oracle) takes the coupled form of the rule: the
  target's token at every position is drawn with that position's key, as `generate` draws it,
  so the sampled text equals `generate`'s for the same key, whatever k, "auto" or drafter."""
  from jaxspec.drafters import Oracle
  sp = Sampling(temperature=0.9, top_k=40, top_p=0.95)
  ref = generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, sampling=sp, key=7, stop_ids=())
  oracle = Oracle(reference=np.asarray(ref.tokens), alpha=0.7, vocab=tiny_target.cfg.vocab_size)
  drafter, k = {"ngram k=2": (NGram(), 2), "ngram k=5": (NGram(), 5),
                "oracle auto": (oracle, "auto"), "oracle k=4": (oracle, 4)}[name]
  auto = dict(auto=AutoK(k_max=2), cost=CPU_LIKE) if k == "auto" else {}
  out = speculative_generate(tiny_target, drafter, PROMPTS, max_new_tokens=N_NEW, sampling=sp,
                             key=7, num_draft_tokens=k, stop_ids=(), **auto)
  np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=name)
  assert sum(out.stats["drafted_per_row"]) > 0, name  # the rule really ran
  if name.startswith("oracle"):
    assert out.stats["acceptance_rate"] > 0.3  # drafts were really accepted
  if k == "auto":
    assert out.stats["plain_steps"] < len(out.stats["k_per_step"]), out.stats["k_per_step"]


def test_sampled_row_does_not_depend_on_the_batch(tiny_target, poor_draft):
  """With a fixed k, a row's sampled text is the same alone and beside other rows (a drafter
  with its own q: its randomness, and the target's, are functions of (key, row, position))."""
  sp = Sampling(temperature=1.0)
  kw = dict(max_new_tokens=N_NEW, sampling=sp, key=3, num_draft_tokens=3, stop_ids=())
  batch = speculative_generate(tiny_target, DraftModel(poor_draft), PROMPTS, **kw)
  alone = speculative_generate(tiny_target, DraftModel(poor_draft), PROMPTS[:1], **kw)
  assert alone.row(0) == batch.row(0)
  assert 0 < batch.stats["acceptance_rate"] < 1



def test_coupled_draft_model_gives_generates_text(tiny_target, poor_draft):
  """DraftModel(coupled=True) draws each draft with the noise the target draws that token
  with: its sampled text is `generate`'s for the key whatever k or "auto" (greedy: the same),
  and its drafts are really accepted."""
  sp = Sampling(temperature=1.0, top_k=30)
  ref = generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, sampling=sp, key=5, stop_ids=())
  # "auto" over k in {0, 1, 2} with a given CPU-like cost model (nothing timed): the self-draft
  # starts at k = 1 and goes to 2 (with the poor draft, or with costs timed on this tiny model,
  # the controller chooses plain steps only and the case would check nothing).
  for drafter, k in ((DraftModel(tiny_target, coupled=True), 3),
                     (DraftModel(poor_draft, coupled=True), 2),
                     (DraftModel(tiny_target, coupled=True), "auto")):
    out = speculative_generate(tiny_target, drafter, PROMPTS, max_new_tokens=N_NEW, sampling=sp,
                               key=5, num_draft_tokens=k, stop_ids=(),
                               **({} if k != "auto" else dict(auto=AutoK(k_max=2), cost=CPU_LIKE)))
    np.testing.assert_array_equal(out.tokens, ref.tokens)
    if drafter.model is tiny_target:  # the target drafting for itself: every draft accepted
      assert out.stats["acceptance_rate"] == 1.0
    elif k == 2:  # both paths of the rule ran, so a wrong correction token changes the text
      assert 0 < out.stats["acceptance_rate"] < 1, out.stats["acceptance_rate"]
    if k == "auto":  # k changed between steps
      assert len(set(out.stats["k_per_step"]) - {0}) > 1, out.stats["k_per_step"]
  assert DraftModel(poor_draft, coupled=True) != DraftModel(poor_draft)


# slow: the text above is `generate`'s for the key token for token (a stronger check than a
# chi-square, as for the n-gram drafter), and test_monte_carlo_joint_of_first_three_tokens runs
# this joint with the same draft under the standard rule.
@pytest.mark.slow
def test_coupled_draft_model_joint_of_first_three_tokens(small_vocab):
  """The coupled draft model's output distribution is the target's: 20000 rows' (t1, t2, t3)
  by chi-square against the exact joint, with drafts both accepted and rejected."""
  target, draft = small_vocab
  sp = Sampling(temperature=0.9, top_k=6, top_p=0.9)
  prompt = [1, 2, 3, 4]
  out = speculative_generate(target, DraftModel(draft, coupled=True), [prompt] * 20000,
                             max_new_tokens=3, sampling=sp, num_draft_tokens=2, key=77,
                             max_len=16)
  assert_first_tokens_follow(out.tokens[:, :3], exact_joint(target, prompt, sp))
  assert 0.05 < out.stats["acceptance_rate"] < 0.9


@dataclasses.dataclass(frozen=True)
class _WildNGram(NGram):
  """An n-gram drafter gone wrong: in row b, draft i is an id past the vocabulary (i < 2) or -1
  (i >= 2) wherever i + b is even, and the n-gram's own draft elsewhere, all claimed valid. Row
  0's first draft is out of range; row 1's first draft is the n-gram's and its second is not."""
  name: str = "wild-ngram"

  def propose(self, params, state, ctx, k, sp, keys):
    prop, state = super().propose(params, state, ctx, k, sp, keys)
    i, b = jnp.arange(k)[None, :], jnp.arange(prop.tokens.shape[0])[:, None]
    tokens = jnp.where((i + b) % 2 == 0, jnp.where(i < 2, 10**6, -1), prop.tokens)
    return Proposal(tokens=tokens, n_valid=jnp.full_like(prop.n_valid, k)), state


def test_out_of_vocabulary_drafts_cannot_change_the_output(tiny_target):
  """Drafts from the first out-of-range one on do not count, and no out-of-range id reaches the
  target's pass (greedy and sampled text stay `generate`'s)."""
  ref = generate(tiny_target, PROMPTS[:2], max_new_tokens=16, stop_ids=())
  out = speculative_generate(tiny_target, _WildNGram(), PROMPTS[:2], max_new_tokens=16,
                             num_draft_tokens=4, stop_ids=())
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  drafted, accepted = out.stats["drafted_per_row"], out.stats["accepted_per_row"]
  # Row 0 counts nothing; row 1 one draft a step (cut at its second), some of them accepted.
  assert drafted[0] == 0 and 0 < drafted[1] <= out.stats["target_passes"], drafted
  assert accepted[1] > 0, accepted
  sp = Sampling(temperature=1.0)
  ref = generate(tiny_target, PROMPTS[:2], max_new_tokens=16, stop_ids=(), sampling=sp, key=4)
  out = speculative_generate(tiny_target, _WildNGram(), PROMPTS[:2], max_new_tokens=16,
                             num_draft_tokens=4, stop_ids=(), sampling=sp, key=4)
  np.testing.assert_array_equal(out.tokens, ref.tokens)  # no NaN reached the cache
  assert out.stats["drafted_per_row"][0] == 0 and out.stats["drafted_per_row"][1] > 0


def test_draft_model_subclass_is_another_program(tiny_target):
  class Mine(DraftModel):
    pass

  a, b = DraftModel(tiny_target), Mine(tiny_target)
  assert a != b and b != a and hash(a) != hash(b)
  assert Mine(tiny_target) == b
