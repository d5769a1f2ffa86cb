"""The one pytree helper every layer uses (a leaf module: it imports nothing of jaxspec)."""

from __future__ import annotations

import dataclasses

import jax


def pytree_dataclass(cls):
  """Registers a dataclass as a pytree whose fields are children (None is an empty child),
  except those declared `static_field()`: hashable values that are part of the tree's structure
  (a change compiles another program), as flax.struct's `pytree_node=False`."""
  fields = dataclasses.fields(cls)
  meta = [f.name for f in fields if f.metadata.get("static")]
  data = [f.name for f in fields if not f.metadata.get("static")]
  return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def static_field(default):
  """A `pytree_dataclass` field that is structure, not a child (`default` hashable)."""
  return dataclasses.field(default=default, metadata={"static": True})
