"""Draft heads on a frozen target: Medusa, the MLP speculator and EAGLE / EAGLE-3.

A head is a small Flax NNX module that reads the target's hidden states and proposes the next
few tokens; the target itself is frozen and its arrays (embedding, final norm, LM head) are
passed to every head function as `frozen` (a `Params`; a head never copies them). Every kind is
registered in `HEADS` with the same five functions, which is all the trainer and the decoding
loop need:

  create(target_cfg, *, rngs, **options) -> module
  loss(module, batch, frozen) -> (scalar, metrics)         the training objective
  required_layers(target_cfg, options) -> layer indices     target layers the head reads
  drafter(module, target) -> Drafter                        for `speculative_generate`
  offline_chain_tau(module, batch, frozen, k) -> float      expected accepted run + 1 (greedy)

Alignment, the one convention every head follows. The target's hidden state f_t is its state
after reading token x_t (`Hidden.final[:, t]`, after the final norm): the target's own LM head on
f_t predicts x_{t+1}. A head at position t predicts x_{t+2}, x_{t+3}, ...: step (or head) j
predicts x_{t+2+j}.

  Medusa  head j   f_t -> x_{t+2+j}; K independent heads.
  MLP     stage j  (s_{j-1}, x_{t+1+j}) -> s_j -> x_{t+2+j}, with s_{-1} = f_t.
  EAGLE   step j   (feature, x_{t+1+j}) -> h_j -> x_{t+2+j}; the feature is f_t (EAGLE) or
                   fc(three target layers at t) (EAGLE-3) at step 0, then the draft's own h_{j-1}.

Training feeds the true tokens x_{t+1+j} (teacher forcing); decoding feeds the drafted ones,
which are the same whenever the previous drafts were right, and only then does a draft count.

Batches (what `loss` reads): `tokens` [B, T] int32; `loss_mask` [B, T] float (1 where tokens[t]
is a response token the target wrote); `hidden_final` [B, T, D] (f_t); and `hidden_layers`
[B, T, n, D] for `required_layers` (the outputs of those decoder layers, in that order). Rows
hold one right-padded sequence each. The prediction of x_s is weighted by loss_mask[s].

Layer indices are jaxspec's (`forward(hidden_layers=...)`: the output of decoder layer i). The
EAGLE-3 papers, vLLM and `speculators` count Hugging Face `hidden_states` indices instead, where
index i is the *input* of layer i: jaxspec index i is their i + 1 (see `jaxspec.train.export`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models.config import LlamaConfig
from jaxspec.models.errors import CheckpointError
from jaxspec.models.llama import (Params, attention, embed_tokens, apply_rope, is_scanned,
                                  lm_head_weight, logits_from_hidden, rms_norm, rope_inv_freq,
                                  write_cache)

F32 = jnp.float32
_NEG = -1e30


class Buffer(nnx.Variable):
  """An array saved with a head but never trained (EAGLE-3's draft vocabulary)."""


def _normal(rngs: nnx.Rngs, shape, std: float) -> jax.Array:
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


def _shift(x: jax.Array, n: int, fill=0) -> jax.Array:
  """x[:, t + n] at t (filled past the end): aligns position t with what is n tokens later."""
  if n == 0:
    return x
  pad = jnp.full((x.shape[0], min(n, x.shape[1])) + x.shape[2:], fill, x.dtype)
  return jnp.concatenate([x[:, n:], pad], axis=1)


def _target_dims(cfg: LlamaConfig) -> tuple[int, int, int]:
  return (cfg.hidden_size, cfg.vocab_size, cfg.num_layers)


# ----------------------------------------------------------------------------------------------
# Medusa.


@dataclasses.dataclass(frozen=True, kw_only=True)
class MedusaConfig:
  """Medusa-1 heads (Cai et al. 2024).

  num_heads: K heads; head j at position t predicts x_{t+2+j}, so k <= K drafts per step.
  num_layers: residual blocks per head.
  own_lm_head: give every head its own [D, V] LM head (as Medusa checkpoints store them) instead
    of sharing the target's frozen one; set by `jaxspec.train.export.import_medusa`.
  soft: train on the target's distribution (KL) instead of the hard next tokens.
  loss_decay: head j's loss weight is loss_decay**j (Medusa's lambda_k = 0.8**k).
  """

  num_heads: int = 4
  num_layers: int = 1
  own_lm_head: bool = False
  soft: bool = False
  loss_decay: float = 0.8


class MedusaHeads(nnx.Module):
  """K heads, each `x + SiLU(W x + b)` (num_layers times) on f_t, then an LM head.

  W and b start at zero, so an untrained head is exactly the target's LM head on f_t.
  """

  def __init__(self, target_cfg: LlamaConfig, cfg: MedusaConfig, *, rngs: nnx.Rngs):
    if cfg.num_heads < 1 or cfg.num_layers < 1:
      raise ValueError(f"Medusa needs num_heads >= 1 and num_layers >= 1, got {cfg}")
    d, v, k, n = target_cfg.hidden_size, target_cfg.vocab_size, cfg.num_heads, cfg.num_layers
    self.cfg = cfg
    self.target_dims = _target_dims(target_cfg)
    self.w = nnx.Param(jnp.zeros((k, n, d, d), F32))  # [K, layers, D_in, D_out]
    self.b = nnx.Param(jnp.zeros((k, n, d), F32))  # [K, layers, D]
    # [K, D, V]; filled by an import (Medusa checkpoints train a copy of the LM head per head).
    self.lm_head = nnx.Param(jnp.zeros((k, d, v), F32)) if cfg.own_lm_head else None

  def features(self, f: jax.Array) -> jax.Array:
    """f [..., D] -> every head's features [..., K, D] (float32)."""
    k = self.cfg.num_heads
    x = jnp.broadcast_to(f.astype(F32)[..., None, :], f.shape[:-1] + (k, f.shape[-1]))
    w, b = self.w[...], self.b[...]
    for i in range(self.cfg.num_layers):
      x = x + jax.nn.silu(jnp.einsum("...kd,kde->...ke", x, w[:, i]) + b[:, i])
    return x

  def logits(self, frozen: Params, f: jax.Array) -> jax.Array:
    """f [..., D] -> float32 logits [..., K, V]; head j predicts x_{t+2+j}."""
    x = self.features(f)
    if self.lm_head is not None:
      return jnp.einsum("...kd,kdv->...kv", x, self.lm_head[...])
    return logits_from_hidden(frozen, x)


def _medusa_predict(model: MedusaHeads, batch, frozen, steps):
  k = model.cfg.num_heads
  if steps > k:
    raise ValueError(f"this Medusa head has {k} heads, so it drafts at most {k} tokens; asked"
                     f" for {steps}: lower k or train more heads (num_heads)")
  return model.logits(frozen, batch["hidden_final"])[:, :, :steps], None


# ----------------------------------------------------------------------------------------------
# MLP speculator (IBM fms-extras).


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLPConfig:
  """The MLP speculator of IBM's fms-extras (Wertheimer et al. 2024).

  n_predict: stages; stage j at position t predicts x_{t+2+j}, so k <= n_predict.
  inner_dim: width of the running state (0: the target's hidden size).
  tie_to_target: read token embeddings from the target's embedding and logits from the target's
    LM head (no [V, I] tables of its own; needs inner_dim == hidden size).
  tie_stages: share the embedding, LM head, norm and the state projections of stages >= 1
    across stages (fms `tie_weights`).
  scale_input: normalise f_t (a LayerNorm without weights) and divide by sqrt(2) first.
  soft, loss_decay: as in `MedusaConfig` (fms weighs all stages equally).
  """

  n_predict: int = 3
  inner_dim: int = 0
  tie_to_target: bool = False
  tie_stages: bool = False
  scale_input: bool = True
  soft: bool = False
  loss_decay: float = 1.0


def _layer_norm(x, scale=None, bias=None, eps=1e-6):
  x = x.astype(F32)
  mu = x.mean(-1, keepdims=True)
  var = jnp.square(x - mu).mean(-1, keepdims=True)
  y = (x - mu) * jax.lax.rsqrt(var + eps)
  if scale is not None:
    y = y * scale + bias
  return y


class MLPSpeculator(nnx.Module):
  """Stage j: `s = GELU(LN_j(s @ P_j + c * E_j[x_{t+1+j}]))`, logits `s @ H_j`, from s = f_t.

  With tie_to_target the logits are the target's LM head applied to LN_j(...) before the GELU
  (the target's head needs a state of either sign).

  c = emb_weight / state_weight with fms's constants: state_weight = 0.5**(0.5 / n) and
  emb_weight = sqrt((1 - state_weight**2) * I / 2), which keep the state's scale steady.
  """

  def __init__(self, target_cfg: LlamaConfig, cfg: MLPConfig, *, rngs: nnx.Rngs):
    d, v, n = target_cfg.hidden_size, target_cfg.vocab_size, cfg.n_predict
    i = cfg.inner_dim or d
    if n < 1:
      raise ValueError(f"the MLP speculator needs n_predict >= 1, got {n}")
    if cfg.tie_to_target and i != d:
      raise ValueError(f"tie_to_target reads the target's embedding and LM head, so inner_dim"
                       f" must equal the target's hidden size {d}, got {i}: set inner_dim=0")
    self.cfg = cfg
    self.target_dims = _target_dims(target_cfg)
    ns = 1 if cfg.tie_stages else n
    std = 1 / math.sqrt(i)
    if cfg.tie_to_target:
      # Tied to the target's LM head, start from the identity: stage 0 then begins as the
      # target's own prediction from f_t (as a zero-initialised Medusa head does) instead of
      # learning to read the target's hidden space from a random projection.
      eye = jnp.eye(d, dtype=F32)
      self.proj0 = nnx.Param(eye + _normal(rngs, (d, i), 0.01 * std))
      self.proj = (nnx.Param(jnp.broadcast_to(eye, (min(ns, n - 1), i, i))
                             + _normal(rngs, (min(ns, n - 1), i, i), 0.01 * std))
                   if n > 1 else None)
    else:
      self.proj0 = nnx.Param(_normal(rngs, (d, i), std))  # [D, I]
      # [ns', I, I] state projections of stages 1..n-1 (one shared when tie_stages).
      self.proj = nnx.Param(_normal(rngs, (min(ns, n - 1), i, i), std)) if n > 1 else None
    self.emb = None if cfg.tie_to_target else nnx.Param(_normal(rngs, (ns, v, i), std))  # [ns,V,I]
    self.head = None if cfg.tie_to_target else nnx.Param(_normal(rngs, (ns, i, v), std))  # [ns,I,V]
    # Tied: a learnt gain on the token term, started small, so the target's embedding of x_{t+1}
    # does not swamp f_t at first (through the tied LM head it would predict x_{t+1} again).
    self.emb_gain = nnx.Param(jnp.full((ns,), 0.1, F32)) if cfg.tie_to_target else None
    self.ln_scale = nnx.Param(jnp.ones((ns, i), F32))  # [ns, I]
    self.ln_bias = nnx.Param(jnp.zeros((ns, i), F32))  # [ns, I]
    self.state_weight = 0.5 ** (0.5 / n)
    self.emb_weight = math.sqrt((1 - self.state_weight ** 2) * (i / 2))

  def start(self, f: jax.Array) -> jax.Array:
    """f_t [..., D] -> the initial state s_{-1} [..., D] (float32)."""
    f = f.astype(F32)
    return _layer_norm(f) / math.sqrt(2) if self.cfg.scale_input else f

  def stage(self, frozen: Params, j: int, s: jax.Array, tok: jax.Array):
    """Stage j: state [..., D or I], token ids [...] -> (new state [..., I], logits [..., V])."""
    tied = self.cfg.tie_stages
    w = self.proj0[...] if j == 0 else self.proj[0 if tied else j - 1]
    c = 0 if tied else j
    if self.emb is None:
      e = embed_tokens(frozen.embed, tok, F32).astype(F32) * self.emb_gain[c]
    else:
      e = jnp.take(self.emb[c], tok, axis=0)
    z = _layer_norm(s @ w + e * (self.emb_weight / self.state_weight), self.ln_scale[c],
                    self.ln_bias[c])
    s = jax.nn.gelu(z, approximate=False)
    # Tied to the target, the logits read the normalised pre-activation: the target's LM head
    # expects a hidden state of either sign, which a GELU output (>= -0.17) cannot express.
    logits = logits_from_hidden(frozen, z) if self.head is None else s @ self.head[c]
    return s, logits


def _mlp_predict(model: MLPSpeculator, batch, frozen, steps):
  n = model.cfg.n_predict
  if steps > n:
    raise ValueError(f"this MLP speculator has {n} stages, so it drafts at most {n} tokens;"
                     f" asked for {steps}: lower k or train more stages (n_predict)")
  s = model.start(batch["hidden_final"])
  out = []
  for j in range(steps):
    s, lg = model.stage(frozen, j, s, _shift(batch["tokens"], 1 + j))
    out.append(lg)
  return jnp.stack(out, axis=2), None


# ----------------------------------------------------------------------------------------------
# EAGLE and EAGLE-3.


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


def eagle3_default_layers(num_layers: int) -> tuple[int, ...]:
  """EAGLE-3's default fused layers (HF 2, L//2, L-3) as jaxspec output indices."""
  return tuple(min(max(h - 1, 0), num_layers - 1) for h in (2, num_layers // 2, num_layers - 3))


def _eagle_config(target_cfg: LlamaConfig, options: Mapping[str, Any]) -> EagleConfig:
  opts = {k: v for k, v in options.items() if k not in ("draft_vocab", "token_counts")}
  version = opts.get("version", 1)
  if version not in (1, 3):
    raise ValueError(f"EAGLE version must be 1 or 3, got {version!r}")
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
    opts["layers"] = None
  cfg = _make_config(EagleConfig, opts)
  # The layer's geometry is written out, so a config read back from a checkpoint is equal.
  lc = eagle_layer_config(target_cfg, cfg)
  return dataclasses.replace(cfg, num_heads=lc.num_heads, num_kv_heads=lc.num_kv_heads,
                             head_dim=lc.head_dim, intermediate_size=lc.intermediate_size)


def eagle_layer_config(target_cfg: LlamaConfig, cfg: EagleConfig) -> LlamaConfig:
  """The draft layer's geometry as a one-layer LlamaConfig (rotary settings are the target's)."""
  h = cfg.num_heads or target_cfg.num_heads
  return dataclasses.replace(
      target_cfg, num_layers=1, num_heads=h,
      num_kv_heads=cfg.num_kv_heads or target_cfg.num_kv_heads,
      head_dim=cfg.head_dim or target_cfg.head_dim,
      intermediate_size=cfg.intermediate_size or target_cfg.intermediate_size,
      attention_bias=False, sliding_window=None, dtype="float32")


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
    self.target_dims = _target_dims(target_cfg)
    self.eps = target_cfg.rms_norm_eps
    std = 0.02
    n_fc = len(cfg.layers) * d if v3 else 2 * d
    d_in = 2 * d if v3 else d
    self.fc = nnx.Param(_normal(rngs, (n_fc, d), std))  # [3D or 2D, D]
    self.fc_bias = None if v3 else nnx.Param(jnp.zeros((d,), F32))  # [D]
    self.wq = nnx.Param(_normal(rngs, (d_in, h, k), std))  # [2D or D, H, K]
    self.wk = nnx.Param(_normal(rngs, (d_in, g, k), std))  # [2D or D, G, K]
    self.wv = nnx.Param(_normal(rngs, (d_in, g, k), std))
    self.wo = nnx.Param(_normal(rngs, (h, k, d), std))  # [H, K, D]
    self.mlp_norm = nnx.Param(jnp.ones((d,), F32))  # post_attention_layernorm
    self.w_gate = nnx.Param(_normal(rngs, (d, f), std))  # [D, F]
    self.w_up = nnx.Param(_normal(rngs, (d, f), std))
    self.w_down = nnx.Param(_normal(rngs, (f, d), std))  # [F, D]
    if v3:
      n = cfg.draft_vocab_size or v
      self.input_norm = nnx.Param(jnp.ones((d,), F32))  # on the embedding
      self.hidden_norm = nnx.Param(jnp.ones((d,), F32))  # on the feature
      self.norm = nnx.Param(jnp.ones((d,), F32))  # before the draft LM head
      self.lm_head = nnx.Param(_normal(rngs, (d, n), std))  # [D, N]
      ids = np.arange(v) if draft_vocab is None else np.asarray(draft_vocab)
      if ids.shape != (n,):
        raise ValueError(f"draft vocabulary has {ids.shape} ids, the config says {n}")
      self.draft_ids = Buffer(jnp.asarray(ids, jnp.int32))  # [N] target id of every draft id
    else:
      self.input_norm = self.hidden_norm = self.norm = self.lm_head = self.draft_ids = None

  # -- the pieces shared by training and decoding --

  def real_feature(self, hidden_final: jax.Array, hidden_layers: jax.Array | None) -> jax.Array:
    """The step-0 feature at real positions [..., D] from f_t [..., D] or the layers [..., n, D]."""
    if self.cfg.version == 1:
      return hidden_final.astype(F32)
    if hidden_layers is None:
      raise ValueError(f"EAGLE-3 reads target layers {self.cfg.layers}: pass hidden_layers")
    x = hidden_layers.astype(F32)
    return x.reshape(x.shape[:-2] + (-1,)) @ self.fc[...]

  def layer_input(self, frozen: Params, feat: jax.Array, tok: jax.Array):
    """(attention input [..., D or 2D], residual [..., D]) of the pair (feature, token)."""
    e = embed_tokens(frozen.embed, tok, F32).astype(F32)
    if self.cfg.version == 1:
      x = jnp.concatenate([e, feat], axis=-1) @ self.fc[...] + self.fc_bias[...]
      return x, x
    x = jnp.concatenate([rms_norm(e, self.input_norm[...], self.eps),
                         rms_norm(feat, self.hidden_norm[...], self.eps)], axis=-1)
    return x, feat

  def qkv(self, x: jax.Array, positions: jax.Array):
    """x [B, T, Din], positions [B, T] -> rotated q [B, T, H, K], k and v [B, T, G, K]."""
    inv = rope_inv_freq(self.layer_cfg)
    q = jnp.einsum("btd,dhk->bthk", x, self.wq[...])
    k = jnp.einsum("btd,dgk->btgk", x, self.wk[...])
    v = jnp.einsum("btd,dgk->btgk", x, self.wv[...])
    return apply_rope(q, positions, inv), apply_rope(k, positions, inv), v

  def finish(self, resid: jax.Array, attn: jax.Array) -> jax.Array:
    """Output projection, residual and SwiGLU MLP: the layer's output h [B, T, D]."""
    h = resid + jnp.einsum("bthk,hkd->btd", attn, self.wo[...])
    x = rms_norm(h, self.mlp_norm[...], self.eps)
    return h + (jax.nn.silu(x @ self.w_gate[...]) * (x @ self.w_up[...])) @ self.w_down[...]

  def logits(self, frozen: Params, h: jax.Array) -> jax.Array:
    """h [..., D] -> float32 logits over the draft vocabulary [..., N] (N = V for version 1)."""
    if self.cfg.version == 1:
      return logits_from_hidden(frozen, h)
    return rms_norm(h, self.norm[...], self.eps) @ self.lm_head[...]

  def target_logits(self, frozen: Params, h: jax.Array) -> jax.Array:
    """Logits over the target's vocabulary [..., V]; tokens outside the draft vocab get -inf."""
    lg = self.logits(frozen, h)
    if self.cfg.version == 1 or not self.cfg.draft_vocab_size:
      return lg
    v = self.target_dims[1]
    full = jnp.full(lg.shape[:-1] + (v,), -jnp.inf, F32)
    return full.at[..., self.draft_ids[...]].set(lg)


def _ttt_attention(q, k0, v0, ks, vs):
  """Training-time-test attention.

  q [B, T, H, K] are step j's queries; k0, v0 [B, T, G, K] step 0's keys and values (read
  causally); ks, vs the keys and values of steps 1..j [B, T, G, K] each, read at the query's own
  position only. That is exactly what decoding sees at draft step j from position t: the real
  pairs 0..t in the cache, then its own entries for steps 1..j.
  """
  b, t, h, kd = q.shape
  g = k0.shape[2]
  qg = q.astype(F32).reshape(b, t, g, h // g, kd) / math.sqrt(kd)
  s0 = jnp.einsum("btgrk,bsgk->bgrts", qg, k0.astype(F32))
  s0 = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s0, _NEG)
  sd = [jnp.einsum("btgrk,btgk->bgrt", qg, k.astype(F32))[..., None] for k in ks]
  p = jax.nn.softmax(jnp.concatenate([s0] + sd, axis=-1), axis=-1)
  out = jnp.einsum("bgrts,bsgk->btgrk", p[..., :t], v0.astype(F32))
  for i, v in enumerate(vs):
    out = out + jnp.einsum("bgrt,btgk->btgrk", p[..., t + i], v.astype(F32))
  return out.reshape(b, t, h, kd)


def _eagle_rollout(model: EagleHead, frozen, tokens, hidden_final, hidden_layers, steps):
  """The training-time forward: per step j, logits [B, T, N] and features h_j [B, T, D].

  Step j at position t reads the token x_{t+1+j} at rotary position t + 1 + j (the position of
  that token, as decoding and `speculators` number them).
  """
  b, t = tokens.shape
  feat = model.real_feature(hidden_final, hidden_layers)
  base = jnp.broadcast_to(jnp.arange(1, t + 1, dtype=jnp.int32)[None], (b, t))
  k0 = v0 = None
  ks, vs, logits, feats = [], [], [], []
  for j in range(steps):
    x, resid = model.layer_input(frozen, feat, _shift(tokens, 1 + j))
    q, k, v = model.qkv(x, base + j)
    if j == 0:
      k0, v0 = k, v
    else:
      ks.append(k)
      vs.append(v)
    feat = model.finish(resid, _ttt_attention(q, k0, v0, ks, vs))
    feats.append(feat)
    logits.append(model.logits(frozen, feat))
  return jnp.stack(logits, axis=2), jnp.stack(feats, axis=2)


def _eagle_predict(model: EagleHead, batch, frozen, steps):
  return _eagle_rollout(model, frozen, batch["tokens"], batch["hidden_final"],
                        batch.get("hidden_layers"), steps)


def eagle_block(model: EagleHead, frozen: Params, cache, feat: jax.Array, tok: jax.Array, *,
                fresh: bool = False, offsets: jax.Array | None = None,
                mask: jax.Array | None = None, write: bool = True):
  """Decoding: T pairs (feat [B, T, D], tok [B, T]) on top of the draft cache.

  Pair t of a row goes to cache position length + t with rotary position length + t + 1 (as in
  `_eagle_rollout`). Returns (h [B, T, D], cache with length + T).

  A draft tree passes `offsets` [B, T] (cache position length + offset: a node's depth - 1) and
  `mask` [B, T, T] (ancestors only) with write=False: the cache is only read and comes back
  unchanged.
  """
  b, t = tok.shape
  x, resid = model.layer_input(frozen, feat, tok)
  if offsets is None:
    offsets = jnp.arange(t, dtype=jnp.int32)[None]
  pos = cache.length[:, None] + offsets
  q, k, v = model.qkv(x, pos + 1)
  if mask is None:
    mask = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (b, t, t))
  attn = attention(q, k, v, None if fresh else cache.k[0], None if fresh else cache.v[0],
                    cache.length, pos, mask, model.layer_cfg)
  h = model.finish(resid, attn.astype(F32))
  if not write:
    return h, cache
  return h, write_cache(cache, k[None], v[None], positions_start=cache.length)


# ----------------------------------------------------------------------------------------------
# Losses, accuracy and the offline acceptance estimate (shared by all heads).


def _draft_ids(model) -> jax.Array | None:
  """Target ids of a reduced draft vocabulary, or None when the head predicts the full one."""
  if isinstance(model, EagleHead) and model.cfg.version == 3 and model.cfg.draft_vocab_size:
    return model.draft_ids[...]
  return None


def target_logits_over(frozen: Params, hidden: jax.Array, ids: jax.Array | None) -> jax.Array:
  """The target's float32 logits [..., V] from final hidden states [..., D], or only those of
  the vocabulary ids `ids` [N] -> [..., N] (equal to `logits_from_hidden(...)[..., ids]`)."""
  if ids is None:
    return logits_from_hidden(frozen, hidden)
  w = lm_head_weight(frozen)[:, ids]  # [D, N]: the head's columns of those ids (float32)
  return jnp.einsum("...d,dn->...n", hidden, w, preferred_element_type=F32)


def _token_loss(model, logits, batch, frozen, soft: bool, decay: float):
  """Cross-entropy (or KL to the target) of every step's predictions, weighted decay**j.

  Args:
    logits: [B, T, S, N] float32; step j at t predicts x_{t+2+j}.
  Returns:
    (loss, metrics with loss_j and acc_j, top-1 accuracy against the data's next tokens).
  """
  tokens = batch["tokens"]
  mask = batch["loss_mask"].astype(F32)
  ids = _draft_ids(model)
  v = model.target_dims[1]
  if soft:  # [B, T, V], or [B, T, N] over a draft vocabulary: the target's distribution
    # renormalised over it, from the head rows of those ids only (a 4096-token draft vocabulary
    # runs a twelfth of SmolLM2's 49k-row head on every training position)
    t_logits = target_logits_over(frozen, batch["hidden_final"].astype(F32), ids)
  if ids is not None:
    t2d = jnp.full((v,), -1, jnp.int32).at[ids].set(jnp.arange(ids.shape[0], dtype=jnp.int32))
  total = jnp.zeros((), F32)
  metrics = {}
  for j in range(logits.shape[2]):
    y = _shift(tokens, 2 + j)
    w = _shift(mask, 2 + j, 0.0)
    logq = jax.nn.log_softmax(logits[:, :, j], axis=-1)
    if soft:
      logp = jax.nn.log_softmax(_shift(t_logits, 1 + j), axis=-1)
      per = jnp.sum(jnp.exp(logp) * (logp - logq), axis=-1)
      w_loss = w
    else:
      yd = y if ids is None else t2d[y]
      per = -jnp.take_along_axis(logq, jnp.maximum(yd, 0)[..., None], axis=-1)[..., 0]
      w_loss = w * (yd >= 0)  # a token outside the draft vocabulary cannot be learnt
    loss_j = jnp.sum(per * w_loss) / jnp.maximum(jnp.sum(w_loss), 1.0)
    pred = jnp.argmax(logits[:, :, j], axis=-1)
    if ids is not None:
      pred = ids[pred]
    acc_j = jnp.sum((pred == y) * w) / jnp.maximum(jnp.sum(w), 1.0)
    total = total + (decay ** j) * loss_j
    metrics[f"loss_{j}"] = loss_j
    metrics[f"acc_{j}"] = acc_j
  return total, metrics


def _smooth_l1(x, y):
  d = jnp.abs(x - y)
  return jnp.where(d < 1.0, 0.5 * d * d, d - 0.5).mean(-1)


def _loss(kind: str, model, batch, frozen):
  spec = HEADS[kind]
  steps = spec.num_steps(model)
  logits, feats = spec.predict(model, batch, frozen, steps)
  cfg = model.cfg
  loss, metrics = _token_loss(model, logits, batch, frozen, cfg.soft, cfg.loss_decay)
  if kind == "eagle":
    loss = cfg.token_weight * loss
    if cfg.version == 1 and cfg.feature_weight:
      f = batch["hidden_final"].astype(F32)
      mask = batch["loss_mask"].astype(F32)
      fl = jnp.zeros((), F32)
      for j in range(steps):
        w = _shift(mask, 1 + j, 0.0)
        fj = jnp.sum(_smooth_l1(feats[:, :, j], _shift(f, 1 + j, 0.0)) * w)
        fl = fl + (cfg.loss_decay ** j) * fj / jnp.maximum(jnp.sum(w), 1.0)
      metrics["feature_loss"] = fl
      loss = loss + cfg.feature_weight * fl
  metrics["loss"] = loss
  return loss, metrics


def chain_lengths(model, logits: jax.Array, batch, frozen) -> tuple[jax.Array, jax.Array]:
  """Accepted-run length per position under greedy verification, from teacher-forced logits.

  Draft j at t counts when it equals the data's token x_{t+2+j} and that token is the target's
  own argmax there (the teacher-forced prefix is then what greedy decoding would have produced;
  for greedy data the two conditions coincide), and all drafts before it counted.

  Returns:
    (run lengths [B, T] in 0..S, positions that count [B, T] bool: loss_mask[t + 2] = 1).
  """
  tokens = batch["tokens"]
  mask = batch["loss_mask"] > 0
  greedy = jnp.argmax(logits_from_hidden(frozen, batch["hidden_final"].astype(F32)), axis=-1)
  ids = _draft_ids(model)
  ok = []
  for j in range(logits.shape[2]):
    pred = jnp.argmax(logits[:, :, j], axis=-1)
    if ids is not None:
      pred = ids[pred]
    y = _shift(tokens, 2 + j, -1)
    ok.append((pred == y) & (y == _shift(greedy, 1 + j, -2)) & _shift(mask, 2 + j, False))
  run = jnp.cumprod(jnp.stack(ok, axis=-1).astype(jnp.int32), axis=-1).sum(-1)
  return run, _shift(mask, 2, False)


@functools.partial(nnx.jit, static_argnames=("kind", "k"))
def _chain_sums(model, batch, frozen, *, kind: str, k: int):
  logits, _ = HEADS[kind].predict(model, batch, frozen, k)
  run, valid = chain_lengths(model, logits, batch, frozen)
  return jnp.sum(run * valid), jnp.sum(valid)


def _offline_chain_tau(kind: str, model, batch, frozen, k: int) -> float:
  batch = {key: batch[key] for key in ("tokens", "loss_mask", "hidden_final", "hidden_layers")
           if key in batch}
  total, n = _chain_sums(model, batch, frozen, kind=kind, k=int(k))
  return float(1.0 + total / max(int(n), 1))


# ----------------------------------------------------------------------------------------------
# The registry.


def _make_config(cls, options: Mapping[str, Any]):
  names = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(options) - names)
  if unknown:
    raise ValueError(f"unknown {cls.__name__} options {unknown}; known: {sorted(names)}")
  return cls(**options)


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


def _create_medusa(target_cfg, *, rngs, **options):
  return MedusaHeads(target_cfg, _make_config(MedusaConfig, options), rngs=rngs)


def _create_mlp(target_cfg, *, rngs, **options):
  return MLPSpeculator(target_cfg, _make_config(MLPConfig, options), rngs=rngs)


def _create_eagle(target_cfg, *, rngs, **options):
  cfg = _eagle_config(target_cfg, options)
  ids = options.get("draft_vocab")
  if cfg.version == 3 and cfg.draft_vocab_size and ids is None:
    counts = options.get("token_counts")
    if counts is None:
      raise ValueError(f"draft_vocab_size={cfg.draft_vocab_size} needs the draft vocabulary:"
                       " pass draft_vocab=<target ids> or token_counts=<[V] counts>"
                       " (jaxspec.heads.token_counts over the training data)")
    ids = draft_vocab_from_counts(counts, cfg.draft_vocab_size)
  return EagleHead(target_cfg, cfg, rngs=rngs, draft_vocab=ids)


def _required_layers_eagle(target_cfg, options) -> tuple[int, ...]:
  return _eagle_config(target_cfg, options).layers or ()


@dataclasses.dataclass(frozen=True)
class HeadSpec:
  """One kind of head: how to build, train, evaluate and decode with it.

  create(target_cfg, *, rngs, **options) -> nnx.Module (options: the kind's config fields;
    EAGLE-3 also takes draft_vocab= or token_counts=).
  loss(model, batch, frozen) -> (scalar float32, metrics): differentiable in the module's
    `nnx.Param`s; `frozen` is the target's `Params`.
  required_layers(target_cfg, options) -> target layer outputs the batch must hold.
  drafter(model, target) -> the `Drafter` for `speculative_generate`.
  offline_chain_tau(model, batch, frozen, k) -> 1 + mean accepted greedy run of k drafts.
  predict(model, batch, frozen, steps) -> (logits [B, T, steps, N], features or None), the
    training-time forward; num_steps(model) -> steps the loss trains.
  """

  name: str
  create: Callable[..., nnx.Module]
  required_layers: Callable[[LlamaConfig, Mapping[str, Any]], tuple[int, ...]]
  predict: Callable[..., tuple[jax.Array, jax.Array | None]]
  num_steps: Callable[[nnx.Module], int]
  config_cls: type

  def loss(self, model, batch, frozen):
    return _loss(self.name, model, batch, frozen)

  def drafter(self, model, target):
    from jaxspec import head_drafters
    return head_drafters.make_drafter(self.name, model, target)

  def offline_chain_tau(self, model, batch, frozen, k: int) -> float:
    return _offline_chain_tau(self.name, model, batch, frozen, k)


HEADS: dict[str, HeadSpec] = {
    "medusa": HeadSpec("medusa", _create_medusa, lambda cfg, o: (), _medusa_predict,
                       lambda m: m.cfg.num_heads, MedusaConfig),
    "mlp": HeadSpec("mlp", _create_mlp, lambda cfg, o: (), _mlp_predict,
                    lambda m: m.cfg.n_predict, MLPConfig),
    "eagle": HeadSpec("eagle", _create_eagle, _required_layers_eagle, _eagle_predict,
                      lambda m: m.cfg.ttt_steps, EagleConfig),
}

_MODULES = {MedusaHeads: "medusa", MLPSpeculator: "mlp", EagleHead: "eagle"}


def head_kind(model: nnx.Module) -> str:
  """The registry key of a head module."""
  for cls, name in _MODULES.items():
    if isinstance(model, cls):
      return name
  raise ValueError(f"{type(model).__name__} is not a jaxspec head (one of {sorted(HEADS)})")


# ----------------------------------------------------------------------------------------------
# Saving and loading.

_FORMAT = "jaxspec-head"
_WEIGHTS = "head.safetensors"
ASSETS = Path(__file__).resolve().parent / "assets" / "heads"


def target_fingerprint(params: Params, cfg: LlamaConfig) -> str:
  """A short hash of the target's shapes and a few of its weights (rounded to bfloat16, so a
  float32 and a bfloat16 load of one checkpoint agree)."""
  import ml_dtypes
  h = hashlib.sha256(json.dumps([cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads,
                                 cfg.num_kv_heads, cfg.head_dim]).encode())
  d = min(cfg.hidden_size, 64)
  parts = [params.embed[:16, :d], lm_head_weight(params)[:d, -16:], params.final_norm[:d]]
  if params.layers is not None:  # the last layer's down projection, in either layer layout
    layers = params.layers
    last = layers.w_down[-1] if is_scanned(params) else layers[-1].w_down
    parts.append(last[:16, :d])
  for p in parts:
    h.update(np.asarray(jnp.asarray(p, F32)).astype(ml_dtypes.bfloat16).tobytes())
  return h.hexdigest()[:16]


def _leaf_name(path) -> str:
  keys = []
  for k in path:
    if isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value":
      continue
    keys.append(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k)))))
  return ".".join(keys)


