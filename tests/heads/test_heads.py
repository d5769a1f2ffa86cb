"""Draft heads: exact decoding with every head, exact sampling, online/offline alignment,
checkpoint errors, and a few optimisation steps that lower every head's loss."""

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxspec import heads
from jaxspec.drafters import DraftContext
from jaxspec.api import generate
from jaxspec.decoding import tree as tree_lib
from jaxspec.decoding.plain import prefill
from jaxspec.models import forward, init_cache, init_params, tiny_config
from jaxspec.models.errors import CheckpointError
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling
from jaxspec.api import speculative_generate
from helpers import assert_first_tokens_follow, exact_joint

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [7]]
N_NEW = 16

# Every head variant the tests build: (registry kind, options).
VARIANTS = {
    "medusa": ("medusa", dict(num_heads=3)),
    "mlp": ("mlp", dict(n_predict=3)),
    "mlp_tied": ("mlp", dict(n_predict=3, tie_to_target=True)),  # the bundled head's layout
    "eagle": ("eagle", dict(ttt_steps=2)),
    "eagle3": ("eagle", dict(version=3, draft_vocab_size=96, ttt_steps=2)),
}


def _create(name, cfg, seed=0, **extra):
  kind, opts = VARIANTS[name]
  opts = dict(opts, **extra)
  if opts.get("draft_vocab_size"):
    # A fixed, deliberately incomplete draft vocabulary: some target tokens cannot be drafted.
    opts["token_counts"] = np.arange(cfg.vocab_size)[::-1]
  return heads.HEADS[kind].create(cfg, rngs=nnx.Rngs(seed), **opts)


@pytest.fixture(scope="module")
def reference(tiny_target):
  return generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, stop_ids=())


def _batch_from(target, reference, layers):
  """Training batch: each row's prompt + the target's greedy continuation, right-padded."""
  rows = [p + reference.row(i) for i, p in enumerate(PROMPTS)]
  t = max(map(len, rows))
  tokens = np.zeros((len(rows), t), np.int32)
  mask = np.zeros((len(rows), t), np.float32)
  for i, r in enumerate(rows):
    tokens[i, :len(r)] = r
    mask[i, len(PROMPTS[i]):len(r)] = 1
  _, hid, _ = forward(target.params, jnp.asarray(tokens), init_cache(target.cfg, len(rows), t),
                      target.cfg, hidden_layers=layers, logits=False, fresh=True)
  batch = dict(tokens=jnp.asarray(tokens), loss_mask=jnp.asarray(mask), hidden_final=hid.final)
  if layers:
    batch["hidden_layers"] = jnp.transpose(hid.layers, (1, 2, 0, 3))
  return batch


# ----------------------------------------------------------------------------------------------
# (e) Loss and gradients: a few Adam steps lower every head's loss. The trained heads are reused
# below, so that the decoding tests see both accepted and rejected drafts.


def _train(model, kind, batch, frozen, steps=15, lr=5e-3):
  opt = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)

  @nnx.jit
  def step(model, opt, batch, frozen):
    (loss, metrics), grads = nnx.value_and_grad(
        lambda m: heads.HEADS[kind].loss(m, batch, frozen), has_aux=True)(model)
    opt.update(model, grads)
    return loss, metrics

  losses = []
  for _ in range(steps):
    loss, metrics = step(model, opt, batch, frozen)
    losses.append(float(loss))
  return losses, metrics


@pytest.fixture(scope="module")
def trained(tiny_target, reference):
  out = {}
  models = {name: _create(name, tiny_target.cfg) for name in VARIANTS}
  layers = models["eagle3"].cfg.layers
  full = _batch_from(tiny_target, reference, layers)
  for name, model in models.items():
    kind, _ = VARIANTS[name]
    batch = full if name == "eagle3" else {k: v for k, v in full.items() if k != "hidden_layers"}
    tau0 = heads.HEADS[kind].offline_chain_tau(model, batch, tiny_target.params, 2)
    losses, metrics = _train(model, kind, batch, tiny_target.params)
    tau1 = heads.HEADS[kind].offline_chain_tau(model, batch, tiny_target.params, 2)
    out[name] = dict(model=model, losses=losses, metrics=metrics, tau=(tau0, tau1), batch=batch)
  return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_training_steps_lower_the_loss(trained, name):
  t = trained[name]
  losses = t["losses"]
  assert all(math.isfinite(x) for x in losses)
  assert losses[-1] < 0.8 * losses[0], losses
  m = t["metrics"]
  assert "acc_0" in m and "loss_0" in m and "acc_1" in m
  if name == "eagle":
    assert "feature_loss" in m
  tau0, tau1 = t["tau"]
  assert 1.0 <= tau0 <= 3.0 and 1.0 <= tau1 <= 3.0
  assert tau1 > tau0, (tau0, tau1)  # fitting the target's own continuations lengthens the runs


