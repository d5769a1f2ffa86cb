"""Tree speculation: the tree forward against plain forwards over each node's path, the tree rule's
exactness (Monte-Carlo, direct and through the loop), greedy equality with `generate` for every
tree drafter, and the errors of a bad tree."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec import AutoK, heads
from jaxspec.decoding import tree as tree_lib
from jaxspec.api import generate
from jaxspec.models import init_params, tiny_config
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling
from jaxspec.api import speculative_generate
from jaxspec.decoding.tree import DynamicTree, Tree
from helpers import (PATHS, assert_first_tokens_follow, assert_tree_forward_matches_plain_forward,
                     chi2_critical, exact_joint)
from jaxspec.cli_options import parse_tree

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [7]]
N_NEW = 16


def test_tree_forward_matches_plain_forward_over_each_path(tiny_target):
  """Every node's logits equal those of a plain causal forward over prompt + the node's path,
  with rows of different cached lengths."""
  assert_tree_forward_matches_plain_forward(tiny_target)


@pytest.mark.parametrize("form", ["recursive", "coupled"])
def test_tree_rule_is_exact_monte_carlo(form):
  """The rule on a fixed tree with a duplicate sibling, in both forms (per-row step keys: the
  recursive rule; position keys: the coupled one): the first token follows the root's p;
  given that the walk went to a child, the second token follows that child's p."""
  v, n_rows = 6, 40000
  # root 0: children 1 (token 2), 2 (token 4), 3 (token 2 again: never accepted);
  # node 1: children 4 (token 0), 5 (token 3); node 2 is a leaf (its bonus token follows p_2).
  parents = np.array([-1, 0, 0, 0, 1, 1], np.int32)
  tokens = np.array([0, 2, 4, 2, 0, 3], np.int32)
  p = np.random.default_rng(1).dirichlet(np.ones(v), size=len(parents)).astype(np.float32)
  bc = lambda a: jnp.broadcast_to(jnp.asarray(a), (n_rows,) + a.shape)
  keys = jax.random.split(jax.random.key(5), n_rows)
  depth = np.array([0, 1, 1, 1, 2, 2], np.int32)
  if form == "coupled":
    from jaxspec.sampling import position_keys
    keys = position_keys(keys, jnp.zeros(n_rows, jnp.int32), 3)
  n_acc, emitted, path = jax.jit(tree_lib.tree_accept, static_argnums=4)(
      bc(p), bc(tokens), bc(parents), keys, 2, depth=bc(depth))
  emitted, n_acc, path = map(np.asarray, (emitted, n_acc, path))
  assert set(np.unique(path[:, 1])) <= {0, 1, 2}  # node 3 (the duplicate) is never taken

  def chi2_ok(obs_tokens, probs):
    obs = np.bincount(obs_tokens, minlength=v).astype(np.float64)
    exp = probs.astype(np.float64) * len(obs_tokens)
    assert obs[probs == 0].sum() == 0
    keep = exp > 0
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    assert chi2 < chi2_critical(int(keep.sum()) - 1), (chi2, obs, exp)

  chi2_ok(emitted[:, 0], p[0])
  via1 = emitted[:, 0] == 2
  assert (n_acc[via1] >= 1).all() and (path[via1, 1] == 1).all()
  chi2_ok(emitted[via1, 1], p[1])
  via2 = emitted[:, 0] == 4
  chi2_ok(emitted[via2, 1], p[2])
  # Greedy (one-hot p): the walk follows the argmax and emits it at the first miss.
  hard = np.eye(v, dtype=np.float32)[[2, 3, 1, 0, 5, 5]]  # root -> 2 (node 1) -> 3 (node 5)
  n1, e1, p1 = tree_lib.tree_accept(jnp.asarray(hard)[None], jnp.asarray(tokens)[None],
                                    jnp.asarray(parents)[None], keys[:1], 2,
                                    greedy=jnp.asarray([True]), depth=jnp.asarray(depth)[None])
  assert int(n1[0]) == 2 and np.asarray(e1[0]).tolist() == [2, 3, 5]
  assert np.asarray(p1[0]).tolist() == [0, 1, 5]


def _medusa(target, seed=0, num_heads=3):
  m = heads.HEADS["medusa"].create(target.cfg, rngs=nnx.Rngs(seed), num_heads=num_heads)
  return heads.HEADS["medusa"].drafter(m, target)


def _eagle(target, version=1, seed=0):
  opts = dict(ttt_steps=2)
  if version == 3:
    opts.update(version=3, draft_vocab_size=96,
                token_counts=np.arange(target.cfg.vocab_size)[::-1])
  m = heads.HEADS["eagle"].create(target.cfg, rngs=nnx.Rngs(seed), **opts)
  return heads.HEADS["eagle"].drafter(m, target)


@pytest.fixture(scope="module")
def reference(tiny_target):
  return generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, stop_ids=())


