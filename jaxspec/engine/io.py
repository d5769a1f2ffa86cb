"""A call's data on the host: its arguments checked (ValueError, naming the fix, before anything
compiles), prompts padded and the cache sized (`prepare_prompts`), a speculative call gathered
into one `SpecRequest`; arrays placed on a mesh (`put_global`) and brought back to numpy
(`to_host`), tokens decoded to text. Nothing here keeps state between calls.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checks import check_int, is_int
from jaxspec.decoding import limits
from jaxspec.decoding.adaptive import CostModel
from jaxspec.decoding.drafter import Drafter, resolve_coupled
from jaxspec.decoding.functional import (check_drafter_for, check_logprobs, check_stop_ids,
                                         eos_ids_of, rollout_keys, working_set)
from jaxspec.decoding.limits import MAX_POSITIONS
from jaxspec.decoding.loop import Policy, resolve_policy
from jaxspec.decoding.protocol import Target, as_lm, as_target
from jaxspec.drafters import resolve_drafter
from jaxspec.drafters.resolve import SUFFIX_NAMES
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling, resolve_sampling


def round_up(n: int, m: int) -> int:
  return -(-n // m) * m


def bucket_rows(n: int, multiple: int = 1) -> int:
  """The rows a batch of `n` prompts is padded to in the host wrappers: the next power of two up
  to 8, then the next multiple of 8 (pad rows cost compute every step, so large batches grow by
  less than a power of two), rounded up to `multiple` (a sharded batch axis); `n` itself when
  it is not a multiple of `multiple` (the mesh check then names the problem)."""
  if n % multiple:
    return n
  b = 1 << (n - 1).bit_length() if n <= 8 else round_up(n, 8)
  return round_up(b, multiple)


def bucket_new_tokens(n: int) -> int:
  """The output width (static) a call of `n` new tokens is compiled for, the true count being a
  traced value below it: 16, then powers of two up to 256, then multiples of 256."""
  return max(16, 1 << (n - 1).bit_length()) if n <= 256 else round_up(n, 256)


@dataclasses.dataclass(frozen=True)
class PreparedPrompts:
  tokens: np.ndarray  # [B, P] int32, right-padded with 0; rows past `rows` are pad rows
  lengths: np.ndarray  # [B] int32
  max_len: int
  n: int = 1  # samples per prompt: prompt b's row repeated n times (rows b * n .. b * n + n - 1)
  # The caller's rows (prompts x n, prompt-major): the rest of B are copies of row 0 that
  # generate nothing (budget 0, `row_budgets`), there so that batch sizes share a compiled
  # program (`bucket_rows`).
  rows: int = 0
  capacity: int = 0  # the output width the programs are compiled for, >= max_new_tokens

  def row_budgets(self, max_new_tokens: int) -> np.ndarray:
    """[B] int32 new tokens per row: `max_new_tokens` for the caller's rows, 0 for pad rows."""
    b = self.tokens.shape[0]
    return np.where(np.arange(b) < self.rows, max_new_tokens, 0).astype(np.int32)


def pad_rows(tree, rows: int):
  """Every array of `tree` with its first axis padded to `rows` with copies of its row 0 (the
  sampling values and per-row keys of pad rows, which only need to be valid); a scalar (one
  key for all rows) as it is."""
  def one(x):
    if getattr(x, "ndim", 0) == 0 or x.shape[0] == rows:
      return x
    return jnp.concatenate([x, jnp.repeat(x[:1], rows - x.shape[0], axis=0)])
  return jax.tree.map(one, tree)


