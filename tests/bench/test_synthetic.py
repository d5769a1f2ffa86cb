"""Measuring the machinery: the oracle drafter, synthetic shapes, the per-backend layout, the
synthetic benchmark's smoke run, and what the compiled verify path holds for greedy rows."""

import collections
import math
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.drafters import Oracle
from jaxspec.api import generate
from jaxspec.models.llama import DEFAULT_SCAN_LAYERS, default_scan_layers
from jaxspec.models.synthetic import SHAPES, random_model, shape_config
from jaxspec.api import speculative_generate

from helpers import ROOT


def _prompts(vocab, batch, length, seed=0):
  rng = np.random.default_rng(seed)
  return [list(map(int, rng.integers(3, vocab, length))) for _ in range(batch)]


@pytest.fixture(scope="module")
def model():
  return random_model("tiny", "float32")


def test_oracle_alpha_one_accepts_everything(model):
  k, n = 3, 1 + 5 * 4  # the first token, then five passes of k + 1
  prompts = _prompts(model.cfg.vocab_size, 2, 9)
  ref = generate(model, prompts, max_new_tokens=n, stop_ids=())
  drafter = Oracle(reference=ref.tokens, alpha=1.0, vocab=model.cfg.vocab_size)
  out = speculative_generate(model, drafter, prompts, max_new_tokens=n, num_draft_tokens=k,
                             stop_ids=())
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  assert out.stats["tau"] == k + 1
  assert out.stats["target_passes"] == 5


def test_oracle_acceptance_is_alpha_and_output_exact(model):
  """Greedy output equals plain decoding; every draft position accepts with probability alpha
  given it was reached, and tau is (1 - a^(k+1)) / (1 - a) up to the last steps' truncation.
  Sized from its power: about 1,400 passes, so each position's rate has a standard error of at
  most 0.03 and the bound (5 errors) detects a bias of 0.15."""
  k, alpha, n = 4, 0.7, 161
  prompts = _prompts(model.cfg.vocab_size, 32, 7, seed=1)
  ref = generate(model, prompts, max_new_tokens=n, stop_ids=())
  drafter = Oracle(reference=ref.tokens, alpha=alpha, vocab=model.cfg.vocab_size)
  out = speculative_generate(model, drafter, prompts, max_new_tokens=n, num_draft_tokens=k,
                             stop_ids=(), key=3)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  st = out.stats
  reached = np.asarray(st["conditional_acceptance_per_position"])
  passes = sum(st["drafted_per_row"]) / k  # row-steps that verified k real drafts, about
  for i, rate in enumerate(reached):
    n_i = passes * alpha ** i  # row-steps that reached position i
    se = math.sqrt(alpha * (1 - alpha) / n_i)
    assert abs(rate - alpha) < 5 * se, (i, rate, se)
  tau = (1 - alpha ** (k + 1)) / (1 - alpha)
  assert abs(st["tau"] - tau) < 0.15, (st["tau"], tau)


# slow: the oracle's sampled text is `generate`'s for the key, token for token
# (test_speculative's test_sampled_text_is_generates_with_deterministic_drafters).
@pytest.mark.slow
def test_oracle_sampled_output_is_the_targets_distribution():
  """Under sampling the oracle is a deterministic drafter (one-hot q) of arbitrary tokens: the
  first two new tokens (the second one verified against drafts) follow the target's own joint
  distribution. Chi-square over the 64 cells of a vocabulary-8 model, 6,000 rows: a cell
  probability off by 0.01 in a cell of 0.05 moves the statistic by about 12 on its own."""
  from scipy import stats

  from jaxspec.models import forward, init_cache, init_params, tiny_config
  from jaxspec.models.model import Model
  cfg = tiny_config(vocab_size=8)
  m = Model(cfg, init_params(cfg, jax.random.key(5), scale=0.3))
  prompt, rows = [1, 4, 2], 6000
  rng = np.random.default_rng(0)
  drafter = Oracle(reference=rng.integers(0, 8, (rows, 3)), alpha=0.6, vocab=8)
  out = speculative_generate(m, drafter, [prompt] * rows, max_new_tokens=3, num_draft_tokens=2,
                             stop_ids=(), temperature=1.0, key=11)
  assert out.stats["acceptance_rate"] > 0.05  # drafts were really verified
  seen = np.zeros((8, 8))
  np.add.at(seen, (out.tokens[:, 0], out.tokens[:, 1]), 1)

  def dist(ids):
    logits, _, _ = forward(m.params, jnp.asarray([ids]), init_cache(cfg, 1, 8), cfg)
    return np.asarray(jax.nn.softmax(logits[0, -1].astype(jnp.float32)), np.float64)
  p0 = dist(prompt)
  joint = np.stack([p0[t] * dist(prompt + [t]) for t in range(8)])
  expected = joint.reshape(-1) * rows
  keep = expected >= 5
  obs = seen.reshape(-1)
  chi2 = ((obs[keep] - expected[keep]) ** 2 / expected[keep]).sum()
  rest = obs[~keep].sum(), expected[~keep].sum()
  if rest[1] > 0:
    chi2 += (rest[0] - rest[1]) ** 2 / rest[1]
  df = int(keep.sum()) - (0 if rest[1] > 0 else 1)
  assert stats.chi2.sf(chi2, df) > 1e-3, (chi2, df)


