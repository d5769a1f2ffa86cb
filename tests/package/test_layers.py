"""The package's layering (pyproject.toml's [tool.importlinter]), checked by import-linter: no
module imports from a layer above its own, so there are no import circles between layers."""

import shutil
import subprocess
import sys
from pathlib import Path

from helpers import ROOT


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
  for name in ("api", "engine", "decoding", "decoding.loop", "decoding.two_mesh",
               "decoding.rejection", "decoding.plain", "decoding.tree", "lm"):
    assert importlib.import_module(f"jaxspec.{name}").__name__ == f"jaxspec.{name}"


def test_no_import_circles():
  """No module of jaxspec reaches itself through its imports, function-local ones included
  (packages' own `__init__` imports of their modules aside)."""
  import grimp
  graph = grimp.build_graph("jaxspec", cache_dir=None)
  packages = {m for m in graph.modules if graph.find_children(m)}
  modules = sorted(graph.modules - packages)
  circles = [(m, n) for m in modules for n in graph.find_modules_directly_imported_by(m)
             if n not in packages and n != m and graph.chain_exists(importer=n, imported=m)]
  assert not circles, circles
