"""The public host functions: `generate` and `speculative_generate` (and their streaming forms)
take strings or token lists, run the compiled loops of `jaxspec.decoding` through
`jaxspec.runner`, and return numpy arrays, texts and statistics.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.decoding import loop as fused
from jaxspec.decoding import plain
from jaxspec.decoding.adaptive import AutoK, CostModel
from jaxspec.decoding.drafter import Drafter
from jaxspec.decoding.functional import as_key
from jaxspec.decoding.loop import SpecState
from jaxspec.models import loading as models_loading
from jaxspec.models.llama import LlamaLM
from jaxspec.models.model import Model
from jaxspec.runner import (SpecRun, check_chunk, compiled, decode_texts,
                            in_shardings_for, keep_cache_buffers, make_run, prepare_prompts,
                            prepare_spec, put_global, stop_ids_for,
                            stream_loop, take_cache_buffers, to_host, view_decode)
from jaxspec.sampling import Sampling, resolve_sampling
from jaxspec.sharding import rules as sharding_rules


@dataclasses.dataclass
class GenerateOutput:
  """What `generate` and `speculative_generate` return.

  Attributes:
    tokens: [B, max_new_tokens] int32 new tokens; -1 past each row's length.
    lengths: [B] number of new tokens per row (a stop token, when hit, is included).
    prompt_lengths: [B] prompt tokens per row.
    texts: decoded new text per row (stop tokens skipped), when the model has a tokenizer.
    stats: timing and, for speculative decoding, acceptance statistics.
    logprobs: [B, max_new_tokens] float32 (with logprobs=True) the target's log-probability of
      each new token under the sampling parameters (log_softmax of the processed logits; greedy
      rows unscaled); 0 past each row's length.
  """

  tokens: np.ndarray
  lengths: np.ndarray
  prompt_lengths: np.ndarray
  texts: list[str] | None = None
  stats: dict[str, Any] = dataclasses.field(default_factory=dict)
  logprobs: np.ndarray | None = None

  def row(self, b: int) -> list[int]:
    """Row b's new tokens as a list."""
    return self.tokens[b, : self.lengths[b]].tolist()


def generate(model: Model, prompts, *, max_new_tokens: int = 128,
             sampling: Sampling | None = None, key: jax.Array | int | None = None,
             stop_ids: Sequence[int] | None = None, max_len: int | None = None,
             temperature: float | None = None, logprobs: bool = False) -> GenerateOutput:
  """Plain autoregressive decoding of a batch of prompts, entirely on device.

  Args:
    model: a loaded `Model` (see `jaxspec.models.load`).
    prompts: a string, list of strings, or list of token-id lists (rows may differ in length).
    max_new_tokens: tokens to generate per row.
    sampling: `Sampling(temperature, top_k, top_p, min_p)`; default greedy. Values are passed as
      arrays, so changing them does not recompile.
    key: PRNG key or int seed for sampling (row b's randomness depends only on key and b),
      or one key per row (a key array [B]): `jaxspec.sampling.row_keys(key, N)[i:j]` for
      prompts i..j-1 of N gives them the texts they get in one N-row call.
    stop_ids: tokens that end a row (included in the output); default the model's EOS ids.
    max_len: KV-cache size; default just enough for the longest prompt plus max_new_tokens.
    temperature: shorthand for `sampling=Sampling(temperature=...)`.
  Returns:
    `GenerateOutput` with tokens [B, max_new_tokens], lengths [B], texts and stats (seconds,
    compile seconds, tokens/s).
  """
  if temperature is not None:
    sampling = dataclasses.replace(resolve_sampling(sampling), temperature=temperature)
  sp_user = resolve_sampling(sampling)
  prep = prepare_prompts(model, prompts, max_new_tokens, max_len=max_len)
  stops = stop_ids_for(model, stop_ids)
  b = prep.tokens.shape[0]
  key = as_key(key, b)
  args = (model.params, jnp.asarray(prep.tokens), jnp.asarray(prep.lengths),
          sp_user.arrays(b), key)
  static = dict(lm=LlamaLM(model.cfg), max_len=prep.max_len, max_new_tokens=int(max_new_tokens),
                stop_ids=stops, logprobs=bool(logprobs))
  sh = model.sharding
  if sh is None:  # the cache in the previous call's buffers (`take_cache_buffers`)
    args += (take_cache_buffers(model.cfg, b, prep.max_len),)
    exe, compile_s = compiled(plain.generate_jit, None, *args, **static)
  else:  # the weights' mesh: batch rows data-parallel, outputs batch-sharded
    sh.check_batch(b)
    in_sh = in_shardings_for(sh, args)
    jit_kwargs = dict(in_shardings=in_sh,
                      out_shardings=(sh.batch(2), sh.batch(1), sh.replicated(), None,
                                     sh.batch(2) if logprobs else None))
    exe, compile_s = compiled(plain.generate_program, sh, *args, jit_kwargs=jit_kwargs, **static)
    # Global arrays on the mesh (on several hosts every process passes the same prompts).
    args = put_global(args, in_sh)
  t0 = time.perf_counter()
  tokens, n_out, steps, bufs, lp = jax.block_until_ready(exe(*args))
  dt = time.perf_counter() - t0
  if bufs is not None:
    keep_cache_buffers(model.cfg, *bufs)
  tokens, n_out, lp = to_host((tokens, n_out, lp))
  new = int(n_out.sum())
  stats = dict(seconds=dt, compile_seconds=compile_s, new_tokens=new,
               tokens_per_second=new / dt if dt > 0 else float("inf"),
               target_passes=int(steps) + 1, batch_size=b)
  return GenerateOutput(tokens=tokens, lengths=n_out, prompt_lengths=prep.lengths, logprobs=lp,
                        texts=decode_texts(model, tokens, n_out), stats=stats)


