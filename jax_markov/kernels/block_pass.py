"""The block pass: one program per (request tile, vocabulary block) and step.

Each program takes a tile of ``block_b`` requests and ``block_v`` vocabulary
columns and

1. forms the pre-temperature logits ``x = base + bias`` in float32, where the
   bias comes either from a [B, V] float32 array computed beforehand
   (method "xla_bias", vLLM's design: an XLA GEMM writes it to HBM, the block
   pass reads it back) or, fused, from the tile's embeddings [block_b, R]
   (rows of embed gathered by the previous tokens) times the projection block
   [block_v, R], on the
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

Remainder rows (``config.remainder_b``, :func:`request_tiles`): where B is a
few rows past a whole number of request tiles, the grid has only the whole
tiles and the last tile's programs also take the rows past them, in the same
rank loop (``remainder_pass="joint"``) or in a second one after the tile's
epilogue (``"after"``), so that no program reads the whole proj tile for a
few live rows.

Reduced draft vocabulary: base, proj (and the xla_bias bias) have Vd
columns / rows, the draft vocabulary, and the draw is over the V target ids.

* Sampling (a cache): ``slots`` int32 [V] gives, per target column t, the
  draft column that maps to it, or -1. The grid walks the target columns: a
  program gathers base and proj at its columns' slots (a masked load reads
  nothing for -1), stores x at its target columns, -inf where the slot is
  -1, as one dense run per row (full 32-byte sectors, no fill of the other
  columns, no scatter), and keeps target-column statistics, so the select
  pass draws a target id directly. Any map order works: the walk is in
  target order. An unmapped column costs a store and tensor-core lanes
  (zeros in the tile's product), no memory read. (Storing only the Vd
  draft columns by scatter, with -inf filled beside them, measured 2.5x
  slower than this on an H200: two partial writes per 32-byte sector;
  docs/perf-notes.md.)
* Greedy (``no_cache``): ``columns`` int32 [Vd], strictly increasing (the
  sampler sorts a map that is not, permuting base and proj with it), the
  target id of each draft column. The grid walks the Vd draft columns; with
  no cache nothing is stored, and draft order being target order, the first
  argmax over draft columns is the first over the target row.

``no_cache`` (greedy drafting): nothing is stored but the block max and the
first-max index of x (no scale: every draw is greedy; no sum: only the
argmax is needed), and no cache exists.
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
from jax_markov.kernels.select_pass import draw_token, greedy_token

# The pallas_call's operands, in order: the inputs that are given, then all
# the outputs ("tokens" and "counters" only with select="tail"). An output
# updates the input of the same name in place when that input is given.
# columns and slots (the reduced draft vocabulary's maps) come last, so the
# other operands keep their positions when they are absent.
INPUTS = ("base", "embed", "proj", "anchors", "tokens", "bias", "step",
          "params", "cache_rows", "cache", "counters", "columns", "slots")
OUTPUTS = ("cache", "block_max", "block_sum", "block_argmax", "tokens",
           "counters")
ALIASED = ("cache", "tokens", "counters")


def num_request_tiles(batch: int, block_b: int) -> int:
  """Programs along the requests; the tail select's counters are int32 of it."""
  return pl.cdiv(batch, block_b)


def request_tiles(batch: int, config: KernelConfig) -> tuple[int, int]:
  """(request tiles of the grid, remainder rows) for B = batch.

  With ``config.remainder_b`` and B = q * block_b + r, 0 < r <=
  remainder_b, q >= 1: q full tiles, and the last tile's programs also take
  the r rows past them (:func:`remainder_tile` rows, r of them live).
  Otherwise ceil(B / block_b) tiles, the last one partial, and no remainder.
  """
  block_b, rest = config.block_b, batch % config.block_b
  if batch > block_b and 0 < rest <= config.remainder_b:
    return batch // block_b, rest
  return num_request_tiles(batch, block_b), 0


def remainder_tile(rows: int, bias_dot: str) -> int:
  """Rows of the tile that holds ``rows`` remainder rows: a power of two,
  at least 16 on the tensor cores (their smallest tile)."""
  return max(16 if bias_dot == "mma" else 1, pl.next_power_of_2(rows))


def first_max_index(y, y_max):
  """The first column of each row of y [rows, cols] that equals its max.

  y holds no NaN (callers map NaN to -inf), so every row has one: an all
  -inf row gives 0, as jnp.argmax does. A max then a min over column
  indices, rather than jnp.argmax's (value, index) reduction: the same
  index, 1-2% faster captured drafts at B = 64 to 256 on an H200
  (docs/perf-notes.md change 33).
  """
  cols = jnp.arange(y.shape[1], dtype=jnp.int32)[None, :]
  return jnp.min(jnp.where(y == y_max[:, None], cols, y.shape[1]), axis=1)


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
  y_arg = first_max_index(y, y_max) + v0
  # An all -inf block has sum 0 (not exp(nan)); a +inf max makes the sum inf,
  # which the select pass reads as "fall back to argmax".
  finite_max = jnp.where((y_max > -jnp.inf) & (y_max < jnp.inf), y_max, 0.0)
  y_sum = jnp.sum(jnp.exp(y - finite_max[:, None]), axis=1)
  return y_max, y_sum, y_arg


