"""jm.sample_draft / jm.sample_draft_into against the reference and the contract.

On CPU the Pallas kernels run in interpret mode; the same tests run compiled in
test_gpu.py.

Two implementations (the kernels and the reference, two selects, two layouts,
two request tiles) sum the bias in their own order, and XLA may contract a
multiply-add to an FMA in one program and not in another: their float32 logits
may differ in the last bit, and a draw on a CDF boundary may then go either
way. They are compared with helpers.assert_drafts_agree (Higham's bound on the
logits, tokens equal wherever the draw is decided beyond rounding). Bit
equality is asserted only where the same compiled program reads the same
values (cache rows no draw names, a repeated call).
"""

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov as jm
from helpers import (assert_drafts_agree, assert_sample_drafts_agree,
                     check_sample_draft, make_problem)

METHODS = ["xla_bias", "fused"]


def _config(method, block_v, rank):
  block_k = min(64, max(16, 1 << (rank - 1).bit_length()))
  return jm.KernelConfig(method=method,
                         block_b=1 if method == "xla_bias" else 16,
                         block_v=block_v, block_k=block_k)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
def test_dtypes_match_reference(method, dtype):
  args = make_problem(5, 3, 300, 16, dtype, seed=1)
  draft = jm.sample_draft(*args, config=_config(method, 128, 16))
  chex.assert_shape(draft.tokens, (5, 3))
  chex.assert_type(draft.tokens, jnp.int32)
  chex.assert_shape(draft.logits, (5, 3, 300))
  chex.assert_type(draft.logits, jnp.float32)
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(*args), *args)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("V,block_v", [
    (300, 128),   # not a multiple of the block
    (100, 128),   # smaller than a block
    (1, 16),      # a single token
    (256, 128),   # an exact multiple
])
def test_vocab_edges(method, V, block_v):
  args = make_problem(4, 2, V, 8, seed=2)
  draft = jm.sample_draft(*args, config=_config(method, block_v, 8))
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(*args), *args)
  if V == 1:
    assert (np.asarray(draft.tokens) == 0).all()


@pytest.mark.parametrize("S", [1, 5, 8])
def test_steps(S):
  args = make_problem(3, S, 200, 8, seed=3)
  draft = jm.sample_draft(*args, config=_config("fused", 64, 8))
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(*args), *args)


@pytest.mark.parametrize("method,R", [("fused", 1), ("xla_bias", 3), ("fused", 80),
                                      ("fused", 256), ("xla_bias", 256)])
def test_ranks(method, R):
  args = make_problem(3, 3, 200, R, seed=4)
  draft = jm.sample_draft(*args, config=_config(method, 128, R))
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(*args), *args)


@pytest.mark.parametrize("temperature", [
    [1e4] * 6, [0.0, 1e-6, 0.5, 1.0, 7.0, 1e4]])
def test_temperatures(temperature):
  args = make_problem(6, 3, 250, 8, seed=5, temperature=temperature)
  draft = jm.sample_draft(*args, config=_config("fused", 128, 8))
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(*args), *args)


def test_tiny_temperature_is_argmax():
  args = make_problem(4, 3, 200, 8, seed=6, temperature=[1e-6] * 4)
  greedy = make_problem(4, 3, 200, 8, seed=6, temperature=[0.0] * 4)
  a = jm.sample_draft(*args)
  b = jm.sample_draft(*greedy)
  # One compiled program (only temperature values differ): the same logits
  # bit for bit, and at T = 1e-6 every token but the max has p = exp(-gap *
  # 1e6) = 0 for the gaps of these normal logits (checked by the contract).
  check_sample_draft(a, *args)
  np.testing.assert_array_equal(a.logits, b.logits)
  np.testing.assert_array_equal(a.tokens, b.tokens)


def test_default_config_and_interpret_flag():
  args = make_problem(2, 2, 70, 4, seed=7)
  draft = jm.sample_draft(*args)  # interpret=None picks the interpreter on CPU
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(*args), *args)


