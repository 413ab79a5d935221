"""The select pass: one program per request and step.

It combines the block statistics of the block pass into the row max m and the
normaliser Z, then draws:

* greedy (T == 0, padding, or m not finite): the lowest index of the row max,
  from the first block holding m and that block's first-max index;
* otherwise the inverse CDF: the first block whose running mass exceeds u * Z,
  then, reading only that block of logits back from the cache, the first index
  whose running sum exceeds u * Z. One exp per logit of that block.

and writes the token to the draft's [B * S] token array, where the next
step's block pass reads it back (and gathers its embedding row itself; for
the Mosaic GPU block pass, which reads dense embeddings, the select pass can
write the token's row of ``embed`` to them instead, as vLLM's does). The
draw itself, :func:`draw_token`, is also what the block pass's tail select
runs (``select="tail"``), so the two forms draw identically.

Invariant: the token is always in [0, V) and its p_j > 0 whenever the row has a
drawable token; float32 rounding that leaves u * Z past the last partial sum
clamps to the last block / index with positive mass, never to a -inf logit.

Reduced draft vocabulary, sampling: the block pass walked the target
columns (its ``slots``), so the statistics and the cache are over the target
row (-inf where no draft id maps, weight 0) and the token is a target id:
nothing here differs from the full vocabulary.

With ``no_cache`` (greedy drafting, :func:`jax_markov.greedy_draft`) there is
no cache, no block sums and no parameters: the token is the row's first
argmax, from the block maxima and first-max indices alone. With a reduced
vocabulary (``columns`` given, int32 [Vd]) the statistics index draft
columns and the token is ``columns[j]`` for the argmax j. Invariant:
``columns`` is strictly increasing (the sampler sorts the map before any
kernel runs), so the lowest draft index of the max is the lowest target id
of the max.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_markov.kernels import dependent_launch as dependent_launch_module
from jax_markov.kernels.config import KernelConfig
from jax_markov.kernels.dependent_launch import wait_for_prior_kernels
from jax_markov.kernels.named_call import named_call

# The pallas_call's operands, in order: the inputs that are given, then the
# output, which updates the input tokens in place when that is given.
# columns (the reduced draft vocabulary's map) and the chunk statistics come
# last, so the order of the other operands is the same with them absent.
INPUTS = ("block_max", "block_sum", "block_argmax", "cache", "step", "params",
          "cache_rows", "tokens", "columns", "chunk_max", "chunk_sum",
          "chunk_argmax", "embed", "emb")
OUTPUTS = ("tokens", "emb")


def _to_target(token, columns_ref, vocab: int):
  """Clamps a draft column into [0, vocab) and maps it through columns."""
  # In range whatever the logits: the next step looks the token up in embed.
  token = jnp.clip(token, 0, vocab - 1)
  return token if columns_ref is None else columns_ref[token]


def _stats(ref, b, blocks_pow2: int, block_major: bool):
  """Request b's row of a statistics ref ([B, NB], or [NB, B] block-major)."""
  blocks = pl.ds(0, blocks_pow2)
  return ref.at[blocks, b] if block_major else ref.at[b, blocks]


def _first_argmax(bmax_ref, barg_ref, b, *, num_blocks: int,
                  blocks_pow2: int, block_major: bool = False):
  """(row max m, first (vocabulary) index of m) of request b's statistics."""
  blk = jnp.arange(blocks_pow2)
  bmax = plgpu.load(_stats(bmax_ref, b, blocks_pow2, block_major),
                    mask=blk < num_blocks, other=-jnp.inf)
  barg = plgpu.load(_stats(barg_ref, b, blocks_pow2, block_major),
                    mask=blk < num_blocks, other=-1)
  m = jnp.max(bmax)
  # The first block whose max is the row max (blocks are in vocabulary order,
  # so its first-max index is the row's lowest index of the max). A block
  # index of -1 (a target block no draft column maps to, all -inf) is skipped.
  first_max_block = jnp.min(jnp.where((bmax == m) & (barg >= 0), blk,
                                      blocks_pow2))
  first_max_block = jnp.minimum(first_max_block, num_blocks - 1)
  return bmax, m, jnp.sum(jnp.where(blk == first_max_block, barg, 0))


