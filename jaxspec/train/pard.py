"""PARD's mask-token objective (An et al. 2025, arXiv 2504.18583): train a draft model to
propose k tokens from one forward pass (`jaxspec.drafters.pard.ParallelDraft`).

At decoding time the draft reads the context x_1..x_t followed by m mask tokens (m = 0..k-1)
and the position after the m-th mask predicts x_{t+m+1}. Training builds those inputs for many
anchors t of a sequence at once, in one forward pass over a packed row:

  [x_1 .. x_T | slots]

The first T entries are the sequence itself (depth 1: position t predicts x_{t+1}, ordinary
next-token prediction). Each slot (d, j), d = 2..k, is the (d-1)-th mask after anchor A_j: its
token is the mask, its rotary position is pos(A_j) + d - 1, it attends to the real tokens up to
A_j (in A_j's conversation) and to the slots (2..d, j) of the same anchor, and it predicts
x_{A_j + d}. Real tokens never attend to slots, so the depth-1 outputs are a plain forward's.
Every slot thus sees exactly what the draft sees at decoding time.

Conditional drop (the paper's "COD"): the deeper subtasks matter less (a deep draft counts only
when every earlier one was accepted) and cost as much each, so depth d keeps only the
n_d = ceil(anchors * keep ** (d - 2)) highest-ranked anchors. The anchors are ranked once per
row, so the ones kept at depth d are kept at every depth below it: a slot's mask chain is
always complete (the condition). Depth 1 costs nothing extra (it is the sequence itself).

Labels: "target" (default): the target's next-token distribution at the label's position
(KL(p || q), as `distill`); since the corpus is the target's own sampled text, the minimiser at
a mask position is the target's marginal over x_{t+m+1} given x_{<=t}, what parallel drafting
should propose, with less variance than the sampled token. "tokens": cross-entropy on the
stored tokens (the paper's target-independent training; no target pass).

The anchors are a pure function of the batch (a random ranking seeded by its token ids), so a
run resumed from a checkpoint trains on the same anchors.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from jaxspec.checks import check_int
from jaxspec.models.llama import forward, init_cache, logits_from_hidden, softcap
from jaxspec.train.corpus import same_segment_ahead

LABELS = ("target", "tokens")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PardObjective:
  """The mask-token objective's settings.

  Attributes:
    mask_id: the mask token (an id of the draft's vocabulary that text never uses; its
      embedding is trained).
    k: drafts per forward pass the draft is trained for (masks 1..k-1); saved as the
      checkpoint's "pard_trained_k".
    anchors: anchors per row that get a mask chain (depth 2).
    keep: conditional drop: depth d keeps ceil(anchors * keep ** (d - 2)) anchors, in (0, 1].
    positions: depth-1 positions per row that go through the LM head (None: every position).
    labels: "target" (KL to the target's distribution) or "tokens" (cross-entropy).
  """

  mask_id: int
  k: int = 4
  anchors: int = 32
  keep: float = 0.7
  positions: int | None = None
  labels: str = "target"

  def __post_init__(self):
    check_int("PardObjective.mask_id", self.mask_id, 0, why="the mask token's id")
    check_int("PardObjective.k", self.k, 2,
              why="drafts per pass; k = 1 is ordinary distillation (objective=\"kl\")")
    check_int("PardObjective.anchors", self.anchors, 1, why="anchors per row with masks")
    if isinstance(self.keep, bool) or not isinstance(self.keep, (int, float)) \
        or not 0 < self.keep <= 1:
      raise ValueError(f"PardObjective.keep must be a number in (0, 1] (the share of anchors"
                       f" kept from one depth to the next), got {self.keep!r}")
    if self.positions is not None:
      check_int("PardObjective.positions", self.positions, 1,
                why="depth-1 positions per row; None: all")
    if self.labels not in LABELS:
      raise ValueError(f"PardObjective.labels must be one of {LABELS}, got {self.labels!r}")

  def depth_counts(self) -> tuple[int, ...]:
    """(n_2, ..., n_k): anchors kept at each mask depth."""
    return tuple(max(1, math.ceil(self.anchors * self.keep ** (d - 2)))
                 for d in range(2, self.k + 1))


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PardLayout:
  """One packed training row per batch row: the sequence followed by the mask slots."""

  tokens: jax.Array  # [B, L] int32, L = T + S (S = sum of n_d)
  positions: jax.Array  # [B, L] int32 rotary positions
  mask: jax.Array  # [B, L, L] bool attention (query, key)
  read: jax.Array  # [B, R + S] int32 entries whose outputs are trained (depth 1, then slots)
  label: jax.Array  # [B, R + S] int32 index into the sequence of the token each predicts
  valid: jax.Array  # [B, R + S] bool the label exists (same conversation, a response token)
  depth: jax.Array  # [R + S] int32 1 for the depth-1 entries, d for slot (d, j)


def pard_layout(tokens, loss_mask, objective: PardObjective, *, segment_ids=None,
                positions=None, key=None) -> PardLayout:
  """The packed row of the mask-token objective (see the module docstring).

  Args:
    tokens: [B, T] int32.
    loss_mask: [B, T] 1 on the tokens a draft should learn to propose (responses).
    objective: the settings.
    segment_ids: [B, T] conversations of a packed row (1, 2, ...; 0 padding); default one.
    positions: [B, T] rotary positions (restarting per conversation); default 0..T-1.
    key: the anchors' random ranking; default one seeded by the token ids.
  Returns:
    The layout.
  """
  b, t = tokens.shape
  k = objective.k
  counts = objective.depth_counts()
  n_anchor = min(counts[0], t)
  counts = tuple(min(c, n_anchor) for c in counts)
  r = t if objective.positions is None else min(objective.positions, t)
  seg = jnp.ones((b, t), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
  pos = (jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)) if positions is None
         else positions.astype(jnp.int32))
  lm = loss_mask > 0
  idx = jnp.arange(t)

  def labelled(d):  # [B, T] x_{a + d} exists in a's conversation and is a response token
    nxt = jnp.take_along_axis(lm, jnp.minimum(idx + d, t - 1)[None, :].repeat(b, 0), axis=1)
    return same_segment_ahead(seg, d) & nxt

  if key is None:  # a pure function of the batch: the same anchors after a resume
    seed = jnp.sum(tokens.astype(jnp.uint32) * (jnp.arange(t, dtype=jnp.uint32) + 1))
    key = jax.random.fold_in(jax.random.key(0), seed)
  u = jax.random.uniform(key, (b, t))
  cand = labelled(1)
  # Depth 1: the r best-ranked labelled positions (all of them when r = T).
  _, read1 = jax.lax.top_k(jnp.where(cand, u, -1.0), r)  # [B, r]
  # Anchors: ranked once, so the n_d kept at depth d are the first n_d, kept at every depth
  # below it as well.
  _, anchor = jax.lax.top_k(jnp.where(cand, u, -1.0), n_anchor)  # [B, n]
  slot_j = jnp.concatenate([jnp.arange(c) for c in counts])  # [S] anchor rank of each slot
  slot_d = jnp.concatenate([jnp.full((c,), d, jnp.int32) for d, c in zip(range(2, k + 1),
                                                                          counts)])  # [S]
  s = slot_j.shape[0]
  a = anchor[:, slot_j]  # [B, S] the slot's anchor index
  take = lambda x, i: jnp.take_along_axis(x, i, axis=1)
  slot_tokens = jnp.full((b, s), objective.mask_id, jnp.int32)
  slot_pos = take(pos, a) + (slot_d - 1)[None, :]
  slot_seg = take(seg, a)
  # Attention. Real -> real: causal inside a conversation; real -> slot: never.
  same = seg[:, :, None] == seg[:, None, :]
  rr = same & jnp.tril(jnp.ones((t, t), bool))[None]
  rs = jnp.zeros((b, t, s), bool)
  # Slot -> real: the anchor's conversation up to the anchor.
  sr = (slot_seg[:, :, None] == seg[:, None, :]) & (idx[None, None, :] <= a[:, :, None])
  # Slot -> slot: the same anchor, depth up to its own.
  ss = (slot_j[:, None] == slot_j[None, :]) & (slot_d[None, :] <= slot_d[:, None])
  ss = jnp.broadcast_to(ss, (b, s, s))
  mask = jnp.concatenate([jnp.concatenate([rr, rs], axis=2),
                          jnp.concatenate([sr, ss], axis=2)], axis=1)
  # What is trained: depth-1 outputs predict the next token; slot (d, j) predicts x_{A_j + d}.
  valid1 = take(cand, read1)
  slot_valid = jnp.stack([labelled(d) for d in range(2, k + 1)], axis=0)  # [k-1, B, T]
  slot_valid = slot_valid[slot_d - 2, :, :]  # [S, B, T]
  slot_valid = jnp.take_along_axis(jnp.swapaxes(slot_valid, 0, 1), a[:, :, None],
                                   axis=2)[:, :, 0]  # [B, S]
  return PardLayout(
      tokens=jnp.concatenate([tokens.astype(jnp.int32), slot_tokens], axis=1),
      positions=jnp.concatenate([pos, slot_pos], axis=1),
      mask=mask,
      read=jnp.concatenate([read1, t + jnp.broadcast_to(jnp.arange(s), (b, s))], axis=1),
      label=jnp.concatenate([read1 + 1, a + slot_d[None, :]], axis=1).astype(jnp.int32),
      valid=jnp.concatenate([valid1, slot_valid], axis=1),
      depth=jnp.concatenate([jnp.ones((r,), jnp.int32), slot_d]))


def pard_loss(model, batch, frozen, *, objective: PardObjective):
  """The mask-token objective on a batch.

  Args:
    model: the draft (`jaxspec.train.distill.DraftLM`).
    batch: tokens [B, T], loss_mask [B, T]; optional segment_ids, positions [B, T]; with
      labels="target", hidden_final [B, T, D] (the target's, `with_hidden_states`).
    frozen: the target's `Params` (its LM head turns hidden_final into p); unused with
      labels="tokens".
    objective: the settings.
  Returns:
    (mean loss over the trained entries, metrics: top-1 agreement with the label at each depth,
    top1_d1 .. top1_d{k}).
  """
  cfg = model.cfg
  params = model.params()
  tokens = batch["tokens"]
  b, _ = tokens.shape
  lay = pard_layout(tokens, batch["loss_mask"], objective, segment_ids=batch.get("segment_ids"),
                    positions=batch.get("positions"))
  n = lay.tokens.shape[1]
  _, hidden, _ = forward(params, lay.tokens, init_cache(cfg, b, n), cfg, logits=False,
                         fresh=True, positions=lay.positions, block_mask=lay.mask)
  take = lambda x, i: jnp.take_along_axis(x, i[:, :, None], axis=1)
  q_logits = softcap(logits_from_hidden(params, take(hidden.final, lay.read)),
                     cfg.final_softcap)  # [B, E, V]
  logq = jax.nn.log_softmax(q_logits, axis=-1)
  valid = lay.valid.astype(jnp.float32)
  if objective.labels == "target":
    # The target's distribution of the label token: its output one position before it. A slot
    # whose label lies past the row (an anchor near a row's end: not valid) reads the last
    # position instead, whose loss is dropped: jnp.take_along_axis fills out-of-range reads
    # with NaN, and NaN * 0 would still be NaN.
    at = jnp.minimum(lay.label - 1, tokens.shape[1] - 1)
    h = take(batch["hidden_final"], at).astype(frozen.final_norm.dtype)
    p_logits = softcap(logits_from_hidden(frozen, h), cfg.final_softcap)
    logp = jax.nn.log_softmax(p_logits, axis=-1)
    per = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)  # [B, E]
    want = jnp.argmax(p_logits, -1)
  else:
    want = jnp.take_along_axis(tokens, jnp.minimum(lay.label, tokens.shape[1] - 1), axis=1)
    per = -jnp.take_along_axis(logq, want[:, :, None], axis=2)[:, :, 0]
  loss = jnp.sum(jnp.where(valid > 0, per, 0.0)) / jnp.maximum(valid.sum(), 1.0)
  agree = (jnp.argmax(q_logits, -1) == want).astype(jnp.float32) * valid
  metrics = {}
  for d in range(1, objective.k + 1):
    at = (lay.depth == d)[None, :]
    metrics[f"top1_d{d}"] = jnp.sum(agree * at) / jnp.maximum(jnp.sum(valid * at), 1.0)
  return loss, metrics


__all__ = ["LABELS", "PardLayout", "PardObjective", "pard_layout", "pard_loss"]
