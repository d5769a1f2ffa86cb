"""Plain decoding: greedy reference, ragged batches, stop tokens, sampling, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.api import generate, generate_stream
from jaxspec.models import forward, init_cache
from jaxspec.sampling import Sampling

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12], [3, 4, 5, 3, 4, 5, 3, 4, 5, 3], [7]]


_full_forward = jax.jit(lambda params, toks, cfg: forward(params, toks, init_cache(cfg, 1, 32), cfg)[0],
                        static_argnums=2)


def _naive_greedy(model, prompt, n):
  """Greedy decoding by a full forward over the whole sequence at every step (no cache reuse);
  the sequence is right-padded to a fixed 32 so one compilation serves every step."""
  seq = list(prompt)
  for _ in range(n):
    toks = jnp.array([seq + [0] * (32 - len(seq))])
    seq.append(int(_full_forward(model.params, toks, model.cfg)[0, len(seq) - 1].argmax()))
  return seq[len(prompt):]


def test_greedy_matches_naive_loop_and_rows_alone(tiny_target):
  out = generate(tiny_target, PROMPTS, max_new_tokens=12, stop_ids=())
  assert out.tokens.shape == (4, 12)
  np.testing.assert_array_equal(out.lengths, 12)
  for i, p in enumerate(PROMPTS):
    assert out.row(i) == _naive_greedy(tiny_target, p, 12)
    alone = generate(tiny_target, [p], max_new_tokens=12, stop_ids=())
    assert alone.row(0) == out.row(i)


def test_stop_token_ends_row_and_is_kept(tiny_target):
  ref = generate(tiny_target, PROMPTS, max_new_tokens=12, stop_ids=())
  stop = int(ref.tokens[0, 4])
  out = generate(tiny_target, PROMPTS, max_new_tokens=12, stop_ids=[stop])
  first = list(ref.tokens[0]).index(stop)
  assert out.row(0) == ref.row(0)[:first + 1]
  assert (out.tokens[0, first + 1:] == -1).all()
  for i in range(4):  # every row stops at its own first stop token, or runs to the end
    r = ref.row(i)
    n = r.index(stop) + 1 if stop in r else 12
    assert out.row(i) == r[:n]


def test_sampling_values_do_not_recompile(tiny_target):
  # Values are arrays: a new temperature, or new filter values, run the program compiled for the
  # old ones. Filtering or not is static (`SamplingArrays.unfiltered`): one program each.
  a = generate(tiny_target, PROMPTS, max_new_tokens=8, sampling=Sampling(temperature=1.0), key=3)
  b = generate(tiny_target, PROMPTS, max_new_tokens=8, sampling=Sampling(temperature=0.5), key=3)
  assert b.stats["compile_seconds"] == 0.0
  assert not np.array_equal(a.tokens, b.tokens)
  f = generate(tiny_target, PROMPTS, max_new_tokens=8,
               sampling=Sampling(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1), key=3)
  assert f.stats["compile_seconds"] > 0.0
  g = generate(tiny_target, PROMPTS, max_new_tokens=8,
               sampling=Sampling(temperature=0.8, top_k=5, top_p=0.95), key=3)
  assert g.stats["compile_seconds"] == 0.0
  assert not np.array_equal(f.tokens, g.tokens)
  c = generate(tiny_target, PROMPTS, max_new_tokens=8, sampling=Sampling(temperature=1.0), key=3)
  np.testing.assert_array_equal(a.tokens, c.tokens)  # same key, same tokens
  assert c.stats["compile_seconds"] == 0.0


def test_top_k_one_is_greedy(tiny_target):
  # 12 tokens without stop ids: the program test_greedy_matches_naive_loop_and_rows_alone compiled.
  g = generate(tiny_target, PROMPTS, max_new_tokens=12, stop_ids=())
  s = generate(tiny_target, PROMPTS, max_new_tokens=12, sampling=Sampling(temperature=2.0, top_k=1),
               key=5, stop_ids=())
  np.testing.assert_array_equal(g.tokens, s.tokens)


def test_stream_yields_the_same_tokens(tiny_target):
  ref = generate(tiny_target, PROMPTS[:1], max_new_tokens=15, stop_ids=())
  got = []
  for new, _ in generate_stream(tiny_target, PROMPTS[:1], max_new_tokens=15, stop_ids=(), chunk=4):
    got += new[0]
  assert got == ref.row(0)


@pytest.mark.parametrize("kw,match", [
    (dict(prompts=[[]]), "empty"),
    (dict(prompts=[list(range(50))], max_len=64, max_new_tokens=20), "does not fit"),
    (dict(prompts=[[1, 2, 999]]), "outside the vocabulary"),
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(temperature=-1.0), "temperature"),
    (dict(prompts=["text"]), "no tokenizer"),
])
def test_bad_input(tiny_target, kw, match):
  args = dict(prompts=PROMPTS, max_new_tokens=4)
  args.update(kw)
  with pytest.raises(ValueError, match=match):
    generate(tiny_target, args.pop("prompts"), **args)


def test_compiled_programs_are_released_near_the_map_limit(tiny_target, monkeypatch):
  """Past MAP_PRESSURE of vm.max_map_count the least recently used programs go before the next
  compile (a long session recompiles instead of failing in LLVM); what they computed is kept."""
  from jaxspec.engine import DEFAULT, core as gen
  gen.release_compiled()
  # A fake process: 10,000 mappings per kept program against a limit at which the pressure
  # starts at 4 programs (MAP_PRESSURE x limit = 35,000).
  limit = round(35_000 / gen.MAP_PRESSURE)
  monkeypatch.setattr(gen, "map_usage", lambda: (10_000 * len(DEFAULT.programs), limit))
  # New-token counts in four buckets (`io.bucket_new_tokens`): four programs.
  firsts = [generate(tiny_target, PROMPTS[:1], max_new_tokens=n, stop_ids=())
            for n in (3, 20, 40, 70)]
  assert len(DEFAULT.programs) == 4 and all(o.stats["compile_seconds"] > 0 for o in firsts)
  first_key = next(iter(DEFAULT.programs))
  again = generate(tiny_target, PROMPTS[:1], max_new_tokens=3, stop_ids=())  # a hit: most recent now
  assert again.stats["compile_seconds"] == 0.0 and next(iter(DEFAULT.programs)) != first_key
  monkeypatch.setattr(DEFAULT, "warned_release", False)  # the first release in a process says so
  with pytest.warns(RuntimeWarning, match="released 2 compiled programs"):
    fresh = generate(tiny_target, PROMPTS[:1], max_new_tokens=150, stop_ids=())  # 4 -> 2 + 1
  assert len(DEFAULT.programs) == 3 and first_key in DEFAULT.programs  # n=3 was used last: kept
  again = generate(tiny_target, PROMPTS[:1], max_new_tokens=20, stop_ids=())  # released: compiles
  assert again.stats["compile_seconds"] > 0 and again.row(0) == firsts[1].row(0)
  assert fresh.row(0)[:70] == firsts[3].row(0)
  # Mappings that releasing cannot lower (held elsewhere): compile anyway, with a warning.
  monkeypatch.setattr(gen, "map_usage", lambda: (limit, limit))
  with pytest.warns(RuntimeWarning, match=f"vm.max_map_count={limit}"):
    generate(tiny_target, PROMPTS[:1], max_new_tokens=300, stop_ids=())
  assert len(DEFAULT.programs) == 1


def test_cache_buffers_are_reused_and_stale_entries_never_read(tiny_target, garbage_cache_pool):
  """A call prefills into the previous call's cache buffers (donated, not copied); what they
  held beyond each row's length never changes a token, greedy or sampled."""
  from jaxspec.engine import DEFAULT, release_cache_buffers
  from jaxspec.engine.io import prepare_prompts
  ml = prepare_prompts(tiny_target, PROMPTS, 12).max_len
  release_cache_buffers()
  kw = dict(max_new_tokens=12, stop_ids=())
  hot = dict(sampling=Sampling(temperature=1.0), key=3)
  greedy = generate(tiny_target, PROMPTS, **kw)
  sampled = generate(tiny_target, PROMPTS, **hot, **kw)
  kept = garbage_cache_pool(tiny_target, len(PROMPTS), ml, seed=1)
  np.testing.assert_array_equal(generate(tiny_target, PROMPTS, **kw).tokens, greedy.tokens)
  assert all(a.is_deleted() for a in kept)  # donated to the call, not copied
  garbage_cache_pool(tiny_target, len(PROMPTS), ml, seed=2)
  np.testing.assert_array_equal(generate(tiny_target, PROMPTS, **hot, **kw).tokens,
                                sampled.tokens)
  # The call kept its cache for the next call of its shapes; a call of other shapes drops it.
  (key, (k, _)), = DEFAULT.buffers.items()
  cfg = tiny_target.cfg
  assert k.shape == (cfg.num_layers, len(PROMPTS), cfg.num_kv_heads, ml, cfg.head_dim)
  generate(tiny_target, PROMPTS[:1], **kw)
  assert key not in DEFAULT.buffers and len(DEFAULT.buffers) == 1
  assert release_cache_buffers() > 0 and not DEFAULT.buffers