def generate_stream(model: Model, prompt, *, max_new_tokens: int = 128,
                    sampling: Sampling | None = None, key=None,
                    stop_ids: Sequence[int] | None = None, chunk: int = 8,
                    ) -> Iterator[tuple[list[int], dict[str, Any]]]:
  """Plain decoding of one batch, yielding (new tokens of row 0, stats) every `chunk` steps.

  The loop runs on device between yields (a `lax.while_loop` bounded by a traced step count), so
  streaming costs one host round-trip per chunk, not per token.
  """
  sp_user = resolve_sampling(sampling)
  chunk = check_chunk(chunk)
  prep = prepare_prompts(model, prompt, max_new_tokens)
  stops = stop_ids_for(model, stop_ids)
  b = prep.tokens.shape[0]
  sp = sp_user.arrays(b)
  init_args = (model.params, jnp.asarray(prep.tokens), jnp.asarray(prep.lengths), sp,
               as_key(key, b), LlamaLM(model.cfg), prep.max_len, int(max_new_tokens), stops)
  init_exe, c1 = compiled(plain.init_decode_jit, "stream-init", *init_args)
  state0 = jax.eval_shape(plain.init_decode_jit, *init_args)
  loop_exe, c2 = compiled(plain.decode_loop_jit, "stream-loop", model.params, state0, sp,
                          jnp.int32(0), LlamaLM(model.cfg), int(max_new_tokens), stops)
  t0 = time.perf_counter()
  state = jax.block_until_ready(init_exe(*init_args[:5]))
  for new, info in stream_loop(lambda s, until: loop_exe(model.params, s, sp, until),
                               view_decode, state, chunk, t0):
    info["compile_seconds"] = c1 + c2
    yield new, info


def speculative_generate(target: Model, drafter: Drafter, prompts, *, max_new_tokens: int = 128,
                         sampling: Sampling | None = None, num_draft_tokens: int | str = "auto",
                         key: jax.Array | int | None = None,
                         stop_ids: Sequence[int] | None = None, max_len: int | None = None,
                         temperature: float | None = None, auto: AutoK | None = None,
                         cost: CostModel | None = None, placement=None,
                         logprobs: bool = False) -> GenerateOutput:
  """Speculative decoding whose output distribution is exactly the target's.

  Prefill and the whole draft -> verify -> accept -> roll back loop run as one jitted
  `lax.while_loop`; rows accept different numbers of tokens.

  Args:
    target: the target `Model`.
    drafter: a `Drafter` (`NGram()`, `DraftModel(small_model)`, `load_head(dir, target)`), or
      a name: "ngram", "eagle" / "medusa" / "mlp" (the heads bundled for SmolLM2), a head
      directory or a draft model's path (see `jaxspec.drafters.resolve_drafter`).
    prompts: a string, list of strings, or list of token-id lists.
    max_new_tokens: tokens to generate per row.
    sampling: `Sampling(temperature, top_k, top_p, min_p)`; default greedy.
    num_draft_tokens: k, drafts per step, or "auto" (default): every step chooses k in
      0..k_max from the measured acceptance and step costs (k = 0 is a plain decode step).
    key: PRNG key or int seed, or one key per row (a key array [B]; see `generate`).
    stop_ids: tokens that end a row; default the target's EOS ids.
    max_len: cache size; default just enough (prompt + max_new_tokens + k + 1).
    temperature: shorthand for `sampling=Sampling(temperature=...)`.
    auto: `AutoK(k_max, buckets, decay, prior, margin)` for num_draft_tokens="auto".
    cost: a `CostModel` of step time per k; with "auto" and none given, it is measured once
      for this batch, cache size and drafter (cached for later calls).
    placement: a `jaxspec.sharding.Placement(target=mesh_a, drafter=mesh_b)`. The target is
      laid out on mesh_a; with mesh_b the same mesh the fused loop runs there, otherwise the
      host-orchestrated loop (draft on mesh_b, verify on mesh_a, small arrays handed across).
      Default: the fused loop where the target's weights are (on their mesh when the target
      was sharded with `jaxspec.sharding.shard_model`).
  Returns:
    `GenerateOutput`; `stats` adds target_passes, drafted/accepted per row, acceptance rate per
    draft position, the mean acceptance length tau (tokens emitted per verify pass, counting
    the bonus token) and the k chosen at every step.
  """
  drafter, sp_user, policy, prep = prepare_spec(target, drafter, prompts, max_new_tokens,
                                                sampling, num_draft_tokens, auto, cost, max_len,
                                                temperature, logprobs)
  run = make_run(target, drafter, prep, sp_user, policy, stop_ids_for(target, stop_ids),
                 int(max_new_tokens), key, cost, placement)
  t0 = time.perf_counter()
  state = run.start()
  state = run.target_state(run.loop(state, run.max_steps))
  outs = jax.block_until_ready(fused.outputs_jit(state, int(max_new_tokens)))
  dt = time.perf_counter() - t0 - run.profile_seconds
  run.finish(state)
  toks, n_out, *lp = to_host(outs)
  stats = run.stats(state.stats)
  new = int(n_out.sum())
  stats.update(seconds=dt, new_tokens=new, tokens_per_second=new / dt if dt > 0 else float("inf"))
  return GenerateOutput(tokens=toks, lengths=n_out, prompt_lengths=prep.lengths,
                        texts=decode_texts(target, toks, n_out), stats=stats,
                        logprobs=lp[0] if lp else None)


