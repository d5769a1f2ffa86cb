"""Medusa heads (Cai et al. 2024): K independent residual heads on the target's final hidden
state; head j at position t predicts x_{t+2+j}."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.heads.common import F32, check_config_ints, make_config, target_dims
from jaxspec.models.config import LlamaConfig
from jaxspec.models.llama import Params, logits_from_hidden


@dataclasses.dataclass(frozen=True, kw_only=True)
class MedusaConfig:
  """Medusa-1 heads (Cai et al. 2024).

  num_heads: K heads; head j at position t predicts x_{t+2+j}, so k <= K drafts per step.
  num_layers: residual blocks per head.
  own_lm_head: give every head its own [D, V] LM head (as Medusa checkpoints store them) instead
    of sharing the target's frozen one; set by `jaxspec.train.export.import_medusa`.
  soft: train on the target's distribution (KL) instead of the hard next tokens.
  loss_decay: head j's loss weight is loss_decay**j (Medusa's lambda_k = 0.8**k).
  """

  num_heads: int = 4
  num_layers: int = 1
  own_lm_head: bool = False
  soft: bool = False
  loss_decay: float = 0.8

  def __post_init__(self):
    check_config_ints(self, dict(num_heads=1, num_layers=1))


class MedusaHeads(nnx.Module):
  """K heads, each `x + SiLU(W x + b)` (num_layers times) on f_t, then an LM head.

  W and b start at zero, so an untrained head is exactly the target's LM head on f_t.
  """

  def __init__(self, target_cfg: LlamaConfig, cfg: MedusaConfig, *, rngs: nnx.Rngs):
    if cfg.num_heads < 1 or cfg.num_layers < 1:
      raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 1, got {cfg}")
    d, v, k, n = target_cfg.hidden_size, target_cfg.vocab_size, cfg.num_heads, cfg.num_layers
    self.cfg = cfg
    self.target_dims = target_dims(target_cfg)
    self.target_softcap = target_cfg.final_softcap  # the soft targets' cap (Gemma 2)
    self.w = nnx.Param(jnp.zeros((k, n, d, d), F32))  # [K, layers, D_in, D_out]
    self.b = nnx.Param(jnp.zeros((k, n, d), F32))  # [K, layers, D]
    # [K, D, V]; filled by an import (Medusa checkpoints train a copy of the LM head per head).
    self.lm_head = nnx.Param(jnp.zeros((k, d, v), F32)) if cfg.own_lm_head else None

  def features(self, f: jax.Array) -> jax.Array:
    """f [..., D] -> every head's features [..., K, D] (float32)."""
    k = self.cfg.num_heads
    x = jnp.broadcast_to(f.astype(F32)[..., None, :], f.shape[:-1] + (k, f.shape[-1]))
    w, b = self.w[...], self.b[...]
    for i in range(self.cfg.num_layers):
      x = x + jax.nn.silu(jnp.einsum("...kd,kde->...ke", x, w[:, i]) + b[:, i])
    return x

  def logits(self, frozen: Params, f: jax.Array) -> jax.Array:
    """f [..., D] -> float32 logits [..., K, V]; head j predicts x_{t+2+j}."""
    x = self.features(f)
    if self.lm_head is not None:
      return jnp.einsum("...kd,kdv->...kv", x, self.lm_head[...])
    return logits_from_hidden(frozen, x)


def medusa_predict(model: MedusaHeads, batch, frozen, steps):
  """The training-time forward: (logits [B, T, steps, V] of heads 0..steps-1, None)."""
  k = model.cfg.num_heads
  if steps > k:
    raise ValueError(f"this Medusa head has {k} heads, so it drafts at most {k} tokens; asked"
                     f" for {steps}: lower k or train more heads (num_heads)")
  return model.logits(frozen, batch["hidden_final"])[:, :, :steps], None


def create_medusa(target_cfg, *, rngs, **options):
  """A `MedusaHeads` for the target; options: `MedusaConfig`'s fields."""
  return MedusaHeads(target_cfg, make_config(MedusaConfig, options), rngs=rngs)
