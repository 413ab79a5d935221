"""embed_rows: each request's previous-token embedding row, for one step.

The Mosaic GPU block pass (kernels/mosaic_block_pass.py) takes the step's
embeddings as a dense [B, R] operand that it keeps in shared memory, where
the Triton block pass gathers them itself. In the native runtime this
kernel fills that operand before each step: one program per request copies
``embed[prev]``, prev being ``anchors[b]`` at step 0 and the token drawn at
the step before otherwise (``tokens[b * S + s - 1]``), both data, so one
compiled kernel serves every step of a captured draft.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_markov.kernels.named_call import named_call

INPUTS = ("embed", "anchors", "tokens", "step")
OUTPUTS = ("emb",)


def _embed_rows_kernel(ins, outs, *, steps: int, rank: int, rank_pow2: int):
  b = pl.program_id(0)
  s = ins["step"][0]
  # At step 0 the tokens are not drawn yet: the index is clamped to a valid
  # entry and its value discarded.
  prev = ins["tokens"][b * steps + jnp.maximum(s - 1, 0)]
  token = jnp.where(s == 0, ins["anchors"][b], prev)
  cols = jnp.arange(rank_pow2)
  row = plgpu.load(ins["embed"].at[token, pl.ds(0, rank_pow2)],
                   mask=cols < rank, other=0)
  plgpu.store(outs["emb"].at[b, pl.ds(0, rank_pow2)], row, mask=cols < rank)


@functools.partial(jax.jit, static_argnames=("num_steps", "interpret"))
def embed_rows(embed: jax.Array, anchors: jax.Array, tokens: jax.Array,
               step: jax.Array, *, num_steps: int,
               interpret: bool = False) -> jax.Array:
  """The embedding rows of each request's previous token at step ``step``.

  Args:
    embed: [V_in, R] embedding table (any dtype).
    anchors: int32 [B], the token before the first draft position, in
      [0, V_in).
    tokens: int32 [B * S], the draft's tokens, draw (b, s) at b * S + s; only
      the entries of step s - 1 are read (none at step 0).
    step: int32 [1], the step s.
    num_steps: S (static).
    interpret: run in the Pallas interpreter (CPU).

  Returns:
    [B, R] in embed's dtype: ``embed[anchors[b]]`` at step 0, else
    ``embed[tokens[b * S + s - 1]]``.

  Operands of the pallas_call (the order a native runtime binds pointers
  in): ``embed, anchors, tokens, step``, then the output ``emb``.
  """
  batch = anchors.shape[0]
  rank = embed.shape[1]
  if tokens.shape != (batch * num_steps,):
    raise ValueError(f"tokens must be int32 [B * S] = [{batch * num_steps}], "
                     f"got {tokens.shape}")
  kernel = functools.partial(_embed_rows_kernel, steps=num_steps, rank=rank,
                             rank_pow2=pl.next_power_of_2(rank))
  out = named_call(
      kernel, dict(embed=embed, anchors=anchors, tokens=tokens, step=step),
      dict(emb=jax.ShapeDtypeStruct((batch, rank), embed.dtype)),
      grid=(batch,),
      compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
      interpret=interpret, name="markov_embed_rows")
  return out["emb"]
