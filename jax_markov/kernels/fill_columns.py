"""Fill columns: -inf at the cache columns the reduced draft vocabulary lacks.

With a reduced draft vocabulary (``draft_to_target``) the block pass computes
and stores only the Vd mapped columns of each cache row; the V - Vd target
columns no draft id maps to must read -inf (never drawn, weight 0 for the
verifier). This kernel stores that -inf, once a draft, at a precomputed list
of those columns for every cache row the draft writes. It reads nothing but
the two int32 index lists: an unmapped column costs one 4-byte store, no base
load and no bias.

Why a kernel of its own and not the block pass: the block pass's grid is the
Vd draft columns and its programs run every step; the unmapped list is often
longer than the mapped one (a 32k draft vocabulary of a 129k target leaves
97k), so folding it into the block pass would either give its programs
unequal work every step or need a second grid axis of their own. The values
do not depend on the step, so one launch before step 0 over all B * S rows
writes the same bytes with one launch a draft more (none when Vd == V).

Grid (row tiles, column tiles): each program stores a ``block_rows`` x
``block_cols`` tile of -inf. Masked rows and columns point past the cache
(distinct from every real row / column: the interpreter's scatter has no
order between duplicates).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_markov.kernels.named_call import named_call

# The pallas_call's operands, in order: the inputs that are given, then the
# output cache, which updates the input cache in place when that is given.
INPUTS = ("unmapped", "cache_rows", "cache")
OUTPUTS = ("cache",)


def _fill_columns_kernel(ins, outs, *, num_rows: int, num_unmapped: int,
                         block_rows: int, block_cols: int):
  cache_ref = outs["cache"]
  num_cache_rows, vocab = cache_ref.shape
  r = pl.program_id(0) * block_rows + jnp.arange(block_rows)
  c = pl.program_id(1) * block_cols + jnp.arange(block_cols)
  r_mask, c_mask = r < num_rows, c < num_unmapped
  cache_rows_ref = ins.get("cache_rows")
  if cache_rows_ref is None:  # the dense layout: every row is written
    rows = r
  else:
    rows = plgpu.load(cache_rows_ref.at[r], mask=r_mask, other=-1)
    r_mask = r_mask & (rows >= 0)  # -1: padding, a row not written
  cols = plgpu.load(ins["unmapped"].at[c], mask=c_mask, other=vocab)
  # An entry past the vocabulary is no column (the list's padding).
  c_mask = c_mask & (cols >= 0) & (cols < vocab)
  rows = jnp.where(r_mask, rows, num_cache_rows)
  cols = jnp.where(c_mask, cols, vocab)
  tile = jnp.full((block_rows, block_cols), -jnp.inf, jnp.float32)
  plgpu.store(cache_ref.at[rows[:, None], cols[None, :]], tile,
              mask=r_mask[:, None] & c_mask[None, :])


def fill_columns(unmapped: jax.Array, cache_rows: jax.Array | None = None,
                 cache: jax.Array | None = None, *, num_cache_rows: int,
                 vocab: int, num_rows: int | None = None,
                 block_rows: int = 16, block_cols: int = 512,
                 interpret: bool = False) -> jax.Array:
  """Stores -inf at columns ``unmapped`` of the cache rows a draft writes.

  Args:
    unmapped: int32 [U >= 1], the cache columns to fill; entries outside
      [0, vocab) are skipped (padding).
    cache_rows: int32 [num_rows], the cache rows to fill, -1 for none
      (padding); None for the dense layout, rows 0 .. num_rows - 1.
    cache: float32 [num_cache_rows, vocab] to update in place, or None to
      return a new cache of which only these columns of these rows are
      written (the block pass then writes the rest).
    num_cache_rows, vocab: the cache's shape (static).
    num_rows: rows to fill (static); None: ``cache_rows``' length, or
      num_cache_rows for the dense layout.
    block_rows, block_cols: the tile of one program (powers of two).
    interpret: run in the Pallas interpreter (CPU).

  Returns:
    cache float32 [num_cache_rows, vocab].

  Operands of the pallas_call (the order a native runtime binds pointers
  in): the inputs that are given, in the order ``unmapped, cache_rows,
  cache``, then the output ``cache``, which aliases the input cache where it
  is given (see :data:`INPUTS`, :data:`OUTPUTS`).
  """
  if num_rows is None:
    num_rows = num_cache_rows if cache_rows is None else cache_rows.shape[0]
  num_unmapped = unmapped.shape[0]
  block_cols = min(block_cols, pl.next_power_of_2(num_unmapped))
  block_rows = min(block_rows, pl.next_power_of_2(num_rows))
  kernel = functools.partial(
      _fill_columns_kernel, num_rows=num_rows, num_unmapped=num_unmapped,
      block_rows=block_rows, block_cols=block_cols)
  given = dict(unmapped=unmapped, cache_rows=cache_rows, cache=cache)
  out = named_call(
      kernel, {name: given[name] for name in INPUTS},
      dict(cache=jax.ShapeDtypeStruct((num_cache_rows, vocab), jnp.float32)),
      aliased=("cache",),
      grid=(pl.cdiv(num_rows, block_rows), pl.cdiv(num_unmapped, block_cols)),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1),
      interpret=interpret,
      name="markov_fill_columns",
  )
  return out["cache"]
