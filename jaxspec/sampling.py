"""Sampling parameters and the one place where logits become a distribution.

Plain decoding, the drafters and the target's verification all call `process_logits` /
`probs` from here, so the draft distribution q and the target distribution p are built by the
same code with the same temperature, top-k, top-p and min-p — which the exactness of rejection
sampling depends on.

Order of the filters: temperature, then top-k, then top-p over what top-k kept, then min-p, as
Hugging Face's warpers and vLLM v0 apply them (vLLM v1 applies min-p first; min-p compares
with the most likely token, which every filter keeps, so the order changes only what top-p
sees). Temperature 0 means greedy: the distribution is a one-hot on the argmax.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


from jaxspec.checks import check_int  # noqa: E402
from jaxspec.pytree import pytree_dataclass as _pytree  # noqa: E402


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
  """User-facing sampling settings (Python numbers, validated before anything compiles).

  Each field is one value for every row, or a sequence of one value per row (rows with
  different settings in one batch; its length must be the batch size).

  Attributes:
    temperature: 0 for greedy decoding, > 0 to sample (one so small that logits / temperature
      overflows float32 acts as its limit, the argmax: see `process_logits`).
    top_k: keep the k most likely tokens; 0 keeps all.
    top_p: keep the smallest set of tokens whose probability reaches top_p; 1 keeps all.
    min_p: drop tokens whose probability is below min_p times the most likely one's; 0 keeps all.
  """

  temperature: float | tuple[float, ...] = 0.0
  top_k: int | tuple[int, ...] = 0
  top_p: float | tuple[float, ...] = 1.0
  min_p: float | tuple[float, ...] = 0.0

  def __post_init__(self):
    for name in ("temperature", "top_k", "top_p", "min_p"):
      v = getattr(self, name)
      if isinstance(v, (str, bytes)) or not hasattr(v, "__len__") or getattr(v, "ndim", 1) == 0:
        _check_value(name, v)
        continue
      vals = tuple(v.tolist() if hasattr(v, "tolist") else v)
      if not vals:
        raise ValueError(f"{name} is an empty sequence: give one value, or one per row")
      for x in vals:
        _check_value(name, x, per_row=True)
      object.__setattr__(self, name, vals)

  @property
  def per_row(self) -> bool:
    """Whether some field holds one value per row."""
    return any(isinstance(getattr(self, f), tuple) for f in ("temperature", "top_k", "top_p",
                                                              "min_p"))

  @property
  def greedy(self) -> bool:
    t = self.temperature
    return all(x == 0 for x in t) if isinstance(t, tuple) else t == 0

  def arrays(self, batch_size: int) -> SamplingArrays:
    """Per-row arrays, so a change of value does not recompile. Raises ValueError when a
    per-row field's length is not `batch_size`."""
    def full(name, dt):
      v = getattr(self, name)
      if isinstance(v, tuple):
        if len(v) != batch_size:
          raise ValueError(f"Sampling.{name} has {len(v)} values for a batch of {batch_size}"
                           f" rows: give one value, or exactly one per row")
        return jnp.asarray(v, dt)
      return jnp.full((batch_size,), v, dt)
    return SamplingArrays(temperature=full("temperature", jnp.float32),
                          top_k=full("top_k", jnp.int32), top_p=full("top_p", jnp.float32),
                          min_p=full("min_p", jnp.float32))


def _check_value(name: str, v, per_row: bool = False) -> None:
  """Raises ValueError for a sampling value outside its range (naming the field)."""
  if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
    v = v.item()
  where = " (each row's)" if per_row else ""
  if name == "temperature":
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
      raise ValueError(f"temperature{where} must be a finite number >= 0 (0 means greedy), got"
                       f" {v!r}")
  elif name == "top_k":
    check_int(f"top_k{where}", v, 0, 2**31 - 1, numpy=False,
              why="0 disables it; a value past the vocabulary keeps all")
  elif name == "top_p":
    if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or not 0 < v <= 1:
      raise ValueError(f"top_p{where} must be in (0, 1] (1 disables it), got {v!r}")
  elif isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) \
      or not 0 <= v <= 1:
    raise ValueError(f"min_p{where} must be in [0, 1] (0 disables it), got {v!r}")


GREEDY = Sampling()


@_pytree
@dataclasses.dataclass
class SamplingArrays:
  """Per-row sampling values as arrays (traced inside jit)."""

  temperature: jax.Array  # [B] float32, 0 = greedy
  top_k: jax.Array  # [B] int32, 0 = off
  top_p: jax.Array  # [B] float32, 1 = off
  min_p: jax.Array  # [B] float32, 0 = off


