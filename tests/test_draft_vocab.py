"""A reduced draft vocabulary (draft_to_target) and greedy drafting (greedy_draft).

The kernels against jm.reference (the spec) and the contract. The kernels run
in the Pallas interpreter on CPU, where compiling dominates: every test here
uses one shape and one configuration unless it tests another, so the jit
cache serves most calls.

Why exact token equality with the reference is sound here: V = 64 columns of
which Vd = 40 are mapped, so a float32 summation-order difference moving
u * Z across a CDF boundary has probability of order Vd * 2^-24 per draw,
far below one in the few dozen draws of a test (docs/design.md); the logits
are checked within Higham's bound by helpers.check_draft on the target row.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

import jax_markov as jm
from helpers import check_draft

# test_gpu.py re-collects the tests (star import): export only them.
__all__ = [name for name in (
    "test_increasing_map", "test_shuffled_map_is_the_sorted_map_permuted",
    "test_map_on_device_without_value_checks",
    "test_identity_map_is_the_plain_path_bit_for_bit",
    "test_nan_and_neg_inf_in_base", "test_empty_target_blocks_never_drawn",
    "test_greedy_draft_is_sample_draft_at_t0",
    "test_tail_select_and_greedy_with_map", "test_xla_bias_with_map",
    "test_into_with_map",
    "test_bad_maps_raise_and_write_nothing",
    "test_unsupported_modes_refuse_a_map",
    "test_reduced_vocab_draw_follows_softmax_over_mapped_columns")]

B, S, VD, V, R = 4, 3, 40, 64, 8
# Fused, 16 columns a block: Vd = 40 is three blocks, the last one partial.
CONFIG = jm.KernelConfig(method="fused", block_b=16, block_v=16, block_k=16)
# One request a program, the tail select (the table's choice at B = 1).
TAIL = jm.KernelConfig(method="fused", block_b=1, block_v=16, block_k=16,
                       bias_dot="fma", select="tail")
# proj loaded before the rank loop (before the dependent-launch wait on the
# GPU; the table's choice at B = 4 and 16): R = 8 is one chunk.
EARLY = dataclasses.replace(CONFIG, early_proj=1)


def _problem(seed=0, temperature=None, shuffled=False, dtype=jnp.float32):
  """base [B, S, Vd], anchors and a head over V target ids, a map Vd -> V."""
  rng = np.random.default_rng(seed)
  base = jnp.asarray(3.0 * rng.standard_normal((B, S, VD)), dtype)
  embed = jnp.asarray(0.3 * rng.standard_normal((V, R)), dtype)
  proj = jnp.asarray(0.3 * rng.standard_normal((VD, R)), dtype)
  d2t = np.sort(rng.choice(V, VD, replace=False)).astype(np.int32)
  if shuffled:
    d2t = rng.permutation(d2t)
  anchor = jnp.asarray(rng.integers(0, V, B), jnp.int32)
  if temperature is None:
    temperature = [1.0, 0.0, 0.7, 0.0]
  t = jnp.asarray(temperature, jnp.float32)
  seeds = rng.integers(-2**63, 2**63 - 1, B, dtype=np.int64)
  pos = jnp.asarray(rng.integers(0, 10_000, (B, 1)) + np.arange(S), jnp.int32)
  return base, anchor, jm.MarkovHead(embed, proj), t, seeds, pos, d2t


def _target_problem(base, head, d2t):
  """The same problem over the target vocabulary: -inf base, zero proj rows
  at the unmapped ids. The plain contract's checks then apply as they are."""
  base_t = np.full(base.shape[:2] + (V,), -np.inf, np.float32)
  base_t[..., d2t] = np.asarray(base, np.float32)
  proj_t = np.zeros((V, R), np.float32)
  proj_t[d2t] = np.asarray(head.proj, np.float32)
  return base_t, jm.MarkovHead(np.asarray(head.embed, np.float32), proj_t)


