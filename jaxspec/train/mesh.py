"""Training on a device mesh: data parallel over the batch, the frozen target sharded.

`train_head(..., mesh=mesh)` and `train(..., mesh=mesh, put_batch=...)` place

  batches         rows over the rules' batch axis ("data"), every other axis replicated
  the target      by the sharding rules (`jaxspec.sharding.shard_params`: tensor parallel over
                  "model" where the mesh has one), as decoding places it
  the head        replicated, with its optimizer state: a step's gradients are the mean over
                  the batch, so XLA all-reduces them across the data axis

and the jitted step compiles for those placements (computation follows the data). Checkpoints
are orbax checkpoints of the placed state, restored into the same placements, so a resumed run
on the same mesh is bit-identical to an uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxspec.sharding.rules import (DEFAULT_RULES, ShardingRules, batch_sharding, mesh_axis_size,
                                    shard_params)


def replicate(tree, mesh: Mesh):
  """Every array of `tree` replicated on `mesh`."""
  return jax.device_put(tree, NamedSharding(mesh, P()))


def batch_placer(mesh: Mesh, rules: ShardingRules | None = None, drop: Sequence[str] = (),
                 ) -> Callable[[dict[str, Any]], dict[str, jax.Array]]:
  """host batch -> arrays with rows over the batch axis (keys in `drop` left out).

  Raises (when called):
    ValueError: a batch whose rows do not divide over the batch axis.
  """
  rules = rules or DEFAULT_RULES
  m = mesh_axis_size(mesh, rules.axis("batch", mesh))

  def put(batch: dict[str, Any]) -> dict[str, jax.Array]:
    out = {}
    for k, v in batch.items():
      if k in drop:
        continue
      v = np.asarray(v)
      if v.shape[0] % m:
        raise ValueError(f"a batch of {v.shape[0]} rows does not divide over the mesh's"
                         f" {rules.batch!r} axis of size {m}: use a batch size that is a"
                         f" multiple of {m}")
      out[k] = jax.device_put(v, batch_sharding(mesh, v.ndim, rules))
    return out

  return put


def mesh_placement(mesh: Mesh, target, rules: ShardingRules | None = None,
                   drop: Sequence[str] = ()):
  """(batch placer, the target's params placed by the rules) for training on `mesh`."""
  rules = rules or DEFAULT_RULES
  return batch_placer(mesh, rules, drop), shard_params(target.params, target.cfg, mesh, rules)


__all__ = ["batch_placer", "mesh_placement", "replicate"]
