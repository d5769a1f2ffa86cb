"""Sampling parameters and the one place where logits become a distribution.

Plain decoding, the drafters and the target's verification all call `process_logits` /
`probs` from here, so the draft distribution q and the target distribution p are built by the
same code with the same temperature, top-k, top-p and min-p — which the exactness of rejection
sampling depends on.

Before them, on the raw logits, the context-dependent adjustments (`adjust`), in vLLM v1's
order: `logit_bias` added, stop ids masked while a row is short of `min_new_tokens`, then the
repetition penalty (Hugging Face's rule, over prompt and generated tokens), then the presence
and frequency penalties (OpenAI's and vLLM's rule, over generated tokens only). They read the
row's context at the position being processed (`TokenHistory`), so a verify pass adjusts each
of its k + 1 positions with the drafts before it counted, as plain decoding would have.

Order of the filters: temperature, then top-k, then top-p over what top-k kept, then min-p, as
Hugging Face's warpers and vLLM v0 apply them (vLLM v1 applies min-p first; min-p compares
with the most likely token, which every filter keeps, so the order changes only what top-p
sees). Temperature 0 means greedy: the distribution is a one-hot on the argmax.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax


from jaxspec.checks import check_int  # noqa: E402
from jaxspec.pytree import pytree_dataclass as _pytree, static_field  # noqa: E402


# The fields holding one number per row, with the value that turns each off (None: always on).
_SCALARS = {"temperature": None, "top_k": None, "top_p": None, "min_p": None,
            "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "min_new_tokens": 0}
_INTEGER = ("top_k", "min_new_tokens")
# The context-dependent adjustments (`adjust`), in the order `SamplingArrays` holds them.
_ADJUSTMENTS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "min_new_tokens",
                "logit_bias")


def _is_traced(v) -> bool:
  return isinstance(v, jax.core.Tracer)


# The filters and the value that turns each off.
_FILTERS_OFF = {"top_k": 0, "top_p": 1.0, "min_p": 0.0}


def _off_in_every_row(v, off) -> bool:
  """Whether a `Sampling` field (one value, or a tuple of one per row) is concretely `off` in
  every row (False where it is traced: unknown before the program runs)."""
  return not _is_traced(v) and all(x == off for x in (v if isinstance(v, tuple) else (v,)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sampling:
  """User-facing sampling settings (numbers, or arrays: validated before anything compiles).

  Each field is one value for every row, or a sequence of one value per row (rows with
  different settings in one batch; its length must be the batch size).

  Attributes:
    temperature: 0 for greedy decoding, > 0 to sample (one so small that logits / temperature
      overflows float32 acts as its limit, the argmax: see `process_logits`; one below the
      smallest normal float32, which XLA would flush to 0, is raised to it).
    top_k: keep the k most likely tokens; 0 keeps all.
    top_p: keep the smallest set of tokens whose probability reaches top_p; 1 keeps all.
    min_p: drop tokens whose probability is below min_p times the most likely one's; 0 keeps all.
    repetition_penalty: > 0: the logit of every token present in the row's context (prompt and
      generated tokens) is divided by it where positive and multiplied by it where negative
      (Hugging Face's rule); 1 is off.
    presence_penalty: subtracted from the logit of every token generated at least once (the
      OpenAI / vLLM rule: the prompt does not count); 0 is off.
    frequency_penalty: times the number of times a token was generated, subtracted from its
      logit (OpenAI / vLLM); 0 is off.
    min_new_tokens: the call's stop ids (its EOS) get probability 0 until a row has generated
      this many tokens; at most the call's max_new_tokens; 0 is off.
    logit_bias: added to the logits before the rest: a {token id: bias} mapping, a [V]
      sequence or array of biases, or one of those per row (a [B, V] array); each bias finite,
      or -inf (never drawn). None (or {}) is off.

  The adjustments (the last five) act on the raw logits, before temperature and the filters
  (`adjust`); greedy rows take the argmax of the adjusted logits. One left at its off value in
  every row compiles nothing: the program is the one without it.

  A value may also be a JAX array, traced included (a `Sampling` built inside your own jit): a
  scalar or one per row [B] ([V] or [B, V] for logit_bias). Concrete arrays are checked as
  numbers are; traced ones only by shape and dtype (their values exist when the program runs).
  """

  temperature: Any = 0.0
  top_k: Any = 0
  top_p: Any = 1.0
  min_p: Any = 0.0
  repetition_penalty: Any = 1.0
  presence_penalty: Any = 0.0
  frequency_penalty: Any = 0.0
  min_new_tokens: Any = 0
  logit_bias: Any = None

  def __post_init__(self):
    for name in _SCALARS:
      v = getattr(self, name)
      if _is_traced(v):
        _check_traced(f"Sampling.{name}", v, 1, integer=name in _INTEGER)
        continue
      if isinstance(v, (str, bytes)) or not hasattr(v, "__len__") or getattr(v, "ndim", 1) == 0:
        _check_value(name, v)
        continue
      vals = tuple(v.tolist() if hasattr(v, "tolist") else v)
      if not vals:
        raise ValueError(f"{name} is an empty sequence: give one value, or one per row")
      for x in vals:
        _check_value(name, x, per_row=True)
      object.__setattr__(self, name, vals)
    object.__setattr__(self, "logit_bias", _normalize_bias(self.logit_bias))

  @property
  def per_row(self) -> bool:
    """Whether some field holds one value per row."""
    def rows(v):
      return isinstance(v, tuple) or (_is_traced(v) and v.ndim == 1)
    bias = self.logit_bias
    return any(rows(getattr(self, f)) for f in _SCALARS) or (
        bias is not None and (bias.ndim == 2 if _is_traced(bias) else bias.per_row))

  @property
  def greedy(self) -> bool:
    """Whether every row decodes greedily (False where the temperature is traced: unknown)."""
    t = self.temperature
    if _is_traced(t):
      return False
    return all(x == 0 for x in t) if isinstance(t, tuple) else t == 0

  @property
  def unfiltered(self) -> bool:
    """Whether top-k, top-p and min-p are off in every row (False where one is traced)."""
    return all(_off_in_every_row(getattr(self, name), off) for name, off in _FILTERS_OFF.items())

  def arrays(self, batch_size: int, vocab_size: int | None = None,
             max_new_tokens=None) -> SamplingArrays:
    """Per-row arrays, so a change of value does not recompile; an adjustment off in every row
    stays None (nothing compiled for it). vocab_size is needed by a `logit_bias` (checked: every
    token id below it) and max_new_tokens, when given, bounds `min_new_tokens`. Raises
    ValueError when a per-row field's length is not `batch_size`."""
    def full(name, dt):
      v = getattr(self, name)
      if name == "temperature" and not _is_traced(v):
        v = normal_temperature(v)
      if _is_traced(v):
        if v.ndim == 1 and v.shape[0] != batch_size:
          raise ValueError(f"Sampling.{name} has {v.shape[0]} values for a batch of"
                           f" {batch_size} rows: give one value, or exactly one per row")
        return jnp.broadcast_to(jnp.asarray(v, dt), (batch_size,))
      if isinstance(v, tuple):
        if len(v) != batch_size:
          raise ValueError(f"Sampling.{name} has {len(v)} values for a batch of {batch_size}"
                           f" rows: give one value, or exactly one per row")
        return jnp.asarray(v, dt)
      return jnp.full((batch_size,), v, dt)

    out = {}
    for name, off in _SCALARS.items():
      v = getattr(self, name)
      if off is not None and _off_in_every_row(v, off):
        continue  # off in every row: nothing compiled for it
      out[name] = full(name, jnp.int32 if name in _INTEGER else jnp.float32)
    if self.logit_bias is not None:
      out["logit_bias"] = _bias_array(self.logit_bias, batch_size, vocab_size)
    m = self.min_new_tokens
    # Off in every row (absent from `out`), min_new_tokens bounds nothing.
    if "min_new_tokens" in out and max_new_tokens is not None and not _is_traced(m) \
        and _is_concrete(max_new_tokens):
      _check_min_new(max(m) if isinstance(m, tuple) else m, int(max_new_tokens))
    return SamplingArrays(**out, all_greedy=bool(self.greedy), unfiltered=self.unfiltered)


def _is_concrete(x) -> bool:
  return not _is_traced(x) and (not hasattr(x, "ndim") or x.ndim == 0)


def _check_min_new(min_new: int, max_new: int, where: str = "") -> None:
  if min_new > max_new:
    raise ValueError(f"min_new_tokens{where} is {min_new} but max_new_tokens is {max_new}: a"
                     f" row must be allowed to stop within its budget; lower min_new_tokens to"
                     f" at most {max_new} (or raise max_new_tokens)")


def _check_traced(name: str, v, max_ndim: int, integer: bool = False) -> None:
  """Raises ValueError for a traced value of the wrong rank or dtype (its values are unknown)."""
  if v.ndim > max_ndim:
    shapes = "a scalar or [B]" if max_ndim == 1 else "[V] or [B, V]"
    raise ValueError(f"{name} must be {shapes}, got a traced array of shape {tuple(v.shape)}")
  ok = jnp.issubdtype(v.dtype, jnp.integer) if integer else (
      jnp.issubdtype(v.dtype, jnp.integer) or jnp.issubdtype(v.dtype, jnp.floating))
  if v.dtype == jnp.bool_ or not ok:
    raise ValueError(f"{name} must hold {'integers' if integer else 'numbers'}, got a traced"
                     f" array of dtype {v.dtype}")


_FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32, ~1.18e-38


def normal_temperature(v):
  """A positive temperature below the smallest normal float32 raised to it: XLA on CPU (and
  GPUs) flushes subnormals to 0, which would make the row greedy (the first of tied tokens)
  instead of the limit every such small temperature stands for (uniform over ties: see
  `process_logits`). Zeros and larger values are kept."""
  def one(t):
    t = t.item() if hasattr(t, "item") else t
    return _FLOAT32_TINY if 0 < t < _FLOAT32_TINY else t
  return tuple(map(one, v)) if isinstance(v, tuple) else one(v)


def _check_value(name: str, v, per_row: bool = False) -> None:
  """Raises ValueError for a sampling value outside its range (naming the field)."""
  if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
    v = v.item()
  where = " (each row's)" if per_row else ""
  number = not isinstance(v, bool) and isinstance(v, (int, float))
  if name == "temperature":
    if not number or not math.isfinite(v) or v < 0:
      raise ValueError(f"temperature{where} must be a finite number >= 0 (0 means greedy), got"
                       f" {v!r}")
  elif name in _INTEGER:
    why = ("0 disables it; a value past the vocabulary keeps all" if name == "top_k" else
           "new tokens before a stop id may be drawn; 0 disables it")
    check_int(f"{name}{where}", v, 0, 2**31 - 1, numpy=False, why=why)
  elif name == "top_p":
    if not number or math.isnan(v) or not 0 < v <= 1:
      raise ValueError(f"top_p{where} must be in (0, 1] (1 disables it), got {v!r}")
  elif name == "min_p":
    if not number or math.isnan(v) or not 0 <= v <= 1:
      raise ValueError(f"min_p{where} must be in [0, 1] (0 disables it), got {v!r}")
  elif name == "repetition_penalty":
    if not number or not math.isfinite(v) or v <= 0:
      raise ValueError(f"repetition_penalty{where} must be a finite number > 0 (1 disables it;"
                       f" > 1 discourages repeating the context), got {v!r}")
  elif not number or not math.isfinite(v):  # presence_penalty, frequency_penalty
    raise ValueError(f"{name}{where} must be a finite number (0 disables it; > 0 discourages"
                     f" repeating generated tokens), got {v!r}")


@dataclasses.dataclass(frozen=True)
class _LogitBias:
  """`Sampling.logit_bias`, checked: sorted (token id, bias) pairs for every row, or one tuple
  of them per row; width: the length of a dense [V] form (checked against the vocabulary)."""

  rows: tuple
  per_row: bool
  width: int | None = None

  def __repr__(self):
    show = lambda r: "{" + ", ".join(f"{t}: {b!r}" for t, b in r) + "}"
    return "[" + ", ".join(map(show, self.rows)) + "]" if self.per_row else show(self.rows)


def _bias_pairs(items, where: str) -> tuple:
  """Checked, sorted (token id, bias) pairs."""
  out = {}
  for tok, bias in items:
    if hasattr(tok, "item") and getattr(tok, "ndim", 0) == 0:
      tok = tok.item()
    check_int(f"logit_bias{where} token id", tok, 0, 2**31 - 1, numpy=False,
              why="a logit_bias maps token ids to the bias added to their logits")
    if hasattr(bias, "item") and getattr(bias, "ndim", 0) == 0:
      bias = bias.item()
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or math.isnan(bias) \
        or bias == math.inf:
      raise ValueError(f"logit_bias{where}[{tok}] must be a finite number or -inf (never"
                       f" drawn), got {bias!r}")
    out[int(tok)] = float(bias)
  return tuple(sorted(out.items()))


def _dense_pairs(a: np.ndarray, where: str) -> tuple:
  """The nonzero entries of a dense [V] bias row as pairs (checked)."""
  if not (np.issubdtype(a.dtype, np.integer) or np.issubdtype(a.dtype, np.floating)) \
      or a.dtype == np.bool_:
    raise ValueError(f"logit_bias{where} must hold numbers, got dtype {a.dtype}")
  bad = np.isnan(a) | (a == np.inf)
  if bad.any():
    t = int(np.argmax(bad))
    raise ValueError(f"logit_bias{where}[{t}] must be a finite number or -inf (never drawn),"
                     f" got {a[t]!r}")
  nz = np.flatnonzero(a)
  return tuple((int(t), float(a[t])) for t in nz)


def _normalize_bias(v):
  """`Sampling.logit_bias` as None (off), a `_LogitBias`, or a traced array ([V] / [B, V])."""
  if v is None or isinstance(v, _LogitBias):
    return v
  if _is_traced(v):
    if v.ndim not in (1, 2):
      raise ValueError(f"Sampling.logit_bias must be [V] or [B, V] when it is an array, got a"
                       f" traced array of shape {tuple(v.shape)}")
    _check_traced("Sampling.logit_bias", v, 2)
    return v
  if isinstance(v, Mapping):
    pairs = _bias_pairs(v.items(), "")
    return _LogitBias(pairs, per_row=False) if pairs else None
  if isinstance(v, (str, bytes)) or not hasattr(v, "__len__"):
    raise ValueError(f"logit_bias must be a {{token id: bias}} mapping, a [V] array of biases"
                     f" or one of them per row, got {type(v).__name__}")
  if not hasattr(v, "shape") and len(v) and all(isinstance(r, Mapping) for r in v):
    rows = tuple(_bias_pairs(r.items(), f" (row {i})") for i, r in enumerate(v))
    return _LogitBias(rows, per_row=True) if any(rows) else None
  try:
    a = np.asarray(v)
  except ValueError:
    a = np.asarray(v, dtype=object)
  if a.ndim == 1 and a.size:
    pairs = _dense_pairs(a, "")
    return _LogitBias(pairs, per_row=False, width=a.shape[0]) if pairs else None
  if a.ndim == 2 and a.size:
    rows = tuple(_dense_pairs(r, f" (row {i})") for i, r in enumerate(a))
    return _LogitBias(rows, per_row=True, width=a.shape[1]) if any(rows) else None
  raise ValueError(f"logit_bias must be a {{token id: bias}} mapping, a [V] array of biases or"
                   f" one of them per row ([B, V]), got shape {a.shape}")


def _bias_array(bias, batch_size: int, vocab_size: int | None) -> jax.Array:
  """logit_bias as [B, V] float32 (checked against the vocabulary and the batch)."""
  if vocab_size is None:
    raise ValueError("Sampling.logit_bias needs the vocabulary size: pass"
                     " arrays(batch_size, vocab_size=...) (the loops' entry points do)")
  if _is_traced(bias):
    if bias.shape[-1] != vocab_size or (bias.ndim == 2 and bias.shape[0] != batch_size):
      raise ValueError(f"Sampling.logit_bias must be [V] or [B, V] = [{batch_size},"
                       f" {vocab_size}], got shape {tuple(bias.shape)}")
    return jnp.broadcast_to(jnp.asarray(bias, jnp.float32), (batch_size, vocab_size))
  if bias.width is not None and bias.width != vocab_size:
    raise ValueError(f"logit_bias has {bias.width} entries per row but the vocabulary has"
                     f" {vocab_size}: give one bias per token (or a {{token id: bias}} mapping)")
  rows = bias.rows if bias.per_row else (bias.rows,) * batch_size
  if len(rows) != batch_size:
    raise ValueError(f"Sampling.logit_bias has {len(rows)} rows for a batch of {batch_size}"
                     f" rows: give one mapping, or exactly one per row")
  out = np.zeros((batch_size, vocab_size), np.float32)
  for r, pairs in enumerate(rows):
    for tok, b in pairs:
      if tok >= vocab_size:
        where = f" (row {r})" if bias.per_row else ""
        raise ValueError(f"logit_bias{where} has token id {tok}, outside the vocabulary [0,"
                         f" {vocab_size}): bias only the model's tokens")
      out[r, tok] = b
  return jnp.asarray(out)


GREEDY = Sampling()


@_pytree
@dataclasses.dataclass
class SamplingArrays:
  """Per-row sampling values as arrays (traced inside jit)."""

  temperature: jax.Array  # [B] float32, 0 = greedy
  top_k: jax.Array  # [B] int32, 0 = off
  top_p: jax.Array  # [B] float32, 1 = off
  min_p: jax.Array  # [B] float32, 0 = off
  # The context-dependent adjustments (`adjust`); None: off, and nothing compiled for it.
  repetition_penalty: jax.Array | None = None  # [B] float32 > 0, 1 = no change
  presence_penalty: jax.Array | None = None  # [B] float32
  frequency_penalty: jax.Array | None = None  # [B] float32
  min_new_tokens: jax.Array | None = None  # [B] int32
  logit_bias: jax.Array | None = None  # [B, V] float32
  # Static (the program's, not an array): every row decodes greedily, so nothing of sampling is
  # compiled (no filters, draws or residuals; the per-row choice costs twice the compile time
  # of a greedy loop on the CPU). `Sampling.arrays` sets it when every temperature is a
  # concrete 0; False leaves the choice to each row's temperature at run time.
  all_greedy: bool = static_field(False)
  # Static: top-k, top-p and min-p are off in every row, so no filter is compiled (they cost
  # about half the XLA compile time of a sampled decode loop on the CPU). `Sampling.arrays` sets
  # it when all three are concrete and off; False leaves the filters to each row at run time.
  unfiltered: bool = static_field(False)

  @property
  def adjusts(self) -> bool:
    """Whether some adjustment is on (static: the pytree's structure), so the loops keep a
    `TokenHistory`."""
    return any(getattr(self, f) is not None for f in _ADJUSTMENTS)

  @property
  def counts_tokens(self) -> bool:
    """Whether a penalty reads how often each token occurs (the history's [B, V] counts)."""
    return any(getattr(self, f) is not None for f in _ADJUSTMENTS[:3])


@_pytree
@dataclasses.dataclass
class TokenHistory:
  """What the adjustments read of each row's context before the position they process: kept by
  the loops beside their token buffer (only when `SamplingArrays.adjusts`), and extended by the
  drafts inside a step, so every position is adjusted with the context it would have."""

  n_new: jax.Array  # [B] int32 tokens generated so far
  stop_ids: jax.Array  # [S] int32 the ids `min_new_tokens` holds back (the call's stop ids)
  counts: jax.Array | None = None  # [B, V] int32 times each token was generated (penalties)
  in_prompt: jax.Array | None = None  # [B, V] bool the prompt's tokens (repetition penalty)


def start_history(sp: SamplingArrays, prompt: jax.Array, prompt_len: jax.Array,
                  vocab_size: int, stop_ids) -> TokenHistory | None:
  """The history after the prompt [B, P] (right-padded, prompt_len [B]) with nothing generated;
  None when `sp` adjusts nothing (the loops then carry nothing)."""
  if not sp.adjusts:
    return None
  b, pw = prompt.shape
  counts = in_prompt = None
  if sp.counts_tokens:
    counts = jnp.zeros((b, vocab_size), jnp.int32)
  if sp.repetition_penalty is not None:
    keep = (jnp.arange(pw)[None, :] < prompt_len[:, None]) & (prompt >= 0) & (prompt < vocab_size)
    in_prompt = jnp.zeros((b, vocab_size), bool).at[
        jnp.arange(b)[:, None], jnp.where(keep, prompt, vocab_size)].set(True, mode="drop")
  return TokenHistory(n_new=jnp.zeros((b,), jnp.int32),
                      stop_ids=jnp.asarray(tuple(stop_ids), jnp.int32).reshape(-1),
                      counts=counts, in_prompt=in_prompt)


def extend_history(h: TokenHistory | None, tokens: jax.Array, n: jax.Array | None = None):
  """h with each row's tokens[:, :n] generated (tokens [B, T], or [B]: one each; n [B] int or
  bool, 0 for a row that emitted nothing; None: all T). None for h None (nothing is traced
  then)."""
  if h is None:
    return None
  tokens = tokens[:, None] if tokens.ndim == 1 else tokens
  b, t = tokens.shape
  n = jnp.full((b,), t, jnp.int32) if n is None else n.astype(jnp.int32)
  counts = h.counts
  if counts is not None:
    v = counts.shape[1]
    take = (jnp.arange(t)[None, :] < n[:, None]) & (tokens >= 0) & (tokens < v)
    counts = counts.at[jnp.arange(b)[:, None], jnp.where(take, tokens, v)].add(1, mode="drop")
  return dataclasses.replace(h, n_new=h.n_new + n, counts=counts)


def adjust(logits: jax.Array, sp: SamplingArrays, h: TokenHistory | None,
           added: jax.Array | None = None, n_added: jax.Array | None = None) -> jax.Array:
  """The logits [B, ..., V] with the context-dependent adjustments applied (float32), in vLLM
  v1's order: logit_bias added; stop ids masked (-inf) while fewer than min_new_tokens are
  generated; the repetition penalty on every token of the context (logit / r where positive,
  logit * r otherwise); presence and frequency penalties subtracted per generated token. The
  logits come back as they are when nothing is on (no program change).

  Position i of the logits has the context of `h` plus, where given, the tokens generated after
  it: added [B, ..., V] int32 their counts and n_added [B, ...] int32 their number (a verify
  pass's drafts before position i: `chain_context`, `tree_context`)."""
  if h is None or not sp.adjusts:
    return logits
  x = logits.astype(jnp.float32)
  nd = x.ndim
  b, v = x.shape[0], x.shape[-1]
  row = lambda a: a.reshape((b,) + (1,) * (nd - 2) + (v,))  # [B, V] -> [B, 1.., V]
  if sp.logit_bias is not None:
    x = x + row(sp.logit_bias)
  if sp.min_new_tokens is not None and h.stop_ids.shape[0]:
    n_new = _expand(h.n_new, nd - 1) + (0 if n_added is None else n_added)
    held = n_new < _expand(sp.min_new_tokens, nd - 1)  # [B, ...]
    stop = jnp.zeros((v,), bool).at[h.stop_ids].set(True, mode="drop")
    x = jnp.where(held[..., None] & stop, -jnp.inf, x)
  if not sp.counts_tokens:
    return x
  counts = row(h.counts) + (0 if added is None else added)
  if sp.repetition_penalty is not None:
    seen = (counts > 0) | row(h.in_prompt)
    r = _expand(sp.repetition_penalty, nd)
    x = jnp.where(seen, jnp.where(x > 0, x / r, x * r), x)
  if sp.frequency_penalty is not None:
    x = x - _expand(sp.frequency_penalty, nd) * counts
  if sp.presence_penalty is not None:
    x = x - _expand(sp.presence_penalty, nd) * (counts > 0)
  return x


def chain_context(sp: SamplingArrays, drafts: jax.Array, vocab_size: int):
  """(added, n_added) of `adjust` for a verify pass over [last, drafts [B, k]]: position i
  follows drafts[:, :i]. (None, None) when nothing is on."""
  if not sp.adjusts:
    return None, None
  b, k = drafts.shape
  n_added = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
  if not sp.counts_tokens:
    return None, n_added
  one = jax.nn.one_hot(drafts, vocab_size, dtype=jnp.int32)  # an id outside counts nothing
  added = jnp.concatenate([jnp.zeros((b, 1, vocab_size), jnp.int32), jnp.cumsum(one, axis=1)],
                          axis=1)
  return added, n_added


def tree_context(sp: SamplingArrays, tokens: jax.Array, ancestors: jax.Array, depth: jax.Array,
                 vocab_size: int):
  """(added, n_added) of `adjust` for a tree pass: node i (tokens [B, N], node 0 the root,
  already in the history) follows the nodes on its path, itself included (ancestors [B, N, N]
  bool: node j is i or an ancestor of i), depth [B, N] of them."""
  if not sp.adjusts:
    return None, None
  if not sp.counts_tokens:
    return None, depth
  on_path = (ancestors & (jnp.arange(tokens.shape[1]) > 0)[None, None, :]).astype(jnp.int32)
  one = jax.nn.one_hot(tokens, vocab_size, dtype=jnp.int32)
  return jnp.einsum("bij,bjv->biv", on_path, one), depth


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


_SIGN = 0x80000000


def _order_keys(x: jax.Array) -> jax.Array:
  """float32 -> uint32 keys in the same order (-0 as +0; -inf lowest), for the bisections."""
  i = lax.bitcast_convert_type(jnp.where(x == 0, jnp.float32(0), x), jnp.uint32)
  sign = jnp.uint32(_SIGN)
  return jnp.where(i >= sign, ~i, i | sign)


def _largest_key(pred, shape) -> jax.Array:
  """Per row, the largest uint32 t with pred(t) true, for pred true up to some t and false
  after it, false at 2**32 - 1 (0 when pred(0) is false too): 32 halvings."""
  def halve(_, c):
    lo, hi = c
    mid = lo + (hi - lo) // 2
    ok = pred(mid)
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)
  lo, _ = lax.fori_loop(0, 32, halve, (jnp.zeros(shape, jnp.uint32),
                                       jnp.full(shape, 0xFFFFFFFF, jnp.uint32)))
  return lo


