"""Speculative and plain decoding as pure functions of arrays, for research code's own jit.

    out = jaxspec.decoding.speculative_decode(target, drafter, prompt_ids, prompt_lengths, key,
                                              max_new_tokens=64, num_draft_tokens=4)

`target` is a jaxspec `Model`, a `Target(lm, params)` or any model meeting `CausalLM` (with
`target_params=`); `drafter` a `Drafter`. Everything else is arrays ([B, P] prompt ids
right-padded, [B] lengths, a PRNG key, optionally a traced `max_new_tokens`) and static
configuration. The functions trace the same prefill and loop the host wrappers
(`jaxspec.speculative_generate`, `jaxspec.generate`) compile, with no host synchronisation,
numpy or timing inside, so they run under the caller's `jax.jit`, `jax.vmap` (over keys or
prompts) and `lax.scan`, on sharded inputs, and give the wrappers' tokens for the same padded
arrays. Arguments are checked before tracing: ranks, dtypes and the batch size always;
lengths, token ids and `max_new_tokens` where they are concrete values.

Values are arrays and shapes are static: `capacity` (static) sizes the output and the cache,
and `max_new_tokens` may be a traced scalar below it, so a new length does not recompile (a
traced value above `capacity` is clipped to it, since a traced value cannot be checked
before the program runs).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sampling as sampling_lib
from jaxspec.checks import check_int, is_int
from jaxspec.decoding import limits, loop, plain, protocol
from jaxspec.decoding.adaptive import AutoK, CostModel
from jaxspec.decoding.drafter import DraftContext, Drafter, resolve_coupled
from jaxspec.decoding.loop import SpecStats, StepConfig, costs_array, resolve_policy
from jaxspec.pytree import pytree_dataclass as _pytree


@_pytree
@dataclasses.dataclass
class DecodeOutput:
  """What `speculative_decode` and `decode` return (a pytree of arrays).

  Attributes:
    tokens: [B, capacity] int32 new tokens; `pad_id` (default -1, as the host wrappers'
      outputs: never a real token) past each row's length.
    lengths: [B] int32 new tokens per row (a stop token, when hit, is included).
    logprobs: [B, capacity] float32 the target's log-probability of each new token under the
      sampling parameters (`log_softmax` of the processed logits; greedy rows unscaled); 0 past
      each row's length. None with logprobs=False.
    target_passes: [] int32 target forward passes after the prefill.
    stats: the speculative loop's counters (`SpecStats`: drafted, accepted, emitted per row,
      acceptance per position, the k of every step); None for plain decoding.
    drafter_params: what the drafter hands to the next call as its `drafter_params`
      (`Drafter.next_params`: a `SuffixDecoding` drafter's corpus with this call's rows
      appended); None for drafters whose params do not change, and for plain decoding.
    top_ids: [B, capacity, N] int32 (with logprobs=N) the N most likely tokens of the
      distribution each new token was drawn from (the target's processed distribution at that
      position, under speculation too), most likely first (ties: lower id first); -1 past each
      row's length. None otherwise.
    top_logprobs: [B, capacity, N] float32 their log-probabilities (as `logprobs` reads them;
      -inf for tokens the filters drop); 0 past each row's length. None otherwise.
  """

  tokens: jax.Array
  lengths: jax.Array
  logprobs: jax.Array | None
  target_passes: jax.Array
  stats: SpecStats | None = None
  drafter_params: Any = None
  top_ids: jax.Array | None = None
  top_logprobs: jax.Array | None = None


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def _check_prompts(prompt_ids, prompt_lengths, vocab_size: int) -> tuple[int, int]:
  """(B, P) after checking ranks and dtypes (and values where concrete)."""
  for name, x, nd in (("prompt_ids", prompt_ids, 2), ("prompt_lengths", prompt_lengths, 1)):
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
      raise ValueError(f"{name} must be an array, got {type(x).__name__}: pass"
                       f" jnp.asarray(...) of int32 ({'[B, P] token ids' if nd == 2 else '[B]'})")
    if x.ndim != nd:
      shape = "[B, P] token ids, right-padded" if nd == 2 else "[B] prompt lengths"
      raise ValueError(f"{name} must be {shape} (rank {nd}), got shape {tuple(x.shape)}"
                       + ("; for one prompt use ids[None]" if nd == 2 and x.ndim == 1 else ""))
    if not jnp.issubdtype(x.dtype, jnp.integer):
      raise ValueError(f"{name} must hold integers, got dtype {x.dtype}: use .astype(jnp.int32)")
  b, p = prompt_ids.shape
  if prompt_lengths.shape[0] != b:
    raise ValueError(f"prompt_lengths has {prompt_lengths.shape[0]} rows, prompt_ids {b}: one"
                     " length per prompt row")
  if b < 1 or p < 1:
    raise ValueError(f"prompt_ids must have at least one row and one column, got {(b, p)}")
  if _is_concrete(prompt_lengths):
    lens = np.asarray(prompt_lengths)
    if lens.min() < 1 or lens.max() > p:
      raise ValueError(f"prompt_lengths must be in [1, {p}] (the padded width of prompt_ids),"
                       f" got min {lens.min()} and max {lens.max()}")
    if _is_concrete(prompt_ids):
      hit = first_out_of_vocabulary(prompt_ids, lens, vocab_size)
      if hit is not None:
        r, c, t = hit
        raise ValueError(f"prompt row {r} has token id {t} at position {c}, outside"
                         f" the target's vocabulary [0, {vocab_size})")
  return int(b), int(p)


def first_out_of_vocabulary(ids, lengths, vocab_size: int) -> tuple[int, int, int] | None:
  """(row, position, id) of the first token id outside [0, vocab_size) below its row's length
  in concrete [B, T] `ids`; None when every one is inside."""
  ids, lengths = np.asarray(ids), np.asarray(lengths)
  live = np.arange(ids.shape[1])[None, :] < lengths[:, None]
  bad = live & ((ids < 0) | (ids >= vocab_size))
  if not bad.any():
    return None
  r, c = map(int, np.argwhere(bad)[0])
  return r, c, int(ids[r, c])


def as_key(key, batch_size: int | None = None, n: int = 1) -> jax.Array:
  """A PRNG key from None (seed 0), an integer seed in [-2**63, 2**64) (one in [2**63, 2**64) is
  its int64 two's complement; seeds past 32 bits fold their high word in, so each draws its own
  key with or without jax_enable_x64) or one key (typed, or a
  raw uint32 [2]); or per-row keys: a typed key array [B] (or raw uint32 [B, 2]), row b drawing
  from keys[b] where one key gives row b fold_in(key, b) (`jaxspec.sampling.row_keys`), so
  `row_keys(key, N)[i:j]` reproduces rows i..j-1 of an N-row call in a batch of their own; or
  per-row integer seeds (a list of ints, or a signed-integer array [B], traced or not): row b
  draws as a batch of its own with key=seeds[b] draws (fold_in(key(seeds[b]), 0)), wherever
  it sits in the batch. Traced keys pass through. Raises ValueError for anything else, and
  for per-row keys or seeds whose count is not `batch_size` (when given; with n samples per
  prompt, `batch_size` or batch_size * n)."""
  if key is None:
    return jax.random.key(0)
  seeds = _seed_keys(key)
  if seeds is not None:
    key = seeds
  if is_int(key):
    if not -2**63 <= int(key) < 2**64:
      raise ValueError(f"key must be a PRNG key or an integer seed in [-2**63, 2**64), got {key}")
    seed = int(key)
    seed = seed - 2**64 if seed >= 2**63 else seed  # [2**63, 2**64): its int64 two's complement
    if -2**31 <= seed < 2**32:
      return jax.random.key(seed)
    # Without jax_enable_x64 jax.random.key keeps a seed's low 32 bits only (2**40 would draw
    # as 0 does): the high word folds in, so every seed in the range draws its own key.
    seed %= 2**64
    return jax.random.fold_in(jax.random.key(seed & 0xFFFFFFFF), seed >> 32)
  out = None
  if isinstance(key, jax.Array) and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) \
      and key.ndim <= 1:
    out = key
  elif isinstance(key, (jax.Array, np.ndarray)) and key.dtype == np.uint32 \
      and key.ndim in (1, 2) and key.shape[-1] == 2:
    out = jax.random.wrap_key_data(jnp.asarray(key))
  if out is None or (out.ndim == 1 and out.shape[0] < 1):
    raise ValueError(f"key must be an integer seed, one PRNG key (jax.random.key(seed)) or one"
                     f" key per row (a key array [B]), got {type(key).__name__}"
                     f"{tuple(getattr(key, 'shape', ()))}: under jax.vmap map over a batch of"
                     " keys so each call sees one")
  if out.ndim == 1 and batch_size is not None and out.shape[0] not in (batch_size,
                                                                       batch_size * n):
    per = (f" (or {batch_size * n}, one per sample: {batch_size} prompts, n = {n})"
           if n > 1 else "")
    raise ValueError(f"key holds {out.shape[0]} per-row keys for a batch of {batch_size} rows:"
                     f" give one key (or seed), or exactly one per row{per}")
  return out


def _seed_keys(key) -> jax.Array | None:
  """Per-row keys [B] from per-row integer seeds (a list or tuple of ints, or a signed-integer
  array [B]), or None when `key` is not one: row b's key is fold_in(key(seeds[b]), 0), the key a
  batch of one row draws with under key=seeds[b]."""
  if isinstance(key, (list, tuple)):
    if not key or not all(is_int(s) for s in key):
      raise ValueError(f"key as a list must hold one integer seed per row, got {list(key)[:8]!r}")
    for s in key:
      if not -2**63 <= int(s) < 2**64:
        raise ValueError(f"seeds must be integers in [-2**63, 2**64), got {s}")
    if all(-2**31 <= int(s) < 2**31 for s in key):
      key = np.asarray(key, np.int32)
    else:  # a wide seed: one at a time, as the scalar path makes it
      return jnp.stack([sampling_lib.row_keys(as_key(int(s)), 1)[0] for s in key])
  if not isinstance(key, (jax.Array, np.ndarray)) or key.ndim != 1 \
      or not jnp.issubdtype(key.dtype, jnp.signedinteger):
    return None
  if key.shape[0] < 1:
    raise ValueError("key holds no seeds: give one integer seed per row")
  if isinstance(key, np.ndarray) and ((key < -2**31) | (key >= 2**31)).any():
    return _seed_keys([int(s) for s in key])
  return jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), 0))(jnp.asarray(key,
                                                                                  jnp.int32))


def rollout_keys(key, batch_size: int, n: int) -> jax.Array:
  """The key argument of an n-sample call's [batch_size * n] rows (`as_key` read with n): one
  key (or per-prompt keys [B], or seeds) gives prompt b's key as with n = 1 and its samples
  `jaxspec.sampling.sample_keys` of it; B * n per-row keys are taken as they are."""
  key = as_key(key, batch_size, n)
  if n == 1 or (key.ndim == 1 and key.shape[0] == batch_size * n):
    return key
  return sampling_lib.sample_keys(sampling_lib.row_keys(key, batch_size), n)


def _check_n(n) -> int:
  """n (samples per prompt) as an int >= 1."""
  check_int("n", n, 1, 2**31 - 1, why="samples per prompt: each prompt's row is repeated n"
            " times")
  return int(n)


def _tile(x, n: int):
  return x if n == 1 else jnp.repeat(x, n, axis=0)


def _tile_sampling(sampling, b: int, n: int, vocab_size: int,
                   max_new) -> sampling_lib.SamplingArrays:
  """SamplingArrays for B * n rows from settings for B prompts (each prompt's samples share
  its settings); a logit_bias checked against the vocabulary, min_new_tokens against max_new
  (an int when concrete, else the capacity)."""
  return jax.tree.map(lambda x: _tile(x, n), sampling_lib.sampling_arrays(
      sampling, b, vocab_size, max_new))


def _check_new_tokens(max_new_tokens, capacity) -> tuple[Any, int]:
  """(max_new_tokens as an int32 value, static capacity)."""
  concrete = is_int(max_new_tokens)
  if not concrete:
    if not hasattr(max_new_tokens, "dtype") or getattr(max_new_tokens, "ndim", 1) != 0 \
        or not jnp.issubdtype(max_new_tokens.dtype, jnp.integer):
      shape = tuple(getattr(max_new_tokens, "shape", ()))
      raise ValueError(f"max_new_tokens must be an int or an integer scalar array, got"
                       f" {type(max_new_tokens).__name__}{shape}")
    if _is_concrete(max_new_tokens):
      concrete, max_new_tokens = True, int(max_new_tokens)
  if capacity is None:
    if not concrete:
      raise ValueError("max_new_tokens is traced: pass capacity=N (static, the output width and"
                       " cache size) as its upper bound")
    capacity = max_new_tokens
  if not is_int(capacity) or not 1 <= capacity <= limits.MAX_POSITIONS:
    raise ValueError(f"capacity must be an int in [1, {limits.MAX_POSITIONS}], got {capacity!r}")
  if concrete and not 1 <= max_new_tokens <= capacity:
    raise ValueError(f"max_new_tokens must be in [1, capacity={capacity}], got {max_new_tokens}:"
                     " raise capacity (static) or lower max_new_tokens")
  return jnp.asarray(max_new_tokens, jnp.int32), int(capacity)


def _check_pad_id(pad_id) -> int:
  """pad_id as an int in the int32 range of the output tokens."""
  if not is_int(pad_id) or not -2**31 <= pad_id < 2**31:
    raise ValueError(f"pad_id must be an integer in [-2**31, 2**31) (the token written past each"
                     f" row's length in the int32 output), got {pad_id!r}")
  return int(pad_id)


def _check_drafter_params(drafter: Drafter, dparams) -> None:
  """Raises ValueError unless `dparams` has the structure and leaf shapes of `drafter.params`
  (the weights the drafter's functions index), before anything is traced."""
  drafter.check_params(dparams)
  want = drafter.params
  got_def, want_def = jax.tree.structure(dparams), jax.tree.structure(want)
  if got_def != want_def:
    raise ValueError(f"drafter_params must have the structure of drafter.params (the"
                     f" {drafter.name} drafter's weights): expected {_short(want_def)}, got"
                     f" {_short(got_def)}")
  for (path, w), g in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(dparams)):
    gs, ws = tuple(getattr(g, "shape", ())), tuple(getattr(w, "shape", ()))
    if gs != ws:
      where = jax.tree_util.keystr(path)
      raise ValueError(f"drafter_params{where} has shape {gs} where drafter.params{where} has"
                       f" {ws}: pass weights of the drafter's own shapes")


