"""Top-N log-probabilities (logprobs=N) in the plain and speculative loops and the functional
API: the N most likely tokens of the target's processed distribution at every emitting
position, checked against a dense recomputation over the whole sequence."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding import decode, join_tokens, speculative_decode
from jaxspec.drafters import DraftModel
from jaxspec.models import forward, init_cache, init_params, tiny_config
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling, process_logits, sampling_arrays

IDS = jnp.asarray([[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12, 0, 0, 0, 0, 0]], jnp.int32)
LENS = jnp.asarray([8, 3], jnp.int32)
N_NEW, TOP = 10, 5
FILTERED = Sampling(temperature=[0.7, 1.3], top_k=[20, 0], top_p=[1.0, 0.9])


@pytest.fixture(scope="module")
def draft():
  cfg = tiny_config(num_layers=1)
  return Model(cfg, init_params(cfg, jax.random.key(1), scale=0.3), name="topn-draft")


def dense_top(model, out, sampling, n):
  """(ids, log-probabilities) [B, N_NEW, n] of each new token's position, from one forward pass
  over prompt + continuation and `process_logits` + `log_softmax` + a full sort."""
  tokens, lengths = join_tokens(IDS, LENS, out.tokens, out.lengths)
  b, t = tokens.shape
  logits = forward(model.params, tokens, init_cache(model.cfg, b, t), model.cfg)[0]
  sp = sampling_arrays(sampling, b)
  lp = np.asarray(jax.nn.log_softmax(process_logits(logits, sp), axis=-1))
  ids = np.full((b, N_NEW, n), -1, np.int64)
  vals = np.zeros((b, N_NEW, n), np.float32)
  for r in range(b):
    for j in range(int(out.lengths[r])):
      row = lp[r, int(LENS[r]) - 1 + j]  # the logits that predicted new token j
      order = np.argsort(-row, kind="stable")[:n]  # ties: lower id first
      ids[r, j], vals[r, j] = order, row[order]
  return ids, vals


def test_greedy_top_first_column_is_the_emitted_token(tiny_target):
  out = decode(tiny_target, IDS, LENS, 0, max_new_tokens=N_NEW, logprobs=TOP)
  assert out.top_ids.shape == (2, N_NEW, TOP) and out.top_logprobs.shape == (2, N_NEW, TOP)
  np.testing.assert_array_equal(out.top_ids[:, :, 0], out.tokens)
  np.testing.assert_allclose(out.top_logprobs[:, :, 0], out.logprobs, atol=1e-6)
  assert (np.diff(np.asarray(out.top_logprobs), axis=2) <= 0).all()  # most likely first
  ids, vals = dense_top(tiny_target, out, None, TOP)
  np.testing.assert_array_equal(out.top_ids, ids)
  np.testing.assert_allclose(out.top_logprobs, vals, atol=2e-5)


def test_sampled_top_matches_dense_recomputation(tiny_target):
  out = decode(tiny_target, IDS, LENS, 3, max_new_tokens=N_NEW, sampling=FILTERED, logprobs=TOP)
  ids, vals = dense_top(tiny_target, out, FILTERED, TOP)
  np.testing.assert_array_equal(out.top_ids, ids)
  np.testing.assert_allclose(out.top_logprobs, vals, atol=2e-5)
  # Each token's own log-probability sits among its position's top-N when it is likely enough.
  hit = np.asarray(out.top_ids) == np.asarray(out.tokens)[:, :, None]
  np.testing.assert_allclose(np.where(hit, out.top_logprobs, 0).sum(2),
                             np.where(hit.any(2), out.logprobs, 0), atol=1e-6)


def test_speculative_top_equals_plain_top_greedy(tiny_target):
  """The target drafting for itself: every draft is accepted, so tokens come from accepted
  drafts and bonus positions (the sampled test below has corrections)."""
  plain = decode(tiny_target, IDS, LENS, 0, max_new_tokens=N_NEW, logprobs=TOP)
  spec = speculative_decode(tiny_target, DraftModel(tiny_target), IDS, LENS, 0,
                            max_new_tokens=N_NEW, num_draft_tokens=3, logprobs=TOP)
  assert int(spec.stats.accepted.sum()) > 0
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.top_ids, plain.top_ids)
  np.testing.assert_allclose(spec.top_logprobs, plain.top_logprobs, atol=2e-5)


def test_speculative_sampled_top_matches_dense_recomputation(tiny_target, draft):
  """Under sampling a token may be a correction drawn from the residual: its position's top-N
  is still the target's processed distribution there."""
  spec = speculative_decode(tiny_target, DraftModel(draft), IDS, LENS, 5,
                            max_new_tokens=N_NEW, num_draft_tokens=3, sampling=FILTERED,
                            logprobs=TOP)
  assert int(spec.stats.drafted.sum()) > int(spec.stats.accepted.sum())  # corrections
  ids, vals = dense_top(tiny_target, spec, FILTERED, TOP)
  np.testing.assert_array_equal(spec.top_ids, ids)
  np.testing.assert_allclose(spec.top_logprobs, vals, atol=2e-5)


def test_top_is_padded_past_each_row_and_absent_without_n(tiny_target):
  out = decode(tiny_target, IDS, LENS, 0, max_new_tokens=4, capacity=N_NEW, logprobs=2)
  assert (np.asarray(out.top_ids)[:, 4:] == -1).all()
  assert (np.asarray(out.top_logprobs)[:, 4:] == 0).all()
  plain = decode(tiny_target, IDS, LENS, 0, max_new_tokens=4, logprobs=True)
  assert plain.top_ids is None and plain.top_logprobs is None
  zero = decode(tiny_target, IDS, LENS, 0, max_new_tokens=4, logprobs=0)  # as vLLM: no top-N
  assert zero.top_ids is None and zero.logprobs is not None


@pytest.mark.parametrize("bad", [-1, 129, 2.5, "5"])
def test_bad_logprobs_is_a_value_error(tiny_target, bad):
  with pytest.raises(ValueError, match=r"logprobs must be True/False or an int N in \[0, 128\]"):
    decode(tiny_target, IDS, LENS, 0, max_new_tokens=4, logprobs=bad)
