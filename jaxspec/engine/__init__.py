"""The host engine: what runs around the compiled loops of `jaxspec.decoding` when a caller
passes prompts to `jaxspec.generate` / `speculative_generate`.

- `core`: the `Engine`, which holds everything kept between calls (compiled programs, the last
  call's cache buffers, drafter weights placed on a mesh, measured cost models, compiler
  options, progress listeners) and runs the four calls; `DEFAULT` is the public functions'.
- `io`: a call's data on the host: arguments checked before anything compiles, prompts padded,
  arrays placed on a mesh and brought back, tokens decoded.
- `runs`: the fused run (`SpecRun`) and the two-mesh run with failover (`HostRun`), and the
  statistics of a run.
- `costs`: the measured cost model of "auto", and the copies kept on disk between processes
  (`clear_cost_cache` deletes them).
"""

from jaxspec.engine.costs import clear_cost_cache, cost_cache_dir
from jaxspec.engine.core import (DEFAULT, Engine, GenerateOutput, programs_released, progress,
                                 release_cache_buffers, release_compiled)

__all__ = ["DEFAULT", "Engine", "GenerateOutput", "clear_cost_cache", "cost_cache_dir",
           "programs_released", "progress", "release_cache_buffers", "release_compiled"]
