"""What tracing the fused speculative loop enters: the code of a feature the call leaves off
(penalties, log-probabilities, the acceptance model of "auto") is not traced at all, so a
reader following one step meets only what it runs (issue 48; benchmarks/trace_step.py counts
the whole call)."""

import dataclasses
import sys

import jax
import jax.numpy as jnp

from jaxspec import sampling as sampling_lib
from jaxspec.decoding import adaptive, loop, protocol
from jaxspec.drafters import NGram
from jaxspec.sampling import Sampling

# The functions of the features off in a greedy, fixed-k call without penalties or logprobs.
FEATURE_CODE = {
    "penalties": (sampling_lib.start_history, sampling_lib.extend_history, sampling_lib.adjust),
    "logprobs": (sampling_lib.token_logprobs, sampling_lib.top_logprobs),
    "acceptance model": (adaptive.update_counts,),
}


def entered_while_tracing(target, sampling: Sampling, policy: loop.Policy) -> set:
  """The code objects entered while `spec_init` and `spec_loop` are traced (not compiled) for
  one 8-token prompt, 8 new tokens and the n-gram drafter."""
  tgt = protocol.as_target(target)
  cfg = loop.StepConfig(lm=tgt.lm, drafter=NGram(), policy=policy, max_new_tokens=8,
                        max_len=64, max_steps=9)
  sp = sampling.arrays(1, tgt.lm.vocab_size, 8)
  costs = loop.costs_array(policy, None)

  def run(params, prompt, lengths, sp, key):
    s = loop.spec_init(params, None, prompt, lengths, sp, key, cfg=cfg)
    return loop.spec_loop(params, None, s, sp, costs, jnp.int32(9), jnp.int32(-1), cfg=cfg)

  seen = set()

  def profile(frame, event, arg):
    if event == "call":
      seen.add(frame.f_code)

  sys.setprofile(profile)
  try:
    jax.make_jaxpr(run)(tgt.params, jnp.array([[1, 2, 3, 4, 5, 1, 2, 3]], jnp.int32),
                        jnp.array([8], jnp.int32), sp, jax.random.key(0))
  finally:
    sys.setprofile(None)
  return seen


def test_a_call_without_penalties_logprobs_or_auto_traces_none_of_their_code(tiny_target):
  seen = entered_while_tracing(tiny_target, Sampling(),
                               loop.resolve_policy(4, None, NGram()))
  entered = {feature: [f.__name__ for f in fns if f.__code__ in seen]
             for feature, fns in FEATURE_CODE.items()}
  assert entered == {feature: [] for feature in FEATURE_CODE}


def test_a_call_with_them_traces_their_code(tiny_target):
  policy = dataclasses.replace(loop.resolve_policy("auto", None, NGram()), logprobs=True,
                               top_logprobs=2)
  seen = entered_while_tracing(
      tiny_target, Sampling(temperature=0.7, repetition_penalty=1.2, min_new_tokens=2), policy)
  missing = [f.__name__ for fns in FEATURE_CODE.values() for f in fns if f.__code__ not in seen]
  assert missing == []