def _filter_bisect(logits: jax.Array, sp: SamplingArrays) -> jax.Array:
  """`_filter_sorted`'s filters without sorting the vocabulary (XLA's CPU sort of a [B, V]
  row of logits takes longer than the model's decode step): top-k's k-th value is the largest
  key that at least k tokens reach, and top-p's edge the largest key whose tokens and those
  above it hold top_p, each found by 32 halvings of a count or a masked sum over the vocabulary;
  among tokens tied at the edge, the lower ids come first, as in the sorted order. The same
  tokens as `_filter_sorted` up to float rounding of the mass before the edge (summed in
  another order). Each bisection runs only when some row uses its filter."""
  nd = logits.ndim
  v = logits.shape[-1]
  u = _order_keys(logits)
  rows = logits.shape[:-1] + (1,)
  everything = jnp.ones(logits.shape, jnp.bool_)
  k = jnp.minimum(_expand(sp.top_k, nd), v)

  def top_k_keep():
    kth = _largest_key(lambda t: jnp.sum(u >= t, axis=-1, keepdims=True) >= k, rows)
    return (k == 0) | (u >= kth)

  keep = lax.cond(jnp.any(k > 0), top_k_keep, lambda: everything)
  top_p = _expand(sp.top_p, nd)

  def top_p_keep():
    pr = jax.nn.softmax(jnp.where(keep, logits, -jnp.inf), axis=-1)
    edge = _largest_key(
        lambda t: jnp.sum(jnp.where(u >= t, pr, 0.0), axis=-1, keepdims=True) >= top_p, rows)
    above = jnp.sum(jnp.where(u > edge, pr, 0.0), axis=-1, keepdims=True)
    tied = jnp.where(u == edge, pr, 0.0)
    before = above + jnp.cumsum(tied, axis=-1) - tied  # mass before each token tied at the edge
    return (top_p >= 1) | (u > edge) | ((u == edge) & (before < top_p))

  keep = keep & lax.cond(jnp.any(top_p < 1), top_p_keep, lambda: everything)
  min_p = _expand(sp.min_p, nd)
  top = jnp.max(logits, axis=-1, keepdims=True)
  keep = keep & ((min_p <= 0) | (logits >= top + jnp.log(jnp.maximum(min_p, 1e-30))))
  first = jnp.argmax(logits, axis=-1)[..., None]  # the most likely token (lowest id) survives
  keep = keep | (lax.broadcasted_iota(jnp.int32, logits.shape, nd - 1) == first)
  return jnp.where(keep, logits, -jnp.inf)


