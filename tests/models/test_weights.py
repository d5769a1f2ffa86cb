"""One declaration per weight (`jaxspec.models.weights`): the parameters, their int8 and
output-major forms, the loaders' placement and the sharding specs are the same, bit for bit, as
before the declarations existed (fingerprints taken from the code before the change)."""

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxspec.models import init_params, quantize, tiny_config
from jaxspec.models import llama
from jaxspec.models.llama import LayerParams, stack_params
from jaxspec.sharding.rules import Placer, make_mesh, param_shardings

CONFIGS = {
    "tiny": dict(),
    "qwen2_tied_bf16": dict(attention_bias=True, tie_embeddings=True, dtype="bfloat16"),
    "gemma_bf16": dict(qk_norm=True, post_norms=True, norm_offset=1.0, dtype="bfloat16",
                       hidden_act="gelu_tanh", tie_embeddings=True, sliding_window=8,
                       layer_types=("sliding", "full"), embed_scale=True),
    "all_switches": dict(attention_bias=True, qk_norm=True, post_norms=True, num_layers=3),
}

# sha256 (first 16 hex digits) over every leaf's path, dtype, shape and bytes, computed with the
# code before the weight declarations (commit 82759eb).
FINGERPRINTS = {
    "tiny": "2809f6a1612a4eb5",
    "tiny/int8": "8418f3c0f6b7cec9",
    "tiny/unrolled": "da99e9ddae42a822",
    "tiny/unrolled_int8": "77f50726cf58ac30",
    "qwen2_tied_bf16": "6bd7d392550dbe79",
    "qwen2_tied_bf16/int8": "1c0c5c5a66b3b3fa",
    "qwen2_tied_bf16/unrolled": "a911d02130bf6731",
    "qwen2_tied_bf16/unrolled_int8": "9c4739826a5409d6",
    "gemma_bf16": "b42fec7799b3fb52",
    "gemma_bf16/int8": "40463f59a71fee85",
    "gemma_bf16/unrolled": "b53160f0d2e11d4b",
    "gemma_bf16/unrolled_int8": "d8cc9ec0b9f5dabb",
    "all_switches": "86f6c98c10a93bbc",
    "all_switches/int8": "977f398e88815ea6",
    "all_switches/unrolled": "82f325f5a931723c",
    "all_switches/unrolled_int8": "5ce1632a9c174d31",
}
# stack_params (the loaders' path) from the same weights as float32 host arrays: alone, placed
# on a 2-device mesh stacked, and placed one layer at a time. Gemma's norms stay float32 there.
STACKED = {
    "tiny": ("2809f6a1612a4eb5", "bac685eff16f4e76"),
    "qwen2_tied_bf16": ("6bd7d392550dbe79", "178740a428547fbd"),
    "gemma_bf16": ("74a1a6c716ffd355", "22cb52fb2a45d34d"),
    "all_switches": ("86f6c98c10a93bbc", "81b361688245d798"),
}
# The PartitionSpec of every leaf under the default rules on a {"data": 2, "model": 4} mesh.
SPECS = {"stacked": "de168aec1fb4cb1f", "unrolled": "0513552b84fb8de7",
         "int8": "21edcd440b1a1469"}


def _fingerprint(tree) -> str:
  h = hashlib.sha256()
  for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
    a = np.asarray(x)
    h.update(f"{jax.tree_util.keystr(path)}:{a.dtype}:{a.shape};".encode())
    h.update(a.tobytes())
  return h.hexdigest()[:16]


def _host(p):
  def layer(i):
    return {f.name: np.asarray(getattr(p.layers, f.name)[i], np.float32)
            for f in dataclasses.fields(LayerParams) if getattr(p.layers, f.name) is not None}
  head = None if p.lm_head is None else np.asarray(p.lm_head, np.float32)
  return layer, np.asarray(p.embed, np.float32), np.asarray(p.final_norm, np.float32), head


def _forms(name: str) -> dict[str, str]:
  cfg = tiny_config(**CONFIGS[name])
  p = init_params(cfg, jax.random.key(7))
  un = llama.with_scan_layers(p, False)
  got = {name: _fingerprint(p), f"{name}/int8": _fingerprint(quantize(p, "int8")),
         f"{name}/unrolled": _fingerprint(un),
         f"{name}/unrolled_int8": _fingerprint(quantize(un, "int8"))}
  args = _host(p)
  place = Placer(make_mesh({"data": 1, "model": 2}))
  got[f"{name}/stack"] = _fingerprint(stack_params(cfg, *args))
  got[f"{name}/stack_placed"] = _fingerprint(stack_params(cfg, *args, place=place))
  got[f"{name}/stack_unrolled"] = _fingerprint(stack_params(cfg, *args, place=place, scan=False))
  return got


