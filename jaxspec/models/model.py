"""The `Model` container: configuration, weights and tokenizer of one loaded checkpoint."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from jaxspec.models.config import LlamaConfig
from jaxspec.models.llama import (DEFAULT_OUTPUT_MAJOR, OutputMajorPolicy, Params, is_scanned,
                                  with_scan_layers)


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

  @property
  def scan_layers(self) -> bool:
    """True when the layers are stacked and run by `lax.scan`; False when unrolled."""
    return is_scanned(self.params)

  def program_cfg(self) -> LlamaConfig:
    """The configuration its programs are traced with: `cfg`, except that "auto" attention
    (`LlamaConfig.attention_kernel`) becomes "xla" when the weights live on CPU devices, where
    `lax.platform_dependent` would lower the XLA read anyway: the Triton and Mosaic kernels are
    then not traced at all (they cost about half of lowering a tiny model's forward pass). A
    program of your own that may be lowered for other platforms keeps "auto"."""
    if self.cfg.attention_kernel != "auto":
      return self.cfg
    arrays = [x for x in jax.tree.leaves(self.params) if isinstance(x, jax.Array)]
    devices = {d for x in arrays for d in x.devices()} if arrays else jax.devices()
    if any(d.platform != "cpu" for d in devices):
      return self.cfg
    return dataclasses.replace(self.cfg, attention_kernel="xla")

  def with_scan_layers(self, scan: bool, *,
                       output_major: OutputMajorPolicy = DEFAULT_OUTPUT_MAJOR) -> Model:
    """This model with its layers stacked (scan=True) or unrolled (scan=False); itself when
    already so. Unrolled steps run faster on XLA's CPU backend and compile several times
    slower; outputs agree up to float rounding, where `output_major` holds the unrolled matmul
    weights output-major (`jaxspec.models.llama.with_scan_layers`)."""
    if bool(scan) == self.scan_layers:
      return self
    return dataclasses.replace(self, params=with_scan_layers(self.params, bool(scan),
                                                             output_major=output_major))
