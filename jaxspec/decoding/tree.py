"""Tree speculation: verify many candidate continuations in one target pass, exactly.

A tree of N nodes per row is flattened into N tokens: node 0 is the root (the last accepted
token, the input a chain's verify pass starts with) and nodes 1..N-1 are candidates, each after
its parent (parents[j] < j). The target runs one pass over all N with rotary position
length + depth and an ancestor-only mask on top of the causal cache (`verify_tree`);
`tree_accept` walks from the root with the recursive rejection rule for deterministic
candidates, and the accepted path's keys, values and hidden states are gathered (`gather_path`)
so the rest of the loop sees exactly what a chain of the same accepted length would give.

Tree shapes:
  `Tree`        a static tree given as paths of ranks (Medusa's `medusa_choices`): path
                (r_1, .., r_d) is the r_d-th candidate (by draft score) of depth d under the node
                (r_1, .., r_{d-1}). `Tree.from_accuracies` builds one from measured per-depth top-k
                accuracies with the greedy expected-acceptance algorithm.
  `DynamicTree` EAGLE-2's dynamic tree: expand the top-k children of the `topk` best frontier
                nodes by cumulative draft log-probability for `depth` steps, then keep the best
                `total_tokens` nodes.

Exactness. Candidates are a deterministic function of the context (top-k of the draft's scores,
never sampled), so at a node with target distribution p and children x_1, x_2, .. tried in
order, child x_i is accepted with probability p'(x_i), where p' is p renormalised after removing
the tokens of the children already rejected; if none is accepted the token is drawn from the
remaining p'. Each token emitted is then distributed exactly as p (SpecInfer's multi-candidate
rule with one-hot drafts). A greedy p is one-hot, and the rule becomes: take the child equal to
the argmax, else emit the argmax.
"""

from __future__ import annotations

import dataclasses
import heapq
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sampling as sampling_lib
from jaxspec.checks import is_int
from jaxspec.decoding import protocol
from jaxspec.lm import Hidden
from jaxspec.pytree import pytree_dataclass as _pytree

# The most nodes (root included) a tree may have: the verify pass's width.
MAX_NODES = 256


