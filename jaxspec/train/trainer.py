"""Training of a Flax NNX module on stored batches, with checkpoints that resume exactly.

`train(model, loss_fn, data, cfg, out_dir)` fits any NNX module (a draft head, a small draft
model) by AdamW with linear warmup, cosine decay and global-norm clipping. The module is split
once into its graph definition, its `nnx.Param` state and the rest (RNG counters, statistics);
the jitted step is a pure function of (params, rest, optimizer state, batch, frozen) that
donates the first three, so parameters are updated in place. `frozen` is whatever the loss
reads but never trains, typically the target's `Params`.

Reproducible resume: training batch `s` is a pure function of (data, seed, s) (see
`Dataset.batch_indices`), and a checkpoint holds params, rest and optimizer state at a step, so a
run restored from the checkpoint at step s performs the same updates, on the same batches, as
one that was never interrupted. Checkpoints are written by orbax's `CheckpointManager`, which
writes each step into a temporary directory and renames it only once complete: a run killed
mid-save leaves a temporary directory that `latest_step` never returns (the tests kill a run
inside a save and check exactly that).

Output directory:
  train_config.json   the `TrainConfig` of the run (resume refuses a different one)
  checkpoints/<step>/ orbax checkpoints, the last `keep_last_n` kept
  history.jsonl       one line per logged step: step, loss, lr, grad_norm, the loss's
                      metrics, and eval_* metrics on the held-out batches when evaluated
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxspec.checks import check_int
from jaxspec.train.data import make_progress

# loss_fn(model, batch, frozen) -> (scalar loss, {name: scalar metric})
LossFn = Callable[[nnx.Module, dict[str, jax.Array], Any], tuple[jax.Array, dict[str, jax.Array]]]


class TrainData(Protocol):
  """What `train` reads from its data (`jaxspec.train.data.Dataset` is one)."""

  def steps_per_epoch(self, batch_size: int) -> int: ...

  def train_batch(self, step: int, batch_size: int, seed: int) -> dict[str, np.ndarray]: ...

  def eval_batches(self, batch_size: int, max_batches: int | None = None,
                   ) -> Iterable[dict[str, np.ndarray]]: ...


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainConfig:
  """Optimisation and bookkeeping settings of `train`.

  Attributes:
    steps: optimizer updates in total.
    batch_size: rows per update.
    lr: peak learning rate (reached after `warmup_steps`, then cosine decay to
      lr * min_lr_ratio at `steps`).
    warmup_steps: linear warmup updates.
    min_lr_ratio: final learning rate as a fraction of `lr`.
    weight_decay: AdamW decoupled weight decay on matrices (parameters of rank >= 2).
    b1, b2: Adam moment decay rates.
    clip_norm: global gradient norm clip (0 = off).
    seed: data-order seed.
    save_every: checkpoint every this many steps (and at the end).
    keep_last_n: checkpoints kept on disk.
    eval_every: held-out evaluation every this many steps (and at the end); 0 = only at the end.
    eval_batches: at most this many held-out batches per evaluation.
    log_every: write a history line every this many steps (evaluated steps always).
  """

  steps: int = 1000
  batch_size: int = 8
  lr: float = 1e-3
  warmup_steps: int = 50
  min_lr_ratio: float = 0.1
  weight_decay: float = 0.01
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float = 1.0
  seed: int = 0
  save_every: int = 100
  keep_last_n: int = 2
  eval_every: int = 100
  eval_batches: int = 8
  log_every: int = 1

  # Fields that change neither the updates nor the data order: free to differ on resume.
  _BOOKKEEPING = ("save_every", "keep_last_n", "eval_every", "eval_batches", "log_every")

  def __post_init__(self):
    ints = dict(steps=1, batch_size=1, warmup_steps=0, save_every=1, keep_last_n=1,
                eval_every=0, eval_batches=1, log_every=1, seed=0)
    for name, lo in ints.items():  # Python ints: the config is written to JSON
      check_int(f"TrainConfig.{name}", getattr(self, name), lo, numpy=False)
    if not self.lr > 0 or not math.isfinite(self.lr):
      raise ValueError(f"TrainConfig.lr must be a positive number, got {self.lr!r}")
    if self.warmup_steps >= self.steps:
      raise ValueError(f"warmup_steps {self.warmup_steps} must be below steps {self.steps}:"
                       " lower --warmup or raise --steps")
    if not 0 <= self.min_lr_ratio <= 1 or self.weight_decay < 0 or self.clip_norm < 0:
      raise ValueError("min_lr_ratio must be in [0, 1]; weight_decay and clip_norm >= 0")

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def lr_schedule(cfg: TrainConfig) -> optax.Schedule:
  """Linear warmup from lr / (warmup + 1) to lr, then cosine decay to lr * min_lr_ratio."""
  return optax.warmup_cosine_decay_schedule(
      init_value=cfg.lr / (cfg.warmup_steps + 1), peak_value=cfg.lr,
      warmup_steps=cfg.warmup_steps, decay_steps=cfg.steps, end_value=cfg.lr * cfg.min_lr_ratio)


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
  """Global-norm clipping, then AdamW (weight decay on rank >= 2 parameters only)."""
  decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)
  adamw = optax.adamw(lr_schedule(cfg), b1=cfg.b1, b2=cfg.b2, weight_decay=cfg.weight_decay,
                      mask=decay_mask)
  if cfg.clip_norm > 0:
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)
  return adamw


def _make_steps(graphdef, tx, loss_fn: LossFn, eval_fn: LossFn | None):
  """The jitted train step (params, rest and optimizer state donated) and eval step."""

  def train_step(params, rest, opt_state, batch, frozen):
    def objective(p):
      model = nnx.merge(graphdef, p, rest, copy=True)
      loss, metrics = loss_fn(model, batch, frozen)
      # RNG counters (dropout) advance inside the loss: carry them to the next step.
      return loss, (metrics, nnx.state(model, nnx.Not(nnx.Param)))

    (loss, (metrics, rest)), grads = jax.value_and_grad(objective, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    metrics = dict(metrics, loss=loss, grad_norm=optax.tree.norm(grads))
    return params, rest, opt_state, metrics

  def eval_step(params, rest, batch, frozen):
    model = nnx.merge(graphdef, params, rest, copy=True)
    model.eval()  # dropout off, running statistics on (a copy: the trained module is untouched)
    loss, metrics = (eval_fn or loss_fn)(model, batch, frozen)
    return dict(metrics, loss=loss)

  return jax.jit(train_step, donate_argnums=(0, 1, 2)), jax.jit(eval_step)


def _host(metrics: dict[str, Any]) -> dict[str, float]:
  return {k: float(v) for k, v in jax.device_get(metrics).items()}


def evaluate(eval_step, params, rest, data: TrainData, cfg: TrainConfig, frozen,
             ) -> dict[str, float]:
  """Metrics averaged over at most `cfg.eval_batches` held-out batches ({} without any)."""
  sums: dict[str, float] = {}
  n = 0
  for batch in data.eval_batches(cfg.batch_size, cfg.eval_batches):
    m = _host(eval_step(params, rest, _device_batch(batch), frozen))
    for k, v in m.items():
      sums[k] = sums.get(k, 0.0) + v
    n += 1
  return {f"eval_{k}": v / n for k, v in sums.items()} if n else {}


def _device_batch(batch: dict[str, Any]) -> dict[str, jax.Array]:
  return {k: jnp.asarray(v) for k, v in batch.items()}


def _copy(tree):
  """Fresh buffers, so donating them leaves the caller's module intact."""
  return jax.tree.map(lambda x: x.copy() if isinstance(x, jax.Array) else x, tree)


