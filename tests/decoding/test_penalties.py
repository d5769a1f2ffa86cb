"""The context-dependent adjustments of `Sampling`: repetition, presence and frequency penalties,
`logit_bias` and `min_new_tokens`. Greedy speculative output equals plain greedy output and an
independent reference; sampled tokens at later positions follow the exact distribution
(chi-square), because every verify position is adjusted with the drafts before it counted;
`score` equals the loops' log-probabilities; left off, they compile nothing; bad values raise
before compiling; `Sampling` takes traced values."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jaxspec
from jaxspec import heads
from jaxspec.decoding import decode, join_tokens, score, speculative_decode
from jaxspec.decoding.plain import prefill
from jaxspec.drafters import DraftModel, NGram
from jaxspec.models import forward, init_cache
from jaxspec.sampling import Sampling, SamplingArrays, sampling_arrays
from helpers import chi2_critical

# A ragged batch: an 8-token prompt that repeats itself (n-gram drafts find matches), a
# 3-token one and a 1-token one.
IDS = jnp.asarray([[5, 6, 7, 8, 5, 6, 7, 8], [9, 10, 11, 0, 0, 0, 0, 0],
                   [12, 0, 0, 0, 0, 0, 0, 0]], jnp.int32)
LENS = jnp.asarray([8, 3, 1], jnp.int32)
N_NEW = 14
# Strong enough to change the tiny target's greedy text (asserted below).
PENALTIES = dict(repetition_penalty=1.6, presence_penalty=0.4, frequency_penalty=0.3)


def _reference_adjust(logits, prompt, generated, *, repetition_penalty=1.0,
                      presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None,
                      min_new_tokens=0, stop_ids=()):
  """The adjustments written out for one position in numpy (float32, as the loops compute):
  bias, min_new_tokens's mask, Hugging Face's repetition penalty over prompt + generated, then
  vLLM's presence and frequency penalties over generated tokens."""
  x = np.array(logits, np.float32)
  for t, b in (logit_bias or {}).items():
    x[t] += np.float32(b)
  if len(generated) < min_new_tokens:
    x[list(stop_ids)] = -np.inf
  r = np.float32(repetition_penalty)
  for t in set(prompt) | set(generated):
    x[t] = x[t] / r if x[t] > 0 else x[t] * r
  for t in set(generated):
    x[t] -= np.float32(frequency_penalty) * np.float32(generated.count(t))
    x[t] -= np.float32(presence_penalty)
  return x


def _reference_greedy(target, ids, lens, n_new, stop_ids=(), **adj):
  """Greedy decoding by full forward passes (no cache reuse, no loop), one row at a time."""
  cfg = target.cfg
  width = int(ids.shape[1]) + n_new
  last_logits = jax.jit(lambda seq: forward(target.params, seq, init_cache(cfg, 1, width), cfg)[0])
  rows = []
  for b in range(ids.shape[0]):
    prompt = [int(t) for t in ids[b, :int(lens[b])]]
    gen: list[int] = []
    while len(gen) < n_new:
      seq = np.zeros((1, width), np.int32)
      seq[0, :len(prompt) + len(gen)] = prompt + gen
      lg = np.asarray(last_logits(jnp.asarray(seq)))[0, len(prompt) + len(gen) - 1]
      tok = int(np.argmax(_reference_adjust(lg, prompt, gen, stop_ids=stop_ids, **adj)))
      gen.append(tok)
      if tok in stop_ids:
        break
    rows.append(gen)
  return rows


def _rows(out) -> list[list[int]]:
  return [np.asarray(out.tokens)[b, :int(out.lengths[b])].tolist() for b in range(len(out.lengths))]


@pytest.fixture(scope="module")
def target(tiny_target):
  return tiny_target


@pytest.fixture(scope="module")
def greedy_case(target):
  """The adjustments, their stop id and the reference text: logit_bias bans row 0's plain
  second token and favours another; the stop id is a token the adjusted text emits third in
  row 0, so that min_new_tokens holds it back."""
  plain = _reference_greedy(target, IDS, LENS, N_NEW)
  bias = {plain[0][1]: -1e9, 3: 1.5}
  probe = _reference_greedy(target, IDS, LENS, N_NEW, logit_bias=bias, **PENALTIES)
  stops = (probe[0][2],)
  adj = dict(PENALTIES, logit_bias=bias, min_new_tokens=6)
  want = _reference_greedy(target, IDS, LENS, N_NEW, stop_ids=stops, **adj)
  # The adjustments change the text, and min_new_tokens keeps row 0 going past the stop id.
  assert want != plain
  assert len(want[0]) > 3 and stops[0] not in want[0][:6]
  assert plain[0][1] not in want[0]
  return Sampling(**adj), stops, want