def process_logits(logits: jax.Array, sp: SamplingArrays) -> jax.Array:
  """Temperature-scaled, filtered float32 logits [B, ..., V] for the sampled rows.

  Rows with temperature 0 come back unscaled (their distribution is the argmax one-hot; see
  `probs`). A positive temperature below float32's resolution for the logits (one where some
  |logit| / temperature exceeds float32's largest value, ~3.4e38: below about 1e-37 for
  logits near 30) acts as its limit T -> 0: 0 on the largest logit's tokens and -inf elsewhere,
  so the distribution is the argmax one-hot (uniform over exact ties) and the chosen token's
  log-probability is 0 (log(1/n) for n tied), finite. Filtering sorts the vocabulary (on the
  CPU it bisects instead: `_filter_bisect`), so it runs only when some row asks for it, and
  is not compiled at all under `SamplingArrays.unfiltered`.
  """
  logits = logits.astype(jnp.float32)
  if sp.all_greedy:
    return logits
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
  if sp.unfiltered:
    return logits
  needs = jnp.any((sp.temperature > 0) & ((sp.top_k > 0) | (sp.top_p < 1) | (sp.min_p > 0)))
  filtered = lambda l: lax.platform_dependent(l, sp, cpu=_filter_bisect, default=_filter_sorted)
  return lax.cond(needs, filtered, lambda l: l, logits)


