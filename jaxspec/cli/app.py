"""The `jaxspec` command's parser and entry points: `main` (raises SystemExit("error: ...")) and
`console_main` (the console script: an `error:` line and exit code 2)."""

from __future__ import annotations

import argparse
import os
import sys

from jaxspec.bench.cli import add_bench_parser, cmd_bench
from jaxspec.cli.generate import add_generate_parser, cmd_generate
from jaxspec.cli.train import add_train_parser, cmd_train
from jaxspec.cli.train_data import add_train_data_parser, cmd_train_data
from jaxspec.cli_options import enable_compile_cache


def _parser() -> argparse.ArgumentParser:
  from jaxspec import __version__
  ap = argparse.ArgumentParser(prog="jaxspec", description="Exact speculative decoding in JAX.")
  ap.add_argument("--version", action="version", version=f"jaxspec {__version__}",
                  help="print 'jaxspec VERSION' and exit")
  sub = ap.add_subparsers(dest="command", required=True)
  add_generate_parser(sub)
  add_train_parser(sub)
  add_train_data_parser(sub)
  add_bench_parser(sub)
  return ap


def main(argv=None) -> int:
  """Runs a command; ordinary bad input (a missing or malformed file, an impossible size, an
  unwritable path, undecodable text) raises SystemExit("error: ...") naming it."""
  try:
    return _main(argv)
  except BrokenPipeError:  # the reader went away (`| head`): console_main ends quietly
    raise
  except ValueError as e:  # CheckpointError, DataError and every argument check
    raise SystemExit(f"error: {e}") from e
  except (OSError, UnicodeError, RecursionError, OverflowError, MemoryError) as e:
    raise SystemExit(f"error: {type(e).__name__}: {e}") from e


def console_main(argv=None) -> int:
  """The `jaxspec` console script: `main`, with an error as one `error:` line on stderr and
  exit code 2 (argparse's code for bad usage), never a Python traceback."""
  try:
    return main(argv)
  except SystemExit as e:
    if isinstance(e.code, str):
      print(e.code if e.code.startswith("error:") else f"error: {e.code}", file=sys.stderr)
      return 2
    raise
  except KeyboardInterrupt:
    print("error: interrupted", file=sys.stderr)
    return 130
  except BrokenPipeError:
    # The reader of stdout closed it (`jaxspec generate ... | head -1`): stop quietly, as a
    # process killed by SIGPIPE would, and keep Python from complaining while it exits.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141


def _main(argv=None) -> int:
  args = _parser().parse_args(argv)
  if hasattr(args, "compile_cache"):
    enable_compile_cache(args.compile_cache)
  if args.command == "generate":
    return cmd_generate(args)
  if args.command == "train":
    return cmd_train(args)
  if args.command == "train-data":
    return cmd_train_data(args)
  if args.command == "bench":
    return cmd_bench(args, sys.argv[1:] if argv is None else argv)
  return 2
