"""The decoding loop on every family switch, with the drafters that lean on the model's
internals: int8 self-drafting (a quantized copy of the model), Medusa on a static tree (tree
attention, whose masks must combine with sliding windows and per-layer rotary bases) and the
tree forward itself. Greedy speculative output must equal `generate` token for token on ragged
prompts, where the length-dependent rotary scalings cross their original context mid-generation
(the Hugging Face parity of each family is `tests/models/test_families.py`; these need no torch).
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

from jaxspec import heads
from jaxspec.api import generate, speculative_generate
from jaxspec.models import forward, init_cache, init_params, tiny_config
from jaxspec.models.hf_loader import check_savable
from jaxspec.models.model import Model
from jaxspec.drafters import self_drafter
from jaxspec.train.distill import draft_from_target
from helpers import FAMILIES, PATHS, assert_tree_forward_matches_plain_forward

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [7]]
N_NEW = 16
def _model(name: str) -> Model:
  cfg = tiny_config(architecture=name.split("-")[0], **FAMILIES[name])
  params = init_params(cfg, jax.random.key(7), scale=0.2)
  return Model(cfg=cfg, params=params, name=name)


# Gemma 3 (the most switches) by default, the other families under -m slow: their parity and
# greedy speculation run by default in tests/models/test_families.py.
@pytest.fixture(scope="module", params=[
    f if f == "gemma3" else pytest.param(f, marks=pytest.mark.slow) for f in FAMILIES])
def family(request):
  model = _model(request.param)
  return model, generate(model, PROMPTS, max_new_tokens=N_NEW, stop_ids=())


def test_int8_self_draft_and_medusa_tree_equal_generate(family):
  model, reference = family
  assert len(set(np.asarray(reference.tokens).ravel().tolist())) > 4  # not one repeated token
  medusa = heads.HEADS["medusa"].create(model.cfg, rngs=nnx.Rngs(0), num_heads=3)
  for drafter, k in ((self_drafter(model), 3),
                     (heads.HEADS["medusa"].drafter(medusa, model).with_tree(PATHS), None)):
    kw = {} if k is None else {"num_draft_tokens": k}
    out = speculative_generate(model, drafter, PROMPTS, max_new_tokens=N_NEW, stop_ids=(), **kw)
    np.testing.assert_array_equal(out.tokens, reference.tokens, err_msg=drafter.name)
    if k is not None:  # the int8 copy agrees often: the verify path runs with accepted drafts
      assert out.stats["acceptance_rate"] > 0.3


def test_tree_forward_matches_plain_forward(family):
  assert_tree_forward_matches_plain_forward(family[0])


def test_eagle_head_and_distilled_draft_on_a_gemma3_target():
  """An EAGLE head's one layer is a plain Llama layer whatever the target's family (the
  target's windows, caps and norms do not carry over), and a draft cut from the target keeps
  its layers' windows."""
  model = _model("gemma3")
  reference = generate(model, PROMPTS, max_new_tokens=8, stop_ids=())
  eagle = heads.HEADS["eagle"].create(model.cfg, rngs=nnx.Rngs(0), ttt_steps=1)
  drafter = heads.HEADS["eagle"].drafter(eagle, model)
  out = speculative_generate(model, drafter, PROMPTS, max_new_tokens=8, num_draft_tokens=2,
                             stop_ids=())
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  # Greedy text is the target's whatever the head proposes: the layer it runs says the rest.
  switches = ("sliding_window", "layer_types", "attn_softcap", "final_softcap", "qk_norm",
              "post_norms", "embed_scale")
  on = [n for n in switches if getattr(model.cfg, n) not in (None, False)]
  assert len(on) >= 5, on  # Gemma 3's switches, which the head's layer must not take
  default = {f.name: f.default for f in dataclasses.fields(eagle.layer_cfg)}
  assert {n: getattr(eagle.layer_cfg, n) for n in on} == {n: default[n] for n in on}
  for n, kinds in ((2, (None, 4)), (1, (None, 4))):
    draft = draft_from_target(model, n)
    assert (draft.cfg.layer_types, draft.cfg.sliding_window) == kinds  # both slide: uniform
    assert draft.cfg.sliding_rope_theta == 1e4  # ... with the sliding layers' own base
  with pytest.raises(ValueError, match="save_hf writes|saving architecture"):
    check_savable(draft_from_target(model, 2).cfg)


def test_sliding_rope_base_applies_when_every_layer_slides():
  cfg = tiny_config(sliding_window=4, rope_theta=1e6, sliding_rope_theta=1e4)
  params = init_params(cfg, jax.random.key(1), scale=0.2)
  tokens = np.arange(3, 13, dtype=np.int32)[None]
  logits = lambda c: np.asarray(forward(params, tokens, init_cache(c, 1, 16), c)[0])
  base = dataclasses.replace(cfg, rope_theta=1e4, sliding_rope_theta=None)
  np.testing.assert_array_equal(logits(cfg), logits(base))  # every layer rotates with 1e4
  unscaled = dataclasses.replace(cfg, sliding_rope_theta=None)
  assert np.abs(logits(cfg) - logits(unscaled)).max() > 1e-3