@pytest.mark.parametrize("method", METHODS)
def test_neg_inf_never_drawn(method):
  B, S, V = 64, 3, 40
  base, anchor, head, _, seeds, pos = make_problem(B, S, V, 4, jnp.float32, seed=8)
  allowed = np.zeros(V, bool)
  allowed[[3, 17, 18, 39]] = True
  base = jnp.where(jnp.asarray(allowed), base, -jnp.inf)
  t = jnp.full((B,), 50.0)  # flat: every allowed token is likely
  draft = jm.sample_draft(base, anchor, head, t, seeds, pos,
                          config=_config(method, 16, 4))
  assert allowed[np.asarray(draft.tokens)].all()
  check_sample_draft(draft, base, anchor, head, t, seeds, pos)


def test_nan_and_all_inf_rows():
  B, S, V = 4, 2, 50
  base, anchor, head, _, seeds, pos = make_problem(B, S, V, 4, jnp.float32, seed=9)
  base = base.at[0].set(-jnp.inf)              # nothing drawable: token 0
  base = base.at[1].set(jnp.nan)               # all NaN: token 0
  base = base.at[2, :, :10].set(jnp.nan)       # NaN never drawn
  t = jnp.array([1.0, 1.0, 1.0, 0.0])
  for method in METHODS:
    draft = jm.sample_draft(base, anchor, head, t, seeds, pos,
                            config=_config(method, 16, 4))
    tokens = np.asarray(draft.tokens)
    assert (tokens[0] == 0).all() and (tokens[1] == 0).all()
    assert (tokens[2] >= 10).all()
    assert ((tokens >= 0) & (tokens < V)).all()
    assert np.isnan(np.asarray(draft.logits[1])).all()
    assert_sample_drafts_agree(draft, jm.reference.sample_draft(base, anchor, head, t, seeds, pos),
                               base, anchor, head, t, seeds, pos)


def test_plus_inf_logit_is_drawn_greedily():
  base, anchor, head, _, seeds, pos = make_problem(3, 2, 60, 4, jnp.float32, seed=10)
  base = base.at[:, :, 41].set(jnp.inf).at[:, :, 45].set(jnp.inf)
  draft = jm.sample_draft(base, anchor, head, jnp.ones(3), seeds, pos)
  assert (np.asarray(draft.tokens) == 41).all()


def test_independent_of_batch_and_row():
  args = make_problem(6, 4, 300, 8, seed=11, temperature=[1.0] * 6)
  base, anchor, head, t, seeds, pos = args
  full = jm.sample_draft(*args)

  def rows(draft, r):
    r = np.asarray(r)
    return np.asarray(draft.tokens)[r], np.asarray(draft.logits)[r]

  def agree(a, b, r):  # drafts a and b of the requests r of args
    r = np.asarray(r)
    sub = (base[r], anchor[r], head, t[r], seeds[r], pos[r])
    assert_sample_drafts_agree(a, b, *sub)

  # A request's row in the batch (and so in the request tile) changes the
  # program's arithmetic at most in the last bits: the draws agree.
  perm = np.array([4, 2, 0, 5, 1, 3])
  permuted = jm.sample_draft(base[perm], anchor[perm], head, t[perm],
                             seeds[perm], pos[perm])
  agree(tuple(permuted), rows(full, perm), perm)
  # Other requests' inputs change; request 0 keeps its own.
  other = make_problem(6, 4, 300, 8, seed=12, temperature=[1.0] * 6)
  mixed = (base.at[1:].set(other[0][1:]), anchor.at[1:].set(other[1][1:]), head,
           t, np.concatenate([seeds[:1], other[4][1:]]), pos.at[1:].set(other[5][1:]))
  alone = jm.sample_draft(*mixed)
  agree(rows(alone, [0]), rows(full, [0]), [0])
  single = jm.sample_draft(base[:1], anchor[:1], head, t[:1], seeds[:1], pos[:1])
  agree(tuple(single), rows(full, [0]), [0])
  # The uniforms depend on nothing but the seed and position: this is what
  # makes the rows above comparable at all.
  np.testing.assert_array_equal(jm.draft_uniforms(seeds[:1], pos[:1]),
                                jm.draft_uniforms(seeds, pos)[:1])


def test_v_in_larger_than_v():
  args = make_problem(3, 3, 120, 8, seed=13, v_in=200)
  draft = jm.sample_draft(*args)
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(*args), *args)


