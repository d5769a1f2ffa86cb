"""Two local processes (CPU, gloo collectives, two devices each) join one global 2 x 2 mesh and
together run a sharded speculative_generate: it gives the single-process tokens."""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest

from jaxspec import generate
from jaxspec.sharding import multihost


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_one_mesh_give_the_single_process_tokens():
  port = _free_port()
  # Two devices a process; the test run's other XLA flags kept (its -O0 compiles faster).
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env = dict(os.environ, XLA_FLAGS=" ".join(flags + ["--xla_force_host_platform_device_count=2"]),
             JAX_PLATFORMS="cpu")
  cmd = [sys.executable, "-m", "jaxspec.sharding.multihost", "--coordinator",
         f"localhost:{port}", "--num-processes", "2", "--mesh", "data=2,model=2", "--tiny",
         "--max-new-tokens", "12", "--k", "3"]
  procs = [subprocess.Popen(cmd + ["--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True) for i in range(2)]
  results = []
  for p in procs:
    try:
      out, err = p.communicate(timeout=400)
    except subprocess.TimeoutExpired:
      for q in procs:
        q.kill()
      pytest.fail("the two-process run did not finish in 400 s")
    assert p.returncode == 0, err[-3000:]
    line = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
    assert line, out[-2000:] + err[-2000:]
    results.append(json.loads(line[-1][len("RESULT "):]))
  assert sorted(r["process"] for r in results) == [0, 1]
  for r in results:
    assert (r["processes"], r["devices"], r["local_devices"]) == (2, 4, 2)
  ref = generate(multihost.tiny_demo_model(), multihost.DEMO_PROMPTS, max_new_tokens=12,
                 stop_ids=())
  for r in results:
    np.testing.assert_array_equal(np.array(r["speculative"]), ref.tokens)
    assert r["acceptance_rate"] > 0.9  # the self-draft ran sharded over both processes too


def test_initialize_rejects_bad_arguments():
  with pytest.raises(ValueError, match="host:port"):
    multihost.initialize("localhost", 2, 0)
  with pytest.raises(ValueError, match="process_id must be in 0..1"):
    multihost.initialize("localhost:1", 2, 2)
