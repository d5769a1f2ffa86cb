"""Suffix decoding's tree mode (`SuffixDecoding(tree=...)`): the speculation tree it drafts (the
candidates' most frequent continuations, a valid tree within the node budget), exact greedy
output with the corpus carried across calls (a ragged batch, under jit and vmap), sampled output
(`generate`'s text for the key; the distribution at later positions), and bad settings."""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.api import generate, speculative_generate
from jaxspec.decoding.drafter import DraftContext
from jaxspec.decoding.functional import speculative_decode
from jaxspec.drafters import SuffixDecoding, SuffixTree, corpus_from, resolve_drafter
from jaxspec.sampling import Sampling
from helpers import assert_tokens_4_5_follow, padded, suffix_sampling_case

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 3, 4, 5, 3, 4, 5, 3], [7]]
N_NEW = 20
# After "1 2" the corpus has 3 10 11, 3 10 12 and (most recent) 4 20.
CORPUS = [[1, 2, 3, 10, 11], [1, 2, 3, 10, 12], [5, 1, 2, 4, 20]]


def _tree(drafter, rows, corpus):
  """(tokens, parents, depth) of the drafter's tree for rows (lists of ids), as lists."""
  ids, lens = padded(rows, max(len(r) for r in rows) + 1)
  state = drafter.init(corpus, ids, lens, ids.shape[1])
  ctx = DraftContext(seq=ids, seq_len=lens, prompt_len=lens)
  prop, _ = drafter.propose_tree(corpus, state, ctx, None, None)
  return [np.asarray(x).tolist() for x in (prop.tokens, prop.parents, prop.depth)]


def test_tree_keeps_the_most_frequent_continuations():
  corpus = corpus_from(CORPUS, 100, 128)
  d = SuffixDecoding(vocab=100, corpus_size=128, spec_factor=8.0, min_prob=0.0,
                     tree=SuffixTree(nodes=8, depth=4))
  assert d.name == "suffix-tree"
  tokens, parents, depth = _tree(d, [[9, 1, 2]], corpus)
  # The trie of the three continuations (shares 2/3: 3, 3 10; 1/3: the rest), by share, then
  # depth, then the most recent candidate; every entry ends after 2 or 3 tokens; the two unused
  # nodes hold -1 under the root.
  assert tokens == [[0, 3, 10, 4, 20, 12, 11, -1, -1]]
  assert parents == [[-1, 0, 1, 0, 3, 2, 2, 0, 0]]
  assert depth == [[0, 1, 2, 1, 2, 3, 3, 1, 1]]
  # A smaller budget keeps the best nodes, still a tree.
  small = d.with_tree(SuffixTree(nodes=3, depth=4))
  assert _tree(small, [[9, 1, 2]], corpus)[:2] == [[[0, 3, 10, 4]], [[-1, 0, 1, 0]]]
  # min_prob drops the nodes of share 1/3; spec_factor 0 and spec_offset 1 stop at depth 1.
  strict = SuffixDecoding(vocab=100, corpus_size=128, spec_factor=8.0, min_prob=0.5, tree=4)
  assert _tree(strict, [[9, 1, 2]], corpus)[0] == [[0, 3, 10, -1, -1]]
  shallow = SuffixDecoding(vocab=100, corpus_size=128, spec_factor=0.0, min_prob=0.0, tree=4)
  assert _tree(shallow, [[9, 1, 2]], corpus)[0] == [[0, 3, 4, -1, -1]]
  # The longest match decides alone (only "5 1 2" continues with 4 20); no match: no nodes.
  tokens, parents, _ = _tree(d, [[5, 1, 2], [40, 41]], corpus)
  assert tokens == [[0, 4, 20] + [-1] * 6, [0] + [-1] * 8]
  assert parents[0][:3] == [-1, 0, 1]
  assert d.with_tree(None) == SuffixDecoding(vocab=100, corpus_size=128, spec_factor=8.0,
                                             min_prob=0.0)


