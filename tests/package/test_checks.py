"""`jaxspec.checks`: the one integer check (what counts as an integer, and the error's words)."""

import argparse

import numpy as np
import pytest

from jaxspec.checks import check_int, int_range, is_int, parse_int


def test_is_int_takes_ints_and_numpy_ints_but_never_bools():
  assert [is_int(v) for v in (0, -3, np.int32(2), np.int64(7))] == [True] * 4
  assert [is_int(v) for v in (True, np.bool_(True), 1.0, "1", None, np.float32(1))] == [False] * 6
  assert not is_int(np.int64(7), numpy=False) and is_int(7, numpy=False)


@pytest.mark.parametrize("lo, hi, words", [
    (1, 8, "an integer in [1, 8]"), (0, None, "an integer >= 0"), (None, 5, "an integer <= 5"),
    (None, None, "an integer"), (0, 2**31 - 1, "an integer in [0, 2**31)"),
    (-2**31, 2**31 - 1, "an integer in [-2**31, 2**31)"), (None, 2**16 - 1, "an integer < 2**16"),
    (1, 2**24, "an integer in [1, 16777216]"), (-8, 2**15 - 1, "an integer in [-8, 32767]")])
def test_int_range_words(lo, hi, words):
  assert int_range(lo, hi) == words


def test_check_int_accepts_the_bounds_and_names_the_range_why_and_value():
  check_int("k", 1, 1, 8)
  check_int("k", np.int64(8), 1, 8)
  check_int("seed", -5)
  with pytest.raises(ValueError) as e:
    check_int("batch_size", 0, 1)
  assert str(e.value) == "batch_size must be an integer >= 1, got 0"
  with pytest.raises(ValueError) as e:
    check_int("top_k", 2**31, 0, 2**31 - 1, why="0 disables it")
  assert str(e.value) == "top_k must be an integer in [0, 2**31) (0 disables it), got 2147483648"
  with pytest.raises(ValueError, match=r"^flag must be an integer, got True$"):
    check_int("flag", True)
  with pytest.raises(ValueError, match=r"^n must be an integer <= 3, got 2.0$"):
    check_int("n", 2.0, hi=3)


def test_check_int_python_only_and_the_callers_error_class():
  class DataError(ValueError):
    pass

  with pytest.raises(DataError, match=r"^DataConfig.batch_size must be an integer >= 1, got"
                                      r" np.int64\(4\)$"):
    check_int("DataConfig.batch_size", np.int64(4), 1, numpy=False, error=DataError)


def test_parse_int_reads_text_and_says_what_it_expected():
  assert parse_int(" 12 ", 1, 2**24) == 12
  with pytest.raises(argparse.ArgumentTypeError) as e:
    parse_int("x", 1, 2**24, error=argparse.ArgumentTypeError)
  assert str(e.value) == "expected an integer in [1, 16777216], got 'x'"
  with pytest.raises(ValueError) as e:
    parse_int("0", 1)
  assert str(e.value) == "expected an integer >= 1, got 0"


def _sites():
  """Checks written with `check_int`: (call with a value, the error class, the argument's name)."""
  from jaxspec.drafters import NGram, Oracle
  from jaxspec.sampling import Sampling
  from jaxspec.sharding import multihost
  from jaxspec.train.data import DataConfig, DataError
  from jaxspec.train.trainer import TrainConfig
  ref = np.zeros((1, 4), np.int32)
  return [(lambda v: NGram(max_ngram=v), ValueError, "NGram.max_ngram"),
          (lambda v: Oracle(reference=ref, vocab=v), ValueError, "vocab"),
          (lambda v: Sampling(temperature=1.0, top_k=v), ValueError, "top_k"),
          (lambda v: DataConfig(batch_size=v), DataError, "DataConfig.batch_size"),
          (lambda v: TrainConfig(steps=v), ValueError, "TrainConfig.steps"),
          (lambda v: multihost.initialize("localhost:1", v, 0), ValueError, "num_processes")]


@pytest.mark.parametrize("bad", [True, 2.0, "4", np.float32(3)])
def test_the_sites_reject_bools_and_non_integers_in_the_checkers_words(bad):
  for make, error, name in _sites():
    with pytest.raises(error, match=rf"^{name} must be an integer"):
      make(bad)
