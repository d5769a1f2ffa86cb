"""The one pytree helper every layer uses (a leaf module: it imports nothing of jaxspec)."""

from __future__ import annotations

import dataclasses

import jax


def pytree_dataclass(cls):
  """Registers a dataclass as a pytree whose fields are all children (None is an empty child)."""
  fields = [f.name for f in dataclasses.fields(cls)]
  return jax.tree_util.register_dataclass(cls, data_fields=fields, meta_fields=[])
