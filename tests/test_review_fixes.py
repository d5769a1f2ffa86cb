"""The outside review's defects, each checked where it was found: out-of-vocabulary drafts,
drafter identity, sizes that used to abort or hang, configs that loaded and then emitted NaN,
and bad API arguments. Every refusal is a ValueError (CheckpointError for files) raised
before anything compiles."""

import dataclasses
import struct
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import AutoK, DraftModel, NGram, Sampling, generate, speculative_generate
from jaxspec.drafters import Proposal
from jaxspec.api import generate_stream
from jaxspec.models.errors import CheckpointError
from jaxspec.models.loading import load
from jaxspec.api import speculative_stream
from test_checkpoints import _tiny, write_tiny_gguf

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12]]


@dataclasses.dataclass(frozen=True)
class _WildNGram(NGram):
  """An n-gram drafter gone wrong: every other draft is an id past the vocabulary (or -1)."""
  name: str = "wild-ngram"

  def propose(self, params, state, ctx, k, sp, keys):
    prop, state = super().propose(params, state, ctx, k, sp, keys)
    bad = jnp.where(jnp.arange(k) % 2 == 1, 10**6, -1)[None, :]
    tokens = jnp.where(jnp.arange(k)[None, :] % 3 == 2, prop.tokens, bad)
    return Proposal(tokens=tokens, n_valid=jnp.full_like(prop.n_valid, k)), state


def test_out_of_vocabulary_drafts_cannot_change_the_output(tiny_target):
  ref = generate(tiny_target, PROMPTS, max_new_tokens=16, stop_ids=())
  out = speculative_generate(tiny_target, _WildNGram(), PROMPTS, max_new_tokens=16,
                             num_draft_tokens=4, stop_ids=())
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  assert out.stats["acceptance_rate"] == 0.0  # the first draft is out of range: nothing counts
  sp = Sampling(temperature=1.0)
  ref = generate(tiny_target, PROMPTS, max_new_tokens=16, stop_ids=(), sampling=sp, key=4)
  out = speculative_generate(tiny_target, _WildNGram(), PROMPTS, max_new_tokens=16,
                             num_draft_tokens=4, stop_ids=(), sampling=sp, key=4)
  np.testing.assert_array_equal(out.tokens, ref.tokens)  # no NaN reached the cache


def test_draft_model_subclass_is_another_program(tiny_target):
  class Mine(DraftModel):
    pass

  a, b = DraftModel(tiny_target), Mine(tiny_target)
  assert a != b and b != a and hash(a) != hash(b)
  assert Mine(tiny_target) == b


@pytest.mark.parametrize("call,match", [
    (lambda m: generate(m, PROMPTS, max_new_tokens=10**18), "max_new_tokens"),
    (lambda m: generate(m, PROMPTS, max_new_tokens=4, max_len=10**9), "max_len"),
    (lambda m: generate(m, PROMPTS * 4000, max_new_tokens=2**24 - 64), "KV cache|positions"),
    (lambda m: speculative_generate(m, "ngram", PROMPTS, num_draft_tokens=10**6), "num_draft"),
    (lambda m: speculative_generate(m, "ngram", PROMPTS, auto=AutoK(k_max=10**6)), "k_max"),
    (lambda m: NGram(max_ngram=100000), "max_ngram"),
    (lambda m: next(generate_stream(m, PROMPTS[0], chunk=0)), "chunk"),
    (lambda m: next(speculative_stream(m, "ngram", PROMPTS[0], chunk=-1)), "chunk"),
    (lambda m: generate(m, PROMPTS, key="abc"), "key"),
    (lambda m: generate(m, PROMPTS, key=10**30), "key"),
    (lambda m: generate(m, PROMPTS, stop_ids=[2**40]), "stop_ids"),
    (lambda m: generate(m, PROMPTS, stop_ids="2"), "stop_ids"),
    (lambda m: generate("smollm2", PROMPTS), "jaxspec Model"),
    (lambda m: speculative_generate("smollm2", "ngram", PROMPTS), "jaxspec Model"),
    (lambda m: Sampling(temperature=1.0, top_k=2**31), "top_k"),
    (lambda m: Sampling(temperature=float("nan")), "temperature"),
])
def test_bad_api_arguments_fail_fast(tiny_target, call, match):
  t0 = time.perf_counter()
  with pytest.raises(ValueError, match=match):
    call(tiny_target)
  assert time.perf_counter() - t0 < 5, "refused only after compiling or allocating"


def _patch_metadata(data: bytes, key: str, fmt: str, value) -> bytes:
  """The GGUF bytes with metadata `key`'s scalar value replaced (same type and width)."""
  k = key.encode()
  at = data.index(struct.pack("<Q", len(k)) + k) + 8 + len(k) + 4  # past the key and its type
  return data[:at] + struct.pack(fmt, value) + data[at + struct.calcsize(fmt):]


def test_gguf_metadata_that_used_to_load_and_misbehave(tmp_path):
  src = tmp_path / "tiny.gguf"
  write_tiny_gguf(src, *_tiny())
  data = src.read_bytes()
  cases = {"block_count": ("llama.block_count", "<I", 2**31, "block_count"),
           "nan freq_base": ("llama.rope.freq_base", "<f", float("nan"), "freq_base"),
           "negative eps": ("llama.attention.layer_norm_rms_epsilon", "<f", -1.0, "rms_norm_eps"),
           "zero context": ("llama.context_length", "<I", 0, "max_position_embeddings")}
  for name, (key, fmt, value, match) in cases.items():
    path = tmp_path / f"{name.replace(' ', '_')}.gguf"
    path.write_bytes(_patch_metadata(data, key, fmt, value))
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=match):
      load(path)
    assert time.perf_counter() - t0 < 5, name


def test_gguf_huge_unneeded_metadata_array_is_refused_fast(tmp_path):
  """A 1,000,000-element metadata array the loader does not read (the gguf package's reader
  walks it element by element: 34 s and 950 MB) is refused at once, naming the key."""
  path = tmp_path / "junk.gguf"
  write_tiny_gguf(path, *_tiny())
  data = path.read_bytes()
  key = b"general.junk"
  n = 1_000_000
  # key, type ARRAY (9), item type INT32 (5), count, items; spliced in as the first entry.
  kv = struct.pack("<Q", len(key)) + key + struct.pack("<IIQ", 9, 5, n) + bytes(4 * n)
  n_kv = struct.unpack_from("<Q", data, 16)[0]
  path.write_bytes(data[:16] + struct.pack("<Q", n_kv + 1) + kv + data[24:])
  t0 = time.perf_counter()
  with pytest.raises(CheckpointError, match="general.junk"):
    load(path)
  assert time.perf_counter() - t0 < 5


def test_integer_seeds_over_the_whole_documented_range(tiny_target):
  """Seeds in [2**63, 2**64) are accepted (as their int64 two's complement), not an
  OverflowError from jax.random.key."""
  kw = dict(max_new_tokens=4, stop_ids=(), temperature=1.0)
  top = generate(tiny_target, PROMPTS, key=2**64 - 1, **kw)
  np.testing.assert_array_equal(top.tokens, generate(tiny_target, PROMPTS, key=-1, **kw).tokens)
  generate(tiny_target, PROMPTS, key=2**63, **kw)
