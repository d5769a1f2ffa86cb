"""The self-distillation corpus: multi-turn conversations the target writes, token-id shards,
the streaming packed reader, resume, progress and the evaluation-set guard."""

import dataclasses
import io
import json
import time
import tracemalloc
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import forward, init_cache, init_params, tiny_config
from jaxspec.models.model import Model
from jaxspec.models.tokenizer import Tokenizer
from jaxspec.train.corpus import (FORMAT, VERSION, Corpus, CorpusConfig,
                                  PackedCorpus, RateMeter, _Progress, batch_plan, chat_turns,
                                  held_out, pack_conversations, pack_rows, packed_attention_mask,
                                  same_segment_ahead, write_corpus, write_shard)
from jaxspec.train.data import DataError

from helpers import TINY_TEMPLATE, padded, padded_logits, tiny_vocab

END = 2  # <|im_end|> of the tiny vocabulary: it ends user and assistant turns


@pytest.fixture(scope="module")
def chat_target():
  """A tiny random model with the tiny byte-level tokenizer and chat template. Its LM-head
  column of <|im_end|> is scaled up so that it ends turns after a few tokens (a plain random
  model almost never does), which lets conversations go on for several turns."""
  tokens, types, merges = tiny_vocab()
  tok = Tokenizer.from_gguf({
      "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "smollm",
      "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types,
      "tokenizer.ggml.merges": merges, "tokenizer.ggml.bos_token_id": 1,
      "tokenizer.ggml.eos_token_id": END, "tokenizer.ggml.add_bos_token": False,
      "tokenizer.chat_template": TINY_TEMPLATE})
  cfg = tiny_config(vocab_size=272)
  p = init_params(cfg, jax.random.key(0), scale=0.2)
  p = dataclasses.replace(p, lm_head=p.lm_head.at[:, END].multiply(6.0))
  return Model(cfg, p, tokenizer=tok, name="tiny-chat")


CFG = CorpusConfig(turns=3, max_new_tokens=12, max_user_tokens=8, min_user_tokens=1,
                   temperatures=(0.0, 0.7), magpie_fraction=0.5, batch_size=4,
                   max_prompt_len=32, max_len=256, shard_tokens=120)
PROMPTS = ["hello world", "how are you", "tell me", "x y z", "what", "why now", "he", "or"]
WHOLE_BUDGET = 400


@pytest.fixture(scope="module")
def whole(chat_target, tmp_path_factory):
  """The corpus of an uninterrupted run to WHOLE_BUDGET answer tokens, which the stopped and
  continued runs below must end with (written once for the module)."""
  return write_corpus(chat_target, PROMPTS, tmp_path_factory.mktemp("whole") / "whole", CFG,
                      token_budget=WHOLE_BUDGET, progress=False)


def _spans(mask):
  """[(start, end)] of the runs of 1 in a 0/1 sequence."""
  m = np.concatenate([[0], np.asarray(mask, np.int8), [0]])
  d = np.diff(m)
  return list(zip(np.flatnonzero(d == 1), np.flatnonzero(d == -1)))


def _greedy_after_each_token(model, seqs):
  """The target's argmax after each position of every sequence (a teacher-forced forward), from
  one forward over them all (`padded_logits`)."""
  logits = padded_logits(model.params, model.cfg, [list(q) for q in seqs])
  return [g[:len(seq)] for g, seq in zip(np.asarray(jnp.argmax(logits, -1)), seqs)]


def test_chat_turns_are_the_template_boundaries(chat_target):
  tok = chat_target.tokenizer
  turns = chat_turns(tok)
  dec = lambda ids: tok.decode(ids, skip_special_tokens=False)  # noqa: E731
  assert dec(turns.user_prefix) == "<|im_start|>user\n"
  assert dec(turns.user_to_assistant) == "<|im_end|>\n<|im_start|>assistant\n"
  assert dec(turns.assistant_to_user) == "<|im_end|>\n<|im_start|>user\n"
  assert turns.user_end == turns.assistant_end == END
  with pytest.raises(DataError, match="chat template"):
    chat_turns(None)


def test_batch_plan_schedule():
  cfg = CorpusConfig(batch_size=3, temperatures=(0.0, 0.7), magpie_fraction=0.25)
  plans = [batch_plan(i, 7, cfg) for i in range(12)]
  # Every 4th batch is Magpie; the prompt batches walk 7 prompts in chunks of 3, once per
  # temperature; once they are used up, every batch is a Magpie batch.
  assert [p.magpie for p in plans] == [False] * 3 + [True] + [False] * 3 + [True] * 5
  assert [(p.temperature_index, p.prompts) for p in plans if not p.magpie] == [
      (0, (0, 1, 2)), (0, (3, 4, 5)), (0, (6,)), (1, (0, 1, 2)), (1, (3, 4, 5)), (1, (6,))]
  assert [p.temperature_index for p in plans[7:]] == [1, 0, 1, 0, 1]
  done = dataclasses.replace(cfg, magpie_fraction=0.0)
  assert batch_plan(6, 7, done) is None and batch_plan(5, 7, done).prompts == (6,)
  assert all(batch_plan(i, 0, cfg).magpie for i in range(5))  # no prompts: all Magpie


