#!/usr/bin/env bash
# benchmarks/bench_synthetic.py (and the attention table) on a lent GPU (the workplace's
# `device` tool), in one call of under 10 minutes. Random-weight targets need no checkpoint; the
# only thing carried is a flax wheel for the machine's Python 3.12 (flax 0.12.12, in .gpuw/,
# ignored by git: `bash benchmarks/gpu_pack.sh synthetic` builds it and prints the call), then:
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
#    in the committed default layout, its loops traced and dumped (the baseline);
# b: the 1B and 135M shapes likewise;
# c: candidates on the 1B and 135M shapes at batch 1, each in its own process: only `wo`
#    output-major (the one-token step's output product ran as three passes on 2026-11-28), and
#    XLA's rewriting of matrix-vector products into reductions turned off;
# d: batch 16 (8B, 1B);
# e: decode ms per step against max_len and the cached length (XLA's blocked read and the
#    Triton kernel) and the ragged batch (benchmarks/bench_attention.py).
# (2026-11-28 on an H200: the 8B shape at batches 1 and 16 took about 100 s each, compile
# included; output-major bfloat16 everywhere and command buffers measured slower.)
STEPS=${STEPS:-abcde}
NOSR='{"xla_gpu_enable_dot_strength_reduction": false}'
case $STEPS in *a*)
  run ${TA:-120} syn_8b $B --configs llama-3.1-8b:bfloat16:1 \
    --out $R/syn_8b.json --profile $R/prof_8b --hlo $R/hlo_8b
esac
case $STEPS in *b*)
  run ${TB:-110} syn_small $B --out $R/syn_small.json --profile $R/prof_1b --hlo $R/hlo_1b \
    --configs llama-3.2-1b:bfloat16:1,smollm2-135m:bfloat16:1
esac
case $STEPS in *c*)
  run ${TC:-100} syn_om_wo $B --output-major wo --out $R/syn_om_wo.json \
    --configs llama-3.2-1b:bfloat16:1,smollm2-135m:bfloat16:1
  run ${TC:-100} syn_nosr $B --options "$NOSR" --out $R/syn_nosr.json \
    --configs llama-3.2-1b:bfloat16:1,smollm2-135m:bfloat16:1
esac
case $STEPS in *d*)
  run ${TD:-150} syn_b16 $B --out $R/syn_b16.json \
    --configs llama-3.1-8b:bfloat16:16,llama-3.2-1b:bfloat16:16
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
for s in 8b 1b; do  # each kernel's read rate (benchmarks/kernel_rates.py)
  [ -f $R/trace_${s}_plain.json.gz ] && python3 benchmarks/kernel_rates.py \
    $R/trace_${s}_plain.json.gz $R/hlo_$s/decode_loop.hlo.txt.gz --top 12 \
    --json $R/kernel_rates_${s}_plain.json
done
tar -C $R -czf "$OUT/gpu_synthetic.tar.gz" . && ls -l "$OUT" && tar -tzvf "$OUT/gpu_synthetic.tar.gz"