# tiny (float32) and gemma_bf16 (bf16, tied, qk norms, sandwich norms, sliding layers) run by
# default; the other two under -m slow: most of the module's time is compiling init_params's
# eager ops, so the fixture computes only the configurations whose tests were selected.
PARAMS = [pytest.param(name, marks=pytest.mark.slow)
          if name in ("qwen2_tied_bf16", "all_switches") else name for name in CONFIGS]


@pytest.fixture(scope="module")
def forms(request):
  """The selected configurations' fingerprints, computed with XLA's default CPU settings: the
  random draws of float32 weights differ in their last bits between optimization levels, and
  `make test` runs the tiny models at -O0 (a subprocess then computes them with the defaults)."""
  names = [n for n in CONFIGS if any(
      item.path == request.path and getattr(item, "callspec", None) is not None
      and item.callspec.params.get("name") == n for item in request.session.items)]
  flags = os.environ.get("XLA_FLAGS", "")
  if "optimization_level" not in flags and "fusion_emitters" not in flags:
    return {k: v for name in names for k, v in _forms(name).items()}
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  out = subprocess.run([sys.executable, __file__, *names], env=env, capture_output=True,
                       text=True, timeout=300, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.optimized
@pytest.mark.parametrize("name", PARAMS)
def test_init_params_and_their_forms_are_unchanged(name, forms):
  got = {k: forms[k] for k in (name, f"{name}/int8", f"{name}/unrolled", f"{name}/unrolled_int8")}
  assert got == {k: FINGERPRINTS[k] for k in got}


@pytest.mark.parametrize("name", PARAMS)
def test_stack_params_is_unchanged(name, forms):
  stacked, unrolled = STACKED[name]
  assert forms[f"{name}/stack"] == forms[f"{name}/stack_placed"] == stacked
  assert forms[f"{name}/stack_unrolled"] == unrolled


def test_sharding_specs_are_unchanged():
  mesh = make_mesh({"data": 2, "model": 4})
  p = init_params(tiny_config(**CONFIGS["all_switches"]), jax.random.key(7))
  for name, tree in (("stacked", p), ("unrolled", llama.with_scan_layers(p, False)),
                     ("int8", quantize(p, "int8"))):
    leaves = jax.tree_util.tree_flatten_with_path(param_shardings(tree, mesh))[0]
    text = ";".join(f"{jax.tree_util.keystr(k)}={v.spec}" for k, v in leaves)
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == SPECS[name], name


# -- the table and what reads it ------------------------------------------------------------------
def test_the_table_declares_every_field_in_order():
  from jaxspec.models.llama import Params
  from jaxspec.models.weights import LAYER_WEIGHTS, MODEL_WEIGHTS
  assert [w.name for w in LAYER_WEIGHTS] == [f.name for f in dataclasses.fields(LayerParams)]
  assert [w.name for w in MODEL_WEIGHTS] == [f.name for f in dataclasses.fields(Params)
                                             if f.name != "layers"]


def test_declarations_give_shapes_presence_and_dtypes():
  from jaxspec.models.weights import WEIGHT
  cfg = tiny_config(num_layers=3, dtype="bfloat16", norm_offset=1.0)
  assert WEIGHT["wo"].shape(cfg) == (3, 4, 16, 64)
  assert WEIGHT["wo"].shape(cfg, stacked=False) == (4, 16, 64)
  assert WEIGHT["embed"].shape(cfg) == WEIGHT["embed"].shape(cfg, stacked=False) == (128, 64)
  assert WEIGHT["wo"].contract_axes(stacked=True) == (1, 2) and WEIGHT["wo"].n_out == 1
  assert WEIGHT["wq"].n_out == 2 and WEIGHT["embed"].contract_axes(stacked=True) == (1,)
  assert WEIGHT["lm_head"].present(cfg) and not WEIGHT["lm_head"].present(
      tiny_config(tie_embeddings=True))
  assert not WEIGHT["bq"].present(cfg) and WEIGHT["bq"].present(tiny_config(attention_bias=True))
  # Gemma's norm scales load in float32; every other weight in the configuration's dtype
  assert str(WEIGHT["q_norm"].dtype(cfg)) == "float32"
  assert str(WEIGHT["wq"].dtype(cfg)) == "bfloat16"
  assert str(WEIGHT["attn_norm"].dtype(tiny_config(dtype="bfloat16"))) == "bfloat16"


def test_a_declaration_that_contradicts_itself_is_refused():
  from jaxspec.models.weights import Weight
  with pytest.raises(ValueError, match="contracted axes must lead"):
    Weight(name="w", axes=("ffw", "embed"), contract=(1,), output_major=True)
  with pytest.raises(ValueError, match="init 'zeros'"):
    Weight(name="w", axes=("embed",), init="zeros")


def test_stack_params_refuses_a_layer_the_declarations_do_not_match():
  cfg = tiny_config(qk_norm=True)
  layer, embed, final_norm, head = _host(init_params(cfg, jax.random.key(7)))

  def missing(i):
    out = layer(i)
    del out["k_norm"]
    return out

  with pytest.raises(ValueError, match=r"layer 0 .* k_norm is missing, declared \(16,\)"):
    stack_params(cfg, missing, embed, final_norm, head)
  wrong = lambda i: {**layer(i), "wo": layer(i)["wo"][:2]}
  with pytest.raises(ValueError, match=r"wo is \(2, 16, 64\), declared \(4, 16, 64\)"):
    stack_params(cfg, wrong, embed, final_norm, head)
  extra = lambda i: {**layer(i), "bq": np.zeros((4, 16), np.float32)}
  with pytest.raises(ValueError, match=r"bq is \(4, 16\), declared absent"):
    stack_params(cfg, extra, embed, final_norm, head, place=Placer(make_mesh({"model": 2})))


def test_output_major_is_an_argument():
  from jaxspec.models.llama import (DEFAULT_OUTPUT_MAJOR, NO_OUTPUT_MAJOR, OutputMajor,
                                    OutputMajorPolicy)
  p = init_params(tiny_config(), jax.random.key(7))
  om = lambda policy: isinstance(
      llama.with_scan_layers(p, False, output_major=policy).layers[0].wq, OutputMajor)
  assert om(DEFAULT_OUTPUT_MAJOR)  # the CPU holds every float dtype output-major
  assert not om(NO_OUTPUT_MAJOR)
  assert not om(OutputMajorPolicy(platforms=(("gpu", None),)))
  assert not om(OutputMajorPolicy(platforms=(("cpu", frozenset({"bfloat16"})),)))
  assert om(OutputMajorPolicy(platforms=(("cpu", frozenset({"float32"})),)))
  assert not hasattr(llama, "OUTPUT_MAJOR_PLATFORMS")  # no module switch left to overwrite
  # Some weights only: those are output-major, the rest logical; the products agree.
  only_wo = OutputMajorPolicy(platforms=(("cpu", None),), weights={"wo"})
  un = llama.with_scan_layers(p, False, output_major=only_wo)
  assert only_wo.names == ("wo",) and isinstance(un.layers[0].wo, OutputMajor)
  assert not any(isinstance(getattr(lp, n), OutputMajor) for lp in un.layers
                 for n in ("wq", "wk", "wv", "w_gate", "w_up", "w_down"))
  cfg = tiny_config()
  toks = jax.random.randint(jax.random.key(3), (2, 5), 0, cfg.vocab_size)
  ref = llama.forward(p, toks, llama.init_cache(cfg, 2, 8), cfg)[0]
  got = llama.forward(un, toks, llama.init_cache(cfg, 2, 8), cfg)[0]
  np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-4)
  np.testing.assert_array_equal(llama.stacked_layers(un).wo, p.layers.wo)
  with pytest.raises(ValueError, match=r"names \['wx'\], not layer matmul weights"):
    OutputMajorPolicy(weights={"wx"})


@pytest.mark.parametrize("scan", [True, False])
def test_layers_are_profiled_as_attention_and_mlp(scan):
  import functools
  import re

  import jax.numpy as jnp
  from jaxspec.models import forward, init_cache
  cfg = tiny_config()
  p = llama.with_scan_layers(init_params(cfg, jax.random.key(7)), scan)
  compiled = jax.jit(functools.partial(forward, cfg=cfg)).lower(
      p, jnp.ones((1, 3), jnp.int32), init_cache(cfg, 1, 8)).compile()
  names = re.findall(r'op_name="([^"]*)"', compiled.as_text())
  for scope in ("attention", "mlp"):
    assert any(re.search(rf"/{scope}/(\S+/)?dot_general", n) for n in names), scope


if __name__ == "__main__":  # the `forms` fixture's subprocess: the configurations named
  print(json.dumps({k: v for name in sys.argv[1:] for k, v in _forms(name).items()}))