def test_multi_turn_answers_are_the_targets_own(chat_target, tmp_path):
  """Every assistant turn of every greedy conversation is the target's greedy continuation of
  the conversation before it (checked by one teacher-forced forward), conversations reach
  several turns with target-written user turns between answers, and the loss mask marks the
  answers only."""
  cfg = dataclasses.replace(CFG, temperatures=(0.0,))
  s = write_corpus(chat_target, PROMPTS, tmp_path / "c", cfg, token_budget=250, progress=False)
  corpus = Corpus(s.path)
  turns = chat_turns(chat_target.tokenizer)
  convs = []
  for s_ in range(corpus.num_shards):
    z = corpus.load_shard(s_)
    o = z["offsets"]
    for c in range(len(o) - 1):
      convs.append((z["tokens"][o[c]:o[c + 1]], z["loss_mask"][o[c]:o[c + 1]], z["turns"][c],
                    z["source"][c]))
  greedy_all = _greedy_after_each_token(chat_target, [toks for toks, *_ in convs])
  seen_turns = []
  for (toks, mask, n_turns, source), greedy in zip(convs, greedy_all):
    spans = _spans(mask)
    assert len(spans) == n_turns >= 1
    seen_turns.append(len(spans))
    for a, b in spans:
      np.testing.assert_array_equal(toks[a:b], greedy[a - 1:b - 1])
    for (a, b), (a2, _) in zip(spans, spans[1:]):
      # An answer ends its turn, then the template's start of a user turn, a user turn the
      # target wrote (ending with the end of a user turn), and the start of the next answer.
      assert toks[b - 1] == END
      between = toks[b:a2].tolist()
      lead = list(turns.assistant_to_user[1:])
      tail = list(turns.user_to_assistant[1:])
      assert between[:len(lead)] == lead and between[-len(tail):] == tail
      user = between[len(lead):-len(tail)]
      assert user[-1] == END and 1 <= len(user) - 1 <= cfg.max_user_tokens
    if source == len(corpus.sources) - 1:  # Magpie: the first user turn is the target's
      assert toks[:len(turns.user_prefix)].tolist() == list(turns.user_prefix)
  assert max(seen_turns) == 3 and min(seen_turns) == 1
  assert corpus.sources[-1].startswith("<instructions written by the target")


def test_sampled_answers_differ_from_greedy(chat_target, tmp_path):
  s = write_corpus(chat_target, PROMPTS, tmp_path / "c", dataclasses.replace(
      CFG, magpie_fraction=0.0, turns=1), token_budget=10**6, progress=False)
  assert s.complete and s.conversations == 2 * len(PROMPTS)
  corpus = Corpus(s.path)
  z = {k: np.concatenate([corpus.load_shard(i)[k] for i in range(corpus.num_shards)])
       for k in ("prompt", "temperature")}
  convs = [t.tolist() for t, _ in corpus.conversations()]
  assert sorted(zip(z["prompt"].tolist(), z["temperature"].tolist())) == sorted(
      (p, t) for p in range(len(PROMPTS)) for t in (0.0, np.float32(0.7)))
  by = {(int(p), float(t)): c for p, t, c in zip(z["prompt"], z["temperature"], convs)}
  assert any(by[(p, 0.0)] != by[(p, float(np.float32(0.7)))] for p in range(len(PROMPTS)))


def test_sampled_conversations_follow_their_keys_phase_by_phase(chat_target, tmp_path):
  """Every target-written span of sampled multi-turn conversations (Magpie user turns, follow-up
  user turns, answers) is what `generate` draws for the conversation before it with the key the
  schedule names: phase p of batch i samples row j with row_keys(fold_in(fold_in(key(seed), i),
  p), batch_size)[j], however the conversations shared the slots."""
  import jaxspec
  cfg = dataclasses.replace(CFG, temperatures=(0.7,), turns=2, seed=3)
  s = write_corpus(chat_target, PROMPTS, tmp_path / "c", cfg, token_budget=10**6,
                   max_batches=4, progress=False)
  corpus = Corpus(s.path)
  turns = chat_turns(chat_target.tokenizer)
  magpie = len(corpus.sources) - 1
  where = {}  # (file prompt) -> (batch, row)
  for i in range(s.next_batch):
    plan = batch_plan(i, len(PROMPTS), cfg)
    where.update({p: (i, j) for j, p in enumerate(plan.prompts)})
  b = cfg.batch_size
  checked = 0

  def drawn(prefix, batch, row, phase, user):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(cfg.seed), batch), phase)
    sp = dict(temperature=cfg.user_temperature, top_p=cfg.user_top_p) if user else dict(
        temperature=0.7)
    budget = cfg.max_user_tokens + 1 if user else min(cfg.max_new_tokens,
                                                      cfg.max_len - len(prefix))
    out = jaxspec.generate(chat_target, [prefix] * b, max_new_tokens=budget, sampling=sp,
                           key=key, stop_ids=(END,), max_len=cfg.max_len + 16)
    return out.row(row)

  for source, prompt, _, toks, mask in _conversations(s.path):
    batch, row = divmod(prompt, b) if source == magpie else where[prompt]
    phase, pos = 0, 0
    if source == magpie:  # the first user turn: after the template's bare user prefix
      pos = len(turns.user_prefix)
      user = drawn(toks[:pos], batch, row, phase, True)
      assert toks[pos:pos + len(user)] == user
      pos, phase = pos + len(user) + len(turns.user_to_assistant) - 1, phase + 1
      checked += 1
    spans = _spans(mask)
    for n, (a, e) in enumerate(spans):
      assert n or source != magpie or a == pos  # a Magpie answer follows its user turn
      if n:  # a follow-up user turn the target wrote, after the lead of a user turn
        lead = len(turns.assistant_to_user) - 1
        start = spans[n - 1][1] + lead
        user = drawn(toks[:start], batch, row, phase, True)
        assert toks[start:start + len(user)] == user
        phase += 1
        checked += 1
      assert toks[a:e] == drawn(toks[:a], batch, row, phase, False)
      phase += 1
      checked += 1
  assert checked >= 12 and any(len(_spans(m)) == 2 for *_, m in _conversations(s.path))


def _written_batches(monkeypatch):
  """The indices of the batches `ConversationWriter.next` hands back from now on (what a
  `write_corpus` call generates): a rerun that continues must not write a batch again."""
  import jaxspec.train.corpus as corpus_mod
  real, done = corpus_mod.ConversationWriter.next, []

  def spy(self, *a, **k):
    out = real(self, *a, **k)
    if out is not None:
      done.append(out[0].index)
    return out

  monkeypatch.setattr(corpus_mod.ConversationWriter, "next", spy)
  return done


