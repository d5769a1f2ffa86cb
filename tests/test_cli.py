"""The command line on the bundled model: streamed text, the final stats line, bad flags."""

import re

import pytest

from jaxspec.cli import main


@pytest.mark.parametrize("draft", ["ngram", "none"])
def test_generate_prints_text_and_stats(smollm2, capsys, draft):
  assert main(["generate", "What is 2+2?", "--max-new-tokens", "8", "--draft", draft]) == 0
  out = capsys.readouterr().out.strip().splitlines()
  last = out[-1]
  assert re.match(r"\[jaxspec\] \d+ new tokens, [\d.]+ tokens/s, compile [\d.]+ s", last), last
  if draft == "ngram":
    assert "tau" in last and "acceptance" in last
  assert len("".join(out[:-1]).strip()) > 0  # some text was streamed before the stats line


@pytest.mark.parametrize("flags,match", [(["--temperature", "-1"], "temperature"),
                                         (["--top-p", "0"], "top_p"),
                                         (["--draft", "no/such/model"], "--draft"),
                                         # the bundled Medusa head has 4 heads
                                         (["--draft", "medusa", "--k-max", "5"],
                                          r"AutoK\(k_max=4\)")])
def test_bad_flags_exit_with_a_message(smollm2, flags, match):
  with pytest.raises(SystemExit, match=match):
    main(["generate", "hi", "--max-new-tokens", "4"] + flags)
