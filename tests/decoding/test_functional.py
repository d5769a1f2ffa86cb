"""The functional core (`jaxspec.decoding.speculative_decode` / `decode`): pure functions that run
inside a user's `jax.jit`, `jax.vmap` and `lax.scan`, on any model meeting `CausalLM`, with
log-probabilities and per-row sampling settings."""

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jaxspec
from jaxspec.decoding import (CausalLM, Target, decode, speculative_decode)
from jaxspec.drafters import DraftModel, NGram
from jaxspec.models import init_params, tiny_config
from jaxspec.models.model import Model
from jaxspec.engine.io import prepare_prompts
from jaxspec.sampling import Sampling, SamplingArrays, process_logits

from helpers import padded_logits

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12]]
N_NEW = 10
K = 3
SAMPLED = Sampling(temperature=0.9, top_k=40)
STOP = (2,)  # the tiny config's EOS: the host wrappers' default stop ids


@pytest.fixture(scope="module")
def target(tiny_target):
  return tiny_target


@pytest.fixture(scope="module")
def draft():
  cfg = tiny_config(num_layers=1)
  return Model(cfg, init_params(cfg, jax.random.key(1), scale=0.3), name="fn-draft")


def _padded(target, prompts, k=K, n_new=N_NEW):
  """The arrays the host wrapper builds for these prompts (same width and cache size)."""
  prep = prepare_prompts(target, prompts, n_new, extra=k + 1)
  return jnp.asarray(prep.tokens), jnp.asarray(prep.lengths), prep.max_len


def _wrapper(target, drafter, prompts, key, sampling=None, n_new=N_NEW):
  return jaxspec.speculative_generate(target, drafter, prompts, max_new_tokens=n_new,
                                      num_draft_tokens=K, key=key, sampling=sampling)


# greedy under -m slow: the sampled case runs the same traced weights inside the user's jit, and
# test_nnx_model_as_target_and_as_draft_model greedy speculation inside a jitted loop.
@pytest.mark.parametrize("sampling", [pytest.param(None, marks=pytest.mark.slow), SAMPLED],
                         ids=["greedy", "sampled"])
def test_inside_user_jit_equals_host_wrapper(target, draft, sampling):
  ids, lens, max_len = _padded(target, PROMPTS)
  drafter = DraftModel(draft)

  @jax.jit
  def user_step(tparams, dparams, key):  # the user's own jitted function, weights traced
    out = speculative_decode(target, drafter, ids, lens, key, max_new_tokens=N_NEW,
                             num_draft_tokens=K, sampling=sampling, max_len=max_len,
                             stop_ids=STOP, target_params=tparams, drafter_params=dparams)
    return out.tokens, out.lengths

  key = jax.random.key(3)
  toks, n = user_step(target.params, draft.params, key)
  ref = _wrapper(target, drafter, PROMPTS, key, sampling)
  np.testing.assert_array_equal(np.asarray(n), ref.lengths)
  np.testing.assert_array_equal(np.asarray(toks), ref.tokens)  # -1 past each row's end
  plain = jax.jit(lambda k: decode(target, ids, lens, k, max_new_tokens=N_NEW,
                                   sampling=sampling, stop_ids=STOP).tokens)(key)
  gen = jaxspec.generate(target, PROMPTS, max_new_tokens=N_NEW, key=key, sampling=sampling)
  np.testing.assert_array_equal(np.asarray(plain), gen.tokens)
  if sampling is None:  # greedy: the same text (sampled with a fixed k: the same distribution)
    np.testing.assert_array_equal(np.asarray(toks), np.asarray(plain))