def _short(treedef, limit: int = 200) -> str:
  s = str(treedef)
  return s if len(s) <= limit else s[:limit] + "..."


def eos_ids_of(target) -> tuple[int, ...]:
  """The end-of-sequence ids a target declares, sorted: a jaxspec `Model`'s (its
  configuration's and its tokenizer's), or the optional `eos_token_ids` of a `CausalLM` (a
  `Target`'s `lm`; jaxspec's Llama declares its configuration's); () where it declares none.
  Decoding stops at them unless given other `stop_ids`."""
  ids: set[int] = set()
  if isinstance(target, protocol.Target):
    target = target.lm
  lm = protocol.as_lm(target)
  cfg = getattr(target, "cfg", None)
  if hasattr(target, "tokenizer") and hasattr(target, "params") and cfg is not None:  # a Model
    ids |= set(getattr(cfg, "eos_token_ids", ()))
    ids |= set(getattr(target.tokenizer, "eos_token_ids", ()) or ())
  else:
    ids |= set(getattr(lm, "eos_token_ids", ()) or ())
  return check_stop_ids(sorted(ids))


def check_stop_ids(stop_ids) -> tuple[int, ...]:
  """Stop ids as a tuple of ints in [0, 2**31) (None: none; one int: that one)."""
  if stop_ids is None:
    return ()
  if isinstance(stop_ids, (int, np.integer)):
    stop_ids = (stop_ids,)
  if isinstance(stop_ids, (str, bytes)) or not isinstance(stop_ids, (Sequence, np.ndarray)):
    raise ValueError(f"stop_ids must be a list of token ids, got {type(stop_ids).__name__}")
  out = []
  for t in stop_ids:
    if not is_int(t) or not 0 <= t < 2**31:
      raise ValueError(f"stop_ids must be token ids in [0, 2**31), got {t!r}")
    out.append(int(t))
  return tuple(out)


