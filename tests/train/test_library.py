"""Training as library functions: `train_head` with a user's own optax optimizer and a plain
generator of batches, callbacks, online hidden states equal to stored ones, the loss choices
(`heads.Objective`), one fingerprint for heads and data, and training on a 2 x 4 mesh of CPU
devices (the single-device losses; a resume bit-identical)."""

import dataclasses
import functools
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxspec import heads
from jaxspec.models.model import Model
from jaxspec.train import (Dataset, TrainConfig, distill, target_hidden, train_head,
                           with_hidden_states)
from jaxspec.train.data import DataConfig, DataError, _fingerprint_v1, write_dataset

EAGLE3 = dict(version=3, layers=(0, 1, 1), ttt_steps=2)


def random_batches(vocab, *, rows=4, width=16, seed=0, n=None):
  """A plain generator of batches: random prompts, the second half of each row a response."""
  rng = np.random.default_rng(seed)
  i = 0
  while n is None or i < n:
    tokens = rng.integers(3, vocab, size=(rows, width)).astype(np.int32)
    mask = np.zeros((rows, width), np.float32)
    mask[:, width // 2:] = 1
    yield {"tokens": tokens, "loss_mask": mask}
    i += 1


@pytest.fixture(scope="module")
def stored(tiny_target, tmp_path_factory):
  """A dataset with the hidden states EAGLE3 reads, stored (float16)."""
  rng = np.random.default_rng(3)
  prompts = [rng.integers(3, 128, size=int(rng.integers(3, 8))).tolist() for _ in range(16)]
  cfg = DataConfig(max_prompt_len=8, max_new_tokens=8, batch_size=16, hidden_batch_size=8,
                   chat=False, hidden_layers=(0, 1))
  path = write_dataset(tiny_target, prompts, tmp_path_factory.mktemp("d") / "ds", cfg,
                       progress=False)
  return path


def _params(model):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_train_head_with_own_optimizer_and_a_plain_generator(tiny_target, tmp_path):
  v = tiny_target.cfg.vocab_size
  logged, evals, saved = [], [], []

  class Watch:
    def on_eval(self, step, record):
      evals.append((step, record["eval_loss"]))

    def on_save(self, step, path):
      saved.append((step, path.name))

  held_out = list(random_batches(v, seed=9, n=2))
  fixed = list(random_batches(v, n=2))

  def batches():  # a plain generator, over two batches again and again (the loss must fall)
    while True:
      yield from fixed

  run = train_head(tiny_target, "eagle", batches(), options=EAGLE3, steps=24,
                   log_every=4, eval_every=12, save_every=12,
                   optimizer=optax.adam(1e-2), out_dir=tmp_path / "run",
                   callbacks=[lambda step, rec: logged.append((step, rec["loss"])), Watch()],
                   eval_data=held_out)
  assert [s for s, _ in logged] == [4, 8, 12, 16, 20, 24]  # host syncs on logged steps only
  assert [s for s, _ in evals] == [12, 24] and saved == [(12, "12"), (24, "24")]
  assert logged[-1][1] < 0.8 * run.history[0]["loss"]
  assert "lr" not in run.history[0]  # a given optimizer's rate is its own
  assert json.loads((tmp_path / "run" / "train_config.json").read_text())["optimizer"] == "given"
  assert run.kind == "eagle" and run.model.cfg.ttt_steps == 2
  # The optimizer given is the one used: plain SGD with rate 0 changes nothing.
  still = train_head(tiny_target, "medusa", random_batches(v), steps=3,
                     optimizer=optax.sgd(0.0), options=dict(num_heads=2))
  fresh = heads.HEADS["medusa"].create(tiny_target.cfg, rngs=nnx.Rngs(0), num_heads=2)
  jax.tree.map(np.testing.assert_array_equal, _params(still.model), _params(fresh))
  drafter = run.drafter(tiny_target)
  assert drafter == heads.HEADS["eagle"].drafter(run.model, tiny_target)
  back = heads.load_head(tiny_target, run.save(tmp_path / "saved", tiny_target, dtype="float32"))
  assert back == drafter


def test_eagle_lm_head_starts_from_the_target(tiny_target, tmp_path):
  """lm_head_init="target": the own LM head is the target's output rows of the draft vocabulary
  and its norm the target's final norm, so at step 0 the head's logits over the draft vocabulary
  are the target's logits of whatever hidden state the layer produces; a creation option, not
  a config field: the saved head loads without the target's weights."""
  from jaxspec.models.llama import lm_head_weight
  v = tiny_target.cfg.vocab_size
  ids = np.array([5, 3, 40, 7, v - 1, 11, 0, 64], np.int32)
  run = train_head(tiny_target, "eagle", random_batches(v), steps=1, optimizer=optax.sgd(0.0),
                   options=dict(EAGLE3, draft_vocab=ids, lm_head_init="target"))
  w = np.asarray(lm_head_weight(tiny_target.params))
  np.testing.assert_array_equal(np.asarray(run.model.lm_head[...]), w[:, ids])
  np.testing.assert_array_equal(np.asarray(run.model.norm[...]),
                                np.asarray(tiny_target.params.final_norm, np.float32))
  assert run.options["lm_head_init"] == "target" and "target_params" not in run.options
  _, back, _ = heads.load_head_model(tiny_target,
                                     run.save(tmp_path / "h", tiny_target, dtype="float32"))
  np.testing.assert_array_equal(np.asarray(back.lm_head[...]), w[:, ids])
  # The default stays random; the option needs the target's weights and an own LM head.
  rand = heads.HEADS["eagle"].create(tiny_target.cfg, rngs=nnx.Rngs(0), **EAGLE3)
  assert not np.allclose(np.asarray(rand.lm_head[...]), w)
  with pytest.raises(ValueError, match="pass target_params"):
    heads.HEADS["eagle"].create(tiny_target.cfg, rngs=nnx.Rngs(0), lm_head_init="target",
                                **EAGLE3)
  with pytest.raises(ValueError, match="version 1 uses the target's LM head"):
    heads.HEADS["eagle"].create(tiny_target.cfg, rngs=nnx.Rngs(0), lm_head_init="target",
                                target_params=tiny_target.params)
  with pytest.raises(ValueError, match="lm_head_init must be one of"):
    heads.HEADS["eagle"].create(tiny_target.cfg, rngs=nnx.Rngs(0), lm_head_init="zeros",
                                **EAGLE3)


def _packed_and_apart(convs, answer_starts, t: int = 20):
  """The conversations packed into one row of t tokens (segment_ids, positions restarting) and
  as rows apart; each one's loss mask from its answer start to its end."""
  packed = {k: np.zeros((1, t), d) for k, d in (("tokens", np.int32), ("loss_mask", np.float32),
                                                ("segment_ids", np.int32), ("positions", np.int32))}
  apart = {k: np.zeros((len(convs), t), d) for k, d in (("tokens", np.int32),
                                                        ("loss_mask", np.float32))}
  at = 0
  for i, (c, a) in enumerate(zip(convs, answer_starts)):
    n = len(c)
    packed["tokens"][0, at:at + n] = c
    packed["loss_mask"][0, at + a:at + n] = 1
    packed["segment_ids"][0, at:at + n] = i + 1
    packed["positions"][0, at:at + n] = np.arange(n)
    apart["tokens"][i, :n] = c
    apart["loss_mask"][i, a:n] = 1
    at += n
  return packed, apart


@pytest.mark.parametrize("kind, options", [  # the heads share the packing: one runs by default
    ("eagle", EAGLE3), pytest.param("medusa", dict(num_heads=3), marks=pytest.mark.slow),
    pytest.param("mlp", dict(n_predict=3), marks=pytest.mark.slow)])
def test_packed_row_trains_as_its_conversations_apart(tiny_target, kind, options):
  """Two conversations packed into one row (segment_ids, positions restarting) give the loss and
  metrics of the same two conversations as separate rows: the head attends within its own
  conversation, at its positions, and no label is taken from the next conversation."""
  v = tiny_target.cfg.vocab_size
  rng = np.random.default_rng(5)
  convs = [rng.integers(3, v, size=n).astype(np.int32) for n in (7, 9)]
  packed, apart = _packed_and_apart(convs, [2, 2])  # answers from the third token on
  spec = heads.HEADS[kind]
  model = spec.create(tiny_target.cfg, rngs=nnx.Rngs(1), **options)
  layers = spec.required_layers(tiny_target.cfg, options)
  loss = with_hidden_states(spec.loss, tiny_target.cfg, layers, mode="online")
  got = loss(model, jax.tree.map(jnp.asarray, packed), tiny_target.params)
  want = loss(model, jax.tree.map(jnp.asarray, apart), tiny_target.params)
  np.testing.assert_allclose(got[0], want[0], rtol=2e-5, atol=1e-6)
  assert set(got[1]) == set(want[1])
  for name in want[1]:
    np.testing.assert_allclose(got[1][name], want[1][name], rtol=2e-5, atol=1e-6, err_msg=name)


def test_offline_chain_tau_of_a_packed_row_is_that_of_its_conversations(tiny_target):
  """A Medusa head fitted to two greedy conversations: its offline chain tau over the two packed
  into one row (segment_ids, positions) equals that over the two as rows apart. It dropped
  segment_ids, so labels across the boundary counted (a lower tau)."""
  from jaxspec import generate
  spec = heads.HEADS["medusa"]
  cfg, frozen = tiny_target.cfg, tiny_target.params
  prompts = [[5, 6, 7], [9]]  # the second answer begins one token in: labels cross the boundary
  out = generate(tiny_target, prompts, max_new_tokens=7, stop_ids=())
  convs = [np.asarray(p + out.row(b), np.int32) for b, p in enumerate(prompts)]
  packed, apart = _packed_and_apart(convs, [len(p) for p in prompts])  # the generated answers
  for batch in (packed, apart):
    final, _ = target_hidden(frozen, jnp.asarray(batch["tokens"]), cfg,
                             segment_ids=None if "segment_ids" not in batch
                             else jnp.asarray(batch["segment_ids"]),
                             positions=batch.get("positions"))
    batch["hidden_final"] = np.asarray(final)
  model = spec.create(cfg, rngs=nnx.Rngs(0), num_heads=2)
  opt = nnx.Optimizer(model, optax.adam(3e-2), wrt=nnx.Param)
  train_batch = jax.tree.map(jnp.asarray, apart)

  @nnx.jit
  def step(model, opt):
    grads = nnx.grad(lambda m: spec.loss(m, train_batch, frozen)[0])(model)
    opt.update(model, grads)
  for _ in range(80):
    step(model, opt)
  taus = [spec.offline_chain_tau(model, jax.tree.map(jnp.asarray, b), frozen, 2)
          for b in (packed, apart)]
  assert taus[1] > 2.0, taus  # it learned the two answers
  assert taus[0] == pytest.approx(taus[1], abs=1e-6), taus


def test_plain_iterables_are_checked(tiny_target):
  v = tiny_target.cfg.vocab_size
  with pytest.raises(ValueError, match="ran out after 2 batches, before steps=5"):
    train_head(tiny_target, "medusa", list(random_batches(v, n=2)), steps=5)
  with pytest.raises(TypeError, match="iterable of batches"):
    train_head(tiny_target, "medusa", {"tokens": 1}, steps=5)
  with pytest.raises(TypeError, match="re-iterable"):
    train_head(tiny_target, "medusa", random_batches(v), steps=5,
               eval_data=random_batches(v, n=2))
  with pytest.raises(ValueError, match="token_counts"):
    train_head(tiny_target, "eagle", random_batches(v), steps=5,
               options=dict(version=3, draft_vocab_size=16))
  with pytest.raises(ValueError, match="hidden must be one of"):
    train_head(tiny_target, "medusa", random_batches(v), steps=5, hidden="disk")
  with pytest.raises(ValueError, match=r"unknown training settings \['step'\]"):
    train_head(tiny_target, "medusa", random_batches(v), step=5)  # a mistyped keyword


def test_seed_sets_the_batch_order_and_the_initialisation(tiny_target):
  """train_head(seed=s), as Hugging Face's Trainer seed: a TrainData's batches are drawn with s
  (replacing config.seed) and the head starts from s; without it config.seed serves both."""
  v = tiny_target.cfg.vocab_size
  batches = list(random_batches(v, n=4))

  class Data:  # a TrainData that records the seed it is asked for
    seeds = []

    def steps_per_epoch(self, batch_size):
      return len(batches)

    def train_batch(self, step, batch_size, seed):
      self.seeds.append(seed)
      return batches[step % len(batches)]

    def eval_batches(self, batch_size, max_batches=None):
      return batches[:1]

  kw = dict(options=dict(n_predict=1), steps=2, optimizer=optax.sgd(0.0))
  a = train_head(tiny_target, "mlp", Data(), seed=3, **kw)
  assert set(Data.seeds) == {3}
  Data.seeds.clear()
  b = train_head(tiny_target, "mlp", Data(), config=TrainConfig(steps=2, warmup_steps=0, seed=3),
                 **kw)
  assert set(Data.seeds) == {3}
  Data.seeds.clear()
  c = train_head(tiny_target, "mlp", Data(), config=TrainConfig(steps=2, warmup_steps=0, seed=3),
                 seed=5, **kw)
  assert set(Data.seeds) == {5}
  jax.tree.map(np.testing.assert_array_equal, _params(a.model), _params(b.model))
  assert not all(jax.tree.leaves(jax.tree.map(np.array_equal, _params(a.model),
                                              _params(c.model))))


def test_a_resumed_generator_is_skipped_to_its_step(tiny_target, tmp_path):
  """A deterministic generator resumes exactly: its first batches are skipped."""
  v = tiny_target.cfg.vocab_size
  kw = dict(options=dict(num_heads=2), steps=6, save_every=3, optimizer=optax.adam(1e-2))
  straight = train_head(tiny_target, "medusa", random_batches(v), **kw)

  class Stop(Exception):
    pass

  def stop(step, record):
    if step == 4:
      raise Stop

  with pytest.raises(Stop):
    train_head(tiny_target, "medusa", random_batches(v), out_dir=tmp_path, callbacks=[stop], **kw)
  ran = []
  resumed = train_head(tiny_target, "medusa", random_batches(v), out_dir=tmp_path, resume=True,
                       callbacks=[lambda step, record: ran.append(step)], **kw)
  assert ran == [4, 5, 6]  # from the checkpoint of step 3, not from scratch
  jax.tree.map(np.testing.assert_array_equal, _params(straight.model), _params(resumed.model))


def test_a_stored_dataset_hands_the_head_its_own_layers(tiny_target, stored):
  """A `Dataset` opened without layers= holds the stored layers (0, 1); an EAGLE head reading
  (0, 1, 1) trains on exactly what `Dataset(layers=(0, 1, 1))` gives it, offline and "auto";
  a dataset opened with other layers is refused, naming both."""
  kw = dict(options=EAGLE3, steps=2, optimizer=optax.sgd(1e-3), seed=0)
  want = train_head(tiny_target, "eagle", Dataset(stored, layers=(0, 1, 1)), hidden="offline",
                    **kw)
  for hidden in ("offline", "auto"):
    got = train_head(tiny_target, "eagle", Dataset(stored), hidden=hidden, **kw)
    assert [h["loss"] for h in got.history] == [h["loss"] for h in want.history], hidden
  with pytest.raises(ValueError, match=r"opened with layers=\(0, 1\) but the head reads target"
                                       r" layers \(0, 1, 1\)"):
    train_head(tiny_target, "eagle", Dataset(stored, layers=(0, 1)), hidden="offline", **kw)


@pytest.mark.parametrize("kind,options", [("eagle", EAGLE3), ("medusa", dict(num_heads=2)),
                                          ("mlp", dict(n_predict=2))])
def test_online_hidden_states_give_the_stored_loss(tiny_target, stored, kind, options):
  ds = Dataset(stored, layers=(0, 1, 1))
  spec = heads.HEADS[kind]
  model = spec.create(tiny_target.cfg, rngs=nnx.Rngs(1), **options)
  layers = tuple(model.cfg.layers or ()) if kind == "eagle" else ()
  batch = {k: jnp.asarray(v) for k, v in ds.train_batch(0, 4, 0).items()}
  assert set(batch) >= {"hidden_final"}
  tokens_only = {k: batch[k] for k in ("tokens", "loss_mask")}
  offline = nnx.jit(with_hidden_states(spec.loss, tiny_target.cfg, layers, mode="offline"))
  online = nnx.jit(with_hidden_states(spec.loss, tiny_target.cfg, layers, mode="online"))
  auto = nnx.jit(with_hidden_states(spec.loss, tiny_target.cfg, layers, mode="auto"))
  off, _ = offline(model, batch, tiny_target.params)
  on, _ = online(model, batch, tiny_target.params)
  on2, _ = auto(model, tokens_only, tiny_target.params)
  # The store holds float16 states: the same loss up to that rounding.
  np.testing.assert_allclose(float(on), float(off), rtol=2e-3)
  assert float(on2) == float(on)
  # The states themselves, at the rows' real positions.
  final, per = target_hidden(tiny_target.params, batch["tokens"], tiny_target.cfg, (0, 1, 1))
  real = np.asarray(batch["tokens"]) > -1
  for b, n in enumerate(np.asarray(ds.lengths)[ds.batch_indices(0, 4, 0)]):
    np.testing.assert_allclose(np.asarray(final)[b, :n], np.asarray(batch["hidden_final"])[b, :n],
                               atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(np.asarray(per)[b, :n],
                               np.asarray(batch["hidden_layers"])[b, :n], atol=2e-3, rtol=2e-3)
  assert real.all()
  with pytest.raises(ValueError, match="hidden='offline' but the batch holds no stored"):
    offline(model, tokens_only, tiny_target.params)


def test_online_and_offline_training_agree(tiny_target, stored):
  """Three updates from the same batches, online and from the store: the same losses."""
  ds = Dataset(stored, layers=(0, 1, 1))
  kw = dict(options=EAGLE3, steps=3, batch_size=4, optimizer=optax.adam(1e-2))
  off = train_head(tiny_target, "eagle", ds, hidden="offline", **kw)
  on = train_head(tiny_target, "eagle", ds, hidden="online", **kw)
  for a, b in zip(off.history, on.history):
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=5e-3)


def test_objectives(tiny_target):
  """Forward KL and total variation against a reference computed here; per-step and
  per-position weights; the training-time-test depth."""
  cfg = tiny_target.cfg
  spec = heads.HEADS["medusa"]
  model = spec.create(cfg, rngs=nnx.Rngs(0), num_heads=2, loss_decay=0.5)
  graphdef, state = nnx.split(model)
  state = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(jax.random.key(2), x.shape), state)
  model = nnx.merge(graphdef, state)
  batch = {k: jnp.asarray(v) for k, v in next(random_batches(cfg.vocab_size, width=12)).items()}
  final, _ = target_hidden(tiny_target.params, batch["tokens"], cfg)
  batch["hidden_final"] = final
  logits = np.asarray(spec.predict(model, batch, tiny_target.params, 2)[0], np.float64)
  p_logits = np.asarray(heads.target_logits_over(tiny_target.params, final, None), np.float64)
  mask = np.asarray(batch["loss_mask"])

  def softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)

  def reference(kind, step_weights, pos_w):
    total = 0.0
    t = mask.shape[1]
    for j, wj in enumerate(step_weights):
      q = softmax(logits[:, :t - 2 - j, j])
      p = softmax(p_logits[:, 1 + j:t - 1])
      per = (np.sum(p * (np.log(p) - np.log(q)), -1) if kind == "kl"
             else 0.5 * np.abs(p - q).sum(-1))
      w = (mask * pos_w)[:, 2 + j:]
      total += wj * (per * w).sum() / max(w.sum(), 1.0)
    return total

  pos_w = np.random.default_rng(0).uniform(0, 2, mask.shape).astype(np.float32)
  for kind in ("kl", "tv"):
    for sw, obj_sw in ((None, (1.0, 0.5)), ((0.3, 2.0), (0.3, 2.0))):
      obj = heads.Objective(loss=kind, step_weights=sw)
      loss, m = heads.head_loss(spec, model, batch, tiny_target.params, obj)
      np.testing.assert_allclose(float(loss), reference(kind, obj_sw, 1.0), rtol=1e-4)
      loss_w, _ = heads.head_loss(spec, model, dict(batch, loss_weights=jnp.asarray(pos_w)),
                                  tiny_target.params, obj)
      np.testing.assert_allclose(float(loss_w), reference(kind, obj_sw, pos_w), rtol=1e-4)
  with pytest.raises(ValueError, match="Objective.loss must be one of"):
    heads.Objective(loss="reverse_kl")
  with pytest.raises(ValueError, match="2 step_weights for depth 3"):
    heads.Objective(step_weights=(1.0, 1.0), depth=3)
  # EAGLE's training-time-test depth: four steps trained on a head configured for two.
  eagle = heads.HEADS["eagle"].create(cfg, rngs=nnx.Rngs(0), **EAGLE3)
  batch["hidden_layers"] = target_hidden(tiny_target.params, batch["tokens"], cfg, (0, 1, 1))[1]
  _, m = heads.head_loss(heads.HEADS["eagle"], eagle, batch, tiny_target.params,
                         heads.Objective(depth=4))
  assert {"loss_3", "acc_3"} <= set(m) and "loss_4" not in m


