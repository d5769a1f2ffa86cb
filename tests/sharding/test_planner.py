"""Device profiles and the placement planner: the plan is the brute-force optimum of the cost
model written out here, profiles measure and round-trip, bad inputs fail with the fix."""

import math

import jax
import pytest

from jaxspec.sharding.planner import DrafterSpec, plan
from jaxspec.sharding.profiles import (LinkProfile, ModelProfile, load_profiles, profile,
                                       profile_link, save_profiles)
from jaxspec.sharding.rules import make_mesh, submesh

V = 32000  # vocabulary: sizes the q [B, k, V] float32 a sampling drafter sends across a link

# Accelerators by their numbers: (bytes/s, FLOP/s, seconds of fixed overhead per pass).
# The FLOP rates are low enough that a pass of B * T = 4 * 9 tokens is compute-bound somewhere,
# so verify(k) and the drafter's catch-up pass depend on T.
GPU = dict(bandwidth=2e12, peak_flops=4e13, overhead=2e-4)  # fast, memory-bound at small batch
NPU = dict(bandwidth=2e11, peak_flops=5e12, overhead=2e-3)  # slow, and busy: a big per-pass cost
CPU = dict(bandwidth=1e11, peak_flops=2e11, overhead=5e-5)
TARGET_PARAMS, DRAFT_PARAMS = 1e9, 1e8


def roofline(numbers, params, b, t):
  """The latency the test expects: max(weights / bandwidth, 2 params B T / peak) + overhead."""
  return max(2 * params / numbers["bandwidth"],
             2 * params * b * t / numbers["peak_flops"]) + numbers["overhead"]


def given(numbers, params):
  return ModelProfile.from_numbers(params=params, vocab_size=V, **numbers)


LINKS = {  # (latency s, bandwidth bytes/s)
    ("gpu0", "cpu"): (2e-5, 2.5e10), ("npu0", "cpu"): (5e-5, 1e10), ("gpu0", "npu0"): (5e-4, 1e10)}


def link_profiles(links):
  return {pair: LinkProfile(latency=lat, bandwidth=bw) for pair, (lat, bw) in links.items()}


def brute_force(alpha, target_on, drafter_on, links, *, b, k_max, probs=True, catch_up=True):
  """argmax over (target group, drafter group, k) of B E(k) / (draft + verify + transfer).

  target_on / drafter_on: group -> (numbers, params) or a latency function (b, t) -> seconds.
  Returns (tokens/s, target group, drafter group, k) of the best and of plain decoding's best.
  """
  lat = lambda spec, bb, t: spec(bb, t) if callable(spec) else roofline(spec[0], spec[1], bb, t)
  rows = []
  for gt, ts in target_on.items():
    rows.append((b / lat(ts, b, 1), gt, None, 0))
    for gd, ds in drafter_on.items():
      for k in range(1, k_max + 1):
        e = k + 1 if alpha == 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
        if catch_up:  # a draft model: one two-token pass, then k - 1 one-token passes
          draft = lat(ds, b, 2) + (k - 1) * lat(ds, b, 1)
        else:
          draft = k * lat(ds, b, 1)
        verify = lat(ts, b, k + 1)
        move = 0.0
        if gd != gt:
          l_lat, l_bw = links.get((gd, gt)) or links[(gt, gd)]
          sent = b * k * 4 + (b * k * V * 4 if probs else 0)
          move = (l_lat + sent / l_bw) + (l_lat + b * (k + 1) * 4 / l_bw)
        rows.append((b * e / (draft + verify + move), gt, gd, k))
  rows.sort(key=lambda r: -r[0])
  # the optimum must be unambiguous, or comparing choices would test the tie-break
  assert rows[0][0] > rows[1][0] * (1 + 1e-9)
  plain = max(r for r in rows if r[3] == 0)
  return rows[0], plain, {r[1:]: r[0] for r in rows}


def check(p, expected, plain, table):
  assert (p.target_group, p.drafter_group, p.k) == expected[1:]
  # every candidate, not only the winner, is priced as the formula says
  got = {(c.target_group, c.drafter_group, c.k): c.tokens_per_s for c in p.candidates}
  assert got.keys() == table.keys()
  assert got == pytest.approx(table, rel=1e-9)
  assert p.tokens_per_s == pytest.approx(expected[0], rel=1e-9)
  assert p.baseline.target_group == plain[1]
  assert p.speedup == pytest.approx(expected[0] / plain[0], rel=1e-9)
  assert p.candidates[0].tokens_per_s == p.tokens_per_s
  rates = [c.tokens_per_s for c in p.candidates]
  assert rates == sorted(rates, reverse=True)


