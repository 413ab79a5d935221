"""The RNG contract: seeds and positions -> uniforms."""

import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jax_markov as jm
from jax_markov import rng


def test_shape_dtype_range():
  u = jm.draft_uniforms(np.arange(7, dtype=np.int64), np.tile(np.arange(5), (7, 1)))
  chex.assert_shape(u, (7, 5))
  chex.assert_type(u, jnp.float32)
  assert ((np.asarray(u) >= 0) & (np.asarray(u) < 1)).all()


def test_all_64_bits_matter():
  base = np.int64(0x0123456789ABCDEF)
  seeds = np.array([base ^ (np.int64(1) << np.int64(k)) for k in range(64)] + [base],
                   dtype=np.int64)
  u = np.asarray(jm.draft_uniforms(seeds, np.zeros((65, 1), np.int32)))
  assert len(np.unique(u)) == 65


def test_int64_uint64_and_split_words_agree():
  seeds = np.array([-1, 2**40 + 3, -(2**62)], dtype=np.int64)
  pos = np.array([[0, 1], [5, 6], [9, 10]])
  a = jm.draft_uniforms(seeds, pos)
  b = jm.draft_uniforms(seeds.view(np.uint64), pos)
  words = rng.seed_words(seeds)
  chex.assert_type(words, jnp.uint32)
  c = jm.draft_uniforms(words, pos)
  np.testing.assert_array_equal(a, b)
  np.testing.assert_array_equal(a, c)
  small = np.array([-5, 7], np.int32)
  np.testing.assert_array_equal(jm.draft_uniforms(small, pos[:2]),
                                jm.draft_uniforms(small.astype(np.int64), pos[:2]))
  np.testing.assert_array_equal(jm.draft_uniforms(jnp.asarray(small), pos[:2]),
                                jm.draft_uniforms(small.astype(np.int64), pos[:2]))


def test_matches_prngkey_under_x64():
  """The documented derivation: PRNGKey(seed) with x64, fold_in(position), uniform."""
  code = r"""
import jax, numpy as np
jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
seeds = np.array([-1, 2**40 + 3, 12345, -(2**62)], dtype=np.int64)
out = []
for s in seeds:
  key = jax.random.fold_in(jax.random.PRNGKey(int(s)), 77)
  out.append(float(jax.random.uniform(key, (), jnp.float32)))
print(repr(out))
"""
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, check=True)
  want = np.array(eval(res.stdout.strip()), np.float32)
  seeds = np.array([-1, 2**40 + 3, 12345, -(2**62)], dtype=np.int64)
  got = np.asarray(jm.draft_uniforms(seeds, np.full((4, 1), 77)))[:, 0]
  np.testing.assert_array_equal(got, want)


def test_positions_and_seeds_change_the_draw():
  u = np.asarray(jm.draft_uniforms(np.array([3, 3, 4], np.int64),
                                   np.array([[0, 1], [0, 2], [0, 1]])))
  assert u[0, 0] == u[1, 0]        # same seed, same position
  assert u[0, 1] != u[1, 1]        # same seed, other position
  assert u[0, 0] != u[2, 0]        # other seed


def test_uniform_and_independent():
  seeds = np.arange(4000, dtype=np.int64) * 1_000_003
  u = np.asarray(jm.draft_uniforms(seeds, np.tile(np.arange(2), (4000, 1))))
  assert stats.kstest(u[:, 0], "uniform").pvalue > 1e-3
  assert stats.kstest(u[:, 1], "uniform").pvalue > 1e-3
  # Consecutive positions of one seed are uncorrelated.
  assert abs(stats.pearsonr(u[:, 0], u[:, 1]).statistic) < 4 / np.sqrt(4000)


def test_bad_seeds():
  with pytest.raises(TypeError):
    jm.draft_uniforms(np.array([1.5]), np.zeros((1, 1), np.int32))
  with pytest.raises(ValueError):
    jm.draft_uniforms(np.array([1, 2]), np.zeros((3, 1), np.int32))
