"""Everything that runs inside jit, and the functional API over it.

    out = jaxspec.decoding.speculative_decode(target, drafter, prompt_ids, prompt_lengths, key,
                                              max_new_tokens=64)
    out.tokens, out.lengths, out.logprobs            # a pytree of arrays

The algorithm is in two files: `rejection.py` (draft, verify, acceptance, rejection_sample) and
`loop.py` (the loop's static `StepConfig`, its state, one step as choose k -> draft -> verify ->
accept, and the single-jit loop around it); `two_mesh.py` runs the same step as separate
programs on two meshes (the target's and the drafter's). Beside them `tree.py` (tree drafts),
`adaptive.py` (choosing k), `plain.py` (plain decoding), `drafter.py` (the drafter protocol),
`protocol.py` (the operations the loop runs on a model meeting `CausalLM`, whose types live in
`jaxspec.lm`), `limits.py` (size checks), `functional.py` (`speculative_decode`, `decode`) and
`score.py` (`score`: the loop's log-probabilities of given tokens, teacher-forced, with
gradients).
"""

from jaxspec.decoding.adaptive import AutoK, CostModel
from jaxspec.decoding.drafter import DraftContext, Drafter, Proposal
from jaxspec.decoding.functional import DecodeOutput, decode, speculative_decode
from jaxspec.decoding.protocol import CausalLM, LengthCache, Target, as_target, check_lm
from jaxspec.decoding.rejection import acceptance, draft, rejection_sample, verify
from jaxspec.decoding.score import join_tokens, score
from jaxspec.decoding.loop import SpecStats
from jaxspec.sampling import Sampling, SamplingArrays

__all__ = ["AutoK", "CausalLM", "CostModel", "DecodeOutput", "DraftContext", "Drafter",
           "LengthCache", "Proposal", "Sampling", "SamplingArrays", "SpecStats", "Target",
           "acceptance", "as_target", "check_lm", "decode", "draft", "join_tokens",
           "rejection_sample", "score", "speculative_decode", "verify"]
