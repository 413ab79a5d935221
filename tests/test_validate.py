"""Bad input raises a clear error before anything compiles."""

import functools
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov as jm
from helpers import make_problem

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def args():
  return make_problem(3, 2, 50, 4, seed=30)


def _call(args, **over):
  names = ["base", "anchor", "head", "temperature", "seeds", "positions"]
  kw = dict(zip(names, args))
  kw.update(over)
  return jm.sample_draft(*[kw[n] for n in names])


@pytest.mark.parametrize("over,exc,match", [
    (dict(base=jnp.zeros((3, 50))), ValueError, r"base_logits must be \[B, S, V\]"),
    (dict(base=jnp.zeros((3, 2, 50), jnp.int32)), TypeError, "base_logits must be bf16"),
    (dict(anchor=jnp.zeros((4,), jnp.int32)), ValueError, r"anchor_tokens must be \[B\]"),
    (dict(anchor=jnp.zeros((3,), jnp.float32)), TypeError, "anchor_tokens must be integers"),
    (dict(anchor=jnp.array([0, 50, 1])), ValueError, "outside the embedding table"),
    (dict(anchor=np.array([-1, 0, 1])), ValueError, "outside the embedding table"),
    (dict(temperature=jnp.array([1.0, -0.5, 0.0])), ValueError, "temperature must be >= 0"),
    (dict(temperature=jnp.array([1.0, np.nan, 0.0])), ValueError, "NaN"),
    (dict(temperature=jnp.ones((2,))), ValueError, r"temperature must be \[B\]"),
    (dict(seeds=np.arange(4)), ValueError, "seeds must be"),
    (dict(seeds=np.array([1.0, 2.0, 3.0])), TypeError, "seeds must be integers"),
    (dict(positions=jnp.zeros((3, 3), jnp.int32)), ValueError, r"positions must be \[B, S\]"),
    (dict(positions=jnp.zeros((3, 2), jnp.float32)), TypeError, "positions must be integers"),
    (dict(positions=-jnp.ones((3, 2), jnp.int32)), ValueError, r"positions must be in \[0, 2\*\*31\)"),
])
def test_bad_arguments(args, over, exc, match):
  with pytest.raises(exc, match=match):
    _call(args, **over)


@pytest.mark.parametrize("embed_shape,proj_shape,match", [
    ((50, 4), (49, 4), "V disagrees"),
    ((50, 4), (50, 5), "rank R disagrees"),
    ((40, 4), (50, 4), "V_in must be >= V"),
    ((50,), (50, 4), r"head.embed must be \[V_in, R\]"),
])
def test_bad_head(args, embed_shape, proj_shape, match):
  head = jm.MarkovHead(jnp.zeros(embed_shape, jnp.bfloat16), jnp.zeros(proj_shape, jnp.bfloat16))
  with pytest.raises(ValueError, match=match):
    _call(args, head=head)


def test_head_dtypes(args):
  head = jm.MarkovHead(jnp.zeros((50, 4), jnp.float32), jnp.zeros((50, 4), jnp.bfloat16))
  with pytest.raises(TypeError, match="share a dtype"):
    _call(args, head=head)


