"""`python -m jaxspec.cli ...`: the `jaxspec` console script."""

import sys

from jaxspec.cli.app import console_main

sys.exit(console_main())
