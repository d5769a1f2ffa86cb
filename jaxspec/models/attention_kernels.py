"""Pallas kernels for the cached part of `llama.attention`, one per accelerator backend.

Both read the whole [L, B, G, S, K] cache in place at a layer index (no per-layer copy) and
only the blocks a row can see: [lo[b], length[b]) rounded out to blocks, where lo[b] is the
oldest position a sliding window of the row still sees (0 without a window). Each query row
masks what lies outside its own [qlo, length). They return the attention over the cache alone,
normalised, with its log-sum-exp, so the caller merges it with the new block's scores (which
the cache does not hold yet) by `merge`.

- `triton_cache_attention` (GPUs, Pallas' Triton lowering): a grid of (batch, kv head, split);
  each program walks its share of the row's visible blocks with an online softmax, so short
  batches still fill the GPU (flash-decoding's split of the sequence).
- `mosaic_cache_attention` (TPUs, Pallas' Mosaic lowering): a grid of (batch, kv head, block)
  whose cache index map clamps every block outside a row's visible range to the nearest
  visible one, so the pipeline re-uses the block already fetched instead of reading another,
  and the kernel skips its arithmetic.

The queries of one kv head come as one [R * T, K] matrix (R query heads per kv head, T new
tokens), the layout `llama.attention` already builds. The functions are jitted: every layer of
a model calls them with the same shapes, so each kernel is traced once, not once per layer
(`lax.platform_dependent` traces every platform's branch, the CPU's program included).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu

# A score no query keeps: finite, so masked maxima never make inf - inf.
_NEG = -1e30
# Mosaic keeps per-row statistics lane-replicated: a [rows, 128] array is one vreg column.
_LANES = 128


def _softcap(x, cap):
  return x if cap is None else jnp.tanh(x / cap) * cap


def _pow2_at_least(n: int, least: int) -> int:
  p = least
  while p < n:
    p *= 2
  return p


def triton_supports(head_dim: int, s_len: int, block: int = 64) -> bool:
  """Whether `triton_cache_attention` takes a cache of this head size and length: Triton tiles
  are powers of two (the head size is one tile's width) and the blocks must fit the cache."""
  return head_dim >= 16 and head_dim & (head_dim - 1) == 0 and s_len >= min(block, 16)


def _triton_block(s_len: int, block: int) -> int:
  """The largest power of two <= block that fits the cache (at least 16)."""
  b = 16
  while b * 2 <= min(block, s_len):
    b *= 2
  return b


@functools.partial(jax.jit, static_argnames=("scale", "cap", "block", "splits", "interpret"))
def triton_cache_attention(q, k_cache, v_cache, layer, length, lo, qlo, *, scale: float,
                           cap: float | None, block: int = 64, splits: int | None = None,
                           interpret: bool = False):
  """Attention of grouped queries over one layer's visible cache, as a Pallas Triton kernel.

  Args:
    q: [B, G, M, K] queries grouped by kv head (M = R * T rows).
    k_cache, v_cache: [L, B, G, S, K] the whole cache; only `layer`'s blocks are read.
    layer: int32 scalar, the layer to read.
    length: [B] int32, cached positions per row (the read stops there).
    lo: [B] int32, the oldest position any query of the row sees (blocks before it are
      skipped).
    qlo: [B, M] int32, the oldest position each query row sees (its window's start, else 0).
    scale, cap: the scores' scale and soft-cap (None: none).
    block: positions per block (a power of two, at most S).
    splits: programs per (row, kv head), each walking a contiguous share of the row's blocks;
      None: enough for about 256 programs in all.
    interpret: run in Pallas' interpreter (any backend; for tests).
  Returns:
    (out [B, G, n, M, K] float32, lse [B, G, n, M] float32): per split, the normalised
    attention and its log-sum-exp (-1e30 where a split saw nothing); `merge` combines them.
  """
  b, g, m, kd = q.shape
  s_len = k_cache.shape[3]
  blk = _triton_block(s_len, block)
  mp = _pow2_at_least(m, 16)  # Triton's dot wants at least 16 rows
  n_blocks = pl.cdiv(s_len, blk)
  if splits is None:
    splits = max(1, min(n_blocks, 256 // (b * g)))
  q = jnp.pad(q, ((0, 0), (0, 0), (0, mp - m), (0, 0)))
  # Padded query rows see nothing (qlo past every position).
  qlo = jnp.pad(qlo.astype(jnp.int32), ((0, 0), (0, mp - m)), constant_values=s_len)
  f32 = q.dtype == jnp.float32

  def kernel(layer_ref, len_ref, lo_ref, q_ref, qlo_ref, k_ref, v_ref, o_ref, lse_ref):
    bi, gi, si = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    li = layer_ref[0]
    hi = len_ref[bi]
    row_first = lo_ref[bi]
    first = lax.div(row_first, blk)
    last = lax.div(hi + blk - 1, blk)
    per = lax.div(jnp.maximum(last - first, 0) + splits - 1, splits)
    begin = first + si * per
    end = jnp.minimum(begin + per, last)
    qv = q_ref[...]  # [Mp, K]
    row_lo = qlo_ref[...]  # [Mp]

    def body(i, carry):
      mx, l, acc = carry
      # A last block that would run past the cache is read ending at its end; the positions
      # it shares with the block before are masked out.
      start = jnp.minimum(i * blk, s_len - blk)
      kb = k_ref[li, bi, gi, pl.ds(start, blk), :]  # [blk, K]
      vb = v_ref[li, bi, gi, pl.ds(start, blk), :]
      s = plgpu.dot(qv, kb, trans_b=True, allow_tf32=not f32).astype(jnp.float32)
      s = _softcap(s * scale, cap)
      pos = start + jnp.arange(blk)
      in_row = (pos >= i * blk) & (pos < hi) & (pos >= row_first)
      vis = in_row[None, :] & (pos[None, :] >= row_lo[:, None])
      s = jnp.where(vis, s, _NEG)
      mx2 = jnp.maximum(mx, s.max(axis=1))
      p = jnp.where(vis, jnp.exp(s - mx2[:, None]), 0.0)
      c = jnp.exp(mx - mx2)
      # Values the row may not see are zeroed, not only weighted by 0: whatever a position
      # past the row's length holds (inf, NaN) cannot reach the output.
      vb = jnp.where(in_row[:, None], vb, jnp.zeros_like(vb))
      pv = plgpu.dot(p.astype(vb.dtype), vb, allow_tf32=not f32).astype(jnp.float32)
      return mx2, l * c + p.sum(axis=1), acc * c[:, None] + pv

    init = (jnp.full((mp,), _NEG, jnp.float32), jnp.zeros((mp,), jnp.float32),
            jnp.zeros((mp, kd), jnp.float32))
    mx, l, acc = lax.fori_loop(begin, end, body, init)
    seen = l > 0
    o_ref[...] = acc / jnp.where(seen, l, 1.0)[:, None]
    lse_ref[...] = jnp.where(seen, mx + jnp.log(jnp.where(seen, l, 1.0)), _NEG)

  whole = lambda a: pl.BlockSpec(a.shape, lambda *_: (0,) * a.ndim)
  out, lse = pl.pallas_call(
      kernel,
      grid=(b, g, splits),
      in_specs=[
          whole(layer), whole(length), whole(lo),
          pl.BlockSpec((None, None, mp, kd), lambda i, j, s: (i, j, 0, 0)),
          pl.BlockSpec((None, mp), lambda i, j, s: (i, 0)),
          whole(k_cache), whole(v_cache),
      ],
      out_specs=[
          pl.BlockSpec((None, None, None, mp, kd), lambda i, j, s: (i, j, s, 0, 0)),
          pl.BlockSpec((None, None, None, mp), lambda i, j, s: (i, j, s, 0)),
      ],
      out_shape=[jax.ShapeDtypeStruct((b, g, splits, mp, kd), jnp.float32),
                 jax.ShapeDtypeStruct((b, g, splits, mp), jnp.float32)],
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
      name="jaxspec_cache_attention",
  )(layer, length, lo, q, qlo, k_cache, v_cache)
  return out[..., :m, :], lse[..., :m]


def mosaic_supports(head_dim: int, s_len: int, block: int = 512) -> bool:
  """Whether `mosaic_cache_attention` takes a cache of this shape: its blocks are a multiple of
  16 positions (bfloat16's sublane tile) unless one block holds the whole cache."""
  return s_len <= block or block % 16 == 0


@functools.partial(jax.jit, static_argnames=("scale", "cap", "block", "interpret"))
def mosaic_cache_attention(q, k_cache, v_cache, layer, length, lo, qlo, *, scale: float,
                           cap: float | None, block: int = 512, interpret: bool = False):
  """Attention of grouped queries over one layer's visible cache, as a Pallas TPU kernel.

  Arguments as `triton_cache_attention`'s (`block`: positions per grid step; the whole cache
  when it holds no more).
  Returns:
    (out [B, G, 1, M, K] float32, lse [B, G, 1, M] float32), as `triton_cache_attention`'s with
    one split.
  """
  b, g, m, kd = q.shape
  s_len = k_cache.shape[3]
  blk = s_len if s_len <= block else block
  n_blocks = pl.cdiv(s_len, blk)

  def visible_blocks(bi, len_ref, lo_ref):
    # Truncating divisions of non-negative values: `//`'s floor lowers through `sign`, which
    # Mosaic lowers only knowing the TPU generation (not from a CPU host).
    return lax.div(lo_ref[bi], blk), lax.div(len_ref[bi] + blk - 1, blk)

  def cache_index(bi, gi, i, layer_ref, len_ref, lo_ref):
    first, last = visible_blocks(bi, len_ref, lo_ref)
    # Outside [first, last) the previous visible block again: the pipeline skips the copy.
    j = jnp.clip(i, first, jnp.maximum(last - 1, first))
    return layer_ref[0], bi, gi, jnp.minimum(j, n_blocks - 1), 0

  def kernel(layer_ref, len_ref, lo_ref, q_ref, qlo_ref, k_ref, v_ref, o_ref, lse_ref,
             m_sc, l_sc, acc_sc):
    bi, i = pl.program_id(0), pl.program_id(2)
    first, last = visible_blocks(bi, len_ref, lo_ref)

    @pl.when(i == 0)
    def _():
      m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
      l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
      acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

    @pl.when((i >= first) & (i < last))
    def _():
      qv = q_ref[...]  # [M, K]
      kb = k_ref[...]  # [blk, K]
      s = lax.dot_general(qv, kb, (((1,), (1,)), ((), ())),
                          preferred_element_type=jnp.float32)  # [M, blk]
      s = _softcap(s * scale, cap)
      pos = i * blk + lax.broadcasted_iota(jnp.int32, (m, blk), 1)
      vis = (pos < len_ref[bi]) & (pos >= qlo_ref[...])  # qlo [M, 1]
      s = jnp.where(vis, s, _NEG)
      m_prev = m_sc[...]  # [M, 128], every lane alike
      m_next = jnp.maximum(m_prev, s.max(axis=1, keepdims=True))
      p = jnp.where(vis, jnp.exp(s - m_next[:, :1]), 0.0)
      c = jnp.exp(m_prev - m_next)
      l_sc[...] = l_sc[...] * c + p.sum(axis=1, keepdims=True)
      m_sc[...] = m_next
      # Values the row may not see are zeroed, not only weighted by 0: whatever a position past
      # the row's length holds (inf, NaN; past the cache's end, what the buffer held) cannot
      # reach the output.
      vpos = i * blk + lax.broadcasted_iota(jnp.int32, (blk, kd), 0)
      vb = v_ref[...]
      vb = jnp.where((vpos < len_ref[bi]) & (vpos >= lo_ref[bi]), vb, jnp.zeros_like(vb))
      acc_sc[...] = acc_sc[...] * c[:, :1] + lax.dot_general(
          p.astype(vb.dtype), vb, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)

    @pl.when(i == n_blocks - 1)
    def _():
      l = l_sc[...]
      seen = l > 0
      o_ref[...] = acc_sc[...] / jnp.where(seen, l, 1.0)[:, :1]
      lse_ref[...] = jnp.where(seen, m_sc[...] + jnp.log(jnp.where(seen, l, 1.0)), _NEG)

  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=3,
      grid=(b, g, n_blocks),
      in_specs=[
          pl.BlockSpec((None, None, m, kd), lambda bi, gi, i, *_: (bi, gi, 0, 0)),
          pl.BlockSpec((None, m, 1), lambda bi, gi, i, *_: (bi, 0, 0)),
          pl.BlockSpec((None, None, None, blk, kd), cache_index),
          pl.BlockSpec((None, None, None, blk, kd), cache_index),
      ],
      out_specs=[
          pl.BlockSpec((None, None, m, kd), lambda bi, gi, i, *_: (bi, gi, 0, 0)),
          pl.BlockSpec((None, None, m, _LANES), lambda bi, gi, i, *_: (bi, gi, 0, 0)),
      ],
      scratch_shapes=[pltpu.VMEM((m, _LANES), jnp.float32),
                      pltpu.VMEM((m, _LANES), jnp.float32),
                      pltpu.VMEM((m, kd), jnp.float32)],
  )
  out, lse = pl.pallas_call(
      kernel,
      grid_spec=grid_spec,
      out_shape=[jax.ShapeDtypeStruct((b, g, m, kd), jnp.float32),
                 jax.ShapeDtypeStruct((b, g, m, _LANES), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=interpret,
      name="jaxspec_cache_attention",
  )(layer, length, lo, q, qlo.astype(jnp.int32)[:, :, None], k_cache, v_cache)
  return out[:, :, None], lse[:, :, None, :, 0]


def merge(parts_out, parts_lse, m_new, l_new, acc_new):
  """The softmax over the cache and the new block together.

  Args:
    parts_out: [B, G, n, M, K] normalised attention of n disjoint parts of the cache.
    parts_lse: [B, G, n, M] their log-sum-exps (-1e30: a part that saw nothing).
    m_new, l_new: [B, G, M, 1] the new block's maximum score and sum of exp(score - m_new)
      (every query sees itself, so m_new is a real score).
    acc_new: [B, G, M, K] the new block's sum of exp(score - m_new) * value.
  Returns:
    [B, G, M, K] float32
  """
  top = jnp.maximum(m_new[..., 0], parts_lse.max(axis=2))  # [B, G, M]
  w = jnp.exp(parts_lse - top[:, :, None])  # [B, G, n, M]
  c = jnp.exp(m_new[..., 0] - top)[..., None]  # [B, G, M, 1]
  num = acc_new * c + jnp.einsum("bgnm,bgnmk->bgmk", w, parts_out,
                                 precision=lax.Precision.HIGHEST)
  return num / (l_new * c + w.sum(axis=2)[..., None])


@functools.partial(jax.jit, static_argnames=("kernel", "interpret", "scale", "cap"))
def cached_attention(q, k_cache, v_cache, layer, length, qlo, s_new, v_new, *, kernel: str,
                     interpret: bool, scale: float, cap: float | None):
  """Attention over the cache (read by `kernel`) and the new block together.

  Args:
    q: [B, G, M, K] queries grouped by kv head.
    k_cache, v_cache, layer, length, qlo: as `triton_cache_attention`'s (lo is qlo's minimum).
    s_new: [B, G, M, T] the queries' scores against the new block, masked (-1e30) where a
      query may not see a new token.
    v_new: [B, G, T, K] the new block's values.
    kernel: "triton" or "mosaic".
  Returns:
    [B, G, M, K] float32
  """
  parts, lse = KERNELS[kernel](q, k_cache, v_cache, layer, length, qlo.min(axis=1), qlo,
                               scale=scale, cap=cap, interpret=interpret)
  m_new = s_new.max(-1, keepdims=True)
  p_new = jnp.exp(s_new - m_new)
  prec = lax.Precision.HIGHEST if v_new.dtype == jnp.float32 else None
  acc_new = jnp.einsum("bgmt,bgtk->bgmk", p_new.astype(v_new.dtype), v_new, precision=prec,
                       preferred_element_type=jnp.float32)
  return merge(parts, lse, m_new, p_new.sum(-1, keepdims=True), acc_new)


KERNELS = {"triton": triton_cache_attention, "mosaic": mosaic_cache_attention}
SUPPORTS = {"triton": triton_supports, "mosaic": mosaic_supports}