def _expand(x: jax.Array, ndim: int) -> jax.Array:
  """[B] -> [B, 1, ..., 1] with `ndim` dims in all."""
  return x.reshape(x.shape + (1,) * (ndim - 1))


def _filter_sorted(logits: jax.Array, sp: SamplingArrays) -> jax.Array:
  """Masks (to -inf) what top-k, top-p and min-p drop; logits are already temperature-scaled.

  As Hugging Face's warpers (and vLLM): top-k keeps every token at least as likely as the k-th
  (ties at the k-th value included); top-p keeps the smallest prefix of the descending order
  whose probability reaches top_p (ties at its edge broken by token id, lower first), each row
  skipping it at top_p >= 1; min-p keeps tokens whose probability is at least min_p times the
  most likely one's."""
  nd = logits.ndim
  v = logits.shape[-1]
  iota = lax.broadcasted_iota(jnp.int32, logits.shape, nd - 1)
  neg, order = lax.sort((-logits, iota), dimension=nd - 1, num_keys=1, is_stable=True)
  srt = -neg  # descending; order[..., i] is the token at sorted position i
  k = _expand(sp.top_k, nd)
  kth = jnp.take_along_axis(srt, jnp.clip(k - 1, 0, v - 1), axis=-1)
  keep = (k == 0) | (srt >= kth)
  masked = jnp.where(keep, srt, -jnp.inf)
  pr = jax.nn.softmax(masked, axis=-1)
  before = jnp.cumsum(pr, axis=-1) - pr  # probability mass strictly before each position
  top_p = _expand(sp.top_p, nd)
  keep = keep & ((top_p >= 1) | (before < top_p))
  min_p = _expand(sp.min_p, nd)
  # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p).
  keep = keep & ((min_p <= 0) | (srt >= srt[..., :1] + jnp.log(jnp.maximum(min_p, 1e-30))))
  keep = keep.at[..., 0].set(True)  # the most likely token always survives
  # Back to vocabulary order: sort the keep flags by token id.
  _, keep_v = lax.sort((order, keep), dimension=nd - 1, num_keys=1)
  return jnp.where(keep_v, logits, -jnp.inf)


def process_logits(logits: jax.Array, sp: SamplingArrays) -> jax.Array:
  """Temperature-scaled, filtered float32 logits [B, ..., V] for the sampled rows.

  Rows with temperature 0 come back unscaled (their distribution is the argmax one-hot; see
  `probs`). A positive temperature below float32's resolution for the logits (one where some
  |logit| / temperature exceeds float32's largest value, ~3.4e38: below about 1e-37 for
  logits near 30) acts as its limit T -> 0: 0 on the largest logit's tokens and -inf elsewhere,
  so the distribution is the argmax one-hot (uniform over exact ties) and the chosen token's
  log-probability is 0 (log(1/n) for n tied), finite. Filtering sorts the vocabulary, so it
  runs only when some row asks for it.
  """
  logits = logits.astype(jnp.float32)
  nd = logits.ndim
  temp = _expand(sp.temperature, nd)
  hot = temp > 0
  scaled = logits / jnp.where(hot, temp, 1.0)
  # A temperature so small that logits / temperature overflows float32 would give inf - inf =
  # NaN in the softmax: such positions take the T -> 0 limit of the distribution instead, which
  # the overflow cannot change: 0 on the tokens of the largest logit, -inf elsewhere.
  over = jnp.any(jnp.isinf(scaled) & jnp.isfinite(logits), axis=-1, keepdims=True)
  limit = jnp.where(logits == jnp.max(logits, axis=-1, keepdims=True), 0.0, -jnp.inf)
  logits = jnp.where(hot, jnp.where(over, limit, scaled), logits)
  needs = jnp.any((sp.temperature > 0) & ((sp.top_k > 0) | (sp.top_p < 1) | (sp.min_p > 0)))
  return lax.cond(needs, lambda l: _filter_sorted(l, sp), lambda l: l, logits)


