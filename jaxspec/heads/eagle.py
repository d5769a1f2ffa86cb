"""EAGLE (Li et al. 2024) and EAGLE-3 (Li et al. 2025): one Llama decoder layer over (token
embedding, feature) pairs, run autoregressively over its own output features; step j at
position t predicts x_{t+2+j}. Training runs it with training-time test (`_ttt_attention`);
decoding runs `eagle_block` over a draft KV cache."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.heads.common import (Buffer, F32, check_config_ints, make_config, normal_init,
                                  packed_attention_mask, shift, target_dims)
from jaxspec.models.config import LlamaConfig
from jaxspec.models.llama import (Params, apply_rope, attention, embed_tokens, lm_head_weight,
                                  logits_from_hidden, rms_norm, rope_inv_freq, write_cache)

_NEG = -1e30


@dataclasses.dataclass(frozen=True, kw_only=True)
class EagleConfig:
  """EAGLE (Li et al. 2024) and EAGLE-3 (Li et al. 2025): one Llama decoder layer over
  (token embedding, feature) pairs, run autoregressively over its own output features.

  version 1 (EAGLE): the feature is the target's final (normed) hidden state f_t; the layer
    input is fc([embed(x_{t+1}), feature]) (2D -> D, with bias) and the layer has no input norm
    (as EAGLE's first layer). Its output h regresses f_{t+1} and goes straight into the
    target's LM head: f_t is already final-normed, so the target's final norm is not applied
    again.
  version 3 (EAGLE-3): the feature at real positions is fc(concat of three target layer
    outputs) (3D -> D, no bias); the layer normalises the embedding and the feature separately
    (input_layernorm, hidden_norm), attends over their concatenation (q/k/v from 2D), keeps the
    un-normed feature as the residual, and its output goes through its own norm and LM head,
    optionally over a reduced draft vocabulary (`d2t`/`t2d` in the exported format).

  layers: target layers fused by EAGLE-3 (jaxspec indices); None: EAGLE-3's defaults 2, L//2,
    L-3 in Hugging Face numbering, i.e. jaxspec (1, L//2 - 1, L - 4), clipped to [0, L).
  num_heads, num_kv_heads, head_dim, intermediate_size: the layer's geometry (0: the target's).
  draft_vocab_size: EAGLE-3 only; 0 keeps the target's vocabulary, N uses the N target tokens
    given at creation (`draft_vocab=` ids or `token_counts=`), by default the most frequent.
  ttt_steps: training-time-test steps: the layer runs that many times on its own features
    during training with losses weighted loss_decay**j (EAGLE-3: 3 steps, 0.8).
  soft: train against the target's distribution (KL) instead of the hard next tokens.
  token_weight, feature_weight: loss = token_weight * token loss + feature_weight * smooth-L1
    of h_j against f_{t+1+j} (version 1 only; EAGLE uses 0.1 and 1.0).

  EAGLE-3 variants of vLLM's `speculators` format (each off by default, as in a plain EAGLE-3
  checkpoint; every norm is an RMSNorm with the target's epsilon):
  norm_before_fc: one RMSNorm over the concatenated layers [n D] before fc (gpt-oss style,
    EAGLE 3.1; weight `fc_in_norm` [nD], `input_norm.weight` in the format).
  fc_norm: an RMSNorm per fused layer before the concatenation (weights `fc_norms` [n, D],
    `fc_norm.{i}.weight`); exclusive with norm_before_fc.
  norm_output: the feature carried to the next step is the output after the head's final norm
    (EAGLE 3.1), norm(h_j), instead of h_j; the logits are unchanged (lm_head(norm(h_j))).
  norm_before_residual: the residual of the attention block is the normed feature
    hidden_norm(feature) instead of the feature.
  """

  version: int = 1
  layers: tuple[int, ...] | None = None
  num_heads: int = 0
  num_kv_heads: int = 0
  head_dim: int = 0
  intermediate_size: int = 0
  draft_vocab_size: int = 0
  ttt_steps: int = 1
  loss_decay: float = 0.8
  soft: bool = True
  token_weight: float = 0.1
  feature_weight: float = 1.0
  norm_before_fc: bool = False
  fc_norm: bool = False
  norm_output: bool = False
  norm_before_residual: bool = False

  def __post_init__(self):
    # 0 for the geometry: the target's.
    check_config_ints(self, dict(num_heads=0, num_kv_heads=0, head_dim=0, intermediate_size=0,
                                 draft_vocab_size=0, ttt_steps=1))


LM_HEAD_INITS = ("random", "target")

# EAGLE-3 switches of the `speculators` format (`EagleConfig`): EAGLE version 1 has none.
EAGLE3_SWITCHES = ("norm_before_fc", "fc_norm", "norm_output", "norm_before_residual")


def eagle3_default_layers(num_layers: int) -> tuple[int, ...]:
  """EAGLE-3's default fused layers (HF 2, L//2, L-3) as jaxspec output indices."""
  return tuple(min(max(h - 1, 0), num_layers - 1) for h in (2, num_layers // 2, num_layers - 3))


def _eagle_config(target_cfg: LlamaConfig, options: Mapping[str, Any]) -> EagleConfig:
  opts = {k: v for k, v in options.items() if k not in _CREATE_ONLY}
  version = opts.get("version", 1)
  if version not in (1, 3):
    raise ValueError(f"EAGLE version must be 1 or 3, got {version!r}")
  init = options.get("lm_head_init", "random")
  if init not in LM_HEAD_INITS:
    raise ValueError(f"lm_head_init must be one of {LM_HEAD_INITS}, got {init!r}")
  if init == "target" and version != 3:
    raise ValueError("lm_head_init='target' starts EAGLE-3's own LM head from the target's;"
                     " version 1 uses the target's LM head itself: drop it or use version=3")
  if version == 3:
    opts.setdefault("ttt_steps", 3)
    opts.setdefault("token_weight", 1.0)
    opts.setdefault("feature_weight", 0.0)
    layers = opts.get("layers")
    layers = eagle3_default_layers(target_cfg.num_layers) if layers is None else layers
    layers = tuple(int(i) for i in layers)
    bad = [i for i in layers if not 0 <= i < target_cfg.num_layers]
    if bad or not layers:
      raise ValueError(f"EAGLE-3 layers {layers} must be target layer indices in [0,"
                       f" {target_cfg.num_layers})")
    opts["layers"] = layers
    if opts.get("norm_before_fc") and opts.get("fc_norm"):
      raise ValueError("norm_before_fc (one norm over the concatenated layers) and fc_norm (a"
                       " norm per layer) are exclusive: set one of them")
    if options.get("draft_vocab") is not None:
      n = len(options["draft_vocab"])
      if opts.get("draft_vocab_size", n) != n:
        raise ValueError(f"draft_vocab has {n} ids but draft_vocab_size is"
                         f" {opts['draft_vocab_size']}: pass one of them")
      opts["draft_vocab_size"] = n
  else:
    if opts.get("layers"):
      raise ValueError("EAGLE (version 1) reads the target's final hidden state only: drop"
                       " `layers` or use version=3")
    if opts.get("draft_vocab_size") or options.get("draft_vocab") is not None:
      raise ValueError("a reduced draft vocabulary needs EAGLE-3's own LM head: use version=3")
    on = [name for name in EAGLE3_SWITCHES if opts.get(name)]
    if on:
      raise ValueError(f"{on} are EAGLE-3 switches (they act on its fc and its own norm): use"
                       " version=3 or drop them")
    opts["layers"] = None
  cfg = make_config(EagleConfig, opts)
  # The layer's geometry is written out, so a config read back from a checkpoint is equal.
  lc = eagle_layer_config(target_cfg, cfg)
  return dataclasses.replace(cfg, num_heads=lc.num_heads, num_kv_heads=lc.num_kv_heads,
                             head_dim=lc.head_dim, intermediate_size=lc.intermediate_size)


# What the draft layer takes from the target: its vocabulary and width, its rotary embedding
# (the head's positions are the target's), its norm epsilon and token ids. Every other
# `LlamaConfig` field keeps its default, so the layer is a plain Llama layer (no window,
# soft-cap, bias, q/k or sandwich norm of the target's family) whatever switches a family adds.
TAKEN_FROM_TARGET = ("vocab_size", "hidden_size", "rope_theta", "rope_scaling",
                     "partial_rotary_factor", "rms_norm_eps", "tie_embeddings",
                     "max_position_embeddings", "bos_token_id", "eos_token_ids", "compute_dtype",
                     "architecture", "attention_kernel")


def eagle_layer_config(target_cfg: LlamaConfig, cfg: EagleConfig) -> LlamaConfig:
  """The draft layer's geometry as a one-layer LlamaConfig: the target's `TAKEN_FROM_TARGET`
  fields, the head's own geometry (0: the target's), float32 weights (the head trains in
  float32), and every other field at its default: a plain Llama layer, as the head trains it."""
  return LlamaConfig(
      **{name: getattr(target_cfg, name) for name in TAKEN_FROM_TARGET},
      num_layers=1, num_heads=cfg.num_heads or target_cfg.num_heads,
      num_kv_heads=cfg.num_kv_heads or target_cfg.num_kv_heads,
      head_dim=cfg.head_dim or target_cfg.head_dim,
      intermediate_size=cfg.intermediate_size or target_cfg.intermediate_size, dtype="float32")


class EagleHead(nnx.Module):
  """One Llama decoder layer over (embedding, feature) pairs; see `EagleConfig`."""

  def __init__(self, target_cfg: LlamaConfig, cfg: EagleConfig, *, rngs: nnx.Rngs,
               draft_vocab: np.ndarray | None = None):
    lc = eagle_layer_config(target_cfg, cfg)
    d, v = target_cfg.hidden_size, target_cfg.vocab_size
    h, g, k, f = lc.num_heads, lc.num_kv_heads, lc.head_dim, lc.intermediate_size
    v3 = cfg.version == 3
    self.cfg = cfg
    self.layer_cfg = lc
    self.target_dims = target_dims(target_cfg)
    self.target_softcap = target_cfg.final_softcap  # the soft targets' cap (Gemma 2)
    self.eps = target_cfg.rms_norm_eps
    std = 0.02
    n_fc = len(cfg.layers) * d if v3 else 2 * d
    d_in = 2 * d if v3 else d
    self.fc = nnx.Param(normal_init(rngs, (n_fc, d), std))  # [3D or 2D, D]
    self.fc_bias = None if v3 else nnx.Param(jnp.zeros((d,), F32))  # [D]
    self.wq = nnx.Param(normal_init(rngs, (d_in, h, k), std))  # [2D or D, H, K]
    self.wk = nnx.Param(normal_init(rngs, (d_in, g, k), std))  # [2D or D, G, K]
    self.wv = nnx.Param(normal_init(rngs, (d_in, g, k), std))
    self.wo = nnx.Param(normal_init(rngs, (h, k, d), std))  # [H, K, D]
    self.mlp_norm = nnx.Param(jnp.ones((d,), F32))  # post_attention_layernorm
    self.w_gate = nnx.Param(normal_init(rngs, (d, f), std))  # [D, F]
    self.w_up = nnx.Param(normal_init(rngs, (d, f), std))
    self.w_down = nnx.Param(normal_init(rngs, (f, d), std))  # [F, D]
    if v3:
      n = cfg.draft_vocab_size or v
      self.input_norm = nnx.Param(jnp.ones((d,), F32))  # on the embedding
      self.hidden_norm = nnx.Param(jnp.ones((d,), F32))  # on the feature
      self.norm = nnx.Param(jnp.ones((d,), F32))  # before the draft LM head
      self.lm_head = nnx.Param(normal_init(rngs, (d, n), std))  # [D, N]
      ids = np.arange(v) if draft_vocab is None else np.asarray(draft_vocab)
      if ids.shape != (n,):
        raise ValueError(f"draft vocabulary has {ids.shape} ids, the config says {n}")
      if not np.issubdtype(ids.dtype, np.integer) or (n and not 0 <= ids.min() <= ids.max() < v):
        raise ValueError(f"draft_vocab must hold target token ids in [0, {v}), got"
                         f" {ids.dtype} ids in [{ids.min()}, {ids.max()}]")
      if len(np.unique(ids)) != n:
        raise ValueError("draft_vocab holds a token id twice: give each target id once")
      self.draft_ids = Buffer(jnp.asarray(ids, jnp.int32))  # [N] target id of every draft id
    else:
      self.input_norm = self.hidden_norm = self.norm = self.lm_head = self.draft_ids = None
    nl = len(cfg.layers) if v3 else 0
    # EAGLE 3.1's norms of the fused layers (`EagleConfig.norm_before_fc`, `fc_norm`).
    self.fc_in_norm = nnx.Param(jnp.ones((nl * d,), F32)) if cfg.norm_before_fc else None  # [nD]
    self.fc_norms = nnx.Param(jnp.ones((nl, d), F32)) if cfg.fc_norm else None  # [n, D]

  def init_from_target(self, params: Params) -> None:
    """Starts the own LM head and its norm from the target's: the output rows of the draft
    vocabulary (`draft_ids`) and the final norm (`create_eagle(..., lm_head_init="target")`)."""
    if self.lm_head is None:
      raise ValueError("an EAGLE (version 1) head has no LM head of its own to initialise")
    w = lm_head_weight(params)  # [D, V] float32
    if w.shape[0] != self.lm_head.shape[0] or params.final_norm.shape != self.norm.shape:
      raise ValueError(f"target_params do not fit this head: LM head {w.shape}, final norm"
                       f" {params.final_norm.shape}, the head's width {self.norm.shape}: pass"
                       " the Params of the target the head is created for")
    self.lm_head[...] = jnp.take(w, self.draft_ids[...], axis=1)
    self.norm[...] = jnp.asarray(params.final_norm, F32)

  # -- the pieces shared by training and decoding --

  def real_feature(self, hidden_final: jax.Array, hidden_layers: jax.Array | None) -> jax.Array:
    """The step-0 feature at real positions [..., D] from f_t [..., D] or the layers [..., n, D]."""
    if self.cfg.version == 1:
      return hidden_final.astype(F32)
    if hidden_layers is None:
      raise ValueError(f"EAGLE-3 reads target layers {self.cfg.layers}: pass hidden_layers")
    x = hidden_layers.astype(F32)  # [..., n, D]
    if self.fc_norms is not None:  # one norm per fused layer
      x = rms_norm(x, self.fc_norms[...], self.eps)
    x = x.reshape(x.shape[:-2] + (-1,))  # [..., nD]
    if self.fc_in_norm is not None:  # one norm over their concatenation
      x = rms_norm(x, self.fc_in_norm[...], self.eps)
    return x @ self.fc[...]

  def layer_input(self, frozen: Params, feat: jax.Array, tok: jax.Array):
    """(attention input [..., D or 2D], residual [..., D]) of the pair (feature, token)."""
    e = embed_tokens(frozen.embed, tok, F32).astype(F32)
    if self.cfg.version == 1:
      x = jnp.concatenate([e, feat], axis=-1) @ self.fc[...] + self.fc_bias[...]
      return x, x
    normed = rms_norm(feat, self.hidden_norm[...], self.eps)
    x = jnp.concatenate([rms_norm(e, self.input_norm[...], self.eps), normed], axis=-1)
    return x, normed if self.cfg.norm_before_residual else feat

  def qkv(self, x: jax.Array, positions: jax.Array):
    """x [B, T, Din], positions [B, T] -> rotated q [B, T, H, K], k and v [B, T, G, K]."""
    return (self.query(x, positions),) + self.keys_values(x, positions)

  def query(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    """x [B, T, Din], positions [B, T] -> rotated q [B, T, H, K]."""
    q = jnp.einsum("btd,dhk->bthk", x, self.wq[...])
    return apply_rope(q, positions, rope_inv_freq(self.layer_cfg))

  def keys_values(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [B, T, Din], positions [B, T] -> rotated k and v [B, T, G, K]."""
    k = jnp.einsum("btd,dgk->btgk", x, self.wk[...])
    v = jnp.einsum("btd,dgk->btgk", x, self.wv[...])
    return apply_rope(k, positions, rope_inv_freq(self.layer_cfg)), v

  def finish(self, resid: jax.Array, attn: jax.Array) -> jax.Array:
    """Output projection, residual and SwiGLU MLP: the step's output feature [B, T, D], the
    layer's output h, or norm(h) with `norm_output` (EAGLE 3.1 carries the normed state to
    the next step; `logits` then applies no norm again)."""
    h = resid + jnp.einsum("bthk,hkd->btd", attn, self.wo[...])
    x = rms_norm(h, self.mlp_norm[...], self.eps)
    h = h + (jax.nn.silu(x @ self.w_gate[...]) * (x @ self.w_up[...])) @ self.w_down[...]
    return rms_norm(h, self.norm[...], self.eps) if self.cfg.norm_output else h

  def logits(self, frozen: Params, h: jax.Array) -> jax.Array:
    """A step's output feature [..., D] (`finish`) -> float32 logits over the draft
    vocabulary [..., N] (N = V for version 1): lm_head(norm(h)) either way."""
    if self.cfg.version == 1:
      return logits_from_hidden(frozen, h)
    if not self.cfg.norm_output:
      h = rms_norm(h, self.norm[...], self.eps)
    return h @ self.lm_head[...]

  def target_logits(self, frozen: Params, h: jax.Array) -> jax.Array:
    """Logits over the target's vocabulary [..., V]; tokens outside the draft vocab get -inf."""
    lg = self.logits(frozen, h)
    if self.cfg.version == 1 or not self.cfg.draft_vocab_size:
      return lg
    v = self.target_dims[1]
    full = jnp.full(lg.shape[:-1] + (v,), -jnp.inf, F32)
    return full.at[..., self.draft_ids[...]].set(lg)


def _ttt_attention(q, k0, v0, ks, vs, mask=None):
  """Training-time-test attention.

  q [B, T, H, K] are step j's queries; k0, v0 [B, T, G, K] step 0's keys and values (read
  causally, or by `mask` [B, T, T]: a packed row's `packed_attention_mask`); ks, vs the keys and
  values of steps 1..j [B, T, G, K] each, read at the query's own position only. That is exactly
  what decoding sees at draft step j from position t: the real pairs 0..t in the cache, then its
  own entries for steps 1..j.
  """
  b, t, h, kd = q.shape
  g = k0.shape[2]
  qg = q.astype(F32).reshape(b, t, g, h // g, kd) / math.sqrt(kd)
  s0 = jnp.einsum("btgrk,bsgk->bgrts", qg, k0.astype(F32))
  seen = jnp.tril(jnp.ones((t, t), bool)) if mask is None else mask[:, None, None]
  s0 = jnp.where(seen, s0, _NEG)
  sd = [jnp.einsum("btgrk,btgk->bgrt", qg, k.astype(F32))[..., None] for k in ks]
  p = jax.nn.softmax(jnp.concatenate([s0] + sd, axis=-1), axis=-1)
  out = jnp.einsum("bgrts,bsgk->btgrk", p[..., :t], v0.astype(F32))
  for i, v in enumerate(vs):
    out = out + jnp.einsum("bgrt,btgk->btgrk", p[..., t + i], v.astype(F32))
  return out.reshape(b, t, h, kd)


def _eagle_rollout(model: EagleHead, frozen, tokens, hidden_final, hidden_layers, steps,
                   segment_ids=None, positions=None):
  """The training-time forward: per step j, logits [B, T, N] and features h_j [B, T, D].

  Step j at position t reads the token x_{t+1+j} at rotary position t + 1 + j (the position of
  that token, as decoding and `speculators` number them). A packed row (`segment_ids` [B, T],
  `positions` [B, T] restarting per conversation) attends within its conversation, at the
  conversation's own positions; predictions whose label lies in the next conversation are
  masked by the loss (`same_segment_ahead`).
  """
  b, t = tokens.shape
  feat = model.real_feature(hidden_final, hidden_layers)
  if positions is None:
    positions = jnp.arange(t, dtype=jnp.int32)[None]
  base = jnp.broadcast_to(positions.astype(jnp.int32) + 1, (b, t))
  mask = None if segment_ids is None else packed_attention_mask(segment_ids)
  k0 = v0 = None
  ks, vs, logits, feats = [], [], [], []
  for j in range(steps):
    x, resid = model.layer_input(frozen, feat, shift(tokens, 1 + j))
    q, k, v = model.qkv(x, base + j)
    if j == 0:
      k0, v0 = k, v
    else:
      ks.append(k)
      vs.append(v)
    feat = model.finish(resid, _ttt_attention(q, k0, v0, ks, vs, mask))
    feats.append(feat)
    logits.append(model.logits(frozen, feat))
  return jnp.stack(logits, axis=2), jnp.stack(feats, axis=2)


def eagle_predict(model: EagleHead, batch, frozen, steps):
  """The training-time forward: (logits [B, T, steps, N], features h_j [B, T, steps, D])."""
  return _eagle_rollout(model, frozen, batch["tokens"], batch["hidden_final"],
                        batch.get("hidden_layers"), steps, batch.get("segment_ids"),
                        batch.get("positions"))


def eagle_block(model: EagleHead, frozen: Params, cache, feat: jax.Array, tok: jax.Array, *,
                fresh: bool = False, offsets: jax.Array | None = None,
                mask: jax.Array | None = None, write: bool = True, return_block: bool = False,
                window: int | None = None):
  """Decoding: T pairs (feat [B, T, D], tok [B, T]) on top of the draft cache.

  Pair t of a row goes to cache position length + t with rotary position length + t + 1 (as in
  `_eagle_rollout`). Returns (h [B, T, D], cache with length + T).

  A draft tree passes `offsets` [B, T] (cache position length + offset: a node's depth - 1) and
  `mask` [B, T, T] (ancestors only) with write=False: the cache is only read and comes back
  unchanged. With write=False and return_block, the pairs' keys and values come back instead of
  the cache, as (k, v) [1, B, T, G, K] for `write_cache`: a caller inside a `lax.cond` writes
  them after it, so the cache never passes through the conditional.

  With `window`, every pair attends to the `window` pairs up to itself only (a sliding window
  over cache positions: `EagleDrafter.context_window`).
  """
  b, t = tok.shape
  x, resid = model.layer_input(frozen, feat, tok)
  if offsets is None:
    offsets = jnp.arange(t, dtype=jnp.int32)[None]
  pos = cache.length[:, None] + offsets
  q, k, v = model.qkv(x, pos + 1)
  if mask is None:
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  cfg = model.layer_cfg
  if window is not None:
    cfg = dataclasses.replace(cfg, sliding_window=window)
  attn = attention(q, k, v, None if fresh else cache.k[0], None if fresh else cache.v[0],
                    cache.length, pos, mask, cfg)
  h = model.finish(resid, attn.astype(F32))
  if not write:
    return h, ((k[None], v[None]) if return_block else cache)
  return h, write_cache(cache, k[None], v[None], positions_start=cache.length)


def eagle_prefill(model: EagleHead, frozen: Params, cache, feat: jax.Array, tok: jax.Array,
                  at: jax.Array):
  """Decoding's first block: the prompt's T pairs (feat [B, T, D], tok [B, T]) written into an
  empty draft cache, and the layer's output at pair `at` [B] only: h [B, D].

  The same function as `eagle_block(..., fresh=True)` read at `at`: the cache needs every pair's
  keys and values, but the next draft only that one output, so the query, attention, output
  projection and MLP run for one position per row (on a long prompt they were most of the pass),
  reading the pairs before it as a cached prefix.
  """
  b, t = tok.shape
  x, resid = model.layer_input(frozen, feat, tok)
  pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32)[None], (b, t))
  k, v = model.keys_values(x, pos + 1)
  cache = write_cache(cache, k[None], v[None], positions_start=jnp.zeros((b,), jnp.int32))
  pick = lambda a: jnp.take_along_axis(a, at.reshape((b,) + (1,) * (a.ndim - 1)), axis=1)
  q = model.query(pick(x), pick(pos) + 1)  # the one query read: not T of them
  attn = attention(q, pick(k), pick(v), cache.k[0], cache.v[0], at, at[:, None],
                   jnp.ones((b, 1, 1), bool), model.layer_cfg)
  return model.finish(pick(resid), attn.astype(F32))[:, 0], cache


# ----------------------------------------------------------------------------------------------
# EAGLE-3's reduced draft vocabulary, and creating a head.


def draft_vocab_from_counts(counts: np.ndarray, size: int) -> np.ndarray:
  """The `size` most frequent token ids (ties to the lower id), ascending: EAGLE-3's draft vocab."""
  counts = np.asarray(counts)
  if not 0 < size <= counts.shape[0]:
    raise ValueError(f"draft_vocab_size must be in [1, {counts.shape[0]}], got {size}")
  order = np.lexsort((np.arange(counts.shape[0]), -counts))
  return np.sort(order[:size])


def token_counts(tokens: np.ndarray, loss_mask: np.ndarray, vocab_size: int) -> np.ndarray:
  """How often every token id occurs as a response token [V] (to pick a draft vocabulary)."""
  tokens = np.asarray(tokens)
  keep = np.asarray(loss_mask) > 0
  return np.bincount(tokens[keep].reshape(-1), minlength=vocab_size)[:vocab_size]


# Options of `create_eagle` that are not config fields (not saved with the head).
_CREATE_ONLY = ("draft_vocab", "token_counts", "lm_head_init", "target_params")


def create_eagle(target_cfg, *, rngs, **options):
  """An `EagleHead` for the target.

  Options: `EagleConfig`'s fields; for EAGLE-3's reduced vocabulary `draft_vocab=` (target ids)
  or `token_counts=` (the most frequent are kept); and how EAGLE-3's own LM head starts,
  `lm_head_init=`: "random" (normal, std 0.02; the default) or "target" (with
  `target_params=`): the target's output rows of the draft vocabulary and its final norm, so
  training starts from the target's token geometry instead of learning a [D, N] table from
  scratch. Neither is a config field: a loaded head's weights are its own.
  """
  cfg = _eagle_config(target_cfg, options)
  target_params = options.get("target_params")
  init = options.get("lm_head_init", "random")
  if init == "target" and target_params is None:
    raise ValueError("lm_head_init='target' copies the target's LM head: pass"
                     " target_params=<the target's Params> (train_head does)")
  ids = options.get("draft_vocab")
  if cfg.version == 3 and cfg.draft_vocab_size and ids is None:
    counts = options.get("token_counts")
    if counts is None:
      raise ValueError(f"draft_vocab_size={cfg.draft_vocab_size} needs the draft vocabulary:"
                       " pass draft_vocab=<target ids> or token_counts=<[V] counts>"
                       " (jaxspec.heads.token_counts over the training data)")
    ids = draft_vocab_from_counts(counts, cfg.draft_vocab_size)
  head = EagleHead(target_cfg, cfg, rngs=rngs, draft_vocab=ids)
  if init == "target":
    head.init_from_target(target_params)
  return head


def eagle_required_layers(target_cfg, options) -> tuple[int, ...]:
  """The target layers the head reads (EAGLE-3's fused layers; none for EAGLE)."""
  return _eagle_config(target_cfg, options).layers or ()
