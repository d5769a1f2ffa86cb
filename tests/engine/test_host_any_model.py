"""The host wrappers (`jaxspec.generate`, `speculative_generate` and their streams) on a model
jaxspec did not write: a `Target(lm, params)` of a plain-JAX `CausalLM`, with texts through a
given tokenizer, n samples per prompt, and the measured cost model handed back."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec.decoding import AutoK, CostModel, Target, decode, speculative_decode
from jaxspec.drafters import DraftModel, NGram, SuffixDecoding
from jaxspec.engine.io import prepare_prompts
from jaxspec.sampling import Sampling

PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5], [9, 10, 11]]
N_NEW = 12
K = 3
SAMPLED = Sampling(temperature=1.0, top_k=20)


@dataclasses.dataclass(frozen=True)
class TinyAttnLM:
  """One attention layer over a learned position table, in plain JAX: the `CausalLM` protocol
  (vocab_size, init_cache, forward) and its optional `eos_token_ids`, no block interface."""

  vocab_size: int = 64
  dim: int = 16
  max_pos: int = 256
  eos_token_ids: tuple[int, ...] = ()

  def init_params(self, seed: int):
    ks = jax.random.split(jax.random.key(seed), 6)
    d, v = self.dim, self.vocab_size
    normal = lambda k, shape, scale: jax.random.normal(k, shape, jnp.float32) * scale  # noqa: E731
    return dict(embed=normal(ks[0], (v, d), 1.0), pos=normal(ks[1], (self.max_pos, d), 0.3),
                wq=normal(ks[2], (d, d), d ** -0.5), wk=normal(ks[3], (d, d), d ** -0.5),
                wv=normal(ks[4], (d, d), d ** -0.5), out=normal(ks[5], (d, v), 1.5 * d ** -0.5))

  def init_cache(self, params, batch_size, max_len):
    z = jnp.zeros((batch_size, max_len, self.dim), jnp.float32)
    return {"k": z, "v": z}

  def forward(self, params, tokens, cache, lengths, *, hidden_layers=()):
    b, t = tokens.shape
    pos = lengths[:, None] + jnp.arange(t)[None, :]  # [B, T]
    x = params["embed"][tokens] + params["pos"][jnp.minimum(pos, self.max_pos - 1)]
    rows = jnp.arange(b)[:, None]
    ck = cache["k"].at[rows, pos].set(x @ params["wk"], mode="drop")  # [B, S, D]
    cv = cache["v"].at[rows, pos].set(x @ params["wv"], mode="drop")
    s = jnp.einsum("btd,bsd->bts", x @ params["wq"], ck) / np.sqrt(self.dim)
    s = jnp.where(jnp.arange(ck.shape[1])[None, None, :] <= pos[:, :, None], s, -1e30)
    h = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(s, axis=-1), cv)
    return h @ params["out"], None, {"k": ck, "v": cv}


class CharTokenizer:
  """Anything with encode / decode: printable ASCII ' '..'[' as ids 4..63."""

  def encode(self, text):
    return [ord(c) - 32 + 4 for c in text]

  def decode(self, ids):
    return "".join(chr(i - 4 + 32) for i in ids if i >= 4)


class TemplateTokenizer(CharTokenizer):
  """A Hugging Face-like tokenizer: a chat template rendered by apply_chat_template, special
  ids (< 4) kept by decode unless told to skip them."""

  chat_template = "<{content}>"

  def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True):
    assert add_generation_prompt and not tokenize
    return "".join(f"<{m['content']}>" for m in messages) + "="

  def encode(self, text, add_special_tokens=True):
    return ([1] if add_special_tokens else []) + super().encode(text)

  def decode(self, ids, skip_special_tokens=False):
    return "".join(("" if skip_special_tokens else f"#{i}") if i < 4 else chr(i - 4 + 32)
                   for i in ids)


@pytest.fixture(scope="module")
def own():
  lm = TinyAttnLM()
  return Target(lm, lm.init_params(0))


@pytest.fixture(scope="module")
def small():
  lm = TinyAttnLM(dim=8)
  return Target(lm, lm.init_params(1))


def _padded(target, prompts, k=K):
  """The arrays the host wrapper builds (same width and cache size)."""
  prep = prepare_prompts(target, prompts, N_NEW, extra=k + 1)
  return jnp.asarray(prep.tokens), jnp.asarray(prep.lengths), prep.max_len


def test_own_model_through_the_host_wrappers_equals_the_functional_api(own, small):
  ids, lens, _ = _padded(own, PROMPTS, k=0)
  ref = decode(own, ids, lens, 0, max_new_tokens=N_NEW)
  host = jaxspec.generate(own, PROMPTS, max_new_tokens=N_NEW, logprobs=True)
  np.testing.assert_array_equal(host.tokens, np.asarray(ref.tokens))
  np.testing.assert_array_equal(host.lengths, np.asarray(ref.lengths))
  np.testing.assert_allclose(host.logprobs, np.asarray(ref.logprobs), atol=1e-6)
  assert host.texts is None  # no tokenizer, no texts
  ids, lens, max_len = _padded(own, PROMPTS)
  for drafter in (NGram(), "suffix", SuffixDecoding(vocab=64), DraftModel(small)):
    spec = jaxspec.speculative_generate(own, drafter, PROMPTS, max_new_tokens=N_NEW,
                                        num_draft_tokens=K)
    np.testing.assert_array_equal(spec.tokens, host.tokens)  # exact: greedy is the target's
    if isinstance(drafter, (str, SuffixDecoding)):  # the name resolved for an own model; the
      continue  # host and functional paths are the same for every drafter (the two below)
    fn = speculative_decode(own, drafter, ids, lens, 0, max_new_tokens=N_NEW,
                            num_draft_tokens=K, max_len=max_len)
    np.testing.assert_array_equal(spec.tokens, np.asarray(fn.tokens))
    assert spec.stats["tau"] == pytest.approx(fn.stats.summary()["tau"])
  # Sampled: the same draws as the functional API for the same key.
  ids, lens, _ = _padded(own, PROMPTS, k=0)
  fn = decode(own, ids, lens, 7, max_new_tokens=N_NEW, sampling=SAMPLED)
  host = jaxspec.generate(own, PROMPTS, max_new_tokens=N_NEW, sampling=SAMPLED, key=7)
  np.testing.assert_array_equal(host.tokens, np.asarray(fn.tokens))
  ids, lens, max_len = _padded(own, PROMPTS)
  fn = speculative_decode(own, NGram(), ids, lens, 7, max_new_tokens=N_NEW, num_draft_tokens=K,
                          sampling=SAMPLED, max_len=max_len)
  spec = jaxspec.speculative_generate(own, NGram(), PROMPTS, max_new_tokens=N_NEW,
                                      num_draft_tokens=K, sampling=SAMPLED, key=7)
  np.testing.assert_array_equal(spec.tokens, np.asarray(fn.tokens))
  # The streams take it too: row 0's tokens as the batch call gives them.
  streamed = [t for new, _ in jaxspec.generate_stream(own, PROMPTS[0], max_new_tokens=N_NEW)
              for t in new[0]]
  spec_streamed = [t for new, _ in jaxspec.speculative_stream(
      own, NGram(), PROMPTS[0], max_new_tokens=N_NEW, num_draft_tokens=K) for t in new[0]]
  alone = jaxspec.generate(own, [PROMPTS[0]], max_new_tokens=N_NEW)
  assert streamed == spec_streamed == alone.row(0)


@pytest.mark.slow  # an own model: the test above; the cost model passed back: test_cost_persist
def test_own_model_auto_and_its_cost_model_passed_back(own):
  ref = jaxspec.generate(own, PROMPTS, max_new_tokens=N_NEW)
  # carry=False: each call starts from the prior (as the functional API's does), so only the
  # cost model decides the k's.
  auto = AutoK(carry=False)
  out = jaxspec.speculative_generate(own, NGram(), PROMPTS, max_new_tokens=N_NEW, auto=auto)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  cm = out.stats["cost_model"]
  assert isinstance(cm, CostModel) and cm.source == "measured" and out.stats["cost_seconds"] > 0
  # A fresh engine, given the model: no timing, the same k at every step.
  again = jaxspec.engine.Engine().speculative_generate(
      own, NGram(), PROMPTS, max_new_tokens=N_NEW, num_draft_tokens="auto", cost=cm, auto=auto)
  assert again.stats["cost_seconds"] == 0.0 and again.stats["cost_model"] is cm
  assert again.stats["k_per_step"] == out.stats["k_per_step"]
  # And the functional API, given it, chooses them too.
  ids, lens, max_len = _padded(own, PROMPTS, k=8)
  fn = speculative_decode(own, NGram(), ids, lens, 0, max_new_tokens=N_NEW,
                          num_draft_tokens="auto", cost=cm, max_len=max_len)
  np.testing.assert_array_equal(np.asarray(fn.tokens), ref.tokens)
  assert fn.stats.summary()["k_per_step"] == out.stats["k_per_step"]


def test_texts_through_a_given_tokenizer(own):
  tok = CharTokenizer()
  texts = ["HELLO WORLD", "AB"]
  out = jaxspec.generate(own, texts, max_new_tokens=N_NEW, tokenizer=tok)
  ids = jaxspec.generate(own, [tok.encode(t) for t in texts], max_new_tokens=N_NEW)
  np.testing.assert_array_equal(out.tokens, ids.tokens)
  assert out.texts == [tok.decode(out.row(b)) for b in range(2)] and ids.texts is None
  spec = jaxspec.speculative_generate(own, NGram(), texts, max_new_tokens=N_NEW,
                                      num_draft_tokens=K, tokenizer=tok)
  assert spec.texts == out.texts
  # A chat template (Hugging Face's apply_chat_template): used by default, as the CLI does.
  hf = TemplateTokenizer()
  rendered = hf.encode("<HI>=", add_special_tokens=False)
  raw = hf.encode("HI")
  for chat, ids in ((None, rendered), (True, rendered), (False, raw)):
    got = jaxspec.generate(own, "HI", max_new_tokens=N_NEW, tokenizer=hf, chat=chat)
    want = jaxspec.generate(own, [ids], max_new_tokens=N_NEW)
    np.testing.assert_array_equal(got.tokens, want.tokens, err_msg=str(chat))
    assert got.prompt_lengths.tolist() == [len(ids)]
    # decode told to skip special tokens (a stop token among them): the row holds one, so
    # the text differs from the raw decoding
    assert got.texts == [hf.decode(got.row(0), skip_special_tokens=True)]
    assert got.texts[0] != hf.decode(got.row(0)), got.row(0)


def test_per_prompt_settings_with_n_samples_on_the_speculative_path(tiny_target):
  """n = 2 with settings per prompt (a logit bias on prompt 0 only, its own temperature list)
  and prompt log-probabilities: speculative decoding gives `generate`'s rows (both greedy), each
  prompt's two rows with its own settings."""
  prompts = [[5, 6, 7, 8, 5, 6, 7], [9, 10, 11]]
  sp = Sampling(temperature=(0.0, 0.0), logit_bias=[{5: 30.0}, {}])
  kw = dict(max_new_tokens=6, sampling=sp, n=2, prompt_logprobs=True, stop_ids=())
  plain = jaxspec.generate(tiny_target, prompts, **kw)
  spec = jaxspec.speculative_generate(tiny_target, NGram(), prompts, num_draft_tokens=2, **kw)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)
  assert set(plain.row(0)) == {5} and 5 not in plain.row(2)  # the bias is prompt 0's alone
  np.testing.assert_allclose(spec.prompt_logprobs, plain.prompt_logprobs, atol=1e-5)


