"""A small draft model cut from the target and distilled on the target's own responses.

The draft starts as the target's embedding, first `num_layers` decoder layers, final norm and LM
head: it already shares the tokenizer and speaks the same hidden-state language, so a short
fine-tune closes much of the gap. Training minimises KL(p_target || q_draft) at every position
that predicts a response token, with the target's distribution recomputed from `hidden_final`
(`logits_from_hidden(target_params, hidden_final)`), stored in the data or computed in the step
by the target's forward (`jaxspec.train.online`).

The result is saved with `save_hf` in Hugging Face layout, so `jaxspec.load(path)` gives a
`Model` for `DraftModel`, and `transformers` can load it as an assistant model for assisted
generation (same tokenizer files as the target).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxspec.checks import check_int
from jaxspec.heads.common import packed_attention_mask, same_segment_ahead, shift
from jaxspec.models.config import LlamaConfig
from jaxspec.models.llama import (LayerParams, Params, forward, init_cache, is_scanned,
                                  logits_from_hidden, softcap, stacked_layers)
from jaxspec.models.model import Model
from jaxspec.train.data import Dataset
from jaxspec.train.pard import PardObjective, pard_loss
from jaxspec.train.trainer import Callback, TrainConfig, train

_LAYER_FIELDS = [f.name for f in dataclasses.fields(LayerParams)]


def draft_from_target(target: Model, num_layers: int = 4) -> Model:
  """The target's embedding, first `num_layers` layers, final norm and LM head as a model.

  Raises:
    ValueError: num_layers is not in [1, target layers).
  """
  n = target.cfg.num_layers
  check_int("num_layers", num_layers, 1, n - 1, numpy=False,
            why=f"a draft keeps 1 to {n - 1} of the target's {n} layers: pass --num-layers in"
                " that range")
  cfg, kinds = target.cfg, target.cfg.layer_types
  if kinds is None:
    cfg = dataclasses.replace(cfg, num_layers=num_layers)
  else:  # the kept layers' windows; uniform ones collapse
    kinds = kinds[:num_layers]
    if "full" not in kinds:
      cfg = dataclasses.replace(cfg, num_layers=num_layers, layer_types=None)
    elif "sliding" not in kinds:
      cfg = dataclasses.replace(cfg, num_layers=num_layers, layer_types=None,
                                sliding_window=None, sliding_rope_theta=None)
    else:
      cfg = dataclasses.replace(cfg, num_layers=num_layers, layer_types=kinds)
  p = target.params
  if is_scanned(p):
    layers = jax.tree.map(lambda x: jnp.array(x[:num_layers]), p.layers)
  else:  # stack only the layers the draft keeps
    layers = stacked_layers(dataclasses.replace(p, layers=p.layers[:num_layers]))
  params = Params(embed=jnp.array(p.embed), layers=layers, final_norm=jnp.array(p.final_norm),
                  lm_head=None if p.lm_head is None else jnp.array(p.lm_head))
  return Model(cfg, params, tokenizer=target.tokenizer,
               name=f"{target.name}-draft-{num_layers}l")


class DraftLM(nnx.Module):
  """A Llama-family model's `Params` held as `nnx.Param`s, so the NNX trainer can fit it.

  `params()` rebuilds the pure `Params` pytree, and every computation goes through the same
  `jaxspec.models.llama.forward` that decoding uses.
  """

  def __init__(self, cfg: LlamaConfig, params: Params):
    self.cfg = cfg
    self.embed = nnx.Param(params.embed)  # [V, D]
    self.final_norm = nnx.Param(params.final_norm)  # [D]
    self.lm_head = None if params.lm_head is None else nnx.Param(params.lm_head)  # [D, V]
    for name in _LAYER_FIELDS:
      value = getattr(params.layers, name)  # [L, ...]
      setattr(self, f"layer_{name}", None if value is None else nnx.Param(value))

  def params(self) -> Params:
    """The weights as a `Params` pytree."""
    value = lambda v: None if v is None else v[...]
    layers = LayerParams(**{n: value(getattr(self, f"layer_{n}")) for n in _LAYER_FIELDS})
    return Params(embed=self.embed[...], layers=layers, final_norm=self.final_norm[...],
                  lm_head=value(self.lm_head))


def response_positions(loss_mask: jax.Array, r: int, segment_ids: jax.Array | None = None
                       ) -> tuple[jax.Array, jax.Array]:
  """The first r positions of each row whose next token is a response token (of every answer
  of a multi-turn row, and in the same conversation of a packed row).

  Args:
    loss_mask: [B, T] 1 on response tokens.
    r: positions per row (at most T; the responses' tokens per row).
    segment_ids: [B, T] conversations of packed rows (optional).
  Returns:
    (idx [B, r] int32 positions t, valid [B, r] float32: loss_mask[t + 1] == 1, t + 1 in t's
    conversation; the invalid entries, past a row's response positions, are other positions).
  """
  t = loss_mask.shape[1]
  r = min(r, t)
  ok = shift(loss_mask > 0, 1, False)  # [B, T]
  if segment_ids is not None:
    ok = ok & same_segment_ahead(segment_ids, 1)
  pos = jnp.arange(t)[None, :]
  _, idx = jax.lax.top_k(jnp.where(ok, t - pos, -pos), r)  # the valid first, earliest first
  valid = jnp.take_along_axis(ok, idx, axis=1)
  return idx.astype(jnp.int32), valid.astype(jnp.float32)


def distill_loss(model: DraftLM, batch: dict[str, jax.Array], frozen: Params, *,
                 positions: int) -> tuple[jax.Array, dict[str, jax.Array]]:
  """KL(target || draft) over the next-token distributions at response positions.

  Only `positions` positions per row (from the last prompt token on) go through the two LM
  heads: the [B, r, V] logits dominate the cost, and prompt positions are not trained.

  Args:
    model: the draft.
    batch: tokens [B, T], loss_mask [B, T], hidden_final [B, T, D] (the target's).
    frozen: the target's `Params` (its LM head turns hidden_final into p).
    positions: r, positions per row (the dataset's max_new_tokens).
  Returns:
    (mean KL, metrics: kl, top1 agreement with the target, accuracy on the stored tokens).
  """
  cfg = model.cfg
  params = model.params()
  tokens = batch["tokens"]
  b, t = tokens.shape
  r = min(positions, t)
  seg = batch.get("segment_ids")  # packed rows: each conversation attends to itself only
  mask = None if seg is None else packed_attention_mask(seg)
  _, hidden, _ = forward(params, tokens, init_cache(cfg, b, t), cfg, logits=False, fresh=True,
                         block_mask=mask, positions=batch.get("positions"))
  idx, valid = response_positions(batch["loss_mask"], r, seg)
  take = lambda x: jnp.take_along_axis(x, idx[:, :, None], axis=1)
  # Both through the final soft-cap (Gemma 2), the distributions the models sample from.
  q_logits = softcap(logits_from_hidden(params, take(hidden.final)), cfg.final_softcap)
  p_logits = softcap(logits_from_hidden(frozen, take(batch["hidden_final"]).astype(
      frozen.final_norm.dtype)), cfg.final_softcap)  # [B, r, V] float32
  logp = jax.nn.log_softmax(p_logits, axis=-1)
  logq = jax.nn.log_softmax(q_logits, axis=-1)
  kl = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)  # [B, r]
  n = jnp.maximum(valid.sum(), 1.0)
  nxt = jnp.take_along_axis(tokens, jnp.clip(idx + 1, 0, t - 1), axis=1)
  q_top = jnp.argmax(q_logits, -1)
  agree = (q_top == jnp.argmax(p_logits, -1)).astype(jnp.float32)
  acc = (q_top == nxt).astype(jnp.float32)
  loss = jnp.sum(kl * valid) / n
  return loss, {"kl": loss, "top1_agreement": jnp.sum(agree * valid) / n,
                "token_accuracy": jnp.sum(acc * valid) / n}


def distill(target: Model, data, out_dir: str | os.PathLike, cfg: TrainConfig | None = None, *,
            num_layers: int = 4, resume: bool = False, save_dtype: str | None = None,
            progress: bool = True, optimizer: optax.GradientTransformation | None = None,
            callbacks: Sequence[Callback | Callable] = (), eval_data=None,
            hidden: str = "auto", positions: int | None = None, mesh=None, rules=None,
            objective: str | PardObjective = "kl", **settings
            ) -> tuple[Model, list[dict[str, Any]]]:
  """Cuts a draft from `target`, distills it on `data`, saves it in Hugging Face layout.

  Args:
    target: the target model.
    data: a `Dataset` written by the target, another `TrainData`, or any iterable of batches
      (`tokens`, `loss_mask`; `hidden_final` is computed in the step when a batch lacks it).
    out_dir: the Hugging Face model directory to write (config.json, model.safetensors and the
      tokenizer); training state goes to out_dir/training.
    cfg: training settings; or give its fields as keywords (steps=, lr=, ...).
    num_layers: target layers the draft keeps.
    resume: continue an interrupted run from out_dir/training.
    save_dtype: storage dtype of the saved weights (default the target's).
    progress: rich progress bars.
    optimizer: your own optax optimizer (default: `make_optimizer(cfg)`).
    callbacks: as `jaxspec.train.train`'s.
    eval_data: held-out batches (default a `TrainData`'s own).
    hidden: "online", "offline" or "auto" (`jaxspec.train.online.with_hidden_states`).
    positions: response positions per row the loss reads (default the dataset's
      max_new_tokens, else every position of a row).
    mesh, rules: train on a mesh (`jaxspec.train.mesh`); the draft is replicated.
    objective: "kl" (next-token distillation) or a `jaxspec.train.pard.PardObjective`: PARD's
      mask-token objective, for a draft that proposes k tokens in one pass (`ParallelDraft`);
      its config.json then names the mask token ("pard_token") and k ("pard_trained_k"), so
      `jaxspec.drafters.load_pard(out_dir)` loads it.
  Returns:
    (the distilled draft `Model`, training history).
  """
  from jaxspec.train.fit import _config
  from jaxspec.train.online import with_hidden_states
  cfg = _config(cfg, dict(settings))
  pard = isinstance(objective, PardObjective)
  if not pard and objective != "kl":
    raise ValueError(f"objective must be \"kl\" or a jaxspec.train.pard.PardObjective, got"
                     f" {objective!r}")
  if pard and objective.mask_id >= target.cfg.vocab_size:
    raise ValueError(f"PardObjective.mask_id {objective.mask_id} is outside the target's"
                     f" vocabulary of {target.cfg.vocab_size}: the mask must be one of its ids"
                     " (an unused special token)")
  if hasattr(data, "check_target") and hidden != "online":  # stored states: this target's
    data.check_target(target, hidden=hidden == "offline")
  draft = draft_from_target(target, num_layers)
  from jaxspec.models.hf_loader import check_savable
  check_savable(draft.cfg)  # the draft is saved as a Hugging Face checkpoint after training
  out = Path(out_dir)
  module = DraftLM(draft.cfg, draft.params)
  if positions is None:  # every answer's tokens: a multi-turn row holds `turns` of them
    turns = int(getattr(data, "meta", {}).get("generation", {}).get("turns", 1) or 1)
    positions = (getattr(data, "max_new_tokens", None) or 1 << 30) * turns
  if not pard:
    loss = with_hidden_states(functools.partial(distill_loss, positions=positions), target.cfg,
                              mode=hidden)
  elif objective.labels == "tokens":  # cross-entropy on the stored tokens: no target pass
    loss = functools.partial(pard_loss, objective=objective)
  else:
    loss = with_hidden_states(functools.partial(pard_loss, objective=objective), target.cfg,
                              mode=hidden)
  put, frozen = None, target.params
  drop = ("hidden_final", "hidden_layers") if hidden == "online" else ()
  if mesh is not None:
    from jaxspec.train.mesh import mesh_placement
    put, frozen = mesh_placement(mesh, target, rules, drop=drop)
  elif drop:
    put = lambda batch: {k: jnp.asarray(v) for k, v in batch.items() if k not in drop}
  module, history = train(module, loss, data, cfg, out / "training", frozen=frozen,
                          resume=resume, progress=progress, optimizer=optimizer,
                          callbacks=callbacks, eval_data=eval_data, put_batch=put, mesh=mesh)
  params = module.params()
  if mesh is not None:  # back from the mesh to the default device
    params = jax.tree.map(jnp.asarray, jax.device_get(params))
  draft = dataclasses.replace(draft, params=params).with_scan_layers(target.scan_layers)
  save_draft(draft, out, dtype=save_dtype, history=history,
             data=data if isinstance(data, Dataset) else None)
  if pard:
    from jaxspec.drafters.pard import MASK_KEY, TRAINED_K_KEY
    config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    config.update({MASK_KEY: objective.mask_id, TRAINED_K_KEY: objective.k})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
  return draft, history


def save_draft(draft: Model, out_dir: str | os.PathLike, *, dtype: str | None = None,
               history: list[dict[str, Any]] | None = None, data: Dataset | None = None) -> Path:
  """`save_hf` plus a jaxspec_draft.json note of how the draft was made."""
  from jaxspec.models.hf_loader import save_hf
  out = save_hf(draft, out_dir, dtype=dtype)
  note: dict[str, Any] = {"name": draft.name, "num_layers": draft.cfg.num_layers}
  if history:
    note["final"] = history[-1]
  if data is not None:
    note["data"] = {"path": str(data.path), "target": data.meta["target"]["name"],
                    "num_examples": len(data)}
  (out / "jaxspec_draft.json").write_text(json.dumps(note, indent=2) + "\n", encoding="utf-8")
  return out


__all__ = ["DraftLM", "distill", "distill_loss", "draft_from_target",
           "response_positions", "save_draft"]
