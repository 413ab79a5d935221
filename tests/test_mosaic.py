"""The Mosaic GPU block pass (method="mosaic") against the contract, on a Hopper GPU.

The same checks the Triton kernels pass: the sampler's draft against the
float64 reference (check_sample_draft: logits within Higham's bound, each
token drawn by the inverse CDF of the reference's u, greedy at T = 0), the
same draft as the fused Triton block pass within float32 rounding
(assert_sample_drafts_agree), and the NaN / -inf / +inf rows drawn as the
select pass draws them. Run with ``pytest -m gpu``; skipped unless the
default device is a Hopper GPU with Pallas Mosaic GPU
(mosaic_block_pass.available()). Lowering on the CPU:
test_mosaic_lowering.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov as jm
from helpers import assert_sample_drafts_agree, check_draft, check_sample_draft, make_problem
from jax_markov.kernels import mosaic_block_pass as mbp

pytestmark = pytest.mark.gpu

DSV4 = dict(V=129280, R=256, S=7)
FUSED = jm.KernelConfig(method="fused", block_b=64, block_v=128, block_k=64,
                        num_warps=4, num_stages=3)


@pytest.fixture(scope="module", autouse=True)
def _hopper():
  ok, why = mbp.available()
  if not ok:
    pytest.skip(why)


def _mosaic(block_b=128, block_v=64, num_stages=0):
  return jm.KernelConfig(method="mosaic", block_b=block_b, block_v=block_v,
                         num_stages=num_stages)


@pytest.mark.parametrize("B,block_b,block_v", [(256, 128, 64), (128, 128, 128),
                                               (64, 64, 64), (128, 64, 128)])
def test_deepseek_v4_shape(B, block_b, block_v):
  args = make_problem(B, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16,
                      seed=40 + B, head_scale=0.1,
                      temperature=np.where(np.arange(B) % 4 == 0, 0.0, 1.0))
  draft = jm.sample_draft(*args, config=_mosaic(block_b, block_v))
  assert draft.tokens.shape == (B, 7) and draft.logits.shape == (B, 7, DSV4["V"])
  check_sample_draft(draft, *args)
  fused = jm.sample_draft(*args, config=FUSED)
  assert_sample_drafts_agree(draft, fused, *args)


def test_table_picks_mosaic_at_b256():
  args = make_problem(256, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16,
                      seed=47, head_scale=0.1,
                      temperature=np.linspace(0.0, 1.5, 256))
  config = jm.sampler._config(None, None, 256, DSV4["V"], DSV4["R"], False,
                              hopper=True)
  assert config.method == "mosaic"
  draft = jm.sample_draft(*args)  # the table's choice
  check_sample_draft(draft, *args)


def test_table_picks_64_request_tiles_at_b192():
  """B = 192 does not fill the 256 bucket's 128-request tiles: the Mosaic
  rule's 64-request tiles (their chunk statistics through the chunk pass);
  the draft is the contract's."""
  args = make_problem(192, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16,
                      seed=48, head_scale=0.1,
                      temperature=np.linspace(0.0, 1.5, 192))
  config = jm.sampler._config(None, None, 192, DSV4["V"], DSV4["R"], False,
                              hopper=True)
  assert (config.method, config.block_b) == ("mosaic", 64)
  draft = jm.sample_draft(*args)
  check_sample_draft(draft, *args)


@pytest.mark.parametrize("V", [151936, 200064])
def test_rule_picks_mosaic_at_other_vocabularies(V):
  """Shapes with no table entry take the Mosaic rule at B = 256 (the 152k
  and 200k vocabularies: 2374 and 3126 blocks of 64, chunks of 36 and 48
  blocks folded in the epilogue); the draft is the contract's."""
  args = make_problem(256, DSV4["S"], V, DSV4["R"], jnp.bfloat16, seed=V % 97,
                      head_scale=0.1, temperature=np.linspace(0.0, 1.5, 256))
  config = jm.sampler._config(None, None, 256, V, DSV4["R"], False,
                              hopper=True)
  assert (config.method, config.block_b) == ("mosaic", 128)
  draft = jm.sample_draft(*args)
  check_sample_draft(draft, *args)


@pytest.mark.parametrize("block_b,block_v,num_stages", [(128, 64, 2),
                                                        (64, 128, 3),
                                                        (128, 128, 0)])