def check_logprobs(logprobs, vocab_size: int) -> tuple[bool, int]:
  """(keep log-probabilities?, top-N) from `logprobs`: False or None (none), True (each new
  token's), or an int N in [0, vocab_size] (each new token's and the N most likely tokens at
  its position; 0 is True, as vLLM's logprobs=0)."""
  if logprobs is None or logprobs is False:
    return False, 0
  if logprobs is True:
    return True, 0
  if not is_int(logprobs) or not 0 <= logprobs <= vocab_size:
    raise ValueError(f"logprobs must be True/False or an int N in [0, {vocab_size}] (the top-N"
                     f" tokens per position, at most the vocabulary), got {logprobs!r}")
  return True, int(logprobs)


def _nbytes(tree) -> int:
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def working_set(lm, params, b: int, p: int, max_len: int, *, verify_tokens: int,
                state_bytes: int, drafter=None, dparams=None,
                greedy: bool = False, unfiltered: bool = False) -> limits.WorkingSet:
  """The estimated allocations of one decoding call (`limits.WorkingSet`), from shapes only
  (nothing is compiled or allocated): the target's cache (and the drafter's state, a draft
  model's cache among it), the loop's buffers, the prefill's activations and a step's logits.

  Args:
    lm, params: the target (a `CausalLM`) and its weights (already resident: not counted).
    b, p, max_len: rows, padded prompt width, cache positions.
    verify_tokens: tokens of the widest pass a step runs (1 for plain decoding).
    state_bytes: the loop's own buffers (sequence, outputs, log-probabilities).
    drafter, dparams: the drafter, whose state from `init` is counted with the cache.
    greedy: every row decodes greedily (`SamplingArrays.all_greedy`: smaller steps).
    unfiltered: no row filters (`SamplingArrays.unfiltered`: smaller sampled steps).
  """
  cache = _nbytes(jax.eval_shape(lambda q: protocol.init_cache(lm, q, b, max_len), params))
  if drafter is not None and not drafter.uses_target_hidden:
    prompt = jax.ShapeDtypeStruct((b, p), jnp.int32)
    lens = jax.ShapeDtypeStruct((b,), jnp.int32)
    cache += _nbytes(jax.eval_shape(
        lambda dp, t, n: drafter.init(dp, t, n, max_len, hidden=None), dparams, prompt, lens))
  cfg = getattr(lm, "cfg", None)
  dims = {}
  if cfg is not None and hasattr(cfg, "num_heads"):
    dims = dict(heads=cfg.num_heads, hidden=cfg.hidden_size, ffw=cfg.intermediate_size)
    layers = getattr(params, "layers", None)
    if layers is not None and not isinstance(layers, tuple):  # stacked: a scan slices a copy
      dims["layer_bytes"] = _nbytes(layers) // max(cfg.num_layers, 1)
  return limits.working_set(
      batch=b, prompt_len=p, max_len=max_len, vocab=lm.vocab_size, cache_bytes=cache,
      state_bytes=state_bytes, verify_tokens=verify_tokens,
      prefill_logits_tokens=1 if protocol.is_block_lm(lm) else p, greedy=greedy,
      unfiltered=unfiltered, **dims)


