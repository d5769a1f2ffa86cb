"""Training a draft head as one library call: `train_head(target, kind, data, ...)`.

What `jaxspec train {medusa,mlp,eagle}` and notebook 02 run, as a function of Python values:
create the head for the target, train it on any iterable of batches (or a `TrainData` for exact
resume) with the built-in or your own optax optimizer, the target's hidden states stored or
computed in the step (`jaxspec.train.online`), the loss of your choice (`heads.Objective`), your
callbacks, and optionally a device mesh. It returns a `TrainedHead`: the module, its history,
and the `Drafter` / saving helpers.

    import optax, jaxspec
    from jaxspec.train import train_head
    target = jaxspec.load()
    def batches():                                   # any iterable of dicts of arrays
      while True:
        yield {"tokens": ..., "loss_mask": ...}      # [B, T] each; hidden states computed online
    run = train_head(target, "eagle", batches(), steps=200, optimizer=optax.adamw(1e-3),
                     callbacks=[lambda step, rec: print(step, rec["loss"])])
    drafter = run.drafter(target)
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import optax
from flax import nnx

from jaxspec.heads import HEADS, Objective, head_loss, save_head, token_counts
from jaxspec.train.online import HIDDEN_MODES, with_hidden_states
from jaxspec.train.trainer import Callback, TrainConfig, TrainData, train

_STORED = ("hidden_final", "hidden_layers")


@dataclasses.dataclass(frozen=True)
class TrainedHead:
  """A head `train_head` trained.

  Attributes:
    kind: "medusa", "mlp" or "eagle".
    model: the trained NNX module (float32).
    options: the options it was created with (without the token counts of a draft vocabulary).
    history: one dict per logged step (loss, metrics, eval_* on evaluated steps).
  """

  kind: str
  model: nnx.Module
  options: Mapping[str, Any]
  history: list[dict[str, Any]]

  def drafter(self, target, tree=None):
    """The `Drafter` of the head for `target` (a tree: as `jaxspec.heads.load_head`'s)."""
    drafter = HEADS[self.kind].drafter(self.model, target)
    if tree is not None:
      from jaxspec.checks import is_int
      from jaxspec.decoding.tree import default_tree
      drafter = drafter.with_tree(default_tree(drafter, tree) if is_int(tree, numpy=False)
                                  else tree)
    return drafter

  def save(self, directory: str | os.PathLike, target, *, meta: Mapping[str, Any] | None = None,
           dtype: str = "bfloat16") -> Path:
    """`jaxspec.heads.save_head` of the head, recording the target's fingerprint."""
    meta = dict(meta or {})
    meta.setdefault("options", {k: v for k, v in self.options.items()})
    meta.setdefault("final", self.history[-1] if self.history else None)
    return save_head(directory, self.kind, self.model, target.cfg, meta=meta, dtype=dtype,
                     target_params=target.params)


def _config(config: TrainConfig | None, settings: dict[str, Any]) -> TrainConfig:
  known = {f.name for f in dataclasses.fields(TrainConfig)}
  unknown = sorted(set(settings) - known)
  if unknown:  # a mistyped keyword would otherwise be TrainConfig's TypeError
    raise ValueError(f"unknown training settings {unknown}: train_head and distill take"
                     f" TrainConfig's fields as keywords ({', '.join(sorted(known))})")
  if config is not None:
    if settings:
      return dataclasses.replace(config, **settings)
    return config
  steps = settings.get("steps", TrainConfig.steps)
  settings.setdefault("warmup_steps", min(50, steps // 10))
  settings.setdefault("save_every", min(TrainConfig.save_every, steps))
  return TrainConfig(**settings)


def _with_vocab(kind: str, options: dict[str, Any], data, vocab_size: int) -> dict[str, Any]:
  """EAGLE-3's reduced draft vocabulary: the most frequent response tokens of a dataset."""
  if kind != "eagle" or not options.get("draft_vocab_size"):
    return options
  if options.get("token_counts") is not None or options.get("draft_vocab") is not None:
    return options
  rows = getattr(data, "train_indices", None)
  if rows is None or not hasattr(data, "tokens"):
    raise ValueError(f"draft_vocab_size={options['draft_vocab_size']} needs the draft"
                     " vocabulary, which a plain iterable of batches cannot give before"
                     " training: pass options token_counts=<[V] counts>"
                     " (jaxspec.heads.token_counts over your data) or draft_vocab=<target ids>")
  return dict(options, token_counts=token_counts(data.tokens[rows], data.loss_mask[rows],
                                                 vocab_size))


def train_head(target, kind: str, data: TrainData | Iterable[dict[str, Any]], *,
               options: Mapping[str, Any] | None = None, head: nnx.Module | None = None,
               config: TrainConfig | None = None,
               optimizer: optax.GradientTransformation | None = None,
               objective: Objective | None = None, hidden: str = "auto",
               out_dir: str | os.PathLike | None = None, resume: bool = False,
               callbacks: Sequence[Callback | Callable] = (),
               eval_data: Iterable[dict[str, Any]] | Callable[[], Iterable] | None = None,
               mesh=None, rules=None, seed: int | None = None, progress: bool = False,
               **settings) -> TrainedHead:
  """Creates a draft head for `target` and trains it; returns a `TrainedHead`.

  Args:
    target: the target `Model` (frozen: its weights are never trained).
    kind: "medusa", "mlp" or "eagle".
    data: any iterable of batches (dicts: `tokens` [B, T] int32, `loss_mask` [B, T], optional
      `hidden_final` [B, T, D] / `hidden_layers` [B, T, n, D], `loss_weights` [B, T]), one per
      step; or a `TrainData` (a `Dataset`, a streaming reader) for exact resume.
    options: the head's options (its config fields, e.g. version=3, ttt_steps=5,
      draft_vocab_size=4096); EAGLE-3's draft vocabulary is counted from a `Dataset`'s training
      rows when not given.
    head: a head module (of `kind`) to train instead of creating one; options are then
      ignored (the returned ones are its config's).
    config: optimisation and bookkeeping settings; or give its fields as keywords (steps=200,
      lr=1e-3, ...; warmup defaults to steps // 10, at most 50).
    optimizer: your own optax optimizer (default: clipping + AdamW + warmup-cosine from config).
    objective: loss ("ce", "kl", "tv"), step weights and depth (`jaxspec.heads.Objective`).
    hidden: "online" (the target's forward runs in the step on the batch's tokens), "offline"
      (the batches hold stored hidden states) or "auto" (online for what a batch lacks).
    out_dir: checkpoints and history.jsonl (None: nothing written, no resume).
    resume: continue the run in out_dir.
    callbacks: functions `(step, record)` called on every logged step, or `Callback` objects.
    eval_data: held-out batches (a list, or a function returning a fresh iterable); default a
      `TrainData`'s own.
    mesh: a `jax.sharding.Mesh`: batches split over its data axis, the target's weights placed
      by `rules` (`jaxspec.sharding`), the head replicated (see `jaxspec.train.mesh`).
    rules: the sharding rules for the target (default `jaxspec.sharding.DEFAULT_RULES`).
    seed: the run's seed, as Hugging Face's Trainer takes it: the head's initialisation and a
      `TrainData`'s batch order (it replaces config.seed); default config.seed.
    progress: a rich progress bar on stderr.
  Returns:
    The `TrainedHead` (module, options, history).
  Raises:
    ValueError: unknown kind or options, settings the data cannot serve; before compiling.
  """
  if kind not in HEADS:
    raise ValueError(f"unknown head kind {kind!r}; known: {sorted(HEADS)}")
  if hidden not in HIDDEN_MODES:
    raise ValueError(f"hidden must be one of {HIDDEN_MODES}, got {hidden!r}")
  spec = HEADS[kind]
  cfg = _config(config, dict(settings))
  if seed is not None:
    cfg = dataclasses.replace(cfg, seed=seed)
  seed = cfg.seed
  opts = dict(options or {})
  if head is None:
    opts = _with_vocab(kind, opts, data, target.cfg.vocab_size)
    extra = {"target_params": target.params} if opts.get("lm_head_init") == "target" else {}
    model = spec.create(target.cfg, rngs=nnx.Rngs(seed), **opts, **extra)
  else:
    from jaxspec.heads import head_kind
    if head_kind(head) != kind:
      raise ValueError(f"head= is a {head_kind(head)} head, not {kind!r}")
    model, opts = head, dataclasses.asdict(head.cfg)
  layers = tuple(model.cfg.layers or ()) if kind == "eagle" else ()
  base = functools.partial(head_loss, spec, objective=objective)
  loss = with_hidden_states(base, target.cfg, layers, mode=hidden)
  # Online, stored states are not read: not even sent to the device.
  drop = _STORED if hidden == "online" else ()
  put, frozen = None, target.params
  if mesh is not None:
    from jaxspec.train.mesh import mesh_placement
    put, frozen = mesh_placement(mesh, target, rules, drop=drop)
  elif drop:
    put = lambda batch: {k: jnp.asarray(v) for k, v in batch.items() if k not in drop}
  if hasattr(data, "check_target") and hidden != "online":  # stored states: this target's
    offline = hidden == "offline"
    data.check_target(target, layers=layers if offline else (), hidden=offline)
    data = _reading_layers(data, layers)
  model, history = train(model, loss, data, cfg, out_dir, frozen=frozen, resume=resume,
                         progress=progress, optimizer=optimizer, callbacks=callbacks,
                         eval_data=eval_data, put_batch=put, mesh=mesh)
  saved = {k: v for k, v in opts.items() if k not in ("token_counts", "draft_vocab")}
  return TrainedHead(kind=kind, model=model, options=saved, history=history)


def _reading_layers(data, layers: tuple[int, ...]):
  """A stored dataset that hands the head its own layers, in its order: a `Dataset` opened
  without `layers=` gives every stored layer in stored order, which an EAGLE head's fc would
  read as other layers (or fail on their count). Stored without some of them (hidden="auto"):
  no stored layers, so the step computes them all. One opened with other layers is refused."""
  if not layers or not hasattr(data, "hidden_layers") or not hasattr(data, "layers"):
    return data
  if data.layers is not None:
    if tuple(data.layers) != layers:
      raise ValueError(f"the data was opened with layers={tuple(data.layers)} but the head reads"
                       f" target layers {layers}: open it with layers={layers} (or without"
                       " layers=)")
    return data
  stored = tuple(data.hidden_layers)
  if stored == layers:
    return data
  view = copy.copy(data)  # shares the memory-mapped arrays
  view.layers = layers if set(layers) <= set(stored) else ()
  return view


__all__ = ["TrainedHead", "train_head"]