def test_bad_method_and_config(args):
  with pytest.raises(ValueError, match="method must be one of"):
    jm.sample_draft(*args, method="gumbel")
  fused = functools.partial(jm.KernelConfig, method="fused")
  xla_bias = functools.partial(jm.KernelConfig, method="xla_bias", block_b=1)
  with pytest.raises(ValueError, match="method must be one of"):
    jm.KernelConfig(method="reference")  # the jnp spec is jm.reference
  with pytest.raises(TypeError):
    jm.KernelConfig("fused", 16, 128)  # keyword-only: a config names fields
  with pytest.raises(ValueError, match="power of two"):
    fused(block_b=16, block_v=100)
  with pytest.raises(ValueError, match=">= 16"):
    fused(block_b=4, block_v=128)
  with pytest.raises(ValueError, match="bias_dot must be"):
    fused(block_b=16, block_v=128, bias_dot="wmma")
  with pytest.raises(ValueError, match="k_loop must be"):
    fused(block_b=16, block_v=128, k_loop="while")
  # On the CUDA cores any power-of-two request tile and rank chunk will do.
  assert fused(block_b=4, block_v=128, block_k=8, bias_dot="fma").block_b == 4
  with pytest.raises(ValueError, match="select must be"):
    fused(block_b=1, block_v=128, bias_dot="fma", select="gumbel")
  # The tail select draws for one request a program (fused only).
  with pytest.raises(ValueError, match="block_b=1"):
    fused(block_b=4, block_v=128, block_k=8, bias_dot="fma", select="tail")
  with pytest.raises(ValueError, match="fused"):
    xla_bias(block_v=128, select="tail")
  with pytest.raises(ValueError, match="proj_l2_rows must be >= 0"):
    fused(block_b=16, block_v=128, proj_l2_rows=-1)
  # Eviction hints without kept rows: the fused pass step by step, not
  # beside proj_l2_rows (its own hints).
  assert fused(block_b=64, block_v=128, l2_hints="proj").l2_hints == "proj"
  with pytest.raises(ValueError, match="l2_hints must be one of"):
    fused(block_b=64, block_v=128, l2_hints="evict_first")
  for bad in (dict(proj_l2_rows=128), dict(select="persistent")):
    with pytest.raises(ValueError, match="l2_hints needs the fused method"):
      fused(block_b=16, block_v=128, l2_hints="stream", **bad)
  with pytest.raises(ValueError, match="l2_hints needs the fused method"):
    xla_bias(block_v=128, l2_hints="stream")
  # The select writing the next embeddings: the Mosaic pass's only.
  assert jm.KernelConfig(method="mosaic", block_b=128, block_v=64,
                         select_embed=True).select_embed
  with pytest.raises(ValueError, match="select_embed is for method='mosaic'"):
    fused(block_b=16, block_v=128, select_embed=True)
  # proj chunks before the wait: step by step, with or without the L2
  # hints.
  assert fused(block_b=16, block_v=128, early_proj=2).early_proj == 2
  assert fused(block_b=1, block_v=128, bias_dot="fma", select="tail",
               early_proj=2, proj_l2_rows=128).early_proj == 2
  for bad in (dict(early_proj=-1), dict(early_proj=1, select="persistent")):
    with pytest.raises(ValueError, match="early_proj must be >= 0"):
      fused(block_b=16, block_v=128, **bad)
  with pytest.raises(ValueError, match="early_proj must be >= 0"):
    xla_bias(block_v=128, early_proj=1)
  # proj chunks prefetched into L2 before the wait: the same, and not with
  # early_proj (which loads them into registers).
  assert fused(block_b=64, block_v=128, prefetch_proj=1,
               prefetch_programs=396).prefetch_programs == 396
  for bad in (dict(prefetch_proj=-1), dict(prefetch_proj=1, proj_l2_rows=128),
              dict(prefetch_proj=1, select="persistent"),
              dict(prefetch_proj=1, early_proj=1)):
    with pytest.raises(ValueError, match="prefetch_proj must be >= 0"):
      fused(block_b=16, block_v=128, **bad)
  with pytest.raises(ValueError, match="prefetch_proj must be >= 0"):
    xla_bias(block_v=128, prefetch_proj=1)
  for bad in (dict(prefetch_programs=-1, prefetch_proj=1),
              dict(prefetch_programs=396)):
    with pytest.raises(ValueError, match="prefetch_programs must be >= 0"):
      fused(block_b=16, block_v=128, **bad)
  # The select pass signalling the next block pass before its wait: the
  # select pass's option (either method), not the tail select's.
  assert xla_bias(block_v=128, early_dependents=True).early_dependents
  with pytest.raises(ValueError, match="early_dependents is for the select"):
    fused(block_b=1, block_v=128, block_k=64, bias_dot="fma", select="tail",
          early_dependents=True)
  with pytest.raises(ValueError, match="needs the fused method"):
    xla_bias(block_v=128, proj_l2_rows=1024)
  # The persistent draft: the fused bias (any request tile, either dot), no
  # cache hints; held_blocks is its own.
  fields = dict(block_b=1, block_v=128, bias_dot="fma", select="persistent")
  with pytest.raises(ValueError, match="select='persistent' needs"):
    fused(**fields, proj_l2_rows=128)
  with pytest.raises(ValueError, match="select='persistent' needs"):
    xla_bias(block_v=128, bias_dot="fma", select="persistent")
  fused(block_b=16, block_v=128, bias_dot="mma", select="persistent",
        held_blocks=2)
  fused(**{**fields, "block_b": 4}, held_blocks=1)
  with pytest.raises(ValueError, match="held_blocks must be >= 0"):
    fused(**fields, held_blocks=-1)
  with pytest.raises(ValueError, match="held_blocks must be >= 0"):
    fused(block_b=1, block_v=128, bias_dot="fma", select="tail",
          held_blocks=1)
  with pytest.raises(ValueError, match="programs must be >= 0"):
    fused(block_b=1, block_v=128, bias_dot="fma", programs=4)
  with pytest.raises(ValueError, match="programs must be >= 0"):
    fused(block_b=1, block_v=128, bias_dot="fma", select="persistent",
          programs=-1)