def greedy_token(bmax_ref, barg_ref, b, *, num_blocks: int, blocks_pow2: int,
                 vocab: int, columns_ref=None, block_major: bool = False):
  """The argmax token of request b from block maxima and first-max indices.

  What :func:`draw_token` draws for a greedy draw, reading no cache and no
  sums (the no-cache variant of greedy drafting). Returns a target id when
  columns_ref (increasing) is given, else an index in [0, vocab).
  """
  _, _, token = _first_argmax(bmax_ref, barg_ref, b, num_blocks=num_blocks,
                              blocks_pow2=blocks_pow2, block_major=block_major)
  return _to_target(token, columns_ref, vocab)


def draw_token(bmax_ref, bsum_ref, barg_ref, cache_ref, params_ref,
               cache_rows_ref, b, d, *, num_blocks: int, blocks_pow2: int,
               block_v: int, vocab: int, block_major: bool = False):
  """The token of draw d (request b) from its block statistics and cache row.

  Shared by the select pass and the block pass's tail select (the block pass
  program that finishes a step last), so both draw with the same float32
  arithmetic. The refs are as the select pass takes them; cache_rows_ref is
  None for the dense layout. vocab is the number of columns the statistics
  and the cache row cover. block_major: the statistics are [NB, B] (the
  Mosaic GPU block pass's), not [B, NB].
  """
  blk = jnp.arange(blocks_pow2)
  blk_mask = blk < num_blocks
  bmax, m, greedy_token = _first_argmax(bmax_ref, barg_ref, b,
                                        num_blocks=num_blocks,
                                        blocks_pow2=blocks_pow2,
                                        block_major=block_major)
  bsum = plgpu.load(_stats(bsum_ref, b, blocks_pow2, block_major),
                    mask=blk_mask, other=0.0)
  finite = (m > -jnp.inf) & (m < jnp.inf)
  greedy = (params_ref[1, d] != 0) | jnp.logical_not(finite)

  # Inverse CDF, level 1: blocks. m is finite on this path; -inf blocks weigh 0.
  m_safe = jnp.where(finite, m, 0.0)
  mass = bsum * jnp.exp(bmax - m_safe)
  running = jax.lax.cumsum(mass, axis=0)
  target = params_ref[2, d] * jnp.max(running)
  k = jnp.sum((running <= target).astype(jnp.int32))
  last_block = jnp.max(jnp.where(mass > 0, blk, -1))
  k = jnp.clip(jnp.minimum(k, last_block), 0, num_blocks - 1)
  prefix = jnp.sum(jnp.where(blk < k, mass, 0.0))

  # Level 2: inside block k, from the logits the block pass cached.
  v0 = k * block_v
  col = jnp.arange(block_v)
  v_mask = v0 + col < vocab
  # Padding draws (row -1) are greedy: any row in range serves.
  row = d if cache_rows_ref is None else jnp.maximum(cache_rows_ref[d], 0)
  x = plgpu.load(cache_ref.at[row, pl.ds(v0, block_v)], mask=v_mask,
                 other=-jnp.inf)
  y = jnp.where(x == x, x, -jnp.inf) * params_ref[0, d]
  y = jnp.where(v_mask, y, -jnp.inf)
  p = jnp.exp(y - m_safe)
  running_v = jax.lax.cumsum(p, axis=0) + prefix
  idx = jnp.sum((running_v <= target).astype(jnp.int32))
  last_idx = jnp.max(jnp.where(p > 0, col, -1))
  # p can underflow to 0 in a block whose block-pass mass was positive: then
  # that block's own argmax is the drawable token left.
  sampled = jnp.where(last_idx >= 0, v0 + jnp.minimum(idx, last_idx),
                      barg_ref[k, b] if block_major else barg_ref[b, k])

  token = jnp.where(greedy, greedy_token, sampled)
  return _to_target(token, None, vocab)


