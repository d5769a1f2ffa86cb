"""Errors raised while reading checkpoints and tokenizers."""

from __future__ import annotations


class CheckpointError(ValueError):
  """A checkpoint (GGUF or Hugging Face directory) is missing, malformed or unsupported.

  The message names the file, what is wrong with it and, where there is one, the fix.
  """
