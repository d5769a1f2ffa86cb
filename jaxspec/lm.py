"""The model protocol's types: what the decoding loop asks of a causal language model and what
the model gives back. A leaf below `models/` and `decoding/`, so a model implements the protocol
and the loop runs it without either importing the other.

  CausalLM   the protocol (vocab_size, init_cache, forward); `jaxspec.decoding.protocol` holds
             the operations the loop runs on any model that meets it
  Hidden     the hidden states a forward returns (final normed states, requested layers)
  register_config   a configuration type that stands for a model (a `LlamaConfig` for
                    jaxspec's Llama, as the older signatures took it)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import jax

from jaxspec.pytree import pytree_dataclass


@pytree_dataclass
@dataclasses.dataclass
class Hidden:
  """Hidden states returned by a model's forward."""

  final: jax.Array  # [B, T, D] after the final norm (what the LM head reads)
  layers: jax.Array | None = None  # [n, B, T, D] outputs of the requested layers, in order


@runtime_checkable
class CausalLM(Protocol):
  """A causal language model the decoding loop can run (see `jaxspec.decoding.protocol`).

  Optionally it declares `eos_token_ids` (a tuple of ints): `decode`, `speculative_decode` and
  the host wrappers then stop a row at them unless given other `stop_ids`."""

  @property
  def vocab_size(self) -> int: ...

  def init_cache(self, params: Any, batch_size: int, max_len: int) -> Any: ...

  def forward(self, params: Any, tokens: jax.Array, cache: Any, lengths: jax.Array, *,
              hidden_layers: tuple[int, ...] = ()) -> tuple[jax.Array, Any, Any]: ...


# Configuration type -> the CausalLM built from it. Filled at import time by the model families
# (jaxspec.models.llama registers LlamaConfig -> LlamaLM) and read by
# `jaxspec.decoding.protocol.as_lm`; like jax's pytree registry, a type is registered once.
LM_OF_CONFIG: dict[type, Callable[[Any], Any]] = {}


def register_config(config_type: type, make_lm: Callable[[Any], Any]) -> None:
  """Declares that a `config_type` instance stands for the model `make_lm(config)` wherever the
  decoding functions take a model (the older signatures took a `LlamaConfig`)."""
  LM_OF_CONFIG[config_type] = make_lm