def test_oracle_bad_arguments():
  ref = np.zeros((2, 4), np.int32)
  for kwargs, what in ((dict(alpha=1.5), "alpha"), (dict(alpha=-0.1), "alpha"),
                       (dict(vocab=1), "vocab"), (dict(vocab=3.0), "vocab")):
    args = dict(reference=ref, alpha=0.5, vocab=10) | kwargs
    with pytest.raises(ValueError, match=what):
      Oracle(**args)
  with pytest.raises(ValueError, match="reference"):
    Oracle(reference=np.zeros(4, np.int32), alpha=0.5, vocab=10)


def test_oracle_new_reference_reuses_the_program(model):
  a = Oracle(reference=np.zeros((2, 8), np.int32), alpha=0.5, vocab=model.cfg.vocab_size)
  b = Oracle(reference=np.ones((2, 8), np.int32), alpha=0.9, vocab=model.cfg.vocab_size)
  c = Oracle(reference=np.ones((3, 8), np.int32), alpha=0.9, vocab=model.cfg.vocab_size)
  assert a == b and hash(a) == hash(b) and a != c


def test_shapes_are_the_published_ones():
  b1, b8 = shape_config("llama-3.2-1b"), shape_config("llama-3.1-8b", "bfloat16")
  assert abs(b1.num_params / 1e9 - 1.236) < 0.01  # Llama-3.2-1B: 1.24 B parameters
  assert abs(b8.num_params / 1e9 - 8.03) < 0.01  # Llama-3.1-8B: 8.03 B
  assert b8.dtype == "bfloat16" and b8.jnp_dtype == jnp.bfloat16
  assert abs(SHAPES["smollm2-135m"].num_params / 1e6 - 134.5) < 0.5
  with pytest.raises(ValueError, match="unknown shape"):
    shape_config("llama-9")


def test_default_layout_per_backend():
  """As the docs say: unrolled on CPUs and GPUs (measured faster there), stacked on TPUs and
  on backends not listed; the CPU's default is what `random_model` builds here."""
  assert default_scan_layers("cpu") is False
  assert default_scan_layers("gpu") is False
  assert default_scan_layers("tpu") is True
  assert default_scan_layers("some-new-backend") is True
  assert set(DEFAULT_SCAN_LAYERS) >= {"cpu", "gpu", "tpu"}
  assert isinstance(random_model("tiny").params.layers, tuple)


# The filters' work: a sort of the vocabulary, or on the CPU the bisections' loops.
_FILTER_OPS = r"\b(sort|while)\("


def _filter_ops_outside_conditionals(hlo: str) -> list[str]:
  """Computations holding a sort or a loop that run without a conditional branch being taken:
  the call graph from ENTRY, following every call edge but conditional branches."""
  comps, calls, name = {}, collections.defaultdict(set), None
  for line in hlo.splitlines():
    m = re.match(r"^(ENTRY )?%?([\w.\-]+) .*\{$", line)
    if m and not line.startswith(" "):
      name = "ENTRY" if m.group(1) else m.group(2)
      comps[name] = []
      continue
    if name is None:
      continue
    comps[name].append(line)
    if " conditional(" in line:
      continue  # its branches run only when taken
    for attr in ("to_apply", "calls", "body", "condition"):
      for callee in re.findall(attr + r"=%?([\w.\-]+)", line):
        calls[name].add(callee)
  seen, todo = set(), ["ENTRY"]
  while todo:
    c = todo.pop()
    if c in seen:
      continue
    seen.add(c)
    todo.extend(calls[c])
  return [c for c in seen if not c.startswith("threefry")  # the random bits' own loop
          and any(re.search(_FILTER_OPS, ln) for ln in comps.get(c, []))]


def _verify_path_hlo(model) -> str:
  """The lowered HLO of one verify pass and its rejection sampling (the verify path of the
  loop, outside the loop's own choice of k)."""
  from jaxspec.models import init_cache
  from jaxspec.sampling import GREEDY
  from jaxspec.decoding.rejection import rejection_sample, verify
  cfg, b, k = model.cfg, 2, 3

  def path(params, cache, last, drafts, sp, keys):
    p, _, _ = verify(cfg, params, cache, last, drafts, sp)
    return rejection_sample(p, None, drafts, keys, greedy=sp.temperature == 0)

  args = (model.params, init_cache(cfg, b, 16), jnp.zeros((b,), jnp.int32),
          jnp.zeros((b, k), jnp.int32), GREEDY.arrays(b), jax.random.split(jax.random.key(0), b))
  return jax.jit(path).lower(*args).as_text(dialect="hlo")


