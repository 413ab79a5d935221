"""Plain JAX baseline: jnp ops and jax.random.categorical in lax.scan, one jit.

What a JAX user writes without a custom kernel: per step the embedding
lookup, the bias dot (accumulated in float32), the add, the write of the
float32 logits into the cache (carried through the scan, updated in place)
and a draw with ``jax.random.categorical`` (Gumbel-max) -- or the argmax at
temperature 0. Its draws at T > 0 follow the right distribution but not
jax_markov's inverse-CDF rule, so only its temperature-0 tokens are comparable.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


@functools.partial(jax.jit, static_argnames=("greedy",))
def sample(base_logits: jax.Array, anchor_tokens: jax.Array, embed: jax.Array,
           proj: jax.Array, temperature: jax.Array, key: jax.Array, *,
           greedy: bool) -> tuple[jax.Array, jax.Array]:
  """Draws S tokens left to right with plain jnp ops.

  Args:
    base_logits: [B, S, V] bf16/fp16/fp32 backbone logits.
    anchor_tokens: int [B], the token before the first draft position.
    embed: [V_in, R] Markov embedding ("markov_w1").
    proj: [V, R] Markov projection ("markov_w2").
    temperature: float32 [B], > 0 unless ``greedy`` (then unused).
    key: a jax.random key, split once per step.
    greedy: static; True draws the argmax (lowest index of the maximum).

  Returns:
    (tokens int32 [B, S], logits float32 [B, S, V]): the drawn tokens and the
    pre-temperature logits base + bias they were drawn from.
  """
  B, S, V = base_logits.shape
  inv_t = 1.0 / temperature.astype(jnp.float32)

  def step(carry, s):
    prev, cache, key = carry
    emb = embed[prev]
    bias = jnp.dot(emb, proj.T, preferred_element_type=jnp.float32)
    base_s = jax.lax.dynamic_index_in_dim(base_logits, s, axis=1,
                                          keepdims=False)
    logits = base_s.astype(jnp.float32) + bias
    cache = jax.lax.dynamic_update_index_in_dim(cache, logits, s, axis=1)
    if greedy:
      tok = jnp.argmax(logits, axis=-1)
    else:
      key, sub = jax.random.split(key)
      tok = jax.random.categorical(sub, logits * inv_t[:, None], axis=-1)
    tok = tok.astype(jnp.int32)
    return (tok, cache, key), tok

  cache = jnp.zeros((B, S, V), jnp.float32)
  init = (anchor_tokens.astype(jnp.int32), cache, key)
  (_, cache, _), tokens = jax.lax.scan(step, init, jnp.arange(S))
  return tokens.T, cache