def _conversations(path):
  corpus = Corpus(path)
  out = []
  for s in range(corpus.num_shards):
    z = corpus.load_shard(s)
    o = z["offsets"]
    out += [(int(z["source"][c]), int(z["prompt"][c]), float(z["temperature"][c]),
             z["tokens"][o[c]:o[c + 1]].tolist(), z["loss_mask"][o[c]:o[c + 1]].tolist())
            for c in range(len(o) - 1)]
  return out


@pytest.mark.optimized
def test_resume_continues_without_duplicates(chat_target, whole, tmp_path, monkeypatch):
  """A run stopped after 3 batches and rerun to the budget writes exactly the conversations of
  an uninterrupted run (same order, no repeats); a leftover temporary file of a write killed
  midway is removed; a rerun with other settings is refused."""
  budget = WHOLE_BUDGET
  part = write_corpus(chat_target, PROMPTS, tmp_path / "part", CFG, token_budget=budget,
                      max_batches=3, progress=False)
  assert part.next_batch == 3 and part.loss_tokens < budget
  (tmp_path / "part" / "shard-00009.npz.tmp.npz").write_bytes(b"torn")
  written = _written_batches(monkeypatch)
  again = write_corpus(chat_target, PROMPTS, tmp_path / "part", CFG, token_budget=budget,
                       progress=False)
  assert written == list(range(3, whole.next_batch)), written  # batches 0-2 not written again
  assert not list((tmp_path / "part").glob("*.tmp*"))
  assert again.next_batch == whole.next_batch and again.loss_tokens == whole.loss_tokens
  a, b = _conversations(tmp_path / "part"), _conversations(whole.path)
  assert a == b
  keys = [(s, p, t) for s, p, t, _, _ in a]
  assert len(keys) == len(set(keys))  # each (prompt, temperature) at most once
  # A finished budget: rerunning adds nothing; a larger one grows the same corpus.
  same = write_corpus(chat_target, PROMPTS, tmp_path / "part", CFG, token_budget=budget,
                      progress=False)
  assert same.next_batch == whole.next_batch and _conversations(tmp_path / "part") == b
  more = write_corpus(chat_target, PROMPTS, tmp_path / "part", CFG, token_budget=budget + 100,
                      progress=False)
  assert more.loss_tokens >= budget + 100 and _conversations(tmp_path / "part")[:len(b)] == b
  with pytest.raises(DataError, match="different config"):
    write_corpus(chat_target, PROMPTS, tmp_path / "part", dataclasses.replace(CFG, seed=1),
                 token_budget=budget, progress=False)
  with pytest.raises(DataError, match="different prompts"):
    write_corpus(chat_target, PROMPTS[:-1], tmp_path / "part", CFG, token_budget=budget,
                 progress=False)


def test_refuses_bad_settings(chat_target, tmp_path):
  with pytest.raises(DataError, match="max_len 64 cannot hold"):
    CorpusConfig(max_len=64, max_prompt_len=32, max_new_tokens=40)
  with pytest.raises(DataError, match="magpie_fraction must be in"):
    CorpusConfig(magpie_fraction=1.5)
  with pytest.raises(DataError, match="token_budget must be"):
    write_corpus(chat_target, PROMPTS, tmp_path / "x", CFG, token_budget=0)
  with pytest.raises(DataError, match="--no-chat"):
    write_corpus(chat_target, PROMPTS, tmp_path / "x",
                 dataclasses.replace(CFG, chat=False), token_budget=10)
  plain = Model(chat_target.cfg, chat_target.params, name="no-tokenizer")
  with pytest.raises(DataError, match="need the target's chat template"):
    write_corpus(plain, [[5, 6, 7]], tmp_path / "x", CFG, token_budget=10)
  with pytest.raises(DataError, match="holds no corpus"):
    Corpus(tmp_path / "x")


# -- shards, packing and the streaming reader ---------------------------------------------------


def _random_corpus(path, shards, vocab=272, seed=0, per_shard=(20, 40), lengths=(3, 50)):
  """A corpus directory of random conversations, written shard by shard (no model)."""
  rng = np.random.default_rng(seed)
  path.mkdir()
  entries, convs = [], []
  for s in range(shards):
    n = int(rng.integers(*per_shard))
    cs = []
    for _ in range(n):
      ln = int(rng.integers(*lengths))
      cs.append((rng.integers(0, vocab, ln), (rng.random(ln) < 0.6).astype(np.uint8)))
    convs += cs
    entries.append(write_shard(path / f"shard-{s:05d}.npz", cs, source=rng.integers(0, 3, n),
                               prompt=np.arange(len(convs) - n, len(convs)),
                               temperature=np.zeros(n), turns=np.ones(n), vocab_size=vocab))
  (path / "index.json").write_text(json.dumps(
      {"format": FORMAT, "version": VERSION, "shards": entries, "sources": ["a", "b", "c"],
       "target": {"name": "x", "fingerprint": "0"}}))
  return convs


def test_shards_round_trip(tmp_path):
  for vocab, dtype in ((272, np.uint16), (70_000, np.int32)):
    path = tmp_path / f"v{vocab}"
    convs = _random_corpus(path, 3, vocab=vocab)
    corpus = Corpus(path)
    with np.load(path / "shard-00000.npz") as z:
      assert z["tokens"].dtype == dtype and z["loss_mask"].dtype == np.uint8
    got = list(corpus.conversations())
    assert len(got) == len(convs)
    for (t, m), (t2, m2) in zip(got, convs):
      assert t.dtype == np.int32
      np.testing.assert_array_equal(t, t2)
      np.testing.assert_array_equal(m, m2)
  (tmp_path / "v272" / "shard-00001.npz").unlink()
  with pytest.raises(DataError, match="lacks shard-00001.npz"):
    Corpus(tmp_path / "v272")
  with pytest.raises(DataError, match="outside"):
    write_shard(tmp_path / "bad.npz", [([5, 300], [1, 1])], source=[0], prompt=[0],
                temperature=[0], turns=[1], vocab_size=272)