@dataclasses.dataclass(frozen=True)
class Tree:
  """A static tree: `paths` of ranks, sorted by (depth, path); the root is implicit."""

  paths: tuple[tuple[int, ...], ...]

  @classmethod
  def from_paths(cls, paths: Sequence[Sequence[int]], *, max_depth: int | None = None,
                 max_nodes: int = MAX_NODES - 1) -> Tree:
    """Validates `paths` (Medusa's `medusa_choices` format: [[0], [1], [0, 0], ...]).

    Every path's prefixes must be paths too; at most `max_depth` deep (a Medusa drafter's head
    count) and `max_nodes` paths (the static node budget, root excluded).
    """
    if isinstance(paths, Tree):
      paths = paths.paths
    out = []
    for p in paths:
      if isinstance(p, (int, np.integer)) or not all(is_int(r) for r in p):
        raise ValueError(f"a tree is a list of paths of ranks, e.g. [[0], [1], [0, 0]]; got the"
                         f" entry {p!r}")
      t = tuple(int(r) for r in p)
      if not t:
        raise ValueError("a tree path is empty: every path names at least one rank")
      if min(t) < 0:
        raise ValueError(f"tree path {list(t)} has a negative rank")
      out.append(t)
    if not out:
      raise ValueError("a tree needs at least one path, e.g. [[0]]")
    seen = set()
    for t in out:
      if t in seen:
        raise ValueError(f"tree path {list(t)} appears twice: every path must be unique")
      seen.add(t)
    for t in out:
      if len(t) > 1 and t[:-1] not in seen:
        raise ValueError(f"tree path {list(t)} has no parent: add {list(t[:-1])} (every prefix"
                         " of a path must be a path)")
    depth = max(map(len, out))
    if max_depth is not None and depth > max_depth:
      longest = max(out, key=len)
      raise ValueError(f"tree path {list(longest)} is {depth} deep but the drafter proposes at"
                       f" most {max_depth} tokens a step (its head count): use paths of at most"
                       f" {max_depth} ranks")
    if len(out) > max_nodes:
      raise ValueError(f"the tree has {len(out)} nodes but the static budget is {max_nodes}:"
                       " use fewer paths")
    return cls(paths=tuple(sorted(out, key=lambda t: (len(t), t))))

  @classmethod
  def from_accuracies(cls, accuracies, size: int, *, max_depth: int | None = None) -> Tree:
    """The `size`-node tree of highest expected acceptance length.

    `accuracies[d][r]` is the measured probability that depth d+1's rank-r candidate is the
    right token (for Medusa, head d's top-(r+1) accuracy). A path's expected contribution is the
    product of its accuracies; greedily adding the best child of the tree built so far (Medusa's
    construction) maximises the sum, because a child never scores above its parent.
    """
    acc = np.asarray(accuracies, np.float64)
    if acc.ndim != 2 or acc.size == 0:
      raise ValueError(f"accuracies must be a [depth, top-k] table, got shape {acc.shape}")
    if size < 1:
      raise ValueError(f"a tree needs at least 1 node, got size={size}")
    depth = acc.shape[0] if max_depth is None else min(acc.shape[0], max_depth)
    heap = [(-acc[0, r], (r,)) for r in range(acc.shape[1])]
    heapq.heapify(heap)
    paths = []
    while heap and len(paths) < size:
      neg, path = heapq.heappop(heap)
      paths.append(path)
      if len(path) < depth:
        for r in range(acc.shape[1]):
          heapq.heappush(heap, (neg * acc[len(path), r], path + (r,)))
    return cls.from_paths(paths)

  @property
  def num_nodes(self) -> int:
    """Nodes including the root (the verify pass's width)."""
    return len(self.paths) + 1

  @property
  def depth(self) -> int:
    return max(map(len, self.paths))

  @property
  def topk(self) -> int:
    """Candidates needed per depth."""
    return max(p[-1] for p in self.paths) + 1

  def arrays(self):
    """(parents [N], depths [N], ranks [N]) as numpy int32; the root's parent is -1."""
    index = {(): 0} | {p: i + 1 for i, p in enumerate(self.paths)}
    parents = np.array([-1] + [index[p[:-1]] for p in self.paths], np.int32)
    depths = np.array([0] + [len(p) for p in self.paths], np.int32)
    ranks = np.array([0] + [p[-1] for p in self.paths], np.int32)
    return parents, depths, ranks

  def describe(self) -> str:
    return f"static tree ({len(self.paths)} nodes, depth {self.depth})"


@dataclasses.dataclass(frozen=True)
class DynamicTree:
  """EAGLE-2's dynamic draft tree (Li et al. 2024).

  depth: expansion steps (the deepest candidate is `depth` tokens ahead).
  topk: children per expanded node and nodes expanded per step.
  total_tokens: candidate nodes verified (root excluded), the best by cumulative draft
    log-probability.
  """

  depth: int = 5
  topk: int = 8
  total_tokens: int = 32

  def __post_init__(self):
    for name in ("depth", "topk", "total_tokens"):
      v = getattr(self, name)
      if not is_int(v) or v < 1:
        raise ValueError(f"DynamicTree.{name} must be an integer >= 1, got {v!r}")
    most = self.topk + (self.depth - 1) * self.topk * self.topk
    if self.total_tokens > most:
      raise ValueError(f"DynamicTree(depth={self.depth}, topk={self.topk}) generates at most"
                       f" {most} candidates, fewer than total_tokens={self.total_tokens}: raise"
                       " depth or topk, or lower total_tokens")
    if self.total_tokens + 1 > MAX_NODES:
      raise ValueError(f"total_tokens={self.total_tokens} exceeds the static budget of"
                       f" {MAX_NODES - 1} nodes")

  @property
  def num_nodes(self) -> int:
    return self.total_tokens + 1

  def describe(self) -> str:
    return (f"dynamic tree ({self.total_tokens} nodes, depth {self.depth}, top-{self.topk})")


