"""What the host wrappers return besides tokens: stop strings, top-N and prompt
log-probabilities, and streams of every row."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.api import generate, generate_stream, speculative_generate, speculative_stream
from jaxspec.decoding.protocol import as_target
from jaxspec.engine import core
from jaxspec.models import forward, init_cache
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 3, 4, 5, 3]]
N_NEW = 24


class PieceTokenizer:
  """A test tokenizer: id i decodes to PIECES[i % len(PIECES)], pieces of one to three
  characters, so a string can start inside one token and end inside a later one."""

  PIECES = ["a", "bc", "d", "ef", "g\n", "\n", "hij", "k", "#", "##", "l", "mn", "o", "p q",
            "r", "s"]
  eos_token_ids = ()

  def decode(self, ids, skip_special_tokens=True):
    return "".join(self.PIECES[i % len(self.PIECES)] for i in ids)


@pytest.fixture(scope="module")
def model(tiny_target):
  return dataclasses.replace(tiny_target, tokenizer=PieceTokenizer(), name="tiny-pieces")


@pytest.fixture(scope="module")
def reference(model):
  return generate(model, PROMPTS, max_new_tokens=N_NEW, stop_ids=(), logprobs=True)


def expected_cut(tok, row: list[int], stops: list[str]):
  """(tokens kept, text) of a row stopped at the first occurrence of any of `stops` in its text:
  the text ends before the stop string, the tokens with the one that completed it."""
  text = tok.decode(row)
  hits = [(text.find(s), s) for s in stops if s in text]
  if not hits:
    return len(row), text
  pos, s = min(hits)
  ends = np.cumsum([len(tok.decode([t])) for t in row])
  return int(np.searchsorted(ends, pos + len(s))) + 1, text[:pos]


def spanning_stop(tok, row: list[int], j: int) -> str:
  """A stop string that starts inside token j's text (or at it) and ends in token j + 1's."""
  a, b = tok.decode(row[j:j + 1]), tok.decode(row[j + 1:j + 2])
  return a[-1] + b[:1]


@pytest.mark.parametrize("spec", [False, True])
def test_stop_strings_cut_text_before_and_tokens_after(model, reference, spec):
  tok = model.tokenizer
  rows = [reference.row(b) for b in range(3)]
  stops = [spanning_stop(tok, rows[0], 6), spanning_stop(tok, rows[1], 12), "ZZZ"]
  run = (lambda **kw: speculative_generate(model, "ngram", PROMPTS, num_draft_tokens=3, **kw)
         ) if spec else (lambda **kw: generate(model, PROMPTS, **kw))
  out = run(max_new_tokens=N_NEW, stop_ids=(), stop=stops, logprobs=True)
  for b in range(3):
    n, text = expected_cut(tok, rows[b], stops)
    assert out.lengths[b] == n
    assert out.row(b) == rows[b][:n]
    assert (out.tokens[b, n:] == -1).all() and (out.logprobs[b, n:] == 0).all()
    np.testing.assert_allclose(out.logprobs[b, :n], reference.logprobs[b, :n], atol=1e-5)
    assert out.texts[b] == text
    assert out.stop_reasons[b] == (None if n == len(rows[b]) else
                                   min((s for s in stops if s in tok.decode(rows[b])),
                                       key=tok.decode(rows[b]).find))
  assert out.lengths[0] <= 8 and out.stop_reasons[0] is not None  # the row's text held it


def test_loop_ends_early_once_every_row_has_stopped(model, reference):
  tok = model.tokenizer
  # Every row's third token completes one of these.
  stops = [spanning_stop(tok, reference.row(b), 1) for b in range(3)]
  out = generate(model, PROMPTS, max_new_tokens=96, stop_ids=(), stop=stops)
  assert all(r is not None for r in out.stop_reasons)
  assert (out.lengths <= 3).all()
  # One chunk of checks after the prefill: the loop did not run to 96 tokens.
  assert out.stats["target_passes"] == core.STOP_CHECK_STEPS + 1
  spec = speculative_generate(model, "ngram", PROMPTS, num_draft_tokens=3, max_new_tokens=96,
                              stop_ids=(), stop=stops)
  np.testing.assert_array_equal(spec.tokens, out.tokens)
  assert spec.stats["target_passes"] <= core.STOP_CHECK_PASSES


class SpecialPieceTokenizer(PieceTokenizer):
  """PieceTokenizer whose ids 6, 22, ... ("hij") are special tokens: kept in the text unless
  decode is told to skip them, as Hugging Face's decode does."""

  def decode(self, ids, skip_special_tokens=False):
    return super().decode([i for i in ids if not (skip_special_tokens and i % 16 == 6)])


