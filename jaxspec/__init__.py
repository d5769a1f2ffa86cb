"""jaxspec: exact speculative decoding for LLMs, written the JAX way.

    import jaxspec
    model = jaxspec.load()                       # the bundled SmolLM2-135M-Instruct
    prompt = model.tokenizer.encode_chat("Summarise: ...")
    out = jaxspec.speculative_generate(model, "eagle", [prompt], max_new_tokens=128)
    print(out.texts[0], out.stats["tau"])

Inside your own `jax.jit`, `jax.vmap` or `lax.scan`: `jaxspec.decoding.speculative_decode` and
`jaxspec.decoding.decode`, pure functions of arrays that take any `jaxspec.decoding.CausalLM`.
"""

from jaxspec.api import (GenerateOutput, generate, generate_stream, speculative_generate,
                         speculative_stream)
from jaxspec.decoding import (CausalLM, DecodeOutput, Target, decode, score, speculative_decode)
from jaxspec.decoding.adaptive import AutoK, CostModel
from jaxspec.decoding.drafter import DraftContext, Drafter
from jaxspec.decoding.rejection import acceptance, draft, rejection_sample, verify
from jaxspec.drafters import DraftModel, NGram, resolve_drafter
from jaxspec.heads import load_head
from jaxspec.api import load
from jaxspec.models.model import Model
from jaxspec.engine import release_cache_buffers, release_compiled
from jaxspec.sampling import Sampling

__version__ = "0.1.0"

__all__ = ["AutoK", "CausalLM", "CostModel", "DecodeOutput", "DraftContext", "DraftModel",
           "Drafter", "GenerateOutput", "Model", "NGram", "Sampling", "Target", "acceptance",
           "decode", "draft", "generate", "generate_stream", "load", "load_head",
           "rejection_sample", "release_cache_buffers", "release_compiled", "resolve_drafter",
           "score", "speculative_decode", "speculative_generate", "speculative_stream", "verify"]