def test_persistent_draft_refuses_programs_that_could_wait_forever(args):
  """The barriers need every program resident: more than one in the
  interpreter (programs run in turn), or more than the multiprocessors,
  would wait forever, so they are refused before anything runs."""
  from jax_markov.kernels.draft_pass import check_programs
  config = jm.KernelConfig(method="fused", block_b=1, block_v=64, block_k=16,
                           bias_dot="fma", select="persistent", programs=2)
  with pytest.raises(ValueError, match="needs programs=1"):
    jm.sample_draft(*args, config=config, interpret=True)
  with pytest.raises(ValueError, match="multiprocessors"):
    check_programs(133, interpret=False, num_sms=132)
  with pytest.raises(ValueError, match="multiprocessors"):
    check_programs(2, interpret=False, num_sms=None)
  with pytest.raises(ValueError, match="programs must be >= 1"):
    check_programs(0, interpret=False, num_sms=132)
  check_programs(132, interpret=False, num_sms=132)  # one a multiprocessor
  check_programs(1, interpret=False, num_sms=None)  # it waits for itself


def test_block_pass_checks_its_operands():
  """A direct block_pass call (a native runtime's entry) is refused operands
  its configuration does not take: the method's form of the bias, the
  persistent draft, and the tail select's counters."""
  from jax_markov.kernels.block_pass import block_pass
  base = jnp.zeros((2, 64), jnp.float32)
  head = (jnp.zeros((64, 16)), jnp.zeros((64, 16)), jnp.zeros((2,), jnp.int32))
  bias = jnp.zeros((2, 64), jnp.float32)
  step, params = jnp.zeros((1,), jnp.int32), jnp.ones((3, 2), jnp.float32)
  kw = dict(num_steps=1, num_cache_rows=2, interpret=True)
  fused = jm.KernelConfig(method="fused", block_b=16, block_v=32, block_k=16)
  xla_bias = jm.KernelConfig(method="xla_bias", block_b=1, block_v=32)
  with pytest.raises(ValueError, match="bias_or_head=\\(embed, proj"):
    block_pass(base, bias, step, params, config=fused, **kw)
  with pytest.raises(ValueError, match="bias_or_head=bias"):
    block_pass(base, head, step, params, config=xla_bias, **kw)
  with pytest.raises(ValueError, match="no tokens"):
    block_pass(base, bias, step, params, None, None,
               jnp.zeros((2,), jnp.int32), config=xla_bias, **kw)
  with pytest.raises(ValueError, match="runs the whole draft"):
    block_pass(base, head, step, params, config=jm.KernelConfig(
        method="fused", block_b=1, block_v=32, block_k=16, bias_dot="fma",
        select="persistent"), **kw)
  with pytest.raises(ValueError, match="counters"):
    block_pass(base, head, step, params, counters=jnp.zeros((1,), jnp.int32),
               config=fused, **kw)