def test_one_fingerprint_for_heads_and_data(tiny_target, stored, tmp_path):
  from jaxspec.train.data import target_fingerprint as data_fp
  fp = heads.target_fingerprint(tiny_target)
  assert data_fp(tiny_target) == fp == heads.target_fingerprint(tiny_target.params,
                                                                tiny_target.cfg)
  # A bfloat16 load of the same weights has the same fingerprint (heads and data serve both).
  bf16 = Model(dataclasses.replace(tiny_target.cfg, dtype="bfloat16"),
               jax.tree.map(lambda x: x.astype(jnp.bfloat16), tiny_target.params))
  assert heads.target_fingerprint(bf16) == fp
  ds = Dataset(stored)
  assert ds.meta["target"]["fingerprint"] == fp
  ds.check_target(bf16, layers=(0, 1))
  # A dataset stamped by the rule before unification still loads; another target's does not.
  old = tmp_path / "old"
  import shutil
  shutil.copytree(stored, old)
  meta = json.loads((old / "meta.json").read_text())
  meta["target"]["fingerprint"] = _fingerprint_v1(tiny_target)
  assert meta["target"]["fingerprint"] != fp
  (old / "meta.json").write_text(json.dumps(meta))
  Dataset(old).check_target(tiny_target, layers=(0, 1))
  meta["target"]["fingerprint"] = "0123456789abcdef"
  (old / "meta.json").write_text(json.dumps(meta))
  with pytest.raises(DataError, match="fingerprint 0123456789abcdef"):
    Dataset(old).check_target(tiny_target)


