"""Saving and loading heads: `save_head` writes config.json and head.safetensors (the target's
architecture and a fingerprint of its weights recorded), `load_head` reads one back as a
`Drafter` after checking it was trained for this target; the bundled heads live in
jaxspec/assets/heads/."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.checks import is_int
from jaxspec.heads.common import F32, target_dims
from jaxspec.heads.registry import HEADS, head_kind
from jaxspec.models.config import LlamaConfig
from jaxspec.models.errors import CheckpointError, read_json
from jaxspec.models.llama import Params, is_scanned, lm_head_weight


_FORMAT = "jaxspec-head"
_WEIGHTS = "head.safetensors"
ASSETS = Path(__file__).resolve().parents[1] / "assets" / "heads"  # jaxspec/assets/heads


def target_fingerprint(target, cfg: LlamaConfig | None = None) -> str:
  """The one fingerprint of a target's weights, recorded by saved heads and stored datasets.

  A short hash of the target's shapes and a few of its weights, rounded to bfloat16 so that a
  float32 and a bfloat16 load of one checkpoint agree (a head or data made with one serves the
  other).

  Args:
    target: a `Model`, or its `Params` when `cfg` is given.
    cfg: the target's `LlamaConfig` (with `Params` as `target`).
  """
  import ml_dtypes
  params, cfg = (target.params, target.cfg) if cfg is None else (target, cfg)
  h = hashlib.sha256(json.dumps([cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads,
                                 cfg.num_kv_heads, cfg.head_dim]).encode())
  d = min(cfg.hidden_size, 64)
  parts = [params.embed[:16, :d], lm_head_weight(params)[:d, -16:], params.final_norm[:d]]
  if params.layers is not None:  # the last layer's down projection, in either layer layout
    layers = params.layers
    last = layers.w_down[-1] if is_scanned(params) else layers[-1].w_down
    parts.append(last[:16, :d])
  for p in parts:
    h.update(np.asarray(jnp.asarray(p, F32)).astype(ml_dtypes.bfloat16).tobytes())
  return h.hexdigest()[:16]


def _leaf_name(path) -> str:
  keys = []
  for k in path:
    if isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value":
      continue
    keys.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
  return ".".join(keys)


def head_tensors(model: nnx.Module) -> dict[str, jax.Array]:
  """The module's arrays by dotted name (what `save_head` writes)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(nnx.state(model))
  return {_leaf_name(p): x for p, x in leaves}


def _config_dict(cfg) -> dict[str, Any]:
  out = dataclasses.asdict(cfg)
  return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


# Target fields that change its hidden states; a head records them and is refused by a target
# that differs in any.
_TARGET_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rope_scaling",
                  "rms_norm_eps", "tie_embeddings", "attention_bias", "sliding_window")


