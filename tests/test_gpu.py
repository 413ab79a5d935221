"""The sampler's checks compiled on a GPU (Triton), plus the DeepSeek-V4 shape.

Every test of test_sampler.py is collected here again under the ``gpu`` marker
(on a GPU, interpret=None compiles the kernels); elsewhere they are skipped.
Run with ``pytest -m gpu``.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov as jm
from helpers import assert_sample_drafts_agree, check_draft, check_sample_draft, make_problem
from test_sampler import *  # noqa: F401,F403  (re-collected under the gpu mark)

pytestmark = pytest.mark.gpu

DSV4 = dict(V=129280, R=256, S=7)


@pytest.mark.parametrize("method", ["xla_bias", "fused"])
@pytest.mark.parametrize("B", [1, 16])
def test_deepseek_v4_shape(method, B):
  args = make_problem(B, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16, seed=20,
                      head_scale=0.1,
                      temperature=np.where(np.arange(B) % 4 == 0, 0.0, 1.0))
  draft = jm.sample_draft(*args, method=method)
  assert draft.tokens.shape == (B, 7) and draft.logits.shape == (B, 7, DSV4["V"])
  check_sample_draft(draft, *args)


@pytest.mark.parametrize("method", ["xla_bias", "fused"])
def test_deepseek_v4_into(method):
  B, S, V, R, N = 8, DSV4["S"], DSV4["V"], DSV4["R"], 12
  base, anchor, head, _, _, pos = make_problem(B, S, V, R, seed=21, head_scale=0.1)
  rng = np.random.default_rng(21)
  idx_map = np.repeat(rng.permutation(N)[:B, None], S, axis=1).astype(np.int32)
  idx_map[2] = -1
  temperature = jnp.asarray(rng.choice([0.0, 1.0], N), jnp.float32)
  seeds = rng.integers(0, 2**62, N, dtype=np.int64)
  cache = jnp.asarray(rng.standard_normal((N, S, V)), jnp.float32)
  before = np.asarray(cache)
  ptr = cache.unsafe_buffer_pointer()
  tokens, new_cache = jm.sample_draft_into(cache, base, anchor, head, temperature,
                                           seeds, jnp.asarray(idx_map), pos,
                                           method=method)
  assert new_cache.unsafe_buffer_pointer() == ptr  # donated: updated in place
  valid = idx_map >= 0
  rows = np.where(valid, idx_map, 0)
  out = np.asarray(new_cache)
  untouched = np.ones((N, S), bool)
  untouched[rows[valid], np.nonzero(valid)[1]] = False
  np.testing.assert_array_equal(out[untouched], before[untouched])
  u = np.asarray(jm.draft_uniforms(seeds[rows].reshape(-1),
                                   np.asarray(pos).reshape(-1, 1))).reshape(rows.shape)
  check_draft(tokens, out[rows, np.arange(S)[None, :]], base, anchor, head,
              np.asarray(temperature)[rows], u, rows=valid)


def test_methods_agree_at_deepseek_v4_shape():
  """Both methods draw the same greedy tokens (T = 0 has no rounding in the draw)."""
  args = make_problem(32, 7, DSV4["V"], DSV4["R"], seed=22, head_scale=0.1,
                      temperature=np.zeros(32))
  a = jm.sample_draft(*args, method="xla_bias")
  b = jm.sample_draft(*args, method="fused")
  ref = jm.reference.sample_draft(*args)
  # Greedy chains can only split where the top two logits lie within float32
  # rounding of the bias: everywhere else the tokens must be equal.
  assert_sample_drafts_agree(b, a, *args)
  assert_sample_drafts_agree(a, ref, *args)


def _assert_selects_draw_alike(B, seed, selects, configs=None, drafts=25):
  """``drafts`` drafts at the DeepSeek-V4 shape with the same tile and each
  select (or each of ``configs``): the same draft within float32 rounding
  (assert_drafts_agree: logits within Higham's bound, tokens equal wherever
  the draw is decided beyond it). Two compiled programs need not round
  alike; a stale read would move logits far past the bound or draw a token
  away from any CDF boundary."""
  base, anchor, head, _, _, pos = make_problem(B, DSV4["S"], DSV4["V"], DSV4["R"],
                                               jnp.bfloat16, seed=seed, head_scale=0.1)
  rng = np.random.default_rng(seed)
  if configs is None:
    configs = [jm.KernelConfig(method="fused", block_b=1, block_v=128,
                               block_k=64, num_warps=4, num_stages=3,
                               bias_dot="fma", select=s) for s in selects]
  for _ in range(drafts):
    anchor = jnp.asarray(rng.integers(0, DSV4["V"], B), jnp.int32)
    t = jnp.asarray(rng.choice([0.0, 0.6, 1.0, 1.5], B), jnp.float32)
    seeds = rng.integers(-2**63, 2**63 - 1, B, dtype=np.int64)
    a, b = (jm.sample_draft(base, anchor, head, t, seeds, pos, config=c,
                            check_values=False) for c in configs)
    assert_sample_drafts_agree(b, a, base, anchor, head, t, seeds, pos)


@pytest.mark.parametrize("B", [1, 4])
def test_tail_select_matches_select_pass_at_deepseek_v4_shape(B):
  """The tail select reads the block statistics and cached logits that the
  other programs of its step wrote (ordered by the count's acq_rel atomic):
  over many draws it must draw exactly what the separate select pass draws
  from the same logits; a stale read would show as a different token."""
  _assert_selects_draw_alike(B, 27, ("pass", "tail"))


@pytest.mark.parametrize("tile", [(1, 128, 64, "fma", "tail", "fori"),
                                  (16, 256, 64, "mma", "pass", "fori"),
                                  (16, 128, 64, "mma", "pass", "static")])
def test_proj_l2_rows_changes_nothing_at_deepseek_v4_shape(tile):
  """L2 hints (part of proj kept across steps) compile on both bias dots,
  also in the unrolled rank loop (whose proj loads keep the hints), and
  give the draft of the same tile without them (within float32 rounding:
  two compiled programs)."""
  block_b, block_v, block_k, bias_dot, select, k_loop = tile
  B = max(1, block_b // 4)
  args = make_problem(B, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16, seed=29,
                      head_scale=0.1, temperature=np.arange(B) % 2 * 1.0)
  drafts = [jm.sample_draft(*args, config=jm.KernelConfig(
      method="fused", block_b=block_b, block_v=block_v, block_k=block_k,
      num_warps=4, num_stages=3, bias_dot=bias_dot, select=select,
      k_loop=k_loop, proj_l2_rows=rows)) for rows in (0, 49152)]
  assert_sample_drafts_agree(drafts[1], drafts[0], *args)


@pytest.mark.parametrize("block_b,prefetch_proj,hints",
                         [(64, 1, "stream"), (64, 0, "proj"),
                          (16, 0, "proj")])
def test_l2_hints_change_nothing_at_deepseek_v4_shape(block_b, prefetch_proj,
                                                      hints):
  """Eviction hints without kept rows (l2_hints: base and the cache
  evict_first, proj evict_last with "proj") compile on the tensor-core
  tiles of the table and give the draft of the same tile without them
  (within float32 rounding: two compiled programs)."""
  B = block_b
  args = make_problem(B, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16,
                      seed=43, head_scale=0.1,
                      temperature=np.arange(B) % 2 * 1.0)
  drafts = [jm.sample_draft(*args, config=jm.KernelConfig(
      method="fused", block_b=block_b, block_v=128, block_k=64, num_warps=4,
      num_stages=3, prefetch_proj=prefetch_proj,
      prefetch_programs=396 if prefetch_proj else 0, l2_hints=h))
      for h in ("none", hints)]
  assert_sample_drafts_agree(drafts[1], drafts[0], *args)


@pytest.mark.parametrize("tile,early_proj,l2_rows",
                         [((16, 128, "mma"), 1, 0),
                          ((64, 128, "mma"), 2, 0),
                          ((1, 128, "fma"), 4, 0),
                          ((1, 128, "fma"), 2, 57344)])
def test_early_proj_changes_nothing_at_deepseek_v4_shape(tile, early_proj,
                                                         l2_rows):
  """proj chunks loaded ahead of the rank loop compile on both bias dots
  (all four chunks in registers at 4), also with L2-kept rows (the early
  loads then under the same hints), and give the draft of the same tile
  without them (within float32 rounding: two compiled programs)."""
  block_b, block_v, bias_dot = tile
  B = max(1, block_b // 4)
  args = make_problem(B, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16,
                      seed=33, head_scale=0.1,
                      temperature=np.arange(B) % 2 * 1.0)
  drafts = [jm.sample_draft(*args, config=jm.KernelConfig(
      method="fused", block_b=block_b, block_v=block_v, block_k=64,
      num_warps=4, num_stages=3, bias_dot=bias_dot,
      select="tail" if block_b == 1 else "pass", early_proj=early,
      proj_l2_rows=l2_rows)) for early in (0, early_proj)]
  assert_sample_drafts_agree(drafts[1], drafts[0], *args)


@pytest.mark.parametrize("B,l2_rows,early_proj", [(4, 57344, 2), (3, 0, 0)])
def test_cuda_core_rows_match_tensor_core_tile_at_deepseek_v4_shape(
    B, l2_rows, early_proj):
  """All requests in one CUDA-core tile, a row each (fma, block_b > 1) with
  or without L2-kept rows and early proj chunks: the draft of the table's
  16-request tensor-core tile (within float32 rounding: two compiled
  programs; the bf16 products are exact in both)."""
  args = make_problem(B, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16,
                      seed=41, head_scale=0.1,
                      temperature=np.arange(B) % 2 * 1.0)
  rows = jm.KernelConfig(method="fused", block_b=4, block_v=128, block_k=64,
                         num_warps=4, num_stages=3, bias_dot="fma",
                         proj_l2_rows=l2_rows, early_proj=early_proj)
  mma = jm.KernelConfig(method="fused", block_b=16, block_v=128, block_k=64,
                        num_warps=4, num_stages=3)
  drafts = [jm.sample_draft(*args, config=c) for c in (rows, mma)]
  assert_sample_drafts_agree(drafts[0], drafts[1], *args)


@pytest.mark.parametrize("remainder_pass", ["joint", "after"])
@pytest.mark.parametrize("B", [72, 80])
def test_remainder_rows_change_nothing_at_deepseek_v4_shape(B,
                                                            remainder_pass):
  """The table's 64-request tile with the rows past it in its programs (8
  or 16 live rows of a 16-row tile) gives the draft of the plain grid, whose
  second tile is partial (within float32 rounding: two compiled programs);
  greedy drafts are equal."""
  from jax_markov.kernels import tuning
  from jax_markov.kernels.block_pass import request_tiles
  config = dataclasses.replace(
      tuning.choose("fused", B, DSV4["V"], DSV4["R"], interpret=False),
      remainder_pass=remainder_pass)
  assert request_tiles(B, config) == (1, B - 64)
  args = make_problem(B, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16,
                      seed=37, head_scale=0.1,
                      temperature=np.arange(B) % 2 * 1.0)
  plain = dataclasses.replace(config, remainder_b=0)
  drafts = [jm.sample_draft(*args, config=c) for c in (plain, config)]
  assert_sample_drafts_agree(drafts[1], drafts[0], *args)
  check_sample_draft(drafts[1], *args)
  greedy = [jm.greedy_draft(*args[:3], config=c) for c in (plain, config)]
  np.testing.assert_array_equal(greedy[1], greedy[0])


@pytest.mark.parametrize("B,per_sm,block_v", [(32, 3, 128), (16, 5, 128),
                                              (64, 2, 128), (64, 3, 64)])
def test_walking_programs_are_the_plain_tile_at_deepseek_v4_shape(B, per_sm,
                                                                   block_v):
  """block_programs (programs walking the vocabulary in one pipelined loop
  over (block, rank chunk)): the table's tile at one request tile, compiled,
  gives the plain tile's draft bit for bit (the same dots in the same order
  a block) and greedy drafts equal."""
  from jax_markov.kernels import tuning
  table = tuning.choose("fused", B, DSV4["V"], DSV4["R"], interpret=False)
  plain = dataclasses.replace(table, early_proj=0, prefetch_proj=0,
                              prefetch_programs=0, block_v=block_v)
  walking = dataclasses.replace(plain, block_programs=per_sm * 132)
  args = make_problem(B, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16,
                      seed=38, head_scale=0.1,
                      temperature=np.arange(B) % 2 * 1.0)
  drafts = [jm.sample_draft(*args, config=c) for c in (plain, walking)]
  for want, got in zip(*drafts):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  check_sample_draft(drafts[1], *args)
  greedy = [jm.greedy_draft(*args[:3], config=c) for c in (plain, walking)]
  np.testing.assert_array_equal(greedy[1], greedy[0])


@pytest.mark.parametrize("B", [1, 3])
def test_persistent_draft_matches_block_pass_at_deepseek_v4_shape(B):
  """The persistent draft's programs (132 // B a request on an H200) meet at
  a barrier each step and then read the block statistics and cached logits
  the others wrote: over many draws every token and logit must equal the
  step-by-step kernels'; a stale read at the barrier would show as a
  different token."""
  _assert_selects_draw_alike(B, 32, ("pass", "persistent"))


@pytest.mark.parametrize("B,tile", [
    (1, (1, 128, 64, "fma", 8, 1)),     # one request, one block held
    (1, (1, 256, 64, "fma", 8, 0)),
    (4, (4, 128, 32, "fma", 8, 1)),     # a tile of 4 on the CUDA cores
    (5, (4, 128, 32, "fma", 8, 1)),     # two tiles, the second padded
    (16, (16, 128, 64, "mma", 8, 1)),   # the tensor cores, one held block
    (4, (16, 128, 32, "mma", 8, 3)),    # three held blocks, a padded tile
    (64, (16, 128, 64, "mma", 4, 0)),   # four tiles; owners draw 64 tokens
])
def test_persistent_draft_tiles_and_held_proj_at_deepseek_v4_shape(B, tile):
  """The persistent draft with request tiles and proj held on chip across
  the steps: the draft of the step-by-step kernels (select pass), 8 drafts
  (4 from B = 16: each draft's float64 check on the host is what takes the
  time, ~100 s for 25 at B = 16). With B > 1 each token is drawn by one
  program and published through the second counter: a token read before
  its owner stored it would make the next step's logits miss the bound."""
  block_b, block_v, block_k, bias_dot, warps, held = tile
  step = jm.KernelConfig(method="fused", block_b=16, block_v=128, block_k=64,
                         num_warps=4, num_stages=3)
  draft = jm.KernelConfig(method="fused", block_b=block_b, block_v=block_v,
                          block_k=block_k, num_warps=warps, num_stages=2,
                          bias_dot=bias_dot, select="persistent",
                          held_blocks=held)
  _assert_selects_draw_alike(B, 33, None, configs=[step, draft],
                             drafts=8 if B < 16 else 4)


