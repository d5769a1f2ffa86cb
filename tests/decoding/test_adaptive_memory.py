"""The acceptance model's two memories: the positions' counts forget fast (a drop in acceptance
is followed within a few dozen steps), the row's pooled rate four times slower, so a drafter
whose probes fail is probed again after about a hundred plain steps rather than twenty."""

import dataclasses

import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import adaptive

KS = (0, 1, 2, 3)
# A CPU-like profile at a long cache: verifying 1-3 drafts costs 1.36-1.7 plain steps.
COSTS = jnp.asarray([1.0, 1.36, 1.64, 1.70])
ONE = jnp.array([True])


def _steps_until_probed_again(counts, max_steps=400):
  """Probes once (every draft rejected), then counts plain steps until k > 0 is chosen again."""
  est = adaptive.acceptance_estimate(counts, (0.5, 0.5))
  k = KS[int(adaptive.choose(est, ONE, COSTS, KS, margin=0.05)[0])]
  assert k > 0  # at the prior, drafting is predicted to pay
  counts = adaptive.update_counts(counts, 0.95, ONE, jnp.array([k]), jnp.array([0]))
  for n in range(1, max_steps):
    est = adaptive.acceptance_estimate(counts, (0.5, 0.5))
    if int(adaptive.choose(est, ONE, COSTS, KS, margin=0.05)[0]) > 0:
      return n
    counts = adaptive.update_counts(counts, 0.95, ~ONE, jnp.array([0]), jnp.array([0]))
  return max_steps


def test_a_failed_probe_is_remembered_longer_by_the_pooled_rate():
  fresh = adaptive.init_counts(1, 3)
  without = dataclasses.replace(fresh, row_tried=None, row_accepted=None)  # one fast memory
  slow, fast = _steps_until_probed_again(fresh), _steps_until_probed_again(without)
  assert fast < 50 and slow > 100, (fast, slow)  # 41 and 141 steps


def test_recent_counts_decide_while_there_are_some():
  """After a long run at acceptance 0.9, every draft then rejected: the estimate follows the
  positions' recent counts, not the row's long memory of 0.9."""
  counts = adaptive.init_counts(1, 3)
  for _ in range(200):
    counts = adaptive.update_counts(counts, 0.95, ONE, jnp.array([3]), jnp.array([3]))
  assert float(adaptive.acceptance_estimate(counts, (0.5, 0.5))[0, 0]) > 0.9
  for _ in range(30):
    counts = adaptive.update_counts(counts, 0.95, ONE, jnp.array([3]), jnp.array([0]))
  est = np.asarray(adaptive.acceptance_estimate(counts, (0.5, 0.5)))
  assert est[0, 0] < 0.35, est
  assert float(counts.row_accepted[0] / counts.row_tried[0]) > 0.5  # the long memory lags