def probs(logits: jax.Array, sp: SamplingArrays) -> jax.Array:
  """The distribution [B, ..., V] (float32) that decoding samples from.

  Greedy rows get a one-hot on the argmax, which makes rejection sampling reduce exactly to
  greedy acceptance (accept while the draft equals the argmax, emit the argmax at the first
  mismatch).
  """
  hard = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  greedy = _expand(sp.temperature, logits.ndim) == 0

  def mixed(logits):
    return jnp.where(greedy, hard, jax.nn.softmax(process_logits(logits, sp), axis=-1))

  # An all-greedy batch skips the softmax over the vocabulary (the common benchmark case).
  return lax.cond(jnp.all(sp.temperature == 0), lambda l: hard, mixed, logits)


def sample(keys: jax.Array, logits: jax.Array, sp: SamplingArrays) -> jax.Array:
  """One token per row from logits [B, V] with per-row keys [B]; greedy rows take the argmax."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)

  def draw(logits):
    proc = process_logits(logits, sp)
    drawn = jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, proc)
    return jnp.where(sp.temperature == 0, greedy, drawn).astype(jnp.int32)

  # An all-greedy batch draws no random numbers over the vocabulary.
  return lax.cond(jnp.all(sp.temperature == 0), lambda l: greedy, draw, logits)


def sample_from_probs(keys: jax.Array, p: jax.Array, one_hot: jax.Array | None = None,
                      ) -> jax.Array:
  """One token per row from unnormalised probabilities p [B, V] (zeros allowed) with keys [B].

  one_hot: [B] bool rows known to hold a one-hot p (greedy decoding): they take the argmax,
  and when every row does no random numbers are drawn.
  """
  def draw(p):
    logp = jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), -jnp.inf)
    return jax.vmap(lambda k, l: jax.random.categorical(k, l))(keys, logp).astype(jnp.int32)

  if one_hot is None:
    return draw(p)
  top = jnp.argmax(p, axis=-1).astype(jnp.int32)
  return lax.cond(jnp.all(one_hot), lambda p: top,
                  lambda p: jnp.where(one_hot, top, draw(p)), p)


def sample_positions(keys: jax.Array, p: jax.Array, greedy: jax.Array | None = None) -> jax.Array:
  """[B, T] tokens drawn from p [B, T, V] with keys [B, T] (`generate`'s draw: a Gumbel-max
  over log p); greedy rows (one-hot p) take the argmax, and an all-greedy batch draws nothing."""
  top = jnp.argmax(p, axis=-1).astype(jnp.int32)

  def draw(p):
    logp = jnp.where(p > 0, jnp.log(jnp.maximum(p, 1e-38)), -jnp.inf)
    y = jax.vmap(jax.vmap(jax.random.categorical))(keys, logp).astype(jnp.int32)
    return y if greedy is None else jnp.where(greedy[:, None], top, y)

  if greedy is None:
    return draw(p)
  return lax.cond(jnp.all(greedy), lambda p: top, draw, p)


def position_keys(row_keys: jax.Array, start: jax.Array, width: int) -> jax.Array:
  """[B, width] keys of new-token indices start .. start + width - 1 of every row: row b's
  token j is drawn with fold_in(row_keys[b], j), as `generate` draws it, whatever step, batch
  or draft count produces it."""
  idx = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]
  return jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)))(row_keys, idx)


def row_keys(key: jax.Array, batch_size: int) -> jax.Array:
  """Independent per-row keys [B]: row b's stream depends only on (key, b). Per-row keys
  (a key array [B]) come back as they are, so `row_keys(key, N)[i:j]` passed as a batch's key
  draws rows i..j-1 as the N-row batch does."""
  if key.ndim == 1 and key.shape[0] == batch_size:
    return key
  return jax.vmap(lambda b: jax.random.fold_in(key, b))(jnp.arange(batch_size))


def sample_keys(prompt_keys: jax.Array, n: int) -> jax.Array:
  """Row keys [B * n] for n samples of each of B prompts (rows prompt-major: row b * n + i is
  sample i of prompt b): sample 0 draws from prompt b's key itself, so n = 1 is the call
  without samples, and sample i >= 1 from fold_in(prompt_keys[b], i). A prompt's samples thus
  depend on its own key only (not on its position in the batch when its key is its own), and a
  larger n keeps the first samples."""
  if n == 1:
    return prompt_keys
  idx = jnp.arange(n, dtype=jnp.int32)
  folded = jax.vmap(lambda k: jax.vmap(lambda i: jax.random.fold_in(k, i))(idx))(prompt_keys)
  own = jax.random.key_data(prompt_keys)[:, None]  # [B, 1, ...]: a key's raw words
  data = jnp.where(_expand(idx == 0, own.ndim - 1)[None], own, jax.random.key_data(folded))
  return jax.random.wrap_key_data(data.reshape((-1,) + data.shape[2:]),
                                  impl=jax.random.key_impl(prompt_keys))


def token_logprobs(logits: jax.Array, tokens: jax.Array, sp: SamplingArrays) -> jax.Array:
  """[B, ...] the log-probability of tokens [B, ...] under the distribution decoding samples
  from: `log_softmax` of the processed logits [B, ..., V] (temperature, top-k, top-p, min-p;
  greedy rows unscaled, as Hugging Face's and vLLM's processed log-probs)."""
  lp = jax.nn.log_softmax(process_logits(logits, sp), axis=-1)
  return jnp.take_along_axis(lp, tokens[..., None].astype(jnp.int32), axis=-1)[..., 0]


def top_logprobs(logits: jax.Array, sp: SamplingArrays, n: int) -> tuple[jax.Array, jax.Array]:
  """The n most likely tokens of the distribution decoding samples from, most likely first:
  (ids [B, ..., n] int32, log-probabilities [B, ..., n] float32) of `log_softmax` of the
  processed logits [B, ..., V], as `token_logprobs` reads them (ties: lower id first). Past
  the tokens the filters keep, the log-probabilities are -inf."""
  lp = jax.nn.log_softmax(process_logits(logits, sp), axis=-1)
  vals, ids = lax.top_k(lp, n)
  return ids.astype(jnp.int32), vals


def resolve_sampling(sampling) -> Sampling:
  """A `Sampling` from one, a dict of its fields, or None (greedy)."""
  if sampling is None:
    return GREEDY
  if isinstance(sampling, dict):
    unknown = set(sampling) - {f.name for f in dataclasses.fields(Sampling)}
    if unknown:
      raise ValueError(f"sampling has unknown fields {sorted(map(str, unknown))}: Sampling takes"
                       " temperature, top_k, top_p and min_p")
    return Sampling(**sampling)
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a jaxspec Sampling (or, inside jit,"
                     f" SamplingArrays), got {type(sampling).__name__}")
  return sampling


def sampling_arrays(sampling, batch_size: int) -> SamplingArrays:
  """`SamplingArrays` [B] from a `Sampling` (one value, or one per row), a dict or None
  (`resolve_sampling`), or from `SamplingArrays` (checked: every field [B], and, where an array
  is concrete, every row's value in the range `Sampling` allows). Raises ValueError naming a
  field of the wrong shape or dtype, or the row whose value is out of range; works on traced
  arrays (only their shapes can be checked before the program runs)."""
  if not isinstance(sampling, SamplingArrays):
    return resolve_sampling(sampling).arrays(batch_size)
  out = {}
  for f in dataclasses.fields(SamplingArrays):
    x = getattr(sampling, f.name)
    if not hasattr(x, "shape") or tuple(x.shape) != (batch_size,):
      raise ValueError(f"SamplingArrays.{f.name} must have shape [{batch_size}] (one value per"
                       f" row of the batch), got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(x, jax.core.Tracer):
      _check_rows(f.name, x)
    want = jnp.int32 if f.name == "top_k" else jnp.float32
    out[f.name] = jnp.asarray(x, want)
  return SamplingArrays(**out)


def _check_rows(name: str, x) -> None:
  """Raises ValueError naming `SamplingArrays.<name>` and the first row whose concrete value
  `Sampling` would refuse (a fractional top_k included: the int32 cast would change it)."""
  a = np.asarray(x)
  if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.integer)
                                 or np.issubdtype(a.dtype, np.floating)):
    raise ValueError(f"SamplingArrays.{name} must hold numbers, got dtype {a.dtype}")
  f = a.astype(np.float64)
  lo, hi = {"temperature": (0, np.inf), "top_k": (0, 2**31 - 1), "top_p": (0, 1),
            "min_p": (0, 1)}[name]
  ok = np.isfinite(f) & (f >= lo) & (f <= hi)
  if name == "top_k":
    ok &= f == np.round(f)
  elif name == "top_p":
    ok &= f > 0
  if ok.all():
    return
  # The first bad row, with `Sampling`'s message for its value.
  for r, v in enumerate(a.tolist()):
    if name == "top_k" and isinstance(v, float) and v.is_integer():
      v = int(v)
    try:
      _check_value(name, v, per_row=True)
    except ValueError as e:
      raise ValueError(f"SamplingArrays.{name}, row {r}: {e}") from None
