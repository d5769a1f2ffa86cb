"""The public API: every name of `jaxspec.__all__` and `jaxspec.decoding.__all__` imports, and the
names written down here (the API as of issue 48, which moved modules behind them) are all still
there. A name may be added; dropping or renaming one is an API change, made here on purpose."""

import importlib

import pytest

PUBLIC = {
    "jaxspec": [
        "AutoK", "CausalLM", "CostModel", "DecodeOutput", "DraftContext", "DraftModel", "Drafter",
        "GenerateOutput", "Model", "NGram", "Sampling", "Target", "acceptance", "decode", "draft",
        "generate", "generate_stream", "load", "load_head", "rejection_sample",
        "release_cache_buffers", "release_compiled", "resolve_drafter", "speculative_decode",
        "speculative_generate", "speculative_stream", "verify"],
    "jaxspec.decoding": [
        "AutoK", "CausalLM", "CostModel", "DecodeOutput", "DraftContext", "Drafter", "LengthCache",
        "Proposal", "Sampling", "SamplingArrays", "SpecStats", "Target", "acceptance", "as_target",
        "check_lm", "decode", "draft", "rejection_sample", "speculative_decode", "verify"],
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_every_public_name_imports(module):
  mod = importlib.import_module(module)
  assert len(mod.__all__) == len(set(mod.__all__)), "a name listed twice in __all__"
  missing = sorted(set(PUBLIC[module]) - set(mod.__all__))
  assert not missing, f"{module}.__all__ lost {missing}"
  ns = {}
  exec(f"from {module} import {', '.join(mod.__all__)}", ns)  # noqa: S102 - as users write it
  for name in mod.__all__:
    assert ns[name] is getattr(mod, name) and ns[name] is not None, name


def test_decoding_names_are_the_top_level_ones():
  """A name both modules export is one object (the top level re-exports the functional core)."""
  import jaxspec
  import jaxspec.decoding
  for name in sorted(set(jaxspec.__all__) & set(jaxspec.decoding.__all__)):
    assert getattr(jaxspec, name) is getattr(jaxspec.decoding, name), name
