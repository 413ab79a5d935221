"""The RNG contract: seeds and positions -> keys -> uniforms.

Every draw of the sampler consumes one float32 uniform ``u`` in [0, 1). The
uniform of the draw at (request b, step s) is::

    key = threefry2x32 key with data [hi, lo]      # (hi, lo): the two 32-bit
                                                   # words of the 64-bit seed
    u   = jax.random.uniform(jax.random.fold_in(key, position[b, s]), (),
                             jnp.float32)

The key is exactly ``jax.random.PRNGKey(seed)`` as JAX builds it from a 64-bit
seed when x64 is enabled (threefry's seed function splits the seed into its
high and low words), so all 64 bits of the seed matter, and no x64 mode is
needed: the split happens on the host (NumPy int64/uint64 arrays, Python ints)
or arrives already split as ``uint32 [..., 2]`` (what the torch bridge passes).

A position is a non-negative int32 (vLLM keys a draw by the position of the
token before the predicted one). Two draws with the same seed and position get
the same uniform; the step index itself is not part of the key, so a request's
draws depend only on its own seed and positions, never on its row in the batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

_MASK32 = (1 << 32) - 1


def seed_words(seeds) -> jax.Array:
  """Splits seeds into their (hi, lo) 32-bit words.

  Args:
    seeds: one of
      * an integer NumPy array / Python int / list of shape [...] (int64,
        uint64 or narrower): split on the host, all 64 bits kept;
      * a JAX integer array of shape [...] with 32-bit or narrower dtype
        (signed values are sign-extended to 64 bits, as NumPy would);
      * an array of shape [..., 2] with dtype uint32 (or int32 bit patterns):
        already split, taken as is.

  Returns:
    uint32 [..., 2]: ``[hi, lo]`` per seed.
  """
  if isinstance(seeds, jax.Array):
    if seeds.dtype == jnp.uint32 and seeds.ndim >= 1 and seeds.shape[-1] == 2:
      return seeds
    if not jnp.issubdtype(seeds.dtype, jnp.integer):
      raise TypeError(f"seeds must be integers, got dtype {seeds.dtype}")
    if seeds.dtype.itemsize > 4:  # only reachable with x64 enabled
      s = seeds.astype(jnp.uint64)
      return jnp.stack([(s >> 32).astype(jnp.uint32),
                        (s & _MASK32).astype(jnp.uint32)], axis=-1)
    lo = seeds.astype(jnp.uint32)
    if jnp.issubdtype(seeds.dtype, jnp.signedinteger):
      hi = jnp.where(seeds < 0, jnp.uint32(_MASK32), jnp.uint32(0))
    else:
      hi = jnp.zeros_like(lo)
    return jnp.stack([hi, lo], axis=-1)
  arr = np.asarray(seeds)
  if not np.issubdtype(arr.dtype, np.integer):
    if arr.dtype == object:  # Python ints beyond int64
      arr = np.asarray([int(x) & ((1 << 64) - 1) for x in arr.ravel()],
                       dtype=np.uint64).reshape(arr.shape)
    else:
      raise TypeError(f"seeds must be integers, got dtype {arr.dtype}")
  # Two's complement: an int64 seed and the uint64 of the same bits are the
  # same seed, as in jax.random.PRNGKey under x64.
  u64 = arr.astype(np.int64).view(np.uint64) if arr.dtype != np.uint64 else arr
  words = np.stack([(u64 >> np.uint64(32)).astype(np.uint32),
                    (u64 & np.uint64(_MASK32)).astype(np.uint32)], axis=-1)
  return jnp.asarray(words)


def _uniform_one(words: jax.Array, position: jax.Array) -> jax.Array:
  key = jax.random.wrap_key_data(words, impl="threefry2x32")
  key = jax.random.fold_in(key, position)
  return jax.random.uniform(key, (), jnp.float32)


def uniforms_from_words(words: jax.Array, positions: jax.Array) -> jax.Array:
  """Uniforms for already-split seeds: words uint32 [B, 2], positions [B, S]."""
  per_request = jax.vmap(_uniform_one, in_axes=(None, 0))
  return jax.vmap(per_request)(words, positions.astype(jnp.int32))


def draft_uniforms(seeds, positions) -> jax.Array:
  """The uniforms the sampler uses for each draw.

  Args:
    seeds: [B] integer seeds (64-bit NumPy arrays accepted without x64), or
      uint32 [B, 2] already split into (hi, lo); see :func:`seed_words`.
    positions: int [B, S], the position each draw is keyed by (>= 0).

  Returns:
    float32 [B, S] in [0, 1): ``u[b, s]`` as documented in this module.
  """
  words = seed_words(seeds)
  positions = jnp.asarray(positions)
  if words.ndim != 2 or positions.ndim != 2 or words.shape[0] != positions.shape[0]:
    raise ValueError(
        f"draft_uniforms: seeds [B] and positions [B, S] expected, got seeds "
        f"words {tuple(words.shape)} and positions {tuple(positions.shape)}")
  return uniforms_from_words(words, positions)