def test_distill_with_own_optimizer_online(tiny_target, tmp_path):
  v = tiny_target.cfg.vocab_size
  fixed = list(random_batches(v, width=12, n=2))

  def batches():
    while True:
      yield from fixed

  draft, hist = distill(tiny_target, batches(), tmp_path / "draft",
                        num_layers=1, steps=8, log_every=2, optimizer=optax.adam(3e-3),
                        progress=False)
  assert [h["step"] for h in hist] == [2, 4, 6, 8]
  assert hist[-1]["loss"] < hist[0]["loss"]
  assert (tmp_path / "draft" / "config.json").is_file() and draft.cfg.num_layers == 1


# ---------------------------------------------------------------------------------------------
# A 2 x 4 mesh of simulated CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8).


def _mesh():
  """The mesh, and rules for the tiny target (2 key/value heads: replicated; its 4 query heads,
  MLP and vocabulary over "model")."""
  if jax.device_count() < 8:
    pytest.skip("needs 8 devices: XLA_FLAGS=--xla_force_host_platform_device_count=8")
  from jaxspec.sharding import DEFAULT_RULES, make_mesh
  return make_mesh({"data": 2, "model": 4}), dataclasses.replace(DEFAULT_RULES, kv_heads=None)


def test_mesh_training_gives_the_single_device_losses(tiny_target):
  mesh, rules = _mesh()
  batches = list(random_batches(tiny_target.cfg.vocab_size, n=20))
  kw = dict(options=EAGLE3, steps=20, optimizer=optax.adam(3e-3), hidden="online")
  one = train_head(tiny_target, "eagle", batches, **kw)
  many = train_head(tiny_target, "eagle", batches, mesh=mesh, rules=rules, **kw)
  a = np.array([h["loss"] for h in one.history])
  b = np.array([h["loss"] for h in many.history])
  assert len(a) == len(b) == 20 and a[-1] < a[0]
  np.testing.assert_allclose(b, a, rtol=2e-4)
  leaf = jax.tree.leaves(nnx.state(many.model, nnx.Param))[0]
  assert leaf.sharding.is_fully_replicated and len(leaf.sharding.device_set) == 8
  with pytest.raises(ValueError, match="does not divide over the mesh's 'data' axis of size 2"):
    train_head(tiny_target, "eagle", list(random_batches(tiny_target.cfg.vocab_size, rows=3,
                                                         n=2)), mesh=mesh, rules=rules,
               **dict(kw, steps=2))


