"""The draw parameters of a batch, from a serving engine's buffers, in one kernel.

What ``jm.sample_draft_into`` computes with XLA ops before its first step (the
per-draw 1 / T, greedy flag and uniform, the cache row of each draw, the
anchor tokens) as one Pallas launch that reads vLLM's buffers as they are.
The native torch runtime (torch_bridge/native.py) runs it, so a draft is only
Pallas kernels launched on torch's stream.

Integer buffers arrive as int32 words: an int64 tensor is read as its
little-endian ``[lo, hi]`` word pairs (``ParamsLayout.*_wide``), so no int64
array is needed (JAX without x64 has none) and torch makes no copy.

For draw (b, s), with ``row = idx[b * S + s]``:

* valid = b < num_reqs and 0 <= row < num_rows (an int64 row must also have a
  zero high word); an invalid draw writes nothing (cache row -1) and is greedy;
* the uniform is ``jax.random.uniform(fold_in(key(seeds[row]), pos - 1))``
  (the RNG contract of jax_markov/rng.py: vLLM keys a draw by the position of
  the token before the predicted one), computed with threefry2x32 here, bit
  for bit what :func:`jax_markov.draft_uniforms` returns;
* greedy where not ``temperature[row] > 0`` (0, negative or NaN: values a
  captured graph cannot check draw the argmax rather than an inverted or NaN
  distribution); else ``1 / T`` rounded to nearest, as XLA divides, with
  :func:`jax_markov.reference.draw_params`' rule for subnormal and infinite T.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jax_markov.kernels import dependent_launch as dependent_launch_module
from jax_markov.kernels.dependent_launch import wait_for_prior_kernels
from jax_markov.reference import MIN_SCALE


@dataclasses.dataclass(frozen=True)
class ParamsLayout:
  """Which int buffers are int64 (read as [lo, hi] int32 word pairs).

  Attributes:
    idx_wide: the state-row map ``idx`` [>= B * S].
    pos_wide: the positions ``pos`` [>= B * S].
    seeds_wide: the seeds [N] (int32 seeds are sign-extended to 64 bits).
    ids_wide: the token ids the anchors are read from.
    anchor_idx_wide: the anchor indices into the token ids.
  """
  idx_wide: bool = False
  pos_wide: bool = False
  seeds_wide: bool = True
  ids_wide: bool = False
  anchor_idx_wide: bool = True


_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))


def _rotl(x, r: int):
  return jax.lax.shift_left(x, np.uint32(r)) | jax.lax.shift_right_logical(
      x, np.uint32(32 - r))


def threefry2x32(k0, k1, x0, x1):
  """Threefry-2x32 with 20 rounds (jax.random's), on uint32 arrays."""
  ks = (k0, k1, k0 ^ k1 ^ np.uint32(0x1BD11BDA))
  x0, x1 = x0 + ks[0], x1 + ks[1]
  for i in range(5):
    for r in _ROTATIONS[i % 2]:
      x0 = x0 + x1
      x1 = _rotl(x1, r) ^ x0
    x0 = x0 + ks[(i + 1) % 3]
    x1 = x1 + ks[(i + 2) % 3] + np.uint32(i + 1)
  return x0, x1


def uniform_from_words(hi, lo, position):
  """jax.random.uniform(fold_in(key, position), (), float32), elementwise.

  hi, lo: uint32, the key data words; position: uint32 fold-in data.
  """
  zero = jnp.zeros_like(hi)
  k0, k1 = threefry2x32(hi, lo, zero, position)  # fold_in: count [0, data]
  b0, b1 = threefry2x32(k0, k1, zero, zero)  # random_bits: count (0, 0)
  bits = b0 ^ b1
  one = np.uint32(np.float32(1.0).view(np.uint32))
  f = jax.lax.bitcast_convert_type(
      jax.lax.shift_right_logical(bits, np.uint32(9)) | one, jnp.float32)
  return jnp.maximum(f - 1.0, 0.0)


def _reciprocal(t, *, interpret: bool):
  """1 / t rounded to nearest (Triton's own float division is approximate)."""
  if interpret:
    return 1.0 / t
  (r,) = plgpu.elementwise_inline_asm(
      "rcp.rn.f32 $0, $1;", args=[t], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(t.shape, jnp.float32)])
  return r


