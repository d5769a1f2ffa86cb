"""Peer libraries that `jaxspec bench` runs beside jaxspec on the same model file and prompts.

Hugging Face transformers (plain greedy or sampled `generate`, prompt lookup with
`prompt_lookup_num_tokens`, assisted generation with `assistant_model`) and, when
`llama-cpp-python` is installed, llama.cpp (plain, and prompt lookup with
`LlamaPromptLookupDecoding`). Every run gets the prompts as token ids (the ones jaxspec
decodes), the same number of new tokens and the same stop tokens, and reports the tokens each
row really generated (up to and including its first stop token), so tokens/s compare the same
work.

The packages are optional (`pip install 'jaxspec[compare]'`); `missing_packages` says which
are absent before anything is loaded.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class Peer:
  """One peer method: what it runs and what it needs.

  Attributes:
    description: one line for the tables.
    library: "transformers" or "llama.cpp"; a peer's speedup is over its library's plain run.
    baseline: the peer whose tokens/s the speedup divides by (its library's plain decoding).
    modules: importable modules it needs.
    install: the pip command that installs them.
    batched: whether it decodes a batch of rows (transformers' prompt lookup and assisted
      generation, and llama.cpp's Python API, take one row).
    needs_draft_model: assisted generation needs a draft model in Hugging Face layout.
  """

  description: str
  library: str
  baseline: str
  modules: tuple[str, ...]
  install: str
  batched: bool = False
  needs_draft_model: bool = False


_HF = ("torch", "transformers", "accelerate")
_HF_INSTALL = "pip install 'jaxspec[compare]'"
_LLAMA = ("llama_cpp",)
_LLAMA_INSTALL = "pip install 'jaxspec[llama-cpp]'"  # llama-cpp-python

# The registry: adding a peer is one entry here and one branch in its runner's `run`.
PEERS: dict[str, Peer] = {
    "transformers": Peer(description="transformers generate, greedy/sampled (plain)",
                         library="transformers", baseline="transformers", modules=_HF,
                         install=_HF_INSTALL, batched=True),
    "transformers-prompt-lookup": Peer(
        description="transformers prompt lookup (prompt_lookup_num_tokens)",
        library="transformers", baseline="transformers", modules=_HF, install=_HF_INSTALL),
    "transformers-assisted": Peer(
        description="transformers assisted generation (assistant_model = the draft model)",
        library="transformers", baseline="transformers", modules=_HF, install=_HF_INSTALL,
        needs_draft_model=True),
    "llama.cpp": Peer(description="llama.cpp (llama-cpp-python) on the GGUF, plain",
                      library="llama.cpp", baseline="llama.cpp", modules=_LLAMA,
                      install=_LLAMA_INSTALL),
    "llama.cpp-prompt-lookup": Peer(
        description="llama.cpp LlamaPromptLookupDecoding on the GGUF",
        library="llama.cpp", baseline="llama.cpp", modules=_LLAMA, install=_LLAMA_INSTALL),
}


def _find_spec(module: str):
  return importlib.util.find_spec(module)


def missing_packages(peer: str) -> list[str]:
  """The modules `peer` needs that are not installed (found without importing them)."""
  out = []
  for m in PEERS[peer].modules:
    try:
      found = _find_spec(m) is not None
    except (ImportError, ValueError):
      found = False
    if not found:
      out.append(m)
  return out


def versions(libraries: Sequence[str]) -> dict[str, str]:
  """Versions of the peer libraries used (and torch's thread count)."""
  out: dict[str, str] = {}
  if "transformers" in libraries:
    import accelerate
    import torch
    import transformers
    out.update(torch=torch.__version__, transformers=transformers.__version__,
               accelerate=accelerate.__version__)
  if "llama.cpp" in libraries:
    import llama_cpp
    out["llama_cpp_python"] = getattr(llama_cpp, "__version__", "?")
  return out


@dataclasses.dataclass
class PeerRun:
  """One peer generation of a batch.

  Attributes:
    tokens: per row, the new tokens up to and including the first stop token.
    seconds: wall time of the generate call (the prompt's prefill included).
    chunk_times: seconds since the start at which row 0 received new tokens, and how many
      (a streamer's callbacks: one per decode step, or per accepted block when speculating).
  """

  tokens: list[list[int]]
  seconds: float
  chunk_times: list[tuple[float, int]]


def _cut(row: Sequence[int], stop_ids: Sequence[int], limit: int) -> list[int]:
  out = []
  for t in list(row)[:limit]:
    out.append(int(t))
    if int(t) in stop_ids:
      break
  return out


def model_files(model_path: str | None) -> tuple[str, str | None]:
  """(directory, gguf file name or None) of the target for transformers' `from_pretrained`."""
  from jaxspec.models.loading import bundled_gguf_path, is_bundled_name
  if is_bundled_name(model_path):
    p = bundled_gguf_path()
    return str(p.parent), p.name
  p = Path(model_path).expanduser()
  if p.suffix.lower() == ".gguf":
    return str(p.parent), p.name
  return str(p), None


class _Clock:
  """A transformers streamer that records when row 0 receives tokens (the first call is the
  prompt, ignored)."""

  def __init__(self):
    self.t0 = time.perf_counter()
    self.times: list[tuple[float, int]] = []
    self._prompt_seen = False

  def put(self, value):
    if not self._prompt_seen:
      self._prompt_seen = True
      return
    n = 1 if value.ndim <= 1 else int(value.shape[1])
    self.times.append((time.perf_counter() - self.t0, n))

  def end(self):
    pass


class TransformersRunner:
  """The target (and the draft model, for assisted generation) loaded in transformers in
  float32, on `threads` CPU threads."""

  def __init__(self, model_path: str | None, draft_model: str | None, *, threads: int,
               lookup_tokens: int = 10):
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(threads)
    self.torch = torch
    self.lookup_tokens = lookup_tokens
    folder, gguf = model_files(model_path)
    kw = dict(gguf_file=gguf) if gguf else {}
    # float32 as jaxspec runs it (a GGUF is dequantized to float32 by transformers too).
    self.model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **kw).eval()
    self.assistant = None
    if draft_model is not None:
      dfolder, dgguf = model_files(draft_model)
      dkw = dict(gguf_file=dgguf) if dgguf else {}
      self.assistant = AutoModelForCausalLM.from_pretrained(dfolder, dtype=torch.float32,
                                                            **dkw).eval()

  def run(self, peer: str, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
          stop_ids: Sequence[int], temperature: float, top_k: int, top_p: float,
          seed: int) -> PeerRun:
    torch = self.torch
    b = len(prompts)
    width = max(len(p) for p in prompts)
    pad = int(stop_ids[0])
    # Left padding with an attention mask: transformers' convention for batched decoding.
    ids = torch.full((b, width), pad, dtype=torch.long)
    mask = torch.zeros((b, width), dtype=torch.long)
    for i, p in enumerate(prompts):
      ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
      mask[i, width - len(p):] = 1
    kw: dict[str, Any] = dict(max_new_tokens=max_new_tokens, eos_token_id=list(stop_ids),
                              pad_token_id=pad, attention_mask=mask)
    if temperature > 0:
      kw.update(do_sample=True, temperature=temperature, top_k=top_k or None, top_p=top_p)
    else:
      kw.update(do_sample=False, temperature=None, top_k=None, top_p=None)
    if peer == "transformers-prompt-lookup":
      kw["prompt_lookup_num_tokens"] = self.lookup_tokens
    elif peer == "transformers-assisted":
      kw["assistant_model"] = self.assistant
    elif peer != "transformers":
      raise ValueError(f"unknown transformers peer {peer!r}")
    torch.manual_seed(seed)
    clock = _Clock()
    with torch.inference_mode():
      t0 = time.perf_counter()
      clock.t0 = t0
      out = self.model.generate(ids, streamer=clock, **kw)
      dt = time.perf_counter() - t0
    new = out[:, width:].tolist()
    return PeerRun(tokens=[_cut(r, stop_ids, max_new_tokens) for r in new], seconds=dt,
                   chunk_times=clock.times)


class LlamaCppRunner:
  """llama.cpp through llama-cpp-python on the GGUF itself (its own quantized kernels), one
  model per peer (prompt lookup is set when the model is created). llama.cpp computes in the
  GGUF's own Q4_1 arithmetic, so its greedy tokens follow jaxspec's float32 ones only until the
  first near-tie; the bench reports that agreement rather than asserting it."""

  def __init__(self, model_path: str | None, peers: Sequence[str], *, threads: int,
               n_ctx: int, lookup_tokens: int = 10):
    from llama_cpp import Llama
    folder, gguf = model_files(model_path)
    if gguf is None:
      raise ValueError("llama.cpp peers need a .gguf model (--model path/to/model.gguf or the"
                       " bundled model)")
    path = os.path.join(folder, gguf)
    self.models = {}
    for peer in peers:
      kw: dict[str, Any] = {}
      if peer == "llama.cpp-prompt-lookup":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        kw["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=lookup_tokens)
      self.models[peer] = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads,
                                n_threads_batch=threads, verbose=False, seed=0, **kw)

  def run(self, peer: str, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
          stop_ids: Sequence[int], temperature: float, top_k: int, top_p: float,
          seed: int) -> PeerRun:
    if len(prompts) != 1:
      raise ValueError("llama.cpp peers decode one row at a time")
    llm = self.models[peer]
    toks: list[int] = []
    times: list[tuple[float, int]] = []
    # llama-cpp-python keeps the last sequence's KV and reuses its longest common prefix; forget
    # it so every timed run (after the warm-up on the same prompt) pays for its own prefill.
    llm.reset()
    t0 = time.perf_counter()
    gen = llm.generate(list(prompts[0]), temp=temperature, top_k=top_k if temperature > 0 else 1,
                       top_p=top_p, min_p=0.0, repeat_penalty=1.0, reset=True)
    for t in gen:
      toks.append(int(t))
      times.append((time.perf_counter() - t0, 1))
      if int(t) in stop_ids or len(toks) >= max_new_tokens:
        break
    dt = time.perf_counter() - t0
    return PeerRun(tokens=[toks], seconds=dt, chunk_times=times)
