"""Errors raised while reading checkpoints and tokenizers."""

from __future__ import annotations


class CheckpointError(ValueError):
  """A checkpoint (GGUF or Hugging Face directory) is missing, malformed or unsupported.

  The message names the file, what is wrong with it and, where there is one, the fix.
  """


class LayoutError(ValueError):
  """The weights being read do not fit the requested layout (a mesh axis that does not divide
  the heads, the MLP width or the vocabulary): the checkpoint is fine, the placement is not."""


def malformed(path, e: BaseException) -> CheckpointError:
  """The `CheckpointError` for an unexpected exception while reading `path`: the reader met a
  value it did not expect (a wrong type, an impossible size, an undecodable name)."""
  return CheckpointError(f"{path} is malformed ({type(e).__name__}: {e}); re-download or"
                         " re-convert it")


def is_reader_failure(e: BaseException) -> bool:
  """Whether an exception raised while reading a checkpoint means the file is malformed (and
  not, say, the device running out of memory or the user interrupting)."""
  if isinstance(e, (CheckpointError, LayoutError, MemoryError, KeyboardInterrupt, SystemExit)):
    return False
  name = type(e).__name__
  return not (name.endswith("RuntimeError") and "Jax" in name or name == "XlaRuntimeError")


def read_checkpoint(path, reader, *args):
  """`reader(*args)`, with whatever a malformed checkpoint at `path` makes it raise (a wrong
  type, an impossible size, an undecodable name) turned into a `CheckpointError` naming it."""
  try:
    return reader(*args)
  except Exception as e:  # noqa: BLE001 - converted below, or re-raised
    if is_reader_failure(e):
      raise malformed(path, e) from e
    raise