@pytest.mark.parametrize("spec", [False, True])
def test_stop_strings_are_matched_in_the_outputs_text(tiny_target, spec):
  """A stop string that only a special token's text holds does not stop a row: it is matched
  in the text the output shows (special tokens skipped), not in the raw decoding."""
  model = dataclasses.replace(tiny_target, tokenizer=SpecialPieceTokenizer(), name="tiny-special")
  run = (lambda **kw: speculative_generate(model, "ngram", PROMPTS, num_draft_tokens=3, **kw)
         ) if spec else (lambda **kw: generate(model, PROMPTS, **kw))
  free = run(max_new_tokens=N_NEW, stop_ids=())
  assert any(t % 16 == 6 for b in range(3) for t in free.row(b))  # a special token was made
  out = run(max_new_tokens=N_NEW, stop_ids=(), stop=["hij"])
  np.testing.assert_array_equal(out.tokens, free.tokens)
  assert out.stop_reasons == [None] * 3 and out.texts == free.texts
  assert all("hij" not in t for t in out.texts)


@pytest.mark.parametrize("stop,match", [
    ([""], "non-empty"), (["ok", 3], "a string or a list of strings"), (7, "stop_ids")])
def test_bad_stop_strings(model, stop, match):
  with pytest.raises(ValueError, match=match):
    generate(model, PROMPTS, max_new_tokens=4, stop=stop)


@pytest.mark.parametrize("bad", [-1, 129, "3"])
def test_bad_logprobs_fail_before_compiling(model, bad):
  for call in (lambda: generate(model, PROMPTS, max_new_tokens=4, logprobs=bad),
               lambda: speculative_generate(model, "ngram", PROMPTS, max_new_tokens=4,
                                            logprobs=bad),
               lambda: next(generate_stream(model, PROMPTS, max_new_tokens=4, logprobs=bad))):
    with pytest.raises(ValueError, match=r"logprobs must be True/False or an int N in \[0, 128\]"):
      call()


def test_stop_strings_need_a_tokenizer(tiny_target):
  with pytest.raises(ValueError, match="no tokenizer: pass stop_ids"):
    generate(tiny_target, PROMPTS, max_new_tokens=4, stop="\n\n")
  with pytest.raises(ValueError, match="no tokenizer: pass stop_ids"):
    speculative_generate(tiny_target, "ngram", PROMPTS, max_new_tokens=4, stop=["\n\n"])


def test_prompt_logprobs_equal_a_dense_recomputation(model):
  sp = Sampling(temperature=0.8)
  out = generate(model, PROMPTS, max_new_tokens=2, sampling=sp, prompt_logprobs=True)
  p = max(map(len, PROMPTS))
  assert out.prompt_logprobs.shape == (3, p)
  toks = jnp.asarray([r + [0] * (p - len(r)) for r in PROMPTS])
  logits = forward(model.params, toks, init_cache(model.cfg, 3, p), model.cfg)[0]
  lp = np.asarray(jax.nn.log_softmax(logits / 0.8, axis=-1))
  for b, row in enumerate(PROMPTS):
    want = [0.0] + [lp[b, t - 1, row[t]] for t in range(1, len(row))] + [0.0] * (p - len(row))
    np.testing.assert_allclose(out.prompt_logprobs[b], want, atol=2e-5)
  spec = speculative_generate(model, "ngram", PROMPTS, max_new_tokens=2, sampling=sp,
                              num_draft_tokens=2, prompt_logprobs=True)
  np.testing.assert_allclose(spec.prompt_logprobs, out.prompt_logprobs, atol=1e-6)
  assert generate(model, PROMPTS, max_new_tokens=2).prompt_logprobs is None