def test_integer_seeds_over_the_whole_documented_range(tiny_target):
  """Seeds in [2**63, 2**64) are accepted (as their int64 two's complement), not an
  OverflowError from jax.random.key."""
  kw = dict(max_new_tokens=4, stop_ids=(), temperature=1.0)
  top = generate(tiny_target, PROMPTS[:2], key=2**64 - 1, **kw)
  np.testing.assert_array_equal(top.tokens, generate(tiny_target, PROMPTS[:2], key=-1, **kw).tokens)
  generate(tiny_target, PROMPTS[:2], key=2**63, **kw)
  # Past 32 bits every seed has its own key (jax.random.key keeps only the low word without
  # jax_enable_x64, so 2**40 drew as 0 did).
  from jaxspec.decoding.functional import as_key
  data = {s: tuple(np.asarray(jax.random.key_data(as_key(s))).tolist())
          for s in (0, 1, -1, 2**32, 2**40, 2**40 + 1, -2**40, 2**63, 2**64 - 2)}
  assert len(set(data.values())) == len(data)
  assert data[0] == (0, 0) and data[1] == (0, 1)  # in 32 bits: jax.random.key's own keys


def test_an_engine_holds_its_own_programs_buffers_and_compiler_options(tiny_target):
  """Everything kept between calls belongs to one `Engine`: a fresh one compiles and keeps its
  own programs and cache buffers (the default engine's are not touched), gives the default
  engine's tokens, passes its compiler options to XLA, and `reset` leaves nothing kept."""
  from jaxspec import NGram, speculative_generate
  from jaxspec.engine import DEFAULT, Engine
  kw = dict(max_new_tokens=5, stop_ids=())
  ref = generate(tiny_target, PROMPTS, **kw)
  spec_ref = speculative_generate(tiny_target, NGram(), PROMPTS, num_draft_tokens=2, **kw)
  programs, buffers = list(DEFAULT.programs.values()), list(DEFAULT.buffers.values())
  engine = Engine()
  out = engine.generate(tiny_target, PROMPTS, **kw)
  spec = engine.speculative_generate(tiny_target, NGram(), PROMPTS, num_draft_tokens=2, **kw)
  np.testing.assert_array_equal(out.tokens, ref.tokens)
  np.testing.assert_array_equal(spec.tokens, spec_ref.tokens)
  assert out.stats["compile_seconds"] > 0  # compiled again: nothing shared with the default
  assert len(engine.programs) == 3 and len(engine.buffers) == 1  # generate, spec init + loop
  assert not {id(p) for p in engine.programs.values()} & {id(p) for p in programs}
  assert list(DEFAULT.programs.values()) == programs and list(DEFAULT.buffers.values()) == buffers
  bad = Engine(compiler_options={jax.default_backend(): {"no_such_xla_option": 1}})
  with pytest.raises(jax.errors.JaxRuntimeError, match="No such compile option: 'no_such_xla_option'"):
    bad.generate(tiny_target, PROMPTS, **kw)
  engine.reset()
  assert not engine.programs and not engine.buffers and DEFAULT.programs


