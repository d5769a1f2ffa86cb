#!/usr/bin/env bash
# benchmarks/bench_synthetic.py (and the attention table) on a lent GPU (the workplace's
# `device` tool), in one call of under 10 minutes. Random-weight targets need no checkpoint; the
# only thing carried is a flax wheel matching the project's (here: `pip download --no-deps
# --only-binary=:all: --python-version 3.12 -d .gpuw flax==0.12.12`, .gpuw/ ignored by git),
# then:
#   device run, carry [.gpuw]: GIT_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/gpu_synthetic.sh
# (the copy of the tree on the GPU machine has no .git: GIT_COMMIT names the commit in the JSONs).
# Each step has its own time limit inside one deadline, so what finished comes back. Everything
# lands in $OUT/gpu_synthetic.tar.gz (JSONs, traces, compiled programs) and $OUT/log.txt.
set -u
export OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=/tmp/site
if ls .gpuw/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .gpuw/*.whl || exit 1
fi
export PYTHONPATH="$SITE:$PWD"
R=/tmp/syn  # results, traces and programs, packed into one file at the end
mkdir -p $R
exec > >(tee "$OUT/log.txt") 2>&1
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
# One deadline for the whole call (BUDGET seconds from here): each step gets the smaller of
# its own limit and what is left, so the last steps shrink rather than the call overrunning.
BUDGET=${BUDGET:-540}
START=$(date +%s)
PEAK=${PEAK:-13}
B="python3 benchmarks/bench_synthetic.py --repeats 3 --widths ${WIDTHS:-1,5} --peak $PEAK"
left() { echo $((BUDGET - ($(date +%s) - START))); }
run() {  # run LIMIT NAME COMMAND...: one benchmark process under a time limit
  local limit=$1 name=$2 l
  shift 2
  l=$(left)
  [ "$l" -lt "$limit" ] && limit=$l
  [ "$limit" -lt 25 ] && { echo "== $name skipped: out of time"; return; }
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | grep -v -e "^WARNING" -e "^I0000" -e "^E0000" -e "^W0000"
}
# a: the 8B shape in bfloat16 (peaked: see jaxspec.models.synthetic.peaked_params) at batch 1
#    and 16 in the committed default layout, the batch-1 loops traced and dumped;
# b: the 1B shape in bfloat16 at batch 1 and 16, and the 135M shape at batch 1, likewise;
# c: candidate: bfloat16 weights output-major (bfloat16 product outputs), 8B and 1B at batch 1;
# d: candidate: the loops' while loops and conditionals as CUDA-graph nodes (command buffers),
#    135M and 1B at batch 1;
# e: decode ms per step against max_len (XLA's blocked read and the Triton kernel) and the
#    ragged batch (benchmarks/bench_attention.py).
STEPS=${STEPS:-abcde}
CMDBUF='{"xla_gpu_enable_command_buffer": "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,CONDITIONAL"}'
case $STEPS in *a*)
  run ${TA:-170} syn_8b $B --configs llama-3.1-8b:bfloat16:1,llama-3.1-8b:bfloat16:16 \
    --out $R/syn_8b.json --profile $R/prof_8b --hlo $R/hlo_8b
esac
case $STEPS in *b*)
  run ${TB:-150} syn_small $B --out $R/syn_small.json --profile $R/prof_1b --hlo $R/hlo_1b \
    --configs llama-3.2-1b:bfloat16:1,llama-3.2-1b:bfloat16:16,smollm2-135m:bfloat16:1
esac
case $STEPS in *c*)
  run ${TC:-110} syn_om $B --output-major on --out $R/syn_om.json \
    --configs llama-3.1-8b:bfloat16:1,llama-3.2-1b:bfloat16:1
esac
case $STEPS in *d*)
  run ${TD:-80} syn_cmdbuf $B --options "$CMDBUF" --out $R/syn_cmdbuf.json \
    --configs smollm2-135m:bfloat16:1,llama-3.2-1b:bfloat16:1
esac
case $STEPS in *e*)
  run ${TE:-90} attention python3 benchmarks/bench_attention.py --kernel xla,auto \
    --tables max_len,cached,ragged --batches 1,8 --repeats 3 --out $R/attention.json
esac
# The traces (perfetto JSON) and compiled programs, packed with the JSONs.
for d in $R/prof_*; do
  for what in plain spec; do
    f=$(find $d/$what -name "perfetto_trace.json.gz" 2>/dev/null | head -1)
    [ -n "$f" ] && cp "$f" "$R/trace_$(basename $d | cut -c6-)_$what.json.gz"
  done
  rm -rf "$d"
done
tar -C $R -czf "$OUT/gpu_synthetic.tar.gz" . && ls -l "$OUT" && tar -tzvf "$OUT/gpu_synthetic.tar.gz"
