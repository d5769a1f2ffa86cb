"""Training a head and judging it offline, for every kind: the token loss (cross-entropy, or KL
to the target's distribution), EAGLE's feature loss, and the accepted-run lengths that greedy
verification would give (`chain_lengths`, `offline_chain_tau`)."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.heads.common import F32, same_segment_ahead, shift
from jaxspec.heads.eagle import EagleHead
from jaxspec.models.llama import Params, lm_head_weight, logits_from_hidden, softcap


def draft_ids(model) -> jax.Array | None:
  """Target ids of a reduced draft vocabulary, or None when the head predicts the full one."""
  if isinstance(model, EagleHead) and model.cfg.version == 3 and model.cfg.draft_vocab_size:
    return model.draft_ids[...]
  return None


def target_logits_over(frozen: Params, hidden: jax.Array, ids: jax.Array | None) -> jax.Array:
  """The target's float32 logits [..., V] from final hidden states [..., D], or only those of
  the vocabulary ids `ids` [N] -> [..., N] (equal to `logits_from_hidden(...)[..., ids]`)."""
  if ids is None:
    return logits_from_hidden(frozen, hidden)
  w = lm_head_weight(frozen)[:, ids]  # [D, N]: the head's columns of those ids (float32)
  return jnp.einsum("...d,dn->...n", hidden, w, preferred_element_type=F32)


LOSSES = ("ce", "kl", "tv")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Objective:
  """What a head's token loss is; None fields keep the head config's choice.

  loss: "ce" (cross-entropy to the data's next tokens), "kl" (forward KL(p_target || q_draft),
    the target's distribution from its final hidden state) or "tv" (total variation
    0.5 * sum |p - q|, which 1 - acceptance probability equals for one sampled draft);
    None: "kl" when the head's config says soft, else "ce".
  step_weights: the weight of draft step (depth) j's loss, one per step trained; None:
    loss_decay**j from the head's config.
  depth: draft steps trained (EAGLE: training-time-test steps; Medusa and MLP: at most their
    heads or stages); None: the head's own (`HeadSpec.num_steps`).
  Batches may also hold "loss_weights" [B, T]: a per-position weight multiplying the loss mask
  (position s weights the prediction of x_s).
  """

  loss: str | None = None
  step_weights: tuple[float, ...] | None = None
  depth: int | None = None

  def __post_init__(self):
    if self.loss is not None and self.loss not in LOSSES:
      raise ValueError(f"Objective.loss must be one of {LOSSES} (or None), got {self.loss!r}")
    if self.depth is not None and (not isinstance(self.depth, int) or self.depth < 1):
      raise ValueError(f"Objective.depth must be an int >= 1, got {self.depth!r}")
    if self.step_weights is not None:
      if self.depth is not None and len(self.step_weights) != self.depth:
        raise ValueError(f"{len(self.step_weights)} step_weights for depth {self.depth}: give"
                         " one weight per step")
      if any(not w >= 0 for w in self.step_weights):
        raise ValueError(f"step_weights must be >= 0, got {self.step_weights}")


def label_weights(batch, mask: jax.Array, d: int) -> jax.Array:
  """mask[t + d] at t (0 past the end), and 0 where t + d lies in another conversation of a packed
  row (`segment_ids`): the weight of a label d tokens ahead of position t."""
  w = shift(mask, d, 0)
  seg = batch.get("segment_ids")
  return w if seg is None else w * same_segment_ahead(seg, d).astype(w.dtype)


def _token_loss(model, logits, batch, frozen, soft: bool, decay: float, loss: str | None = None,
                step_weights: tuple[float, ...] | None = None):
  """Cross-entropy, forward KL or total variation of every step's predictions, step j weighted
  step_weights[j] (default decay**j).

  Args:
    logits: [B, T, S, N] float32; step j at t predicts x_{t+2+j}.
    loss: "ce", "kl" or "tv" (`Objective`); None: "kl" if soft else "ce".
  Returns:
    (loss, metrics with loss_j and acc_j, top-1 accuracy against the data's next tokens).
  """
  loss = loss or ("kl" if soft else "ce")
  soft = loss != "ce"
  if step_weights is not None and len(step_weights) != logits.shape[2]:
    raise ValueError(f"{len(step_weights)} step_weights for {logits.shape[2]} draft steps: give"
                     " one weight per step")
  tokens = batch["tokens"]
  mask = batch["loss_mask"].astype(F32)
  if "loss_weights" in batch:  # per-position weights [B, T]
    mask = mask * batch["loss_weights"].astype(F32)
  ids = draft_ids(model)
  v = model.target_dims[1]
  if soft:  # [B, T, V], or [B, T, N] over a draft vocabulary: the target's distribution
    # renormalised over it, from the head rows of those ids only (a 4096-token draft vocabulary
    # runs a twelfth of SmolLM2's 49k-row head on every training position)
    t_logits = target_logits_over(frozen, batch["hidden_final"].astype(F32), ids)
    # The distribution the target samples from: its logits soft-capped where it caps them.
    t_logits = softcap(t_logits, getattr(model, "target_softcap", None))
  if ids is not None:
    t2d = jnp.full((v,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
  total = jnp.zeros((), F32)
  metrics = {}
  for j in range(logits.shape[2]):
    y = shift(tokens, 2 + j)
    w = label_weights(batch, mask, 2 + j)
    logq = jax.nn.log_softmax(logits[:, :, j], axis=-1)
    if soft:
      logp = jax.nn.log_softmax(shift(t_logits, 1 + j), axis=-1)
      if loss == "kl":
        per = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
      else:  # total variation
        per = 0.5 * jnp.sum(jnp.abs(jnp.exp(logp) - jnp.exp(logq)), axis=-1)
      w_loss = w
    else:
      yd = y if ids is None else t2d[y]
      per = -jnp.take_along_axis(logq, jnp.maximum(yd, 0)[..., None], axis=-1)[..., 0]
      w_loss = w * (yd >= 0)  # a token outside the draft vocabulary cannot be learnt
    loss_j = jnp.sum(per * w_loss) / jnp.maximum(jnp.sum(w_loss), 1.0)
    pred = jnp.argmax(logits[:, :, j], axis=-1)
    if ids is not None:
      pred = ids[pred]
    acc_j = jnp.sum((pred == y) * w) / jnp.maximum(jnp.sum(w), 1.0)
    total = total + (decay ** j if step_weights is None else step_weights[j]) * loss_j
    metrics[f"loss_{j}"] = loss_j
    metrics[f"acc_{j}"] = acc_j
  return total, metrics


def _smooth_l1(x, y):
  d = jnp.abs(x - y)
  return jnp.where(d < 1.0, 0.5 * d * d, d - 0.5).mean(-1)


def head_loss(spec, model, batch, frozen, objective: Objective | None = None):
  """A head's training loss: `spec` is its `HeadSpec`, `frozen` the target's `Params`,
  `objective` the choice of loss, step weights and depth (default: the head config's).

  Returns:
    (scalar float32 loss, metrics: loss, loss_j and acc_j per step, and feature_loss for
    EAGLE version 1).
  """
  objective = objective or Objective()
  steps = objective.depth or spec.num_steps(model)
  logits, feats = spec.predict(model, batch, frozen, steps)
  cfg = model.cfg
  loss, metrics = _token_loss(model, logits, batch, frozen, cfg.soft, cfg.loss_decay,
                              objective.loss, objective.step_weights)
  if spec.name == "eagle":
    loss = cfg.token_weight * loss
    if cfg.version == 1 and cfg.feature_weight:
      f = batch["hidden_final"].astype(F32)
      mask = batch["loss_mask"].astype(F32)
      fl = jnp.zeros((), F32)
      for j in range(steps):
        w = label_weights(batch, mask, 1 + j)
        fj = jnp.sum(_smooth_l1(feats[:, :, j], shift(f, 1 + j, 0.0)) * w)
        fl = fl + (cfg.loss_decay ** j) * fj / jnp.maximum(jnp.sum(w), 1.0)
      metrics["feature_loss"] = fl
      loss = loss + cfg.feature_weight * fl
  metrics["loss"] = loss
  return loss, metrics


def chain_lengths(model, logits: jax.Array, batch, frozen) -> tuple[jax.Array, jax.Array]:
  """Accepted-run length per position under greedy verification, from teacher-forced logits.

  Draft j at t counts when it equals the data's token x_{t+2+j} and that token is the target's
  own argmax there (the teacher-forced prefix is then what greedy decoding would have produced;
  for greedy data the two conditions coincide), and all drafts before it counted.

  Returns:
    (run lengths [B, T] in 0..S, positions that count [B, T] bool: loss_mask[t + 2] = 1).
  """
  tokens = batch["tokens"]
  mask = batch["loss_mask"] > 0
  greedy = jnp.argmax(logits_from_hidden(frozen, batch["hidden_final"].astype(F32)), axis=-1)
  ids = draft_ids(model)
  ok = []
  for j in range(logits.shape[2]):
    pred = jnp.argmax(logits[:, :, j], axis=-1)
    if ids is not None:
      pred = ids[pred]
    y = shift(tokens, 2 + j, -1)
    ok.append((pred == y) & (y == shift(greedy, 1 + j, -2)) & label_weights(batch, mask, 2 + j))
  run = jnp.cumprod(jnp.stack(ok, axis=-1).astype(jnp.int32), axis=-1).sum(-1)
  return run, label_weights(batch, mask, 2)


@functools.partial(nnx.jit, static_argnames=("predict", "k"))
def _chain_sums(model, batch, frozen, *, predict, k: int):
  logits, _ = predict(model, batch, frozen, k)
  run, valid = chain_lengths(model, logits, batch, frozen)
  return jnp.sum(run * valid), jnp.sum(valid)


def offline_chain_tau(spec, model, batch, frozen, k: int) -> float:
  """1 + the mean accepted greedy run of k drafts over a batch's positions (`chain_lengths`);
  `spec` is the head's `HeadSpec`."""
  batch = {key: batch[key] for key in ("tokens", "loss_mask", "hidden_final", "hidden_layers",
                                       "segment_ids", "positions") if key in batch}
  total, n = _chain_sums(model, batch, frozen, predict=spec.predict, k=int(k))
  return float(1.0 + total / max(int(n), 1))
