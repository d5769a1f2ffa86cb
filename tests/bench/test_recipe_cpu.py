"""benchmarks/recipe_eagle_cpu.py (the head's round on this CPU): the training corpus mixes a
written corpus with earlier rounds' rows, each row one conversation whose loss mask is its
response, and the head trains on it online and is saved with its record."""

import json
import sys

import numpy as np
import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import recipe_eagle_cpu as recipe  # noqa: E402

CORPUS = ROOT / "data" / "corpus" / "smollm2-135m"


def _rows(path, rows):
  """A rows.npz like data/heads/*/ (prompt then response, zero padded)."""
  width = max(len(p) + len(r) for p, r in rows) + 3
  tokens = np.zeros((len(rows), width), np.uint16)
  for i, (p, r) in enumerate(rows):
    tokens[i, :len(p) + len(r)] = p + r
  np.savez_compressed(path, tokens=tokens, lengths=[len(p) + len(r) for p, r in rows],
                      prompt_lengths=[len(p) for p, _ in rows],
                      prompt_index=np.arange(len(rows)))
  return path


def test_mixed_corpus_holds_the_corpus_and_every_row(tmp_path):
  from jaxspec.train.corpus import Corpus, PackedCorpus
  rows = [([5, 6, 7], [8, 9]), ([1, 2], [3, 4, 5, 6]), ([10] * 5, [11])]
  f = _rows(tmp_path / "rows.npz", rows)
  mixed = recipe.mixed_corpus([CORPUS], [str(f)], tmp_path / "mixed", 49152, shard_rows=2)
  base, got = Corpus(CORPUS), mixed
  assert got.num_shards == base.num_shards + 2
  assert got.sources == [f"{s} (smollm2-135m)" for s in base.sources] + [recipe.ROWS_SOURCE]
  convs = list(got.conversations())
  n = base.index["totals"]["conversations"]
  assert len(convs) == n + 3 == got.index["totals"]["conversations"]
  for (t, m), (p, r) in zip(convs[n:], rows):
    assert t.tolist() == p + r and m.tolist() == [0] * len(p) + [1] * len(r)
  assert got.index["totals"]["loss_tokens"] == base.index["totals"]["loss_tokens"] + 7
  assert PackedCorpus(mixed, 256).num_train_rows > 0
  # Rebuilt, not appended to, on a second call.
  recipe.mixed_corpus([CORPUS], [], tmp_path / "mixed", 49152)
  assert Corpus(tmp_path / "mixed").index["totals"] == base.index["totals"]


def test_two_corpora_keep_their_sources_apart(tmp_path):
  from jaxspec.train.corpus import Corpus
  mixed = recipe.mixed_corpus([CORPUS, CORPUS], [], tmp_path / "mixed", 49152)
  base, got = Corpus(CORPUS), mixed
  assert got.num_shards == 2 * base.num_shards and len(got.sources) == 2 * len(base.sources)
  n = base.num_shards
  for s in range(n):
    a, b = got.load_shard(s), got.load_shard(n + s)
    assert (b["source"] == a["source"] + len(base.sources)).all()
    assert (a["tokens"] == b["tokens"]).all() and (a["offsets"] == b["offsets"]).all()
  assert got.index["totals"]["loss_tokens"] == 2 * base.index["totals"]["loss_tokens"]


@pytest.mark.parametrize("kind", ["eagle", "mlp"])
def test_recipe_trains_the_head_online_and_saves_it_with_its_record(smollm2, tmp_path, kind):
  """--init names the bundled head trained further, and so its kind (EAGLE-3 by default)."""
  from jaxspec.heads import head_kind
  from jaxspec.heads.io import load_head_model
  f = _rows(tmp_path / "rows.npz", [([1, 2, 3], list(range(40, 70)))] * 4)
  out = tmp_path / "out"
  rec = recipe.main(["--corpus", str(CORPUS), "--work", str(tmp_path / "work"), "--out",
                     str(out), "--rows", str(f), "--steps", "2", "--batch-size", "2",
                     "--seq-len", "128", "--eval-every", "2", "--eval-batches", "1"]
                    + (["--init", kind] if kind != "eagle" else []), target=smollm2)
  assert json.loads((out / "record.json").read_text()) == json.loads(json.dumps(rec,
                                                                                default=str))
  assert rec["train"]["steps"] == 2 and rec["train"]["stopped"] is None
  from jaxspec.train.corpus import Corpus
  assert rec["data"]["totals"]["conversations"] == Corpus(CORPUS).index["totals"][
      "conversations"] + 4
  history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
  assert history[-1]["step"] == 2 and "eval_acc_0" in history[-1]
  _, head, config = load_head_model(smollm2, out / kind)
  assert config["meta"]["recipe"] == rec["recipe"] and head_kind(head) == kind
  assert config["meta"]["init"].startswith(kind)
  if kind == "eagle":
    assert head.cfg.version == 3
