"""The sampler in plain jnp: the executable spec the kernels are tested against.

The draw rule (one row x of float32 logits, temperature T, uniform u):

* NaN logits count as -inf: they are never drawn.
* The draw is greedy unless T > 0: T == 0, and also a negative or NaN T (the
  entry points refuse those when they can read them; under jit they cannot),
  and a subnormal T (below 2^-126), whose 1 / T overflows float32.
* y = x * scale with scale = max(1 / T, 2^-126) when T > 0, y = x when
  greedy; m = max(y). The floor keeps -inf logits at -inf for T = +inf (and
  for T > 2^126, where 1 / T would be subnormal and may be flushed to zero):
  those draw as T = 2^126, uniformly over the finite logits of ordinary size.
* greedy, or m not finite (every logit -inf/NaN, or a +inf logit): the token is
  the lowest index of the maximum of y (0 when the whole row is -inf/NaN).
* otherwise p_j = exp(y_j - m), Z = sum_j p_j, and the token is the smallest i
  with u * Z < sum_{j <= i} p_j: the inverse CDF in vocabulary order. Should
  float32 rounding leave u * Z at or past the last partial sum, the token is
  the last index with p_j > 0, so a -inf logit is never drawn.

A reduced draft vocabulary (``draft_to_target``, int [Vd], distinct target
ids): base [B, S, Vd] and proj [Vd, R] are over the draft ids, embed over the
target ids. The row drawn from is the target row of width V: -inf at every
target id no draft id maps to, ``base[j] + bias[j]`` at target id
``draft_to_target[j]``. The token is that row's draw by the rule above (a
target id; so the inverse CDF runs in target-id order and ties go to the
lowest target id), except that a row with nothing drawable draws the lowest
mapped target id rather than 0, so every token is one the draft vocabulary
has. The next step's bias uses embed[that target id].

Every function here is jittable; none of them uses Pallas.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_markov import rng


def bias(head, prev: jax.Array) -> jax.Array:
  """Markov bias proj @ embed[prev], accumulated and returned in float32. [B, V]."""
  emb = head.embed[prev]
  return jax.lax.dot_general(
      emb, head.proj, (((1,), (1,)), ((), ())),
      precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32)


# The smallest normal float32: 1 / T is floored here (see the module doc).
MIN_SCALE = 2.0**-126


def draw_params(temperature: jax.Array):
  """(scale float32, greedy bool) per draw from float temperatures, any shape.

  greedy wherever NOT (T > 0): zero, negative and NaN temperatures draw the
  argmax, and so does a subnormal T whose 1 / T overflows; scale =
  max(1 / T, 2^-126) elsewhere, 1 where greedy.
  """
  t = temperature.astype(jnp.float32)
  inv = 1.0 / jnp.where(t > 0, t, 1.0)
  # A subnormal T overflows 1 / T to inf, and inf * 0 would be NaN: that is
  # the limit T -> 0+, the argmax.
  greedy = ~(t > 0) | (inv == jnp.inf)
  scale = jnp.where(greedy, 1.0, jnp.maximum(inv, MIN_SCALE))
  return scale, greedy


def draw(logits: jax.Array, temperature: jax.Array, u: jax.Array) -> jax.Array:
  """Draws one token per row by the rule above.

  Args:
    logits: float32 [B, V] pre-temperature logits.
    temperature: float [B], >= 0 (greedy wherever not > 0).
    u: float32 [B] uniforms in [0, 1).

  Returns:
    int32 [B] tokens in [0, V).
  """
  x = logits.astype(jnp.float32)
  x = jnp.where(jnp.isnan(x), -jnp.inf, x)
  scale, greedy = draw_params(temperature)
  y = x * scale[:, None]
  m = jnp.max(y, axis=-1)
  first_max = jnp.argmax(y, axis=-1).astype(jnp.int32)
  # p = exp(y - m) computed as exp((x - max x) * scale), equal up to float32
  # rounding (scale > 0 keeps the order). Written as y - m, XLA's CPU compiler
  # recomputes y inside the fusion and contracts it to fma(x, scale, -m): the
  # maximum's own p became exp(its rounding error of x * scale), at T = 1e-30
  # exp(+-1e23), 0 or inf, and the draw fell out of [0, V). Here the maximum's
  # p is exp(0 * scale) = 1 whatever the compiler contracts.
  mx = jnp.max(x, axis=-1)
  p = jnp.exp((x - jnp.where(jnp.isfinite(mx), mx, 0.0)[:, None]) * scale[:, None])
  cdf = jnp.cumsum(p, axis=-1)
  target = u.astype(jnp.float32) * cdf[:, -1]
  idx = jnp.sum(cdf <= target[:, None], axis=-1).astype(jnp.int32)
  vocab = jnp.arange(x.shape[-1], dtype=jnp.int32)
  last_drawable = jnp.max(jnp.where(p > 0, vocab, -1), axis=-1)
  idx = jnp.minimum(idx, last_drawable)
  return jnp.where(greedy | ~jnp.isfinite(m), first_max, idx)


def to_target(logits, draft_to_target, target_vocab: int):
  """Draft-vocabulary logits [..., Vd] -> target row [..., V], -inf unmapped."""
  full = jnp.full(logits.shape[:-1] + (target_vocab,), -jnp.inf, jnp.float32)
  return full.at[..., draft_to_target].set(logits.astype(jnp.float32))


def _chain(base_logits, anchor_tokens, head, temperature, u,
           draft_to_target=None, target_vocab=None):
  """Runs the S steps; temperature and u are [B, S]. Returns tokens, logits.

  With draft_to_target the logits are over the target vocabulary (width
  target_vocab) and the tokens are target ids.
  """
  def step(prev, xs):
    base_s, t_s, u_s = xs
    logits = base_s.astype(jnp.float32) + bias(head, prev)
    if draft_to_target is None:
      tok = draw(logits, t_s, u_s)
      return tok, (tok, logits)
    logits = to_target(logits, draft_to_target, target_vocab)
    tok = draw(logits, t_s, u_s)
    # Nothing drawable (every mapped logit -inf or NaN): the lowest mapped id.
    x = jnp.where(jnp.isnan(logits), -jnp.inf, logits)
    none = jnp.max(x, axis=-1) == -jnp.inf
    tok = jnp.where(none, jnp.min(draft_to_target).astype(jnp.int32), tok)
    return tok, (tok, logits)

  xs = (jnp.swapaxes(base_logits, 0, 1), temperature.T, u.T)
  _, (tokens, logits) = jax.lax.scan(step, anchor_tokens.astype(jnp.int32), xs)
  return tokens.T, jnp.swapaxes(logits, 0, 1)


@functools.partial(jax.jit, static_argnames=("target_vocab",))
def _sample_draft(base_logits, anchor_tokens, head, temperature, words, positions,
                  draft_to_target=None, target_vocab=None):
  u = rng.uniforms_from_words(words, positions)
  t = jnp.broadcast_to(temperature[:, None], u.shape)
  return _chain(base_logits, anchor_tokens, head, t, u, draft_to_target,
                target_vocab)


def _target_vocab(head, draft_to_target, target_vocab):
  if draft_to_target is None or target_vocab is not None:
    return target_vocab
  return head.embed.shape[0]


def sample_draft(base_logits, anchor_tokens, head, temperature, seeds, positions,
                 *, draft_to_target=None, target_vocab=None):
  """Reference for :func:`jax_markov.sample_draft`. Returns (tokens, logits).

  tokens int32 [B, S]; logits float32 [B, S, V], pre-temperature (with
  draft_to_target, V = target_vocab, default head.embed's rows).
  """
  d2t = None if draft_to_target is None else jnp.asarray(draft_to_target)
  return _sample_draft(jnp.asarray(base_logits), jnp.asarray(anchor_tokens),
                       head, jnp.asarray(temperature), rng.seed_words(seeds),
                       jnp.asarray(positions), d2t,
                       target_vocab=_target_vocab(head, d2t, target_vocab))


def greedy_draft(base_logits, anchor_tokens, head, *, draft_to_target=None,
                 target_vocab=None):
  """Reference for :func:`jax_markov.greedy_draft`: int32 [B, S] tokens.

  The T = 0 draft: every draw the argmax (by the rule, with the map's
  semantics above); the uniforms are not used.
  """
  base = jnp.asarray(base_logits)
  B, S, _ = base.shape
  d2t = None if draft_to_target is None else jnp.asarray(draft_to_target)
  zeros = jnp.zeros((B, S), jnp.float32)
  tokens, _ = _chain(base, jnp.asarray(anchor_tokens), head, zeros, zeros, d2t,
                     _target_vocab(head, d2t, target_vocab))
  return tokens


@jax.jit
def _sample_draft_into(cache, base_logits, anchor_tokens, head, temperature,
                       words, idx_map, positions, draft_to_target=None):
  S = base_logits.shape[1]
  valid = (idx_map >= 0) & (idx_map < cache.shape[0])  # else padding, as the kernels
  rows = jnp.where(valid, idx_map, 0)
  # Padding rows draw greedily: their token is any valid id by contract.
  t = jnp.where(valid, temperature[rows], 0.0)
  u = rng.uniforms_from_words(words[rows].reshape(-1, 2),
                              positions.reshape(-1, 1)).reshape(rows.shape)
  tokens, logits = _chain(base_logits, anchor_tokens, head, t, u,
                          draft_to_target, cache.shape[2])
  steps = jnp.broadcast_to(jnp.arange(S), idx_map.shape)
  # Padding rows scatter out of bounds, and mode="drop" discards them.
  oob = jnp.where(valid, idx_map, cache.shape[0])
  cache = cache.at[oob, steps].set(logits, mode="drop")
  return tokens, cache


def sample_draft_into(cache, base_logits, anchor_tokens, head, temperature,
                      seeds, idx_map, positions, *, draft_to_target=None):
  """Reference for :func:`jax_markov.sample_draft_into`. Returns (tokens, cache).

  With draft_to_target the target vocabulary is the cache's width.
  """
  d2t = None if draft_to_target is None else jnp.asarray(draft_to_target)
  return _sample_draft_into(jnp.asarray(cache), jnp.asarray(base_logits),
                            jnp.asarray(anchor_tokens), head,
                            jnp.asarray(temperature), rng.seed_words(seeds),
                            jnp.asarray(idx_map), jnp.asarray(positions), d2t)
