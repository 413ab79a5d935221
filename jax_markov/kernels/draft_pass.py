"""The draft pass: all S steps of a draft in one launch (persistent programs).

Grid (P,): program p takes the vocabulary blocks p, p + P, p + 2P, ... and
keeps them for the whole draft, for every request (in tiles of block_b
requests). Its first ``held_blocks`` blocks of proj are loaded once, before
the first step, and stay on chip for all S steps (in registers on the CUDA
cores; with the tensor cores Triton keeps them in shared memory, as the
dot's operand): P * held_blocks * block_v rows of proj are read from HBM
once a draft instead of S times (the rest streams every step, as in the
block pass). Each step, every program

1. forms the pre-temperature logits ``x = base + proj @ embed[prev]`` of its
   blocks (the block pass's bias chunk: CUDA cores or tensor cores), stores
   x to the cache and keeps the blocks' max, sum of exp and first-max index,
   as the block pass does;
2. counts itself done and waits until all P programs have counted for this
   step (a barrier through an acq_rel atomic at GPU scope);
3. draws: with one request, every program draws the token itself, from the
   same data with the same arithmetic (:func:`select_pass.draw_token`), so
   none waits for another to publish it, and program 0 stores it; with
   several, program p draws requests p, p + P, ..., stores their tokens and
   counts them on a second counter, and every program waits until all B
   tokens of the step are counted before it reads them.

So a draft is one launch instead of S or 2S, with no gap between the steps.
The barriers need all P programs resident at once: the wrapper allows P = 1
(a program only waits for itself) or P no larger than the number of
multiprocessors (one program each). The interpreter runs programs one after
another, so there only P = 1 can run.

The statistics are kept per draw ([B * S, NB]): a program that has started the
next step never overwrites what a slower one is still reading.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_markov.kernels.block_pass import bias_chunk, block_statistics
from jax_markov.kernels.config import KernelConfig
from jax_markov.kernels.named_call import named_call
from jax_markov.kernels.select_pass import draw_token

# The pallas_call's operands, in order: the inputs that are given, then the
# outputs. The outputs cache and counters update the inputs of those names in
# place (cache where it is given).
INPUTS = ("base", "embed", "proj", "anchors", "params", "cache_rows", "cache",
          "counters")
OUTPUTS = ("cache", "block_max", "block_sum", "block_argmax", "tokens",
           "counters")
# counters: [0] counts programs at the step barrier (P a step), [1] counts the
# tokens drawn (B a step; used with B > 1). Both must be 0 at launch.
NUM_COUNTERS = 2


def multiprocessors() -> int | None:
  """Multiprocessors of the first GPU; None without one or its count."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return None
  return getattr(devices[0], "core_count", None) if devices else None


def check_programs(programs: int, *, interpret: bool,
                   num_sms: int | None) -> None:
  """Raises ValueError where a barrier could wait for a program never run."""
  if programs < 1:
    raise ValueError(f"programs must be >= 1, got {programs}")
  if programs == 1:
    return
  if interpret:
    raise ValueError("the draft pass in the interpreter needs programs=1 "
                     "(programs run one after another: the first would wait "
                     f"for the others forever), got {programs}")
  if num_sms is None or programs > num_sms:
    raise ValueError(
        f"the draft pass needs programs <= multiprocessors so every program "
        f"is resident at its barrier; got {programs} programs with "
        f"{num_sms} multiprocessors")


def num_programs(config: KernelConfig, *, interpret: bool,
                 num_sms: int | None) -> int:
  """P for a configuration: config.programs, or (0) one a multiprocessor."""
  if config.programs:
    return config.programs
  return 1 if interpret else (num_sms or 1)


def _arrive_and_wait(counter_ref, index, amount, target, *, interpret):
  """Adds amount to counter_ref[index], then spins until it is >= target.

  A CTA barrier first orders every thread's stores before the atomic, whose
  release (acq_rel at GPU scope) makes them visible to the programs that
  acquire the count; the spin's acquires make theirs visible here.
  """
  if not interpret:  # the interpreter runs a program's ops in order
    plgpu.debug_barrier()
  # Traced, not constants: a constant would be a const of the loop body.
  zero = amount * 0
  index = zero + index
  now = plgpu.atomic_add(counter_ref, index, amount) + amount
  jax.lax.while_loop(lambda c: c < target,
                     lambda c: plgpu.atomic_add(counter_ref, index, zero), now)


