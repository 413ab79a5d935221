"""Property-based tests of jm.sample_draft and jm.sample_draft_into (hypothesis).

Over shapes, dtypes, temperatures (0, tiny, normal, large, +inf), seeds over
the whole 64-bit range, positions over [0, 2^31), state maps with padding and
rows that change between steps, and NaN / infinity patterns in the base
logits, in interpret mode on the CPU:

* tokens are int32 [B, S] in [0, V);
* logits equal base + bias within Higham's bound, and every draw is the
  inverse CDF at jm.draft_uniforms away from CDF boundaries
  (helpers.check_draft), and agrees with jm.reference (assert_drafts_agree);
* cache rows no draw names are untouched, bit for bit;
* an invalid input raises ValueError / TypeError naming the argument, and
  writes nothing: the donated cache stays alive and unchanged.

Compiling the interpreted kernels costs seconds per shape and dtype, running
them much less: shapes and dtypes come from a small fixed set
(st.sampled_from), values vary freely. derandomize=True: CI runs the same
examples every time.
"""

import chex
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import jax_markov as jm
from helpers import assert_drafts_agree, check_draft

SETTINGS = dict(deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow,
                                       HealthCheck.data_too_large])

DTYPES = {"bf16": jnp.bfloat16, "fp16": jnp.float16, "fp32": jnp.float32}
# (B, S, V, R, dtype): B 1-4, S 1-3, V 1-300, R 1-16. A small fixed set: each
# entry compiles once.
DENSE_SHAPES = [(1, 1, 1, 1, "fp32"), (2, 3, 37, 5, "bf16"),
                (4, 2, 300, 16, "fp16"), (3, 3, 129, 3, "fp32"),
                (4, 3, 200, 8, "bf16")]
# (B, S, V, R, N, dtype)
INTO_SHAPES = [(2, 3, 37, 5, 3, "bf16"), (4, 2, 300, 16, 6, "fp32"),
               (1, 1, 1, 1, 2, "fp16")]
TEMPERATURES = [0.0, 1e-30, 1e-6, 0.3, 1.0, 2.5, 1e4, float("inf")]
# Per request and step: what the base logits hold besides normal values.
PATTERNS = ["normal", "normal", "nan_some", "neg_inf_most", "all_neg_inf",
            "all_nan", "pos_inf", "huge"]


def _base(rng, B, S, V, patterns, dtype):
  base = 3.0 * rng.standard_normal((B, S, V))
  for b in range(B):
    for s in range(S):
      p = patterns[b * S + s]
      row = base[b, s]
      if p == "nan_some":
        row[rng.random(V) < 0.3] = np.nan
      elif p == "neg_inf_most":
        keep = rng.random(V) < 0.1
        keep[rng.integers(V)] = True
        row[~keep] = -np.inf
      elif p == "all_neg_inf":
        row[:] = -np.inf
      elif p == "all_nan":
        row[:] = np.nan
      elif p == "pos_inf":
        row[rng.integers(V, size=2)] = np.inf
      elif p == "huge":
        row *= 1e3
  return jnp.asarray(base, DTYPES[dtype])


def _common(draw, B, S, V, R, dtype):
  """base, anchor, head, positions of a problem of the given shape."""
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  patterns = draw(st.lists(st.sampled_from(PATTERNS), min_size=B * S, max_size=B * S))
  base = _base(rng, B, S, V, patterns, dtype)
  head = jm.MarkovHead(jnp.asarray(0.3 * rng.standard_normal((V, R)), DTYPES[dtype]),
                       jnp.asarray(0.3 * rng.standard_normal((V, R)), DTYPES[dtype]))
  anchor = np.asarray(draw(st.lists(st.integers(0, V - 1), min_size=B, max_size=B)),
                      np.int32)
  start = draw(st.lists(st.integers(0, 2**31 - S), min_size=B, max_size=B))
  positions = (np.asarray(start, np.int64)[:, None] + np.arange(S)).astype(np.int32)
  return base, anchor, head, positions


@st.composite
def dense_problems(draw):
  B, S, V, R, dtype = draw(st.sampled_from(DENSE_SHAPES))
  base, anchor, head, positions = _common(draw, B, S, V, R, dtype)
  t = np.asarray(draw(st.lists(st.sampled_from(TEMPERATURES), min_size=B, max_size=B)),
                 np.float32)
  # Python ints over the whole 64-bit range, both signs (two's complement).
  seeds = draw(st.lists(st.integers(-2**63, 2**64 - 1), min_size=B, max_size=B))
  return base, anchor, head, t, seeds, positions