def test_first_fit_decreasing_packing():
  assert pack_conversations([5, 3, 4, 2, 6], 8) == [[4, 3], [0, 1], [2]]
  assert pack_conversations([10, 2], 8) == [[0], [1]]  # too long: a row alone (truncated)
  rng = np.random.default_rng(0)
  lengths = rng.integers(1, 60, 200).tolist()
  rows = pack_conversations(lengths, 64)
  assert sorted(c for r in rows for c in r) == list(range(200))
  assert all(sum(lengths[c] for c in r) <= 64 for r in rows)
  assert len(rows) <= -(-sum(lengths) // 64) * 1.25  # dense: first-fit decreasing


def test_packed_rows_keep_conversations_apart(chat_target):
  """Packed rows: each segment holds its conversation and mask at positions 0.., padding is 0;
  the attention mask confines every query to its own conversation, so the target's forward over
  a packed row gives each conversation the hidden states it has alone."""
  rng = np.random.default_rng(1)
  convs = [(rng.integers(3, 272, n), (rng.random(n) < 0.5).astype(np.uint8))
           for n in (7, 12, 5, 20, 9)]
  tokens = np.concatenate([t for t, _ in convs])
  mask = np.concatenate([m for _, m in convs])
  offsets = np.concatenate([[0], np.cumsum([len(t) for t, _ in convs])])
  rows = [[3, 1], [4, 0, 2]]
  b = pack_rows(tokens, mask, offsets, rows, 32)
  for i, r in enumerate(rows):
    at = 0
    for seg, c in enumerate(r, 1):
      n = len(convs[c][0])
      np.testing.assert_array_equal(b["tokens"][i, at:at + n], convs[c][0])
      np.testing.assert_array_equal(b["loss_mask"][i, at:at + n], convs[c][1])
      assert (b["segment_ids"][i, at:at + n] == seg).all()
      np.testing.assert_array_equal(b["positions"][i, at:at + n], np.arange(n))
      at += n
    assert (b["tokens"][i, at:] == 0).all() and (b["loss_mask"][i, at:] == 0).all()
    assert (b["segment_ids"][i, at:] == 0).all()
  am = packed_attention_mask(b["segment_ids"])
  assert am[0, 21, 20] and not am[0, 20, 19] and not am[0, 3, 4] and am[0, 19, 0]
  assert am[1, 25, 24] and not am[1, 25, 20]  # padding reads padding only
  ahead = same_segment_ahead(b["segment_ids"], 2)
  assert ahead[0, 17] and not ahead[0, 18] and not ahead[0, 19] and not ahead[0, 30]
  np.testing.assert_array_equal(np.asarray(same_segment_ahead(jnp.asarray(b["segment_ids"]), 2)),
                                ahead)
  cfg = chat_target.cfg
  _, hid, _ = forward(chat_target.params, jnp.asarray(b["tokens"]), init_cache(cfg, 2, 32), cfg,
                      positions=jnp.asarray(b["positions"]),
                      block_mask=jnp.asarray(am), fresh=True, logits=False)
  # Each conversation alone: one forward over the five, right-padded (causal: a row's hidden
  # states do not see its padding), not one op-by-op forward per length.
  alone, _ = padded([list(t) for t, _ in convs], 20)
  alone = jax.jit(lambda t: forward(chat_target.params, t, init_cache(cfg, len(convs), 20), cfg,
                                    fresh=True, logits=False)[1].final)(alone)
  for i, r in enumerate(rows):
    at = 0
    for c in r:
      n = len(convs[c][0])
      np.testing.assert_allclose(np.asarray(hid.final[i, at:at + n]),
                                 np.asarray(alone[c, :n]), rtol=1e-4, atol=1e-4)
      at += n


def _check_two_epochs(data, full, bs, seed):
  """Two epochs of `data`'s batches equal the rows built from `full` (every shard's arrays in
  memory) in the epoch's order; an epoch reads each shard once, and at most shuffle_window
  shards are held at a time."""
  per = data.steps_per_epoch(bs)
  for step in range(2 * per):
    got = data.train_batch(step, bs, seed=seed)
    assert len(data._cached) <= data.shuffle_window
    epoch, pos = divmod(step, per)
    pairs = data.epoch_order(epoch, seed)[pos * bs:(pos + 1) * bs]
    want = [pack_rows(full[s]["tokens"], full[s]["loss_mask"], full[s]["offsets"],
                      [data.train_rows[s][r]], data.seq_len) for s, r in pairs]
    for k in ("tokens", "loss_mask", "segment_ids", "positions"):
      np.testing.assert_array_equal(got[k], np.concatenate([w[k] for w in want]))
    if step == per - 1:
      assert data.loads <= len(full)  # one read per shard in an epoch


def test_streaming_reader_equals_in_memory_reader_one_shard_at_a_time(tmp_path):
  """Batches read shard by shard equal the batches built from the whole corpus held in memory,
  over two epochs; an epoch reads each shard once; and the reader's memory stays far below the
  corpus's size."""
  path = tmp_path / "c"
  _random_corpus(path, 8, per_shard=(150, 200), lengths=(20, 120))
  data = PackedCorpus(path, 128, eval_fraction=0.1)
  corpus = Corpus(path)
  # In memory: every shard's arrays at once, rows built from the same plan and order.
  full = [corpus.load_shard(s) for s in range(corpus.num_shards)]
  bs = 8
  per = data.steps_per_epoch(bs)
  assert per == data.num_train_rows // bs and data.num_eval_rows > 0
  tracemalloc.start()
  _check_two_epochs(data, full, bs, seed=3)
  tracemalloc.stop()
  # Every training conversation appears exactly once in an epoch's rows, none held out.
  rows = data.epoch_order(0, 3)
  seen = sorted((int(s), c) for s, r in rows for c in data.train_rows[s][r])
  held = [held_out(corpus.shard_info(s)["source"], corpus.shard_info(s)["prompt"], 0.1, 0)
          for s in range(corpus.num_shards)]
  assert seen == sorted((s, c) for s in range(corpus.num_shards)
                        for c in np.flatnonzero(~held[s]).tolist())
  # Memory: one shard at a time, so the reader's peak does not grow with the corpus: a corpus of
  # four times as many shards (of the same size) peaks at about the same, a small multiple of
  # one shard (holding every shard would take 16 of them).
  del full

  def peak(n):
    big = tmp_path / f"big{n}"
    _random_corpus(big, n, per_shard=(100, 101), lengths=(200, 400), seed=n)
    data = PackedCorpus(big, 512, eval_fraction=0.1)
    tracemalloc.start()
    for step in range(data.steps_per_epoch(4)):
      data.train_batch(step, 4, seed=5)
    _, p = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    return p

  shard_bytes = 100 * 300 * 5  # int32 tokens and uint8 mask of a mean shard
  p16, p4 = peak(16), peak(4)
  assert p16 < 1.3 * p4 and p16 < 4 * shard_bytes, (p16, p4, shard_bytes)


def test_shuffle_window_mixes_shards_and_keeps_epochs_exact(tmp_path):
  """shuffle_window=W shuffles the training rows of W shards together: batches mix shards (one
  shard's rows alone when W is 1, as before), an epoch holds the same rows as with W = 1, each
  shard is read once per epoch and at most W are held, batches equal those built in memory,
  and a batch is a pure function of (seed, step) (a fresh reader at step k reads the same)."""
  path = tmp_path / "c"
  _random_corpus(path, 8, per_shard=(60, 80), lengths=(20, 120))
  corpus = Corpus(path)
  one = PackedCorpus(path, 128, eval_fraction=0.1)
  mixed = PackedCorpus(path, 128, eval_fraction=0.1, shuffle_window=4)
  # W = 1 keeps the order the reader had before the window (a resumed run reads what it read).
  want = np.concatenate([
      np.stack([np.full(len(one.train_rows[s]), s),
                np.random.default_rng([3, 0, int(s)]).permutation(len(one.train_rows[s]))], 1)
      for s in np.random.default_rng([3, 0]).permutation(corpus.num_shards)])
  np.testing.assert_array_equal(one.epoch_order(0, 3), want)
  order = mixed.epoch_order(0, 3)
  assert sorted(map(tuple, order.tolist())) == sorted(map(tuple, want.tolist()))
  bs = 8
  per = mixed.steps_per_epoch(bs)

  def shards_per_batch(data):
    o = data.epoch_order(0, 3)
    return np.mean([len(set(o[i * bs:(i + 1) * bs, 0].tolist())) for i in range(per)])
  assert shards_per_batch(one) < 1.3 and shards_per_batch(mixed) > 3.0
  full = [corpus.load_shard(s) for s in range(corpus.num_shards)]
  _check_two_epochs(mixed, full, bs, seed=3)
  fresh = PackedCorpus(path, 128, eval_fraction=0.1, shuffle_window=4)
  for k, v in fresh.train_batch(per + 3, bs, seed=3).items():
    np.testing.assert_array_equal(v, mixed.train_batch(per + 3, bs, seed=3)[k])
  with pytest.raises(DataError, match="shuffle_window"):
    PackedCorpus(path, 128, shuffle_window=0)
  # What a resumed run checks (`train`): the window and the shards decide the batches.
  assert one.signature() == dict(mixed.signature(), shuffle_window=1)
  assert one.signature()["shards"] == 8 and fresh.signature() == mixed.signature()


def test_unpacked_rows_and_eval_batches(tmp_path):
  path = tmp_path / "c"
  convs = _random_corpus(path, 2, lengths=(3, 30))
  data = PackedCorpus(path, 16, pack=False, eval_fraction=0.3)
  b = data.train_batch(0, 4, seed=0)
  assert b["tokens"].shape == (4, 16) and set(np.unique(b["segment_ids"])) <= {0, 1}
  lengths = {len(t) for t, _ in convs}
  assert all(min(int((r > 0).sum()), 16) in {min(n, 16) for n in lengths}
             for r in b["segment_ids"])
  ev = list(data.eval_batches(4, max_batches=2))
  assert len(ev) == 2 and all(e["tokens"].shape == (4, 16) for e in ev)
  with pytest.raises(DataError, match="exceeds the"):
    data.steps_per_epoch(10**6)


def test_held_out_is_per_prompt_and_stable():
  src = np.array([0, 0, 1, 1] * 500)
  prompt = np.repeat(np.arange(1000), 2)
  h = held_out(src, prompt, 0.1, 0)
  assert 0.05 < h.mean() < 0.15
  np.testing.assert_array_equal(h, held_out(src, prompt, 0.1, 0))
  assert not held_out(src, prompt, 0.0, 0).any()
  assert (h != held_out(src, prompt, 0.1, 1)).any()


# -- progress -----------------------------------------------------------------------------------


def test_progress_line_has_rate_and_eta():
  m = RateMeter(total=1000, done=400, start_done=100, t0=10.0)
  assert m.rate(now=40.0) == 10.0 and m.eta_seconds(now=40.0) == 60.0
  assert m.line(now=40.0) == ("[jaxspec] corpus: 400 / 1,000 tokens (40.0%), 10.0 tok/s,"
                              " eta 1m00s")
  assert RateMeter(total=10, t0=5.0).eta_seconds(now=5.0) is None
  # A time limit that comes before the budget is the ETA, and the line says so.
  m.deadline = 70.0
  assert m.eta_seconds(now=40.0) == 30.0
  assert m.line(now=40.0).endswith(" eta 0m30s (time limit)")
  m.deadline = 1000.0
  assert m.line(now=40.0).endswith(" eta 1m00s")
  assert RateMeter(total=10, t0=5.0, deadline=65.0).eta_seconds(now=5.0) == 60.0
  out = io.StringIO()  # not a terminal: plain lines, at most one per interval
  p = _Progress(RateMeter(total=10), True, every=3600.0, stream=out)
  p.update()
  p.update()
  p.update(force=True)
  assert out.getvalue().count("[jaxspec] corpus: 0 / 10 tokens") == 2


# -- the command ---------------------------------------------------------------------------------


def test_command_refuses_evaluation_prompts(tmp_path):
  from jaxspec.cli.app import main
  ev = tmp_path / "spec_bench_dev.jsonl"
  ev.write_text(json.dumps({"turns": ["hi"]}) + "\n")
  with pytest.raises(SystemExit, match="evaluation prompt set"):
    main(["train-data", "--out", str(tmp_path / "c"), "--tokens", "1k", "--prompts", str(ev)])
  assert not (tmp_path / "c").exists()
  with pytest.raises(SystemExit):
    main(["train-data", "--out", str(tmp_path / "c"), "--tokens", "lots"])


def test_token_count_suffixes():
  from jaxspec.cli.train_data import token_count
  assert [token_count(s) for s in ("500", "2M", "1.5k", "3G")] == [500, 2_000_000, 1500,
                                                                    3 * 10**9]


def test_train_data_layout_and_compile_cache_options(tmp_path, monkeypatch):
  """--scan-layers: auto stacks the layers on the CPU (a corpus compiles a program per cache size
  and answer length); yes / no are passed to load as they are. --compile-cache as generate's."""
  import jaxspec.models.loading as loading
  from jaxspec.cli.app import main
  seen = []

  def fake_load(*args, **kw):
    seen.append(kw["scan_layers"])
    raise OSError("stop here")

  monkeypatch.setattr(loading, "load", fake_load)
  for flag in ([], ["--scan-layers", "no"], ["--scan-layers", "yes"]):
    with pytest.raises(SystemExit, match="stop here"):
      main(["train-data", "--out", str(tmp_path / "c"), "--tokens", "1k"] + flag)
  assert seen == [True, False, True]
  from jaxspec.cli.app import _parser
  args = ["train-data", "--out", "c", "--tokens", "1k"]
  assert _parser().parse_args(args).compile_cache is None  # the default cache, as generate's
  assert _parser().parse_args(args + ["--compile-cache", "none"]).compile_cache == "none"


def test_max_minutes_option(tmp_path, capsys):
  """--max-minutes (train-data and train) takes positive finite minutes; other values are a
  one-line usage error before anything loads."""
  import argparse

  from jaxspec.cli.app import main
  from jaxspec.cli_options import minutes
  assert [minutes(s) for s in ("30", "0.5", "1e-3")] == [30.0, 0.5, 0.001]
  for bad in ("0", "-1", "nan", "inf", "soon"):
    with pytest.raises(argparse.ArgumentTypeError, match="expected minutes > 0"):
      minutes(bad)
  for cmd in (["train-data", "--out", str(tmp_path / "c"), "--tokens", "1k"],
              ["train", "eagle", "--out", str(tmp_path / "h")]):
    with pytest.raises(SystemExit):
      main(cmd + ["--max-minutes", "0"])
    assert "expected minutes > 0" in capsys.readouterr().err
  assert not (tmp_path / "c").exists() and not (tmp_path / "h").exists()
  from jaxspec.cli.app import _parser
  from jaxspec.cli.train import _train_config
  args = _parser().parse_args(["train", "eagle", "--out", "h", "--max-minutes", "2.5"])
  assert _train_config(args).time_limit == 150.0
  args = _parser().parse_args(["train", "eagle", "--out", "h"])
  assert _train_config(args).time_limit is None


# -- the offline path -----------------------------------------------------------------------------


def test_corpus_dataset_stores_conversations_and_hidden_states(chat_target, tmp_path):
  """`write_corpus_dataset`: one conversation a row (cut to seq_len), its loss mask, the
  answers to one prompt under one prompt index, and the target's hidden states of the row."""
  from jaxspec.train.corpus import write_corpus_dataset
  from jaxspec.train.data import Dataset
  s = write_corpus(chat_target, PROMPTS, tmp_path / "c", CFG, token_budget=150, progress=False)
  convs = _conversations(s.path)
  ds_dir = write_corpus_dataset(chat_target, s.path, tmp_path / "ds", seq_len=40,
                                hidden_layers=(1, 0, 1), progress=False)
  ds = Dataset(ds_dir, layers=(1, 0, 1), eval_fraction=0.25)
  ds.check_target(chat_target, layers=(1, 0))
  kept = [c for c in convs if any(c[4][:40])]
  assert len(ds) == len(kept) and ds.hidden_layers == (1, 0)
  for r, (src, prompt, _, toks, mask) in enumerate(kept):
    n = min(len(toks), 40)
    assert int(ds.lengths[r]) == n
    np.testing.assert_array_equal(ds.tokens[r, :n], toks[:n])
    np.testing.assert_array_equal(ds.loss_mask[r, :n], mask[:n])
    assert int(ds.prompt_lengths[r]) == mask.index(1)
  groups = {}
  for r, (src, prompt, *_) in enumerate(kept):
    groups.setdefault((src, prompt), set()).add(int(ds.prompt_index[r]))
  assert all(len(g) == 1 for g in groups.values())
  assert len({next(iter(g)) for g in groups.values()}) == len(groups)
  cfg = chat_target.cfg
  n = int(ds.lengths[0])
  _, hid, _ = forward(chat_target.params, jnp.asarray(ds.tokens[:1, :n]), init_cache(cfg, 1, n),
                      cfg, hidden_layers=(1, 0))
  np.testing.assert_allclose(ds.hidden_final[0, :n], np.asarray(hid.final[0]), rtol=2e-3,
                             atol=2e-3)
  b = ds.train_batch(0, 2, seed=0)
  assert b["hidden_layers"].shape[2] == 3
  with pytest.raises(DataError, match="already holds a dataset"):
    write_corpus_dataset(chat_target, s.path, ds_dir, progress=False)
  other = Model(chat_target.cfg, init_params(chat_target.cfg, jax.random.key(9)), name="other")
  with pytest.raises(DataError, match="was written by target 'tiny-chat'"):
    write_corpus_dataset(other, s.path, tmp_path / "ds2", progress=False)


def test_commands_write_a_corpus_resume_it_and_train_a_head_on_it(tiny_target, tmp_path, capsys):
  """`jaxspec train-data` writes a corpus to a budget, a rerun with a larger one continues it,
  and `jaxspec train medusa --corpus` trains on it through the offline hidden-state store."""
  from jaxspec.cli.app import main
  from jaxspec.models.hf_loader import save_hf
  target = save_hf(tiny_target, tmp_path / "target")
  rng = np.random.default_rng(2)
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt_ids": rng.integers(3, 128, size=5).tolist()})
                             + "\n" for _ in range(12)))
  out = tmp_path / "corpus"
  args = ["train-data", "--model", str(target), "--out", str(out), "--prompts", str(prompts),
          "--no-chat", "--turns", "1", "--magpie-fraction", "0", "--max-new-tokens", "10",
          "--max-prompt-len", "8", "--max-len", "64", "--gen-batch-size", "4",
          "--shard-tokens", "40", "--no-progress"]
  assert main(args + ["--tokens", "30"]) == 0
  first = json.loads((out / "index.json").read_text())
  assert "budget reached" in capsys.readouterr().out
  assert 30 <= first["totals"]["loss_tokens"] < 240 and first["sources"][0] == "prompts.jsonl"
  assert main(args + ["--tokens", "10k"]) == 0  # more than 12 prompts x 2 temperatures hold
  index = json.loads((out / "index.json").read_text())
  assert index["complete"] and index["totals"]["conversations"] == 24
  assert index["shards"][:len(first["shards"])] == first["shards"]
  assert "complete" in capsys.readouterr().out
  head = tmp_path / "medusa"
  assert main(["train", "medusa", "--model", str(target), "--corpus", str(out), "--out",
               str(head), "--steps", "2", "--batch-size", "4", "--option", "num_heads=1",
               "--corpus-seq-len", "16", "--no-progress"]) == 0
  meta = json.loads((head / "data" / "meta.json").read_text())
  assert meta["num_examples"] == 24 and meta["corpus"]["path"] == str(out)
  assert json.loads((head / "summary.json").read_text())["final"]["step"] == 2
  with pytest.raises(SystemExit, match="--corpus is the training data"):
    main(["train", "medusa", "--model", str(target), "--corpus", str(out), "--prompts",
          str(prompts), "--out", str(tmp_path / "x")])