def test_greedy_verify_path_has_no_unconditional_sort(model, monkeypatch):
  """Top-k/top-p sort the vocabulary (bisect it on the CPU): the verify path must reach a sort
  or a loop only through a run-time conditional (taken when some row samples with a filter),
  so greedy rows never pay for one. Checked on the lowered program; a verify path without the
  guards fails it."""
  hlo = _verify_path_hlo(model)
  assert re.search(_FILTER_OPS, hlo), "the path should still hold the filters"
  assert _filter_ops_outside_conditionals(hlo) == []
  from jaxspec import sampling
  unguarded = lambda logits, sp: jax.nn.softmax(sampling._filter_sorted(
      logits.astype(jnp.float32), sp), axis=-1)
  monkeypatch.setattr(sampling, "probs", unguarded)
  assert _filter_ops_outside_conditionals(_verify_path_hlo(model)) != []


@pytest.mark.slow  # CI's smoke run (make test-slow); the oracle's tests above run by default
def test_bench_synthetic_smoke(tmp_path):
  """The synthetic-scale benchmark end to end on the tiny shape (CI's smoke run): every
  number it reports is there, speculative output equals plain output, tau is measured."""
  sys.path.insert(0, str(ROOT / "benchmarks"))
  import bench_synthetic
  out = bench_synthetic.main(["--configs", "tiny:float32:1,tiny:float32:2", "--new-tokens", "16",
                              "--prompt-len", "8", "--widths", "1,5", "--repeats", "1",
                              "--iters", "2", "--rounds", "1", "--bandwidth-gib", "0.05",
                              "--out", str(tmp_path / "syn.json"), "--plot"])
  assert (tmp_path / "syn.json").exists() and (tmp_path / "syn.png").exists()
  assert [r["batch"] for r in out["results"]] == [1, 2]
  for r in out["results"]:
    assert "error" not in r, r
    assert r["spec_equals_plain"] is True
    assert r["plain_ms_per_step"] > 0 and r["limit_ms"] > 0 and r["fraction_of_limit"] > 0
    assert set(r["verify_cost"]) == {"1", "5"} and r["verify_cost"]["1"] == 1.0
    assert 1.0 <= r["tau"] <= 5.0 and r["tau_expected"] == pytest.approx(3.3616)
    assert r["machinery_efficiency"] == pytest.approx(r["speedup"] / r["ideal_speedup"])
  assert out["bandwidth_gbs"]["limit"] >= out["bandwidth_gbs"]["read"] > 0


def test_peaked_model_repeats_its_token_by_the_margin_asked():
  """A peaked model (random_model(peak=...)) keeps every shape and dtype of the random one, and
  its next token is the current one, winning by about `peak` logits: so bfloat16 verify passes
  and decode steps agree, and a bfloat16 oracle run keeps its acceptance. Fails if the layers'
  output projections or the final norm are left unscaled (the top token is then a near-tie of
  random logits, not the input)."""
  from jaxspec.models.llama import forward, init_cache, init_params
  from jaxspec.models.synthetic import peaked_params
  plain, peaked = random_model("tiny", "bfloat16"), random_model("tiny", "bfloat16", peak=8.0)
  assert jax.tree.map(lambda x: (x.shape, x.dtype), plain.params) == jax.tree.map(
      lambda x: (x.shape, x.dtype), peaked.params)
  cfg = peaked.cfg
  tokens = jnp.asarray(_prompts(cfg.vocab_size, 3, 12, seed=4), jnp.int32)
  logits = forward(peaked.params, tokens, init_cache(cfg, 3, 16), cfg)[0].astype(jnp.float32)
  top2 = jnp.sort(logits, axis=-1)[..., -2:]
  np.testing.assert_array_equal(jnp.argmax(logits, -1), tokens)
  assert 6.0 < float(top2[..., 1].min()) and float(top2[..., 1].max()) < 10.0
  assert float((top2[..., 1] - top2[..., 0]).min()) > 3.0
  # bfloat16 speculative greedy output equals plain, at the oracle's alpha-implied tau.
  k, alpha, n = 4, 0.8, 96
  prompts = _prompts(cfg.vocab_size, 4, 9, seed=5)
  ref = generate(peaked, prompts, max_new_tokens=n, stop_ids=())
  drafter = Oracle(reference=ref.tokens, alpha=alpha, vocab=cfg.vocab_size)
  out = speculative_generate(peaked, drafter, prompts, max_new_tokens=n, num_draft_tokens=k,
                             stop_ids=(), key=2)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  assert abs(out.stats["tau"] - (1 - alpha ** (k + 1)) / (1 - alpha)) < 0.5
  # Only init_params' stacked layout is taken, and only a positive margin.
  cfg32 = shape_config("tiny")
  params = init_params(cfg32, jax.random.key(0))
  with pytest.raises(ValueError, match="positive"):
    peaked_params(params, cfg32, 0.0)
  with pytest.raises(ValueError, match="before with_scan_layers"):
    peaked_params(random_model("tiny", scan_layers=False).params, cfg32, 8.0)
