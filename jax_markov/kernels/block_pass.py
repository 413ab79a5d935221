"""The block pass: one program per (request tile, vocabulary block) and step.

Each program takes a tile of ``block_b`` requests and ``block_v`` vocabulary
columns and

1. forms the pre-temperature logits ``x = base + bias`` in float32, where the
   bias comes either from a [B, V] float32 array computed beforehand (the
   reference design: an XLA GEMM writes it to HBM, the block pass reads it back)
   or, fused, from the tile's embeddings [block_b, R] (rows of embed gathered
   by the previous tokens) times the projection block [block_v, R], on the
   tensor cores or, for one request a program, the CUDA cores (proj is read
   once per step for the whole tile and the bias never reaches HBM);
2. stores x to the cache row of each request (rows < 0 are padding: no store);
3. keeps, per request, the block's max of ``y = x * scale``, the sum of
   ``exp(y - max)`` and the first index of that max, which is all the select
   pass needs to choose a block without reading the logits again;
4. with ``select="tail"``, counts itself done on its request tile's counter;
   the program that counts last draws the tile's tokens (the select pass's
   arithmetic, :func:`select_pass.draw_token`), so a step is one launch.

NaN logits enter the statistics as -inf (never drawn) but are stored as they are.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_markov.kernels.select_pass import draw_token

K_LOOPS = ("fori", "static")
BIAS_DOTS = ("mma", "fma")
SELECTS = ("pass", "tail", "persistent")


def check_options(*, fused: bool, block_b: int, block_k: int, k_loop: str,
                  bias_dot: str, select: str, proj_l2_rows: int) -> None:
  """Raises ValueError for an option the block pass does not have."""
  for name, value, allowed in (("k_loop", k_loop, K_LOOPS),
                               ("bias_dot", bias_dot, BIAS_DOTS),
                               ("select", select, SELECTS)):
    if value not in allowed:
      raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
  if fused and bias_dot == "mma" and (block_b < 16 or block_k < 16):
    raise ValueError("fused with bias_dot='mma': block_b and block_k must be "
                     f">= 16 (tensor-core tile), got block_b={block_b}, "
                     f"block_k={block_k}")
  if select == "tail" and not (fused and block_b == 1):
    # One request a program: its block statistics are single values, stored
    # by the thread that also counts, so the count's release covers them.
    raise ValueError("select='tail' needs the fused method with block_b=1, "
                     f"got fused={fused}, block_b={block_b}")
  if select == "persistent" and not (fused and block_b == 1
                                     and bias_dot == "fma"
                                     and proj_l2_rows == 0):
    # kernels/draft_pass.py: one request a program, the bias on the CUDA
    # cores, no cache hints.
    raise ValueError("select='persistent' needs the fused method with "
                     "block_b=1, bias_dot='fma' and proj_l2_rows=0, got "
                     f"fused={fused}, block_b={block_b}, bias_dot={bias_dot!r}, "
                     f"proj_l2_rows={proj_l2_rows}")
  if proj_l2_rows < 0 or (proj_l2_rows and not fused):
    raise ValueError("proj_l2_rows must be >= 0 and needs the fused method, "
                     f"got {proj_l2_rows} (fused={fused})")


def num_request_tiles(batch: int, block_b: int) -> int:
  """Programs along the requests; the tail select's counters are int32 of it."""
  return pl.cdiv(batch, block_b)


def block_statistics(x, v_mask, scale, v0):
  """Per row of a logits tile: the block's max, sum of exp and first-max index.

  Args:
    x: float32 [rows, block_v], the tile's pre-temperature logits.
    v_mask: bool, broadcastable to x: the columns inside the vocabulary.
    scale: float32, broadcastable to x: 1 / T (1 where greedy).
    v0: the vocabulary index of the tile's first column.

  Returns:
    (max float32 [rows] of y = x * scale, sum float32 [rows] of
    exp(y - max), first-max index int32 [rows]). NaN logits count as -inf.
  """
  y = jnp.where(x == x, x, -jnp.inf) * scale  # NaN -> -inf
  y = jnp.where(v_mask, y, -jnp.inf)
  y_max = jnp.max(y, axis=1)
  y_arg = jnp.argmax(y, axis=1).astype(jnp.int32) + v0
  # An all -inf block has sum 0 (not exp(nan)); a +inf max makes the sum inf,
  # which the select pass reads as "fall back to argmax".
  finite_max = jnp.where((y_max > -jnp.inf) & (y_max < jnp.inf), y_max, 0.0)
  y_sum = jnp.sum(jnp.exp(y - finite_max[:, None]), axis=1)
  return y_max, y_sum, y_arg