def test_block_pass_and_select_pass_check_their_maps():
  """The two reduced-vocabulary maps go with their modes: slots (int32 [V
  target], one per cache column) with a cache, columns (draft columns) only
  without one; a mismatch is a clear error, never a silent wrong draw."""
  from jax_markov.kernels.block_pass import block_pass
  from jax_markov.kernels.select_pass import select_pass
  vd, v = 40, 64
  base = jnp.zeros((2, vd), jnp.float32)
  head = (jnp.zeros((v, 16)), jnp.zeros((vd, 16)), jnp.zeros((2,), jnp.int32))
  step, params = jnp.zeros((1,), jnp.int32), jnp.ones((3, 2), jnp.float32)
  kw = dict(config=jm.KernelConfig(method="fused", block_b=16, block_v=32,
                                   block_k=16),
            num_steps=1, num_cache_rows=2, interpret=True)
  slots = jnp.full((v,), -1, jnp.int32).at[:vd].set(jnp.arange(vd))
  columns = jnp.arange(vd, dtype=jnp.int32)
  with pytest.raises(ValueError, match="greedy drafting"):
    block_pass(base, head, step, params, columns=columns, **kw)
  with pytest.raises(ValueError, match="slots is for sampling"):
    block_pass(base, head, step, None, slots=slots, no_cache=True, **kw)
  with pytest.raises(ValueError, match="slots must be int32"):
    block_pass(base, head, step, params, slots=slots.astype(jnp.int16), **kw)
  with pytest.raises(ValueError, match="one entry per cache column"):
    block_pass(base, head, step, params, slots=slots,
               cache=jnp.zeros((2, 48), jnp.float32), **kw)
  cache, bmax, bsum, barg = block_pass(base, head, step, params, slots=slots,
                                       **kw)
  chex.assert_shape(cache, (2, v))
  chex.assert_shape((bmax, bsum, barg), (2, 2))
  # Target columns past the draft vocabulary (slot -1) are -inf; a block with
  # no mapped column names no argmax.
  assert (np.asarray(cache)[:, vd:] == -np.inf).all()
  np.testing.assert_array_equal(np.asarray(barg)[:, 1], [0 + 32, 0 + 32])
  with pytest.raises(ValueError, match="greedy drafting"):
    select_pass(bmax, bsum, barg, cache, step, params, config=kw["config"],
                num_steps=1, columns=columns, interpret=True)
  # Target block 0 (columns 0-31) maps nothing, block 1 twenty draft columns.
  empty = jnp.full((v,), -1, jnp.int32).at[32:52].set(jnp.arange(20))
  _, bmax, _, barg = block_pass(base, head, step, params, slots=empty, **kw)
  np.testing.assert_array_equal(np.asarray(barg)[:, 0], [-1, -1])
  assert (np.asarray(bmax)[:, 0] == -np.inf).all()


def test_block_pass_tail_needs_counters():
  from jax_markov.kernels.block_pass import block_pass
  base = jnp.zeros((2, 64), jnp.float32)
  head = (jnp.zeros((64, 16)), jnp.zeros((64, 16)), jnp.zeros((2,), jnp.int32))
  params = jnp.ones((3, 2), jnp.float32)
  step = jnp.zeros((1,), jnp.int32)
  config = jm.KernelConfig(method="fused", block_b=1, block_v=32, block_k=16,
                           bias_dot="fma", select="tail")
  kw = dict(config=config, num_steps=1, num_cache_rows=2, interpret=True)
  with pytest.raises(ValueError, match="counters int32 \\[2\\]"):
    block_pass(base, head, step, params, **kw)
  with pytest.raises(ValueError, match="counters int32"):
    block_pass(base, head, step, params, counters=jnp.zeros((3,), jnp.int32),
               **kw)
  out = block_pass(base, head, step, params,
                   counters=jnp.zeros((2,), jnp.int32), **kw)
  tokens, counters = out[4:]
  chex.assert_shape(tokens, (2,))
  np.testing.assert_array_equal(counters, [0, 0])  # left at zero


def test_cached_shape_checks_still_raise(args):
  """The shape checks are cached per signature; a bad call raises every time,
  and a good signature seen before does not excuse a bad one."""
  base, anchor, head, t, seeds, pos = args
  bad_pos = jnp.zeros((base.shape[0], base.shape[1] + 1), jnp.int32)
  for _ in range(2):
    with pytest.raises(ValueError, match=r"positions must be \[B, S\]"):
      _call(args, positions=bad_pos)
  with pytest.raises(TypeError, match="positions must be integers"):
    _call(args, positions=jnp.zeros(pos.shape, jnp.float32))