def spec_working_set(tgt: protocol.Target, drafter, dparams, policy, b: int, p: int,
                     capacity: int, max_len: int, *, greedy: bool = False,
                     unfiltered: bool = False) -> limits.WorkingSet:
  """`working_set` of `speculative_decode`'s program: the sequence buffer (max_len + k_max + 1
  positions), its log-probabilities and the outputs; steps verify k_max + 1 tokens (a tree:
  its nodes). greedy, unfiltered: `SamplingArrays.all_greedy`, `.unfiltered` of the call."""
  width = drafter.tree.num_nodes if drafter.tree is not None else policy.k_max + 1
  # int32 tokens, float32 log-probabilities, and top-N ids and log-probabilities
  lp = (2 + 2 * policy.top_logprobs) if policy.logprobs else 1
  state = 4 * lp * b * (max_len + policy.k_max + 1 + 2 * capacity)
  return working_set(tgt.lm, tgt.params, b, p, max_len, verify_tokens=width, state_bytes=state,
                     drafter=drafter, dparams=dparams, greedy=greedy, unfiltered=unfiltered)


def decode_working_set(tgt: protocol.Target, b: int, p: int, capacity: int, max_len: int, *,
                       logprobs: bool, top_logprobs: int = 0) -> limits.WorkingSet:
  """`working_set` of `decode`'s program: its token and log-probability buffers [B, capacity]
  (and top-N [B, capacity, N]; in the loop and as outputs); steps of one token."""
  lp = (2 + 2 * top_logprobs) if logprobs else 1
  return working_set(tgt.lm, tgt.params, b, p, max_len, verify_tokens=1,
                     state_bytes=4 * lp * b * 3 * capacity)


