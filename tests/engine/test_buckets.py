"""Bucketed host calls: batch sizes and new-token counts padded to buckets share one compiled
program per bucket, and give the outputs and statistics of the exact sizes (pad rows are dead
from the prefill on and never appear)."""

import numpy as np
import pytest

from jaxspec.decoding.adaptive import AutoK
from jaxspec.drafters import NGram
from jaxspec.engine import Engine
from jaxspec.engine.io import bucket_new_tokens, bucket_rows
from jaxspec.sampling import Sampling
from helpers import CPU_LIKE

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 3, 4, 5, 3, 4, 5, 3], [7],
           [1, 2, 3, 1, 2, 3, 1, 2]]
# "auto" with a given cost model: the controller reads every live row, so a pad row that took
# part in the choice of k would show in k_per_step and tau. Prompts on which the tiny target
# repeats itself, so that every row has an n-gram match at some steps and "auto" drafts (on
# PROMPTS some row has none at almost every step, and k stays 0).
SPEC = dict(num_draft_tokens="auto", auto=AutoK(k_max=4), cost=CPU_LIKE, stop_ids=())
SPEC_PROMPTS = [[23, 23], [65] * 6, [40] * 8, [104] * 8]
SPEC_STATS = ("tau", "acceptance_rate", "acceptance_per_position",
              "conditional_acceptance_per_position", "drafted_per_row", "accepted_per_row",
              "target_passes", "plain_steps", "k_per_step", "mean_k", "batch_size")


def test_bucket_sizes():
  assert [bucket_rows(n) for n in (1, 2, 3, 4, 5, 8, 9, 17)] == [1, 2, 4, 4, 8, 8, 16, 24]
  # On a mesh: a multiple of its batch axis, or unpadded where the batch is none (the mesh
  # check then names the problem).
  assert bucket_rows(6, multiple=2) == 8 and bucket_rows(3, multiple=2) == 3
  assert [bucket_new_tokens(n) for n in (1, 16, 17, 20, 33, 256, 257)] == [
      16, 16, 32, 32, 64, 256, 512]


def _same(out, ref):
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(out.lengths, ref.lengths)
  np.testing.assert_array_equal(out.prompt_lengths, ref.prompt_lengths)
  assert (out.logprobs is None) == (ref.logprobs is None)
  if ref.logprobs is not None:
    np.testing.assert_array_equal(out.logprobs, ref.logprobs)


def test_plain_batches_and_lengths_share_one_program_per_bucket(tiny_target):
  engine, exact = Engine(), Engine(buckets=False)
  outs = {}
  for n, new in [(3, 17), (4, 17), (4, 20), (3, 20)]:
    outs[n, new] = engine.generate(tiny_target, PROMPTS[:n], max_new_tokens=new, stop_ids=())
    assert len(engine.programs) == 1, (n, new)
  assert [o.stats["compile_seconds"] > 0 for o in outs.values()] == [True, False, False, False]
  assert outs[3, 17].tokens.shape == (3, 17) and outs[4, 20].tokens.shape == (4, 20)
  five = engine.generate(tiny_target, PROMPTS, max_new_tokens=17, stop_ids=())
  assert len(engine.programs) == 2 and five.tokens.shape == (5, 17)  # the bucket of 8 rows
  ref = exact.generate(tiny_target, PROMPTS[:3], max_new_tokens=17, stop_ids=(), logprobs=True)
  _same(engine.generate(tiny_target, PROMPTS[:3], max_new_tokens=17, stop_ids=(), logprobs=True),
        ref)
  np.testing.assert_array_equal(outs[3, 17].tokens, ref.tokens)
  assert outs[3, 17].stats["new_tokens"] == 3 * 17 and outs[3, 17].stats["batch_size"] == 3
  assert ref.stats["target_passes"] == outs[3, 17].stats["target_passes"]
  np.testing.assert_array_equal(outs[3, 20].tokens[:, :17], ref.tokens)  # 17 then 20: a prefix
  np.testing.assert_array_equal(five.tokens[:3], ref.tokens)
  # Seeded sampling: a row's keys do not depend on the padded batch size.
  sp = dict(sampling=Sampling(temperature=1.0, top_p=0.9), key=7, max_new_tokens=17,
            stop_ids=())
  _same(engine.generate(tiny_target, PROMPTS[:3], **sp),
        exact.generate(tiny_target, PROMPTS[:3], **sp))
  # Per-row seeds and per-row sampling values are padded with the rest.
  per_row = dict(sp, key=[3, 1, 4], sampling=Sampling(temperature=(1.0, 0.5, 0.8)))
  _same(engine.generate(tiny_target, PROMPTS[:3], **per_row),
        exact.generate(tiny_target, PROMPTS[:3], **per_row))