def test_into_bad_arguments(args):
  base, anchor, head, _, seeds, pos = args
  N = 4
  cache = jnp.zeros((N, 2, 50), jnp.float32)
  t = jnp.ones((N,))
  s = np.arange(N, dtype=np.int64)
  idx = jnp.array([[0, 0], [1, 1], [2, 2]], jnp.int32)
  with pytest.raises(ValueError, match=r"cache must be \[N, S, V\]"):
    jm.sample_draft_into(jnp.zeros((N, 3, 50)), base, anchor, head, t, s, idx, pos)
  with pytest.raises(TypeError, match="cache must be float32"):
    jm.sample_draft_into(cache.astype(jnp.bfloat16), base, anchor, head, t, s, idx, pos)
  with pytest.raises(ValueError, match="idx_map outside"):
    jm.sample_draft_into(cache, base, anchor, head, t, s, idx.at[0, 0].set(N), pos)
  with pytest.raises(ValueError, match="names a state row twice"):
    jm.sample_draft_into(cache, base, anchor, head, t, s, idx.at[1, 0].set(0), pos)
  with pytest.raises(ValueError, match=r"temperature must be \[N\]"):
    jm.sample_draft_into(cache, base, anchor, head, jnp.ones((3,)), s, idx, pos)
  with pytest.raises(ValueError, match="seeds must be"):
    jm.sample_draft_into(cache, base, anchor, head, t, s[:3], idx, pos)
  with pytest.raises(TypeError, match="idx_map must be integers"):
    jm.sample_draft_into(cache, base, anchor, head, t, s, idx.astype(jnp.float32), pos)


def test_inside_jit_out_of_range_anchor_is_safe(args):
  """Inside jit nothing is read: an out-of-range anchor must still give valid tokens."""
  base, anchor, head, t, seeds, pos = args
  words = jm.rng.seed_words(seeds)

  @jax.jit
  def f(anchor):
    return jm.sample_draft(base, anchor, head, t, words, pos).tokens

  tokens = np.asarray(f(jnp.array([10_000, -7, 3], jnp.int32)))
  assert ((tokens >= 0) & (tokens < 50)).all()


# Issue 16: values under jit, positions, seeds, derivatives, donation, types,
# and nothing written by a refused call.

def _words_jit(args):
  base, anchor, head, t, seeds, pos = args
  return base, anchor, head, jm.rng.seed_words(seeds), pos


def test_inside_jit_temperature_not_positive_draws_greedily(args):
  """Under jit a temperature cannot be read, so it cannot be refused: a draw is
  greedy wherever NOT (T > 0) (negative, zero, NaN), never softmax(-x/|T|)."""
  from helpers import check_draft
  base, anchor, head, words, pos = _words_jit(args)
  f = jax.jit(lambda t: jm.sample_draft(base, anchor, head, t, words, pos))
  for t in ([-1.0, -0.5, -1e30], [np.nan, -np.inf, 0.0]):
    draft = f(jnp.asarray(t, jnp.float32))
    chex.assert_type(draft.tokens, jnp.int32)
    u = np.asarray(jm.draft_uniforms(words, pos))
    check_draft(draft.tokens, draft.logits, base, anchor, head, np.zeros(u.shape), u)
    logits = np.asarray(draft.logits)
    np.testing.assert_array_equal(draft.tokens, logits.argmax(-1))


@pytest.mark.parametrize("jit", [False, True])
def test_infinite_temperature_draws_uniformly_over_finite_logits(args, jit):
  """T = +inf: 1 / T = 0 would make -inf logits NaN; it is floored at 2^-126,
  so -inf logits stay undrawable and the draw is the inverse CDF of the
  uniform distribution over the finite ones. A subnormal T (1 / T = inf) draws
  the argmax."""
  from helpers import check_draft
  base, anchor, head, words, pos = _words_jit(args)
  B, S, V = base.shape
  allowed = np.zeros(V, bool)
  allowed[[2, 3, 20, 47]] = True
  base = jnp.where(jnp.asarray(allowed), base, -jnp.inf)
  t = jnp.array([np.inf, np.inf, 1e-45], jnp.float32)
  call = lambda t: jm.sample_draft(base, anchor, head, t, words, pos)  # noqa: E731
  draft = jax.jit(call)(t) if jit else call(t)
  tokens = np.asarray(draft.tokens)
  assert allowed[tokens].all(), tokens
  u = np.asarray(jm.draft_uniforms(words, pos))
  check_draft(tokens, draft.logits, base, anchor, head,
              np.broadcast_to(np.asarray(t)[:, None], u.shape), u)
  # Uniform over the 4 finite logits: the k-th of them with k = floor(4 u).
  np.testing.assert_array_equal(tokens[:2], np.flatnonzero(allowed)[(4 * u[:2]).astype(int)])
  np.testing.assert_array_equal(tokens[2], np.asarray(draft.logits)[2].argmax(-1))