def _target_record(cfg: LlamaConfig) -> dict[str, Any]:
  out = {}
  for name in _TARGET_FIELDS:
    value = getattr(cfg, name)
    out[name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
  return out


def save_head(directory: str | os.PathLike, kind: str, model: nnx.Module,
              target_cfg, meta: Mapping[str, Any] | None = None,
              dtype: str = "bfloat16", *, target_params: Params | None = None) -> Path:
  """Writes `config.json` and `head.safetensors` to `directory` (created if needed).

  Args:
    kind: the registry key ("medusa", "mlp", "eagle").
    model: the head module.
    target_cfg: the target's `LlamaConfig`, or the target `Model` (then its weights are
      fingerprinted too). Its architecture fields are recorded and checked at load.
    meta: free-form JSON-able information (training data, steps, offline tau, ...).
    dtype: "bfloat16", "float16" or "float32" for floating weights (integer buffers are kept).
    target_params: the target's weights, when `target_cfg` is a config: their fingerprint is
      recorded so that a head loaded onto another target of the same shapes is refused.
  """
  from jaxspec.models.hf_loader import SAVE_DTYPES, write_safetensors
  if not isinstance(target_cfg, LlamaConfig):  # a Model
    target_params = target_cfg.params if target_params is None else target_params
    target_cfg = target_cfg.cfg
  if kind not in HEADS:
    raise ValueError(f"unknown head kind {kind!r}; known: {sorted(HEADS)}")
  if head_kind(model) != kind:
    raise ValueError(f"the module is a {head_kind(model)} head, not {kind!r}")
  if dtype not in SAVE_DTYPES:
    raise ValueError(f"dtype {dtype!r} is not one of {sorted(SAVE_DTYPES)}")
  if target_dims(target_cfg) != model.target_dims:
    raise ValueError(f"the head was built for a target with (hidden, vocab, layers) ="
                     f" {model.target_dims}, but target_cfg has {target_dims(target_cfg)}")
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  np_dtype = SAVE_DTYPES[dtype][1]
  tensors = {}
  for name, x in head_tensors(model).items():
    a = np.asarray(x)
    tensors[name] = a.astype(np_dtype) if np.issubdtype(a.dtype, np.floating) else a
  write_safetensors(directory / _WEIGHTS, tensors, metadata={"format": _FORMAT})
  config = {
      "format": _FORMAT, "format_version": 1, "kind": kind,
      "head_config": _config_dict(model.cfg),
      "target": dict(_target_record(target_cfg), num_layers=target_cfg.num_layers,
                     fingerprint=(None if target_params is None
                                  else target_fingerprint(target_params, target_cfg))),
      "dtype": dtype, "meta": dict(meta or {}),
  }
  (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
  return directory


def resolve_head_path(dir_or_name: str | os.PathLike) -> Path:
  """A directory, or a bundled head's name ("eagle", "medusa", "mlp") under jaxspec/assets."""
  p = Path(dir_or_name)
  if p.is_dir():
    return p
  name = str(dir_or_name)
  if name in HEADS and os.sep not in name:
    bundled = ASSETS / name
    if (bundled / "config.json").exists():
      return bundled
    raise CheckpointError(
        f"no bundled {name!r} head at {bundled}: train one for your target with jaxspec's head"
        f" trainer (jaxspec.train) and save it with jaxspec.heads.save_head(<dir>, {name!r},"
        " ...), then pass that directory")
  raise CheckpointError(f"head directory {p} does not exist (pass a directory written by"
                        f" jaxspec.heads.save_head, or one of {sorted(HEADS)})")


def is_head_dir(path: str | os.PathLike) -> bool:
  """Whether `path` holds a config.json written by `save_head` (by its "format" field)."""
  try:
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return False
  return isinstance(config, dict) and config.get("format") == _FORMAT


def bundled_head_for(target, kinds: Sequence[str] = ("eagle", "medusa", "mlp")) -> str | None:
  """The first of `kinds` bundled under jaxspec/assets/heads/ that was trained for `target`
  (same shapes and fingerprint), or None."""
  for kind in kinds:
    path = ASSETS / kind
    if not (path / "config.json").is_file():
      continue
    try:
      check_target(_read_config(path), target, str(path))
    except CheckpointError:
      continue
    return kind
  return None


def _read_config(path: Path) -> dict[str, Any]:
  cfg_path = path / "config.json"
  if not cfg_path.exists():
    raise CheckpointError(f"{cfg_path} is missing: {path} is not a head written by"
                          " jaxspec.heads.save_head")
  config = read_json(cfg_path)
  if config.get("format") != _FORMAT:
    raise CheckpointError(f"{cfg_path} is not a jaxspec head config (no \"format\":"
                          f" \"{_FORMAT}\"); Medusa or speculators checkpoints load with"
                          " jaxspec.train.export.import_medusa / import_eagle3")
  if config.get("kind") not in HEADS:
    raise CheckpointError(f"{cfg_path}: unknown head kind {config.get('kind')!r}; known:"
                          f" {sorted(HEADS)}")
  return config


def check_target(config: Mapping[str, Any], target, where: str,
                 check_fingerprint: bool = True) -> None:
  """Raises CheckpointError when the head's recorded target differs from `target`."""
  rec = config.get("target") or {}
  mine = dict(zip(("hidden_size", "vocab_size", "num_layers"), target_dims(target.cfg)))
  # Compared as JSON stores them (tuples as lists); a recorded rope scaling is compared on the
  # fields it records (records written before a field existed stay valid).
  mine.update({k: json.loads(json.dumps(v)) for k, v in _target_record(target.cfg).items()
               if k in rec})
  for key, value in mine.items():
    if isinstance(value, dict) and isinstance(rec.get(key), dict):
      value = {k: value.get(k) for k in rec[key]}
    if rec.get(key) != value:
      raise CheckpointError(
          f"{where} was trained for a target with {key}={rec.get(key)}, but this target"
          f" ({getattr(target, 'name', 'model')}) has {key}={value}: a head only works with the"
          " target it was trained on; load that target or train a head for this one")
  fp = rec.get("fingerprint")
  if check_fingerprint and not isinstance(fp, str):
    raise CheckpointError(
        f"{where} records no fingerprint of the target it was trained for ({fp!r}), so it"
        " cannot be checked against this target: save it with jaxspec.heads.save_head(...,"
        " target_params=<the target's weights>) or the target Model, or pass"
        " check_fingerprint=False to load it anyway (outputs stay exact; a head trained for"
        " another target only accepts less)")
  if check_fingerprint:
    mine_fp = target_fingerprint(target.params, target.cfg)
    if fp != mine_fp:
      raise CheckpointError(
          f"{where} was trained for another target of the same shapes (fingerprint {fp}, this"
          f" target's is {mine_fp}): load the target it was trained on or train a head for this"
          " one (check_fingerprint=False loads it anyway; outputs stay exact, acceptance drops)")


def model_first(fn: str, target, dir_or_name):
  """(target, dir_or_name) of a call made model first, or of one in the order before issue 49
  (a directory or name first, the model second), which still works with a DeprecationWarning
  naming the new order."""
  if isinstance(target, (str, os.PathLike)) and not isinstance(dir_or_name, (str, os.PathLike)):
    warnings.warn(f"{fn}(dir_or_name, target) is deprecated: pass the model first,"
                  f" {fn}(target, dir_or_name), as resolve_drafter(target, name) does",
                  DeprecationWarning, stacklevel=3)
    return dir_or_name, target
  return target, dir_or_name


def load_head_model(target, dir_or_name: str | os.PathLike,
                    check_fingerprint: bool = True) -> tuple[str, nnx.Module, dict[str, Any]]:
  """Reads a saved head for `target` (model first, as `load_head`): (kind, module with float32
  weights, config dict); a malformed config.json or weights file comes out as a
  `CheckpointError` naming the file."""
  target, dir_or_name = model_first("load_head_model", target, dir_or_name)
  from jaxspec.models.errors import read_checkpoint
  return read_checkpoint(dir_or_name, _load_head_model, dir_or_name, target, check_fingerprint)


def _load_head_model(dir_or_name, target, check_fingerprint):
  from jaxspec.models.hf_loader import read_safetensors
  path = resolve_head_path(dir_or_name)
  config = _read_config(path)
  check_target(config, target, f"the head at {path}", check_fingerprint)
  kind = config["kind"]
  weights = path / _WEIGHTS
  if not weights.exists():
    raise CheckpointError(f"{weights} is missing: the head at {path} is incomplete; save it"
                          " again with jaxspec.heads.save_head")
  tensors = read_safetensors(weights)
  options = {k: tuple(v) if isinstance(v, list) else v
             for k, v in (config.get("head_config") or {}).items()}
  extra = {}
  if kind == "eagle" and options.get("version") == 3 and options.get("draft_vocab_size"):
    if "draft_ids" not in tensors:
      raise CheckpointError(f"{weights} has no draft_ids for its reduced draft vocabulary")
    extra["draft_vocab"] = np.asarray(tensors["draft_ids"])
  try:
    abstract = nnx.eval_shape(lambda: HEADS[kind].create(target.cfg, rngs=nnx.Rngs(0),
                                                         **options, **extra))
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{path / 'config.json'}: head_config does not build a {kind}"
                          f" head ({e})") from e
  return kind, fill_module(abstract, tensors, str(weights)), config


def fill_module(abstract: nnx.Module, tensors: Mapping[str, np.ndarray], where: str):
  """A module of `abstract`'s structure with its arrays taken from `tensors` by dotted name."""
  graphdef, state = nnx.split(abstract)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  new = []
  for p, leaf in leaves:
    name = _leaf_name(p)
    if name not in tensors:
      raise CheckpointError(f"{where} has no tensor {name!r}: it is corrupted or was written"
                            " by another version; save the head again")
    a = np.asarray(tensors[name])
    if tuple(a.shape) != tuple(leaf.shape):
      raise CheckpointError(f"{where}: tensor {name!r} has shape {a.shape}, expected"
                            f" {tuple(leaf.shape)}")
    new.append(jnp.asarray(a, leaf.dtype))
  return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, new))