def draw_token_chunked(bmax_ref, bsum_ref, cmax_ref, csum_ref, carg_ref,
                       barg_ref, cache_ref, params_ref, cache_rows_ref, b, d,
                       *, num_blocks: int, chunk: int, num_chunks: int,
                       block_v: int, vocab: int):
  """:func:`draw_token` on block-major statistics and their chunk pass.

  The same draw through one more level: the chunks' statistics
  (kernels/chunk_pass.py, [NC, B]) choose the chunk and give the row max,
  the normaliser and the greedy token; then the chosen chunk's ``chunk``
  blocks, then that block's logits. Reads NC + chunk words of each
  statistic where draw_token reads NB. The running sums associate
  differently from draw_token's (a chunk's blocks are summed first), so a
  token may differ from its draw where u * Z falls within float32 rounding
  of a partial sum.
  """
  chunks_pow2 = pl.next_power_of_2(num_chunks)
  ch = jnp.arange(chunks_pow2)
  ch_mask = ch < num_chunks
  stats = pl.ds(0, chunks_pow2)
  cmax = plgpu.load(cmax_ref.at[stats, b], mask=ch_mask, other=-jnp.inf)
  carg = plgpu.load(carg_ref.at[stats, b], mask=ch_mask, other=-1)
  m = jnp.max(cmax)
  # As in _first_argmax, a chunk at a time: a chunk's first-max index is the
  # first of its blocks'; chunks with none (-1) are skipped.
  first_max_chunk = jnp.minimum(
      jnp.min(jnp.where((cmax == m) & (carg >= 0), ch, chunks_pow2)),
      num_chunks - 1)
  greedy_token = jnp.sum(jnp.where(ch == first_max_chunk, carg, 0))
  csum = plgpu.load(csum_ref.at[stats, b], mask=ch_mask, other=0.0)
  finite = (m > -jnp.inf) & (m < jnp.inf)
  greedy = (params_ref[1, d] != 0) | jnp.logical_not(finite)

  # Level 0: chunks. chunk_sum is relative to the chunk max where that is
  # finite, to 0 where it is -inf (and then 0): the factor is exp(-inf) = 0.
  m_safe = jnp.where(finite, m, 0.0)
  chunk_mass = csum * jnp.exp(cmax - m_safe)
  running = jax.lax.cumsum(chunk_mass, axis=0)
  target = params_ref[2, d] * jnp.max(running)
  k0 = jnp.sum((running <= target).astype(jnp.int32))
  last_chunk = jnp.max(jnp.where(chunk_mass > 0, ch, -1))
  k0 = jnp.clip(jnp.minimum(k0, last_chunk), 0, num_chunks - 1)
  prefix = jnp.sum(jnp.where(ch < k0, chunk_mass, 0.0))

  # Level 1: the blocks of chunk k0 (a chunk need not be a power of two:
  # the Mosaic pass's chunks are its workers' runs of blocks).
  chunk_pow2 = pl.next_power_of_2(chunk)
  j = jnp.arange(chunk_pow2)
  blk_mask = (j < chunk) & (k0 * chunk + j < num_blocks)
  blocks = pl.ds(k0 * chunk, chunk_pow2)
  bmax = plgpu.load(bmax_ref.at[blocks, b], mask=blk_mask, other=-jnp.inf)
  bsum = plgpu.load(bsum_ref.at[blocks, b], mask=blk_mask, other=0.0)
  mass = bsum * jnp.exp(bmax - m_safe)
  running_b = jax.lax.cumsum(mass, axis=0) + prefix
  kk = jnp.sum((running_b <= target).astype(jnp.int32))
  last_block = jnp.max(jnp.where(mass > 0, j, -1))
  # Every block's mass can underflow to 0 where the chunk's product did not:
  # then the chunk's max block, whose argmax is the likeliest token left.
  top_block = jnp.min(jnp.where(bmax == jnp.max(bmax), j, chunk_pow2))
  kk = jnp.clip(jnp.where(last_block >= 0, jnp.minimum(kk, last_block),
                          top_block), 0, chunk - 1)
  k = jnp.minimum(k0 * chunk + kk, num_blocks - 1)
  prefix = prefix + jnp.sum(jnp.where(j < kk, mass, 0.0))

  # Level 2: inside block k, as draw_token.
  v0 = k * block_v
  col = jnp.arange(block_v)
  v_mask = v0 + col < vocab
  row = d if cache_rows_ref is None else jnp.maximum(cache_rows_ref[d], 0)
  x = plgpu.load(cache_ref.at[row, pl.ds(v0, block_v)], mask=v_mask,
                 other=-jnp.inf)
  y = jnp.where(x == x, x, -jnp.inf) * params_ref[0, d]
  y = jnp.where(v_mask, y, -jnp.inf)
  p = jnp.exp(y - m_safe)
  running_v = jax.lax.cumsum(p, axis=0) + prefix
  idx = jnp.sum((running_v <= target).astype(jnp.int32))
  last_idx = jnp.max(jnp.where(p > 0, col, -1))
  sampled = jnp.where(last_idx >= 0, v0 + jnp.minimum(idx, last_idx),
                      barg_ref[k, b])

  token = jnp.where(greedy, greedy_token, sampled)
  return _to_target(token, None, vocab)


