"""The console script on ordinary bad input: one `error:` line and exit code 2, no traceback.
Runs on a tiny GGUF the test writes, so it needs no bundled model."""

import os
import shutil
import subprocess
import sys

from jaxspec.cli import console_main
from jaxspec.models.hf_loader import save_hf
from helpers import tiny_checkpoint, write_tiny_gguf


def test_console_script_errors_are_one_line_exit_2(tmp_path, capsys):
  """Ordinary bad input: exit code 2 and an `error:` line on stderr, never a Python traceback
  (runs without the bundled model). The installed console script runs the cases that read a
  file's bytes and parse deep JSON in a process of their own (a crash there would not take the
  test run with it); the others call its entry point, `console_main`, in this process (each
  subprocess spent about 4 s starting Python and importing JAX)."""
  exe = shutil.which("jaxspec", path=os.path.dirname(sys.executable)) or shutil.which("jaxspec")
  assert exe, "the jaxspec console script is not installed"
  gguf = tmp_path / "tiny.gguf"
  write_tiny_gguf(gguf, *tiny_checkpoint())
  cut = tmp_path / "cut.gguf"
  cut.write_bytes(gguf.read_bytes()[:3000])
  no_tok = tmp_path / "hf"
  save_hf(tiny_checkpoint(), no_tok)  # no tokenizer files
  deep = tmp_path / "deep.jsonl"
  deep.write_text("[" * 100000 + "]" * 100000 + "\n")
  badutf = tmp_path / "bad.jsonl"
  badutf.write_bytes(b'{"turns": ["\xff\xfe"]}\n')
  cases = {  # name: (argv, what the error line must say)
      "missing model": (["generate", "hi", "--model", str(tmp_path / "nope.gguf")],
                        "nope.gguf does not exist"),
      "truncated gguf": (["generate", "hi", "--model", str(cut)],
                         "cut.gguf is truncated or corrupt"),
      "no tokenizer": (["generate", "hi", "--model", str(no_tok)], "has no tokenizer"),
      "huge seed": (["generate", "hi", "--model", str(gguf), "--seed", str(10**30),
                     "--max-new-tokens", "2"], "--seed: key must be"),
      "deep json": (["bench", "--model", str(gguf), "--prompts", str(deep), "--out",
                     str(tmp_path / "b1")], "deep.jsonl:1: not valid JSON (nested too deeply"),
      "invalid utf-8": (["bench", "--model", str(gguf), "--prompts", str(badutf), "--out",
                         str(tmp_path / "b2")], "bad.jsonl:1: not UTF-8 text"),
      "prompt and --prompts": (["generate", "hi", "--model", str(gguf), "--prompts", str(deep)],
                               "got both a prompt"),
      "missing --prompts file": (["generate", "--model", str(gguf), "--prompts",
                                  str(tmp_path / "nope.txt")], "nope.txt does not exist"),
      "malformed --prompts file": (["generate", "--model", str(gguf), "--prompts", str(badutf)],
                                   "bad.jsonl:1: not UTF-8 text"),
  }
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {
      "JAXSPEC_COMPILE_CACHE": "none"}
  own_process = ("truncated gguf", "deep json")
  for name, (argv, says) in cases.items():
    if name in own_process:
      out = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=300, env=env)
      code, err = out.returncode, out.stderr
    else:
      code, err = console_main(argv), capsys.readouterr().err
    assert code == 2, (name, code, err[-1500:])
    assert "Traceback" not in err, (name, err[-1500:])
    assert [ln for ln in err.splitlines() if "error:" in ln] == [err.splitlines()[-1]], (
        name, err[-500:])  # one error line, the last
    assert says in err.splitlines()[-1], (name, says, err[-500:])