def as_host_target(model) -> Target:
  """`Target(lm, params)` of what a host wrapper was given: a jaxspec `Model` (its Llama and
  weights) or a `Target` binding any `CausalLM` to its weights. Raises ValueError otherwise."""
  if isinstance(model, Model):
    return Target(as_lm(model.program_cfg()), model.params)
  if isinstance(model, Target):
    return as_target(model)
  hint = (": bind it to its weights, Target(lm, params)" if hasattr(model, "forward")
          and hasattr(model, "init_cache") else "")
  raise ValueError(f"the model must be a jaxspec Model (jaxspec.load(path) or Model(cfg, params))"
                   f" or a jaxspec.decoding.Target(lm, params) of your own CausalLM, got"
                   f" {type(model).__name__}{hint}")


def sharding_of(target):
  """The `ModelSharding` of a jaxspec Model laid out on a mesh; None otherwise (an own model's
  weights stay where the caller put them)."""
  return getattr(target, "sharding", None) if isinstance(target, Model) else None


def tokenizer_of(model, tokenizer=None):
  """The tokenizer a host call encodes strings and decodes texts with: `tokenizer` when given
  (checked: it needs `encode` and `decode`), else a jaxspec Model's own; None for an own model
  without one."""
  if tokenizer is not None:
    missing = [m for m in ("encode", "decode") if not callable(getattr(tokenizer, m, None))]
    if missing:
      raise ValueError(f"tokenizer= must have encode(text) -> token ids and decode(ids) -> text"
                       f" (a jaxspec or Hugging Face tokenizer), got {type(tokenizer).__name__}"
                       f" without {' and '.join(missing)}")
    return tokenizer
  return model.tokenizer if isinstance(model, Model) else None


def has_chat_template(tok) -> bool:
  """Whether `tok` renders a chat template: jaxspec's (`encode_chat`) or Hugging Face's
  (`apply_chat_template`), with a template set."""
  return getattr(tok, "chat_template", None) is not None and (
      hasattr(tok, "encode_chat") or hasattr(tok, "apply_chat_template"))


def _ids(encoded) -> list[int]:
  """Token ids from what a tokenizer's encode returns: a list, or an object with `.ids` (the
  `tokenizers` library's Encoding)."""
  return list(getattr(encoded, "ids", encoded))


def encode_text(tok, text: str, chat: bool | None) -> list[int]:
  """A string prompt's ids: through the chat template as one user message (chat=None where the
  tokenizer has a template, as the CLI does; chat=True requires one), or the text as it is
  (chat=False)."""
  template = has_chat_template(tok)
  if chat is True and not template:
    raise ValueError("chat=True renders the chat template, but the tokenizer has none: pass"
                     " chat=False to encode the text as it is")
  if chat is False or not template:
    return _ids(tok.encode(text))
  if hasattr(tok, "encode_chat"):  # jaxspec's Tokenizer
    return _ids(tok.encode_chat(text))
  # A Hugging Face tokenizer: the rendered template carries its own special tokens.
  rendered = tok.apply_chat_template([{"role": "user", "content": text}],
                                     add_generation_prompt=True, tokenize=False)
  return _ids(tok.encode(rendered, add_special_tokens=False))