def _unmapped(d2t):
  return np.setdiff1d(np.arange(V), d2t)


def _check(draft, base, anchor, head, t, seeds, pos, d2t):
  """The draft against the reference and the contract on the target row."""
  tokens, logits = np.asarray(draft.tokens), np.asarray(draft.logits)
  assert logits.shape == (B, S, V) and tokens.dtype == np.int32
  assert np.isin(tokens, d2t).all(), "a token outside the draft vocabulary"
  assert (logits[..., _unmapped(d2t)] == -np.inf).all()
  ref_tokens, ref_logits = jm.reference.sample_draft(
      base, anchor, head, t, seeds, pos, draft_to_target=d2t)
  np.testing.assert_array_equal(tokens, ref_tokens)
  np.testing.assert_allclose(logits, ref_logits, rtol=2e-6, atol=2e-5)
  base_t, head_t = _target_problem(base, head, d2t)
  u = np.asarray(jm.draft_uniforms(seeds, pos))
  check_draft(tokens, logits, base_t, anchor, head_t,
              np.broadcast_to(np.asarray(t)[:, None], (B, S)), u)


@pytest.mark.parametrize("temperature", [
    [0.0] * 4, [1.5] * 4, [1.0, 0.0, 0.7, 0.0]], ids=["T0", "T>0", "mixed"])
def test_increasing_map(temperature):
  args = _problem(1, temperature)
  draft = jm.sample_draft(*args[:-1], draft_to_target=args[-1], config=CONFIG)
  _check(draft, *args)


def test_shuffled_map_is_the_sorted_map_permuted():
  """Any map order draws the same: the result is, bit for bit, that of the
  sorted map with base and proj permuted alike (sampling walks the target
  columns; greedy drafting sorts the map in the call)."""
  base, anchor, head, t, seeds, pos, d2t = _problem(2, shuffled=True)
  draft = jm.sample_draft(base, anchor, head, t, seeds, pos,
                          draft_to_target=d2t, config=CONFIG)
  _check(draft, base, anchor, head, t, seeds, pos, d2t)
  order = np.argsort(d2t)
  sorted_head = jm.MarkovHead(head.embed, head.proj[order])
  want = jm.sample_draft(base[..., order], anchor, sorted_head, t, seeds, pos,
                         draft_to_target=d2t[order], config=CONFIG)
  np.testing.assert_array_equal(draft.tokens, want.tokens)
  np.testing.assert_array_equal(draft.logits, want.logits)


def test_map_on_device_without_value_checks():
  """A device map is read and checked once per array object (it is
  immutable), also with check_values=False, so a serving loop neither
  re-checks nor re-sorts it; a traced map is sorted inside the call. All
  give the NumPy map's result."""
  from jax_markov import validate  # pylint: disable=g-import-not-at-top
  args = _problem(3, shuffled=True)
  want = jm.sample_draft(*args[:-1], draft_to_target=args[-1], config=CONFIG)
  device_map = jnp.asarray(args[-1])
  got = jm.sample_draft(*args[:-1], draft_to_target=device_map,
                        config=CONFIG, check_values=False)
  assert id(device_map) in validate._MAP_FACTS  # pylint: disable=protected-access
  assert validate._MAP_FACTS[id(device_map)][2] is False  # pylint: disable=protected-access
  np.testing.assert_array_equal(got.tokens, want.tokens)
  np.testing.assert_array_equal(got.logits, want.logits)
  traced = jax.jit(lambda m: jm.sample_draft(
      *args[:-1], draft_to_target=m, config=CONFIG, check_values=False))(
          device_map)
  np.testing.assert_array_equal(traced.tokens, want.tokens)
  np.testing.assert_array_equal(traced.logits, want.logits)
  bad = jnp.zeros_like(device_map)  # read once: refused without check_values
  with pytest.raises(ValueError, match="draft_to_target"):
    jm.sample_draft(*args[:-1], draft_to_target=bad, config=CONFIG,
                    check_values=False)


