"""`jaxspec generate`'s command-line conventions: `--version`, the text alone on stdout and the
stats on stderr, `--json` lines, `--prompts` batches in file order, acceptance "n/a" when
nothing was drafted, and every drafter name printed being one `--draft` takes."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

import jaxspec
from jaxspec.cli import generate as gen
from jaxspec.cli import main

P1, P2 = "What is 2+2?", "Name a colour."
PLAIN = ["--max-new-tokens", "8", "--draft", "none"]
STATS_KEYS = {"tokens_per_second", "seconds", "compile_seconds", "cost_seconds", "cost_source",
              "load_seconds", "model",
              "peak_memory_bytes",
              "drafter", "batch_size", "k", "mean_k", "plain_steps", "target_passes", "tau",
              "drafted", "accepted", "acceptance"}


@pytest.fixture
def bundled(bundled_cli_model):
  """The CLI's load of the bundled model returns the session's copy (conftest)."""
  return bundled_cli_model


def _messages(err: str) -> list[str]:
  """stderr's lines without the status lines of slow phases ("[jaxspec] compiled the ...")."""
  return [ln for ln in err.splitlines()
          if not re.match(r"\[jaxspec\] (loaded|compiled|measured) .* in [\d.]+ s$", ln)]


@pytest.fixture
def no_model(monkeypatch):
  """Fails any model load: the checks under test must come before it."""
  from jaxspec.models import loading

  def refuse(*a, **kw):
    raise AssertionError("the model was loaded before the input was checked")
  monkeypatch.setattr(loading, "load", refuse)


def _generate(capsys, *argv):
  assert main(["generate", *argv]) == 0
  return capsys.readouterr()


def _records(out: str) -> list[dict]:
  return [json.loads(line) for line in out.splitlines()]


def test_version_prints_name_and_version(capsys):
  with pytest.raises(SystemExit) as e:
    main(["--version"])
  assert e.value.code == 0
  assert capsys.readouterr().out == f"jaxspec {jaxspec.__version__}\n"
  exe = shutil.which("jaxspec", path=os.path.dirname(sys.executable)) or shutil.which("jaxspec")
  assert exe, "the jaxspec console script is not installed"
  out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=120)
  assert (out.returncode, out.stdout, out.stderr) == (0, f"jaxspec {jaxspec.__version__}\n", "")


def test_stdout_holds_only_the_text_and_json_has_the_fields(bundled, capsys):
  text = _generate(capsys, P1, *PLAIN)
  rec_out = _generate(capsys, P1, *PLAIN, "--json")
  (rec,) = _records(rec_out.out)
  assert set(rec) == {"prompt", "text", "token_ids", "new_tokens", "stats"}
  assert set(rec["stats"]) == STATS_KEYS
  assert rec["prompt"] == P1 and rec["new_tokens"] == len(rec["token_ids"]) == 8
  assert rec["text"] == bundled.tokenizer.decode(rec["token_ids"]) and rec["text"].strip()
  # stdout: the streamed text and its newline, nothing else; the stats line on stderr
  assert text.out == rec["text"] + "\n"
  for err in (text.err, rec_out.err):
    (line,) = _messages(err)
    assert re.fullmatch(r"\[jaxspec\] 8 new tokens, [\d.]+ tokens/s, compile [\d.]+ s, load"
                        r" [\d.]+ s, peak memory [\d.]+ GiB, model SmolLM2-135M-Instruct,"
                        r" draft none, acceptance n/a", line), line
  st = rec["stats"]
  assert (st["model"], st["drafter"], st["batch_size"]) == ("SmolLM2-135M-Instruct", "none", 1)
  assert all(st[k] is None for k in ("k", "mean_k", "plain_steps", "target_passes", "tau",
                                      "drafted", "accepted", "acceptance"))
  assert st["seconds"] > 0 and st["tokens_per_second"] == pytest.approx(8 / st["seconds"])
  assert st["compile_seconds"] >= 0 and st["load_seconds"] >= 0


