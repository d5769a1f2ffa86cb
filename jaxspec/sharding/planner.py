"""The placement planner: where the target and the drafter run, and how many tokens to draft.

From profiles alone (`jaxspec.sharding.profiles`), the planner predicts the decoding throughput
of every placement of the target and the drafter on the given device groups and every draft
count k = 0..k_max, and picks the best. It measures nothing itself, so a GPU, TPU or NPU
described by `ModelProfile.from_numbers` can be planned for on a machine without one.

The cost model is the i.i.d. one of `jaxspec.adaptive` with acceptance probability alpha per
draft: a step that verifies k drafts emits, per row,

    E(k) = 1 + alpha + ... + alpha^k = (1 - alpha^(k+1)) / (1 - alpha)   (k + 1 at alpha = 1)

tokens and costs draft(k) + verify(k) + transfer(k) seconds, where, for a batch of B rows,

    verify(k)   = target(B, T=k+1)            (k = 0: a plain decode step target(B, 1))
    draft(k)    = drafter(B, 2) + (k-1) drafter(B, 1)   a draft model (`DraftModel`): its cache
                  is one token behind, so the first draft comes from a two-token catch-up pass
                  and the other k - 1 from single-token passes
                = k drafter(B, 1)                       a head or n-gram drafter
    transfer(k) = 0 on the same group (fused), else
                  link(drafter -> target)(B k 4 [+ B k V 4] bytes)  the drafts [B, k] int32
                  (+ their distribution q [B, k, V] float32 when the drafter samples)
                + link(target -> drafter)(B (k+1) 4 bytes)           the accepted tokens
                                                                     [B, k+1] int32 (padded)
                  (+ B (k+1) D 4 n bytes for a head: the target's hidden states of n layers)

and throughput(k) = B E(k) / (draft(k) + verify(k) + transfer(k)) tokens per second.

Draft, transfer and verify add up rather than overlap, on the same group and on different ones
alike: in the chain algorithm the verify needs the drafts, and the next draft needs the verify's
accepted tokens, so one group always waits for the other (the host-orchestrated placement runs
the drafter on another group to use faster or idle hardware for it, not to overlap it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from jaxspec.checks import check_int
from jaxspec.sharding.profiles import LinkProfile, ModelProfile

_KINDS = ("model", "head", "ngram")


def expected_tokens_per_step(alpha: float, k: int) -> float:
  """E(k) = (1 - alpha^(k+1)) / (1 - alpha): tokens a row emits per step verifying k drafts
  with i.i.d. acceptance alpha (`jaxspec.decoding.adaptive.expected_tokens` with constant alpha)."""
  if alpha >= 1.0:
    return k + 1.0
  return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DrafterSpec:
  """What the planner needs to know about a drafter besides its profiles.

  Attributes:
    name: the drafter's key in `profiles`.
    kind: "model" (a draft model: a two-token catch-up pass, then k - 1 single-token passes),
      "head" (a Medusa/EAGLE-style head: k single-token passes; it reads the target's hidden
      states) or "ngram" (k lookups, each costing its profile's T = 1 time; see
      `ModelProfile.per_token`).
    probs: whether the drafts travel with their distribution q [B, k, V] float32 (a sampling
      drafter); default True for "model" and "head", False for "ngram" (one-hot q).
    vocab_size: V for the size of q; default the drafter's profile's, else the target's.
    hidden_size, feature_layers: a head on another group than the target receives the target's
      hidden states of every verified position, [B, k+1, D] float32 per feature layer (1 for
      Medusa / MLP / EAGLE, 4 for EAGLE-3: three fused layers plus the final one); without
      hidden_size a head is only planned fused, on the target's group.
  """

  name: str
  kind: str = "model"
  probs: bool | None = None
  vocab_size: int | None = None
  hidden_size: int | None = None
  feature_layers: int = 1

  def __post_init__(self):
    if self.kind not in _KINDS:
      raise ValueError(f"DrafterSpec.kind must be one of {_KINDS}, got {self.kind!r}")
    if self.probs is None:
      object.__setattr__(self, "probs", self.kind != "ngram")

  def draft_seconds(self, prof: ModelProfile, batch: int, k: int) -> float:
    """Seconds to propose k drafts for `batch` rows (see the module docstring)."""
    if k == 0:
      return 0.0
    if self.kind == "model":
      return prof.latency(batch, 2) + (k - 1) * prof.latency(batch, 1)
    return k * prof.latency(batch, 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Candidate:
  """One placement and draft count with its predicted cost.

  Attributes:
    target_group: where the target runs.
    drafter_group: where the drafter runs (None: plain decoding, k = 0).
    k: drafts per step.
    tokens_per_step: E(k), expected tokens per row per step.
    draft_s, verify_s, transfer_s: seconds per step of each part.
    draft_pass_s: seconds of one single-token drafter pass (0 without a drafter).
    tokens_per_s: predicted throughput of the batch.
  """

  target_group: str
  drafter_group: str | None
  k: int
  tokens_per_step: float
  draft_s: float
  verify_s: float
  transfer_s: float
  draft_pass_s: float
  tokens_per_s: float

  @property
  def step_s(self) -> float:
    return self.draft_s + self.verify_s + self.transfer_s

  @property
  def fused(self) -> bool:
    return self.drafter_group == self.target_group

  def describe(self) -> str:
    if self.k == 0:
      return f"target on {self.target_group}, plain decoding"
    how = "fused" if self.fused else "host-orchestrated"
    return (f"target on {self.target_group}, drafter on {self.drafter_group} ({how}),"
            f" k={self.k}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Plan:
  """The planner's choice and the table it was chosen from.

  Attributes:
    target_group: where to run the target.
    drafter_group: where to run the drafter; None: do not speculate.
    k: drafts per step (0: plain decoding).
    tokens_per_s: predicted throughput of the chosen candidate.
    speedup: tokens_per_s over plain decoding on the best target group.
    baseline: plain decoding on the best target group.
    candidates: every candidate, best first.
    acceptance: the alpha planned for.
    batch_size: the batch B planned for.
    drafter: the drafter planned for (None: none was given).
  """

  target_group: str
  drafter_group: str | None
  k: int
  tokens_per_s: float
  speedup: float
  baseline: Candidate
  candidates: tuple[Candidate, ...]
  acceptance: float
  batch_size: int
  drafter: DrafterSpec | None

  @property
  def best(self) -> Candidate:
    return self.candidates[0]

  @property
  def speculate(self) -> bool:
    return self.k > 0

  def placement(self, devices: Mapping[str, Any], **kwargs):
    """The chosen layout as a `Placement`, with `devices` mapping each group name to its mesh
    (or devices); when not speculating the drafter shares the target's mesh (unused)."""
    from jaxspec.sharding.placement import Placement
    missing = [g for g in (self.target_group, self.drafter_group)
               if g is not None and g not in devices]
    if missing:
      raise ValueError(f"no devices given for group {missing[0]!r}: pass a mapping with"
                       f" {sorted({self.target_group, self.drafter_group} - {None})}")
    target = devices[self.target_group]
    drafter = devices[self.drafter_group] if self.drafter_group is not None else None
    return Placement(target=target, drafter=drafter, **kwargs)

  def explain(self, top: int = 5) -> str:
    """Why this plan: its cost breakdown, the k trade-off, the placements it beat, the table."""
    a, b, best, base = self.acceptance, self.batch_size, self.best, self.baseline
    ms = lambda s: f"{s * 1e3:.3g} ms"
    lines = []
    plain = (f"plain decoding on {base.target_group} costs v(1) = {ms(base.verify_s)} per step"
             f" of one token per row ({base.tokens_per_s:.4g} tokens/s at batch {b})")
    spec = [c for c in self.candidates if c.k > 0]
    if not self.speculate:
      lines.append(f"do not speculate: run the target on {self.target_group} with plain"
                   f" decoding, {self.tokens_per_s:.4g} tokens/s predicted.")
      if not spec:
        why = "no drafter was given" if self.drafter is None else "k_max = 0"
        lines.append(f"why: {why}; {plain}.")
      else:
        s = spec[0]
        lines.append(
            f"why: {plain}; the best speculative candidate, {s.describe()}, reaches only"
            f" {s.tokens_per_s:.4g} tokens/s: its step costs {ms(s.step_s)} ({self._parts(s)})"
            f" for E({s.k}) = {s.tokens_per_step:.3g} tokens per row at alpha = {a:g}, i.e."
            f" {ms(s.step_s / s.tokens_per_step)} per token > {ms(base.verify_s)}.")
    else:
      lines.append(f"{best.describe()}: {self.tokens_per_s:.4g} tokens/s predicted,"
                   f" {self.speedup:.3g}x plain decoding on {base.target_group}.")
      lines.append(
          f"why: at alpha = {a:g} a step verifying k = {best.k} drafts emits E({best.k}) ="
          f" (1 - alpha^{best.k + 1}) / (1 - alpha) = {best.tokens_per_step:.3g} tokens per row"
          f" and costs {ms(best.step_s)} ({self._parts(best)}), i.e."
          f" {ms(best.step_s / best.tokens_per_step)} per token, where {plain}.")
      same = sorted((c for c in spec if (c.target_group, c.drafter_group) ==
                     (best.target_group, best.drafter_group)), key=lambda c: c.k)
      per_k = ", ".join(f"k={c.k}: {c.tokens_per_s:.4g}" for c in same)
      lines.append(f"k: E(k) / (draft(k) + verify(k) + transfer(k)) on this placement, in"
                   f" tokens/s: {per_k}; k = {best.k} maximises it.")
    # The best of every other placement, so the reader sees what the choice beat and by what.
    seen = {(best.target_group, best.drafter_group)}
    for c in self.candidates:
      key = (c.target_group, c.drafter_group)
      if key in seen or c.k == 0:
        continue
      seen.add(key)
      pass_ = f"a draft pass costs {ms(c.draft_pass_s)} on {c.drafter_group}"
      move = "" if c.fused else f", {ms(c.transfer_s)} of transfer per step"
      lines.append(f"instead: target on {c.target_group}, drafter on {c.drafter_group} at best"
                   f" k={c.k}, {c.tokens_per_s:.4g} tokens/s ({pass_}, verify"
                   f" {ms(c.verify_s)}{move}).")
    if spec:
      lines.append("draft, transfer and verify serialise: the verify needs the drafts and the"
                   " next draft needs the accepted tokens.")
    lines.append(f"top {min(top, len(self.candidates))} of {len(self.candidates)} candidates:")
    for i, c in enumerate(self.candidates[:top]):
      lines.append(f"  {i + 1}. {c.describe()}: {c.tokens_per_s:.4g} tokens/s ({self._parts(c)})")
    return "\n".join(lines)

  @staticmethod
  def _parts(c: Candidate) -> str:
    ms = lambda s: f"{s * 1e3:.3g} ms"
    if c.k == 0:
      return f"verify {ms(c.verify_s)}"
    return (f"draft {ms(c.draft_s)} + verify v({c.k + 1}) {ms(c.verify_s)} + transfer"
            f" {ms(c.transfer_s)}")