@settings(max_examples=30, **SETTINGS)
@given(dense_problems())
def test_sample_draft_properties(problem):
  base, anchor, head, t, seeds, positions = problem
  B, S, V = base.shape
  draft = jm.sample_draft(*problem)
  chex.assert_shape(draft.tokens, (B, S))
  chex.assert_type(draft.tokens, jnp.int32)
  chex.assert_shape(draft.logits, (B, S, V))
  chex.assert_type(draft.logits, jnp.float32)
  tokens = np.asarray(draft.tokens)
  assert ((tokens >= 0) & (tokens < V)).all()
  u = np.asarray(jm.draft_uniforms(seeds, positions))
  chex.assert_shape(u, (B, S))
  assert ((u >= 0) & (u < 1)).all()
  t_bs = np.broadcast_to(t[:, None], (B, S))
  # The contract on the draft's own logits, and agreement with the reference.
  assert_drafts_agree(tuple(draft), jm.reference.sample_draft(*problem),
                      base, anchor, head, t_bs, u)
  # NaN is never drawn; a row without a drawable logit draws token 0.
  x = np.asarray(draft.logits)
  picked = np.take_along_axis(x, tokens[:, :, None], 2)[:, :, 0]
  drawable = (~np.isnan(x) & (x > -np.inf)).any(-1)
  assert not np.isnan(picked[drawable]).any()
  assert (tokens[~drawable] == 0).all()


# (B, S, Vd, V, R, dtype): a reduced draft vocabulary of Vd of the V target
# ids. Vd == V (a permutation), Vd much smaller than V (target blocks that no
# draft id maps to), and one in between.
MAPPED_SHAPES = [(2, 3, 20, 37, 5, "bf16"), (3, 2, 100, 300, 8, "fp32"),
                 (1, 3, 129, 129, 4, "fp16"), (4, 2, 7, 200, 8, "fp32")]
MAPPED_CONFIGS = [
    None,
    jm.KernelConfig(method="fused", block_b=16, block_v=16, block_k=16),
    jm.KernelConfig(method="fused", block_b=1, block_v=16, block_k=16,
                    bias_dot="fma", select="tail")]


@st.composite
def mapped_problems(draw):
  B, S, vd, V, R, dtype = draw(st.sampled_from(MAPPED_SHAPES))
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  patterns = draw(st.lists(st.sampled_from(PATTERNS), min_size=B * S,
                           max_size=B * S))
  base = _base(rng, B, S, vd, patterns, dtype)
  head = jm.MarkovHead(
      jnp.asarray(0.3 * rng.standard_normal((V, R)), DTYPES[dtype]),
      jnp.asarray(0.3 * rng.standard_normal((vd, R)), DTYPES[dtype]))
  # Any order: a random subset of the target ids in a random order.
  d2t = np.asarray(draw(st.permutations(range(V)))[:vd], np.int32)
  anchor = np.asarray(draw(st.lists(st.integers(0, V - 1), min_size=B,
                                    max_size=B)), np.int32)
  start = draw(st.lists(st.integers(0, 2**31 - S), min_size=B, max_size=B))
  positions = (np.asarray(start, np.int64)[:, None]
               + np.arange(S)).astype(np.int32)
  t = np.asarray(draw(st.lists(st.sampled_from(TEMPERATURES), min_size=B,
                               max_size=B)), np.float32)
  seeds = draw(st.lists(st.integers(-2**63, 2**64 - 1), min_size=B,
                        max_size=B))
  # The interpreter's default is one block for these vocabularies: small
  # blocks give target blocks that no draft id maps to.
  config = draw(st.sampled_from(MAPPED_CONFIGS))
  return (base, anchor, head, t, seeds, positions), d2t, config


