"""Sharding and placement on 8 simulated CPU devices: a 4-way tensor x 2-way data parallel
target gives the unsharded tokens; vocab-parallel verification gathers no full logits; a drafter
on its own sub-mesh (host-orchestrated loop) gives the fused loop's tokens and the exact
distribution; a drafter that fails mid-generation degrades to plain decoding, keeping every
token; bad placements fail with clear errors before anything compiles."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import AutoK, DraftModel, NGram, Sampling, generate, speculative_generate
from jaxspec.engine import DEFAULT
from jaxspec.models import init_params, quantize, tiny_config
from jaxspec.models.model import Model
from jaxspec.sharding import Placement, make_mesh, multihost, shard_model, submesh
from helpers import assert_first_tokens_follow, exact_joint

PROMPTS = multihost.DEMO_PROMPTS
N_NEW = 16


@pytest.fixture(scope="module")
def target():
  return multihost.tiny_demo_model()  # 8 query / 4 key-value heads: "model" = 4 divides both


@pytest.fixture(scope="module")
def draft():
  cfg = tiny_config(num_heads=8, num_kv_heads=4, head_dim=8, vocab_size=256, num_layers=1)
  return Model(cfg, init_params(cfg, jax.random.key(3), scale=0.2), name="tp-draft")


@pytest.fixture(scope="module")
def reference(target):
  return generate(target, PROMPTS, max_new_tokens=N_NEW, stop_ids=())


@pytest.fixture(scope="module")
def sharded(target):
  return shard_model(target, make_mesh({"data": 2, "model": 4}))


def test_tensor_and_data_parallel_equals_unsharded(target, draft, sharded, reference):
  wq = sharded.params.layers.wq
  assert wq.sharding.spec == jax.sharding.PartitionSpec(None, None, "model", None)
  assert len(wq.addressable_shards) == 8 and wq.addressable_shards[0].data.shape[2] == 2
  out = generate(sharded, PROMPTS, max_new_tokens=N_NEW, stop_ids=())
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  for drafter in (NGram(), DraftModel(draft)):
    spec = speculative_generate(sharded, drafter, PROMPTS, max_new_tokens=N_NEW,
                                num_draft_tokens=3, stop_ids=())
    np.testing.assert_array_equal(spec.tokens, reference.tokens, err_msg=drafter.name)
    assert spec.stats["drafted_per_row"] != [0] * len(PROMPTS)  # drafts were verified
  # The draft model was laid out on the target's mesh too (tensor-parallel over 4 devices).
  placed = DEFAULT.place_drafter_params(sharded, DraftModel(draft))
  assert placed.layers.wq.sharding.spec[2] == "model"


def test_unrolled_layers_shard_per_layer(target, reference):
  """An unrolled target (one set of weights per layer, jaxspec.load's CPU default) shards each
  layer by the same rules, without the layer axis, and gives the same tokens."""
  un = shard_model(target.with_scan_layers(False), make_mesh({"data": 2, "model": 4}))
  assert not un.scan_layers
  wq = un.params.layers[1].wq
  assert wq.sharding.spec == jax.sharding.PartitionSpec(None, "model", None)
  assert wq.addressable_shards[0].data.shape[1] == 2
  out = generate(un, PROMPTS, max_new_tokens=N_NEW, stop_ids=())
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  spec = speculative_generate(un, NGram(), PROMPTS, max_new_tokens=N_NEW, num_draft_tokens=3,
                              stop_ids=())
  np.testing.assert_array_equal(spec.tokens, reference.tokens)


def _all_gathers(hlo: str):
  """(shape, op name) of every all-gather in an HLO text."""
  out = []
  for line in hlo.splitlines():
    m = re.search(r"= (\w+\[[\d,]*\])\S* all-gather\(", line)
    if m:
      op = re.search(r'op_name="([^"]*)"', line)
      out.append((m.group(1), op.group(1) if op else ""))
  return out


def test_vocab_parallel_verify_gathers_no_full_logits(target, sharded):
  # The same call as above: its compiled loop is reused, not compiled again.
  speculative_generate(sharded, NGram(), PROMPTS, max_new_tokens=N_NEW, num_draft_tokens=3,
                       stop_ids=())
  loops = [exe for sig, exe in DEFAULT.programs.items()
           if isinstance(sig, tuple) and isinstance(sig[1], tuple) and sig[1][0] == "spec-loop"
           and sig[1][1] == sharded.sharding]
  assert loops, "the sharded loop was not compiled through the mesh path"
  v = target.cfg.vocab_size
  gathers = _all_gathers(loops[-1].as_text())
  assert gathers  # the argmax and acceptance do cross shards: as small per-shard partials
  full = [(shape, op) for shape, op in gathers if re.search(rf"[\[,]{v}[\],]", shape)]
  # Only top-k / top-p need the whole vocabulary (they sort it); greedy verification and
  # acceptance reduce per shard.
  assert all("sort" in op or "cumsum" in op for _, op in full), full
  assert any(re.search(r"[\[,]4[\],]", s) for s, _ in gathers)  # [.., 4 shards] partials


@pytest.fixture(scope="module")
def placement():
  devs = jax.devices()
  return Placement(target=make_mesh({"data": 1, "model": 4}, devices=devs[:4]),
                   drafter=[devs[4]])


@pytest.mark.slow  # a drafter on its own mesh: test_head_drafter_across_meshes_equals_fused
def test_drafter_on_its_own_submesh_equals_fused(target, placement, reference):
  """Self-speculation across meshes: an int8 copy of the target drafts on its own device."""
  assert not placement.fused
  int8 = dataclasses.replace(placement, drafter_precision="int8")
  for drafter, k, pl in ((DraftModel(target), 3, int8), (NGram(), "auto", placement)):
    # "auto" times each k through the host loop itself (two buckets keep the compile short).
    host = speculative_generate(target, drafter, PROMPTS, max_new_tokens=N_NEW,
                                num_draft_tokens=k, stop_ids=(), placement=pl,
                                auto=AutoK(k_max=2) if k == "auto" else None)
    np.testing.assert_array_equal(host.tokens, reference.tokens, err_msg=drafter.name)
    assert host.stats["placement"]["mode"] == "host"
    assert host.stats["placement"]["drafter"] == [str(jax.devices()[4])]
    assert host.stats["failover"] is None
    if k == "auto":
      assert host.stats["cost_model"].ks == (0, 1, 2)
    else:  # a fixed k: the same steps as the fused loop, so the same statistics
      fused = speculative_generate(target, DraftModel(quantize(target, "int8")), PROMPTS,
                                   max_new_tokens=N_NEW, num_draft_tokens=k, stop_ids=())
      for key in ("target_passes", "accepted_per_row", "drafted_per_row", "tau"):
        assert host.stats[key] == fused.stats[key], key
      assert 0 < host.stats["acceptance_rate"] < 1
  # The same mesh for both: the fused loop (tested sharded above) runs there.
  same = Placement(target=placement.target, drafter=placement.target)
  assert same.fused
  assert Placement(target=placement.target).fused


def test_head_drafter_across_meshes_equals_fused(target, placement, reference):
  """An EAGLE head reads the target's hidden states: they travel to the drafter's mesh."""
  from flax import nnx

  from jaxspec import heads
  head = heads.HEADS["eagle"].create(target.cfg, rngs=nnx.Rngs(0))
  drafter = heads.HEADS["eagle"].drafter(head, target)
  host = speculative_generate(target, drafter, PROMPTS[:2], max_new_tokens=N_NEW,
                              num_draft_tokens=2, stop_ids=(), placement=placement)
  np.testing.assert_array_equal(host.tokens, reference.tokens[:2])
  assert host.stats["placement"]["mode"] == "host" and sum(host.stats["drafted_per_row"]) > 0


def test_log_probabilities_across_meshes(target, placement):
  """logprobs=True through the two-mesh loop: the target's log-probability of every emitted
  token, as plain decoding computes it (greedy: the same tokens)."""
  host = speculative_generate(target, NGram(), PROMPTS[:2], max_new_tokens=N_NEW,
                              num_draft_tokens=2, stop_ids=(), placement=placement,
                              logprobs=True)
  plain = generate(target, PROMPTS[:2], max_new_tokens=N_NEW, stop_ids=(), logprobs=True)
  assert host.stats["placement"]["mode"] == "host"
  np.testing.assert_array_equal(host.tokens, plain.tokens)
  np.testing.assert_allclose(host.logprobs, plain.logprobs, atol=1e-5)
  assert (host.logprobs < 0).all()


def test_host_orchestrated_sampling_is_exact():
  """Chi-square of the first three sampled tokens against the target's exact joint, with the
  draft model on its own device and the target on two others."""
  t_cfg = tiny_config(vocab_size=8, eos_token_ids=())
  tgt = Model(t_cfg, init_params(t_cfg, jax.random.key(11), scale=0.6))
  d_cfg = tiny_config(vocab_size=8, num_layers=1, eos_token_ids=())
  drf = Model(d_cfg, init_params(d_cfg, jax.random.key(37), scale=0.6))  # as small_vocab
  devs = jax.devices()
  pl = Placement(target=submesh([devs[5], devs[6]]), drafter=[devs[7]])
  sp = Sampling(temperature=0.9, top_k=6, top_p=0.9)
  prompt = [1, 2, 3, 4]
  n = 2000
  out = speculative_generate(tgt, DraftModel(drf), [prompt] * n, max_new_tokens=3, sampling=sp,
                             num_draft_tokens=2, key=99, placement=pl)
  assert out.stats["placement"]["mode"] == "host"
  assert_first_tokens_follow(out.tokens[:, :3], exact_joint(tgt, prompt, sp))
  assert 0.05 < out.stats["acceptance_rate"] < 0.9  # both paths of the rejection rule ran


# A drafter whose device "fails" at its third proposal: the error comes from inside its
# computation (a host callback raising at run time), as a device fault or OOM would.
_CALLS = {"n": 0}


@dataclasses.dataclass(frozen=True)
class _FailingNGram(NGram):
  fail_at: int = 3
  name: str = "failing-ngram"

  def propose(self, params, state, ctx, k, sp, keys):
    prop, state = super().propose(params, state, ctx, k, sp, keys)

    def tick(_):
      _CALLS["n"] += 1
      if _CALLS["n"] >= self.fail_at:
        raise RuntimeError("injected fault: drafter device lost")
      return np.int32(0)

    z = jax.pure_callback(tick, jax.ShapeDtypeStruct((), jnp.int32), ctx.seq_len)
    return dataclasses.replace(prop, tokens=prop.tokens + z), state


def test_failover_to_plain_decoding_keeps_every_token(target, placement, reference):
  _CALLS["n"] = 0
  out = speculative_generate(target, _FailingNGram(), PROMPTS, max_new_tokens=N_NEW,
                             num_draft_tokens=3, stop_ids=(), placement=placement)
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  fo = out.stats["failover"]
  assert fo is not None and fo["step"] == 2 and "injected fault" in fo["error"], fo
  assert fo["action"] == "plain target decoding"
  hist = out.stats["k_per_step"]
  assert all(k == 0 for k in hist[fo["step"]:])  # plain steps after the fault
  assert _CALLS["n"] >= 3
  jax.effects_barrier()  # the handled fault is not raised again here (nor at interpreter exit)


def test_failover_while_timing_auto_keeps_every_token(target, placement, reference):
  """With "auto" and no cost model the loop is timed first; a drafter that fails then falls
  back to plain steps instead of raising out of speculative_generate."""
  _CALLS["n"] = 0
  out = speculative_generate(target, _FailingNGram(fail_at=1), PROMPTS, max_new_tokens=N_NEW,
                             num_draft_tokens="auto", stop_ids=(), placement=placement)
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  assert out.stats["failover"] is not None and "injected fault" in out.stats["failover"]["error"]
  jax.effects_barrier()
  # Those timings were of plain steps: not kept, so the next call of these shapes (the drafter
  # working now) measures its own instead of reading them from the engine or the disk.
  _CALLS["n"] = -10**9
  again = speculative_generate(target, _FailingNGram(fail_at=1), PROMPTS, max_new_tokens=N_NEW,
                               num_draft_tokens="auto", stop_ids=(), placement=placement)
  assert again.stats["failover"] is None and again.stats["cost_source"] == "measured"
  jax.effects_barrier()


def test_failover_when_the_commit_fails_to_dispatch(target, placement, reference, monkeypatch):
  """A commit that fails as it is dispatched (not inside its computation): the verified
  tokens are kept and the rest of the generation runs plain steps."""
  from jaxspec.engine import runs
  init = runs.HostRun.__init__
  calls = {"n": 0}

  def patched(self, *a, **kw):
    init(self, *a, **kw)
    exe = self.commit_exe

    def commit(*args):
      calls["n"] += 1
      if calls["n"] >= 3:
        raise RuntimeError("injected fault: commit dispatch failed")
      return exe(*args)
    self.commit_exe = commit

  monkeypatch.setattr(runs.HostRun, "__init__", patched)
  out = speculative_generate(target, NGram(), PROMPTS, max_new_tokens=N_NEW, num_draft_tokens=3,
                             stop_ids=(), placement=placement)
  np.testing.assert_array_equal(out.tokens, reference.tokens)
  fo = out.stats["failover"]
  assert fo is not None and "commit dispatch" in fo["error"], fo
  assert any(k > 0 for k in out.stats["k_per_step"][:fo["step"]])


def test_coupled_drafter_across_meshes_gives_generates_text(target, draft, placement):
  """The host-orchestrated loop hands the drafter its copy of the row keys: a coupled draft
  model on its own device gives `generate`'s sampled text for the key."""
  sp = Sampling(temperature=1.0, top_k=40)
  ref = generate(target, PROMPTS, max_new_tokens=N_NEW, sampling=sp, key=9, stop_ids=())
  out = speculative_generate(target, DraftModel(draft, coupled=True), PROMPTS,
                             max_new_tokens=N_NEW, sampling=sp, key=9, num_draft_tokens=2,
                             stop_ids=(), placement=placement)
  assert out.stats["placement"]["mode"] == "host"
  np.testing.assert_array_equal(out.tokens, ref.tokens)


def test_bad_placements_fail_clearly(target, draft):
  with pytest.raises(ValueError, match="device index 99"):
    Placement(target=[0, 1], drafter=[99])
  with pytest.raises(ValueError, match="not a device"):
    make_mesh({"model": 1}, devices=["gpu:0"])
  with pytest.raises(ValueError, match="needs 16 devices"):
    make_mesh({"data": 4, "model": 4})
  narrow = Model(tiny_config(), init_params(tiny_config(), jax.random.key(0)))  # 2 kv heads
  with pytest.raises(ValueError, match="'model' axis of size 4 does not divide 2 key/value"):
    shard_model(narrow, make_mesh({"data": 2, "model": 4}))
  sharded = shard_model(target, make_mesh({"data": 2, "model": 4}))
  with pytest.raises(ValueError, match="batch of 3 rows does not divide .* size 2"):
    generate(sharded, PROMPTS[:3], max_new_tokens=4)
  with pytest.raises(ValueError, match="batch of 3 rows does not divide"):
    speculative_generate(sharded, NGram(), PROMPTS[:3], max_new_tokens=4, num_draft_tokens=2)
  with pytest.raises(ValueError, match="must be a jaxspec.sharding.Placement"):
    speculative_generate(target, NGram(), PROMPTS, max_new_tokens=4, num_draft_tokens=2,
                         placement="gpu")
  with pytest.raises(ValueError, match="drafter_precision"):
    Placement(target=[0], drafter=[1], drafter_precision="int4")


def test_sharded_checkpoint_load_checks_the_mesh_first(tmp_path, target):
  from jaxspec.models.hf_loader import save_hf
  save_hf(target, tmp_path / "ok")
  model = jaxspec.load(tmp_path / "ok", mesh=make_mesh({"data": 2, "model": 4}))
  assert model.sharding is not None and model.params.embed.sharding.spec[0] == "model"
  cfg = tiny_config(num_heads=6, num_kv_heads=3, head_dim=8)
  save_hf(Model(cfg, init_params(cfg, jax.random.key(1))), tmp_path / "odd")
  (tmp_path / "odd" / "model.safetensors").write_bytes(b"not read: the config fails first")
  with pytest.raises(ValueError, match="does not divide 6 attention heads"):
    jaxspec.load(tmp_path / "odd", mesh=make_mesh({"data": 2, "model": 4}))