# ----------------------------------------------------------------------------------------------


def _groups(devices) -> tuple[str, ...]:
  names = tuple(devices) if isinstance(devices, Mapping) else tuple(devices)
  if not names:
    raise ValueError("devices is empty: give the candidate device groups, e.g."
                     " {'gpu0': submesh([0]), 'cpu': submesh([1])} or ['gpu0', 'cpu']")
  bad = [n for n in names if not isinstance(n, str)]
  if bad:
    raise ValueError(f"device group names must be strings, got {bad[0]!r}: name each group,"
                     " e.g. {'gpu0': mesh}")
  if len(set(names)) != len(names):
    raise ValueError(f"device group names repeat in {names}: name each group once")
  return names


def _check_profiles(profiles, groups: tuple[str, ...]) -> None:
  if not isinstance(profiles, Mapping):
    raise ValueError("profiles must map model name -> {device group: ModelProfile}, got"
                     f" {type(profiles).__name__}")
  for model, per in profiles.items():
    if not isinstance(per, Mapping):
      raise ValueError(f"profiles[{model!r}] must map device group -> ModelProfile, got"
                       f" {type(per).__name__}")
    for g, p in per.items():
      if g not in groups:
        raise ValueError(f"profiles[{model!r}] names device group {g!r}, which is not in devices"
                         f" {groups}: add {g!r} to devices or drop that profile")
      if not isinstance(p, ModelProfile):
        raise ValueError(f"profiles[{model!r}][{g!r}] must be a ModelProfile, got"
                         f" {type(p).__name__}: measure one with profile(model, mesh) or give"
                         " one with ModelProfile.from_numbers / from_table")