def test_soft_targets_are_the_capped_distribution_the_target_samples(tiny_target):
  """On a target that soft-caps its logits (Gemma 2), the KL target is softmax(cap * tanh(l /
  cap)), the distribution it samples from: step 0's loss equals KL(p_{t+1} || q_t) by hand."""
  from jaxspec.models.llama import logits_from_hidden, softcap
  cap = 2.0
  cfg = tiny_config(final_softcap=cap)
  params = init_params(cfg, jax.random.key(1), scale=0.5)
  spec = heads.HEADS["medusa"]
  model = spec.create(cfg, rngs=nnx.Rngs(0), num_heads=1)
  assert model.target_softcap == cap
  rng = np.random.default_rng(0)
  b, t = 2, 8
  mask = np.zeros((b, t), np.float32)
  mask[:, 3:] = 1
  batch = {"tokens": jnp.asarray(rng.integers(3, 128, (b, t)), jnp.int32),
           "loss_mask": jnp.asarray(mask),
           "hidden_final": jnp.asarray(rng.normal(size=(b, t, cfg.hidden_size)), jnp.float32)}
  _, metrics = heads.head_loss(spec, model, batch, params,
                               objective=heads.Objective(loss="kl", depth=1))
  q = jax.nn.log_softmax(spec.predict(model, batch, params, 1)[0][:, :, 0], axis=-1)
  p = jax.nn.log_softmax(softcap(logits_from_hidden(params, batch["hidden_final"]), cap), -1)
  kl = np.asarray(jnp.sum(jnp.exp(p[:, 1:]) * (p[:, 1:] - q[:, :-1]), axis=-1))  # [B, T-1]
  w = mask[:, 2:]  # step 0 at position s predicts x_{s+2}
  want = float((kl[:, :t - 2] * w).sum() / w.sum())
  np.testing.assert_allclose(float(metrics["loss_0"]), want, rtol=1e-5)


def test_required_layers_and_options(tiny_target):
  cfg = tiny_config(num_layers=32)
  assert heads.HEADS["eagle"].required_layers(cfg, dict(version=3)) == (1, 15, 28)
  assert heads.HEADS["eagle"].required_layers(cfg, {}) == ()
  assert heads.HEADS["medusa"].required_layers(cfg, {}) == ()
  with pytest.raises(ValueError, match="unknown MedusaConfig options"):
    heads.HEADS["medusa"].create(cfg, rngs=nnx.Rngs(0), heads=3)
  with pytest.raises(ValueError, match="token_counts"):
    heads.HEADS["eagle"].create(cfg, rngs=nnx.Rngs(0), version=3, draft_vocab_size=8)
  with pytest.raises(ValueError, match="version=3"):
    heads.HEADS["eagle"].create(cfg, rngs=nnx.Rngs(0), draft_vocab_size=8)
  # Out-of-range values of the configs and the draft vocabulary: a ValueError naming them.
  eagle3 = lambda **kw: heads.HEADS["eagle"].create(cfg, rngs=nnx.Rngs(0), version=3, **kw)
  for make, match in [
      (lambda: heads.HEADS["medusa"].create(cfg, rngs=nnx.Rngs(0), num_heads=0),
       r"MedusaConfig\.num_heads must be an integer >= 1, got 0"),
      (lambda: heads.HEADS["medusa"].create(cfg, rngs=nnx.Rngs(0), num_layers=0),
       r"MedusaConfig\.num_layers must be an integer >= 1, got 0"),
      (lambda: eagle3(ttt_steps=0), r"EagleConfig\.ttt_steps must be an integer >= 1, got 0"),
      (lambda: eagle3(num_heads=-1), r"EagleConfig\.num_heads must be an integer >= 0"),
      (lambda: eagle3(draft_vocab=np.array([1, 2, 128])), r"target token ids in \[0, 128\)"),
      (lambda: eagle3(draft_vocab=np.array([1.0, 2.0])), r"target token ids in \[0, 128\)"),
      (lambda: eagle3(draft_vocab=np.array([1, 2, 2])), "a token id twice")]:
    with pytest.raises(ValueError, match=match):
      make()