@pytest.mark.parametrize("positions", [
    np.full((3, 2), 2**31, np.int64),
    np.array([[0, 1], [2, 3], [2**32 + 4, 5]], np.int64),
    [[0, 1], [2, 3], [4, 2**40]],
    np.array([[0, 1], [2, 3], [-1, 5]], np.int64),
])
def test_positions_beyond_int32_are_refused(args, positions):
  """Positions are non-negative int32: 2^32 + p used to reuse p's uniform."""
  with pytest.raises(ValueError, match=r"positions must be in \[0, 2\*\*31\)"):
    _call(args, positions=positions)
  _, _, _, _, seeds, _ = args
  with pytest.raises(ValueError, match=r"positions must be in \[0, 2\*\*31\)"):
    jm.draft_uniforms(seeds, positions)


def test_positions_beyond_int32_refused_as_jax_int64():
  code = r"""
import sys; sys.path.insert(0, "tests")
import jax; jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp, numpy as np
import jax_markov as jm
from helpers import make_problem
base, anchor, head, t, seeds, pos = make_problem(3, 2, 50, 4, seed=30)
bad = jnp.asarray(pos, jnp.int64).at[1, 1].set(2**32 + 7)
for f in (lambda: jm.sample_draft(base, anchor, head, t, seeds, bad),
          lambda: jm.draft_uniforms(seeds, bad)):
  try:
    f()
  except ValueError as e:
    assert "positions" in str(e), e
  else:
    raise SystemExit("not refused")
print("ok")
"""
  res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=_ROOT)
  assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


def test_largest_position_is_accepted(args):
  base, anchor, head, t, seeds, pos = args
  pos = np.full(pos.shape, 2**31 - 1, np.int64)
  u = jm.draft_uniforms(seeds, pos)
  chex.assert_shape(u, pos.shape)
  _call(args, positions=pos)


def test_seed_forms_of_the_api_doc():
  """docs/api.md: [B] ints (NumPy, Python, JAX 32-bit), or [B, 2] uint32 / int32
  bit patterns already split, NumPy or JAX. A 1-D array is always [B] seeds,
  also when B = 2."""
  seeds = np.array([-1, 2**40 + 3], np.int64)
  pos = np.array([[0, 1], [5, 6]])
  want = np.asarray(jm.draft_uniforms(seeds, pos))
  words = np.asarray(jm.rng.seed_words(seeds))
  chex.assert_shape(words, (2, 2))
  forms = [words, jnp.asarray(words), words.view(np.int32),
           jnp.asarray(words.view(np.int32)), [-1, 2**40 + 3],
           [2**64 - 1, 2**40 + 3], seeds.view(np.uint64)]
  for form in forms:
    np.testing.assert_array_equal(jm.draft_uniforms(form, pos), want)
  # 1-D of length 2: two seeds, not one split seed.
  two = jnp.array([7, 9], jnp.uint32)
  np.testing.assert_array_equal(jm.draft_uniforms(two, pos),
                                jm.draft_uniforms(np.array([7, 9], np.int64), pos))
  # A Python list mixing negative ints and ints >= 2^63: each its own 64 bits.
  np.testing.assert_array_equal(
      jm.draft_uniforms([-1, 2**63], pos),
      jm.draft_uniforms(np.array([-1, -2**63], np.int64), pos))


def test_seed_forms_accepted_by_the_samplers(args):
  base, anchor, head, t, seeds, pos = args
  words = np.asarray(jm.rng.seed_words(seeds))
  want = _call(args)
  for form in (words, jnp.asarray(words.view(np.int32)), [int(s) for s in seeds]):
    np.testing.assert_array_equal(_call(args, seeds=form).tokens, want.tokens)