def load_head(target, dir_or_name: str | os.PathLike, check_fingerprint: bool = True,
              tree=None):
  """The `Drafter` of a saved head for `target` (a `Model`).

  Args:
    target: the target `Model` the head was trained for (first, as in every public function;
      the order before issue 49, `load_head(dir_or_name, target)`, still works with a
      DeprecationWarning).
    dir_or_name: a directory written by `save_head`, or "eagle" / "medusa" / "mlp" for the head
      bundled under jaxspec/assets/heads/.
    check_fingerprint: refuse a head recorded for another target of the same shapes.
    tree: draft a tree each step (Medusa, EAGLE): a `jaxspec.decoding.tree.Tree`,
      `DynamicTree`, a list of paths, or a number of nodes (`jaxspec.decoding.tree.default_tree`).
  Raises:
    CheckpointError: missing or corrupted files, or a head trained for another target.
  """
  target, dir_or_name = model_first("load_head", target, dir_or_name)
  kind, model, config = load_head_model(target, dir_or_name, check_fingerprint)
  drafter = HEADS[kind].drafter(model, target)
  meta = config.get("meta") or {}
  acc = meta.get("topk_accuracy")
  if acc is not None:
    drafter = dataclasses.replace(drafter, topk_accuracy=tuple(map(tuple, acc)))
  # An EAGLE head trained on rows cropped to a window never attended further: it drafts over
  # that many pairs (EagleDrafter.context_window; `with_context_window(None)`: the whole context).
  if hasattr(drafter, "context_window") and is_int(meta.get("window"), numpy=False) \
      and meta["window"] > 0:
    drafter = drafter.with_context_window(int(meta["window"]))
  if tree is not None:
    from jaxspec.decoding.tree import default_tree
    if is_int(tree, numpy=False):
      tree = default_tree(drafter, tree)
    drafter = drafter.with_tree(tree)
  return drafter
