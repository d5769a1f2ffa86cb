"""What the decoding loop needs of a model: the `CausalLM` protocol, and the operations the loop
runs on any model that meets it.

A target (or a `DraftModel`'s model) is a static, hashable object that describes the model,
with its weights passed separately as a pytree (as flax's `nnx.split` gives them), so new
weights of the same shapes reuse the compiled loop:

  vocab_size: int
  init_cache(params, batch_size, max_len) -> cache          a pytree, for max_len positions
  forward(params, tokens [B, T], cache, lengths [B], *, hidden_layers=())
      -> (logits [B, T, V], hidden, cache)

`forward` runs T new tokens per row: token t of row b sits at position lengths[b] + t, its keys
and values are written there, and it attends to the row's positions < lengths[b] + t + 1 (the
cache below lengths[b] and the new tokens up to itself). The loop keeps each row's length
itself; rolling a row back is passing a smaller length next time: entries past it are never
read, and are overwritten before they could be. `hidden` is None, a [B, T, D] array, or a
`Hidden` (the final normed states and, in order, the outputs of the requested `hidden_layers`),
which drafters that read the target's features (heads) need.

The protocol's types (`CausalLM`, `Hidden`) live in `jaxspec.lm`, below both the models package
and this one, which imports nothing from the models. jaxspec's Llama (`LlamaLM`) is its
implementation; it also offers the block interface (`forward_block`, `write_block`,
`pad_block`, tree attention), found here by its methods (`is_block_lm`), with which a verify
branch inside a `lax.switch` only reads the cache and the new keys and values are written once
after it. A model without it runs the same loop with its cache passed through the branches.
`Target(lm, params)` binds a model to its weights as one pytree for `jaxspec.decoding`'s
functions.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.checks import is_int
from jaxspec.lm import LM_OF_CONFIG, CausalLM, Hidden  # noqa: F401 - the protocol's types


REQUIRED = ("vocab_size", "init_cache", "forward")


def check_lm(lm, who: str = "target") -> None:
  """Raises ValueError unless `lm` meets the `CausalLM` protocol (naming what is missing) and
  is hashable (it is a static argument of the compiled loop)."""
  missing = [m for m in REQUIRED if not hasattr(lm, m)]
  if missing:
    raise ValueError(
        f"the {who} model {type(lm).__name__} does not meet jaxspec.decoding.CausalLM: it has no"
        f" {', '.join(missing)} (needs vocab_size, init_cache(params, batch_size, max_len) and"
        " forward(params, tokens, cache, lengths, *, hidden_layers=()); see"
        " jaxspec.decoding.protocol)")
  for m in ("init_cache", "forward"):
    if not callable(getattr(lm, m)):
      raise ValueError(f"the {who} model's {m} must be a method, got {type(getattr(lm, m))}")
  v = lm.vocab_size
  if not is_int(v, numpy=False) or v < 1:
    raise ValueError(f"the {who} model's vocab_size must be a positive int, got {v!r}")
  try:
    hash(lm)
  except TypeError:
    raise ValueError(f"the {who} model {type(lm).__name__} must be hashable (it is static in the"
                     " compiled loop; its weights go in params): make it a frozen dataclass or"
                     " define __hash__ and __eq__") from None


def as_lm(lm):
  """`lm` itself, or the model a registered configuration stands for (`jaxspec.lm`'s
  `register_config`: a `LlamaConfig` is jaxspec's Llama, as the older signatures took one)."""
  make = LM_OF_CONFIG.get(type(lm))
  return lm if make is None else make(lm)


def is_block_lm(lm) -> bool:
  """Whether `lm` offers the block interface (read-only forward, one write after a branch)."""
  return hasattr(lm, "forward_block") and hasattr(lm, "write_block")


@functools.partial(jax.tree_util.register_dataclass, data_fields=["params"],
                   meta_fields=["lm"])
@dataclasses.dataclass(frozen=True)
class Target:
  """A model bound to its weights: `lm` (static, meets `CausalLM`) and `params` (a pytree), as one
  pytree, so a jitted function can take it as an argument and trace the weights."""

  lm: Any
  params: Any

  @property
  def vocab_size(self) -> int:
    return self.lm.vocab_size


def as_target(model, params=None, who: str = "target") -> Target:
  """A `Target` from a jaxspec `Model`, a `Target`, or a protocol model with `params`."""
  if isinstance(model, Target):
    check_lm(model.lm, who)
    return model if params is None else Target(model.lm, params)
  if hasattr(model, "cfg") and hasattr(model, "params") and hasattr(model, "tokenizer"):
    return Target(as_lm(model.cfg), model.params if params is None else params)  # a Model
  check_lm(model, who)
  return Target(model, params)


# ----------------------------------------------------------------------------------------------
# The operations the loop runs. Block models use their cache's own length; any other model's
# cache is wrapped with the lengths the loop keeps.


@functools.partial(jax.tree_util.register_dataclass, data_fields=["inner", "length"],
                   meta_fields=["max_len"])
@dataclasses.dataclass
class LengthCache:
  """A protocol model's cache with the per-row length the loop keeps for it."""

  inner: Any
  length: jax.Array  # [B] int32: positions [0, length) are valid
  max_len: int


def init_cache(lm, params, batch_size: int, max_len: int):
  if is_block_lm(lm):
    return lm.init_cache(params, batch_size, max_len)
  return LengthCache(inner=lm.init_cache(params, batch_size, max_len),
                     length=jnp.zeros((batch_size,), jnp.int32), max_len=max_len)


def _as_hidden(hidden, hidden_layers, lm, tokens) -> Hidden:
  if hidden is None:
    if hidden_layers:
      raise ValueError(f"{type(lm).__name__}.forward returned no hidden states, but the drafter"
                       f" reads layers {tuple(hidden_layers)}: return a jaxspec Hidden")
    # A placeholder the loop carries (no drafter reads it: one that does needs real states).
    return Hidden(final=jnp.zeros(tokens.shape + (1,), jnp.float32))
  if isinstance(hidden, Hidden):
    if hidden_layers and hidden.layers is None:
      raise ValueError(f"{type(lm).__name__}.forward returned Hidden without layers, but the"
                       f" drafter reads layers {tuple(hidden_layers)}")
    return hidden
  return Hidden(final=hidden)


def forward(lm, params, tokens, cache, *, hidden_layers=(), logits=True, fresh=False, write=True,
            positions=None, block_mask=None, seq_lengths=None):
  """The loop's forward: (logits [B, T, V], Hidden, new cache with length + T), or with
  write=False (logits, Hidden, block) where `write_block` later writes the block.
  `seq_lengths` ([B] prompt lengths of a prefill) reaches block models that take it."""
  if is_block_lm(lm):
    kw = {"seq_lengths": seq_lengths} if seq_lengths is not None and _takes_seq_lengths(
        lm) else {}
    return lm.forward_block(params, tokens, cache, hidden_layers=hidden_layers, logits=logits,
                            fresh=fresh, write=write, positions=positions, block_mask=block_mask,
                            **kw)
  if positions is not None or block_mask is not None:
    raise ValueError(f"tree drafting needs tree attention from the target, which"
                     f" {type(lm).__name__} does not offer (forward_block with positions and"
                     " block_mask): draft chains (drafter.with_tree(None))")
  out_logits, hidden, inner = lm.forward(params, tokens, cache.inner, cache.length,
                                         hidden_layers=tuple(hidden_layers))
  hidden = _as_hidden(hidden, hidden_layers, lm, tokens)
  out_logits = out_logits.astype(jnp.float32) if logits else None
  if not write:
    return out_logits, hidden, inner  # the block: the whole written cache
  return out_logits, hidden, LengthCache(inner=inner, length=cache.length + tokens.shape[1],
                                         max_len=cache.max_len)


def write_block(lm, cache, block, start):
  """The cache with a `forward(write=False)` block written at per-row `start` (the length is
  then start + T for block models; the caller sets the length it keeps)."""
  if is_block_lm(lm):
    return lm.write_block(cache, block, start)
  return LengthCache(inner=block, length=start, max_len=cache.max_len)


def pad_block(lm, block, width: int):
  """A block padded to `width` tokens, so the branches of a `lax.switch` agree in shape."""
  if is_block_lm(lm):
    return lm.pad_block(block, width)
  return block


def with_length(cache, length):
  return dataclasses.replace(cache, length=length)


def _takes_seq_lengths(lm) -> bool:
  """Whether a block model's prefill takes each row's prompt length (jaxspec's Llama does:
  length-dependent rotary scaling rotates a prompt by its length)."""
  try:
    return "seq_lengths" in inspect.signature(lm.forward_block).parameters
  except (TypeError, ValueError):
    return False


def prefill(lm, params, prompt, lengths, max_len: int, *, hidden_layers=(), logits: bool = True,
            buffers=None):
  """Runs the prompt [B, P] through the model; returns (last logits [B, V], Hidden, cache).

  Padding positions are written but the cache length is set to each row's prompt length, so
  they are rolled back. A block model runs its LM head only on each row's last prompt position
  (and not at all with logits=False, which returns None for them). With `buffers` (a block
  model's donated earlier cache) the prompt is written into them in place.
  """
  b = prompt.shape[0]
  if is_block_lm(lm):
    if buffers is None:
      cache = lm.init_cache(params, b, max_len)
    else:
      cache = lm.cache_from_buffers(buffers, b)
    _, hidden, cache = forward(lm, params, prompt, cache, logits=False,
                               hidden_layers=hidden_layers, fresh=True, seq_lengths=lengths)
    last = jnp.take_along_axis(hidden.final, (lengths - 1)[:, None, None], axis=1)[:, 0]
    out = lm.logits_from_hidden(params, last) if logits else None
    return out, hidden, dataclasses.replace(cache, length=lengths)
  cache = init_cache(lm, params, b, max_len)
  all_logits, hidden, cache = forward(lm, params, prompt, cache, hidden_layers=hidden_layers)
  out = None
  if logits:
    out = jnp.take_along_axis(all_logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
  return out, hidden, dataclasses.replace(cache, length=lengths)