def head_tensors(model: nnx.Module) -> dict[str, jax.Array]:
  """The module's arrays by dotted name (what `save_head` writes)."""
  leaves, _ = jax.tree_util.tree_flatten_with_path(nnx.state(model))
  return {_leaf_name(p): x for p, x in leaves}


def _config_dict(cfg) -> dict[str, Any]:
  out = dataclasses.asdict(cfg)
  return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}


# Target fields that change its hidden states; a head records them and is refused by a target
# that differs in any.
_TARGET_FIELDS = ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "rope_theta", "rope_scaling",
                  "rms_norm_eps", "tie_embeddings", "attention_bias", "sliding_window")


def _target_record(cfg: LlamaConfig) -> dict[str, Any]:
  out = {}
  for name in _TARGET_FIELDS:
    value = getattr(cfg, name)
    out[name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
  return out


def save_head(directory: str | os.PathLike, kind: str, model: nnx.Module,
              target_cfg, meta: Mapping[str, Any] | None = None,
              dtype: str = "bfloat16", *, target_params: Params | None = None) -> Path:
  """Writes `config.json` and `head.safetensors` to `directory` (created if needed).

  Args:
    kind: the registry key ("medusa", "mlp", "eagle").
    model: the head module.
    target_cfg: the target's `LlamaConfig`, or the target `Model` (then its weights are
      fingerprinted too). Its architecture fields are recorded and checked at load.
    meta: free-form JSON-able information (training data, steps, offline tau, ...).
    dtype: "bfloat16", "float16" or "float32" for floating weights (integer buffers are kept).
    target_params: the target's weights, when `target_cfg` is a config: their fingerprint is
      recorded so that a head loaded onto another target of the same shapes is refused.
  """
  from jaxspec.models.hf_loader import _SAVE_DTYPES, write_safetensors
  if not isinstance(target_cfg, LlamaConfig):  # a Model
    target_params = target_cfg.params if target_params is None else target_params
    target_cfg = target_cfg.cfg
  if kind not in HEADS:
    raise ValueError(f"unknown head kind {kind!r}; known: {sorted(HEADS)}")
  if head_kind(model) != kind:
    raise ValueError(f"the module is a {head_kind(model)} head, not {kind!r}")
  if dtype not in _SAVE_DTYPES:
    raise ValueError(f"dtype {dtype!r} is not one of {sorted(_SAVE_DTYPES)}")
  if _target_dims(target_cfg) != model.target_dims:
    raise ValueError(f"the head was built for a target with (hidden, vocab, layers) ="
                     f" {model.target_dims}, but target_cfg has {_target_dims(target_cfg)}")
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  np_dtype = _SAVE_DTYPES[dtype][1]
  tensors = {}
  for name, x in head_tensors(model).items():
    a = np.asarray(x)
    tensors[name] = a.astype(np_dtype) if np.issubdtype(a.dtype, np.floating) else a
  write_safetensors(directory / _WEIGHTS, tensors, metadata={"format": _FORMAT})
  config = {
      "format": _FORMAT, "format_version": 1, "kind": kind,
      "head_config": _config_dict(model.cfg),
      "target": dict(_target_record(target_cfg), num_layers=target_cfg.num_layers,
                     fingerprint=(None if target_params is None
                                  else target_fingerprint(target_params, target_cfg))),
      "dtype": dtype, "meta": dict(meta or {}),
  }
  (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
  return directory


def resolve_head_path(dir_or_name: str | os.PathLike) -> Path:
  """A directory, or a bundled head's name ("eagle", "medusa", "mlp") under jaxspec/assets."""
  p = Path(dir_or_name)
  if p.is_dir():
    return p
  name = str(dir_or_name)
  if name in HEADS and os.sep not in name:
    bundled = ASSETS / name
    if (bundled / "config.json").exists():
      return bundled
    raise CheckpointError(
        f"no bundled {name!r} head at {bundled}: train one for your target with jaxspec's head"
        f" trainer (jaxspec.train) and save it with jaxspec.heads.save_head(<dir>, {name!r},"
        " ...), then pass that directory")
  raise CheckpointError(f"head directory {p} does not exist (pass a directory written by"
                        f" jaxspec.heads.save_head, or one of {sorted(HEADS)})")


def is_head_dir(path: str | os.PathLike) -> bool:
  """Whether `path` holds a config.json written by `save_head` (by its "format" field)."""
  try:
    config = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
  except (OSError, ValueError):
    return False
  return isinstance(config, dict) and config.get("format") == _FORMAT


def bundled_head_for(target, kinds: Sequence[str] = ("eagle", "medusa", "mlp")) -> str | None:
  """The first of `kinds` bundled under jaxspec/assets/heads/ that was trained for `target`
  (same shapes and fingerprint), or None."""
  for kind in kinds:
    path = ASSETS / kind
    if not (path / "config.json").is_file():
      continue
    try:
      check_target(_read_config(path), target, str(path))
    except CheckpointError:
      continue
    return kind
  return None


def _read_config(path: Path) -> dict[str, Any]:
  cfg_path = path / "config.json"
  if not cfg_path.exists():
    raise CheckpointError(f"{cfg_path} is missing: {path} is not a head written by"
                          " jaxspec.heads.save_head")
  try:
    config = json.loads(cfg_path.read_text(encoding="utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise CheckpointError(f"{cfg_path} is not valid JSON ({e}): the head is corrupted; save"
                          " it again") from e
  if not isinstance(config, dict) or config.get("format") != _FORMAT:
    raise CheckpointError(f"{cfg_path} is not a jaxspec head config (no \"format\":"
                          f" \"{_FORMAT}\"); Medusa or speculators checkpoints load with"
                          " jaxspec.train.export.import_medusa / import_eagle3")
  if config.get("kind") not in HEADS:
    raise CheckpointError(f"{cfg_path}: unknown head kind {config.get('kind')!r}; known:"
                          f" {sorted(HEADS)}")
  return config


def check_target(config: Mapping[str, Any], target, where: str,
                 check_fingerprint: bool = True) -> None:
  """Raises CheckpointError when the head's recorded target differs from `target`."""
  rec = config.get("target") or {}
  mine = dict(zip(("hidden_size", "vocab_size", "num_layers"), _target_dims(target.cfg)))
  mine.update({k: v for k, v in _target_record(target.cfg).items() if k in rec})
  for key, value in mine.items():
    if rec.get(key) != value:
      raise CheckpointError(
          f"{where} was trained for a target with {key}={rec.get(key)}, but this target"
          f" ({getattr(target, 'name', 'model')}) has {key}={value}: a head only works with the"
          " target it was trained on; load that target or train a head for this one")
  fp = rec.get("fingerprint")
  if check_fingerprint and not isinstance(fp, str):
    raise CheckpointError(
        f"{where} records no fingerprint of the target it was trained for ({fp!r}), so it"
        " cannot be checked against this target: save it with jaxspec.heads.save_head(...,"
        " target_params=<the target's weights>) or the target Model, or pass"
        " check_fingerprint=False to load it anyway (outputs stay exact; a head trained for"
        " another target only accepts less)")
  if check_fingerprint:
    mine_fp = target_fingerprint(target.params, target.cfg)
    if fp != mine_fp:
      raise CheckpointError(
          f"{where} was trained for another target of the same shapes (fingerprint {fp}, this"
          f" target's is {mine_fp}): load the target it was trained on or train a head for this"
          " one (check_fingerprint=False loads it anyway; outputs stay exact, acceptance drops)")


def load_head_model(dir_or_name: str | os.PathLike, target,
                    check_fingerprint: bool = True) -> tuple[str, nnx.Module, dict[str, Any]]:
  """Reads a saved head: (kind, module with float32 weights, config dict); a malformed
  config.json or weights file comes out as a `CheckpointError` naming the file."""
  from jaxspec.models.errors import read_checkpoint
  return read_checkpoint(dir_or_name, _load_head_model, dir_or_name, target, check_fingerprint)


def _load_head_model(dir_or_name, target, check_fingerprint):
  from jaxspec.models.hf_loader import read_safetensors
  path = resolve_head_path(dir_or_name)
  config = _read_config(path)
  check_target(config, target, f"the head at {path}", check_fingerprint)
  kind = config["kind"]
  weights = path / _WEIGHTS
  if not weights.exists():
    raise CheckpointError(f"{weights} is missing: the head at {path} is incomplete; save it"
                          " again with jaxspec.heads.save_head")
  tensors = read_safetensors(weights)
  options = {k: tuple(v) if isinstance(v, list) else v
             for k, v in (config.get("head_config") or {}).items()}
  extra = {}
  if kind == "eagle" and options.get("version") == 3 and options.get("draft_vocab_size"):
    if "draft_ids" not in tensors:
      raise CheckpointError(f"{weights} has no draft_ids for its reduced draft vocabulary")
    extra["draft_vocab"] = np.asarray(tensors["draft_ids"])
  try:
    abstract = nnx.eval_shape(lambda: HEADS[kind].create(target.cfg, rngs=nnx.Rngs(0),
                                                         **options, **extra))
  except (TypeError, ValueError) as e:
    raise CheckpointError(f"{path / 'config.json'}: head_config does not build a {kind}"
                          f" head ({e})") from e
  return kind, fill_module(abstract, tensors, str(weights)), config


def fill_module(abstract: nnx.Module, tensors: Mapping[str, np.ndarray], where: str):
  """A module of `abstract`'s structure with its arrays taken from `tensors` by dotted name."""
  graphdef, state = nnx.split(abstract)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(state)
  new = []
  for p, leaf in leaves:
    name = _leaf_name(p)
    if name not in tensors:
      raise CheckpointError(f"{where} has no tensor {name!r}: it is corrupted or was written"
                            " by another version; save the head again")
    a = np.asarray(tensors[name])
    if tuple(a.shape) != tuple(leaf.shape):
      raise CheckpointError(f"{where}: tensor {name!r} has shape {a.shape}, expected"
                            f" {tuple(leaf.shape)}")
    new.append(jnp.asarray(a, leaf.dtype))
  return nnx.merge(graphdef, jax.tree_util.tree_unflatten(treedef, new))


def load_head(dir_or_name: str | os.PathLike, target, check_fingerprint: bool = True,
              tree=None):
  """The `Drafter` of a saved head for `target` (a `Model`).

  Args:
    dir_or_name: a directory written by `save_head`, or "eagle" / "medusa" / "mlp" for the head
      bundled under jaxspec/assets/heads/.
    target: the target `Model` the head was trained for.
    check_fingerprint: refuse a head recorded for another target of the same shapes.
    tree: draft a tree each step (Medusa, EAGLE): a `jaxspec.tree.Tree`, `DynamicTree`, a list
      of paths, or a number of nodes (`jaxspec.tree.default_tree`).
  Raises:
    CheckpointError: missing or corrupted files, or a head trained for another target.
  """
  kind, model, config = load_head_model(dir_or_name, target, check_fingerprint)
  drafter = HEADS[kind].drafter(model, target)
  acc = (config.get("meta") or {}).get("topk_accuracy")
  if acc is not None:
    drafter = dataclasses.replace(drafter, topk_accuracy=tuple(map(tuple, acc)))
  if tree is not None:
    from jaxspec.tree import default_tree
    if isinstance(tree, int) and not isinstance(tree, bool):
      tree = default_tree(drafter, tree)
    drafter = drafter.with_tree(tree)
  return drafter