def test_small_shapes_and_stages(block_b, block_v, num_stages):
  """Few vocabulary tiles per worker (V = 1024: one tile each), R = 64 and
  128 (one and two chunks), proj chunks in flight from 2 up."""
  for R in (64, 128):
    args = make_problem(128, 3, 1024, R, jnp.bfloat16, seed=48 + R,
                        temperature=np.linspace(0.0, 2.0, 128))
    draft = jm.sample_draft(*args, config=_mosaic(block_b, block_v, num_stages))
    check_sample_draft(draft, *args)


def test_edge_rows():
  """NaN, all -inf and +inf rows, -inf columns: drawn as the fused block pass
  draws them (the statistics treat NaN as -inf, an all -inf block sums to 0,
  the first max wins)."""
  B, S, V = 64, 3, 2048
  base, anchor, head, _, seeds, pos = make_problem(B, S, V, 64, seed=49)
  base = np.asarray(base.astype(jnp.float32)).copy()
  base[0, 0, :] = np.nan
  base[1, :, :] = -np.inf
  base[2, 1, 37] = np.inf
  base[2, 1, 1900] = np.inf
  base[3, :, ::3] = -np.inf
  base[4, 2, 64:128] = np.nan
  base = jnp.asarray(base, jnp.bfloat16)
  t = jnp.asarray(np.resize([1.0, 0.0, 0.7, np.inf], B), jnp.float32)
  args = (base, anchor, head, t, seeds, pos)
  drafts = [jm.sample_draft(*args, config=c)
            for c in (_mosaic(64, 64), FUSED)]
  assert_sample_drafts_agree(drafts[0], drafts[1], *args)
  for f in (np.isnan, np.isposinf, np.isneginf):
    np.testing.assert_array_equal(f(np.asarray(drafts[0].logits)),
                                  f(np.asarray(drafts[1].logits)))
  tokens = np.asarray(drafts[0].tokens)
  assert (tokens[1] == 0).all() and tokens[2, 1] == 37
  assert (tokens[3] % 3 != 0).all()
  assert ((tokens >= 0) & (tokens < V)).all()


def test_jit_and_repeat_calls_are_deterministic():
  base, anchor, head, t, seeds, pos = make_problem(
      128, 4, 4096, 128, seed=50, temperature=np.full(128, 0.8))
  run = lambda base, anchor, head, t: jm.sample_draft(
      base, anchor, head, t, seeds, pos, config=_mosaic(), check_values=False)
  a = run(base, anchor, head, t)
  # seeds (int64, all 64 bits) stay outside the jit: traced they would be
  # cut to int32 words.
  b = jax.jit(run)(base, anchor, head, t)
  c = run(base, anchor, head, t)
  for x in (b, c):
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(x.tokens))
    np.testing.assert_array_equal(np.asarray(a.logits), np.asarray(x.logits))


def test_refuses_what_it_does_not_run():
  # A partial last request tile needs B >= 64 and a multiple of 4 (change
  # 50; B = 96 on 64-request tiles runs): B = 66 and 32 do not.
  for batch in (66, 32):
    with pytest.raises(ValueError, match="multiple of block_b"):
      jm.sample_draft(*make_problem(batch, 2, 1024, 64, seed=51),
                      config=_mosaic(64, 64))
  with pytest.raises(ValueError, match="bfloat16"):
    jm.sample_draft(*make_problem(64, 2, 1024, 64, jnp.float32, seed=51),
                    config=_mosaic(64, 64))
  with pytest.raises(ValueError, match="greedy_draft"):
    jm.greedy_draft(*make_problem(64, 2, 1024, 64, seed=51)[:3],
                    config=_mosaic(64, 64))


def _check_into(tokens, cache, before, idx_map, base, anchor, head,
                temperature, seeds, pos):
  """sample_draft_into's result: rows no draw names as before, the draws
  the contract's (check_draft). Returns the untouched [N, S] mask."""
  N, S = before.shape[:2]
  valid = idx_map >= 0
  out = np.asarray(cache)
  untouched = np.ones((N, S), bool)
  untouched[idx_map[valid], np.nonzero(valid)[1]] = False
  np.testing.assert_array_equal(out[untouched], before[untouched])
  rows = np.where(valid, idx_map, 0)
  u = np.asarray(jm.draft_uniforms(seeds[rows].reshape(-1),
                                   np.asarray(pos).reshape(-1, 1))).reshape(rows.shape)
  check_draft(tokens, out[rows, np.arange(S)[None, :]], base, anchor, head,
              np.asarray(temperature)[rows], u, rows=valid)
  return untouched


@pytest.mark.parametrize("B,N,block_b,rows", [
    (256, 300, 128, "random"), (64, 80, 64, "random"),
    (256, 320, 128, "runs"), (64, 96, 64, "runs")])