def prepare_prompts(model, prompts, max_new_tokens: int, *, extra: int = 0,
                    max_len: int | None = None, held: int = 0, tokenizer=None,
                    chat: bool | None = None, prompt_lengths=None, n: int = 1,
                    bucket: bool = False, rows_multiple: int = 1) -> PreparedPrompts:
  """Validates and pads prompts; sizes the cache. Raises ValueError before anything compiles.

  Args:
    model: a jaxspec `Model` or a `Target(lm, params)` (`as_host_target`).
    prompts: a string, a list of strings (encoded with the tokenizer: `encode_text`), a list of
      token-id lists, or an integer array ([P] one prompt, [B, P] a batch).
    max_new_tokens: new tokens per row.
    extra: cache slots needed beyond prompt + max_new_tokens (speculative verification writes
      up to k + 1 positions ahead).
    max_len: cache size; by default the padded prompt length plus what decoding needs, rounded
      up to a multiple of 128.
    held: bytes of buffers the run reuses or frees (`check_cache_fits`).
    tokenizer, chat: see `tokenizer_of` and `encode_text`.
    prompt_lengths: [B] tokens of each token-id prompt (the rest of its row is padding).
    n: samples per prompt; each prompt's row is repeated n times, prompt-major.
    bucket: pad the batch to `bucket_rows(B, rows_multiple)` rows and size the output and the
      default cache for `bucket_new_tokens(max_new_tokens)`, so that nearby batch sizes and
      lengths share one compiled program; where the padded batch does not fit in memory, the
      exact sizes are used.
  """
  tgt = as_host_target(model)
  tok = tokenizer_of(model, tokenizer)
  if chat is not None and not isinstance(chat, bool):
    raise ValueError(f"chat must be None (the chat template where the tokenizer has one), True or"
                     f" False, got {chat!r}")
  check_int("n", n, 1, 2**31 - 1, why="samples per prompt: each prompt's row is repeated n"
            " times")
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
                       f" [B, P] for a batch (every column a token unless prompt_lengths says"
                       f" otherwise), got {arr.dtype}{arr.shape}")
    prompts = [arr.tolist()] if arr.ndim == 1 else [list(r) for r in arr.tolist()]
  if not isinstance(prompts, Sequence) or len(prompts) == 0:
    raise ValueError("prompts must be a string, a non-empty list of strings or of token-id"
                     " lists, or an integer array of token ids ([P] or [B, P])")
  keep = None if prompt_lengths is None else _check_prompt_lengths(prompt_lengths, prompts)
  rows, vocab = [], tgt.lm.vocab_size
  for i, p in enumerate(prompts):
    if isinstance(p, str):
      if tok is None:
        raise ValueError(f"prompt {i} is a string but there is no tokenizer: pass token ids, or"
                         " tokenizer= (anything with encode(text) -> ids and decode(ids) ->"
                         " text, such as a Hugging Face tokenizer)")
      p = encode_text(tok, p, chat)
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
    if keep is not None:
      if keep[i] > len(p):
        raise ValueError(f"prompt_lengths[{i}] = {keep[i]} is longer than prompt {i}'s"
                         f" {len(p)} tokens: each length counts the row's real tokens")
      p = p[: keep[i]]
    bad = [t for t in p if not 0 <= t < vocab]
    if bad:
      raise ValueError(f"prompt {i} has token id {bad[0]} outside the vocabulary [0, {vocab})")
    rows.append(p)
  longest = max(len(p) for p in rows)
  padded_len = round_up(longest, 64)  # coarse buckets: fewer compilations across prompts
  n_rows, capacity = len(rows) * n, int(max_new_tokens)
  if bucket:
    n_rows, capacity = bucket_rows(n_rows, rows_multiple), bucket_new_tokens(capacity)
  given_max_len = max_len
  need = longest + capacity + extra
  if max_len is None:
    max_len = round_up(max(need, padded_len), 128)
  elif longest > max_len - max_new_tokens - extra:
    raise ValueError(
        f"a prompt of {longest} tokens does not fit: max_len {max_len} - max_new_tokens"
        f" {max_new_tokens}{f' - {extra} speculative slots' if extra else ''} leaves"
        f" {max_len - max_new_tokens - extra}; shorten the prompt, lower max_new_tokens or raise"
        " max_len")
  padded_len = min(padded_len, max_len)
  base = rows
  rows = [p for p in rows for _ in range(n)]  # prompt-major: the n samples of a prompt together
  try:
    check_cache_fits(tgt, n_rows, int(max_len), prompt_len=padded_len,
                     verify_tokens=max(extra, 1), held=held)
  except ValueError:
    if not bucket or (n_rows, capacity) == (len(rows), max_new_tokens):
      raise
    return prepare_prompts(model, base, max_new_tokens, extra=extra, max_len=given_max_len,
                           held=held, n=n)
  toks = np.zeros((n_rows, padded_len), np.int32)
  for i, p in enumerate(rows + [rows[0]] * (n_rows - len(rows))):
    toks[i, : len(p)] = p
  lengths = np.array([len(p) for p in rows] + [len(rows[0])] * (n_rows - len(rows)), np.int32)
  return PreparedPrompts(toks, lengths, int(max_len), int(n), rows=len(rows), capacity=capacity)


