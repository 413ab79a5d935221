"""The select pass: one program per request and step.

It combines the block statistics of the block pass into the row max m and the
normaliser Z, then draws:

* greedy (T == 0, padding, or m not finite): the lowest index of the row max,
  from the first block holding m and that block's first-max index;
* otherwise the inverse CDF: the first block whose running mass exceeds u * Z,
  then, reading only that block of logits back from the cache, the first index
  whose running sum exceeds u * Z. One exp per logit of that block.

and looks up the drawn token's embedding row for the next step.

Invariant: the token is always in [0, V) and its p_j > 0 whenever the row has a
drawable token; float32 rounding that leaves u * Z past the last partial sum
clamps to the last block / index with positive mass, never to a -inf logit.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def _select_pass_kernel(*refs, dense: bool, num_blocks: int, blocks_pow2: int,
                        block_v: int, steps: int, vocab: int, rank: int,
                        rank_pow2: int):
  bmax_ref, bsum_ref, barg_ref, cache_ref, step_ref, *refs = refs
  cache_rows_ref = None if dense else refs.pop(0)
  scale_ref, greedy_ref, u_ref, embed_ref, tokens_ref, emb_next_ref = refs
  b = pl.program_id(0)
  d = b * steps + step_ref[0]  # this draw's flat index in the [B * S] arrays
  blk = jnp.arange(blocks_pow2)
  blk_mask = blk < num_blocks
  bmax = plgpu.load(bmax_ref.at[pl.ds(0, blocks_pow2), b], mask=blk_mask,
                    other=-jnp.inf)
  bsum = plgpu.load(bsum_ref.at[pl.ds(0, blocks_pow2), b], mask=blk_mask,
                    other=0.0)
  m = jnp.max(bmax)
  finite = (m > -jnp.inf) & (m < jnp.inf)
  greedy = (greedy_ref[d] != 0) | jnp.logical_not(finite)

  # Greedy: the first block whose max is the row max (blocks are in vocabulary
  # order, so its first-max index is the row's lowest index of the max).
  first_max_block = jnp.min(jnp.where(bmax == m, blk, blocks_pow2))
  first_max_block = jnp.minimum(first_max_block, num_blocks - 1)
  greedy_token = barg_ref[first_max_block, b]

  # Inverse CDF, level 1: blocks. m is finite on this path; -inf blocks weigh 0.
  m_safe = jnp.where(finite, m, 0.0)
  mass = bsum * jnp.exp(bmax - m_safe)
  running = jax.lax.cumsum(mass, axis=0)
  target = u_ref[d] * jnp.max(running)
  k = jnp.sum((running <= target).astype(jnp.int32))
  last_block = jnp.max(jnp.where(mass > 0, blk, -1))
  k = jnp.clip(jnp.minimum(k, last_block), 0, num_blocks - 1)
  prefix = jnp.sum(jnp.where(blk < k, mass, 0.0))

  # Level 2: inside block k, from the logits the block pass cached.
  v0 = k * block_v
  col = jnp.arange(block_v)
  v_mask = v0 + col < vocab
  # Padding draws (row -1) are greedy: any row in range serves.
  row = d if dense else jnp.maximum(cache_rows_ref[d], 0)
  x = plgpu.load(cache_ref.at[row, pl.ds(v0, block_v)], mask=v_mask,
                 other=-jnp.inf)
  y = jnp.where(x == x, x, -jnp.inf) * scale_ref[d]
  y = jnp.where(v_mask, y, -jnp.inf)
  p = jnp.exp(y - m_safe)
  running_v = jax.lax.cumsum(p, axis=0) + prefix
  idx = jnp.sum((running_v <= target).astype(jnp.int32))
  last_idx = jnp.max(jnp.where(p > 0, col, -1))
  # p can underflow to 0 in a block whose block-pass mass was positive: then
  # that block's own argmax is the drawable token left.
  sampled = jnp.where(last_idx >= 0, v0 + jnp.minimum(idx, last_idx),
                      barg_ref[k, b])

  token = jnp.where(greedy, greedy_token, sampled)
  token = jnp.clip(token, 0, vocab - 1)  # the embedding lookup stays in range
  tokens_ref[b] = token

  r = jnp.arange(rank_pow2)
  r_mask = r < rank
  emb = plgpu.load(embed_ref.at[token, pl.ds(0, rank_pow2)], mask=r_mask,
                   other=0)
  plgpu.store(emb_next_ref.at[b, pl.ds(0, rank_pow2)], emb, mask=r_mask)


def select_pass(block_max: jax.Array, block_sum: jax.Array,
                block_argmax: jax.Array, cache: jax.Array, step: jax.Array,
                scale: jax.Array, greedy: jax.Array, u: jax.Array,
                embed: jax.Array, cache_rows: jax.Array | None = None, *,
                num_steps: int, block_v: int, num_warps: int = 4,
                interpret: bool = False):
  """Runs the select pass of one step.

  Args:
    block_max, block_sum, block_argmax: [NB, B] from the block pass.
    cache: float32 [rows, V], the cache the block pass just wrote.
    step: int32 [1], the step s; draw (b, s) is flat index b * S + s of the
      per-draw arrays.
    scale: float32 [B * S], 1 / T (1 where greedy).
    greedy: int32 [B * S], nonzero where the draw is the argmax.
    u: float32 [B * S], the uniforms.
    embed: [V_in, R], the Markov head's embedding table.
    cache_rows: int32 [B * S], the cache row of each draw (-1: padding, which
      must be greedy); None for the dense layout (row b * S + s).
    num_steps: S (static).
    block_v: the block pass's block size.
    num_warps: Triton launch parameter.
    interpret: run in the Pallas interpreter (CPU).

  Returns:
    (tokens int32 [B], emb_next [B, R] in embed's dtype: embed[tokens]).
  """
  num_blocks, batch = block_max.shape
  vocab = cache.shape[1]
  rank = embed.shape[1]
  dense = cache_rows is None
  kernel = functools.partial(
      _select_pass_kernel, dense=dense, num_blocks=num_blocks,
      blocks_pow2=pl.next_power_of_2(num_blocks), block_v=block_v,
      steps=num_steps, vocab=vocab, rank=rank,
      rank_pow2=pl.next_power_of_2(rank))
  rows = () if dense else (cache_rows,)
  return pl.pallas_call(
      kernel,
      out_shape=(jax.ShapeDtypeStruct((batch,), jnp.int32),
                 jax.ShapeDtypeStruct((batch, rank), embed.dtype)),
      grid=(batch,),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="markov_select_pass",
  )(block_max, block_sum, block_argmax, cache, step, *rows, scale, greedy, u,
    embed)
