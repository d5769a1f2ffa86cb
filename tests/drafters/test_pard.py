"""Parallel drafting (`ParallelDraft`, PARD): what one pass proposes, exact greedy output (ragged
batch, fixed k and "auto", under jit and vmap, through the host wrapper), the sampled
distribution at later positions, PARD-format checkpoints, and bad input before compilation."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import AutoK
from jaxspec.api import generate, speculative_generate
from jaxspec.decoding import functional
from jaxspec.decoding.drafter import DraftContext
from jaxspec.decoding.functional import speculative_decode
from jaxspec.drafters import DraftModel, ParallelDraft, load_pard, resolve_drafter
from jaxspec.models import init_params, tiny_config
from jaxspec.models.errors import CheckpointError
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling
from helpers import CPU_LIKE, assert_tokens_4_5_follow, exact_tables, padded, padded_logits

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 3, 4, 5, 3, 4, 5, 3], [7]]
N_NEW = 16
MASK = 3


@pytest.fixture(scope="module")
def plain(tiny_target):
  return generate(tiny_target, PROMPTS, max_new_tokens=N_NEW, stop_ids=())


# -- what one pass proposes -----------------------------------------------------------------------


def _masked_logits(d, rows, n_masks):
  """Logits [B, T, V] of a plain forward of the draft model over each row followed by n_masks
  masks, the rows right-padded into one batch (`padded_logits`)."""
  return padded_logits(d.params, d.cfg, [r + [MASK] * n_masks for r in rows], cache_len=16)


def test_one_pass_reads_the_context_then_the_masks(tiny_target):
  """Drafts and q are the draft model's distributions after [context], [context, M],
  [context, M, M] of a plain forward; only the real tokens stay in its cache."""
  d = ParallelDraft(tiny_target, mask_id=MASK)
  rows = [[5, 6, 7, 8, 9], [10, 11], [4]]  # the last row holds one token
  k = 3
  ids, lens = padded(rows, 12)
  params = d.params
  state = d.init(params, ids, lens, 16)
  ctx = DraftContext(seq=ids, seq_len=lens, prompt_len=lens)
  sp = Sampling(temperature=1.0).arrays(len(rows))
  prop, state = d.propose(params, state, ctx, k, sp, jax.random.split(jax.random.key(0), 3))
  lg = _masked_logits(d, rows, k - 1)
  for i, r in enumerate(rows):
    want = np.asarray(jax.nn.softmax(lg[i, len(r) - 1:len(r) + k - 1], axis=-1))  # [k, V]
    np.testing.assert_allclose(np.asarray(prop.q[i]), want, atol=2e-5, err_msg=f"row {i}")
  assert prop.n_valid is None
  # The cache keeps [0, seq_len) after the pass: the two real tokens (one for the single-token
  # row), not the masks (the loop's commit then moves it to seq_len - 2 + accepted).
  np.testing.assert_array_equal(np.asarray(state.cache.length), [5, 2, 1])
  # Greedy: the argmax of each of those distributions.
  g = Sampling(temperature=0.0).arrays(len(rows))
  prop_g, _ = d.propose(params, d.init(params, ids, lens, 16), ctx, k, g,
                        jax.random.split(jax.random.key(0), 3))
  np.testing.assert_array_equal(np.asarray(prop_g.tokens), np.asarray(prop.q).argmax(-1))


def test_commit_after_several_accepted_drafts_holds_the_real_tokens(tiny_target):
  """After a pass of k = 4 the cache keeps [0, s); a commit after a accepted drafts (3, 0 and 2
  for the three rows, plus each step's bonus token) holds exactly what a fresh prefill of the
  longer rows holds on [0, seq_len - 2): no mask entry left where an accepted token belongs."""
  d = ParallelDraft(tiny_target, mask_id=MASK)
  rows = [[5, 6, 7, 8, 9], [10, 11], [4]]
  ids, lens = padded(rows, 16)
  params = d.params
  state = d.init(params, ids, lens, 16)
  ctx = DraftContext(seq=ids, seq_len=lens, prompt_len=lens)
  _, state = d.propose(params, state, ctx, 4, Sampling(temperature=0.0).arrays(3),
                       jax.random.split(jax.random.key(0), 3))
  longer = [r + new for r, new in zip(rows, ([21, 22, 23, 24], [25], [26, 27, 28]))]
  ids2, lens2 = padded(longer, 16)
  got = d.commit(params, state, DraftContext(seq=ids2, seq_len=lens2, prompt_len=lens)).cache
  want = d.init(params, ids2, lens2, 16).cache
  np.testing.assert_array_equal(np.asarray(got.length), np.asarray(want.length))
  for b, n in enumerate(np.asarray(want.length)):
    np.testing.assert_allclose(np.asarray(got.k)[:, b, :, :n], np.asarray(want.k)[:, b, :, :n],
                               atol=2e-5, err_msg=f"row {b}")
    np.testing.assert_allclose(np.asarray(got.v)[:, b, :, :n], np.asarray(want.v)[:, b, :, :n],
                               atol=2e-5, err_msg=f"row {b}")


def test_p_min_stops_at_the_first_unconfident_position(tiny_target):
  d = ParallelDraft(tiny_target, mask_id=MASK)
  ids, lens = padded([[5, 6, 7, 8, 9], [10, 11]], 12)
  ctx = DraftContext(seq=ids, seq_len=lens, prompt_len=lens)
  sp = Sampling(temperature=0.0).arrays(2)
  keys = jax.random.split(jax.random.key(0), 2)
  rows = [[5, 6, 7, 8, 9], [10, 11]]
  out = _masked_logits(d, rows, 3)
  # each position's top probability under the draft model's own softmax
  top = np.stack([np.asarray(jax.nn.softmax(out[i, len(r) - 1:len(r) + 3], -1)).max(-1)
                  for i, r in enumerate(rows)])  # [2, 4]
  p_min = float(np.sort(top.reshape(-1))[3])  # some positions fall below it, some do not
  stop = dataclasses.replace(d, p_min=p_min)
  prop, _ = stop.propose(d.params, d.init(d.params, ids, lens, 16), ctx, 4, sp, keys)
  want = [int(np.argmin(np.append(row >= p_min, False))) for row in top]
  assert np.asarray(prop.n_valid).tolist() == want


# -- exactness ------------------------------------------------------------------------------------


def test_greedy_equals_plain_fixed_k_and_auto(tiny_target, poor_draft, plain):
  """A ragged batch (a row of one token among them) through the host wrapper, with a draft
  that is often rejected and one (the target itself) that is often accepted."""
  for model, k in ((poor_draft, 3), (tiny_target, "auto")):
    d = ParallelDraft(model, mask_id=MASK)
    # "auto" with a fixed cost model, so whether it drafts does not follow the machine's
    # timings (a draft as large as the target never pays on measured costs).
    out = speculative_generate(tiny_target, d, PROMPTS, max_new_tokens=N_NEW,
                               num_draft_tokens=k, stop_ids=(),
                               cost=CPU_LIKE if k == "auto" else None)
    np.testing.assert_array_equal(out.tokens, plain.tokens, err_msg=f"{model.name} k={k}")
    assert sum(out.stats["drafted_per_row"]) > 0


@pytest.mark.slow  # greedy: the test above; jit and vmap: the sampled test below
def test_greedy_equals_plain_under_jit_and_vmap(tiny_target, plain):
  d = ParallelDraft(tiny_target, mask_id=MASK)
  ids, lens = padded(PROMPTS)

  @jax.jit
  def call(dparams, key):
    out = speculative_decode(tiny_target, d, ids, lens, key, max_new_tokens=N_NEW,
                             num_draft_tokens=4, stop_ids=(), drafter_params=dparams)
    return out.tokens, out.stats.accepted.sum()

  toks, acc = call(d.params, jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(toks), plain.tokens)
  assert int(acc) > 0
  rows = [padded([p]) for p in PROMPTS]
  ids4, lens4 = jnp.stack([r[0] for r in rows]), jnp.stack([r[1] for r in rows])
  out = jax.jit(jax.vmap(lambda i, l: speculative_decode(
      tiny_target, d, i, l, 0, max_new_tokens=N_NEW, num_draft_tokens=3, stop_ids=())))(
          ids4, lens4)
  np.testing.assert_array_equal(np.asarray(out.tokens[:, 0]), plain.tokens)



@pytest.mark.optimized
def test_sampled_distribution_at_later_positions(small_vocab):
  """The 4th and 5th new tokens over 4000 mapped calls with k = 2 (so they come from a second
  or third pass, after commits, with drafts read at mask positions): chi-square against the
  target's exact joint at the 1e-4 tail, with drafts both accepted and rejected."""
  target, draft = small_vocab
  v = target.cfg.vocab_size
  sp = Sampling(temperature=0.9, top_k=6, top_p=0.95)
  prompt = [1, 2, 3, 4]
  tables = exact_tables(target, prompt, sp)
  d = ParallelDraft(draft, mask_id=7)
  ids, lens = padded([prompt], 4)

  def one(key):
    out = speculative_decode(target, d, ids, lens, key, max_new_tokens=6, num_draft_tokens=2,
                             sampling=sp, max_len=16, logprobs=False)
    return out.tokens[0, 3:5], out.stats.drafted[0], out.stats.accepted[0]

  n = 4000  # as test_suffix's chain test, which says why that suffices
  toks, drafted, accepted = jax.jit(jax.vmap(one))(jax.random.split(jax.random.key(3), n))
  rate = int(accepted.sum()) / int(drafted.sum())
  assert 0.05 < rate < 0.9, rate  # both paths of the rejection rule
  assert_tokens_4_5_follow(toks, tables)


# -- PARD-format checkpoints ----------------------------------------------------------------------


def _hf_draft(path, vocab=128, **extra):
  """A tiny random Hugging Face Llama directory, `extra` added to its config.json."""
  import torch
  from transformers import LlamaConfig, LlamaForCausalLM
  torch.manual_seed(0)
  cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                    head_dim=16, max_position_embeddings=256, tie_word_embeddings=False)
  LlamaForCausalLM(cfg).save_pretrained(path)
  raw = json.loads((path / "config.json").read_text())
  raw.update(extra)
  (path / "config.json").write_text(json.dumps(raw))
  return path


