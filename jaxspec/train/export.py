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
  EAGLE 3.1 switches (config flags, each false by default): norm_before_fc (tensor
                   input_norm.weight [nD]), fc_norm (fc_norm.{i}.weight [D]), norm_output,
                   norm_before_residual; `EagleConfig` implements all four. The importer
                   refuses, naming it, any other setting that is on and any tensor it does not
                   read, rather than load a head that would draft another function.

MLP speculator <-> vLLM's `mlp_speculator` (IBM fms-extras; vllm serve --speculative-config
'{"model": <dir>, "method": "mlp_speculator"}'):
  config.json      architectures ["MLPSpeculatorPreTrainedModel"], model_type "mlp_speculator",
                   vocab_size, emb_dim (the target's width), inner_dim, n_predict,
                   top_k_tokens_per_head, n_candidates, tie_weights, scale_input.
  model.safetensors  emb.{j}.weight [V, I], proj.{j}.weight [I, D or I] ([out, in]),
                   head.{j}.weight [V, I], ln.{j}.weight and ln.{j}.bias [I] per stage j (with
                   tie_weights stage 0 only, plus proj.1); stage j: s = GELU(LN_j(proj_j(s) +
                   c * emb_j[x])), logits head_j(s), LN_j the RMS-scaling norm of fms-extras.
  Only heads with norm="rms" and their own tables (tie_to_target=False) compute that function.

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
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
from flax import nnx

from jaxspec import heads as heads_lib
from jaxspec.heads import EagleHead, MedusaHeads, MLPSpeculator
from jaxspec.models.errors import CheckpointError
from jaxspec.models.hf_loader import (SAVE_DTYPES, config_to_hf, hf_class_name, read_json,
                                      read_safetensors, write_safetensors)
from jaxspec.models.llama import lm_head_weight

SPECULATORS_VERSION = "0.1.0"
MEDUSA_WEIGHTS = "medusa_lm_head.safetensors"
MLP_WEIGHTS = "model.safetensors"


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
  if model.fc_in_norm is not None:
    tensors["input_norm.weight"] = _np32(model.fc_in_norm[...])
  if model.fc_norms is not None:
    for i, w in enumerate(_np32(model.fc_norms[...])):
      tensors[f"fc_norm.{i}.weight"] = w
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
      **{name: bool(getattr(model.cfg, name)) for name in heads_lib.EAGLE3_SWITCHES},
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


# Top-level settings of a speculators EAGLE-3 config.json that import_eagle3 reads or that do not
# change the drafted function (names, versions, storage dtype, training-only switches). Any other
# key that is on (not false, null, empty) is refused by name.
_EAGLE3_CONFIG_KEYS = frozenset({
    "architectures", "speculators_model_type", "speculators_version", "speculators_config",
    "transformer_layer_config", "draft_vocab_size", "target_hidden_size",
    "eagle_aux_hidden_state_layer_ids", "torch_dtype", "dtype", "transformers_version",
    "model_type", "_name_or_path", "embed_requires_grad", "enable_sp_ulysses",
    *heads_lib.EAGLE3_SWITCHES})
# transformer_layer_config settings and the values jaxspec's draft layer has (a plain Llama
# layer: SiLU, no biases, no window); the geometry is read separately.
_EAGLE3_LAYER_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                       "sliding_window": None, "use_sliding_window": False,
                       "pretraining_tp": 1, "num_hidden_layers": 1}
# Tensors that belong to the target, not the head (the verifier's norm and LM head, written by
# some speculators versions): never read.
_EAGLE3_TARGET_TENSORS = frozenset({"verifier_norm.weight", "verifier_lm_head.weight"})


def _is_off(value) -> bool:
  return value is None or value is False or value == [] or value == {}


