"""Self-speculation: the target at a lower precision drafting for itself.

`self_drafter(target)` is `DraftModel(quantize(target, "int8"))`: the target's own weights in
int8, a quarter of the weight bytes, propose the drafts and the float target verifies them, so
the output is still exactly the target's. It lives in the drafters package, which sits above
`jaxspec.models` (which quantizes), because the models package imports nothing above it.
"""

from __future__ import annotations

from jaxspec.drafters.draft_model import DraftModel
from jaxspec.models.model import Model
from jaxspec.models.quant import quantize


def self_drafter(target: Model, precision: str = "int8", **kwargs) -> DraftModel:
  """The target at a lower precision drafting for itself: `DraftModel(quantize(target,
  precision), **kwargs)` (kwargs: DraftModel's, e.g. p_min).

  The speculative output stays exactly the target's; only the acceptance rate depends on how
  close the low-precision copy's distribution is.
  """
  return DraftModel(quantize(target, precision), **kwargs)


__all__ = ["self_drafter"]
