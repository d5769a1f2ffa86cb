"""What `jaxspec bench` runs: the methods (`METHODS`, one `Method` each; adding a method is
adding an entry), the `Settings` of one invocation, and `BenchError` for bad input."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

DEFAULT_METHODS = "none,ngram,eagle"


class BenchError(ValueError):
  """Bad input to the benchmark; the message says what to change."""


# ----------------------------------------------------------------------------------------------
# The method registry.


@dataclasses.dataclass(frozen=True, kw_only=True)
class Method:
  """One jaxspec method.

  Attributes:
    description: one line for the tables.
    make: (target, settings) -> (drafter, what it is); None: plain `generate`.
    options: extra keyword arguments of `speculative_generate` / `speculative_stream`.
  """

  description: str
  make: Callable[[Any, "Settings"], tuple[Any, str]] | None = None
  options: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def _named(spec: str, what: str):
  def make(target, s):
    from jaxspec.drafters import resolve_drafter
    return resolve_drafter(target, spec), what
  return make


def _tree(spec: str, what: str):
  """A head drafting a tree of `--tree-size` nodes (`jaxspec.decoding.tree.default_tree`: EAGLE-2's
  dynamic tree for EAGLE, the best static tree from the measured top-k accuracies for Medusa)."""
  def make(target, s):
    from jaxspec.drafters import resolve_drafter
    from jaxspec.decoding.tree import default_tree
    drafter = resolve_drafter(target, spec)
    tree = default_tree(drafter, s.tree_size)
    return drafter.with_tree(tree), f"{what}, {tree.describe()}"
  return make


def _draft_model(target, s):
  if s.draft_model:
    from jaxspec.drafters import resolve_drafter
    return resolve_drafter(target, s.draft_model), f"draft model {s.draft_model}"
  from jaxspec.drafters import self_drafter
  return self_drafter(target, "int8"), ("the target in int8 (self-speculation; no"
                                        " --draft-model given)")


METHODS: dict[str, Method] = {
    "none": Method(description="plain `generate` (the baseline of every jaxspec speedup)"),
    "ngram": Method(description="prompt lookup (NGram)", make=_named("ngram", "NGram()")),
    "medusa": Method(description="Medusa head",
                     make=_named("medusa", "bundled Medusa head (jaxspec/assets/heads/medusa)")),
    "mlp": Method(description="MLP speculator",
                  make=_named("mlp", "bundled MLP speculator (jaxspec/assets/heads/mlp)")),
    "eagle": Method(description="EAGLE-3 head",
                    make=_named("eagle", "bundled EAGLE-3 head (jaxspec/assets/heads/eagle)")),
    "eagle-tree": Method(description="EAGLE-3 head, EAGLE-2 dynamic tree (--tree-size nodes)",
                         make=_tree("eagle", "bundled EAGLE-3 head")),
    "medusa-tree": Method(description="Medusa head, static tree (--tree-size nodes)",
                          make=_tree("medusa", "bundled Medusa head")),
    "draft-model": Method(description="draft model (--draft-model; default the int8 target)",
                          make=_draft_model),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
  """What one `jaxspec bench` invocation measures."""

  model: str | None = None
  scan_layers: bool | None = None  # the layer layout (None: the backend's default)
  prompts: str | None = None
  categories: tuple[str, ...] | None = None
  per_category: int = 1
  methods: tuple[str, ...] = ("none",)
  peers: tuple[str, ...] = ()
  batch_sizes: tuple[int, ...] = (1,)
  max_new_tokens: int = 64
  temperature: float = 0.0
  top_k: int = 0
  top_p: float = 1.0
  min_p: float = 0.0
  seed: int = 0
  num_draft_tokens: int | str = "auto"
  k_max: int | None = None
  tree_size: int = 8
  draft_model: str | None = None
  lookup_tokens: int = 10
  chat: bool = True
  latency: bool = True
  out: str = "bench_out"
  progress: bool = True
