"""Online hidden states: the frozen target's forward inside the jitted training step.

A head reads the target's hidden states: the final-normed state f_t (`hidden_final`) and, for
EAGLE-3, the outputs of a few decoder layers (`hidden_layers`). Offline they are computed once and
stored (`jaxspec.train.data.write_dataset`, float16 on disk); online they are recomputed from the
batch's token ids in every step by `with_hidden_states`, which wraps a loss function. Online
training needs only token ids and loss masks (no store, so any corpus size and any number of
epochs), at the price of a target forward per step; which is faster depends on the machine (the
measurements are in docs/performance.md).

Batches for the online forward: `tokens` [B, T] int32, rows right-padded (padding positions get
hidden states too, which the loss masks out). Packed rows may carry `segment_ids` [B, T] (a
token attends only to earlier tokens of its own segment) and `positions` [B, T] (rotary
positions restarting per segment).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxspec.heads.common import packed_attention_mask
from jaxspec.models.config import LlamaConfig
from jaxspec.models.llama import Params, forward, init_cache

HIDDEN_MODES = ("auto", "online", "offline")


def target_hidden(frozen: Params, tokens: jax.Array, cfg: LlamaConfig,
                  layers: Sequence[int] = (), *, segment_ids: jax.Array | None = None,
                  positions: jax.Array | None = None) -> tuple[jax.Array, jax.Array | None]:
  """The target's hidden states over `tokens`, as a stored dataset holds them.

  Args:
    frozen: the target's `Params`.
    tokens: [B, T] int32.
    cfg: the target's configuration (static).
    layers: decoder layers whose outputs are returned, in this order (repeats allowed).
    segment_ids: [B, T] packed segments (optional).
    positions: [B, T] rotary positions (optional; default 0..T-1).
  Returns:
    (hidden_final [B, T, D], hidden_layers [B, T, n, D] or None without layers), float32, with
    no gradient.
  """
  b, t = tokens.shape
  uniq = tuple(dict.fromkeys(int(i) for i in layers))
  mask = None if segment_ids is None else packed_attention_mask(segment_ids)  # [B, T, T]
  _, hidden, _ = forward(frozen, tokens, init_cache(cfg, b, t), cfg, hidden_layers=uniq,
                         logits=False, fresh=True, block_mask=mask, positions=positions)
  final = jax.lax.stop_gradient(hidden.final.astype(jnp.float32))
  if not layers:
    return final, None
  per = jnp.transpose(hidden.layers, (1, 2, 0, 3))[:, :, [uniq.index(int(i)) for i in layers]]
  return final, jax.lax.stop_gradient(per.astype(jnp.float32))  # [B, T, n, D]


def needs_forward(batch, layers: Sequence[int], mode: str) -> bool:
  """Whether the step must run the target: always online, never offline, and under "auto"
  when the batch lacks a stored state the head reads."""
  if mode == "online":
    return True
  missing = "hidden_final" not in batch or (bool(layers) and "hidden_layers" not in batch)
  if mode == "offline" and missing:
    raise ValueError("hidden='offline' but the batch holds no stored hidden states"
                     f" (keys {sorted(batch)}): use a dataset written with hidden states and"
                     " the head's layers, or hidden='online'")
  return mode == "auto" and missing


def with_hidden_states(loss_fn, target_cfg: LlamaConfig, layers: Sequence[int] = (), *,
                       mode: str = "auto"):
  """`loss_fn(model, batch, frozen)` with the target's hidden states computed in the step.

  Args:
    loss_fn: a loss reading `hidden_final` (and `hidden_layers`) from its batch.
    target_cfg: the target's configuration; `frozen` (the loss's third argument) is its
      `Params`.
    layers: the target layers `hidden_layers` must hold, in order.
    mode: "online" (always recompute; stored states are ignored), "offline" (the batch must hold
      them) or "auto" (recompute what the batch lacks).
  Returns:
    A loss function of the same signature, traceable under jit.
  """
  if mode not in HIDDEN_MODES:
    raise ValueError(f"hidden must be one of {HIDDEN_MODES}, got {mode!r}")
  layers = tuple(int(i) for i in layers)

  def loss(model, batch, frozen):
    if needs_forward(batch, layers, mode):
      final, per = target_hidden(frozen, batch["tokens"], target_cfg, layers,
                                 segment_ids=batch.get("segment_ids"),
                                 positions=batch.get("positions"))
      batch = dict(batch, hidden_final=final)
      if per is not None:
        batch["hidden_layers"] = per
    return loss_fn(model, batch, frozen)

  return loss


__all__ = ["HIDDEN_MODES", "needs_forward", "target_hidden", "with_hidden_states"]
