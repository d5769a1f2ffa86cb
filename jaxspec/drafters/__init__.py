"""The drafters jaxspec ships, one module per kind:

  ngram        `NGram`: prompt lookup (copies what followed an earlier occurrence); no model pass
  draft_model  `DraftModel`: a separate draft model with its own KV cache
  self_draft   `self_drafter(target)`: the target in int8 (or bfloat16) as its own `DraftModel`
  oracle       `Oracle`: a known continuation kept with probability alpha (benchmarks)
  suffix       `SuffixDecoding`: suffix decoding over the batch's rows and a corpus of earlier
               outputs carried from call to call (`SuffixCorpus`); no model pass
  pard         `ParallelDraft`: a PARD draft model proposing k tokens from one pass over k - 1
               mask tokens; `load_pard` reads a PARD-format checkpoint
  resolve      `resolve_drafter`: a drafter named by a string ("ngram", a head, a path)

The drafters of the trained heads (Medusa, the MLP speculator, EAGLE) live with the heads, in
`jaxspec.heads.drafting`, because the heads package builds them (`HEADS[kind].drafter`,
`load_head`) and sits below this one; they are re-exported here so every drafter class has one
address. The protocol every drafter implements is `jaxspec.decoding.Drafter`.
"""

# The protocol's names, importable from here as before; documented with the protocol.
from jaxspec.decoding.drafter import (DraftContext, Drafter, NoState, Proposal,  # noqa: F401
                                      position_draft_keys)
from jaxspec.drafters.draft_model import DraftModel, DraftModelState
from jaxspec.drafters.ngram import MAX_NGRAM, NGram
from jaxspec.drafters.oracle import Oracle, OracleParams
from jaxspec.drafters.pard import ParallelDraft, load_pard
from jaxspec.drafters.resolve import resolve_drafter
from jaxspec.drafters.self_draft import self_drafter
from jaxspec.drafters.suffix import SuffixCorpus, SuffixDecoding, SuffixTree, corpus_from
from jaxspec.heads.drafting import EagleDrafter, HeadDrafter, MedusaDrafter, MLPDrafter

__all__ = ["MAX_NGRAM", "DraftModel", "DraftModelState", "EagleDrafter", "HeadDrafter",
           "MLPDrafter", "MedusaDrafter", "NGram", "Oracle", "OracleParams", "ParallelDraft",
           "SuffixCorpus", "SuffixDecoding", "SuffixTree", "corpus_from", "load_pard",
           "resolve_drafter", "self_drafter"]
