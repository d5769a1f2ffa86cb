"""The cost model of "auto" kept on disk: a second process with the same model, drafter, shapes
and device loads it instead of timing (its stats say so), files that are not one are ignored,
and the directory can be moved, turned off and cleared."""

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import pytest

from jaxspec.decoding.adaptive import AutoK, CostModel
from jaxspec.drafters import NGram
from jaxspec.engine import Engine, clear_cost_cache, cost_cache_dir
from jaxspec.engine.costs import cost_key, load_cost, save_cost

ROOT = Path(__file__).resolve().parents[2]
KS = (0, 1, 2, 4)
COST = CostModel(ks=KS, seconds=(1.0, 1.5, 2.0, 3.0), batch_size=4, source="measured",
                 raw=(1.0, 1.5, 2.0, 3.0), length=12)

# One "auto" call of the tiny model in a fresh process, with JAX's persistent compilation cache
# in argv[1] (so the second process loads its programs instead of compiling them); prints the
# call's cost statistics as JSON.
SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_compilation_cache_dir", sys.argv[1])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    from jaxspec import speculative_generate
    from jaxspec.decoding.adaptive import AutoK
    from jaxspec.drafters import NGram
    from jaxspec.models import init_params, tiny_config
    from jaxspec.models.model import Model
    cfg = tiny_config()
    target = Model(cfg, init_params(cfg, jax.random.key(0), scale=0.2), name="tiny-target")
    out = speculative_generate(target, NGram(), [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12]],
                               max_new_tokens=12, num_draft_tokens="auto",
                               auto=AutoK(k_max=2), stop_ids=())
    st = out.stats
    print(json.dumps(dict(source=st["cost_source"], cost_seconds=st["cost_seconds"],
                          ks=list(st["cost_model"].ks), tokens=out.tokens.tolist())))
