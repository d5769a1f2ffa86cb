"""`jaxspec bench`: every method on a prompt set, beside plain decoding and peer libraries.

    jaxspec bench --prompts ../shared/data/spec_bench_dev.jsonl --categories mt-bench \\
        --methods none,ngram,medusa,mlp,eagle,eagle-tree,draft-model --batch-sizes 1,8 \\
        --peers transformers,transformers-prompt-lookup --out bench_out

For every batch size, category and batch of prompts, all methods (jaxspec's and the peers')
run back to back in an order that alternates from one batch to the next, so a slow spell of a
shared machine hits every method alike; speedups divide tokens/s measured in the same
invocation. Per method, category and batch size it reports tokens/s, the speedup over plain
`generate` (a peer: over its own library's plain decoding), τ, acceptance per draft position,
the k the adaptive controller chose, per-token latency percentiles, time to first token,
compile time (apart), and the speedup the cost model predicts from the measured acceptance and
step costs. It writes bench.json (every raw number, the machine, versions, git commit and
command), bench.md (tables) and four plots into --out.

A method is one entry of `METHODS` (a peer one of `jaxspec.peers.PEERS`); adding one is adding
an entry. Definitions of every number are in `DEFINITIONS` and in the JSON.

`--workload rollout` runs the rollout workload instead (`rollout`: n sampled continuations of
gsm8k and humaneval prompts, as one batch and as consecutive calls carrying a suffix corpus).

Modules: `methods` (`METHODS`, `Settings`), `inputs` (the prompt file and the option checks),
`run` (`run_bench`), `rollout` (`run_rollout`, `RolloutSettings`), `aggregate` (the numbers of
every cell), `report` (tables, plots, JSON), `machine` (hardware, versions, commit) and `cli`
(the `bench` subcommand).
"""

from jaxspec.bench.aggregate import (aggregate, expected_tokens, expected_tokens_by_k, goals,
                                     latency_samples, predicted_times, summarize)
from jaxspec.bench.cli import add_bench_parser, cmd_bench
from jaxspec.bench.inputs import (DEMO_PROMPTS, MT_BENCH, parse_batch_sizes, parse_categories,
                                  parse_methods, parse_peers, read_prompts, select,
                                  settings_from_args)
from jaxspec.bench.machine import git_commit, loadavg, machine, threads, versions
from jaxspec.bench.methods import DEFAULT_METHODS, METHODS, BenchError, Method, Settings
from jaxspec.bench.report import DEFINITIONS, SCHEMA, markdown, plots, to_json
from jaxspec.bench.rollout import RolloutSettings, run_rollout
from jaxspec.bench.run import run_bench

__all__ = ["DEFAULT_METHODS", "DEFINITIONS", "DEMO_PROMPTS", "METHODS", "MT_BENCH", "SCHEMA",
           "BenchError", "Method", "RolloutSettings", "Settings", "add_bench_parser", "aggregate",
           "cmd_bench", "expected_tokens", "expected_tokens_by_k", "git_commit", "goals",
           "latency_samples", "loadavg", "machine", "markdown", "parse_batch_sizes",
           "parse_categories", "parse_methods", "parse_peers", "plots", "predicted_times",
           "read_prompts", "run_bench", "run_rollout", "select", "settings_from_args", "summarize",
           "threads", "to_json", "versions"]
