"""chunk_pass: block-major statistics reduced over chunks of blocks.

The Mosaic GPU block pass leaves its statistics vocabulary-block-major,
[NB, B] (kernels/mosaic_block_pass.py says why). A select program that
draws for one request then reads a strided column of NB words from each
array, a memory sector a word: at B = 256 and NB = 2020 that made the select
13.8 us a step against ~6.9 on request-major statistics (docs/perf-notes.md
change 37). This pass reads the statistics the way they lie, whole rows of
requests, and reduces each chunk of ``chunk`` consecutive blocks to the
same three numbers a block has: for chunk c (blocks c * chunk to
c * chunk + chunk - 1) and request b,

  chunk_max[c, b]    = max_j block_max[j, b]
  chunk_sum[c, b]    = sum_j block_sum[j, b] * exp(block_max[j, b] - m_c)
  chunk_argmax[c, b] = block_argmax[j, b] of the first block j with
                       block_max[j, b] == m_c and block_argmax[j, b] >= 0
                       (-1 where none is)

with m_c = chunk_max[c, b] where it is finite, else 0 (so an all -inf chunk
sums to 0). The select pass (``chunk`` given) then walks NB / chunk chunks,
the chosen chunk's blocks and the chosen block's logits: three short strided
reads where there was one long one.

One program per (chunk, tile of ``block_b`` requests); it loads [chunk,
block_b] tiles, each row contiguous.

With 128-request tiles the Mosaic pass folds this reduction into its own
epilogue (its ``chunk`` argument: each CTA a contiguous run of blocks), one
launch a step fewer; this pass serves its 64-request tiles, and is the
reference the fold is tested against.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_markov.kernels.named_call import named_call

INPUTS = ("block_max", "block_sum", "block_argmax")
OUTPUTS = ("chunk_max", "chunk_sum", "chunk_argmax")
# Blocks a chunk: with NB = 2020 (V = 129280, block_v = 64) the select reads
# 64 chunks, then 32 blocks, then 64 logits.
CHUNK = 32
# Requests a program: 128 contiguous words (512 bytes) a row of each tile.
BLOCK_B = 128


def num_chunks(num_blocks: int, chunk: int = CHUNK) -> int:
  """NC, the chunks of ``chunk`` blocks covering NB blocks."""
  return pl.cdiv(num_blocks, chunk)


def _chunk_pass_kernel(ins, outs, *, chunk: int, block_b: int,
                       num_blocks: int, batch: int):
  c, j = pl.program_id(0), pl.program_id(1)
  rows = pl.next_power_of_2(chunk)  # a tile's rows: chunk, padded
  tile = (rows, block_b)
  within = lax.broadcasted_iota(jnp.int32, tile, 0)
  blk = c * chunk + within
  req = j * block_b + lax.broadcasted_iota(jnp.int32, tile, 1)
  mask = (within < chunk) & (blk < num_blocks) & (req < batch)
  at = (pl.ds(c * chunk, rows), pl.ds(j * block_b, block_b))
  bmax = plgpu.load(ins["block_max"].at[at], mask=mask, other=-jnp.inf)
  barg = plgpu.load(ins["block_argmax"].at[at], mask=mask, other=-1)
  bsum = plgpu.load(ins["block_sum"].at[at], mask=mask, other=0.0)

  cmax = jnp.max(bmax, axis=0)
  # Blocks are in vocabulary order: the first block holding the chunk max
  # has the chunk's lowest index of it. A block index of -1 (no drawable
  # column) is skipped, as the select pass skips it.
  first = jnp.min(jnp.where((bmax == cmax[None, :]) & (barg >= 0), blk,
                            num_blocks), axis=0)
  carg = jnp.sum(jnp.where(blk == first[None, :], barg, 0), axis=0)
  carg = jnp.where(first < num_blocks, carg, -1)
  finite = (cmax > -jnp.inf) & (cmax < jnp.inf)
  c_safe = jnp.where(finite, cmax, 0.0)
  # -inf blocks (and the masked rows) weigh 0: exp(-inf) * 0.
  csum = jnp.sum(bsum * jnp.exp(bmax - c_safe[None, :]), axis=0)

  cols = j * block_b + jnp.arange(block_b)
  out = (c, pl.ds(j * block_b, block_b))
  plgpu.store(outs["chunk_max"].at[out], cmax, mask=cols < batch)
  plgpu.store(outs["chunk_sum"].at[out], csum, mask=cols < batch)
  plgpu.store(outs["chunk_argmax"].at[out], carg, mask=cols < batch)


@functools.partial(jax.jit, static_argnames=("chunk", "block_b", "interpret"))
def chunk_pass(block_max: jax.Array, block_sum: jax.Array,
               block_argmax: jax.Array, *, chunk: int = CHUNK,
               block_b: int = BLOCK_B, interpret: bool = False):
  """Reduces block-major block statistics over chunks of ``chunk`` blocks.

  Args:
    block_max, block_sum: float32 [NB, B], each block's max of y = x / T and
      sum of exp(y - max) (the Mosaic GPU block pass's statistics).
    block_argmax: int32 [NB, B], each block's first index of its max
      (a vocabulary index; -1: a block with no drawable column).
    chunk: blocks a chunk (static, >= 1; the Mosaic pass's chunks are its
      workers' runs, e.g. 31).
    block_b: requests a program (static, a power of two).
    interpret: run in the Pallas interpreter (CPU).

  Returns:
    (chunk_max, chunk_sum, chunk_argmax): float32, float32, int32
    [NC, B], NC = ceil(NB / chunk), as the module docstring defines them.

  Operands of the pallas_call (the order a native runtime binds pointers
  in): ``block_max, block_sum, block_argmax``, then the outputs
  ``chunk_max, chunk_sum, chunk_argmax``.
  """
  if chunk < 1:
    raise ValueError(f"chunk must be >= 1 blocks, got {chunk}")
  if block_b < 1 or block_b & (block_b - 1):
    raise ValueError(f"block_b must be a power of two, got {block_b}")
  num_blocks, batch = block_max.shape
  for name, x, dtype in (("block_sum", block_sum, jnp.float32),
                         ("block_argmax", block_argmax, jnp.int32),
                         ("block_max", block_max, jnp.float32)):
    if x.shape != (num_blocks, batch) or x.dtype != dtype:
      raise ValueError(f"{name} must be {jnp.dtype(dtype).name} "
                       f"[{num_blocks}, {batch}] (block-major, as block_max), "
                       f"got {x.dtype} {x.shape}")
  block_b = min(block_b, pl.next_power_of_2(batch))
  nc = num_chunks(num_blocks, chunk)
  kernel = functools.partial(_chunk_pass_kernel, chunk=chunk,
                             block_b=block_b, num_blocks=num_blocks,
                             batch=batch)
  stat = lambda dtype: jax.ShapeDtypeStruct((nc, batch), dtype)
  out = named_call(
      kernel, dict(block_max=block_max, block_sum=block_sum,
                   block_argmax=block_argmax),
      dict(chunk_max=stat(jnp.float32), chunk_sum=stat(jnp.float32),
           chunk_argmax=stat(jnp.int32)),
      grid=(nc, pl.cdiv(batch, block_b)),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret, name="markov_chunk_pass")
  return out["chunk_max"], out["chunk_sum"], out["chunk_argmax"]
