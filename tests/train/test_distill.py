"""Draft-model distillation: a draft cut from the tiny target learns its distribution, is saved
in Hugging Face layout, reloads, and drafts for exact greedy speculative decoding."""

import functools
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.cli import main
from jaxspec.drafters import DraftModel
from jaxspec.api import generate
from jaxspec.models.hf_loader import save_hf
from jaxspec.api import speculative_generate
from jaxspec.train.data import DataConfig, DataError, Dataset, write_dataset
from jaxspec.train.distill import (DraftLM, distill, distill_loss, draft_from_target,
                                   response_positions)
from jaxspec.train.trainer import TrainConfig


@pytest.fixture(scope="module")
def data(tiny_target, tmp_path_factory):
  rng = np.random.default_rng(1)
  prompts = [rng.integers(3, 128, size=int(rng.integers(2, 8))).tolist() for _ in range(32)]
  # The same generation shapes as test_cli_train_draft_model's: one compilation for both.
  cfg = DataConfig(max_prompt_len=8, max_new_tokens=12, batch_size=32, hidden_batch_size=8,
                   chat=False, temperatures=(0.0, 1.0))
  path = write_dataset(tiny_target, prompts, tmp_path_factory.mktemp("d") / "ds", cfg,
                       progress=False)
  return Dataset(path, eval_fraction=0.15)


def test_draft_is_the_targets_first_layers(tiny_target):
  draft = draft_from_target(tiny_target, num_layers=1)
  assert draft.cfg.num_layers == 1 and draft.cfg.vocab_size == tiny_target.cfg.vocab_size
  np.testing.assert_array_equal(draft.params.layers.wq[0], tiny_target.params.layers.wq[0])
  np.testing.assert_array_equal(draft.params.lm_head, tiny_target.params.lm_head)
  module = DraftLM(draft.cfg, draft.params)
  jax.tree.map(np.testing.assert_array_equal, module.params(), draft.params)
  with pytest.raises(ValueError, match="--num-layers"):
    draft_from_target(tiny_target, num_layers=2)


def test_response_positions():
  """The first r positions whose next token is a response token: of every answer of a
  multi-turn row (row 2), and only inside a conversation of a packed row (row 3, segment_ids)."""
  mask = jnp.array([[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 1, 0, 0, 0, 0, 0],
                    [0, 1, 1, 0, 0, 1, 1, 0], [0, 1, 1, 1, 0, 1, 1, 0]], jnp.float32)
  seg = jnp.array([[1] * 8, [1] * 8, [1] * 8, [1, 1, 1, 2, 2, 2, 2, 0]])
  idx, valid = response_positions(mask, 4, seg)
  got = [sorted(int(i) for i, v in zip(row_i, row_v) if v) for row_i, row_v in zip(idx, valid)]
  assert got == [[1, 2, 3], [0, 1], [0, 1, 4, 5], [0, 1, 4, 5]]
  assert idx.shape == valid.shape == (4, 4)
  from jaxspec.heads.common import same_segment_ahead
  assert not np.asarray(same_segment_ahead(seg[:, :3], 5)).any()  # past the row: no label
  assert same_segment_ahead(np.asarray(seg[:, :3]), 3).shape == (4, 3)
  idx, valid = response_positions(mask[:1], 2)  # r cuts a row's positions: the first ones
  assert np.asarray(idx).tolist() == [[1, 2]] and np.asarray(valid).tolist() == [[1, 1]]


def test_loss_of_a_packed_row_is_its_conversations_apart(tiny_target):
  """distill_loss on two conversations packed in one row (segment_ids, positions restarting)
  equals the loss of each conversation alone, weighted by its response positions."""
  rng = np.random.default_rng(5)
  a, b = rng.integers(3, 128, 7).tolist(), rng.integers(3, 128, 6).tolist()
  ma, mb = [0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1]
  cut = draft_from_target(tiny_target, 1)
  model = DraftLM(cut.cfg, cut.params)
  loss_fn = jax.jit(functools.partial(distill_loss, positions=1 << 30))
  from jaxspec.train.online import target_hidden
  alone = []
  for toks, m in ((a, ma), (b, mb)):
    tokens = jnp.asarray([toks], jnp.int32)
    batch = {"tokens": tokens, "loss_mask": jnp.asarray([m], jnp.float32),
             "hidden_final": target_hidden(tiny_target.params, tokens, tiny_target.cfg)[0]}
    alone.append((float(loss_fn(model, batch, tiny_target.params)[0]), sum(m)))  # positions
  packed = {"tokens": jnp.asarray([a + b], jnp.int32),
            "loss_mask": jnp.asarray([ma + mb], jnp.float32),
            "segment_ids": jnp.asarray([[1] * 7 + [2] * 6], jnp.int32),
            "positions": jnp.asarray([list(range(7)) + list(range(6))], jnp.int32)}
  packed["hidden_final"] = target_hidden(tiny_target.params, packed["tokens"], tiny_target.cfg,
                                         segment_ids=packed["segment_ids"],
                                         positions=packed["positions"])[0]
  got = float(loss_fn(model, packed, tiny_target.params)[0])
  want = sum(l * n for l, n in alone) / sum(n for _, n in alone)
  np.testing.assert_allclose(got, want, rtol=1e-4)