@settings(max_examples=30, **SETTINGS)
@given(mapped_problems())
def test_reduced_vocabulary_properties(problem):
  """sample_draft with draft_to_target in any order: tokens are mapped target
  ids, the logits are -inf at every unmapped id, the draft satisfies the
  contract over the target row (the problem rewritten over V: -inf base and
  zero proj rows at the unmapped ids) and agrees with jm.reference; a row
  with nothing drawable draws the lowest mapped id."""
  args, d2t, config = problem
  base, anchor, head, t, seeds, positions = args
  B, S, vd = base.shape
  V = head.embed.shape[0]
  draft = jm.sample_draft(*args, draft_to_target=d2t, config=config)
  chex.assert_shape(draft.tokens, (B, S))
  chex.assert_type(draft.tokens, jnp.int32)
  chex.assert_shape(draft.logits, (B, S, V))
  tokens, x = np.asarray(draft.tokens), np.asarray(draft.logits)
  assert np.isin(tokens, d2t).all()
  unmapped = np.setdiff1d(np.arange(V), d2t)
  assert (x[..., unmapped] == -np.inf).all()
  ref = jm.reference.sample_draft(*args, draft_to_target=d2t)
  base_t = np.full((B, S, V), -np.inf, np.float32)
  base_t[..., d2t] = np.asarray(base, np.float32)
  proj_t = np.zeros((V, head.proj.shape[1]), np.float32)
  proj_t[d2t] = np.asarray(head.proj, np.float32)
  head_t = jm.MarkovHead(np.asarray(head.embed, np.float32), proj_t)
  u = np.asarray(jm.draft_uniforms(seeds, positions))
  drawable = (~np.isnan(x) & (x > -np.inf)).any(-1)
  assert_drafts_agree(tuple(draft), ref, base_t, anchor, head_t,
                      np.broadcast_to(t[:, None], (B, S)), u, rows=drawable)
  assert (tokens[~drawable] == d2t.min()).all()


@st.composite
def into_problems(draw):
  B, S, V, R, N, dtype = draw(st.sampled_from(INTO_SHAPES))
  base, anchor, head, positions = _common(draw, B, S, V, R, dtype)
  # Per step: distinct state rows (changing from step to step), some padding.
  idx_map = np.empty((B, S), np.int32)
  for s in range(S):
    rows = draw(st.permutations(range(N)))[:B]
    pad = draw(st.lists(st.booleans(), min_size=B, max_size=B))
    idx_map[:, s] = np.where(pad, -1, rows)
  t = np.asarray(draw(st.lists(st.sampled_from(TEMPERATURES), min_size=N, max_size=N)),
                 np.float32)
  seeds = np.asarray(draw(st.lists(st.integers(-2**63, 2**63 - 1), min_size=N,
                                   max_size=N)), np.int64)
  rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
  cache = jnp.asarray(rng.standard_normal((N, S, V)), jnp.float32)
  return cache, base, anchor, head, t, seeds, idx_map, positions


def _draws(cache, idx_map, t, seeds, positions):
  valid = idx_map >= 0
  rows = np.where(valid, idx_map, 0)
  u = np.asarray(jm.draft_uniforms(seeds[rows].reshape(-1),
                                   positions.reshape(-1, 1))).reshape(rows.shape)
  logits = np.asarray(cache)[rows, np.arange(rows.shape[1])[None, :]]
  return logits, t[rows], u, valid


@settings(max_examples=20, **SETTINGS)
@given(into_problems())
def test_sample_draft_into_properties(problem):
  cache, base, anchor, head, t, seeds, idx_map, positions = problem
  B, S, V = base.shape
  before = np.asarray(cache).copy()
  ref_tokens, ref_cache = jm.reference.sample_draft_into(*problem)
  tokens, new_cache = jm.sample_draft_into(*problem)   # donates cache
  assert cache.is_deleted()
  chex.assert_shape(tokens, (B, S))
  chex.assert_type(tokens, jnp.int32)
  chex.assert_shape(new_cache, before.shape)
  chex.assert_type(new_cache, jnp.float32)
  tok = np.asarray(tokens)
  assert ((tok >= 0) & (tok < V)).all()       # padding draws included
  written = np.zeros(before.shape[:2], bool)
  for b, s in zip(*np.nonzero(idx_map >= 0)):
    written[idx_map[b, s], s] = True
  np.testing.assert_array_equal(np.asarray(new_cache)[~written], before[~written])
  logits, t_bs, u, valid = _draws(new_cache, idx_map, t, seeds, positions)
  ref_logits = _draws(ref_cache, idx_map, t, seeds, positions)[0]
  check_draft(tokens, logits, base, anchor, head, t_bs, u, rows=valid)
  assert_drafts_agree((tok, logits), (np.asarray(ref_tokens), ref_logits),
                      base, anchor, head, t_bs, u, rows=valid)