def _checkpoint_manager(path: Path, keep: int):
  import orbax.checkpoint as ocp
  options = ocp.CheckpointManagerOptions(
      max_to_keep=keep, create=True, enable_async_checkpointing=False,
      cleanup_tmp_directories=True)
  return ocp.CheckpointManager(path, options=options)


def _read_history(path: Path, upto: int) -> list[dict[str, Any]]:
  if not path.is_file():
    return []
  rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()
          if line.strip()]
  return [r for r in rows if r["step"] <= upto]


def _check_resumable(out: Path, cfg: TrainConfig) -> None:
  saved_file = out / "train_config.json"
  if not saved_file.is_file():
    return
  saved = json.loads(saved_file.read_text(encoding="utf-8"))
  now = cfg.to_json()
  diff = {k: (saved.get(k), now[k]) for k in now
          if k not in TrainConfig._BOOKKEEPING and saved.get(k) != now[k]}
  if diff:
    what = ", ".join(f"{k}={a!r} (now {b!r})" for k, (a, b) in diff.items())
    raise ValueError(f"{out} was trained with {what}: resume with the same settings, or train"
                     " into a new --out")


def train(model: nnx.Module, loss_fn: LossFn, data: TrainData, cfg: TrainConfig,
          out_dir: str | os.PathLike, *, frozen: Any = None, resume: bool = False,
          eval_fn: LossFn | None = None, progress: bool = True,
          on_step: Callable[[int, dict[str, Any]], None] | None = None,
          ) -> tuple[nnx.Module, list[dict[str, Any]]]:
  """Trains `model` in place on `data`; checkpoints into `out_dir`; resumes when asked.

  Args:
    model: the NNX module to train; its `nnx.Param` variables are trained, everything else (RNG
      state, statistics) is carried along.
    loss_fn: `loss_fn(model, batch, frozen) -> (loss [], {name: metric []})`, traced under jit.
      `batch` is a dict of arrays from `data.train_batch`.
    data: a `Dataset` (or anything with its `steps_per_epoch`, `train_batch`, `eval_batches`).
    cfg: optimisation and checkpoint settings.
    out_dir: where checkpoints, train_config.json and history.jsonl go.
    frozen: a pytree the loss reads but does not train (the target's `Params`); not donated.
    resume: continue from the latest complete checkpoint in out_dir (from scratch if none).
    eval_fn: the held-out metric function, same signature as loss_fn; default loss_fn.
    progress: show a rich progress bar on stderr.
    on_step: called as on_step(step, record) after every step, once its checkpoint (if any) is
      written; `step` counts completed updates.
  Returns:
    (model with the trained weights, history: one dict per logged step).
  Raises:
    ValueError: out_dir already holds a run and resume is False, or holds one trained with
      different settings; a batch size the data cannot fill. All before anything compiles.
  """
  import orbax.checkpoint as ocp

  out = Path(out_dir).absolute()
  ckpt_dir = out / "checkpoints"
  data.steps_per_epoch(cfg.batch_size)  # raises on a batch size the data cannot fill
  existing = ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())
  if existing and not resume:
    raise ValueError(f"{out} already holds checkpoints: pass resume=True (--resume) to continue"
                     " that run, or choose a new output directory")
  if resume:
    _check_resumable(out, cfg)
  out.mkdir(parents=True, exist_ok=True)
  (out / "train_config.json").write_text(json.dumps(cfg.to_json(), indent=2) + "\n",
                                         encoding="utf-8")

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = _copy(params), _copy(rest)
  tx = make_optimizer(cfg)
  opt_state = tx.init(params)
  schedule = jax.jit(lr_schedule(cfg))  # one compilation, not a dozen eager ops per step
  mngr = _checkpoint_manager(ckpt_dir, cfg.keep_last_n)
  start = 0
  try:
    if resume and mngr.latest_step() is not None:
      start = int(mngr.latest_step())
      state = dict(params=params, rest=rest, opt_state=opt_state)
      abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state)
      restored = mngr.restore(start, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
      if restored.meta["step"] != start:
        raise ValueError(f"checkpoint {ckpt_dir / str(start)} says step"
                         f" {restored.meta['step']}: it is corrupt; delete it to resume from an"
                         " earlier one")
      params, rest, opt_state = (restored.state[k] for k in ("params", "rest", "opt_state"))
      if start > cfg.steps:
        raise ValueError(f"{out} holds a checkpoint at step {start}, past steps={cfg.steps}")
    history_file = out / "history.jsonl"
    history = _read_history(history_file, start)
    history_file.write_text("".join(json.dumps(r) + "\n" for r in history), encoding="utf-8")

    train_step, eval_step = _make_steps(graphdef, tx, loss_fn, eval_fn)
    t0 = time.perf_counter()
    with make_progress(progress) as bar, open(history_file, "a", encoding="utf-8") as hist:
      task = bar.add_task("training", total=cfg.steps, completed=start, info="")
      for step in range(start, cfg.steps):
        batch = _device_batch(data.train_batch(step, cfg.batch_size, cfg.seed))
        params, rest, opt_state, metrics = train_step(params, rest, opt_state, batch, frozen)
        done = step + 1
        record = dict(step=done, lr=float(schedule(step)), **_host(metrics))
        if not math.isfinite(record["loss"]):
          raise FloatingPointError(f"loss became {record['loss']} at step {done}: lower --lr"
                                   " or check the data")
        evaluated = (cfg.eval_every and done % cfg.eval_every == 0) or done == cfg.steps
        if evaluated:
          record.update(evaluate(eval_step, params, rest, data, cfg, frozen))
        record["seconds"] = round(time.perf_counter() - t0, 3)
        if evaluated or done % cfg.log_every == 0:
          history.append(record)
          hist.write(json.dumps(record) + "\n")
          hist.flush()
        if done % cfg.save_every == 0 or done == cfg.steps:
          mngr.save(done, force=True, args=ocp.args.Composite(
              state=ocp.args.StandardSave(dict(params=params, rest=rest, opt_state=opt_state)),
              meta=ocp.args.JsonSave({"step": done, "config": cfg.to_json()})))
          mngr.wait_until_finished()
        info = f"loss {record['loss']:.4f}"
        if "eval_loss" in record:
          info += f"  eval {record['eval_loss']:.4f}"
        bar.update(task, completed=done, info=info)
        if on_step is not None:
          on_step(done, record)
  finally:
    mngr.close()
  nnx.update(model, params, rest)
  return model, history