def test_n_samples_rows_equal_the_functional_api_and_seeds(own):
  ids, lens, _ = _padded(own, PROMPTS, k=0)
  fn = decode(own, ids, lens, 5, max_new_tokens=N_NEW, sampling=SAMPLED, n=3)
  host = jaxspec.generate(own, PROMPTS, max_new_tokens=N_NEW, sampling=SAMPLED, key=5, n=3)
  assert host.tokens.shape == (6, N_NEW)
  np.testing.assert_array_equal(host.tokens, np.asarray(fn.tokens))
  np.testing.assert_array_equal(host.prompt_lengths, [9, 9, 9, 3, 3, 3])  # prompt-major
  assert len({tuple(host.row(i)) for i in range(3)}) > 1  # the samples differ
  # Sample 0 is the n = 1 call's row.
  one = jaxspec.generate(own, PROMPTS, max_new_tokens=N_NEW, sampling=SAMPLED, key=5)
  np.testing.assert_array_equal(host.tokens[::3], one.tokens)
  ids, lens, max_len = _padded(own, PROMPTS)
  fn = speculative_decode(own, NGram(), ids, lens, 5, max_new_tokens=N_NEW, num_draft_tokens=K,
                          sampling=SAMPLED, max_len=max_len, n=3)
  spec = jaxspec.speculative_generate(own, NGram(), PROMPTS, max_new_tokens=N_NEW,
                                      num_draft_tokens=K, sampling=SAMPLED, key=5, n=3)
  np.testing.assert_array_equal(spec.tokens, np.asarray(fn.tokens))
  # Per-prompt seeds: a prompt's samples do not depend on the batch or its place in it.
  both = jaxspec.generate(own, PROMPTS, max_new_tokens=N_NEW, sampling=SAMPLED, key=[11, 12],
                          n=3)
  swapped = jaxspec.generate(own, PROMPTS[::-1], max_new_tokens=N_NEW, sampling=SAMPLED,
                             key=[12, 11], n=3)
  alone = jaxspec.generate(own, [PROMPTS[1]], max_new_tokens=N_NEW, sampling=SAMPLED, key=[12],
                           n=3)
  np.testing.assert_array_equal(both.tokens[3:], swapped.tokens[:3])
  np.testing.assert_array_equal(both.tokens[3:], alone.tokens)