def test_host_top_n_speculative_equals_plain(model):
  plain = generate(model, PROMPTS, max_new_tokens=12, stop_ids=(), logprobs=4)
  spec = speculative_generate(model, "ngram", PROMPTS, max_new_tokens=12, stop_ids=(),
                              num_draft_tokens=3, logprobs=4)
  assert plain.top_ids.shape == (3, 12, 4)
  np.testing.assert_array_equal(plain.top_ids[:, :, 0], plain.tokens)
  np.testing.assert_array_equal(spec.top_ids, plain.top_ids)
  np.testing.assert_allclose(spec.top_logprobs, plain.top_logprobs, atol=2e-5)


def _joined(stream, b: int):
  rows, lps, infos = [[] for _ in range(b)], [[] for _ in range(b)], []
  for new, info in stream:
    assert len(new) == b
    for r in range(b):
      rows[r] += new[r]
      lps[r] += info.get("logprobs", [[]] * b)[r]
      assert len(info.get("logprobs", new)[r]) == len(new[r])
    infos.append(info)
  return rows, lps, infos


@pytest.mark.parametrize("spec", [False, True])
def test_streams_yield_every_row(model, reference, spec):
  if spec:
    stream = speculative_stream(model, "ngram", PROMPTS, max_new_tokens=N_NEW, stop_ids=(),
                                num_draft_tokens=3, chunk=2, logprobs=True)
  else:
    stream = generate_stream(model, PROMPTS, max_new_tokens=N_NEW, stop_ids=(), chunk=5,
                             logprobs=True)
  rows, lps, infos = _joined(stream, 3)
  assert len(infos) > 2
  for b in range(3):
    assert rows[b] == reference.row(b)
    np.testing.assert_allclose(lps[b], reference.logprobs[b, :len(rows[b])], atol=1e-5)
  public = {"first_chunk_seconds", "seconds", "compile_seconds", "cost_seconds", "cost_source",
            "done", "stats", "logprobs", "top_ids", "top_logprobs", "output"}
  for info in infos:
    assert set(info) <= public, set(info) - public
    assert "state" not in info
  assert infos[-1]["done"] == [True] * 3 and "output" in infos[-1]
  assert all("output" not in i for i in infos[:-1])
  np.testing.assert_array_equal(infos[-1]["output"].tokens, reference.tokens)


def test_stream_with_stop_strings_and_top_n(model, reference):
  tok = model.tokenizer
  stops = [spanning_stop(tok, reference.row(1), 4)]
  want = generate(model, PROMPTS, max_new_tokens=N_NEW, stop_ids=(), stop=stops, logprobs=3)
  rows, _, infos = _joined(generate_stream(model, PROMPTS, max_new_tokens=N_NEW, stop_ids=(),
                                           chunk=3, stop=stops, logprobs=3), 3)
  for b in range(3):
    assert rows[b] == want.row(b)
  out = infos[-1]["output"]
  assert out.texts == want.texts and out.stop_reasons == want.stop_reasons
  np.testing.assert_array_equal(out.top_ids, want.top_ids)
  first = [i for i in infos if i.get("top_ids") and i["top_ids"][0]][0]
  assert np.asarray(first["top_ids"][0]).shape[1] == 3