def _select_pass_kernel(ins, outs, *, num_blocks: int, blocks_pow2: int,
                        block_v: int, steps: int, vocab: int, no_cache: bool,
                        dependent_launch: bool, block_major: bool,
                        chunk: int | None, signal_first: bool = False):
  # Every access below reads what the block pass wrote, or writes what the
  # next step's block pass reads: all after the wait, through b.
  b = pl.program_id(0)
  if dependent_launch:
    b = b + wait_for_prior_kernels(dependent_launch,
                                   signal_first=signal_first)
  d = b * steps + ins["step"][0]  # this draw's flat index in the [B * S] arrays
  columns_ref = ins.get("columns")
  if no_cache:
    token = greedy_token(
        ins["block_max"], ins["block_argmax"], b, num_blocks=num_blocks,
        blocks_pow2=blocks_pow2, vocab=vocab, columns_ref=columns_ref,
        block_major=block_major)
  elif chunk is not None:
    token = draw_token_chunked(
        ins["block_max"], ins["block_sum"], ins["chunk_max"],
        ins["chunk_sum"], ins["chunk_argmax"], ins["block_argmax"],
        ins["cache"], ins["params"], ins.get("cache_rows"), b, d,
        num_blocks=num_blocks, chunk=chunk,
        num_chunks=ins["chunk_max"].shape[0], block_v=block_v, vocab=vocab)
  else:
    token = draw_token(
        ins["block_max"], ins["block_sum"], ins["block_argmax"], ins["cache"],
        ins["params"], ins.get("cache_rows"), b, d, num_blocks=num_blocks,
        blocks_pow2=blocks_pow2, block_v=block_v, vocab=vocab,
        block_major=block_major)
  # Written through the output ref: with tokens given, the same buffer as the
  # input of that name, which the kernel does not read.
  outs["tokens"][d] = token
  if "embed" in ins:
    # The next step's embedding row, as vLLM's select fetches it: the Mosaic
    # block pass reads a dense [B, R] operand, which this fills, so no
    # embed_rows launch runs a step. The token is in [0, vocab) by the
    # draw's clamp, and vocab <= the table's rows (select_pass checks).
    rank = ins["embed"].shape[1]
    rank_pow2 = pl.next_power_of_2(rank)
    cols = jnp.arange(rank_pow2)
    row = plgpu.load(ins["embed"].at[token, pl.ds(0, rank_pow2)],
                     mask=cols < rank, other=0)
    plgpu.store(outs["emb"].at[b, pl.ds(0, rank_pow2)], row,
                mask=cols < rank)