def _into_problem(seed=14, B=5, S=3, V=200, R=8, N=9):
  base, anchor, head, _, _, pos = make_problem(B, S, V, R, seed=seed)
  rng = np.random.default_rng(seed)
  rows = rng.permutation(N)[:B].astype(np.int32)
  idx_map = np.repeat(rows[:, None], S, axis=1)
  idx_map[1, :] = -1                       # a padding request
  idx_map[3, 2] = -1                       # a padded step
  temperature = jnp.asarray(rng.choice([0.0, 0.7, 1.0], N), jnp.float32)
  seeds = rng.integers(-2**63, 2**63 - 1, N, dtype=np.int64)
  cache = jnp.asarray(rng.standard_normal((N, S, V)), jnp.float32)
  return cache, base, anchor, head, temperature, seeds, jnp.asarray(idx_map), pos


def _into_draws(cache, idx_map, temperature, seeds, pos):
  """Per draw (b, s): its logits cache[idx_map[b, s], s], temperature and
  uniform, and the bool [B, S] mask of draws that are not padding."""
  idx_map = np.asarray(idx_map)
  valid = idx_map >= 0
  rows = np.where(valid, idx_map, 0)
  u = np.asarray(jm.draft_uniforms(np.asarray(seeds)[rows].reshape(-1),
                                   np.asarray(pos).reshape(-1, 1))).reshape(rows.shape)
  logits = np.asarray(cache)[rows, np.arange(rows.shape[1])[None, :]]
  return logits, np.asarray(temperature)[rows], u, valid


def _assert_into_matches(problem, tokens, new_cache, ref_tokens, ref_cache, before):
  """Draws agree with the reference's; cache rows no draw names unchanged (bit
  for bit: nothing may write them).

  problem: the arguments of the call (cache, base, anchor, head, temperature,
  seeds, idx_map, pos). Returns the bool [B, S] mask of draws that are not
  padding.
  """
  _, base, anchor, head, temperature, seeds, idx_map, pos = problem
  chex.assert_type([tokens, new_cache], [jnp.int32, jnp.float32])
  chex.assert_shape(new_cache, before.shape)
  logits, t, u, valid = _into_draws(new_cache, idx_map, temperature, seeds, pos)
  ref_logits = _into_draws(ref_cache, idx_map, temperature, seeds, pos)[0]
  assert_drafts_agree((np.asarray(tokens), logits), (np.asarray(ref_tokens), ref_logits),
                      base, anchor, head, t, u, rows=valid)
  written = np.zeros(before.shape[:2], bool)
  for b, s in zip(*np.nonzero(valid)):
    written[idx_map[b, s], s] = True
  np.testing.assert_array_equal(np.asarray(new_cache)[~written], before[~written])
  return valid


@pytest.mark.parametrize("method", METHODS)
def test_into_matches_reference_and_leaves_other_rows(method):
  problem = _into_problem()
  cache, base, anchor, head, temperature, seeds, idx_map, pos = problem
  before = np.asarray(cache)
  ref_tokens, ref_cache = jm.reference.sample_draft_into(*problem)
  tokens, new_cache = jm.sample_draft_into(
      *problem, config=_config(method, 64, 8), donate=False)
  chex.assert_shape(tokens, (5, 3))
  chex.assert_type(tokens, jnp.int32)
  # Padding draws too: their token is some valid id.
  assert ((np.asarray(tokens) >= 0) & (np.asarray(tokens) < 200)).all()
  # assert_drafts_agree checks the contract on the draws that are not padding.
  _assert_into_matches(problem, tokens, new_cache, ref_tokens, ref_cache, before)


def test_into_equals_dense_with_gathered_state():
  cache, base, anchor, head, temperature, seeds, idx_map, pos = _into_problem(seed=15)
  idx_map = jnp.asarray(np.repeat(np.array([2, 0, 7, 4, 5])[:, None], 3, axis=1))
  tokens, new_cache = jm.sample_draft_into(cache, base, anchor, head, temperature,
                                           seeds, idx_map, pos, donate=False)
  rows = np.asarray(idx_map[:, 0])
  dense_args = (base, anchor, head, temperature[rows], seeds[rows], pos)
  dense = jm.sample_draft(*dense_args)
  assert_sample_drafts_agree((tokens, np.asarray(new_cache)[rows]), dense, *dense_args)