def test_vmap_over_keys_and_prompts(target):
  ids, lens, max_len = _padded(target, PROMPTS)
  keys = jax.random.split(jax.random.key(7), 4)
  run = lambda k: speculative_decode(target, NGram(), ids, lens, k, max_new_tokens=N_NEW,
                                     num_draft_tokens=K, sampling=SAMPLED,
                                     max_len=max_len, stop_ids=STOP).tokens
  toks = jax.jit(jax.vmap(run))(keys)
  assert toks.shape == (4, 2, N_NEW)
  for i in range(4):
    ref = _wrapper(target, NGram(), PROMPTS, keys[i], SAMPLED)
    np.testing.assert_array_equal(np.asarray(toks[i]), ref.tokens)  # -1 past each row's end
  # Four prompts, one row each, mapped over (the same padded width for all).
  prompts = [[5, 6, 7, 5, 6], [9, 9, 9], [1, 2, 3, 4], [20, 21, 20, 21, 20]]
  rows = [_padded(target, [p]) for p in prompts]
  ids4 = jnp.stack([r[0] for r in rows])  # [4, 1, P]
  lens4 = jnp.stack([r[1] for r in rows])
  key = jax.random.key(2)
  per = jax.jit(jax.vmap(lambda i, l: speculative_decode(
      target, NGram(), i, l, key, max_new_tokens=N_NEW, num_draft_tokens=K, sampling=SAMPLED,
      max_len=rows[0][2], stop_ids=STOP).tokens))(ids4, lens4)
  for i, p in enumerate(prompts):
    ref = _wrapper(target, NGram(), [p], key, SAMPLED)
    np.testing.assert_array_equal(np.asarray(per[i]), ref.tokens)


def test_scan_of_rollouts_and_no_recompile(target):
  ids, lens, max_len = _padded(target, PROMPTS)

  def rollouts(keys):
    def body(carry, k):
      out = speculative_decode(target, NGram(), ids, lens, k, max_new_tokens=N_NEW,
                               num_draft_tokens=K, sampling=SAMPLED, max_len=max_len,
                               stop_ids=STOP)
      return carry + out.lengths.sum(), out.tokens
    return lax.scan(body, jnp.int32(0), keys)

  keys = jax.random.split(jax.random.key(11), 3)
  total, toks = jax.jit(rollouts)(keys)
  for i in range(3):
    ref = _wrapper(target, NGram(), PROMPTS, keys[i], SAMPLED)
    np.testing.assert_array_equal(np.asarray(toks[i]), ref.tokens)  # -1 past each row's end
  assert int(total) == sum(int(_wrapper(target, NGram(), PROMPTS, k, SAMPLED).lengths.sum())
                          for k in keys)

  # max_new_tokens as a traced value under a static capacity: one compilation for both lengths.
  @jax.jit
  def f(n):
    out = speculative_decode(target, NGram(), ids, lens, jax.random.key(0), max_new_tokens=n,
                             capacity=N_NEW, num_draft_tokens=K, max_len=max_len, pad_id=7)
    return out.tokens, out.lengths

  short, n_short = f(jnp.int32(4))
  full, n_full = f(jnp.int32(N_NEW))
  assert f._cache_size() == 1
  np.testing.assert_array_equal(np.asarray(n_short), [4, 4])
  np.testing.assert_array_equal(np.asarray(n_full), [N_NEW, N_NEW])
  np.testing.assert_array_equal(np.asarray(short)[:, :4], np.asarray(full)[:, :4])
  assert (np.asarray(short)[:, 4:] == 7).all()  # the pad id past the length


def _reference_logprobs(target, prompts, tokens, lengths, sp: SamplingArrays):
  """log_softmax of the target's processed logits at each emitted token, from a forward over
  prompt + output."""
  out = np.zeros(tokens.shape, np.float32)
  # The rows in one right-padded forward (`padded_logits`).
  seqs = [list(p) + tokens[b, :lengths[b]].tolist() for b, p in enumerate(prompts)]
  all_logits = padded_logits(target.params, target.cfg, seqs)
  for b, (p, seq) in enumerate(zip(prompts, seqs)):
    logits = all_logits[b:b + 1]
    row = jax.tree.map(lambda x: x[b:b + 1], sp)
    lp = jax.nn.log_softmax(process_logits(logits[0, len(p) - 1:len(seq) - 1][None], row), -1)
    out[b, :lengths[b]] = np.take_along_axis(np.asarray(lp[0]),
                                             np.asarray(seq[len(p):])[:, None], 1)[:, 0]
  return out


# sampled-per-row under -m slow: test_score.py's `[sampled-filtered]` case checks both loops'
# log-probabilities with per-row temperatures and filters (a draft model's corrections too).
@pytest.mark.parametrize("sampling", [None, pytest.param(
    Sampling(temperature=[0.7, 1.3], top_k=[20, 0], top_p=[1.0, 0.9]), marks=pytest.mark.slow)],
                         ids=["greedy", "sampled-per-row"])
