"""Executes the code blocks of README.md and docs/**/*.md, so the examples cannot rot.

    .venv/bin/python tests/docs_run.py                      # every page
    .venv/bin/python tests/docs_run.py README.md guides/cli  # some pages (path or its suffix)
    .venv/bin/python tests/docs_run.py --list               # the blocks found, nothing run

What runs:
  ```python blocks: a page's blocks run in order in one namespace, in a fresh subprocess per
      page (pages are isolated from each other, blocks of a page share their variables), with
      JAXSPEC_SCAN_LAYERS=stacked (the layers as one lax.scan: compiles several times faster
      than the CPU's unrolled default; the tokens are the same up to float rounding) and 8
      simulated CPU devices, as the tests have.
  ```bash / ```sh / ```console blocks, line by line (a trailing backslash continues a line; a
      leading "$ " is dropped; other lines are left alone):
      `jaxspec ...`  runs through the installed console script, in a subprocess, and must exit 0;
      `python ...`   runs with this interpreter, and must exit 0;
      `make TARGET`  is only checked: TARGET must be a target of the Makefile (the targets take
                     minutes or install packages: CI runs them as their own steps);
      `pip install`  is only checked: every extra it names ('.[docs]', 'jaxspec[compare]') must
                     be declared in pyproject.toml (installing needs the network).
A block that cannot run here (it needs a GPU or TPU, several hosts, the network, files this
checkout does not have, or minutes of training) is marked on the line before its fence:

    <!-- docs: skip — needs two hosts -->

The reason is required (a skip without one fails the run) and every skip is listed at the end.
Blocks of other languages (text, the output of a command) are not run.

Exit status 0 when every block ran, 1 otherwise. Not a pytest module (no test_ prefix): the
examples compile SmolLM2's programs and take minutes, so CI runs this as its own step
(`make docs`); tests/docs/test_docs.py holds the fast checks.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
# docs/results and docs/notebooks link to benchmarks/results and notebooks/: not documentation.
NOT_PAGES = ("results", "notebooks", "_hooks")
SHELL_LANGS = ("bash", "sh", "console", "shell")
RUN_TIMEOUT = 900  # seconds per page or command

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<lang>[\w+-]*)[^\n]*$")
_SKIP = re.compile(r"^\s*<!--\s*docs:\s*skip\b\s*[—:–-]*\s*(?P<reason>.*?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
  page: Path
  line: int          # 1-based line of the opening fence
  lang: str
  code: str
  skip: str | None   # None: runs; "": marked without a reason (an error); else the reason

  @property
  def where(self) -> str:
    return f"{self.page.relative_to(ROOT)}:{self.line}"


def pages() -> list[Path]:
  """README.md, then every Markdown page under docs/ (sorted)."""
  found = [ROOT / "README.md"]
  for p in sorted(DOCS.rglob("*.md")):
    rel = p.relative_to(DOCS)
    if rel.parts[0] in NOT_PAGES:
      continue
    found.append(p)
  return found


def blocks(page: Path) -> list[Block]:
  """The fenced code blocks of one page, in order."""
  lines = page.read_text(encoding="utf-8").splitlines()
  out, i = [], 0
  while i < len(lines):
    m = _FENCE.match(lines[i])
    if not m:
      i += 1
      continue
    fence, indent, lang = m["fence"], m["indent"], m["lang"].lower()
    start, body = i, []
    i += 1
    while i < len(lines) and not re.match(rf"^[ \t]*{re.escape(fence[0])}{{{len(fence)},}}[ \t]*$",
                                          lines[i]):
      body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
      i += 1
    i += 1  # the closing fence
    prev = start - 1
    while prev >= 0 and not lines[prev].strip():
      prev -= 1
    skip = None
    if prev >= 0:
      s = _SKIP.match(lines[prev])
      if s:
        skip = s["reason"]
    out.append(Block(page, start + 1, lang, "\n".join(body) + "\n", skip))
  return out


def shell_commands(code: str) -> list[str]:
  """The lines of a shell block, continuations joined and console prompts dropped."""
  cmds, cur = [], ""
  for raw in code.splitlines():
    line = raw.rstrip()
    if not cur and line.startswith("$ "):
      line = line[2:]
    if line.endswith("\\"):
      cur += line[:-1] + " "
      continue
    cur += line
    if cur.strip():
      cmds.append(cur.strip())
    cur = ""
  if cur.strip():
    cmds.append(cur.strip())
  return cmds


def makefile_targets() -> set[str]:
  text = (ROOT / "Makefile").read_text()
  return {m.group(1) for m in re.finditer(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M)}


def declared_extras() -> set[str]:
  with open(ROOT / "pyproject.toml", "rb") as f:
    return set(tomllib.load(f)["project"].get("optional-dependencies", {}))


def check_make(argv: list[str]) -> str | None:
  targets = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
  missing = [t for t in targets if t not in makefile_targets()]
  if not targets:
    return "names no target"
  return f"no Makefile target {', '.join(missing)}" if missing else None


def check_pip(argv: list[str]) -> str | None:
  extras = set()
  for a in argv[1:]:
    m = re.search(r"\[([\w,\s-]+)\]", a)
    if m and not a.startswith("-"):
      extras |= {e.strip() for e in m.group(1).split(",")}
  missing = sorted(extras - declared_extras())
  return f"extras not declared in pyproject.toml: {missing}" if missing else None


def _env(tmp: str) -> dict[str, str]:
  env = dict(os.environ)
  env["JAXSPEC_SCAN_LAYERS"] = "stacked"
  env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
  # The CLI's persistent compilation cache, fresh for this run (shared by its commands).
  env["JAXSPEC_COMPILE_CACHE"] = str(Path(tmp) / "xla")
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  env.setdefault("MPLBACKEND", "Agg")
  return env


# Runs a page's python blocks in one namespace; names the block that failed.
_DRIVER = r"""
import json, sys, traceback
blocks = json.load(open(sys.argv[1]))
ns = {"__name__": "__main__"}
for where, code in blocks:
  print(f"[docs]   {where}", flush=True)
  try:
    exec(compile(code, where, "exec"), ns)
  except BaseException:
    traceback.print_exc()
    print(f"[docs] FAILED at {where}", file=sys.stderr, flush=True)
    sys.exit(1)