def test_old_argument_orders_warn_and_still_work(tiny_target):
  """Model first everywhere: load_head(target, name) and verify(lm, params, ...); the orders
  before issue 49 still run, with a DeprecationWarning naming the new one."""
  from jaxspec import heads
  from jaxspec.decoding import verify
  from jaxspec.models.errors import CheckpointError
  from jaxspec.sampling import sampling_arrays
  installed = (heads.ASSETS / "eagle" / "config.json").exists()
  refused = "trained for a target" if installed else "train one"
  # The bundled head is SmolLM2's: refused for the tiny target, in either order.
  with pytest.raises(CheckpointError, match=refused):
    heads.load_head(tiny_target, "eagle")
  with pytest.warns(DeprecationWarning, match=r"load_head\(target, dir_or_name\)"):
    with pytest.raises(CheckpointError, match=refused):
      heads.load_head("eagle", tiny_target)
  cfg, params = tiny_target.cfg, tiny_target.params
  cache = init_cache(cfg, 2, 16)
  last, drafts = jnp.asarray([5, 7]), jnp.asarray([[1, 2], [3, 4]])
  sp = sampling_arrays(None, 2)
  p_new = verify(cfg, params, cache, last, drafts, sp)[0]
  with pytest.warns(DeprecationWarning, match=r"verify\(lm, params, cache, last, drafts, sp\)"):
    p_old = verify(params, cache, last, drafts, cfg, sp)[0]
  np.testing.assert_array_equal(p_new, p_old)


class EncodingPieceTokenizer(PieceTokenizer):
  """PieceTokenizer with the `encode` a `tokenizer=` argument needs (one id per character)."""

  def encode(self, text):
    return [ord(c) % 16 for c in text]


@pytest.mark.parametrize("spec", [False, True])
def test_own_model_takes_stop_strings_and_top_n_with_tokenizer(model, reference, spec):
  """Stop strings, top-N and prompt log-probabilities of an own `Target` (decoded with
  `tokenizer=`) equal the Model's, on a bucketed batch (3 rows padded to 4)."""
  own = as_target(model)
  stops = [spanning_stop(model.tokenizer, reference.row(1), 4)]
  args = dict(max_new_tokens=N_NEW, stop_ids=(), stop=stops, logprobs=3, prompt_logprobs=True)
  if spec:
    call = lambda m, **kw: speculative_generate(m, "ngram", PROMPTS, num_draft_tokens=3,
                                                **args, **kw)
  else:
    call = lambda m, **kw: generate(m, PROMPTS, **args, **kw)
  want, got = call(model), call(own, tokenizer=EncodingPieceTokenizer())
  assert want.stop_reasons[1] == stops[0] and want.lengths[1] < N_NEW
  assert got.texts == want.texts and got.stop_reasons == want.stop_reasons
  assert got.top_ids.shape == (3, N_NEW, 3) and got.prompt_logprobs.shape == (3, 8)
  for f in ("tokens", "lengths", "top_ids"):
    np.testing.assert_array_equal(getattr(got, f), getattr(want, f))
  for f in ("logprobs", "top_logprobs", "prompt_logprobs"):
    np.testing.assert_allclose(getattr(got, f), getattr(want, f), atol=1e-5)
  with pytest.raises(ValueError, match="no tokenizer: pass stop_ids"):
    call(own)


@pytest.mark.parametrize("spec", [False, True])
def test_streams_take_n_samples_per_prompt(model, spec):
  """A stream with n yields the B * n sample rows `generate(..., n=n)` returns, prompt-major."""
  args = dict(max_new_tokens=N_NEW, stop_ids=(), sampling=Sampling(temperature=1.0), key=7,
              n=2, logprobs=2)
  if spec:
    want = speculative_generate(model, "ngram", PROMPTS[:2], num_draft_tokens=3, **args)
    stream = speculative_stream(model, "ngram", PROMPTS[:2], num_draft_tokens=3, chunk=2, **args)
  else:
    want = generate(model, PROMPTS[:2], **args)
    stream = generate_stream(model, PROMPTS[:2], chunk=5, **args)
  rows, lps, infos = _joined(stream, 4)
  assert want.tokens.shape == (4, N_NEW)
  for b in range(4):
    assert rows[b] == want.row(b)
    np.testing.assert_allclose(lps[b], want.logprobs[b, :len(rows[b])], atol=1e-5)
  out = infos[-1]["output"]
  np.testing.assert_array_equal(out.tokens, want.tokens)
  np.testing.assert_array_equal(out.top_ids, want.top_ids)
