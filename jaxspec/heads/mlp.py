"""The MLP speculator of IBM's fms-extras (Wertheimer et al. 2024): a chain of small stages,
each reading the previous stage's state and the next token; stage j at position t predicts
x_{t+2+j}."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.heads.common import F32, make_config, normal_init, shift, target_dims
from jaxspec.models.config import LlamaConfig
from jaxspec.models.llama import Params, embed_tokens, logits_from_hidden


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
  norm: "layer" (subtract the mean, then divide by the standard deviation: jaxspec's heads
    before this option) or "rms" (divide by the root mean square only: fms-extras' and vLLM's
    `MLPSpeculatorLayerNorm`, which `jaxspec.train.export.export_mlp_speculator` needs).
  """

  n_predict: int = 3
  inner_dim: int = 0
  tie_to_target: bool = False
  tie_stages: bool = False
  scale_input: bool = True
  soft: bool = False
  loss_decay: float = 1.0
  norm: str = "layer"


MLP_NORMS = ("layer", "rms")


def _layer_norm(x, scale=None, bias=None, eps=1e-6, *, mean: bool = True):
  """LayerNorm over the last axis (mean=False: RMS scaling only, fms-extras' norm), then an
  optional elementwise scale and shift."""
  x = x.astype(F32)
  if mean:
    x = x - x.mean(-1, keepdims=True)
  y = x * jax.lax.rsqrt(jnp.square(x).mean(-1, keepdims=True) + eps)
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
    if cfg.norm not in MLP_NORMS:
      raise ValueError(f"MLPConfig.norm must be one of {MLP_NORMS}, got {cfg.norm!r}")
    if cfg.tie_to_target and i != d:
      raise ValueError(f"tie_to_target reads the target's embedding and LM head, so inner_dim"
                       f" must equal the target's hidden size {d}, got {i}: set inner_dim=0")
    self.cfg = cfg
    self.target_dims = target_dims(target_cfg)
    self.target_softcap = target_cfg.final_softcap  # the soft targets' cap (Gemma 2)
    ns = 1 if cfg.tie_stages else n
    std = 1 / math.sqrt(i)
    if cfg.tie_to_target:
      # Tied to the target's LM head, start from the identity: stage 0 then begins as the
      # target's own prediction from f_t (as a zero-initialised Medusa head does) instead of
      # learning to read the target's hidden space from a random projection.
      eye = jnp.eye(d, dtype=F32)
      self.proj0 = nnx.Param(eye + normal_init(rngs, (d, i), 0.01 * std))
      self.proj = (nnx.Param(jnp.broadcast_to(eye, (min(ns, n - 1), i, i))
                             + normal_init(rngs, (min(ns, n - 1), i, i), 0.01 * std))
                   if n > 1 else None)
    else:
      self.proj0 = nnx.Param(normal_init(rngs, (d, i), std))  # [D, I]
      # [ns', I, I] state projections of stages 1..n-1 (one shared when tie_stages).
      self.proj = nnx.Param(normal_init(rngs, (min(ns, n - 1), i, i), std)) if n > 1 else None
    own = not cfg.tie_to_target  # its own embedding and LM head tables
    self.emb = nnx.Param(normal_init(rngs, (ns, v, i), std)) if own else None  # [ns, V, I]
    self.head = nnx.Param(normal_init(rngs, (ns, i, v), std)) if own else None  # [ns, I, V]
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
    mean = self.cfg.norm == "layer"
    return _layer_norm(f, mean=mean) / math.sqrt(2) if self.cfg.scale_input else f

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
                    self.ln_bias[c], mean=self.cfg.norm == "layer")
    s = jax.nn.gelu(z, approximate=False)
    # Tied to the target, the logits read the normalised pre-activation: the target's LM head
    # expects a hidden state of either sign, which a GELU output (>= -0.17) cannot express.
    logits = logits_from_hidden(frozen, z) if self.head is None else s @ self.head[c]
    return s, logits


def mlp_predict(model: MLPSpeculator, batch, frozen, steps):
  """The training-time forward, teacher-forced: (logits [B, T, steps, V] of stages
  0..steps-1, None)."""
  n = model.cfg.n_predict
  if steps > n:
    raise ValueError(f"this MLP speculator has {n} stages, so it drafts at most {n} tokens;"
                     f" asked for {steps}: lower k or train more stages (n_predict)")
  s = model.start(batch["hidden_final"])
  out = []
  for j in range(steps):
    s, lg = model.stage(frozen, j, s, shift(batch["tokens"], 1 + j))
    out.append(lg)
  return jnp.stack(out, axis=2), None


def create_mlp(target_cfg, *, rngs, **options):
  """An `MLPSpeculator` for the target; options: `MLPConfig`'s fields."""
  return MLPSpeculator(target_cfg, make_config(MLPConfig, options), rngs=rngs)