"""


def run_python(page_blocks: list[Block], tmp: str) -> tuple[bool, str]:
  spec = Path(tmp) / "blocks.json"
  spec.write_text(json.dumps([(b.where, b.code) for b in page_blocks]))
  driver = Path(tmp) / "driver.py"
  driver.write_text(_DRIVER)
  p = subprocess.run([sys.executable, str(driver), str(spec)], cwd=ROOT, env=_env(tmp),
                     capture_output=True, text=True, timeout=RUN_TIMEOUT)
  return p.returncode == 0, p.stdout + p.stderr


def run_shell(block: Block, tmp: str) -> list[tuple[str, bool, str]]:
  """(command, ok, output) for every line of a shell block that the runner knows."""
  results = []
  bindir = Path(sys.executable).parent
  for cmd in shell_commands(block.code):
    try:
      argv = shlex.split(cmd, comments=True)
    except ValueError as e:
      results.append((cmd, False, f"cannot parse: {e}"))
      continue
    if not argv:
      continue
    head = argv[0]
    if head == "make":
      err = check_make(argv)
      results.append((cmd, err is None, err or "target exists (not run)"))
    elif head == "pip" or (head.endswith("python") and argv[1:3] == ["-m", "pip"]):
      err = check_pip(argv)
      results.append((cmd, err is None, err or "extras declared (not run)"))
    elif head in ("jaxspec", "python", "python3"):
      exe = [str(bindir / "jaxspec")] if head == "jaxspec" else [sys.executable]
      p = subprocess.run(exe + argv[1:], cwd=ROOT, env=_env(tmp), capture_output=True,
                         text=True, timeout=RUN_TIMEOUT)
      tail = (p.stdout + p.stderr)[-3000:]
      results.append((cmd, p.returncode == 0, f"exit {p.returncode}\n{tail}"))
  return results


def _select(names: list[str]) -> list[Path]:
  every = pages()
  if not names:
    return every
  chosen = []
  for name in names:
    n = name if name.endswith(".md") else name + ".md"
    hits = [p for p in every if str(p.relative_to(ROOT)).endswith(n)]
    if not hits:
      raise SystemExit(f"no page matches {name!r}")
    chosen += [h for h in hits if h not in chosen]
  return chosen


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("pages", nargs="*", help="pages (a path or its suffix); default: all")
  ap.add_argument("--list", action="store_true", help="list the blocks, run nothing")
  args = ap.parse_args(argv)
  chosen = _select(args.pages)
  failures, skipped, counts = [], [], {"python": 0, "shell": 0}
  t_all = time.perf_counter()
  for page in chosen:
    bs = blocks(page)
    py = [b for b in bs if b.lang in ("python", "py")]
    sh = [b for b in bs if b.lang in SHELL_LANGS]
    for b in py + sh:
      if b.skip is not None:
        skipped.append(b)
        if not b.skip:
          failures.append((b.where, "skip marker without a reason"))
    py_run = [b for b in py if b.skip is None]
    sh_run = [b for b in sh if b.skip is None]
    counts["python"] += len(py_run)
    counts["shell"] += len(sh_run)
    if args.list:
      for b in py_run + sh_run:
        print(f"{b.where} {b.lang}")
      continue
    if not py_run and not sh_run:
      continue
    rel = page.relative_to(ROOT)
    t0 = time.perf_counter()
    print(f"[docs] {rel}: {len(py_run)} python, {len(sh_run)} shell blocks", flush=True)
    with tempfile.TemporaryDirectory(prefix="jaxspec-docs-") as tmp:
      if py_run:
        ok, out = run_python(py_run, tmp)
        if not ok:
          failures.append((str(rel), out[-6000:]))
      for b in sh_run:
        for cmd, ok, out in run_shell(b, tmp):
          print(f"[docs]   {b.where} $ {cmd[:100]}{' ...' if len(cmd) > 100 else ''}"
                f"{'' if ok else '  FAILED'}", flush=True)
          if not ok:
            failures.append((f"{b.where}: {cmd}", out))
    print(f"[docs] {rel}: {time.perf_counter() - t0:.1f} s", flush=True)
  print(f"[docs] {counts['python']} python and {counts['shell']} shell blocks"
        f"{'' if args.list else f' in {time.perf_counter() - t_all:.1f} s'}; "
        f"{len(skipped)} skipped:", flush=True)
  for b in skipped:
    print(f"[docs]   skipped {b.where}: {b.skip or '(NO REASON GIVEN)'}", flush=True)
  for where, out in failures:
    print(f"\n[docs] FAILED {where}\n{out}", file=sys.stderr, flush=True)
  return 1 if failures else 0


if __name__ == "__main__":
  sys.exit(main())
