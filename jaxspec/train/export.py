"""Export draft heads to the formats serving engines read, and import them back.

EAGLE-3 <-> `speculators` (vLLM's format for draft models: vllm serve --speculative-config
'{"model": <dir>, "method": "eagle3", ...}'):
  config.json      architectures ["Eagle3Speculator"], speculators_model_type "eagle3",
                   transformer_layer_config (a one-layer Llama config), draft_vocab_size,
                   norm_before_residual, target_hidden_size, eagle_aux_hidden_state_layer_ids
                   (Hugging Face `hidden_states` indices: jaxspec layer i is i + 1) and
                   speculators_config {algorithm, proposal_methods, default_proposal_method,
                   verifier}.
  model.safetensors  fc.weight [D, 3D]; layers.0.{input_layernorm, hidden_norm,
                   post_attention_layernorm}.weight; layers.0.self_attn.{q,k,v}_proj.weight
                   [out, 2D], o_proj [D, H*K]; layers.0.mlp.{gate,up,down}_proj.weight;
                   norm.weight; lm_head.weight [N, D]; d2t [N] int64 (target id = draft id +
                   d2t[draft id]); t2d [V] bool (target token is in the draft vocabulary).
                   Linear weights are [out, in] as in PyTorch; q/k use the rotate-half layout
                   both here and in Hugging Face, so nothing is permuted.

Medusa <-> FasterDecoding/Medusa:
  config.json      medusa_num_heads, medusa_num_layers, base_model_name_or_path (+ sizes).
  medusa_lm_head.safetensors  "{i}.{j}.linear.weight" [D, D] and "{i}.{j}.linear.bias" [D] for
                   residual block j of head i, "{i}.{L}.weight" [V, D] the head's LM head.
  jaxspec heads share the target's LM head, so export writes a copy of it per head; import keeps
  per-head LM heads only when they differ from the target's.

Pickled checkpoints (`pytorch_model.bin`) are never loaded: convert them to safetensors first.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from jaxspec import heads as heads_lib
from jaxspec.heads import EagleHead, MedusaHeads
from jaxspec.models.errors import CheckpointError
from jaxspec.models.hf_loader import (SAVE_DTYPES, config_to_hf, hf_class_name, read_json,
                                      read_safetensors, write_safetensors)
from jaxspec.models.llama import lm_head_weight

SPECULATORS_VERSION = "0.1.0"
MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"


def _np32(x) -> np.ndarray:
  return np.asarray(x).astype(np.float32)


def _cast(tensors: dict[str, np.ndarray], dtype: str) -> dict[str, np.ndarray]:
  if dtype not in SAVE_DTYPES:
    raise ValueError(f"dtype {dtype!r} is not one of {sorted(SAVE_DTYPES)}")
  np_dtype = SAVE_DTYPES[dtype][1]
  return {k: v.astype(np_dtype) if np.issubdtype(v.dtype, np.floating) else v
          for k, v in tensors.items()}


def _check_dims(where: str, what: dict[str, Any], target) -> None:
  cfg = target.cfg
  mine = {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size}
  for key, value in what.items():
    if value is not None and value != mine[key]:
      raise CheckpointError(f"{where} has {key}={value} but the target has {key}={mine[key]}:"
                            " it was made for another target; load the target it was trained for")


# ----------------------------------------------------------------------------------------------
# EAGLE-3 <-> speculators.


def export_eagle3(directory: str | os.PathLike, model: EagleHead, target, *,
                  verifier_name_or_path: str | None = None, speculative_tokens: int = 3,
                  dtype: str = "bfloat16", include_embeddings: bool = False) -> Path:
  """Writes an EAGLE-3 head in the `speculators` format (config.json + model.safetensors).

  Args:
    model: an `EagleHead` with version 3.
    target: the target `Model` (its embedding is written when include_embeddings).
    verifier_name_or_path: the target's Hugging Face id or path, recorded for vLLM.
    speculative_tokens: the default number of drafts per step recorded in the config.
    dtype: "bfloat16", "float16" or "float32".
  """
  if not isinstance(model, EagleHead) or model.cfg.version != 3:
    raise ValueError("export_eagle3 needs an EAGLE-3 head (heads.HEADS['eagle'] with"
                     " version=3); EAGLE-1 heads have no speculators export here")
  if model.target_dims != heads_lib.target_dims(target.cfg):
    raise ValueError(f"the head was built for a target with (hidden, vocab, layers) ="
                     f" {model.target_dims}, not {heads_lib.target_dims(target.cfg)}")
  lc = model.layer_cfg
  d, h, g, k = target.cfg.hidden_size, lc.num_heads, lc.num_kv_heads, lc.head_dim
  ids = np.asarray(model.draft_ids[...]).astype(np.int64)
  n, v = ids.shape[0], target.cfg.vocab_size
  t2d = np.zeros((v,), bool)
  t2d[ids] = True
  p = "layers.0."
  tensors = {
      "fc.weight": _np32(model.fc[...]).T,
      p + "input_layernorm.weight": _np32(model.input_norm[...]),
      p + "hidden_norm.weight": _np32(model.hidden_norm[...]),
      p + "post_attention_layernorm.weight": _np32(model.mlp_norm[...]),
      p + "self_attn.q_proj.weight": _np32(model.wq[...]).reshape(2 * d, h * k).T,
      p + "self_attn.k_proj.weight": _np32(model.wk[...]).reshape(2 * d, g * k).T,
      p + "self_attn.v_proj.weight": _np32(model.wv[...]).reshape(2 * d, g * k).T,
      p + "self_attn.o_proj.weight": _np32(model.wo[...]).reshape(h * k, d).T,
      p + "mlp.gate_proj.weight": _np32(model.w_gate[...]).T,
      p + "mlp.up_proj.weight": _np32(model.w_up[...]).T,
      p + "mlp.down_proj.weight": _np32(model.w_down[...]).T,
      "norm.weight": _np32(model.norm[...]),
      "lm_head.weight": _np32(model.lm_head[...]).T,
      "d2t": ids - np.arange(n, dtype=np.int64),
      "t2d": t2d,
  }
  if include_embeddings:
    tensors["embed_tokens.weight"] = _np32(target.params.embed)
  layer = config_to_hf(dataclasses.replace(lc, architecture="llama"), dtype)
  layer.update(num_hidden_layers=1, vocab_size=v, architectures=["LlamaForCausalLM"],
               model_type="llama", tie_word_embeddings=False)
  verifier = {"name_or_path": verifier_name_or_path,
              "architectures": [hf_class_name(target.cfg.architecture)]}
  config = {
      "architectures": ["Eagle3Speculator"],
      "speculators_model_type": "eagle3",
      "speculators_version": SPECULATORS_VERSION,
      "transformer_layer_config": layer,
      "draft_vocab_size": int(n),
      "norm_before_residual": False,
      "target_hidden_size": None,
      "eagle_aux_hidden_state_layer_ids": [int(i) + 1 for i in model.cfg.layers],
      "torch_dtype": dtype,
      "speculators_config": {
          "algorithm": "eagle3",
          "proposal_methods": [{"proposal_type": "greedy",
                                "speculative_tokens": int(speculative_tokens),
                                "verifier_accept_k": 1, "accept_tolerance": 0.0}],
          "default_proposal_method": "greedy",
          "verifier": verifier,
      },
  }
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  write_safetensors(directory / "model.safetensors", _cast(tensors, dtype),
                    metadata={"format": "pt"})
  (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
  return directory


def _speculators_tensors(path: Path) -> dict[str, np.ndarray]:
  single = path / "model.safetensors"
  index = path / "model.safetensors.index.json"
  if single.is_file():
    files = [single]
  elif index.is_file():
    shards = sorted(set((read_json(index).get("weight_map") or {}).values()))
    files = [path / s for s in shards]
  elif (path / "pytorch_model.bin").exists():
    raise CheckpointError(f"{path} holds pytorch_model.bin, a pickle that jaxspec never loads:"
                          " convert it to model.safetensors first (safetensors.torch.save_file)")
  else:
    raise CheckpointError(f"{path} has no model.safetensors")
  out = {}
  for f in files:
    if not f.is_file():
      raise CheckpointError(f"{f} is missing (listed in the index)")
    out.update(read_safetensors(f))
  # The original EAGLE-3 checkpoints name the decoder layer "midlayer".
  return {k.replace("midlayer.", "layers.0."): v for k, v in out.items()}


def import_eagle3(directory: str | os.PathLike, target) -> EagleHead:
  """Reads a `speculators` EAGLE-3 checkpoint into an `EagleHead` (float32) for `target`.

  Raises:
    CheckpointError: missing/corrupted files, a head for another target, or a variant jaxspec
      does not implement (several draft layers, norm_before_residual, another draft width).
  """
  path = Path(directory)
  cfg_path = path / "config.json"
  if not cfg_path.is_file():
    raise CheckpointError(f"{cfg_path} is missing: {path} is not a speculators checkpoint")
  config = read_json(cfg_path)
  kind = config.get("speculators_model_type")
  if kind != "eagle3":
    raise CheckpointError(f"{cfg_path}: speculators_model_type is {kind!r}, import_eagle3 reads"
                          " 'eagle3' checkpoints")
  layer = config.get("transformer_layer_config") or {}
  where = f"the EAGLE-3 checkpoint at {path}"
  _check_dims(where, {"vocab_size": layer.get("vocab_size"),
                      "hidden_size": config.get("target_hidden_size") or layer.get("hidden_size")},
              target)
  if layer.get("hidden_size") != target.cfg.hidden_size:
    raise CheckpointError(f"{where}: its draft width {layer.get('hidden_size')} differs from the"
                          f" target's {target.cfg.hidden_size}; jaxspec's EAGLE-3 head uses the"
                          " target's width")
  if layer.get("num_hidden_layers", 1) != 1:
    raise CheckpointError(f"{where} has {layer.get('num_hidden_layers')} draft layers; jaxspec"
                          " implements the one-layer EAGLE-3 head")
  if config.get("norm_before_residual"):
    raise CheckpointError(f"{where} uses norm_before_residual, which jaxspec does not implement")
  if layer.get("attention_bias"):
    raise CheckpointError(f"{where} has attention biases, which jaxspec's head does not have")
  nl = target.cfg.num_layers
  hf_ids = config.get("eagle_aux_hidden_state_layer_ids")
  layers = (heads_lib.eagle3_default_layers(nl) if hf_ids is None
            else tuple(int(i) - 1 for i in hf_ids))
  if any(not 0 <= i < nl for i in layers):
    raise CheckpointError(f"{where} reads target hidden states {hf_ids} (Hugging Face numbering),"
                          f" which a {nl}-layer target's decoder layer outputs do not cover")
  t = _speculators_tensors(path)
  n = int(config.get("draft_vocab_size") or target.cfg.vocab_size)
  if "d2t" in t:
    ids = np.arange(n, dtype=np.int64) + np.asarray(t["d2t"]).astype(np.int64)
  else:
    ids = np.arange(n, dtype=np.int64)
  if ids.shape != (n,) or ids.min() < 0 or ids.max() >= target.cfg.vocab_size:
    raise CheckpointError(f"{where}: d2t does not map {n} draft ids into the target vocabulary")
  if "fc.bias" in t:
    raise CheckpointError(f"{where} has fc.bias; jaxspec's EAGLE-3 fc has none")
  options = dict(version=3, layers=layers, num_heads=layer["num_attention_heads"],
                 num_kv_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
                 head_dim=layer.get("head_dim") or layer["hidden_size"] // layer[
                     "num_attention_heads"],
                 intermediate_size=layer["intermediate_size"])
  if n != target.cfg.vocab_size or not np.array_equal(ids, np.arange(n)):
    options["draft_vocab"] = ids
  abstract = nnx.eval_shape(lambda: heads_lib.HEADS["eagle"].create(
      target.cfg, rngs=nnx.Rngs(0), **options))
  lc = abstract.layer_cfg
  d, h, g, k = target.cfg.hidden_size, lc.num_heads, lc.num_kv_heads, lc.head_dim
  p = "layers.0."

  def get(name):
    if name not in t:
      raise CheckpointError(f"{where} has no tensor {name!r}")
    return _np32(t[name])

  mine = {
      "fc": get("fc.weight").T,
      "input_norm": get(p + "input_layernorm.weight"),
      "hidden_norm": get(p + "hidden_norm.weight"),
      "mlp_norm": get(p + "post_attention_layernorm.weight"),
      "wq": get(p + "self_attn.q_proj.weight").T.reshape(2 * d, h, k),
      "wk": get(p + "self_attn.k_proj.weight").T.reshape(2 * d, g, k),
      "wv": get(p + "self_attn.v_proj.weight").T.reshape(2 * d, g, k),
      "wo": get(p + "self_attn.o_proj.weight").T.reshape(h, k, d),
      "w_gate": get(p + "mlp.gate_proj.weight").T,
      "w_up": get(p + "mlp.up_proj.weight").T,
      "w_down": get(p + "mlp.down_proj.weight").T,
      "norm": get("norm.weight"),
      "lm_head": get("lm_head.weight").T,
      "draft_ids": ids.astype(np.int32),
  }
  return heads_lib.fill_module(abstract, mine, where)


# ----------------------------------------------------------------------------------------------
# Medusa <-> FasterDecoding/Medusa.


def export_medusa(directory: str | os.PathLike, model: MedusaHeads, target, *,
                  base_model_name_or_path: str | None = None,
                  dtype: str = "bfloat16") -> Path:
  """Writes a Medusa head in Medusa's format (config.json + medusa_lm_head.safetensors)."""
  if not isinstance(model, MedusaHeads):
    raise ValueError(f"export_medusa needs a MedusaHeads module, got {type(model).__name__}")
  if model.target_dims != heads_lib.target_dims(target.cfg):
    raise ValueError(f"the head was built for a target with (hidden, vocab, layers) ="
                     f" {model.target_dims}, not {heads_lib.target_dims(target.cfg)}")
  k, nl = model.cfg.num_heads, model.cfg.num_layers
  w, b = _np32(model.w[...]), _np32(model.b[...])
  shared = _np32(lm_head_weight(target.params)).T  # [V, D]
  tensors = {}
  for i in range(k):
    for j in range(nl):
      tensors[f"{i}.{j}.linear.weight"] = w[i, j].T
      tensors[f"{i}.{j}.linear.bias"] = b[i, j]
    tensors[f"{i}.{nl}.weight"] = (shared if model.lm_head is None
                                   else _np32(model.lm_head[...][i]).T)
  config = {"medusa_num_heads": k, "medusa_num_layers": nl,
            "base_model_name_or_path": base_model_name_or_path,
            "hidden_size": target.cfg.hidden_size, "vocab_size": target.cfg.vocab_size,
            "architectures": ["MedusaModel"], "torch_dtype": dtype}
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  write_safetensors(directory / MEDUSA_WEIGHTS, _cast(tensors, dtype), metadata={"format": "pt"})
  (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
  return directory


def import_medusa(directory: str | os.PathLike, target, *, rtol: float = 1e-2) -> MedusaHeads:
  """Reads a Medusa checkpoint into `MedusaHeads` (float32) for `target`.

  Heads whose LM heads all equal the target's (to `rtol`, which covers a bfloat16 export)
  share the target's; otherwise every head keeps its own (own_lm_head=True).
  """
  path = Path(directory)
  cfg_path = path / "config.json"
  weights = path / MEDUSA_WEIGHTS
  if not cfg_path.is_file():
    raise CheckpointError(f"{cfg_path} is missing: {path} is not a Medusa checkpoint")
  if not weights.is_file():
    raise CheckpointError(f"{weights} is missing" + (
        ": medusa_lm_head.pt is a pickle jaxspec never loads; convert it to safetensors"
        if (path / "medusa_lm_head.pt").exists() else ""))
  config = read_json(cfg_path)
  where = f"the Medusa checkpoint at {path}"
  try:
    k, nl = int(config["medusa_num_heads"]), int(config.get("medusa_num_layers", 1))
  except (KeyError, TypeError, ValueError) as e:
    raise CheckpointError(f"{cfg_path} has no valid medusa_num_heads ({e})") from e
  _check_dims(where, {"hidden_size": config.get("hidden_size"),
                      "vocab_size": config.get("vocab_size")}, target)
  t = read_safetensors(weights)
  d, v = target.cfg.hidden_size, target.cfg.vocab_size

  def get(name, shape):
    if name not in t:
      raise CheckpointError(f"{weights} has no tensor {name!r}")
    a = _np32(t[name])
    if a.shape != shape:
      raise CheckpointError(f"{weights}: {name!r} has shape {a.shape}, expected {shape} for a"
                            f" target with hidden_size={d}, vocab_size={v}")
    return a

  w = np.stack([np.stack([get(f"{i}.{j}.linear.weight", (d, d)).T for j in range(nl)])
                for i in range(k)])
  b = np.stack([np.stack([get(f"{i}.{j}.linear.bias", (d,)) for j in range(nl)])
                for i in range(k)])
  heads_lm = np.stack([get(f"{i}.{nl}.weight", (v, d)).T for i in range(k)])  # [K, D, V]
  shared = _np32(lm_head_weight(target.params))
  own = not all(np.allclose(x, shared, rtol=rtol, atol=rtol * np.abs(shared).max())
                for x in heads_lm)
  abstract = nnx.eval_shape(lambda: heads_lib.HEADS["medusa"].create(
      target.cfg, rngs=nnx.Rngs(0), num_heads=k, num_layers=nl, own_lm_head=own))
  mine = {"w": w, "b": b}
  if own:
    mine["lm_head"] = heads_lm
  return heads_lib.fill_module(abstract, mine, where)
