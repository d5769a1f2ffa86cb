"""One set of defaults across the host wrappers and the functional API: rows stop at the
model's EOS ids, positions past a row's end hold -1, a padded [B, P] array takes its
prompt_lengths, and a string is encoded alike in Python (`chat=`) and on the CLI."""

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.decoding import Target, decode, speculative_decode
from jaxspec.drafters import NGram
from jaxspec.engine.io import prepare_prompts
from jaxspec.models.llama import LlamaLM
from jaxspec.models.model import Model
from helpers import tiny_checkpoint, write_tiny_gguf

PROMPTS = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11]]
N_NEW = 12


def _arrays(target, prompts=PROMPTS, extra=0):
  prep = prepare_prompts(target, prompts, N_NEW, extra=extra)
  return jnp.asarray(prep.tokens), jnp.asarray(prep.lengths), prep.max_len


@pytest.fixture(scope="module")
def stop_model(tiny_target):
  """The tiny target with an EOS id its greedy rows emit mid-row (a random model's configured
  EOS may never come): (model, eos id, the rows run past it)."""
  free = Model(dataclasses.replace(tiny_target.cfg, eos_token_ids=()), tiny_target.params,
               name="no-eos")
  ids, lens, _ = _arrays(free)
  full = np.asarray(decode(free, ids, lens, 0, max_new_tokens=N_NEW).tokens)
  eos = int(full[0, 3])
  cfg = dataclasses.replace(tiny_target.cfg, eos_token_ids=(eos,))
  return Model(cfg, tiny_target.params, name="eos-model"), eos, full


def test_functional_api_stops_at_the_models_eos_and_pads_with_minus_one(stop_model):
  model, eos, full = stop_model
  ids, lens, _ = _arrays(model)
  out = decode(model, ids, lens, 0, max_new_tokens=N_NEW)
  lengths = np.asarray(out.lengths)
  tokens = np.asarray(out.tokens)
  for b in range(2):
    hits = np.flatnonzero(full[b] == eos)
    want = int(hits[0]) + 1 if hits.size else N_NEW
    assert lengths[b] == want, b
    np.testing.assert_array_equal(tokens[b, :want], full[b, :want])
    assert (tokens[b, want:] == -1).all()  # the host wrappers' padding
  assert lengths[0] <= 4 < N_NEW
  # The host wrapper's defaults are the same: equal arrays, padding included.
  host = jaxspec.generate(model, PROMPTS, max_new_tokens=N_NEW)
  np.testing.assert_array_equal(host.tokens, tokens)
  # Its Llama as a Target declares the same ids (CausalLM's optional eos_token_ids).
  as_target = decode(Target(LlamaLM(model.cfg), model.params), ids, lens, 0,
                     max_new_tokens=N_NEW)
  np.testing.assert_array_equal(np.asarray(as_target.tokens), tokens)
  # stop_ids=() runs past EOS; pad_id= still writes another padding.
  np.testing.assert_array_equal(
      np.asarray(decode(model, ids, lens, 0, max_new_tokens=N_NEW, stop_ids=()).tokens), full)
  padded = np.asarray(decode(model, ids, lens, 0, max_new_tokens=N_NEW, pad_id=0).tokens)
  assert (padded[0, lengths[0]:] == 0).all()
  # speculative_decode too, equal to the speculative host wrapper.
  ids, lens, max_len = _arrays(model, extra=3 + 1)
  spec = speculative_decode(model, NGram(), ids, lens, 0, max_new_tokens=N_NEW,
                            num_draft_tokens=3, max_len=max_len)
  np.testing.assert_array_equal(np.asarray(spec.tokens), tokens)
  host = jaxspec.speculative_generate(model, NGram(), PROMPTS, max_new_tokens=N_NEW,
                                      num_draft_tokens=3)
  np.testing.assert_array_equal(host.tokens, tokens)


def test_prompt_lengths_with_a_padded_array(tiny_target):
  arr = np.zeros((2, 9), np.int32)
  for b, p in enumerate(PROMPTS):
    arr[b, :len(p)] = p
  ref = jaxspec.generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, stop_ids=())
  got = jaxspec.generate(tiny_target, arr, max_new_tokens=N_NEW, stop_ids=(),
                         prompt_lengths=np.array([7, 3]))
  np.testing.assert_array_equal(got.tokens, ref.tokens)
  np.testing.assert_array_equal(got.prompt_lengths, [7, 3])
  # Without them every column is a token: other rows (the zeros are read as prompt).
  whole = jaxspec.generate(tiny_target, arr, max_new_tokens=N_NEW, stop_ids=())
  np.testing.assert_array_equal(whole.prompt_lengths, [9, 9])
  spec = jaxspec.speculative_generate(tiny_target, NGram(), arr, max_new_tokens=N_NEW,
                                      stop_ids=(), num_draft_tokens=3, prompt_lengths=[7, 3])
  np.testing.assert_array_equal(spec.tokens, ref.tokens)


@pytest.mark.parametrize("lengths,match", [
    ([7], "1 lengths for 2 prompts"),
    ([7, 10], "longer than prompt 1's"),
    ([7, 0], ">= 1"),
    ([7.0, 3.0], "one integer per prompt"),
    (7, "one integer per prompt"),
])
def test_bad_prompt_lengths_are_named_errors(tiny_target, lengths, match):
  arr = np.ones((2, 9), np.int32)
  with pytest.raises(ValueError, match=match):
    jaxspec.generate(tiny_target, arr, max_new_tokens=4, prompt_lengths=lengths)


def test_strings_are_encoded_alike_in_python_and_on_the_cli(tmp_path, capsys):
  """A string goes through the chat template by default in both (chat=None / no flag), as it
  is with chat=False / --no-chat; chat=True / --chat needs a template."""
  from jaxspec.cli.app import main
  gguf = tmp_path / "tiny.gguf"
  write_tiny_gguf(gguf, *tiny_checkpoint())
  model = jaxspec.load(str(gguf))
  tok = model.tokenizer
  assert tok.chat_template is not None and tok.encode_chat("hello") != tok.encode("hello")
  kw = dict(max_new_tokens=4, stop_ids=())
  for chat, flags, ids in ((None, [], tok.encode_chat("hello")),
                           (True, ["--chat"], tok.encode_chat("hello")),
                           (False, ["--no-chat"], tok.encode("hello"))):
    py = jaxspec.generate(model, "hello", chat=chat, **kw)
    np.testing.assert_array_equal(py.tokens, jaxspec.generate(model, [ids], **kw).tokens)
    assert py.prompt_lengths.tolist() == [len(ids)]
    assert main(["generate", "hello", "--model", str(gguf), "--draft", "none", "--json",
                 "--max-new-tokens", "4", *flags]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # The CLI stops at EOS; its tokens are the Python call's up to its length.
    assert rec["token_ids"] == py.row(0)[:len(rec["token_ids"])], (chat, flags)
  with pytest.raises(SystemExit) as e:
    main(["generate", "hello", "--model", str(gguf), "--chat", "--no-chat"])
  assert e.value.code == 2 and "not allowed with argument --chat" in capsys.readouterr().err