def test_prompts_files_give_one_result_per_prompt_in_order(bundled, capsys, tmp_path):
  (single,) = _records(_generate(capsys, P1, *PLAIN, "--json").out)
  txt = tmp_path / "prompts.txt"
  txt.write_text(f"{P1}\n\n   \n{P2}\n")
  jsonl = tmp_path / "prompts.jsonl"  # Spec-Bench's format (the first turn), and "prompt"
  jsonl.write_text(json.dumps({"question_id": 1, "turns": [P2, "And another?"]}) + "\n\n"
                   + json.dumps({"prompt": P1}) + "\n")
  by_txt = _records(_generate(capsys, "--prompts", str(txt), *PLAIN, "--json").out)
  by_jsonl = _records(_generate(capsys, "--prompts", str(jsonl), *PLAIN, "--json").out)
  assert [r["prompt"] for r in by_txt] == [P1, P2]
  assert [r["prompt"] for r in by_jsonl] == [P2, P1]
  # rows are independent: greedy, each text is what the prompt alone gives
  for r in (by_txt[0], by_jsonl[1]):
    assert (r["token_ids"], r["text"]) == (single["token_ids"], single["text"])
  assert by_jsonl[0]["token_ids"] == by_txt[1]["token_ids"] != single["token_ids"]
  assert [r["stats"]["batch_size"] for r in by_txt] == [2, 2]
  # one prompt at a time: the same results, and the stats line sums the two runs
  one_by_one = _generate(capsys, "--prompts", str(txt), *PLAIN, "--json", "--batch-size", "1")
  assert [r["token_ids"] for r in _records(one_by_one.out)] == [r["token_ids"] for r in by_txt]
  n = sum(r["new_tokens"] for r in by_txt)
  assert one_by_one.err.splitlines()[-1].startswith(f"[jaxspec] 2 prompts, {n} new tokens, ")
  # text mode: the texts in file order, a blank line between them; headers on stderr
  res = _generate(capsys, "--prompts", str(txt), *PLAIN)
  assert res.out == by_txt[0]["text"] + "\n\n" + by_txt[1]["text"] + "\n"
  assert _messages(res.err) == [f"[jaxspec] prompt 1/2: {P1}", f"[jaxspec] prompt 2/2: {P2}",
                                res.err.splitlines()[-1]]
  assert res.err.splitlines()[-1].startswith(f"[jaxspec] 2 prompts, {n} new tokens, ")


def test_a_prompts_sample_depends_on_seed_and_index_not_on_batch_size(capsys, tmp_path):
  """One prompt six times, sampled: six different texts, each the same whatever --batch-size
  (prompt i draws from --seed and i), and another --seed gives others. On a tiny GGUF with a
  chat template (the batching is the CLI's, whatever the model: the bundled model's programs
  took 45 s of the real-model pass for it)."""
  from helpers import tiny_checkpoint, write_tiny_gguf
  gguf = tmp_path / "tiny.gguf"
  write_tiny_gguf(gguf, *tiny_checkpoint())
  txt = tmp_path / "same.txt"
  txt.write_text(f"{P1}\n" * 6)
  # 12 tokens: two honest samples of a few tokens can coincide (a reused key makes half the rows
  # equal whatever the length).
  sampled = ["--model", str(gguf), "--prompts", str(txt), "--max-new-tokens", "12", "--draft",
             "none", "--json", "--temperature", "1.0"]

  def ids(*flags):
    return [r["token_ids"] for r in _records(_generate(capsys, *sampled, *flags).out)]
  by6 = ids("--seed", "3", "--batch-size", "6")
  assert len({tuple(r) for r in by6}) == 6, by6
  assert ids("--seed", "3", "--batch-size", "4") == by6  # batches of 4 and 2
  assert ids("--seed", "4", "--batch-size", "6") != by6


def test_a_failing_batch_names_the_files_prompt_and_keeps_the_printed_ones(capsys, tmp_path):
  """A prompt refused in the third batch of a --prompts file: the error numbers it as the file
  does (prompt 3, not the batch's prompt 0), and the two results printed before it stay."""
  from helpers import tiny_checkpoint, write_tiny_gguf
  gguf = tmp_path / "tiny.gguf"
  write_tiny_gguf(gguf, *tiny_checkpoint())
  jsonl = tmp_path / "ids.jsonl"
  jsonl.write_text("\n".join(json.dumps({"prompt_ids": ids})
                             for ids in ([5, 6, 7], [8, 9], [10, 10 ** 6], [11])) + "\n")
  with pytest.raises(SystemExit, match=rf"error: --prompts {re.escape(str(jsonl))}: prompt 3 has"
                                       r" token id 1000000 outside the vocabulary"):
    main(["generate", "--model", str(gguf), "--prompts", str(jsonl), "--max-new-tokens", "4",
          "--draft", "none", "--json", "--batch-size", "1"])
  assert [r["prompt"] for r in _records(capsys.readouterr().out)] == [[5, 6, 7], [8, 9]]