def _block_pass_kernel(*refs, fused: bool, has_tokens: bool, dense: bool,
                       has_cache_in: bool, block_b: int, block_v: int,
                       block_k: int, batch: int,
                       steps: int, vocab: int, rank: int, k_loop: str,
                       serpentine: bool, bias_dot: str, tail: bool,
                       keep_blocks: int, precision):
  if fused:
    base_ref, embed_ref, proj_ref, anchors_ref, *refs = refs
    tokens_ref = refs.pop(0) if has_tokens else None
  else:
    base_ref, bias_ref, *refs = refs
  step_ref, params_ref, *refs = refs
  cache_rows_ref = None if dense else refs.pop(0)
  if has_cache_in:
    refs.pop(0)  # aliased with cache_ref: the same buffer
  if tail:
    refs.pop(0)  # the counters, aliased with counter_ref
  cache_ref, bmax_ref, bsum_ref, barg_ref, *refs = refs
  tokens_out_ref, counter_ref = refs if tail else (None, None)

  i = pl.program_id(0)
  j = pl.program_id(1)
  if serpentine:
    # Odd steps walk the vocabulary from its end: the programs that start
    # first then read the proj blocks the step before read last, which are
    # still in L2 (proj is the same every step and larger than L2, so in one
    # direction each step would evict what the next one needs first).
    j = jnp.where(step_ref[0] % 2 == 1, pl.num_programs(1) - 1 - j, j)
  b0 = i * block_b
  v0 = j * block_v
  b_idx = b0 + jnp.arange(block_b)
  b_mask = b_idx < batch
  v_mask = v0 + jnp.arange(block_v) < vocab
  tile_mask = b_mask[:, None] & v_mask[None, :]
  # Draw (b, s) is flat index b * S + s of the per-draw arrays and of base's
  # rows; masked requests index past them and are never loaded.
  draw = b_idx * steps + step_ref[0]

  # Gathers and scatters index rows and columns with arrays (not a slice
  # beside an array), the one mixed form both Triton and the interpreter take;
  # the interpreter clamps an out-of-range slice instead of masking it.
  cols = (v0 + jnp.arange(block_v))[None, :]
  # With keep_blocks > 0, what a step reads or writes once (base, cache, the
  # rest of proj) leaves L2 first, so the first keep_blocks blocks of proj,
  # which every step reads again, stay there from one step to the next.
  stream = "evict_first" if keep_blocks else None
  x = plgpu.load(base_ref.at[draw[:, None], cols], mask=tile_mask,
                 other=0, eviction_policy=stream).astype(jnp.float32)
  if fused:
    # The previous token of each request: its anchor at step 0, else what the
    # select pass drew at step - 1. Its embedding row is gathered here, so no
    # [B, R] embedding array passes between the kernels.
    prev = plgpu.load(anchors_ref.at[b_idx], mask=b_mask, other=0)
    if tokens_ref is not None:
      drawn = plgpu.load(tokens_ref.at[draw - 1],
                         mask=b_mask & (step_ref[0] > 0), other=0)
      prev = jnp.where(step_ref[0] > 0, drawn, prev)
    # An anchor outside the table is clamped, as XLA's gather clamps.
    prev = jnp.clip(prev, 0, embed_ref.shape[0] - 1)
    b_rows = prev[:, None]
    v_rows = (v0 + jnp.arange(block_v))[:, None]

    def rank_chunk(k0, acc, proj_policy):
      k_cols = (k0 + jnp.arange(block_k))[None, :]
      emb = plgpu.load(embed_ref.at[b_rows, k_cols],
                       mask=b_mask[:, None] & (k_cols < rank), other=0)
      proj = plgpu.load(proj_ref.at[v_rows, k_cols],
                        mask=v_mask[:, None] & (k_cols < rank), other=0,
                        eviction_policy=proj_policy)
      if bias_dot == "fma":
        # CUDA cores: products summed over k, with no shared-memory staging:
        # at a few requests the proj tile goes from HBM straight to registers.
        if block_b == 1:  # a 2D product: no 3D layout for Triton to convert
          prod = proj.astype(jnp.float32) * emb.astype(jnp.float32)
          return acc + jnp.sum(prod, axis=1)[None, :]
        prod = (emb.astype(jnp.float32)[:, None, :]
                * proj.astype(jnp.float32)[None, :, :])
        return acc + jnp.sum(prod, axis=2)
      return acc + jax.lax.dot_general(emb, proj, (((1,), (1,)), ((), ())),
                                       precision=precision,
                                       preferred_element_type=jnp.float32)

    num_chunks = pl.cdiv(rank, block_k)

    def bias_loop(acc, proj_policy):
      if k_loop == "fori":
        # A loop Triton sees: num_stages > 1 prefetches the next proj chunk
        # while the tensor cores work on this one.
        return jax.lax.fori_loop(
            0, num_chunks,
            lambda c, acc: rank_chunk(c * block_k, acc, proj_policy), acc)
      for c in range(num_chunks):  # "static": no software pipelining
        acc = rank_chunk(c * block_k, acc, proj_policy)
      return acc

    # The base tile is the accumulator's initial value: no second [block_b,
    # block_v] float32 tile stays live across the rank loop (168 -> 128
    # registers at 64 x 128; docs/perf-notes.md).
    if keep_blocks:
      # The policy is static per load, so the loop is traced once per policy
      # and the program takes one branch. At the last step the kept blocks
      # are read evict_first too: the draft leaves nothing pinned behind it.
      keep = (j < keep_blocks) & (step_ref[0] < steps - 1)
      x = jax.lax.cond(keep, lambda acc: bias_loop(acc, "evict_last"),
                       lambda acc: bias_loop(acc, "evict_first"), x)
    else:
      x = bias_loop(x, None)
  else:
    rows = jnp.where(b_mask, b_idx, 0)
    x = x + plgpu.load(bias_ref.at[rows[:, None], cols], mask=tile_mask,
                       other=0)

  if dense:
    write = b_mask
    cache_rows = draw
  else:
    cache_rows = plgpu.load(cache_rows_ref.at[draw], mask=b_mask, other=-1)
    write = cache_rows >= 0
  # The cache holds pre-temperature logits: the verifier applies its own T.
  # Rows not written point past the cache, never at a row another request
  # writes (the interpreter's scatter has no order between duplicates).
  cache_rows = jnp.where(write, cache_rows, cache_ref.shape[0])
  plgpu.store(cache_ref.at[cache_rows[:, None], cols], x,
              mask=write[:, None] & v_mask[None, :], eviction_policy=stream)

  scale = plgpu.load(params_ref.at[0, draw], mask=b_mask, other=1.0)
  y_max, y_sum, y_arg = block_statistics(x, v_mask[None, :], scale[:, None],
                                         v0)
  # Request-major [B, NB]: the select pass then reads each request's
  # statistics as one contiguous row (a column of [NB, B] is one 32-byte
  # sector per value); these stores are spread over all programs instead.
  # Masked requests' rows (b_idx >= B) are distinct and past the array.
  plgpu.store(bmax_ref.at[b_idx, j], y_max, mask=b_mask)
  plgpu.store(bsum_ref.at[b_idx, j], y_sum, mask=b_mask)
  plgpu.store(barg_ref.at[b_idx, j], y_arg, mask=b_mask)

  if tail:
    # The count is acq_rel at GPU scope: it releases this program's stores
    # (cache before the block reductions' barrier, statistics by the counting
    # thread), and the program that counts last acquires everyone's.
    done = plgpu.atomic_add(counter_ref, i, jnp.ones((), jnp.int32))

    @pl.when(done == pl.num_programs(1) - 1)
    def _select_tail():
      # block_b == 1 (check_options): request tile i is request i.
      num_blocks = pl.cdiv(vocab, block_v)
      d = i * steps + step_ref[0]
      tokens_out_ref[d] = draw_token(
          bmax_ref, bsum_ref, barg_ref, cache_ref, params_ref, cache_rows_ref,
          i, d, num_blocks=num_blocks,
          blocks_pow2=pl.next_power_of_2(num_blocks), block_v=block_v,
          vocab=vocab)
      # Every program of this tile has counted: the next step starts from 0.
      counter_ref[i] = 0


