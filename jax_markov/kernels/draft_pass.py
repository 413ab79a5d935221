"""The draft pass: all S steps of a draft in one launch (persistent programs).

Grid (requests, P): the P programs of request b split its vocabulary blocks
among them (program p takes blocks p, p + P, p + 2P, ...) and keep them for
the whole draft. Each step, every program

1. forms the pre-temperature logits ``x = base + proj @ embed[prev]`` of its
   blocks (the bias on the CUDA cores, one request a program, as the block
   pass with ``bias_dot="fma"``), stores x to the cache and keeps the blocks'
   max, sum of exp and first-max index, as the block pass does;
2. counts itself done on its request's counter and waits until all P
   programs of the request have counted for this step (a barrier through an
   acq_rel atomic at GPU scope);
3. draws the step's token from the block statistics and one block of the
   cache, with the select pass's arithmetic (:func:`select_pass.draw_token`).
   Every program draws, from the same data with the same arithmetic, so all P
   hold the same token and none waits for another to publish it; program 0
   stores it.

So a draft is one launch instead of S or 2S, with no gap between the steps.
The barrier needs all P programs of a request resident at once: the wrapper
allows P = 1 (a program only waits for itself) or B * P no larger than the
number of multiprocessors (one program each). The interpreter runs programs
one after another, so there only P = 1 can run.

The statistics are kept per draw ([B * S, NB]): a program that has started the
next step never overwrites what a slower one is still reading.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_markov.kernels.block_pass import block_statistics
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


def multiprocessors() -> int | None:
  """Multiprocessors of the first GPU; None without one or its count."""
  try:
    devices = jax.devices("gpu")
  except RuntimeError:
    return None
  return getattr(devices[0], "core_count", None) if devices else None


def check_programs(batch: int, programs: int, *, interpret: bool,
                   num_sms: int | None) -> None:
  """Raises ValueError where the barrier could wait for a program never run."""
  if programs < 1:
    raise ValueError(f"programs must be >= 1, got {programs}")
  if programs == 1:
    return
  if interpret:
    raise ValueError("the draft pass in the interpreter needs programs=1 "
                     "(programs run one after another: the first would wait "
                     f"for the others forever), got {programs}")
  if num_sms is None or batch * programs > num_sms:
    raise ValueError(
        f"the draft pass needs batch * programs <= multiprocessors so every "
        f"program is resident at its barrier; got {batch} * {programs} with "
        f"{num_sms} multiprocessors")


def _draft_kernel(ins, outs, *, steps: int, vocab: int, rank: int,
                  block_v: int, block_k: int, programs: int, serpentine: bool):
  base_ref, embed_ref, proj_ref = ins["base"], ins["embed"], ins["proj"]
  params_ref = ins["params"]
  cache_rows_ref = ins.get("cache_rows")  # absent: the dense layout
  # Through the outputs: the cache and the counters alias the inputs of those
  # names (where given), so their input refs are not read.
  cache_ref, tokens_ref, counter_ref = (outs["cache"], outs["tokens"],
                                        outs["counters"])
  bmax_ref, bsum_ref, barg_ref = (outs["block_max"], outs["block_sum"],
                                  outs["block_argmax"])
  dense = cache_rows_ref is None

  b = pl.program_id(0)
  p = pl.program_id(1)
  num_blocks = pl.cdiv(vocab, block_v)
  per_program = pl.cdiv(num_blocks, programs)
  num_chunks = pl.cdiv(rank, block_k)
  col = jnp.arange(block_v)

  def one_step(s, prev):
    d = b * steps + s  # draw (b, s): flat index b * S + s
    # A token outside the table is clamped, as XLA's gather clamps.
    prev_rows = jnp.full((1, 1), jnp.minimum(jnp.maximum(prev, 0),
                                             embed_ref.shape[0] - 1))
    if dense:
      cache_row, write = d, None
    else:
      cache_row = cache_rows_ref[d]
      write = cache_row >= 0
    # A row not written points past the cache (padding draws write nothing).
    rows = jnp.full((1, 1), cache_row if write is None else
                    jnp.where(write, cache_row, cache_ref.shape[0]))
    scale = params_ref[0, d]
    draws = jnp.full((1, 1), d)
    stat_rows = jnp.full((1,), d)
    # lax.rem, not %: inside a loop, the Triton lowering of jnp's jitted
    # remainder failed on its constant divisor.
    odd = jax.lax.rem(s, 2) == 1

    def one_block(t, carry):
      if serpentine:
        # Odd steps take this program's blocks in reverse, so a step starts
        # on the proj blocks the step before read last (still in L2).
        t = jnp.where(odd, per_program - 1 - t, t)
      j = p + t * programs
      v0 = j * block_v
      cols = (v0 + col)[None, :]                                # [1, block_v]
      v_mask = cols < vocab        # also all False for j >= num_blocks
      x = plgpu.load(base_ref.at[draws, cols], mask=v_mask,
                     other=0).astype(jnp.float32)
      v_rows = (v0 + col)[:, None]                              # [block_v, 1]

      def rank_chunk(c, acc):
        # The bias on the CUDA cores, as the block pass's fma path with one
        # request a program: the same products summed in the same chunks.
        k_cols = (c * block_k + jnp.arange(block_k))[None, :]
        emb = plgpu.load(embed_ref.at[prev_rows, k_cols], mask=k_cols < rank,
                         other=0)
        proj = plgpu.load(proj_ref.at[v_rows, k_cols],
                          mask=(v_rows < vocab) & (k_cols < rank), other=0)
        prod = proj.astype(jnp.float32) * emb.astype(jnp.float32)
        return acc + jnp.sum(prod, axis=1)[None, :]

      # Triton software-pipelines this loop: the next proj chunk is in flight
      # while this one is summed.
      x = jax.lax.fori_loop(0, num_chunks, rank_chunk, x)
      # The cache holds pre-temperature logits.
      plgpu.store(cache_ref.at[rows, cols], x,
                  mask=v_mask if write is None else v_mask & write)
      y_max, y_sum, y_arg = block_statistics(x, v_mask, scale, v0)
      in_range = jnp.full((1,), j < num_blocks)
      # Stored by the thread that counts below, after the reductions' barrier
      # that also follows every thread's cache stores: the count releases
      # both.
      plgpu.store(bmax_ref.at[stat_rows, j], y_max, mask=in_range)
      plgpu.store(bsum_ref.at[stat_rows, j], y_sum, mask=in_range)
      plgpu.store(barg_ref.at[stat_rows, j], y_arg, mask=in_range)
      return carry

    jax.lax.fori_loop(0, per_program, one_block, d)

    # The barrier: count this program done (acq_rel at GPU scope releases its
    # stores), then wait until the request's P programs have all counted for
    # this step; the acquire makes their stores visible here. The counter
    # only grows (P per step), so a program already in the next step cannot
    # make a slower one miss this step's count.
    seen = plgpu.atomic_add(counter_ref, b, jnp.ones((), jnp.int32)) + 1
    target = (s + 1) * programs
    zero = seen * 0  # traced: a constant would be a const of the loop body
    jax.lax.while_loop(lambda c: c < target,
                       lambda c: plgpu.atomic_add(counter_ref, b, zero), seen)

    token = draw_token(
        bmax_ref, bsum_ref, barg_ref, cache_ref, params_ref, cache_rows_ref,
        d, d, num_blocks=num_blocks,
        blocks_pow2=pl.next_power_of_2(num_blocks), block_v=block_v,
        vocab=vocab)

    @pl.when(p == 0)
    def _store_token():
      tokens_ref[d] = token

    return token

  jax.lax.fori_loop(0, steps, one_step, ins["anchors"][b])


def draft_pass(base: jax.Array, embed: jax.Array, proj: jax.Array,
               anchors: jax.Array, params: jax.Array,
               cache_rows: jax.Array | None = None,
               cache: jax.Array | None = None, *, config: KernelConfig,
               num_steps: int, num_cache_rows: int, interpret: bool = False):
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
    config: a configuration with select="persistent" (KernelConfig then
      holds block_b=1, bias_dot="fma"); the draft pass reads block_v,
      block_k (rank columns summed per loop iteration), serpentine (odd steps
      take each program's blocks in reverse order; the results do not depend
      on it), programs (P, programs per request, see :func:`check_programs`;
      0: the multiprocessors split over the requests, 1 in the interpreter),
      num_warps and num_stages.
    num_steps: S (static).
    num_cache_rows: rows of the cache (static).
    interpret: run in the Pallas interpreter (CPU; programs must be 1).

  Returns:
    (cache float32 [num_cache_rows, V], tokens int32 [B * S]).

  Operands of the pallas_call (the order a native runtime binds pointers
  in): the inputs that are given, in the order ``base, embed, proj, anchors,
  params, cache_rows, cache, counters``, then the outputs ``cache, block_max,
  block_sum, block_argmax, tokens, counters`` (see :data:`INPUTS`,
  :data:`OUTPUTS`). counters is int32 [B] zeros, made here; each request's
  counter ends at S * P. The block statistics are float32 / int32
  [B * S, NB] scratch, one row per draw. The outputs cache and counters
  alias the inputs of those names.
  """
  if config.select != "persistent":
    raise ValueError("the draft pass runs select='persistent' configurations, "
                     f"got select={config.select!r}")
  steps = num_steps
  block_v = config.block_v
  batch, vocab = base.shape[0] // steps, base.shape[1]
  rank = proj.shape[1]
  num_sms = None if interpret else multiprocessors()
  programs = config.programs
  if programs == 0:
    programs = max(1, (num_sms or 1) // batch)
  check_programs(batch, programs, interpret=interpret, num_sms=num_sms)
  num_blocks = pl.cdiv(vocab, block_v)
  given = dict(base=base, embed=embed, proj=proj, anchors=anchors,
               params=params, cache_rows=cache_rows, cache=cache,
               counters=jnp.zeros((batch,), jnp.int32))
  kernel = functools.partial(
      _draft_kernel, steps=steps, vocab=vocab, rank=rank, block_v=block_v,
      block_k=config.block_k, programs=programs, serpentine=config.serpentine)
  outputs = dict(
      cache=jax.ShapeDtypeStruct((num_cache_rows, vocab), jnp.float32),
      block_max=jax.ShapeDtypeStruct((batch * steps, num_blocks), jnp.float32),
      block_sum=jax.ShapeDtypeStruct((batch * steps, num_blocks), jnp.float32),
      block_argmax=jax.ShapeDtypeStruct((batch * steps, num_blocks),
                                        jnp.int32),
      tokens=jax.ShapeDtypeStruct((batch * steps,), jnp.int32),
      counters=jax.ShapeDtypeStruct((batch,), jnp.int32),
  )
  out = named_call(
      kernel, {name: given[name] for name in INPUTS}, outputs,
      aliased=("cache", "counters"),
      grid=(batch, programs),
      compiler_params=plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages),
      interpret=interpret,
      name="markov_draft_pass",
  )
  return out["cache"], out["tokens"]
