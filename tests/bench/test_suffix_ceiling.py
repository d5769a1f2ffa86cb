"""benchmarks/suffix_ceiling.py: its offline replay of suffix decoding over fixed samples gives
the target passes the jitted loop takes on the same samples, and its oracles' arithmetic."""

import sys

import numpy as np
import pytest

from helpers import ROOT
from jaxspec.bench import RolloutSettings, run_rollout
from jaxspec.drafters import SuffixDecoding
from jaxspec.drafters.suffix import SEP
from jaxspec.models import tiny_config
from jaxspec.models.synthetic import random_model

sys.path.insert(0, str(ROOT / "benchmarks"))
import suffix_ceiling  # noqa: E402


def test_oracles_on_a_hand_made_haystack():
  hay = np.array([1, 2, 3, 4, 9, SEP, 7, 2, 3, 5, 6, SEP, 2, 3], np.int64)
  # How many of the row's last tokens end at each position; the row's own end (the haystack's
  # last position) has nothing after it.
  assert suffix_ceiling._match(hay, np.array([1, 2, 3]), 16).tolist() == [
      0, 0, 3, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0]
  assert suffix_ceiling._match(hay, np.array([1, 2, 3]), 2).max() == 2  # at most m
  # The longest match ends at 2 (continuing 4, 9); position 8 matches 2 tokens (5, 6).
  tail = np.array([1, 2, 3])
  assert suffix_ceiling._oracle(hay, tail, np.array([4, 9, 1]), 16, longest=True) == 2
  assert suffix_ceiling._oracle(hay, tail, np.array([5, 6, 1]), 16, longest=True) == 0
  assert suffix_ceiling._oracle(hay, tail, np.array([5, 6, 1]), 16, longest=False) == 2
  assert suffix_ceiling._oracle(hay, tail, np.array([8, 6, 1]), 16, longest=False) == 0
  assert suffix_ceiling._oracle(hay, np.array([8]), np.array([4]), 16, longest=False) == 0


@pytest.mark.slow  # a rollout run and its replay (about 25 s); the oracles' test stays default
def test_replay_takes_the_loops_target_passes(tmp_path):
  # A peaked tiny model (the next token is the current one with about 0.7 of the mass): its
  # samples repeat themselves in part, so suffix drafts are often accepted, and often not.
  target = random_model(tiny_config(), peak=6.0)
  prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 30, 4, 9, 30]]
  s = RolloutSettings(samples=3, temperatures=(0.8,), batch_sizes=(1,), max_new_tokens=24,
                      methods=("none", "suffix"), num_draft_tokens=3, corpus_size=96,
                      out=str(tmp_path), progress=False)
  rep = run_rollout(s, target=target, prompt_ids=prompts)
  cell = next(c for c in rep["results"] if c["method"] == "suffix")
  samples = suffix_ceiling.rollouts(target, prompts, 0.8, 3, 24, s.seed)
  drafter = SuffixDecoding(vocab=target.cfg.vocab_size, corpus_size=96)
  width = 7 + 24 + 4
  propose = suffix_ceiling.proposer(drafter, 3)
  corpus, passes, emitted, oracle = drafter.params, 0, 0, 0
  for prompt, group in zip(prompts, samples):
    rules, corpus = suffix_ceiling.replay(drafter, prompt, group, corpus, 3, width, propose)
    passes += rules["suffix"][0]
    emitted += rules["suffix"][1]
    oracle += rules["oracle-any"][0]
  assert emitted == cell["emitted"] == sum(len(y) - 1 for g in samples for y in g)
  assert passes == cell["row_steps"]
  assert cell["accepted"] > 20  # drafts were accepted: the counts are not all one per pass
  assert oracle <= passes  # the oracle needs no more passes than the drafter