@pytest.fixture(scope="module")
def eagle(target):
  return heads.HEADS["eagle"].drafter(heads.HEADS["eagle"].create(target.cfg, rngs=nnx.Rngs(5)),
                                      target)


# EAGLE under -m slow: the adjustments act in the target's verify, whatever drafts it checks;
# n-gram (drafts partly rejected) and the target drafting for itself (all accepted) keep it.
@pytest.mark.parametrize("name", ["ngram", "draft-model",
                                  pytest.param("eagle", marks=pytest.mark.slow)])
def test_greedy_speculative_equals_plain_with_adjustments(target, eagle, greedy_case, name):
  """Token for token, on a ragged batch: the plain loop equals the reference, and speculative
  decoding with every adjustment on equals the plain loop (drafts were accepted, so later
  verify positions were adjusted with the drafts before them)."""
  sp, stops, want = greedy_case
  plain = decode(target, IDS, LENS, 0, max_new_tokens=N_NEW, sampling=sp, stop_ids=stops)
  assert _rows(plain) == want
  drafter = {"ngram": NGram(), "draft-model": DraftModel(target), "eagle": eagle}[name]
  out = speculative_decode(target, drafter, IDS, LENS, 0, max_new_tokens=N_NEW, sampling=sp,
                           stop_ids=stops, num_draft_tokens=3)
  assert _rows(out) == want
  np.testing.assert_allclose(out.logprobs, plain.logprobs, atol=1e-4)
  if name == "draft-model":  # the target drafting for itself: its drafts are all accepted
    assert int(out.stats.accepted.sum()) >= N_NEW


def test_host_wrappers_and_the_two_loops_agree(target, greedy_case):
  """`generate` and `speculative_generate` take the adjustments through `Sampling`."""
  sp, stops, want = greedy_case
  prompts = [np.asarray(IDS)[b, :int(LENS[b])].tolist() for b in range(3)]
  got = jaxspec.generate(target, prompts, max_new_tokens=N_NEW, sampling=sp, stop_ids=stops)
  assert [got.tokens[b, :got.lengths[b]].tolist() for b in range(3)] == want
  spec = jaxspec.speculative_generate(target, NGram(), prompts, max_new_tokens=N_NEW,
                                      sampling=sp, stop_ids=stops, num_draft_tokens=3)
  assert [spec.tokens[b, :spec.lengths[b]].tolist() for b in range(3)] == want


# ----------------------------------------------------------------------------------------------
# Sampled: the distribution at later positions, and score


BIAS = {3: 0.7, 6: -0.8}
SAMPLED = Sampling(temperature=1.0, logit_bias=BIAS, min_new_tokens=2, **PENALTIES)
STOP = (5,)
N_POS = 4  # the prefill's token, then three through verify passes
MC_ROWS = 20000


def _exact_marginals(target, prompt, sp: Sampling, stops, n_pos):
  """[n_pos, V + 1] the exact distribution of each new token (column V: the row has ended at a
  stop id), every history enumerated and adjusted by `_reference_adjust`."""
  v = target.cfg.vocab_size
  adj = {f: getattr(sp, f) for f in ("repetition_penalty", "presence_penalty",
                                     "frequency_penalty", "min_new_tokens")}
  adj["logit_bias"] = BIAS
  alive, weight, ended, out = [()], [1.0], 0.0, []
  for _ in range(n_pos):
    seqs = np.array([prompt + list(h) for h in alive], np.int32)
    lg, _, _ = prefill(target.params, jnp.asarray(seqs), jnp.full((len(seqs),), seqs.shape[1]),
                       target.cfg, seqs.shape[1] + 1)
    marg = np.zeros(v + 1)
    marg[v] = ended
    nxt, nw = [], []
    for h, w, row in zip(alive, weight, np.asarray(lg)):
      x = _reference_adjust(row, prompt, list(h), stop_ids=stops, **adj).astype(np.float64)
      p = np.exp(x - x.max())
      p /= p.sum()
      marg[:v] += w * p
      for t in range(v):
        if t in stops:
          ended += w * p[t]
        elif p[t] > 0:
          nxt.append(h + (t,))
          nw.append(w * p[t])
    out.append(marg)
    alive, weight = nxt, nw
  return np.stack(out)


