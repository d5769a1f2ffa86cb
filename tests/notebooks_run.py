"""Executes the notebooks in notebooks/ in their small setting and fails on any cell error.

    .venv/bin/python tests/notebooks_run.py                    # every notebook, SMALL=1
    .venv/bin/python tests/notebooks_run.py 01_quickstart      # some of them (name or path)
    .venv/bin/python tests/notebooks_run.py --full             # SMALL=0: the full-size runs

Each notebook runs top to bottom in a fresh `python3` kernel of this interpreter (nbclient),
with notebooks/ as its working directory and SMALL=1 in its environment. Every notebook's last
cell asserts what it demonstrated, so a wrong result fails here like an exception does. The
committed notebooks keep no outputs; `--out DIR` writes the executed copies there for reading.

Exit status 0 when every notebook ran, 1 otherwise; the wall time of each is printed. Not a
pytest module (no test_ prefix): the notebooks take minutes, so CI runs this as its own step.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def _check_kernel() -> None:
  """Fails early when the `python3` kernel would not run this interpreter (its packages)."""
  from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel
  try:
    spec = KernelSpecManager().get_kernel_spec("python3")
  except NoSuchKernel:
    raise SystemExit("no python3 kernel: install ipykernel into this environment"
                     f" ({sys.executable} -m pip install ipykernel)") from None
  exe = spec.argv[0] if spec.argv else ""
  # jupyter_client runs a spec whose argv[0] is plain "python"/"python3" with sys.executable.
  if exe not in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}") \
      and Path(exe).resolve() != Path(sys.executable).resolve():
    raise SystemExit(f"the python3 kernel spec at {spec.resource_dir} runs {exe}, not"
                     f" {sys.executable}: remove that spec or run this script with {exe}")


def _select(names: list[str]) -> list[Path]:
  every = sorted(NOTEBOOKS.glob("*.ipynb"))
  if not names:
    return every
  chosen = []
  for name in names:
    p = Path(name)
    hits = [p] if p.suffix == ".ipynb" and p.is_file() else [
        nb for nb in every if nb.stem == name or nb.stem.startswith(name)]
    if len(hits) != 1:
      raise SystemExit(f"{name!r} matches {len(hits)} notebooks of {[nb.stem for nb in every]}:"
                       " give a name, its prefix or a path")
    chosen.append(hits[0].resolve())
  return chosen


def run_notebook(path: Path, timeout: int, out_dir: Path | None) -> tuple[bool, float, str]:
  """(ran without error, wall seconds, the error report) for one notebook."""
  import nbformat
  from nbclient import NotebookClient
  from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

  nb = nbformat.read(path, as_version=4)
  client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                          resources={"metadata": {"path": str(path.parent)}})
  t0 = time.perf_counter()
  error = ""
  try:
    client.execute()
  except (CellExecutionError, CellTimeoutError, DeadKernelError) as e:
    error = re.sub(r"\x1b\[[0-9;]*m", "", str(e))  # the traceback without terminal colours
  seconds = time.perf_counter() - t0
  if out_dir is not None:
    out_dir.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, out_dir / path.name)
  return not error, seconds, error


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("notebooks", nargs="*", help="names (or prefixes, or paths); default: all")
  ap.add_argument("--full", action="store_true", help="SMALL=0: the full-size runs")
  ap.add_argument("--timeout", type=int, default=900, help="seconds per cell (default 900)")
  ap.add_argument("--out", type=Path, default=None, help="write the executed notebooks here")
  args = ap.parse_args(argv)
  paths = _select(args.notebooks)
  if not paths:
    raise SystemExit(f"no notebooks in {NOTEBOOKS}")
  _check_kernel()
  os.environ["SMALL"] = "0" if args.full else "1"  # the kernels inherit this environment
  results = []
  for path in paths:
    print(f"[notebooks] running {path.name} (SMALL={os.environ['SMALL']}) ...", flush=True)
    ok, seconds, error = run_notebook(path, args.timeout, args.out)
    results.append((path.name, ok, seconds))
    print(f"[notebooks] {path.name}: {'ok' if ok else 'FAILED'} in {seconds:.1f} s", flush=True)
    if error:
      print(error, file=sys.stderr, flush=True)
  failed = [name for name, ok, _ in results if not ok]
  total = sum(s for _, _, s in results)
  print(f"[notebooks] {len(results) - len(failed)} of {len(results)} ran in {total:.1f} s"
        + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
