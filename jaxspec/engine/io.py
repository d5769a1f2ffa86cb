"""A call's data on the host: its arguments checked (ValueError, naming the fix, before anything
compiles), prompts padded and the cache sized (`prepare_prompts`), a speculative call gathered
into one `SpecRequest`; arrays placed on a mesh (`put_global`) and brought back to numpy
(`to_host`), tokens decoded to text. Nothing here keeps state between calls.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jaxspec.checks import check_int, is_int
from jaxspec.decoding import limits
from jaxspec.decoding.adaptive import CostModel
from jaxspec.decoding.drafter import Drafter, resolve_coupled
from jaxspec.decoding.functional import (check_drafter_for, check_logprobs, check_stop_ids,
                                         working_set)
from jaxspec.decoding.limits import MAX_POSITIONS
from jaxspec.decoding.loop import Policy, resolve_policy
from jaxspec.drafters import resolve_drafter
from jaxspec.models.llama import LlamaLM
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling, resolve_sampling


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


@dataclasses.dataclass(frozen=True)
class PreparedPrompts:
  tokens: np.ndarray  # [B, P] int32, right-padded with 0
  lengths: np.ndarray  # [B] int32
  max_len: int


def prepare_prompts(model: Model, prompts, max_new_tokens: int, *, extra: int = 0,
                    max_len: int | None = None, held: int = 0) -> PreparedPrompts:
  """Validates and pads prompts; sizes the cache. Raises ValueError before anything compiles.

  Args:
    prompts: a string, a list of strings (encoded with the model's tokenizer, no chat template:
      use `model.tokenizer.encode_chat` for that), or a list of token-id lists.
    max_new_tokens: new tokens per row.
    extra: cache slots needed beyond prompt + max_new_tokens (speculative verification writes
      up to k + 1 positions ahead).
    max_len: cache size; by default the padded prompt length plus what decoding needs, rounded
      up to a multiple of 64.
    held: bytes of buffers the run reuses or frees (`check_cache_fits`).
  """
  check_model(model)
  check_int("max_new_tokens", max_new_tokens, 1, MAX_POSITIONS)
  if max_len is not None:
    check_int("max_len", max_len, 1, MAX_POSITIONS)
  if isinstance(prompts, str) or (isinstance(prompts, Sequence) and prompts
                                  and is_int(prompts[0])):
    prompts = [prompts]
  if isinstance(prompts, (np.ndarray, jax.Array)):  # token ids: [P] one prompt, [B, P] a batch
    if isinstance(prompts, jax.core.Tracer):
      raise ValueError("prompts are traced: generate / speculative_generate run on the host; inside"
                       " jax.jit use jaxspec.decoding.decode / speculative_decode")
    arr = np.asarray(prompts)
    if arr.ndim not in (1, 2) or not np.issubdtype(arr.dtype, np.integer):
      raise ValueError(f"an array of prompts must hold integer token ids, [P] for one prompt or"
                       f" [B, P] for a batch (every column a token), got {arr.dtype}{arr.shape}")
    prompts = [arr.tolist()] if arr.ndim == 1 else [list(r) for r in arr.tolist()]
  if not isinstance(prompts, Sequence) or len(prompts) == 0:
    raise ValueError("prompts must be a string, a non-empty list of strings or of token-id"
                     " lists, or an integer array of token ids ([P] or [B, P])")
  rows = []
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if model.tokenizer is None:
        raise ValueError(f"prompt {i} is a string but the model has no tokenizer: pass token ids")
      p = model.tokenizer.encode(p)
    try:
      arr = np.asarray(p)
    except (ValueError, TypeError):  # ragged nesting, or items numpy cannot hold
      arr = None
    if arr is not None and arr.size == 0:
      raise ValueError(f"prompt {i} is empty: every row needs at least one token to condition on")
    if arr is None or arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
      what = f"dtype {arr.dtype}" if arr is not None else type(p).__name__
      raise ValueError(f"prompt {i} must be a string or a list of integer token ids, got"
                       f" {what} ({str(p)[:40]}): token ids are ints, not floats or None")
    p = [int(t) for t in arr.reshape(-1)]
    bad = [t for t in p if not 0 <= t < model.cfg.vocab_size]
    if bad:
      raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary"
                       f" [0, {model.cfg.vocab_size})")
    rows.append(p)
  longest = max(len(p) for p in rows)
  padded_len = round_up(longest, 64)  # coarse buckets: fewer compilations across prompts
  need = longest + max_new_tokens + extra
  if max_len is None:
    max_len = round_up(max(need, padded_len), 128)
  elif longest > max_len - max_new_tokens - extra:
    raise ValueError(
        f"a prompt of {longest} tokens does not fit: max_len {max_len} - max_new_tokens"
        f" {max_new_tokens}{f' - {extra} speculative slots' if extra else ''} leaves"
        f" {max_len - max_new_tokens - extra}; shorten the prompt, lower max_new_tokens or raise"
        " max_len")
  padded_len = min(padded_len, max_len)
  if max_len > model.cfg.max_position_embeddings:
    pass  # rotary extrapolates; Hugging Face does not refuse either
  check_cache_fits(model, len(rows), int(max_len), prompt_len=padded_len,
                   verify_tokens=max(extra, 1), held=held)
  toks = np.zeros((len(rows), padded_len), np.int32)
  for i, p in enumerate(rows):
    toks[i, : len(p)] = p
  return PreparedPrompts(toks, np.array([len(p) for p in rows], np.int32), int(max_len))


def stop_ids_for(model: Model, stop_ids: Sequence[int] | None) -> tuple[int, ...]:
  if stop_ids is None:
    ids = set(model.cfg.eos_token_ids)
    if model.tokenizer is not None:
      ids |= set(getattr(model.tokenizer, "eos_token_ids", ()))
    return tuple(sorted(ids))
  if isinstance(stop_ids, (int, np.integer)):
    raise ValueError(f"stop_ids must be a list of token ids, got {type(stop_ids).__name__}")
  return check_stop_ids(stop_ids)


def check_cache_fits(model: Model, batch: int, max_len: int, *, prompt_len: int = 1,
                     verify_tokens: int = 1, held: int = 0) -> None:
  """Raises ValueError (before anything compiles) when a run of `batch` rows with a [batch,
  max_len] KV cache cannot be held: past `MAX_POSITIONS` positions, or its estimated working
  set (`decoding.functional.working_set`: the cache, the loop's buffers, and the larger of the
  prefill's activations over `prompt_len` padded tokens and a step's logits over
  `verify_tokens`) larger than the device's free memory plus `held` (the bytes of the engine's
  kept cache buffers, which the run reuses or frees)."""
  limits.check_positions(max_len)
  ws = working_set(LlamaLM(model.cfg), model.params, batch, prompt_len, max_len,
                   verify_tokens=verify_tokens,
                   state_bytes=4 * 2 * batch * (max_len + verify_tokens + 2 * max_len))
  limits.check_working_set(ws, batch, max_len, "generating", held=held)


def check_chunk(chunk) -> int:
  """A stream's chunk: an integer >= 1 (0 would never advance)."""
  check_int("chunk", chunk, 1, why="steps between yields")
  return int(chunk)