def _mc_drafter(name, target, draft):
  if name == "draft-model":
    # p_min stops about a tenth of the drafts here (counted below): this case also keeps
    # test_monte_carlo's `[draft-model-p_min]` (now under -m slow) in the default run.
    return DraftModel(draft, p_min=0.5), 3
  m = heads.HEADS["medusa"].create(target.cfg, rngs=nnx.Rngs(3), num_heads=2)
  tree = [[0], [1], [0, 0], [0, 1], [1, 0]]
  return heads.HEADS["medusa"].drafter(m, target).with_tree(tree), "auto"


@pytest.mark.parametrize("name", ["draft-model", "tree"])
def test_sampled_later_positions_follow_the_adjusted_distribution(small_vocab, name):
  """20,000 rows of 4 sampled tokens with every adjustment on (min_new_tokens holding a stop id
  back for two tokens, after which rows may end): at each position, after earlier steps'
  rollbacks, the tokens follow the exact distribution (chi-square at the 1e-4 tail), and
  drafts were both accepted and rejected (and, for the draft model, some stopped by p_min)."""
  target, draft = small_vocab
  drafter, k = _mc_drafter(name, target, draft)
  prompt = [1, 2, 3, 1, 2, 3, 1, 2]
  ids = jnp.asarray([prompt] * MC_ROWS, jnp.int32)
  out = speculative_decode(target, drafter, ids, jnp.full((MC_ROWS,), len(prompt), jnp.int32),
                           2024, max_new_tokens=N_POS, sampling=SAMPLED, stop_ids=STOP,
                           num_draft_tokens=k, logprobs=False)
  v = target.cfg.vocab_size
  toks = np.asarray(out.tokens)
  toks = np.where(np.arange(N_POS)[None, :] < np.asarray(out.lengths)[:, None], toks, v)
  exact = _exact_marginals(target, prompt, SAMPLED, STOP, N_POS)
  assert exact[1, v] == 0 and exact[3, v] > 0.01  # rows may stop only from the third token on
  for j in range(N_POS):
    obs = np.bincount(toks[:, j], minlength=v + 1).astype(np.float64)
    assert obs[exact[j] == 0].sum() == 0, (j, obs, exact[j])
    exp = exact[j] * MC_ROWS
    keep = exp >= 5
    chi2 = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    assert chi2 < chi2_critical(int(keep.sum()) - 1), (name, j, chi2, obs, exp)
  st = out.stats.summary()
  assert 0.02 < st["acceptance_rate"] < 0.98, st["acceptance_rate"]
  if name == "draft-model":  # every step asked for k drafts: the ones missing p_min stopped
    asked = k * int(np.asarray(out.stats.spec_row_steps).sum())
    stopped = asked - int(np.asarray(out.stats.drafted).sum())
    assert stopped > 0.05 * asked, (stopped, asked)


def test_score_equals_the_loops_logprobs_with_adjustments(target, poor_draft):
  """score's teacher-forced log-probabilities are the ones both loops report, per row, with
  penalties, a bias and min_new_tokens on (the stop id it holds back passed to score)."""
  sp = Sampling(temperature=[0.8, 1.2, 1.0], top_k=[0, 20, 0], logit_bias={3: 1.0},
                min_new_tokens=2, **PENALTIES)
  stops = (7,)
  for out in (decode(target, IDS, LENS, 3, max_new_tokens=N_NEW, sampling=sp, stop_ids=stops),
              speculative_decode(target, DraftModel(poor_draft), IDS, LENS, 3,
                                 max_new_tokens=N_NEW, sampling=sp, stop_ids=stops,
                                 num_draft_tokens=3)):
    tokens, lengths = join_tokens(IDS, LENS, out.tokens, out.lengths)
    lp = score(target, tokens, lengths, sampling=sp, prompt_lengths=LENS, stop_ids=stops)
    cols = LENS[:, None] + jnp.arange(N_NEW)[None, :]
    got = jnp.take_along_axis(lp, jnp.minimum(cols, lp.shape[1] - 1), axis=1)
    got = np.where(np.arange(N_NEW)[None, :] < np.asarray(out.lengths)[:, None], got, 0.0)
    np.testing.assert_allclose(got, out.logprobs, atol=2e-4)
    # Without the adjustments score gives other values: the comparison above can fail.
    plain = score(target, tokens, lengths, sampling=dataclasses.replace(
        sp, repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0,
        logit_bias=None, min_new_tokens=0), prompt_lengths=LENS)
    assert not np.allclose(plain, lp, atol=1e-2)


