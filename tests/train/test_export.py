"""Export of draft heads to `speculators` (EAGLE-3) and Medusa formats, and import back."""

import functools
import math
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


def test_medusa_import_refuses_what_it_does_not_read(tmp_path, tiny_target):
  """An LM-head bias, or heads and layers past the config's counts, are tensors jaxspec's
  Medusa would not read: a CheckpointError naming them; zero heads or layers too."""
  from jaxspec.models.hf_loader import write_safetensors
  model = heads.HEADS["medusa"].create(tiny_target.cfg, rngs=nnx.Rngs(0), num_heads=2)
  out = export.export_medusa(tmp_path / "m", model, tiny_target, dtype="float32")
  t = read_safetensors(out / export.MEDUSA_WEIGHTS)
  v = tiny_target.cfg.vocab_size
  for name, extra in (("1.1.bias", np.zeros((v,), np.float32)),
                      ("2.0.linear.bias", t["0.0.linear.bias"])):
    write_safetensors(out / export.MEDUSA_WEIGHTS, {**t, name: extra})
    with pytest.raises(CheckpointError, match=rf"tensors \['{name}'\] that jaxspec's Medusa"):
      export.import_medusa(out, tiny_target)
  write_safetensors(out / export.MEDUSA_WEIGHTS, t)
  config = json.loads((out / "config.json").read_text())
  (out / "config.json").write_text(json.dumps(dict(config, medusa_num_layers=0)))
  with pytest.raises(CheckpointError, match="must be at least 1"):
    export.import_medusa(out, tiny_target)


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


# ---------------------------------------------------------------------------------------------
# EAGLE 3.1 (speculators' norm_before_fc, fc_norm, norm_output, norm_before_residual) against a
# reference forward written here from the speculators model, on the exported tensors.


def _rms(x, w, eps):
  return w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps))


