"""Later positions: every sampled token after the rollbacks of earlier steps follows the
target's exact marginal (its own module, so pytest-xdist runs it beside test_speculative)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import DraftModel, NGram, Sampling, speculative_generate
from jaxspec.sampling import probs
from helpers import chi2_critical


N_POS = 6  # new tokens checked per row: the prefill's, then five through verify passes
MC_ROWS = 30000  # a 0.01 shift in a token's probability gives a noncentrality of about 40


_MARGINALS: dict = {}


def _exact_marginals(target, prompt, sp, n_pos):
  """[n_pos, V] the target's exact distribution of each new token, averaged over histories
  (every prefix of V^(j-1) tokens enumerated, weighted by its probability); computed once per
  target, prompt and setting."""
  key = (id(target), tuple(prompt), repr(sp), n_pos)
  if key not in _MARGINALS:
    _MARGINALS[key] = _enumerate_marginals(target, prompt, sp, n_pos)
  return _MARGINALS[key]


def _enumerate_marginals(target, prompt, sp, n_pos):
  from jaxspec.decoding.plain import prefill
  v = target.cfg.vocab_size
  prefixes = np.zeros((1, 0), np.int64)
  weight = np.ones(1)
  out = []
  for _ in range(n_pos):
    seqs = np.concatenate([np.tile(prompt, (len(prefixes), 1)), prefixes], axis=1)
    n = len(seqs)
    lg, _, _ = prefill(target.params, jnp.asarray(seqs, jnp.int32),
                       jnp.full((n,), seqs.shape[1], jnp.int32), target.cfg, seqs.shape[1] + 1)
    p = np.asarray(probs(lg, sp.arrays(n)), np.float64)  # [n, V]
    out.append((weight[:, None] * p).sum(0))
    weight = (weight[:, None] * p).reshape(-1)
    prefixes = np.concatenate([np.repeat(prefixes, v, axis=0),
                               np.tile(np.arange(v), len(prefixes))[:, None]], axis=1)
  return np.stack(out)


def _assert_positions_follow(tokens, marginals, what):
  """Chi-square of every position's tokens against its exact marginal at the 1e-4 tail."""
  for j, p in enumerate(marginals):
    obs = np.bincount(tokens[:, j], minlength=len(p)).astype(np.float64)
    assert obs[p == 0].sum() == 0, f"{what}: position {j} emitted a token of probability 0"
    exp = p * len(tokens)
    keep = exp >= 5
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    assert chi2 < chi2_critical(int(keep.sum()) - 1), (what, j, chi2, obs, exp)


def _mc_drafter(name, target, draft):
  from jaxspec import heads
  from jaxspec.decoding.adaptive import AutoK, CostModel
  if name == "ngram":
    return NGram(max_ngram=2), 3, {}
  if name == "draft-model":
    return DraftModel(draft), 2, {}
  if name == "draft-model-p_min":
    # The draft's top probability is below 0.5 at about a third of its drafts here (below 0.3
    # at none): drafts are stopped by p_min, and the test counts them.
    return DraftModel(draft, p_min=0.5), 3, {}
  if name == "auto":  # k changes with the acceptance model; plain steps happen
    cost = CostModel(ks=(0, 1, 2, 3), seconds=(1.0, 1.3, 1.45, 1.6))
    return DraftModel(draft), "auto", dict(auto=AutoK(k_max=3), cost=cost)
  from flax import nnx
  m = heads.HEADS["medusa"].create(target.cfg, rngs=nnx.Rngs(3), num_heads=2)
  tree = heads.HEADS["medusa"].drafter(m, target).with_tree([[0], [1], [0, 0], [0, 1], [1, 0]])
  return tree, "auto", {}


# "draft-model" (a fixed k) runs the standard rule; under "auto" the same drafter is coupled.
# slow: "ngram" and "auto" (where the draft model is coupled) sample `generate`'s own text for the
# key, which test_speculative asserts token for token, a stronger check than a chi-square;
# "draft-model" and "draft-model-p_min" run in test_penalties' later-position test (the same
# draft, k and target, p_min = 0.5 stopping some drafts, counted there), "tree" in
# test_penalties' (the same Medusa tree on the same target).
@pytest.mark.parametrize("name", [pytest.param("ngram", marks=pytest.mark.slow),
                                  pytest.param("draft-model", marks=pytest.mark.slow),
                                  pytest.param("draft-model-p_min", marks=pytest.mark.slow),
                                  pytest.param("auto", marks=pytest.mark.slow),
                                  pytest.param("tree", marks=pytest.mark.slow)])
def test_monte_carlo_later_positions(small_vocab, name):
  """30,000 rows of 6 sampled tokens: at every position, after the rollbacks of earlier
  steps, the tokens follow the target's exact marginal (chi-square at the 1e-4 tail). Drafts
  are really verified and rejected (both paths of the rule)."""
  target, draft = small_vocab
  drafter, k, kw = _mc_drafter(name, target, draft)
  sp = Sampling(temperature=1.0, top_k=7)
  prompt = [1, 2, 3, 1, 2, 3, 1, 2]
  out = speculative_generate(target, drafter, [prompt] * MC_ROWS, max_new_tokens=N_POS,
                             sampling=sp, num_draft_tokens=k, key=2024, max_len=24, **kw)
  assert (out.lengths == N_POS).all()
  _assert_positions_follow(out.tokens[:, :N_POS], _exact_marginals(target, prompt, sp, N_POS),
                           name)
  st_ = out.stats
  assert 0.02 < st_["acceptance_rate"] < 0.98, st_["acceptance_rate"]
  assert st_["target_passes"] >= 3
  if name == "auto":
    assert len(set(st_["k_per_step"])) > 1, st_["k_per_step"]
  if name == "draft-model":  # the count below is exact: no p_min, no draft stopped
    assert _drafts_stopped(out, k) == 0
  if name == "draft-model-p_min":
    assert _drafts_stopped(out, k) > 0.1 * k * _row_steps(out), st_["drafted_per_row"][:8]


def _row_steps(out) -> int:
  """Verify passes over all live rows: tau is new tokens emitted (after the prefill's first)
  per live row-step."""
  emitted = int(out.lengths.sum()) - len(out.lengths)
  return round(emitted / out.stats["tau"])


def _drafts_stopped(out, k: int) -> int:
  """Drafts not proposed in a run whose every step asked for k: those p_min stopped."""
  assert out.stats["plain_steps"] == 0 and set(out.stats["k_per_step"]) == {k}
  return k * _row_steps(out) - sum(out.stats["drafted_per_row"])
