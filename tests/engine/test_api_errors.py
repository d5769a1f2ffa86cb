"""Bad API calls are `ValueError`s naming the argument, raised before anything compiles: a fixed
list of the calls issue 50 found, and a seeded fuzz of mutated good calls.

The compiled programs' entry points are replaced by a stub that raises `Reached`: a call that
gets past the checks ends there (a valid call, for the fuzz; a missed check, for the fixed
list), so nothing is compiled and the whole module runs in seconds."""

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import AutoK, DraftModel, NGram, Sampling, generate, speculative_generate
from jaxspec.decoding.adaptive import CostModel
from jaxspec.api import generate_stream, speculative_stream
from jaxspec.decoding import decode, functional, speculative_decode
from jaxspec.sampling import row_keys


class Reached(Exception):
  """A call reached a compiled program: its arguments passed every check."""


@pytest.fixture
def no_programs(monkeypatch):
  """Every compiled program of the wrappers and the functional core (their jitted entry
  points and the wrappers' compile cache) raises `Reached` instead of compiling."""
  from jaxspec.engine import Engine

  def reached(*a, **kw):
    raise Reached()
  for mod, name in ((functional, "_speculative_jit"), (functional, "_decode_jit"),
                    (Engine, "compile")):
    monkeypatch.setattr(mod, name, reached)


def _arrays(rows):
  ids = jnp.asarray([r + [0] * (6 - len(r)) for r in rows], jnp.int32)
  return ids, jnp.asarray([len(r) for r in rows], jnp.int32)


PROMPTS = [[5, 6, 7, 5], [9, 10]]


def _good_arrays(b=2):
  return Sampling(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05).arrays(b)


def _with(sp, **fields):
  return dataclasses.replace(sp, **{k: jnp.asarray(v) for k, v in fields.items()})


def _fixed_cases(target, draft):
  ids, lens = _arrays(PROMPTS)
  sp = _good_arrays()
  dec = lambda **kw: decode(target, ids, lens, 0, max_new_tokens=4, **kw)
  spec = lambda **kw: speculative_decode(target, DraftModel(draft), ids, lens, 0,
                                         max_new_tokens=4, num_draft_tokens=2, **kw)
  gen = lambda prompts, **kw: jaxspec.generate(target, prompts, max_new_tokens=4, **kw)
  sgen = lambda prompts, **kw: jaxspec.speculative_generate(target, NGram(), prompts,
                                                            max_new_tokens=4, **kw)
  other = draft.params
  return [
      ("SamplingArrays.temperature", lambda: dec(sampling=_with(sp, temperature=[0.7, np.nan]))),
      ("SamplingArrays.temperature", lambda: dec(sampling=_with(sp, temperature=[-1.0, 0.7]))),
      ("SamplingArrays.temperature", lambda: spec(sampling=_with(sp, temperature=[np.inf, 1.]))),
      ("SamplingArrays.top_k", lambda: dec(sampling=_with(sp, top_k=[5, -1]))),
      ("SamplingArrays.top_p", lambda: spec(sampling=_with(sp, top_p=[np.nan, 0.9]))),
      ("SamplingArrays.min_p", lambda: dec(sampling=_with(sp, min_p=[2.0, 0.0]))),
      ("SamplingArrays.all_greedy",
       lambda: spec(sampling=dataclasses.replace(sp, all_greedy=True))),
      ("SamplingArrays.unfiltered",
       lambda: dec(sampling=dataclasses.replace(sp, unfiltered=True))),
      ("prompt 0", lambda: gen([[1.5, 2.7]])),
      ("prompt 0", lambda: sgen([[None]])),
      ("prompt 1", lambda: gen([[1, 2], [None]])),
      ("prompt 0", lambda: gen([[1, 2**70]])),
      ("pad_id", lambda: dec(pad_id=2.5)),
      ("pad_id", lambda: spec(pad_id=2**40)),
      ("pad_id", lambda: dec(pad_id=True)),
      ("drafter_params", lambda: spec(drafter_params={"embed": other.embed})),
      ("drafter_params", lambda: spec(drafter_params=target.params)),
      ("drafter_params", lambda: spec(drafter_params=[])),
      ("p_min", lambda: DraftModel(draft, p_min="0.5")),
      ("p_min", lambda: DraftModel(draft, p_min=float("nan"))),
      ("key holds 3 per-row keys for a batch of 2 rows",
       lambda: decode(target, ids, lens, row_keys(jax.random.key(0), 3), max_new_tokens=4)),
      ("key holds 1 per-row keys for a batch of 2 rows",
       lambda: gen(PROMPTS, key=row_keys(jax.random.key(0), 1))),
      ("key must be an integer seed", lambda: decode(target, ids, lens, "seed",
                                                     max_new_tokens=4)),
      ("sampling has unknown fields ['temp']", lambda: gen(PROMPTS, sampling={"temp": 1.0})),
      ("top_k", lambda: dec(sampling=Sampling(top_k=jnp.asarray(2.5)))),
  ]


