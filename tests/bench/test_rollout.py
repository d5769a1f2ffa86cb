"""`jaxspec bench --workload rollout`: the settings' checks, the prompts it reads, and a run on the
tiny model (the report's cells; plain decoding's samples do not depend on the batch size)."""

import json

import pytest

from jaxspec.bench import BenchError, RolloutSettings, run_rollout
from jaxspec.bench.rollout import check_rollout, rollout_prompts
from jaxspec.cli import main
from helpers import SHARED, shared_or_skip


@pytest.mark.parametrize("kw, match", [
    (dict(batch_sizes=(1, 3)), "3 does not divide --samples 8"),
    (dict(methods=("none", "eagle")), "unknown rollout method 'eagle'"),
    (dict(temperatures=(0.0,)), "must be positive"),
    (dict(data_dir="/nonexistent"), "gsm8k_train.jsonl does not exist"),
    (dict(methods=("none", "suffix-tree"), tree_size=0), "--tree-size must be in"),
])
def test_bad_settings(kw, match):
  with pytest.raises(BenchError, match=match):
    check_rollout(RolloutSettings(**kw))


def test_bad_command_line_is_an_error(tmp_path):
  with pytest.raises(SystemExit, match="does not divide"):
    main(["bench", "--workload", "rollout", "--batch-sizes", "3", "--data-dir",
          str(tmp_path), "--out", str(tmp_path)])
  with pytest.raises(SystemExit, match="--temperatures must be numbers"):
    main(["bench", "--workload", "rollout", "--temperatures", "hot", "--out", str(tmp_path)])


def test_prompts_alternate_gsm8k_and_humaneval():
  data = shared_or_skip(SHARED / "data")
  got = rollout_prompts(RolloutSettings(data_dir=str(data), prompts_per_set=3))
  assert [k for k, _ in got] == ["gsm8k", "humaneval"] * 3
  first = json.loads((data / "gsm8k_train.jsonl").open().readline())["question"]
  assert got[0][1] == first
  assert got[1][1].startswith("Complete this Python function.\n\nfrom typing import List")


def test_run_on_the_tiny_model(tiny_target, tmp_path):
  # "suffix-sampled" is one more drafter name through the same report (it resolves in
  # drafters/test_suffix.py's default tests, which check its drafts exact).
  s = RolloutSettings(samples=2, temperatures=(0.8,), batch_sizes=(1, 2), max_new_tokens=6,
                      methods=("none", "suffix", "suffix-tree"),
                      num_draft_tokens=2,
                      corpus_size=64, tree_size=4, out=str(tmp_path), progress=False)
  rep = run_rollout(s, target=tiny_target, prompt_ids=[[5, 6, 7, 8, 5, 6, 7], [9, 30, 4]])
  cells = {(c["batch_size"], c["method"]): c for c in rep["results"]}
  methods = ("none", "suffix", "suffix-tree")
  assert set(cells) == {(b, m) for b in (1, 2) for m in methods}
  for b in (1, 2):
    assert cells[b, "none"]["calls"] == 2 * 2 // b  # 2 prompts, samples / b calls each
    assert cells[b, "none"]["speedup"] == 1.0
    assert cells[b, "suffix"]["tau"] >= 1.0 and cells[b, "suffix"]["speedup"] > 0
    assert cells[b, "suffix"]["speedup_over_ngram"] is None  # NGram did not run
    # Per draft position: accepted at i over the row-steps that verified drafts (k = 2).
    c = cells[b, "suffix"]
    assert len(c["acceptance_per_position"]) == 2 and sum(c["accepted_at"]) >= c["accepted"]
    assert c["acceptance_per_position"][0] == c["accepted_at"][0] / c["spec_row_steps"]
    assert cells[b, "none"]["acceptance_per_position"] is None
    # The tree rule draws every position with the target's key for it: plain's samples.
    assert cells[b, "suffix-tree"]["tokens"] == cells[b, "none"]["tokens"]
    assert cells[b, "suffix-tree"]["tau"] >= 1.0 and cells[b, "suffix-tree"]["calls"] == 4 // b
  # Row i of a prompt draws with the same key at every batch size: the same plain samples.
  assert cells[1, "none"]["tokens"] == cells[2, "none"]["tokens"]
  saved = json.loads((tmp_path / "rollout.json").read_text())
  assert saved["schema"] == "jaxspec-bench-rollout/1" and len(saved["results"]) == 6
  md = (tmp_path / "rollout.md").read_text()
  assert "| 0.8 | 1 | suffix |" in md and "| 0.8 | 1 | suffix-tree |" in md
  assert "acceptance per position |" in md
  assert "suffix tree 4 nodes" in md
  assert [g["goal"] for g in saved["goals"]] == [
      f"{m} {what} at T=0.8, batch 1" for m in ("suffix", "suffix-tree")
      for what in ("tau >= 2.0", "speedup >= 1.25x over plain")]