def _word(ref, i, mask, wide: bool):
  """The low word of element i (an int64 buffer), or element i (int32)."""
  return plgpu.load(ref.at[i * 2 if wide else i], mask=mask, other=0)


def _low(ref, i, mask, wide: bool):
  """Element i of an int32 buffer, or of an int64 one saturated to int32.

  An int64 value outside the int32 range saturates to int32's min or max,
  never cut to its low word (which would alias a valid row, index or token):
  a state row then counts as padding, an anchor index or token is clamped.
  """
  lo = _word(ref, i, mask, wide)
  if not wide:
    return lo
  hi = plgpu.load(ref.at[i * 2 + 1], mask=mask, other=0)
  info = jnp.iinfo(jnp.int32)
  fits = hi == jnp.where(lo < 0, -1, 0)
  return jnp.where(fits, lo, jnp.where(hi < 0, info.min, info.max))


def _draw_params_kernel(idx_ref, pos_ref, temperature_ref, seeds_ref, ids_ref,
                        anchor_idx_ref, num_reqs_ref, params_ref,
                        cache_rows_ref, anchors_ref, *, layout: ParamsLayout,
                        steps: int, steps_pow2: int, num_rows: int,
                        num_ids: int, vocab_in: int, interpret: bool,
                        dependent_launch: bool):
  # Every input may come from the kernels just before the draft (the
  # engine's), every output is read by the draft's other kernels: all after
  # the wait, through b and zero.
  b, zero = pl.program_id(0), 0
  if dependent_launch:
    zero = wait_for_prior_kernels(dependent_launch)
    b = b + zero
  live = b < num_reqs_ref[zero]
  s = jnp.arange(steps_pow2)
  s_mask = s < steps
  d = b * steps + s  # flat draw index, request-major

  idx = _low(idx_ref, d, s_mask, layout.idx_wide)
  valid = live & s_mask & (idx >= 0) & (idx < num_rows)
  row = jnp.where(valid, idx, 0)

  t = plgpu.load(temperature_ref.at[row], mask=s_mask,
                 other=0).astype(jnp.float32)
  # reference.draw_params' rule: greedy unless T > 0 (and 1 / T finite: a
  # subnormal T is the limit T -> 0+); 1 / T floored at 2^-126 (T = +inf).
  positive = valid & (t > 0)
  inv = _reciprocal(jnp.where(positive, t, 1.0), interpret=interpret)
  greedy = jnp.logical_not(positive) | (inv == jnp.inf)
  scale = jnp.where(greedy, 1.0, jnp.maximum(inv, MIN_SCALE))

  # The seed's (hi, lo) words, as rng.seed_words splits a 64-bit seed.
  if layout.seeds_wide:
    lo = plgpu.load(seeds_ref.at[row * 2], mask=s_mask, other=0)
    hi = plgpu.load(seeds_ref.at[row * 2 + 1], mask=s_mask, other=0)
  else:
    lo = plgpu.load(seeds_ref.at[row], mask=s_mask, other=0)
    hi = jnp.where(lo < 0, -1, 0).astype(jnp.int32)
  # The key is pos - 1, an int32 >= 0 by contract: pos in [1, 2**31]. A
  # position outside (unreadable in a captured graph) is clamped into that
  # range, never wrapped onto another position's uniform.
  pos = _word(pos_ref, d, s_mask, layout.pos_wide)
  int_min = jnp.iinfo(jnp.int32).min
  if layout.pos_wide:
    pos_hi = plgpu.load(pos_ref.at[d * 2 + 1], mask=s_mask, other=0)
    in_range = (pos_hi == 0) & ((pos >= 1) | (pos == int_min))
    too_low = (pos_hi < 0) | ((pos_hi == 0) & (pos == 0))
  else:
    in_range = pos >= 1
    too_low = jnp.logical_not(in_range)
  key_pos = jnp.where(in_range, pos - 1,  # wraps 2**31 to 2**31 - 1
                      jnp.where(too_low, 0, jnp.iinfo(jnp.int32).max))
  as_u32 = functools.partial(jax.lax.bitcast_convert_type,
                             new_dtype=jnp.uint32)
  u = uniform_from_words(as_u32(hi), as_u32(lo), as_u32(key_pos))

  plgpu.store(params_ref.at[0, d], scale, mask=s_mask)
  plgpu.store(params_ref.at[1, d], greedy.astype(jnp.float32), mask=s_mask)
  plgpu.store(params_ref.at[2, d], u, mask=s_mask)
  plgpu.store(cache_rows_ref.at[d], jnp.where(valid, idx * steps + s, -1),
              mask=s_mask)

  # The anchor: ids[anchor_idx[b]], a negative index counting from the end.
  one = jnp.arange(1) + b
  a = _low(anchor_idx_ref, one, live, layout.anchor_idx_wide)
  a = jnp.clip(jnp.where(a < 0, a + num_ids, a), 0, num_ids - 1)
  tok = _low(ids_ref, a, live, layout.ids_wide)
  # Clamped into the embedding table: the block pass gathers its row.
  tok = jnp.where(live, jnp.clip(tok, 0, vocab_in - 1), 0)
  plgpu.store(anchors_ref.at[one], tok)


