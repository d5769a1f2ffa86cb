"""Tokenizers: SmolLM2's GGUF tokenizer against Hugging Face's ids, chat templates, streaming."""

from __future__ import annotations

import json

import gguf
import jinja2
import numpy as np
import pytest
import tokenizers
from jinja2.exceptions import SecurityError

from jaxspec.models.errors import CheckpointError
from jaxspec.models.loading import bundled_gguf_path
from jaxspec.models.tokenizer import StreamDecoder, Tokenizer
from helpers import REFERENCE

USER_START, END = "<|im_start|>user\n", "<|im_end|>"
# Multi-byte characters that byte-level BPE splits across tokens.
UNICODE_TEXT = "naïve café, 東京タワー 🙂🚀 — Ünïcödé ∑x² → ✓ 👍🏽 done"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
  return Tokenizer.from_gguf(gguf.GGUFReader(bundled_gguf_path()).fields)


@pytest.fixture(scope="module")
def reference():
  if not REFERENCE.is_file():
    pytest.skip(f"Hugging Face reference {REFERENCE} is absent (it lives in the shared folder)")
  with np.load(REFERENCE, allow_pickle=False) as z:
    return {k: z[k] for k in ("prompt_text", "prompt_ids", "prompt_len")}


def _user_message(prompt: str) -> str:
  start = prompt.index(USER_START) + len(USER_START)
  return prompt[start:prompt.index(END, start)]


def test_encode_matches_hugging_face(tok, reference):
  for i, text in enumerate(reference["prompt_text"]):
    expected = reference["prompt_ids"][i, :reference["prompt_len"][i]].tolist()
    assert tok.encode(str(text)) == expected, f"prompt {i}"


def test_chat_template_reproduces_prompts(tok, reference):
  for i, text in enumerate(reference["prompt_text"]):
    user = _user_message(str(text))
    assert tok.apply_chat_template([{"role": "user", "content": user}]) == str(text), f"prompt {i}"
    expected = reference["prompt_ids"][i, :reference["prompt_len"][i]].tolist()
    assert tok.encode_chat(user) == expected, f"prompt {i}"


def test_smollm_tokenizer_basics(tok):
  assert tok.vocab_size == 49152
  assert tok.eos_token_ids == (2,) and tok.bos_token_id == 1 and not tok.add_bos
  assert tok.encode("<|im_start|>user<|im_end|>") == [1, tok.token_to_id("user"), 2]
  assert tok.encode("2024") == [tok.token_to_id(d) for d in "2024"]  # digits one by one
  assert tok.decode(tok.encode("<|im_start|>hi<|im_end|>")) == "hi"
  assert tok.decode(tok.encode("<|im_start|>hi"), skip_special_tokens=False) == "<|im_start|>hi"
  assert tok.decode(tok.encode(UNICODE_TEXT)) == UNICODE_TEXT
  assert tok.decode(np.array(tok.encode("  two  spaces\n\ttab"))) == "  two  spaces\n\ttab"
  assert tok.encode("hi", add_bos=True)[0] == 1


def test_chat_template_with_system_and_history(tok):
  msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
          {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
  assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
      "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n")
  assert tok.encode_chat(msgs) == tok.encode(tok.apply_chat_template(msgs))


def test_stream_decoder_never_splits_characters(tok):
  ids = tok.encode(UNICODE_TEXT)
  # The test means something only if some token alone is half a character.
  assert any("\ufffd" in tok.decode([i]) for i in ids)
  stream = StreamDecoder(tok)
  pieces = [stream.push(i) for i in ids] + [stream.flush()]
  assert "".join(pieces) == UNICODE_TEXT
  assert not any("\ufffd" in p for p in pieces)
  assert "" in pieces[:-1]  # something was held back until its character was complete
  assert "".join(tok.decode_stream(ids)) == UNICODE_TEXT
  assert "".join(tok.decode_stream(tok.encode("<|im_start|>a b<|im_end|>"))) == "a b"


