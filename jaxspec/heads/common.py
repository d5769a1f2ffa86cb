"""What every head shares: float32, the never-trained `Buffer`, weight initialisation, the
position shift that aligns a position with a later token, the masks of packed rows (several
conversations in one row, `segment_ids`), and config building."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.checks import check_int
from jaxspec.models.config import LlamaConfig

F32 = jnp.float32


class Buffer(nnx.Variable):
  """An array saved with a head but never trained (EAGLE-3's draft vocabulary)."""


def normal_init(rngs: nnx.Rngs, shape, std: float) -> jax.Array:
  """Normal(0, std) float32 initial weights from the next `rngs.params()` key.

  Outside a trace the draw is numpy's, seeded by the key's data (still a function of the key):
  `jax.random.normal` would compile one kernel per weight shape, which is most of the time it
  takes to create a small head. Inside jit / eval_shape it is `jax.random.normal`.
  """
  key = rngs.params()
  if isinstance(key, jax.core.Tracer):
    return std * jax.random.normal(key, shape, F32)
  seed = np.asarray(jax.random.key_data(key)).reshape(-1).astype(np.uint64).tolist()
  return jnp.asarray(std * np.random.default_rng(seed).standard_normal(shape), F32)


def shift(x: jax.Array, n: int, fill=0) -> jax.Array:
  """x[:, t + n] at t (filled past the end): aligns position t with what is n tokens later."""
  if n == 0:
    return x
  pad = jnp.full((x.shape[0], min(n, x.shape[1])) + x.shape[2:], fill, x.dtype)
  return jnp.concatenate([x[:, n:], pad], axis=1)


def packed_attention_mask(segment_ids):
  """[B, T, T] bool: query t may read key s when s <= t and both are in the same conversation
  (padding, segment 0, reads only padding). Works on numpy and jax arrays alike."""
  t = segment_ids.shape[-1]
  same = segment_ids[..., :, None] == segment_ids[..., None, :]
  causal = np.tril(np.ones((t, t), bool))
  return same & causal


def same_segment_ahead(segment_ids, d: int):
  """[B, T] bool: position t + d exists and is in t's conversation (not padding): where a label
  d tokens ahead may train position t. Works on numpy and jax arrays alike."""
  t = segment_ids.shape[-1]
  if d >= t:  # no position has a label that far ahead
    none = np.zeros(segment_ids.shape, bool)
    return none if isinstance(segment_ids, np.ndarray) else jnp.asarray(none)
  ahead = segment_ids[..., d:]
  ok = (ahead == segment_ids[..., : t - d]) & (ahead > 0)
  pad = np.zeros(segment_ids.shape[:-1] + (d,), bool)
  if isinstance(segment_ids, np.ndarray):
    return np.concatenate([ok, pad], axis=-1)
  return jnp.concatenate([ok, jnp.asarray(pad)], axis=-1)


def target_dims(cfg: LlamaConfig) -> tuple[int, int, int]:
  """(hidden size, vocabulary, layers) of a target: what a head is built for and checked
  against."""
  return (cfg.hidden_size, cfg.vocab_size, cfg.num_layers)


def check_config_ints(cfg, lows: Mapping[str, int]) -> None:
  """Raises ValueError naming `Config.field` unless each field is an int >= its low bound."""
  for name, lo in lows.items():
    check_int(f"{type(cfg).__name__}.{name}", getattr(cfg, name), lo, numpy=False)


def make_config(cls, options: Mapping[str, Any]):
  """`cls(**options)`, naming the unknown options and the known ones."""
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(options) - names)
  if unknown:
    raise ValueError(f"unknown {cls.__name__} options {unknown}; known: {sorted(names)}")
  return cls(**options)