def draw_params(idx, pos, temperature, seeds, ids, anchor_idx, num_reqs, *,
                batch: int, steps: int, vocab_in: int, layout: ParamsLayout,
                dependent_launch: bool = False, interpret: bool = False):
  """The per-draw parameters of a batch of ``batch`` requests.

  Args:
    idx: int32 [>= batch * S * w] words of the state row of each draw
      (request-major; -1 = padding).
    pos: int32 words like idx: the predicted token's position of each draw;
      the draw is keyed by ``pos - 1``.
    temperature: float [N], per state row (fp32, fp16 or bf16).
    seeds: int32 [N * w] words of the 64-bit (or int32) seed per state row.
    ids: int32 [num_ids * w] words of the token ids the anchors come from.
    anchor_idx: int32 [>= batch * w] words: the anchor of request b is
      ``ids[anchor_idx[b]]``.
    num_reqs: int32 [1], the live requests; rows past it are padding.
    batch: B, the requests (programs) of this launch (static).
    steps: S (static).
    vocab_in: rows of the embedding table; anchors are clamped into it.
    layout: which buffers are int64 word pairs (static).
    dependent_launch: build for a programmatic dependent launch (static;
      sm_90 or newer, not in the interpreter): the kernel waits for the
      kernels before it first thing, then lets the next one start (see
      :mod:`dependent_launch`).
    interpret: run in the Pallas interpreter (CPU).

  Returns:
    (params float32 [3, B * S]: 1 / T (1 where greedy), 1.0 where greedy,
    the uniform; cache_rows int32 [B * S]: ``idx * S + s`` or -1; anchors
    int32 [B]), as the block and select passes take them.
  """
  dependent_launch_module.check(dependent_launch, interpret=interpret)
  num_rows = temperature.shape[0]
  num_ids = ids.shape[0] // (2 if layout.ids_wide else 1)
  kernel = functools.partial(
      _draw_params_kernel, layout=layout, steps=steps,
      steps_pow2=pl.next_power_of_2(steps), num_rows=num_rows,
      num_ids=num_ids, vocab_in=vocab_in, interpret=interpret,
      dependent_launch=dependent_launch)
  out_shape = (jax.ShapeDtypeStruct((3, batch * steps), jnp.float32),
               jax.ShapeDtypeStruct((batch * steps,), jnp.int32),
               jax.ShapeDtypeStruct((batch,), jnp.int32))
  return pl.pallas_call(
      kernel,
      out_shape=out_shape,
      grid=(batch,),
      compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
      interpret=interpret,
      name="markov_draw_params",
  )(idx, pos, temperature, seeds, ids, anchor_idx, num_reqs)