def check_drafter_for(vocab_size: int, drafter) -> None:
  """Raises ValueError unless `drafter` is a `Drafter` proposing ids of a `vocab_size` target."""
  if not isinstance(drafter, Drafter):
    raise ValueError(f"drafter must be a jaxspec Drafter (NGram(), DraftModel(model), a head from"
                     f" load_head, ...), got {type(drafter).__name__}")
  dv = drafter.vocab_size
  if dv is not None and dv != vocab_size:
    raise ValueError(f"draft vocab {dv} != target vocab {vocab_size}: drafts must be target"
                     " token ids (share the target's tokenizer)")


def _check_drafter(target: protocol.Target, drafter) -> None:
  check_drafter_for(target.vocab_size, drafter)
  if drafter.tree is not None and not protocol.is_block_lm(target.lm):
    raise ValueError(f"the {drafter.name} drafter drafts a tree, which needs tree attention"
                     f" from the target ({type(target.lm).__name__} has no forward_block): use"
                     " drafter.with_tree(None)")


def speculative_decode(target, drafter: Drafter, prompt_ids, prompt_lengths, key, *,
                       max_new_tokens, capacity: int | None = None,
                       num_draft_tokens: int | str = 4, auto: AutoK | None = None,
                       cost: CostModel | None = None, sampling=None,
                       stop_ids: Sequence[int] | None = None, max_len: int | None = None,
                       pad_id: int = -1, logprobs: bool | int = True, target_params=None,
                       drafter_params=None, n: int = 1) -> DecodeOutput:
  """Exact speculative decoding as one pure, traceable function.

  Args:
    target: a jaxspec `Model`, a `Target(lm, params)`, or a `CausalLM` with `target_params`.
    drafter: a `Drafter` (NGram(), DraftModel(model), a head from `load_head`, `Oracle`...).
    prompt_ids: [B, P] int token ids, right-padded.
    prompt_lengths: [B] int tokens per row, in [1, P].
    key: one PRNG key (or an int seed), one key per row ([B] key array) or one seed per row
      (a list of ints or an int array [B]); row b's token j is drawn with fold_in(row_key_b,
      j), where one key gives row_key_b = fold_in(key, b), as `decode` and the host wrappers
      draw it (per-row keys let a batch be split without changing any row's draws: pass
      `jaxspec.sampling.row_keys(key, N)[i:j]`), and seed s gives the key a batch of its own
      with key=s draws with, wherever the row sits. With n > 1 these are the prompts' keys
      (`jaxspec.sampling.sample_keys` makes the samples'), or give B * n keys, one per row.
    max_new_tokens: new tokens per row, an int or a traced int scalar <= capacity.
    capacity: static output width and cache budget (default max_new_tokens, which must then be
      an int).
    num_draft_tokens: k drafts per step, or "auto" (k chosen per step among `auto`'s buckets
      from the acceptance model and `cost`, which "auto" requires here: a `CostModel`, e.g.
      a `jaxspec.speculative_generate(...)` run's `stats["cost_model"]`, or
      `CostModel.from_ratios({0: 1.0, 1: 1.3, 2: 1.5, 4: 1.9})` of relative step times).
    sampling: `Sampling` (one value or one per row), `SamplingArrays` ([B] each), or None
      (greedy).
    stop_ids: tokens that end a row (included in its output); default None: the target's EOS
      ids where it declares them (`eos_ids_of`: a jaxspec `Model`'s configuration and
      tokenizer, a `CausalLM`'s optional `eos_token_ids`), as the host wrappers stop; () runs
      every row to max_new_tokens.
    max_len: the target cache's positions; default P + capacity + k_max + 1.
    pad_id: the token written past each row's length in `tokens`; default -1, as the host
      wrappers write (0 is a real token of most vocabularies).
    logprobs: compute `DecodeOutput.logprobs` (costs a log-softmax over the vocabulary per
      verified position); an int N also the N most likely tokens at every new token's position
      and their log-probabilities (`DecodeOutput.top_ids` / `top_logprobs`; a top-N over the
      vocabulary per verified position more).
    target_params / drafter_params: weights to use instead of the target's / `drafter.params`
      (pass them as arguments of your jitted function so they are traced, not constants).
    n: samples per prompt: prompt b's row is repeated n times (rows prompt-major: row
      b * n + i is its sample i), with its sampling settings, in one batch of B * n rows. The
      same program as tiling the rows by hand, and unlike `jax.vmap` over keys no loop branch
      turns into a select that runs both sides. Sample 0 draws as n = 1 does and sample i
      from fold_in(prompt key, i).
  Returns:
    `DecodeOutput` ([B * n] rows).
  Raises:
    ValueError for a bad argument, before anything is traced; and when differentiated
    (`jax.grad`, `jax.jvp`): the loop is not differentiable, `score` the sampled tokens.
  """
  tgt = protocol.as_target(target, target_params)
  n = _check_n(n)
  b, p = _check_prompts(prompt_ids, prompt_lengths, tgt.vocab_size)
  key = rollout_keys(key, b, n)
  max_new, capacity = _check_new_tokens(max_new_tokens, capacity)
  _check_drafter(tgt, drafter)
  keep_lp, top_n = check_logprobs(logprobs, tgt.vocab_size)
  policy = dataclasses.replace(resolve_policy(num_draft_tokens, auto, drafter),
                               logprobs=keep_lp, top_logprobs=top_n)
  if policy.auto and cost is None:
    raise ValueError("num_draft_tokens=\"auto\" inside a trace needs cost=CostModel(...) (the step"
                     " costs it weighs; the host wrapper measures one:"
                     " speculative_generate(...).stats['cost_model']), or"
                     " pass an integer num_draft_tokens")
  if cost is not None and not isinstance(cost, CostModel):
    raise ValueError(f"cost must be a jaxspec CostModel, got {type(cost).__name__}"
                     + (": wrap a dict of step times as CostModel.from_ratios(d), or what"
                        " CostModel.to_dict wrote as CostModel.from_dict(d)"
                        if isinstance(cost, dict) else ""))
  drafter = resolve_coupled(drafter, policy.auto)
  sp = _tile_sampling(sampling, b, n, tgt.vocab_size,
                      max_new if is_int(max_new) else capacity)
  stops = eos_ids_of(target) if stop_ids is None else check_stop_ids(stop_ids)
  pad = _check_pad_id(pad_id)
  if max_len is None:
    max_len = p + capacity + policy.k_max + 1
  elif not is_int(max_len) or max_len < p + capacity + policy.k_max + 1:
    raise ValueError(f"max_len must be an int >= P + capacity + k_max + 1 ="
                     f" {p + capacity + policy.k_max + 1}, got {max_len!r}")
  if drafter_params is None:
    dparams = drafter.params
  else:
    _check_drafter_params(drafter, drafter_params)
    dparams = drafter_params
  limits.check_positions(int(max_len))
  ws = spec_working_set(tgt, drafter, dparams, policy, b * n, p, capacity, int(max_len),
                        greedy=sp.all_greedy, unfiltered=sp.unfiltered)
  limits.check_working_set(ws, b * n, int(max_len), "speculative decoding of")
  costs = costs_array(policy, cost if policy.auto else None)
  run = _not_differentiable(functools.partial(
      _speculative_jit, drafter=drafter, policy=policy, capacity=capacity, max_len=int(max_len),
      stop_ids=stops, pad_id=pad), "speculative_decode")
  return run(tgt, dparams, _tile(jnp.asarray(prompt_ids, jnp.int32), n),
             _tile(jnp.asarray(prompt_lengths, jnp.int32), n), key, max_new, sp, costs)