def probs(logits: jax.Array, sp: SamplingArrays) -> jax.Array:
  """The distribution [B, ..., V] (float32) that decoding samples from.

  Greedy rows get a one-hot on the argmax, which makes rejection sampling reduce exactly to
  greedy acceptance (accept while the draft equals the argmax, emit the argmax at the first
  mismatch).
  """
  hard = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=jnp.float32)
  if sp.all_greedy:
    return hard
  greedy = _expand(sp.temperature, logits.ndim) == 0

  def mixed(logits):
    return jnp.where(greedy, hard, jax.nn.softmax(process_logits(logits, sp), axis=-1))

  # An all-greedy batch skips the softmax over the vocabulary (the common benchmark case).
  return lax.cond(jnp.all(sp.temperature == 0), lambda l: hard, mixed, logits)


def greedy_rows(sp: SamplingArrays) -> jax.Array | bool:
  """The rows decoded greedily: sp.temperature == 0 [B], or True (a Python bool) when
  `sp.all_greedy` (every row, known before compiling: `sample_from_probs`, `sample_positions`
  and the acceptance rules then compile no draw)."""
  return True if sp.all_greedy else sp.temperature == 0


def sample(keys: jax.Array, logits: jax.Array, sp: SamplingArrays) -> jax.Array:
  """One token per row from logits [B, V] with per-row keys [B]; greedy rows take the argmax.

  Sampled rows draw from `probs`' distribution (the float32 softmax of `process_logits`) with
  `draw`, as the speculative loops draw from the target's p, so a key gives the same text."""
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if sp.all_greedy:
    return greedy

  def drawn(logits):
    tok = draw(keys, jax.nn.softmax(process_logits(logits, sp), axis=-1))
    return jnp.where(sp.temperature == 0, greedy, tok)

  # An all-greedy batch draws no random numbers.
  return lax.cond(jnp.all(sp.temperature == 0), lambda l: greedy, drawn, logits)