def _draft_kernel(ins, outs, *, batch: int, steps: int, vocab: int, rank: int,
                  config: KernelConfig, programs: int, held: int, precision,
                  interpret: bool):
  block_b, block_v, block_k = config.block_b, config.block_v, config.block_k
  base_ref, embed_ref, proj_ref = ins["base"], ins["embed"], ins["proj"]
  params_ref = ins["params"]
  cache_rows_ref = ins.get("cache_rows")  # absent: the dense layout
  # Through the outputs: the cache and the counters alias the inputs of those
  # names (where given), so their input refs are not read.
  cache_ref, tokens_ref, counter_ref = (outs["cache"], outs["tokens"],
                                        outs["counters"])
  bmax_ref, bsum_ref, barg_ref = (outs["block_max"], outs["block_sum"],
                                  outs["block_argmax"])

  p = pl.program_id(0)
  num_blocks = pl.cdiv(vocab, block_v)
  per_program = pl.cdiv(num_blocks, programs)
  streamed = per_program - held
  num_chunks = pl.cdiv(rank, block_k)
  num_tiles = pl.cdiv(batch, block_b)
  col = jnp.arange(block_v)
  lane = jnp.arange(block_b)

  def proj_chunk(j, c):
    v_rows = (j * block_v + col)[:, None]
    k_cols = (c * block_k + jnp.arange(block_k))[None, :]
    return plgpu.load(proj_ref.at[v_rows, k_cols],
                      mask=(v_rows < vocab) & (k_cols < rank), other=0)

  # Loaded once, on chip for all S steps: chunk c of block t is
  # held_proj[t][c], [block_v, block_k]. On the CUDA cores each bf16 takes a
  # whole 32-bit register (220 registers a thread for one 128 x 256 block at
  # 8 warps, read from ptxas on the CPU), so one block is what fits there.
  held_proj = [[proj_chunk(p + t * programs, c) for c in range(num_chunks)]
               for t in range(held)]

  def prev_tokens(s, b_idx, b_mask, token):
    """The previous token of each request of a tile, clamped into the table
    as XLA's gather clamps."""
    if batch == 1:
      prev = jnp.full((block_b,), token)  # rows past the first are masked
    else:
      anchor = plgpu.load(ins["anchors"].at[b_idx], mask=b_mask, other=0)
      drawn = plgpu.load(tokens_ref.at[b_idx * steps + s - 1],
                         mask=b_mask & (s > 0), other=0)
      prev = jnp.where(s > 0, drawn, anchor)
    return jnp.clip(prev, 0, embed_ref.shape[0] - 1)

  def tile_coords(s, j, rt):
    """Rows and columns of block j for request tile rt at step s."""
    b_idx = rt * block_b + lane
    b_mask = b_idx < batch
    d = b_idx * steps + s  # draw (b, s): flat index b * S + s
    cols = j * block_v + col
    v_mask = cols < vocab  # also all False for j >= num_blocks
    return b_idx, b_mask, d, cols, v_mask

  def load_base(s, j, rt, when=True):
    _, b_mask, d, cols, v_mask = tile_coords(s, j, rt)
    return plgpu.load(base_ref.at[d[:, None], cols[None, :]],
                      mask=b_mask[:, None] & v_mask[None, :] & when, other=0)

  def add_chunk(s, j, rt, c, token, acc, proj):
    """acc + the bias of rank chunk c (proj: its [block_v, block_k] rows)."""
    b_idx, b_mask, _, _, _ = tile_coords(s, j, rt)
    prev = prev_tokens(s, b_idx, b_mask, token)
    k_cols = (c * block_k + jnp.arange(block_k))[None, :]
    emb = plgpu.load(embed_ref.at[prev[:, None], k_cols],
                     mask=b_mask[:, None] & (k_cols < rank), other=0)
    return bias_chunk(acc, emb, proj, bias_dot=config.bias_dot,
                      precision=precision)

  def finish(s, j, rt, x):
    """Stores block j's logits x of tile rt to the cache, and its
    statistics."""
    _, b_mask, d, cols, v_mask = tile_coords(s, j, rt)
    if cache_rows_ref is None:
      rows, write = d, b_mask
    else:
      rows = plgpu.load(cache_rows_ref.at[d], mask=b_mask, other=-1)
      write = rows >= 0
    # The cache holds pre-temperature logits. A row not written points past
    # the cache (padding draws write nothing).
    rows = jnp.where(write, rows, cache_ref.shape[0])
    plgpu.store(cache_ref.at[rows[:, None], cols[None, :]], x,
                mask=write[:, None] & v_mask[None, :])
    scale = plgpu.load(params_ref.at[0, d], mask=b_mask, other=1.0)
    y_max, y_sum, y_arg = block_statistics(x, v_mask[None, :], scale[:, None],
                                           j * block_v)
    in_range = b_mask & (j < num_blocks)
    plgpu.store(bmax_ref.at[d, j], y_max, mask=in_range)
    plgpu.store(bsum_ref.at[d, j], y_sum, mask=in_range)
    plgpu.store(barg_ref.at[d, j], y_arg, mask=in_range)

  def held_block(s, t, token):
    """Held block t (proj on chip) for every request tile."""
    j = p + t * programs

    def tile(rt, carry):
      x = load_base(s, j, rt).astype(jnp.float32)
      for c in range(num_chunks):  # the held chunks, in the streamed order
        x = add_chunk(s, j, rt, c, token, x, held_proj[t][c])
      finish(s, j, rt, x)
      return carry

    if num_tiles == 1:
      tile(0, 0)
    else:
      jax.lax.fori_loop(0, num_tiles, tile, 0)

  def streamed_blocks(s, token):
    """This program's streamed blocks for every request tile.

    One loop over (block, tile, chunk) units, not a loop of loops: Triton
    software-pipelines only an innermost loop, so nested, each block would
    drain the pipeline and wait out a full load latency (read from the
    TTGIR: about 4 blocks a step, one program a multiprocessor, nothing
    else to overlap it with). Flat, the proj and embedding chunks of the next
    block are in flight while this block's last chunk is summed, and base is
    loaded one block ahead, carried in registers across its chunks.
    """
    units = streamed * num_tiles
    # lax.rem, not %: inside a loop, the Triton lowering of jnp's jitted
    # remainder failed on its constant divisor.
    odd = jax.lax.rem(s, 2) == 1

    def unit(q):
      u, rt = jax.lax.div(q, num_tiles), jax.lax.rem(q, num_tiles)
      if config.serpentine:
        # Odd steps take this program's streamed blocks in reverse, so a
        # step starts on the proj blocks the step before read last (still
        # in L2).
        u = jnp.where(odd, streamed - 1 - u, u)
      return p + (held + u) * programs, rt

    def base_of(q, when):
      j, rt = unit(q)
      return load_base(s, j, rt, when & (q < units))

    def body(i, carry):
      acc, pending = carry
      q, c = jax.lax.div(i, num_chunks), jax.lax.rem(i, num_chunks)
      first = c == 0
      j, rt = unit(q)
      # A unit starts from its base (loaded a unit ago) and loads the next
      # unit's base, to be waited for only a unit from now.
      acc = jnp.where(first, pending.astype(jnp.float32), acc)
      pending = jnp.where(first, base_of(q + 1, first), pending)
      acc = add_chunk(s, j, rt, c, token, acc, proj_chunk(j, c))

      @pl.when(c == num_chunks - 1)
      def _finish():
        finish(s, j, rt, acc)

      return acc, pending

    jax.lax.fori_loop(
        0, units * num_chunks, body,
        (jnp.zeros((block_b, block_v), jnp.float32),
         base_of(jnp.zeros((), jnp.int32), True)))

  def draw(s, r):
    d = r * steps + s
    return draw_token(
        bmax_ref, bsum_ref, barg_ref, cache_ref, params_ref, cache_rows_ref,
        d, d, num_blocks=num_blocks,
        blocks_pow2=pl.next_power_of_2(num_blocks), block_v=block_v,
        vocab=vocab)

  def one_step(s, token):
    for t in range(held):
      held_block(s, t, token)
    streamed_blocks(s, token)

    # The step barrier. The counter only grows (P a step), so a program
    # already in the next step cannot make a slower one miss this step's
    # count.
    _arrive_and_wait(counter_ref, 0, jnp.ones((), jnp.int32),
                     (s + 1) * programs, interpret=interpret)

    if batch == 1:
      token = draw(s, 0)

      @pl.when(p == 0)
      def _store_token():
        tokens_ref[s] = token

      return token

    # Program p draws requests p, p + P, ...; the next step reads the tokens
    # once all B of this step are counted.
    # (batch - p + P - 1 > 0: lax.div truncates as floor here.)
    owned = jax.lax.div(batch - p + programs - 1, programs)

    def draw_owned(i, carry):
      r = p + i * programs
      tokens_ref[r * steps + s] = draw(s, r)
      return carry

    jax.lax.fori_loop(0, owned, draw_owned, 0)
    _arrive_and_wait(counter_ref, 1, owned.astype(jnp.int32),
                     (s + 1) * batch, interpret=interpret)
    return token

  first = ins["anchors"][0] if batch == 1 else jnp.zeros((), jnp.int32)
  jax.lax.fori_loop(0, steps, one_step, first)