def test_train_turns_writes_multi_turn_conversations_and_self_instructions(chat_target,
                                                                           tmp_path):
  """`jaxspec train KIND --turns 2 --self-instructions N`: every prompt at every temperature
  plus N target-started conversations (whole Magpie batches), each with up to two answers,
  kept in --out/corpus and stored with hidden states as the training data."""
  from jaxspec.cli.app import main

  from helpers import write_tiny_gguf
  gguf_path = tmp_path / "tiny-chat.gguf"
  write_tiny_gguf(gguf_path, chat_target.cfg, chat_target.params,
                  types={k: "F32" for k in ("token_embd", "output", "attn_q", "attn_k",
                                            "attn_v", "attn_output", "ffn_gate", "ffn_up",
                                            "ffn_down")})
  prompts = tmp_path / "prompts.jsonl"
  prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:5]))
  out = tmp_path / "medusa"
  assert main(["train", "medusa", "--model", str(gguf_path), "--prompts", str(prompts),
               "--self-instructions", "6", "--turns", "2", "--out", str(out), "--steps", "2",
               "--batch-size", "2", "--option", "num_heads=1", "--max-new-tokens", "12",
               "--max-prompt-len", "32", "--gen-batch-size", "4", "--temperature", "0", "0.7",
               "--no-progress"]) == 0
  index = json.loads((out / "corpus" / "index.json").read_text())
  # 5 prompts at 2 temperatures in batches of 4: 4 prompt batches; 6 instructions: 2 Magpie.
  assert index["next_batch"] == 6 and index["config"]["turns"] == 2
  convs = _conversations(out / "corpus")
  magpie = len(index["sources"]) - 1
  assert sorted((p, t) for s, p, t, _, _ in convs if s != magpie) == sorted(
      (p, float(np.float32(t))) for p in range(5) for t in (0.0, 0.7))
  # Magpie rows keep only user turns of 4 tokens or more (the tiny model's are often shorter).
  assert sum(s == magpie for s, *_ in convs) <= 8
  assert max(len(_spans(m)) for *_, m in convs) == 2
  meta = json.loads((out / "data" / "meta.json").read_text())
  assert meta["num_examples"] == len(convs) and meta["generation"]["turns"] == 2
  with pytest.raises(SystemExit, match="--turns above 1"):
    main(["train", "medusa", "--model", str(gguf_path), "--prompts", str(prompts), "--turns",
          "2", "--responses", "given", "--out", str(tmp_path / "x")])