def test_random_trees_are_valid_and_ranked():
  """Over random corpora: parents precede their children, a node's depth is its parent's + 1,
  siblings hold distinct tokens, each node's path is a prefix that occurs in the corpus after
  the row's match, and shares never increase down the node order."""
  rng = np.random.default_rng(1)
  d = SuffixDecoding(vocab=6, corpus_size=512, max_match=2, spec_factor=8.0, min_prob=0.0,
                     candidates=16, tree=SuffixTree(nodes=12, depth=4))
  for trial in range(5):
    seqs = [list(rng.integers(0, 6, size=rng.integers(3, 30))) for _ in range(12)]
    corpus = corpus_from(seqs, 6, 512)
    row = [int(x) for x in rng.integers(0, 6, size=4)]
    tokens, parents, depth = (x[0] for x in _tree(d, [row], corpus))
    paths = {0: ()}
    for j in range(1, len(tokens)):
      if tokens[j] < 0:
        assert all(t < 0 for t in tokens[j:])  # unused nodes come last
        break
      assert 0 <= parents[j] < j and depth[j] == depth[parents[j]] + 1
      paths[j] = paths[parents[j]] + (tokens[j],)
    assert len(paths) > 1, f"trial {trial}: no node drafted"  # vocab 6: the row's suffix occurs
    assert len(set(paths.values())) == len(paths), f"trial {trial}: a prefix twice"
    # Each path continues an occurrence of the row's longest matched suffix in the corpus.
    text = [t for s in seqs for t in s + [-1]]
    for L in (2, 1):
      ends = [i for i in range(L - 1, len(text) - 1)
              if text[i - L + 1:i + 1] == row[-L:] and text[i + 1] >= 0]
      if ends:
        break
    conts = [tuple(text[i + 1:i + 5]) for i in ends]
    counts = [sum(c[:len(p)] == p for c in conts) for p in paths.values()]
    assert all(c > 0 for c in counts[1:]), f"trial {trial}: a path the corpus lacks"
    assert counts[1:] == sorted(counts[1:], reverse=True), f"trial {trial}: {counts}"


# -- exactness ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tiny_target):
  return generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, stop_ids=())


def test_greedy_tree_equals_plain_with_the_corpus_carried_under_jit(tiny_target, plain):
  d = SuffixDecoding(vocab=tiny_target.cfg.vocab_size, corpus_size=256,
                     tree=SuffixTree(nodes=6, depth=4))
  ids, lens = padded(PROMPTS)

  @jax.jit
  def call(corpus, key):
    out = speculative_decode(tiny_target, d, ids, lens, key, max_new_tokens=N_NEW, stop_ids=(),
                             num_draft_tokens="auto", drafter_params=corpus)
    return out.tokens, out.stats.accepted.sum(), out.drafter_params

  corpus, accepted = d.params, []
  for i in range(3):
    toks, acc, corpus = call(corpus, jax.random.key(i))
    np.testing.assert_array_equal(np.asarray(toks), plain.tokens, err_msg=f"call {i}")
    accepted.append(int(acc))
  assert call._cache_size() == 1
  assert accepted[1] > accepted[0] + 40 and accepted[2] > accepted[0] + 40, accepted


def test_greedy_tree_equals_plain_under_vmap(tiny_target, plain):
  d = SuffixDecoding(vocab=tiny_target.cfg.vocab_size, corpus_size=128, tree=5)
  corpus = corpus_from([p + list(t) for p, t in zip(PROMPTS, plain.tokens)],
                       tiny_target.cfg.vocab_size, 128)
  rows = [padded([p]) for p in PROMPTS]
  ids4, lens4 = jnp.stack([r[0] for r in rows]), jnp.stack([r[1] for r in rows])
  out = jax.jit(jax.vmap(lambda i, l, c: speculative_decode(
      tiny_target, d, i, l, 0, max_new_tokens=N_NEW, stop_ids=(), num_draft_tokens="auto",
      drafter_params=c),
      in_axes=(0, 0, None)))(ids4, lens4, corpus)
  np.testing.assert_array_equal(np.asarray(out.tokens[:, 0]), plain.tokens)
  assert out.drafter_params.tokens.shape == (4, 128)
  assert int(out.stats.accepted.sum()) > 0


def test_sampled_tree_writes_generates_text(tiny_target):
  """Sampled, the tree rule draws every position with the target's key for it: the text is
  `generate`'s for the key, whatever the corpus proposes (here a corpus of that very text, so
  most of it is accepted)."""
  sp = Sampling(temperature=1.0, top_k=40)
  ref = generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, sampling=sp, key=6, stop_ids=())
  d = SuffixDecoding(vocab=tiny_target.cfg.vocab_size, corpus_size=256, tree=8)
  ids, lens = padded(PROMPTS)
  for corpus in (d.params, corpus_from([p + list(t) for p, t in zip(PROMPTS, ref.tokens)],
                                       tiny_target.cfg.vocab_size, 256)):
    out = speculative_decode(tiny_target, d, ids, lens, jax.random.key(6), max_new_tokens=N_NEW,
                             sampling=sp, stop_ids=(), num_draft_tokens="auto",
                             drafter_params=corpus)
    np.testing.assert_array_equal(np.asarray(out.tokens), ref.tokens)
  assert int(out.stats.accepted.sum()) > 40  # the corpus of the very text
  # The host wrapper (its rows' own suffixes, no corpus).
  host = speculative_generate(tiny_target, d, PROMPTS, max_new_tokens=N_NEW, sampling=sp, key=6,
                              stop_ids=(), num_draft_tokens="auto")
  np.testing.assert_array_equal(host.tokens, ref.tokens)


