"""benchmarks/recipe_eagle_gpu.py (the head's round on a lent GPU) at the sizes of a CPU: it writes
a corpus, trains the head online within its limits, and returns at most 8 files a later session
reads back (the head, the record, the corpus as a tar cut into pieces when large)."""

import json
import sys
import tarfile

from helpers import ROOT, SHARED, shared_or_skip

sys.path.insert(0, str(ROOT / "benchmarks"))
import recipe_eagle_gpu as recipe  # noqa: E402


def test_split_file_cuts_large_files_into_pieces_that_join_back(tmp_path):
  data = bytes(range(256)) * 41  # 10,496 bytes
  small = tmp_path / "small.bin"
  small.write_bytes(data[:100])
  assert recipe.split_file(small, size=1000) == [small]
  big = tmp_path / "big.tar"
  big.write_bytes(data)
  parts = recipe.split_file(big, size=4000)
  assert [p.name for p in parts] == ["big.tar.00", "big.tar.01", "big.tar.02"]
  assert not big.exists() and b"".join(p.read_bytes() for p in parts) == data


def test_recipe_at_cpu_sizes_returns_the_head_and_the_corpus(smollm2, tmp_path):
  shared_or_skip(SHARED / "data" / "gsm8k_train.jsonl")
  from jaxspec.heads.io import load_head_model
  from jaxspec.train.corpus import Corpus
  out = tmp_path / "out"
  rec = recipe.main(["--work", str(tmp_path / "work"), "--out", str(out), "--gen-batch-size",
                     "4", "--max-new-tokens", "16", "--max-len", "1024", "--generate-minutes",
                     "0.01", "--steps", "3", "--batch-size", "2", "--seq-len", "128",
                     "--eval-every", "3"], target=smollm2)
  files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
  assert files == ["corpus.tar", "eagle/config.json", "eagle/head.safetensors",
                   "history.jsonl", "record.json"]
  assert json.loads((out / "record.json").read_text()) == json.loads(json.dumps(rec,
                                                                                default=str))
  # One batch started before the limit: its conversations, and nothing else, are the corpus.
  assert rec["corpus"]["next_batch"] == 1 and rec["corpus"]["conversations"] == 4
  assert rec["train"]["steps"] == 3 and rec["train"]["stopped"] is None
  assert [json.loads(line)["step"] for line in (out / "history.jsonl").read_text().splitlines()
          ][-1] == 3
  with tarfile.open(out / "corpus.tar") as f:
    f.extractall(tmp_path / "back", filter="data")
  corpus = Corpus(tmp_path / "back" / "corpus")
  assert corpus.index["totals"]["loss_tokens"] == rec["corpus"]["answer_tokens"] > 0
  corpus.check_target(smollm2)
  _, head, config = load_head_model(smollm2, out / "eagle")
  assert config["meta"]["recipe"] == rec["recipe"]
  assert config["meta"]["train"]["steps"] == 3 and head.cfg.version == 3
