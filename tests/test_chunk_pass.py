"""kernels/chunk_pass.py and the select pass on chunk statistics (interpret mode).

The chunk pass against a NumPy reduction of the same statistics (infinite
and NaN-free edge cases: all -inf chunks, +inf blocks, blocks with no
drawable column, NB and B not multiples of the tile); the chunked draw
against the draw rule (check_step: each sampled token where u * Z falls on
the float64 CDF of the cached logits, each greedy one the first argmax).
GPU runs of the same checks: test_mosaic.py (the Mosaic draft takes the
chunked select).
"""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov as jm
from helpers import check_step, make_problem
from jax_markov.kernels.block_pass import block_pass
from jax_markov.kernels.chunk_pass import chunk_pass, num_chunks
from jax_markov.kernels.select_pass import select_pass


def _reference(bmax, bsum, barg, chunk):
  """chunk_pass in NumPy, float64 sums."""
  nb, b = bmax.shape
  nc = -(-nb // chunk)
  cmax = np.full((nc, b), -np.inf, np.float32)
  csum = np.zeros((nc, b))
  carg = np.full((nc, b), -1, np.int32)
  for c in range(nc):
    m = bmax[c * chunk:(c + 1) * chunk]
    s = bsum[c * chunk:(c + 1) * chunk]
    a = barg[c * chunk:(c + 1) * chunk]
    cmax[c] = m.max(axis=0)
    safe = np.where(np.isfinite(cmax[c]), cmax[c], 0.0)
    with np.errstate(invalid="ignore"):
      csum[c] = (s * np.exp(m.astype(np.float64) - safe)).sum(axis=0)
    for r in range(b):
      hits = np.flatnonzero((m[:, r] == cmax[c, r]) & (a[:, r] >= 0))
      if hits.size:
        carg[c, r] = a[hits[0], r]
  return cmax, csum, carg


def _statistics(nb, b, seed):
  rng = np.random.default_rng(seed)
  bmax = rng.normal(size=(nb, b)).astype(np.float32) * 4
  bsum = rng.uniform(1, 64, size=(nb, b)).astype(np.float32)
  barg = (np.arange(nb)[:, None] * 64
          + rng.integers(0, 64, size=(nb, b))).astype(np.int32)
  bmax[:, 0] = -np.inf          # a row with nothing drawable
  bsum[:, 0] = 0
  bmax[3:9, 1] = -np.inf        # -inf blocks across a chunk boundary
  bsum[3:9, 1] = 0
  bmax[5, 2] = np.inf           # a +inf block
  bsum[5, 2] = np.inf
  bmax[:4, 3] = 7.0             # ties: the first block holding the max
  barg[:2, 3] = -1              # ... that has a drawable column
  return bmax, bsum, barg


# Chunks need not be powers of two (the Mosaic pass's are its workers'
# runs of blocks, 31 at B = 256).
CASES = [(37, 6, 8, 4), (16, 5, 4, 8), (9, 4, 16, 4), (12, 4, 1, 2),
         (40, 6, 7, 4), (31, 5, 3, 4)]


@pytest.mark.parametrize("nb,b,chunk,block_b", CASES)
def test_chunk_pass_matches_numpy(nb, b, chunk, block_b, interpret=True):
  bmax, bsum, barg = _statistics(nb, b, seed=nb + b)
  got = chunk_pass(jnp.asarray(bmax), jnp.asarray(bsum), jnp.asarray(barg),
                   chunk=chunk, block_b=block_b, interpret=interpret)
  nc = num_chunks(nb, chunk)
  chex.assert_shape(got, (nc, b))
  chex.assert_type(got, (jnp.float32, jnp.float32, jnp.int32))
  want = _reference(bmax, bsum, barg, chunk)
  np.testing.assert_array_equal(np.asarray(got[0]), want[0])
  np.testing.assert_allclose(np.asarray(got[1]), want[1], rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(got[2]), want[2])


@pytest.mark.gpu
@pytest.mark.parametrize("nb,b,chunk,block_b",
                         CASES + [(2020, 256, 32, 128), (1010, 192, 32, 128),
                                  (2020, 256, 31, 128)])
def test_chunk_pass_compiled(nb, b, chunk, block_b):
  """The same, compiled by Triton; and at the DeepSeek-V4 shape's NB."""
  test_chunk_pass_matches_numpy(nb, b, chunk, block_b, interpret=False)


def test_chunk_pass_refuses_bad_input():
  bmax = jnp.zeros((8, 4), jnp.float32)
  barg = jnp.zeros((8, 4), jnp.int32)
  with pytest.raises(ValueError, match="chunk must be >= 1"):
    chunk_pass(bmax, bmax, barg, chunk=0, interpret=True)
  with pytest.raises(ValueError, match="block_b must be a power of two"):
    chunk_pass(bmax, bmax, barg, block_b=3, interpret=True)
  with pytest.raises(ValueError, match="block_argmax must be int32"):
    chunk_pass(bmax, bmax, bmax, interpret=True)
  with pytest.raises(ValueError, match=r"block_sum must be float32 \[8, 4\]"):
    chunk_pass(bmax, bmax[:4], barg, interpret=True)


@pytest.mark.parametrize("block_v,chunk", [(32, 2), (16, 4), (16, 32),
                                           (16, 3)])
def test_select_pass_draws_from_chunk_statistics(block_v, chunk):
  """The chunked draw of block-major statistics from the block pass: every
  token by the draw rule on its cached logits. Sampled and greedy draws
  (every third), a row with -inf blocks, a NaN block and a +inf logit."""
  B, S, V, R = 8, 3, 250, 16
  base, anchor, head, _, _, _ = make_problem(B, S, V, R, jnp.float32, seed=6)
  base = base.reshape(B * S, V).at[1, :100].set(-jnp.inf)
  base = base.at[4, 32:64].set(jnp.nan).at[7, 200].set(jnp.inf)
  t = np.where(np.arange(B * S) % 3 == 0, 0.0, 0.8).astype(np.float32)
  u = np.asarray(jax.random.uniform(jax.random.PRNGKey(1), (B * S,)))
  params = jnp.stack([jnp.where(t > 0, 1 / np.maximum(t, 1e-9), 1.0),
                      jnp.asarray(t == 0, jnp.float32), jnp.asarray(u)])
  config = jm.KernelConfig(method="fused", block_b=16, block_v=block_v,
                           block_k=16)
  tokens = None
  for s in range(S):
    step = jnp.full((1,), s, jnp.int32)
    cache, bmax, bsum, barg = block_pass(
        base, (head.embed, head.proj, anchor), step, params, None, None,
        tokens, config=config, num_steps=S, num_cache_rows=B * S,
        interpret=True)
    stats = (bmax.T, bsum.T, barg.T)
    chunks = chunk_pass(*stats, chunk=chunk, interpret=True)
    tokens = select_pass(*stats, cache, step, params, None, tokens,
                         config=config, num_steps=S, stats_major="block",
                         chunk_stats=chunks, chunk=chunk, interpret=True)
    x = np.asarray(cache)
    for b in range(B):
      d = b * S + s
      err = check_step(x[d], int(tokens[d]), t[d], u[d])
      assert err is None, f"draw {d} (step {s}): {err}"


def test_select_pass_refuses_bad_chunk_statistics():
  B, NB = 4, 8
  bmax = jnp.zeros((NB, B), jnp.float32)
  barg = jnp.zeros((NB, B), jnp.int32)
  cache = jnp.zeros((B, NB * 32), jnp.float32)
  params = jnp.ones((3, B), jnp.float32)
  step = jnp.zeros((1,), jnp.int32)
  config = jm.KernelConfig(method="fused", block_v=32)
  chunks = chunk_pass(bmax, bmax, barg, chunk=4, interpret=True)
  kw = dict(config=config, num_steps=1, interpret=True)
  with pytest.raises(ValueError, match="go together"):
    select_pass(bmax, bmax, barg, cache, step, params, stats_major="block",
                chunk_stats=chunks, **kw)
  with pytest.raises(ValueError, match=r"ceil\(8 / 2\)"):
    select_pass(bmax, bmax, barg, cache, step, params, stats_major="block",
                chunk_stats=chunks, chunk=2, **kw)
  with pytest.raises(ValueError, match="stats_major='block'"):
    select_pass(bmax.T, bmax.T, barg.T, cache, step, params,
                chunk_stats=chunks, chunk=4, **kw)
