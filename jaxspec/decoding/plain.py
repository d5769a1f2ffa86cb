"""Plain autoregressive decoding inside jit: the prefill, one decode step and the decode loop.

The baseline every speculative number is measured against: one `lax.while_loop` over decode
steps, so no token goes back to the host until the batch is done. `jaxspec.api.generate` runs
it as one compiled program; `jaxspec.decoding.decode` is the same loop as a pure function.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from jaxspec import sampling as sampling_lib
from jaxspec.decoding import protocol
from jaxspec.pytree import pytree_dataclass as _pytree
from jaxspec.sampling import SamplingArrays


@_pytree
@dataclasses.dataclass
class DecodeState:
  """The `lax.while_loop` state of plain decoding."""

  tokens: jax.Array  # [B, N] int32 output buffer (-1 = empty)
  n_out: jax.Array  # [B] int32 tokens emitted per row
  done: jax.Array  # [B] bool
  last: jax.Array  # [B] int32 last emitted token, the next forward's input
  cache: Any
  keys: jax.Array  # [B] per-row PRNG keys
  steps: jax.Array  # [] int32 decode forward passes so far
  logprobs: jax.Array | None = None  # [B, N] float32 (when asked for) the tokens' log-probs
  # What penalties, logit_bias and min_new_tokens read (None when the sampling has none).
  history: sampling_lib.TokenHistory | None = None
  # [B, N, n] int32 / float32 (top_logprobs n) the n most likely tokens at each new token's
  # position and their log-probabilities.
  top_ids: jax.Array | None = None
  top_lp: jax.Array | None = None


def is_stop(tokens: jax.Array, stop_ids: tuple[int, ...] | jax.Array) -> jax.Array:
  """[B] whether each row's token [B] is a stop token: one of `stop_ids` (a tuple, every row's),
  or of its own row of `stop_ids` [B, K] (an array, -1 padded: per-row stops)."""
  if isinstance(stop_ids, jax.Array):
    return jnp.any(tokens[:, None] == stop_ids, axis=1)
  if not stop_ids:
    return jnp.zeros(tokens.shape, bool)
  return jnp.isin(tokens, jnp.array(stop_ids, jnp.int32))


def prefill(params, prompt: jax.Array, lengths: jax.Array, lm, max_len: int, *,
            hidden_layers: tuple[int, ...] = (), logits: bool = True, buffers=None):
  """Runs the prompt [B, P] through the model `lm` (a `CausalLM`; a `LlamaConfig` means
  jaxspec's Llama); returns (last logits [B, V], Hidden, cache with each row's prompt length).
  See `jaxspec.decoding.protocol.prefill`."""
  return protocol.prefill(protocol.as_lm(lm), params, prompt, lengths, max_len,
                          hidden_layers=hidden_layers, logits=logits, buffers=buffers)


def init_decode(params, prompt, lengths, sp, key, lm, max_len, max_new_tokens, stop_ids,
                buffers=None, capacity=None, logprobs=False, top_logprobs=0):
  """Prefill and the first new token. `max_new_tokens` may be traced when `capacity` (static,
  the output buffer's width) bounds it; `logprobs` keeps every token's log-probability, and
  `top_logprobs` n (with it) the n most likely tokens at every position."""
  b = prompt.shape[0]
  cap = max_new_tokens if capacity is None else capacity
  logits, _, cache = protocol.prefill(lm, params, prompt, lengths, max_len, buffers=buffers)
  history = sampling_lib.start_history(sp, prompt, lengths, logits.shape[-1], stop_ids)
  logits = sampling_lib.adjust(logits, sp, history)
  keys = sampling_lib.row_keys(key, b)
  first = sampling_lib.sample(jax.vmap(jax.random.fold_in)(keys, jnp.zeros(b, jnp.int32)),
                              logits, sp)
  tokens = jnp.full((b, cap), -1, jnp.int32).at[:, 0].set(first)
  lp = top_ids = top_lp = None
  if logprobs:
    lp = jnp.zeros((b, cap), jnp.float32).at[:, 0].set(
        sampling_lib.token_logprobs(logits, first, sp))
    if top_logprobs:
      ids, vals = sampling_lib.top_logprobs(logits, sp, top_logprobs)
      top_ids = jnp.full((b, cap, top_logprobs), -1, jnp.int32).at[:, 0].set(ids)
      top_lp = jnp.zeros((b, cap, top_logprobs), jnp.float32).at[:, 0].set(vals)
  done = is_stop(first, stop_ids) | (max_new_tokens <= 1)
  return DecodeState(tokens=tokens, n_out=jnp.ones((b,), jnp.int32), done=done, last=first,
                     cache=cache, keys=keys, steps=jnp.zeros((), jnp.int32), logprobs=lp,
                     history=sampling_lib.extend_history(history, first), top_ids=top_ids,
                     top_lp=top_lp)


def decode_step(params, s: DecodeState, sp: SamplingArrays, lm, max_new_tokens, stop_ids):
  logits, _, cache = protocol.forward(lm, params, s.last[:, None], s.cache)
  logits = sampling_lib.adjust(logits, sp, s.history)
  tok = sampling_lib.sample(jax.vmap(jax.random.fold_in)(s.keys, s.n_out), logits[:, 0], sp)
  live = ~s.done
  rows = jnp.arange(tok.shape[0])
  cap = s.tokens.shape[1]
  col = jnp.where(live, s.n_out, cap)
  tokens = s.tokens.at[rows, col].set(tok, mode="drop")
  lp = s.logprobs
  if lp is not None:
    lp = lp.at[rows, col].set(sampling_lib.token_logprobs(logits[:, 0], tok, sp), mode="drop")
  top_ids, top_lp = s.top_ids, s.top_lp
  if top_ids is not None:
    ids, vals = sampling_lib.top_logprobs(logits[:, 0], sp, top_ids.shape[2])
    top_ids = top_ids.at[rows, col].set(ids, mode="drop")
    top_lp = top_lp.at[rows, col].set(vals, mode="drop")
  n_out = s.n_out + live
  length = jnp.where(live, cache.length, s.cache.length)  # finished rows stop growing
  cache = protocol.with_length(cache, length)
  full = length + 1 > cache.max_len
  done = s.done | (live & is_stop(tok, stop_ids)) | (n_out >= max_new_tokens) | full
  history = sampling_lib.extend_history(s.history, tok, live)
  return DecodeState(tokens=tokens, n_out=n_out, done=done, last=jnp.where(live, tok, s.last),
                     cache=cache, keys=s.keys, steps=s.steps + 1, logprobs=lp, history=history,
                     top_ids=top_ids, top_lp=top_lp)


def decode_loop(params, s: DecodeState, sp, until, lm, max_new_tokens, stop_ids):
  """Decodes until every row is done or `until` steps ([] int32, traced) have run."""
  return lax.while_loop(
      lambda s: jnp.any(~s.done) & (s.steps < until),
      lambda s: decode_step(params, s, sp, lm, max_new_tokens, stop_ids), s)


def generate_program(params, prompt, lengths, sp, key, buffers=None, *, lm, max_len,
                     max_new_tokens, stop_ids, logprobs=False, top_logprobs=0):
  """Prefill and decode loop in one program; with `buffers` (donated, `take_cache_buffers`)
  the cache lives in them and comes back as the fourth output, for the next call. The last
  output is None, or with `top_logprobs` the (ids, log-probabilities) [B, N, n]."""
  s = init_decode(params, prompt, lengths, sp, key, lm, max_len, max_new_tokens, stop_ids,
                  buffers, logprobs=logprobs, top_logprobs=top_logprobs)
  s = decode_loop(params, s, sp, jnp.int32(max_new_tokens), lm, max_new_tokens, stop_ids)
  return (s.tokens, s.n_out, s.steps, (None if buffers is None else (s.cache.k, s.cache.v)),
          s.logprobs, None if s.top_ids is None else (s.top_ids, s.top_lp))


generate_jit = jax.jit(generate_program, static_argnames=(
    "lm", "max_len", "max_new_tokens", "stop_ids", "logprobs", "top_logprobs"),
    donate_argnums=(5,))
init_decode_jit = jax.jit(init_decode, static_argnums=(5, 6, 7, 8, 10, 11, 12))
decode_loop_jit = jax.jit(decode_loop, static_argnums=(4, 5, 6), donate_argnums=(1,))
