"""Bad input raises a clear error before anything compiles."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov as jm
from helpers import make_problem


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
    (dict(positions=-jnp.ones((3, 2), jnp.int32)), ValueError, "positions must be >= 0"),
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
  with pytest.raises(ValueError, match="needs the fused method"):
    xla_bias(block_v=128, proj_l2_rows=1024)
  # The persistent draft: one request a program, the bias on the CUDA cores.
  for kw in (dict(block_b=16), dict(block_b=16, bias_dot="mma"),
             dict(proj_l2_rows=128)):
    fields = dict(block_b=1, block_v=128, bias_dot="fma", select="persistent")
    with pytest.raises(ValueError, match="select='persistent' needs"):
      fused(**{**fields, **kw})
  with pytest.raises(ValueError, match="select='persistent' needs"):
    xla_bias(block_v=128, bias_dot="fma", select="persistent")
  with pytest.raises(ValueError, match="programs must be >= 0"):
    fused(block_b=1, block_v=128, bias_dot="fma", programs=4)
  with pytest.raises(ValueError, match="programs must be >= 0"):
    fused(block_b=1, block_v=128, bias_dot="fma", select="persistent",
          programs=-1)

def test_persistent_draft_refuses_programs_that_could_wait_forever(args):
  """The barrier needs every program of a request resident: more than one in
  the interpreter (programs run in turn), or more than the multiprocessors,
  would wait forever, so they are refused before anything runs."""
  from jax_markov.kernels.draft_pass import check_programs
  config = jm.KernelConfig(method="fused", block_b=1, block_v=64, block_k=16,
                           bias_dot="fma", select="persistent", programs=2)
  with pytest.raises(ValueError, match="needs programs=1"):
    jm.sample_draft(*args, config=config, interpret=True)
  with pytest.raises(ValueError, match="multiprocessors"):
    check_programs(4, 40, interpret=False, num_sms=132)
  with pytest.raises(ValueError, match="multiprocessors"):
    check_programs(1, 2, interpret=False, num_sms=None)
  with pytest.raises(ValueError, match="programs must be >= 1"):
    check_programs(1, 0, interpret=False, num_sms=132)
  check_programs(2, 66, interpret=False, num_sms=132)  # one a multiprocessor
  check_programs(512, 1, interpret=False, num_sms=132)  # each waits for itself


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
