"""Drafters for the draft heads of `jaxspec.heads` (chain drafting: k tokens in a row).

Each drafter is a frozen, hashable dataclass whose static part is the head's NNX `GraphDef`
(which carries the head's config) and the target's config; its weights, `params`, are a
`HeadParams`: the head's `nnx.State` and the target arrays it reads (embedding, final norm, LM
head), which are the target's own arrays, referenced and not copied.

What the loop gives a drafter (see `jaxspec.decoding.loop.spec_step`). After every step the
sequence holds x_0 .. x_{n-1} (n = seq_len); the target's cache holds [0, n - 1), and x_{n-1}
is the input of the next verify pass. `commit` receives the Hidden of the last verify pass over
[x_{n'-1}, d_1 .. d_k] (n' the previous seq_len): block index j holds f_{n'-1+j}, and the kept
ones are j = 0 .. n_new - 1, the last being f_{n-2} (`ctx.hidden_pos`). So after a commit the
drafter knows f_0 .. f_{n-2} and x_0 .. x_{n-1}, and drafts x_n, x_{n+1}, ... With the heads'
convention (a head at t predicts x_{t+2+j}) that is position t = n - 2:

  Medusa  d_{j+1} = head_j(f_{n-2})
  MLP     d_{j+1} = stage_j(s_{j-1}, tok_j), s_{-1} = f_{n-2}, tok_0 = x_{n-1}, tok_j = d_j
  EAGLE   the draft cache holds the pairs (feature_t, x_{t+1}) for t = 0 .. n-2, and `feat` the
          layer's output at t = n - 2, whose logits give d_1; draft step j then runs the pair
          (h, d_j) at cache position n - 2 + j.

After the prefill (`init`) the target has computed f_0 .. f_{P-1}; the drafters use the same
t = P - 2 as after a commit, except EAGLE (version 1), whose LM head is the target's: it drafts
d_1 from f_{P-1} itself (the target's own distribution) and its first pair is (f_{P-1}, d_1).
A one-token prompt has no f_{P-2}; those rows draft from f_0 (still exact, just less likely to
be accepted). The loop itself always commits the first new token (sampled from the prefill's
logits, as a plain step whose Hidden block is f_{P-1}) before the first draft, so there the
first draft follows the general rule at t = P - 1.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax import lax

from jaxspec import sampling as sampling_lib
from jaxspec.checks import check_int
from jaxspec.decoding import tree as tree_lib
from jaxspec.decoding.drafter import DraftContext, Drafter, Proposal, split_draft_keys
from jaxspec.heads.common import target_dims
from jaxspec.heads.eagle import eagle_block, eagle_prefill
from jaxspec.heads.training import draft_ids
from jaxspec.models.config import LlamaConfig
from jaxspec.models.llama import KVCache, Params, init_cache, write_cache
from jaxspec.pytree import pytree_dataclass as _pytree

F32 = jnp.float32


@_pytree
@dataclasses.dataclass
class HeadParams:
  """A head drafter's weights: the head's state and the frozen target arrays it reads."""

  head: Any  # nnx.State of the head module
  target: Params  # embed [V, D], final_norm [D], lm_head [D, V] or None; layers=None


@_pytree
@dataclasses.dataclass
class FeatureState:
  feat: jax.Array  # [B, D] float32 f_{n-2}: the feature Medusa / the MLP speculator draft from


@_pytree
@dataclasses.dataclass
class EagleState:
  cache: KVCache  # the draft layer's keys/values: pairs t = 0 .. length-1 (length = n - 1)
  feat: jax.Array  # [B, D] float32: the layer's output at t = n - 2 (or f_{P-1} after init, v1)


def frozen_target_arrays(target_params: Params) -> Params:
  """The target arrays a head reads (same arrays, not copies); `layers` is left out."""
  return Params(embed=target_params.embed, layers=None, final_norm=target_params.final_norm,
                lm_head=target_params.lm_head)


def _draw(key: jax.Array, q: jax.Array, sp) -> jax.Array:
  """One draft per row from q [B, V] (the target's Gumbel-max draw: coupled, `key` is the
  target's key for the token); greedy rows (one-hot q) take the argmax without drawing."""
  return sampling_lib.sample_from_probs(key, q, sampling_lib.greedy_rows(sp))


def _sample_steps(drafter, logits: jax.Array, sp, keys: jax.Array, ctx):
  """logits [B, k, V] -> (tokens [B, k], q [B, k, V]) with q processed by `sp` like the target.
  With context-dependent adjustments (`ctx.history`), q_j depends on the drafts before j, so
  the k are drawn in turn."""
  if ctx.history is None or not sp.adjusts:
    q = sampling_lib.probs(logits, sp)
    dk = split_draft_keys(drafter, keys, ctx, logits.shape[1])
    toks = jax.vmap(lambda kk, qq: _draw(kk, qq, sp), in_axes=(1, 1), out_axes=1)(dk, q)
    return toks, q
  dk = split_draft_keys(drafter, keys, ctx, logits.shape[1])
  hist, toks, qs = ctx.history, [], []
  for j in range(logits.shape[1]):
    q, tok, hist = _adjusted_draw(logits[:, j], sp, hist, dk, j)
    toks.append(tok)
    qs.append(q)
  return jnp.stack(toks, 1), jnp.stack(qs, 1)


def _adjusted_draw(logits: jax.Array, sp, hist, keys: jax.Array, j: int | None = None):
  """(q [B, V], the draft [B], the history after it) from draft logits [B, V] at the position
  `hist` describes (None: no adjustments), drawn with keys [B] (or keys[:, j])."""
  q = sampling_lib.probs(sampling_lib.adjust(logits, sp, hist), sp)
  tok = _draw(keys if j is None else keys[:, j], q, sp)
  return q, tok, sampling_lib.extend_history(hist, tok)


def _gather(x: jax.Array, idx: jax.Array) -> jax.Array:
  """x [B, T, ...] at per-row index idx [B] -> [B, ...]."""
  return jnp.take_along_axis(x, idx.reshape((-1, 1) + (1,) * (x.ndim - 2)), axis=1)[:, 0]


def _layers_btnd(hidden) -> jax.Array | None:
  """Hidden.layers [n, B, T, D] -> [B, T, n, D] (the heads' batch layout)."""
  return None if hidden.layers is None else jnp.transpose(hidden.layers, (1, 2, 0, 3))


@dataclasses.dataclass(frozen=True)
class HeadDrafter(Drafter):
  """Base of the head drafters: static GraphDef + target config, weights in `params`."""

  graphdef: Any
  target_cfg: LlamaConfig
  weights: HeadParams = dataclasses.field(compare=False, repr=False)
  hidden_layers: tuple[int, ...] = ()
  name: str = "head"
  tree: Any = None  # a jaxspec.decoding.tree.Tree / DynamicTree: tree drafting (`with_tree`)
  # Measured top-k accuracy per draft step [steps][rank] (`jaxspec.tree_fit.medusa_accuracies`),
  # read from the head's config.json when it was saved with one: `default_tree` builds from it.
  topk_accuracy: Any = dataclasses.field(default=None, compare=False, repr=False)
  # Sampled chains: draw draft j with the key the target draws token j with and propose it as
  # deterministic (`DraftModel.coupled`); None: coupled exactly when k is chosen by "auto".
  coupled: bool | None = None

  uses_target_hidden = True
  free_proposals = False
  tree_kinds = ()  # the tree shapes this head drafts (a class attribute, not a field)

  def with_tree(self, tree) -> HeadDrafter:
    """This drafter drafting a tree each step (None: back to chains). Medusa takes a static
    `Tree` (paths of ranks, at most its head count deep); EAGLE a `DynamicTree` (EAGLE-2) or a
    static `Tree`."""
    base = self.name.removesuffix("-tree")
    if tree is None:
      return dataclasses.replace(self, tree=None, name=base)
    if not self.tree_kinds:
      raise ValueError(f"the {base} drafter drafts chains only: tree drafting needs a Medusa or"
                       " an EAGLE head")
    tree = tree_lib.as_tree(tree, max_depth=self.max_draft_tokens)
    if not isinstance(tree, self.tree_kinds):
      names = " or ".join(k.__name__ for k in self.tree_kinds)
      raise ValueError(f"the {base} drafter drafts a {names}, not a {type(tree).__name__}")
    return dataclasses.replace(self, tree=tree, name=f"{base}-tree")

  @property
  def tree_depth(self) -> int:
    return self.tree.depth

  @property
  def params(self) -> HeadParams:
    return self.weights

  @property
  def vocab_size(self) -> int:
    return self.target_cfg.vocab_size

  def module(self, params: HeadParams):
    return nnx.merge(self.graphdef, params.head)


class _FeatureDrafter(HeadDrafter):
  """Medusa and the MLP speculator: the state is f_{n-2}."""

  steps_field = ""  # the head config field that bounds k: num_heads (Medusa), n_predict (MLP)

  @property
  def max_draft_tokens(self) -> int:
    return getattr(self.module(self.weights).cfg, self.steps_field)

  def checked_module(self, params: HeadParams, k: int):
    """The head module, after checking that it can draft k tokens a step (`speculative_generate`
    checks that before compiling; this guards direct calls of `draft`)."""
    model = self.module(params)
    limit = getattr(model.cfg, self.steps_field)
    if k > limit:
      raise ValueError(f"this {self.name} drafter proposes at most {limit} tokens a step:"
                       f" num_draft_tokens must be <= {limit}, got {k}")
    return model

  def init(self, params, prompt, prompt_len, max_len, hidden=None) -> FeatureState:
    if hidden is None:
      raise ValueError(f"{self.name} drafts from the target's hidden states: the loop must pass"
                       " them (uses_target_hidden)")
    return FeatureState(_gather(hidden.final, jnp.maximum(prompt_len - 2, 0)).astype(F32))

  def commit(self, params, state: FeatureState, ctx: DraftContext) -> FeatureState:
    f = _gather(ctx.hidden.final, ctx.hidden_pos).astype(F32)  # f_{n-2}
    return FeatureState(jnp.where((ctx.n_new > 0)[:, None], f, state.feat))


@dataclasses.dataclass(frozen=True)
class MedusaDrafter(_FeatureDrafter):
  """Medusa: draft j from head j on f_{n-2} (heads are independent, so q_j is too)."""

  name: str = "medusa"
  steps_field = "num_heads"
  tree_kinds = (tree_lib.Tree,)

  def propose_tree(self, params, state: FeatureState, ctx, sp, keys):
    """The static tree's candidates: head j's top-k tokens at depth j + 1 (Medusa's cartesian
    tree; candidates are the heads' top-k, never sampled, so the tree rule is exact)."""
    model = self.module(params)
    logits = model.logits(params.target, state.feat)[:, :self.tree.depth]  # [B, D, V]
    _, cand = lax.top_k(logits, self.tree.topk)
    return tree_lib.static_proposal(self.tree, cand), state

  def propose(self, params, state: FeatureState, ctx, k, sp, keys):
    model = self.checked_module(params, k)
    logits = model.logits(params.target, state.feat)[:, :k]  # [B, k, V]
    toks, q = _sample_steps(self, logits, sp, keys, ctx)
    return Proposal(tokens=toks, q=None if self.coupled else q), state


@dataclasses.dataclass(frozen=True)
class MLPDrafter(_FeatureDrafter):
  """The MLP speculator: stage j reads the token drafted by stage j - 1 (x_{n-1} for stage 0)."""

  name: str = "mlp"
  steps_field = "n_predict"

  def propose(self, params, state: FeatureState, ctx, k, sp, keys):
    model = self.checked_module(params, k)
    tok = jnp.take_along_axis(ctx.seq, (ctx.seq_len - 1)[:, None], axis=1)[:, 0]  # x_{n-1}
    s = model.start(state.feat)
    step_keys = split_draft_keys(self, keys, ctx, k)
    toks, qs, hist = [], [], ctx.history
    for j in range(k):
      s, logits = model.stage(params.target, j, s, tok)
      q, tok, hist = _adjusted_draw(logits, sp, hist, step_keys, j)
      toks.append(tok)
      qs.append(q)
    return Proposal(tokens=jnp.stack(toks, 1), q=None if self.coupled else jnp.stack(qs, 1)), state


@dataclasses.dataclass(frozen=True)
class EagleDrafter(HeadDrafter):
  """EAGLE / EAGLE-3 with its own one-layer KV cache.

  Cache entry t holds the pair (feature_t, x_{t+1}); entries past `length` are scratch (the
  drafting steps write there and `commit` overwrites them), so a rollback is the length alone.

  `context_window` (None: the whole context): the draft layer attends to the last
  `context_window` pairs only, a sliding window. The prefill then runs the head's input
  projection and keys and values over the prompt's last `context_window` pairs, not all of them
  (on a 1,187-token prompt that was most of the head's fixed cost). `load_head` sets it to the
  window a head was trained on (`jaxspec train --window`, 128 for the bundled heads): such a
  head never attended further during training. Exactness does not depend on it.
  """

  name: str = "eagle"
  context_window: int | None = None
  tree_kinds = (tree_lib.DynamicTree, tree_lib.Tree)
  defer_commit = True  # a plain step's commit runs the draft layer; `commit` takes any width

  def __post_init__(self):
    if self.context_window is not None:
      check_int("context_window", self.context_window, 1, why="pairs the draft layer attends to",
                numpy=False)

  def with_context_window(self, window: int | None) -> EagleDrafter:
    """This drafter attending to the last `window` pairs (None: the whole context)."""
    return dataclasses.replace(self, context_window=window)

  def _model(self, params):
    return self.module(params)

  def _top(self, model, frozen, h, k):
    """h [B, T, D] -> (log-probabilities [B, T, k], target token ids [B, T, k]) of the k best
    draft tokens (over the reduced draft vocabulary when the head has one)."""
    lp = jax.nn.log_softmax(model.logits(frozen, h), axis=-1)
    vals, idx = lax.top_k(lp, k)
    ids = draft_ids(model)
    return vals, (idx if ids is None else ids[idx]).astype(jnp.int32)

  def propose_tree(self, params, state: EagleState, ctx, sp, keys):
    """EAGLE-2's dynamic tree, or a static tree grown from the head's top-k at every node.

    The candidates are the draft layer's top-k tokens (deterministic, so the tree rule is
    exact). Every expansion runs the layer over all the nodes expanded so far (with an
    ancestor-only mask on top of the draft cache, read and never written: `commit` then writes
    the accepted pairs as after a chain) and reads the logits of the newest ones.
    """
    model = self._model(params)
    frozen = params.target
    tree = self.tree
    b = state.feat.shape[0]
    if isinstance(tree, tree_lib.Tree):
      return self._static_tree(model, frozen, state, tree), state
    k, depth = tree.topk, tree.depth
    vals, toks = self._top(model, frozen, state.feat[:, None], k)  # [B, 1, K]
    score, tok = [vals[:, 0]], [toks[:, 0]]
    parent = [jnp.full((b, k), -1, jnp.int32)]
    cdepth = [jnp.ones((b, k), jnp.int32)]
    front = jnp.broadcast_to(jnp.arange(k, dtype=jnp.int32), (b, k))  # candidate indices
    front_score = vals[:, 0]
    front_feat = jnp.broadcast_to(state.feat[:, None], (b, k, state.feat.shape[-1]))
    front_par = jnp.full((b, k), -1, jnp.int32)  # parent's index among the expanded nodes
    x_tok = x_feat = x_off = x_par = None
    count = k
    for s in range(1, depth):
      tok_all = jnp.concatenate(tok, axis=1)
      ft = jnp.take_along_axis(tok_all, front, axis=1)
      cat = lambda a, n: n if a is None else jnp.concatenate([a, n], axis=1)
      x_tok, x_feat = cat(x_tok, ft), cat(x_feat, front_feat)
      x_off = cat(x_off, jnp.full((b, k), s - 1, jnp.int32))
      x_par = cat(x_par, front_par)
      mask = tree_lib.ancestor_mask(x_par, s)
      h, _ = eagle_block(model, frozen, state.cache, x_feat, x_tok, offsets=x_off,
                                   mask=mask, write=False, window=self.context_window)
      h_new = h[:, (s - 1) * k:]  # [B, K, D] the newest nodes' outputs
      vals, toks = self._top(model, frozen, h_new, k)  # [B, K, K]
      child_score = (front_score[:, :, None] + vals).reshape(b, k * k)
      score.append(child_score)
      tok.append(toks.reshape(b, k * k))
      parent.append(jnp.repeat(front, k, axis=1))
      cdepth.append(jnp.full((b, k * k), s + 1, jnp.int32))
      if s < depth - 1:
        front_score, j = lax.top_k(child_score, k)
        front = (count + j).astype(jnp.int32)
        slot = j // k
        front_feat = jnp.take_along_axis(h_new, slot[:, :, None], axis=1)
        front_par = ((s - 1) * k + slot).astype(jnp.int32)
      count += k * k
    score, tok = jnp.concatenate(score, 1), jnp.concatenate(tok, 1)
    parent, cdepth = jnp.concatenate(parent, 1), jnp.concatenate(cdepth, 1)
    # The best total_tokens by cumulative log-probability, in creation order (a child never
    # scores above its parent and ties go to the lower index, so the set is a tree).
    _, sel = lax.top_k(score, tree.total_tokens)
    sel = jnp.sort(sel, axis=1)
    pc = jnp.take_along_axis(parent, sel, axis=1)
    pos = jnp.argmax(sel[:, None, :] == pc[:, :, None], axis=2)
    node_parent = jnp.where(pc < 0, 0, pos + 1).astype(jnp.int32)
    z = jnp.zeros((b, 1), jnp.int32)
    return tree_lib.TreeProposal(
        tokens=jnp.concatenate([z, jnp.take_along_axis(tok, sel, axis=1)], axis=1),
        parents=jnp.concatenate([z - 1, node_parent], axis=1),
        depth=jnp.concatenate([z, jnp.take_along_axis(cdepth, sel, axis=1)], axis=1)), state

  def _static_tree(self, model, frozen, state: EagleState, tree) -> tree_lib.TreeProposal:
    """A static tree: the children of every node are that node's top-k draft tokens at the
    ranks its paths name; depth d's nodes are expanded in one layer pass over depths < d."""
    parents, depths, ranks = tree.arrays()
    b, n = state.feat.shape[0], tree.num_nodes
    kk = tree.topk
    _, toks = self._top(model, frozen, state.feat[:, None], kk)
    tokens = jnp.zeros((b, n), jnp.int32)
    d1 = np.nonzero(depths == 1)[0]
    tokens = tokens.at[:, d1].set(toks[:, 0, ranks[d1]])
    h_prev, prev_local = None, {}
    for d in range(1, tree.depth):
      upto = np.nonzero((depths >= 1) & (depths <= d))[0]  # nodes expanded so far
      local = {int(g): i for i, g in enumerate(upto)}
      par_local = np.array([local.get(int(parents[g]), -1) for g in upto], np.int32)
      # A node's input feature is its parent's output from the previous pass (the root's: feat).
      feat_in = jnp.stack([state.feat if parents[g] == 0
                           else h_prev[:, prev_local[int(parents[g])]] for g in upto], 1)
      mask = tree_lib.ancestor_mask(jnp.broadcast_to(jnp.asarray(par_local), (b, len(upto))), d)
      off = jnp.broadcast_to(jnp.asarray(depths[upto] - 1), (b, len(upto)))
      h, _ = eagle_block(model, frozen, state.cache, feat_in, tokens[:, upto],
                                   offsets=off, mask=mask, write=False,
                                   window=self.context_window)
      h_prev, prev_local = h, local
      nxt = np.nonzero(depths == d + 1)[0]
      src = np.array([local[int(parents[g])] for g in nxt])
      _, toks = self._top(model, frozen, h[:, src], kk)  # [B, len(nxt), kk]
      tokens = tokens.at[:, nxt].set(toks[:, np.arange(len(nxt)), ranks[nxt]])
    bcast = lambda a: jnp.broadcast_to(jnp.asarray(a), (b, n))
    return tree_lib.TreeProposal(tokens=tokens, parents=bcast(parents), depth=bcast(depths))

  def init(self, params, prompt, prompt_len, max_len, hidden=None) -> EagleState:
    if hidden is None:
      raise ValueError("EAGLE drafts from the target's hidden states: the loop must pass them")
    model = self._model(params)
    b, p = prompt.shape
    tok = jnp.concatenate([prompt[:, 1:], jnp.zeros((b, 1), prompt.dtype)], axis=1)  # x_{t+1}
    final, layers = hidden.final, _layers_btnd(hidden)
    # Pairs t = 0 .. P-2 are real (x_{t+1} is a prompt token); the last one is padding.
    n = jnp.maximum(prompt_len - 1, 0)
    w = self.context_window
    if w is not None and w < p:  # only the last w real pairs, at cache positions 0 .. m-1
      m = jnp.minimum(n, w)
      idx = jnp.minimum((n - m)[:, None] + jnp.arange(w)[None, :], p - 1)  # [B, w]
      take = lambda a: jnp.take_along_axis(a, idx.reshape(idx.shape + (1,) * (a.ndim - 2)),
                                           axis=1)
      final, tok = take(final), take(tok)
      layers = None if layers is None else take(layers)
      n = m
    feat = model.real_feature(final, layers)  # [B, T, D] feature_t
    cache = init_cache(model.layer_cfg, b, max_len, dtype=F32)
    # The next draft reads the output of the last real pair only (version 1: none).
    h, cache = eagle_prefill(model, params.target, cache, feat, tok, jnp.maximum(n - 1, 0))
    cache = dataclasses.replace(cache, length=n)
    if model.cfg.version == 1:  # the target's head on f_{P-1} drafts x_P exactly
      start = _gather(hidden.final, prompt_len - 1).astype(F32)
    else:
      start = jnp.where((prompt_len >= 2)[:, None], h, feat[:, 0])
    return EagleState(cache=cache, feat=start)

  def propose(self, params, state: EagleState, ctx, k, sp, keys):
    model = self._model(params)
    frozen = params.target
    step_keys = split_draft_keys(self, keys, ctx, k)
    # [B, V] q of draft 1; each q adjusted with the drafts before it (`ctx.history`).
    q0, d0, hist = _adjusted_draw(model.target_logits(frozen, state.feat), sp, ctx.history,
                                  step_keys, 0)
    length = state.cache.length

    def body(carry, key_j):
      feat, tok, cache, hist = carry
      h, cache = eagle_block(model, frozen, cache, feat[:, None], tok[:, None],
                             window=self.context_window)
      q, nxt, hist = _adjusted_draw(model.target_logits(frozen, h[:, 0]), sp, hist, key_j)
      return (h[:, 0], nxt, cache, hist), (nxt, q)

    if k > 1:
      (_, _, cache, _), (toks, qs) = lax.scan(body, (state.feat, d0, state.cache, hist),
                                              jnp.swapaxes(step_keys[:, 1:], 0, 1))
      drafts = jnp.concatenate([d0[:, None], toks.T], axis=1)
      q = jnp.concatenate([q0[:, None], jnp.swapaxes(qs, 0, 1)], axis=1)
    else:
      cache, drafts, q = state.cache, d0[:, None], q0[:, None]
    # The drafting steps' entries are scratch: keep the arrays (written in place), not the length.
    return Proposal(tokens=drafts, q=None if self.coupled else q), EagleState(
        cache=dataclasses.replace(cache, length=length), feat=state.feat)

  def _pairs(self, model, ctx: DraftContext):
    """The pairs a commit writes: (feature [B, W, D], token [B, W]). Block index j of the verify
    pass is f_{n'-1+j}; it pairs with x_{n'+j}, written at cache position n'-1+j = length + j.
    The kept pairs are j < n_new."""
    hid = ctx.hidden
    w = hid.final.shape[1]
    feat = model.real_feature(hid.final, _layers_btnd(hid))  # [B, W, D]
    old_n = ctx.seq_len - ctx.n_new
    idx = old_n[:, None] + jnp.arange(w)[None, :]
    return feat, jnp.take_along_axis(ctx.seq, jnp.minimum(idx, ctx.seq.shape[1] - 1), axis=1)

  @staticmethod
  def _kept(state: EagleState, cache: KVCache, h, ctx: DraftContext, live) -> EagleState:
    """The state after the pairs' outputs h [B, W, D] (cache written at the old length): the
    length moves by n_new and feat is the output at t = n - 2, on rows where `live`."""
    start = state.cache.length
    new_feat = _gather(h, jnp.maximum(ctx.n_new - 1, 0))
    return EagleState(cache=dataclasses.replace(cache, length=jnp.where(live, start + ctx.n_new,
                                                                        start)),
                      feat=jnp.where(live[:, None], new_feat, state.feat))

  def commit(self, params, state: EagleState, ctx: DraftContext) -> EagleState:
    model = self._model(params)
    feat, tok = self._pairs(model, ctx)
    h, cache = eagle_block(model, params.target, state.cache, feat, tok,
                           window=self.context_window)
    return self._kept(state, cache, h, ctx, ctx.n_new > 0)

  def catch_up_where(self, params, state: EagleState, ctx: DraftContext, width: int, when):
    """`catch_up` (= `commit`) where `when` holds, with the draft cache outside the conditional:
    the conditional computes the pairs' keys and values reading the cache, and they are written
    after it at each row's length. Where `when` is false zeros are written there, past the
    length (scratch, as a draft's entries), and the length stays."""
    model = self._model(params)

    def run(_):
      feat, tok = self._pairs(model, ctx)
      return eagle_block(model, params.target, state.cache, feat, tok, write=False,
                         return_block=True, window=self.context_window)

    h, (k, v) = lax.cond(when, run, lambda _: jax.tree.map(
        lambda a: jnp.zeros(a.shape, a.dtype), jax.eval_shape(run, None)), None)
    cache = write_cache(state.cache, k, v, positions_start=state.cache.length)
    return self._kept(state, cache, h, ctx, when & (ctx.n_new > 0))


_DRAFTERS = {"medusa": MedusaDrafter, "mlp": MLPDrafter, "eagle": EagleDrafter}


def make_drafter(kind: str, model: nnx.Module, target) -> HeadDrafter:
  """The drafter of head `model` (of registry kind `kind`) for the target `Model`."""
  dims = target_dims(target.cfg)
  if model.target_dims != dims:
    raise ValueError(
        f"this {kind} head was built for a target with (hidden, vocab, layers) ="
        f" {model.target_dims}, but the target has {dims}: use the target it was trained on")
  layers = tuple(model.cfg.layers) if kind == "eagle" and model.cfg.version == 3 else ()
  graphdef, state = nnx.split(model)
  name = kind if kind != "eagle" else ("eagle3" if model.cfg.version == 3 else "eagle")
  return _DRAFTERS[kind](graphdef=graphdef, target_cfg=target.cfg,
                         weights=HeadParams(head=state,
                                            target=frozen_target_arrays(target.params)),
                         hidden_layers=layers, name=name)