def _not_differentiable(fn, name: str):
  """`fn` whose derivative rule raises a ValueError naming `score`, instead of JAX's
  reverse-mode `while_loop` error (whose "use lax.scan" hint does not apply to a loop of
  data-dependent length). The rule runs only when some argument carries a tangent (params
  passed through `jax.lax.stop_gradient` do not), at trace time, before anything compiles."""
  @jax.custom_jvp
  def run(*args):
    return fn(*args)

  @run.defjvp
  def _(primals, tangents):
    del primals, tangents
    raise ValueError(
        f"{name} cannot be differentiated (jax.grad, jax.jvp): its tokens are discrete and its"
        " lax.while_loop has no reverse-mode derivative. Sample outside the differentiated"
        " function (or pass jax.lax.stop_gradient(params) to it), then differentiate"
        " jaxspec.decoding.score(target, tokens, lengths, sampling=..., prompt_lengths=...) of"
        " the sampled tokens (jaxspec.decoding.join_tokens builds them): the loop's"
        " log-probabilities, teacher-forced, with gradients")

  return run


@functools.partial(jax.jit, static_argnames=("drafter", "policy", "capacity", "max_len",
                                             "stop_ids", "pad_id"))
def _speculative_jit(target, dparams, prompt, lengths, key, max_new, sp, costs, *, drafter,
                     policy, capacity, max_len, stop_ids, pad_id):
  max_new = jnp.clip(max_new, 1, capacity)
  # Built inside the trace (max_new_tokens is traced here): the jit's static arguments are the
  # pieces above, and this config is never hashed.
  cfg = StepConfig(lm=target.lm, drafter=drafter, policy=policy, max_new_tokens=max_new,
                   stop_ids=stop_ids, max_len=max_len, max_steps=capacity + 1)
  s = loop.spec_init(target.params, dparams, prompt, lengths, sp, key, cfg=cfg)
  s = loop.spec_loop(target.params, dparams, s, sp, costs, max_new + 1, jnp.int32(-1), cfg=cfg)
  toks, n_out, lp, top_ids, top_lp = loop.outputs(s, capacity)
  dstate = s.draft_state.inner if cfg.defers else s.draft_state
  nxt = drafter.next_params(dparams, dstate, DraftContext(
      seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len))
  return DecodeOutput(tokens=jnp.where(toks < 0, pad_id, toks), lengths=n_out,
                      logprobs=lp, target_passes=s.stats.target_passes,
                      stats=s.stats, drafter_params=nxt, top_ids=top_ids, top_logprobs=top_lp)