# One compile each: Medusa on a static tree, EAGLE-1 on EAGLE-2's dynamic tree, EAGLE-3 (reduced
# draft vocabulary) on a static tree grown from its own top-k.
@pytest.mark.parametrize("which", ["medusa-static", "eagle-dynamic", "eagle3-static"])
def test_greedy_tree_equals_generate(tiny_target, reference, which):
  if which == "medusa-static":
    drafter = _medusa(tiny_target).with_tree(PATHS)
  elif which == "eagle-dynamic":
    drafter = _eagle(tiny_target).with_tree(DynamicTree(depth=3, topk=3, total_tokens=10))
  else:
    drafter = _eagle(tiny_target, version=3).with_tree(PATHS[:-1])
  assert drafter.name.endswith("-tree")
  out = speculative_generate(tiny_target, drafter, PROMPTS, max_new_tokens=N_NEW, stop_ids=())
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  np.testing.assert_array_equal(out.lengths, reference.lengths)
  assert out.stats["tree_nodes"] == drafter.tree.num_nodes - 1
  # Untrained heads, yet some nodes are accepted (1-6 per row): accepted paths were committed.
  assert sum(out.stats["accepted_per_row"]) > 0 and out.stats["tau"] > 1.0


def test_dynamic_tree_is_a_valid_tree(tiny_target):
  """The EAGLE-2 proposal: parents precede children, depths follow the parents, siblings hold
  distinct tokens, and the first-level nodes are the head's best tokens at the root in rank
  order (the selection of deeper nodes by cumulative draft log-probability is not checked
  here)."""
  from jaxspec.drafters import DraftContext
  from jaxspec.decoding.plain import prefill
  drafter = _eagle(tiny_target).with_tree(DynamicTree(depth=3, topk=3, total_tokens=12))
  cfg = tiny_target.cfg
  prompt = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
  plen = jnp.asarray([4], jnp.int32)

  @jax.jit
  def propose(tparams, dparams):
    _, hid, _ = prefill(tparams, prompt, plen, cfg, 16, logits=False)
    state = drafter.init(dparams, prompt, plen, 16, hid)
    ctx = DraftContext(seq=prompt, seq_len=plen, prompt_len=plen)
    tree = drafter.propose_tree(dparams, state, ctx, Sampling().arrays(1),
                                jax.random.split(jax.random.key(0), 1))[0]
    _, root_top = drafter._top(drafter._model(dparams), dparams.target, state.feat[:, None], 3)
    return tree, root_top[0, 0]  # the head's 3 best tokens at the root, best first

  prop, root_top = propose(tiny_target.params, drafter.params)
  par, dep, tok = (np.asarray(x[0]) for x in (prop.parents, prop.depth, prop.tokens))
  assert par[0] == -1 and dep[0] == 0 and len(par) == 13
  for j in range(1, len(par)):
    assert 0 <= par[j] < j and dep[j] == dep[par[j]] + 1
  for c in range(len(par)):
    kids = tok[1:][par[1:] == c]
    assert len(kids) == len(set(kids.tolist()))
  assert dep.max() <= 3
  first = tok[dep == 1].tolist()  # creation order: the root's candidates by rank
  assert 1 <= len(first) and first == np.asarray(root_top)[:len(first)].tolist(), (first,
                                                                                  root_top)


# A Medusa (static) tree's sampled distribution: test_penalties.py's later-position chi-square
# (`[tree]`, 20,000 rows), which runs one under "auto"; this one the dynamic tree.
@pytest.mark.optimized
def test_tree_sampling_distribution():
  """Chi-square of the first three tokens under sampling, with an EAGLE-2 dynamic tree of
  several children per node."""
  cfg = tiny_config(vocab_size=8, eos_token_ids=())
  target = Model(cfg, init_params(cfg, jax.random.key(11), scale=0.6), name="v8-target")
  sp = Sampling(temperature=0.9, top_k=6)
  prompt = [1, 2, 3, 4]
  joint = exact_joint(target, prompt, sp)
  drafter = _eagle(target, seed=5).with_tree(DynamicTree(depth=2, topk=3, total_tokens=7))
  out = speculative_generate(target, drafter, [prompt] * 20000, max_new_tokens=3, sampling=sp,
                             key=99, max_len=16)
  assert_first_tokens_follow(out.tokens[:, :3], joint, "top-k")
  assert 0.05 < out.stats["acceptance_rate"] < 0.95, out.stats["acceptance_rate"]