DEVICES = {"gpu0": "a GPU", "npu0": "an NPU", "cpu": "the host"}


@pytest.mark.parametrize("alpha", [0.3, 0.6, 0.9])
@pytest.mark.parametrize("batch", [1, 4])
def test_plan_is_the_brute_force_optimum(alpha, batch):
  target_on = {"gpu0": (GPU, TARGET_PARAMS), "npu0": (NPU, TARGET_PARAMS)}
  drafter_on = {g: (n, DRAFT_PARAMS) for g, n in (("gpu0", GPU), ("npu0", NPU), ("cpu", CPU))}
  profiles = {"target": {g: given(n, p) for g, (n, p) in target_on.items()},
              "draft": {g: given(n, p) for g, (n, p) in drafter_on.items()}}
  p = plan("target", "draft", DEVICES, profiles, alpha, k_max=8, batch_size=batch,
           links=link_profiles(LINKS))
  expected, plain, table = brute_force(alpha, target_on, drafter_on, LINKS, b=batch, k_max=8)
  check(p, expected, plain, table)
  assert p.target_group == "gpu0" and p.drafter_group == "gpu0" and p.k > 0  # fused on the GPU
  # every placement was a candidate: 2 plain + 2 target groups x 3 drafter groups x 8 k
  assert len(p.candidates) == 2 + 2 * 3 * 8
  assert "do not speculate" not in p.explain()


def test_do_not_speculate_when_the_drafter_is_slow():
  # The drafter only fits on the slow CPU, and every step pays a millisecond each way.
  slow_cpu = dict(CPU, bandwidth=2e10)
  target_on = {"gpu0": (GPU, TARGET_PARAMS)}
  drafter_on = {"cpu": (slow_cpu, DRAFT_PARAMS)}
  links = {("gpu0", "cpu"): (1e-3, 1e9)}
  profiles = {"target": {"gpu0": given(GPU, TARGET_PARAMS)},
              "draft": {"cpu": given(slow_cpu, DRAFT_PARAMS)}}
  for alpha in (0.3, 0.6, 0.9):
    p = plan("target", "draft", DEVICES, profiles, alpha, links=link_profiles(links))
    expected, plain, table = brute_force(alpha, target_on, drafter_on, links, b=1, k_max=8)
    check(p, expected, plain, table)
    assert (p.k, p.drafter_group, p.speedup) == (0, None, 1.0)
    text = p.explain()
    assert text.startswith("do not speculate") and "drafter on cpu" in text, text


def test_the_drafter_moves_off_a_memory_bound_busy_target_device():
  # The target only fits on the NPU, whose per-pass overhead makes each small draft pass cost
  # 3 ms there; the host CPU runs one in about 2 ms plus a cheap transfer.
  target_on = {"npu0": (NPU, TARGET_PARAMS)}
  drafter_on = {"npu0": (NPU, DRAFT_PARAMS), "cpu": (CPU, DRAFT_PARAMS)}
  profiles = {"target": {"npu0": given(NPU, TARGET_PARAMS)},
              "draft": {g: given(n, p) for g, (n, p) in drafter_on.items()}}
  for alpha in (0.3, 0.6, 0.9):
    p = plan("target", "draft", DEVICES, profiles, alpha, links=link_profiles(LINKS))
    expected, plain, table = brute_force(alpha, target_on, drafter_on, LINKS, b=1, k_max=8)
    check(p, expected, plain, table)
    assert (p.target_group, p.drafter_group) == ("npu0", "cpu") and p.k > 0
    fused = max(c.tokens_per_s for c in p.candidates if c.drafter_group == "npu0")
    assert p.tokens_per_s > fused
    assert "host-orchestrated" in p.explain() and "drafter on npu0" in p.explain()


def test_ngram_drafter_costs_per_token_and_sends_no_q():
  # An n-gram drafter on the host: 20 us per lookup, tokens (not q) cross the link.
  target_on = {"gpu0": (GPU, TARGET_PARAMS)}
  drafter_on = {"cpu": lambda b, t: 2e-5 * t}
  links = {("cpu", "gpu0"): (3e-4, 1e9)}
  profiles = {"target": {"gpu0": given(GPU, TARGET_PARAMS)},
              "ngram": {"cpu": ModelProfile.per_token(2e-5)}}
  spec = DrafterSpec(name="ngram", kind="ngram")
  for alpha in (0.3, 0.6, 0.9):
    p = plan("target", spec, ["gpu0", "cpu"], profiles, alpha, links=link_profiles(links))
    expected, plain, table = brute_force(alpha, target_on, drafter_on, links, b=1, k_max=8,
                                  probs=False, catch_up=False)
    check(p, expected, plain, table)


