"""Fast checks of README.md and docs/ (seconds): the code-block runner finds the examples, every
page of mkdocs.yml's nav exists, the README stays short, and every dotted `jaxspec.` name the
pages mention imports. Running the examples is tests/docs_run.py (`make docs`)."""

from __future__ import annotations

import importlib
import re

import pytest

import jaxspec  # noqa: F401

import docs_run  # noqa: E402  (tests/docs_run.py: tests/ is on the path)
from helpers import ROOT  # noqa: E402


def _nav_pages(node) -> list[str]:
  if isinstance(node, str):
    return [node]
  if isinstance(node, list):
    return [p for item in node for p in _nav_pages(item)]
  if isinstance(node, dict):
    return [p for v in node.values() for p in _nav_pages(v)]
  return []


def _nav() -> list[str]:
  # mkdocs.yml is plain YAML apart from nothing: read its nav without importing mkdocs.
  yaml = pytest.importorskip("yaml")
  cfg = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
  return _nav_pages(cfg["nav"])


def test_runner_finds_the_examples():
  all_blocks = [b for page in docs_run.pages() for b in docs_run.blocks(page)]
  python = [b for b in all_blocks if b.lang == "python" and b.skip is None]
  shell = [b for b in all_blocks if b.lang in docs_run.SHELL_LANGS and b.skip is None]
  skipped = [b for b in all_blocks if b.skip is not None]
  assert len(python) >= 12, [b.where for b in python]
  assert len(shell) >= 8, [b.where for b in shell]
  assert all(b.skip for b in skipped), [b.where for b in skipped if not b.skip]
  assert len(skipped) < 10, [b.where for b in skipped]
  assert any(b.page.name == "README.md" for b in python)


def test_shell_lines_are_parsed():
  cmds = docs_run.shell_commands("$ jaxspec bench \\\n  --per-category 1\nmake demo\n")
  assert [c.split() for c in cmds] == [["jaxspec", "bench", "--per-category", "1"], ["make", "demo"]]
  assert docs_run.check_make(["make", "demo"]) is None
  assert docs_run.check_make(["make", "no-such-target"])
  assert docs_run.check_pip(["pip", "install", "-e", ".[docs]"]) is None
  assert docs_run.check_pip(["pip", "install", "jaxspec[nope]"])


def test_every_nav_page_exists():
  nav = _nav()
  assert len(nav) > 20
  missing = [p for p in nav if not (ROOT / "docs" / p).exists()]
  assert not missing, missing


def test_readme_is_short():
  n = len((ROOT / "README.md").read_text().splitlines())
  assert n <= 170, f"README.md has {n} lines: move detail into docs/"


def test_relative_links_resolve():
  """Links in README.md to docs/ pages (GitHub renders them; mkdocs checks docs/ itself)."""
  text = (ROOT / "README.md").read_text()
  targets = re.findall(r"\]\(((?!https?:|#)[^)\s]+)\)", text)
  assert targets
  missing = [t for t in targets if not (ROOT / t.split("#")[0]).exists()]
  assert not missing, missing


_DOTTED = re.compile(r"`(jaxspec(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")


def _resolves(dotted: str) -> bool:
  parts = dotted.split(".")
  for i in range(len(parts), 0, -1):
    try:
      obj = importlib.import_module(".".join(parts[:i]))
    except ImportError:
      continue
    try:
      for name in parts[i:]:
        obj = getattr(obj, name)
    except AttributeError:
      return False
    return True
  return False


def test_dotted_names_import():
  """Every `jaxspec.x.y` written in backticks in README.md or docs/ names something real."""
  names = set()
  for page in docs_run.pages():
    for m in _DOTTED.finditer(page.read_text(encoding="utf-8")):
      names.add(m.group(1).rstrip("."))
  assert len(names) > 20
  bad = sorted(n for n in names if not _resolves(n))
  assert not bad, bad