def test_each_bad_call_of_issue_50_is_a_value_error_naming_its_argument(tiny_target,
                                                                        poor_draft,
                                                                        no_programs):
  for what, call in _fixed_cases(tiny_target, poor_draft):
    with pytest.raises(ValueError) as e:
      call()
    assert what in str(e.value), (what, str(e.value))


def test_good_calls_reach_the_program(tiny_target, poor_draft, no_programs):
  """The stub is reached by valid calls: the fuzz's "valid" outcome is a real one."""
  ids, lens = _arrays(PROMPTS)
  for call in (lambda: decode(tiny_target, ids, lens, 0, max_new_tokens=4,
                              sampling=_good_arrays()),
               lambda: speculative_decode(tiny_target, DraftModel(poor_draft), ids, lens,
                                          row_keys(jax.random.key(1), 2), max_new_tokens=4,
                                          num_draft_tokens=2,
                                          drafter_params=poor_draft.params, pad_id=-1),
               lambda: jaxspec.generate(tiny_target, PROMPTS, max_new_tokens=4),
               lambda: jaxspec.speculative_generate(tiny_target, NGram(), PROMPTS,
                                                    max_new_tokens=4, num_draft_tokens=2)):
    with pytest.raises(Reached):
      call()


# Values a mutation puts in place of a good argument: wrong types, out-of-range numbers,
# non-finite floats, arrays of the wrong rank, dtype or length.
_POOL = [None, True, -1, 0, 1, 2.5, 2**31, 2**40, -2**63 - 1, float("nan"), float("inf"),
         -0.5, 1.5, "x", "0.5", b"1", [], [None], [[None]], [[1.5, 2.7]], {}, {"a": 1},
         (1, 2), object()]


def _pool_arrays(b):
  return [np.zeros((b,), np.float32), np.zeros((b, 3), np.int32), np.full((b,), np.nan),
          jnp.ones((b + 1,), jnp.int32), jnp.asarray([1.5] * b), jnp.asarray([-3] * b),
          jnp.asarray([True] * b), jnp.zeros((), jnp.int32)]


def _mutations(rng, good: dict, b: int):
  """One (argument, value) mutation: an argument of `good`, or a field of a `Sampling`
  ("sampling.<field>") or of `SamplingArrays` ("arrays.<field>"), and the value to put there."""
  pool = _POOL + _pool_arrays(b)
  name = str(rng.choice(sorted(good) + ["sampling.field", "arrays.field"]))
  if name.endswith(".field"):
    name = name.replace("field", str(rng.choice(["temperature", "top_k", "top_p", "min_p"])))
  return name, pool[rng.integers(len(pool))]


def _call(kind, target, draft, name, value):
  ids, lens = _arrays(PROMPTS)
  kw = dict(max_new_tokens=4, key=0, sampling=Sampling(temperature=0.7, top_k=5), pad_id=0,
            stop_ids=(2,))
  if kind in ("decode", "speculative_decode"):
    kw.update(prompt_ids=ids, prompt_lengths=lens, capacity=None, logprobs=True)
  else:
    kw.update(prompts=PROMPTS, max_len=None)
    kw.pop("pad_id")
  if kind.startswith("spec"):
    kw.update(num_draft_tokens=2)
    if kind == "speculative_decode":
      kw.update(drafter_params=draft.params)
  field = name.split(".")[-1]
  if name.startswith("sampling."):
    kw["sampling"] = lambda: Sampling(**{field: value})
  elif name.startswith("arrays."):
    kw["sampling"] = lambda: dataclasses.replace(_good_arrays(), **{field: value})
  elif name in kw:
    kw[name] = value
  sampling = kw.pop("sampling")
  kw["sampling"] = sampling() if callable(sampling) else sampling
  if kind == "decode":
    return decode(target, kw.pop("prompt_ids"), kw.pop("prompt_lengths"), kw.pop("key"), **kw)
  if kind == "speculative_decode":
    return speculative_decode(target, DraftModel(draft), kw.pop("prompt_ids"),
                              kw.pop("prompt_lengths"), kw.pop("key"), **kw)
  if kind == "generate":
    return jaxspec.generate(target, kw.pop("prompts"), **kw)
  return jaxspec.speculative_generate(target, NGram(), kw.pop("prompts"), **kw)


