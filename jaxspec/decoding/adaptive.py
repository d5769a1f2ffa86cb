"""Adaptive speculation: choose how many tokens to draft at every step, including none.

Three pieces, each a pure function over arrays so they run inside the jitted loop:

* **An acceptance model.** Per row and per draft position i, exponentially decayed counts of
  how often draft i was tried (drafts 1..i-1 accepted) and accepted, giving the conditional
  acceptance probability a[b, i], shrunk towards the row's rate over all positions (so a
  position never tried yet is estimated from the others). Counts decay every step, observed or
  not, so a row that stopped drafting drifts back to the prior and is probed again later. The
  row's pooled rate forgets four times slower than the positions' counts: a drafter whose
  probes keep failing is probed again after about a hundred plain steps, not twenty (where a
  probe costs much more than a plain step, as a wide verify on a CPU does, a drafter that is
  never accepted would otherwise lose a step's worth of time every twenty), while a row whose
  drafts are verified every step follows its positions' fast counts. A
  drafter whose proposals are free (made before k is chosen) is observed on plain steps too:
  the emitted token says whether its first draft would have been accepted (`update_counts`).
* **A cost model.** The seconds of one loop step that drafts k tokens and verifies them, for
  every compiled width k (k = 0 is a plain one-token decode step), and how they grow per cached
  position: measured at start-up on the actual batch, cache size and drafter, at the prompt's
  length and at a short cache (`jaxspec.engine.costs.measure_costs`), or given (`CostModel`). The
  controller weighs them at the longest live row's current length.
* **The controller.** With E_b(k) = 1 + sum_{j<=k} prod_{i<=j} a[b, i] the expected tokens a
  live row emits when k drafts are verified (at most as many as the drafter really proposed),
  choose the width k maximising sum_b E_b(k) / cost(k). For i.i.d. acceptance alpha this is the
  textbook (1 - alpha^(k+1)) / ((1 - alpha) (k c + v(k))). A k > 0 must beat k = 0 by
  `AutoK.margin`.

Choosing k depends only on the past, and every step's rejection sampling is exact for any k,
so the output distribution is still exactly the target's.

The verify width is bucketed: each k in `AutoK.buckets` is its own branch of a `lax.switch`,
compiled once, so a step pays for the width it uses (on CPUs a (k+1)-token verify costs far
more than a decode step). The alternative, one width masked per row, is `AutoK(buckets=(0,
k_max))`; `benchmarks/bench_adaptive.py` measures both. While the controller keeps choosing
k = 0, the loop runs those plain steps in an inner `lax.while_loop` as `generate`'s decode step
(the forward writing its cache entry in place), so a batch that never drafts decodes at plain
decoding's speed (a plain branch of the switch reads the cache and writes after it: at batch 16
a step 96 ms against 90).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checks import is_int
from jaxspec.pytree import pytree_dataclass as _pytree

_DEFAULT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)


def _is_real(v) -> bool:
  """A real number (not a bool, not NaN): what a float field of the configs may hold."""
  return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) \
      and not np.isnan(v)


# The most drafts a step may verify (AutoK.k_max, a fixed num_draft_tokens): every bucket is a
# compiled branch over k + 1 tokens; past a few hundred no drafter gains anything.
MAX_K = 256


@dataclasses.dataclass(frozen=True, kw_only=True)
class AutoK:
  """Configuration of `num_draft_tokens="auto"`.

  Attributes:
    k_max: the most drafts per step.
    buckets: the compiled draft counts the controller chooses from (0 = a plain decode step);
      default 0, 1, 2, 3, 4, 6, 8, ... up to k_max (k_max included).
    decay: per-step forgetting factor of the acceptance counts (0.95: about the last 20 steps).
    prior: Beta pseudo-counts (accepted, rejected) of every position's acceptance estimate.
    margin: drafting is chosen only when its predicted rate beats a plain step's by this
      fraction. Both models are estimates (a cost timed once on a shared machine varies by
      +-10%); at a break-even prediction a draft is as likely to lose as to win, and losing
      costs more than the margin gives up.
    carry: the host wrappers start a call's pooled acceptance (`AcceptanceCounts.row_tried`,
      `row_accepted`) from where the engine's last call with the same target, drafter and
      sampling ended, so a drafter that was never accepted is not probed afresh at every call
      (each probe of a poor drafter costs a wide verify); the carried counts fade within
      about a hundred steps, after which the drafter is probed again. Only where the emitted
      text cannot depend on the k's chosen (greedy rows, or a coupled drafter: `coupled`),
      on one device mesh. `stats["acceptance_carried"]` says what a call started from.
  """

  k_max: int = 8
  buckets: tuple[int, ...] | None = None
  decay: float = 0.95
  prior: tuple[float, float] = (0.5, 0.5)
  margin: float = 0.05
  carry: bool = True

  def __post_init__(self):
    if not is_int(self.k_max) or not 1 <= self.k_max <= MAX_K:
      raise ValueError(f"AutoK.k_max must be an integer in [1, {MAX_K}], got {self.k_max!r}")
    if self.buckets is not None:
      b = tuple(self.buckets) if isinstance(self.buckets, (Sequence, np.ndarray)) else None
      if not b or isinstance(self.buckets, str) or any(not is_int(k) or not 0 <= k <= self.k_max
                                                       for k in b):
        raise ValueError(f"AutoK.buckets must be a sequence of draft counts in 0..k_max="
                         f"{self.k_max}, got {self.buckets!r}")
    if not _is_real(self.decay) or not 0.0 < self.decay <= 1.0:
      raise ValueError(f"AutoK.decay must be a number in (0, 1], got {self.decay!r}")
    if isinstance(self.prior, (str, bytes)) or not isinstance(self.prior, (Sequence, np.ndarray)) \
        or len(self.prior) != 2 or not all(_is_real(v) and 0 < v < np.inf for v in self.prior):
      raise ValueError(f"AutoK.prior must be two positive finite pseudo-counts (accepted,"
                       f" rejected), e.g. (0.5, 0.5), got {self.prior!r}")
    if not _is_real(self.margin) or not 0.0 <= self.margin < 1.0:
      raise ValueError(f"AutoK.margin must be a number in [0, 1), got {self.margin!r}")
    if not isinstance(self.carry, (bool, np.bool_)):
      raise ValueError(f"AutoK.carry must be True or False, got {self.carry!r}")

  def resolved_buckets(self) -> tuple[int, ...]:
    if self.buckets is not None:
      ks = set(int(k) for k in self.buckets) | {0}
    else:
      ks = {k for k in _DEFAULT_BUCKETS if k <= self.k_max} | {self.k_max}
    return tuple(sorted(ks))


@dataclasses.dataclass(frozen=True)
class CostModel:
  """Seconds of one loop step per number of drafts k (k = 0: a plain decode step), and how they
  grow with the cache.

  A step's cost at a cache of L positions is seconds(k) + per_token(k) * (L - length): where
  attention reads only the cached positions, every verify grows dearer as the cache fills, and
  a (k+1)-token verify grows faster than a decode step, so the controller weighs the costs at
  the batch's current length (the longest live row), not the length they were timed at.

  Attributes:
    ks: draft counts, ascending.
    seconds: the step time for each, at a cache of `length` positions.
    batch_size: the batch it was measured at (informational).
    source: where the numbers come from ("measured", "given", ...).
    raw: the measurements before smoothing, when measured (per k; then per k at the longer
      cache, when timed at two lengths).
    per_token: for each k, the seconds a step gains per cached position (>= 0); None: the
      costs do not depend on the cache's length.
    length: the cache length (positions) `seconds` hold at.
    steps: when measured, the fewest loop steps any k was timed over in a round (timing runs
      `jaxspec.engine.costs.TIMED_STEPS`; fewer when the rows had no room to run them, and
      then the engine does not keep the model for later calls); None otherwise.
  """

  ks: tuple[int, ...]
  seconds: tuple[float, ...] = ()
  batch_size: int | None = None
  source: str = "given"
  raw: tuple[float, ...] | None = None
  per_token: tuple[float, ...] | None = None
  length: int = 0
  steps: int | None = None

  def __post_init__(self):
    if isinstance(self.ks, (str, bytes)) or not isinstance(self.ks, (Sequence, np.ndarray)) \
        or not len(self.ks) or not all(is_int(k) and k >= 0 for k in self.ks) \
        or list(self.ks) != sorted(set(self.ks)):
      raise ValueError(f"CostModel.ks must be ascending distinct draft counts >= 0 (0: a plain"
                       f" step), e.g. (0, 1, 2, 4), got {self.ks!r}")
    for name in ("seconds", "per_token", "raw"):
      v = getattr(self, name)
      if v is None and name != "seconds":
        continue
      if isinstance(v, (str, bytes)) or not isinstance(v, (Sequence, np.ndarray)) \
          or (len(v) != len(self.ks) if name != "raw" else len(v) % len(self.ks)):
        raise ValueError(f"CostModel.{name} must hold one time per k (ks={tuple(self.ks)}), got"
                         f" {v!r}")
      lo_ok = (lambda x: x > 0) if name != "per_token" else (lambda x: x >= 0)
      if not all(_is_real(x) and x < np.inf and lo_ok(x) for x in v):
        what = "positive" if name != "per_token" else "non-negative"
        raise ValueError(f"CostModel.{name} must be finite {what} seconds, got {v!r}")
    if self.batch_size is not None and (not is_int(self.batch_size) or self.batch_size < 1):
      raise ValueError(f"CostModel.batch_size must be None or a positive integer, got"
                       f" {self.batch_size!r}")
    if not isinstance(self.source, str):
      raise ValueError(f"CostModel.source must be a string, got {self.source!r}")
    if not is_int(self.length) or self.length < 0:
      raise ValueError(f"CostModel.length must be an integer >= 0 (cache positions), got"
                       f" {self.length!r}")
    if self.steps is not None and (not is_int(self.steps) or self.steps < 0):
      raise ValueError(f"CostModel.steps must be None or an integer >= 0 (timed loop steps),"
                       f" got {self.steps!r}")

  @classmethod
  def from_formula(cls, ks: Sequence[int], draft_cost: float, verify_cost) -> CostModel:
    """k * draft_cost + verify_cost(k) for each k (verify_cost(0) is a decode step)."""
    return cls(tuple(int(k) for k in ks),
               tuple(float(k * draft_cost + verify_cost(k)) for k in ks), source="formula")

  @classmethod
  def from_ratios(cls, ratios, per_token=None, length: int = 0) -> CostModel:
    """A cost model from {k: step time} (seconds, or any unit: only ratios matter to the
    controller), with string or integer keys, such as {0: 1.0, 1: 1.3, 2: 1.6}; with
    `per_token` ({k: seconds per cached position}) and `length` (the cache positions `ratios`
    hold at), its growth with the cache too. A run's `stats["cost_model"]` is a `CostModel`
    already (pass it as it is; `to_dict` / `from_dict` for JSON)."""
    def items(d, what):
      if not isinstance(d, dict) or not d:
        raise ValueError(f"CostModel.from_ratios takes a non-empty dict {{k: {what}}}, such as"
                         f" {{0: 1.0, 1: 1.3}}, got {type(d).__name__}"
                         + (": a CostModel is passed as it is" if isinstance(d, CostModel)
                            else ""))
      try:
        return sorted((int(k), v) for k, v in d.items())
      except (TypeError, ValueError):
        raise ValueError(f"CostModel.from_ratios: keys must be draft counts (0, 1, \"2\", ...),"
                         f" got {list(d)!r}") from None
    pairs = items(ratios, "seconds")
    slope = None
    if per_token is not None:
      sp = items(per_token, "seconds per cached position")
      if [k for k, _ in sp] != [k for k, _ in pairs]:
        raise ValueError("CostModel.from_ratios: per_token must have the same keys as ratios")
      slope = tuple(v for _, v in sp)
    return cls(tuple(k for k, _ in pairs), tuple(v for _, v in pairs), per_token=slope,
               length=length, source="given")

  def to_dict(self) -> dict:
    """Plain data (lists, numbers, strings) for a JSON file; `from_dict` rebuilds the same
    model."""
    def floats(v):
      return None if v is None else [float(x) for x in v]
    return dict(ks=[int(k) for k in self.ks], seconds=floats(self.seconds),
                per_token=floats(self.per_token), length=int(self.length),
                batch_size=None if self.batch_size is None else int(self.batch_size),
                source=self.source, raw=floats(self.raw),
                steps=None if self.steps is None else int(self.steps))

  @classmethod
  def from_dict(cls, d) -> CostModel:
    """The model `to_dict` wrote (as read back from JSON); keys it does not name are refused,
    so a dict of step times {k: seconds} is pointed to `from_ratios`."""
    fields = ("ks", "seconds", "per_token", "length", "batch_size", "source", "raw", "steps")
    if not isinstance(d, dict) or "ks" not in d or "seconds" not in d \
        or not set(d) <= set(fields):
      got = sorted(map(str, d)) if isinstance(d, dict) else type(d).__name__
      raise ValueError(f"CostModel.from_dict takes what CostModel.to_dict wrote (keys {fields},"
                       f" ks and seconds required), got {got}: for a dict of step times {{k:"
                       " seconds}} use CostModel.from_ratios")
    opt = lambda v: None if v is None else tuple(v)  # noqa: E731
    return cls(tuple(d["ks"]), tuple(d["seconds"]), per_token=opt(d.get("per_token")),
               length=d.get("length", 0), batch_size=d.get("batch_size"),
               source=d.get("source", "given"), raw=opt(d.get("raw")), steps=d.get("steps"))

  @classmethod
  def from_measurements(cls, ks: Sequence[int], seconds: Sequence[float], *,
                        longer: Sequence[float] | None = None, length: int = 0,
                        longer_length: int | None = None, **kw) -> CostModel:
    """A cost model from noisy timings: the non-decreasing fit in k (pool adjacent violators).

    A step that verifies more tokens never costs less; a timing that says otherwise is noise
    (on a shared 2-core VM single timings vary by +-25%), and pooling neighbours averages it.
    With `longer` (the same steps timed at a cache of `longer_length` positions against
    `length`), the per-position growth of each k, fitted the same way and never negative (a
    longer cache never makes a step cheaper).
    """
    fit = isotonic(seconds)
    slope = None
    if longer is not None:
      if longer_length is None or longer_length <= length:
        raise ValueError("from_measurements: longer needs longer_length > length")
      far = isotonic(longer)
      slope = tuple(max(v, 0.0) for v in isotonic(
          [(f - n) / (longer_length - length) for f, n in zip(far, fit)]))
      raw = tuple(map(float, seconds)) + tuple(map(float, longer))
    else:
      raw = tuple(map(float, seconds))
    return cls(tuple(int(k) for k in ks), tuple(fit), raw=raw, per_token=slope, length=int(length),
               **kw)

  def at(self, ks: Sequence[int], length: int | None = None) -> np.ndarray:
    """Times for these k, linearly interpolated (and extrapolated) from the known ones; at a
    cache of `length` positions (default: the length they were timed at)."""
    out = _interp(self.ks, self.seconds, ks)
    if length is not None and self.per_token is not None:
      out = out + np.maximum(_interp(self.ks, self.per_token, ks), 0.0) * (length - self.length)
    return np.maximum(out, 1e-9).astype(np.float32)

  def arrays(self, ks: Sequence[int]) -> np.ndarray:
    """[2, len(ks)] float32 (seconds at an empty cache, seconds per cached position): the form
    the jitted controller takes (`costs_at`)."""
    base = _interp(self.ks, self.seconds, ks)
    slope = np.zeros_like(base)
    if self.per_token is not None:
      slope = np.maximum(_interp(self.ks, self.per_token, ks), 0.0)
    return np.stack([base - slope * self.length, slope]).astype(np.float32)

  def relative(self) -> dict[int, float]:
    """Step time per k relative to a plain step (k = 0 when measured)."""
    base = self.at([0])[0]
    return {k: float(s / base) for k, s in zip(self.ks, self.seconds)}


def _interp(xs, ys, ks) -> np.ndarray:
  """ys at ks, linear in between, extrapolated with the last slope past the end."""
  x, y = np.asarray(xs, np.float64), np.asarray(ys, np.float64)
  k = np.asarray(ks, np.float64)
  if len(x) == 1:
    return np.full(len(k), y[0])
  out = np.interp(k, x, y)
  slope = (y[-1] - y[-2]) / (x[-1] - x[-2])
  return np.where(k > x[-1], y[-1] + slope * (k - x[-1]), out)


def costs_at(costs: jax.Array, length: jax.Array) -> jax.Array:
  """Each k's step cost [nk] at a cache of `length` positions, from `CostModel.arrays`'
  [2, nk] (a [nk] array is a cost that does not depend on the length)."""
  if costs.ndim == 1:
    return costs
  return jnp.maximum(costs[0] + costs[1] * jnp.asarray(length, jnp.float32), 1e-9)


def isotonic(y: Sequence[float]) -> list[float]:
  """The least-squares non-decreasing fit of y (pool adjacent violators)."""
  blocks: list[list[float]] = []  # [mean, weight]
  for v in y:
    blocks.append([float(v), 1.0])
    while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
      m2, w2 = blocks.pop()
      m1, w1 = blocks.pop()
      blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2])
  out: list[float] = []
  for m, w in blocks:
    out += [m] * int(w)
  return out


# ----------------------------------------------------------------------------------------------
# The acceptance model.


@_pytree
@dataclasses.dataclass
class AcceptanceCounts:
  """Decayed per-row, per-position counts behind the acceptance estimate."""

  tried: jax.Array  # [B, K] f32 draft i was verified with drafts 1..i-1 accepted
  accepted: jax.Array  # [B, K] f32 ... and was accepted
  # [B] f32 the same summed over positions, decayed by decay ** POOLED_SLOWER: the row's pooled
  # rate, with a longer memory (None: pooled from `tried` and `accepted`).
  row_tried: jax.Array | None = None
  row_accepted: jax.Array | None = None


# The row's pooled counts decay as decay ** POOLED_SLOWER per step: 4 times the memory.
POOLED_SLOWER = 0.25


def init_counts(batch: int, k_max: int) -> AcceptanceCounts:
  z = jnp.zeros((batch, k_max), jnp.float32)
  zr = jnp.zeros((batch,), jnp.float32)
  return AcceptanceCounts(tried=z, accepted=z, row_tried=zr, row_accepted=zr)


def acceptance_estimate(counts: AcceptanceCounts, prior: tuple[float, float],
                        strength: float = 4.0) -> jax.Array:
  """Each row's conditional acceptance per position [B, K], shrunk towards the row's pooled rate.

  The pooled rate (all positions together, Beta `prior`) is the prior mean of every position
  with weight `strength`: a position the row has not tried yet (k never reached it) takes the
  row's overall rate, so a drafter that is always right is trusted with longer drafts. The
  pooled rate's own prior mean is the row's slowly decayed rate (`row_tried`, `row_accepted`,
  itself shrunk to `prior`): recent counts decide while there are some; once they have faded
  (a row that stopped drafting) the estimate returns to the row's long-run rate, and only
  then to the prior.
  """
  a, r = prior
  base = a / (a + r)
  if counts.row_tried is not None:  # the prior's mean, moved by the row's long memory
    base = (counts.row_accepted + a) / (counts.row_tried + a + r)
  pooled = ((counts.accepted.sum(1) + (a + r) * base) / (counts.tried.sum(1) + a + r))[:, None]
  return (counts.accepted + strength * pooled) / (counts.tried + strength)


def update_counts(counts: AcceptanceCounts, decay: float, verified: jax.Array,
                  n_real: jax.Array, n_accepted: jax.Array, shadow: jax.Array | None = None,
                  shadow_hit: jax.Array | None = None) -> AcceptanceCounts:
  """Decays the counts and adds one step's observations.

  Args:
    verified: [B] bool rows whose drafts were verified this step (live, k > 0).
    n_real: [B] real drafts verified per row (min(k, what the drafter proposed)).
    n_accepted: [B] drafts accepted per row.
    shadow: [B] bool rows that had a deterministic first draft but took a plain step; the
      token the step emitted tells whether that draft would have been accepted: greedily the
      draft is accepted iff it is the target's argmax, the emitted token; under sampling a
      one-hot draft x is accepted with probability p(x), the chance that the emitted token
      (drawn from p) is x. So the first position's count learns from plain steps too, with no
      verify spent on probing.
    shadow_hit: [B] bool the emitted token equals that first draft.
  """
  k = counts.tried.shape[1]
  i = jnp.arange(k)[None, :]
  acc = jnp.minimum(n_accepted, n_real)[:, None]
  tried = (i < jnp.minimum(acc + 1, n_real[:, None])) & verified[:, None]
  accepted = (i < acc) & verified[:, None]
  if shadow is not None:
    first = i == 0
    tried = tried | (first & shadow[:, None])
    accepted = accepted | (first & (shadow & shadow_hit)[:, None])
  row_tried = row_accepted = None
  if counts.row_tried is not None:
    slow = decay ** POOLED_SLOWER
    row_tried = slow * counts.row_tried + tried.sum(1)
    row_accepted = slow * counts.row_accepted + accepted.sum(1)
  return AcceptanceCounts(tried=decay * counts.tried + tried,
                          accepted=decay * counts.accepted + accepted,
                          row_tried=row_tried, row_accepted=row_accepted)


def expected_tokens(alpha: jax.Array, ks: Sequence[int], n_real: jax.Array | None = None):
  """Expected tokens a row emits in a step verifying k drafts, for each k in ks [B, len(ks)].

  E(k) = 1 + sum_{j=1..min(k, n_real)} prod_{i<=j} alpha_i (the bonus/correction token counts).
  """
  b, kmax = alpha.shape
  reach = jnp.cumprod(alpha, axis=1)  # [B, K] P(drafts 1..j all accepted)
  if n_real is not None:
    reach = jnp.where(jnp.arange(kmax)[None, :] < n_real[:, None], reach, 0.0)
  csum = jnp.concatenate([jnp.zeros((b, 1), reach.dtype), jnp.cumsum(reach, axis=1)], axis=1)
  return 1.0 + csum[:, jnp.asarray(ks)]


def choose(alpha: jax.Array, live: jax.Array, costs: jax.Array, ks: Sequence[int],
           n_real: jax.Array | None = None, remaining: jax.Array | None = None,
           margin: float = 0.0, length: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """The controller: index into ks maximising the batch's expected progress per second.

  A batch is done when its slowest row is, so with `remaining` the progress of a step is how
  much it is expected to shorten the largest remaining count: max_r R_r - max_r (R_r - E_r(k)),
  over live rows, with E_r(k) the row's expected tokens. A row far ahead gains nothing from
  drafting and a row without a draft holds the batch back, so at a large batch the controller
  only speculates when the rows that decide the finish accept. At batch 1 this is the row's
  expected tokens per second. Without `remaining` the progress is the sum of E_r(k) (every
  row's tokens count, as when finished rows are replaced by new requests).

  Args:
    alpha: [B, K] acceptance estimate per row and position.
    live: [B] bool rows still generating.
    costs: [len(ks)] seconds per step for each k, or [2, len(ks)] (`CostModel.arrays`: at an
      empty cache and per cached position), weighed at `length`.
    ks: the candidate draft counts.
    n_real: [B] drafts the drafter has for each row, when known before choosing.
    remaining: [B] tokens each row may still emit.
    margin: a k > 0 is chosen only when its rate beats k = 0's by this fraction (`AutoK`).
    length: [B] each row's cache length; the costs are taken at the longest live row's (the
      attention of a batched pass reads as far as its longest row).
  Returns:
    (index into ks, predicted progress per second for every k [len(ks)]).
  """
  e = expected_tokens(alpha, ks, n_real)  # [B, nk]
  if remaining is None:
    progress = jnp.sum(jnp.where(live[:, None], e, 0.0), axis=0)
  else:
    r = jnp.where(live, remaining.astype(jnp.float32), -jnp.inf)[:, None]  # [B, 1]
    worst = jnp.max(r, axis=0)
    after = jnp.max(jnp.where(live[:, None], r - e, -jnp.inf), axis=0)
    progress = jnp.where(jnp.any(live), worst - after, 0.0)
  if costs.ndim == 2:
    if length is None:
      raise ValueError("costs of shape [2, nk] grow with the cache: pass length=")
    costs = costs_at(costs, jnp.max(jnp.where(live, length, 0)))
  rate = progress / costs
  handicap = jnp.where(jnp.asarray(ks) > 0, 1.0 + margin, 1.0)
  return jnp.argmax(rate / handicap).astype(jnp.int32), rate


def best_k_formula(alpha: float, ks: Sequence[int], costs: Sequence[float]) -> int:
  """argmax_k (1 - alpha^(k+1)) / ((1 - alpha) cost(k)): the i.i.d. textbook optimum."""
  ks = list(ks)
  if alpha >= 1.0:
    gain = [k + 1.0 for k in ks]
  else:
    gain = [(1 - alpha ** (k + 1)) / (1 - alpha) for k in ks]
  return ks[int(np.argmax(np.array(gain) / np.asarray(costs)))]
