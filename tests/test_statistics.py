"""Chi-square tests over many seeds: draws follow softmax(logits / T), steps and
requests are independent.

Each test draws from fixed seeds, so it is deterministic; the threshold 1e-3 is
the false-alarm rate a correct sampler would have over a random choice of seeds.
"""

import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jax_markov as jm

P_MIN = 1e-3


def _softmax(x, t):
  y = np.asarray(x, np.float64) / t
  p = np.exp(y - y.max())
  return p / p.sum()


def _chisquare(observed, expected_p):
  expected = expected_p * observed.sum()
  keep = expected >= 5  # pool the sparse cells so the chi-square law holds
  obs = np.append(observed[keep], observed[~keep].sum())
  exp = np.append(expected[keep], expected[~keep].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  return stats.chisquare(obs, exp).pvalue


def _problem(B, V, R, temperature, seed):
  rng = np.random.default_rng(seed)
  base_row = rng.standard_normal((2, V)).astype(np.float32)
  base = jnp.asarray(np.broadcast_to(base_row, (B, 2, V)))
  embed = jnp.asarray(rng.standard_normal((V, R)), jnp.float32)
  proj = jnp.asarray(0.7 * rng.standard_normal((V, R)), jnp.float32)
  head = jm.MarkovHead(embed, proj)
  anchor = jnp.full((B,), 2, jnp.int32)
  seeds = np.arange(B, dtype=np.int64) * 7_919 + seed * 2**40
  positions = jnp.tile(jnp.arange(2, dtype=jnp.int32), (B, 1)) + 500
  t = jnp.full((B,), temperature, jnp.float32)
  return base, anchor, head, t, seeds, positions, base_row


@pytest.mark.parametrize("method,temperature", [("fused", 1.0), ("xla_bias", 0.6)])
def test_joint_of_two_steps_follows_the_chain(method, temperature):
  """P(t0, t1) = softmax(l0 / T)[t0] * softmax(l1(t0) / T)[t1]: the marginal of
  step 0 and the conditional of step 1 on the drawn token at once."""
  B, V, R = 3000, 6, 3
  base, anchor, head, t, seeds, pos, base_row = _problem(B, V, R, temperature, 40)
  draft = jm.sample_draft(base, anchor, head, t, seeds, pos, method=method)
  tokens = np.asarray(draft.tokens)
  embed, proj = np.asarray(head.embed, np.float64), np.asarray(head.proj, np.float64)
  p0 = _softmax(base_row[0] + proj @ embed[2], temperature)
  joint = np.stack([p0[a] * _softmax(base_row[1] + proj @ embed[a], temperature)
                    for a in range(V)])
  observed = np.bincount(tokens[:, 0] * V + tokens[:, 1], minlength=V * V)
  assert _chisquare(observed, joint.ravel()) > P_MIN


def test_requests_are_independent():
  B, V, R = 3000, 5, 2
  base, anchor, head, t, seeds, pos, _ = _problem(B, V, R, 1.0, 41)
  tokens = np.asarray(jm.sample_draft(base, anchor, head, t, seeds, pos).tokens)
  table = np.zeros((V, V))
  np.add.at(table, (tokens[0::2, 0], tokens[1::2, 0]), 1)
  table = table[table.sum(1) > 0][:, table.sum(0) > 0]
  assert stats.chi2_contingency(table).pvalue > P_MIN


def test_positions_give_fresh_draws():
  """One seed, many positions: the draws are iid from the same softmax."""
  B, V, R = 2000, 7, 2
  base, anchor, head, t, _, _, base_row = _problem(B, V, R, 1.0, 42)
  seeds = np.full((B,), 123456789, np.int64)
  pos = jnp.asarray(np.arange(2 * B).reshape(B, 2), jnp.int32)
  tokens = np.asarray(jm.sample_draft(base, anchor, head, t, seeds, pos).tokens)
  embed, proj = np.asarray(head.embed, np.float64), np.asarray(head.proj, np.float64)
  p0 = _softmax(base_row[0] + proj @ embed[2], 1.0)
  assert _chisquare(np.bincount(tokens[:, 0], minlength=V), p0) > P_MIN
