"""Fitting a static tree to a Medusa drafter: its heads' measured top-k accuracies on the
target's own continuations (host-side: it runs `generate`), from which `Tree.from_accuracies`
builds a tree."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.api import generate
from jaxspec.models.llama import forward, init_cache


def medusa_accuracies(drafter, target, prompts, *, max_new_tokens: int = 128, topk: int = 10,
                      batch_size: int = 16) -> np.ndarray:
  """Measured top-k accuracies of a Medusa drafter's heads on the target's own continuations.

  The target answers `prompts` greedily; `acc[j, r]` is the share of response positions t at
  which head j's rank-r token (on f_t) is x_{t+2+j}, the token it drafts. This is the table
  `Tree.from_accuracies` builds a tree from. Use prompts that are not your evaluation set.
  """
  model = drafter.module(drafter.params)
  k = model.cfg.num_heads
  hits = np.zeros((k, topk))
  counts = np.zeros(k)

  @jax.jit
  def ranks(tparams, dparams, seq):
    _, hid, _ = forward(tparams, seq, init_cache(target.cfg, seq.shape[0], seq.shape[1]),
                        target.cfg, logits=False, fresh=True)
    lg = drafter.module(dparams).logits(dparams.target, hid.final)  # [B, T, K, V]
    return jax.lax.top_k(lg, topk)[1]  # [B, T, K, topk]

  for s in range(0, len(prompts), batch_size):
    chunk = prompts[s:s + batch_size]
    out = generate(target, chunk, max_new_tokens=max_new_tokens)
    for i, prompt in enumerate(chunk):
      seq = list(prompt) + out.row(i)
      width = -(-len(seq) // 64) * 64  # a few compiled widths
      arr = np.zeros((1, width), np.int32)
      arr[0, :len(seq)] = seq
      top = np.asarray(ranks(target.params, drafter.params, jnp.asarray(arr)))[0]
      for t in range(len(prompt) - 2, len(seq) - 2):
        for j in range(k):
          if t + 2 + j < len(seq):
            counts[j] += 1
            hit = np.flatnonzero(top[t, j] == seq[t + 2 + j])
            if len(hit):
              hits[j, hit[0]] += 1
  return hits / np.maximum(counts, 1)[:, None]


# EAGLE-2 shape for a tree of a given size (the number of candidate nodes): expand this many
# children per node, this deep (measured on SmolLM2 in benchmarks/bench_tree.py).