def test_template_is_sandboxed_and_can_raise(tok):
  raising = Tokenizer(tok.backend, chat_template="{{ raise_exception('only user turns') }}")
  with pytest.raises(jinja2.TemplateError, match="only user turns"):
    raising.apply_chat_template([{"role": "user", "content": "x"}])
  escaping = Tokenizer(tok.backend,
                       chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
  with pytest.raises(SecurityError):
    escaping.apply_chat_template([{"role": "user", "content": "x"}])
  fancy = Tokenizer(tok.backend, bos_token="<|im_start|>", chat_template=(
      "{{ bos_token }}{% for m in messages %}{% generation %}{{ m | tojson }}"
      "{% endgeneration %}{% endfor %}"))
  assert fancy.apply_chat_template([{"role": "user", "content": "é"}]) == (
      '<|im_start|>{"role": "user", "content": "é"}')


def test_no_chat_template(tok):
  plain = Tokenizer(tok.backend, eos_token="<|im_end|>")
  with pytest.raises(ValueError, match="no chat template"):
    plain.apply_chat_template([{"role": "user", "content": "x"}])
  assert plain.encode_chat("hello there") == plain.encode("hello there")
  assert plain.eos_token_ids == (2,)


def test_from_hf_dir(tok, tmp_path):
  tok.backend.save(str(tmp_path / "tokenizer.json"))
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>"},
      "chat_template": tok.chat_template}))
  hf = Tokenizer.from_hf_dir(tmp_path, eos_token_ids=[0])
  assert hf.encode(UNICODE_TEXT) == tok.encode(UNICODE_TEXT)
  msgs = [{"role": "user", "content": "hi"}]
  assert hf.apply_chat_template(msgs) == tok.apply_chat_template(msgs)
  assert hf.eos_token_ids == (2, 0) and not hf.add_bos
  # No chat_template in the config: chat_template.jinja; no add_bos_token: the post-processor.
  (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>"}))
  (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
  backend = tokenizers.Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
  backend.post_processor = tokenizers.processors.TemplateProcessing(
      single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)])
  backend.save(str(tmp_path / "tokenizer.json"))
  hf = Tokenizer.from_hf_dir(tmp_path)
  assert hf.add_bos and hf.encode("hi") == [1] + tok.encode("hi")
  assert hf.apply_chat_template(msgs) == "hi!"
  assert hf.encode_chat("hi") == tok.encode("hi!")  # the template owns BOS: none added


def test_from_hf_dir_errors(tmp_path):
  with pytest.raises(CheckpointError, match="no tokenizer.json"):
    Tokenizer.from_hf_dir(tmp_path)
  (tmp_path / "tokenizer.json").write_text("{broken")
  with pytest.raises(CheckpointError, match="not a valid tokenizers file"):
    Tokenizer.from_hf_dir(tmp_path)


def _spm_fields():
  """GGUF metadata of a tiny SentencePiece ("llama") vocabulary with byte fallback."""
  tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
  types = [2, 3, 3] + [6] * 256
  scores = [0.0] * len(tokens)
  pieces = {"▁": -1, "h": -2, "e": -3, "l": -4, "o": -5, "w": -6, "r": -7, "d": -8,
            "he": -9, "ll": -10, "▁he": -11, "▁hell": -12, "or": -13, "▁w": -14}
  for piece, score in pieces.items():
    tokens.append(piece)
    types.append(1)
    scores.append(float(score))
  return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": tokens,
          "tokenizer.ggml.token_type": types, "tokenizer.ggml.scores": scores,
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
          "tokenizer.ggml.unknown_token_id": 0}


def test_sentencepiece_gguf_tokenizer():
  fields = _spm_fields()
  spm = Tokenizer.from_gguf(fields)
  assert spm.add_bos and spm.eos_token_ids == (2,)
  ids = spm.encode("hello world")
  pieces = [spm.id_to_token(i) for i in ids]
  assert pieces[0] == "<s>" and "▁hell" in pieces and "▁w" in pieces
  assert spm.decode(ids) == "hello world"
  ids = spm.encode("hé")  # é is not a piece: its two UTF-8 bytes via byte fallback
  assert [spm.id_to_token(i) for i in ids[-2:]] == ["<0xC3>", "<0xA9>"]
  assert spm.decode(ids) == "hé"
  assert "".join(spm.decode_stream(spm.encode("hé hello"))) == "hé hello"


def test_a_sentencepiece_piece_too_long_to_convert_is_refused_quickly():
  """One piece of a million characters: building the merges tries every split (quadratic: about
  two minutes, from 0.13 s at 31,623 characters); refused as a corrupt file first, naming it."""
  import time
  from jaxspec.models.errors import CheckpointError
  fields = _spm_fields()
  for key, value in (("tokenizer.ggml.tokens", "▁" + "l" * 1_000_000),
                     ("tokenizer.ggml.token_type", 1), ("tokenizer.ggml.scores", -20.0)):
    fields[key] = fields[key] + [value]
  start = time.perf_counter()
  with pytest.raises(CheckpointError, match=r"the longest has 1,000,001 characters"):
    Tokenizer.from_gguf(fields)
  assert time.perf_counter() - start < 5.0


def test_unsupported_gguf_tokenizers():
  fields = _spm_fields()
  with pytest.raises(CheckpointError, match="tokenizer model 'bert' is not supported"):
    Tokenizer.from_gguf(fields | {"tokenizer.ggml.model": "bert"})
  bpe = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
         "tokenizer.ggml.merges": ["a b"], "tokenizer.ggml.pre": "deepseek-coder"}
  with pytest.raises(CheckpointError, match="pre-tokenizer 'deepseek-coder' is not supported"):
    Tokenizer.from_gguf(bpe)
  for pre in ("gpt-2", "default", "llama-bpe", "qwen2", "smollm"):
    assert Tokenizer.from_gguf(bpe | {"tokenizer.ggml.pre": pre}).encode("abab") == [2, 2], pre
  with pytest.raises(CheckpointError, match="has no tokenizer"):
    Tokenizer.from_gguf({})
