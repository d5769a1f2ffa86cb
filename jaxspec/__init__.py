"""jaxspec: exact speculative decoding for LLMs, written the JAX way.

    import jaxspec
    model = jaxspec.load()                       # the bundled SmolLM2-135M-Instruct
    prompt = model.tokenizer.encode_chat("Summarise: ...")
    out = jaxspec.speculative_generate(model, "eagle", [prompt], max_new_tokens=128)
    print(out.texts[0], out.stats["tau"])
"""

from jaxspec.adaptive import AutoK, CostModel
from jaxspec.drafters import DraftContext, Drafter, DraftModel, NGram, resolve_drafter
from jaxspec.generate import GenerateOutput, generate, generate_stream, release_cache_buffers
from jaxspec.heads import load_head
from jaxspec.models.loading import load
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling
from jaxspec.speculative import (acceptance, draft, rejection_sample, speculative_generate,
                                 speculative_stream, verify)

__version__ = "0.1.0"

__all__ = ["AutoK", "CostModel", "DraftContext", "DraftModel", "Drafter", "GenerateOutput",
           "Model", "NGram", "Sampling", "acceptance", "draft", "generate", "generate_stream",
           "load", "load_head", "rejection_sample", "release_cache_buffers", "resolve_drafter",
           "speculative_generate", "speculative_stream", "verify"]
