"""Export of draft heads to `speculators` (EAGLE-3) and Medusa formats, and import back."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxspec import heads
from jaxspec.models import forward, init_cache, tiny_config
from jaxspec.models.errors import CheckpointError
from jaxspec.models.hf_loader import read_safetensors
from jaxspec.models.model import Model
from jaxspec.train import export


def _randomize(model, seed):
  """Non-trivial weights everywhere (Medusa starts at zero), keeping integer buffers."""
  graphdef, state = nnx.split(model)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed), len(leaves))
  leaves = [x if not jnp.issubdtype(x.dtype, jnp.floating)
            else x + 0.05 * jax.random.normal(kk, x.shape) for x, kk in zip(leaves, keys)]
  return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


def _batch(target, layers):
  tokens = jax.random.randint(jax.random.key(4), (2, 12), 0, target.cfg.vocab_size)
  _, hid, _ = forward(target.params, tokens, init_cache(target.cfg, 2, 12), target.cfg,
                      hidden_layers=layers, logits=False, fresh=True)
  batch = dict(tokens=tokens, loss_mask=jnp.ones((2, 12)), hidden_final=hid.final)
  if layers:
    batch["hidden_layers"] = jnp.transpose(hid.layers, (1, 2, 0, 3))
  return batch


@functools.partial(nnx.jit, static_argnames=("kind", "steps"))
def _predict(model, batch, frozen, *, kind, steps):
  return heads.HEADS[kind].predict(model, batch, frozen, steps)[0]


def _same_drafts(kind, a, b, target, steps, layers, exact):
  batch = _batch(target, layers)
  la = _predict(a, batch, target.params, kind=kind, steps=steps)
  lb = _predict(b, batch, target.params, kind=kind, steps=steps)
  if exact:
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), rtol=1e-6, atol=1e-6)
  else:
    np.testing.assert_allclose(np.asarray(la), np.asarray(lb), atol=0.05 * float(jnp.abs(la).max()))
  # The drafts themselves (greedy argmax, mapped to target ids).
  ids = heads.draft_ids(a)
  pa, pb = jnp.argmax(la, -1), jnp.argmax(lb, -1)
  if ids is not None:
    pa, pb = ids[pa], heads.draft_ids(b)[pb]
  agree = float(jnp.mean(pa == pb))
  assert agree == 1.0 if exact else agree > 0.9


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_eagle3_speculators_roundtrip(tmp_path, tiny_target, dtype):
  cfg = tiny_target.cfg
  model = heads.HEADS["eagle"].create(cfg, rngs=nnx.Rngs(1), version=3, draft_vocab_size=40,
                                      token_counts=np.arange(cfg.vocab_size) % 7)
  out = export.export_eagle3(tmp_path / "e3", model, tiny_target, dtype=dtype,
                             verifier_name_or_path="tiny/target", speculative_tokens=4)
  config = json.loads((out / "config.json").read_text())
  assert config["speculators_model_type"] == "eagle3"
  assert config["architectures"] == ["Eagle3Speculator"]
  assert config["draft_vocab_size"] == 40
  assert config["transformer_layer_config"]["num_hidden_layers"] == 1
  assert config["transformer_layer_config"]["vocab_size"] == cfg.vocab_size
  assert config["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in model.cfg.layers]
  sc = config["speculators_config"]
  assert sc["algorithm"] == "eagle3" and sc["verifier"]["name_or_path"] == "tiny/target"
  assert sc["proposal_methods"][0]["speculative_tokens"] == 4
  t = read_safetensors(out / "model.safetensors")
  d = cfg.hidden_size
  assert t["fc.weight"].shape == (d, 3 * d)
  assert t["layers.0.self_attn.q_proj.weight"].shape == (cfg.num_heads * cfg.head_dim, 2 * d)
  assert t["lm_head.weight"].shape == (40, d)
  ids = np.asarray(model.draft_ids[...])
  np.testing.assert_array_equal(np.arange(40) + t["d2t"], ids)  # target = draft + d2t[draft]
  assert t["t2d"].dtype == np.bool_ and t["t2d"].sum() == 40 and t["t2d"][ids].all()

  back = export.import_eagle3(out, tiny_target)
  assert back.cfg.layers == model.cfg.layers and back.cfg.draft_vocab_size == 40
  _same_drafts("eagle", model, back, tiny_target, 2, model.cfg.layers, dtype == "float32")
  if dtype == "float32":  # the importer's drafter is interchangeable with the original's
    assert heads.HEADS["eagle"].drafter(back, tiny_target) == heads.HEADS["eagle"].drafter(
        model, tiny_target)


@pytest.mark.parametrize("own_lm_head", [False, True])
def test_medusa_roundtrip(tmp_path, tiny_target, own_lm_head):
  cfg = tiny_target.cfg
  model = _randomize(heads.HEADS["medusa"].create(cfg, rngs=nnx.Rngs(0), num_heads=3,
                                                  num_layers=2, own_lm_head=own_lm_head), 2)
  out = export.export_medusa(tmp_path / "m", model, tiny_target, dtype="float32",
                             base_model_name_or_path="tiny/target")
  config = json.loads((out / "config.json").read_text())
  assert (config["medusa_num_heads"], config["medusa_num_layers"]) == (3, 2)
  t = read_safetensors(out / export.MEDUSA_WEIGHTS)
  d, v = cfg.hidden_size, cfg.vocab_size
  assert t["0.0.linear.weight"].shape == (d, d) and t["2.1.linear.bias"].shape == (d,)
  assert t["1.2.weight"].shape == (v, d)
  back = export.import_medusa(out, tiny_target)
  assert back.cfg.own_lm_head == own_lm_head  # a copy of the target's head is shared again
  _same_drafts("medusa", model, back, tiny_target, 3, (), True)


def test_import_errors(tmp_path, tiny_target):
  cfg = tiny_target.cfg
  model = heads.HEADS["medusa"].create(cfg, rngs=nnx.Rngs(0), num_heads=2)
  out = export.export_medusa(tmp_path / "m", model, tiny_target)
  other_cfg = tiny_config(hidden_size=32, num_heads=2, num_kv_heads=1)
  other = Model(other_cfg, None)  # the sizes are checked before any weight is read
  with pytest.raises(CheckpointError, match="hidden_size=64 but the target has hidden_size=32"):
    export.import_medusa(out, other)
  (out / export.MEDUSA_WEIGHTS).write_bytes(b"\x08\x00")
  with pytest.raises(CheckpointError):
    export.import_medusa(out, tiny_target)
  with pytest.raises(CheckpointError, match="is missing"):
    export.import_eagle3(tmp_path / "nothing", tiny_target)
  e3 = heads.HEADS["eagle"].create(cfg, rngs=nnx.Rngs(0), version=3)
  out3 = export.export_eagle3(tmp_path / "e3", e3, tiny_target)
  with pytest.raises(CheckpointError, match="vocab_size=128 but the target has vocab_size=64"):
    c = tiny_config(vocab_size=64)
    export.import_eagle3(out3, Model(c, None))
  with pytest.raises(ValueError, match="EAGLE-3 head"):
    export.export_eagle3(tmp_path / "e1", heads.HEADS["eagle"].create(cfg, rngs=nnx.Rngs(0)),
                         tiny_target)
