"""Suffix decoding (Oliaro et al. 2024, arXiv 2411.04975): `SuffixDecoding` drafts what followed
the longest earlier occurrences of a row's last tokens, in every row of the batch and in a corpus
of earlier outputs carried from call to call.

The corpus is a `SuffixCorpus`: a ring buffer of `corpus_size` token slots, fixed in size, that
the drafter takes as its params. Each call reads it (it is the drafter's `params`, so a new
corpus of the same size reuses the compiled loop) and returns it with the call's rows appended
(`DecodeOutput.drafter_params`), oldest entries overwritten first:

    drafter = SuffixDecoding(vocab=target.vocab_size)
    corpus = drafter.params                                     # empty
    for batch in rollouts:
      out = speculative_decode(target, drafter, ids, lens, key, max_new_tokens=256,
                               num_draft_tokens=8, drafter_params=corpus)
      corpus = out.drafter_params                               # this call's rows appended

Matching is a direct scan, vectorised over positions: every step compares each row's last
`max_match` tokens with every position of the corpus and of the batch's rows (O((C + B S)
max_match) per row, no host work), so it runs inside the loop under jit, vmap and scan and is
deterministic. Among the positions with the longest match (up to `candidates` of them, most
recent first) the draft follows the continuation most of them agree on, token by token, as the
suffix tree's most frequent child; each draft's confidence is the share of the remaining
candidates that agree, and a row stops drafting where the product of the confidences falls
below `min_prob`, or after `spec_factor` x the match length tokens. So the draft length of a
row follows its match (`Proposal.n_valid`), capped by the step's k.

`SuffixDecoding(..., tree=N)` (or `tree=SuffixTree(nodes=N, depth=D)`) drafts a speculation
tree instead, as the paper does: the candidates' continuations merged into a trie, each prefix
scored by the product of the empirical branch shares down to it (the share of candidates
continuing with it), the best N kept (`speculation_tree`); the loop verifies all N in one target
pass with the tree rule (`jaxspec.decoding.tree`), so a branch where the earlier outputs
disagree tries several continuations at once. The tree fixes the step's shape: its width N + 1
is verified at every step where some live row has a candidate (otherwise the step is a plain
one-token pass), so it pays where a wide pass costs little more than a narrow one.

Exact: the proposal of row b is a deterministic function of the corpus and of tokens already
emitted (its own and the other rows'), never of the noise its own next tokens will be drawn
with. Row b's token j is drawn with fold_in(row_key_b, j) and the verify pass's rejection rule;
other rows' tokens depend on their own keys (and on row b's earlier tokens only), so the drafts
are fixed before row b's future randomness is used, and rejection sampling of a deterministic
(one-hot) draft then leaves row b's output distribution the target's. Greedy output equals plain
greedy output token for token. A tree step draws the token of every position with the key
plain decoding would use there and follows the child holding it (the tree rule's coupled form),
so several children per node stay exact and sampled text is `generate`'s for the key.

`SuffixDecoding(sample_drafts=True)` samples its chain in sampled rows instead: at draft
position d, q_d is the empirical distribution of the next token over the remaining candidates
(those that continued with drafts 1..d-1 and whose entry goes on: the suffix tree's child counts
over its parent's), the draft is the token of one of them drawn uniformly (so it has probability
q_d(x) exactly), and the proposal carries q ([B, k, V], dense as a draft model's: building it
costs less than the one-hot rule's draw of the target's token over the vocabulary at every
position). The rejection rule then accepts with probability sum_x min(p(x), q(x)), where the
one-hot draft's is p(x) of the single most frequent x; when earlier rollouts are samples of the
same target, q resembles p and the difference is large. Still exact: q_d depends on the
corpus, on tokens already emitted (the row's and other rows') and on drafts 1..d-1, and the draw
of x_d on the step's draft keys only (split per position from the loop's draft key, never the
position keys the verify pass draws the row's tokens and uniforms with), so each x_d is
distributed as q_d independently of the verification's noise, which is what rejection sampling
needs; whether draft d counts (`Proposal.n_valid`) reads q_d and the earlier drafts, never
x_d. Greedy rows keep the deterministic chain (with a one-hot q), so greedy output is plain
greedy's. Sampled text is exact in distribution but no longer `generate`'s for the same key (a
rejection draws the residual with its own stream), as with a sampling `DraftModel`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax

from jaxspec import sampling as sampling_lib
from jaxspec.checks import check_int, is_int
from jaxspec.decoding.drafter import DraftContext, Drafter, Proposal, split_draft_keys
from jaxspec.decoding.tree import MAX_NODES, TreeProposal
from jaxspec.pytree import pytree_dataclass as _pytree

# Marks empty slots and the end of every corpus entry and row: it equals no token and no
# context, so no match runs across two entries.
SEP = -1
# A context position before the start of a sequence (matches nothing, SEP included).
_NONE = -2


@dataclasses.dataclass
class SuffixCorpus:
  """The corpus of earlier outputs: a ring of `corpus_size` token slots.

  Entries (a row's last prompt tokens and its output, then `SEP`) are written at `end` and wrap
  around, overwriting the oldest; empty slots hold `SEP`. `vocab_size` is static (the pytree's
  metadata): the token ids it holds belong to that vocabulary.
  """

  tokens: jax.Array  # [C] int32 token ids, SEP between entries and in empty slots
  end: jax.Array  # [] int32 the slot the next token goes to (the oldest slot when full)
  vocab_size: int = 0

  @classmethod
  def empty(cls, corpus_size: int, vocab_size: int) -> SuffixCorpus:
    return cls(tokens=jnp.full((corpus_size,), SEP, jnp.int32), end=jnp.zeros((), jnp.int32),
               vocab_size=int(vocab_size))

  def ordered(self) -> jax.Array:
    """[C] the slots oldest first (the newest entry, then its SEP, last)."""
    return jnp.roll(self.tokens, -self.end)


jax.tree_util.register_dataclass(SuffixCorpus, data_fields=["tokens", "end"],
                                 meta_fields=["vocab_size"])


@_pytree
@dataclasses.dataclass
class SuffixState:
  corpus: jax.Array  # [C] int32 the corpus oldest first (`SuffixCorpus.ordered`), per call


def append_rows(corpus: SuffixCorpus, seq: jax.Array, seq_len: jax.Array, start: jax.Array
                ) -> SuffixCorpus:
  """The corpus with seq[b, start[b]:seq_len[b]] and a `SEP` appended for every row b, in row
  order; only the last C tokens of what is appended are written when it holds more, so slots
  are written at most once (a scatter's duplicates have no defined order).

  Args:
    seq: [B, S] int32 token ids; seq_len, start: [B] int32, 0 <= start <= seq_len <= S.
  """
  c = corpus.tokens.shape[0]
  b, s = seq.shape
  lens = seq_len - start + 1  # [B] with the separator
  offs = jnp.cumsum(lens) - lens  # where each row's entry starts in what is appended
  total = jnp.sum(lens)
  i = jnp.arange(s + 1)[None, :]
  src = jnp.take_along_axis(seq, jnp.minimum(start[:, None] + i, s - 1), axis=1)
  tok = jnp.where(i < lens[:, None] - 1, src, SEP)  # [B, S + 1]
  g = offs[:, None] + i  # index in what is appended
  keep = (i < lens[:, None]) & (g >= total - c)
  slot = jnp.where(keep, (corpus.end + g) % c, c)  # c: dropped
  tokens = corpus.tokens.at[slot.reshape(-1)].set(tok.reshape(-1), mode="drop")
  return SuffixCorpus(tokens=tokens, end=((corpus.end + total) % c).astype(jnp.int32),
                      vocab_size=corpus.vocab_size)


def corpus_from(tokens, vocab_size: int, corpus_size: int) -> SuffixCorpus:
  """A corpus holding the given token sequences (a list of lists of ids, e.g. earlier outputs),
  oldest first; when they hold more than corpus_size tokens (with a separator each) the oldest
  are evicted. Raises ValueError for an id outside [0, vocab_size)."""
  import numpy as np
  out = SuffixCorpus.empty(corpus_size, vocab_size)
  seqs = [np.asarray(t, np.int64).reshape(-1) for t in tokens]
  for j, t in enumerate(seqs):
    if t.size and (t.min() < 0 or t.max() >= vocab_size):
      bad = int(t.min()) if t.min() < 0 else int(t.max())
      raise ValueError(f"corpus sequence {j} holds token id {bad}, outside the vocabulary"
                       f" [0, {vocab_size})")
  seqs = [t for t in seqs if t.size]
  if not seqs:
    return out
  width = max(t.size for t in seqs)
  arr = np.zeros((len(seqs), width), np.int32)
  for j, t in enumerate(seqs):
    arr[j, :t.size] = t
  lens = jnp.asarray([t.size for t in seqs], jnp.int32)
  return append_rows(out, jnp.asarray(arr), lens, jnp.zeros_like(lens))


@dataclasses.dataclass(frozen=True)
class SuffixTree:
  """The shape of `SuffixDecoding`'s speculation tree: `nodes` candidate tokens verified per
  step (the root excluded), at most `depth` deep (a row also stops at spec_factor x its match +
  spec_offset)."""

  nodes: int = 24
  depth: int = 8

  def __post_init__(self):
    for name in ("nodes", "depth"):
      v = getattr(self, name)
      if not is_int(v, numpy=False) or v < 1:
        raise ValueError(f"SuffixTree.{name} must be an integer >= 1, got {v!r}")
    if self.nodes + 1 > MAX_NODES:
      raise ValueError(f"SuffixTree(nodes={self.nodes}) exceeds the static budget of"
                       f" {MAX_NODES - 1} nodes")
    if self.depth > 64:
      raise ValueError(f"SuffixTree.depth must be <= 64, got {self.depth}")

  @property
  def num_nodes(self) -> int:
    """Nodes including the root (the verify pass's width)."""
    return self.nodes + 1

  def describe(self) -> str:
    return f"suffix speculation tree ({self.nodes} nodes, depth {self.depth})"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SuffixDecoding(Drafter):
  """Suffix decoding over the batch's rows and a carried corpus of earlier outputs (see the
  module docstring). Deterministic (one-hot q) unless `sample_drafts`; costs no model pass.

  Attributes:
    vocab: the target's vocabulary size (`vocab_size`; the corpus holds its token ids).
    corpus_size: C, token slots of the corpus ring (entries and their separators).
    max_match: the longest suffix matched (the scan is unrolled over it).
    min_match: a row drafts only from a match at least this long.
    candidates: matches whose continuations vote (the longest, most recent first).
    min_prob: a row stops drafting where the product of its drafts' confidences (the share of
      candidates agreeing with each) falls below this.
    spec_factor, spec_offset: a row drafts at most spec_factor x match length + spec_offset
      tokens (and at most the step's k).
    context: prompt tokens kept before each output in the corpus (so a later call's first
      tokens find the continuation of the same prompt); default max_match.
    tree: None (the default) drafts one chain a step; a `SuffixTree` (or its node count)
      drafts a speculation tree instead (`speculation_tree`: the candidates' most frequent
      continuations, several per branch), verified in one target pass by the tree rule. A tree
      sets the draft's shape: call the loop with num_draft_tokens="auto" (no AutoK).
    sample_drafts: in sampled rows (temperature > 0), draw each draft from the candidates'
      empirical continuation distribution q and pass q to the rejection rule, which then
      accepts with probability sum_x min(p, q) rather than p(x) for the most frequent x; greedy
      rows keep the most frequent continuation. Chains only (no `tree`).
  """

  vocab: int
  corpus_size: int = 8192
  max_match: int = 16
  min_match: int = 1
  candidates: int = 32
  min_prob: float = 0.1
  spec_factor: float = 1.0
  spec_offset: int = 1
  context: int | None = None
  tree: SuffixTree | None = None
  sample_drafts: bool = False
  name: str = "suffix"
  free_proposals = True  # a scan, not a model pass

  def __post_init__(self):
    if self.tree is not None and not isinstance(self.tree, SuffixTree):
      if not is_int(self.tree, numpy=False):
        raise ValueError(f"SuffixDecoding.tree must be a SuffixTree, a node count or None, got"
                         f" {self.tree!r}")
      object.__setattr__(self, "tree", SuffixTree(nodes=self.tree))
    if not isinstance(self.sample_drafts, bool):
      raise ValueError(f"SuffixDecoding.sample_drafts must be True or False, got"
                       f" {self.sample_drafts!r}")
    if self.sample_drafts and self.tree is not None:
      raise ValueError("SuffixDecoding(sample_drafts=True) drafts chains: the tree rule verifies"
                       " deterministic candidates only; drop tree= or sample_drafts=")
    if self.tree is not None and self.name == "suffix":
      object.__setattr__(self, "name", "suffix-tree")
    for name in ("vocab", "corpus_size", "max_match", "min_match", "candidates",
                 "spec_offset"):  # Python ints: the drafter is a static argument
      check_int(f"SuffixDecoding.{name}", getattr(self, name), numpy=False)
    if self.context is not None:
      check_int("SuffixDecoding.context", self.context, numpy=False)
    if self.vocab < 1 or self.corpus_size < 2:
      raise ValueError(f"SuffixDecoding needs vocab >= 1 and corpus_size >= 2, got"
                       f" vocab={self.vocab}, corpus_size={self.corpus_size}")
    if not 1 <= self.min_match <= self.max_match <= 64:
      raise ValueError(f"need 1 <= min_match <= max_match <= 64, got min_match={self.min_match},"
                       f" max_match={self.max_match} (the scan is traced once per matched"
                       " position)")
    if not 1 <= self.candidates <= 256:
      raise ValueError(f"SuffixDecoding.candidates must be in [1, 256], got {self.candidates}")
    if not 0.0 <= float(self.min_prob) <= 1.0 or float(self.spec_factor) < 0:
      raise ValueError(f"need 0 <= min_prob <= 1 and spec_factor >= 0, got"
                       f" min_prob={self.min_prob}, spec_factor={self.spec_factor}")
    if self.spec_offset < 0 or (self.context is not None and self.context < 0):
      raise ValueError(f"spec_offset and context must be >= 0, got spec_offset="
                       f"{self.spec_offset}, context={self.context}")
    if self.tree is not None and self.tree.nodes > min(self.candidates, self.corpus_size) \
        * self.tree.depth:
      raise ValueError(f"a tree of {self.tree.nodes} nodes needs more than candidates x depth ="
                       f" {self.candidates} x {self.tree.depth} prefixes: raise candidates or"
                       " lower SuffixTree.nodes")

  def with_tree(self, tree) -> SuffixDecoding:
    """This drafter drafting a speculation tree (a `SuffixTree` or a node count), or chains
    (None)."""
    base = self.name.removesuffix("-tree")
    return dataclasses.replace(self, tree=tree, name=base)

  @property
  def vocab_size(self) -> int:
    return self.vocab

  @property
  def params(self) -> SuffixCorpus:
    """An empty corpus of this drafter's size and vocabulary."""
    return SuffixCorpus.empty(self.corpus_size, self.vocab_size)

  def check_params(self, params) -> None:
    """Raises ValueError unless `params` is a `SuffixCorpus` of this drafter's size and
    vocabulary (before anything is traced)."""
    if not isinstance(params, SuffixCorpus):
      raise ValueError(f"the suffix drafter's params must be a SuffixCorpus (drafter.params, or"
                       f" a call's DecodeOutput.drafter_params), got {type(params).__name__}")
    if params.vocab_size != self.vocab_size:
      raise ValueError(f"the corpus holds ids of a vocabulary of {params.vocab_size}, the"
                       f" drafter's is {self.vocab_size}: a corpus is made for one tokenizer;"
                       " start from drafter.params for this target")
    shape = tuple(getattr(params.tokens, "shape", ()))
    if shape != (self.corpus_size,) or tuple(getattr(params.end, "shape", (1,))) != ():
      raise ValueError(f"the corpus has {shape} token slots, the drafter {self.corpus_size}:"
                       f" use SuffixDecoding(corpus_size={shape[0] if len(shape) == 1 else '?'},"
                       " ...) or a corpus from this drafter's params")

  def init(self, params, prompt, prompt_len, max_len, hidden=None):
    return SuffixState(corpus=params.ordered())

  def commit(self, params, state, ctx):
    return state  # the rows are read from ctx.seq at every step

  def next_params(self, params, state, ctx: DraftContext) -> SuffixCorpus:
    """The corpus for the next call: `params` with every row's last `context` prompt tokens
    and its output appended."""
    keep = self.max_match if self.context is None else self.context
    start = jnp.maximum(ctx.prompt_len - keep, 0)
    return append_rows(params, ctx.seq, ctx.seq_len, start)

  def _matches(self, state, ctx, width: int):
    """The candidate matches of every row: (cont [B, N, width] the `width` tokens after each,
    SEP past an entry's end; alive [B, N] the real candidates; best [B] the longest match)."""
    seq, n = ctx.seq, ctx.seq_len
    b, s = seq.shape
    m = self.max_match
    # The haystack: the corpus, then every row up to its length, each followed by a SEP.
    rows = jnp.where(jnp.arange(s + 1)[None, :] < n[:, None],
                     jnp.pad(seq, ((0, 0), (0, 1))), SEP)
    hay = jnp.concatenate([state.corpus, rows.reshape(-1)])  # [H]
    h = hay.shape[0]
    idx = n[:, None] - m + jnp.arange(m)[None, :]
    tail = jnp.where(idx >= 0, jnp.take_along_axis(seq, jnp.maximum(idx, 0), axis=1), _NONE)
    # match[b, j]: how many of row b's last tokens end at position j (at most m).
    run = jnp.ones((b, h), bool)
    match = jnp.zeros((b, h), jnp.int32)
    for i in range(m):
      shifted = jnp.concatenate([jnp.full((i,), SEP, hay.dtype), hay[:h - i]])  # hay[j - i]
      run = run & (shifted[None, :] == tail[:, m - 1 - i:m - i])
      match = match + run
    # A match counts only where something follows it (not a row's own last token, nor an
    # entry's end).
    follows = jnp.concatenate([hay[1:], jnp.full((1,), SEP, hay.dtype)]) >= 0
    match = jnp.where(follows[None, :], match, 0)
    best = jnp.max(match, axis=1)  # [B]
    nc = min(self.candidates, h)
    # The longest matches, most recent (furthest into the haystack) first: slot r of cand holds
    # the r-th most recent (a scatter of distinct slots; lax.top_k over [B, H] costs ten times
    # the scan on XLA's CPU).
    longest = match == best[:, None]
    rank = jnp.cumsum(longest[:, ::-1], axis=1, dtype=jnp.int32)[:, ::-1] - 1
    slot = jnp.where(longest & (rank < nc), rank, nc)  # nc: dropped
    cand = jnp.zeros((b, nc), jnp.int32).at[jnp.arange(b)[:, None], slot].set(
        jnp.broadcast_to(jnp.arange(h, dtype=jnp.int32), (b, h)), mode="drop")
    alive = (jnp.arange(nc)[None, :] < jnp.sum(longest, axis=1)[:, None]) \
        & (best >= self.min_match)[:, None]
    padded = jnp.concatenate([hay, jnp.full((width + 1,), SEP, hay.dtype)])
    cont = padded[cand[:, :, None] + 1 + jnp.arange(width)[None, None, :]]  # [B, N, width]
    return cont, alive, best

  def _limit(self, best, width: int):
    """[B] the most tokens a row drafts: spec_factor x its match + spec_offset, at most width."""
    return jnp.minimum(jnp.floor(self.spec_factor * best).astype(jnp.int32) + self.spec_offset,
                       width)

  def propose(self, params, state, ctx, k, sp, keys):
    cont, alive, best = self._matches(state, ctx, k)
    if not self.sample_drafts:
      return self._most_frequent(cont, alive, best, k), state
    if keys is None:
      raise ValueError("SuffixDecoding(sample_drafts=True) draws its drafts with the step's"
                       " draft keys: call propose with keys (the loop passes them)")
    return self._sampled(cont, alive, best, k, sp, keys), state

  def _most_frequent(self, cont, alive, best, k: int) -> Proposal:
    """The deterministic chain: at each position the token most candidates agree on."""
    b = cont.shape[0]
    limit = self._limit(best, k)
    prob = jnp.ones((b,), jnp.float32)
    going = jnp.ones((b,), bool)
    tokens, valid = [], []
    for d in range(k):
      t = cont[:, :, d]  # [B, N]
      votes = jnp.sum((t[:, :, None] == t[:, None, :]) & alive[:, None, :], axis=2)
      votes = jnp.where(alive, votes, 0)
      pick = jnp.argmax(votes, axis=1)  # the most recent of the most agreed-on
      tok = jnp.take_along_axis(t, pick[:, None], axis=1)[:, 0]
      v = jnp.take_along_axis(votes, pick[:, None], axis=1)[:, 0]
      prob = prob * v / jnp.maximum(jnp.sum(alive, axis=1), 1)
      going = going & (v > 0) & (tok >= 0) & (prob >= self.min_prob) & (d < limit)
      tokens.append(jnp.maximum(tok, 0))
      valid.append(going)
      alive = alive & (t == tok[:, None])
    n_valid = jnp.sum(jnp.stack(valid, axis=1), axis=1).astype(jnp.int32)
    return Proposal(tokens=jnp.stack(tokens, axis=1).astype(jnp.int32), n_valid=n_valid)

  def _sampled(self, cont, alive, best, k: int, sp, keys) -> Proposal:
    """Drafts drawn from the candidates' empirical continuation distribution, with q.

    At position d, q_d(x) is the share of the remaining candidates (those that continued with
    the drafts drawn so far and whose entry goes on) continuing with x: the suffix tree's child
    counts over the parent's. The draft is the token of one such candidate drawn uniformly with
    the row's draft key for position d, so it has probability q_d(x) exactly. Whether draft d
    counts reads q_d and the earlier drafts only (some candidate goes on, the product of the
    earlier drafts' q times q_d's largest share is at least `min_prob`, d below the match's
    limit), never the token drawn at d (`jaxspec.decoding.drafter`'s rule). Greedy rows
    (temperature 0) take the deterministic chain, with a one-hot q.
    """
    b = cont.shape[0]
    v = self.vocab_size
    det = None  # the deterministic chain of greedy rows, with its one-hot q
    if sp is not None:
      det = self._most_frequent(cont, alive, best, k)
      det = dataclasses.replace(det, q=jax.nn.one_hot(det.tokens, v, dtype=jnp.float32))
      if sp.all_greedy:  # every row takes it: no draw compiled
        return det
    rows = jnp.arange(b)
    limit = self._limit(best, k)
    step_keys = split_draft_keys(self, keys, None, k)  # [B, k] (never coupled)
    prob = jnp.ones((b,), jnp.float32)
    going = jnp.ones((b,), bool)
    tokens, qs, valid = [], [], []
    for d in range(k):
      t = cont[:, :, d]  # [B, N]
      ok = alive & (t >= 0)  # the candidates whose entry continues
      n_ok = jnp.sum(ok, axis=1)  # [B]
      weight = jnp.where(ok, 1.0 / jnp.maximum(n_ok, 1)[:, None], 0.0)  # [B, N]
      q = jnp.zeros((b, v), jnp.float32).at[rows[:, None], jnp.where(ok, t, v)].add(
          weight, mode="drop")  # [B, V] the shares
      pick = sampling_lib.draw(step_keys[:, d], ok.astype(jnp.float32))
      tok = jnp.where(n_ok > 0, t[rows, pick], 0)
      going = going & (n_ok > 0) & (prob * jnp.max(q, axis=1) >= self.min_prob) & (d < limit)
      prob = prob * q[rows, tok]
      tokens.append(tok)
      qs.append(q)
      valid.append(going)
      alive = ok & (t == tok[:, None])
    sampled = Proposal(tokens=jnp.stack(tokens, axis=1).astype(jnp.int32),
                       q=jnp.stack(qs, axis=1),
                       n_valid=jnp.sum(jnp.stack(valid, axis=1), axis=1).astype(jnp.int32))
    if det is None:
      return sampled
    greedy = sp.temperature == 0  # [B]
    per_row = lambda a, c: jnp.where(greedy.reshape((-1,) + (1,) * (a.ndim - 1)), a, c)
    return Proposal(tokens=per_row(det.tokens, sampled.tokens), q=per_row(det.q, sampled.q),
                    n_valid=per_row(det.n_valid, sampled.n_valid))

  def propose_tree(self, params, state, ctx, sp, keys):
    """The speculation tree of every row (`speculation_tree`): the continuations of its
    candidate matches merged into a trie, the `tree.nodes` most frequent prefixes kept.
    Deterministic, so the tree rule verifies it exactly (several children per node included)."""
    depth = self.tree.depth
    cont, alive, best = self._matches(state, ctx, depth)
    prop = speculation_tree(cont, alive, self._limit(best, depth), self.tree.nodes,
                            self.min_prob)
    return prop, state


def speculation_tree(cont: jax.Array, alive: jax.Array, limit: jax.Array, nodes: int,
                     min_prob: float) -> TreeProposal:
  """The suffix tree's speculation tree from a row's candidate matches.

  The candidates' continuations form a trie: its node at depth d is a distinct prefix of d
  tokens, and the product of the empirical branch shares down to it (count of children over
  count of parent, at every branch) is the share of the candidates continuing with that prefix.
  The `nodes` prefixes of highest share (at least `min_prob`, at most limit[b] deep, never
  across an entry's end) are kept; ties go to the shallower, then to the most recent candidate,
  so a kept node's parent (whose share is at least the node's, one level up) is always kept:
  the result is a tree. Unused nodes hold token -1 under the root (never accepted).

  Args:
    cont: [B, N, D] int32 the D tokens after each candidate (SEP past an entry's end), the most
      recent candidate first.
    alive: [B, N] bool the real candidates.
    limit: [B] int32 the deepest node per row.
    nodes: static, candidate nodes (the root excluded).
  Returns:
    a `TreeProposal` of nodes + 1 nodes, the most frequent first (node 0: the root).
  """
  b, n, d = cont.shape
  rows = jnp.arange(b)[:, None]
  # peers[b, i, e, j]: candidate j is alive and continues with candidate i's first e + 1 tokens.
  differ = jnp.cumsum(cont[:, :, None, :] != cont[:, None, :, :], axis=3) > 0  # [B, i, j, D]
  peers = jnp.moveaxis(~differ, 3, 2) & alive[:, None, None, :]  # [B, i, D, j]
  count = jnp.sum(peers, axis=3)  # [B, N, D]
  real = (jnp.cumsum(cont < 0, axis=2) == 0) & alive[:, :, None] \
      & (jnp.arange(d)[None, None, :] < limit[:, None, None])
  # A prefix is taken by the first (most recent) candidate continuing with it.
  first = jnp.argmax(peers, axis=3)  # [B, N, D] the first such j (i itself when alive)
  rep = real & (first == jnp.arange(n)[None, :, None])
  share = count / jnp.maximum(jnp.sum(alive, axis=1), 1)[:, None, None]
  keep = rep & (share >= min_prob)
  # Order: count, then shallower, then the earlier (candidate, depth) slot; strictly above the
  # key of every descendant, so every kept node's parent is ranked before it.
  flat = jnp.arange(n * d, dtype=jnp.int32).reshape(n, d)
  level = jnp.arange(d, dtype=jnp.int32)[None, :]
  key = (count * (d + 1) + (d - level)) * (n * d) + (n * d - 1 - flat)
  top, sel = lax.top_k(jnp.where(keep, key, -1).reshape(b, n * d), nodes)  # [B, M]
  valid = top >= 0
  ci, lv = sel // d, sel % d
  tok = cont[rows, ci, lv]
  # The parent: the representative of the prefix one token shorter, a node ranked earlier.
  up = jnp.maximum(lv - 1, 0)
  par_flat = first[rows, ci, up] * d + up  # [B, M]
  pos = jnp.argmax(sel[:, None, :] == par_flat[:, :, None], axis=2)  # [B, M]
  parent = jnp.where(valid & (lv > 0), pos + 1, 0)
  root = lambda v: jnp.full((b, 1), v, jnp.int32)
  return TreeProposal(
      tokens=jnp.concatenate([root(0), jnp.where(valid, tok, -1)], axis=1).astype(jnp.int32),
      parents=jnp.concatenate([root(-1), parent], axis=1).astype(jnp.int32),
      depth=jnp.concatenate([root(0), jnp.where(valid, lv + 1, 1)], axis=1).astype(jnp.int32))