def check_model(model) -> None:
  """Raises ValueError unless `model` is a jaxspec `Model`."""
  if not isinstance(model, Model):
    raise ValueError(f"the model must be a jaxspec Model (jaxspec.load(path) or"
                     f" Model(cfg, params)), got {type(model).__name__}")


def _describe(model: Model) -> str:
  return f"{model.name} ({model.cfg.architecture}, vocabulary of {model.cfg.vocab_size})"


def check_draft_vocabulary(target: Model, draft: Model) -> None:
  """Raises ValueError, naming both models, unless a draft model proposes the target's token
  ids: equal vocabulary sizes and, where both have tokenizers, the same piece for every id both
  vocabularies hold (drafting across families works where they share a tokenizer: a Qwen3
  draft for a Qwen3 target; a Mistral draft for a Llama 2 target has the same 32000 ids for
  other pieces). Added and special tokens are not compared (releases rename reserved ones,
  llama.cpp pads GGUF vocabularies with placeholders); exactness never depends on it, only the
  acceptance rate does."""
  if draft.cfg.vocab_size != target.cfg.vocab_size:
    raise ValueError(
        f"the draft model {_describe(draft)} and the target {_describe(target)} have different"
        " vocabularies: a draft model must propose the target's token ids, so use a draft of"
        " the target's family that shares its tokenizer (the same vocabulary size and tokens)")
  ta, tb = target.tokenizer, draft.tokenizer
  if ta is None or tb is None or ta is tb:
    return
  tid = _first_different_id(ta, tb)
  if tid is None:
    return
  raise ValueError(
      f"the draft model {_describe(draft)} and the target {_describe(target)} have different"
      f" tokenizers: id {tid} is {ta.id_to_token(tid)!r} for the target and"
      f" {tb.id_to_token(tid)!r} for the draft, so the draft's proposals would be other tokens:"
      " use a draft model that shares the target's tokenizer")


@functools.lru_cache(maxsize=16)  # tokenizers hash by identity: one comparison per pair
def _first_different_id(ta, tb) -> int | None:
  base_a = ta.backend.get_vocab(with_added_tokens=False)
  base_b = tb.backend.get_vocab(with_added_tokens=False)
  added = set(ta.backend.get_added_tokens_decoder()) | set(tb.backend.get_added_tokens_decoder())
  ia = {i: t for t, i in base_a.items() if i not in added}
  ib = {i: t for t, i in base_b.items() if i not in added}
  differ = [i for i in ia.keys() & ib.keys() if ia[i] != ib[i]]
  return min(differ) if differ else None


