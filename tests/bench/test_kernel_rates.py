"""benchmarks/kernel_rates.py: a GPU trace's kernel times joined with the bytes their HLO
instructions move (the per-kernel read rates of the GPU issue), on a hand-made trace."""

import gzip
import json
import sys

import pytest

from helpers import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import kernel_rates  # noqa: E402

HLO = """HloModule jit_decode_loop
%fused_computation (a: bf16[1,1024], b: bf16[1024,1024]) -> bf16[1,1024] {
  ROOT %dot.0 = bf16[1,1024]{1,0} dot(bf16[1,1024]{1,0} %a, bf16[1024,1024]{1,0} %b)
}
ENTRY %main (p.0: bf16[1,1024], w.1: bf16[1024,1024]) -> (bf16[1,1024], f32[4]) {
  %p.0 = bf16[1,1024]{1,0} parameter(0)
  %w.1 = bf16[1024,1024]{1,0} parameter(1)
  %gemm_fusion_dot.7 = bf16[1,1024]{1,0} fusion(%p.0, %w.1), kind=kCustom, calls=%fused_computation
  %loop_add_fusion = (f32[4]{0}, s32[]) fusion(%gemm_fusion_dot.7), kind=kLoop, calls=%fused_add
  ROOT %t = (bf16[1,1024]{1,0}, f32[4]{0}) tuple(%gemm_fusion_dot.7, %loop_add_fusion)
}
"""


def _trace(path):
  meta = [dict(ph="M", pid=1, name="process_name", args=dict(name="/device:GPU:0")),
          dict(ph="M", pid=1, tid=7, name="thread_name", args=dict(name="Stream #7(Compute)")),
          dict(ph="M", pid=2, name="process_name", args=dict(name="/host:CPU")),
          dict(ph="M", pid=2, tid=3, name="thread_name", args=dict(name="python3"))]
  ev, t = [], 0.0
  for _ in range(2):  # two steps: a 10 us product, then a 1 us add, then a 2 us gap
    ev.append(dict(ph="X", pid=1, tid=7, ts=t, dur=10.0, name="gemm_fusion_dot_7"))
    ev.append(dict(ph="X", pid=1, tid=7, ts=t + 10.0, dur=1.0, name="loop_add_fusion"))
    t += 13.0
  ev.append(dict(ph="X", pid=2, tid=3, ts=0.0, dur=500.0, name="host work"))  # not a kernel
  with gzip.open(path, "wt") as f:
    json.dump(dict(traceEvents=meta + ev), f)


def test_rates_join_kernel_times_with_instruction_bytes(tmp_path):
  _trace(tmp_path / "t.json.gz")
  (tmp_path / "p.hlo.txt").write_text(HLO)
  res = kernel_rates.analyse(str(tmp_path / "t.json.gz"), str(tmp_path / "p.hlo.txt"))
  assert res["steps"] == 2 and res["kernels_per_step"] == 2
  rows = {r["kernel"]: r for r in res["rows"]}
  gemm = rows["gemm_fusion_dot_7"]  # operands 2 KiB + 2 MiB, result 2 KiB, in 10 us
  moved = 2 * 1024 + 2 * 1024 * 1024 + 2 * 1024
  assert gemm["mb"] == pytest.approx(moved / 1e6)
  assert gemm["gbs"] == pytest.approx(moved / 10e-6 / 1e9)
  assert gemm["calls_per_step"] == 1 and gemm["mean_us"] == 10.0
  add = rows["loop_add_fusion"]  # a tuple result counts each element: f32[4] + s32[]
  assert add["mb"] == pytest.approx((2 * 1024 + 16 + 4) / 1e6)
  # the host's 500 us event is not a kernel; the span is 2 steps minus the last gap
  assert res["busy_us_per_step"] == pytest.approx(11.0)
  assert res["span_us_per_step"] == pytest.approx((13.0 + 11.0) / 2)
  assert res["weight_kernels_us_per_step"] == pytest.approx(10.0)
  assert res["small_kernels_us_per_step"] == pytest.approx(1.0)