def test_loss_is_the_kl_to_the_target(tiny_target, data):
  """The loss of the full target as its own draft is zero; the untrained cut draft's is not."""
  batch = {k: jnp.asarray(v) for k, v in data.train_batch(0, 4, 0).items()}
  loss_fn = jax.jit(functools.partial(distill_loss, positions=data.max_new_tokens))
  same = DraftLM(tiny_target.cfg, tiny_target.params)
  loss, m = loss_fn(same, batch, tiny_target.params)
  assert float(loss) < 1e-3 and float(m["top1_agreement"]) == 1.0  # float16 hidden states
  cut = draft_from_target(tiny_target, 1)
  loss, _ = loss_fn(DraftLM(cut.cfg, cut.params), batch, tiny_target.params)
  assert float(loss) > 0.05


def test_distilled_draft_saves_reloads_and_drafts_exactly(tiny_target, data, tmp_path):
  cfg = TrainConfig(steps=30, batch_size=8, lr=3e-3, warmup_steps=4, save_every=20,
                    eval_every=20, eval_batches=2)
  out = tmp_path / "draft"
  draft, hist = distill(tiny_target, data, out, cfg, num_layers=1, progress=False)
  first = np.mean([h["kl"] for h in hist[:4]])
  last = np.mean([h["kl"] for h in hist[-4:]])
  assert last < 0.6 * first, (first, last)
  assert hist[-1]["top1_agreement"] > hist[0]["top1_agreement"] + 0.2
  assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
  assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1
  assert (out / "training" / "history.jsonl").is_file()

  loaded = jaxspec.load(out)  # in the backend's default layer layout; compared stacked
  assert loaded.cfg == draft.cfg
  jax.tree.map(np.testing.assert_array_equal, loaded.with_scan_layers(True).params,
               draft.with_scan_layers(True).params)
  # Greedy speculative output is the target's, token for token; on prompts it was trained on
  # (a random target teaches nothing that generalises) the draft gets more accepted than the
  # untrained cut does.
  rows = data.train_indices[::2][:4]
  prompts = [data.tokens[i, :data.prompt_lengths[i]].tolist() for i in rows] + [[5, 6, 7]]
  plain = generate(tiny_target, prompts, max_new_tokens=12)
  spec = speculative_generate(tiny_target, DraftModel(loaded), prompts, max_new_tokens=12,
                              num_draft_tokens=3)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  np.testing.assert_array_equal(spec.lengths, plain.lengths)
  untrained = speculative_generate(tiny_target, DraftModel(draft_from_target(tiny_target, 1)),
                                   prompts, max_new_tokens=12, num_draft_tokens=3)
  np.testing.assert_array_equal(untrained.tokens, plain.tokens)
  assert spec.stats["tau"] > untrained.stats["tau"] + 0.2, (spec.stats["tau"],
                                                            untrained.stats["tau"])


def test_distill_without_stored_hidden_states_runs_the_target(tiny_target, data, tmp_path):
  """A dataset without hidden states trains with the target's forward in the step (online);
  hidden="offline" asks for stored ones and names what is missing."""
  path = shutil.copytree(data.path, tmp_path / "ds", ignore=shutil.ignore_patterns("hidden_*"))
  meta = json.loads((path / "meta.json").read_text())
  (path / "meta.json").write_text(json.dumps(dict(meta, hidden_final=False)))
  cfg = TrainConfig(steps=2, warmup_steps=0, batch_size=4)
  with pytest.raises(DataError, match="stores no hidden states"):
    distill(tiny_target, Dataset(path), tmp_path / "out", cfg, num_layers=1, progress=False,
            hidden="offline")
  _, online = distill(tiny_target, Dataset(path, eval_fraction=0.15), tmp_path / "online", cfg,
                      num_layers=1, progress=False)
  _, stored = distill(tiny_target, data, tmp_path / "stored", cfg, num_layers=1, progress=False)
  for a, b in zip(online, stored):  # the stored states are float16: equal up to that rounding
    np.testing.assert_allclose(a["loss"], b["loss"], rtol=5e-3)