""")


def _second_process(xla: Path) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "JAXSPEC_COST_CACHE"}
  out = subprocess.run([sys.executable, "-c", SCRIPT, str(xla)], capture_output=True, text=True,
                       env=env, cwd=ROOT, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_second_process_loads_the_cost_model_and_times_nothing(tmp_path):
  """The default directory is beside JAX's compilation cache, and what one process measured
  another loads (a corrupt file timed again and replaced, and JAXSPEC_COST_CACHE=none, are
  checked in one process: `test_an_engine_reads_and_writes_its_directory`,
  `test_the_directory_env_var_compile_cache_and_clearing`)."""
  xla = tmp_path / "xla"
  first = _second_process(xla)
  assert first["source"] == "measured" and first["cost_seconds"] > 0
  (saved,) = (tmp_path / "xla-costs").iterdir()
  second = _second_process(xla)
  assert second["source"] == "disk" and second["cost_seconds"] == 0.0
  assert second["ks"] == first["ks"] and second["tokens"] == first["tokens"]
  assert json.loads(saved.read_text())["key"] == saved.stem


def test_corrupt_and_foreign_files_are_ignored(tmp_path):
  key = "ab" * 20
  assert save_cost(tmp_path, key, COST)
  loaded = load_cost(tmp_path, key, KS)
  assert loaded == CostModel(ks=KS, seconds=COST.seconds, batch_size=4, source="disk",
                             raw=COST.raw, length=12)
  assert load_cost(tmp_path, key, (0, 1, 2)) is None  # other k's
  assert load_cost(tmp_path, "cd" * 20, KS) is None  # none saved
  path = tmp_path / f"{key}.json"
  good = json.loads(path.read_text())
  bad = [b"\xff\xfe not json", b"[1, 2]", b"", json.dumps(dict(good, format="other")).encode(),
         json.dumps(dict(good, version=99)).encode(), json.dumps(dict(good, key="x")).encode(),
         json.dumps(dict(good, cost=dict(good["cost"], seconds=[1.0, -1.0, 2.0, 3.0]))).encode(),
         json.dumps(dict(good, cost=dict(good["cost"], seconds=["a", 1, 2, 3]))).encode(),
         json.dumps(dict(good, cost=None)).encode()]
  for b in bad:
    path.write_bytes(b)
    assert load_cost(tmp_path, key, KS) is None, b
  path.unlink()
  path.mkdir()  # a directory where the file would be: nothing read, nothing saved
  assert load_cost(tmp_path, key, KS) is None and not save_cost(tmp_path, key, COST)


def test_an_engine_reads_and_writes_its_directory(tiny_target, tmp_path):
  """In one process: a fresh engine on the same directory loads what another engine measured;
  a corrupt file is re-timed and overwritten; cost_cache=False keeps nothing."""
  prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12]]
  kw = dict(max_new_tokens=12, num_draft_tokens="auto", auto=AutoK(k_max=2), stop_ids=())
  a = Engine(cost_cache=tmp_path)
  first = a.speculative_generate(tiny_target, NGram(), prompts, **kw)
  assert (first.stats["cost_source"], len(list(tmp_path.iterdir()))) == ("measured", 1)
  again = a.speculative_generate(tiny_target, NGram(), prompts, **kw)
  assert (again.stats["cost_source"], again.stats["cost_seconds"]) == ("cached", 0.0)
  b = Engine(cost_cache=tmp_path)
  b.programs = a.programs  # the same compiled programs: only the cost model is in question
  loaded = b.speculative_generate(tiny_target, NGram(), prompts, **kw)
  assert (loaded.stats["cost_source"], loaded.stats["cost_seconds"]) == ("disk", 0.0)
  # The same model, which says where it came from.
  assert loaded.stats["cost_model"].source == "disk"
  assert loaded.stats["cost_model"] == dataclasses.replace(first.stats["cost_model"],
                                                           source="disk")
  (saved,) = tmp_path.iterdir()
  saved.write_text("garbage")
  c = Engine(cost_cache=tmp_path)
  c.programs = a.programs
  timed = c.speculative_generate(tiny_target, NGram(), prompts, **kw)
  assert timed.stats["cost_source"] == "measured" and timed.stats["cost_seconds"] > 0
  assert json.loads(saved.read_text())["key"] == saved.stem
  off = Engine(cost_cache=False)
  off.programs = a.programs
  assert off.cost_cache_dir() is None
  assert off.speculative_generate(tiny_target, NGram(), prompts, **kw).stats["cost_source"] == (
      "measured")
  given = a.speculative_generate(tiny_target, NGram(), prompts, cost=COST_FOR_K2, **kw)
  assert (given.stats["cost_source"], given.stats["cost_seconds"]) == ("given", 0.0)
  fixed = a.speculative_generate(tiny_target, NGram(), prompts, max_new_tokens=12,
                                 num_draft_tokens=2, stop_ids=())
  assert (fixed.stats["cost_source"], fixed.stats["cost_seconds"]) == (None, 0.0)


COST_FOR_K2 = CostModel(ks=(0, 1, 2), seconds=(1.0, 1.2, 1.4))


def test_the_key_follows_model_drafter_shapes_and_settings(tiny_target, poor_draft):
  from jaxspec.decoding.loop import resolve_policy
  base = dict(target=tiny_target, drafter=NGram(), batch=4, prompt_width=64, max_len=128,
              policy=resolve_policy("auto", AutoK(k_max=2)), sampling="greedy", sharding=None,
              run="SpecRun", placement=None)
  key = cost_key(base)
  assert cost_key(dict(base)) == key and len(key) == 40
  # The same weights' layout under another object: the same key (values never change a
  # step's time).
  same = jax.tree.map(lambda x: x + 1, tiny_target.params)
  assert cost_key(dict(base, target=tiny_target.__class__(tiny_target.cfg, same,
                                                           name=tiny_target.name))) == key
  others = [dict(base, target=poor_draft), dict(base, drafter=NGram(max_ngram=2)),
            dict(base, batch=8), dict(base, max_len=256), dict(base, prompt_width=128),
            dict(base, policy=resolve_policy("auto", AutoK(k_max=4))),
            dict(base, sampling="temperature=1.0")]
  keys = {cost_key(o) for o in others}
  assert key not in keys and len(keys) == len(others)


def test_the_directory_env_var_compile_cache_and_clearing(tmp_path, monkeypatch):
  monkeypatch.setenv("JAXSPEC_COST_CACHE", str(tmp_path / "mine"))
  assert cost_cache_dir() == tmp_path / "mine"
  assert Engine().cost_cache_dir() == tmp_path / "mine"
  assert Engine(cost_cache=tmp_path / "x").cost_cache_dir() == tmp_path / "x"
  # None and "off" / "none" keep none, as the variable reads them (not a directory "./off").
  assert all(Engine(cost_cache=v).cost_cache_dir() is None for v in (None, "off", "None", False))
  for bad in (0, 1.5, ""):
    with pytest.raises(ValueError, match="cost_cache must be True"):
      Engine(cost_cache=bad)
  with pytest.raises(ValueError, match="keep must be an integer"):
    Engine().release_compiled(keep=-1)
  for off in ("none", "off", "NONE"):
    monkeypatch.setenv("JAXSPEC_COST_CACHE", off)
    assert cost_cache_dir() is None
  monkeypatch.delenv("JAXSPEC_COST_CACHE")
  previous = jax.config.jax_compilation_cache_dir
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    assert cost_cache_dir() is None  # no compilation cache: nothing kept
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "xla"))
    assert cost_cache_dir() == tmp_path / "xla-costs"
  finally:
    jax.config.update("jax_compilation_cache_dir", previous)
  d = tmp_path / "costs"
  for key in ("ab" * 20, "cd" * 20):
    assert save_cost(d, key, COST)
  (d / "notes.json").write_text("{}")  # not ours: kept
  assert clear_cost_cache(d) == 2 and [p.name for p in d.iterdir()] == ["notes.json"]
  assert clear_cost_cache(tmp_path / "missing") == 0
  monkeypatch.setenv("JAXSPEC_COST_CACHE", str(d))
  assert save_cost(d, "ef" * 20, COST) and clear_cost_cache() == 1


def test_a_short_call_times_the_steps_of_a_long_one(tiny_target):
  """A call of one new token (its rows done at the prefill) still times every k over the full
  count of steps, since its model is kept for later calls of the same shapes; a call whose
  cache leaves no room for them times fewer, uses that, and the next call measures again."""
  from jaxspec.engine.costs import TIMED_STEPS
  prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12]]
  kw = dict(num_draft_tokens="auto", auto=AutoK(k_max=2), stop_ids=())
  eng = Engine(cost_cache=False)
  one = eng.speculative_generate(tiny_target, NGram(), prompts, max_new_tokens=1, **kw)
  assert one.stats["cost_source"] == "measured"
  assert one.stats["cost_model"].steps == TIMED_STEPS
  long = eng.speculative_generate(tiny_target, NGram(), prompts, max_new_tokens=40, **kw)
  assert long.stats["cost_source"] == "cached"
  # max_len = prompt + 1 + the k + 1 slots a step may write past: no room for a timed step.
  tight = dict(kw, max_len=8 + 1 + 3)
  cut = eng.speculative_generate(tiny_target, NGram(), prompts, max_new_tokens=1, **tight)
  assert cut.stats["cost_source"] == "measured" and cut.stats["cost_model"].steps < TIMED_STEPS
  again = eng.speculative_generate(tiny_target, NGram(), prompts, max_new_tokens=1, **tight)
  assert again.stats["cost_source"] == "measured"
  with pytest.raises(ValueError, match="CostModel.steps"):
    CostModel(ks=(0,), seconds=(1.0,), steps=-1)
  assert CostModel.from_dict(cut.stats["cost_model"].to_dict()) == cut.stats["cost_model"]