def test_into_donation_updates_in_place():
  cache, *rest = _into_problem(seed=16)
  ptr = cache.unsafe_buffer_pointer()
  tokens, new_cache = jm.sample_draft_into(cache, *rest)
  assert cache.is_deleted()
  if jax.default_backend() != "cpu":  # the CPU client may copy donated buffers
    assert new_cache.unsafe_buffer_pointer() == ptr
  tokens2, newer = jm.sample_draft_into(new_cache, *rest)
  # The same compiled program on the same inputs (the cache rows it reads are
  # the rows it writes first): the same tokens, bit for bit.
  np.testing.assert_array_equal(tokens, tokens2)


def _check_changing_rows(seed, config=None):
  """Draws into state rows that change between steps; checks against the reference."""
  cache, base, anchor, head, temperature, seeds, _, pos = _into_problem(seed=seed, N=12)
  idx_map = jnp.asarray([[0, 5, 11], [3, -1, 4], [7, 8, 0], [1, 1, 1], [-1, 2, 3]],
                        jnp.int32)
  problem = (cache, base, anchor, head, temperature, seeds, idx_map, pos)
  before = np.asarray(cache)
  ref_tokens, ref_cache = jm.reference.sample_draft_into(*problem)
  tokens, new_cache = jm.sample_draft_into(*problem, config=config, donate=False)
  _assert_into_matches(problem, tokens, new_cache, ref_tokens, ref_cache, before)


def test_into_state_rows_may_change_between_steps():
  """idx_map[b, s] names the state row of each draw, not only of each request."""
  _check_changing_rows(seed=17)


def test_base_dtype_may_differ_from_the_head():
  base, anchor, head, t, seeds, pos = make_problem(4, 3, 150, 8, jnp.bfloat16, seed=18)
  base32 = base.astype(jnp.float32) * 1.5  # not representable in bf16
  draft = jm.sample_draft(base32, anchor, head, t, seeds, pos)
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(base32, anchor, head, t, seeds, pos),
                             base32, anchor, head, t, seeds, pos)


@pytest.mark.parametrize("unroll,k_loop,serpentine",
                         [(True, "fori", True), (True, "static", False),
                          (False, "static", True), (False, "fori", False)])
def test_loop_forms_agree(unroll, k_loop, serpentine):
  """The step loop (Python-unrolled or lax.scan), the rank loop (fori or
  static) and the vocabulary order of odd steps change the program, never the
  draft: both layouts, against the reference."""
  args = make_problem(5, 3, 300, 80, seed=19)
  ref = jm.reference.sample_draft(*args)
  for method, block_b in METHODS_AND_TILES:
    config = jm.KernelConfig(method=method, block_b=block_b, block_v=128,
                             block_k=32, unroll=unroll, k_loop=k_loop,
                             serpentine=serpentine)
    draft = jm.sample_draft(*args, config=config)
    assert_sample_drafts_agree(draft, ref, *args)

  _check_changing_rows(20, jm.KernelConfig(method="fused", block_b=16,
                                            block_v=64, block_k=16,
                                            unroll=unroll, k_loop=k_loop,
                                            serpentine=serpentine))


@pytest.mark.parametrize("block_b,block_v,block_k,k_loop",
                         [(1, 64, 32, "fori"), (1, 128, 64, "static"),
                          (4, 32, 16, "fori")])
def test_fma_bias_agrees(block_b, block_v, block_k, k_loop):
  """The bias on the CUDA cores (bias_dot='fma', request tiles below 16):
  the same draft as the reference, both layouts."""
  args = make_problem(5, 3, 300, 80, seed=23)
  config = jm.KernelConfig(method="fused", block_b=block_b, block_v=block_v, block_k=block_k, k_loop=k_loop,
                           bias_dot="fma")
  draft = jm.sample_draft(*args, config=config)
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(*args), *args)
  _check_changing_rows(20, config)


@pytest.mark.parametrize(
    "block_b,bias_dot,select,k_loop,proj_l2_rows,early_proj",
    [(16, "mma", "pass", "fori", 100, 0),
     (1, "fma", "tail", "fori", 64, 0),
     (1, "fma", "pass", "static", 10_000, 0),
     (1, "fma", "tail", "fori", 64, 2),
     (16, "mma", "pass", "fori", 100, 1),
     (16, "mma", "pass", "static", 100, 0)])