def _check_eagle3_config(config: dict, layer: dict, target, where: str) -> None:
  """Refuses every setting that is on but not implemented (by name), before any tensor is read."""
  unknown = sorted(k for k, v in config.items() if k not in _EAGLE3_CONFIG_KEYS and not _is_off(v))
  if unknown:
    raise CheckpointError(f"{where} sets {unknown}, which jaxspec's EAGLE-3 head does not"
                          " implement: it would draft another function than the one trained;"
                          " import only checkpoints without them")
  if config.get("norm_before_fc") and config.get("fc_norm"):
    raise CheckpointError(f"{where} sets both norm_before_fc and fc_norm, which exclude each"
                          " other: the checkpoint is inconsistent")
  for key, want in _EAGLE3_LAYER_FIXED.items():
    if key in layer and layer[key] != want and not (want is None and _is_off(layer[key])):
      raise CheckpointError(f"{where}: transformer_layer_config has {key}={layer[key]!r};"
                            f" jaxspec's draft layer implements {key}={want!r} only")
  model_type = layer.get("model_type", "llama")
  if model_type != "llama":
    raise CheckpointError(f"{where}: its draft layer is a {model_type!r} layer; jaxspec's EAGLE-3"
                          " head implements the Llama layer (no q/k norms)")
  for key in ("rope_theta", "rms_norm_eps"):  # the head uses the target's
    mine = getattr(target.cfg, key)
    if key in layer and layer[key] is not None and not np.isclose(float(layer[key]), mine):
      raise CheckpointError(f"{where}: transformer_layer_config has {key}={layer[key]} but the"
                            f" target has {key}={mine}; jaxspec's head uses the target's")
  mine, theirs = target.cfg.rope_scaling, layer.get("rope_scaling")
  kind, factor = None, float("nan")
  if isinstance(theirs, dict):
    kind = theirs.get("rope_type", theirs.get("type"))
    try:
      factor = float(theirs.get("factor", "nan"))
    except (TypeError, ValueError):
      pass
  if _is_off(theirs) != (mine is None) or (mine is not None and (
      kind != mine.rope_type or not np.isclose(factor, mine.factor))):
    said = "none" if mine is None else f"{mine.rope_type} x{mine.factor:g}"
    raise CheckpointError(f"{where}: transformer_layer_config has rope_scaling={theirs!r} but"
                          f" the target's is {said}; jaxspec's head uses the target's rotary"
                          " embedding, so it would draft another function")