def test_logprobs_are_the_processed_target_logprobs(target, draft, sampling):
  ids, lens, max_len = _padded(target, PROMPTS)
  sp = jaxspec.sampling.sampling_arrays(sampling, 2)
  key = jax.random.key(5)
  for run in (lambda: speculative_decode(target, DraftModel(draft), ids, lens, key,
                                         max_new_tokens=N_NEW, num_draft_tokens=K,
                                         sampling=sampling, max_len=max_len),
              lambda: decode(target, ids, lens, key, max_new_tokens=N_NEW, sampling=sampling)):
    out = run()
    toks, n = np.asarray(out.tokens), np.asarray(out.lengths)
    ref = _reference_logprobs(target, PROMPTS, toks, n, sp)
    np.testing.assert_allclose(np.asarray(out.logprobs), ref, atol=2e-5)
    assert (np.asarray(out.logprobs) <= 0).all()
  # The host wrappers return the same with logprobs=True.
  spec = jaxspec.speculative_generate(target, DraftModel(draft), PROMPTS, max_new_tokens=N_NEW,
                                      num_draft_tokens=K, sampling=sampling, key=key,
                                      logprobs=True)
  ref = _reference_logprobs(target, PROMPTS, spec.tokens, spec.lengths, sp)
  np.testing.assert_allclose(spec.logprobs, ref, atol=2e-5)


def test_per_row_sampling_gives_each_row_its_own(target):
  """Rows with different settings in one batch: row b gets what a batch all set like row b
  gives row b (its randomness depends on the key and its index only)."""
  mixed = Sampling(temperature=[0.0, 1.1], top_k=[0, 8], min_p=[0.0, 0.05])
  alone = [Sampling(temperature=0.0), Sampling(temperature=1.1, top_k=8, min_p=0.05)]
  ids, lens, max_len = _padded(target, PROMPTS)
  key = jax.random.key(9)
  run = lambda s: np.asarray(speculative_decode(target, NGram(), ids, lens, key,
                                                max_new_tokens=N_NEW, num_draft_tokens=K,
                                                sampling=s, max_len=max_len, stop_ids=STOP).tokens)
  got = run(mixed)
  for b in range(2):
    np.testing.assert_array_equal(got[b], run(alone[b])[b])
  wrapped = jaxspec.speculative_generate(target, NGram(), PROMPTS, max_new_tokens=N_NEW,
                                         num_draft_tokens=K, sampling=mixed, key=key)
  np.testing.assert_array_equal(wrapped.tokens, got)
  plain = jaxspec.generate(target, PROMPTS, max_new_tokens=N_NEW, sampling=mixed, key=key)
  for b in range(2):
    one = jaxspec.generate(target, PROMPTS, max_new_tokens=N_NEW, sampling=alone[b], key=key)
    np.testing.assert_array_equal(plain.row(b), one.row(b))


def test_sharded_inputs(target):
  if len(jax.devices()) < 2:
    pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  ids, lens, max_len = _padded(target, PROMPTS)
  ids_s = jax.device_put(ids, NamedSharding(mesh, P("data")))
  lens_s = jax.device_put(lens, NamedSharding(mesh, P("data")))
  f = lambda i, l: speculative_decode(target, NGram(), i, l, jax.random.key(0),
                                      max_new_tokens=N_NEW, num_draft_tokens=K,
                                      max_len=max_len, stop_ids=STOP).tokens
  np.testing.assert_array_equal(np.asarray(jax.jit(f)(ids_s, lens_s)),
                                np.asarray(jax.jit(f)(ids, lens)))


# ----------------------------------------------------------------------------------------------
# A model jaxspec did not write: a small flax NNX decoder with its own parameters and cache.


class _Block(nnx.Module):

  def __init__(self, dim: int, heads: int, rngs: nnx.Rngs):
    self.heads, self.head_dim = heads, dim // heads
    self.norm1 = nnx.RMSNorm(dim, rngs=rngs)
    self.qkv = nnx.Linear(dim, 3 * dim, use_bias=False, rngs=rngs)
    self.out = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
    self.norm2 = nnx.RMSNorm(dim, rngs=rngs)
    self.up = nnx.Linear(dim, 2 * dim, rngs=rngs)
    self.down = nnx.Linear(2 * dim, dim, rngs=rngs)

  def __call__(self, x, ck, cv, positions):
    b, t, d = x.shape
    q, k, v = jnp.split(self.qkv(self.norm1(x)), 3, axis=-1)
    split = lambda a: a.reshape(b, t, self.heads, self.head_dim)
    q, k, v = split(q), split(k), split(v)
    rows = jnp.arange(b)[:, None]
    ck = ck.at[rows, positions].set(k, mode="drop")  # [B, S, H, Dh]
    cv = cv.at[rows, positions].set(v, mode="drop")
    s = jnp.einsum("bthd,bshd->bhts", q, ck) / np.sqrt(self.head_dim)
    visible = jnp.arange(ck.shape[1])[None, None, :] <= positions[:, :, None]  # [B, T, S]
    s = jnp.where(visible[:, None], s, -1e30)
    attn = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), cv).reshape(b, t, d)
    x = x + self.out(attn)
    return x + self.down(jax.nn.gelu(self.up(self.norm2(x)))), ck, cv