def as_tree(tree, *, max_depth: int | None = None):
  """A `Tree` or `DynamicTree` from a Tree, DynamicTree or a list of paths."""
  if isinstance(tree, DynamicTree):
    return tree
  if isinstance(tree, Tree):
    return Tree.from_paths(tree.paths, max_depth=max_depth)
  if isinstance(tree, (list, tuple)):
    return Tree.from_paths(tree, max_depth=max_depth)
  raise ValueError(f"tree must be a jaxspec.decoding.tree.Tree, a DynamicTree or a list of paths, got"
                   f" {type(tree).__name__}")


@_pytree
@dataclasses.dataclass
class TreeProposal:
  """A drafter's tree for every row; node 0 is the root (its token is filled in by the loop)."""

  tokens: jax.Array  # [B, N] int32
  parents: jax.Array  # [B, N] int32, parents[:, 0] = -1, parents[:, j] < j
  depth: jax.Array  # [B, N] int32, depth[:, 0] = 0


def ancestor_mask(parents: jax.Array, max_depth: int) -> jax.Array:
  """[B, N, N] bool: entry (i, j) is True when node j is node i or one of its ancestors."""
  b, n = parents.shape
  eye = jnp.eye(n, dtype=bool)
  has_parent = (parents >= 0)[:, :, None]
  par = jnp.maximum(parents, 0)
  anc = jnp.broadcast_to(eye, (b, n, n))
  for _ in range(max_depth):
    anc = eye | (jnp.take_along_axis(anc, par[:, :, None], axis=1) & has_parent)
  return anc


def verify_tree(params, cache, tokens: jax.Array, parents: jax.Array, depth: jax.Array, lm,
                sp, *, max_depth: int, hidden_layers: tuple[int, ...] = (),
                return_logits: bool = False, history=None):
  """One target pass over every row's tree.

  Args:
    tokens: [B, N] node tokens (node 0: the last accepted token).
    parents, depth: [B, N] the tree (see `TreeProposal`).
    max_depth: a static bound on depth.
    history: the rows' `jaxspec.sampling.TokenHistory` (the loop's), when `sp` adjusts logits:
      node j is adjusted with the tokens on its path (itself included, the root excluded)
      counted as generated, the context plain decoding would have had after them.
  Returns:
    p [B, N, V] float32 (p[:, j] is the distribution of the token after node j's path), the
    Hidden states [B, N, D], and the new block's keys and values (k_new, v_new) [L, B, N, G, K]
    (the cache itself is only read).
  """
  mask = ancestor_mask(parents, max_depth)
  positions = cache.length[:, None] + depth
  logits, hidden, kv = protocol.forward(protocol.as_lm(lm), params, tokens, cache,
                                        positions=positions, block_mask=mask,
                                        hidden_layers=hidden_layers, write=False)
  if history is not None:
    added, n_added = sampling_lib.tree_context(sp, tokens, mask, depth, logits.shape[-1])
    logits = sampling_lib.adjust(logits, sp, history, added, n_added)
  if return_logits:
    return sampling_lib.probs(logits, sp), hidden, kv, logits
  return sampling_lib.probs(logits, sp), hidden, kv