def test_loads_a_pard_checkpoint_and_decodes_exactly(tiny_target, plain, tmp_path):
  path = _hf_draft(tmp_path / "pard", pard_token=MASK, pard_trained_k=4)
  d = load_pard(path, tiny_target)
  assert isinstance(d, ParallelDraft)
  assert (d.mask_id, d.trained_k, d.max_draft_tokens, d.vocab_size) == (MASK, 4, 4, 128)
  assert load_pard(path, tiny_target, mask_id=9).mask_id == 9  # the documented override
  named = resolve_drafter(tiny_target, str(path))  # by path: the config names the mask
  assert isinstance(named, ParallelDraft) and named.mask_id == MASK
  out = speculative_generate(tiny_target, str(path), PROMPTS, max_new_tokens=N_NEW,
                             num_draft_tokens=4, stop_ids=())
  np.testing.assert_array_equal(out.tokens, plain.tokens)
  # Without "pard_token" the directory is an ordinary draft model.
  plain_dir = _hf_draft(tmp_path / "plain")
  assert type(resolve_drafter(tiny_target, str(plain_dir))) is DraftModel
  with pytest.raises(CheckpointError, match="names no pard_token.*mask_id="):
    load_pard(plain_dir, tiny_target)
  assert load_pard(plain_dir, tiny_target, mask_id=5).mask_id == 5