def speculative_stream(target: Model, drafter: Drafter, prompt, *, max_new_tokens: int = 128,
                       sampling: Sampling | None = None, num_draft_tokens: int | str = "auto",
                       key=None, stop_ids: Sequence[int] | None = None, chunk: int = 4,
                       auto: AutoK | None = None, cost: CostModel | None = None):
  """Speculative decoding of one prompt, yielding (new tokens, info) every `chunk` verify steps.

  The same prefill and loop body as `speculative_generate`, run in chunks so a CLI can print
  text as it is produced; `info["stats"]` holds the statistics once the row is done.
  """
  chunk = check_chunk(chunk)
  drafter, sp_user, policy, prep = prepare_spec(target, drafter, prompt, max_new_tokens,
                                                sampling, num_draft_tokens, auto, cost, None,
                                                None)
  run = SpecRun(target, drafter, prep, sp_user, policy, stop_ids_for(target, stop_ids),
                int(max_new_tokens), key, cost)
  t0 = time.perf_counter()
  state = jax.block_until_ready(run.start())
  t0 += run.profile_seconds

  def view(s: SpecState):
    p0, n0 = int(np.asarray(s.prompt_len)[0]), int(np.asarray(s.seq_len)[0])
    return (np.asarray(s.seq)[0, p0:n0], bool(np.asarray(s.done).all()),
            int(s.stats.target_passes))

  for new, info in stream_loop(run.loop, view, state, chunk, t0):
    s = info.pop("state")
    info["stats"] = run.stats(s.stats)
    info["compile_seconds"] = run.compile_seconds
    info["profile_seconds"] = run.profile_seconds
    yield new, info
  run.finish(s)


def load(name_or_path=None, dtype: str | None = None, *, mesh=None, rules=None,
         scan_layers: bool | None = None, compute_dtype: str | None = None,
         allow_nonfinite: bool = False) -> Model:
  """Loads a model by name or path (`jaxspec.models.load`), laid out on `mesh` when given.

  Args:
    name_or_path: None or "smollm2-135m" / "smollm2-135m-instruct" for the bundled GGUF; a path
      to a `.gguf` file; or a Hugging Face model directory (config.json + safetensors).
    dtype: parameter dtype, "float32" or "bfloat16"; default the checkpoint's (bfloat16 for a
      bfloat16 checkpoint, float32 otherwise).
    mesh: a `jax.sharding.Mesh`: every device receives only its shard of each weight as the
      checkpoint is read (`jaxspec.sharding.rules.load_sharded`). The checkpoint's
      configuration (Hugging Face or GGUF) is checked against the mesh before any weight is
      read.
    rules: `jaxspec.sharding.ShardingRules` for `mesh` (default tensor x data parallel).
    scan_layers: stacked (True) or unrolled (False) layers; default the backend's.
    compute_dtype: None (activations, products and the KV cache in `dtype`) or "float32"
      (those in float32 over bfloat16 weights: greedy speculative output then equals plain
      greedy output as a float32 model's does; see `jaxspec.models.load`).
    allow_nonfinite: load weights holding NaN or infinite values; by default each tensor is
      checked as it is converted, and such a weight is a CheckpointError naming it.
  Raises:
    CheckpointError: unknown name, missing path, a checkpoint that cannot be read, or one
      whose weights hold NaN or infinite values (without `allow_nonfinite`).
    ValueError: the mesh does not divide the model's heads, MLP width or vocabulary.
  """
  if mesh is None:
    if rules is not None:
      raise ValueError("rules= lays a model out on a mesh: pass mesh= too")
    return models_loading.load(name_or_path, dtype, scan_layers=scan_layers,
                               compute_dtype=compute_dtype, allow_nonfinite=allow_nonfinite)
  models_loading.check_compute_dtype(compute_dtype)
  return models_loading.with_compute_dtype(sharding_rules.load_sharded(
      name_or_path, mesh, dtype=dtype, rules=rules, scan_layers=scan_layers,
      allow_nonfinite=allow_nonfinite), compute_dtype)