def test_identity_map_is_the_plain_path_bit_for_bit():
  rng = np.random.default_rng(4)
  base, anchor, head, t, seeds, pos, _ = _problem(4)
  head = jm.MarkovHead(head.embed[:VD], head.proj)
  anchor = jnp.asarray(rng.integers(0, VD, B), jnp.int32)
  identity = np.arange(VD, dtype=np.int32)
  plain = jm.sample_draft(base, anchor, head, t, seeds, pos, config=CONFIG)
  mapped = jm.sample_draft(base, anchor, head, t, seeds, pos, config=CONFIG,
                           draft_to_target=identity)
  np.testing.assert_array_equal(mapped.tokens, plain.tokens)
  np.testing.assert_array_equal(mapped.logits, plain.logits)
  N = B + 1
  idx = jnp.asarray(np.stack([np.roll(np.arange(N), s)[:B] for s in range(S)], 1),
                    jnp.int32)
  cache = jnp.full((N, S, VD), 5.0, jnp.float32)
  tn, cn = jm.sample_draft_into(cache, base, anchor, head, jnp.ones(N) * 0.8,
                                np.arange(N), idx, pos, config=CONFIG,
                                donate=False)
  tm, cm = jm.sample_draft_into(cache, base, anchor, head, jnp.ones(N) * 0.8,
                                np.arange(N), idx, pos, config=CONFIG,
                                donate=False, draft_to_target=identity)
  np.testing.assert_array_equal(tm, tn)
  np.testing.assert_array_equal(cm, cn)


def test_nan_and_neg_inf_in_base():
  base, anchor, head, t, seeds, pos, d2t = _problem(5, [0.0, 1.0, 1.0, 0.0])
  base = base.at[0, 0].set(-jnp.inf)          # nothing drawable: lowest mapped id
  base = base.at[1, 1].set(jnp.nan)           # all NaN: likewise
  base = base.at[2, :, :20].set(jnp.nan)      # NaN never drawn
  base = base.at[3, :, 5:30].set(-jnp.inf)    # -inf never drawn
  draft = jm.sample_draft(base, anchor, head, t, seeds, pos,
                          draft_to_target=d2t, config=CONFIG)
  tokens, logits = np.asarray(draft.tokens), np.asarray(draft.logits)
  assert tokens[0, 0] == d2t.min() and tokens[1, 1] == d2t.min()
  assert not np.isin(tokens[2], d2t[:20]).any()
  assert not np.isin(tokens[3], d2t[5:30]).any()
  assert (logits[..., _unmapped(d2t)] == -np.inf).all()
  ref_tokens, ref_logits = jm.reference.sample_draft(
      base, anchor, head, t, seeds, pos, draft_to_target=d2t)
  np.testing.assert_array_equal(tokens, ref_tokens)
  np.testing.assert_allclose(logits, ref_logits, rtol=2e-6, atol=2e-5)


@pytest.mark.parametrize("config", [CONFIG, TAIL, EARLY],
                         ids=["pass", "tail", "early"])
def test_empty_target_blocks_never_drawn(config):
  """No draft id maps to target ids 0-15 (a whole target block at block_v =
  16) and the map is shuffled: that block is all -inf, and a row with nothing
  drawable still draws the lowest mapped target id, never an id of it."""
  base, anchor, head, t, seeds, pos, _ = _problem(6, [0.0, 1.0, 0.7, 0.0])
  rng = np.random.default_rng(6)
  d2t = rng.permutation(np.arange(16, V))[:VD].astype(np.int32)
  base = base.at[0, 0].set(-jnp.inf).at[1, 2].set(jnp.nan)
  draft = jm.sample_draft(base, anchor, head, t, seeds, pos,
                          draft_to_target=d2t, config=config)
  tokens = np.asarray(draft.tokens)
  assert tokens[0, 0] == d2t.min() and tokens[1, 2] == d2t.min()
  assert np.isin(tokens, d2t).all()
  logits = np.asarray(draft.logits)
  assert (logits[..., _unmapped(d2t)] == -np.inf).all()
  # The reference's rule for a row with nothing drawable is the lowest
  # mapped id too (the plain contract's check would want target id 0).
  ref_tokens, ref_logits = jm.reference.sample_draft(
      base, anchor, head, t, seeds, pos, draft_to_target=d2t)
  np.testing.assert_array_equal(tokens, ref_tokens)
  np.testing.assert_allclose(logits, ref_logits, rtol=2e-6, atol=2e-5)


