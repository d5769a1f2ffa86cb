"""The CLI's persistent compilation cache: a second run loads the compiled programs instead of
compiling them, prints the same text, and `none` or a bad directory behave."""

import os
import re
import subprocess
import sys

import jax
import pytest

from jaxspec.cli import console_main
from helpers import tiny_checkpoint, write_tiny_gguf


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
  path = tmp_path_factory.mktemp("cc") / "tiny.gguf"
  write_tiny_gguf(path, *tiny_checkpoint())
  return path


def _run(gguf, *flags, cwd=None, env=None):
  env = {k: v for k, v in os.environ.items() if k != "JAXSPEC_COMPILE_CACHE"} | (env or {})
  out = subprocess.run([sys.executable, "-m", "jaxspec.cli", "generate", "hello world",
                        "--model", str(gguf), "--max-new-tokens", "12", "--draft", "ngram",
                        "--num-draft-tokens", "3", *flags],
                       capture_output=True, text=True, env=env, timeout=300, cwd=cwd)
  assert out.returncode == 0, out.stderr[-2000:]
  stats = out.stderr.strip().splitlines()[-1]  # the text alone on stdout, the stats on stderr
  assert re.search(r"compile [\d.]+ s", stats), stats
  counts = re.search(r"\((\d+) programs loaded from the cache, (\d+) written\)", stats)
  return out.stdout, *(map(int, counts.groups()) if counts else (None, None))


def test_second_run_loads_compiled_programs(tiny_gguf, tmp_path):
  # Every program is kept (JAX otherwise keeps only those that took >= 1 s to compile, and on a
  # loaded machine which ones do changes between the two runs: the test once flaked so).
  every = {"JAXSPEC_COMPILE_CACHE_MIN_SECONDS": "0"}
  cache = tmp_path / "xla"
  text1, loaded1, written1 = _run(tiny_gguf, "--compile-cache", str(cache), env=every)
  entries = sorted(p.name for p in cache.iterdir() if p.name.endswith("-cache"))
  assert entries and (loaded1, written1) == (0, len(entries)), (loaded1, written1, entries)
  text2, loaded2, written2 = _run(tiny_gguf, "--compile-cache", str(cache), env=every)
  assert text2 == text1
  # Counted from JAX's own cache events, not timed: a timing ratio flaked under a loaded CI.
  assert (loaded2, written2) == (len(entries), 0), (loaded2, written2, entries)
  assert sorted(p.name for p in cache.iterdir() if p.name.endswith("-cache")) == entries


def test_default_directory_none_and_a_file_refused(tiny_gguf, tmp_path, capsys):
  home = {"XDG_CACHE_HOME": str(tmp_path / "home-cache")}
  _run(tiny_gguf, env=home, cwd=tmp_path)  # no flag: $XDG_CACHE_HOME/jaxspec/xla
  assert any((tmp_path / "home-cache" / "jaxspec" / "xla").iterdir())
  (work := tmp_path / "work").mkdir()
  # 'none' also turns off a directory JAX was given in its own variable (it used to fill it).
  *_, loaded, written = _run(tiny_gguf, "--compile-cache", "none",
                             env={"XDG_CACHE_HOME": str(work / "c"),
                                  "JAX_COMPILATION_CACHE_DIR": str(work / "jax"),
                                  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}, cwd=work)
  assert (loaded, written) == (None, None)  # the stats line says nothing of a cache
  assert not any(work.iterdir())  # no cache anywhere (not even a directory called "none")
  blocker = tmp_path / "a-file"
  blocker.write_text("")
  # Refused before JAX's configuration is touched, so this process may run it.
  before = jax.config.jax_compilation_cache_dir
  code = console_main(["generate", "hi", "--model", str(tiny_gguf), "--compile-cache",
                       str(blocker / "xla")])
  err = capsys.readouterr().err
  assert code == 2 and jax.config.jax_compilation_cache_dir == before
  assert "--compile-cache" in err and "--compile-cache none" in err, err
