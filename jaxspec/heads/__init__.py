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

Modules: `common` (what all kinds share), `medusa`, `mlp`, `eagle` (a kind each), `training`
(the losses and the offline acceptance estimate), `drafting` (each kind's `Drafter`, also
exported by `jaxspec.drafters`), `registry` (`HEADS`, `HeadSpec`) and `io` (saving, loading and
the bundled heads). Import from `jaxspec.heads`, which holds them all.
"""

from jaxspec.heads.common import F32, Buffer, make_config, normal_init, shift, target_dims
from jaxspec.heads.eagle import (EAGLE3_SWITCHES, EagleConfig, EagleHead, create_eagle,
                                 draft_vocab_from_counts, eagle3_default_layers, eagle_block,
                                 eagle_layer_config, eagle_predict, eagle_required_layers,
                                 token_counts)
from jaxspec.heads.io import (ASSETS, bundled_head_for, check_target, fill_module, head_tensors,
                              is_head_dir, load_head, load_head_model, resolve_head_path,
                              save_head, target_fingerprint)
from jaxspec.heads.medusa import MedusaConfig, MedusaHeads, create_medusa, medusa_predict
from jaxspec.heads.mlp import MLP_NORMS, MLPConfig, MLPSpeculator, create_mlp, mlp_predict
from jaxspec.heads.registry import HEADS, HeadSpec, head_kind
from jaxspec.heads.training import (Objective, chain_lengths, draft_ids, head_loss,
                                    offline_chain_tau, target_logits_over)

__all__ = ["ASSETS", "Buffer", "EAGLE3_SWITCHES", "EagleConfig", "EagleHead", "F32", "HEADS",
           "HeadSpec", "MLPConfig", "MLP_NORMS", "MLPSpeculator", "MedusaConfig", "MedusaHeads",
           "Objective", "bundled_head_for",
           "chain_lengths", "check_target", "create_eagle", "create_medusa", "create_mlp",
           "draft_ids", "draft_vocab_from_counts", "eagle3_default_layers", "eagle_block",
           "eagle_layer_config", "eagle_predict", "eagle_required_layers", "fill_module",
           "head_kind", "head_loss", "head_tensors", "is_head_dir", "load_head",
           "load_head_model", "make_config", "medusa_predict", "mlp_predict", "normal_init",
           "offline_chain_tau", "resolve_head_path", "save_head", "shift", "target_dims",
           "target_fingerprint", "target_logits_over", "token_counts"]
