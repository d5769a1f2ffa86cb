"""The command line on the bundled model: streamed text on stdout, the final stats line on
stderr, bad flags."""

import re

import pytest

from jaxspec.cli import main


@pytest.fixture(autouse=True)
def _bundled_model_loaded_once(bundled_cli_model):
  """The CLI's load of the bundled model returns the session's copy (conftest)."""


@pytest.mark.parametrize("draft", ["ngram", "none"])
def test_generate_prints_text_and_stats(smollm2, capsys, draft):
  from jaxspec.cli.generate import peak_memory_bytes
  before = peak_memory_bytes() / 2**30  # this worker's peak so far (earlier tests' included)
  # --k-max 2: "auto" (the default) compiles and times 3 draft widths, not 7 (none: no drafts).
  assert main(["generate", "What is 2+2?", "--max-new-tokens", "8", "--draft", draft]
              + (["--k-max", "2"] if draft != "none" else [])) == 0
  out, err = capsys.readouterr()
  last = err.strip().splitlines()[-1]  # the stats line goes to stderr, the text alone to stdout
  assert re.match(r"\[jaxspec\] \d+ new tokens, [\d.]+ tokens/s, compile [\d.]+ s", last), last
  if draft == "ngram":
    assert "k=auto" in last and "tau" in last and "acceptance" in last
  else:
    assert last.endswith(", draft none, acceptance n/a"), last
  assert out.endswith("\n") and out.strip() and "[jaxspec]" not in out
  # Each slow phase is one status line on stderr (not a terminal), and the peak memory is
  # reported: the process's peak, in GiB; for the 135M model under 3 GiB (a busy machine once
  # saw 3.2 GB) when nothing before it in this process went near that.
  assert re.search(r"^\[jaxspec\] compiled the (speculative|decode) loop in [\d.]+ s$", err,
                   re.M), err
  peak = float(re.search(r"peak memory ([\d.]+) GiB", last).group(1))
  assert 0.1 < peak and before - 0.01 <= peak <= peak_memory_bytes() / 2**30 + 0.01, last
  if before < 2.0:
    assert peak < 3.0, last


@pytest.mark.parametrize("flags,match", [(["--temperature", "-1"], "temperature"),
                                         (["--top-p", "0"], "top_p"),
                                         (["--draft", "no/such/model"], "--draft"),
                                         # the bundled Medusa head has 4 heads
                                         (["--draft", "medusa", "--k-max", "5"],
                                          r"AutoK\(k_max=4\)"),
                                         # --k-max where nothing reads it (was ignored)
                                         (["--draft", "none", "--k-max", "2"],
                                          r"--k-max .* but --draft none drafts nothing"),
                                         (["--num-draft-tokens", "3", "--k-max", "2"],
                                          r"--k-max .* but --num-draft-tokens is 3")])
def test_bad_flags_exit_with_a_message(smollm2, flags, match):
  with pytest.raises(SystemExit, match=match):
    main(["generate", "hi", "--max-new-tokens", "4"] + flags)

