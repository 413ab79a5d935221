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

from jax_markov import validate

_MASK32 = (1 << 32) - 1


_SEED_MIN, _SEED_END = -(1 << 63), 1 << 64  # a seed is 64 bits, either sign


def _is_split(dtype, shape) -> bool:
  """[..., 2] uint32 or int32 (bit patterns), at least 2-D: already split.

  A 1-D array is always [B] seeds, also when B = 2: a single split seed
  ``[hi, lo]`` is given as [1, 2].
  """
  return (len(shape) >= 2 and shape[-1] == 2
          and np.dtype(dtype) in (np.dtype(np.uint32), np.dtype(np.int32)))


def _python_seeds(seeds) -> np.ndarray:
  """Python ints (nested lists / tuples) -> uint64, each a 64-bit pattern.

  NumPy would give a list mixing negative ints and ints >= 2^63 dtype float64
  (or object), losing bits; each int is taken on its own instead.
  """
  arr = np.array(seeds, dtype=object)
  flat = arr.ravel()
  out = np.empty(flat.shape, np.uint64)
  for i, x in enumerate(flat):
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, np.integer)):
      raise TypeError(f"seeds must be integers, got {type(x).__name__} {x!r}")
    x = int(x)
    if not _SEED_MIN <= x < _SEED_END:
      raise ValueError(f"seeds must be 64-bit integers in [-2**63, 2**64), got {x}")
    out[i] = x & ((1 << 64) - 1)
  return out.reshape(arr.shape)


def seed_words(seeds) -> jax.Array:
  """Splits seeds into their (hi, lo) 32-bit words.

  Args:
    seeds: one of
      * a Python int or (nested) list / tuple of them, each in
        [-2^63, 2^64): split on the host, all 64 bits kept (two's complement:
        -1 and 2^64 - 1 are the same seed);
      * an integer NumPy array of shape [...] (int64, uint64 or narrower):
        split on the host, all 64 bits kept;
      * a JAX integer array of shape [...] (32-bit or narrower; 64-bit under
        x64); signed values are sign-extended to 64 bits, as NumPy would;
      * a NumPy or JAX array of shape [..., 2], at least 2-D, with dtype uint32
        (or int32 bit patterns, as the torch bridge passes them): already
        split into (hi, lo), taken as is. A 1-D array is always seeds.
    Booleans and floats are refused (TypeError).

  Returns:
    uint32 [..., 2]: ``[hi, lo]`` per seed.
  """
  if isinstance(seeds, jax.Array):
    if _is_split(seeds.dtype, seeds.shape):
      return seeds if seeds.dtype == jnp.uint32 else jax.lax.bitcast_convert_type(
          seeds, jnp.uint32)
    if seeds.dtype == jnp.bool_ or not jnp.issubdtype(seeds.dtype, jnp.integer):
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
  if isinstance(seeds, (np.ndarray, np.generic)):
    arr = np.asarray(seeds)
    if _is_split(arr.dtype, arr.shape):
      return jnp.asarray(arr.view(np.uint32))
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
      if arr.dtype == object:
        arr = _python_seeds(arr)
      else:
        raise TypeError(f"seeds must be integers, got dtype {arr.dtype}")
  else:
    arr = _python_seeds(seeds)
  # Two's complement: an int64 seed and the uint64 of the same bits are the
  # same seed, as in jax.random.PRNGKey under x64.
  u64 = arr.astype(np.int64).view(np.uint64) if arr.dtype != np.uint64 else arr
  words = np.stack([(u64 >> np.uint64(32)).astype(np.uint32),
                    (u64 & np.uint64(_MASK32)).astype(np.uint32)], axis=-1)
  return jnp.asarray(words)


def check_seeds(seeds, n: int, what: str = "B") -> jax.Array:
  """seed_words(seeds), refused unless it holds exactly n seeds. uint32 [n, 2]."""
  words = seed_words(seeds)
  if tuple(words.shape) != (n, 2):
    shape = tuple(np.shape(seeds)) if not hasattr(seeds, "shape") else tuple(seeds.shape)
    dtype = getattr(seeds, "dtype", None)
    got = f"shape {shape}" + (f" and dtype {dtype}" if dtype is not None else "")
    raise ValueError(
        f"seeds must be [{what}]=[{n}] integers, or [{what}, 2]=[{n}, 2] uint32 "
        f"(or int32) already split into (hi, lo); got {got}")
  return words


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
    positions: int [B, S], the position each draw is keyed by, in [0, 2^31)
      (refused outside it when concrete; under jit a wider dtype is cut to
      its low 32 bits, see docs/limitations.md).

  Returns:
    float32 [B, S] in [0, 1): ``u[b, s]`` as documented in this module.
  """
  words = seed_words(seeds)
  if words.ndim != 2:
    raise ValueError(
        f"draft_uniforms: seeds must be [B] integers or [B, 2] uint32 already "
        f"split, got words of shape {tuple(words.shape)}")
  B = words.shape[0]
  validate.check_positions(positions, B, None, check_values=True,
                           where="draft_uniforms: ")
  return uniforms_from_words(words, jnp.asarray(positions))