def test_proj_l2_rows_changes_no_result(block_b, bias_dot, select, k_loop,
                                        proj_l2_rows, early_proj):
  """L2 hints that keep the first rows of proj in L2 across the steps (part
  of them, one block, or all of proj) take one branch or the other per
  program and step, also for the chunks loaded ahead of the rank loop
  (early_proj): the same draft as the reference, both layouts, and greedy
  drafting (whose epilogue stores only statistics)."""
  args = make_problem(5, 3, 300, 80, seed=27)
  config = jm.KernelConfig(method="fused", block_b=block_b, block_v=64, block_k=32, k_loop=k_loop,
                           bias_dot=bias_dot, select=select,
                           proj_l2_rows=proj_l2_rows, early_proj=early_proj)
  draft = jm.sample_draft(*args, config=config)
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(*args), *args)
  base, anchor, head = args[:3]
  np.testing.assert_array_equal(
      jm.greedy_draft(base, anchor, head, config=config),
      jm.reference.greedy_draft(base, anchor, head))
  _check_changing_rows(28, config)


@pytest.mark.parametrize("block_b,bias_dot,select,hints,early_proj",
                         [(16, "mma", "pass", "stream", 0),
                          (16, "mma", "pass", "proj", 1),
                          (1, "fma", "tail", "proj", 0),
                          (4, "fma", "pass", "stream", 2)])
def test_l2_hints_change_no_result(block_b, bias_dot, select, hints,
                                   early_proj):
  """Eviction hints without kept rows (l2_hints), also on the chunks loaded
  ahead of the rank loop: the same draft as the reference, both layouts."""
  args = make_problem(5, 3, 300, 80, seed=37)
  config = jm.KernelConfig(method="fused", block_b=block_b, block_v=64,
                           block_k=32, bias_dot=bias_dot, select=select,
                           l2_hints=hints, early_proj=early_proj)
  draft = jm.sample_draft(*args, config=config)
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(*args), *args)
  _check_changing_rows(30, config)


@pytest.mark.parametrize("block_b,bias_dot,select,k_loop,early_proj",
                         [(16, "mma", "pass", "fori", 1),
                          (16, "mma", "pass", "static", 2),
                          (1, "fma", "tail", "fori", 3),
                          (4, "fma", "pass", "fori", 9)])
def test_early_proj_changes_no_result(block_b, bias_dot, select, k_loop,
                                      early_proj):
  """proj chunks loaded ahead of the rank loop (before the dependent-launch
  wait on the GPU): some of the 3 chunks of R = 80, all of them, or more
  than there are (all): the same draft as the reference, both layouts."""
  args = make_problem(5, 3, 300, 80, seed=31)
  config = jm.KernelConfig(method="fused", block_b=block_b, block_v=64,
                           block_k=32, k_loop=k_loop, bias_dot=bias_dot,
                           select=select, early_proj=early_proj)
  draft = jm.sample_draft(*args, config=config)
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(*args), *args)
  _check_changing_rows(32, config)


@pytest.mark.parametrize(
    "B,block_b,remainder_b,bias_dot,k_loop,early_proj,remainder_pass",
    [(21, 16, 8, "mma", "fori", 0, "joint"),     # 1 tile + 5
     (21, 16, 8, "mma", "fori", 1, "after"),
     (40, 16, 15, "mma", "static", 1, "joint"),  # 2 tiles + 8
     (40, 16, 15, "mma", "fori", 0, "after"),
     (7, 2, 1, "fma", "fori", 0, "joint"),       # 3 tiles + 1
     (7, 2, 1, "fma", "static", 0, "after"),
     (7, 4, 3, "fma", "fori", 2, "joint"),       # 1 tile + 3
     (12, 4, 3, "fma", "fori", 0, "joint"),      # no remainder
     (11, 4, 2, "fma", "fori", 0, "after")])     # 3 > 2: partial