def test_speculative_json_stats_and_exact_text(bundled, capsys):
  (plain,) = _records(_generate(capsys, P1, *PLAIN, "--json").out)
  res = _generate(capsys, P1, "--max-new-tokens", "8", "--draft", "ngram",
                  "--num-draft-tokens", "2", "--json")
  (rec,) = _records(res.out)
  assert rec["token_ids"] == plain["token_ids"]  # greedy speculative == greedy plain
  st = rec["stats"]
  assert (st["drafter"], st["k"], st["mean_k"], st["plain_steps"]) == ("ngram", 2, None, None)
  assert st["tau"] >= 1.0 and st["target_passes"] >= 1 and 0 <= st["accepted"] <= st["drafted"]
  acc = "n/a" if st["drafted"] == 0 else f"{st['accepted'] / st['drafted']:.2f}"
  assert st["acceptance"] == (None if st["drafted"] == 0 else st["accepted"] / st["drafted"])
  assert res.err.splitlines()[-1].endswith(
      f", draft ngram, k=2, tau {st['tau']:.2f}, acceptance {acc}"), res.err


def _spec(drafted, accepted, **kw):
  return dict(drafted_per_row=drafted, accepted_per_row=accepted, tau=1.0, mean_k=0.0,
              plain_steps=7, target_passes=8) | kw


@pytest.mark.parametrize("spec,k,tail", [
    (None, 4, "draft d, acceptance n/a"),
    (_spec([0], [0]), "auto", "draft d, k=auto (mean 0.0, 7 plain steps), tau 1.00,"
                              " acceptance n/a"),
    (_spec([0, 4], [0, 3], tau=1.5), 3, "draft d, k=3, tau 1.50, acceptance 0.75"),
])
def test_stats_line_shows_acceptance_na_when_nothing_was_drafted(spec, k, tail):
  source = "disk" if k == "auto" else None  # the cost model's time and source: "auto" only
  st = gen.run_stats(dict(seconds=2.0, compile_seconds=1.0, cost_seconds=0.5,
                          cost_source=source), spec, 8,
                     load_s=0.25, model="m", drafter="d", num_draft_tokens=k, batch_size=1,
                     peak_bytes=3 * 2**29)
  cost = " cost model 0.5 s (disk)," if source else ""
  assert gen.stats_line(st) == (f"[jaxspec] 8 new tokens, 4.0 tokens/s, compile 1.0 s,{cost}"
                                f" load 0.2 s, peak memory 1.50 GiB, model m, {tail}")
  assert st["acceptance"] == (None if spec is None or not sum(spec["drafted_per_row"])
                              else 0.75)


def test_merged_stats_of_batches():
  runs = [gen.run_stats(dict(seconds=s, compile_seconds=c), _spec(d, a, tau=t, mean_k=m,
                                                                  target_passes=p),
                        n, load_s=1.0, model="m", drafter="ngram", num_draft_tokens="auto",
                        batch_size=b)
          for s, c, d, a, t, m, p, n, b in [(1.0, 3.0, [4, 2], [2, 1], 1.5, 2.0, 4, 12, 2),
                                            (3.0, 0.0, [6], [0], 1.0, 1.0, 12, 4, 1)]]
  st = gen.merge_stats(runs)
  assert (st["new_tokens"], st["seconds"], st["compile_seconds"], st["tokens_per_second"]) == (
      16, 4.0, 3.0, 4.0)
  assert (st["drafted"], st["accepted"], st["acceptance"], st["target_passes"]) == (
      12, 3, 0.25, 16)
  assert st["tau"] == 16 / (12 / 1.5 + 4 / 1.0)  # tokens over live row-steps
  assert (st["mean_k"], st["plain_steps"], st["batch_size"]) == ((2 * 4 + 12) / 16, 14, 2)
  assert gen.stats_line(st, prompts=3).startswith("[jaxspec] 3 prompts, 16 new tokens, 4.0")