@pytest.fixture(scope="module")
def target_dir(tiny_target, tmp_path_factory):
  return save_hf(tiny_target, tmp_path_factory.mktemp("target"))


def test_cli_train_draft_model(target_dir, tmp_path):
  target = target_dir
  rng = np.random.default_rng(2)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt_ids": rng.integers(3, 128, size=5).tolist()})
                             + "\n" for _ in range(16)))
  out = tmp_path / "out"
  args = ["train", "draft-model", "--model", str(target), "--prompts", str(prompts), "--out",
          str(out), "--steps", "4", "--batch-size", "4", "--num-layers", "1",
          "--max-new-tokens", "12", "--max-prompt-len", "8", "--gen-batch-size", "32",
          "--temperature", "0", "--save-every", "2", "--save-dtype", "float32", "--no-progress"]
  assert main(args) == 0
  summary = json.loads((out / "summary.json").read_text())
  assert summary["final"]["step"] == 4 and summary["train_rows"] + summary["eval_rows"] == 16
  draft = jaxspec.load(out)
  assert draft.cfg.num_layers == 1
  assert json.loads((out / "data" / "meta.json").read_text())["num_examples"] == 16
  with pytest.raises(SystemExit, match="--resume"):  # the run is there: resume or a new --out
    main(args)
  assert main(args + ["--resume"]) == 0  # finished already: reuses data/, trains nothing more
  with pytest.raises(SystemExit, match="no training data"):
    main(["train", "draft-model", "--out", str(tmp_path / "o2")])
  with pytest.raises(SystemExit, match="--num-layers"):
    main(args[:-1] + ["--num-layers", "2", "--out", str(tmp_path / "o3")])


def test_cli_train_head_on_stored_data(target_dir, data, tmp_path, capsys):
  """A head kind goes through the same data and trainer, and is saved with its registry;
  --no-progress prints plain progress lines; a resumed run's summary counts its own steps."""
  import shutil
  out = tmp_path / "medusa"
  args = ["train", "medusa", "--model", str(target_dir), "--data-dir", str(data.path),
          "--out", str(out), "--steps", "4", "--save-every", "2", "--batch-size", "4",
          "--option", "num_heads=2", "--no-progress"]
  assert main(args) == 0
  captured = capsys.readouterr()
  assert "[jaxspec] training: 4 / 4 (100%)" in captured.err
  assert "trained medusa for 4 steps in" in captured.out
  config = json.loads((out / "config.json").read_text())
  assert config["kind"] == "medusa" and config["head_config"]["num_heads"] == 2
  summary = json.loads((out / "summary.json").read_text())
  assert summary["final"]["step"] == 4 and summary["offline_tau"] >= 1.0
  assert (out / "training" / "checkpoints" / "4").is_dir()
  # Killed after its step-2 checkpoint: the resumed run trains steps 3 and 4 and says so.
  shutil.rmtree(out / "training" / "checkpoints" / "4")
  assert main(args + ["--resume"]) == 0
  assert "trained medusa for 2 steps (resumed at step 2 of 4) in" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="unknown MedusaConfig options"):
    main(["train", "medusa", "--model", str(target_dir), "--data-dir", str(data.path), "--out",
          str(tmp_path / "m2"), "--option", "heads=2", "--no-progress"])


def test_cli_init_goes_on_training_a_saved_head(target_dir, data, tmp_path):
  """--init starts from a saved head: its weights (a step at a vanishing learning rate leaves
  them as saved), its options, recorded in the new head's meta; another kind, --option beside
  it and a non-head kind are refused before training."""
  from safetensors.numpy import load_file
  base = ["train", "medusa", "--model", str(target_dir), "--data-dir", str(data.path),
          "--batch-size", "4", "--no-progress"]
  first, second = tmp_path / "first", tmp_path / "second"
  assert main(base + ["--out", str(first), "--steps", "3", "--option", "num_heads=2"]) == 0
  assert main(base + ["--out", str(second), "--steps", "1", "--lr", "1e-30",
                      "--init", str(first)]) == 0
  before, after = load_file(first / "head.safetensors"), load_file(second / "head.safetensors")
  assert sorted(before) == sorted(after)
  for name in before:  # a fresh head would differ by its random initialisation
    np.testing.assert_allclose(np.asarray(after[name], np.float32),
                               np.asarray(before[name], np.float32), rtol=0, atol=1e-20)
  config = json.loads((second / "config.json").read_text())
  assert config["head_config"]["num_heads"] == 2 and config["meta"]["init"] == str(first)
  with pytest.raises(SystemExit, match="is a medusa head, not mlp"):
    main(["train", "mlp"] + base[2:] + ["--out", str(tmp_path / "x"), "--init", str(first)])
  with pytest.raises(SystemExit, match="keeps that head's options: drop --option"):
    main(base + ["--out", str(tmp_path / "y"), "--init", str(first), "--option", "num_heads=3"])
  with pytest.raises(SystemExit, match="--init continues a saved head"):
    main(["train", "draft-model"] + base[2:] + ["--out", str(tmp_path / "z"), "--init",
                                                str(first)])
  assert not any((tmp_path / d).exists() for d in "xyz")