# Under -m slow: mesh training runs by default above, resuming in test_trainer.py.
@pytest.mark.slow
def test_mesh_resume_is_bit_identical(tiny_target, tmp_path):
  """Under `make test-slow`'s -O0 XLA flags the resumed run's parameters round apart from the
  straight run's in the last bit (a difference not yet explained; the losses agree), so the
  test then runs itself in a subprocess with XLA's default flags, where users train."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_backend_optimization_level=0" in flags:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p",
                          "no:cacheprovider", "-m", "slow",
                          f"{__file__}::test_mesh_resume_is_bit_identical"],
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    return
  mesh, rules = _mesh()
  batches = list(random_batches(tiny_target.cfg.vocab_size, n=6))
  kw = dict(options=EAGLE3, steps=6, save_every=3, optimizer=optax.adam(3e-3), mesh=mesh,
            rules=rules)
  straight = train_head(tiny_target, "eagle", batches, **kw)

  class Stop(Exception):
    pass

  def stop(step, record):
    if step == 5:
      raise Stop

  with pytest.raises(Stop):
    train_head(tiny_target, "eagle", batches, out_dir=tmp_path, callbacks=[stop], **kw)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3"]
  ran = []
  resumed = train_head(tiny_target, "eagle", batches, out_dir=tmp_path, resume=True,
                       callbacks=[lambda step, record: ran.append(step)], **kw)
  assert ran == [4, 5, 6]  # from the checkpoint of step 3, not from scratch
  assert [h["loss"] for h in resumed.history] == [h["loss"] for h in straight.history]
  jax.tree.map(np.testing.assert_array_equal, _params(straight.model), _params(resumed.model))