def test_remainder_rows_agree(B, block_b, remainder_b, bias_dot, k_loop,
                              early_proj, remainder_pass):
  """The last request tile's programs take the rows past it (remainder_b):
  the grid, which rows are live and which programs store them change, not
  the draft. Against the reference, both layouts, at temperatures 0 and 1;
  and where the remainder does not fit remainder_b (or there is none) the
  config runs the plain grid."""
  from jax_markov.kernels.block_pass import request_tiles
  config = jm.KernelConfig(method="fused", block_b=block_b, block_v=64,
                           block_k=32, bias_dot=bias_dot, k_loop=k_loop,
                           early_proj=early_proj, remainder_b=remainder_b,
                           remainder_pass=remainder_pass)
  tiles, rest = request_tiles(B, config)
  assert (tiles, rest) == ((B // block_b, B % block_b)
                           if 0 < B % block_b <= remainder_b
                           else (-(-B // block_b), 0))
  args = make_problem(B, 3, 300, 80, seed=B,
                      temperature=np.arange(B) % 2 * 1.0)
  draft = jm.sample_draft(*args, config=config)
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(*args), *args)
  base, anchor, head = args[:3]
  np.testing.assert_array_equal(
      jm.greedy_draft(base, anchor, head, config=config),
      jm.reference.greedy_draft(base, anchor, head))
  if B == 7:
    # B = 5 state rows on 2-request tiles: 2 tiles and 1 row.
    _check_changing_rows(35, dataclasses.replace(config, block_b=2,
                                                    remainder_b=1))
  if B == 21:
    # 5 rows in a 16-row tile: 11 masked rows in the last tile's programs.
    assert request_tiles(B, config) == (1, 5)


@pytest.mark.parametrize("remainder_pass", ["joint", "after"])
@pytest.mark.parametrize("greedy", [False, True], ids=["sample", "greedy"])
def test_remainder_rows_with_a_reduced_vocabulary(greedy, remainder_pass):
  """A reduced draft vocabulary (the grid walks target columns with slots,
  or draft columns with their target ids when greedy) with remainder rows:
  the reference's draft."""
  rng = np.random.default_rng(36)
  B, S, V, Vd, R = 21, 3, 200, 120, 32
  base = jnp.asarray(3.0 * rng.standard_normal((B, S, Vd)), jnp.float32)
  head = jm.MarkovHead(
      jnp.asarray(0.3 * rng.standard_normal((V, R)), jnp.float32),
      jnp.asarray(0.3 * rng.standard_normal((Vd, R)), jnp.float32))
  d2t = rng.permutation(V)[:Vd].astype(np.int32)
  anchor = jnp.asarray(rng.integers(0, V, B), jnp.int32)
  config = jm.KernelConfig(method="fused", block_b=16, block_v=64,
                           block_k=16, remainder_b=8,
                           remainder_pass=remainder_pass)
  if greedy:
    np.testing.assert_array_equal(
        jm.greedy_draft(base, anchor, head, draft_to_target=d2t,
                        config=config),
        jm.reference.greedy_draft(base, anchor, head, draft_to_target=d2t))
    return
  t = jnp.asarray(np.arange(B) % 2 * 1.0, jnp.float32)
  seeds = rng.integers(-2**63, 2**63 - 1, B, dtype=np.int64)
  pos = jnp.asarray(rng.integers(0, 10_000, (B, 1)) + np.arange(S), jnp.int32)
  tokens, logits = jm.sample_draft(base, anchor, head, t, seeds, pos,
                                   draft_to_target=d2t, config=config)
  want_tokens, want_logits = jm.reference.sample_draft(
      base, anchor, head, t, seeds, pos, draft_to_target=d2t)
  # V = 200 target columns, 120 of them mapped: a draw on a rounding
  # boundary has probability ~ Vd * 2^-24 (test_draft_vocab.py's argument).
  np.testing.assert_array_equal(tokens, want_tokens)
  np.testing.assert_allclose(logits, want_logits, rtol=2e-6, atol=2e-5)


def test_remainder_b_is_checked():
  for bad in (-1, 16, 17):
    with pytest.raises(ValueError, match="remainder_b"):
      jm.KernelConfig(method="fused", block_b=16, remainder_b=bad)
  with pytest.raises(ValueError, match="remainder_b"):
    jm.KernelConfig(method="xla_bias", block_b=2, remainder_b=1)
  with pytest.raises(ValueError, match="remainder_pass"):
    jm.KernelConfig(method="fused", block_b=16, remainder_b=8,
                    remainder_pass="before")
  with pytest.raises(ValueError, match="remainder_b"):
    jm.KernelConfig(method="fused", block_b=2, bias_dot="fma",
                    select="persistent", remainder_b=1)


@pytest.mark.parametrize("B,block_b,programs,serpentine", [
    (5, 16, 1, True),    # one program walks all 5 blocks
    (5, 16, 2, False),   # 3 and 2 blocks
    (11, 16, 9, True),   # more programs than blocks: one a block
])
def test_walking_programs_are_the_plain_tile_bit_for_bit(B, block_b, programs,
                                                         serpentine):
  """block_programs (P programs walking the vocabulary in one loop over
  (block, rank chunk)) sums each block as the plain tile does: the same
  tokens and cache bit for bit, sampling (temperatures 0 and 1, dense and
  into state rows that change between steps) and greedy; and the
  reference's draft."""
  plain = jm.KernelConfig(method="fused", block_b=block_b, block_v=64,
                          block_k=32, serpentine=serpentine)
  walking = dataclasses.replace(plain, block_programs=programs)
  args = make_problem(B, 3, 300, 80, seed=50 + B,
                      temperature=np.arange(B) % 2 * 1.0)
  want = jm.sample_draft(*args, config=plain)
  got = jm.sample_draft(*args, config=walking)
  for w, g in zip(want, got):
    np.testing.assert_array_equal(np.asarray(w), np.asarray(g))
  assert_sample_drafts_agree(got, jm.reference.sample_draft(*args), *args)
  base, anchor, head = args[:3]
  np.testing.assert_array_equal(
      jm.greedy_draft(base, anchor, head, config=walking),
      jm.greedy_draft(base, anchor, head, config=plain))
  if programs == 2:
    _check_changing_rows(51, walking)


def test_block_programs_is_checked():
  for kw in (dict(block_programs=-1), dict(bias_dot="fma"),
             dict(select="tail", block_b=1, bias_dot="fma"),
             dict(k_loop="static"), dict(method="xla_bias", block_b=1)):
    with pytest.raises(ValueError, match="block_programs"):
      jm.KernelConfig(**{**dict(method="fused", block_b=16,
                                block_programs=4), **kw})
  for kw in (dict(remainder_b=8), dict(early_proj=1), dict(prefetch_proj=1),
             dict(proj_l2_rows=64), dict(l2_hints="stream")):
    with pytest.raises(ValueError, match="block_programs takes no"):
      jm.KernelConfig(method="fused", block_b=16, block_programs=4, **kw)
  # One request tile only: B = 20 on 16-request tiles is two.
  args = make_problem(20, 3, 300, 80, seed=52)
  with pytest.raises(ValueError, match="one request tile"):
    jm.sample_draft(*args, config=jm.KernelConfig(
        method="fused", block_b=16, block_v=64, block_k=32,
        block_programs=4))


@pytest.mark.parametrize("block_v,k_loop,unroll",
                         [(64, "fori", True), (128, "static", False),
                          (16, "fori", False)])
def test_tail_select_agrees(block_v, k_loop, unroll):
  """select='tail' (the block pass's last program draws, one launch a step):
  the same tokens and cache as the select pass, which the reference checks,
  both layouts, at temperatures 0 and 1."""
  args = make_problem(5, 3, 300, 80, seed=24,
                      temperature=np.array([1.0, 0.0, 1.0, 0.7, 0.0]))
  ref = jm.reference.sample_draft(*args)
  drafts = []
  for select in ("pass", "tail"):
    config = jm.KernelConfig(method="fused", block_b=1, block_v=block_v, block_k=32, k_loop=k_loop,
                             unroll=unroll, bias_dot="fma", select=select)
    drafts.append(jm.sample_draft(*args, config=config))
    assert_sample_drafts_agree(drafts[-1], ref, *args)
  assert_sample_drafts_agree(drafts[1], drafts[0], *args)
  _check_changing_rows(25, config)


@pytest.mark.parametrize("select", ["tail", "persistent"])
def test_one_launch_selects_edge_rows(select):
  """NaN, all -inf and +inf rows draw as the select pass draws them with the
  tail select and the persistent draft; and one step (S = 1)."""
  base, anchor, head, t, seeds, pos = make_problem(4, 2, 200, 8, seed=26)
  base = np.asarray(base).copy()
  base[0, 0, :] = np.nan
  base[1, :, :] = -np.inf
  base[2, 1, 37] = np.inf
  base[3, 0, ::3] = -np.inf
  args = (jnp.asarray(base), anchor, head, t, seeds, pos)
  one_step = (args[0][:, :1], anchor, head, t, seeds, pos[:, :1])
  for problem in (one_step, args):
    drafts = [jm.sample_draft(*problem, config=jm.KernelConfig(
        method="fused", block_b=1, block_v=64, block_k=16, bias_dot="fma", select=s)) for s in ("pass", select)]
    assert_sample_drafts_agree(drafts[1], drafts[0], *problem)
    # The NaN and infinity pattern comes from base alone: the same in both.
    for f in (np.isnan, np.isposinf, np.isneginf):
      np.testing.assert_array_equal(f(np.asarray(drafts[0].logits)),
                                    f(np.asarray(drafts[1].logits)))
  np.testing.assert_array_equal(drafts[1].tokens[1], [0, 0])  # of args
  assert drafts[1].tokens[2, 1] == 37


@pytest.mark.parametrize("block_v,block_k,serpentine",
                         [(64, 32, True), (128, 16, False), (16, 64, True)])
def test_persistent_draft_agrees(block_v, block_k, serpentine):
  """select='persistent' (the whole draft in one launch; programs meet at a
  barrier each step and all draw): the same draft as the block pass with the
  select pass and as the reference, both layouts, T 0 and > 0. Not bit for
  bit: the two are separate programs, which XLA's CPU compiler may round
  differently (a fresh CPU machine had 11 of 4500 logits 1 ulp apart at
  block_v=64, issue 16). On a GPU the programs per request are the
  multiprocessors split over B."""
  args = make_problem(5, 3, 300, 80, seed=30,
                      temperature=np.array([1.0, 0.0, 1.0, 0.7, 0.0]))
  drafts = [jm.sample_draft(*args, config=jm.KernelConfig(
      method="fused", block_b=1, block_v=block_v, block_k=block_k, bias_dot="fma", select=select,
      serpentine=serpentine)) for select in ("pass", "persistent")]
  assert_sample_drafts_agree(drafts[1], drafts[0], *args)
  assert_sample_drafts_agree(drafts[1], jm.reference.sample_draft(*args), *args)
  _check_changing_rows(31, jm.KernelConfig(method="fused", block_b=1, block_v=block_v, block_k=block_k,
                                           bias_dot="fma", select="persistent",
                                           serpentine=serpentine))


@pytest.mark.parametrize("tile", [
    dict(block_b=1, bias_dot="fma", held_blocks=2),
    dict(block_b=2, bias_dot="fma", held_blocks=1),   # three tiles of 2
    dict(block_b=16, bias_dot="mma", held_blocks=1),  # one padded tile
    dict(block_b=4, bias_dot="fma", held_blocks=99),  # every block held
])
def test_persistent_draft_with_tiles_and_held_proj_agrees(tile):
  """The persistent draft with request tiles (owners draw, the next step
  reads the published tokens) and proj held across the steps: the draft of
  the step-by-step kernels and of the reference, both layouts."""
  args = make_problem(5, 3, 300, 80, seed=34,
                      temperature=np.array([1.0, 0.0, 1.0, 0.7, 0.0]))
  config = jm.KernelConfig(method="fused", block_v=64, block_k=16,
                           select="persistent", **tile)
  draft = jm.sample_draft(*args, config=config)
  stepwise = jm.sample_draft(*args, config=jm.KernelConfig(
      method="fused", block_b=1, block_v=64, block_k=16, bias_dot="fma"))
  assert_sample_drafts_agree(draft, stepwise, *args)
  assert_sample_drafts_agree(draft, jm.reference.sample_draft(*args), *args)
  _check_changing_rows(35, config)


METHODS_AND_TILES = [("fused", 16), ("xla_bias", 1)]