def block_pass(base: jax.Array, bias_or_head: tuple,
               step: jax.Array, params: jax.Array,
               cache_rows: jax.Array | None = None,
               cache: jax.Array | None = None, *, num_steps: int,
               num_cache_rows: int, block_b: int, block_v: int,
               block_k: int = 64, k_loop: str = "fori",
               serpentine: bool = True, bias_dot: str = "mma",
               select: str = "pass", counters: jax.Array | None = None,
               proj_l2_rows: int = 0, num_warps: int = 4, num_stages: int = 1,
               interpret: bool = False):
  """Runs the block pass of one step.

  Draw (b, s) is flat index ``b * S + s`` of ``base``'s rows and of the
  per-draw arrays, so one step reads them in place: the step index is data,
  and no slice of them runs as a separate launch.

  Args:
    base: [B * S, V] base logits (bf16, fp16 or fp32), request-major rows.
    bias_or_head: ``(bias,)`` with bias float32 [B, V] (reference design), or
      ``(embed, proj, anchors, tokens)`` (fused: the bias is computed in the
      kernel from the previous token's row of embed [V_in, R] and proj
      [V, R]). The previous token of request b is ``anchors[b]`` (int32 [B])
      at step 0 or where tokens is None, else ``tokens[b * S + s - 1]``
      (tokens: int32 [B * S], what the select pass drew so far).
    step: int32 [1], the step s.
    params: float32 [P >= 1, B * S], the draw parameters; the block pass reads
      row 0, 1 / T per draw or 1 where the draw is greedy (the select pass
      also reads rows 1 and 2).
    cache_rows: int32 [B * S], the cache row each draw writes, -1 for none
      (padding); None for the dense layout, where draw (b, s) writes row
      b * S + s.
    cache: float32 [num_cache_rows, V] to update in place, or None to return a
      new cache of which only this step's rows are written.
    num_steps: S (static).
    num_cache_rows: rows of the cache (static).
    block_b: requests per program (1 for the reference design; >= 16 fused,
      the tensor cores' smallest tile).
    block_v: vocabulary columns per program, a power of two.
    block_k: rank columns per dot (fused only), a power of two >= 16.
    k_loop: "fori" (a loop over rank chunks that Triton can software-pipeline
      with num_stages) or "static" (unrolled in Python).
    serpentine: on odd steps, map the programs to the vocabulary blocks in
      reverse order, so a step starts on the blocks (of proj) the step before
      touched last, which L2 still holds. The results do not depend on it.
    bias_dot: fused only: "mma" (tensor cores; block_b, block_k >= 16) or
      "fma" (products summed on the CUDA cores; any block_b, for a few
      requests, where the tensor cores' 16-row tile would be mostly padding).
    select: "pass" (the select pass draws, a second launch) or "tail" (fused
      with block_b = 1: the last program of each request tile to finish
      draws its tokens, so the step is one launch; needs ``counters``).
    counters: with select="tail", int32 [cdiv(B, block_b)] zeros, one
      counter per request tile, updated in place and left at zero.
    proj_l2_rows: fused only: the first rows of proj (rounded up to whole
      vocabulary blocks) are loaded with an L2 evict_last hint at every step
      but the last, and base, cache and the rest of proj with evict_first, so
      those rows of proj stay in L2 from one step to the next (proj is read
      again every step and is larger than L2). 0: no hints. The results do
      not depend on it.
    num_warps, num_stages: Triton launch parameters.
    interpret: run the kernel in the Pallas interpreter (CPU).

  Returns:
    (cache, block_max, block_sum, block_argmax): the cache float32
    [num_cache_rows, V], and per request and block float32 [B, NB] max of
    x * scale, float32 [B, NB] sum of exp(x * scale - max), int32 [B, NB]
    vocabulary index of the first max; NB = cdiv(V, block_v). With
    select="tail" also (tokens, counters): tokens int32 [B * S] (the tokens
    argument updated, or a new array with only this step's draws written)
    and the counters, zero again.
  """
  fused = len(bias_or_head) == 4
  if not fused and len(bias_or_head) != 1:
    raise ValueError("bias_or_head must be (bias,) or (embed, proj, anchors, "
                     f"tokens), got {len(bias_or_head)} arrays")
  check_options(fused=fused, block_b=block_b, block_k=block_k, k_loop=k_loop,
                bias_dot=bias_dot, select=select, proj_l2_rows=proj_l2_rows)
  if select == "persistent":
    raise ValueError("select='persistent' runs the whole draft as "
                     "draft_pass.draft_pass, not step by step")
  tail = select == "tail"
  has_tokens = fused and bias_or_head[3] is not None
  if fused and not has_tokens:
    bias_or_head = bias_or_head[:3]
  batch, vocab = base.shape[0] // num_steps, base.shape[1]
  rank = bias_or_head[1].shape[1] if fused else 0
  num_blocks = pl.cdiv(vocab, block_v)
  num_tiles = num_request_tiles(batch, block_b)
  if tail and (counters is None or counters.shape != (num_tiles,)
               or counters.dtype != jnp.int32):
    raise ValueError(f"select='tail' needs counters int32 [{num_tiles}], got "
                     f"{None if counters is None else counters.shape}")
  keep_blocks = min(pl.cdiv(proj_l2_rows, block_v), num_blocks)
  precision = None
  if fused and bias_or_head[1].dtype == jnp.float32:
    precision = jax.lax.Precision.HIGHEST  # no tf32: keep float32 products
  dense = cache_rows is None
  kernel = functools.partial(
      _block_pass_kernel, fused=fused, has_tokens=has_tokens, dense=dense,
      has_cache_in=cache is not None, block_b=block_b, block_v=block_v,
      block_k=block_k, batch=batch, steps=num_steps, vocab=vocab, rank=rank,
      k_loop=k_loop, serpentine=serpentine, bias_dot=bias_dot, tail=tail,
      keep_blocks=keep_blocks, precision=precision)
  inputs = (base, *bias_or_head, step, params)
  if not dense:
    inputs = (*inputs, cache_rows)
  aliases = {}
  if cache is not None:
    aliases[len(inputs)] = 0
    inputs = (*inputs, cache)
  out_shape = (
      jax.ShapeDtypeStruct((num_cache_rows, vocab), jnp.float32),
      jax.ShapeDtypeStruct((batch, num_blocks), jnp.float32),
      jax.ShapeDtypeStruct((batch, num_blocks), jnp.float32),
      jax.ShapeDtypeStruct((batch, num_blocks), jnp.int32),
  )
  if tail:
    if has_tokens:  # the tokens input (after base, embed, proj, anchors)
      aliases[4] = 4
    aliases[len(inputs)] = 5
    inputs = (*inputs, counters)
    out_shape = (*out_shape,
                 jax.ShapeDtypeStruct((batch * num_steps,), jnp.int32),
                 jax.ShapeDtypeStruct((num_tiles,), jnp.int32))
  return pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(num_tiles, num_blocks),
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps,
                                           num_stages=num_stages),
      interpret=interpret,
      name="markov_block_pass",
  )(*inputs)