@pytest.mark.parametrize("seeds,exc,match", [
    ([2**64 + 11, 0, 1], ValueError, r"seeds must be 64-bit integers in \[-2\*\*63, 2\*\*64\)"),
    ([-(2**63) - 1, 0, 1], ValueError, r"seeds must be 64-bit integers"),
    (2**70, ValueError, r"seeds must be 64-bit integers"),
    ([True, False, True], TypeError, "seeds must be integers"),
    (np.array([True, False, True]), TypeError, "seeds must be integers"),
    (jnp.array([True, False, True]), TypeError, "seeds must be integers"),
    ([1, 2.5, 3], TypeError, "seeds must be integers"),
    (np.zeros((3, 2), np.int64), ValueError,
     r"seeds must be \[B\]=\[3\] integers, or \[B, 2\]=\[3, 2\] uint32"),
    (jnp.zeros((2,), jnp.uint32), ValueError, r"got shape \(2,\) and dtype uint32"),
    (np.zeros((3, 3), np.uint32), ValueError, r"got shape \(3, 3\)"),
])
def test_bad_seeds_are_named(args, seeds, exc, match):
  with pytest.raises(exc, match=match):
    _call(args, seeds=seeds)


def test_seed_shape_message_does_not_contradict_itself(args):
  """It used to read "seeds must be [B]=[2] (or already split, [2, 2]), got (2, 2)"."""
  with pytest.raises(ValueError) as err:
    _call(args, seeds=jnp.zeros((2,), jnp.uint32))
  msg = str(err.value)
  assert "[B]=[3]" in msg and "(2,)" in msg, msg


@pytest.mark.parametrize("wrap", ["none", "jit"])
def test_not_differentiable(args, wrap):
  """jax.grad used to stop at a bare AssertionError inside Pallas."""
  base, anchor, head, t, seeds, pos = args
  words = jm.rng.seed_words(seeds)

  def loss(base):
    return jm.sample_draft(base, anchor, head, t, words, pos).logits.sum()

  f = jax.jit(loss) if wrap == "jit" else loss
  with pytest.raises(TypeError, match="sample_draft is not differentiable"):
    jax.grad(f)(base.astype(jnp.float32))
  with pytest.raises(TypeError, match="sample_draft is not differentiable"):
    jax.jvp(lambda t: jm.sample_draft(base, anchor, head, t, words, pos).logits,
            (t,), (jnp.ones_like(t),))
  cache = jnp.zeros((3, 2, 50), jnp.float32)
  idx = jnp.array([[0, 0], [1, 1], [2, 2]], jnp.int32)
  with pytest.raises(TypeError, match="sample_draft_into is not differentiable"):
    jax.grad(lambda c: jm.sample_draft_into(c, base, anchor, head, t, words, idx, pos,
                                            donate=False)[1].sum())(cache)
  # stop_gradient, as the message advises, draws inside a differentiated function.
  g = jax.grad(lambda x: x * jm.sample_draft(jax.lax.stop_gradient(base * x), anchor, head,
                                             t, words, pos).logits.sum())(1.0)
  assert np.isfinite(g)


def _into_args(args, N=4):
  base, anchor, head, _, _, pos = args
  cache = jnp.asarray(np.random.default_rng(0).standard_normal((N, 2, 50)), jnp.float32)
  t = jnp.ones((N,))
  s = np.arange(N, dtype=np.int64)
  idx = jnp.array([[0, 0], [1, 1], [2, 2]], jnp.int32)
  return [cache, base, anchor, head, t, s, idx, pos]


def test_donated_cache_is_named(args):
  into = _into_args(args)
  tokens, cache = jm.sample_draft_into(*into)
  assert into[0].is_deleted()
  with pytest.raises(ValueError, match="cache has been deleted: it was donated"):
    jm.sample_draft_into(*into)
  into[0] = cache  # the returned cache serves
  jm.sample_draft_into(*into)


@pytest.mark.parametrize("name,i", [("anchor_tokens", 2), ("seeds", 5),
                                    ("idx_map", 6), ("positions", 7)])