_ARGS = {"decode": ("prompt_ids", "prompt_lengths", "key", "max_new_tokens", "capacity",
                    "pad_id", "stop_ids", "logprobs", "sampling"),
         "speculative_decode": ("prompt_ids", "prompt_lengths", "key", "max_new_tokens",
                                "num_draft_tokens", "pad_id", "stop_ids", "drafter_params",
                                "sampling"),
         "generate": ("prompts", "key", "max_new_tokens", "stop_ids", "max_len", "sampling"),
         "speculative_generate": ("prompts", "key", "max_new_tokens", "num_draft_tokens",
                                  "stop_ids", "max_len", "sampling")}


def test_seeded_fuzz_of_mutated_calls_ends_in_value_errors_or_valid_calls(tiny_target,
                                                                         poor_draft,
                                                                         no_programs):
  """300 calls, each a good call with one argument (or sampling field) replaced by a value of
  the pool: every outcome is a ValueError (before any program) or a valid call."""
  rng = np.random.default_rng(50)
  outcomes = {"ValueError": 0, "valid": 0}
  for i in range(300):
    kind = str(rng.choice(sorted(_ARGS)))
    name, value = _mutations(rng, dict.fromkeys(_ARGS[kind]), 2)
    try:
      _call(kind, tiny_target, poor_draft, name, value)
    except ValueError:
      outcomes["ValueError"] += 1
    except Reached:
      outcomes["valid"] += 1
    except Exception as e:  # noqa: BLE001 - any other type is the failure under test
      raise AssertionError(f"call {i}: {kind} with {name}={value!r}: {type(e).__name__}: {e}")
  assert outcomes["ValueError"] > 150 and outcomes["valid"] > 10, outcomes


# The fixed list's prompts (sizes multiply them).
ROWS = [[5, 6, 7, 8, 9, 5, 6, 7], [10, 11, 12]]


def test_a_chunk_past_int32_runs_to_the_end(tiny_target):
  """A stream's chunk larger than int32 steps: one chunk to the end (the loop's bound is
  clamped), not an OverflowError after the prefill."""
  chunks = list(generate_stream(tiny_target, ROWS[0], max_new_tokens=6, chunk=2**40,
                                stop_ids=()))
  got = sum((new[0] for new, _ in chunks), [])
  assert got == generate(tiny_target, [ROWS[0]], max_new_tokens=6, stop_ids=()).row(0)


@pytest.mark.parametrize("call,match", [
    (lambda m: generate(m, ROWS, max_new_tokens=10**18), "max_new_tokens"),
    (lambda m: generate(m, ROWS, max_new_tokens=4, max_len=10**9), "max_len"),
    (lambda m: generate(m, ROWS * 4000, max_new_tokens=2**24 - 64), "KV cache|positions"),
    (lambda m: speculative_generate(m, "ngram", ROWS, num_draft_tokens=10**6), "num_draft"),
    (lambda m: speculative_generate(m, "ngram", ROWS, auto=AutoK(k_max=10**6)), "k_max"),
    (lambda m: NGram(max_ngram=100000), "max_ngram"),
    # a cost model with a fixed k (nothing would read it)
    (lambda m: speculative_generate(m, "ngram", ROWS, num_draft_tokens=2,
                                    cost=CostModel.from_ratios({0: 1.0, 2: 1.3})),
     r"cost= is what num_draft_tokens=\"auto\" weighs .* fixed \(num_draft_tokens=2\)"),
    (lambda m: next(generate_stream(m, ROWS[0], chunk=0)), "chunk"),
    (lambda m: next(speculative_stream(m, "ngram", ROWS[0], chunk=-1)), "chunk"),
    (lambda m: generate(m, ROWS, prompt_logprobs=5), "prompt_logprobs must be True or False"),
    (lambda m: speculative_generate(m, "ngram", ROWS, prompt_logprobs="yes"),
     "prompt_logprobs must be True or False"),
    (lambda m: generate(m, ROWS, key="abc"), "key must be an integer seed"),
    (lambda m: generate(m, ROWS, key=10**30), r"key must be a PRNG key or an integer seed in"),
    (lambda m: generate(m, ROWS, stop_ids=[2**40]), "stop_ids"),
    (lambda m: generate(m, ROWS, stop_ids="2"), "stop_ids"),
    (lambda m: generate("smollm2", ROWS), "jaxspec Model"),
    (lambda m: speculative_generate("smollm2", "ngram", ROWS), "jaxspec Model"),
    (lambda m: Sampling(temperature=1.0, top_k=2**31), "top_k"),
    (lambda m: Sampling(temperature=float("nan")), "temperature"),
])
def test_bad_api_arguments_fail_fast(tiny_target, call, match):
  t0 = time.perf_counter()
  with pytest.raises(ValueError, match=match):
    call(tiny_target)
  assert time.perf_counter() - t0 < 5, "refused only after compiling or allocating"