@pytest.mark.optimized
def test_interrupt_keeps_finished_batches(chat_target, whole, tmp_path, monkeypatch):
  """Ctrl-C (or the command's SIGTERM) during batch 3 stores batches 0-2 before it propagates;
  a rerun, with another shard size, ends with the conversations of an uninterrupted run."""
  import jaxspec.train.corpus as corpus_mod
  real, calls = corpus_mod.ConversationWriter.next, []

  def flaky(self, *a, **k):  # batch 3 is being written when Ctrl-C comes
    calls.append(self.next_batch)
    if len(calls) == 4:
      raise KeyboardInterrupt
    return real(self, *a, **k)

  monkeypatch.setattr(corpus_mod.ConversationWriter, "next", flaky)
  big = dataclasses.replace(CFG, shard_tokens=10**6)  # nothing would be flushed before the end
  with pytest.raises(KeyboardInterrupt):
    write_corpus(chat_target, PROMPTS, tmp_path / "part", big, token_budget=WHOLE_BUDGET,
                 progress=False)
  index = json.loads((tmp_path / "part" / "index.json").read_text())
  assert index["next_batch"] == 3 and len(index["shards"]) == 1
  monkeypatch.setattr(corpus_mod.ConversationWriter, "next", real)
  written = _written_batches(monkeypatch)
  again = write_corpus(chat_target, PROMPTS, tmp_path / "part", CFG, token_budget=WHOLE_BUDGET,
                       progress=False)
  assert written == list(range(3, whole.next_batch)), written
  assert again.next_batch == whole.next_batch
  assert _conversations(tmp_path / "part") == _conversations(whole.path)