@pytest.mark.parametrize("config", [CONFIG, EARLY], ids=["pass", "early"])
@pytest.mark.parametrize("mapped", [False, True], ids=["plain", "map"])
def test_greedy_draft_is_sample_draft_at_t0(mapped, config):
  base, anchor, head, _, seeds, pos, d2t = _problem(6, shuffled=True)
  t0 = jnp.zeros((B,), jnp.float32)
  kw = dict(draft_to_target=d2t) if mapped else {}
  if not mapped:
    head = jm.MarkovHead(head.embed[:VD], head.proj)
    anchor = anchor % VD
  want = jm.sample_draft(base, anchor, head, t0, seeds, pos, config=config,
                         **kw)
  got = jm.greedy_draft(base, anchor, head, config=config, **kw)
  assert got.dtype == jnp.int32 and got.shape == (B, S)
  np.testing.assert_array_equal(got, want.tokens)
  np.testing.assert_array_equal(
      got, jm.reference.greedy_draft(base, anchor, head, **kw))


def test_tail_select_and_greedy_with_map():
  """The tail select (one launch a step) draws through the map too."""
  base, anchor, head, t, seeds, pos, d2t = _problem(7, shuffled=True)
  draft = jm.sample_draft(base, anchor, head, t, seeds, pos,
                          draft_to_target=d2t, config=TAIL)
  _check(draft, base, anchor, head, t, seeds, pos, d2t)
  base = base.at[1, 0].set(jnp.nan)
  np.testing.assert_array_equal(
      jm.greedy_draft(base, anchor, head, draft_to_target=d2t, config=TAIL),
      jm.reference.greedy_draft(base, anchor, head, draft_to_target=d2t))


def _into_problem(seed):
  base, anchor, head, _, _, pos, d2t = _problem(seed, shuffled=True)
  N = 7
  temperature = jnp.asarray([0.0, 1.0, 0.5, 2.0, 0.0, 1.0, 1.0], jnp.float32)
  seeds = np.arange(N, dtype=np.int64) * 1_000_003
  # Rows 5 and 6 are never named; one draw is padding.
  idx = np.array([[0, 1, 2], [3, 4, 0], [1, -1, 3], [2, 0, 4]], np.int32)
  cache = jnp.full((N, S, V), 7.0, jnp.float32)
  return cache, base, anchor, head, temperature, seeds, idx, pos, d2t


def test_xla_bias_with_map():
  """method="xla_bias": the XLA GEMM's bias is over the (sorted) draft ids."""
  config = jm.KernelConfig(method="xla_bias", block_b=1, block_v=16)
  base, anchor, head, t, seeds, pos, d2t = _problem(11, shuffled=True)
  draft = jm.sample_draft(base, anchor, head, t, seeds, pos,
                          draft_to_target=d2t, config=config)
  _check(draft, base, anchor, head, t, seeds, pos, d2t)
  np.testing.assert_array_equal(
      jm.greedy_draft(base, anchor, head, draft_to_target=d2t, config=config),
      jm.reference.greedy_draft(base, anchor, head, draft_to_target=d2t))


