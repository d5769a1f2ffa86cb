"""benchmarks/recipe_eagle_round3.py: `pack` gathers the finished chunks into the committed
rows format, a prompt round two answered keeping round two's prompt_index, and its rows read
back as the (prompt, response) pairs the chunks hold."""

import json
import sys

import numpy as np

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import recipe_eagle_round3 as recipe  # noqa: E402


def _chunk(d, rows, temp, source):
  """A tokens-only chunk as `write_dataset(..., store_hidden=False)` leaves it."""
  d.mkdir(parents=True)
  width = max(len(p) + len(r) for p, r in rows)
  tokens = np.zeros((len(rows), width), np.int32)
  for i, (p, r) in enumerate(rows):
    tokens[i, :len(p) + len(r)] = p + r
  np.save(d / "tokens.npy", tokens)
  np.save(d / "lengths.npy", np.array([len(p) + len(r) for p, r in rows], np.int32))
  np.save(d / "prompt_lengths.npy", np.array([len(p) for p, _ in rows], np.int32))
  meta = {"num_examples": len(rows), "prompt_files": {source: len(rows)},
          "generation": {"temperatures": [temp], "max_new_tokens": 256},
          "response_tokens": sum(len(r) for _, r in rows), "stopped_rows": 1,
          "seconds": {"generate": 2.0, "hidden": 0.0}, "target": {"fingerprint": "f"}}
  (d / "meta.json").write_text(json.dumps(meta))


def test_pack_keeps_round_two_prompt_indices_and_reads_back(tmp_path):
  z = np.load(recipe.ROUND2)
  i = int(np.flatnonzero(z["prompt_index"] >= recipe.FIRST_MAGPIE)[0])
  old_prompt = z["tokens"][i, :z["prompt_lengths"][i]].tolist()
  assert recipe.round2_magpie_prompts()[0] == old_prompt
  new_prompt = [1, 2, 3, 4]
  _chunk(tmp_path / "chunks" / "new00-t0", [(new_prompt, [5, 6, 2])], 0.0, "new")
  _chunk(tmp_path / "chunks" / "old00", [(old_prompt, [7, 8, 9, 10, 2])], 0.7, "old")
  (tmp_path / "chunks" / "new01-t0").mkdir()  # unfinished: no meta.json, left out
  recipe.pack(tmp_path)
  packed = np.load(tmp_path / "rows.npz")
  assert packed["tokens"].dtype == np.uint16
  assert packed["prompt_index"].tolist() == [int(z["prompt_index"].max()) + 1,
                                              int(z["prompt_index"][i])]
  assert packed["temperature"].tolist() == [0.0, np.float32(0.7)]
  assert recipe._rows(tmp_path / "rows.npz") == [(new_prompt, [5, 6, 2]),
                                                  (old_prompt, [7, 8, 9, 10, 2])]
  record = json.loads((tmp_path / "meta.json").read_text())
  assert record["rows_by_source"] == {"new": 1, "old": 1}
  assert record["response_tokens"] == 8 and record["prompts"] == 2
  assert record["chunks"] == ["new00-t0", "old00"]


def test_the_committed_rows_hold_what_their_record_says():
  record = json.loads((recipe.ROUND3.parent / "meta.json").read_text())
  rows = recipe._rows(recipe.ROUND3)
  assert len(rows) == record["rows"] == 1440
  assert sum(len(r) for _, r in rows) == record["response_tokens"]
  assert max(len(r) for _, r in rows) <= record["max_new_tokens"]
