"""The registry of head kinds: `HEADS` maps "medusa", "mlp" and "eagle" to a `HeadSpec`, the
five functions the trainer and the decoding loop need."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
from flax import nnx

from jaxspec.heads.drafting import make_drafter
from jaxspec.heads.eagle import (EagleConfig, EagleHead, create_eagle, eagle_predict,
                                 eagle_required_layers)
from jaxspec.heads.medusa import MedusaConfig, MedusaHeads, create_medusa, medusa_predict
from jaxspec.heads.mlp import MLPConfig, MLPSpeculator, create_mlp, mlp_predict
from jaxspec.heads.training import head_loss, offline_chain_tau
from jaxspec.models.config import LlamaConfig


@dataclasses.dataclass(frozen=True)
class HeadSpec:
  """One kind of head: how to build, train, evaluate and decode with it.

  create(target_cfg, *, rngs, **options) -> nnx.Module (options: the kind's config fields;
    EAGLE-3 also takes draft_vocab= or token_counts=).
  loss(model, batch, frozen) -> (scalar float32, metrics): differentiable in the module's
    `nnx.Param`s; `frozen` is the target's `Params`.
  required_layers(target_cfg, options) -> target layer outputs the batch must hold.
  drafter(model, target) -> the `Drafter` for `speculative_generate`.
  offline_chain_tau(model, batch, frozen, k) -> 1 + mean accepted greedy run of k drafts.
  predict(model, batch, frozen, steps) -> (logits [B, T, steps, N], features or None), the
    training-time forward; num_steps(model) -> steps the loss trains.
  """

  name: str
  create: Callable[..., nnx.Module]
  required_layers: Callable[[LlamaConfig, Mapping[str, Any]], tuple[int, ...]]
  predict: Callable[..., tuple[jax.Array, jax.Array | None]]
  num_steps: Callable[[nnx.Module], int]
  config_cls: type

  def loss(self, model, batch, frozen):
    return head_loss(self, model, batch, frozen)

  def drafter(self, model, target):
    return make_drafter(self.name, model, target)

  def offline_chain_tau(self, model, batch, frozen, k: int) -> float:
    return offline_chain_tau(self, model, batch, frozen, k)


HEADS: dict[str, HeadSpec] = {
    "medusa": HeadSpec("medusa", create_medusa, lambda cfg, o: (), medusa_predict,
                       lambda m: m.cfg.num_heads, MedusaConfig),
    "mlp": HeadSpec("mlp", create_mlp, lambda cfg, o: (), mlp_predict,
                    lambda m: m.cfg.n_predict, MLPConfig),
    "eagle": HeadSpec("eagle", create_eagle, eagle_required_layers, eagle_predict,
                      lambda m: m.cfg.ttt_steps, EagleConfig),
}

_MODULES = {MedusaHeads: "medusa", MLPSpeculator: "mlp", EagleHead: "eagle"}


def head_kind(model: nnx.Module) -> str:
  """The registry key of a head module."""
  for cls, name in _MODULES.items():
    if isinstance(model, cls):
      return name
  raise ValueError(f"{type(model).__name__} is not a jaxspec head (one of {sorted(HEADS)})")
