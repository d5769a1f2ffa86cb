"""Each GPU kernel's read rate in a traced decode loop: the trace's kernel times joined with the
bytes each kernel's HLO instruction moves.

`bench_synthetic.py --profile DIR --hlo DIR` writes a perfetto trace of one plain and one
speculative loop and the loops' optimised programs (HLO text); `gpu_synthetic.sh` packs them.
XLA names a fused kernel after its instruction (`gemm_fusion_dot.420` runs as
`gemm_fusion_dot_420`; instructions of one computation share the kernel of the first), so each
kernel event's bytes are its instruction's operands plus its result, as the program declares
them: an upper bound for in-place updates (the cache write's fusion counts the whole cache
operand), exact for the matrix-vector products that read the weights.

    python benchmarks/kernel_rates.py TRACE.json.gz PROGRAM.hlo.txt.gz [--steps N] [--top 25]

Prints, per kernel: calls per step, mean microseconds, megabytes moved, GB/s, and its share of
the step; then the step's time split into weight-reading kernels (>= 1 MB), small kernels, and
the gaps between kernels, and the weight readers' aggregate rate.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import re

_ITEM = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
         "pred": 1, "s64": 8, "u64": 8, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
_ARRAY = re.compile(r"\b(" + "|".join(_ITEM) + r")\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")


def _open(path):
  return gzip.open(path, "rt") if path.endswith(".gz") else open(path)


def shape_bytes(shape: str) -> int:
  """Bytes of every array in an HLO shape (a tuple counts each element)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape):
    n = 1
    for d in filter(None, dims.split(",")):
      n *= int(d)
    total += n * _ITEM[dtype]
  return total


def instruction_bytes(hlo_text: str) -> dict[str, int]:
  """name -> bytes of its operands plus its result, for every instruction of the program."""
  shapes, operands = {}, {}
  for line in hlo_text.splitlines():
    m = _INSTR.match(line)
    if not m:
      continue
    name, shape, _, rest = m.groups()
    shapes[name] = shape_bytes(shape)
    depth, args = 1, []
    for i, ch in enumerate(rest):  # the operand list: up to the matching parenthesis
      depth += (ch == "(") - (ch == ")")
      if depth == 0:
        args = re.findall(r"%([\w.\-]+)", rest[:i])
        break
    operands[name] = args
  return {name: shapes[name] + sum(shapes.get(a, 0) for a in operands[name])
          for name in shapes}


def kernel_events(trace_path: str) -> list[dict]:
  """The kernels the GPU ran (complete events on the device's compute stream), in time order."""
  events = json.load(_open(trace_path))["traceEvents"]
  device_pids = {e["pid"] for e in events if e.get("ph") == "M" and e.get("name") ==
                 "process_name" and "/device:" in e["args"].get("name", "")}
  compute = {(e["pid"], e.get("tid")) for e in events if e.get("ph") == "M" and e.get("name") ==
             "thread_name" and e["pid"] in device_pids and "Compute" in e["args"]["name"]}
  out = [e for e in events if e.get("ph") == "X" and (e["pid"], e.get("tid")) in compute]
  return sorted(out, key=lambda e: e["ts"])


def analyse(trace_path: str, hlo_path: str, steps: int | None = None) -> dict:
  events = kernel_events(trace_path)
  sizes = instruction_bytes(_open(hlo_path).read())
  per = collections.defaultdict(lambda: [0, 0.0])
  for e in events:
    per[e["name"]][0] += 1
    per[e["name"]][1] += e["dur"]
  if steps is None:  # the most frequent count among kernels that run once a step
    steps = collections.Counter(n for n, _ in per.values()).most_common(1)[0][0]
  span = events[-1]["ts"] + events[-1]["dur"] - events[0]["ts"]
  rows = []
  for name, (n, us) in per.items():
    instr = re.sub(r"_(\d+)$", r".\1", name)
    mb = sizes.get(instr, sizes.get(name))
    mb = None if mb is None else mb / 1e6
    rows.append(dict(kernel=name, calls_per_step=n / steps, mean_us=us / n,
                     us_per_step=us / steps, mb=mb,
                     gbs=None if mb is None else mb * 1e6 / (us / n * 1e-6) / 1e9))
  rows.sort(key=lambda r: -r["us_per_step"])
  busy = sum(r["us_per_step"] for r in rows)
  big = [r for r in rows if r["mb"] is not None and r["mb"] >= 1.0]
  big_us = sum(r["us_per_step"] for r in big)
  big_mb = sum(r["mb"] * r["calls_per_step"] for r in big)
  return dict(steps=steps, kernels_per_step=len(events) / steps, span_us_per_step=span / steps,
              busy_us_per_step=busy, gaps_us_per_step=span / steps - busy,
              weight_kernels_us_per_step=big_us, weight_mb_per_step=big_mb,
              weight_kernels_gbs=big_mb * 1e6 / (big_us * 1e-6) / 1e9 if big_us else None,
              small_kernels_us_per_step=busy - big_us, rows=rows)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("trace")
  ap.add_argument("hlo")
  ap.add_argument("--steps", type=int, default=None,
                  help="loop iterations in the trace (default: the commonest kernel count)")
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--json", default="", help="write the full table here")
  args = ap.parse_args(argv)
  res = analyse(args.trace, args.hlo, args.steps)
  print(f"{res['steps']} steps; {res['kernels_per_step']:.0f} kernels a step; per step:"
        f" span {res['span_us_per_step']:.0f} us = kernels {res['busy_us_per_step']:.0f}"
        f" + gaps {res['gaps_us_per_step']:.0f}; kernels moving >= 1 MB:"
        f" {res['weight_kernels_us_per_step']:.0f} us for {res['weight_mb_per_step']:.0f} MB"
        f" ({res['weight_kernels_gbs'] or 0:.0f} GB/s); smaller kernels"
        f" {res['small_kernels_us_per_step']:.0f} us")
  print(f"{'kernel':<34} {'calls/step':>10} {'us':>8} {'MB':>9} {'GB/s':>7} {'share':>6}")
  for r in res["rows"][:args.top]:
    mb = "" if r["mb"] is None else f"{r['mb']:9.1f}"
    gbs = "" if r["gbs"] is None else f"{r['gbs']:7.0f}"
    print(f"{r['kernel'][:34]:<34} {r['calls_per_step']:10.2f} {r['mean_us']:8.2f} {mb:>9}"
          f" {gbs:>7} {r['us_per_step'] / res['span_us_per_step']:6.1%}")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(res, f, indent=1)
  return res


if __name__ == "__main__":
  main()
