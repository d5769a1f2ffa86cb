"""Suffix decoding (`SuffixDecoding`): what it proposes (from the batch's rows and the corpus,
its length following the match), the corpus ring (fixed size, oldest evicted first), exact
greedy output with the corpus carried across calls (under jit and vmap), the sampled
distribution at later positions, and bad input."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.api import generate, speculative_generate
from jaxspec.decoding import functional
from jaxspec.decoding.drafter import DraftContext
from jaxspec.decoding.functional import speculative_decode
from jaxspec.drafters import SuffixCorpus, SuffixDecoding, corpus_from, resolve_drafter
from jaxspec.drafters.suffix import SEP, append_rows
from jaxspec.sampling import Sampling
from helpers import assert_tokens_4_5_follow, padded, suffix_sampling_case

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 3, 4, 5, 3, 4, 5, 3], [7]]
N_NEW = 20


def _propose(drafter, rows, corpus=None, k=4):
  """The proposal for rows (lists of ids) with the given corpus (default empty)."""
  corpus = drafter.params if corpus is None else corpus
  ids, lens = padded(rows, max(len(r) for r in rows) + k + 1)
  state = drafter.init(corpus, ids, lens, ids.shape[1])
  ctx = DraftContext(seq=ids, seq_len=lens, prompt_len=lens)
  prop, _ = drafter.propose(corpus, state, ctx, k, None, None)
  return np.asarray(prop.tokens), np.asarray(prop.n_valid)


# -- what it proposes -----------------------------------------------------------------------------


def test_rows_draft_from_each_other_and_from_the_corpus():
  d = SuffixDecoding(vocab=100, corpus_size=64)
  # Row 0 ends with 1 2; row 1 holds 1 2 3 4 5: row 0 drafts 3 4 5 from row 1's text. Row 1's
  # own last tokens (4 5) occur nowhere else: it drafts nothing.
  toks, nv = _propose(d, [[9, 1, 2], [8, 1, 2, 3, 4, 5]])
  np.testing.assert_array_equal(toks[0, :3], [3, 4, 5])
  assert nv.tolist() == [3, 0]  # match length 2 + spec_offset 1
  # The same row alone drafts from a corpus holding the continuation (up to its SEP).
  corpus = corpus_from([[1, 2, 3, 4, 5, 6]], 100, 64)
  toks, nv = _propose(d, [[9, 1, 2]], corpus)
  np.testing.assert_array_equal(toks[0, :3], [3, 4, 5])
  assert nv.tolist() == [3]
  toks, nv = _propose(d, [[9, 1, 2]], corpus, k=8)
  assert nv.tolist() == [3]  # spec_factor 1 x match 2 + 1
  d_long = SuffixDecoding(vocab=100, corpus_size=64, spec_factor=4.0)
  toks, nv = _propose(d_long, [[9, 1, 2]], corpus, k=8)
  np.testing.assert_array_equal(toks[0, :4], [3, 4, 5, 6])
  assert nv.tolist() == [4]  # the corpus entry ends after 6
  # No earlier occurrence anywhere: nothing proposed.
  _, nv = _propose(d, [[40, 41]], corpus)
  assert nv.tolist() == [0]


def test_longest_match_wins_and_continuations_vote():
  d = SuffixDecoding(vocab=100, corpus_size=128, spec_factor=8.0, min_prob=0.3)
  # After "1 2" the corpus has 3 (twice) and 4 (once); after "7 1 2" only 4.
  corpus = corpus_from([[1, 2, 3, 10, 11], [1, 2, 3, 10, 12], [5, 1, 2, 4, 20]], 100, 128)
  toks, nv = _propose(d, [[9, 1, 2]], corpus)
  # 3 (2 of 3 votes), then 10 (2 of 2), then 11 or 12 (1 of 2: the product 1/3 >= 0.3), the
  # most recent first; then the entry ends.
  np.testing.assert_array_equal(toks[0, :3], [3, 10, 12])
  assert nv.tolist() == [3]
  toks, nv = _propose(d, [[5, 1, 2]], corpus)  # the longer match decides alone
  np.testing.assert_array_equal(toks[0, :2], [4, 20])
  assert nv.tolist() == [2]
  strict = SuffixDecoding(vocab=100, corpus_size=128, spec_factor=8.0, min_prob=0.5)
  _, nv = _propose(strict, [[9, 1, 2]], corpus)
  assert nv.tolist() == [2]  # 2/3 then 2/3 x 1, then 1/3 < 0.5
  assert _propose(SuffixDecoding(vocab=100, corpus_size=128, min_match=3), [[9, 1, 2]],
                  corpus)[1].tolist() == [0]


# -- the corpus -----------------------------------------------------------------------------------


def test_corpus_is_a_fixed_ring_that_evicts_the_oldest_first():
  c = 16
  corpus = SuffixCorpus.empty(c, 100)
  stream = []
  rng = np.random.default_rng(0)
  for step in range(6):
    rows = [list(rng.integers(0, 100, size=n)) for n in rng.integers(1, 9, size=3)]
    ids, lens = padded(rows, 10)
    corpus = append_rows(corpus, ids, lens, jnp.zeros_like(lens))
    for r in rows:
      stream += r + [SEP]
    assert corpus.tokens.shape == (c,)  # never grows
    held = np.asarray(corpus.ordered())
    want = ([SEP] * c + stream)[-c:]  # the newest c slots, oldest first
    np.testing.assert_array_equal(held, want, err_msg=f"append {step}")
    assert int(corpus.end) == len(stream) % c
  assert len(stream) > 3 * c  # the ring wrapped
  # One append larger than the ring keeps its last c tokens.
  big = corpus_from([list(range(10)), list(range(20, 45))], 100, c)
  np.testing.assert_array_equal(np.asarray(big.ordered()), list(range(30, 45)) + [SEP])


# -- exactness ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tiny_target):
  return generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, stop_ids=())


def _carrying_call(target, d, ids, lens):
  """One jitted call on the padded rows taking and returning the corpus: (tokens, drafts
  accepted, the corpus after the call)."""
  @jax.jit
  def call(corpus, key):
    out = speculative_decode(target, d, ids, lens, key, max_new_tokens=N_NEW,
                             num_draft_tokens=4, stop_ids=(), drafter_params=corpus)
    return out.tokens, out.stats.accepted.sum(), out.drafter_params

  return call


def test_greedy_equals_plain_with_the_corpus_carried_under_jit(tiny_target, plain):
  """A ragged batch, three calls carrying the corpus, inside the user's jax.jit (one
  compilation: the corpus is an argument): every call's tokens are plain greedy's, and later
  calls draft from the corpus (far more drafts accepted)."""
  d = SuffixDecoding(vocab=tiny_target.cfg.vocab_size, corpus_size=256)
  ids, lens = padded(PROMPTS)

  call = _carrying_call(tiny_target, d, ids, lens)

  corpus, accepted = d.params, []
  for i in range(3):
    toks, acc, corpus = call(corpus, jax.random.key(i))
    np.testing.assert_array_equal(np.asarray(toks), plain.tokens, err_msg=f"call {i}")
    accepted.append(int(acc))
    # The call returns its rows appended: each row's last max_match prompt tokens (here the
    # whole prompts), its output and a separator, after the earlier calls' (the ring of 256
    # slots has wrapped by the third call).
    want = ([SEP] * 256 + [t for p, out in zip(PROMPTS, plain.tokens)
                           for t in p[-16:] + list(out) + [SEP]] * (i + 1))[-256:]
    np.testing.assert_array_equal(np.asarray(corpus.ordered()), want, err_msg=f"call {i}")
  assert corpus.vocab_size == tiny_target.cfg.vocab_size
  assert call._cache_size() == 1
  assert accepted[1] > accepted[0] + 40 and accepted[2] > accepted[0] + 40, accepted


@pytest.mark.slow  # vmap: the sampled tests below; by name: test_suffix_tree_by_name
def test_greedy_equals_plain_under_vmap_and_through_the_host_wrapper(tiny_target, plain):
  d = SuffixDecoding(vocab=tiny_target.cfg.vocab_size, corpus_size=128)
  corpus = corpus_from([p + list(t) for p, t in zip(PROMPTS, plain.tokens)],
                       tiny_target.cfg.vocab_size, 128)
  rows = [padded([p]) for p in PROMPTS]
  ids4, lens4 = jnp.stack([r[0] for r in rows]), jnp.stack([r[1] for r in rows])
  out = jax.jit(jax.vmap(lambda i, l, c: speculative_decode(
      tiny_target, d, i, l, 0, max_new_tokens=N_NEW, num_draft_tokens=3, stop_ids=(),
      drafter_params=c), in_axes=(0, 0, None)))(ids4, lens4, corpus)
  np.testing.assert_array_equal(np.asarray(out.tokens[:, 0]), plain.tokens)
  assert out.drafter_params.tokens.shape == (4, 128)  # one corpus per mapped call
  assert int(out.stats.accepted.sum()) > 0
  # By name, through the host wrapper (every call from an empty corpus).
  named = resolve_drafter(tiny_target, "suffix")
  assert named == SuffixDecoding(vocab=tiny_target.cfg.vocab_size)
  host = speculative_generate(tiny_target, "suffix", PROMPTS, max_new_tokens=N_NEW,
                              num_draft_tokens=3, stop_ids=())
  np.testing.assert_array_equal(host.tokens, plain.tokens)


def test_sampled_text_is_generates(tiny_target):
  """Sampled, the one-hot drafts take the coupled form of the rule (the target's token at each
  position drawn with that position's key, as `generate` draws it): the text is `generate`'s
  for the key whatever the drafts, from the rows alone (drafts accepted and rejected) and from
  a corpus of that very text (most of it accepted)."""
  sp = Sampling(temperature=1.0, top_k=40)
  ref = generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, sampling=sp, key=6, stop_ids=())
  d = SuffixDecoding(vocab=tiny_target.cfg.vocab_size, corpus_size=256)
  ids, lens = padded(PROMPTS)
  run = jax.jit(lambda corpus: speculative_decode(
      tiny_target, d, ids, lens, jax.random.key(6), max_new_tokens=N_NEW, num_draft_tokens=3,
      sampling=sp, stop_ids=(), drafter_params=corpus))
  accepted = []
  for corpus in (d.params, corpus_from([p + list(t) for p, t in zip(PROMPTS, ref.tokens)],
                                       tiny_target.cfg.vocab_size, 256)):
    out = run(corpus)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref.tokens)
    accepted.append((int(out.stats.accepted.sum()), int(out.stats.drafted.sum())))
  (acc0, drafted0), (acc1, _) = accepted
  assert 0 < acc0 < drafted0, accepted  # both paths of the rule, from the rows alone
  assert acc1 > 40, accepted


# slow: test_sampled_text_is_generates above is `generate`'s text for the key token for token
# (a stronger check than a chi-square, as for the n-gram drafter), and
# test_sampled_drafts_distribution_at_later_positions keeps the chi-square of this case with
# sampled drafts (and runs these one-hot drafts for its acceptance comparison).
@pytest.mark.slow
def test_sampled_distribution_at_later_positions(small_vocab):
  """The 4th and 5th new tokens of row 1 (which drafts from row 0 and from a corpus of earlier
  samples) over 4000 mapped calls: chi-square against the target's exact joint at the 1e-4
  tail, with drafts both accepted and rejected."""
  target, _ = small_vocab
  sp, tables, corpus, ids, lens, options = suffix_sampling_case(target)
  d = SuffixDecoding(**options)

  def one(key):
    out = speculative_decode(target, d, ids, lens, key, max_new_tokens=6, num_draft_tokens=3,
                             sampling=sp, max_len=16, drafter_params=corpus, logprobs=False)
    return out.tokens[1, 3:5], out.stats.drafted[1], out.stats.accepted[1]

  # 4000 rows keep the power that matters: a rule that accepts with probability p(x) and
  # then draws afresh from p (not the residual) fails this test by a factor of ~40
  # (docs/tests.md); most of the test's time is running the rows at -O0.
  n = 4000
  toks, drafted, accepted = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(5), n))
  rate = int(accepted.sum()) / int(drafted.sum())
  assert 0.1 < rate < 0.9, rate  # both paths of the rejection rule
  assert_tokens_4_5_follow(toks, tables)


# -- sampled drafts (sample_drafts=True) ----------------------------------------------------------


def _three_continuations(min_prob):
  """A sampling suffix drafter on a corpus continuing "1 2" with "3 10 11", "3 10 12" and
  "4 20", and its state and context for a row ending in "1 2"."""
  d = SuffixDecoding(vocab=100, corpus_size=128, spec_factor=8.0, min_prob=min_prob,
                     sample_drafts=True)
  corpus = corpus_from([[1, 2, 3, 10, 11], [1, 2, 3, 10, 12], [1, 2, 4, 20]], 100, 128)
  ids, lens = padded([[9, 1, 2]], 8)
  state = d.init(corpus, ids, lens, 8)
  return d, corpus, state, DraftContext(seq=ids, seq_len=lens, prompt_len=lens)


def test_sampled_drafts_follow_the_continuation_shares():
  """Drafts drawn from the candidates' continuations: after "1 2" the corpus continues with 3
  twice and 4 once, so the first draft is 3 with probability 2/3 and its q is (2/3 at 3, 1/3
  at 4); the next position's q comes from the candidates that continued with the drawn token
  (after 3: 10 surely; after 4: 20), and a row drafts until its entries end. A greedy row
  drafts the deterministic chain with a one-hot q."""
  d, corpus, state, ctx = _three_continuations(min_prob=0.0)
  sampled = Sampling(temperature=0.8).arrays(1)
  one = lambda sp, key: d.propose(corpus, state, ctx, 4, sp, key[None])[0]
  n = 3000
  prop = jax.jit(jax.vmap(lambda key: one(sampled, key)))(jax.random.split(jax.random.key(0), n))
  toks, q, nv = np.asarray(prop.tokens[:, 0]), np.asarray(prop.q[:, 0]), np.asarray(prop.n_valid)
  threes = toks[:, 0] == 3
  assert set(toks[:, 0]) == {3, 4}
  assert abs(threes.mean() - 2 / 3) < 4 * np.sqrt(2 / 9 / n), threes.mean()
  np.testing.assert_allclose(q[:, 0, [3, 4]], np.broadcast_to([2 / 3, 1 / 3], (n, 2)), rtol=1e-6)
  assert np.all(q[:, 0].sum(axis=1) > 1 - 1e-6)
  # After 3: 10 (both candidates), then 11 or 12 (one each), then the entries end.
  np.testing.assert_array_equal(toks[threes, 1], 10)
  np.testing.assert_allclose(q[threes, 1, 10], 1.0)
  assert set(toks[threes, 2]) == {11, 12}
  np.testing.assert_allclose(q[threes][:, 2, [11, 12]], 0.5)
  np.testing.assert_array_equal(nv[threes, 0], 3)
  np.testing.assert_array_equal(toks[~threes, 1], 20)
  np.testing.assert_array_equal(nv[~threes, 0], 2)
  # The draw is the draft keys': the same key, the same drafts; a greedy row ignores them.
  again = jax.jit(jax.vmap(lambda key: one(sampled, key)))(jax.random.split(jax.random.key(0), n))
  np.testing.assert_array_equal(np.asarray(again.tokens[:, 0]), toks)
  greedy = one(Sampling(temperature=0.0).arrays(1), jax.random.key(1))
  np.testing.assert_array_equal(np.asarray(greedy.tokens[0, :3]), [3, 10, 12])
  assert int(greedy.n_valid[0]) == 3
  np.testing.assert_array_equal(np.asarray(greedy.q[0, :3]).argmax(axis=1), [3, 10, 12])
  np.testing.assert_array_equal(np.asarray(greedy.q[0, :3]).max(axis=1), 1.0)
  with pytest.raises(ValueError, match="draft keys"):
    d.propose(corpus, state, ctx, 4, sampled, None)


def test_sampled_drafts_stop_on_q_never_on_the_drawn_token():
  """min_prob stops a row where the product of the earlier drafts' q times the largest share at
  the next position falls below it: after 3 (2/3) the next shares are 1/2 each, so with
  min_prob 0.4 the third draft never counts, whichever token would be drawn there."""
  d, corpus, state, ctx = _three_continuations(min_prob=0.4)
  sp = Sampling(temperature=0.8).arrays(1)
  prop = jax.jit(jax.vmap(lambda key: d.propose(corpus, state, ctx, 4, sp, key[None])[0]))(
      jax.random.split(jax.random.key(2), 400))
  toks, nv = np.asarray(prop.tokens[:, 0]), np.asarray(prop.n_valid[:, 0])
  # 3 then 10: 2/3 x 1 >= 0.4, then 2/3 x 1/2 < 0.4: two drafts. 4 (1/3): 1/3 x 1 < 0.4 stops
  # at the second; the first counts (its largest share 2/3 >= 0.4) whatever is drawn.
  np.testing.assert_array_equal(nv[toks[:, 0] == 3], 2)
  np.testing.assert_array_equal(nv[toks[:, 0] == 4], 1)


def _sampled_drafts_carried(tiny_target, plain):
  """sample_drafts under jit, carrying the corpus across two calls on a ragged batch: plain
  greedy's tokens each time; returns the drafter and the corpus."""
  d = SuffixDecoding(vocab=tiny_target.cfg.vocab_size, corpus_size=256, sample_drafts=True)
  ids, lens = padded(PROMPTS)
  call = _carrying_call(tiny_target, d, ids, lens)
  corpus = d.params
  for i in range(2):
    toks, acc, corpus = call(corpus, jax.random.key(i))
    np.testing.assert_array_equal(np.asarray(toks), plain.tokens, err_msg=f"call {i}")
  assert int(acc) > 40
  return d, corpus


def test_sampled_drafts_greedy_equals_plain_under_jit(tiny_target, plain):
  """sample_drafts changes nothing greedy: a ragged batch carrying the corpus across calls
  under jit, and the host wrapper by name, give plain greedy's tokens."""
  v = tiny_target.cfg.vocab_size
  _sampled_drafts_carried(tiny_target, plain)
  # By name (a `jaxspec bench --workload rollout` method), through the host wrapper.
  assert resolve_drafter(tiny_target, "suffix-sampled") == SuffixDecoding(vocab=v,
                                                                          sample_drafts=True)
  host = speculative_generate(tiny_target, "suffix-sampled", PROMPTS, max_new_tokens=N_NEW,
                              num_draft_tokens=3, stop_ids=())
  np.testing.assert_array_equal(host.tokens, plain.tokens)


# Greedy: the test above; vmap: the sampled tests below and test_functional's
# test_vmap_over_keys_and_prompts.
@pytest.mark.slow
def test_sampled_drafts_greedy_equals_plain_under_vmap(tiny_target, plain):
  """Mapped calls with the carried corpus give plain greedy's tokens."""
  d, corpus = _sampled_drafts_carried(tiny_target, plain)
  rows = [padded([p]) for p in PROMPTS]
  ids4, lens4 = jnp.stack([r[0] for r in rows]), jnp.stack([r[1] for r in rows])
  out = jax.jit(jax.vmap(lambda i, l: speculative_decode(
      tiny_target, d, i, l, 0, max_new_tokens=N_NEW, num_draft_tokens=3, stop_ids=(),
      drafter_params=corpus)))(ids4, lens4)
  np.testing.assert_array_equal(np.asarray(out.tokens[:, 0]), plain.tokens)


def test_sampled_drafts_distribution_at_later_positions(small_vocab):
  """As the one-hot test above, with drafts drawn from the corpus's continuations and their q
  passed to the rejection rule: the 4th and 5th tokens of row 1 follow the target's exact
  joint, and the corpus (samples of the target itself) is accepted more often than the most
  frequent continuation is."""
  target, _ = small_vocab
  sp, tables, corpus, ids, lens, options = suffix_sampling_case(target)

  def run(d, n):
    def one(key):
      out = speculative_decode(target, d, ids, lens, key, max_new_tokens=6, num_draft_tokens=3,
                               sampling=sp, max_len=16, drafter_params=corpus, logprobs=False)
      return out.tokens[1, 3:5], out.stats.drafted[1], out.stats.accepted[1]
    toks, drafted, accepted = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(5), n))
    return toks, int(accepted.sum()) / int(drafted.sum())

  toks, rate = run(SuffixDecoding(**options, sample_drafts=True), 4000)  # as the chain test
  assert 0.1 < rate < 0.95, rate  # both paths of the rejection rule
  assert_tokens_4_5_follow(toks, tables)
  _, rate_one_hot = run(SuffixDecoding(**options), 1000)
  assert rate > rate_one_hot + 0.05, (rate, rate_one_hot)  # 0.49 against 0.38 here


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(corpus_size=1), "corpus_size >= 2"),
    (dict(vocab=0), "vocab >= 1"),
    (dict(max_match=0), "min_match <= max_match"),
    (dict(min_match=5, max_match=4), "min_match <= max_match"),
    (dict(max_match=65), "max_match <= 64"),
    (dict(candidates=0), "candidates"),
    (dict(min_prob=1.5), "min_prob"),
    (dict(spec_offset=-1), "spec_offset"),
    (dict(corpus_size=8.0), "SuffixDecoding.corpus_size"),
    (dict(sample_drafts=1), "sample_drafts must be True or False"),
    (dict(sample_drafts=True, tree=4), "drafts chains: the tree rule"),
])
def test_bad_settings(kw, match):
  with pytest.raises(ValueError, match=match):
    SuffixDecoding(**{"vocab": 100, **kw})


def test_bad_corpus_is_an_error_before_compiling(tiny_target):
  v = tiny_target.cfg.vocab_size
  d = SuffixDecoding(vocab=v, corpus_size=32)
  ids, lens = padded(PROMPTS[:1])
  before = functional._speculative_jit._cache_size()
  cases = [(SuffixCorpus.empty(32, v + 1), "vocabulary of 129, the drafter's is 128"),
           (SuffixCorpus.empty(64, v), "64,\\) token slots, the drafter 32"),
           (jnp.zeros((32,), jnp.int32), "must be a SuffixCorpus")]
  for corpus, match in cases:
    with pytest.raises(ValueError, match=match):
      speculative_decode(tiny_target, d, ids, lens, 0, max_new_tokens=4, num_draft_tokens=2,
                         drafter_params=corpus)
  with pytest.raises(ValueError, match="draft vocab 129 != target vocab 128"):
    speculative_decode(tiny_target, SuffixDecoding(vocab=v + 1), ids, lens, 0,
                       max_new_tokens=4, num_draft_tokens=2)
  with pytest.raises(ValueError, match="outside the vocabulary"):
    corpus_from([[1, 2, v]], v, 32)
  assert functional._speculative_jit._cache_size() == before  # nothing was compiled