def tree_accept(p: jax.Array, tokens: jax.Array, parents: jax.Array, keys: jax.Array,
                max_depth: int, greedy: jax.Array | None = None, valid: jax.Array | None = None,
                depth: jax.Array | None = None):
  """The recursive rejection rule on a tree of deterministic candidates, per row.

  Children are tried in node order. Child j of node c (token x_j) is accepted with probability
  p_c(x_j) / (1 - m_j), where m_j is the mass p_c of the distinct tokens of c's children tried
  before j (a token equal to an earlier sibling's is never accepted: p' has no mass there).
  The walk follows accepted children from the root; at the node where it stops, the token is
  drawn from p_c with its children's tokens removed (p_c itself at a leaf: the bonus token).

  Args:
    p: [B, N, V] target distributions at every node.
    tokens, parents: [B, N] the tree (node 0 the root).
    keys: [B] the step's per-row keys, or [B, max_depth + 1] the keys of the positions at
      depths 0.. (`jaxspec.sampling.position_keys`, with `depth`): then the coupled form of
      the rule. At every node the target's token is drawn from p with the key of the node's
      position, as `generate` draws it; the walk follows the child holding that token and
      emits it where no child does. Each child is then accepted with probability p(x) minus
      its earlier siblings' share, as in the recursive rule, and the text is `generate`'s.
    depth: [B, N] each node's depth (with position keys).
    max_depth: static bound on the depth (the walk's length).
    greedy: [B] rows whose p is one-hot (the draw is an argmax).
    valid: [B, N] nodes that may be accepted (None: all).
  Returns:
    n_accepted [B] int32 in 0..max_depth, emitted [B, max_depth + 1] int32 (the accepted path's
    tokens, then the correction or bonus token, then -1), and path [B, max_depth + 1] int32:
    the node index of the root and the accepted nodes in order (later entries repeat the last).
  """
  b, n, v = p.shape
  p = p.astype(jnp.float32)
  node = jnp.arange(n)
  is_cand = (node > 0)[None, :] & (parents >= 0)
  if valid is not None:
    is_cand = is_cand & valid
  if keys.ndim == 2:
    return _tree_accept_coupled(p, tokens, parents, keys, max_depth, greedy, is_cand, depth)
  ku, ks = jax.vmap(lambda kk: jax.random.split(kk, 2), out_axes=1)(keys)
  u = jax.vmap(lambda kk: jax.random.uniform(kk, (n,), jnp.float32))(ku)  # [B, N]
  par = jnp.maximum(parents, 0)
  p_par = jnp.take_along_axis(p, par[:, :, None], axis=1)  # [B, N, V] p at each node's parent
  px = jnp.take_along_axis(p_par, tokens[:, :, None], axis=2)[..., 0]  # [B, N]
  # before[b, j, s]: s is a candidate sibling of j tried before it.
  before = ((parents[:, None, :] == parents[:, :, None]) & (node[None, None, :] < node[None, :, None])
            & is_cand[:, None, :] & is_cand[:, :, None])
  same = tokens[:, None, :] == tokens[:, :, None]
  first = is_cand & ~jnp.any(before & same, axis=2)  # no earlier sibling with the same token
  mass = jnp.sum(jnp.where(before & first[:, None, :], px[:, None, :], 0.0), axis=2)
  accept = first & (u * jnp.maximum(1.0 - mass, 0.0) < px)
  rows = jnp.arange(b)
  n_acc, path = _walk(parents, accept, max_depth)
  cur = path[:, -1]
  # At the stopping node every candidate child was tried and rejected: remove their tokens.
  p_c = p[rows, cur]  # [B, V]
  kids = (parents == cur[:, None]) & is_cand  # [B, N]
  hit = jnp.zeros((b, v), bool).at[rows[:, None], tokens].max(kids)
  resid = jnp.where(hit, 0.0, p_c)
  resid = jnp.where(resid.sum(-1, keepdims=True) > 0, resid, p_c)  # rounding only
  final = sampling_lib.sample_from_probs(ks, resid, greedy)
  return _emit(tokens, path, n_acc, final, max_depth)


def _walk(parents, accept, max_depth):
  """From the root, each node's first accepted child in turn (accept [B, N]: the nodes that
  would be taken from their parent): (n_accepted [B], path [B, D + 1])."""
  b, n = parents.shape
  node = jnp.arange(n)
  child = (parents[:, None, :] == node[None, :, None]) & accept[:, None, :]  # [B, c, j]
  first_child = jnp.min(jnp.where(child, node[None, None, :], n), axis=2)  # [B, N], n: none
  rows = jnp.arange(b)
  cur = jnp.zeros((b,), jnp.int32)
  n_acc = jnp.zeros((b,), jnp.int32)
  path = [cur]
  for _ in range(max_depth):
    nxt = first_child[rows, cur]
    step = nxt < n
    cur = jnp.where(step, nxt, cur).astype(jnp.int32)
    n_acc = n_acc + step
    path.append(cur)
  return n_acc, jnp.stack(path, axis=1)


