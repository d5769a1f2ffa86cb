"""One declaration per weight (`jaxspec.models.weights`): the parameters, their int8 and
output-major forms, the loaders' placement and the sharding specs are the same, bit for bit, as
before the declarations existed (fingerprints taken from the code before the change)."""

import dataclasses
import hashlib

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


@pytest.mark.parametrize("name", list(CONFIGS))
def test_init_params_and_their_forms_are_unchanged(name):
  cfg = tiny_config(**CONFIGS[name])
  p = init_params(cfg, jax.random.key(7))
  un = llama.with_scan_layers(p, False)
  got = {name: _fingerprint(p), f"{name}/int8": _fingerprint(quantize(p, "int8")),
         f"{name}/unrolled": _fingerprint(un),
         f"{name}/unrolled_int8": _fingerprint(quantize(un, "int8"))}
  assert got == {k: FINGERPRINTS[k] for k in got}


def _host(p):
  def layer(i):
    return {f.name: np.asarray(getattr(p.layers, f.name)[i], np.float32)
            for f in dataclasses.fields(LayerParams) if getattr(p.layers, f.name) is not None}
  head = None if p.lm_head is None else np.asarray(p.lm_head, np.float32)
  return layer, np.asarray(p.embed, np.float32), np.asarray(p.final_norm, np.float32), head


@pytest.mark.parametrize("name", list(CONFIGS))
def test_stack_params_is_unchanged(name):
  cfg = tiny_config(**CONFIGS[name])
  args = _host(init_params(cfg, jax.random.key(7)))
  place = Placer(make_mesh({"data": 1, "model": 2}))
  stacked, unrolled = STACKED[name]
  assert _fingerprint(stack_params(cfg, *args)) == stacked
  assert _fingerprint(stack_params(cfg, *args, place=place)) == stacked
  assert _fingerprint(stack_params(cfg, *args, place=place, scan=False)) == unrolled


def test_sharding_specs_are_unchanged():
  mesh = make_mesh({"data": 2, "model": 4})
  p = init_params(tiny_config(**CONFIGS["all_switches"]), jax.random.key(7))
  for name, tree in (("stacked", p), ("unrolled", llama.with_scan_layers(p, False)),
                     ("int8", quantize(p, "int8"))):
    leaves = jax.tree_util.tree_flatten_with_path(param_shardings(tree, mesh))[0]
    text = ";".join(f"{jax.tree_util.keystr(k)}={v.spec}" for k, v in leaves)
    assert hashlib.sha256(text.encode()).hexdigest()[:16] == SPECS[name], name