def _check_prompt_lengths(prompt_lengths, prompts) -> list[int]:
  """prompt_lengths (given) as a list of ints, one per prompt, each >= 1."""
  if any(isinstance(p, str) for p in prompts):
    raise ValueError("prompt_lengths goes with token-id prompts (a padded [B, P] array or lists"
                     " of ids): a string's length is what it encodes to; drop prompt_lengths")
  if isinstance(prompt_lengths, jax.core.Tracer):
    raise ValueError("prompt_lengths is traced: the host wrappers take concrete lengths")
  arr = np.asarray(prompt_lengths) if not is_int(prompt_lengths) else None
  if arr is None or arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
    raise ValueError(f"prompt_lengths must be one integer per prompt ([B], a list or an array),"
                     f" got {type(prompt_lengths).__name__}"
                     f"{tuple(getattr(prompt_lengths, 'shape', ()))}")
  if arr.shape[0] != len(prompts):
    raise ValueError(f"prompt_lengths has {arr.shape[0]} lengths for {len(prompts)} prompts: give"
                     " one per prompt")
  if arr.min() < 1:
    raise ValueError(f"prompt_lengths must be >= 1 (every row needs a token to condition on),"
                     f" got {int(arr.min())}")
  return [int(x) for x in arr]


def stop_ids_for(model, stop_ids: Sequence[int] | None) -> tuple[int, ...]:
  """Stop ids as given, or (None) the target's EOS ids, as the functional API's default
  (`jaxspec.decoding.functional.eos_ids_of`)."""
  if stop_ids is None:
    return eos_ids_of(model)
  if isinstance(stop_ids, (int, np.integer)):
    raise ValueError(f"stop_ids must be a list of token ids, got {type(stop_ids).__name__}")
  return check_stop_ids(stop_ids)


def sampling_rows(sp: Sampling, prep: PreparedPrompts, vocab_size: int | None = None,
                  max_new_tokens=None):
  """`SamplingArrays` for the prepared rows: one value, or one per prompt (each prompt's n
  samples share its settings); vocab_size and max_new_tokens as `Sampling.arrays` takes them."""
  b = prep.rows // prep.n
  arrays = sp.arrays(b, vocab_size, max_new_tokens)
  if prep.n == 1:
    return arrays
  return jax.tree.map(lambda x: jnp.repeat(x, prep.n, axis=0), arrays)