def test_a_cpu_call_traces_no_gpu_or_tpu_kernel(monkeypatch):
  """On CPU devices the engine traces "auto" attention as XLA's read (`Model.program_cfg`): the
  Pallas kernels, which `lax.platform_dependent` would trace and never lower there, are not
  entered. (A 1-layer model of its own, so no program of another test is reused untraced.)"""
  from jaxspec.api import speculative_generate
  from jaxspec.drafters import NGram
  from jaxspec.models import attention_kernels, init_params, tiny_config
  from jaxspec.models.model import Model

  def refuse(*args, **kwargs):
    raise AssertionError("a GPU/TPU attention kernel was traced for a CPU call")

  monkeypatch.setattr(attention_kernels, "cached_attention", refuse)
  cfg = tiny_config(num_layers=1)
  assert cfg.attention_kernel == "auto"
  model = Model(cfg, init_params(cfg, jax.random.key(3), scale=0.2), name="one-layer")
  assert model.program_cfg().attention_kernel == "xla"
  plain = generate(model, PROMPTS[:2], max_new_tokens=8, stop_ids=())
  spec = speculative_generate(model, NGram(), PROMPTS[:2], max_new_tokens=8, stop_ids=(),
                              num_draft_tokens=4)
  np.testing.assert_array_equal(spec.tokens, plain.tokens)


def test_the_same_model_on_another_device_runs_there(tiny_target):
  """A model's weights copied to a second device: programs and kept cache buffers are keyed by
  device, so the copy compiles its own, runs there, and the first device's calls still run
  (JAX refused the device-0 program for device-1 weights: 'compiled for input shardings that
  disagree')."""
  from jaxspec.api import speculative_generate
  from jaxspec.drafters import NGram
  from jaxspec.models.model import Model
  dev1 = jax.devices()[1]
  moved = Model(tiny_target.cfg, jax.device_put(tiny_target.params, dev1), name="tiny-dev1")
  prompts = [[5, 6, 7, 5, 6, 7, 5], [9, 3]]
  plain = [generate(m, prompts, max_new_tokens=8, stop_ids=()) for m in
           (tiny_target, moved, tiny_target)]
  spec = [speculative_generate(m, NGram(), prompts, max_new_tokens=8, num_draft_tokens=2)
          for m in (tiny_target, moved, tiny_target)]
  for outs in (plain, spec):
    for out in outs[1:]:
      np.testing.assert_array_equal(out.tokens, outs[0].tokens)
  assert sum(spec[0].stats["drafted_per_row"]) > 0
  np.testing.assert_array_equal(spec[0].tokens, plain[0].tokens)
