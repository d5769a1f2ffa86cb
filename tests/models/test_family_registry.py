"""Model families as one file each: the registry the loaders ask, loaders that read formats only,
and family switches that cannot leak into an EAGLE head's layer or a saved checkpoint."""

import ast
import dataclasses

import numpy as np
import pytest

from helpers import ROOT
from jaxspec.heads.eagle import TAKEN_FROM_TARGET, EagleConfig, eagle_layer_config
from jaxspec.models import families
from jaxspec.models.config import LlamaConfig, RopeScaling, tiny_config
from jaxspec.models.families.base import Family
from jaxspec.models.hf_loader import ARCHITECTURES, check_savable, config_from_hf
from jaxspec.models.gguf_loader import SUPPORTED_ARCHITECTURES

MODELS = ROOT / "jaxspec" / "models"


@dataclasses.dataclass(frozen=True, kw_only=True)
class _WithNewSwitch(LlamaConfig):
  """A LlamaConfig as a future family would extend it: one more switch, off by default."""

  new_switch: bool = False


def _with_new_switch(**overrides) -> _WithNewSwitch:
  fields = {f.name: getattr(tiny_config(), f.name) for f in dataclasses.fields(LlamaConfig)}
  return _WithNewSwitch(**{**fields, "new_switch": True, **overrides})


def test_registry_lists_the_families_in_order():
  assert ARCHITECTURES == {
      "LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
      "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "GemmaForCausalLM": "gemma",
      "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
      "Phi3ForCausalLM": "phi3"}
  assert SUPPORTED_ARCHITECTURES == ("llama", "qwen2", "qwen3", "gemma", "gemma2", "gemma3",
                                     "phi3")
  assert families.SAVABLE == ("llama", "mistral", "qwen2")
  assert families.family("phi3").hf_class == "Phi3ForCausalLM"
  assert families.by_model_type("gemma3_text").architecture == "gemma3"
  assert families.by_gguf_architecture("mistral") is None  # llama.cpp converts it as "llama"
  # A config built in code with an architecture no family registers: the plain Llama layout.
  assert families.family("custom") == Family(architecture="custom")


def _literals(path) -> set[str]:
  """The string constants of a module's code, docstrings excluded."""
  tree = ast.parse(path.read_text(encoding="utf-8"))
  docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef))
                and node.body and isinstance(node.body[0], ast.Expr)
                and isinstance(node.body[0].value, ast.Constant)}
  return {node.value for node in ast.walk(tree)
          if isinstance(node, ast.Constant) and isinstance(node.value, str)
          and id(node) not in docstrings}


def _tensor_names(family: Family) -> set[str]:
  """The tensor names (within a layer) a family's projection hooks read, Llama's excluded."""
  cfg = tiny_config()
  names = set()

  def get(name, shape):
    names.add(name)
    return np.zeros(shape, np.float32)

  family.hf_projections(get, "", cfg)
  for fused in (True, False):  # Phi-3's GGUFs come with and without the fused attn_qkv
    family.gguf_projections(get, lambda name: fused, "", cfg)
  return names - _tensor_names_of_llama()


def _tensor_names_of_llama() -> set[str]:
  names = set()
  get = lambda name, shape: names.add(name) or np.zeros(shape, np.float32)
  Family(architecture="").hf_projections(get, "", tiny_config())
  Family(architecture="").gguf_projections(get, lambda name: False, "", tiny_config())
  return names


@pytest.mark.parametrize("loader", ["hf_loader.py", "gguf_loader.py"])
def test_loaders_name_no_family(loader):
  """The loaders read formats: no architecture, class or model_type of any family is a string
  in their code, and no tensor name only a family reads (Phi-3's fused ones) is part of one."""
  names = set()
  tensors = set()
  for f in families.FAMILIES:
    names |= {f.architecture, f.hf_class, f.hf_model_type, f.gguf_architecture,
              *f.hf_text_of, *f.hf_refused}
    tensors |= _tensor_names(f)
  names -= {"", None}
  assert "self_attn.qkv_proj.weight" in tensors and "ffn_up.weight" not in tensors
  literals = _literals(MODELS / loader)
  assert {s for s in literals if s in names} == set()
  assert {s for s in literals if any(t in s for t in tensors)} == set()