def test_multi_turn_prompts_give_their_user_turns(chat_target, tmp_path):
  """A prompt of several user turns: the file's turns follow the target's answers (as the
  template writes a user message), every answer is the target's (greedy here), and
  `read_prompts(all_turns=True)` reads them from a `turns` line."""
  from jaxspec.train.data import read_prompts
  f = tmp_path / "mt.jsonl"
  f.write_text("".join(json.dumps({"turns": [a, "and why?", "ok"]}) + "\n" for a in PROMPTS))
  prompts, _ = read_prompts([f], all_turns=True)
  assert sorted(p[0] for p in prompts) == sorted(PROMPTS) and all(p[1:] == ["and why?", "ok"]
                                                                 for p in prompts)
  assert read_prompts([f])[0][0] in PROMPTS  # without all_turns: the first turn only
  cfg = dataclasses.replace(CFG, temperatures=(0.0,), magpie_fraction=0.0, turns=4)
  s = write_corpus(chat_target, prompts, tmp_path / "c", cfg, token_budget=10**6,
                   progress=False)
  turns = chat_turns(chat_target.tokenizer)
  tok = chat_target.tokenizer
  given = [tok.encode(t, add_bos=False) for t in ("and why?", "ok")]
  seen = 0
  convs = _conversations(s.path)
  greedy_all = _greedy_after_each_token(chat_target, [toks for *_, toks, _ in convs])
  for (*_, toks, mask), greedy in zip(convs, greedy_all):
    spans = _spans(mask)
    for a, b in spans:
      assert toks[a:b] == greedy[a - 1:b - 1].tolist()
    for j, ((_, b), (a2, _)) in enumerate(zip(spans, spans[1:])):
      between = toks[b:a2]
      if j < 2:  # the file's turns, then one the target wrote (4 answers)
        assert between == (list(turns.assistant_to_user[1:]) + given[j]
                           + list(turns.user_to_assistant))
        seen += 1
  assert seen >= 2


