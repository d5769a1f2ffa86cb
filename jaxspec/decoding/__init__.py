"""Everything that runs inside jit, and the functional API over it.

    out = jaxspec.decoding.speculative_decode(target, drafter, prompt_ids, prompt_lengths, key,
                                              max_new_tokens=64)
    out.tokens, out.lengths, out.logprobs            # a pytree of arrays

The algorithm is in three files: `rejection.py` (draft, verify, acceptance, rejection_sample),
`step.py` (what both loops share: choose k, verify a branch, accept, roll back, record) and
`fused.py` / `host.py` (the single-jit loop and the two-mesh loop over `step.py`); beside them
`tree.py` (tree drafts), `adaptive.py` (choosing k), `plain.py` (plain decoding), `drafter.py`
(the drafter protocol), `protocol.py` (the model protocol, `CausalLM`) and `functional.py`
(`speculative_decode`, `decode`).
"""

from jaxspec.decoding.adaptive import AutoK, CostModel
from jaxspec.decoding.drafter import DraftContext, Drafter, Proposal
from jaxspec.decoding.functional import DecodeOutput, decode, speculative_decode
from jaxspec.decoding.protocol import CausalLM, LengthCache, Target, as_target, check_lm
from jaxspec.decoding.rejection import acceptance, draft, rejection_sample, verify
from jaxspec.decoding.step import SpecStats
from jaxspec.sampling import Sampling, SamplingArrays

__all__ = ["AutoK", "CausalLM", "CostModel", "DecodeOutput", "DraftContext", "Drafter",
           "LengthCache", "Proposal", "Sampling", "SamplingArrays", "SpecStats", "Target",
           "acceptance", "as_target", "check_lm", "decode", "draft", "rejection_sample",
           "speculative_decode", "verify"]
