"""The `jaxspec` command line: `jaxspec generate "PROMPT"`, `jaxspec train KIND` and
`jaxspec bench`.

Modules: `options` (options and argparse types the subcommands share, `jaxspec.bench`'s too),
`generate`, `train` (a subcommand each; bench's is `jaxspec.bench.cli`) and `app` (the parser,
`main` and the `console_main` console script).
"""

from jaxspec.cli.app import console_main, main
from jaxspec.cli.generate import cmd_generate
from jaxspec.cli_options import (CACHE_EVENTS, add_compile_cache, default_compile_cache,
                                 enable_compile_cache)
from jaxspec.cli.train import (EAGLE_DRAFT_VOCAB, HEAD_DEFAULTS, TRAIN_DEFAULTS, TRAIN_KINDS,
                               cmd_train, head_options)

__all__ = ["CACHE_EVENTS", "EAGLE_DRAFT_VOCAB", "HEAD_DEFAULTS", "TRAIN_DEFAULTS", "TRAIN_KINDS",
           "add_compile_cache", "cmd_generate", "cmd_train", "console_main",
           "default_compile_cache", "enable_compile_cache", "head_options", "main"]
