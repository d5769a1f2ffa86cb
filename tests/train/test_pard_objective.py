"""PARD's mask-token objective (`jaxspec.train.pard`): the packed layout's targets on a hand
example, that every slot sees what the draft sees at decoding time, the loss against plain
forwards, and `distill(objective=PardObjective(...))` writing a checkpoint `load_pard` reads."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.drafters import ParallelDraft, load_pard
from jaxspec.models import forward, init_cache
from jaxspec.train import TrainConfig, distill
from jaxspec.train.distill import DraftLM, draft_from_target
from jaxspec.train.pard import PardObjective, pard_layout, pard_loss

from helpers import padded_logits

M = 99  # the mask token of the hand examples


def _slots(lay):
  """[(anchor, depth, entry index in the layout)] of the slots of row 0."""
  read, label = np.asarray(lay.read[0]), np.asarray(lay.label[0])
  depth = np.asarray(lay.depth)
  return [(int(label[e] - depth[e]), int(depth[e]), int(read[e]))
          for e in range(len(depth)) if depth[e] > 1]


def test_layout_targets_on_a_hand_example():
  """x = 10..17, responses from x_2 on, k = 3, two anchors, keep 0.5: depth 2 keeps both
  anchors, depth 3 the first (conditional drop: its depth-2 mask exists)."""
  t = 8
  tokens = jnp.arange(10, 10 + t, dtype=jnp.int32)[None]
  loss_mask = jnp.asarray([[0, 0, 1, 1, 1, 1, 1, 1]])
  obj = PardObjective(mask_id=M, k=3, anchors=2, keep=0.5)
  assert obj.depth_counts() == (2, 1)
  lay = pard_layout(tokens, loss_mask, obj, key=jax.random.key(4))
  slots = _slots(lay)
  assert [d for _, d, _ in slots] == [2, 2, 3]
  (a0, _, e0), (a1, _, e1), (a2, _, e2) = slots
  assert a2 == a0 != a1  # the depth-3 slot extends the first anchor's chain
  assert {a0, a1} <= set(range(1, 7))  # anchors whose next token is a response token
  np.testing.assert_array_equal(np.asarray(lay.tokens[0, t:]), [M, M, M])
  np.testing.assert_array_equal(np.asarray(lay.positions[0, t:]), [a0 + 1, a1 + 1, a0 + 2])
  # Each slot's target: x_{a + d}, the token d places after its anchor.
  tok = np.asarray(tokens[0])
  label = np.asarray(lay.label[0])
  assert [int(tok[label[i]]) for i in range(t, t + 3)] == [10 + a0 + 2, 10 + a1 + 2, 10 + a0 + 3]
  mask = np.asarray(lay.mask[0]).astype(int)
  np.testing.assert_array_equal(mask[:t, :t], np.tril(np.ones((t, t), int)))  # plain causal
  assert mask[:t, t:].sum() == 0  # the sequence never reads a slot
  for (a, d, e) in slots:
    np.testing.assert_array_equal(mask[e, :t], np.arange(t) <= a)  # the context up to a
  np.testing.assert_array_equal(mask[t:, t:], [[1, 0, 0], [0, 1, 0], [1, 0, 1]])
  # Depth 1: every position with a response token next, each predicting that token.
  depth1 = np.asarray(lay.depth) == 1
  read1, label1, valid1 = (np.asarray(x[0])[depth1] for x in (lay.read, lay.label, lay.valid))
  np.testing.assert_array_equal(label1, read1 + 1)
  np.testing.assert_array_equal(valid1, (read1 >= 1) & (read1 <= 6))
  assert np.asarray(lay.valid[0, ~depth1]).all()


def test_layout_keeps_packed_conversations_apart():
  """Two conversations in a row: a slot reads only its anchor's, and a label in the other
  conversation is not trained."""
  t = 8
  tokens = jnp.arange(20, 20 + t, dtype=jnp.int32)[None]
  seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 2]])
  pos = jnp.asarray([[0, 1, 2, 3, 0, 1, 2, 3]])
  obj = PardObjective(mask_id=M, k=3, anchors=6, keep=1.0)
  lay = pard_layout(tokens, jnp.ones((1, t)), obj, segment_ids=seg, positions=pos,
                    key=jax.random.key(0))
  s, p = np.asarray(seg[0]), np.asarray(pos[0])
  valid = np.asarray(lay.valid[0])
  mask = np.asarray(lay.mask[0])
  slots = _slots(lay)
  assert sorted(a for a, d, _ in slots if d == 2) == [0, 1, 2, 4, 5, 6]
  for a, d, e in slots:
    assert valid[e] == (a + d < t and s[a + d] == s[a]), (a, d)
    np.testing.assert_array_equal(mask[e, :t], (s == s[a]) & (np.arange(t) <= a))
    assert int(lay.positions[0, e]) == p[a] + d - 1


def test_every_slot_sees_what_decoding_sees(tiny_target):
  """The layout's outputs equal plain forwards over x_0..x_a followed by d - 1 masks, and its
  loss (labels="tokens") is their mean cross-entropy on x_{a + d}."""
  draft = draft_from_target(tiny_target, 1)
  cfg, params = draft.cfg, draft.params
  t = 10
  tokens = jax.random.randint(jax.random.key(2), (2, t), 4, cfg.vocab_size, jnp.int32)
  loss_mask = jnp.asarray([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
  obj = PardObjective(mask_id=3, k=3, anchors=3, keep=0.7, labels="tokens")
  lay = pard_layout(tokens, loss_mask, obj)
  n = lay.tokens.shape[1]
  lg, _, _ = forward(params, lay.tokens, init_cache(cfg, 2, n), cfg, positions=lay.positions,
                     block_mask=lay.mask)
  tok = np.asarray(tokens)
  # Every slot's plain forward in one right-padded batch (causal: a row's last real position
  # does not see its padding), not one op-by-op forward per length.
  slots = [(b, e) for b in range(2) for e in range(lay.read.shape[1])]
  seqs = []
  for b, e in slots:
    d = int(lay.depth[e])
    seqs.append(list(tok[b, :int(lay.label[b, e]) - d + 1]) + [3] * (d - 1))
  plain = padded_logits(params, cfg, seqs)
  nll = []
  for (b, e), seq, row in zip(slots, seqs, plain):
    at = int(lay.read[b, e])
    want = row[len(seq) - 1]
    np.testing.assert_allclose(np.asarray(lg[b, at]), np.asarray(want), atol=2e-5,
                               err_msg=f"row {b} entry {e}")
    if bool(lay.valid[b, e]):
      nll.append(-float(jax.nn.log_softmax(want)[tok[b, int(lay.label[b, e])]]))
  loss, metrics = pard_loss(DraftLM(cfg, params), {"tokens": tokens, "loss_mask": loss_mask},
                            None, objective=obj)
  np.testing.assert_allclose(float(loss), np.mean(nll), rtol=1e-5)
  assert set(metrics) == {"top1_d1", "top1_d2", "top1_d3"}


def test_target_labels_near_the_rows_end_keep_the_loss_finite(tiny_target):
  """labels="target" on rows that end inside a response: the slots anchored at the last
  positions have labels past the row (not valid), and the loss stays finite (their NaN reads
  once made it NaN) and equals the loss over the valid entries alone."""
  from jaxspec.models.llama import logits_from_hidden
  draft = draft_from_target(tiny_target, 1)
  t = 6
  tokens = jax.random.randint(jax.random.key(4), (2, t), 4, draft.cfg.vocab_size, jnp.int32)
  loss_mask = jnp.asarray([[0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]])
  hidden = jax.random.normal(jax.random.key(5), (2, t, draft.cfg.hidden_size))
  obj = PardObjective(mask_id=3, k=3, anchors=t, labels="target")
  lay = pard_layout(tokens, loss_mask, obj)
  assert int(jnp.max(lay.label)) >= t  # some slot's label is past the row
  batch = {"tokens": tokens, "loss_mask": loss_mask, "hidden_final": hidden}
  loss, _ = pard_loss(DraftLM(draft.cfg, draft.params), batch, tiny_target.params,
                      objective=obj)
  assert np.isfinite(float(loss))
  # By hand over the valid entries: KL(p || q) with p from the target's hidden state one
  # position before the label.
  n = lay.tokens.shape[1]
  _, hid, _ = forward(draft.params, lay.tokens, init_cache(draft.cfg, 2, n), draft.cfg,
                      logits=False, positions=lay.positions, block_mask=lay.mask)
  total, count = 0.0, 0
  for b in range(2):
    for e in range(lay.read.shape[1]):
      if not bool(lay.valid[b, e]):
        continue
      lq = jax.nn.log_softmax(logits_from_hidden(draft.params, hid.final[b, lay.read[b, e]]))
      lp = jax.nn.log_softmax(logits_from_hidden(tiny_target.params,
                                                 hidden[b, lay.label[b, e] - 1]))
      total += float(jnp.sum(jnp.exp(lp) * (lp - lq)))
      count += 1
  np.testing.assert_allclose(float(loss), total / count, rtol=1e-4)


def test_distill_with_the_pard_objective_writes_a_pard_checkpoint(tiny_target, tmp_path):
  rng = np.random.default_rng(0)
  tokens = rng.integers(4, 128, (4, 24)).astype(np.int32)
  mask = np.zeros((4, 24), np.float32)
  mask[:, 6:] = 1
  data = [{"tokens": tokens, "loss_mask": mask}] * 3
  obj = PardObjective(mask_id=3, k=3, anchors=4)
  cfg = TrainConfig(steps=3, batch_size=4, lr=1e-3, warmup_steps=0, save_every=3)
  draft, hist = distill(tiny_target, data, tmp_path / "pard", cfg, num_layers=1,
                        progress=False, objective=obj)
  assert len(hist) == 3 and "top1_d3" in hist[-1]
  raw = json.loads((tmp_path / "pard" / "config.json").read_text())
  assert (raw["pard_token"], raw["pard_trained_k"]) == (3, 3)
  d = load_pard(tmp_path / "pard", tiny_target)
  assert isinstance(d, ParallelDraft) and (d.mask_id, d.trained_k) == (3, 3)
  with pytest.raises(ValueError, match="outside the target's vocabulary of 128"):
    distill(tiny_target, data, tmp_path / "bad", cfg, num_layers=1, progress=False,
            objective=PardObjective(mask_id=128))
  with pytest.raises(ValueError, match="objective must be \"kl\" or"):
    distill(tiny_target, data, tmp_path / "bad", cfg, num_layers=1, progress=False,
            objective="pard")


@pytest.mark.parametrize("kw, match", [
    (dict(k=1), "k must be an integer >= 2"),
    (dict(keep=0.0), r"keep must be a number in \(0, 1\]"),
    (dict(anchors=0), "anchors must be an integer >= 1"),
    (dict(labels="soft"), "labels must be one of"),
    (dict(mask_id=-1), "mask_id must be an integer >= 0"),
])
def test_bad_objective_settings(kw, match):
  with pytest.raises(ValueError, match=match):
    PardObjective(**{"mask_id": 3, **kw})


def test_cli_train_pard_needs_a_corpus_and_a_mask(tmp_path):
  """`jaxspec train pard` refuses, before loading anything, a run without --corpus or without
  --option mask_id, and options PardObjective does not have."""
  from jaxspec.cli.app import main
  base = ["train", "pard", "--out", str(tmp_path / "out")]
  corpus = ["--corpus", str(tmp_path / "corpus")]
  cases = [(base + ["--option", "mask_id=16"], "pass --corpus DIR"),
           (base + corpus, "needs its mask token: --option mask_id=ID"),
           (base + corpus + ["--option", "mask_id=16", "--option", "depth=3"],
            r"pard takes --option .*; got \['depth'\]"),
           (base + corpus + ["--option", "mask_id=16", "--option", "k=1"],
            "PardObjective.k must be an integer >= 2")]
  for argv, match in cases:
    with pytest.raises(SystemExit, match=match):
      main(argv)
