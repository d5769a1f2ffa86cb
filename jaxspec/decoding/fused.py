"""The fused loop: prefill and the whole draft -> verify -> accept -> roll back loop as one
jitted program around a `lax.while_loop` (`spec_init`, then `spec_loop`), over `step.py`."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from jaxspec import sampling as sampling_lib
from jaxspec.decoding import protocol
from jaxspec.decoding import tree as tree_lib
from jaxspec.decoding.drafter import DraftContext
from jaxspec.decoding.rejection import draft
from jaxspec.decoding.step import (Choice, Deferred, SpecState, catch_up_pending, choose_k,
                                   commit_step, defers, finish_step, plain_outcome,
                                   shadow_draft, slice_proposal, spec_prefill, step_inputs,
                                   verify_branch)


def spec_init(tparams, dparams, prompt, prompt_len, sp, key, buffers=None, *, lm, drafter,
              max_len, seq_cap, policy, max_new_tokens, stop_ids, max_steps):
  """Prefill, the first new token and the drafter's state after it; with `buffers` (donated,
  `take_cache_buffers`) the target's cache is written into them."""
  s, ctx = spec_prefill(tparams, dparams, prompt, prompt_len, sp, key, lm=lm, drafter=drafter,
                        max_len=max_len, seq_cap=seq_cap, policy=policy,
                        max_new_tokens=max_new_tokens, stop_ids=stop_ids, max_steps=max_steps,
                        buffers=buffers)
  if defers(drafter, policy):  # the first token is a plain step: kept pending too
    hidden = ctx.hidden if drafter.uses_target_hidden else None
    return dataclasses.replace(s, draft_state=Deferred(inner=s.draft_state, pending=ctx.n_new,
                                                       hidden=hidden))
  return dataclasses.replace(s, draft_state=drafter.commit(dparams, s.draft_state, ctx))


def tree_step(tparams, dparams, s: SpecState, sp, *, lm, drafter, policy, max_new_tokens,
              stop_ids):
  """One tree step: the drafter's tree, one target pass over all its nodes, the tree rule,
  and the accepted path committed as a chain of the same length would be."""
  _, kd, kv, last = step_inputs(s, policy.k_max + 1)
  ctx = DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len,
                     row_keys=s.keys)
  prop, dstate = drafter.propose_tree(dparams, s.draft_state, ctx, sp, kd)
  # A node outside the vocabulary is never accepted, and runs through the target as token 0
  # (an out-of-range id would read a NaN embedding into the pass and the cache).
  in_vocab = (prop.tokens >= 0) & (prop.tokens < lm.vocab_size)
  tokens = jnp.where(in_vocab, prop.tokens, 0).at[:, 0].set(last)
  depth = policy.k_max
  hidden_layers = drafter.hidden_layers if drafter.uses_target_hidden else ()
  p, hidden, kv_new, logits = tree_lib.verify_tree(
      tparams, s.cache, tokens, prop.parents, prop.depth, lm, sp, max_depth=depth,
      hidden_layers=hidden_layers, return_logits=True)
  n_acc, emitted, path = tree_lib.tree_accept(p, tokens, prop.parents, kv, depth,
                                              greedy=sp.temperature == 0, valid=in_vocab,
                                              depth=prop.depth)
  hidden, kv_path = tree_lib.gather_path(path, hidden, kv_new)
  lp = None
  if policy.logprobs:  # emitted token i was drawn from the target's logits at path node i
    at_path = jnp.take_along_axis(logits, path[:, :, None], axis=1)
    lp = sampling_lib.token_logprobs(at_path, jnp.maximum(emitted, 0), sp)
  b = last.shape[0]
  out = (n_acc, emitted, hidden, kv_path, jnp.full((b,), depth, jnp.int32), jnp.int32(depth), lp)
  new, ctx = finish_step(s, out, lm=lm, policy=policy, max_new_tokens=max_new_tokens,
                         stop_ids=stop_ids)
  return dataclasses.replace(new, draft_state=drafter.commit(dparams, dstate, ctx))


def spec_step(tparams, dparams, s: SpecState, sp, costs, force_idx, *, lm, drafter, policy,
              max_new_tokens, stop_ids):
  """One draft -> verify -> accept -> roll back step.

  The draft count is chosen among `policy.buckets`, each a branch of a `lax.switch` compiled
  with its own static width. force_idx >= 0 (a traced int) takes that bucket and verifies even
  filler: the cost model times the real loop that way, with no extra compilation.
  """
  if drafter.tree is not None:
    return tree_step(tparams, dparams, s, sp, lm=lm, drafter=drafter, policy=policy,
                     max_new_tokens=max_new_tokens, stop_ids=stop_ids)
  kmax = policy.k_max
  live, kd, kv, last = step_inputs(s, kmax + 1)
  ctx = DraftContext(seq=s.seq, seq_len=s.seq_len, prompt_len=s.prompt_len,
                     row_keys=s.keys)
  choice = choose_k(dparams, s, sp, costs, force_idx, drafter=drafter, policy=policy,
                    max_new_tokens=max_new_tokens)
  idx, prop_all, dstate_all, nv_all = choice.idx, choice.prop, choice.dstate, choice.n_valid
  forced = force_idx >= 0
  vb = functools.partial(verify_branch, lm=lm, drafter=drafter, kmax=kmax,
                         known_drafts=drafter.free_proposals and not policy.auto,
                         logprobs=policy.logprobs)

  # Branches only read the target cache and return the new block's keys and values padded to
  # k_max + 1; the one write after the switch keeps XLA from passing the whole cache through
  # (and copying it in) every branch.
  defer = defers(drafter, policy)
  own_state = s.draft_state.inner if defer else s.draft_state

  def branch(k):
    def run(cache):
      if k == 0:
        dstate = dstate_all if drafter.free_proposals else own_state
        return vb(tparams, cache, last, None, 0, sp, kv, live, forced), dstate
      if drafter.free_proposals:
        prop, dstate = slice_proposal(prop_all, k, nv_all), dstate_all
      else:
        current = (catch_up_pending(drafter, dparams, s, s.draft_state, kmax + 1) if defer
                   else own_state)
        prop, dstate = draft(drafter, dparams, current, ctx, k, sp, kd)
      return vb(tparams, cache, last, prop, k, sp, kv, live, forced), dstate
    return run

  out, dstate = lax.switch(idx, [branch(k) for k in policy.buckets], s.cache)
  new, ctx = finish_step(s, out, lm=lm, policy=policy, max_new_tokens=max_new_tokens,
                         stop_ids=stop_ids, shadow_draft=shadow_draft(choice, drafter, policy))
  return commit_step(drafter, dparams, policy, s, new, dstate, ctx, idx == 0)