def select_pass(block_max: jax.Array, block_sum: jax.Array | None,
                block_argmax: jax.Array, cache: jax.Array | None,
                step: jax.Array, params: jax.Array | None,
                cache_rows: jax.Array | None = None,
                tokens: jax.Array | None = None, *, config: KernelConfig,
                num_steps: int, columns: jax.Array | None = None,
                vocab: int | None = None, no_cache: bool = False,
                dependent_launch: bool = False, stats_major: str = "request",
                chunk_stats: tuple[jax.Array, jax.Array, jax.Array] | None = None,
                chunk: int | None = None, embed: jax.Array | None = None,
                emb: jax.Array | None = None, interpret: bool = False):
  """Runs the select pass of one step.

  Args:
    block_max, block_sum, block_argmax: [B, NB] from the block pass ([NB, B]
      with stats_major="block").
    cache: float32 [rows, V], the cache the block pass just wrote.
    step: int32 [1], the step s; draw (b, s) is flat index b * S + s of the
      per-draw arrays.
    params: float32 [3, B * S], per draw: 1 / T (1 where greedy), 1 where
      the draw is the argmax (else 0), and the uniform u.
    cache_rows: int32 [B * S], the cache row of each draw (-1: padding, which
      must be greedy); None for the dense layout (row b * S + s).
    tokens: int32 [B * S] to update in place (the tokens of the steps
      before), or None to return a new array of which only this step's
      entries are written.
    config: the launch configuration; the select pass reads block_v (the
      block pass's) and select_warps.
    num_steps: S (static).
    columns: greedy drafting (no_cache) with a reduced draft vocabulary:
      int32 [Vd], strictly increasing (the caller sorts the map; the first
      argmax relies on it), the target id of each draft column. The
      statistics then cover the Vd draft columns and the token written is
      ``columns[j]`` for the argmax j. (Sampling with a reduced vocabulary
      needs no map here: its statistics and cache are over the target row.)
    vocab: the columns the statistics cover (static): V, or Vd with columns;
      None: ``cache.shape[1]``, or ``columns.shape[0]`` when columns is given.
      Required with no_cache and no columns.
    no_cache: greedy drafting (static): block_sum, cache, params and
      cache_rows are None, and every draw is the argmax from the block maxima
      and first-max indices (the block pass's no-cache variant).
    dependent_launch: build for a programmatic dependent launch (static;
      sm_90 or newer, not in the interpreter): the kernel waits for the
      kernels before it first thing, then lets the next one start (see
      :mod:`dependent_launch`).
    stats_major: "request" (the statistics are [B, NB], the Triton block
      pass's) or "block" ([NB, B], the Mosaic GPU block pass's: each request
      reads a strided column, from L2 where the block pass just wrote it).
    chunk_stats: with stats_major="block" and sampling, optionally
      (chunk_max, chunk_sum, chunk_argmax), float32 / float32 / int32
      [NC, B]: :func:`jax_markov.kernels.chunk_pass.chunk_pass` of these
      statistics. The draw then reads the chunks, one chunk's blocks and
      one block's logits (:func:`draw_token_chunked`) instead of a column
      of NB words a statistic.
    chunk: the blocks a chunk of chunk_stats (static); NC must be
      ceil(NB / chunk). Given exactly when chunk_stats is.
    embed: optionally the [V_in, R] embedding table (V_in >= vocab, no
      columns, sampling): each program then also writes its token's row to
      emb, the next step's embeddings (what kernels/embed_rows.py gathers).
    emb: with embed, the [B, R] buffer (embed's dtype) to update in place,
      or None for a new one.
    interpret: run in the Pallas interpreter (CPU).

  Returns:
    tokens int32 [B * S], with draw (b, s) at b * S + s written; with embed,
    (tokens, emb) where emb[b] = embed[the token of draw (b, s)].

  Operands of the pallas_call (the order a native runtime binds pointers
  in): the inputs that are given, in the order ``block_max, block_sum,
  block_argmax, cache, step, params, cache_rows, tokens, columns, chunk_max,
  chunk_sum, chunk_argmax, embed, emb``, then the outputs ``tokens`` (and
  ``emb`` with embed), each aliasing the input of its name where that is
  given (see :data:`INPUTS`, :data:`OUTPUTS`). The operands past tokens are
  optional, so without them the order is that of the plain select pass;
  with no_cache the inputs are ``block_max, block_argmax, step, tokens,
  columns`` (those given).
  """
  dependent_launch_module.check(dependent_launch, interpret=interpret)
  if stats_major not in ("request", "block"):
    raise ValueError(f"stats_major must be 'request' or 'block', got "
                     f"{stats_major!r}")
  block_major = stats_major == "block"
  batch, num_blocks = block_max.shape[::-1] if block_major else block_max.shape
  if no_cache != (cache is None) or (no_cache and any(
      x is not None for x in (block_sum, params, cache_rows))):
    raise ValueError("no_cache=True takes no block_sum, cache, params or "
                     "cache_rows; no_cache=False needs block_sum, cache and "
                     f"params (no_cache={no_cache})")
  if columns is not None and not no_cache:
    raise ValueError("columns maps draft columns for greedy drafting "
                     "(no_cache=True); sampling over a reduced vocabulary "
                     "draws from the target row and takes none")
  if vocab is None:
    if columns is not None:
      vocab = columns.shape[0]
    elif cache is not None:
      vocab = cache.shape[1]
    else:
      raise ValueError("select_pass with no_cache and no columns needs vocab")
  if columns is not None and columns.shape != (vocab,):
    raise ValueError(f"columns must be int32 [{vocab}] (one per draft "
                     f"column), got {columns.shape}")
  if (chunk_stats is None) != (chunk is None):
    raise ValueError("chunk_stats and chunk go together (the chunk pass's "
                     "outputs and its chunk size)")
  if chunk_stats is not None:
    if chunk < 1:
      raise ValueError(f"chunk must be >= 1 blocks, got {chunk}")
    if not block_major or no_cache:
      raise ValueError("chunk_stats reduce block-major statistics for "
                       "sampling: stats_major='block', no_cache=False")
    nc = pl.cdiv(num_blocks, chunk)
    for x, dtype in zip(chunk_stats, (jnp.float32, jnp.float32, jnp.int32)):
      if x.shape != (nc, batch) or x.dtype != dtype:
        raise ValueError(
            f"chunk_stats must be (float32, float32, int32) [{nc}, {batch}] "
            f"(ceil(NB / chunk) = ceil({num_blocks} / {chunk}) chunks), got "
            f"{[(str(y.dtype), y.shape) for y in chunk_stats]}")
  if embed is None and emb is not None:
    raise ValueError("emb is the buffer the next embeddings go to: it needs "
                     "embed")
  if embed is not None:
    if no_cache or embed.ndim != 2 or embed.shape[0] < vocab:
      raise ValueError(
          f"embed must be [V_in >= {vocab}, R], the table the drawn tokens "
          f"index, and is for sampling (no_cache=False); got {embed.shape} "
          f"with no_cache={no_cache}")
    if emb is not None and (emb.shape != (batch, embed.shape[1])
                            or emb.dtype != embed.dtype):
      raise ValueError(f"emb must be {embed.dtype} [{batch}, "
                       f"{embed.shape[1]}], got {emb.dtype} {emb.shape}")
  kernel = functools.partial(
      _select_pass_kernel, num_blocks=num_blocks,
      blocks_pow2=pl.next_power_of_2(num_blocks), block_v=config.block_v,
      steps=num_steps, vocab=vocab, no_cache=no_cache,
      dependent_launch=dependent_launch, block_major=block_major,
      chunk=chunk, signal_first=config.early_dependents)
  chunk_max, chunk_sum, chunk_argmax = chunk_stats or (None, None, None)
  given = dict(block_max=block_max, block_sum=block_sum,
               block_argmax=block_argmax, cache=cache, step=step,
               params=params, cache_rows=cache_rows, tokens=tokens,
               columns=columns, chunk_max=chunk_max, chunk_sum=chunk_sum,
               chunk_argmax=chunk_argmax, embed=embed, emb=emb)
  outputs = dict(tokens=jax.ShapeDtypeStruct((batch * num_steps,), jnp.int32))
  if embed is not None:
    outputs["emb"] = jax.ShapeDtypeStruct((batch, embed.shape[1]),
                                          embed.dtype)
  out = named_call(
      kernel, {name: given[name] for name in INPUTS}, outputs,
      aliased=OUTPUTS,
      grid=(batch,),
      compiler_params=plgpu.CompilerParams(num_warps=config.select_warps,
                                           num_stages=1),
      interpret=interpret,
      name="markov_select_pass",
  )
  if embed is not None:
    return out["tokens"], out["emb"]
  return out["tokens"]
