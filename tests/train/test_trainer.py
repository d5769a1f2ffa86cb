"""The generic NNX trainer: loss goes down, checkpoints are atomic, and a killed run resumes to
exactly the parameters of an uninterrupted one."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from jaxspec.models import logits_from_hidden
from jaxspec.train.data import DataConfig, Dataset, write_dataset
from jaxspec.train.trainer import TrainConfig, lr_schedule, train

RUN_CFG = TrainConfig(steps=12, batch_size=4, lr=3e-3, warmup_steps=2, save_every=4,
                      keep_last_n=3, eval_every=6, eval_batches=2, seed=5)


class ToyHead(nnx.Module):
  """Predicts the next token from the target's final hidden state (with dropout, so the RNG
  state must survive a resume too)."""

  def __init__(self, d: int, v: int, *, rngs: nnx.Rngs):
    self.proj = nnx.Linear(d, d, rngs=rngs)
    self.drop = nnx.Dropout(0.1, rngs=rngs)
    self.out = nnx.Linear(d, v, rngs=rngs)

  def __call__(self, h):
    return self.out(self.drop(jax.nn.silu(self.proj(h))))


def toy_loss(model, batch, frozen):
  """Cross-entropy to the target's greedy next token, on response positions."""
  h = batch["hidden_final"][:, :-1]  # [B, T-1, D]
  labels = jnp.argmax(logits_from_hidden(frozen, h), -1)  # [B, T-1]
  mask = batch["loss_mask"][:, 1:]
  logits = model(h)
  ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
  n = jnp.maximum(mask.sum(), 1.0)
  acc = ((jnp.argmax(logits, -1) == labels) * mask).sum() / n
  return (ce * mask).sum() / n, {"acc": acc}


def make_head(d: int, v: int) -> ToyHead:
  return ToyHead(d, v, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def data_dir(tiny_target, tmp_path_factory):
  rng = np.random.default_rng(0)
  prompts = [rng.integers(3, 128, size=int(rng.integers(2, 9))).tolist() for _ in range(24)]
  cfg = DataConfig(max_prompt_len=10, max_new_tokens=12, batch_size=24, hidden_batch_size=8,
                   chat=False)
  return write_dataset(tiny_target, prompts, tmp_path_factory.mktemp("d") / "ds", cfg,
                       progress=False)


def _params(model):
  return jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_loss_goes_down_and_history_is_written(tiny_target, data_dir, tmp_path):
  ds = Dataset(data_dir)
  cfg = TrainConfig(steps=30, batch_size=4, lr=1e-2, warmup_steps=3, save_every=30,
                    eval_every=10, eval_batches=2)
  head = make_head(tiny_target.cfg.hidden_size, tiny_target.cfg.vocab_size)
  before = _params(head)
  head, hist = train(head, toy_loss, ds, cfg, tmp_path, frozen=tiny_target.params,
                     progress=False)
  assert [h["step"] for h in hist] == list(range(1, 31))
  first, last = np.mean([h["loss"] for h in hist[:3]]), np.mean([h["loss"] for h in hist[-3:]])
  assert last < 0.7 * first, (first, last)
  assert {"eval_loss", "eval_acc"} <= set(hist[9]) and "eval_loss" not in hist[8]
  assert hist[-1]["eval_acc"] > hist[9]["eval_acc"] - 0.05
  assert hist[0]["lr"] == pytest.approx(float(lr_schedule(cfg)(0)))
  on_disk = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
  assert on_disk == hist
  after = _params(head)  # the module was updated in place
  assert not np.allclose(after["out"]["kernel"], before["out"]["kernel"])
  assert (tmp_path / "checkpoints" / "30").is_dir()


def test_refuses_to_overwrite_or_change_settings(tiny_target, data_dir, tmp_path):
  ds = Dataset(data_dir)
  cfg = TrainConfig(steps=2, batch_size=4, warmup_steps=0, save_every=1)
  head = make_head(tiny_target.cfg.hidden_size, tiny_target.cfg.vocab_size)
  train(head, toy_loss, ds, cfg, tmp_path, frozen=tiny_target.params, progress=False)
  with pytest.raises(ValueError, match="already holds checkpoints: pass resume=True"):
    train(head, toy_loss, ds, cfg, tmp_path, frozen=tiny_target.params, progress=False)
  with pytest.raises(ValueError, match=r"lr=0.001 \(now 0.5\)"):
    train(head, toy_loss, ds, TrainConfig(steps=2, batch_size=4, warmup_steps=0, lr=0.5),
          tmp_path, frozen=tiny_target.params, resume=True, progress=False)
  with pytest.raises(ValueError, match="warmup_steps 5 must be below steps 5"):
    TrainConfig(steps=5, warmup_steps=5)
  with pytest.raises(ValueError, match="lower --batch-size"):
    train(head, toy_loss, ds, TrainConfig(steps=2, batch_size=999, warmup_steps=0),
          tmp_path / "other", frozen=tiny_target.params, progress=False)


# ---------------------------------------------------------------------------------------------
# Kill and resume, in subprocesses.

_SCRIPT = r"""
import os, sys
sys.path.insert(0, {tests!r})
import jax, numpy as np
import orbax.checkpoint as ocp
from flax import nnx
from jaxspec.models import init_params, tiny_config
from jaxspec.train.data import Dataset
from jaxspec.train.trainer import train
import test_trainer as T

mode, data_dir, out_dir = sys.argv[1:4]
if mode == "die-in-save":
  # Kill the process inside orbax's save of step 8: the state item may be partly written, the
  # checkpoint is never finalized.
  handler = ocp.handlers.JsonCheckpointHandler
  original = handler.async_save

  async def dying_save(self, directory, *args, **kwargs):
    item = kwargs.get("item") or (args[0] if args else None)
    a = kwargs.get("args") or (args[1] if len(args) > 1 else None)
    meta = item if item is not None else getattr(a, "item", None)
    if isinstance(meta, dict) and meta.get("step") == 8:
      os._exit(17)
    return await original(self, directory, *args, **kwargs)

  handler.async_save = dying_save
cfg = tiny_config()
target_params = init_params(cfg, jax.random.key(0), scale=0.2)
head = T.make_head(cfg.hidden_size, cfg.vocab_size)
ran = []  # the steps this process trains (every step is logged)
head, hist = train(head, T.toy_loss, Dataset(data_dir), T.RUN_CFG, out_dir,
                   frozen=target_params, resume=(mode == "resume"), progress=False,
                   on_step=lambda step, record: ran.append(step))
np.savez(os.path.join(out_dir, "final.npz"),
         **{{jax.tree_util.keystr(k): np.asarray(v) for k, v in
            jax.tree_util.tree_flatten_with_path(T._params(head))[0]}})
print("first step", hist[0]["step"] if hist else None)
print("ran", ran)
"""


def _run(script, *args):
  return subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                        text=True, timeout=300, env=dict(os.environ))