def plain_step(tparams, dparams, s: SpecState, choice: Choice, sp, *, lm, drafter, policy,
               max_new_tokens, stop_ids):
  """A step the controller gave k = 0, as `generate`'s decode step runs it: the forward writes
  its one new cache entry in place. The same tokens, statistics and acceptance updates as the
  switch's plain branch, whose read-only forward and separate write of a k_max + 1 block (with
  the switch around them) made a batch-16 step of SmolLM2 96 ms against `generate`'s 90."""
  _, _, kv, last = step_inputs(s)
  hidden_layers = drafter.hidden_layers if drafter.uses_target_hidden else ()
  logits, hidden, written = protocol.forward(lm, tparams, last[:, None], s.cache,
                                             hidden_layers=hidden_layers)
  tok = sampling_lib.sample(kv[:, 0], logits[:, 0], sp)
  lp = sampling_lib.token_logprobs(logits[:, 0], tok, sp) if policy.logprobs else None
  out = plain_outcome(tok, hidden, None, policy.k_max, lp)
  # The entry is written; finish_step rolls the length back from the old one.
  s1 = dataclasses.replace(s, cache=protocol.with_length(written, s.cache.length))
  new, ctx = finish_step(s1, out, lm=lm, policy=policy, max_new_tokens=max_new_tokens,
                         stop_ids=stop_ids, shadow_draft=shadow_draft(choice, drafter, policy))
  own = s.draft_state.inner if defers(drafter, policy) else s.draft_state
  dstate = choice.dstate if drafter.free_proposals else own
  return commit_step(drafter, dparams, policy, s, new, dstate, ctx, jnp.bool_(True))


def plain_run(tparams, dparams, s: SpecState, sp, costs, until, force_idx, *, lm, drafter,
              policy, max_new_tokens, stop_ids):
  """Plain steps for as long as the choice stays k = 0: a `lax.while_loop` inside the loop's
  body, so they run at `generate`'s speed (a `lax.cond` around an in-place step would copy the
  cache). Ends with every row done, `until` passes run, or a choice of k > 0, which the
  next `spec_step` makes again from the same state."""
  if drafter.tree is not None or not (policy.auto or drafter.free_proposals):
    return s  # a tree, or a fixed k with drafts made in the branch: k = 0 is never chosen
  pick = functools.partial(choose_k, dparams, sp=sp, costs=costs, force_idx=force_idx,
                           drafter=drafter, policy=policy, max_new_tokens=max_new_tokens)

  def go_on(c):
    st, choice = c
    return (choice.idx == 0) & jnp.any(~st.done) & (st.stats.target_passes < until)

  def body(c):
    st, choice = c
    st = plain_step(tparams, dparams, st, choice, sp, lm=lm, drafter=drafter, policy=policy,
                    max_new_tokens=max_new_tokens, stop_ids=stop_ids)
    return st, pick(s=st)

  return lax.while_loop(go_on, body, (s, pick(s=s)))[0]


def spec_loop(tparams, dparams, s, sp, costs, until, force_idx, **static):
  """Steps until every row is done or `until` target passes have run: each iteration is one
  `spec_step`, then the plain steps that follow while the choice stays k = 0."""
  def body(s):
    s = spec_step(tparams, dparams, s, sp, costs, force_idx, **static)
    return plain_run(tparams, dparams, s, sp, costs, until, force_idx, **static)

  return lax.while_loop(lambda s: jnp.any(~s.done) & (s.stats.target_passes < until), body, s)


def outputs(s: SpecState, width: int):
  """New tokens [B, width] (-1 padded) and their count [B], gathered from the sequence buffer;
  with `logprobs` also their log-probabilities [B, width] (0 past each row's count)."""
  n_out = s.seq_len - s.prompt_len
  idx = jnp.minimum(s.prompt_len[:, None] + jnp.arange(width)[None, :], s.seq.shape[1] - 1)
  valid = jnp.arange(width)[None, :] < n_out[:, None]
  toks = jnp.where(valid, jnp.take_along_axis(s.seq, idx, axis=1), -1)
  if s.logp is None:
    return toks, n_out
  return toks, n_out, jnp.where(valid, jnp.take_along_axis(s.logp, idx, axis=1), 0.0)


SPEC_INIT_STATIC = ("lm", "drafter", "max_len", "seq_cap", "policy", "max_new_tokens",
                    "stop_ids", "max_steps")
LOOP_STATIC = ("lm", "drafter", "policy", "max_new_tokens", "stop_ids")
spec_init_jit = jax.jit(spec_init, static_argnames=SPEC_INIT_STATIC, donate_argnums=(6,))
spec_loop_jit = jax.jit(spec_loop, static_argnames=LOOP_STATIC, donate_argnums=(2,))
outputs_jit = jax.jit(outputs, static_argnums=(1,))
