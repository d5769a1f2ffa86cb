"""The `Model` container: configuration, weights and tokenizer of one loaded checkpoint."""

from __future__ import annotations

import dataclasses
from typing import Any

from jaxspec.models.config import LlamaConfig
from jaxspec.models.llama import Params


@dataclasses.dataclass
class Model:
  """A loaded model. `params` is a pytree; `cfg` is static; `tokenizer` may be None."""

  cfg: LlamaConfig
  params: Params
  tokenizer: Any = None
  name: str = "model"
  # Where the weights are laid out (`jaxspec.sharding.shard_model`); None: wherever they are.
  sharding: Any = None

  @property
  def vocab_size(self) -> int:
    return self.cfg.vocab_size