def _history(out):
  return [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


def test_killed_mid_save_resumes_to_the_same_params(tiny_target, data_dir, tmp_path):
  script = tmp_path / "run.py"
  script.write_text(_SCRIPT.format(tests=str(Path(__file__).parent)))

  killed = tmp_path / "killed"
  r = _run(script, "die-in-save", data_dir, killed)
  assert r.returncode == 17, r.stderr[-3000:]
  ckpts = killed / "checkpoints"
  names = sorted(p.name for p in ckpts.iterdir())
  # Step 4 is complete; step 8 died inside its save and exists only as a temporary directory.
  assert "4" in names and "8" not in names, names
  assert any(n.startswith("8") and n != "8" for n in names), names
  assert [h["step"] for h in _history(killed)] == list(range(1, 9))

  r = _run(script, "resume", data_dir, killed)
  assert r.returncode == 0, r.stderr[-3000:]
  assert "first step 1" in r.stdout  # history up to the checkpoint is kept ...
  assert f"ran {list(range(5, 13))}" in r.stdout, r.stdout  # ... and only steps 5-12 rerun
  hist_resumed = _history(killed)
  assert [h["step"] for h in hist_resumed] == list(range(1, 13))
  assert sorted(p.name for p in ckpts.iterdir()) == ["12", "4", "8"]  # temp dir cleaned up

  # The uninterrupted run, in this process.
  head = make_head(tiny_target.cfg.hidden_size, tiny_target.cfg.vocab_size)
  head, hist = train(head, toy_loss, Dataset(data_dir), RUN_CFG, tmp_path / "straight",
                     frozen=tiny_target.params, progress=False)
  for a, b in zip(hist, hist_resumed):
    assert a["loss"] == b["loss"] and a.get("eval_loss") == b.get("eval_loss"), (a, b)
  final = np.load(killed / "final.npz")
  flat = jax.tree_util.tree_flatten_with_path(_params(head))[0]
  assert len(flat) == len(final.files) == 4
  for k, v in flat:
    np.testing.assert_array_equal(final[jax.tree_util.keystr(k)], v)


def test_a_torn_history_line_does_not_block_resume(tiny_target, data_dir, tmp_path):
  """A run killed while writing a history line leaves it cut short: resume drops it (it is
  newer than any checkpoint); an unreadable line before the last is a ValueError naming the
  file."""
  ds = Dataset(data_dir)
  cfg = TrainConfig(steps=4, batch_size=4, warmup_steps=0, save_every=2)
  d, v = tiny_target.cfg.hidden_size, tiny_target.cfg.vocab_size
  run = lambda **kw: train(make_head(d, v), toy_loss, ds, cfg, tmp_path,
                           frozen=tiny_target.params, progress=False, **kw)

  def die(step, record):
    if step == 3:  # after checkpoint 2 and history line 3
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    run(callbacks=[die])
  with open(tmp_path / "history.jsonl", "a", encoding="utf-8") as f:
    f.write('{"step": 4, "lo')  # step 4's line, cut short
  _, hist = run(resume=True)
  assert [h["step"] for h in hist] == [1, 2, 3, 4] and "loss" in hist[3]
  lines = (tmp_path / "history.jsonl").read_text().splitlines()
  (tmp_path / "history.jsonl").write_text("\n".join(["not json"] + lines[1:]) + "\n")
  with pytest.raises(ValueError, match=r"history\.jsonl line 1 is not a history record"):
    run(resume=True)


def test_resume_refuses_other_data(tiny_target, data_dir, tmp_path):
  """The data's signature (rows, split, crop) is stored with the run: resuming on data that
  would give other batches (here another crop window) is a ValueError naming what changed."""
  cfg = TrainConfig(steps=4, batch_size=4, warmup_steps=0, save_every=2)
  d, v = tiny_target.cfg.hidden_size, tiny_target.cfg.vocab_size
  run = lambda data, **kw: train(make_head(d, v), toy_loss, data, cfg, tmp_path,
                                 frozen=tiny_target.params, progress=False, **kw)

  def stop(step, record):
    if step == 3:
      raise KeyboardInterrupt

  with pytest.raises(KeyboardInterrupt):
    run(Dataset(data_dir), callbacks=[stop])
  saved = json.loads((tmp_path / "train_config.json").read_text())
  assert saved["data"] == Dataset(data_dir).signature() and saved["data"]["window"] is None
  with pytest.raises(ValueError, match=r"trained on other data \(window None \(now 8\)\)"):
    run(Dataset(data_dir, window=8), resume=True)
  _, hist = run(Dataset(data_dir), resume=True)  # the same data resumes
  assert [h["step"] for h in hist] == [1, 2, 3, 4]


def test_a_nan_loss_is_never_saved(tiny_target, tmp_path):
  """A loss that turns NaN on a step that is not logged stops the run at the next save, before
  that checkpoint is written: the last one kept is the last finite one."""
  d, v = tiny_target.cfg.hidden_size, tiny_target.cfg.vocab_size
  rng = np.random.default_rng(0)
  batches = []
  for i in range(8):
    h = rng.normal(size=(2, 6, d)).astype(np.float32)
    if i >= 4:  # from step 5 on the data poisons the weights
      h[:] = np.nan
    batches.append({"hidden_final": h, "loss_mask": np.ones((2, 6), np.float32)})
  cfg = TrainConfig(steps=8, batch_size=2, warmup_steps=0, save_every=3, log_every=100,
                    keep_last_n=1)
  with pytest.raises(FloatingPointError, match="at step 6"):
    train(make_head(d, v), toy_loss, batches, cfg, tmp_path, frozen=tiny_target.params,
          progress=False)
  assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["3"]


def test_resume_after_completion_changes_nothing(tiny_target, data_dir, tmp_path):
  ds = Dataset(data_dir)
  cfg = TrainConfig(steps=3, batch_size=4, warmup_steps=0, save_every=3)
  d, v = tiny_target.cfg.hidden_size, tiny_target.cfg.vocab_size
  done, hist = train(make_head(d, v), toy_loss, ds, cfg, tmp_path, frozen=tiny_target.params,
                     progress=False)
  again, hist2 = train(make_head(d, v), toy_loss, ds, cfg, tmp_path, frozen=tiny_target.params,
                       resume=True, progress=False)
  assert hist2 == hist
  jax.tree.map(np.testing.assert_array_equal, _params(done), _params(again))


def test_time_limit_stops_saves_and_resumes_to_the_same_params(tiny_target, data_dir,
                                                                 tmp_path):
  """A run past its time_limit ends at that step: evaluated, logged with "stopped", saved;
  resumed (another limit is bookkeeping), it reaches the parameters of an uninterrupted run."""
  ds = Dataset(data_dir)
  d, v = tiny_target.cfg.hidden_size, tiny_target.cfg.vocab_size
  whole, _ = train(make_head(d, v), toy_loss, ds, RUN_CFG, tmp_path / "whole",
                   frozen=tiny_target.params, progress=False)
  cut = dataclasses.replace(RUN_CFG, time_limit=1e-6)
  _, hist = train(make_head(d, v), toy_loss, ds, cut, tmp_path / "cut",
                  frozen=tiny_target.params, progress=False)
  assert [h["step"] for h in hist] == [1]
  assert hist[-1]["stopped"] == "time_limit" and "eval_loss" in hist[-1]
  assert sorted(int(p.name) for p in (tmp_path / "cut" / "checkpoints").iterdir()
                if p.name.isdigit()) == [1]
  ran = []
  resumed, hist2 = train(make_head(d, v), toy_loss, ds,
                         dataclasses.replace(RUN_CFG, time_limit=3600.0), tmp_path / "cut",
                         frozen=tiny_target.params, resume=True, progress=False,
                         on_step=lambda step, record: ran.append(step))
  assert ran == list(range(2, RUN_CFG.steps + 1))  # from the checkpoint, not from scratch
  assert [h["step"] for h in hist2] == list(range(1, RUN_CFG.steps + 1))
  assert "stopped" not in hist2[-1]
  jax.tree.map(np.testing.assert_array_equal, _params(whole), _params(resumed))
  for bad in (0, -1.0, float("nan"), float("inf"), True, "10"):
    with pytest.raises(ValueError, match="time_limit is seconds > 0"):
      dataclasses.replace(RUN_CFG, time_limit=bad)
