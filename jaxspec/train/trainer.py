"""Training of a Flax NNX module on batches, with checkpoints that resume exactly.

`train(model, loss_fn, data, cfg, out_dir)` fits any NNX module (a draft head, a small draft
model) by AdamW with linear warmup, cosine decay and global-norm clipping, or by the optax
optimizer passed as `optimizer=`. `data` is a `TrainData` (batch s a pure function of s) or
any iterable of batches; callbacks see every logged step, evaluation and checkpoint. The module
is split once into its graph definition, its `nnx.Param` state and the rest (RNG counters,
statistics); the jitted step is a pure function of (params, rest, optimizer state, batch, frozen) that
donates the first three, so parameters are updated in place. `frozen` is whatever the loss
reads but never trains, typically the target's `Params`.

Reproducible resume: with a `TrainData`, training batch `s` is a pure function of (data, seed,
s) (see `Dataset.batch_indices`), and a checkpoint holds params, rest and optimizer state at a
step, so a run restored from the checkpoint at step s performs the same updates, on the same batches, as
one that was never interrupted. Checkpoints are written by orbax's `CheckpointManager`, which
writes each step into a temporary directory and renames it only once complete: a run killed
mid-save leaves a temporary directory that `latest_step` never returns (the tests kill a run
inside a save and check exactly that).

Output directory:
  train_config.json   the `TrainConfig` of the run and whether the optimizer was built in or
                      given (resume refuses a different one)
  checkpoints/<step>/ orbax checkpoints, the last `keep_last_n` kept
  history.jsonl       one line per logged step: step, loss, lr, grad_norm, the loss's
                      metrics, and eval_* metrics on the held-out batches when evaluated
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from jaxspec.checks import check_int
from jaxspec.train.data import check_time_limit, make_progress

# loss_fn(model, batch, frozen) -> (scalar loss, {name: scalar metric})
LossFn = Callable[[nnx.Module, dict[str, jax.Array], Any], tuple[jax.Array, dict[str, jax.Array]]]


class TrainData(Protocol):
  """What `train` reads from its data (`jaxspec.train.data.Dataset` is one). A `signature()`
  method (optional) returns a JSON-able dict of what decides its batches; `train` stores it and
  refuses to resume on data whose signature changed (a corpus that grew, another window)."""

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
    time_limit: seconds this call may train (None: no limit). A step that ends past it is the
      call's last: evaluated, logged (its record has "stopped": "time_limit") and saved, so
      `resume=True` continues the schedule from there; the learning rate follows `steps`, not
      the limit.
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
  time_limit: float | None = None

  # Fields that change neither the updates nor the data order: free to differ on resume.
  _BOOKKEEPING = ("save_every", "keep_last_n", "eval_every", "eval_batches", "log_every",
                  "time_limit")

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
    # Python numbers only: the config is written to JSON.
    check_time_limit("TrainConfig.time_limit", self.time_limit, numpy=False)

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


def evaluate(eval_step, params, rest, batches: Iterable[dict[str, Any]], frozen,
             max_batches: int | None = None, put=None) -> dict[str, float]:
  """Metrics averaged over at most `max_batches` of `batches` ({} without any)."""
  sums: dict[str, float] = {}
  n = 0
  put = put or _device_batch
  for batch in batches:
    if max_batches is not None and n >= max_batches:
      break
    m = _host(eval_step(params, rest, put(batch), frozen))
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


def _write_atomic(path: Path, text: str) -> None:
  """Writes the file whole or not at all (a temporary file renamed over it)."""
  tmp = path.with_name(path.name + ".tmp")
  tmp.write_text(text, encoding="utf-8")
  os.replace(tmp, path)


def _read_history(path: Path, upto: int) -> list[dict[str, Any]]:
  """The history's records up to step `upto`. A last line cut short (the process killed while
  writing it, before that step's checkpoint) is dropped; any other unreadable line is a
  ValueError naming the file."""
  if not path.is_file():
    return []
  lines = [line for line in path.read_text(encoding="utf-8", errors="replace").splitlines()
           if line.strip()]
  rows = []
  for i, line in enumerate(lines):
    try:
      row = json.loads(line)
    except json.JSONDecodeError:
      row = None
    if not isinstance(row, dict) or not isinstance(row.get("step"), int):
      if i == len(lines) - 1:
        break
      raise ValueError(f"{path} line {i + 1} is not a history record: repair or delete the"
                       " file to resume (the checkpoints do not need it)") from None
    rows.append(row)
  return [r for r in rows if r["step"] <= upto]


def _data_signature(data) -> dict[str, Any] | None:
  """What decides a `TrainData`'s batches beside the seed (its rows, split, crop or packing),
  when it says (`signature()`): a resumed run must read the data it started with."""
  sig = getattr(data, "signature", None)
  return None if sig is None else json.loads(json.dumps(sig()))


def _check_resumable(out: Path, cfg: TrainConfig, own_optimizer: bool,
                     data_signature: dict[str, Any] | None = None) -> None:
  saved_file = out / "train_config.json"
  if not saved_file.is_file():
    return
  saved = json.loads(saved_file.read_text(encoding="utf-8"))
  before = saved.get("data")
  if before is not None and data_signature is not None and before != data_signature:
    what = ", ".join(f"{k} {before.get(k)!r} (now {data_signature.get(k)!r})"
                     for k in sorted(set(before) | set(data_signature))
                     if before.get(k) != data_signature.get(k))
    raise ValueError(f"{out} was trained on other data ({what}): its batches would differ from"
                     " the run's; resume with the data it started with, or train into a new"
                     " --out")
  now = dict(cfg.to_json(), optimizer="given" if own_optimizer else "built-in")
  diff = {k: (saved.get(k, "built-in" if k == "optimizer" else None), now[k]) for k in now
          if k not in TrainConfig._BOOKKEEPING
          and saved.get(k, "built-in" if k == "optimizer" else None) != now[k]}
  if diff:
    what = ", ".join(f"{k}={a!r} (now {b!r})" for k, (a, b) in diff.items())
    raise ValueError(f"{out} was trained with {what}: resume with the same settings, or train"
                     " into a new --out")


# ----------------------------------------------------------------------------------------------
# Data: the `TrainData` protocol (exact resume) or any iterable of batches.


def is_train_data(data: Any) -> bool:
  """Whether `data` implements `TrainData` (batch s is a pure function of s: exact resume)."""
  return all(callable(getattr(data, m, None))
             for m in ("steps_per_epoch", "train_batch", "eval_batches"))


def _train_stream(data, cfg: TrainConfig, start: int) -> Iterator[dict[str, Any]]:
  """Training batches from step `start` on.

  `TrainData` gives batch s directly. Any other iterable is read from its beginning and its
  first `start` batches are skipped, so a resumed run sees the batches an uninterrupted one
  would exactly when the iterable yields the same sequence again (a deterministic generator, a
  list); the data helper's streaming readers implement `TrainData` instead and seek.
  """
  if is_train_data(data):
    return (data.train_batch(step, cfg.batch_size, cfg.seed) for step in range(start, cfg.steps))
  if isinstance(data, Mapping) or not isinstance(data, Iterable):
    raise TypeError(f"data must be an iterable of batches (dicts of arrays) or implement"
                    f" TrainData (steps_per_epoch, train_batch, eval_batches); got"
                    f" {type(data).__name__}")
  it = iter(data)
  for _ in range(start):
    if next(it, None) is None:
      raise ValueError(f"the data ran out before step {start}, where the run resumes: pass"
                       " the same batches again (a resumed iterable is read from its"
                       " beginning and its first batches skipped)")
  return it


def _eval_source(data, eval_data, cfg: TrainConfig) -> Callable[[], Iterable] | None:
  if eval_data is not None:
    if callable(eval_data):
      return eval_data
    if iter(eval_data) is eval_data:  # a generator or iterator: readable once only
      raise TypeError("eval_data must be re-iterable (a list of batches) or a function that"
                      " returns a fresh iterable: a generator would be empty at the second"
                      " evaluation")
    return lambda: eval_data
  if is_train_data(data):
    return lambda: data.eval_batches(cfg.batch_size, cfg.eval_batches)
  return None


# ----------------------------------------------------------------------------------------------
# Callbacks.


class Callback(Protocol):
  """What `train` calls; every method is optional (define the ones you need).

  on_log(step, record)    after every logged step (`TrainConfig.log_every`, evaluated steps and
                          the last), once its metrics are on the host: the only host
                          synchronisation of a step.
  on_eval(step, record)   after an evaluation (record holds the eval_* metrics).
  on_save(step, path)     after a checkpoint is written (path: its directory).

  A plain function is called as `on_log`.
  """


def _callbacks(callbacks, on_step) -> dict[str, list[Callable]]:
  out: dict[str, list[Callable]] = {"on_log": [], "on_eval": [], "on_save": []}
  for cb in list(callbacks or ()) + ([on_step] if on_step is not None else []):
    hooks = [name for name in out if callable(getattr(cb, name, None))]
    if hooks:
      for name in hooks:
        out[name].append(getattr(cb, name))
    elif callable(cb):
      out["on_log"].append(cb)
    else:
      raise TypeError(f"callback {cb!r} is neither a function nor an object with on_log,"
                      " on_eval or on_save")
  return out


def train(model: nnx.Module, loss_fn: LossFn, data: TrainData | Iterable[dict[str, Any]],
          cfg: TrainConfig, out_dir: str | os.PathLike | None = None, *, frozen: Any = None,
          resume: bool = False, eval_fn: LossFn | None = None, progress: bool = True,
          on_step: Callable[[int, dict[str, Any]], None] | None = None,
          optimizer: optax.GradientTransformation | None = None,
          callbacks: Sequence[Callback | Callable] = (),
          eval_data: Iterable[dict[str, Any]] | Callable[[], Iterable] | None = None,
          put_batch: Callable[[dict[str, Any]], dict[str, jax.Array]] | None = None,
          mesh=None) -> tuple[nnx.Module, list[dict[str, Any]]]:
  """Trains `model` in place on `data`; checkpoints into `out_dir`; resumes when asked.

  Args:
    model: the NNX module to train; its `nnx.Param` variables are trained, everything else (RNG
      state, statistics) is carried along.
    loss_fn: `loss_fn(model, batch, frozen) -> (loss [], {name: metric []})`, traced under jit.
      `batch` is a dict of arrays.
    data: a `TrainData` (`Dataset`, the streaming readers: batch s is a pure function of s, so a
      resumed run is exact), or any iterable of batches (a generator, a list): one batch per
      step, `cfg.steps` in all (see `_train_stream` for resuming one).
    cfg: optimisation and checkpoint settings (`lr` and the rest of the optimiser's fields only
      build the default optimiser).
    out_dir: where checkpoints, train_config.json and history.jsonl go; None: none are written
      (and resume is impossible).
    frozen: a pytree the loss reads but does not train (the target's `Params`); not donated.
    resume: continue from the latest complete checkpoint in out_dir (from scratch if none).
    eval_fn: the held-out metric function, same signature as loss_fn; default loss_fn.
    progress: show a rich progress bar on stderr.
    on_step: called as on_step(step, record) after every logged step (as a callback's on_log).
    optimizer: your own optax transformation (default: `make_optimizer(cfg)`, clipping, AdamW
      and warmup-cosine). Its state is checkpointed and restored like the default one's.
    callbacks: functions (called on every logged step) or `Callback` objects.
    eval_data: held-out batches (a list, or a function returning a fresh iterable); default the
      data's own `eval_batches` for a `TrainData`, none for a plain iterable.
    put_batch: host batch -> device arrays (default `jnp.asarray` per array; on a mesh,
      `jaxspec.train.mesh.batch_placer`, rows over the data axis).
    mesh: a `jax.sharding.Mesh`: the module and optimizer state are replicated on it (and
      checkpoints restored so); place `frozen` and the batches yourself, or use `train_head`.
  Returns:
    (model with the trained weights, history: one dict per logged step).
  Raises:
    ValueError: out_dir already holds a run and resume is False, or holds one trained with
      different settings; a batch size the data cannot fill. All before anything compiles.
    TypeError: data that is neither a TrainData nor an iterable of batches.
    FloatingPointError: the loss of a logged step is not finite (the host reads the loss on
      logged steps only).
  """
  import orbax.checkpoint as ocp

  if resume and out_dir is None:
    raise ValueError("resume=True needs the out_dir of the run to continue")
  if is_train_data(data):
    data.steps_per_epoch(cfg.batch_size)  # raises on a batch size the data cannot fill
  elif isinstance(data, Mapping) or not isinstance(data, Iterable):
    _train_stream(data, cfg, 0)  # raises the TypeError
  hooks = _callbacks(callbacks, on_step)
  evals = _eval_source(data, eval_data, cfg)
  if mesh is not None and put_batch is None:
    from jaxspec.train.mesh import batch_placer
    put_batch = batch_placer(mesh)
  put = put_batch or _device_batch
  out = None if out_dir is None else Path(out_dir).absolute()
  if out is not None:
    ckpt_dir = out / "checkpoints"
    existing = ckpt_dir.is_dir() and any(p.name.isdigit() for p in ckpt_dir.iterdir())
    if existing and not resume:
      raise ValueError(f"{out} already holds checkpoints: pass resume=True (--resume) to"
                       " continue that run, or choose a new output directory")
    signature = _data_signature(data)
    if resume:
      _check_resumable(out, cfg, optimizer is not None, signature)
    out.mkdir(parents=True, exist_ok=True)
    saved = dict(cfg.to_json(), optimizer="given" if optimizer is not None else "built-in")
    if signature is not None:
      saved["data"] = signature
    _write_atomic(out / "train_config.json", json.dumps(saved, indent=2) + "\n")

  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  params, rest = _copy(params), _copy(rest)
  tx = make_optimizer(cfg) if optimizer is None else optimizer
  if mesh is not None:  # the head is replicated; XLA all-reduces its gradients
    from jaxspec.train.mesh import replicate
    params, rest = replicate(params, mesh), replicate(rest, mesh)
  opt_state = tx.init(params)
  if mesh is not None:
    opt_state = replicate(opt_state, mesh)
  # The learning rate is known for the built-in schedule only (one compilation, not a dozen
  # eager ops per step); a given optimizer's is its own business.
  schedule = jax.jit(lr_schedule(cfg)) if optimizer is None else None
  mngr = None if out is None else _checkpoint_manager(ckpt_dir, cfg.keep_last_n)
  start = 0
  history: list[dict[str, Any]] = []
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
    hist = None
    if out is not None:
      history_file = out / "history.jsonl"
      history = _read_history(history_file, start)
      _write_atomic(history_file, "".join(json.dumps(r) + "\n" for r in history))
      hist = open(history_file, "a", encoding="utf-8")

    train_step, eval_step = _make_steps(graphdef, tx, loss_fn, eval_fn)
    batches = _train_stream(data, cfg, start)
    t0 = time.perf_counter()
    with make_progress(progress) as bar, (hist or contextlib.nullcontext()):
      task = bar.add_task("training", total=cfg.steps, completed=start, info="")
      for step in range(start, cfg.steps):
        batch = next(batches, None)
        if batch is None:
          raise ValueError(f"the data ran out after {step} batches, before steps={cfg.steps}:"
                           " pass more batches (or a generator that loops over epochs), or"
                           " lower steps")
        params, rest, opt_state, metrics = train_step(params, rest, opt_state, put(batch),
                                                      frozen)
        done = step + 1
        # Past the time limit this step is the last (timed after dispatch: the device may be
        # a few steps behind, so the call runs over by at most that much).
        timed_out = cfg.time_limit is not None and time.perf_counter() - t0 >= cfg.time_limit
        last = done == cfg.steps or timed_out
        evaluated = (cfg.eval_every and done % cfg.eval_every == 0) or last
        logged = evaluated or done % cfg.log_every == 0
        if logged:  # the host waits for the device only here
          lr = {} if schedule is None else {"lr": float(schedule(step))}
          record = dict(step=done, **lr, **_host(metrics))
          if timed_out and done < cfg.steps:
            record["stopped"] = "time_limit"
          if not math.isfinite(record["loss"]):
            raise FloatingPointError(f"loss became {record['loss']} at step {done}: lower --lr"
                                     " or check the data")
          if evaluated and evals is not None:
            record.update(evaluate(eval_step, params, rest, evals(), frozen,
                                   cfg.eval_batches, put))
          record["seconds"] = round(time.perf_counter() - t0, 3)
          history.append(record)
          if hist is not None:
            hist.write(json.dumps(record) + "\n")
            hist.flush()
          for fn in hooks["on_log"]:
            fn(done, record)
          if evaluated and evals is not None:
            for fn in hooks["on_eval"]:
              fn(done, record)
          info = f"loss {record['loss']:.4f}"
          if "eval_loss" in record:
            info += f"  eval {record['eval_loss']:.4f}"
          bar.update(task, completed=done, info=info)
        if mngr is not None and (done % cfg.save_every == 0 or last):
          if not logged and not math.isfinite(float(metrics["loss"])):  # never save NaN weights
            raise FloatingPointError(f"loss became {float(metrics['loss'])} at step {done}:"
                                     " lower --lr or check the data")
          mngr.save(done, force=True, args=ocp.args.Composite(
              state=ocp.args.StandardSave(dict(params=params, rest=rest, opt_state=opt_state)),
              meta=ocp.args.JsonSave({"step": done, "config": cfg.to_json()})))
          mngr.wait_until_finished()
          for fn in hooks["on_save"]:
            fn(done, ckpt_dir / str(done))
        if last:
          break
  finally:
    if mngr is not None:
      mngr.close()
  nnx.update(model, params, rest)
  return model, history