def check_drafter(target: Model, drafter: Drafter) -> None:
  """Raises ValueError for a drafter that cannot serve this target."""
  draft = getattr(drafter, "model", None)
  if isinstance(draft, Model):
    check_draft_vocabulary(target, draft)
  check_drafter_for(target.cfg.vocab_size, drafter)
  dparams = drafter.params
  if dparams is not None and target.sharding is None:  # a sharded target gets them copied
    tdev = _devices(target.params)
    ddev = _devices(dparams)
    if tdev and ddev and tdev != ddev:
      raise ValueError(
          f"the drafter's weights are on {sorted(map(str, ddev))} but the target's are on"
          f" {sorted(map(str, tdev))}: move both to the same devices (jax.device_put) for the"
          " fused loop, or give them separate meshes with a Placement")


def _devices(tree) -> set:
  out = set()
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      out |= set(leaf.devices())
  return out


@dataclasses.dataclass(frozen=True)
class SpecRequest:
  """A checked speculative call, before anything compiles: what its run is built from."""

  target: Model
  drafter: Drafter  # resolved by name; coupled under "auto" where it samples its drafts
  sampling: Sampling
  policy: Policy
  prep: PreparedPrompts
  stop_ids: tuple[int, ...]
  max_new_tokens: int
  key: Any  # as given: None, an integer seed, a key or one key per row (`as_key`)
  cost: CostModel | None  # given by the caller; None measures it under "auto"


def prepare_spec(target: Model, drafter, prompts, *, max_new_tokens: int, num_draft_tokens,
                 sampling: Sampling | None = None, temperature: float | None = None,
                 auto=None, cost: CostModel | None = None, max_len: int | None = None,
                 stop_ids: Sequence[int] | None = None, key=None,
                 logprobs: bool | int = False, held: int = 0) -> SpecRequest:
  """Everything a speculative call checks before compiling (the arguments of
  `speculative_generate`), the drafter resolved by name."""
  check_model(target)
  drafter = resolve_drafter(target, drafter)
  if temperature is not None:
    sampling = dataclasses.replace(resolve_sampling(sampling), temperature=temperature)
  sp_user = resolve_sampling(sampling)
  check_drafter(target, drafter)
  keep_lp, top_n = check_logprobs(logprobs, target.vocab_size)
  policy = dataclasses.replace(resolve_policy(num_draft_tokens, auto, drafter),
                               logprobs=keep_lp, top_logprobs=top_n)
  # A drafter that samples its drafts is coupled with the target's draws under "auto" (unless
  # it says otherwise), so a timed k schedule cannot change the text.
  drafter = resolve_coupled(drafter, policy.auto)
  if cost is not None and not isinstance(cost, CostModel):
    raise ValueError(f"cost must be a jaxspec CostModel, got {type(cost).__name__}")
  try:
    prep = prepare_prompts(target, prompts, max_new_tokens, extra=policy.k_max + 1,
                           max_len=max_len, held=held)
  except ValueError as e:
    if policy.auto and "does not fit" in str(e):
      raise ValueError(f"{e} (with num_draft_tokens=\"auto\" the cache also holds k_max ="
                       f" {policy.k_max} drafts: lower AutoK(k_max=...))") from None
    raise
  return SpecRequest(target=target, drafter=drafter, sampling=sp_user, policy=policy, prep=prep,
                     stop_ids=stop_ids_for(target, stop_ids), max_new_tokens=int(max_new_tokens),
                     key=key, cost=cost)


def decode_texts(model: Model, tokens: np.ndarray, lengths: np.ndarray) -> list[str] | None:
  if model.tokenizer is None:
    return None
  return [model.tokenizer.decode(tokens[b, : lengths[b]].tolist()) for b in range(len(lengths))]


def to_host(tree):
  """numpy copies of a pytree's arrays; an array spread over several processes' devices (a
  multi-host mesh) is gathered from all of them first."""
  def one(x):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      from jax.experimental import multihost_utils
      return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(x)
  return jax.tree.map(one, tree)


def put_global(tree, shardings):
  """`tree` placed by `shardings` (a matching pytree), as global arrays: on a multi-host mesh
  every process passes the same host values (prompts, sampling values, the PRNG key), which
  go through numpy so that each process contributes its own devices' shards."""
  if jax.process_count() == 1:
    return jax.device_put(tree, shardings)

  def one(x, sh):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      return x  # already global
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = jax.device_put(np.asarray(jax.random.key_data(x)), sh)
      return jax.random.wrap_key_data(data, impl=jax.random.key_impl(x))
    return jax.device_put(np.asarray(x), sh)

  return jax.tree.map(one, tree, shardings)


def in_shardings_for(sh, args):
  """in_shardings for (params, *batch arrays, key, ...) on a sharded model's mesh: the params
  keep their layout; every other array is batch-sharded when its first dimension is the batch,
  replicated otherwise (PRNG keys, scalars)."""
  params, rest = args[0], args[1:]
  b = args[1].shape[0]
  return (jax.tree.map(lambda x: x.sharding, params),
          *(sh.state(jax.eval_shape(lambda t: t, r), b) for r in rest))


def shardings_of(tree):
  return jax.tree.map(lambda x: x.sharding, tree)