# ----------------------------------------------------------------------------------------------
# Off: nothing compiled; on: a [B, V] count in the loop's state


def test_adjustments_left_off_compile_the_program_without_them(target):
  off = Sampling(temperature=0.7, repetition_penalty=1.0, presence_penalty=0.0,
                 frequency_penalty=0.0, min_new_tokens=0, logit_bias={})
  arr = sampling_arrays(off, 3, target.cfg.vocab_size)
  assert not arr.adjusts and arr.logit_bias is None and arr.repetition_penalty is None

  def program(sp):
    fn = jax.jit(lambda key: speculative_decode(target, NGram(), IDS, LENS, key,
                                                max_new_tokens=8, sampling=sp,
                                                num_draft_tokens=3))
    return fn.lower(jax.random.key(0)).as_text()

  def carries_counts(text):  # a while loop carrying the history's [B, V] int32 counts
    counts = f"tensor<3x{target.cfg.vocab_size}xi32>"
    return any("stablehlo.while" in ln and counts in ln for ln in text.splitlines())

  base = program(Sampling(temperature=0.7))
  assert program(off) == base
  assert not carries_counts(base)
  assert carries_counts(program(dataclasses.replace(off, frequency_penalty=0.1)))


# ----------------------------------------------------------------------------------------------
# Bad values, before anything compiles


@pytest.mark.parametrize("kw, match", [
    (dict(repetition_penalty=-1.2), "repetition_penalty must be a finite number > 0"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(presence_penalty=float("nan")), "presence_penalty must be a finite number"),
    (dict(frequency_penalty=[0.1, float("inf")]), "frequency_penalty \\(each row's\\)"),
    (dict(min_new_tokens=-1), "min_new_tokens must be an integer in \\[0, 2\\*\\*31\\)"),
    (dict(min_new_tokens=1.5), "min_new_tokens must be an integer"),
    (dict(logit_bias={-3: 1.0}), "logit_bias token id must be an integer in \\[0"),
    (dict(logit_bias={4: float("nan")}), "logit_bias\\[4\\] must be a finite number or -inf"),
    (dict(logit_bias="3:1"), "logit_bias must be a \\{token id: bias\\} mapping"),
])
def test_bad_values_raise_naming_the_argument(kw, match):
  with pytest.raises(ValueError, match=match):
    Sampling(**kw)


@pytest.mark.parametrize("sampling, match", [
    (Sampling(logit_bias={128: 1.0}), "logit_bias has token id 128, outside the vocabulary"),
    (Sampling(logit_bias=np.full(100, 0.5)), "logit_bias has 100 entries per row but the vocabulary"
                                             " has 128"),
    (Sampling(logit_bias=[{1: 1.0}, {2: 1.0}]), "logit_bias has 2 rows for a batch of 3"),
    (Sampling(min_new_tokens=9), "min_new_tokens is 9 but max_new_tokens is 8"),
    (Sampling(min_new_tokens=[0, 0, 9]), "min_new_tokens is 9 but max_new_tokens is 8"),
    (SamplingArrays(temperature=jnp.zeros(3), top_k=jnp.zeros(3, jnp.int32),
                    top_p=jnp.ones(3), min_p=jnp.zeros(3), logit_bias=jnp.zeros((3, 7))),
     "SamplingArrays.logit_bias must have shape \\[3, 128\\]"),
    (SamplingArrays(temperature=jnp.zeros(3), top_k=jnp.zeros(3, jnp.int32),
                    top_p=jnp.ones(3), min_p=jnp.zeros(3),
                    repetition_penalty=jnp.asarray([1.0, -1.0, 1.0])),
     "SamplingArrays.repetition_penalty, row 1: repetition_penalty \\(each row's\\) must be"),
])
def test_bad_arguments_raise_before_compiling(target, no_compile, sampling, match):
  for run in (lambda: decode(target, IDS, LENS, 0, max_new_tokens=8, sampling=sampling),
              lambda: speculative_decode(target, NGram(), IDS, LENS, 0, max_new_tokens=8,
                                         sampling=sampling)):
    with pytest.raises(ValueError, match=match):
      run()