def test_into_with_map():
  cache, base, anchor, head, t, seeds, idx, pos, d2t = _into_problem(8)
  tokens, out = jm.sample_draft_into(cache, base, anchor, head, t, seeds, idx,
                                     pos, draft_to_target=d2t, config=CONFIG,
                                     donate=False)
  ref_tokens, ref_cache = jm.reference.sample_draft_into(
      cache, base, anchor, head, t, seeds, idx, pos, draft_to_target=d2t)
  valid = idx >= 0
  np.testing.assert_array_equal(np.asarray(tokens)[valid],
                                np.asarray(ref_tokens)[valid])
  assert np.isin(np.asarray(tokens), d2t).all()
  out = np.asarray(out)
  np.testing.assert_allclose(out, ref_cache, rtol=2e-6, atol=2e-5)
  written = np.zeros((7, S), bool)
  for b in range(B):
    for s in range(S):
      if idx[b, s] >= 0:
        written[idx[b, s], s] = True
  assert (out[written][:, _unmapped(d2t)] == -np.inf).all()
  assert (out[~written] == 7.0).all(), "a row outside idx_map was touched"


def _bad_maps(d2t):
  dup = d2t.copy()
  dup[3] = dup[7]
  neg, high = d2t.copy(), d2t.copy()
  neg[0], high[-1] = -1, V
  return [
      (dup, ValueError, "same target id"),
      (neg, ValueError, "outside the target vocabulary"),
      (high, ValueError, "outside the target vocabulary"),
      (d2t[:-1], ValueError, r"\[Vd\]"),
      (d2t.astype(np.float32), TypeError, "integers"),
      (d2t[None], ValueError, r"\[Vd\]"),
  ]


def test_bad_maps_raise_and_write_nothing():
  cache, base, anchor, head, t, seeds, idx, pos, d2t = _into_problem(9)
  before = np.asarray(cache)
  for bad, exc, msg in _bad_maps(d2t):
    with pytest.raises(exc, match=msg) as err:
      jm.sample_draft_into(cache, base, anchor, head, t, seeds, idx, pos,
                           draft_to_target=bad, config=CONFIG)  # donate=True
    assert "draft_to_target" in str(err.value)
    assert not cache.is_deleted(), "the cache was donated before the error"
    with pytest.raises(exc, match=msg):
      jm.sample_draft(base, anchor, head, t[:B], seeds[:B], pos,
                      draft_to_target=bad, config=CONFIG)
    with pytest.raises(exc, match=msg):
      jm.greedy_draft(base, anchor, head, draft_to_target=bad, config=CONFIG)
  np.testing.assert_array_equal(np.asarray(cache), before)
  with pytest.raises(ValueError, match="draft_to_target.*smaller than"):
    jm.sample_draft(base, anchor, head, t[:B], seeds[:B], pos,
                    draft_to_target=d2t, target_vocab=VD - 1)
  with pytest.raises(ValueError, match="draft_to_target.*V_in must be >= V"):
    jm.sample_draft(base, anchor, head, t[:B], seeds[:B], pos,
                    draft_to_target=d2t, target_vocab=V + 1)


@pytest.mark.parametrize("tile", [dict(block_b=1, bias_dot="fma"),
                                  dict(block_b=16, bias_dot="mma")])
def test_persistent_table_entry_runs_step_by_step_with_a_map(monkeypatch,
                                                             tile):
  """A table entry that picks the persistent draft (which runs neither a map
  nor greedy drafting) runs the same tile step by step there: the tail
  select with one-request tiles, else the select pass; the draft is the one
  of the plain step-by-step tile."""
  from jax_markov.kernels import tuning
  entry = jm.KernelConfig(method="fused", block_v=16, block_k=16,
                          select="persistent", held_blocks=1, **tile)
  want = tuning.stepwise(entry)
  assert want.select == ("tail" if tile["block_b"] == 1 else "pass")
  assert want.held_blocks == 0 and want.block_b == entry.block_b
  assert tuning.stepwise(want) is want
  monkeypatch.setattr(tuning, "choose", lambda *a, **k: entry)
  base, anchor, head, t, seeds, pos, d2t = _problem(12)
  got = jm.sample_draft(base, anchor, head, t, seeds, pos, draft_to_target=d2t)
  ref = jm.sample_draft(base, anchor, head, t, seeds, pos, draft_to_target=d2t,
                        config=want)
  np.testing.assert_array_equal(got.tokens, ref.tokens)
  np.testing.assert_array_equal(got.logits, ref.logits)
  np.testing.assert_array_equal(
      jm.greedy_draft(base, anchor, head),
      jm.greedy_draft(base, anchor, head, config=want))