def test_bool_arrays_are_refused(args, name, i):
  """True is not a token id, a seed, a state row or a position."""
  into = _into_args(args)
  into[i] = jnp.asarray(into[i]).astype(bool)
  with pytest.raises(TypeError, match=f"{name} must be integers"):
    jm.sample_draft_into(*into, donate=False)
  dense = {2: "anchor", 5: "seeds", 7: "positions"}
  if i in dense:
    original = dict(zip(["base", "anchor", "head", "temperature", "seeds", "positions"], args))
    with pytest.raises(TypeError, match=f"{name} must be integers"):
      _call(args, **{dense[i]: np.asarray(original[dense[i]]).astype(bool)})


_REJECTED_INTO = [
    (1, jnp.zeros((3, 2, 49)), ValueError),                       # base V
    (2, jnp.array([0, 50, 1]), ValueError),                       # anchor range
    (2, jnp.zeros((3,), bool), TypeError),                        # anchor bool
    (4, jnp.array([1.0, -1.0, 1.0, 1.0]), ValueError),            # temperature < 0
    (4, jnp.array([1.0, np.nan, 1.0, 1.0]), ValueError),          # temperature NaN
    (4, jnp.ones((3,)), ValueError),                              # temperature [B]
    (5, [2**64, 1, 2, 3], ValueError),                            # seed range
    (5, np.arange(3), ValueError),                                # seeds [B]
    (6, jnp.array([[0, 0], [0, 1], [2, 2]], jnp.int32), ValueError),  # row twice
    (6, jnp.array([[0, 0], [1, 1], [2, 4]], jnp.int32), ValueError),  # row >= N
    (6, jnp.zeros((3, 2), jnp.float32), TypeError),               # idx_map float
    (7, np.full((3, 2), 2**31, np.int64), ValueError),            # position range
    (7, -jnp.ones((3, 2), jnp.int32), ValueError),                # position < 0
]


@pytest.mark.parametrize("i,value,exc", _REJECTED_INTO)
def test_refused_into_call_writes_and_donates_nothing(args, i, value, exc):
  """Every check runs before the jitted call: with donate=True (the default) a
  refused call leaves the cache alive and bit for bit unchanged."""
  into = _into_args(args)
  before = np.asarray(into[0]).copy()
  into[i] = value
  with pytest.raises(exc):
    jm.sample_draft_into(*into)
  assert not into[0].is_deleted()
  np.testing.assert_array_equal(np.asarray(into[0]), before)


def test_refused_persistent_config_donates_nothing(args):
  into = _into_args(args)
  before = np.asarray(into[0]).copy()
  config = jm.KernelConfig(method="fused", block_b=1, block_v=64, block_k=16, bias_dot="fma",
                           select="persistent", programs=2)
  with pytest.raises(ValueError, match="needs programs=1"):
    jm.sample_draft_into(*into, config=config, interpret=True)
  assert not into[0].is_deleted()
  np.testing.assert_array_equal(np.asarray(into[0]), before)


def test_inside_jit_idx_map_out_of_range_writes_nothing(args):
  """Under jit idx_map cannot be read: a state row outside [-1, N) is padding
  (it wrote past the cache before: an out-of-bounds store on a GPU)."""
  into = _into_args(args)
  cache, base, anchor, head, t, s, idx, pos = into
  words = jm.rng.seed_words(s)
  before = np.asarray(cache).copy()
  bad = jnp.array([[0, 4], [1, -7], [2, 2]], jnp.int32)  # N = 4
  f = jax.jit(lambda c, m: jm.sample_draft_into(c, base, anchor, head, t, words, m, pos,
                                                donate=False))
  tokens, new = f(cache, bad)
  chex.assert_shape(tokens, (3, 2))
  assert ((np.asarray(tokens) >= 0) & (np.asarray(tokens) < 50)).all()
  new = np.asarray(new)
  written = np.zeros((4, 2), bool)
  written[[0, 1, 2, 2], [0, 0, 0, 1]] = True
  np.testing.assert_array_equal(new[~written], before[~written])
  ref = jm.reference.sample_draft_into(cache, base, anchor, head, t, words, bad, pos)[1]
  np.testing.assert_array_equal(np.asarray(ref)[~written], before[~written])