# Tokens per block of `draw`: a row costs a sum over its blocks, V / 256 + 256 random numbers
# and two argmaxes of a few hundred entries, not V random numbers.
_DRAW_BLOCK = 256


def draw(keys: jax.Array, p: jax.Array) -> jax.Array:
  """Tokens [...] int32 drawn from unnormalised probabilities p [..., V] (zeros allowed) with
  keys [...]: the one categorical draw of jaxspec (plain decoding, the target's draws in a
  speculative step, the residual after a rejection, the drafters' drafts).

  A Gumbel-max in two levels: the vocabulary is cut into blocks of 256 tokens; a Gumbel-max
  over the blocks' log-masses picks a block (P = its mass / the total), then a Gumbel-max over
  that block's log-probabilities picks the token (P = p_i / the block's mass), with noise
  independent of the first level's: token i is drawn with probability p_i / sum(p), exactly as
  far as a Gumbel-max over all V is (float32 noise reaches about 16 at each level, so a block
  below about 1e-7 of the total, or a token below 1e-7 of its block, is drawn less often than
  it should be, as `jax.random.categorical`'s default mode does below 1e-7 of the largest
  token). A draw costs V / 256 + 256 random numbers (one threefry
  call) and O(V) additions, where `jax.random.categorical` over V draws V random numbers.

  Two draws with one key from nearby distributions (a coupled drafter's q and the target's p)
  share their noise block by block and token by token, so they coincide about as often as a
  Gumbel-max over all V makes them (an inverse CDF with one uniform would drift apart along
  the vocabulary: far less often).

  A token of probability 0 is never drawn, whatever the rounding: an entry of weight 0 (a
  token, or a block all of whose tokens are 0: a float sum of zeros is 0, and of nonnegative
  numbers with a positive one is positive) scores -inf, any positive one a finite log plus
  finite noise, so each argmax lands on a positive entry; the padding of the last block is 0.
  Only a row with no positive entry at all (never a distribution) draws token 0 (a backend
  that flushes subnormals reads a subnormal entry as 0).
  """
  lead, v = p.shape[:-1], p.shape[-1]
  p = p.reshape((-1, v)).astype(jnp.float32)  # [N, V]
  size = min(_DRAW_BLOCK, v)
  n_blocks = -(-v // size)
  blocks = jnp.pad(p, ((0, 0), (0, n_blocks * size - v))).reshape(
      (-1, n_blocks, size))  # [N, nb, size]
  keys = keys.reshape((-1,) + keys.shape[len(lead):])  # [N] (raw uint32 keys: [N, 2])
  noise = jax.vmap(lambda k: jax.random.gumbel(k, (n_blocks + size,)))(keys)  # [N, nb + size]
  block = jnp.argmax(_log_weight(jnp.sum(blocks, axis=-1)) + noise[:, :n_blocks], axis=-1)
  inside = jnp.take_along_axis(blocks, block[:, None, None], axis=1)[:, 0]  # [N, size]
  tok = block * size + jnp.argmax(_log_weight(inside) + noise[:, n_blocks:], axis=-1)
  return tok.astype(jnp.int32).reshape(lead)


def _log_weight(w: jax.Array) -> jax.Array:
  """log w, and -inf exactly where w is 0 (never drawn)."""
  return jnp.where(w > 0, jnp.log(jnp.maximum(w, 1e-38)), -jnp.inf)


def sample_from_probs(keys: jax.Array, p: jax.Array, one_hot: jax.Array | None = None,
                      ) -> jax.Array:
  """One token per row from unnormalised probabilities p [B, V] (zeros allowed) with keys [B]
  (`draw`).

  one_hot: [B] bool rows known to hold a one-hot p (greedy decoding): they take the argmax,
  and when every row does no random numbers are drawn; True (`greedy_rows` of an all-greedy
  `SamplingArrays`): every row, and no draw is compiled.
  """
  if one_hot is None:
    return draw(keys, p)
  top = jnp.argmax(p, axis=-1).astype(jnp.int32)
  if one_hot is True:
    return top
  return lax.cond(jnp.all(one_hot), lambda p: top,
                  lambda p: jnp.where(one_hot, top, draw(keys, p)), p)


def sample_positions(keys: jax.Array, p: jax.Array, greedy: jax.Array | None = None) -> jax.Array:
  """[B, T] tokens drawn from p [B, T, V] with keys [B, T] (`draw`: `generate`'s draw of each
  position's token with its key); greedy rows (one-hot p) take the argmax, and an all-greedy
  batch draws nothing (greedy True: every row, and no draw is compiled)."""
  top = jnp.argmax(p, axis=-1).astype(jnp.int32)
  if greedy is True:
    return top

  def drawn(p):
    y = draw(keys, p)
    return y if greedy is None else jnp.where(greedy[:, None], top, y)

  if greedy is None:
    return drawn(p)
  return lax.cond(jnp.all(greedy), lambda p: top, drawn, p)


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
                       f" {', '.join(f.name for f in dataclasses.fields(Sampling))}")
    return Sampling(**sampling)
  if not isinstance(sampling, Sampling):
    raise ValueError(f"sampling must be a jaxspec Sampling (or, inside jit,"
                     f" SamplingArrays), got {type(sampling).__name__}")
  return sampling