def test_into_state_rows(B, N, block_b, rows):
  """sample_draft_into: each draw's row of the [N, S, V] cache, padding rows
  written nowhere, every other row untouched, the draft the reference's
  within rounding (check_draft); one TMA store a row. "random": distinct
  random state rows; "runs": the first requests hold consecutive state rows
  from 16 on, a run broken by a padded draw, the rest random."""
  S, V, R = 4, 8192, 128
  base, anchor, head, _, _, pos = make_problem(B, S, V, R, seed=52,
                                               head_scale=0.2)
  rng = np.random.default_rng(52)
  if rows == "random":
    state = rng.permutation(N)[:B]
  else:
    run = B if B == 64 else 3 * B // 4
    rest = np.setdiff1d(np.arange(N), np.arange(16, 16 + run))
    state = np.concatenate([np.arange(16, 16 + run),
                            rng.permutation(rest)[:B - run]])
  idx_map = np.repeat(state[:, None], S, axis=1).astype(np.int32)
  if rows == "random" or B > 64:
    idx_map[3] = -1  # a padded request (at B = 64 "runs": slots 16-79 whole)
  idx_map[B - 1, 2] = -1  # a padded draw
  temperature = jnp.asarray(rng.choice([0.0, 0.7, 1.0], N), jnp.float32)
  seeds = rng.integers(0, 2**62, N, dtype=np.int64)
  cache0 = jnp.asarray(rng.standard_normal((N, S, V)), jnp.float32)
  before = np.asarray(cache0)
  outs = []
  for config in (_mosaic(block_b, 64), FUSED):
    cache = jnp.array(cache0)
    outs.append(jm.sample_draft_into(cache, base, anchor, head, temperature,
                                     seeds, jnp.asarray(idx_map), pos,
                                     config=config))
  (tokens, cache), (tokens_f, cache_f) = outs
  untouched = _check_into(tokens, cache, before, idx_map, base, anchor, head,
                          temperature, seeds, pos)
  # Padding writes nothing in either kernel.
  np.testing.assert_array_equal(np.asarray(cache_f)[untouched],
                                before[untouched])


def test_repeated_drafts_are_bit_identical_at_b256():
  """Three drafts from the same inputs at the DeepSeek-V4 shape, B = 256,
  dense and into random state rows: the same tokens and cache bit for bit.
  (A cache stored from registers instead of TMA failed this: a few rows a
  draft differed between runs; docs/perf-notes.md change 35.)"""
  B, S, V, R, N = 256, DSV4["S"], DSV4["V"], DSV4["R"], 256
  base, anchor, head, _, _, pos = make_problem(B, S, V, R, jnp.bfloat16,
                                               seed=54, head_scale=0.1)
  rng = np.random.default_rng(54)
  idx_map = jnp.asarray(np.repeat(rng.permutation(N)[:B, None], S, axis=1),
                        jnp.int32)
  temperature = jnp.asarray(rng.choice([0.0, 0.7, 1.0], N), jnp.float32)
  seeds = rng.integers(0, 2**62, N, dtype=np.int64)
  cache0 = jnp.zeros((N, S, V), jnp.float32)
  into, dense = [], []
  for _ in range(3):
    tokens, cache = jm.sample_draft_into(
        jnp.array(cache0), base, anchor, head, temperature, seeds, idx_map,
        pos, config=_mosaic())
    into.append((np.asarray(tokens), np.asarray(cache)))
    draft = jm.sample_draft(base, anchor, head, temperature[:B], seeds[:B],
                            pos, config=_mosaic())
    dense.append((np.asarray(draft.tokens), np.asarray(draft.logits)))
  for runs in (into, dense):
    for tokens, cache in runs[1:]:
      np.testing.assert_array_equal(tokens, runs[0][0])
      np.testing.assert_array_equal(cache, runs[0][1])


@pytest.mark.parametrize("B,block_b,block_v", [(256, 128, 64), (256, 128, 128),
                                               (64, 64, 128)])