def test_unsupported_modes_refuse_a_map():
  base, anchor, head, t, seeds, pos, d2t = _problem(10)
  persistent = jm.KernelConfig(method="fused", block_b=1, block_v=16,
                               block_k=16, bias_dot="fma", select="persistent")
  with pytest.raises(ValueError, match="persistent"):
    jm.sample_draft(base, anchor, head, t, seeds, pos, draft_to_target=d2t,
                    config=persistent)
  with pytest.raises(ValueError, match="persistent"):
    jm.greedy_draft(base, anchor, head, config=persistent)
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("vocab",))
  with pytest.raises(ValueError, match="draft_to_target"):
    jm.sample_draft_sharded(base, anchor, head, t, seeds, pos, mesh=mesh,
                            draft_to_target=d2t)


P_MIN = 1e-3  # the false-alarm rate of a correct sampler over seeds (as test_statistics)


def test_reduced_vocab_draw_follows_softmax_over_mapped_columns():
  """Two steps through a shuffled map, T = 1: P(t0, t1) = q0[t0] q1(t0)[t1],
  q the softmax over the mapped target ids, the step-1 bias from embed[t0]
  (a target id). Unmapped ids must never be drawn. Chi-square over the joint,
  sparse cells pooled (as test_statistics.py); deterministic seeds."""
  n, vd, v, r = 3000, 5, 9, 3
  rng = np.random.default_rng(43)
  d2t = np.array([7, 1, 4, 0, 5], np.int32)        # not increasing
  base_row = rng.standard_normal((2, vd)).astype(np.float32)
  base = jnp.asarray(np.broadcast_to(base_row, (n, 2, vd)))
  embed = rng.standard_normal((v, r)).astype(np.float32)
  proj = (0.7 * rng.standard_normal((vd, r))).astype(np.float32)
  head = jm.MarkovHead(jnp.asarray(embed), jnp.asarray(proj))
  anchor = jnp.full((n,), 8, jnp.int32)            # an unmapped target id
  seeds = np.arange(n, dtype=np.int64) * 7_919 + 43 * 2**40
  pos = jnp.tile(jnp.arange(2, dtype=jnp.int32), (n, 1)) + 500
  draft = jm.sample_draft(base, anchor, head, jnp.ones((n,)), seeds, pos,
                          draft_to_target=d2t, target_vocab=v,
                          config=jm.KernelConfig(method="fused", block_b=16,
                                                 block_v=16, block_k=16))
  tokens = np.asarray(draft.tokens)
  assert np.isin(tokens, d2t).all()

  def q(step, prev):  # softmax over the target row, 0 at unmapped ids
    x = np.full(v, -np.inf)
    x[d2t] = base_row[step] + proj.astype(np.float64) @ embed[prev]
    p = np.exp(x - x.max())
    return p / p.sum()

  q0 = q(0, 8)
  joint = np.stack([q0[a] * q(1, a) for a in range(v)]).ravel()
  observed = np.bincount(tokens[:, 0] * v + tokens[:, 1], minlength=v * v)
  keep = joint > 0
  assert observed[~keep].sum() == 0
  expected = joint[keep] * n
  obs = observed[keep]
  big = expected >= 5  # pool the sparse cells so the chi-square law holds
  obs = np.append(obs[big], obs[~big].sum())
  exp = np.append(expected[big], expected[~big].sum())
  if exp[-1] == 0:
    obs, exp = obs[:-1], exp[:-1]
  assert stats.chisquare(obs, exp).pvalue > P_MIN