def key_rows(key, prep: PreparedPrompts):
  """The key argument for the prepared rows: as given for n = 1 (`as_key` reads it), else the
  [B * n] sample keys `decode(..., n=n)` draws with (`rollout_keys`)."""
  if prep.n == 1:
    return key
  return rollout_keys(key, prep.rows // prep.n, prep.n)


def check_cache_fits(tgt: Target, batch: int, max_len: int, *, prompt_len: int = 1,
                     verify_tokens: int = 1, held: int = 0) -> None:
  """Raises ValueError (before anything compiles) when a run of `batch` rows with a [batch,
  max_len] KV cache cannot be held: past `MAX_POSITIONS` positions, or its estimated working
  set (`decoding.functional.working_set`: the cache, the loop's buffers, and the larger of the
  prefill's activations over `prompt_len` padded tokens and a step's logits over
  `verify_tokens`) larger than the device's free memory plus `held` (the bytes of the engine's
  kept cache buffers, which the run reuses or frees). `tgt`: the checked `Target` of the call's
  model (`as_host_target`)."""
  limits.check_positions(max_len)
  ws = working_set(tgt.lm, tgt.params, batch, prompt_len, max_len,
                   verify_tokens=verify_tokens,
                   state_bytes=4 * 2 * batch * (max_len + verify_tokens + 2 * max_len))
  limits.check_working_set(ws, batch, max_len, "generating", held=held)


def check_prompt_logprobs(prompt_logprobs) -> bool:
  """`prompt_logprobs` is True or False: each prompt token's log-probability or none (vLLM's
  top-N of prompt tokens is not implemented, so an int is refused rather than read as True)."""
  if not isinstance(prompt_logprobs, (bool, np.bool_)):
    raise ValueError(f"prompt_logprobs must be True or False (each prompt token's"
                     f" log-probability; a top-N of prompt tokens is not implemented), got"
                     f" {prompt_logprobs!r}")
  return bool(prompt_logprobs)


def check_chunk(chunk) -> int:
  """A stream's chunk: an integer >= 1 (0 would never advance)."""
  check_int("chunk", chunk, 1, why="steps between yields")
  return int(chunk)


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


def check_drafter(target, drafter: Drafter) -> None:
  """Raises ValueError for a drafter that cannot serve this target (a `Model` or `Target`)."""
  draft = getattr(drafter, "model", None)
  if isinstance(draft, Model) and isinstance(target, Model):
    check_draft_vocabulary(target, draft)
  check_drafter_for(as_host_target(target).lm.vocab_size, drafter)
  dparams = drafter.params
  if dparams is not None and sharding_of(target) is None:  # a sharded target gets them copied
    tdev = devices_of(target.params)
    ddev = devices_of(dparams)
    if tdev and ddev and tdev != ddev:
      raise ValueError(
          f"the drafter's weights are on {sorted(map(str, ddev))} but the target's are on"
          f" {sorted(map(str, tdev))}: move both to the same devices (jax.device_put) for the"
          " fused loop, or give them separate meshes with a Placement")


def devices_of(tree) -> set:
  """The devices a pytree's arrays are on (empty without any)."""
  out = set()
  for leaf in jax.tree.leaves(tree):
    if isinstance(leaf, jax.Array):
      out |= set(leaf.devices())
  return out


@dataclasses.dataclass(frozen=True)
class SpecRequest:
  """A checked speculative call, before anything compiles: what its run is built from."""

  target: Model | Target  # as given: a jaxspec Model, or a Target of an own CausalLM
  lm: Any  # the target's CausalLM (static in the compiled loop)
  tokenizer: Any  # what texts are decoded with; None: no texts
  drafter: Drafter  # resolved by name; coupled under "auto" where it samples its drafts
  sampling: Sampling  # one value or one per prompt (its n rows share it: `sampling_rows`)
  policy: Policy
  prep: PreparedPrompts
  stop_ids: tuple[int, ...]
  max_new_tokens: int
  key: Any  # as given: None, an integer seed, a key or one key per row (`as_key`)
  cost: CostModel | None  # given by the caller; None measures it under "auto"


def prepare_spec(target, drafter, prompts, *, max_new_tokens: int, num_draft_tokens,
                 sampling: Sampling | None = None, temperature: float | None = None,
                 auto=None, cost: CostModel | None = None, max_len: int | None = None,
                 stop_ids: Sequence[int] | None = None, key=None,
                 logprobs: bool | int = False, held: int = 0, tokenizer=None,
                 chat: bool | None = None, prompt_lengths=None, n: int = 1,
                 bucket: bool = False) -> SpecRequest:
  """Everything a speculative call checks before compiling (the arguments of
  `speculative_generate`), the drafter resolved by name; `bucket` as `prepare_prompts`'s."""
  tgt = as_host_target(target)
  if not isinstance(target, Model) and isinstance(drafter, str) \
      and drafter != "ngram" and drafter not in SUFFIX_NAMES:
    raise ValueError(
        f"the drafter {drafter!r} is built from a jaxspec Model (a bundled or saved head reads"
        " its hidden states and weights; a draft model's path is loaded in its dtype): with your"
        " own model pass \"ngram\", \"suffix\", \"suffix-sampled\", \"suffix-tree\" or a"
        " Drafter: NGram(), SuffixDecoding(vocab=...), DraftModel(Target(draft_lm, draft_params))")
  drafter = resolve_drafter(tgt if not isinstance(target, Model) else target, drafter)
  if temperature is not None:
    sampling = dataclasses.replace(resolve_sampling(sampling), temperature=temperature)
  sp_user = resolve_sampling(sampling)
  check_drafter(target, drafter)
  keep_lp, top_n = check_logprobs(logprobs, tgt.lm.vocab_size)
  policy = dataclasses.replace(resolve_policy(num_draft_tokens, auto, drafter),
                               logprobs=keep_lp, top_logprobs=top_n)
  # A drafter that samples its drafts is coupled with the target's draws under "auto" (unless
  # it says otherwise), so a timed k schedule cannot change the text.
  drafter = resolve_coupled(drafter, policy.auto)
  if cost is not None and not isinstance(cost, CostModel):
    raise ValueError(f"cost must be a jaxspec CostModel, got {type(cost).__name__}"
                     + (": wrap a dict of step times as CostModel.from_ratios(d), or what"
                        " CostModel.to_dict wrote as CostModel.from_dict(d)"
                        if isinstance(cost, dict) else ""))
  if cost is not None and not policy.auto:
    fixed = ("by the drafter's tree" if getattr(drafter, "tree", None) is not None
             else f"num_draft_tokens={num_draft_tokens}")
    raise ValueError(f"cost= is what num_draft_tokens=\"auto\" weighs to choose k, but k is"
                     f" fixed ({fixed}): pass num_draft_tokens=\"auto\" or drop cost=")
  try:
    sh = sharding_of(target)
    prep = prepare_prompts(target, prompts, max_new_tokens, extra=policy.k_max + 1,
                           max_len=max_len, held=held, tokenizer=tokenizer, chat=chat,
                           prompt_lengths=prompt_lengths, n=n, bucket=bucket,
                           rows_multiple=1 if sh is None else sh.data_size)
  except ValueError as e:
    if policy.auto and "does not fit" in str(e):
      raise ValueError(f"{e} (with num_draft_tokens=\"auto\" the cache also holds k_max ="
                       f" {policy.k_max} drafts: lower AutoK(k_max=...))") from None
    raise
  if prep.n > 1:  # one value, or one per prompt (checked here; `sampling_rows` repeats them)
    sp_user.arrays(prep.rows // prep.n, tgt.lm.vocab_size, max_new_tokens)
  return SpecRequest(target=target, lm=tgt.lm, tokenizer=tokenizer_of(target, tokenizer),
                     drafter=drafter, sampling=sp_user, policy=policy, prep=prep,
                     stop_ids=stop_ids_for(target, stop_ids), max_new_tokens=int(max_new_tokens),
                     key=key_rows(key, prep), cost=cost)


def decode_text(tok, ids: list[int]) -> str:
  """The text of `ids` as outputs show it: special tokens (a stop token among them) skipped
  where the tokenizer `tok`'s decode can skip them. Stop strings are matched in this text."""
  kw = dict(skip_special_tokens=True) if _takes(tok.decode, "skip_special_tokens") else {}
  return tok.decode(ids, **kw)


def decode_texts(tok, tokens: np.ndarray, lengths: np.ndarray) -> list[str]:
  """Each row's new text (`decode_text`)."""
  return [decode_text(tok, tokens[b, : lengths[b]].tolist()) for b in range(len(lengths))]


def _takes(fn, name: str) -> bool:
  """Whether `fn` accepts the keyword `name` (Hugging Face's decode keeps special tokens unless
  told to skip them; a plain decode(ids) takes no keywords)."""
  try:
    params = inspect.signature(fn).parameters
  except (TypeError, ValueError):  # a builtin without a signature
    return False
  return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


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