def test_plain_stream_shares_its_programs_across_lengths(tiny_target):
  engine = Engine()
  ref = engine.generate(tiny_target, PROMPTS[:1], max_new_tokens=20, stop_ids=())
  for new in (17, 20):
    chunks = list(engine.generate_stream(tiny_target, PROMPTS[:1], max_new_tokens=new, chunk=8,
                                         stop_ids=()))
    assert sum((c[0] for c, _ in chunks), []) == ref.row(0)[:new]
    assert (chunks[-1][1]["compile_seconds"] > 0) == (new == 17)


def test_speculative_batches_and_lengths_share_one_program_per_bucket(tiny_target):
  engine, exact = Engine(), Engine(buckets=False)
  first = engine.speculative_generate(tiny_target, NGram(), SPEC_PROMPTS[:3], max_new_tokens=17, **SPEC)
  n = len(engine.programs)
  assert n == 2 and first.stats["compile_seconds"] > 0  # the prefill and the loop
  again = engine.speculative_generate(tiny_target, NGram(), SPEC_PROMPTS[:4], max_new_tokens=20, **SPEC)
  assert len(engine.programs) == n and again.stats["compile_seconds"] == 0.0
  assert again.tokens.shape == (4, 20)
  ref = exact.speculative_generate(tiny_target, NGram(), SPEC_PROMPTS[:3], max_new_tokens=17, **SPEC)
  assert ref.stats["compile_seconds"] > 0
  _same(first, ref)
  for k in SPEC_STATS:
    assert first.stats[k] == ref.stats[k], k
  assert first.stats["batch_size"] == 3 and len(first.stats["drafted_per_row"]) == 3
  assert sum(first.stats["accepted_per_row"]) > 0 and 0 < first.stats["plain_steps"] < len(
      first.stats["k_per_step"])  # it drafted at some steps, and not at others
  # The longer call's rows begin with the exact batch's (greedy: the same tokens, bucketed or
  # not; that greedy speculation equals plain decoding is every drafter's own test).
  np.testing.assert_array_equal(again.tokens[:3, :17], ref.tokens)
  # Seeded sampling: the same text per row, and the same statistics, as the exact batch (at
  # these temperatures the tiny target no longer repeats itself: plain steps only).
  sp = dict(SPEC, sampling=Sampling(temperature=1.0), key=11, max_new_tokens=17)
  sampled = engine.speculative_generate(tiny_target, NGram(), SPEC_PROMPTS[:3], **sp)
  sampled_ref = exact.speculative_generate(tiny_target, NGram(), SPEC_PROMPTS[:3], **sp)
  _same(sampled, sampled_ref)
  for k in SPEC_STATS:
    assert sampled.stats[k] == sampled_ref.stats[k], k
  # A call that samples has programs of its own (an all-greedy one compiles no sampling); other
  # temperatures, batches and lengths share them.
  assert len(engine.programs) == n + 2
  engine.speculative_generate(tiny_target, NGram(), SPEC_PROMPTS[:4],
                              **dict(sp, sampling=Sampling(temperature=(0.5, 0.0, 2.0, 1.0))))
  assert len(engine.programs) == n + 2
  # (Five rows take the bucket of 8, new programs: the plain test above checks it; the rows'
  # bucket is io.bucket_rows for both.)


@pytest.mark.parametrize("buckets", [True, False])
def test_a_batch_that_does_not_fit_padded_runs_unpadded(tiny_target, monkeypatch, buckets):
  """A padded batch past the memory limit falls back to the exact sizes rather than failing
  where the unbucketed call would fit."""
  from jaxspec.engine import io
  real = io.check_cache_fits
  seen = []

  def fits_three_rows(model, batch, max_len, **kw):
    seen.append(batch)
    if batch > 3:
      raise ValueError("does not fit")
    return real(model, batch, max_len, **kw)

  monkeypatch.setattr(io, "check_cache_fits", fits_three_rows)
  prep = io.prepare_prompts(tiny_target, SPEC_PROMPTS[:3], 17, bucket=buckets)
  assert prep.tokens.shape[0] == prep.rows == 3 and prep.capacity == 17
  assert seen == ([4, 3] if buckets else [3])