def test_row_stores_agree_bit_for_bit(B, block_b, block_v):
  """The kernel alone at the DeepSeek-V4 shape into random state rows with
  padding: row_stores="warp" (one warp store a row through shared memory)
  writes the same cache and statistics as "tma" (one TMA a row) bit for bit,
  run after run, and leaves every other row as it was."""
  S, V, R = DSV4["S"], DSV4["V"], DSV4["R"]
  N = B + 9
  rng = np.random.default_rng(55 + B + block_v)
  bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  base, emb, proj = bf16(B * S, V), bf16(B, R), bf16(V, R) * 0.1
  params = jnp.stack([jnp.asarray(rng.choice([1.0, 1 / 0.7], B * S),
                                  jnp.float32),
                      jnp.zeros(B * S), jnp.full(B * S, 0.5)])
  rows = (rng.permutation(N)[:B, None] * S + np.arange(S)).astype(np.int32)
  rows[5] = -1
  rows[B - 2, 3] = -1
  rows = jnp.asarray(rows.reshape(-1))
  cache0 = jnp.asarray(rng.standard_normal((N * S, V)), jnp.float32)
  before = np.asarray(cache0)
  for s in (0, 4):
    step = jnp.array([s], jnp.int32)
    outs = [[np.asarray(a) for a in mbp.mosaic_block_pass(
        base, emb, proj, params, step, jnp.array(cache0), rows, num_steps=S,
        num_cache_rows=N * S, block_b=block_b, block_v=block_v,
        row_stores=stores)] for stores in ("tma", "warp", "warp")]
    for out in outs[1:]:
      for a, b in zip(outs[0], out):
        np.testing.assert_array_equal(a, b)
    written = np.asarray(rows).reshape(B, S)[:, s]
    written = written[written >= 0]
    assert written.size == B - 1
    untouched = np.setdiff1d(np.arange(N * S), written)
    np.testing.assert_array_equal(outs[1][0][untouched], before[untouched])
    assert not np.array_equal(outs[1][0][written], before[written])


@pytest.mark.parametrize("B,block_b,block_v,rows", [
    (256, 128, 64, True), (64, 64, 64, True), (64, 64, 128, True),
    (136, 64, 64, True), (136, 64, 64, False), (200, 128, 64, True)])
def test_store_warpgroup_agrees_bit_for_bit(B, block_b, block_v, rows):
  """store_warpgroup (a fourth warpgroup stores the consumers' staged cache
  rows) writes the cache and statistics the consumers' own warp row stores
  do, bit for bit, run after run, at the DeepSeek-V4 shape: into random
  state rows with padding (every other row untouched), and, with a partial
  last tile (B = 136, 200), into the dense cache too."""
  S, V, R = DSV4["S"], DSV4["V"], DSV4["R"]
  N = B + 5 if rows else B
  rng = np.random.default_rng(91 + B + block_v)
  bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  base, emb, proj = bf16(B * S, V), bf16(B, R), bf16(V, R) * 0.1
  params = jnp.stack([jnp.asarray(rng.choice([1.0, 1 / 0.7], B * S),
                                  jnp.float32),
                      jnp.zeros(B * S), jnp.full(B * S, 0.5)])
  cache_rows = None
  if rows:
    r = (rng.permutation(N)[:B, None] * S + np.arange(S)).astype(np.int32)
    r[3] = -1
    r[B - 1, 5] = -1  # a padded draw in the last (possibly partial) tile
    cache_rows = jnp.asarray(r.reshape(-1))
  cache0 = jnp.asarray(rng.standard_normal((N * S, V)), jnp.float32)
  before = np.asarray(cache0)
  p = mbp.plan((B * S, V), (B, R), (V, R), num_steps=S, block_b=block_b,
               block_v=block_v, max_concurrent_steps=None, num_sms=None,
               row_stores="warp", state_rows=rows, store_warpgroup=True)
  assert p.store_wg and p.num_wgs == 4
  for s in (0, 5):
    step = jnp.array([s], jnp.int32)
    outs = [[np.asarray(a) for a in mbp.mosaic_block_pass(
        base, emb, proj, params, step, jnp.array(cache0), cache_rows,
        num_steps=S, num_cache_rows=N * S, block_b=block_b, block_v=block_v,
        store_warpgroup=on)] for on in (False, True, True)]
    for out in outs[1:]:
      for a, b in zip(outs[0], out):
        np.testing.assert_array_equal(a, b)
    written = (np.asarray(cache_rows).reshape(B, S)[:, s] if rows
               else np.arange(B) * S + s)
    written = written[written >= 0]
    untouched = np.setdiff1d(np.arange(N * S), written)
    np.testing.assert_array_equal(outs[2][0][untouched], before[untouched])
    assert not np.array_equal(outs[2][0][written], before[written])


