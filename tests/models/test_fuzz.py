"""A small, seeded fuzz of the checkpoint readers: truncations and single-byte flips of a tiny
GGUF file and of a tiny Hugging Face directory (safetensors weights, config.json). Every
outcome must be a clean load or a `CheckpointError`, never another exception, a crash or a
large allocation (each attempt's Python-side peak, numpy's arrays included, is bounded)."""

import json
import shutil
import tracemalloc

import numpy as np
import pytest

from jaxspec.models.errors import CheckpointError
from jaxspec.models.hf_loader import save_hf
from jaxspec.models.loading import load
from helpers import tiny_checkpoint, write_tiny_gguf

PEAK_BYTES = 64 << 20  # the tiny checkpoints are a few hundred KB; a garbage size must not pass
FLIPS = 80
CUTS = 24


def _attempt(path) -> str:
  """'ok' or 'error' for one load; anything else fails the test (with the input named)."""
  tracemalloc.start()
  try:
    load(path)
    return "ok"
  except CheckpointError:
    return "error"
  finally:
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < PEAK_BYTES, f"{path}: {peak / 2**20:.0f} MB allocated"


def _mutations(data: bytes, rng):
  """(name, bytes): truncations at spread and random points, then single-byte flips (most in
  the header, where sizes and offsets live)."""
  n = len(data)
  cuts = sorted(set(np.linspace(0, n - 1, CUTS // 2, dtype=int).tolist()
                    + rng.integers(0, n, CUTS // 2).tolist()))
  for c in cuts:
    yield f"cut@{c}", data[:c]
  head = min(n, 4096)
  for i in range(FLIPS):
    pos = int(rng.integers(0, head if i % 4 else n))
    b = bytearray(data)
    b[pos] ^= int(rng.integers(1, 256))
    yield f"flip@{pos}", bytes(b)


def test_fuzz_gguf(tmp_path):
  src = tmp_path / "tiny.gguf"
  write_tiny_gguf(src, *tiny_checkpoint())
  data = src.read_bytes()
  rng = np.random.default_rng(0)
  outcomes = {"ok": 0, "error": 0}
  target = tmp_path / "m.gguf"
  for name, blob in _mutations(data, rng):
    target.write_bytes(blob)
    try:
      outcomes[_attempt(target)] += 1
    except AssertionError:
      raise
    except Exception as e:  # noqa: BLE001 - the point of the test
      pytest.fail(f"{name}: {type(e).__name__}: {e}")
  assert outcomes["error"] >= CUTS - 2, outcomes  # truncations are refused


@pytest.mark.parametrize("which", ["model.safetensors", "config.json"])
def test_fuzz_hf_directory(tmp_path, which):
  src = tmp_path / "src"
  save_hf(tiny_checkpoint(), src)
  data = (src / which).read_bytes()
  rng = np.random.default_rng(1 if which == "config.json" else 2)
  outcomes = {"ok": 0, "error": 0}
  work = tmp_path / "work"
  for name, blob in _mutations(data, rng):
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(src, work)
    (work / which).write_bytes(blob)
    try:
      outcomes[_attempt(work)] += 1
    except AssertionError:
      raise
    except Exception as e:  # noqa: BLE001
      pytest.fail(f"{which} {name}: {type(e).__name__}: {e}")
  assert outcomes["error"] > 0, outcomes


def test_fuzz_config_values(tmp_path):
  """Well-formed JSON with wrong values (the review's list): each refused with a
  CheckpointError naming the field."""
  src = tmp_path / "src"
  save_hf(tiny_checkpoint(), src)
  base = json.loads((src / "config.json").read_text())
  bad = {"rope_theta": float("nan"), "rms_norm_eps": -1.0, "tie_word_embeddings": "false",
         "eos_token_id": 2**40, "max_position_embeddings": 0, "num_hidden_layers": 2**31,
         "hidden_size": "big", "vocab_size": None, "rope_scaling": {"rope_type": "llama3",
                                                                   "factor": 0.0},
         "num_attention_heads": [4]}
  for field, value in bad.items():
    (src / "config.json").write_text(json.dumps(base | {field: value}))
    with pytest.raises(CheckpointError) as e:
      load(src)
    named = {"num_hidden_layers": "num_layers"}.get(field, field)  # LlamaConfig's name
    assert named in str(e.value), (field, e.value)
