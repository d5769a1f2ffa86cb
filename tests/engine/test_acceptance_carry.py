"""`AutoK.carry`: a call of "auto" starts its pooled acceptance where the engine's last call of
the same target, drafter and sampling ended, so a drafter that is never accepted is not probed
afresh at every call; only where the emitted text cannot depend on the k's chosen."""

import numpy as np

from jaxspec import generate
from jaxspec.decoding.adaptive import AutoK, CostModel
from jaxspec.drafters import DraftModel
from jaxspec.engine import Engine

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12]]
N_NEW = 24
# A verify of 1 or 2 drafts costs 1.3x and 1.6x a plain step: at the prior (acceptance 0.5)
# drafting is predicted to pay, so the first step probes the drafter.
COST = CostModel(ks=(0, 1, 2), seconds=(1.0, 1.3, 1.6))


def _run(eng, target, drafter, **kw):
  return eng.speculative_generate(target, drafter, PROMPTS, max_new_tokens=N_NEW,
                                  num_draft_tokens="auto", cost=COST, stop_ids=(), **kw)


def test_a_poor_drafter_is_not_probed_afresh_at_every_call(tiny_target, poor_draft):
  ref = generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, stop_ids=())
  drafter = DraftModel(poor_draft)
  eng = Engine(cost_cache=False)
  first = _run(eng, tiny_target, drafter, auto=AutoK(k_max=2))
  second = _run(eng, tiny_target, drafter, auto=AutoK(k_max=2))
  for out in (first, second):
    np.testing.assert_array_equal(out.tokens, ref.tokens)
  assert first.stats["acceptance_carried"] is None
  carried = second.stats["acceptance_carried"]
  assert carried["tried"] > 0 and carried["accepted"] < 0.5 * carried["tried"]
  k1, k2 = first.stats["k_per_step"], second.stats["k_per_step"]
  assert k1[0] > 0 and k2[0] == 0, (k1, k2)  # probed at the prior, then not
  assert sum(k > 0 for k in k2) < sum(k > 0 for k in k1)
  # carry=False: every call starts from the prior (and probes at its first step).
  off = _run(eng, tiny_target, drafter, auto=AutoK(k_max=2, carry=False))
  assert off.stats["acceptance_carried"] is None and off.stats["k_per_step"][0] > 0
  # A fresh engine (or reset) carries nothing.
  eng.reset()
  assert _run(eng, tiny_target, drafter, auto=AutoK(k_max=2)).stats["acceptance_carried"] is None


def test_nothing_is_carried_where_the_text_could_depend_on_k(tiny_target, poor_draft):
  """Sampled rows with a drafter verified by its own q (coupled=False): the text depends on the
  k's chosen, so each call starts from the prior; coupled (the default under "auto") carries."""
  eng = Engine(cost_cache=False)
  kw = dict(auto=AutoK(k_max=2), temperature=0.8, key=3)
  for _ in range(2):
    out = _run(eng, tiny_target, DraftModel(poor_draft, coupled=False), **kw)
    assert out.stats["acceptance_carried"] is None
  _run(eng, tiny_target, DraftModel(poor_draft), **kw)
  again = _run(eng, tiny_target, DraftModel(poor_draft), **kw)
  assert again.stats["acceptance_carried"] is not None


def test_carry_is_checked():
  import pytest
  with pytest.raises(ValueError, match="AutoK.carry must be True or False"):
    AutoK(carry="yes")