@pytest.mark.parametrize("B,block_b", [(256, 128), (136, 64)])
def test_store_warpgroup_draft_into_state_rows(B, block_b):
  """The sampler's draft into state rows with store_warpgroup: the contract
  (check_draft; padding and every row no draw names untouched), and the
  same tokens and cache as without it, bit for bit."""
  S, V, R = DSV4["S"], DSV4["V"], DSV4["R"]
  N = B + 12
  base, anchor, head, _, _, pos = make_problem(B, S, V, R, jnp.bfloat16,
                                               seed=93 + B, head_scale=0.1)
  rng = np.random.default_rng(93 + B)
  idx_map = np.repeat(rng.permutation(N)[:B, None], S, axis=1).astype(np.int32)
  idx_map[2] = -1
  idx_map[B - 1, 4] = -1
  temperature = jnp.asarray(rng.choice([0.0, 0.7, 1.0], N), jnp.float32)
  seeds = rng.integers(0, 2**62, N, dtype=np.int64)
  cache0 = jnp.asarray(rng.standard_normal((N, S, V)), jnp.float32)
  before = np.asarray(cache0)
  outs = []
  for on in (False, True):
    config = jm.KernelConfig(method="mosaic", block_b=block_b, block_v=64,
                             partial_tiles=B % block_b != 0,
                             select_embed=True, store_warpgroup=on)
    outs.append(jm.sample_draft_into(jnp.array(cache0), base, anchor, head,
                                     temperature, seeds, jnp.asarray(idx_map),
                                     pos, config=config))
  (tokens, cache), (tokens_w, cache_w) = outs
  _check_into(tokens_w, cache_w, before, idx_map, base, anchor, head,
              temperature, seeds, pos)
  np.testing.assert_array_equal(np.asarray(tokens_w), np.asarray(tokens))
  np.testing.assert_array_equal(np.asarray(cache_w), np.asarray(cache))


@pytest.mark.parametrize("B,block_b,block_v", [(256, 128, 64), (128, 64, 64),
                                               (512, 128, 64)])
def test_multicast_agrees_bit_for_bit(B, block_b, block_v):
  """A cluster of the request tiles sharing each proj chunk by TMA multicast
  computes what the CTAs loading their own chunks do, bit for bit, run after
  run (DeepSeek-V4 shape, random state rows with padding)."""
  S, V, R = DSV4["S"], DSV4["V"], DSV4["R"]
  N = B + 3
  rng = np.random.default_rng(77 + B)
  bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  base, emb, proj = bf16(B * S, V), bf16(B, R), bf16(V, R) * 0.1
  params = jnp.stack([jnp.asarray(rng.choice([1.0, 1 / 0.7], B * S),
                                  jnp.float32),
                      jnp.zeros(B * S), jnp.full(B * S, 0.5)])
  rows = (rng.permutation(N)[:B, None] * S + np.arange(S)).astype(np.int32)
  rows[7] = -1
  rows = jnp.asarray(rows.reshape(-1))
  cache0 = jnp.asarray(rng.standard_normal((N * S, V)), jnp.float32)
  step = jnp.array([3], jnp.int32)
  outs = [[np.asarray(a) for a in mbp.mosaic_block_pass(
      base, emb, proj, params, step, jnp.array(cache0), rows, num_steps=S,
      num_cache_rows=N * S, block_b=block_b, block_v=block_v,
      _multicast=multicast)] for multicast in (False, True, True)]
  for out in outs[1:]:
    for a, b in zip(outs[0], out):
      np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("B,block_v,rows", [(256, 64, False), (256, 64, True),
                                            (128, 128, False),
                                            (384, 64, True)])