def _tree_accept_coupled(p, tokens, parents, keys, max_depth, greedy, is_cand, depth):
  """`tree_accept` with position keys: see its docstring."""
  if depth is None:
    raise ValueError("tree_accept with position keys needs every node's depth")
  node_keys = jnp.take_along_axis(keys, jnp.clip(depth, 0, max_depth), axis=1)  # [B, N]
  y = sampling_lib.sample_positions(node_keys, p, greedy)  # [B, N] the token after each
  y_par = jnp.take_along_axis(y, jnp.maximum(parents, 0), axis=1)
  n_acc, path = _walk(parents, is_cand & (tokens == y_par), max_depth)
  final = jnp.take_along_axis(y, path[:, -1:], axis=1)[:, 0]
  return _emit(tokens, path, n_acc, final, max_depth)


def _emit(tokens, path, n_acc, final, max_depth):
  """(n_acc, emitted [B, D + 1], path): the path's tokens, then the final token, then -1."""
  b = tokens.shape[0]
  idx = jnp.arange(max_depth + 1)[None, :]
  path_tok = jnp.take_along_axis(tokens, path, axis=1)
  # emitted[i] for i < n_acc is the token of path node i + 1.
  shifted = jnp.concatenate([path_tok[:, 1:], jnp.zeros((b, 1), tokens.dtype)], axis=1)
  emitted = jnp.where(idx < n_acc[:, None], shifted,
                      jnp.where(idx == n_acc[:, None], final[:, None], -1))
  return n_acc, emitted.astype(jnp.int32), path


def gather_path(path: jax.Array, hidden: Hidden, kv):
  """The accepted path's hidden states [B, D+1, ...] and keys/values [L, B, D+1, G, K], in
  path order, so the cache write and the drafter's commit see what a chain would have given."""
  take = lambda x, axis: jnp.take_along_axis(
      x, path.reshape((1,) * (axis - 1) + path.shape + (1,) * (x.ndim - axis - 1)), axis=axis)
  final = take(hidden.final, 1)
  layers = None if hidden.layers is None else take(hidden.layers, 2)
  k_new, v_new = kv
  return Hidden(final=final, layers=layers), (take(k_new, 2), take(v_new, 2))


def static_proposal(tree: Tree, candidates: jax.Array) -> TreeProposal:
  """A static tree's proposal from per-depth ranked candidates [B, depth, topk] (rank 0 best)."""
  parents, depths, ranks = tree.arrays()
  b = candidates.shape[0]
  toks = candidates[:, np.maximum(depths[1:] - 1, 0), ranks[1:]]  # [B, N - 1]
  tokens = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), toks.astype(jnp.int32)], axis=1)
  bcast = lambda a: jnp.broadcast_to(jnp.asarray(a), (b, a.shape[0]))
  return TreeProposal(tokens=tokens, parents=bcast(parents), depth=bcast(depths))


EAGLE_DEPTH = 5
EAGLE_TOPK = 8


def default_tree(drafter, size: int):
  """A tree of `size` candidate nodes for `drafter`: EAGLE-2's dynamic tree for an EAGLE head;
  for a Medusa head, the static tree of highest expected acceptance from the head's measured
  top-k accuracies (`medusa_accuracies`, stored with the bundled head)."""
  if not is_int(size) or size < 1:
    raise ValueError(f"a tree size is a number of nodes >= 1, got {size!r}")
  kinds = getattr(drafter, "tree_kinds", ())
  if DynamicTree in kinds:
    topk = min(EAGLE_TOPK, size)
    depth = EAGLE_DEPTH
    return DynamicTree(depth=depth, topk=topk, total_tokens=size)
  if Tree in kinds:
    acc = getattr(drafter, "topk_accuracy", None)
    if acc is None:
      raise ValueError(f"the {drafter.name} head has no measured top-k accuracies to build a"
                       f" {size}-node tree from: measure them with"
                       " jaxspec.tree_fit.medusa_accuracies(drafter, target, prompts) and pass"
                       " Tree.from_accuracies(acc, size), or give the paths")
    return Tree.from_accuracies(acc, size, max_depth=drafter.max_draft_tokens)
  raise ValueError(f"the {getattr(drafter, 'name', 'drafter')} drafter drafts chains only: tree"
                   " drafting needs a Medusa or an EAGLE head")
