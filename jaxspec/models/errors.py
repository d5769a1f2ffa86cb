"""Errors raised while reading checkpoints and tokenizers."""

from __future__ import annotations

import json
from pathlib import Path


class CheckpointError(ValueError):
  """A checkpoint (GGUF or Hugging Face directory) is missing, malformed or unsupported.

  The message names the file, what is wrong with it and, where there is one, the fix.
  """


class LayoutError(ValueError):
  """The weights being read do not fit the requested layout (a mesh axis that does not divide
  the heads, the MLP width or the vocabulary): the checkpoint is fine, the placement is not."""


def read_json(path: str | Path) -> dict:
  """The parsed JSON object of a checkpoint's file (config.json, an index); a file that cannot
  be read, is not UTF-8 JSON, nests too deeply or holds something other than an object is a
  CheckpointError naming it."""
  try:
    value = json.loads(Path(path).read_text(encoding="utf-8"))
  except OSError as e:
    raise CheckpointError(f"{path} cannot be read ({e.strerror or e})") from e
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{path} is not valid JSON: {e}") from e
  except RecursionError as e:
    raise CheckpointError(f"{path} is not valid JSON: nested too deeply") from e
  if not isinstance(value, dict):
    raise CheckpointError(f"{path} holds a JSON {type(value).__name__}, not an object"
                          " ({...}): the file is corrupt or not this checkpoint's")
  return value


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


def refuse_nonfinite(x, tensor: str, where) -> None:
  """Raises a `CheckpointError` naming `tensor` when float array `x` holds a NaN or an infinity.

  Called on each tensor as a loader converts it, so the check reads memory the conversion just
  wrote: one sum over `x` (any NaN or infinity makes it non-finite), and only when the sum is
  not finite a look at the values themselves (a sum of large finite values may overflow).
  """
  import numpy as np  # kept out of the module's imports: errors.py is imported everywhere
  with np.errstate(over="ignore", invalid="ignore"):
    total = np.add.reduce(x, axis=None)
  if np.isfinite(total):
    return
  bad = ~np.isfinite(x)
  n = int(np.count_nonzero(bad))
  if not n:
    return
  first = tuple(int(i) for i in np.unravel_index(int(np.argmax(bad)), x.shape))
  raise CheckpointError(
      f"{where}: tensor {tensor!r} holds {n} non-finite values of {x.size} ({x[first]} at index"
      f" {list(first)}); the weights are corrupt: re-download or re-convert the checkpoint, or"
      " pass allow_nonfinite=True to load them as they are")