def decode(target, prompt_ids, prompt_lengths, key, *, max_new_tokens,
           capacity: int | None = None, sampling=None, stop_ids: Sequence[int] | None = None,
           max_len: int | None = None, pad_id: int = -1, logprobs: bool | int = True,
           target_params=None, n: int = 1) -> DecodeOutput:
  """Plain autoregressive decoding as one pure, traceable function: `speculative_decode`'s
  arguments without the drafter (max_len default P + capacity), `n` samples per prompt
  included."""
  tgt = protocol.as_target(target, target_params)
  n = _check_n(n)
  b, p = _check_prompts(prompt_ids, prompt_lengths, tgt.vocab_size)
  key = rollout_keys(key, b, n)
  max_new, capacity = _check_new_tokens(max_new_tokens, capacity)
  sp = _tile_sampling(sampling, b, n, tgt.vocab_size,
                      max_new if is_int(max_new) else capacity)
  stops = eos_ids_of(target) if stop_ids is None else check_stop_ids(stop_ids)
  pad = _check_pad_id(pad_id)
  keep_lp, top_n = check_logprobs(logprobs, tgt.vocab_size)
  if max_len is None:
    max_len = p + capacity
  elif not is_int(max_len) or max_len < p + capacity:
    raise ValueError(f"max_len must be an int >= P + capacity = {p + capacity}, got"
                     f" {max_len!r}")
  limits.check_positions(int(max_len))
  ws = decode_working_set(tgt, b * n, p, capacity, int(max_len), logprobs=keep_lp,
                          top_logprobs=top_n)
  limits.check_working_set(ws, b * n, int(max_len), "decoding")
  run = _not_differentiable(functools.partial(
      _decode_jit, capacity=capacity, max_len=int(max_len), stop_ids=stops, pad_id=pad,
      logprobs=keep_lp, top_logprobs=top_n), "decode")
  return run(tgt, _tile(jnp.asarray(prompt_ids, jnp.int32), n),
             _tile(jnp.asarray(prompt_lengths, jnp.int32), n), key, max_new, sp)


