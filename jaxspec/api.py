"""The public host functions: `generate` and `speculative_generate` (and their streaming forms)
take strings or token lists and return numpy arrays, texts and statistics. Each documents its
arguments and calls the default engine (`jaxspec.engine.DEFAULT`), which checks them, compiles
and keeps the loops of `jaxspec.decoding`, and runs them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import jax

from jaxspec.decoding.adaptive import AutoK, CostModel
from jaxspec.decoding.drafter import Drafter
from jaxspec.decoding.protocol import Target
from jaxspec.engine import DEFAULT, GenerateOutput
from jaxspec.models import loading as models_loading
from jaxspec.models.model import Model
from jaxspec.sampling import Sampling
from jaxspec.sharding import rules as sharding_rules

__all__ = ["GenerateOutput", "generate", "generate_stream", "load", "speculative_generate",
           "speculative_stream"]


def generate(model: Model | Target, prompts, *, max_new_tokens: int = 128,
             sampling: Sampling | None = None, key: jax.Array | int | None = None,
             stop_ids: Sequence[int] | None = None, max_len: int | None = None,
             temperature: float | None = None, logprobs: bool | int = False,
             prompt_logprobs: bool = False, stop: str | Sequence[str] | None = None,
             tokenizer=None, chat: bool | None = None, prompt_lengths=None,
             n: int = 1) -> GenerateOutput:
  """Plain autoregressive decoding of a batch of prompts, entirely on device.

  Args:
    model: a loaded `Model` (see `jaxspec.models.load`), or your own model: a
      `jaxspec.decoding.Target(lm, params)` binding any `CausalLM` to its weights (the same
      loop as `jaxspec.decoding.decode`, which takes it too).
    prompts: a string, list of strings, list of token-id lists (rows may differ in length), or
      an integer array ([P] one prompt, [B, P] a batch, right-padded when `prompt_lengths`
      is given). Strings need a tokenizer: the model's, or `tokenizer`.
    max_new_tokens: tokens to generate per row.
    sampling: `Sampling(temperature, top_k, top_p, min_p)`; default greedy. Values are passed as
      arrays, so changing them does not recompile.
    key: PRNG key or int seed for sampling (row b's randomness depends only on key and b),
      one key per row (a key array [B]: `jaxspec.sampling.row_keys(key, N)[i:j]` for prompts
      i..j-1 of N gives them the texts they get in one N-row call), or one integer seed per
      prompt (a list of ints, or an int array [B]): a prompt with seed s draws what it draws
      alone with key=s, whatever the batch and its position in it. With n > 1 these are the
      prompts' keys (or give B * n, one per row).
    stop_ids: tokens that end a row (included in the output); default the model's EOS ids
      (a jaxspec Model's configuration and tokenizer; an own `CausalLM`'s optional
      `eos_token_ids`), as `jaxspec.decoding.decode`'s default; () runs to max_new_tokens.
    max_len: KV-cache size; default just enough for the longest prompt plus max_new_tokens.
    temperature: shorthand for `sampling=Sampling(temperature=...)`.
    logprobs: True: each new token's log-probability (`GenerateOutput.logprobs`); an int N:
      also the N most likely tokens at its position and theirs (`top_ids`, `top_logprobs`;
      0 is True, as vLLM's logprobs=0).
    prompt_logprobs: also each prompt token's log-probability given its prefix
      (`GenerateOutput.prompt_logprobs`, one more forward pass over the prompts).
    stop: a string or strings that end a row where they first occur in its decoded text: the
      text ends before the stop string (it is not included), the tokens with the token that
      completed it (`GenerateOutput.stop_reasons` says which). The loop then runs in chunks of
      `jaxspec.engine.core.STOP_CHECK_STEPS` steps, the host checking the rows' text between
      them, and ends once every row has stopped. Needs a model with a tokenizer.
    tokenizer: what strings are encoded and texts decoded with (default the Model's own; an own
      model has none): anything with `encode(text) -> list[int]` (or an object with `.ids`, as
      the `tokenizers` library returns) and `decode(ids) -> str`, such as a jaxspec or Hugging
      Face tokenizer. For `chat`, a `chat_template` with jaxspec's `encode_chat(text)` or
      Hugging Face's `apply_chat_template(messages, add_generation_prompt=True, tokenize=False)`.
    chat: how a string prompt is encoded: None (default) renders it as one user message through
      the tokenizer's chat template where it has one, else encodes it as it is (what
      `jaxspec generate` does); True requires a template; False encodes the text as it is.
      Token-id prompts are never changed.
    prompt_lengths: [B] tokens of each token-id prompt (a list or an array; the rest of the row
      is padding), for a padded [B, P] array; default every token of every row.
    n: samples per prompt, as `jaxspec.decoding.decode`'s `n`: prompt b's row repeated n times,
      output rows prompt-major (row b * n + i is sample i of prompt b); sample 0 draws as with
      n = 1 and sample i from fold_in(prompt b's key, i), so a prompt's samples depend on its
      own key only (its seed, or fold_in(key, b)).
  Returns:
    `GenerateOutput` with tokens [B * n, max_new_tokens] (-1 past each row's length), lengths,
    texts (with a tokenizer) and stats (seconds, compile seconds, tokens/s). Batch sizes and
    max_new_tokens are bucketed (`jaxspec.engine.io.bucket_rows` / `bucket_new_tokens`), so
    nearby calls reuse one compiled program; the outputs are those of the exact sizes.
  Raises:
    ValueError: a bad argument (named, with the fix), before anything compiles.
  """
  return DEFAULT.generate(model, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                          key=key, stop_ids=stop_ids, max_len=max_len, temperature=temperature,
                          logprobs=logprobs, prompt_logprobs=prompt_logprobs, stop=stop,
                          tokenizer=tokenizer, chat=chat, prompt_lengths=prompt_lengths, n=n)


def generate_stream(model: Model | Target, prompts, *, max_new_tokens: int = 128,
                    sampling: Sampling | None = None, key=None,
                    stop_ids: Sequence[int] | None = None, chunk: int = 8,
                    max_len: int | None = None, logprobs: bool | int = False,
                    prompt_logprobs: bool = False, stop: str | Sequence[str] | None = None,
                    tokenizer=None, chat: bool | None = None, prompt_lengths=None, n: int = 1,
                    ) -> Iterator[tuple[list[list[int]], dict[str, Any]]]:
  """Plain decoding of a batch, yielding (new tokens of every row, info) after the prefill and
  every `chunk` steps: `new[b]` is row b's tokens since the last yield (empty once it is done),
  so each row's chunks joined are `generate`'s `out.row(b)` for the same arguments.

  The loop runs on device between yields (a `lax.while_loop` bounded by a traced step count), so
  streaming costs one host round-trip per chunk, not per token. Arguments as `generate`'s; a
  row that reaches a stop string yields its tokens up to the one that completed it.

  `info` holds: seconds (since the prefill began), first_chunk_seconds, compile_seconds,
  done ([B] bools), stats (target_passes so far); with logprobs, `logprobs` `[B][n]` for the
  yielded tokens, and with logprobs=N `top_ids` / `top_logprobs` `[B][n][N]`; and in the last
  yield `output`, the call's `GenerateOutput` (texts cut at stop strings, prompt_logprobs).
  (Before issue 49 a stream took one prompt and yielded row 0's tokens as a flat list.)
  """
  return DEFAULT.generate_stream(model, prompts, max_new_tokens=max_new_tokens, chunk=chunk,
                                 sampling=sampling, key=key, stop_ids=stop_ids, max_len=max_len,
                                 logprobs=logprobs, prompt_logprobs=prompt_logprobs, stop=stop,
                                 tokenizer=tokenizer, chat=chat, prompt_lengths=prompt_lengths,
                                 n=n)


def speculative_generate(target: Model | Target, drafter: Drafter, prompts, *,
                         max_new_tokens: int = 128, sampling: Sampling | None = None,
                         num_draft_tokens: int | str = "auto",
                         key: jax.Array | int | None = None,
                         stop_ids: Sequence[int] | None = None, max_len: int | None = None,
                         temperature: float | None = None, auto: AutoK | None = None,
                         cost: CostModel | None = None, placement=None,
                         logprobs: bool | int = False, prompt_logprobs: bool = False,
                         stop: str | Sequence[str] | None = None, tokenizer=None,
                         chat: bool | None = None, prompt_lengths=None,
                         n: int = 1) -> GenerateOutput:
  """Speculative decoding whose output distribution is exactly the target's.

  Prefill and the whole draft -> verify -> accept -> roll back loop run as one jitted
  `lax.while_loop`; rows accept different numbers of tokens.

  Args:
    target: the target `Model`, or your own model as a `jaxspec.decoding.Target(lm, params)`
      (any `CausalLM`, as `jaxspec.decoding.speculative_decode` takes it).
    drafter: a `Drafter` (`NGram()`, `DraftModel(small_model)`, `load_head(target, dir)`), or
      a name: "ngram", "suffix", "eagle" / "medusa" / "mlp" (the heads bundled for SmolLM2), a
      head directory or a draft model's path (see `jaxspec.drafters.resolve_drafter`). An own
      model takes "ngram", "suffix" or a `Drafter` (`NGram()`, `SuffixDecoding(...)`,
      `DraftModel(Target(draft_lm, draft_params))`); the other names need a jaxspec Model
      (ValueError).
    prompts: a string, list of strings, list of token-id lists, or an integer array (see
      `generate`).
    max_new_tokens: tokens to generate per row.
    sampling: `Sampling(temperature, top_k, top_p, min_p)`; default greedy.
    num_draft_tokens: k, drafts per step, or "auto" (default): every step chooses k in
      0..k_max from the measured acceptance and step costs (k = 0 is a plain decode step).
    key: PRNG key or int seed, one key per row (a key array [B]) or one seed per prompt (see
      `generate`).
    stop_ids: tokens that end a row; default the target's EOS ids (see `generate`).
    max_len: cache size; default just enough (prompt + max_new_tokens + k + 1).
    temperature: shorthand for `sampling=Sampling(temperature=...)`.
    auto: `AutoK(k_max, buckets, decay, prior, margin)` for num_draft_tokens="auto".
    cost: a `CostModel` of step time per k, such as an earlier run's `stats["cost_model"]`;
      with "auto" and none given, it is measured once for this batch, cache size and drafter
      (cached for later calls).
    placement: a `jaxspec.sharding.Placement(target=mesh_a, drafter=mesh_b)`. The target is
      laid out on mesh_a; with mesh_b the same mesh the fused loop runs there, otherwise the
      host-orchestrated loop (draft on mesh_b, verify on mesh_a, small arrays handed across).
      Default: the fused loop where the target's weights are (on their mesh when the target
      was sharded with `jaxspec.sharding.shard_model`). A jaxspec Model only.
    logprobs, prompt_logprobs: as `generate`'s; the top-N of a speculative token is that of
      the target's processed distribution at its position, as plain decoding reports it.
    stop: as `generate`'s; the loop runs in chunks of `jaxspec.engine.core.STOP_CHECK_PASSES`
      verify steps, the host checking the rows' text between them.
    tokenizer, chat, prompt_lengths, n: as `generate`'s (n samples per prompt, rows
      prompt-major, each sample's text the one `generate(..., n=n)` samples).
  Returns:
    `GenerateOutput`; `stats` adds target_passes, drafted/accepted per row, acceptance rate per
    draft position, the mean acceptance length tau (tokens emitted per verify pass, counting
    the bonus token), the k chosen at every step and, with "auto", `cost_model`: the
    `CostModel` it weighed (pass it as `cost=` to skip the timing; `to_dict()` for JSON),
    `cost_seconds` (the time spent timing it, apart from `compile_seconds`), `cost_source`
    ("measured", "cached" in this process, "disk" from an earlier one, or "given") and
    `acceptance_carried` (the pooled acceptance counts {tried, accepted} the call started from,
    `AutoK.carry`; None: the prior). Batch sizes
    and max_new_tokens are bucketed in the fused loop, as in `generate`.
  Raises:
    ValueError: a bad argument (named, with the fix), before anything compiles.
  """
  return DEFAULT.speculative_generate(
      target, drafter, prompts, max_new_tokens=max_new_tokens, num_draft_tokens=num_draft_tokens,
      placement=placement, sampling=sampling, temperature=temperature, auto=auto, cost=cost,
      max_len=max_len, stop_ids=stop_ids, key=key, logprobs=logprobs,
      prompt_logprobs=prompt_logprobs, stop=stop, tokenizer=tokenizer, chat=chat,
      prompt_lengths=prompt_lengths, n=n)


def speculative_stream(target: Model | Target, drafter: Drafter, prompts, *,
                       max_new_tokens: int = 128, sampling: Sampling | None = None,
                       num_draft_tokens: int | str = "auto", key=None,
                       stop_ids: Sequence[int] | None = None, chunk: int = 4,
                       auto: AutoK | None = None, cost: CostModel | None = None,
                       max_len: int | None = None, logprobs: bool | int = False,
                       prompt_logprobs: bool = False,
                       stop: str | Sequence[str] | None = None, tokenizer=None,
                       chat: bool | None = None, prompt_lengths=None, n: int = 1,
                       ) -> Iterator[tuple[list[list[int]], dict[str, Any]]]:
  """Speculative decoding of a batch, yielding (new tokens of every row, info) after the prefill
  and every `chunk` verify steps, as `generate_stream` does (the same `info`, whose `stats` are
  `speculative_generate`'s statistics so far, plus cost_seconds and cost_source).

  The same prefill and loop body as `speculative_generate`, run in chunks so a CLI can print
  text as it is produced. Arguments as `speculative_generate`'s (`target`, `tokenizer`, `chat`,
  `prompt_lengths`, `n` and the defaults included).
  """
  return DEFAULT.speculative_stream(target, drafter, prompts, max_new_tokens=max_new_tokens,
                                    num_draft_tokens=num_draft_tokens, chunk=chunk,
                                    sampling=sampling, auto=auto, cost=cost, stop_ids=stop_ids,
                                    key=key, max_len=max_len, logprobs=logprobs,
                                    prompt_logprobs=prompt_logprobs, stop=stop,
                                    tokenizer=tokenizer, chat=chat, prompt_lengths=prompt_lengths,
                                    n=n)


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
