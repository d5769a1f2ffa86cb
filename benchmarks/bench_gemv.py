"""How fast XLA CPU streams a decode step's weights: SmolLM2-135M's 30 layers of matmuls at
one row (the batch-1 decode step without attention), random float32 weights of the real shapes,
held output-major as jaxspec holds them on CPU.

Four forms, best of 15 interleaved runs each: the seven products of a layer as jaxspec runs them
(plain, and in blocks of 64 output rows), and with q/k/v and gate/up fused into one product each
(what llama.cpp and vLLM load), against one large matrix-vector product (the attainable
bandwidth). Run it with `taskset -c 0` for one thread.

    .venv/bin/python benchmarks/bench_gemv.py
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

D, F, KV, L = 576, 1536, 192, 30  # SmolLM2-135M: width, MLP width, k/v width, layers


def _mm(x, w, blocked):
  o, i = w.shape
  if blocked and o % 64 == 0 and o > 64:
    y = jnp.einsum("xi,nci->nxc", x, w.reshape(o // 64, 64, i))
    return jnp.swapaxes(y, 0, 1).reshape(x.shape[0], o)
  return jnp.einsum("xi,oi->xo", x, w)


def _separate(layers, x, blocked):
  for w in layers:
    q, k, v = (_mm(x, w[n], blocked) for n in ("q", "k", "v"))
    h = x + _mm(q + 1e-3 * (k.sum() + v.sum()), w["o"], blocked)
    x = h + _mm(jax.nn.silu(_mm(h, w["g"], blocked)) * _mm(h, w["u"], blocked), w["d"], blocked)
  return x


def _fused(layers, x, blocked):
  for w in layers:
    qkv = _mm(x, w["qkv"], blocked)
    q, k, v = qkv[:, :D], qkv[:, D:D + KV], qkv[:, D + KV:]
    h = x + _mm(q + 1e-3 * (k.sum() + v.sum()), w["o"], blocked)
    gu = _mm(h, w["gu"], blocked)
    x = h + _mm(jax.nn.silu(gu[:, :F]) * gu[:, F:], w["d"], blocked)
  return x


def main():
  rng = np.random.default_rng(0)
  mk = lambda o, i: jnp.asarray(rng.standard_normal((o, i), dtype=np.float32) * 0.02)
  sep = [dict(q=mk(D, D), k=mk(KV, D), v=mk(KV, D), o=mk(D, D), g=mk(F, D), u=mk(F, D),
              d=mk(D, F)) for _ in range(L)]
  fus = [dict(qkv=jnp.concatenate([w["q"], w["k"], w["v"]]), o=w["o"],
              gu=jnp.concatenate([w["g"], w["u"]]), d=w["d"]) for w in sep]
  big = mk(4 * 49152, D)  # 453 MB: one product large enough to reach memory speed
  x = jnp.full((1, D), 0.1, jnp.float32)
  runs = {
      "7 products a layer": (jax.jit(lambda p, x: _separate(p, x, False)), sep),
      "7 products, 64-row blocks": (jax.jit(lambda p, x: _separate(p, x, True)), sep),
      "q/k/v and gate/up fused": (jax.jit(lambda p, x: _fused(p, x, False)), fus),
      "fused, 64-row blocks": (jax.jit(lambda p, x: _fused(p, x, True)), fus),
      "one 453 MB product": (jax.jit(lambda w, x: x @ w.T), big),
  }
  for f, p in runs.values():
    f(p, x).block_until_ready()
  best = dict.fromkeys(runs, float("inf"))
  for _ in range(15):
    for name, (f, p) in runs.items():
      t0 = time.perf_counter()
      f(p, x).block_until_ready()
      best[name] = min(best[name], time.perf_counter() - t0)
  layer_bytes = sum(w.nbytes for layer in sep for w in layer.values())
  print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}; best of 15")
  for name, t in best.items():
    nbytes = big.nbytes if name.startswith("one") else layer_bytes
    print(f"  {name:28s} {t * 1e3:7.2f} ms  {nbytes / t / 1e9:5.1f} GB/s")


if __name__ == "__main__":
  main()