def import_eagle3(directory: str | os.PathLike, target) -> EagleHead:
  """Reads a `speculators` EAGLE-3 checkpoint into an `EagleHead` (float32) for `target`.

  EAGLE 3.1's norm_before_fc, fc_norm, norm_output and norm_before_residual are implemented
  (`EagleConfig`); every other setting that is on, and every tensor that is not read, is refused
  by name: a head that drafts another function than the one trained would only lose acceptance,
  silently.

  Raises:
    CheckpointError: missing/corrupted files, a head for another target, or a variant jaxspec
      does not implement (several draft layers, another draft width, an unknown setting or
      tensor).
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
  _check_eagle3_config(config, layer, target, where)
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
    d2t = np.asarray(t["d2t"]).astype(np.int64)
    if d2t.shape != (n,):
      raise CheckpointError(f"{where}: d2t has shape {d2t.shape} but draft_vocab_size is {n}")
    ids = np.arange(n, dtype=np.int64) + d2t
  else:
    ids = np.arange(n, dtype=np.int64)
  if ids.shape != (n,) or ids.min() < 0 or ids.max() >= target.cfg.vocab_size:
    raise CheckpointError(f"{where}: d2t does not map {n} draft ids into the target vocabulary")
  missing = [k for k in ("num_attention_heads", "intermediate_size") if not layer.get(k)]
  if missing:
    raise CheckpointError(f"{where}: transformer_layer_config has no {missing}: the draft"
                          " layer's geometry is unknown")
  switches = {name: bool(config.get(name)) for name in heads_lib.EAGLE3_SWITCHES}
  options = dict(version=3, layers=layers, num_heads=layer["num_attention_heads"],
                 num_kv_heads=layer.get("num_key_value_heads", layer["num_attention_heads"]),
                 head_dim=layer.get("head_dim") or layer["hidden_size"] // layer[
                     "num_attention_heads"],
                 intermediate_size=layer["intermediate_size"], **switches)
  if n != target.cfg.vocab_size or not np.array_equal(ids, np.arange(n)):
    options["draft_vocab"] = ids
  abstract = nnx.eval_shape(lambda: heads_lib.HEADS["eagle"].create(
      target.cfg, rngs=nnx.Rngs(0), **options))
  lc = abstract.layer_cfg
  d, h, g, k = target.cfg.hidden_size, lc.num_heads, lc.num_kv_heads, lc.head_dim
  p = "layers.0."
  read = set()

  def get(name):
    if name not in t:
      raise CheckpointError(f"{where} has no tensor {name!r}")
    read.add(name)
    return _np32(t[name])

  def shaped(name, *shape):  # a [out, in] matrix as the head's [in, heads, head_dim] or so
    a = get(name).T
    if a.size != math.prod(shape):
      raise CheckpointError(f"{where}: tensor {name!r} has shape {a.T.shape}, which the"
                            f" config's geometry cannot read as {shape}")
    return a.reshape(shape)

  mine = {
      "fc": get("fc.weight").T,
      "input_norm": get(p + "input_layernorm.weight"),
      "hidden_norm": get(p + "hidden_norm.weight"),
      "mlp_norm": get(p + "post_attention_layernorm.weight"),
      "wq": shaped(p + "self_attn.q_proj.weight", 2 * d, h, k),
      "wk": shaped(p + "self_attn.k_proj.weight", 2 * d, g, k),
      "wv": shaped(p + "self_attn.v_proj.weight", 2 * d, g, k),
      "wo": shaped(p + "self_attn.o_proj.weight", h, k, d),
      "w_gate": get(p + "mlp.gate_proj.weight").T,
      "w_up": get(p + "mlp.up_proj.weight").T,
      "w_down": get(p + "mlp.down_proj.weight").T,
      "norm": get("norm.weight"),
      "lm_head": get("lm_head.weight").T,
      "draft_ids": ids.astype(np.int32),
  }
  if switches["norm_before_fc"]:
    mine["fc_in_norm"] = get("input_norm.weight")
  if switches["fc_norm"]:
    mine["fc_norms"] = np.stack([get(f"fc_norm.{i}.weight") for i in range(len(layers))])
  read |= {"d2t", "t2d"} | _EAGLE3_TARGET_TENSORS
  if "embed_tokens.weight" in t:  # the target's embedding, unless the checkpoint trained its own
    read.add("embed_tokens.weight")
    emb = _np32(t["embed_tokens.weight"])
    if target.params is not None and (emb.shape != tuple(target.params.embed.shape) or not
                                      np.allclose(emb, _np32(target.params.embed), rtol=1e-2,
                                                  atol=1e-2 * float(np.abs(emb).max()))):
      raise CheckpointError(f"{where} holds an embed_tokens.weight that differs from the"
                            " target's embedding; jaxspec's head reads the target's, so it"
                            " would draft another function")
  extra = sorted(set(t) - read)
  if extra:
    raise CheckpointError(f"{where} holds tensors {extra} that jaxspec's EAGLE-3 head does not"
                          " read (a variant it does not implement): it would draft another"
                          " function than the one trained")
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
  if k < 1 or nl < 1:
    raise CheckpointError(f"{cfg_path}: medusa_num_heads ({k}) and medusa_num_layers ({nl})"
                          " must be at least 1")
  _check_dims(where, {"hidden_size": config.get("hidden_size"),
                      "vocab_size": config.get("vocab_size")}, target)
  t = read_safetensors(weights)
  d, v = target.cfg.hidden_size, target.cfg.vocab_size
  read = set()

  def get(name, shape):
    if name not in t:
      raise CheckpointError(f"{weights} has no tensor {name!r}")
    read.add(name)
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
  extra = sorted(set(t) - read)
  if extra:  # an LM-head bias, more heads or layers than the config says: another function
    raise CheckpointError(f"{where} holds tensors {extra} that jaxspec's Medusa heads do not"
                          f" read (with medusa_num_heads={k}, medusa_num_layers={nl}): it would"
                          " draft another function than the one trained")
  shared = _np32(lm_head_weight(target.params))
  own = not all(np.allclose(x, shared, rtol=rtol, atol=rtol * np.abs(shared).max())
                for x in heads_lm)
  abstract = nnx.eval_shape(lambda: heads_lib.HEADS["medusa"].create(
      target.cfg, rngs=nnx.Rngs(0), num_heads=k, num_layers=nl, own_lm_head=own))
  mine = {"w": w, "b": b}
  if own:
    mine["lm_head"] = heads_lm
  return heads_lib.fill_module(abstract, mine, where)


# ----------------------------------------------------------------------------------------------
# MLP speculator <-> vLLM's mlp_speculator (IBM fms-extras).


def export_mlp_speculator(directory: str | os.PathLike, model: MLPSpeculator, target, *,
                          dtype: str = "bfloat16", n_candidates: int = 5) -> Path:
  """Writes an MLP speculator in the format vLLM serves (`method: mlp_speculator`).

  Args:
    model: an `MLPSpeculator` with norm="rms" and its own tables (tie_to_target=False): the
      function fms-extras and vLLM compute (see the module docstring).
    target: the target `Model` it was trained for.
    dtype: "bfloat16", "float16" or "float32".
    n_candidates: recorded for fms-extras' tree search (vLLM does not read it).
  Raises:
    ValueError: another kind of head, or one whose function the format cannot express.
  """
  if not isinstance(model, MLPSpeculator):
    raise ValueError(f"export_mlp_speculator needs an MLPSpeculator, got {type(model).__name__}")
  if model.target_dims != heads_lib.target_dims(target.cfg):
    raise ValueError(f"the head was built for a target with (hidden, vocab, layers) ="
                     f" {model.target_dims}, not {heads_lib.target_dims(target.cfg)}")
  cfg = model.cfg
  if cfg.tie_to_target:
    raise ValueError("this MLP speculator reads the target's embedding and LM head"
                     " (tie_to_target=True), which vLLM's mlp_speculator cannot express: train"
                     " one with tie_to_target=False (and norm='rms') to export it")
  if cfg.norm != "rms":
    raise ValueError(f"this MLP speculator normalises with norm={cfg.norm!r}; vLLM's"
                     " mlp_speculator uses the RMS-scaling norm of fms-extras: train one with"
                     " norm='rms' to export it")
  n, d = cfg.n_predict, target.cfg.hidden_size
  if cfg.tie_stages and n < 2:
    raise ValueError("vLLM ties the stages of an MLP speculator only when it has 2 or more:"
                     " use tie_stages=False with n_predict=1")
  stages = 1 if cfg.tie_stages else n
  tensors = {"proj.0.weight": _np32(model.proj0[...]).T}
  proj = [] if model.proj is None else _np32(model.proj[...])
  for j in range(1 if cfg.tie_stages else n - 1):
    tensors[f"proj.{j + 1}.weight"] = proj[j].T  # [I, I] as [out, in]
  for j in range(stages):
    tensors[f"emb.{j}.weight"] = _np32(model.emb[...][j])  # [V, I]
    tensors[f"head.{j}.weight"] = _np32(model.head[...][j]).T  # [V, I]
    tensors[f"ln.{j}.weight"] = _np32(model.ln_scale[...][j])
    tensors[f"ln.{j}.bias"] = _np32(model.ln_bias[...][j])
  inner = int(model.proj0.shape[1])
  config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator",
            "vocab_size": target.cfg.vocab_size, "emb_dim": d,
            "inner_dim": 0 if inner == d else inner, "n_predict": n,
            "top_k_tokens_per_head": [1] * n, "n_candidates": int(n_candidates),
            "tie_weights": bool(cfg.tie_stages), "scale_input": bool(cfg.scale_input),
            "torch_dtype": dtype}
  directory = Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  write_safetensors(directory / MLP_WEIGHTS, _cast(tensors, dtype), metadata={"format": "pt"})
  (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
  return directory


# config.json settings of an mlp_speculator that do not change the drafted function.
_MLP_CONFIG_KEYS = frozenset({
    "architectures", "model_type", "vocab_size", "emb_dim", "hidden_size", "inner_dim",
    "n_predict", "top_k_tokens_per_head", "n_candidates", "tie_weights", "scale_input",
    "torch_dtype", "dtype", "transformers_version", "num_lookahead_tokens", "_name_or_path"})


def import_mlp_speculator(directory: str | os.PathLike, target) -> MLPSpeculator:
  """Reads an `mlp_speculator` checkpoint (vLLM / fms-extras) into an `MLPSpeculator` (float32,
  norm="rms") for `target`; tensor names may carry fms's "speculator." prefix.

  Raises:
    CheckpointError: missing/corrupted files, a head for another target, an unknown setting
      that is on, or a tensor it does not read (each named).
  """
  path = Path(directory)
  cfg_path = path / "config.json"
  if not cfg_path.is_file():
    raise CheckpointError(f"{cfg_path} is missing: {path} is not an mlp_speculator checkpoint")
  config = read_json(cfg_path)
  where = f"the mlp_speculator checkpoint at {path}"
  if config.get("model_type") != "mlp_speculator":
    raise CheckpointError(f"{cfg_path}: model_type is {config.get('model_type')!r},"
                          " import_mlp_speculator reads 'mlp_speculator' checkpoints")
  unknown = sorted(k for k, v in config.items() if k not in _MLP_CONFIG_KEYS and not _is_off(v))
  if unknown:
    raise CheckpointError(f"{where} sets {unknown}, which jaxspec's MLP speculator does not"
                          " implement")
  _check_dims(where, {"hidden_size": config.get("emb_dim"),
                      "vocab_size": config.get("vocab_size")}, target)
  try:
    n = int(config["n_predict"])
    inner = int(config.get("inner_dim") or 0)
  except (KeyError, TypeError, ValueError) as e:
    raise CheckpointError(f"{cfg_path} has no valid n_predict / inner_dim ({e})") from e
  tied = bool(config.get("tie_weights"))
  weights = path / MLP_WEIGHTS
  if not weights.is_file():
    raise CheckpointError(f"{weights} is missing" + (
        ": pytorch_model.bin is a pickle jaxspec never loads; convert it to safetensors"
        if (path / "pytorch_model.bin").exists() else ""))
  t = {k.removeprefix("speculator."): v for k, v in read_safetensors(weights).items()}
  abstract = nnx.eval_shape(lambda: heads_lib.HEADS["mlp"].create(
      target.cfg, rngs=nnx.Rngs(0), n_predict=n, inner_dim=inner, tie_stages=tied,
      scale_input=bool(config.get("scale_input")), norm="rms"))
  d, v = target.cfg.hidden_size, target.cfg.vocab_size
  i = inner or d
  read = set()

  def get(name, shape):
    if name not in t:
      raise CheckpointError(f"{weights} has no tensor {name!r}")
    a = _np32(t[name])
    if a.shape != shape:
      raise CheckpointError(f"{weights}: {name!r} has shape {a.shape}, expected {shape}")
    read.add(name)
    return a

  stages = 1 if tied else n
  mine = {"proj0": get("proj.0.weight", (i, d)).T,
          "emb": np.stack([get(f"emb.{j}.weight", (v, i)) for j in range(stages)]),
          "head": np.stack([get(f"head.{j}.weight", (v, i)).T for j in range(stages)]),
          "ln_scale": np.stack([get(f"ln.{j}.weight", (i,)) for j in range(stages)]),
          "ln_bias": np.stack([get(f"ln.{j}.bias", (i,)) for j in range(stages)])}
  if n > 1:
    mine["proj"] = np.stack([get(f"proj.{j + 1}.weight", (i, i)).T
                             for j in range(1 if tied else n - 1)])
  extra = sorted(set(t) - read)
  if extra:
    raise CheckpointError(f"{where} holds tensors {extra} that jaxspec's MLP speculator does not"
                          " read: it would draft another function than the one trained")
  return heads_lib.fill_module(abstract, mine, where)