def bias_chunk(acc, emb, proj, *, bias_dot: str, precision):
  """acc + emb @ proj.T for one rank chunk (shared with the draft pass).

  Args:
    acc: float32 [block_b, block_v].
    emb: [block_b, block_k] embedding rows of the previous tokens.
    proj: [block_v, block_k] proj rows of the tile's columns.
    bias_dot: "fma" (CUDA cores) or "mma" (tensor cores).
    precision: the dot's precision (HIGHEST for float32 weights).
  """
  if bias_dot == "fma":
    # CUDA cores: products summed over k, with no shared-memory staging: at
    # a few requests the proj tile goes from HBM straight to registers.
    if emb.shape[0] == 1:  # a 2D product: no 3D layout for Triton to convert
      prod = proj.astype(jnp.float32) * emb.astype(jnp.float32)
      return acc + jnp.sum(prod, axis=1)[None, :]
    prod = (emb.astype(jnp.float32)[:, None, :]
            * proj.astype(jnp.float32)[None, :, :])
    return acc + jnp.sum(prod, axis=2)
  return acc + jax.lax.dot_general(emb, proj, (((1,), (1,)), ((), ())),
                                   precision=precision,
                                   preferred_element_type=jnp.float32)


def _block_pass_kernel(ins, outs, *, config: KernelConfig, batch: int,
                       steps: int, vocab: int, rank: int, keep_blocks: int,
                       remainder_rows: int, precision, no_cache: bool,
                       dependent_launch: bool):
  fused = config.fused
  block_b, block_v, block_k = config.block_b, config.block_v, config.block_k
  bias_dot = config.bias_dot
  base_ref, step_ref = ins["base"], ins["step"]
  params_ref = ins.get("params")  # absent with no_cache
  # Absent: the dense layout (draw d writes cache row d).
  cache_rows_ref = ins.get("cache_rows")
  # Absent at step 0: the previous token is the anchor.
  tokens_ref = ins.get("tokens")
  # The cache is read back (tail select) through the output ref: with a cache
  # given, it is the same buffer as the input of that name.
  cache_ref = outs.get("cache")  # absent with no_cache
  bsum_ref = outs.get("block_sum")  # absent with no_cache
  bmax_ref, barg_ref = outs["block_max"], outs["block_argmax"]
  # Absent: grid column v is draft column v.
  slots_ref = ins.get("slots")

  i = pl.program_id(0)
  j = pl.program_id(1)
  if config.serpentine:
    # Odd steps walk the vocabulary from its end: the programs that start
    # first then read the proj blocks the step before read last, which are
    # still in L2 (proj is the same every step and larger than L2, so in one
    # direction each step would evict what the next one needs first).
    j = jnp.where(step_ref[0] % 2 == 1, pl.num_programs(1) - 1 - j, j)
  v0 = j * block_v
  v_mask = v0 + jnp.arange(block_v) < vocab
  if slots_ref is None:
    d_mask, d_cols = v_mask, v0 + jnp.arange(block_v)
  else:
    # Target columns with no draft column (slot -1) load nothing: x = -inf.
    slot = plgpu.load(slots_ref.at[v0 + jnp.arange(block_v)], mask=v_mask,
                      other=-1)
    d_mask = v_mask & (slot >= 0)
    d_cols = jnp.where(d_mask, slot, 0)
  # The request tiles a program takes: its own, and with remainder rows the
  # grid's last tile also the rows past it (its own tile then holds no
  # padding), so that one read of the proj tile serves both and no program
  # of a mostly empty tile re-reads it (docs/perf-notes.md change 48).
  if fused and bias_dot == "fma" and block_b > 1:
    # On the CUDA cores each request is a tile of its own: B = 1's 2D
    # product once per row of the same proj chunk, where a [block_b,
    # block_v, block_k] product is a 3D layout Triton handles 4x slower
    # (docs/perf-notes.md change 52).
    tiles = [i * block_b + r + jnp.arange(1) for r in range(block_b)]
  else:
    tiles = [i * block_b + jnp.arange(block_b)]
  own = len(tiles)  # the program's own tiles; then the remainder's
  last = None
  after = remainder_rows and config.remainder_pass == "after"
  if remainder_rows:
    last = i == pl.num_programs(0) - 1
    rest_idx = ((batch - remainder_rows)
                + jnp.arange(remainder_tile(remainder_rows, bias_dot)))
    if not after:
      tiles.append(rest_idx)

  def row_masks(b_idx, g):
    b_mask = b_idx < batch
    return b_mask if g < own else b_mask & last

  masks = [row_masks(b_idx, g) for g, b_idx in enumerate(tiles)]
  # Draw (b, s) is flat index b * S + s of the per-draw arrays and of base's
  # rows; masked requests index past them and are never loaded.
  draws = [b_idx * steps + step_ref[0] for b_idx in tiles]

  # Gathers and scatters index rows and columns with arrays (not a slice
  # beside an array), the one mixed form both Triton and the interpreter take;
  # the interpreter clamps an out-of-range slice instead of masking it.
  cols = (v0 + jnp.arange(block_v))[None, :]  # grid (cache) columns
  # With keep_blocks > 0, what a step reads or writes once (base, cache, the
  # rest of proj) leaves L2 first, so the first keep_blocks blocks of proj,
  # which every step reads again, stay there from one step to the next.
  stream = ("evict_first" if keep_blocks or config.l2_hints != "none"
            else None)
  # l2_hints="proj": every proj load evict_last, one static policy (no
  # branch); else proj takes no hint unless keep_blocks picks one per program.
  proj_hint = "evict_last" if config.l2_hints == "proj" else None

  def load_base(draw, b_mask):
    tile_mask = b_mask[:, None] & d_mask[None, :]
    if slots_ref is None:
      x = plgpu.load(base_ref.at[draw[:, None], d_cols[None, :]],
                     mask=tile_mask, other=0, eviction_policy=stream)
    else:
      # Gathered as [columns, requests] and transposed: triton 3.6 gives a
      # gathered tile's dim 0 to a warp's 32 threads, so in [requests,
      # columns] a warp's load touched 32 rows' sectors (161 against 109 us
      # a step at B = 256; docs/perf-notes.md change 29); along the columns
      # it reads 64 contiguous bytes of one row.
      x = plgpu.load(base_ref.at[draw[None, :], d_cols[:, None]],
                     mask=tile_mask.T, other=0, eviction_policy=stream).T
    return x.astype(jnp.float32)

  xs = [load_base(draw, b_mask) for draw, b_mask in zip(draws, masks)]

  def add_bias(x, b_idx, b_mask):  # method "xla_bias"
    rows = jnp.where(b_mask, b_idx, 0)
    return x + plgpu.load(ins["bias"].at[rows[:, None], d_cols[None, :]],
                          mask=b_mask[:, None] & d_mask[None, :], other=0)

  warm = []  # prefetched proj chunks (config.prefetch_proj)
  if fused:
    proj_ref = ins["proj"]

    def load_proj(k_cols, policy, v_rows, mask=True):
      return plgpu.load(proj_ref.at[v_rows, k_cols],
                        mask=d_mask[:, None] & (k_cols < rank) & mask,
                        other=0, eviction_policy=policy)

    num_chunks = pl.cdiv(rank, block_k)
    # With keep_blocks, a program of a kept block (not at the last step)
    # reads proj evict_last, every other evict_first; the policy is static
    # per load, so the loads are traced once per policy and the program
    # takes one branch.
    keep = ((j < keep_blocks) & (step_ref[0] < steps - 1) if keep_blocks
            else None)

    def by_policy(load):
      if keep is None:
        return load(proj_hint)
      return jax.lax.cond(keep, lambda: load("evict_last"),
                          lambda: load("evict_first"))

    # proj, like base, does not depend on the previous token: the first
    # chunks load before the wait, while the previous step's select runs.
    def early_chunks(policy):
      return [load_proj((c * block_k + jnp.arange(block_k))[None, :], policy,
                        d_cols[:, None])
              for c in range(min(config.early_proj, num_chunks))]

    early = by_policy(early_chunks) if config.early_proj else []
    if dependent_launch and config.prefetch_proj:
      # Loaded only to be in L2 when the rank loop reads them: one element
      # of each 32-byte sector (DRAM fills L2 a sector at a time), so a
      # chunk costs block_v * block_k / (16 * 128) registers a thread, not
      # block_v * block_k / 256. Programs launched after the first wave find
      # the step before done and would only wait for these loads (masked
      # off: no memory access). Grid axis 0 is blockIdx.x, the fastest in
      # the order programs are dispatched.
      launch_index = pl.program_id(0) + pl.program_id(1) * pl.num_programs(0)
      ahead = (launch_index < config.prefetch_programs
               if config.prefetch_programs else True)
      sector = max(1, 32 // proj_ref.dtype.itemsize)
      touched = min(config.prefetch_proj, num_chunks) * block_k
      warm = [load_proj(jnp.arange(0, touched, sector)[None, :], proj_hint,
                        d_cols[:, None], ahead)]
  # What follows reads or writes what earlier kernels of the draft write or
  # read, so its indices carry the wait's zero; base, written before the
  # draft, is loaded above it (see dependent_launch).
  zero = 0
  if dependent_launch:
    zero = wait_for_prior_kernels(dependent_launch)
    if warm:
      # Reduced to a zero after the wait: the prefetched registers are free
      # before the rank loop (the first wave's loads have landed by then).
      zero = zero + dependent_launch_module.zero_after(
          sum(jnp.max(w.astype(jnp.float32)) for w in warm))
    i = i + zero
    tiles = [b_idx + zero for b_idx in tiles]
    draws = [draw + zero for draw in draws]
  if fused:
    # The previous token of each request: its anchor at step 0, else what the
    # select pass drew at step - 1. Its embedding row is gathered here, so no
    # [B, R] embedding array passes between the kernels.
    embed_ref = ins["embed"]

    def previous_rows(b_idx, draw, b_mask):
      prev = plgpu.load(ins["anchors"].at[b_idx], mask=b_mask, other=0)
      if tokens_ref is not None:
        drawn = plgpu.load(tokens_ref.at[draw - 1],
                           mask=b_mask & (step_ref[0] > 0), other=0)
        prev = jnp.where(step_ref[0] > 0, drawn, prev)
      # An anchor outside the table is clamped, as XLA's gather clamps.
      return jnp.clip(prev, 0, embed_ref.shape[0] - 1)[:, None]

    v_rows = d_cols[:, None]

    def rank_chunk(k0, accs, proj_policy, rows, proj=None):
      k_cols = (k0 + jnp.arange(block_k))[None, :]
      if proj is None:
        proj = load_proj(k_cols, proj_policy, v_rows)
      out = []
      for acc, (b_rows, b_mask) in zip(accs, rows):
        emb = plgpu.load(embed_ref.at[b_rows, k_cols],
                         mask=b_mask[:, None] & (k_cols < rank), other=0)
        out.append(bias_chunk(acc, emb, proj, bias_dot=bias_dot,
                              precision=precision))
      return tuple(out)

    def bias_loop(accs, proj_policy, rows, early):
      for c, proj in enumerate(early):
        accs = rank_chunk(c * block_k, accs, proj_policy, rows, proj)
      first = len(early)
      if config.k_loop == "fori" and first < num_chunks:
        # A loop Triton sees: num_stages > 1 prefetches the next proj chunk
        # while the tensor cores work on this one.
        return jax.lax.fori_loop(
            first, num_chunks,
            lambda c, accs: rank_chunk(c * block_k, accs, proj_policy, rows),
            accs)
      for c in range(first, num_chunks):  # "static": no software pipelining
        accs = rank_chunk(c * block_k, accs, proj_policy, rows)
      return accs

    def add_products(xs, rows, early):
      """xs + emb @ proj.T for each tile of rows [(prev rows, mask)]."""
      # The base tile is the accumulator's initial value: no second
      # [block_b, block_v] float32 tile stays live across the rank loop
      # (168 -> 128 registers at 64 x 128; docs/perf-notes.md).
      if keep_blocks:
        # At the last step the kept blocks are read evict_first too: the
        # draft leaves nothing pinned behind it.
        return jax.lax.cond(
            keep, lambda accs: bias_loop(accs, "evict_last", rows, early),
            lambda accs: bias_loop(accs, "evict_first", rows, early),
            tuple(xs))
      return bias_loop(tuple(xs), proj_hint, rows, early)

    rows = [(previous_rows(*t), t[2]) for t in zip(tiles, draws, masks)]
    xs = add_products(xs, rows, early)
  else:
    xs = [add_bias(*t) for t in zip(xs, tiles, masks)]
  if slots_ref is not None:
    xs = [jnp.where(d_mask[None, :], x, -jnp.inf) for x in xs]

  def epilogue(x, b_idx, draw, b_mask):
    """The tile's cache stores and block statistics (rows b_idx)."""
    if no_cache:
      # Greedy drafting: the argmax of x (NaN as -inf) is all the select
      # needs.
      y = jnp.where(x == x, x, -jnp.inf)
      y = jnp.where(v_mask[None, :], y, -jnp.inf)
      y_max = jnp.max(y, axis=1)
      plgpu.store(bmax_ref.at[b_idx, j], y_max, mask=b_mask)
      plgpu.store(barg_ref.at[b_idx, j], first_max_index(y, y_max) + v0,
                  mask=b_mask)
      return
    if cache_rows_ref is None:
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
    y_max, y_sum, y_arg = block_statistics(x, v_mask[None, :],
                                           scale[:, None], v0)
    if slots_ref is not None:
      # An all -inf block names its first mapped column, or -1 with none (the
      # select pass skips it): the argmax of an all -inf row is then the
      # lowest mapped target id, as with the draft columns, never an
      # unmapped one.
      first = jnp.min(jnp.where(d_mask, jnp.arange(block_v), block_v))
      first = jnp.where(first < block_v, v0 + first, -1)
      y_arg = jnp.where(y_max > -jnp.inf, y_arg, first)
    # Request-major [B, NB]: the select pass then reads each request's
    # statistics as one contiguous row (a column of [NB, B] is one 32-byte
    # sector per value); these stores are spread over all programs instead.
    # Masked requests' rows (b_idx >= B) are distinct and past the array.
    plgpu.store(bmax_ref.at[b_idx, j], y_max, mask=b_mask)
    plgpu.store(bsum_ref.at[b_idx, j], y_sum, mask=b_mask)
    plgpu.store(barg_ref.at[b_idx, j], y_arg, mask=b_mask)

  for g in range(own):
    epilogue(xs[g], tiles[g], draws[g], masks[g])
  if remainder_rows and not after:
    # Only the last tile's programs store remainder rows: the others skip
    # their arithmetic (their loads above were masked off).
    pl.when(last)(lambda: epilogue(xs[own], tiles[own], draws[own],
                                   masks[own]))

  if after:
    @pl.when(last)
    def _remainder_after():
      # remainder_pass="after": the remainder rows' own rank loop once the
      # tile's epilogue is done, in the last tile's programs only, so that
      # the tile's registers are free again (the program's occupancy is that
      # of the tile alone) and the proj tile it reads again is still in L2.
      b_idx = rest_idx + zero
      b_mask = b_idx < batch
      draw = b_idx * steps + step_ref[0]
      x = load_base(draw, b_mask)
      if fused:
        (x,) = add_products([x], [(previous_rows(b_idx, draw, b_mask), b_mask)],
                            [])
      else:
        x = add_bias(x, b_idx, b_mask)
      if slots_ref is not None:
        x = jnp.where(d_mask[None, :], x, -jnp.inf)
      epilogue(x, b_idx, draw, b_mask)

  if config.select == "tail":
    _tail_select(ins, outs, i, config=config, steps=steps, vocab=vocab,
                 no_cache=no_cache)


def _walking_block_pass_kernel(ins, outs, *, config: KernelConfig,
                               batch: int, steps: int, vocab: int, rank: int,
                               precision, no_cache: bool,
                               dependent_launch: bool):
  """config.block_programs programs over the one request tile: program p
  takes the vocabulary blocks p, p + P, ... in one loop over (block, rank
  chunk), so Triton's software pipeline loads the next block's first proj
  and embedding chunks while this block's last chunk and epilogue run,
  where a program a block fills and drains its own. Each block's sums are
  _block_pass_kernel's in its order (the base tile is the accumulator at
  the block's first chunk, then one dot a chunk): the same bits."""
  block_b, block_v, block_k = config.block_b, config.block_v, config.block_k
  f32 = jnp.float32
  base_ref, step_ref = ins["base"], ins["step"]
  embed_ref, proj_ref = ins["embed"], ins["proj"]
  params_ref = ins.get("params")  # absent with no_cache
  cache_rows_ref = ins.get("cache_rows")  # absent: the dense layout
  tokens_ref = ins.get("tokens")  # absent at step 0
  cache_ref = outs.get("cache")
  bsum_ref = outs.get("block_sum")
  bmax_ref, barg_ref = outs["block_max"], outs["block_argmax"]
  p = pl.program_id(0)
  programs = pl.num_programs(0)
  num_blocks = pl.cdiv(vocab, block_v)
  num_chunks = pl.cdiv(rank, block_k)

  # Every load below depends on the step before (tokens) or sits in the
  # loop with the ones that do, so the wait comes first.
  zero = wait_for_prior_kernels(dependent_launch) if dependent_launch else 0
  b_idx = jnp.arange(block_b) + zero
  b_mask = b_idx < batch
  draw = b_idx * steps + step_ref[0]
  # The previous tokens' embedding rows, as _block_pass_kernel gathers them.
  prev = plgpu.load(ins["anchors"].at[b_idx], mask=b_mask, other=0)
  if tokens_ref is not None:
    drawn = plgpu.load(tokens_ref.at[draw - 1],
                       mask=b_mask & (step_ref[0] > 0), other=0)
    prev = jnp.where(step_ref[0] > 0, drawn, prev)
  e_rows = jnp.clip(prev, 0, embed_ref.shape[0] - 1)[:, None]
  if not no_cache:
    scale = plgpu.load(params_ref.at[0, draw], mask=b_mask, other=1.0)
    if cache_rows_ref is None:
      write, cache_rows = b_mask, draw
    else:
      cache_rows = plgpu.load(cache_rows_ref.at[draw], mask=b_mask, other=-1)
      write = cache_rows >= 0
    # Rows not written point past the cache (see _block_pass_kernel).
    cache_rows = jnp.where(write, cache_rows, cache_ref.shape[0])
  odd = step_ref[0] % 2 == 1

  def epilogue(x, j, v0, v_cols, v_mask):
    if no_cache:
      y = jnp.where(x == x, x, -jnp.inf)
      y = jnp.where(v_mask[None, :], y, -jnp.inf)
      y_max = jnp.max(y, axis=1)
      plgpu.store(bmax_ref.at[b_idx, j], y_max, mask=b_mask)
      plgpu.store(barg_ref.at[b_idx, j], first_max_index(y, y_max) + v0,
                  mask=b_mask)
      return
    # The cache holds pre-temperature logits.
    plgpu.store(cache_ref.at[cache_rows[:, None], v_cols[None, :]], x,
                mask=write[:, None] & v_mask[None, :])
    y_max, y_sum, y_arg = block_statistics(x, v_mask[None, :],
                                           scale[:, None], v0)
    plgpu.store(bmax_ref.at[b_idx, j], y_max, mask=b_mask)
    plgpu.store(bsum_ref.at[b_idx, j], y_sum, mask=b_mask)
    plgpu.store(barg_ref.at[b_idx, j], y_arg, mask=b_mask)

  def chunk(it, acc):
    t, c = jax.lax.div(it, num_chunks), jax.lax.rem(it, num_chunks)
    j = p + t * programs
    if config.serpentine:
      # Odd steps walk from the end, as the one-block programs do.
      j = jnp.where(odd, num_blocks - 1 - j, j)
    v0 = j * block_v
    v_cols = v0 + jnp.arange(block_v)
    v_mask = v_cols < vocab
    k_cols = (c * block_k + jnp.arange(block_k))[None, :]
    first = c == 0
    # The base tile, read at the block's first chunk only (masked off at
    # the others: no memory access), is the accumulator's initial value.
    base = plgpu.load(base_ref.at[draw[:, None], v_cols[None, :]],
                      mask=(b_mask & first)[:, None] & v_mask[None, :],
                      other=0).astype(f32)
    acc = jnp.where(first, base, acc)
    proj = plgpu.load(proj_ref.at[v_cols[:, None], k_cols],
                      mask=v_mask[:, None] & (k_cols < rank), other=0)
    emb = plgpu.load(embed_ref.at[e_rows, k_cols],
                     mask=b_mask[:, None] & (k_cols < rank), other=0)
    acc = bias_chunk(acc, emb, proj, bias_dot="mma", precision=precision)
    pl.when(c == num_chunks - 1)(
        lambda: epilogue(acc, j, v0, v_cols, v_mask))
    return acc

  mine = jax.lax.div(num_blocks - p + programs - 1, programs)
  jax.lax.fori_loop(0, mine * num_chunks, chunk,
                    jnp.zeros((block_b, block_v), f32))


def _tail_select(ins, outs, i, *, config: KernelConfig, steps: int,
                 vocab: int, no_cache: bool):
  """select="tail": the request tile's last program to finish draws.

  i: the request tile, pl.program_id(0) (after the dependent-launch wait).
  """
  # The count is acq_rel at GPU scope: it releases this program's stores
  # (cache before the block reductions' barrier, statistics by the counting
  # thread), and the program that counts last acquires everyone's.
  counter_ref = outs["counters"]
  done = plgpu.atomic_add(counter_ref, i, jnp.ones((), jnp.int32))

  @pl.when(done == pl.num_programs(1) - 1)
  def _select_tail():
    # block_b == 1 (KernelConfig checks it): request tile i is request i.
    num_blocks = pl.cdiv(vocab, config.block_v)
    d = i * steps + ins["step"][0]
    statics = dict(num_blocks=num_blocks,
                   blocks_pow2=pl.next_power_of_2(num_blocks), vocab=vocab)
    if no_cache:
      outs["tokens"][d] = greedy_token(outs["block_max"],
                                       outs["block_argmax"], i, **statics,
                                       columns_ref=ins.get("columns"))
    else:
      outs["tokens"][d] = draw_token(
          outs["block_max"], outs["block_sum"], outs["block_argmax"],
          outs["cache"], ins["params"], ins.get("cache_rows"), i, d,
          block_v=config.block_v, **statics)
    # Every program of this tile has counted: the next step starts from 0.
    counter_ref[i] = 0


def block_pass(base: jax.Array, bias_or_head, step: jax.Array,
               params: jax.Array, cache_rows: jax.Array | None = None,
               cache: jax.Array | None = None,
               tokens: jax.Array | None = None,
               counters: jax.Array | None = None, *, config: KernelConfig,
               num_steps: int, num_cache_rows: int,
               columns: jax.Array | None = None,
               slots: jax.Array | None = None,
               cache_vocab: int | None = None, no_cache: bool = False,
               dependent_launch: bool = False, interpret: bool = False):
  """Runs the block pass of one step.

  Draw (b, s) is flat index ``b * S + s`` of ``base``'s rows and of the
  per-draw arrays, so one step reads them in place: the step index is data,
  and no slice of them runs as a separate launch.

  Args:
    base: [B * S, V] base logits (bf16, fp16 or fp32), request-major rows.
    bias_or_head: ``bias`` float32 [B, V] for ``config.method="xla_bias"``,
      or ``(embed, proj, anchors)`` for "fused": the bias is computed in the
      kernel from the previous token's row of embed [V_in, R] and proj [V, R]
      (one dtype). The previous token of request b is ``anchors[b]`` (int32
      [B]) at step 0 or where tokens is None, else ``tokens[b * S + s - 1]``.
    step: int32 [1], the step s.
    params: float32 [P >= 1, B * S], the draw parameters; the block pass reads
      row 0, 1 / T per draw or 1 where the draw is greedy (the select pass
      and the tail select also read rows 1 and 2).
    cache_rows: int32 [B * S], the cache row each draw writes, -1 for none
      (padding); None for the dense layout, where draw (b, s) writes row
      b * S + s.
    cache: float32 [num_cache_rows, V] to update in place, or None to return a
      new cache of which only this step's rows are written.
    tokens: fused only: int32 [B * S], the tokens drawn at the steps before
      (read at s - 1); None at step 0. With select="tail" the step's draws
      are written into it in place.
    counters: with select="tail" (required), int32 [cdiv(B, block_b)] zeros,
      one counter per request tile, updated in place and left at zero; else
      None.
    config: the launch configuration (method, tile, Triton parameters,
      select, proj_l2_rows; see :class:`KernelConfig`).
      ``select="persistent"`` is :func:`draft_pass.draft_pass`, not this.
    num_steps: S (static).
    num_cache_rows: rows of the cache (static).
    columns: greedy drafting (no_cache) with a reduced draft vocabulary:
      int32 [Vd], strictly increasing, the target id of each draft column
      (V = Vd above: base [B * S, Vd], proj [Vd, R]); the statistics index
      draft columns and the tail select returns columns[j] for the argmax j.
      The sampler sorts a map that is not increasing (permuting base and
      proj): the first argmax relies on draft order being target order.
    slots: sampling with a reduced draft vocabulary: int32 [V_target], the
      draft column of each target column, or -1 where none maps to it (base
      [B * S, Vd], proj [Vd, R], bias [B, Vd]). The grid, the cache columns
      and the statistics are the V_target target columns (V below); a
      column with slot -1 is x = -inf. Any map order. Values outside
      [-1, Vd) are not checked here (the callers build slots from a checked
      map).
    cache_vocab: the cache's width (static); None: the cache's width, or
      the grid's columns when no cache is given. Must equal the grid's
      columns (V, or V_target with slots).
    no_cache: greedy drafting (static): no cache (cache, cache_rows and
      params are None), no block sums; every draw is the argmax of x.
    dependent_launch: build for a programmatic dependent launch (static;
      sm_90 or newer, not in the interpreter): the kernel waits for the
      kernels before it after loading its base tile, then lets the next one
      start (see :mod:`dependent_launch`). The native runtime launches it
      so; under any other launch the wait returns at once.
    interpret: run the kernel in the Pallas interpreter (CPU).

  Returns:
    (cache, block_max, block_sum, block_argmax): the cache float32
    [num_cache_rows, V], and per request and block float32 [B, NB] max of
    x * scale, float32 [B, NB] sum of exp(x * scale - max), int32 [B, NB]
    vocabulary index of the first max; NB = cdiv(V, block_v). With
    select="tail" also (tokens, counters): tokens int32 [B * S] (the tokens
    argument updated, or a new array with only this step's draws written)
    and the counters, zero again.

  Operands of the pallas_call (the order a native runtime binds pointers
  in): the inputs that are given, in the order ``base, embed, proj, anchors,
  tokens`` (fused) or ``base, bias`` (xla_bias), then ``step, params,
  cache_rows, cache, counters, columns, slots``; then the outputs ``cache,
  block_max, block_sum, block_argmax`` and, with select="tail", ``tokens,
  counters``. The outputs cache, tokens and counters alias the inputs of the
  same name where those are given (see :data:`INPUTS`, :data:`OUTPUTS`).
  columns and slots, the last inputs, come after counters, so the positions
  of the others are the same with them absent. With no_cache the inputs params,
  cache_rows, cache and the outputs cache, block_sum are absent: the outputs
  are ``block_max, block_argmax`` [, ``tokens, counters``].
  """
  if config.select == "persistent":
    raise ValueError("select='persistent' runs the whole draft as "
                     "draft_pass.draft_pass, not step by step")
  dependent_launch_module.check(dependent_launch, interpret=interpret)
  fused = config.fused
  if fused:
    if not (isinstance(bias_or_head, tuple) and len(bias_or_head) == 3):
      raise ValueError("method='fused' takes bias_or_head=(embed, proj, "
                       f"anchors), got {type(bias_or_head).__name__}")
    embed, proj, anchors = bias_or_head
    bias = None
  else:
    if isinstance(bias_or_head, tuple) or tokens is not None:
      raise ValueError("method='xla_bias' takes bias_or_head=bias float32 "
                       "[B, V] and no tokens")
    embed = proj = anchors = None
    bias = bias_or_head
  tail = config.select == "tail"
  batch, vocab = base.shape[0] // num_steps, base.shape[1]
  if columns is not None and not no_cache:
    raise ValueError("columns maps draft columns for greedy drafting "
                     "(no_cache=True); sampling with a reduced vocabulary "
                     "takes slots")
  if slots is not None and no_cache:
    raise ValueError("slots is for sampling (a cache); greedy drafting with "
                     "a reduced vocabulary takes columns")
  if slots is not None:
    if slots.ndim != 1 or slots.dtype != jnp.int32:
      raise ValueError("slots must be int32 [V_target], got "
                       f"{slots.dtype}{list(slots.shape)}")
    vocab = slots.shape[0]  # the grid walks the target columns
  rank = proj.shape[1] if fused else 0
  num_blocks = pl.cdiv(vocab, config.block_v)
  num_tiles = num_request_tiles(batch, config.block_b)
  grid_tiles, remainder_rows = request_tiles(batch, config)
  if tail != (counters is not None) or (
      tail and (counters.shape != (num_tiles,) or counters.dtype != jnp.int32)):
    raise ValueError(f"select='tail' needs counters int32 [{num_tiles}] "
                     "(and any other select none), got "
                     f"{None if counters is None else counters.shape} with "
                     f"select={config.select!r}")
  if no_cache and any(x is not None for x in (params, cache_rows, cache)):
    raise ValueError("no_cache=True takes no params, cache_rows or cache")
  if not no_cache and params is None:
    raise ValueError("the block pass needs params (unless no_cache=True)")
  if columns is not None and columns.shape != (vocab,):
    raise ValueError(f"columns must be int32 [{vocab}] (one per draft "
                     f"column of base), got {columns.shape}")
  if cache is not None:
    if cache_vocab is not None and cache_vocab != cache.shape[1]:
      raise ValueError(f"cache_vocab={cache_vocab} disagrees with the "
                       f"cache's {cache.shape[1]} columns")
    cache_vocab = cache.shape[1]
  elif cache_vocab is None:
    cache_vocab = vocab
  if cache_vocab != vocab:
    raise ValueError(f"a cache of {cache_vocab} columns for {vocab} grid "
                     "columns (with a reduced vocabulary, slots has one "
                     "entry per cache column)")
  keep_blocks = min(pl.cdiv(config.proj_l2_rows, config.block_v), num_blocks)
  precision = None
  if fused and proj.dtype == jnp.float32:
    precision = jax.lax.Precision.HIGHEST  # no tf32: keep float32 products
  given = dict(base=base, embed=embed, proj=proj, anchors=anchors,
               tokens=tokens, bias=bias, step=step, params=params,
               cache_rows=cache_rows, cache=cache, counters=counters,
               columns=columns, slots=slots)
  outputs = dict(
      cache=jax.ShapeDtypeStruct((num_cache_rows, cache_vocab), jnp.float32),
      block_max=jax.ShapeDtypeStruct((batch, num_blocks), jnp.float32),
      block_sum=jax.ShapeDtypeStruct((batch, num_blocks), jnp.float32),
      block_argmax=jax.ShapeDtypeStruct((batch, num_blocks), jnp.int32),
  )
  if no_cache:
    del outputs["cache"], outputs["block_sum"]
  if tail:
    outputs["tokens"] = jax.ShapeDtypeStruct((batch * num_steps,), jnp.int32)
    outputs["counters"] = jax.ShapeDtypeStruct((num_tiles,), jnp.int32)
  kernel = functools.partial(
      _block_pass_kernel, config=config, batch=batch, steps=num_steps,
      vocab=vocab, rank=rank, keep_blocks=keep_blocks,
      remainder_rows=remainder_rows, precision=precision, no_cache=no_cache,
      dependent_launch=dependent_launch)
  grid = (grid_tiles, num_blocks)
  if config.block_programs:
    if num_tiles != 1 or slots is not None or columns is not None:
      raise ValueError(
          "block_programs walks one request tile of the full vocabulary: B "
          f"<= block_b = {config.block_b} (got B = {batch}), no slots or "
          "columns")
    kernel = functools.partial(
        _walking_block_pass_kernel, config=config, batch=batch,
        steps=num_steps, vocab=vocab, rank=rank, precision=precision,
        no_cache=no_cache, dependent_launch=dependent_launch)
    grid = (min(config.block_programs, num_blocks),)
  out = named_call(
      kernel, {name: given[name] for name in INPUTS}, outputs,
      aliased=ALIASED,
      grid=grid,
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="markov_block_pass",
  )
  return tuple(out.values())