def test_cli_self_instructions(target_dir, tmp_path, monkeypatch):
  """--self-instructions through the CLI: the target's own requests are answered beside the
  prompt files', counted under their own name, and the minutes spent writing them count in the
  head's data_seconds; a negative count and a target without a chat template are refused."""
  import sys
  import time

  from jaxspec.train.data import SELF_INSTRUCTIONS
  base = ["train", "medusa", "--model", str(target_dir), "--steps", "2", "--batch-size", "4",
          "--option", "num_heads=1", "--max-new-tokens", "12", "--max-prompt-len", "8",
          "--gen-batch-size", "32", "--temperature", "0", "--no-progress"]
  with pytest.raises(SystemExit, match="--self-instructions must be >= 0"):
    main(base + ["--self-instructions", "-1", "--out", str(tmp_path / "neg")])
  # The tiny target is saved without a tokenizer, so it has no chat template to write after.
  with pytest.raises(SystemExit, match="chat template"):
    main(base + ["--self-instructions", "3", "--out", str(tmp_path / "no_template")])

  asked = []

  def fake_instructions(target, n, *, seed, batch_size, progress):
    asked.append(n)
    time.sleep(0.2)  # the time the CLI must record
    return [[7, 8, 9 + i] for i in range(n)]  # token-id prompts: the tiny target has no tokenizer

  monkeypatch.setattr(sys.modules["jaxspec.train.data"], "target_instructions",
                      fake_instructions)
  rng = np.random.default_rng(4)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt_ids": rng.integers(3, 128, size=5).tolist()})
                             + "\n" for _ in range(6)))
  out = tmp_path / "own"
  assert main(base + ["--prompts", str(prompts), "--self-instructions", "10",
                      "--out", str(out)]) == 0
  assert asked == [10]
  meta = json.loads((out / "data" / "meta.json").read_text())
  assert meta["prompt_files"] == {str(prompts): 6, SELF_INSTRUCTIONS: 10}
  assert meta["num_examples"] == 16 and meta["seconds"]["instructions"] >= 0.2
  record = json.loads((out / "config.json").read_text())["meta"]
  assert record["data_seconds"] == pytest.approx(sum(meta["seconds"].values()), abs=0.2)
  assert record["data_seconds"] >= meta["seconds"]["instructions"] + meta["seconds"]["generate"]


def test_cli_given_responses(target_dir, tmp_path):
  """--responses given: the prompt files' own answers are stored teacher-forced (no generation)
  and train a head whose record says so; a file line without an answer, and target-written
  instructions (which have none), are refused."""
  base = ["train", "medusa", "--model", str(target_dir), "--steps", "2", "--batch-size", "4",
          "--option", "num_heads=1", "--max-new-tokens", "6", "--max-prompt-len", "8",
          "--responses", "given", "--no-progress"]
  rng = np.random.default_rng(5)
  rows = [{"prompt_ids": rng.integers(3, 128, size=4).tolist(),
           "response_ids": rng.integers(3, 128, size=int(n)).tolist()}
          for n in rng.integers(2, 9, size=8)]
  prompts = tmp_path / "pairs.jsonl"
  prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
  out = tmp_path / "given"
  assert main(base + ["--prompts", str(prompts), "--out", str(out)]) == 0
  meta = json.loads((out / "data" / "meta.json").read_text())
  assert meta["responses"] == "given" and meta["num_examples"] == 8
  tokens = np.load(out / "data" / "tokens.npy")
  lengths = np.load(out / "data" / "lengths.npy")
  by_prompt = {tuple(r["prompt_ids"]): r["response_ids"][:6] for r in rows}
  for t, n in zip(tokens, lengths):
    assert t[4:n].tolist() == by_prompt[tuple(t[:4].tolist())]
  assert json.loads((out / "config.json").read_text())["meta"]["data_responses"] == "given"
  bad = tmp_path / "bad.jsonl"
  bad.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"prompt_ids": [4, 5]}) + "\n")
  with pytest.raises(SystemExit, match=r"bad\.jsonl:2: no answer field"):
    main(base + ["--prompts", str(bad), "--out", str(tmp_path / "bad")])
  with pytest.raises(SystemExit, match="--self-instructions has no given responses"):
    main(base + ["--prompts", str(prompts), "--self-instructions", "2",
                 "--out", str(tmp_path / "own")])
