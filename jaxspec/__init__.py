"""jaxspec: exact speculative decoding for LLMs, written the JAX way."""