def test_every_printed_drafter_name_is_one_draft_takes(bundled):
  from jaxspec.cli_options import parse_tree
  labels = {}
  for spec in gen.DRAFT_NAMES:
    d = gen._make_drafter(spec, bundled, "float32")
    labels[spec] = label = gen.draft_label(spec, d)
    again = gen._make_drafter(label, bundled, "float32")
    assert gen.draft_label(label, again) == label
    assert (again is None and d is None) or again.name == d.name
  assert labels == {"default": "eagle3", "none": "none", "ngram": "ngram", "eagle": "eagle3",
                    "eagle3": "eagle3", "medusa": "medusa", "mlp": "mlp"}
  eagle = gen._make_drafter("eagle3", bundled, "float32")
  assert gen.draft_label("eagle3", eagle.with_tree(parse_tree("4", eagle))) == "eagle3"
  assert gen.draft_label("/my/head", eagle) == "/my/head"  # a path prints as given


def test_draft_help_lists_exactly_the_names_it_takes(capsys):
  from jaxspec.heads import HEADS
  assert set(gen.DRAFT_NAMES) == {"default", "none", "ngram", "eagle3"} | set(HEADS)
  with pytest.raises(SystemExit):
    main(["generate", "--help"])
  text = " ".join(capsys.readouterr().out.split())
  names = re.search(r"--draft DRAFT (.*?) \| a head directory \|", text).group(1)
  assert names.split(" | ") == list(gen.DRAFT_NAMES)


@pytest.mark.parametrize("name,content,match", [
    ("nope.txt", None, r"--prompts \S+nope\.txt does not exist"),
    ("dir", "DIR", r"--prompts \S+dir is a directory"),
    ("empty.txt", "\n  \n\n", r"--prompts \S+empty\.txt holds no prompts"),
    ("empty.jsonl", "\n", r"--prompts \S+empty\.jsonl holds no prompts"),
    ("bad.jsonl", '{"prompt": "hi"}\n{"prompt": \n',
     r"--prompts: \S+bad\.jsonl:2: not valid JSON"),
    ("field.jsonl", '\n{"text": "hi"}\n', r"--prompts: \S+field\.jsonl:2: no prompt field"),
    ("latin1.txt", b"caf\xe9\n", r"--prompts \S+latin1\.txt is not UTF-8 text"),
])
def test_bad_prompts_files_exit_with_a_message(no_model, tmp_path, name, content, match):
  path = tmp_path / name
  if content == "DIR":
    path.mkdir()
  elif isinstance(content, bytes):
    path.write_bytes(content)
  elif content is not None:
    path.write_text(content)
  with pytest.raises(SystemExit, match=r"^error: " + match):
    main(["generate", "--prompts", str(path)])


def test_a_prompt_and_prompts_file_together_or_neither_are_refused(no_model, tmp_path):
  path = tmp_path / "p.txt"
  path.write_text("hi\n")
  with pytest.raises(SystemExit, match=r"^error: got both a prompt \('hi'\) and --prompts .*"
                                       r"pass one of them"):
    main(["generate", "hi", "--prompts", str(path)])
  with pytest.raises(SystemExit, match=r"^error: no prompt: pass the text"):
    main(["generate"])


def test_a_closed_stdout_ends_quietly(monkeypatch, capsys):
  """The reader of stdout went away (`jaxspec ... | head -1`): exit 141, as SIGPIPE would,
  with no traceback and no error line."""
  import io
  import os

  from jaxspec.cli import app, console_main

  def writes(argv):  # a command printing its text (argparse's own output swallows the error)
    print("text " * 10_000, flush=True)
    return 0

  r, w = os.pipe()
  os.close(r)
  broken = io.TextIOWrapper(os.fdopen(w, "wb", buffering=0), write_through=True)
  saved = os.dup(1)
  monkeypatch.setattr("sys.stdout", broken)
  monkeypatch.setattr(app, "_main", writes)
  try:
    assert console_main(["generate", "hi"]) == 141
  finally:
    os.dup2(saved, 1)
    os.close(saved)
  assert "error" not in capsys.readouterr().err


def test_eagle3_is_a_name_the_python_api_takes_too(smollm2):
  """The bundled EAGLE head reports itself as eagle3, and resolve_drafter takes that name."""
  import jaxspec
  d = jaxspec.resolve_drafter(smollm2, "eagle3")
  assert d.name == "eagle3" and d is jaxspec.resolve_drafter(smollm2, "eagle")
