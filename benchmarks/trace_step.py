"""Counts the jaxspec functions one speculative call enters: how far a reader follows one step.

    python benchmarks/trace_step.py [--list] [--json results/trace_step.json]

One `speculative_generate` call with `NGram()`, k = 4, 8 new tokens, on `tiny_config()` random
weights, after a warm-up call and `jax.clear_caches()` (so the call traces its programs afresh
and the count includes every traced function, not only the host side). Every Python function
whose code lives in the `jaxspec` package and is entered during the call (`sys.setprofile`
"call" events) is counted once, lambdas and comprehensions left out (they are expressions, not
places a reader goes); the script prints the distinct functions and the files they live in.

The GPU (Triton) and TPU (Mosaic) attention kernels of models/attention_kernels.py, which
`lax.platform_dependent` traces on every platform, are not among them: the host wrappers trace
a model whose weights are on CPU devices with XLA's read (`Model.program_cfg`; 15 functions
fewer). A program of the functional core lowered by a user's own `jax.jit` still traces them.

It prints a second count under a narrower rule: module-level functions only (no methods, no
nested functions), the files holding at least one. That rule reproduces the count issue 48 was
filed with (108 functions in 14 files; this script gives 106 in 14 on the code it was filed
against, 82759eb, and 150 in 15 under the first rule).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import sys

import jax

import jaxspec
from jaxspec.models.config import tiny_config
from jaxspec.models.llama import init_params
from jaxspec.models.model import Model

PACKAGE = os.path.dirname(os.path.abspath(jaxspec.__file__)) + os.sep
EXPRESSION = re.compile(r"<(lambda|genexpr|listcomp|setcomp|dictcomp)>$")


def trace_call(fn) -> dict[str, set[str]]:
  """Runs fn() under sys.setprofile; returns {file relative to the package: {qualified names}}."""
  seen: dict[str, set[str]] = collections.defaultdict(set)

  def profile(frame, event, arg):
    if event != "call":
      return
    path = frame.f_code.co_filename
    if path.startswith(PACKAGE) and not EXPRESSION.search(frame.f_code.co_qualname):
      seen[path[len(PACKAGE):]].add(frame.f_code.co_qualname)

  sys.setprofile(profile)
  try:
    fn()
  finally:
    sys.setprofile(None)
  return seen


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--list", action="store_true", help="print every function, by file")
  ap.add_argument("--json", help="write the counts and the functions to this file")
  args = ap.parse_args()

  cfg = tiny_config()
  model = Model(cfg, init_params(cfg, jax.random.key(0)))
  prompts = [[1, 2, 3, 4, 5, 1, 2, 3]]

  def call():
    return jaxspec.speculative_generate(model, jaxspec.NGram(), prompts, max_new_tokens=8,
                                        num_draft_tokens=4)

  call()  # warm-up: imports, first compiles
  jax.clear_caches()
  jaxspec.release_compiled()
  seen = trace_call(call)
  n_fn = sum(len(v) for v in seen.values())
  top = {p: sorted(n for n in v if "." not in n) for p, v in seen.items()}
  top = {p: v for p, v in top.items() if v}
  n_top = sum(len(v) for v in top.values())
  if args.list:
    for path in sorted(seen):
      print(f"{path} ({len(seen[path])})")
      for name in sorted(seen[path]):
        print(f"  {name}")
  print(f"{n_fn} distinct jaxspec functions in {len(seen)} files")
  print(f"{n_top} module-level functions in {len(top)} files")
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"functions": n_fn, "files": len(seen),
                 "module_level_functions": n_top, "module_level_files": len(top),
                 "by_file": {p: sorted(v) for p, v in sorted(seen.items())}}, f, indent=1)
      f.write("\n")


if __name__ == "__main__":
  main()