def sampling_arrays(sampling, batch_size: int, vocab_size: int | None = None,
                    max_new_tokens=None) -> SamplingArrays:
  """`SamplingArrays` [B] from a `Sampling` (one value, or one per row), a dict or None
  (`resolve_sampling`), or from `SamplingArrays` (checked: every field [B], logit_bias [B, V],
  and, where an array is concrete, every row's value in the range `Sampling` allows).
  vocab_size: the model's (a logit_bias needs it); max_new_tokens (an int, when known) bounds
  min_new_tokens. Raises ValueError naming a field of the wrong shape or dtype, or the row
  whose value is out of range; works on traced arrays (only their shapes can be checked before
  the program runs)."""
  if not isinstance(sampling, SamplingArrays):
    return resolve_sampling(sampling).arrays(batch_size, vocab_size, max_new_tokens)
  out = {}
  for f in dataclasses.fields(SamplingArrays):
    if f.metadata.get("static"):
      continue
    x = getattr(sampling, f.name)
    if x is None and f.name in _ADJUSTMENTS:
      continue
    if f.name == "logit_bias":
      shape = f"[{batch_size}, {'V' if vocab_size is None else vocab_size}] (one bias per token"
      ok = getattr(x, "ndim", 0) == 2 and x.shape[0] == batch_size and (
          vocab_size is None or x.shape[1] == vocab_size)
    else:
      shape, ok = f"[{batch_size}] (one value", tuple(getattr(x, "shape", ())) == (batch_size,)
    if not hasattr(x, "shape") or not ok:
      raise ValueError(f"SamplingArrays.{f.name} must have shape {shape} per row of the batch),"
                       f" got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(x, jax.core.Tracer):
      _check_rows(f.name, x)
    want = jnp.int32 if f.name in _INTEGER else jnp.float32
    out[f.name] = jnp.asarray(x, want)
  m = out.get("min_new_tokens")
  if m is not None and max_new_tokens is not None and _is_concrete(max_new_tokens) \
      and not isinstance(sampling.min_new_tokens, jax.core.Tracer):
    _check_min_new(int(np.max(np.asarray(m))), int(max_new_tokens), " (SamplingArrays)")
  t = sampling.temperature
  if sampling.all_greedy and not _is_traced(t) and np.any(np.asarray(t) != 0):
    raise ValueError("SamplingArrays.all_greedy is True but some row's temperature is not 0:"
                     " leave all_greedy False for rows that sample (it compiles no sampling)")
  if sampling.unfiltered:
    for name, off in _FILTERS_OFF.items():
      x = getattr(sampling, name)
      if not _is_traced(x) and np.any(np.asarray(x) != off):
        raise ValueError(f"SamplingArrays.unfiltered is True but some row's {name} is not"
                         f" {off}: leave unfiltered False for rows that filter (it compiles no"
                         " filter)")
  return SamplingArrays(**out, all_greedy=sampling.all_greedy, unfiltered=sampling.unfiltered)


def _check_rows(name: str, x) -> None:
  """Raises ValueError naming `SamplingArrays.<name>` and the first row whose concrete value
  `Sampling` would refuse (a fractional top_k included: the int32 cast would change it)."""
  a = np.asarray(x)
  if a.dtype == np.bool_ or not (np.issubdtype(a.dtype, np.integer)
                                 or np.issubdtype(a.dtype, np.floating)):
    raise ValueError(f"SamplingArrays.{name} must hold numbers, got dtype {a.dtype}")
  f = a.astype(np.float64)
  if name == "logit_bias":
    bad = np.isnan(f) | (f == np.inf)
    if bad.any():
      r, t = np.argwhere(bad)[0]
      raise ValueError(f"SamplingArrays.logit_bias, row {r}, token {t}: a bias must be a finite"
                       f" number or -inf (never drawn), got {a[r, t]!r}")
    return
  lo, hi = {"temperature": (0, np.inf), "top_k": (0, 2**31 - 1), "top_p": (0, 1),
            "min_p": (0, 1), "repetition_penalty": (0, np.inf),
            "presence_penalty": (-np.inf, np.inf), "frequency_penalty": (-np.inf, np.inf),
            "min_new_tokens": (0, 2**31 - 1)}[name]
  ok = np.isfinite(f) & (f >= lo) & (f <= hi)
  if name in _INTEGER:
    ok &= f == np.round(f)
  elif name in ("top_p", "repetition_penalty"):
    ok &= f > 0
  if ok.all():
    return
  # The first bad row, with `Sampling`'s message for its value.
  for r, v in enumerate(a.tolist()):
    if name in _INTEGER and isinstance(v, float) and v.is_integer():
      v = int(v)
    try:
      _check_value(name, v, per_row=True)
    except ValueError as e:
      raise ValueError(f"SamplingArrays.{name}, row {r}: {e}") from None