def draft_pass(base: jax.Array, embed: jax.Array, proj: jax.Array,
               anchors: jax.Array, params: jax.Array,
               cache_rows: jax.Array | None = None,
               cache: jax.Array | None = None, *, config: KernelConfig,
               num_steps: int, num_cache_rows: int,
               num_sms: int | None = None, interpret: bool = False):
  """Runs all S steps of a draft in one launch.

  Args:
    base: [B * S, V] base logits (bf16, fp16 or fp32), request-major rows:
      draw (b, s) is row b * S + s.
    embed: [V_in, R] and proj: [V, R], the Markov head (one dtype).
    anchors: int32 [B], the token before each request's first draw.
    params: float32 [3, B * S], per draw: 1 / T (1 where greedy), 1 where
      the draw is the argmax (else 0), and the uniform u.
    cache_rows: int32 [B * S], the cache row each draw writes, -1 for none
      (padding, which must be greedy); None for the dense layout (draw d
      writes row d).
    cache: float32 [num_cache_rows, V] to update in place, or None to return a
      new one (dense: every row is written).
    config: a configuration with select="persistent". The draft pass reads
      block_b (requests a tile; the programs loop over ceil(B / block_b)
      tiles), block_v, block_k (rank columns a chunk), bias_dot, serpentine
      (odd steps take each program's streamed blocks in reverse order; the
      results do not depend on it), programs (P, see :func:`check_programs`;
      0: one a multiprocessor, 1 in the interpreter), held_blocks (blocks of
      proj a program keeps on chip for the whole draft; at most the blocks
      every program has), num_warps and num_stages.
    num_steps: S (static).
    num_cache_rows: rows of the cache (static).
    num_sms: the GPU's multiprocessors (static); None: JAX's first GPU. A
      native runtime lowering for another process's GPU passes it.
    interpret: run in the Pallas interpreter (CPU; programs must be 1).

  Returns:
    (cache float32 [num_cache_rows, V], tokens int32 [B * S]).

  Operands of the pallas_call (the order a native runtime binds pointers
  in): the inputs that are given, in the order ``base, embed, proj, anchors,
  params, cache_rows, cache, counters``, then the outputs ``cache, block_max,
  block_sum, block_argmax, tokens, counters`` (see :data:`INPUTS`,
  :data:`OUTPUTS`). counters is int32 [2] zeros, made here (a native runtime
  zeroes its own before each launch); they end at (S * P, S * B). The block
  statistics are float32 / int32 [B * S, NB] scratch, one row per draw. The
  outputs cache and counters alias the inputs of those names.
  """
  if config.select != "persistent":
    raise ValueError("the draft pass runs select='persistent' configurations, "
                     f"got select={config.select!r}")
  steps = num_steps
  batch, vocab = base.shape[0] // steps, base.shape[1]
  rank = proj.shape[1]
  if num_sms is None and not interpret:
    num_sms = multiprocessors()
  programs = num_programs(config, interpret=interpret, num_sms=num_sms)
  check_programs(programs, interpret=interpret, num_sms=num_sms)
  num_blocks = pl.cdiv(vocab, config.block_v)
  # Every program holds at most the blocks it has: the held ones are those
  # all P programs have (the remainder streams).
  held = min(config.held_blocks, num_blocks // programs)
  precision = None
  if proj.dtype == jnp.float32:
    precision = jax.lax.Precision.HIGHEST  # no tf32: keep float32 products
  given = dict(base=base, embed=embed, proj=proj, anchors=anchors,
               params=params, cache_rows=cache_rows, cache=cache,
               counters=jnp.zeros((NUM_COUNTERS,), jnp.int32))
  kernel = functools.partial(
      _draft_kernel, batch=batch, steps=steps, vocab=vocab, rank=rank,
      config=config, programs=programs, held=held, precision=precision,
      interpret=interpret)
  outputs = dict(
      cache=jax.ShapeDtypeStruct((num_cache_rows, vocab), jnp.float32),
      block_max=jax.ShapeDtypeStruct((batch * steps, num_blocks), jnp.float32),
      block_sum=jax.ShapeDtypeStruct((batch * steps, num_blocks), jnp.float32),
      block_argmax=jax.ShapeDtypeStruct((batch * steps, num_blocks),
                                        jnp.int32),
      tokens=jax.ShapeDtypeStruct((batch * steps,), jnp.int32),
      counters=jax.ShapeDtypeStruct((NUM_COUNTERS,), jnp.int32),
  )
  out = named_call(
      kernel, {name: given[name] for name in INPUTS}, outputs,
      aliased=("cache", "counters"),
      grid=(programs,),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="markov_draft_pass",
  )
  return out["cache"], out["tokens"]