def test_k_grows_with_acceptance():
  profiles = {"target": {"gpu0": given(GPU, TARGET_PARAMS)},
              "draft": {"gpu0": given(GPU, DRAFT_PARAMS)}}
  ks = [plan("target", "draft", ["gpu0"], profiles, a).k for a in (0.0, 0.3, 0.6, 0.9, 1.0)]
  assert ks[0] == 0  # nothing is ever accepted: drafting only costs
  assert ks[-1] == 8  # everything is accepted: draft as far as allowed
  assert ks == sorted(ks) and len(set(ks[1:4])) == 3, ks  # 0.3 < 0.6 < 0.9 strictly
  assert plan("target", "draft", ["gpu0"], profiles, 0.9, k_max=0).k == 0


def test_profile_interpolation():
  p = ModelProfile.from_table({(1, 1): 1.0, (1, 3): 3.0, (4, 1): 2.0, (4, 3): 8.0})
  assert p.latency(1, 2) == pytest.approx(2.0)  # linear in T
  assert p.latency(2, 1) == pytest.approx(1 + 1 / 3)  # linear in B
  assert p.latency(2, 2) == pytest.approx((2 * 2 + 5) / 3)  # bilinear
  assert p.latency(1, 0) == 1.0 and p.latency(0, 1) == 1.0  # below the grid: the edge value
  assert p.latency(1, 5) == pytest.approx(5.0)  # above: the last slope
  assert p.latency(8, 1) == pytest.approx(2 + 4 / 3)
  flat_then_down = ModelProfile.from_table({(1, 1): 2.0, (1, 2): 1.0})
  assert flat_then_down.latency(1, 9) == 1.0  # extrapolation never goes down
  with pytest.raises(ValueError, match=r"no time for \(batch, T\) = \(4, 3\)"):
    ModelProfile.from_table({(1, 1): 1.0, (1, 3): 3.0, (4, 1): 2.0})
  with pytest.raises(ValueError, match="finite and >= 0"):
    ModelProfile.from_table({(1, 1): -1.0})


@pytest.fixture(scope="module")
def small_model():
  from jaxspec.models import init_params, tiny_config
  from jaxspec.models.model import Model
  cfg = tiny_config(num_layers=1, hidden_size=32, num_heads=2, num_kv_heads=2,
                    intermediate_size=64)
  return Model(cfg, init_params(cfg, jax.random.key(3), scale=0.2), name="small")


def test_profile_measures_and_round_trips(small_model, tmp_path):
  one = submesh([0])
  two = make_mesh({"data": 1, "model": 2}, devices=jax.devices()[2:4])
  measured = {}
  for name, mesh in (("one", one), ("two", two)):
    p = profile(small_model, mesh, tokens=(1, 2), batch_sizes=(1, 2), cache_len=16, repeats=2)
    assert p.source == "measured" and p.platform == "cpu" and p.vocab_size == 128
    assert set(p.table) == {(1, 1), (1, 2), (2, 1), (2, 2)}
    assert all(0 < s < 1 and math.isfinite(s) for s in p.table.values()), p.table
    measured[name] = p
  assert "ids 2, 3" in measured["two"].devices
  link = profile_link(one, two, repeats=2)
  assert link.latency >= 0 and link.bandwidth > 0 and link.source == "measured"

  path = tmp_path / "profiles.json"
  profiles = {"small": measured}
  save_profiles(path, profiles, {("one", "two"): link})
  loaded, links = load_profiles(path)
  assert loaded == profiles and links == {("one", "two"): link}
  # measured profiles plan like given ones
  p = plan("small", "small", {"one": one, "two": two}, loaded, 0.7, k_max=2, links=links)
  assert p.tokens_per_s > 0 and len(p.candidates) == 2 + 2 * 2 * 2


def test_profile_rejects_a_mesh_that_does_not_divide_the_batch(small_model):
  mesh = make_mesh({"data": 2, "model": 1}, devices=jax.devices()[:2])
  with pytest.raises(ValueError, match="does not divide a batch of 1 rows"):
    profile(small_model, mesh, tokens=(1,), batch_sizes=(1,))


