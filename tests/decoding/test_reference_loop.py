"""The reference loop of docs/concepts/design.md: speculative decoding with a fixed k and chain
drafts, written with the public pieces (`draft`, `verify`, `rejection_sample`, a `Target`), and
checked token for token against the fused `speculative_decode`, greedy and sampled with the same
key. The function below is the one printed in the docs (kept identical)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import ROOT
from jaxspec.decoding import (DraftContext, Target, as_target, draft, rejection_sample,
                              speculative_decode, verify)
from jaxspec.decoding.plain import prefill
from jaxspec.drafters import DraftModel, NGram
from jaxspec.models import init_params, tiny_config
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling, position_keys, row_keys, sample, sampling_arrays


def reference_loop(target: Target, drafter, dparams, prompt, prompt_len, key, sp, *, k: int,
                   max_new: int):
  """Speculative decoding of prompt [B, P] (right-padded, lengths [B]) with k chain drafts a
  step: max_new new tokens per row [B, max_new]. For drafters that do not read the target's
  hidden states. Token j of row b is drawn with fold_in(row_keys(key)[b], j) in every loop."""
  lm, params = target.lm, target.params
  b, p = prompt.shape
  rows = jnp.arange(b)
  max_len = p + max_new + k + 1  # the cache: prompt, outputs, and one step's drafts past them
  keys = row_keys(key, b)
  # Prefill: the cache holds the prompt; the first token comes from the last prompt position.
  logits, _, cache = prefill(params, prompt, prompt_len, lm, max_len)
  first = sample(position_keys(keys, jnp.zeros_like(prompt_len), 1)[:, 0], logits, sp)
  seq = jnp.zeros((b, max_len + k + 1), jnp.int32).at[:, :p].set(prompt)
  seq = seq.at[rows, prompt_len].set(first)
  seq_len, n_out = prompt_len + 1, jnp.ones_like(prompt_len)
  state = drafter.init(dparams, prompt, prompt_len, max_len)
  ctx = DraftContext(seq=seq, seq_len=seq_len, prompt_len=prompt_len, n_new=n_out)
  state = drafter.commit(dparams, state, ctx)
  # The loop keeps: the cache holds seq[:, :seq_len - 1]; the newest token is the next input.

  @jax.jit
  def step(state, cache, seq, seq_len, n_out):
    live = n_out < max_new
    last = seq[rows, seq_len - 1]
    # Draft: k tokens per row, with the step's draft keys.
    ctx = DraftContext(seq=seq, seq_len=seq_len, prompt_len=prompt_len, row_keys=keys)
    draft_keys = jax.vmap(lambda kk, n: jax.random.split(jax.random.fold_in(kk, n))[0])(
        keys, seq_len)
    prop, state = draft(drafter, dparams, state, ctx, k, sp, draft_keys)
    # Verify: one target pass over [last, d_1 .. d_k] writes k + 1 cache entries.
    p_target, _, new_cache = verify(lm, params, cache, last, prop.tokens, sp)
    # Accept: the accepted drafts, then the target's own token at the first rejection.
    n_acc, emitted = rejection_sample(p_target, prop.q, prop.tokens,
                                      position_keys(keys, n_out, k + 1), prop.n_valid,
                                      greedy=sp.temperature == 0)
    n_emit = jnp.where(live, jnp.minimum(n_acc + 1, max_new - n_out), 0)
    cols = seq_len[:, None] + jnp.arange(k + 1)[None, :]
    cols = jnp.where(jnp.arange(k + 1)[None, :] < n_emit[:, None], cols, seq.shape[1])
    seq = seq.at[rows[:, None], cols].set(emitted, mode="drop")
    # Roll back by length: the cache keeps what was emitted, minus the newest token.
    cache = dataclasses.replace(new_cache, length=cache.length + n_emit)
    seq_len, n_out = seq_len + n_emit, n_out + n_emit
    ctx = DraftContext(seq=seq, seq_len=seq_len, prompt_len=prompt_len, n_new=n_emit)
    return drafter.commit(dparams, state, ctx), cache, seq, seq_len, n_out

  while bool(jnp.any(n_out < max_new)):  # one jitted step at a time, the host deciding when
    state, cache, seq, seq_len, n_out = step(state, cache, seq, seq_len, n_out)
  return seq[rows[:, None], prompt_len[:, None] + jnp.arange(max_new)[None, :]]


PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [10, 11, 12, 10, 11]]
N_NEW = 12
K = 3


@pytest.fixture(scope="module")
def draft_model():
  cfg = tiny_config(num_layers=1)
  return Model(cfg, init_params(cfg, jax.random.key(1), scale=0.3), name="ref-draft")


def _arrays():
  width = max(map(len, PROMPTS))
  ids = np.zeros((len(PROMPTS), width), np.int32)
  for i, p in enumerate(PROMPTS):
    ids[i, :len(p)] = p
  return jnp.asarray(ids), jnp.asarray([len(p) for p in PROMPTS], jnp.int32)


SAMPLED = Sampling(temperature=0.9, top_k=40)


@pytest.mark.parametrize("drafter_name, sampling", [("ngram", None), ("ngram", SAMPLED),
                                                    ("draft_model", SAMPLED)],
                         ids=["ngram-greedy", "ngram-sampled", "draft_model-sampled"])
def test_reference_loop_equals_fused_loop(tiny_target, draft_model, drafter_name, sampling):
  """Same tokens as `speculative_decode` for the same key: greedy, and sampled (the
  reference draws every token with the same key, so equal text, not only equal distributions),
  with deterministic drafts (n-gram: the coupled rule) and sampled ones (a draft model: the
  min(1, p/q) rule and its residual draws). The fused loop may run a plain step where no row
  has a real draft; the reference always verifies k, which emits the same token (a draft that
  does not count leaves its position to the target's own draw)."""
  drafter = NGram() if drafter_name == "ngram" else DraftModel(draft_model)
  ids, lens = _arrays()
  key = jax.random.key(7)
  fused = speculative_decode(tiny_target, drafter, ids, lens, key, max_new_tokens=N_NEW,
                             num_draft_tokens=K, sampling=sampling, logprobs=False,
                             stop_ids=())  # the reference runs every row to N_NEW
  target = as_target(tiny_target)  # Target(LlamaLM(cfg), params): what the fused loop runs
  ref = reference_loop(target, drafter, drafter.params, ids, lens, key,
                       sampling_arrays(sampling, ids.shape[0]), k=K, max_new=N_NEW)
  np.testing.assert_array_equal(np.asarray(ref), np.asarray(fused.tokens))
  if drafter_name == "ngram" and sampling is None:  # the prompts repeat: drafts were accepted
    assert int(fused.stats.accepted.sum()) > 0



def test_the_docs_show_this_loop():
  """docs/concepts/design.md prints `reference_loop` as it is here, so the page's code is tested."""
  import inspect
  page = ROOT / "docs" / "concepts" / "design.md"
  assert inspect.getsource(reference_loop) in page.read_text()
