#!/usr/bin/env bash
# The EAGLE-3 head's next round on a lent GPU (the workplace's `device` tool):
# benchmarks/recipe_eagle_gpu.py, corpus generation and online training, in one call of at most
# 9 minutes.
#
# The GGUF travels in three pieces as for benchmarks/gpu_run.sh, and .gpu3 also carries the
# training prompt files, compressed (the tree and a piece must stay under 64 MiB):
# `bash benchmarks/gpu_pack.sh recipe` builds .gpu1-3 and prints the three device calls, back
# to back (the machine stays warm 30 s):
#   carry [.gpu1]: mkdir -p /tmp/parts && cp .gpu1/part00 /tmp/parts/
#   carry [.gpu2]: cp .gpu2/part01 /tmp/parts/
#   carry [.gpu3]: cp .gpu3/part02 /tmp/parts/ && GIT_COMMIT=<commit> bash benchmarks/gpu_recipe.sh
# (timeout_s 600). The recipe's minutes and sizes can be set through RECIPE_ARGS. What comes
# back under $OUT: eagle/config.json, eagle/head.safetensors, record.json, history.jsonl,
# corpus.tar (or its pieces corpus.tar.00, ...) and log.txt; on this machine
# `cat corpus.tar* > corpus.tar && tar xf corpus.tar` gives the corpus, and
# `benchmarks/bench_heads.py --methods plain,eagle,eagle3=DIR` measures the head.
set -u
export OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
source benchmarks/gpu_setup.sh
LIMIT=${LIMIT:-530}
# shellcheck disable=SC2086
timeout "$LIMIT" python3 benchmarks/recipe_eagle_gpu.py --work /tmp/recipe --out "$OUT" \
  ${RECIPE_ARGS:---generate-minutes 3.5 --train-minutes 2.5} 2>&1 \
  | grep -v -e "^WARNING" -e "^I0000" -e "^E0000" -e "^W0000"
ls -lR "$OUT"
