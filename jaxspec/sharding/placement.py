"""Placement: where the target and the drafter run. The target on one mesh and the drafter on
another (a sub-mesh, or another backend such as the host CPU beside a GPU target) run the
two-mesh loop (`jaxspec.decoding.two_mesh`, driven by `jaxspec.engine.runs.HostRun`); both on one mesh,
the fused loop.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh

from jaxspec.decoding.drafter import Drafter
from jaxspec.drafters import DraftModel
from jaxspec.models.model import Model
from jaxspec.sharding.rules import DEFAULT_RULES, ShardingRules, shard_model, submesh


def as_mesh(where, what: str) -> Mesh:
  """A Mesh from a Mesh, a device, a list of devices or of indices into jax.devices()."""
  if isinstance(where, Mesh):
    return where
  if isinstance(where, jax.Device):
    where = [where]
  if isinstance(where, (list, tuple)) and where:
    try:
      return submesh(where)
    except ValueError as e:
      raise ValueError(f"the {what} placement: {e}") from None
  raise ValueError(f"the {what} placement must be a jax Mesh, a device or a list of devices"
                   f" (or indices into jax.devices()), got {where!r}")


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
  """Where the target and the drafter run.

  Args:
    target: a Mesh (or devices) for the target; its weights are laid out by `rules`.
    drafter: a Mesh (or devices) for the drafter. The same mesh as the target: the fused
      single-jit loop. Other devices (a sub-mesh, another backend): the host-orchestrated loop.
    rules: logical-axis sharding rules for both meshes.
    drafter_precision: "int8" / "bfloat16" / None (as loaded): the precision the drafter's
      model is converted to on its mesh (a draft model only).
    target_precision: the same for the target (weight-only int8 or bf16 on a device that
      prefers them).
  """

  target: Any
  drafter: Any = None
  rules: ShardingRules = DEFAULT_RULES
  drafter_precision: str | None = None
  target_precision: str | None = None

  def __post_init__(self):
    object.__setattr__(self, "target", as_mesh(self.target, "target"))
    object.__setattr__(self, "drafter", self.target if self.drafter is None
                       else as_mesh(self.drafter, "drafter"))
    for field in ("drafter_precision", "target_precision"):
      if getattr(self, field) not in (None, "int8", "bfloat16", "float32"):
        raise ValueError(f"{field} must be None, 'int8', 'bfloat16' or 'float32', got"
                         f" {getattr(self, field)!r}")

  @property
  def fused(self) -> bool:
    """Both on the same mesh: the single-jit loop runs."""
    return self.target == self.drafter

  def describe(self) -> dict[str, Any]:
    devs = lambda m: [str(d) for d in m.devices.flat]
    return dict(mode="fused" if self.fused else "host", target=devs(self.target),
                drafter=devs(self.drafter),
                target_mesh=dict(self.target.shape), drafter_mesh=dict(self.drafter.shape))


def place_target(target: Model, placement: Placement) -> Model:
  """The target laid out on the placement's target mesh (unchanged when it already is)."""
  if placement.target_precision is not None:
    from jaxspec.models import quant
    if not (placement.target_precision == "int8" and quant.is_quantized(target.params)):
      target = quant.quantize(target, placement.target_precision)
  sh = target.sharding
  if sh is not None and sh.mesh == placement.target and sh.rules == placement.rules:
    return target
  return shard_model(target, placement.target, placement.rules)


def drafter_in_precision(drafter: Drafter, precision: str | None) -> Drafter:
  """A draft model converted to `precision` ("int8", "bfloat16"); other drafters unchanged."""
  if precision is None:
    return drafter
  if not isinstance(drafter, DraftModel):
    raise ValueError(f"drafter_precision={precision!r} converts a draft model's weights, but"
                     f" the drafter is {drafter.name!r}: drop drafter_precision")
  from jaxspec.models import quant
  return dataclasses.replace(drafter, model=quant.quantize(drafter.model, precision))