@pytest.mark.parametrize("sampling", [None, Sampling(temperature=1.0, top_k=40)])
def test_a_tree_step_without_candidates_is_a_plain_step(tiny_target, sampling):
  """Where no live row has a candidate node (nothing in the rows or the corpus matches yet),
  the step is a one-token pass, as a chain step's fallback, not a pass over N filler nodes; the
  text stays `generate`'s (greedy, and sampled for the key)."""
  prompts = [[7], [40, 41]]
  ref = generate(tiny_target, prompts, max_new_tokens=12, sampling=sampling, key=3, stop_ids=())
  d = SuffixDecoding(vocab=tiny_target.cfg.vocab_size, corpus_size=64, tree=4)
  ids, lens = padded(prompts, 2)
  out = speculative_decode(tiny_target, d, ids, lens, jax.random.key(3), max_new_tokens=12,
                           sampling=sampling, stop_ids=(), num_draft_tokens="auto")
  np.testing.assert_array_equal(np.asarray(out.tokens), ref.tokens)
  ks = np.asarray(out.stats.k_history)[:int(out.stats.target_passes)].tolist()
  assert ks[0] == 0 and set(ks) <= {0, d.tree.depth}, ks  # the first step has no match
  assert int((np.asarray(out.stats.spec_row_steps) < np.asarray(out.stats.row_steps)).sum()) == 2


def test_suffix_tree_by_name(tiny_target, plain):
  """"suffix-tree" (a `jaxspec bench --workload rollout` method) resolves to the default tree,
  and runs through the host wrapper with num_draft_tokens "auto"."""
  v = tiny_target.cfg.vocab_size
  assert resolve_drafter(tiny_target, "suffix-tree") == SuffixDecoding(vocab=v, tree=SuffixTree())
  assert resolve_drafter(tiny_target, "suffix-tree").name == "suffix-tree"
  host = speculative_generate(tiny_target, "suffix-tree", PROMPTS, max_new_tokens=N_NEW,
                              num_draft_tokens="auto", stop_ids=())
  np.testing.assert_array_equal(host.tokens, plain.tokens)


# slow: the tree's sampled text is `generate`'s for the key token for token
# (test_sampled_tree_writes_generates_text, a stronger check than a chi-square, as for the
# n-gram drafter), and test_suffix's sampled-drafts test keeps the chi-square of this case.
@pytest.mark.slow
def test_sampled_tree_distribution_at_later_positions(small_vocab):
  """As test_suffix's chain test: the 4th and 5th new tokens of row 1 over 4000 mapped calls,
  drafting a tree from row 0 and a corpus of earlier samples, chi-square against the exact
  joint, with nodes both accepted and rejected."""
  target, _ = small_vocab
  sp, tables, corpus, ids, lens, options = suffix_sampling_case(target)
  d = SuffixDecoding(**options, tree=SuffixTree(nodes=6, depth=3))

  def one(key):
    out = speculative_decode(target, d, ids, lens, key, max_new_tokens=6, sampling=sp,
                             max_len=24, drafter_params=corpus, logprobs=False,
                             num_draft_tokens="auto")
    return out.tokens[1, 3:5], out.stats.emitted[1], out.stats.row_steps[1]

  n = 4000
  toks, emitted, steps = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(5), n))
  tau = int(emitted.sum()) / int(steps.sum())
  assert 1.2 < tau < 3.5, tau  # nodes accepted and rejected
  assert_tokens_4_5_follow(toks, tables)


# -- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(tree=0), "SuffixTree.nodes"),
    (dict(tree=300), "static budget"),
    (dict(tree="wide"), "a SuffixTree, a node count or None"),
    (dict(tree=SuffixTree(nodes=40, depth=2), candidates=16), "candidates x depth"),
])
def test_bad_tree_settings(kw, match):
  with pytest.raises(ValueError, match=match):
    SuffixDecoding(**{"vocab": 100, **kw})


def test_a_tree_takes_no_fixed_k(tiny_target):
  d = SuffixDecoding(vocab=tiny_target.cfg.vocab_size, tree=4)
  ids, lens = padded(PROMPTS[:1])
  with pytest.raises(ValueError, match="leave num_draft_tokens at \"auto\""):
    speculative_decode(tiny_target, d, ids, lens, 0, max_new_tokens=4, num_draft_tokens=2)