def test_folded_chunk_statistics(B, block_v, rows):
  """chunk (each CTA a contiguous run of blocks, reduced in its epilogue):
  the cache and the block statistics bit for bit as the strided workers
  write them, and chunk statistics equal to the chunk pass's of the same
  block statistics (max and argmax exactly, sums within float32 rounding
  of another order), with a -inf row, -inf runs, NaN and +inf logits."""
  from jax_markov.kernels.chunk_pass import chunk_pass
  S, V, R = DSV4["S"], DSV4["V"], DSV4["R"]
  N = B + 5
  rng = np.random.default_rng(91 + B)
  base = rng.standard_normal((B * S, V)).astype(np.float32)
  s = 2
  base[0 * S + s] = -np.inf                    # a row with nothing drawable
  base[1 * S + s, :5000] = -np.inf             # -inf chunks, then finite
  base[2 * S + s, 700:900] = np.nan
  base[3 * S + s, 4097] = np.inf
  base[4 * S + s, 128:192] = 30.0              # ties across blocks
  base = jnp.asarray(base, jnp.bfloat16)
  emb = jnp.asarray(rng.standard_normal((B, R)), jnp.bfloat16)
  proj = jnp.asarray(rng.standard_normal((V, R)) * 0.1, jnp.bfloat16)
  params = jnp.stack([jnp.asarray(rng.choice([1.0, 1 / 0.7], B * S),
                                  jnp.float32),
                      jnp.zeros(B * S), jnp.full(B * S, 0.5)])
  step = jnp.array([s], jnp.int32)
  if rows:
    r = (rng.permutation(N)[:B, None] * S + np.arange(S)).astype(np.int32)
    r[6] = -1
    cache_rows, n = jnp.asarray(r.reshape(-1)), N * S
  else:
    cache_rows, n = None, B * S
  cache0 = jnp.asarray(rng.standard_normal((n, V)), jnp.float32)
  chunk = mbp.default_chunk(B, V, block_b=128, block_v=block_v)
  kw = dict(num_steps=S, num_cache_rows=n, block_b=128, block_v=block_v)
  plain = [np.asarray(a) for a in mbp.mosaic_block_pass(
      base, emb, proj, params, step, jnp.array(cache0), cache_rows, **kw)]
  for _ in range(2):
    folded = mbp.mosaic_block_pass(base, emb, proj, params, step,
                                   jnp.array(cache0), cache_rows, chunk=chunk,
                                   **kw)
    assert len(folded) == 7
    for a, b in zip(plain, folded[:4]):
      np.testing.assert_array_equal(a, np.asarray(b))
    want = chunk_pass(*folded[1:4], chunk=chunk)
    nc = -(-(V // block_v) // chunk)
    for got, ref, dtype in zip(folded[4:], want,
                               (jnp.float32, jnp.float32, jnp.int32)):
      assert got.shape == (nc, B) and got.dtype == dtype
    np.testing.assert_array_equal(np.asarray(folded[4]), np.asarray(want[0]))
    np.testing.assert_array_equal(np.asarray(folded[6]), np.asarray(want[2]))
    np.testing.assert_allclose(np.asarray(folded[5]), np.asarray(want[1]),
                               rtol=2e-6 * chunk)
  # The edge rows came through: nothing drawable, +inf.
  assert np.all(np.asarray(folded[4])[:, 0] == -np.inf)
  assert np.all(np.asarray(folded[5])[:, 0] == 0)
  assert np.asarray(folded[4])[:, 3].max() == np.inf


def test_folded_and_unfolded_drafts_agree_at_b256():
  """The sampler with the fold (the default) and with the chunk pass: the
  same cache bit for bit, tokens that agree as draws of the same logits
  (the chunk sums associate differently), both within the contract."""
  B = 256
  args = make_problem(B, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16,
                      seed=93, head_scale=0.1,
                      temperature=np.where(np.arange(B) % 5 == 0, 0.0, 0.9))
  folded = jm.sample_draft(*args, config=_mosaic())
  plain = jm.sample_draft(*args, config=jm.KernelConfig(
      method="mosaic", block_b=128, block_v=64, fold_chunks=False))
  check_sample_draft(folded, *args)
  assert_sample_drafts_agree(folded, plain, *args)


@pytest.mark.parametrize("B,block_b", [(256, 128), (192, 64)])
def test_select_embed_draft_is_the_gathered_draft_bit_for_bit(B, block_b):
  """The select pass writing the next step's embeddings (select_embed)
  instead of XLA's gather before each step: the same tokens and cache, bit
  for bit (the same rows reach the same kernels), with the fold (128-request
  tiles) and with the chunk pass (64)."""
  args = make_problem(B, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16,
                      seed=97, head_scale=0.1,
                      temperature=np.where(np.arange(B) % 5 == 0, 0.0, 0.9))
  drafts = [jm.sample_draft(*args, config=jm.KernelConfig(
      method="mosaic", block_b=block_b, block_v=64, select_embed=fetch))
            for fetch in (False, True)]
  np.testing.assert_array_equal(np.asarray(drafts[1].tokens),
                                np.asarray(drafts[0].tokens))
  np.testing.assert_array_equal(np.asarray(drafts[1].logits),
                                np.asarray(drafts[0].logits))
  check_sample_draft(drafts[1], *args)


@pytest.mark.parametrize("B,block_b,fold", [(72, 128, True), (72, 64, True),
                                            (136, 128, True),
                                            (136, 128, False),
                                            (200, 64, True)])
def test_partial_last_request_tile(B, block_b, fold):
  """A batch the request tiles do not divide (partial_tiles): the last
  tile's consumers take 64-row windows ending at row B. The dense draft
  against the reference and the fused Triton pass; into state rows, padding
  and every row no draw names untouched."""
  S, V, R, N = 4, 8192, 128, B + 40
  args = make_problem(B, S, V, R, seed=60 + B, head_scale=0.2,
                      temperature=np.where(np.arange(B) % 4 == 0, 0.0, 1.0))
  config = jm.KernelConfig(method="mosaic", block_b=block_b, block_v=64,
                           fold_chunks=fold, partial_tiles=True)
  draft = jm.sample_draft(*args, config=config)
  check_sample_draft(draft, *args)
  assert_sample_drafts_agree(draft, jm.sample_draft(*args, config=FUSED),
                             *args)
  base, anchor, head, _, _, pos = args
  rng = np.random.default_rng(B)
  idx_map = np.repeat(rng.permutation(N)[:B, None], S, axis=1).astype(np.int32)
  idx_map[B - 1] = -1  # the last request of the partial tile: padding
  idx_map[B - 3, 1] = -1
  temperature = jnp.asarray(rng.choice([0.0, 1.0], N), jnp.float32)
  seeds = rng.integers(0, 2**62, N, dtype=np.int64)
  cache0 = jnp.asarray(rng.standard_normal((N, S, V)), jnp.float32)
  before = np.asarray(cache0)
  tokens, cache = jm.sample_draft_into(jnp.array(cache0), base, anchor, head,
                                       temperature, seeds,
                                       jnp.asarray(idx_map), pos,
                                       config=config)
  _check_into(tokens, cache, before, idx_map, base, anchor, head, temperature,
              seeds, pos)


def test_partial_last_request_tile_at_deepseek_v4_shape():
  """B = 72 on one 128-request tile (its second consumer's window is rows
  8-71, of which it stores 64-71): the contract at the DeepSeek-V4 shape."""
  B = 72
  args = make_problem(B, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16,
                      seed=71, head_scale=0.1,
                      temperature=np.where(np.arange(B) % 4 == 0, 0.0, 1.0))
  draft = jm.sample_draft(*args, config=jm.KernelConfig(
      method="mosaic", block_b=128, block_v=64, num_stages=4,
      partial_tiles=True))
  check_sample_draft(draft, *args)
  assert_sample_drafts_agree(draft, jm.sample_draft(*args, config=FUSED),
                             *args)


@pytest.mark.parametrize("B,rows,fold", [
    (192, False, False), (192, True, True), (136, False, True),
    (136, True, True), (160, True, False), (384, True, True),
    (256, False, False)])
def test_three_consumers_agree_with_two_bit_for_bit(B, rows, fold):
  """block_b = 192 (three consumer warpgroups at 152 registers, the 68-word
  staging pitch where rows are stored by warp) at the DeepSeek-V4 shape:
  each 64-row window is the same WGMMA over the same proj chunks as in
  128-request tiles, so the cache and the block statistics are those of
  block_b = 128 bit for bit (full tiles, a partial one at 136 / 160 / 256,
  two tiles at 384; dense and into state rows with padding, every other row
  untouched), run after run; with chunk, the chunk statistics are the
  chunk pass's of those block statistics."""
  from jax_markov.kernels.chunk_pass import chunk_pass
  S, V, R = DSV4["S"], DSV4["V"], DSV4["R"]
  N = B + 7 if rows else B
  rng = np.random.default_rng(193 + B)
  bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  base, emb, proj = bf16(B * S, V), bf16(B, R), bf16(V, R) * 0.1
  params = jnp.stack([jnp.asarray(rng.choice([1.0, 1 / 0.7], B * S),
                                  jnp.float32),
                      jnp.zeros(B * S), jnp.full(B * S, 0.5)])
  cache_rows = None
  if rows:
    r = (rng.permutation(N)[:B, None] * S + np.arange(S)).astype(np.int32)
    r[2] = -1
    r[B - 1, 4] = -1  # a padded draw in the last tile
    cache_rows = jnp.asarray(r.reshape(-1))
  cache0 = jnp.asarray(rng.standard_normal((N * S, V)), jnp.float32)
  before = np.asarray(cache0)
  p = mbp.plan((B * S, V), (B, R), (V, R), num_steps=S, block_b=192,
               block_v=64, max_concurrent_steps=None, num_sms=None,
               row_stores="warp", state_rows=rows)
  assert p.consumers == 3 and p.consumer_registers <= 152
  assert p.stages >= 2 and p.smem_bytes <= mbp.SMEM_LIMIT
  chunk = mbp.default_chunk(B, V, block_b=192, block_v=64) if fold else None
  for s in (0, 6):
    step = jnp.array([s], jnp.int32)
    kw = dict(num_steps=S, num_cache_rows=N * S, block_v=64)
    two = [np.asarray(a) for a in mbp.mosaic_block_pass(
        base, emb, proj, params, step, jnp.array(cache0), cache_rows,
        block_b=128, **kw)]
    for _ in range(2):
      three = mbp.mosaic_block_pass(
          base, emb, proj, params, step, jnp.array(cache0), cache_rows,
          block_b=192, chunk=chunk, **kw)
      assert len(three) == (7 if fold else 4)
      for a, b in zip(two, three[:4]):
        np.testing.assert_array_equal(a, np.asarray(b))
    if fold:
      want = chunk_pass(*three[1:4], chunk=chunk)
      np.testing.assert_array_equal(np.asarray(three[4]), np.asarray(want[0]))
      np.testing.assert_array_equal(np.asarray(three[6]), np.asarray(want[2]))
      np.testing.assert_allclose(np.asarray(three[5]), np.asarray(want[1]),
                                 rtol=2e-6 * chunk)
    written = (np.asarray(cache_rows).reshape(B, S)[:, s] if rows
               else np.arange(B) * S + s)
    written = written[written >= 0]
    untouched = np.setdiff1d(np.arange(N * S), written)
    cache = np.asarray(three[0])
    np.testing.assert_array_equal(cache[untouched], before[untouched])
    assert not np.array_equal(cache[written], before[written])


@pytest.mark.parametrize("B", [192, 136])
def test_three_consumer_draft(B):
  """The sampler's draft on 192-request tiles (the fold, select_embed): the
  contract at the DeepSeek-V4 shape, and the fused Triton pass's draft
  within float32 rounding."""
  args = make_problem(B, DSV4["S"], DSV4["V"], DSV4["R"], jnp.bfloat16,
                      seed=190 + B, head_scale=0.1,
                      temperature=np.where(np.arange(B) % 4 == 0, 0.0, 1.0))
  config = jm.KernelConfig(method="mosaic", block_b=192, block_v=64,
                           select_embed=True, partial_tiles=B % 192 != 0)
  draft = jm.sample_draft(*args, config=config)
  check_sample_draft(draft, *args)
  assert_sample_drafts_agree(draft, jm.sample_draft(*args, config=FUSED),
                             *args)


@pytest.mark.parametrize("B,block_b,rows,fold,store_wg", [
    (256, 128, True, True, False),    # the table's B = 256 entry
    (256, 128, False, False, False),  # dense, strided workers
    (192, 64, True, False, False),    # the rule's 64-request tiles
    (136, 64, True, False, True),     # a partial tile, a store warpgroup
    (72, 128, False, True, False),    # one partial 128-request tile
])
def test_dependent_launch_kernel_is_the_plain_kernel_bit_for_bit(
    B, block_b, rows, fold, store_wg):
  """Built for a dependent launch (the producer loads the first tile's base
  and proj chunks before griddepcontrol.wait, the loop skips them at tile
  0) and launched plainly by XLA, where the wait returns at once, the
  kernel writes what the plain kernel writes, bit for bit: cache, block
  and chunk statistics (docs/perf-notes.md change 62)."""
  S, V, R = DSV4["S"], DSV4["V"], DSV4["R"]
  N = B + 5 if rows else B
  rng = np.random.default_rng(62 + B)
  bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  base, emb, proj = bf16(B * S, V), bf16(B, R), bf16(V, R) * 0.1
  params = jnp.stack([jnp.full(B * S, 1 / 0.7, jnp.float32),
                      jnp.zeros(B * S), jnp.full(B * S, 0.5)])
  cache_rows = None
  if rows:
    r = (rng.permutation(N)[:B, None] * S + np.arange(S)).astype(np.int32)
    r[1] = -1
    cache_rows = jnp.asarray(r.reshape(-1))
  cache0 = jnp.asarray(rng.standard_normal((N * S, V)), jnp.float32)
  chunk = (mbp.default_chunk(B, V, block_b=block_b, block_v=64) if fold
           else None)
  for s in (0, 5):
    step = jnp.array([s], jnp.int32)
    kw = dict(num_steps=S, num_cache_rows=N * S, block_b=block_b,
              block_v=64, chunk=chunk, store_warpgroup=store_wg)
    plain, early = ([np.asarray(a) for a in mbp.mosaic_block_pass(
        base, emb, proj, params, step, jnp.array(cache0), cache_rows,
        dependent_launch=dependent, **kw)] for dependent in (False, True))
    assert len(plain) == (7 if fold else 4)
    for a, b in zip(plain, early):
      np.testing.assert_array_equal(a, b)