class TinyNNXDecoder(nnx.Module):

  def __init__(self, vocab: int, dim: int, heads: int, layers: int, max_pos: int, seed: int):
    rngs = nnx.Rngs(seed)
    self.embed = nnx.Embed(vocab, dim, rngs=rngs)
    self.pos = nnx.Embed(max_pos, dim, rngs=rngs)
    self.blocks = nnx.List([_Block(dim, heads, rngs) for _ in range(layers)])
    self.norm = nnx.RMSNorm(dim, rngs=rngs)
    self.head = nnx.Linear(dim, vocab, use_bias=False, rngs=rngs)

  def __call__(self, tokens, cache, lengths):
    positions = lengths[:, None] + jnp.arange(tokens.shape[1])[None, :]
    x = self.embed(tokens) + self.pos(jnp.minimum(positions, self.pos.num_embeddings - 1))
    ks, vs = [], []
    for i, blk in enumerate(self.blocks):
      x, k, v = blk(x, cache["k"][i], cache["v"][i], positions)
      ks.append(k)
      vs.append(v)
    return self.head(self.norm(x)), {"k": jnp.stack(ks), "v": jnp.stack(vs)}


@dataclasses.dataclass(frozen=True)
class NNXLM:
  """The adapter: what `CausalLM` asks, over the NNX module's graph definition (static) and
  state (the params pytree)."""

  graphdef: Any
  vocab_size: int
  layers: int
  heads: int
  head_dim: int

  @classmethod
  def split(cls, module: TinyNNXDecoder):
    graphdef, state = nnx.split(module)
    blk = module.blocks[0]
    return cls(graphdef, module.embed.num_embeddings, len(module.blocks), blk.heads,
               blk.head_dim), state

  def init_cache(self, params, batch_size, max_len):
    shape = (self.layers, batch_size, max_len, self.heads, self.head_dim)
    return {"k": jnp.zeros(shape), "v": jnp.zeros(shape)}

  def forward(self, params, tokens, cache, lengths, *, hidden_layers=()):
    logits, cache = nnx.merge(self.graphdef, params)(tokens, cache, lengths)
    return logits, None, cache


def test_nnx_model_as_target_and_as_draft_model(target):
  lm, state = NNXLM.split(TinyNNXDecoder(128, 32, 4, 2, 64, seed=0))
  small, small_state = NNXLM.split(TinyNNXDecoder(128, 16, 2, 1, 64, seed=1))
  assert isinstance(lm, CausalLM)
  nnx_target = Target(lm, state)
  prompts = jnp.asarray([[3, 4, 5, 3, 4, 5, 3, 4], [9, 10, 11, 0, 0, 0, 0, 0]], jnp.int32)
  lens = jnp.asarray([8, 3], jnp.int32)
  key = jax.random.key(0)
  ref = decode(nnx_target, prompts, lens, key, max_new_tokens=12)
  for drafter in (NGram(), DraftModel(Target(small, small_state)), DraftModel(nnx_target)):
    out = jax.jit(lambda t, k: speculative_decode(t, drafter, prompts, lens, k,
                                                  max_new_tokens=12, num_draft_tokens=3))(
        nnx_target, key)
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(out.logprobs), np.asarray(ref.logprobs), atol=1e-5)
  same = out  # the model drafting for itself (the loop's last drafter): every draft kept
  assert int(same.stats.accepted.sum()) == int(same.stats.drafted.sum()) > 0
  # The public summary of the counters: what the host wrappers report.
  summary = same.stats.summary()
  assert summary["acceptance_rate"] == 1.0 and summary["accepted_per_row"] == \
      np.asarray(same.stats.accepted).tolist()
  assert summary["tau"] == pytest.approx(float(same.stats.emitted.sum())
                                         / float(same.stats.row_steps.sum()))
  assert summary["tau"] > 1 and summary["plain_steps"] == 0
  # The NNX model drafting for jaxspec's Llama (the same vocabulary) through the host wrapper.
  assert target.cfg.vocab_size == 128
  spec = jaxspec.speculative_generate(target, DraftModel(Target(small, small_state)), PROMPTS,
                                      max_new_tokens=N_NEW, num_draft_tokens=3)
  np.testing.assert_array_equal(spec.tokens,
                                jaxspec.generate(target, PROMPTS, max_new_tokens=N_NEW).tokens)


