"""Teacher-forced scoring: the log-probabilities the decoding loop assigns, with gradients.

    out = decode(Target(lm, params), prompt_ids, prompt_lengths, key, max_new_tokens=32,
                 sampling=sp, n=8)
    tokens, lengths = join_tokens(jnp.repeat(prompt_ids, 8, 0), jnp.repeat(prompt_lengths, 8),
                                  out.tokens, out.lengths)
    lp = score(Target(lm, params), tokens, lengths, sampling=sp,
               prompt_lengths=jnp.repeat(prompt_lengths, 8))      # [B, T], differentiable

`decode` and `speculative_decode` run a `lax.while_loop`, which reverse-mode autodiff cannot
go through; an RL or likelihood objective scores the sampled tokens again, teacher-forced, in
one forward pass over each whole sequence, and differentiates that. `score` applies the
loop's processing (`jaxspec.sampling.adjust`: logit bias, min_new_tokens and the penalties,
each position with the context before it; then `jaxspec.sampling.token_logprobs`:
temperature, top-k, top-p, min-p; greedy rows unscaled), so its values equal the loop's
`logprobs` up to float rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import sampling as sampling_lib
from jaxspec.decoding import protocol
from jaxspec.decoding.functional import _is_concrete, check_stop_ids, first_out_of_vocabulary


def _check_rows(name: str, x, b: int | None, nd: int, what: str):
  if not hasattr(x, "shape") or not hasattr(x, "dtype"):
    raise ValueError(f"{name} must be an array ({what}), got {type(x).__name__}: pass"
                     " jnp.asarray(..., jnp.int32)")
  if x.ndim != nd:
    raise ValueError(f"{name} must be {what} (rank {nd}), got shape {tuple(x.shape)}")
  if not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must hold integers, got dtype {x.dtype}: use .astype(jnp.int32)")
  if b is not None and x.shape[0] != b:
    raise ValueError(f"{name} has {x.shape[0]} rows, tokens {b}: one value per row")


def check_score_args(tokens, lengths, prompt_lengths, vocab_size: int) -> tuple[int, int]:
  """(B, T) after checking ranks and dtypes, and values where they are concrete: lengths in
  [1, T], prompt_lengths in [1, lengths], token ids below each row's length in the
  vocabulary. Raises ValueError naming the argument."""
  _check_rows("tokens", tokens, None, 2, "[B, T] token ids, right-padded")
  b, t = map(int, tokens.shape)
  if b < 1 or t < 1:
    raise ValueError(f"tokens must have at least one row and one column, got {(b, t)}")
  _check_rows("lengths", lengths, b, 1, "[B] tokens per row")
  if prompt_lengths is not None:
    _check_rows("prompt_lengths", prompt_lengths, b, 1, "[B] prompt tokens per row")
  if not _is_concrete(lengths):
    return b, t
  lens = np.asarray(lengths)
  if lens.min() < 1 or lens.max() > t:
    raise ValueError(f"lengths must be in [1, {t}] (the padded width of tokens), got min"
                     f" {lens.min()} and max {lens.max()}")
  if prompt_lengths is not None and _is_concrete(prompt_lengths):
    pl = np.asarray(prompt_lengths)
    bad = (pl < 1) | (pl > lens)
    if bad.any():
      r = int(np.argmax(bad))
      raise ValueError(f"prompt_lengths must be in [1, lengths] (a row's first scored token"
                       f" follows its prompt), got {pl[r]} for row {r} of length {lens[r]}")
  if _is_concrete(tokens):
    hit = first_out_of_vocabulary(tokens, lens, vocab_size)
    if hit is not None:
      r, c, tok = hit
      raise ValueError(f"tokens row {r} has id {tok} at position {c} (below its length"
                       f" {lens[r]}), outside the target's vocabulary [0, {vocab_size})")
  return b, t


def score(target, tokens, lengths, *, sampling=None, prompt_lengths=None,
          target_params=None, stop_ids=None) -> jax.Array:
  """The log-probability the decoding loop assigns to each token of `tokens`, teacher-forced.

  One forward pass over each whole sequence (two for a model whose rotary scaling depends on
  the sequence length, "dynamic" and "longrope": the prompt as the loop's prefill rotates it,
  then the rest on top, as the loop decodes it). Position t of row b holds
  log p(tokens[b, t] | tokens[b, :t]) under `sampling`'s processing, exactly what `decode` and
  `speculative_decode` report in `logprobs` for a token they emitted there (`log_softmax` of the
  processed logits: logit bias, min_new_tokens and penalties, then temperature, top-k, top-p
  and min-p; greedy rows unscaled). A token the filters drop scores -inf. The penalties count
  the tokens from prompt_lengths on as generated (the prompt's count only for
  repetition_penalty), as the loop does: pass the loop's prompt lengths.

  Differentiable with respect to the target's weights (and the sampling temperatures): call it
  inside `jax.grad` with a `Target(lm, params)` built from the traced params, or pass them as
  `target_params`. The filters' keep-masks carry no gradient (they are comparisons).

  Args:
    target: a jaxspec `Model`, a `Target(lm, params)`, or a `CausalLM` with `target_params`.
    tokens: [B, T] int token ids: each row's prompt, then its continuation, right-padded (what
      `join_tokens` builds from a prompt batch and a `DecodeOutput`).
    lengths: [B] int tokens per row (prompt + continuation), in [1, T].
    sampling: `Sampling` (one value or one per row), `SamplingArrays` ([B] each), or None
      (greedy), as given to the loop.
    prompt_lengths: [B] int, in [1, lengths]: position t of row b is scored when
      prompt_lengths[b] <= t < lengths[b]. Default 1 (every token after the first).
    target_params: weights to use instead of the target's.
    stop_ids: the loop's stop ids: the ones `Sampling.min_new_tokens` holds back (default
      none; needed only with min_new_tokens).
  Returns:
    [B, T] float32: the scored positions' log-probabilities, 0 at every other position (the
    prompt, the first token, padding), so `.sum(axis=1)` is each continuation's log-probability.
  """
  tgt = protocol.as_target(target, target_params)
  b, t = check_score_args(tokens, lengths, prompt_lengths, tgt.vocab_size)
  sp = sampling_lib.sampling_arrays(sampling, b, tgt.vocab_size)
  stops = check_stop_ids(stop_ids)
  lengths = jnp.asarray(lengths, jnp.int32)
  if prompt_lengths is None:
    prompt_lengths = jnp.ones((b,), jnp.int32)
  return _score_jit(tgt, jnp.asarray(tokens, jnp.int32), lengths,
                    jnp.asarray(prompt_lengths, jnp.int32), sp,
                    two_pass=_length_dependent_rotary(tgt.lm), stop_ids=stops)


def _length_dependent_rotary(lm) -> bool:
  """Whether `lm` (a block model, jaxspec's Llama) rotates a prefill by its length ("dynamic",
  "longrope"): one pass over prompt + continuation would rotate the continuation's keys as a
  prefill, not as the loop decodes them. Read from the model's config by duck typing (decoding
  imports nothing from the models)."""
  if not protocol.is_block_lm(lm):
    return False
  s = getattr(getattr(lm, "cfg", None), "rope_scaling", None)
  return getattr(s, "rope_type", None) in ("dynamic", "longrope")


@functools.partial(jax.jit, static_argnames=("two_pass", "stop_ids"))
def _score_jit(target, tokens, lengths, prompt_lengths, sp, *, two_pass, stop_ids=()):
  lm, params = target.lm, target.params
  b, t = tokens.shape
  cols = jnp.arange(t, dtype=jnp.int32)[None, :]
  if not two_pass:
    cache = protocol.init_cache(lm, params, b, t)
    logits, _, _ = protocol.forward(lm, params, tokens, cache, fresh=True)  # [B, T, V]
  else:
    # The loop's prefill (the prompt rotated by its length) and then the continuation shifted
    # to start at column 0, decoded on top of the prompt's cache (position p rotated by p + 1).
    cache = protocol.init_cache(lm, params, b, 2 * t)
    first, _, cache = protocol.forward(lm, params, tokens, cache, fresh=True,
                                       seq_lengths=prompt_lengths)
    cache = protocol.with_length(cache, prompt_lengths)
    shift = jnp.clip(prompt_lengths[:, None] + cols, 0, t - 1)
    rest, _, _ = protocol.forward(lm, params, jnp.take_along_axis(tokens, shift, axis=1), cache)
    # Column c's logits (predicting token c + 1): the prefill's below the prompt's end, else
    # the continuation pass's column c - prompt_length.
    back = jnp.clip(cols - prompt_lengths[:, None], 0, t - 1)
    later = jnp.take_along_axis(rest, back[:, :, None], axis=1)
    logits = jnp.where((cols < prompt_lengths[:, None])[:, :, None], first, later)
  nxt = jnp.clip(tokens[:, 1:], 0, lm.vocab_size - 1)  # padding may hold any id
  logits = _adjusted(logits[:, :-1], tokens, prompt_lengths, sp, stop_ids, lm.vocab_size)
  lp = sampling_lib.token_logprobs(logits, nxt, sp)  # [B, T - 1]
  lp = jnp.concatenate([jnp.zeros((b, 1), lp.dtype), lp], axis=1)
  scored = (cols >= prompt_lengths[:, None]) & (cols < lengths[:, None])
  return jnp.where(scored, lp, 0.0)


def _adjusted(logits, tokens, prompt_lengths, sp, stop_ids, vocab_size):
  """logits [B, T - 1, V] with the loop's context-dependent adjustments: column c follows
  tokens[:, :c + 1], of which those from the prompt's end on count as generated (unchanged
  when the sampling has no penalty, logit bias or min_new_tokens)."""
  history = sampling_lib.start_history(sp, tokens, prompt_lengths, vocab_size, stop_ids)
  if history is None:
    return logits
  cols = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :]
  generated = cols >= prompt_lengths[:, None]  # [B, T]
  n_added = jnp.cumsum(generated, axis=1, dtype=jnp.int32)[:, :-1]
  added = None
  if sp.counts_tokens:  # [B, T - 1, V]: how often each token was generated before column c + 1
    one = jax.nn.one_hot(jnp.where(generated, tokens, -1), vocab_size, dtype=jnp.int32)
    added = jnp.cumsum(one, axis=1)[:, :-1]
  return sampling_lib.adjust(logits, sp, history, added, n_added)


def join_tokens(prompt_ids, prompt_lengths, new_tokens, new_lengths):
  """The sequences `score` takes from a prompt batch and what the loop emitted for it: row b is
  prompt_ids[b, :prompt_lengths[b]] then new_tokens[b, :new_lengths[b]], right-padded with 0.

  Args:
    prompt_ids: [B, P] int, right-padded; prompt_lengths: [B] int.
    new_tokens: [B, N] int (`DecodeOutput.tokens`); new_lengths: [B] int (`.lengths`).
  Returns:
    (tokens [B, P + N] int32, lengths [B] int32 = prompt_lengths + new_lengths).
  """
  _check_rows("prompt_ids", prompt_ids, None, 2, "[B, P] token ids, right-padded")
  b = prompt_ids.shape[0]
  _check_rows("prompt_lengths", prompt_lengths, b, 1, "[B] prompt tokens per row")
  _check_rows("new_tokens", new_tokens, b, 2, "[B, N] the loop's new tokens")
  _check_rows("new_lengths", new_lengths, b, 1, "[B] new tokens per row")
  return _join(jnp.asarray(prompt_ids, jnp.int32), jnp.asarray(prompt_lengths, jnp.int32),
               jnp.asarray(new_tokens, jnp.int32), jnp.asarray(new_lengths, jnp.int32))


@jax.jit
def _join(prompt_ids, prompt_lengths, new_tokens, new_lengths):
  p, n = prompt_ids.shape[1], new_tokens.shape[1]
  cols = jnp.arange(p + n, dtype=jnp.int32)[None, :]
  from_new = jnp.take_along_axis(new_tokens, jnp.clip(cols - prompt_lengths[:, None], 0, n - 1),
                                 axis=1)
  from_prompt = jnp.take_along_axis(prompt_ids, jnp.clip(cols, 0, p - 1), axis=1)
  lengths = prompt_lengths + new_lengths
  tokens = jnp.where(cols < prompt_lengths[:, None], from_prompt,
                     jnp.where(cols < lengths[:, None], from_new, 0))
  return tokens, lengths