from test_draft_vocab import *  # noqa: F401,F403,E402  (re-collected under the gpu mark)


@pytest.mark.parametrize("B", [1, 16])
def test_deepseek_v4_reduced_draft_vocab(B):
  """A 32k draft vocabulary of the 129k target, shuffled map, compiled: the
  contract on the target row, -inf at every unmapped id, and greedy_draft
  equal to the T = 0 tokens."""
  S, V, R, VD = DSV4["S"], DSV4["V"], DSV4["R"], 32768
  rng = np.random.default_rng(22)
  base, anchor, head, t, seeds, pos = make_problem(
      B, S, VD, R, jnp.bfloat16, seed=22, v_in=V, head_scale=0.1,
      temperature=np.where(np.arange(B) % 4 == 0, 0.0, 1.0))
  anchor = jnp.asarray(rng.integers(0, V, B), jnp.int32)
  d2t = rng.permutation(np.sort(rng.choice(V, VD, replace=False))).astype(np.int32)
  draft = jm.sample_draft(base, anchor, head, t, seeds, pos, draft_to_target=d2t)
  tokens, logits = np.asarray(draft.tokens), np.asarray(draft.logits)
  assert logits.shape == (B, S, V) and np.isin(tokens, d2t).all()
  unmapped = np.setdiff1d(np.arange(V), d2t)
  assert (logits[..., unmapped] == -np.inf).all()
  base_t = np.full((B, S, V), -np.inf, np.float32)
  base_t[..., d2t] = np.asarray(base, np.float32)
  proj_t = np.zeros((V, R), np.float32)
  proj_t[d2t] = np.asarray(head.proj, np.float32)
  u = np.asarray(jm.draft_uniforms(seeds, pos))
  check_draft(tokens, logits, base_t, anchor,
              jm.MarkovHead(np.asarray(head.embed, np.float32), proj_t),
              np.broadcast_to(np.asarray(t)[:, None], (B, S)), u)
  t0 = jnp.zeros((B,), jnp.float32)
  want = jm.sample_draft(base, anchor, head, t0, seeds, pos, draft_to_target=d2t)
  got = jm.greedy_draft(base, anchor, head, draft_to_target=d2t)
  np.testing.assert_array_equal(got, want.tokens)