# Invalid inputs: (argument index in sample_draft_into's call, a strategy of
# bad values given the problem's B, S, V, N, the error, the name it must carry).
def _bad_values(B, S, V, N):
  i32 = lambda a: jnp.asarray(a, jnp.int32)  # noqa: E731
  return [
      (1, st.just(jnp.zeros((B, S, V + 1))), ValueError, "base_logits"),
      (1, st.just(jnp.zeros((B, S, V), jnp.int32)), TypeError, "base_logits"),
      (2, st.integers(V, 2**31 - 1).map(lambda a: i32([a] * B)), ValueError, "anchor_tokens"),
      (2, st.integers(-2**31, -1).map(lambda a: np.full(B, a, np.int64)), ValueError,
       "anchor_tokens"),
      (2, st.just(np.ones(B, bool)), TypeError, "anchor_tokens"),
      (2, st.just(jnp.zeros((B,), jnp.float32)), TypeError, "anchor_tokens"),
      (4, st.floats(max_value=-1e-30, allow_infinity=True, allow_nan=False).map(
          lambda x: np.full(N, x, np.float32)), ValueError, "temperature"),
      (4, st.just(np.full(N, np.nan, np.float32)), ValueError, "temperature"),
      (4, st.just(np.ones(N + 1, np.float32)), ValueError, "temperature"),
      (5, st.integers(2**64, 2**80).map(lambda x: [x] * N), ValueError, "seeds"),
      (5, st.integers(-2**80, -2**63 - 1).map(lambda x: [x] * N), ValueError, "seeds"),
      (5, st.just(np.ones(N, bool)), TypeError, "seeds"),
      (5, st.just(np.ones(N + 1, np.int64)), ValueError, "seeds"),
      (5, st.just(np.ones((N, 3), np.uint32)), ValueError, "seeds"),
      (6, st.integers(N, 2**31 - 1).map(lambda r: np.full((B, S), r, np.int32)),
       ValueError, "idx_map"),
      (6, st.integers(-2**31, -2).map(lambda r: np.full((B, S), r, np.int32)),
       ValueError, "idx_map"),
      (6, st.just(np.zeros((B, S), bool)), TypeError, "idx_map"),
      (6, st.just(np.zeros((B, S + 1), np.int32)), ValueError, "idx_map"),
      (7, st.integers(2**31, 2**63 - 1).map(lambda p: np.full((B, S), p, np.int64)),
       ValueError, "positions"),
      (7, st.integers(-2**63, -1).map(lambda p: np.full((B, S), p, np.int64)),
       ValueError, "positions"),
      (7, st.just(np.zeros((B, S), np.float32)), TypeError, "positions"),
      (7, st.just(np.zeros((B, S), bool)), TypeError, "positions"),
      (0, st.just(jnp.zeros((N, S, V), jnp.bfloat16)), TypeError, "cache"),
      (0, st.just(jnp.zeros((N, S + 1, V), jnp.float32)), ValueError, "cache"),
  ]


@st.composite
def invalid_calls(draw):
  problem = list(draw(into_problems()))
  cache, base, _, _, t, _, idx_map, _ = problem
  B, S, V = base.shape
  N = cache.shape[0]
  cases = _bad_values(B, S, V, N)
  if B >= 2 and N >= 2 and S >= 1:   # a state row twice in one step
    dup = np.array(idx_map)
    dup[:, 0] = -1
    dup[0, 0] = dup[1, 0] = draw(st.integers(0, N - 1))
    cases.append((6, st.just(dup), ValueError, "idx_map"))
  i, values, exc, name = draw(st.sampled_from(cases))
  problem[i] = draw(values)
  return problem, exc, name


@settings(max_examples=80, **SETTINGS)
@given(invalid_calls())
def test_invalid_into_calls_raise_and_write_nothing(case):
  problem, exc, name = case
  cache = problem[0]
  before = np.asarray(cache).copy()
  with pytest.raises(exc, match=name):
    jm.sample_draft_into(*problem)          # donate=True
  assert not cache.is_deleted()
  np.testing.assert_array_equal(np.asarray(cache), before)


@settings(max_examples=40, **SETTINGS)
@given(dense_problems(), st.data())
def test_invalid_dense_calls_raise(problem, data):
  """The dense layout refuses what the state layout refuses, for its arguments."""
  base, anchor, head, t, seeds, positions = problem
  B, S, V = base.shape
  into_index = {1: 0, 2: 1, 4: 3, 5: 4, 7: 5}   # sample_draft_into -> sample_draft
  cases = [c for c in _bad_values(B, S, V, B) if c[0] in into_index]
  i, values, exc, name = data.draw(st.sampled_from(cases))
  args = list(problem)
  args[into_index[i]] = data.draw(values)
  with pytest.raises(exc, match=name):
    jm.sample_draft(*args)