@pytest.mark.parametrize("tied", [False, True])
def test_soft_labels_over_a_draft_vocabulary_are_the_full_logits_columns(tied):
  """Training's soft labels over a reduced draft vocabulary are computed from those head rows
  only; they must equal the full logits' columns (tied and untied heads)."""
  from jaxspec.models.llama import logits_from_hidden
  cfg = tiny_config(tie_embeddings=tied)
  params = init_params(cfg, jax.random.key(1), scale=0.2)
  h = jax.random.normal(jax.random.key(2), (2, 5, cfg.hidden_size))
  ids = jnp.asarray([0, 3, 17, 40, cfg.vocab_size - 1])
  full = logits_from_hidden(params, h)
  np.testing.assert_allclose(heads.target_logits_over(params, h, ids), full[..., ids],
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(heads.target_logits_over(params, h, None), full)


# ----------------------------------------------------------------------------------------------
# (a) Exact greedy decoding with every head.


# Every head on the three ragged prompts; k = 1 and batch 1 on some (each call compiles the whole
# loop, so the grid is spread over the heads rather than multiplied).
@pytest.mark.parametrize("name,k,batch1", [("medusa", 1, False), ("mlp", 3, False),
                                           ("eagle", 3, True), ("eagle3", 3, False)])
def test_greedy_equals_generate(tiny_target, reference, trained, name, k, batch1):
  drafter = heads.HEADS[VARIANTS[name][0]].drafter(trained[name]["model"], tiny_target)
  out = speculative_generate(tiny_target, drafter, PROMPTS, max_new_tokens=N_NEW,
                             num_draft_tokens=k, stop_ids=())
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  np.testing.assert_array_equal(out.lengths, reference.lengths)
  assert out.stats["acceptance_rate"] > 0  # the trained heads' drafts are sometimes accepted
  assert out.stats["acceptance_rate"] < 1  # ... and sometimes rejected
  if batch1:
    for i in (0, 2):  # a long prompt and a one-token prompt
      one = speculative_generate(tiny_target, drafter, [PROMPTS[i]], max_new_tokens=N_NEW,
                                 num_draft_tokens=1, stop_ids=())
      assert one.row(0) == reference.row(i)


# ----------------------------------------------------------------------------------------------
# (c) The online drafter proposes what the training-time forward predicts.


def _online(drafter, target, prompts, k, accept=2, correction=7):
  """Init, one step that keeps `accept` drafts plus `correction`, commit, propose again.

  Returns (sequence [B, S], its length [B], the second proposal's tokens [B, k] and q [B, k, V])
  under temperature 1, so q is the head's softmax.
  """
  cfg = target.cfg
  b = len(prompts)
  pw = max(map(len, prompts))
  prompt = np.zeros((b, pw), np.int32)
  for i, p in enumerate(prompts):
    prompt[i, :len(p)] = p
  plen = jnp.asarray([len(p) for p in prompts], jnp.int32)
  max_len, cap = 48, 48
  sp = Sampling(temperature=1.0).arrays(b)
  layers = drafter.hidden_layers

  @jax.jit
  def run(tparams, dparams, prompt, plen, key):
    _, hidden, cache = prefill(tparams, prompt, plen, cfg, max_len, logits=False,
                               hidden_layers=layers)
    cache = dataclasses.replace(cache, length=plen - 1)
    state = drafter.init(dparams, prompt, plen, max_len, hidden)
    seq = jnp.zeros((b, cap), jnp.int32).at[:, :pw].set(prompt)
    ctx = DraftContext(seq=seq, seq_len=plen, prompt_len=plen)
    k1, k2 = jax.random.split(key)
    prop, state = drafter.propose(dparams, state, ctx, k, sp, jax.random.split(k1, b))
    last = jnp.take_along_axis(seq, (plen - 1)[:, None], axis=1)
    _, hid, cache = forward(tparams, jnp.concatenate([last, prop.tokens], 1), cache, cfg,
                            hidden_layers=layers)
    emitted = jnp.concatenate([prop.tokens[:, :accept], jnp.full((b, 1), correction)], 1)
    rows = jnp.arange(b)[:, None]
    seq = seq.at[rows, plen[:, None] + jnp.arange(accept + 1)[None]].set(emitted)
    n_new = jnp.full((b,), accept + 1, jnp.int32)
    ctx = DraftContext(seq=seq, seq_len=plen + n_new, prompt_len=plen, hidden=hid,
                       hidden_pos=n_new - 1, n_new=n_new)
    state = drafter.commit(dparams, state, ctx)
    prop2, _ = drafter.propose(dparams, state, ctx, k, sp, jax.random.split(k2, b))
    return seq, ctx.seq_len, prop2.tokens, prop2.q

  return run(target.params, drafter.params, jnp.asarray(prompt), plen, jax.random.key(3))


# Medusa shares the MLP speculator's state handling (f_{n-2} after init and commit) and has no
# chain to misalign, so the MLP case covers it.
@pytest.mark.parametrize("name", ["mlp", "mlp_tied", "eagle", "eagle3"])
def test_online_proposals_match_training_forward(tiny_target, trained, name):
  kind = VARIANTS[name][0]
  model = trained[name]["model"]
  drafter = heads.HEADS[kind].drafter(model, tiny_target)
  k = 3
  prompts = [PROMPTS[0], PROMPTS[1]]
  seq, n, toks, q = map(np.asarray, _online(drafter, tiny_target, prompts, k))
  # The whole sequence, drafts included, through the target, then the training-time forward.
  full = np.zeros((len(prompts), int(n.max()) + k), np.int32)
  for i in range(len(prompts)):
    full[i, :n[i]] = seq[i, :n[i]]
    full[i, n[i]:n[i] + k] = toks[i]
  layers = drafter.hidden_layers
  _, hid, _ = forward(tiny_target.params, jnp.asarray(full),
                      init_cache(tiny_target.cfg, len(prompts), full.shape[1]), tiny_target.cfg,
                      hidden_layers=layers, logits=False, fresh=True)
  batch = dict(tokens=jnp.asarray(full), loss_mask=jnp.ones(full.shape, jnp.float32),
               hidden_final=hid.final)
  if layers:
    batch["hidden_layers"] = jnp.transpose(hid.layers, (1, 2, 0, 3))
  predict = nnx.jit(lambda m, b, f: heads.HEADS[kind].predict(m, b, f, k)[0])
  logits = predict(model, batch, tiny_target.params)  # [B, T, k, N]
  ids = heads.draft_ids(model)
  for i in range(len(prompts)):
    t = int(n[i]) - 2  # the position whose head predicts x_n, x_{n+1}, ...
    p_off = np.asarray(jax.nn.softmax(logits[i, t], axis=-1))  # [k, N]
    q_on = q[i] if ids is None else q[i][:, np.asarray(ids)]
    np.testing.assert_allclose(q_on, p_off, atol=2e-5, err_msg=f"row {i}")
    if ids is not None:
      assert q[i].sum(-1) == pytest.approx(np.ones(k), abs=1e-5)  # nothing outside the vocab


# EAGLE-1 under -m slow: EAGLE-3 defers the same commits, of its fused multi-layer features.
@pytest.mark.parametrize("name", [pytest.param("eagle", marks=pytest.mark.slow), "eagle3"])
def test_eagle_deferred_commits_equal_eager_ones(tiny_target, reference, trained, name):
  """With "auto", EAGLE's commits are deferred over plain steps and caught up in one pass of its
  layer (the buffered target features, `defer_commit`). Under a forced schedule of plain and
  drafting steps, the deferring drafter drafts exactly what one committing after every plain
  step drafts: the same tokens and acceptances, greedily and under sampling (where acceptance
  reads q, so the drafts' distributions must agree too)."""
  from helpers import forced_run
  from jaxspec.heads.drafting import EagleDrafter

  @dataclasses.dataclass(frozen=True)
  class EagerEagle(EagleDrafter):
    defer_commit = False

  drafter = heads.HEADS["eagle"].drafter(trained[name]["model"], tiny_target)
  assert drafter.defer_commit
  eager = EagerEagle(**{f.name: getattr(drafter, f.name) for f in dataclasses.fields(drafter)})
  schedule = [(0, 6), (3, 1), (0, 2), (3, 1), (0, 1), (3, None)]  # a full buffer of 4 at step 3
  # Greedy, the deferring drafter alone gives plain decoding's tokens (the eager one's greedy
  # run was the weaker half of the sampled comparison below, which runs the same catch-up).
  tok, st = forced_run(tiny_target, drafter, PROMPTS, schedule, k_max=3, n_new=N_NEW, key=5)
  np.testing.assert_array_equal(tok, reference.tokens)
  assert 0 < sum(st["accepted_per_row"]) < sum(st["drafted_per_row"])
  sp = Sampling(temperature=1.0)
  (tok, st), (tok_eager, st_eager) = [
      forced_run(tiny_target, d, PROMPTS, schedule, k_max=3, n_new=N_NEW, sampling=sp, key=5)
      for d in (drafter, eager)]
  np.testing.assert_array_equal(tok, tok_eager)
  assert st["k_per_step"] == st_eager["k_per_step"]
  assert st["accepted_per_row"] == st_eager["accepted_per_row"]
  assert 0 < sum(st["accepted_per_row"]) < sum(st["drafted_per_row"])


def _eqns(jaxpr, name):
  """Every equation of primitive `name` in jaxpr and in the jaxprs below it."""
  from jax.extend import core as jcore
  for e in jaxpr.eqns:
    if e.primitive.name == name:
      yield e
    for v in e.params.values():
      for x in (v if isinstance(v, (tuple, list)) else (v,)):
        if isinstance(x, (jcore.ClosedJaxpr, jcore.Jaxpr)):
          yield from _eqns(getattr(x, "jaxpr", x), name)


def test_eagle_plain_steps_pass_no_cache_through_a_conditional(tiny_target):
  """The plain steps "auto" runs in its inner loop (`plain_run`) cost what `generate`'s do: no
  conditional in them returns the draft layer's cache (or the target's). XLA copies what a
  conditional passes through, even on the branch that leaves it as it is; the deferred EAGLE
  commit's catch-up computes its new keys and values in the conditional and writes them after
  it (`catch_up_where`)."""
  import functools
  from jaxspec.decoding import loop
  from jaxspec.decoding.adaptive import AutoK
  from jaxspec.engine import io
  from jaxspec.models.llama import LlamaLM
  from helpers import CPU_LIKE

  drafter = heads.HEADS["eagle"].drafter(_create("eagle3", tiny_target.cfg), tiny_target)
  req = io.prepare_spec(tiny_target, drafter, PROMPTS[:1], max_new_tokens=8,
                        num_draft_tokens="auto", auto=AutoK(k_max=3), cost=CPU_LIKE,
                        stop_ids=())
  cfg = loop.StepConfig(lm=LlamaLM(tiny_target.cfg), drafter=req.drafter, policy=req.policy,
                        max_new_tokens=8, max_len=req.prep.max_len, max_steps=9)
  assert cfg.defers
  sp = req.sampling.arrays(1)
  state = jax.eval_shape(functools.partial(loop.spec_init, cfg=cfg), tiny_target.params,
                         req.drafter.params, jnp.asarray(req.prep.tokens),
                         jnp.asarray(req.prep.lengths), sp, jax.random.key(0))
  jaxpr = jax.make_jaxpr(functools.partial(loop.spec_loop, cfg=cfg))(
      tiny_target.params, req.drafter.params, state, sp, loop.costs_array(req.policy, req.cost),
      jnp.int32(0), jnp.int32(-1)).jaxpr
  body = next(_eqns(jaxpr, "while")).params["body_jaxpr"].jaxpr  # spec_loop's
  plain_runs = [e for e in body.eqns if e.primitive.name == "while"]
  assert len(plain_runs) == 1
  caches = {state.draft_state.inner.cache.k.shape, state.cache.k.shape}
  conds = list(_eqns(plain_runs[0].params["body_jaxpr"].jaxpr, "cond"))
  assert conds  # the catch-up when a buffer is full, the sampling's greedy switch
  passed = [v.aval.shape for c in conds for v in c.outvars if v.aval.shape in caches]
  assert passed == []


@pytest.mark.parametrize("name", ["eagle", "eagle3"])
def test_eagle_prefill_equals_the_full_block_at_the_read_position(tiny_target, name):
  """The drafter's init computes attention and MLP at one pair per row (the one the next draft
  reads): the same output there and the same cache as the whole fresh block."""
  from jaxspec.heads.eagle import eagle_block, eagle_prefill
  model = _create(name, tiny_target.cfg)
  b, t, d = 3, 11, tiny_target.cfg.hidden_size
  rng = np.random.default_rng(0)
  if model.cfg.version == 1:
    feat = jnp.asarray(rng.normal(size=(b, t, d)), jnp.float32)
  else:
    feat = model.real_feature(None, jnp.asarray(
        rng.normal(size=(b, t, len(model.cfg.layers), d)), jnp.float32))
  tok = jnp.asarray(rng.integers(0, tiny_target.cfg.vocab_size, (b, t)), jnp.int32)
  at = jnp.asarray([0, 5, t - 1], jnp.int32)
  empty = init_cache(model.layer_cfg, b, 16, dtype=jnp.float32)
  h_all, c_all = eagle_block(model, tiny_target.params, empty, feat, tok, fresh=True)
  h_at, c_at = eagle_prefill(model, tiny_target.params, empty, feat, tok, at)
  np.testing.assert_allclose(h_at, h_all[jnp.arange(b), at], rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(c_at.k, c_all.k)
  np.testing.assert_array_equal(c_at.v, c_all.v)


def test_eagle_context_window_drafts_from_the_last_pairs_only(tiny_target, trained):
  """`context_window` W: init runs the head over each row's last W prompt pairs only, and gives
  the state (feature, first proposal) that the whole-context drafter gives on the prompt cut to
  its last W + 1 tokens with the same target features (positions shift; rotary is relative).
  Under the window, decoding stays token for token plain greedy decoding (chains, a tree,
  "auto"), and a window too small to hold the context drafts differently (it is applied)."""
  from jaxspec.decoding.plain import prefill
  model = trained["eagle3"]["model"]
  whole = heads.HEADS["eagle"].drafter(model, tiny_target)
  w = 4
  windowed = whole.with_context_window(w)
  assert whole.context_window is None and windowed.context_window == w
  cfg, layers = tiny_target.cfg, whole.hidden_layers
  prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 12], [10, 11, 12], [7]]
  pw = max(map(len, prompts))

  keys = jax.random.split(jax.random.key(1), len(prompts))

  def first(drafter, prompt, plen, hidden, keys):
    state = drafter.init(drafter.params, prompt, plen, 32, hidden)
    seq = jnp.zeros((prompt.shape[0], 32), jnp.int32).at[:, :prompt.shape[1]].set(prompt)
    ctx = DraftContext(seq=seq, seq_len=plen, prompt_len=plen)
    prop, _ = drafter.propose(drafter.params, state, ctx, 3, Sampling(temperature=1.0).arrays(
        prompt.shape[0]), keys)
    return state.feat, prop.tokens, prop.q

  batch = np.zeros((3, pw), np.int32)
  for i, p in enumerate(prompts):
    batch[i, :len(p)] = p
  plen = jnp.asarray([len(p) for p in prompts], jnp.int32)
  _, hid, _ = prefill(tiny_target.params, jnp.asarray(batch), plen, cfg, 32, logits=False,
                      hidden_layers=layers)
  feat, toks, q = jax.jit(lambda h: first(windowed, jnp.asarray(batch), plen, h, keys))(hid)
  # The references jitted too (op by op, every row's shapes compiled each primitive again).
  first_whole = jax.jit(lambda *a: first(whole, *a))
  first_windowed = jax.jit(lambda *a: first(windowed, *a))
  for i, p in enumerate(prompts):
    cut = max(len(p) - (w + 1), 0)  # the last W + 1 tokens make the last W pairs
    sub = dataclasses.replace(hid, final=hid.final[i:i + 1, cut:len(p)],
                              layers=hid.layers[:, i:i + 1, cut:len(p)])
    args = jnp.asarray([p[cut:]], jnp.int32), jnp.asarray([len(p) - cut]), sub, keys[i:i + 1]
    ref = first_whole(*args)  # the state and the first draft read the prefill only
    np.testing.assert_allclose(feat[i], ref[0][0], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(toks[i, 0], ref[1][0, 0])
    np.testing.assert_allclose(q[i, 0], ref[2][0, 0], rtol=1e-5, atol=1e-6)
    # Later drafts attend to the last W pairs up to themselves: the oldest prompt pair drops out.
    ref = first_windowed(*args)
    np.testing.assert_array_equal(toks[i], ref[1][0])
    np.testing.assert_allclose(q[i], ref[2][0], rtol=1e-5, atol=1e-6)

  # N_NEW tokens of three rows: `generate`'s program is the `reference` fixture's and the whole
  # drafter's is test_greedy_equals_generate's eagle3 case (prompts are padded to one width).
  # "auto" is given a cost model (nothing timed at -O0; its k still moves, asserted below).
  from helpers import CPU_LIKE
  n_new = N_NEW
  ref = generate(tiny_target, prompts, max_new_tokens=n_new, stop_ids=())
  stats = {}
  for name, d, k in (("w", windowed, 3), ("whole", whole, 3), ("w-auto", windowed, "auto"),
                     ("w-tree", windowed.with_tree(tree_lib.DynamicTree(topk=2, depth=3,
                                                                        total_tokens=5)),
                      "auto")):
    out = speculative_generate(tiny_target, d, prompts, max_new_tokens=n_new,
                               num_draft_tokens=k, stop_ids=(),
                               cost=CPU_LIKE if name == "w-auto" else None)
    np.testing.assert_array_equal(out.tokens, ref.tokens, err_msg=name)
    stats[name] = out.stats
  assert stats["w"]["accepted_per_row"] != stats["whole"]["accepted_per_row"]
  assert len(set(stats["w-auto"]["k_per_step"])) > 1, stats["w-auto"]["k_per_step"]  # k moved
  with pytest.raises(ValueError, match="context_window"):
    whole.with_context_window(0)


# ----------------------------------------------------------------------------------------------
# (b) Exact sampling with a head drafter (chi-square on the first three tokens).


def test_sampling_distribution_with_eagle():
  cfg = tiny_config(vocab_size=8, eos_token_ids=())
  target = Model(cfg, init_params(cfg, jax.random.key(11), scale=0.6), name="v8-target")
  model = heads.HEADS["eagle"].create(cfg, rngs=nnx.Rngs(5))  # untrained: q differs from p
  drafter = heads.HEADS["eagle"].drafter(model, target)
  sp = Sampling(temperature=0.9, top_k=6)
  prompt = [1, 2, 3, 4]
  n = 20000
  out = speculative_generate(target, drafter, [prompt] * n, max_new_tokens=3, sampling=sp,
                             num_draft_tokens=2, key=99, max_len=16)
  assert_first_tokens_follow(out.tokens[:, :3], exact_joint(target, prompt, sp), "top-k")
  assert 0.05 < out.stats["acceptance_rate"] < 0.95  # both accepts and rejections happened


# ----------------------------------------------------------------------------------------------
# (d) Saving, loading and the errors of a wrong or broken checkpoint.


def test_save_load_roundtrip_and_errors(tmp_path, tiny_target, trained):
  model = trained["eagle3"]["model"]
  path = heads.save_head(tmp_path / "h", "eagle", model, tiny_target, meta={"steps": 15},
                         dtype="float32")
  drafter = heads.load_head(tiny_target, path)
  ref = heads.HEADS["eagle"].drafter(model, tiny_target)
  assert drafter == ref  # same static structure: reuses the compiled loop
  # The directory as a drafter name (the compiled loop of test_greedy_equals_generate is reused).
  by_name = speculative_generate(tiny_target, str(path), PROMPTS, max_new_tokens=N_NEW,
                                 num_draft_tokens=3, stop_ids=())
  np.testing.assert_array_equal(by_name.tokens,
                                generate(tiny_target, PROMPTS, max_new_tokens=N_NEW,
                                         stop_ids=()).tokens)
  from jaxspec.drafters import resolve_drafter
  assert resolve_drafter(tiny_target, str(path)) is resolve_drafter(tiny_target, str(path))
  with pytest.raises(ValueError, match="not 'ngram', 'suffix', .*a bundled head"):
    speculative_generate(tiny_target, str(tmp_path / "no-such-draft"), PROMPTS)
  with pytest.raises(ValueError, match="or a name"):
    speculative_generate(tiny_target, 3, PROMPTS)
  for a, b in zip(jax.tree.leaves(drafter.params.head), jax.tree.leaves(ref.params.head)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

  # A target with other shapes, and one with the same shapes but other weights.
  other = Model(tiny_config(hidden_size=32, num_heads=2, num_kv_heads=1),
                init_params(tiny_config(hidden_size=32, num_heads=2, num_kv_heads=1),
                            jax.random.key(1)))
  with pytest.raises(CheckpointError, match="hidden_size=64.*hidden_size=32"):
    heads.load_head(other, path)
  rope = Model(dataclasses.replace(tiny_target.cfg, rope_theta=5e5), tiny_target.params)
  with pytest.raises(CheckpointError, match="rope_theta=10000.0.*rope_theta=500000.0"):
    heads.load_head(rope, path)
  twin = Model(tiny_target.cfg, init_params(tiny_target.cfg, jax.random.key(9)))
  with pytest.raises(CheckpointError, match="another target of the same shapes"):
    heads.load_head(twin, path)
  heads.load_head(twin, path, check_fingerprint=False)  # allowed on request
  # A record whose fingerprint was deleted or nulled no longer passes for any target.
  saved = json.loads((path / "config.json").read_text())
  for edit in ("delete", "null"):
    rec = json.loads(json.dumps(saved))
    if edit == "delete":
      del rec["target"]["fingerprint"]
    else:
      rec["target"]["fingerprint"] = None
    (path / "config.json").write_text(json.dumps(rec))
    with pytest.raises(CheckpointError, match="records no fingerprint"):
      heads.load_head(tiny_target, path)
  (path / "config.json").write_text(json.dumps(saved))
  with pytest.raises(ValueError, match="built for a target"):
    heads.HEADS["eagle"].drafter(model, other)

  # Corrupted: truncated weights, broken JSON, a missing file, a missing tensor.
  weights = path / "head.safetensors"
  raw = weights.read_bytes()
  weights.write_bytes(raw[: len(raw) // 2])
  with pytest.raises(CheckpointError):
    heads.load_head(tiny_target, path)
  weights.unlink()
  with pytest.raises(CheckpointError, match="head.safetensors is missing"):
    heads.load_head(tiny_target, path)
  cfg_file = path / "config.json"
  cfg_file.write_text(cfg_file.read_text()[:-20])
  with pytest.raises(CheckpointError, match="not valid JSON"):
    heads.load_head(tiny_target, path)
  with pytest.raises(CheckpointError, match="does not exist"):
    heads.load_head(tiny_target, tmp_path / "nowhere")

  path2 = heads.save_head(tmp_path / "m", "medusa", trained["medusa"]["model"], tiny_target.cfg)
  from jaxspec.models.hf_loader import read_safetensors, write_safetensors
  t = {k: np.array(v) for k, v in read_safetensors(path2 / "head.safetensors").items()}
  t.pop("b")
  write_safetensors(path2 / "head.safetensors", t)
  with pytest.raises(CheckpointError, match="no tensor 'b'"):
    heads.load_head(tiny_target, path2, check_fingerprint=False)
  assert json.loads((path2 / "config.json").read_text())["target"]["fingerprint"] is None
  # Saved without the target's weights, it names no target: refused unless asked not to check.
  with pytest.raises(CheckpointError, match="records no fingerprint"):
    heads.load_head(tiny_target, path2)


def test_bundled_head_names(tiny_target):
  # No bundled head fits the tiny target: a clear error (what to train, or which target).
  for kind in ("eagle", "medusa", "mlp"):
    installed = (heads.ASSETS / kind / "config.json").exists()
    with pytest.raises(CheckpointError, match="trained for a target" if installed else "train one"):
      heads.load_head(tiny_target, kind)
  assert heads.bundled_head_for(tiny_target) is None


def test_heads_with_few_drafts_cap_k_before_compiling(tiny_target, trained):
  from jaxspec.decoding.adaptive import AutoK
  from jaxspec.decoding.loop import resolve_policy
  medusa = heads.HEADS["medusa"].drafter(trained["medusa"]["model"], tiny_target)  # 3 heads
  assert medusa.max_draft_tokens == 3
  assert resolve_policy("auto", None, medusa).k_max == 3  # the default AutoK is capped
  with pytest.raises(ValueError, match="at most 3 tokens.*num_draft_tokens must be <= 3"):
    speculative_generate(tiny_target, medusa, PROMPTS, num_draft_tokens=4)
  with pytest.raises(ValueError, match=r"AutoK\(k_max=3\)"):
    speculative_generate(tiny_target, medusa, PROMPTS, auto=AutoK(k_max=5))