def _link(links, a: str, b: str) -> LinkProfile | None:
  """The link a -> b, or b -> a when only that direction was given (links are symmetric)."""
  return links.get((a, b)) or links.get((b, a))


def plan(target: str, drafter: str | DrafterSpec | None, devices: Mapping[str, Any] | Sequence[str],
         profiles: Mapping[str, Mapping[str, ModelProfile]], acceptance: float, *,
         k_max: int = 8, batch_size: int = 1,
         links: Mapping[tuple[str, str], LinkProfile] | None = None) -> Plan:
  """The placement of target and drafter, and the draft count, with the best predicted throughput.

  Candidates: the target on every group where it has a profile; for each, plain decoding
  (k = 0) and, for k = 1..k_max, the drafter on the same group (fused, nothing transferred) or
  on any other group where it has a profile (host-orchestrated: the drafts and the accepted
  tokens cross a link every step; a head also receives the target's hidden states, and is only
  planned on another group when its `DrafterSpec.hidden_size` is given). See the module docstring for
  the cost of a step; draft, transfer and verify serialise in the chain algorithm, on one
  group or two.

  Args:
    target: the target's key in `profiles`.
    drafter: the drafter's key in `profiles` (a draft model), a `DrafterSpec` (head, n-gram,
      probabilities or not), or None (only plain decoding is planned).
    devices: the candidate device groups, by name: a mapping name -> anything (a mesh, devices)
      or a sequence of names.
    profiles: model name -> {device group: ModelProfile}; a model may run on exactly the groups
      it has a profile for.
    acceptance: alpha in [0, 1], the probability that a draft is accepted.
    k_max: the most drafts per step (0: plain decoding only).
    batch_size: B, rows decoded together.
    links: (group a, group b) -> LinkProfile for every pair of groups the target and the drafter
      may be split over; one direction stands for both when the other is not given.
  Returns:
    The `Plan`, with every candidate ranked (ties: fewer drafts, then fused, then group order).
  Raises:
    ValueError, before anything is computed, for a group not in `devices`, a model without a
    profile, a split placement without a link, alpha outside [0, 1], k_max < 0, batch_size < 1.
  """
  # -- checks, all before any prediction ------------------------------------------------------
  if (isinstance(acceptance, bool) or not isinstance(acceptance, (int, float, np.floating))
      or not 0.0 <= float(acceptance) <= 1.0):
    raise ValueError(f"acceptance must be a probability in [0, 1], got {acceptance!r}: measure it"
                     " with speculative_generate's stats or use e.g. 0.6 for a matched drafter")
  alpha = float(acceptance)
  check_int("k_max", k_max, 0, why="0: plan plain decoding only")
  check_int("batch_size", batch_size, 1)
  k_max, b = int(k_max), int(batch_size)
  groups = _groups(devices)
  _check_profiles(profiles, groups)
  links = dict(links or {})
  for (ga, gb), lp in links.items():
    for g in (ga, gb):
      if g not in groups:
        raise ValueError(f"links names device group {g!r}, which is not in devices {groups}:"
                         f" add {g!r} to devices or drop the link ({ga!r}, {gb!r})")
    if not isinstance(lp, LinkProfile):
      raise ValueError(f"links[({ga!r}, {gb!r})] must be a LinkProfile, got {type(lp).__name__}")
  spec = DrafterSpec(name=drafter) if isinstance(drafter, str) else drafter
  if spec is not None and not isinstance(spec, DrafterSpec):
    raise ValueError(f"drafter must be a profile name, a DrafterSpec or None, got"
                     f" {type(drafter).__name__}")
  t_prof = profiles.get(target, {})
  if not t_prof:
    raise ValueError(f"no profile for the target {target!r} on any device group (profiles has"
                     f" {sorted(profiles)}): measure one with profile(model, mesh) or give one"
                     " with ModelProfile.from_numbers")
  t_groups = [g for g in groups if g in t_prof]
  for g in t_groups:
    if t_prof[g].latency(b, 1) <= 0:
      raise ValueError(f"the target's profile on {g!r} gives a decode step of 0 seconds: a"
                       " target profile needs positive times")
  d_prof: Mapping[str, ModelProfile] = {}
  pairs: list[tuple[str, str]] = []  # (target group, drafter group)
  if spec is not None:
    d_prof = profiles.get(spec.name, {})
    if not d_prof:
      raise ValueError(f"no profile for the drafter {spec.name!r} on any device group (profiles"
                       f" has {sorted(profiles)}): give one, or drafter=None to plan plain"
                       " decoding")
    for gt in t_groups:
      for gd in groups:
        if gd not in d_prof or (spec.kind == "head" and gd != gt and spec.hidden_size is None):
          continue
        if gd != gt and _link(links, gd, gt) is None:
          raise ValueError(
              f"no LinkProfile between {gd!r} and {gt!r} for the drafter on {gd!r} and the target"
              f" on {gt!r}: give links={{({gd!r}, {gt!r}): LinkProfile(...)}} (measure one with"
              f" profile_link) or drop the drafter's profile on {gd!r}")
        pairs.append((gt, gd))
    if spec.kind == "head" and not pairs:
      raise ValueError(f"the head drafter {spec.name!r} has no profile on a group the target runs"
                       f" on ({t_groups}): a head reads the target's hidden states, so profile it"
                       " there")
    vocab = spec.vocab_size
    for p in (*d_prof.values(), *t_prof.values()):
      vocab = vocab or p.vocab_size
    if spec.probs and vocab is None and any(gt != gd for gt, gd in pairs):
      raise ValueError(f"the drafter {spec.name!r} sends q [B, k, V] across a link but V is"
                       " unknown: give DrafterSpec(vocab_size=...) or profiles with vocab_size")

  # -- the table ------------------------------------------------------------------------------
  cands = []
  for gt in t_groups:
    v1 = t_prof[gt].latency(b, 1)
    cands.append(Candidate(target_group=gt, drafter_group=None, k=0, tokens_per_step=1.0,
                           draft_s=0.0, verify_s=v1, transfer_s=0.0, draft_pass_s=0.0,
                           tokens_per_s=b / v1))
  for gt, gd in pairs:
    for k in range(1, k_max + 1):
      draft_s = spec.draft_seconds(d_prof[gd], b, k)
      verify_s = t_prof[gt].latency(b, k + 1)
      transfer_s = 0.0
      if gd != gt:
        sent = b * k * 4 + (b * k * vocab * 4 if spec.probs else 0)  # drafts (+ q)
        back = b * (k + 1) * 4  # accepted tokens
        if spec.kind == "head":  # and the target's features of the verified positions
          back += b * (k + 1) * spec.hidden_size * 4 * spec.feature_layers
        transfer_s = _link(links, gd, gt).seconds(sent) + _link(links, gt, gd).seconds(back)
      e = expected_tokens_per_step(alpha, k)
      step = draft_s + verify_s + transfer_s
      cands.append(Candidate(target_group=gt, drafter_group=gd, k=k, tokens_per_step=e,
                             draft_s=draft_s, verify_s=verify_s, transfer_s=transfer_s,
                             draft_pass_s=d_prof[gd].latency(b, 1),
                             tokens_per_s=b * e / step))
  order = {g: i for i, g in enumerate(groups)}
  ranked = tuple(sorted(cands, key=lambda c: (
      -c.tokens_per_s, c.k, not c.fused, order[c.target_group],
      -1 if c.drafter_group is None else order[c.drafter_group])))
  best = ranked[0]
  baseline = max((c for c in cands if c.k == 0), key=lambda c: (c.tokens_per_s,
                                                                -order[c.target_group]))
  return Plan(target_group=best.target_group, drafter_group=best.drafter_group, k=best.k,
              tokens_per_s=best.tokens_per_s,
              speedup=best.tokens_per_s / baseline.tokens_per_s, baseline=baseline,
              candidates=ranked, acceptance=alpha, batch_size=b, drafter=spec)
