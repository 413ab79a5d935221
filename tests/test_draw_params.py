"""kernels/draw_params.py against the RNG contract and jm.sample_draft_into's
parameters, in the interpreter (the compiled kernel runs in tests/test_native.py)."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov as jm
from jax_markov.kernels.draw_params import ParamsLayout, draw_params


def _words(a: np.ndarray, wide: bool):
  a = np.ascontiguousarray(a.astype(np.int64 if wide else np.int32))
  return jnp.asarray(a.view(np.int32))


@pytest.mark.parametrize("wide", [True, False])
def test_params_follow_the_contract(wide):
  rng = np.random.default_rng(1)
  m, s, batch, n = 6, 3, 4, 3
  seeds = rng.integers(-2**63, 2**63 - 1, m, dtype=np.int64)
  seeds[:2] = [-1, 5]
  if not wide:
    seeds = seeds.astype(np.int32).astype(np.int64)  # int32 seeds
  temp = np.array([1.0, 0.5, 0.0, -1.0, np.nan, np.inf], np.float32)
  idx = np.full(m * s, -1, np.int64)
  for b, r in enumerate([3, 0, 5, 1]):
    idx[b * s:(b + 1) * s] = r
  idx[1] = -1          # one padding step
  idx[4] = m           # out of range: padding
  if wide:
    idx[7] = 2**32 + 1  # its low word is a valid row: still padding
  pos = np.full(m * s, -1, np.int64)
  pos[:batch * s] = rng.integers(1, 2**31, batch * s)
  if wide:
    pos[2] = 2**31      # the largest keyed position: key 2**31 - 1
    pos[5] = 2**40      # out of range: clamped to key 2**31 - 1, not wrapped
  ids = rng.integers(0, 50, 20)
  aidx = np.array([0, 5, -1, 7, 0, 0])
  if wide:
    aidx[1] = 2**32 + 5  # saturates (clamped to the last id), never wraps
  layout = ParamsLayout(idx_wide=wide, pos_wide=wide, seeds_wide=wide,
                        ids_wide=wide, anchor_idx_wide=wide)
  params, rows, anchors = draw_params(
      _words(idx, wide), _words(pos, wide), jnp.asarray(temp),
      _words(seeds, wide), _words(ids, wide), _words(aidx, wide),
      jnp.asarray([n], jnp.int32), batch=batch, steps=s, vocab_in=40,
      layout=layout, interpret=True)
  chex.assert_shape(params, (3, batch * s))
  chex.assert_type([params, rows, anchors], [jnp.float32, jnp.int32, jnp.int32])
  params, rows, anchors = map(np.asarray, (params, rows, anchors))
  for b in range(batch):
    for step in range(s):
      d = b * s + step
      r = idx[d]
      valid = b < n and 0 <= r < m
      r = r if valid else 0
      assert rows[d] == (r * s + step if valid else -1), d
      t = temp[r] if valid else 0.0
      scale, greedy = jm.reference.draw_params(jnp.asarray([t], jnp.float32))
      assert params[1, d] == float(greedy[0]), d
      assert params[0, d] == scale[0], d
      if valid:
        key = min(max(int(pos[d]), 1), 2**31) - 1
        u = jm.draft_uniforms(seeds[r:r + 1], np.array([[key]]))
        assert params[2, d] == np.asarray(u)[0, 0], d
  want = [min(int(ids[a]), 39) for a in (0, 19 if wide else 5, 19)] + [0]
  np.testing.assert_array_equal(anchors, want)
