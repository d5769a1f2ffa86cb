#!/usr/bin/env bash
# Timings of jaxspec on a lent GPU (the workplace's `device` tool), in one call.
#
# The GPU machine has JAX with CUDA, flax, optax and orbax but neither the bundled model nor
# gguf, and reaches no registry. The GGUF (98 MB) is larger than what one call carries beside
# the tree, so it travels in three pieces, one per call, each copied to /tmp/parts on the warm
# machine. Here, `bash benchmarks/gpu_pack.sh run` builds the three folders (git-ignored: the
# pieces, the checksum, the evaluation prompts, the gguf and flax wheels for Python 3.12) and
# prints the three device calls, back to back (the machine stays warm 30 s):
#   carry [.gpu1]: mkdir -p /tmp/parts && cp .gpu1/part00 /tmp/parts/
#   carry [.gpu2]: cp .gpu2/part01 /tmp/parts/
#   carry [.gpu3]: cp .gpu3/part02 /tmp/parts/ && bash benchmarks/gpu_run.sh
# This script joins the pieces, checks the checksum, installs the carried wheels, and then
# runs, each under its own time limit so that what finished comes back:
#   1. the verify cost of a pass over T = k+1 tokens (and over tree-sized widths) relative to a
#      decode step, batch 1 / 8 / 32, 256 cached tokens;
#   2. chain vs tree for EAGLE-3 and Medusa plus plain decoding and n-gram, one prompt per
#      MT-bench category, 128 new tokens, greedy (benchmarks/bench_heads.py);
#   3. `jaxspec bench` (interleaved, with the cost model's predictions) on the same prompts:
#      plain, n-gram and a 16-node EAGLE tree, without the streamed latency runs.
# Results go to $OUT (the device tool brings that folder back).
set -u
# The machine's set-up (the GGUF joined and checked, wheels, ../shared/data):
source benchmarks/gpu_setup.sh

# Limits that fit one 600 s call (measured on the H200, 2026-11-26: the verify costs of three
# batch sizes take about 110 s with the model's load, step 2 about 210 s, step 3 about 110 s).
T1=${T1:-100}
T2=${T2:-300}
T3=${T3:-150}
echo "== 1. verify cost"
timeout "$T1" python3 - <<'EOF' 2>&1 | grep -v "^WARNING"
import json, os, sys
sys.path.insert(0, "benchmarks")
from bench_speculative import verify_cost
from common import machine
import jaxspec
m = jaxspec.load()
ks = [1, 2, 3, 4, 5, 7, 15, 31, 63]
res = verify_cost(m, batch_sizes=(1, 8, 32), ks=ks, context=256)
json.dump(dict(machine=machine(), context=256, ks=ks, verify_cost=res),
          open(os.path.join(os.environ.get("OUT", "/tmp/gpu_out"), "verify_cost.json"), "w"),
          indent=1)
EOF
echo "== 2. chains vs trees"
timeout "$T2" python3 benchmarks/bench_heads.py --others-per-category 0 --per-category 1 \
  --max-new-tokens 128 --out "$OUT/tree_gpu.json" --methods \
  "plain;ngram;eagle;eagle:tree=8;eagle:tree=16;eagle:tree=64;medusa;medusa:tree=16;medusa:tree=64" \
  2>&1 | grep -v "^WARNING"
echo "== 3. jaxspec bench"
timeout "$T3" python3 -m jaxspec.cli bench --prompts ../shared/data/spec_bench_dev.jsonl \
  --categories mt-bench --per-category 1 --methods none,ngram,eagle-tree --tree-size 16 \
  --max-new-tokens 128 --no-latency --out "$OUT/bench" --no-progress 2>&1 | grep -v "^WARNING"
ls -l "$OUT" "$OUT/bench" 2>/dev/null
