"""Multi-host runs: one speculative generation over one global mesh that spans processes.

JAX is multi-controller: every process runs the same program on its own devices, and
`jax.distributed.initialize` joins them so that `jax.devices()` lists every process's devices.
A mesh over all of them is then global; `shard_model` lays the weights out on it (each process
holds its devices' shards), `generate` / `speculative_generate` place the prompts (the same on
every process) as global arrays, run one SPMD program with the collectives between hosts, and
gather the outputs back to every process.

    # on each of N hosts (process_id = 0..N-1; the coordinator is process 0's address):
    jaxspec.sharding.multihost.initialize("10.0.0.1:1234", num_processes=N, process_id=i)
    mesh = jaxspec.sharding.make_mesh({"data": 2, "model": jax.device_count() // 2})
    model = jaxspec.load(mesh=mesh)
    out = jaxspec.speculative_generate(model, "ngram", prompts)

On CPU the collectives between processes go through gloo. `python -m jaxspec.sharding.multihost`
runs that demo (a tiny random model with --tiny), printing the tokens as JSON; the tests launch
two local processes with two CPU devices each this way.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from jaxspec.checks import check_int, is_int


def initialize(coordinator_address: str, num_processes: int, process_id: int, *,
               local_device_ids=None, cpu_collectives: str = "gloo") -> None:
  """Joins this process to a multi-process JAX run (call before any other JAX use).

  Args:
    coordinator_address: "host:port" of process 0.
    num_processes: how many processes take part.
    process_id: this process's index, 0..num_processes-1.
    local_device_ids: the local devices this process contributes (default all).
    cpu_collectives: the CPU cross-process collectives ("gloo", or "mpi" where built).
  """
  import jax
  check_int("num_processes", num_processes, 1, numpy=False)
  if not is_int(process_id, numpy=False) or not 0 <= process_id < num_processes:
    raise ValueError(f"process_id must be in 0..{num_processes - 1}, got {process_id!r}")
  if ":" not in str(coordinator_address):
    raise ValueError(f"coordinator_address must be \"host:port\" (process 0's address), got"
                     f" {coordinator_address!r}")
  jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id,
                             local_device_ids=local_device_ids)


def tiny_demo_model():
  """The tiny random model the multi-process test runs (8 heads, 4 key/value heads)."""
  import jax

  from jaxspec.models import init_params, tiny_config
  from jaxspec.models.model import Model
  cfg = tiny_config(num_heads=8, num_kv_heads=4, head_dim=8, vocab_size=256)
  return Model(cfg, init_params(cfg, jax.random.key(0), scale=0.2), name="tiny-demo")


DEMO_PROMPTS = [[1, 5, 9, 13, 5, 9, 13, 5], [3, 4, 5, 6, 7, 8, 9, 10, 11, 3, 4], [7],
                [9, 9, 2, 9]]


def run_demo(mesh_shape: dict[str, int], *, tiny: bool, max_new_tokens: int, k: int) -> dict:
  """Sharded speculative (self-draft) greedy decoding of the demo prompts."""
  import jaxspec
  from jaxspec import DraftModel
  from jaxspec.sharding import make_mesh, shard_model
  mesh = make_mesh(mesh_shape)
  model = tiny_demo_model() if tiny else jaxspec.load()
  drafter = DraftModel(model)  # the drafter's weights follow the target onto the mesh
  model = shard_model(model, mesh)
  prompts = DEMO_PROMPTS if tiny else [model.tokenizer.encode_chat(p) for p in (
      "Name three primes.", "What is JAX?", "Say hello.", "Count to five.")]
  spec = jaxspec.speculative_generate(model, drafter, prompts, max_new_tokens=max_new_tokens,
                                      num_draft_tokens=k, stop_ids=())
  import jax
  return dict(process=jax.process_index(), processes=jax.process_count(),
              devices=jax.device_count(), local_devices=jax.local_device_count(),
              speculative=spec.tokens.tolist(),
              acceptance_rate=spec.stats["acceptance_rate"], tau=spec.stats["tau"])


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description="One sharded speculative generation over processes.")
  ap.add_argument("--coordinator", required=True, help="host:port of process 0")
  ap.add_argument("--num-processes", type=int, required=True)
  ap.add_argument("--process-id", type=int, required=True)
  ap.add_argument("--local-devices", type=int, default=None,
                  help="simulated CPU devices per process (sets XLA_FLAGS before JAX starts)")
  ap.add_argument("--mesh", default="data=2,model=2", help="global mesh, e.g. data=2,model=2")
  ap.add_argument("--tiny", action="store_true", help="a tiny random model (tests)")
  ap.add_argument("--max-new-tokens", type=int, default=12)
  ap.add_argument("--k", type=int, default=3)
  args = ap.parse_args(argv)
  if args.local_devices:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={args.local_devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
  try:
    shape = {k: int(v) for k, v in (part.split("=") for part in args.mesh.split(","))}
  except ValueError:
    ap.error(f"--mesh must look like data=2,model=2, got {args.mesh!r}")
  initialize(args.coordinator, args.num_processes, args.process_id)
  out = run_demo(shape, tiny=args.tiny, max_new_tokens=args.max_new_tokens, k=args.k)
  print("RESULT " + json.dumps(out), flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
