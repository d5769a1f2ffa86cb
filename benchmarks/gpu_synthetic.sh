#!/usr/bin/env bash
# benchmarks/bench_synthetic.py on a lent GPU (the workplace's `device` tool), in one call of
# under 8 minutes. Random-weight targets need no checkpoint; the only thing carried is a flax
# wheel matching the project's (here: `pip download --no-deps --only-binary=:all:
# --python-version 3.12 -d .gpuw flax==0.12.12`, .gpuw/ ignored by git), then:
#   device run, carry [.gpuw]: bash benchmarks/gpu_synthetic.sh
# Each step has its own time limit, so what finished comes back. Results go to $OUT.
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
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem,driver_version --format=csv
# One deadline for the whole call (BUDGET seconds from here): each step gets the smaller of
# its own limit and what is left, so the last steps shrink rather than the call overrunning.
BUDGET=${BUDGET:-330}
START=$(date +%s)
B="python3 benchmarks/bench_synthetic.py --repeats 3 --widths ${WIDTHS:-1,5}"
run() {  # run LIMIT NAME ARGS...: one benchmark process under a time limit
  local limit=$1 name=$2 left
  shift 2
  left=$((BUDGET - ($(date +%s) - START)))
  [ "$left" -lt "$limit" ] && limit=$left
  [ "$limit" -lt 20 ] && { echo "== $name skipped: out of time"; return; }
  echo "== $name ($(date +%T), limit ${limit}s)"
  timeout "$limit" $B --out "$OUT/$name.json" "$@" 2>&1 | grep -v -e "^WARNING" -e "^I0000" \
    -e "^E0000" -e "^W0000"
}
# a: the 8B shape at batch 1 in the default layout (unrolled, output-major), traced;
# b: the 1B shape, float32 and bfloat16, batch 1 and 16; c: the 8B shape with the logical
# (input-major) layout, to compare; d: the 8B shape at batch 16 and the 135M shape.
STEPS=${STEPS:-abcd}
case $STEPS in *a*)
  run ${TA:-120} syn_8b --configs llama-3.1-8b:bfloat16:1 --profile /tmp/prof --hlo /tmp/hlo
esac
case $STEPS in *b*)
  run ${TB:-110} syn_1b --configs llama-3.2-1b:float32:1,llama-3.2-1b:bfloat16:1,llama-3.2-1b:bfloat16:16
esac
case $STEPS in *c*)
  run ${TC:-80} syn_8b_logical --configs llama-3.1-8b:bfloat16:1 --output-major off
esac
case $STEPS in *d*)
  run ${TD:-100} syn_more --configs ${MORE:-llama-3.1-8b:bfloat16:16,smollm2-135m:float32:1}
esac
# The traces and programs, flattened to what the tool brings back (two folders down at most).
for what in plain spec; do
  f=$(find /tmp/prof/$what -name "perfetto_trace.json.gz" 2>/dev/null | head -1)
  [ -n "$f" ] && cp "$f" "$OUT/trace_$what.json.gz"
done
cp /tmp/hlo/*.gz "$OUT/" 2>/dev/null
ls -l "$OUT"