def test_eagle_layer_takes_only_its_list_from_the_target():
  """Every switch set on the target (a Gemma 3-like one, biases, bfloat16): the head's layer
  holds the target's `TAKEN_FROM_TARGET` fields, its own geometry, float32 weights, and every
  other field at LlamaConfig's default."""
  target = tiny_config(
      architecture="gemma3", attention_bias=True, sliding_window=4, layer_types=("sliding",
                                                                                 "full"),
      sliding_rope_theta=10000.0, rope_theta=1e6, qk_norm=True, post_norms=True,
      norm_offset=1.0, embed_scale=True, attn_softcap=50.0, final_softcap=30.0,
      query_pre_attn_scalar=24.0, hidden_act="gelu_tanh", dtype="bfloat16",
      compute_dtype="float32", partial_rotary_factor=0.5, tie_embeddings=True,
      rope_scaling=RopeScaling(rope_type="linear", factor=2.0), eos_token_ids=(2, 3))
  lc = eagle_layer_config(target, EagleConfig(num_heads=2, num_kv_heads=1, head_dim=8,
                                              intermediate_size=96))
  own = dict(num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, intermediate_size=96,
             dtype="float32")
  for f in dataclasses.fields(LlamaConfig):
    want = (getattr(target, f.name) if f.name in TAKEN_FROM_TARGET
            else own.get(f.name, f.default))
    assert getattr(lc, f.name) == want, f.name
  assert lc.rope_theta == 1e6 and lc.partial_rotary_factor == 0.5  # taken, not defaulted


def test_a_new_target_switch_does_not_reach_the_eagle_layer():
  """A switch a future family adds to the target's config is not in `TAKEN_FROM_TARGET`, so the
  head's layer does not inherit it (a copy of the target with a reset list would)."""
  lc = eagle_layer_config(_with_new_switch(), EagleConfig())
  assert type(lc) is LlamaConfig
  assert getattr(lc, "new_switch", False) is False


def test_a_new_switch_is_refused_on_save():
  """save_hf writes the fields it knows; a switch it does not record is refused, not dropped."""
  check_savable(_with_new_switch(new_switch=False))  # at its default: nothing lost
  with pytest.raises(ValueError, match="cannot hold new_switch=True"):
    check_savable(_with_new_switch())


def test_phi3_family_reads_its_own_config_names():
  """What only phi3.py knows: the older rope names read as LongRoPE, 4096 as the pretraining
  length, a window on every layer, and its refusal of attention biases."""
  config = dict(architectures=["Phi3ForCausalLM"], vocab_size=320, hidden_size=64,
                intermediate_size=128, num_attention_heads=4, num_hidden_layers=2,
                max_position_embeddings=8192, sliding_window=2047,
                rope_scaling={"type": "su", "short_factor": [1.0] * 8,
                              "long_factor": [2.0] * 8})
  cfg = config_from_hf(config)
  assert cfg.architecture == "phi3" and cfg.sliding_window == 2047 and cfg.layer_types is None
  assert cfg.rope_scaling.rope_type == "longrope"
  assert cfg.rope_scaling.original_max_position_embeddings == 4096
  assert cfg.rope_scaling.factor == 2.0  # 8192 / 4096
  llama = config_from_hf(dict(config, architectures=["LlamaForCausalLM"],
                              rope_scaling={"rope_type": "linear", "factor": 2.0}))
  assert llama.sliding_window is None  # Llama slides only where layer_types say
  with pytest.raises(Exception, match="Phi-3 attention biases are not supported"):
    config_from_hf(dict(config, attention_bias=True))