def test_tree_errors(tiny_target):
  medusa = _medusa(tiny_target)  # 3 heads
  with pytest.raises(ValueError, match=r"\[0, 0, 0, 0\] is 4 deep.*at most 3"):
    medusa.with_tree([[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]])
  with pytest.raises(ValueError, match=r"\[1\] appears twice"):
    Tree.from_paths([[0], [1], [1]])
  with pytest.raises(ValueError, match="static budget is 4"):
    Tree.from_paths([[0], [1], [2], [3], [4]], max_nodes=4)
  with pytest.raises(ValueError, match="static budget"):
    Tree.from_paths([[i] for i in range(tree_lib.MAX_NODES)])
  with pytest.raises(ValueError, match=r"\[2, 0\] has no parent: add \[2\]"):
    Tree.from_paths([[0], [2, 0]])
  with pytest.raises(ValueError, match="generates at most 12"):
    DynamicTree(depth=2, topk=3, total_tokens=13)
  with pytest.raises(ValueError, match="depth must be an integer"):
    DynamicTree(depth=0)
  with pytest.raises(ValueError, match="drafts a Tree, not a DynamicTree"):
    medusa.with_tree(DynamicTree())
  mlp = heads.HEADS["mlp"].drafter(
      heads.HEADS["mlp"].create(tiny_target.cfg, rngs=nnx.Rngs(0), n_predict=3), tiny_target)
  with pytest.raises(ValueError, match="chains only"):
    mlp.with_tree(PATHS)
  with pytest.raises(ValueError, match="leave num_draft_tokens"):
    speculative_generate(tiny_target, medusa.with_tree(PATHS), PROMPTS, num_draft_tokens=3)
  from jaxspec.sharding import Placement
  devs = jax.devices()
  with pytest.raises(ValueError, match="fused loop only"):
    speculative_generate(tiny_target, medusa.with_tree(PATHS), PROMPTS,
                         placement=Placement(target=devs[:1], drafter=devs[1:2]))
  # with_tree(None) goes back to chains.
  assert medusa.with_tree(PATHS).with_tree(None) == medusa


def test_tree_from_accuracies():
  """Greedy expected-acceptance construction: the best-scoring paths, closed under prefixes."""
  acc = [[0.6, 0.2, 0.1], [0.5, 0.2, 0.05], [0.4, 0.1, 0.05]]
  tree = Tree.from_accuracies(acc, 5)
  # Scores: (0)=.6 (0,0)=.3 (1)=.2 (0,0,0)=.12 (0,1)=.12 -> ties broken by the path order.
  assert set(tree.paths) == {(0,), (0, 0), (1,), (0, 0, 0), (0, 1)}
  big = Tree.from_accuracies(acc, 20, max_depth=2)
  assert big.depth == 2 and len(big.paths) == 12  # 3 + 9: everything at depth <= 2
  with pytest.raises(ValueError, match="top-k"):
    Tree.from_accuracies([0.5, 0.2], 3)


def test_parse_tree_and_default_tree(tiny_target, tmp_path):
  eagle, medusa = _eagle(tiny_target), _medusa(tiny_target)
  assert parse_tree("dynamic:3,2,4", eagle) == DynamicTree(depth=3, topk=2,
                                                                    total_tokens=4)
  assert parse_tree("[[0],[1],[0,0]]", medusa).paths == ((0,), (1,), (0, 0))
  f = tmp_path / "tree.json"
  f.write_text("[[0], [0, 0]]")
  assert parse_tree(str(f), medusa).depth == 2
  assert parse_tree("16", eagle) == DynamicTree(depth=tree_lib.EAGLE_DEPTH,
                                                         topk=tree_lib.EAGLE_TOPK,
                                                         total_tokens=16)
  with pytest.raises(ValueError, match="no measured top-k accuracies"):
    parse_tree("8", medusa)
  acc = ((0.5, 0.2), (0.3, 0.1), (0.2, 0.1))
  assert len(tree_lib.default_tree(dataclasses.replace(medusa, topk_accuracy=acc), 4).paths) == 4
  with pytest.raises(ValueError, match="expected dynamic:DEPTH,TOPK,TOTAL"):
    parse_tree("dynamic:3,2", eagle)
  with pytest.raises(ValueError, match="not valid JSON"):
    parse_tree("[[0],", medusa)
  with pytest.raises(ValueError, match="expected a number of nodes"):
    parse_tree("wide", medusa)


def test_sampled_head_chains_are_coupled_under_auto(tiny_target):
  """A head's sampled chain under "auto" draws each draft with the target's key for that
  token (the default `coupled=None`): the text is `generate`'s for the key; with a fixed k and
  coupled=True too. Greedy or not, the output distribution is exact either way."""
  from jaxspec.decoding.adaptive import CostModel
  sp = Sampling(temperature=1.0, top_k=40)
  ref = generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, sampling=sp, key=6, stop_ids=())
  cost = CostModel(ks=(0, 1, 2, 3), seconds=(1.0, 1.1, 1.2, 1.3))
  # EAGLE under "auto", Medusa at a fixed k (the two other pairings were the same rule twice:
  # `coupled` is the heads' common field, read by the same chain code).
  eagle, medusa = _eagle(tiny_target), _medusa(tiny_target)
  assert eagle.coupled is None and medusa.coupled is None
  out = speculative_generate(tiny_target, eagle, PROMPTS, max_new_tokens=N_NEW, sampling=sp,
                             key=6, num_draft_tokens="auto", auto=AutoK(k_max=3), cost=cost,
                             stop_ids=())
  np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=eagle.name)
  assert sum(out.stats["drafted_per_row"]) > 0  # drafts were made (and counted)
  out = speculative_generate(tiny_target, dataclasses.replace(medusa, coupled=True), PROMPTS,
                             max_new_tokens=N_NEW, sampling=sp, key=6, num_draft_tokens=2,
                             stop_ids=())
  np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=medusa.name)
