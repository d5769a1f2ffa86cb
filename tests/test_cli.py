"""The command line on the bundled model: streamed text, the final stats line, bad flags."""

import re

import pytest

from jaxspec.cli import main


@pytest.fixture(autouse=True)
def _bundled_model_loaded_once(smollm2, monkeypatch):
  """The CLI's load of the bundled model returns the session's copy (loading the GGUF takes
  about 5 s a time; the smollm2 fixture is that same load)."""
  from jaxspec.models import loading
  real = loading.load
  monkeypatch.setattr(loading, "load", lambda name_or_path=None, dtype="float32", **kw: (
      smollm2 if name_or_path is None and dtype == "float32" and kw.get("scan_layers") is None
      else real(name_or_path, dtype, **kw)))


@pytest.mark.parametrize("draft", ["ngram", "none"])
def test_generate_prints_text_and_stats(smollm2, capsys, draft):
  # --k-max 2: "auto" (the default) compiles and times 3 draft widths, not 7 (none: no drafts).
  assert main(["generate", "What is 2+2?", "--max-new-tokens", "8", "--draft", draft,
               "--k-max", "2"]) == 0
  out = capsys.readouterr().out.strip().splitlines()
  last = out[-1]
  assert re.match(r"\[jaxspec\] \d+ new tokens, [\d.]+ tokens/s, compile [\d.]+ s", last), last
  if draft == "ngram":
    assert "k=auto" in last and "tau" in last and "acceptance" in last
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