# ----------------------------------------------------------------------------------------------
# Bad input: clear errors before tracing.


def test_bad_input_is_refused_before_tracing(target, no_compile):
  ids, lens, _ = _padded(target, PROMPTS)
  key = jax.random.key(0)
  call = lambda **kw: speculative_decode(**{**dict(
      target=target, drafter=NGram(), prompt_ids=ids, prompt_lengths=lens, key=key,
      max_new_tokens=4, num_draft_tokens=2), **kw})
  cases = [
      (dict(prompt_ids=ids[0]), "rank 2.*ids\\[None\\]"),
      (dict(prompt_ids=ids.astype(jnp.float32)), "must hold integers"),
      (dict(prompt_lengths=lens[:1]), "one length per prompt row"),
      (dict(prompt_lengths=jnp.asarray([0, 3])), "prompt_lengths must be in \\[1, 64\\]"),
      (dict(prompt_lengths=jnp.asarray([65, 3])), "prompt_lengths must be in \\[1, 64\\]"),
      (dict(prompt_ids=ids.at[0, 0].set(500)), "token id 500 .* vocabulary"),
      (dict(max_new_tokens=9, capacity=8), "max_new_tokens must be in \\[1, capacity=8\\]"),
      (dict(sampling=Sampling(temperature=[0.5, 0.5, 0.5])), "3 values for a batch of 2"),
      (dict(sampling=SamplingArrays(jnp.zeros(3), jnp.zeros(2, jnp.int32), jnp.ones(2),
                                    jnp.zeros(2))), "temperature must have shape \\[2\\]"),
      (dict(num_draft_tokens="auto"), "needs cost=CostModel"),
      (dict(key=jax.random.split(key, 3)), "3 per-row keys for a batch of 2 rows"),
      (dict(key=jax.random.split(key, 4).reshape(2, 2)), "one PRNG key"),
      (dict(drafter="ngram"), "must be a jaxspec Drafter"),
  ]
  for kw, msg in cases:
    with pytest.raises(ValueError, match=msg):
      call(**kw)

  class NoForward:
    vocab_size = 128

    def init_cache(self, params, b, n):
      return {}

  with pytest.raises(ValueError, match="has no forward"):
    call(target=Target(NoForward(), {}))
  with pytest.raises(ValueError, match="has no forward"):
    DraftModel(Target(NoForward(), {}))
  with pytest.raises(ValueError, match="pass capacity=N"):
    jax.jit(lambda n: call(max_new_tokens=n).tokens)(jnp.int32(3))


def test_host_wrappers_take_arrays_and_refuse_traced_prompts(target):
  """A jax.Array (or numpy) batch of token ids is a batch of prompts for the host wrappers; a
  traced one gets an error that points at the functional API."""
  ids = jnp.asarray([[5, 6, 7, 8], [9, 10, 11, 12]], jnp.int32)
  ref = jaxspec.generate(target, [[5, 6, 7, 8], [9, 10, 11, 12]], max_new_tokens=4)
  np.testing.assert_array_equal(jaxspec.generate(target, ids, max_new_tokens=4).tokens,
                                ref.tokens)
  np.testing.assert_array_equal(jaxspec.generate(target, ids[0], max_new_tokens=4).tokens,
                                ref.tokens[:1])
  with pytest.raises(ValueError, match="jaxspec.decoding.decode / speculative_decode"):
    jax.jit(lambda p: jaxspec.generate(target, p, max_new_tokens=4).tokens)(ids)
  with pytest.raises(ValueError, match="integer token ids"):
    jaxspec.generate(target, ids.astype(jnp.float32), max_new_tokens=4)