def test_a_corpus_stamped_by_the_old_fingerprint_rule_continues(chat_target, tmp_path):
  """data/corpus/smollm2-135m's README command continues it: its index carries the fingerprint
  rule of before the unification, which `write_corpus` once refused as another target."""
  from jaxspec.train.data import _fingerprint_v1
  out = tmp_path / "c"
  write_corpus(chat_target, PROMPTS, out, CFG, token_budget=10**6, max_batches=1,
               progress=False)
  index = json.loads((out / "index.json").read_text())
  index["target"]["fingerprint"] = _fingerprint_v1(chat_target)
  (out / "index.json").write_text(json.dumps(index))
  s = write_corpus(chat_target, PROMPTS, out, CFG, token_budget=10**6, max_batches=1,
                   progress=False)
  assert s.next_batch == 2
  assert Corpus(out).index["target"]["fingerprint"] == _fingerprint_v1(chat_target)
  other = Model(chat_target.cfg, init_params(chat_target.cfg, jax.random.key(9)),
                tokenizer=chat_target.tokenizer, name="tiny-chat")
  with pytest.raises(DataError, match="different target"):
    write_corpus(other, PROMPTS, out, CFG, token_budget=10**6, max_batches=1, progress=False)


def test_committed_corpus_serves_the_bundled_model(smollm2):
  """data/corpus/smollm2-135m was stamped by the fingerprint rule of before the unification, with
  the config fields of that day: a field LlamaConfig gained later (attention_kernel) once made
  every such corpus refuse the very model that wrote it."""
  from pathlib import Path
  path = Path(__file__).resolve().parents[2] / "data" / "corpus" / "smollm2-135m"
  if not (path / "index.json").is_file():
    pytest.skip(f"no committed corpus at {path}")
  corpus = Corpus(path)
  corpus.check_target(smollm2)  # raises DataError on a mismatch
  # Another target's stamp is still refused.
  corpus.index["target"]["fingerprint"] = "0123456789abcdef"
  with pytest.raises(DataError, match="fingerprint 0123456789abcdef"):
    corpus.check_target(smollm2)


@pytest.mark.optimized
def test_time_limit_starts_no_batch_past_it(chat_target, whole, tmp_path, monkeypatch):
  """write_corpus(time_limit=) starts no batch once the limit has passed, keeps what it wrote,
  and a rerun continues to the corpus of an uninterrupted run; bad limits are refused."""
  import jaxspec.train.corpus as corpus_mod
  budget = WHOLE_BUDGET
  clock = {"t": 0.0}

  def fake_clock():  # every reading is 10 s later: a limit of 25 s lets batches 0 and 1 start
    clock["t"] += 10.0
    return clock["t"]

  fake_time = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time)
                                       if not k.startswith("_")})
  fake_time.monotonic = fake_clock  # the corpus module's clock only
  monkeypatch.setattr(corpus_mod, "time", fake_time)
  part = write_corpus(chat_target, PROMPTS, tmp_path / "part", CFG, token_budget=budget,
                      time_limit=25.0, progress=False)
  monkeypatch.undo()
  assert part.next_batch == 2 < whole.next_batch and part.loss_tokens < budget
  written = _written_batches(monkeypatch)
  again = write_corpus(chat_target, PROMPTS, tmp_path / "part", CFG, token_budget=budget,
                       progress=False)
  assert written == list(range(2, whole.next_batch)), written
  assert _conversations(tmp_path / "part") == _conversations(whole.path)
  assert again.next_batch == whole.next_batch
  for bad in (0, -5, float("nan"), float("inf"), True, "60"):
    with pytest.raises(DataError, match="time_limit is seconds > 0"):
      write_corpus(chat_target, PROMPTS, tmp_path / "x", CFG, token_budget=budget,
                   time_limit=bad, progress=False)