def test_own_model_takes_every_suffix_name(own):
  """The suffix drafters need only the vocabulary size: every name resolves for a model of the
  user's own (`prepare_spec` checks before compiling, so nothing compiles here)."""
  from jaxspec.drafters.resolve import SUFFIX_NAMES
  from jaxspec.engine.io import prepare_spec
  for name in SUFFIX_NAMES:
    req = prepare_spec(own, name, PROMPTS, max_new_tokens=N_NEW, num_draft_tokens="auto")
    assert isinstance(req.drafter, SuffixDecoding), name


def _raises(fn, match):
  with pytest.raises(ValueError, match=match):
    fn()


@pytest.mark.parametrize("call,match", [
    (lambda t: jaxspec.generate("my-model", PROMPTS), "jaxspec Model .* or a jaxspec.decoding"),
    (lambda t: jaxspec.generate(t.lm, PROMPTS), r"Target\(lm, params\)"),
    (lambda t: jaxspec.speculative_generate(t, "eagle", PROMPTS), "built from a jaxspec Model"),
    (lambda t: jaxspec.speculative_generate(t, "/no/such/draft.gguf", PROMPTS),
     "with your own model pass"),
    (lambda t: jaxspec.generate(t, ["HI"]), "tokenizer="),
    (lambda t: jaxspec.generate(t, PROMPTS, tokenizer=object()), "encode.*decode"),
    (lambda t: jaxspec.generate(t, ["HI"], tokenizer=CharTokenizer(), chat="yes"),
     "chat must be None"),
    (lambda t: jaxspec.generate(t, ["HI"], tokenizer=CharTokenizer(), chat=True), "chat=False"),
    (lambda t: jaxspec.generate(t, PROMPTS, n=0), "n must be"),
    (lambda t: jaxspec.speculative_generate(t, NGram(), PROMPTS, n=1.5), "n must be"),
    (lambda t: jaxspec.generate(t, PROMPTS, n=2, key=[1, 2, 3]), "key holds 3 per-row keys"),
    (lambda t: jaxspec.generate(t, PROMPTS, n=2, sampling=Sampling(temperature=(1.0,) * 4)),
     "2 rows"),
    (lambda t: jaxspec.speculative_generate(t, NGram(), PROMPTS, cost={"0": 1.0}),
     "from_ratios"),
])
def test_bad_arguments_are_named_errors(own, call, match):
  _raises(lambda: call(own), match)
