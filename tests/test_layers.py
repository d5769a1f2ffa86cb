"""The package's layering (pyproject.toml's [tool.importlinter]), checked by import-linter: no
module imports from a layer above its own, so there are no import circles between layers."""

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_layers_are_kept():
  exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
  assert exe, "lint-imports is missing: install the test extra (pip install -e '.[test]')"
  out = subprocess.run([exe, "--no-cache"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
  assert "2 kept, 0 broken" in out.stdout


def test_generate_is_a_function_and_the_modules_are_modules():
  """`jaxspec.generate` is the function; no module of that name shadows it or is shadowed."""
  import importlib

  import jaxspec
  assert callable(jaxspec.generate) and jaxspec.generate.__module__ == "jaxspec.api"
  for name in ("api", "runner", "decoding", "decoding.loop", "decoding.two_mesh",
               "decoding.rejection", "decoding.plain", "decoding.tree", "lm"):
    assert importlib.import_module(f"jaxspec.{name}").__name__ == f"jaxspec.{name}"