def test_bad_inputs_name_the_fix(tmp_path):
  gpu = given(GPU, TARGET_PARAMS)
  profiles = {"target": {"gpu0": gpu}, "draft": {"gpu0": given(GPU, DRAFT_PARAMS),
                                                 "cpu": given(CPU, DRAFT_PARAMS)}}
  links = link_profiles(LINKS)
  ok = dict(devices=DEVICES, profiles=profiles, links=links)

  def run(target="target", drafter="draft", alpha=0.6, **kw):
    args = {**ok, **kw}
    return plan(target, drafter, args.pop("devices"), args.pop("profiles"), alpha, **args)

  run()  # the good inputs plan
  with pytest.raises(ValueError, match="'tpu9', which is not in devices"):
    run(profiles={**profiles, "target": {"tpu9": gpu}})
  with pytest.raises(ValueError, match="links names device group 'tpu9'"):
    run(links={("gpu0", "tpu9"): LinkProfile(latency=0, bandwidth=1)})
  with pytest.raises(ValueError, match="no profile for the target 'big'"):
    run(target="big")
  with pytest.raises(ValueError, match="no profile for the drafter 'tiny'"):
    run(drafter="tiny")
  with pytest.raises(ValueError, match="no LinkProfile between 'cpu' and 'gpu0'"):
    run(links={})
  for alpha in (-0.1, 1.1, float("nan"), True, "0.5"):
    with pytest.raises(ValueError, match=r"acceptance must be a probability in \[0, 1\]"):
      run(alpha=alpha)
  with pytest.raises(ValueError, match="k_max must be an integer >= 0"):
    run(k_max=-1)
  with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
    run(batch_size=0)
  with pytest.raises(ValueError, match="device group names repeat"):
    run(devices=["gpu0", "gpu0", "cpu"])
  with pytest.raises(ValueError, match="head drafter 'draft' has no profile on a group the"):
    run(drafter=DrafterSpec(name="draft", kind="head"),
        profiles={**profiles, "draft": {"cpu": given(CPU, DRAFT_PARAMS)}})
  with pytest.raises(ValueError, match="kind must be one of"):
    DrafterSpec(name="draft", kind="medusa-ish")
  bad = tmp_path / "bad.json"
  bad.write_text('{"format": "something else"}')
  with pytest.raises(ValueError, match="not a jaxspec profile file"):
    load_profiles(bad)


def test_plan_becomes_a_placement():
  target_on = {"npu0": (NPU, TARGET_PARAMS)}
  profiles = {"target": {"npu0": given(NPU, TARGET_PARAMS)},
              "draft": {"npu0": given(NPU, DRAFT_PARAMS), "cpu": given(CPU, DRAFT_PARAMS)}}
  p = plan("target", "draft", DEVICES, profiles, 0.8, links=link_profiles(LINKS))
  assert (p.target_group, p.drafter_group) == ("npu0", "cpu") and target_on
  devs = jax.devices()
  placement = p.placement({"npu0": devs[:2], "cpu": [devs[2]]})
  assert not placement.fused
  assert [d.id for d in placement.target.devices.flat] == [devs[0].id, devs[1].id]
  assert [d.id for d in placement.drafter.devices.flat] == [devs[2].id]
  with pytest.raises(ValueError, match="no devices given for group 'cpu'"):
    p.placement({"npu0": devs[:2]})


def test_a_head_across_groups_pays_for_the_hidden_states():
  profiles = {"target": {"npu0": given(NPU, TARGET_PARAMS)},
              "head": {"npu0": ModelProfile.per_token(3e-3), "cpu": ModelProfile.per_token(1e-4)}}
  fused_only = plan("target", DrafterSpec(name="head", kind="head", vocab_size=V), DEVICES,
                    profiles, 0.7, links=link_profiles(LINKS))
  assert all(c.drafter_group in (None, "npu0") for c in fused_only.candidates)
  spec = DrafterSpec(name="head", kind="head", vocab_size=V, hidden_size=1024, feature_layers=4)
  p = plan("target", spec, DEVICES, profiles, 0.7, links=link_profiles(LINKS))
  lat, bw = LINKS[("npu0", "cpu")]
  for c in p.candidates:
    if c.drafter_group == "cpu":
      k = c.k
      sent = k * 4 + k * V * 4
      back = (k + 1) * 4 + (k + 1) * 1024 * 4 * 4
      assert c.transfer_s == pytest.approx(2 * lat + (sent + back) / bw, rel=1e-9)
  assert any(c.drafter_group == "cpu" for c in p.candidates)