def _rope(x, pos, theta):
  """Hugging Face's rotate-half rotary embedding: x [B, T, H, K], pos [T]."""
  k = x.shape[-1]
  inv = 1.0 / theta ** (np.arange(0, k, 2) / k)
  ang = pos[:, None] * inv[None]  # [T, K/2]
  cos = np.cos(np.concatenate([ang, ang], -1))[None, :, None]
  sin = np.sin(np.concatenate([ang, ang], -1))[None, :, None]
  rot = np.concatenate([-x[..., k // 2:], x[..., :k // 2]], -1)
  return x * cos + rot * sin


def _reference_eagle3(t, config, cfg, embed, layers_btnd, tokens, steps):
  """speculators' Eagle3DraftModel forward with teacher-forced tokens: logits [B, T, steps, N].

  Step j's queries at position t attend the step-0 keys at positions <= t and the keys of
  steps 1..j at position t only (speculators' extend_mask_for_draft_tokens)."""
  eps, theta = cfg.rms_norm_eps, cfg.rope_theta
  lc = config["transformer_layer_config"]
  h_, g_, k_ = lc["num_attention_heads"], lc["num_key_value_heads"], lc["head_dim"]
  b, n_t = tokens.shape
  hs = layers_btnd.reshape(b, n_t, -1)
  if config["norm_before_fc"]:
    hs = _rms(hs, t["input_norm.weight"], eps)
  if config["fc_norm"]:
    chunks = np.split(hs, layers_btnd.shape[2], axis=-1)
    hs = np.concatenate([_rms(c, t[f"fc_norm.{i}.weight"], eps) for i, c in enumerate(chunks)],
                        -1)
  feat = hs @ t["fc.weight"].T
  p = "layers.0."
  keys, values, out = [], [], []
  for j in range(steps):
    tok = np.concatenate([tokens[:, 1 + j:], np.zeros((b, 1 + j), tokens.dtype)], 1)
    emb = embed[tok]
    normed = _rms(feat, t[p + "hidden_norm.weight"], eps)
    x = np.concatenate([_rms(emb, t[p + "input_layernorm.weight"], eps), normed], -1)
    resid = normed if config["norm_before_residual"] else feat
    pos = np.arange(n_t) + 1.0 + j
    q = _rope((x @ t[p + "self_attn.q_proj.weight"].T).reshape(b, n_t, h_, k_), pos, theta)
    k = _rope((x @ t[p + "self_attn.k_proj.weight"].T).reshape(b, n_t, g_, k_), pos, theta)
    v = (x @ t[p + "self_attn.v_proj.weight"].T).reshape(b, n_t, g_, k_)
    keys.append(k)
    values.append(v)
    rep = h_ // g_
    attn = np.zeros((b, n_t, h_, k_))
    for hh in range(h_):
      gg = hh // rep
      s0 = np.einsum("btk,bsk->bts", q[:, :, hh], keys[0][:, :, gg]) / np.sqrt(k_)
      s0 = np.where(np.tril(np.ones((n_t, n_t), bool)), s0, -np.inf)
      own = [np.einsum("btk,btk->bt", q[:, :, hh], kk[:, :, gg])[..., None] / np.sqrt(k_)
             for kk in keys[1:]]
      s = np.concatenate([s0] + own, -1)
      w = np.exp(s - s.max(-1, keepdims=True))
      w = w / w.sum(-1, keepdims=True)
      o = np.einsum("bts,bsk->btk", w[..., :n_t], values[0][:, :, gg])
      for i, vv in enumerate(values[1:]):
        o = o + w[..., n_t + i, None] * vv[:, :, gg]
      attn[:, :, hh] = o
    hid = resid + attn.reshape(b, n_t, -1) @ t[p + "self_attn.o_proj.weight"].T
    m = _rms(hid, t[p + "post_attention_layernorm.weight"], eps)
    gate = m @ t[p + "mlp.gate_proj.weight"].T
    hid = hid + ((gate / (1 + np.exp(-gate))) * (m @ t[p + "mlp.up_proj.weight"].T)) @ t[
        p + "mlp.down_proj.weight"].T
    if config["norm_output"]:
      hid = _rms(hid, t["norm.weight"], eps)
      out.append(hid @ t["lm_head.weight"].T)
    else:
      out.append(_rms(hid, t["norm.weight"], eps) @ t["lm_head.weight"].T)
    feat = hid
  return np.stack(out, 2)


EAGLE31_CASES = [dict(), dict(norm_before_fc=True, norm_output=True),
                 dict(fc_norm=True, norm_output=True), dict(norm_before_residual=True),
                 dict(fc_norm=True)]


@pytest.mark.parametrize("switches", EAGLE31_CASES, ids=lambda s: "+".join(s) or "plain")
def test_eagle31_switches_match_the_speculators_forward(tmp_path, tiny_target, switches):
  cfg = tiny_target.cfg
  model = _randomize(heads.HEADS["eagle"].create(cfg, rngs=nnx.Rngs(3), version=3,
                                                 draft_vocab_size=48,
                                                 token_counts=np.arange(cfg.vocab_size) % 11,
                                                 **switches), 5)
  out = export.export_eagle3(tmp_path / "e31", model, tiny_target, dtype="float32")
  config = json.loads((out / "config.json").read_text())
  for name in heads.EAGLE3_SWITCHES:
    assert config[name] is bool(switches.get(name))
  t = {k: np.asarray(v, np.float64) for k, v in read_safetensors(out / "model.safetensors").items()}
  assert ("input_norm.weight" in t) == bool(switches.get("norm_before_fc"))
  assert ("fc_norm.0.weight" in t) == bool(switches.get("fc_norm"))
  batch = _batch(tiny_target, model.cfg.layers)
  steps = 3
  mine = np.asarray(_predict(model, batch, tiny_target.params, kind="eagle", steps=steps))
  ref = _reference_eagle3(t, config, cfg, np.asarray(tiny_target.params.embed, np.float64),
                          np.asarray(batch["hidden_layers"], np.float64),
                          np.asarray(batch["tokens"]), steps)
  np.testing.assert_allclose(mine, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
  back = export.import_eagle3(out, tiny_target)
  assert all(getattr(back.cfg, k) == getattr(model.cfg, k) for k in heads.EAGLE3_SWITCHES)
  _same_drafts("eagle", model, back, tiny_target, steps, model.cfg.layers, True)


def test_eagle31_switches_change_the_function(tiny_target):
  """Each switch changes the drafts' logits (so the reference test above can fail)."""
  cfg = tiny_target.cfg
  batch = _batch(tiny_target, (0, 1, 1))

  def logits(**switches):
    m = _randomize(heads.HEADS["eagle"].create(cfg, rngs=nnx.Rngs(3), version=3,
                                               layers=(0, 1, 1), **switches), 5)
    return np.asarray(_predict(m, batch, tiny_target.params, kind="eagle", steps=2))

  plain = logits()
  for name in heads.EAGLE3_SWITCHES:
    assert not np.allclose(logits(**{name: True}), plain, atol=1e-4), name
  with pytest.raises(ValueError, match="exclusive"):
    heads.HEADS["eagle"].create(cfg, rngs=nnx.Rngs(0), version=3, norm_before_fc=True,
                                fc_norm=True)
  with pytest.raises(ValueError, match=r"\['norm_output'\] are EAGLE-3 switches"):
    heads.HEADS["eagle"].create(cfg, rngs=nnx.Rngs(0), version=1, norm_output=True)


def _edit_checkpoint(src, dst, *, config=None, layer=None, add=None, drop=()):
  import shutil
  from jaxspec.models.hf_loader import write_safetensors
  shutil.copytree(src, dst)
  c = json.loads((dst / "config.json").read_text())
  c.update(config or {})
  c["transformer_layer_config"].update(layer or {})
  (dst / "config.json").write_text(json.dumps(c))
  if add or drop:
    t = dict(read_safetensors(dst / "model.safetensors"))
    t.update(add or {})
    for name in drop:
      del t[name]
    write_safetensors(dst / "model.safetensors", t, metadata={"format": "pt"})
  return dst


def test_import_eagle3_refuses_every_unknown_setting_and_tensor(tmp_path, tiny_target):
  cfg = tiny_target.cfg
  model = heads.HEADS["eagle"].create(cfg, rngs=nnx.Rngs(0), version=3)
  src = export.export_eagle3(tmp_path / "src", model, tiny_target, dtype="float32")
  export.import_eagle3(src, tiny_target)  # the unedited export imports
  d = cfg.hidden_size
  cases = [
      (dict(config={"use_off_policy_tokens_at_inference": True}),
       r"sets \['use_off_policy_tokens_at_inference'\]"),
      (dict(config={"my_new_norm": "rms"}), r"sets \['my_new_norm'\]"),
      (dict(config={"norm_before_fc": True, "fc_norm": True}), "exclude each other"),
      (dict(config={"norm_before_fc": True}), "has no tensor 'input_norm.weight'"),
      (dict(layer={"hidden_act": "gelu"}), "hidden_act='gelu'"),
      (dict(layer={"mlp_bias": True}), "mlp_bias=True"),
      (dict(layer={"sliding_window": 4}), "sliding_window=4"),
      (dict(layer={"model_type": "qwen3"}), "'qwen3' layer"),
      (dict(layer={"rope_theta": 500000.0}), "rope_theta=500000.0 but the target"),
      (dict(layer={"rms_norm_eps": 1e-3}), "rms_norm_eps=0.001 but the target"),
      (dict(layer={"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}), "rope_scaling"),
      (dict(add={"fc.bias": np.zeros(d, np.float32)}), r"tensors \['fc.bias'\]"),
      (dict(add={"layers.0.self_attn.q_norm.weight": np.ones(16, np.float32),
                 "extra.scale": np.ones(1, np.float32)}),
       r"tensors \['extra.scale', 'layers.0.self_attn.q_norm.weight'\]"),
      (dict(add={"embed_tokens.weight": np.ones((cfg.vocab_size, d), np.float32)}),
       "embed_tokens.weight that differs"),
      (dict(layer={"num_attention_heads": 0}), r"has no \['num_attention_heads'\]"),
      (dict(add={"layers.0.self_attn.q_proj.weight": np.ones((5, 2 * d), np.float32)}),
       r"'layers.0.self_attn.q_proj.weight' has shape \(5, 128\), which the config's"),
      (dict(add={"d2t": np.zeros(5, np.int64)}), r"d2t has shape \(5,\) but draft_vocab_size"),
  ]
  for i, (edit, match) in enumerate(cases):
    bad = _edit_checkpoint(src, tmp_path / f"bad{i}", **edit)
    with pytest.raises(CheckpointError, match=match):
      export.import_eagle3(bad, tiny_target)
  # Off settings and the target's own tensors are fine.
  ok = _edit_checkpoint(src, tmp_path / "ok", config={"some_future_switch": False},
                        add={"embed_tokens.weight": np.asarray(tiny_target.params.embed),
                             "verifier_norm.weight": np.ones(d, np.float32)})
  export.import_eagle3(ok, tiny_target)
  # The rotary scaling must be the target's, both ways: the head uses the target's.
  import dataclasses as dc
  from jaxspec.models.config import RopeScaling
  scaled = Model(dc.replace(cfg, rope_scaling=RopeScaling(rope_type="linear", factor=2.0)),
                 tiny_target.params)
  with pytest.raises(CheckpointError, match="rope_scaling=None but the target's is linear x2"):
    export.import_eagle3(src, scaled)
  same = _edit_checkpoint(src, tmp_path / "linear2",
                          layer={"rope_scaling": {"rope_type": "linear", "factor": 2.0}})
  export.import_eagle3(same, scaled)
  other = _edit_checkpoint(src, tmp_path / "linear4",
                           layer={"rope_scaling": {"rope_type": "linear", "factor": 4.0}})
  with pytest.raises(CheckpointError, match="the target's is linear x2"):
    export.import_eagle3(other, scaled)


# ---------------------------------------------------------------------------------------------
# MLP speculator <-> vLLM's mlp_speculator.


def _reference_mlp_speculator(t, config, hidden, tokens, steps):
  """vLLM's MLPSpeculator.generate_proposals, teacher-forced: logits [B, T, steps, V]."""
  def ln(x, w=None, b=None, eps=1e-6):
    x = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)
    return x if w is None else w * x + b

  n = config["n_predict"]
  inner = config["inner_dim"] or config["emb_dim"]
  sw = 0.5 ** (0.5 / n)
  ew = np.sqrt((1 - sw ** 2) * (inner / 2))
  s = ln(hidden) / np.sqrt(2) if config["scale_input"] else hidden
  tied = config["tie_weights"]
  out = []
  for j in range(steps):
    c = 0 if tied else j
    pj = min(j, 1) if tied else j
    tok = np.concatenate([tokens[:, 1 + j:], np.zeros((tokens.shape[0], 1 + j), tokens.dtype)], 1)
    z = s @ t[f"proj.{pj}.weight"].T + (ew / sw) * t[f"emb.{c}.weight"][tok]
    z = ln(z, t[f"ln.{c}.weight"], t[f"ln.{c}.bias"])
    s = 0.5 * z * (1 + np.vectorize(math.erf)(z / np.sqrt(2)))  # exact GELU
    out.append(s @ t[f"head.{c}.weight"].T)
  return np.stack(out, 2)


@pytest.mark.parametrize("tie_stages,inner_dim", [(False, 0), (True, 48)])
def test_mlp_speculator_roundtrip_and_vllm_forward(tmp_path, tiny_target, tie_stages, inner_dim):
  cfg = tiny_target.cfg
  model = _randomize(heads.HEADS["mlp"].create(cfg, rngs=nnx.Rngs(2), n_predict=3, norm="rms",
                                               tie_stages=tie_stages, inner_dim=inner_dim), 7)
  out = export.export_mlp_speculator(tmp_path / "mlp", model, tiny_target, dtype="float32")
  config = json.loads((out / "config.json").read_text())
  assert config["model_type"] == "mlp_speculator"
  assert (config["n_predict"], config["emb_dim"], config["vocab_size"]) == (3, 64, 128)
  assert config["inner_dim"] == inner_dim and config["tie_weights"] is tie_stages
  t = {k: np.asarray(v, np.float64) for k, v in read_safetensors(out / export.MLP_WEIGHTS).items()}
  i = inner_dim or cfg.hidden_size
  names = {"proj.0.weight", "proj.1.weight", "emb.0.weight", "head.0.weight", "ln.0.weight",
           "ln.0.bias"}
  if not tie_stages:
    names |= {f"{p}.{j}.{w}" for j in (1, 2) for p, w in
              (("emb", "weight"), ("head", "weight"), ("ln", "weight"), ("ln", "bias"))}
    names.add("proj.2.weight")
  assert set(t) == names
  assert t["proj.0.weight"].shape == (i, 64) and t["head.0.weight"].shape == (128, i)
  batch = _batch(tiny_target, ())
  mine = np.asarray(_predict(model, batch, tiny_target.params, kind="mlp", steps=3))
  ref = _reference_mlp_speculator(t, config, np.asarray(batch["hidden_final"], np.float64),
                                  np.asarray(batch["tokens"]), 3)
  np.testing.assert_allclose(mine, ref, rtol=2e-4, atol=2e-4 * np.abs(ref).max())
  back = export.import_mlp_speculator(out, tiny_target)
  assert back.cfg.norm == "rms" and back.cfg.tie_stages == tie_stages
  _same_drafts("mlp", model, back, tiny_target, 3, (), True)
  # fms-extras' own checkpoints prefix the tensors with "speculator.".
  import shutil
  from jaxspec.models.hf_loader import write_safetensors
  fms = tmp_path / "fms"
  shutil.copytree(out, fms)
  write_safetensors(fms / export.MLP_WEIGHTS, {"speculator." + k: v.astype(np.float32)
                                               for k, v in t.items()})
  _same_drafts("mlp", model, export.import_mlp_speculator(fms, tiny_target), tiny_target, 3, (),
               True)


def test_mlp_speculator_export_and_import_refusals(tmp_path, tiny_target):
  cfg = tiny_target.cfg
  tied = heads.HEADS["mlp"].create(cfg, rngs=nnx.Rngs(0), tie_to_target=True)
  with pytest.raises(ValueError, match="tie_to_target=True"):
    export.export_mlp_speculator(tmp_path / "a", tied, tiny_target)
  layer_norm = heads.HEADS["mlp"].create(cfg, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="norm='layer'"):
    export.export_mlp_speculator(tmp_path / "b", layer_norm, tiny_target)
  with pytest.raises(ValueError, match="norm must be one of"):
    heads.HEADS["mlp"].create(cfg, rngs=nnx.Rngs(0), norm="batch")
  good = heads.HEADS["mlp"].create(cfg, rngs=nnx.Rngs(0), norm="rms", n_predict=2)
  src = export.export_mlp_speculator(tmp_path / "src", good, tiny_target, dtype="float32")
  bad = _mlp_edit(src, tmp_path / "c", config={"use_ln0_bias": True})
  with pytest.raises(CheckpointError, match=r"sets \['use_ln0_bias'\]"):
    export.import_mlp_speculator(bad, tiny_target)
  bad = _mlp_edit(src, tmp_path / "d", add={"emb.2.weight": np.zeros((128, 64), np.float32)})
  with pytest.raises(CheckpointError, match=r"tensors \['emb.2.weight'\]"):
    export.import_mlp_speculator(bad, tiny_target)
  bad = _mlp_edit(src, tmp_path / "e", config={"emb_dim": 32})
  with pytest.raises(CheckpointError, match="hidden_size=32 but the target has hidden_size=64"):
    export.import_mlp_speculator(bad, tiny_target)


def _mlp_edit(src, dst, *, config=None, add=None):
  import shutil
  from jaxspec.models.hf_loader import write_safetensors
  shutil.copytree(src, dst)
  c = json.loads((dst / "config.json").read_text())
  c.update(config or {})
  (dst / "config.json").write_text(json.dumps(c))
  if add:
    t = dict(read_safetensors(dst / export.MLP_WEIGHTS))
    t.update(add)
    write_safetensors(dst / export.MLP_WEIGHTS, t, metadata={"format": "pt"})
  return dst