@functools.partial(jax.jit, static_argnames=("capacity", "max_len", "stop_ids", "pad_id",
                                             "logprobs", "top_logprobs"))
def _decode_jit(target, prompt, lengths, key, max_new, sp, *, capacity, max_len, stop_ids,
                pad_id, logprobs, top_logprobs):
  max_new = jnp.clip(max_new, 1, capacity)
  s = plain.init_decode(target.params, prompt, lengths, sp, key, target.lm, max_len, max_new,
                        stop_ids, capacity=capacity, logprobs=logprobs,
                        top_logprobs=top_logprobs)
  s = plain.decode_loop(target.params, s, sp, max_new, target.lm, max_new, stop_ids)
  valid = jnp.arange(capacity)[None, :] < s.n_out[:, None]
  lp = None if s.logprobs is None else jnp.where(valid, s.logprobs, 0.0)
  top_ids = top_lp = None
  if s.top_ids is not None:
    top_ids = jnp.where(valid[:, :, None], s.top_ids, -1)
    top_lp = jnp.where(valid[:, :, None], s.top_lp, 0.0)
  return DecodeOutput(tokens=jnp.where(valid, s.tokens, pad_id), lengths=s.n_out, logprobs=lp,
                      target_passes=s.steps, top_ids=top_ids, top_logprobs=top_lp)
