"""The real model: greedy parity with Hugging Face, and speculative greedy equality on it."""

import numpy as np
import pytest

from helpers import REFERENCE, shared_or_skip
from jaxspec.drafters import NGram, resolve_drafter
from jaxspec.api import generate
from jaxspec.api import speculative_generate

N = 128
# The speculative equality tests decode the first NS of those steps and compare them with the
# same prefix of `generate`'s (all 128 cost about 26 s more of the suite).
NS = 64


@pytest.fixture(scope="module")
def ref():
  return np.load(shared_or_skip(REFERENCE), allow_pickle=False)


@pytest.fixture(scope="module")
def greedy(smollm2, ref):
  """Our greedy continuations of all 26 reference prompts, EOS-stopping, in three length buckets
  (40-83, 245-403 and 767-772 tokens: so shorter prompts are not padded to the longest, which
  would double the prefill's compute)."""
  lens = ref["prompt_len"]
  prompts = [ref["prompt_ids"][i, :lens[i]].tolist() for i in range(len(lens))]
  out = {}
  for bucket in (np.flatnonzero(lens <= 128), np.flatnonzero((lens > 128) & (lens <= 512)),
                 np.flatnonzero(lens > 512)):
    res = generate(smollm2, [prompts[i] for i in bucket], max_new_tokens=N, stop_ids=[2])
    for j, i in enumerate(bucket):
      out[i] = res.row(j)
  return prompts, out


def _compare_upto(ref, i):
  """Steps to compare: up to the first near-tie (top-2 margin < 1e-3), and the EOS step."""
  margins = ref["greedy_top2_margin"][i]
  ties = np.flatnonzero(margins < 1e-3)
  return int(ties[0]) if len(ties) else N


def test_greedy_continuations_match_hugging_face(ref, greedy):
  _, ours = greedy
  for i in range(len(ref["prompt_len"])):
    upto = _compare_upto(ref, i)
    eos = int(ref["greedy_eos_step"][i])
    want = ref["greedy_ids"][i].tolist()
    got = ours[i]
    if eos >= 0 and eos < upto:
      # Unmasked greedy decoding picks EOS at step `eos`: we must stop exactly there.
      assert got == want[:eos] + [2], f"prompt {i}: EOS expected at step {eos}"
    else:
      assert got[:upto] == want[:upto], f"prompt {i}: diverged before step {upto}"


def test_ngram_speculation_is_exact_on_smollm2(smollm2, greedy):
  prompts, ours = greedy
  pick = [10, 6, 23, 0]  # summarization-, rag-, stem- and coding-style prompts; mixed lengths
  out = speculative_generate(smollm2, NGram(), [prompts[i] for i in pick], max_new_tokens=NS,
                             num_draft_tokens=4, stop_ids=[2])
  for j, i in enumerate(pick):
    assert out.row(j) == ours[i][:NS], f"prompt {i}"
  assert out.stats["tau"] > 1.0


# Medusa and MLP run with -m slow (their exactness is in test_heads on the tiny target; the
# bundled EAGLE head, the CLI's default, runs always).
@pytest.mark.parametrize("kind", ["eagle", pytest.param("medusa", marks=pytest.mark.slow),
                                  pytest.param("mlp", marks=pytest.mark.slow)])
def test_bundled_heads_are_exact_and_accepted_on_smollm2(smollm2, greedy, kind):
  from jaxspec.heads import bundled_head_for
  assert bundled_head_for(smollm2) == "eagle"  # shipped in the package, and the CLI's default
  prompts, ours = greedy
  pick = [10, 0]  # a summarization-style and a coding-style prompt
  drafter = resolve_drafter(smollm2, kind)
  k = min(4, drafter.max_draft_tokens or 4)  # the MLP speculator has 3 stages
  out = speculative_generate(smollm2, kind, [prompts[i] for i in pick], max_new_tokens=NS,
                             num_draft_tokens=k, stop_ids=[2])
  for j, i in enumerate(pick):
    assert out.row(j) == ours[i][:NS], f"{kind}, prompt {i}"
  # The heads were trained: their drafts get accepted (an untrained Medusa head, the target's
  # own next-token head one position late, gives about 1.0).
  assert out.stats["tau"] > (1.25 if kind == "eagle" else 1.05), out.stats["tau"]


# Tree speculation on the real model: the bundled EAGLE head on EAGLE-2's dynamic tree and
# Medusa's static tree, both with -m slow (this module is the real-model pass's longest, the
# EAGLE tree a fifth of it): tree exactness for every drafter is in test_tree, the bundled
# heads' trees are built in tests/bench/test_bench.py::test_tree_methods_draft_trees, and the
# bundled EAGLE head's exactness and acceptance on these prompts are checked above.
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["eagle", "medusa"])
def test_tree_speculation_is_exact_on_smollm2(smollm2, greedy, kind):
  from jaxspec.heads import load_head
  prompts, ours = greedy
  pick = [10, 0]
  drafter = load_head(smollm2, kind, tree=16)  # EAGLE-2 / Medusa's measured-accuracy tree
  assert drafter.tree.num_nodes == 17
  out = speculative_generate(smollm2, drafter, [prompts[i] for i in pick], max_new_tokens=NS,
                             stop_ids=[2])
  for j, i in enumerate(pick):
    assert out.row(j) == ours[i][:NS], f"{kind} tree, prompt {i}"
  assert out.stats["tau"] > (1.4 if kind == "eagle" else 1.1), out.stats["tau"]