# -- bad input ------------------------------------------------------------------------------------


def test_bad_input_is_an_error_before_compiling(tiny_target, tmp_path):
  v = tiny_target.cfg.vocab_size
  ids, lens = padded(PROMPTS[:1])
  before = functional._speculative_jit._cache_size()
  with pytest.raises(ValueError, match=r"mask_id must be an integer in \[0, 127\]"):
    ParallelDraft(tiny_target, mask_id=v)
  with pytest.raises(ValueError, match="needs the draft model's mask token: pass mask_id="):
    ParallelDraft(tiny_target)
  with pytest.raises(ValueError, match="trained_k must be an integer >= 1"):
    ParallelDraft(tiny_target, mask_id=MASK, trained_k=0)
  # k above the trained k: fixed, and "auto" with a larger k_max.
  d = ParallelDraft(tiny_target, mask_id=MASK, trained_k=3)
  with pytest.raises(ValueError, match="pard drafter proposes at most 3 tokens a step:"
                                       " num_draft_tokens must be <= 3, got 4"):
    speculative_decode(tiny_target, d, ids, lens, 0, max_new_tokens=4, num_draft_tokens=4)
  with pytest.raises(ValueError, match=r"use AutoK\(k_max=3\)"):
    speculative_decode(tiny_target, d, ids, lens, 0, max_new_tokens=4,
                       num_draft_tokens="auto", auto=AutoK(k_max=5))
  # A vocabulary other than the target's.
  cfg = tiny_config(vocab_size=v + 8)
  other = ParallelDraft(Model(cfg, init_params(cfg, jax.random.key(1))), mask_id=MASK)
  with pytest.raises(ValueError, match=f"draft vocab {v + 8} != target vocab {v}"):
    speculative_decode(tiny_target, other, ids, lens, 0, max_new_tokens=4, num_draft_tokens=2)
  assert functional._speculative_jit._cache_size() == before  # nothing was compiled
  # Checkpoints: a mask outside the vocabulary, another vocabulary, a malformed key.
  with pytest.raises(ValueError, match=r"PARD mask id must be an integer in \[0, 127\]"):
    load_pard(_hf_draft(tmp_path / "out", pard_token=v), tiny_target)
  with pytest.raises(ValueError, match=f"draft vocab {v + 8} != target vocab {v}: a PARD"):
    load_pard(_hf_draft(tmp_path / "vocab", vocab=v + 8, pard_token=MASK), tiny_target)
  with pytest.raises(CheckpointError, match="pard_trained_k must be an integer >= 1"):
    load_pard(_hf_draft(tmp_path / "k", pard_token=MASK, pard_trained_k="8"), tiny_target)


@pytest.mark.parametrize("content,match", [
    (b"caf\xe9", "is not valid JSON"), (b"[1, 2]", "holds a JSON list, not an object"),
    (b"7", "holds a JSON int, not an object"), (b"[" * 100_000, "nested too deeply"),
    (None, "does not exist")])
def test_unreadable_configs_are_checkpoint_errors(tmp_path, content, match):
  """A directory whose config.json is not UTF-8, not an object or too deep (was a raw
  UnicodeDecodeError, AttributeError or RecursionError), or missing: a CheckpointError naming
  the file, and `is_pard_dir` says no."""
  from jaxspec.drafters.pard import is_pard_dir, pard_config
  if content is not None:
    (tmp_path / "config.json").write_bytes(content)
  with pytest.raises(CheckpointError, match=rf"config\.json.*{match}"):
    pard_config(tmp_path)
  assert is_pard_dir(tmp_path) is False
