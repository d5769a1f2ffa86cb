"""`resolve_drafter`: a drafter named by a string (a bundled head, a head directory, the path of
a draft model, "ngram", "suffix") made into a `Drafter`."""

from __future__ import annotations

import jax.numpy as jnp

from jaxspec.decoding.drafter import Drafter
from jaxspec.drafters.draft_model import DraftModel
from jaxspec.drafters.ngram import NGram
from jaxspec.drafters.pard import is_pard_dir, load_pard
from jaxspec.drafters.suffix import SuffixDecoding, SuffixTree
from jaxspec.models.model import Model


# The suffix drafters by name (what `jaxspec bench --workload rollout` calls its methods).
SUFFIX_NAMES = {
    "suffix": lambda v: SuffixDecoding(vocab=v),
    "suffix-sampled": lambda v: SuffixDecoding(vocab=v, sample_drafts=True),
    "suffix-tree": lambda v: SuffixDecoding(vocab=v, tree=SuffixTree()),
}

# Drafters built from a name, by target: loading a head or a draft model once per target.
_NAMED: dict[tuple[str, int, str | None], tuple[Model, Drafter]] = {}


def resolve_drafter(target: Model, drafter, dtype: str | None = None) -> Drafter:
  """A `Drafter`, or one named by a string.

  Names: "ngram" (`NGram()`); "suffix" (`SuffixDecoding(vocab=target.vocab_size)`: drafting
  from the batch's rows; the host wrappers start every call from an empty corpus),
  "suffix-sampled" (`sample_drafts=True`: sampled drafts verified with their q) and
  "suffix-tree" (`tree=SuffixTree()`: a speculation tree, num_draft_tokens "auto"); "eagle" (or
  "eagle3", the name its drafter reports), "medusa", "mlp" (the head bundled for the default
  SmolLM2 target under jaxspec/assets/heads/); a directory written by `jaxspec.heads.save_head`
  or `jaxspec train`; or the path of a draft model (.gguf file or Hugging Face directory),
  loaded as a `DraftModel` in `dtype` (default the target's), or as a `ParallelDraft` when its
  config.json names a PARD mask token ("pard_token": `load_pard`). A named drafter is loaded once
  per target and reused by later calls.
  """
  if isinstance(drafter, Drafter):
    return drafter
  if not isinstance(drafter, str):
    raise ValueError(f"drafter must be a jaxspec Drafter (NGram(), DraftModel(model), ...) or a"
                     f" name (\"ngram\", \"suffix\", \"suffix-tree\", \"eagle\", \"medusa\","
                     f" \"mlp\", or a path),"
                     f" got {type(drafter).__name__}")
  if drafter == "ngram":
    return NGram()
  if drafter in SUFFIX_NAMES:
    return SUFFIX_NAMES[drafter](target.vocab_size)
  if drafter == "eagle3":  # the bundled EAGLE head under the name its drafter reports
    drafter = "eagle"
  key = (drafter, id(target), dtype)
  hit = _NAMED.get(key)
  if hit is not None and hit[0] is target:
    return hit[1]
  import os

  from jaxspec import heads as heads_lib
  if drafter in heads_lib.HEADS or heads_lib.is_head_dir(drafter):
    made = heads_lib.load_head(target, drafter)
  elif is_pard_dir(drafter):
    made = load_pard(drafter, target, dtype=dtype)
  elif os.path.exists(drafter):
    from jaxspec.models.loading import load
    if dtype is None:
      dtype = "bfloat16" if target.params.embed.dtype == jnp.bfloat16 else "float32"
    made = DraftModel(load(drafter, dtype=dtype))
  else:
    raise ValueError(f"drafter {drafter!r} is not 'ngram', 'suffix', 'suffix-sampled',"
                     " 'suffix-tree', a bundled head"
                     f" ({', '.join(sorted(heads_lib.HEADS) + ['eagle3'])}), a head directory"
                     " or the path of"
                     " a draft model (.gguf file or Hugging Face directory)")
  if len(_NAMED) >= 8:
    _NAMED.clear()
  _NAMED[key] = (target, made)
  return made
