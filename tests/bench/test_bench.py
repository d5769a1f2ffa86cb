"""`jaxspec bench` on a tiny random model: the report's schema, speedups against the plain run of
the same invocation, the plots and tables, and the bad-input errors."""

import json

import pytest

from jaxspec import peers
from jaxspec.bench import (METHODS, Settings, expected_tokens, latency_samples,
                           predicted_times)
from jaxspec.bench.run import _groups, _spec_kwargs, _units
from jaxspec.cli import main
from jaxspec.models.hf_loader import save_hf


@pytest.fixture(scope="module")
def tiny_dir(tiny_target, tmp_path_factory):
  return save_hf(tiny_target, tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
  path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
  rows = [{"category": "copy", "prompt_ids": [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]},
          {"category": "mixed", "prompt_ids": [9, 30, 4, 77, 12]},
          {"category": "mixed", "prompt_ids": [11, 3, 3, 50]}]
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return path


def _bench(model, prompts, out, *extra):
  return main(["bench", "--model", str(model), "--prompts", str(prompts), "--max-new-tokens",
               "6", "--k-max", "2", "--out", str(out), "--no-progress", *extra])


# The transformers peers join the same invocation when installed (one plain compile less).
PEERS = [] if peers.missing_packages("transformers") else [
    "--peers", "transformers-prompt-lookup,transformers-assisted"]


@pytest.fixture(scope="module")
def report(tiny_dir, prompts_file, tmp_path_factory):
  """One bench run for all the report tests: plain and n-gram at batch 1 (about 20 s, most of
  it compiling; every batch size compiles every method again)."""
  out = tmp_path_factory.mktemp("bench")
  assert _bench(tiny_dir, prompts_file, out, "--methods", "ngram", "--per-category", "2",
                *PEERS) == 0
  return out, json.loads((out / "bench.json").read_text())


def test_report_schema(report):
  out, r = report
  assert r["schema"] == "jaxspec-bench/1"
  assert r["command"].startswith("jaxspec bench --model")
  assert {"cpu", "cores", "accelerator"} <= set(r["machine"])
  assert {"jax", "flax", "jaxspec"} <= set(r["versions"])
  assert "commit" in r["git"]
  assert list(r["methods"]) == ["none", "ngram"]  # plain is added: the speedups' baseline
  assert r["categories"] == ["copy", "mixed"]
  assert set(r["results"]) == {"1"}
  for key in ("tokens_per_second", "speedup", "predicted_speedup", "latency_ms", "ttft_ms"):
    assert key in r["definitions"]
  for cat in ("copy", "mixed", "all"):
    spec = r["results"]["1"]["ngram"][cat]
    for key in ("tau", "acceptance_per_position", "conditional_acceptance_per_position",
                "mean_k", "k_histogram", "compile_seconds", "predicted_speedup",
                "predicted_decode_speedup", "achieved_over_predicted", "latency_ms",
                "ttft_ms"):
      assert key in spec, (cat, key)
    assert spec["predicted_speedup"] > 0 and spec["tau"] >= 1
    assert sum(spec["k_histogram"].values()) == spec["target_passes"]
    # Acceptance is known where drafts were verified (k_max 2 positions), None where none were.
    # (In 6 tokens of this random model no token repeats, so the n-gram drafts nothing and the
    # None branch is the one this run takes: test_report_acceptance_where_drafts_were_verified.)
    drafted = spec["target_passes"] > spec["plain_steps"]
    assert (len(spec["acceptance_per_position"]) == 2) if drafted else (
        spec["acceptance_per_position"] is None)
    assert spec["matches_plain"] == 1.0  # greedy speculative output is plain's, token for token
    lat = spec["latency_ms"]
    assert lat["p50"] <= lat["p95"] <= lat["p99"] and spec["ttft_ms"]["mean"] > 0
    assert r["results"]["1"]["none"][cat]["compile_seconds"] >= 0
  runs = [x for x in r["runs"] if x["method"] == "ngram"]
  assert sorted((x["category"], len(x["lengths"])) for x in runs) == [
      ("copy", 1), ("mixed", 1), ("mixed", 1)]


def test_report_acceptance_where_drafts_were_verified(tiny_dir, prompts_file, tmp_path):
  """k fixed at 2 and 24 new tokens: the n-gram drafts wherever the context's last token came
  earlier, and the report's acceptance per position is then two rates. (The report above drafts
  nothing: in 6 tokens of this random model no token repeats, so only its None branch ran.)
  Without a cost model no speedup is predicted."""
  assert _bench(tiny_dir, prompts_file, tmp_path, "--methods", "ngram",
                "--num-draft-tokens", "2", "--max-new-tokens", "24") == 0
  r = json.loads((tmp_path / "bench.json").read_text())
  for cat in ("copy", "mixed", "all"):
    spec = r["results"]["1"]["ngram"][cat]
    drafted = spec["target_passes"] - spec["plain_steps"]
    assert spec["k_histogram"] == {k: v for k, v in (("0", spec["plain_steps"]), ("2", drafted))
                                   if v}, spec["k_histogram"]
    acc, cond = spec["acceptance_per_position"], spec["conditional_acceptance_per_position"]
    if drafted or cat == "all":
      assert drafted and len(acc) == 2 and all(0 <= a <= 1 for a in acc) and acc[1] <= acc[0]
      assert len(cond) == 2, cond
    else:
      assert acc is None
    assert spec["predicted_speedup"] is None and spec["achieved_over_predicted"] is None
    assert spec["matches_plain"] == 1.0


def test_batches_repeat_prompts_to_fill():
  assert _groups(["a", "b", "c"], 2) == [["a", "b"], ["c", "a"]]
  assert _groups(["a"], 3) == [["a", "a", "a"]]
  assert _groups(["a", "b"], 1) == [["a"], ["b"]]


def test_units_run_by_batch_size_then_compiled_prompt_length():
  """Each compiled loop is needed for one stretch of the run (few programs alive at once)."""
  enc = {"a": [[1] * 70, [1] * 10], "b": [[1] * 20], "c": [[1] * 130, [1] * 60]}
  units = _units(enc, [2, 1])
  assert [(b, c, g) for b, c, g, _ in units] == [
      (2, "b", 0), (2, "a", 0), (2, "c", 0),  # batch 2 first (as given), then 64 / 128 / 192
      (1, "a", 1), (1, "b", 0), (1, "c", 1), (1, "a", 0), (1, "c", 0)]
  assert all(len(group) == b for b, _, _, group in units)


def test_speedups_are_against_the_plain_run_of_the_same_invocation(report):
  _, r = report
  runs = r["runs"]
  for b, by_method in r["results"].items():
    for cat in ("copy", "mixed", "all"):
      tps = {}
      for m in ("none", "ngram"):
        mine = [x for x in runs if x["method"] == m and x["batch_size"] == int(b)
                and cat in ("all", x["category"])]
        tokens, secs = sum(sum(x["lengths"]) for x in mine), sum(x["seconds"] for x in mine)
        cell = by_method[m][cat]
        assert cell["tokens"] == tokens and cell["seconds"] == pytest.approx(secs)
        tps[m] = tokens / secs
        assert cell["tokens_per_second"] == pytest.approx(tps[m])
      assert by_method["none"][cat]["speedup"] == pytest.approx(1.0)
      assert by_method["ngram"][cat]["speedup"] == pytest.approx(tps["ngram"] / tps["none"])
      spec = by_method["ngram"][cat]
      assert spec["achieved_over_predicted"] == pytest.approx(spec["speedup"]
                                                              / spec["predicted_speedup"])


def test_plots_and_table_are_written(report):
  out, r = report
  for name in ("speedup_by_category.png", "acceptance_by_position.png",
               "throughput_vs_batch.png", "achieved_vs_predicted.png"):
    assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
    assert name in r["files"]
  md = (out / "bench.md").read_text()
  assert "## Batch 1" in md and "| ngram |" in md and "Speedup by category" in md


def test_an_interrupted_run_keeps_its_finished_runs(tiny_dir, prompts_file, tmp_path, monkeypatch):
  """A crash or Ctrl-C mid-run (e.g. LLVM out of memory mappings) loses nothing finished."""
  from jaxspec.bench import run as bench_run
  real, calls = bench_run._run_jaxspec, []

  def flaky(*args, **kwargs):
    calls.append(1)
    if len(calls) == 3:
      raise KeyboardInterrupt
    return real(*args, **kwargs)

  monkeypatch.setattr(bench_run, "_run_jaxspec", flaky)
  with pytest.raises(KeyboardInterrupt):
    _bench(tiny_dir, prompts_file, tmp_path, "--methods", "none", "--per-category", "2")
  assert not (tmp_path / "bench.json").exists()
  partial = json.loads((tmp_path / "bench.partial.json").read_text())
  assert partial["incomplete"].startswith("KeyboardInterrupt")
  assert [r["category"] for r in partial["runs"]] == ["copy", "mixed"]
  assert all(r["method"] == "none" and r["seconds"] > 0 for r in partial["runs"])


def test_wrong_prompt_format_names_the_line_and_fields(tmp_path):
  bad = tmp_path / "bad.jsonl"
  bad.write_text('{"prompt": "fine"}\n{"text": "no prompt field"}\n')
  # --model does not exist: the error must come before any model is loaded.
  with pytest.raises(SystemExit, match=r"bad\.jsonl:2: .*'prompt'.*'turns'.*'prompt_ids'"):
    _bench(tmp_path / "no-model", bad, tmp_path / "o")
  bad.write_text('{"prompt": "fine"}\nnot json\n')
  with pytest.raises(SystemExit, match=r"bad\.jsonl:2: not valid JSON"):
    _bench(tmp_path / "no-model", bad, tmp_path / "o")


def test_unknown_method_lists_the_known_ones(prompts_file, tmp_path):
  with pytest.raises(SystemExit, match="unknown method 'fast'.*none, ngram, medusa, mlp, eagle,"
                                       " eagle-tree, medusa-tree, draft-model"):
    _bench(tmp_path / "no-model", prompts_file, tmp_path / "o", "--methods", "none,fast")


def test_tree_size_is_checked_before_loading(prompts_file, tmp_path):
  for bad in ("0", "256"):
    with pytest.raises(SystemExit, match=f"--tree-size must be .* 1..255, got {bad}"):
      _bench(tmp_path / "no-model", prompts_file, tmp_path / "o", "--methods", "eagle-tree",
             "--tree-size", bad)


def test_tree_methods_draft_trees(smollm2):
  """eagle-tree / medusa-tree: the bundled heads with a --tree-size tree; the tree sets the
  depth, so no num_draft_tokens is passed (speculative_generate refuses one with a tree)."""
  s = Settings(methods=("none", "eagle-tree", "medusa-tree"), tree_size=6,
               num_draft_tokens=3)
  for name, kind in (("eagle-tree", "DynamicTree"), ("medusa-tree", "Tree")):
    drafter, what = METHODS[name].make(smollm2, s)
    assert type(drafter.tree).__name__ == kind and "tree" in what
    assert drafter.tree.num_nodes == 6 + 1  # the root (the last accepted token) and 6 drafts
    assert _spec_kwargs(s, drafter, METHODS[name]) == {}


def test_missing_peer_package_names_the_extra(prompts_file, tmp_path, monkeypatch):
  monkeypatch.setattr(peers, "_find_spec", lambda module: None)
  with pytest.raises(SystemExit, match=r"needs torch, transformers, accelerate.*"
                                       r"pip install 'jaxspec\[compare\]'"):
    _bench(tmp_path / "no-model", prompts_file, tmp_path / "o", "--peers",
           "transformers-prompt-lookup")
  with pytest.raises(SystemExit, match=r"unknown peer 'vllm'.*transformers, "):
    _bench(tmp_path / "no-model", prompts_file, tmp_path / "o", "--peers", "vllm")


def test_transformers_peers(report):
  missing = peers.missing_packages("transformers")
  if missing:
    pytest.skip(f"{', '.join(missing)} not installed (pip install 'jaxspec[compare]')")
  _, r = report
  assert r["peers_run"] == ["transformers", "transformers-prompt-lookup"]
  assert "--draft-model" in r["skipped"]["transformers-assisted"]
  assert {"torch", "transformers"} <= set(r["versions"]) and r["peer_threads"] >= 1
  cells = r["results"]["1"]
  hf, lookup = cells["transformers"]["all"], cells["transformers-prompt-lookup"]["all"]
  assert lookup["baseline"] == "transformers"
  assert lookup["speedup"] == pytest.approx(lookup["tokens_per_second"]
                                            / hf["tokens_per_second"])
  assert hf["vs_jaxspec_plain"] == pytest.approx(hf["tokens_per_second"]
                                                 / cells["none"]["all"]["tokens_per_second"])
  for run in r["runs"]:
    assert 1 <= run["lengths"][0] <= 6
  assert sum(x["method"] == "transformers-prompt-lookup" for x in r["runs"]) == 3
  # The same prompt ids and greedy decoding in float32: transformers' tokens are jaxspec's.
  assert hf["matches_plain"] == 1.0 and lookup["matches_plain"] == 1.0


def test_latency_and_prediction_arithmetic():
  # Row 0 got 1 token at 0.1 s (the first), 2 at 0.2 s, 1 at 0.5 s.
  ttft, xs = latency_samples([(0.1, 1), (0.2, 2), (0.5, 1)])
  assert ttft == 0.1 and xs == pytest.approx([0.05, 0.05, 0.3])
  assert expected_tokens([0.5, 0.5], 2) == 1.75 and expected_tokens([0.5], 3) == 1.5
  # Steps verifying k = 2, 2, 0 drafts, always accepted: 3 + 3 + 1 tokens; c(0) = 10 ms,
  # c(2) = 20 ms; 7 tokens after a 0.1 s prefill.
  run = dict(lengths=[7], stats=dict(cost_model={"0": 0.01, "2": 0.02}, k_per_step=[2, 2, 0],
                                     conditional_acceptance_per_position=[1.0, 1.0]))
  p = predicted_times(run, 0.1)
  assert p["plain"] == pytest.approx(0.1 + 6 * 0.01)
  assert p["spec"] == pytest.approx(0.1 + 7 * (0.05 / 3) / (7 / 3))
  assert p["decode"] == pytest.approx(0.01 * (7 / 3) / (0.05 / 3))
  # A run written since stats["cost_model"] is a CostModel holds its to_dict(): the same times.
  from jaxspec.decoding.adaptive import CostModel
  run["stats"]["cost_model"] = CostModel((0, 2), (0.01, 0.02)).to_dict()
  assert predicted_times(run, 0.1) == p


def test_llama_cpp_peers_on_the_bundled_gguf(smollm2):
  """llama.cpp's plain and prompt-lookup greedy decoding of the bundled GGUF each give the same
  tokens on every run and stop at the token budget, and every run evaluates the whole prompt
  (the runner forgets the previous run's KV, which llama-cpp-python would otherwise reuse, so a
  timed run after the warm-up pays for its own prefill). The two agree on the first tokens only:
  llama.cpp's prompt lookup scores several tokens at once with Q4_1 kernels that round
  differently from the one-token ones, so it is not token-exact against its own plain decoding."""
  missing = peers.missing_packages("llama.cpp")
  if missing:
    pytest.skip(f"{', '.join(missing)} not installed (pip install 'jaxspec[llama-cpp]')")
  names = ["llama.cpp", "llama.cpp-prompt-lookup"]
  runner = peers.LlamaCppRunner(None, names, threads=2, n_ctx=256)
  evaluated: dict[str, list[int]] = {n: [] for n in names}  # tokens per `eval` call
  for n in names:
    llm = runner.models[n]
    llm.eval = lambda toks, _eval=llm.eval, _n=n: (evaluated[_n].append(len(toks)), _eval(toks))[1]
  # A prompt that repeats itself, so prompt lookup has drafts to verify.
  prompt = [1, 28, 1317, 314, 253, 3437, 30, 28, 1317, 314, 253, 3437, 30, 28]
  kw = dict(max_new_tokens=24, stop_ids=[2], temperature=0.0, top_k=0, top_p=1.0, seed=0)
  runs: dict[str, list] = {n: [] for n in names}
  for n in names:
    for _ in range(2):
      evaluated[n].clear()
      runs[n].append(runner.run(n, [prompt], **kw))
      assert evaluated[n][0] == len(prompt), (n, evaluated[n][:3])
  for n in names:
    first = runs[n][0].tokens[0]
    assert 1 <= len(first) <= 24 and (len(first) == 24 or first[-1] == 2), n
    for r in runs[n]:
      assert r.tokens[0] == first, n
      assert r.seconds > 0 and r.chunk_times[-1][0] <= r.seconds
  assert runs["llama.cpp"][0].tokens[0][:4] == runs["llama.cpp-prompt-lookup"][0].tokens[0][:4]
  with pytest.raises(ValueError, match="one row at a time"):
    runner.run("llama.cpp", [prompt, prompt], **kw)