def test_host_wrappers_check_min_new_tokens_and_the_vocabulary(target):
  with pytest.raises(ValueError, match="min_new_tokens is 5 but max_new_tokens is 4"):
    jaxspec.generate(target, [[1, 2]], max_new_tokens=4, sampling=Sampling(min_new_tokens=5))
  with pytest.raises(ValueError, match="outside the vocabulary \\[0, 128\\)"):
    jaxspec.speculative_generate(target, NGram(), [[1, 2]], max_new_tokens=4,
                                 num_draft_tokens=2, sampling=Sampling(logit_bias={999: 1.0}))


# ----------------------------------------------------------------------------------------------
# Sampling with arrays, traced ones included


def test_sampling_accepts_traced_values_inside_jit(target):
  """A `Sampling` built inside jit from traced values decodes as the one of Python numbers."""
  @jax.jit
  def run(temperature, penalty, bias):
    sp = Sampling(temperature=temperature, repetition_penalty=penalty, logit_bias=bias)
    return decode(target, IDS, LENS, 7, max_new_tokens=8, sampling=sp).tokens

  bias = np.zeros(target.cfg.vocab_size, np.float32)
  bias[3] = 2.0
  got = run(jnp.asarray([0.9, 0.0, 1.1]), jnp.float32(1.3), jnp.asarray(bias))
  want = decode(target, IDS, LENS, 7, max_new_tokens=8, sampling=Sampling(
      temperature=[0.9, 0.0, 1.1], repetition_penalty=1.3, logit_bias={3: 2.0})).tokens
  np.testing.assert_array_equal(got, want)


def test_traced_values_of_the_wrong_shape_or_dtype_raise():
  with pytest.raises(ValueError, match="Sampling.temperature must be a scalar or \\[B\\]"):
    jax.jit(lambda t: Sampling(temperature=t))(jnp.zeros((2, 2)))
  with pytest.raises(ValueError, match="Sampling.top_k must hold integers"):
    jax.jit(lambda t: Sampling(top_k=t))(jnp.float32(3.0))
  with pytest.raises(ValueError, match="Sampling.temperature has 2 values for a batch of 3"):
    jax.jit(lambda t: Sampling(temperature=t).arrays(3))(jnp.zeros(2))


def test_concrete_arrays_are_checked_as_numbers_are():
  with pytest.raises(ValueError, match="temperature \\(each row's\\) must be a finite number"):
    Sampling(temperature=jnp.asarray([0.5, jnp.nan]))
  assert Sampling(temperature=jnp.asarray([0.5, 0.0])).temperature == (0.5, 0.0)
  sp = Sampling(logit_bias=np.eye(2, 4, dtype=np.float32))  # one [V] row per batch row
  np.testing.assert_array_equal(sp.arrays(2, 4).logit_bias, np.eye(2, 4))


# ----------------------------------------------------------------------------------------------
# The command line


def test_cli_flags_build_the_sampling(monkeypatch):
  from jaxspec.cli import generate as gen
  from jaxspec.cli import main
  seen = []
  monkeypatch.setattr(gen, "_generate", lambda args, prompts, sampling, status: seen.append(
      sampling) or 0)
  assert main(["generate", "hi", "--repetition-penalty", "1.3", "--presence-penalty", "0.5",
               "--frequency-penalty", "0.25", "--min-new-tokens", "2", "--logit-bias", "5=-2",
               "--logit-bias", "7=-inf"]) == 0
  assert seen == [Sampling(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25,
                           min_new_tokens=2, logit_bias={5: -2.0, 7: float("-inf")})]
  with pytest.raises(SystemExit, match="error: repetition_penalty must be a finite number > 0"):
    main(["generate", "hi", "--repetition-penalty", "-1"])
  with pytest.raises(SystemExit):
    main(["generate", "hi", "--logit-bias", "5"])
