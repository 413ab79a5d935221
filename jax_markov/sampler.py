"""The S-step Markov sampler: one jitted call for all S steps.

A step is two Pallas launches (block pass, select pass), plus the bias GEMM in
XLA with method="xla_bias"; one launch with ``select="tail"``, where the
block pass's last program draws; and with ``select="persistent"`` the whole
draft is one launch (kernels/draft_pass.py). Compiled, the steps are a Python
loop (each launch gets its step index as a constant); in the interpreter they
are a lax.scan, which compiles faster. The cache and the tokens drawn so far pass
from step to step on the device (the block pass gathers the previous token's
embedding row itself): nothing returns to the host.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jax_markov import reference, rng, validate
from jax_markov.head import Draft, MarkovHead
from jax_markov.kernels import tuning
from jax_markov.kernels.block_pass import block_pass, num_request_tiles
from jax_markov.kernels.draft_pass import draft_pass
from jax_markov.kernels.select_pass import select_pass


def _as_array(x) -> jax.Array:
  # jnp.asarray on a jax.Array still costs tens of microseconds per call.
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


@functools.cache
def _default_backend() -> str:
  return jax.default_backend()  # ~3 us a call: looked up once


def _interpret_default(interpret: bool | None) -> bool:
  return _default_backend() != "gpu" if interpret is None else interpret


def _run_steps(cache, base, anchor_tokens, head, params, cache_rows,
               *, num_cache_rows: int, config: tuning.KernelConfig,
               interpret: bool):
  """Runs the S steps.

  Args:
    cache: float32 [num_cache_rows, V] updated in place, or None: step 0 then
      creates it (no memset: every row gets written by some step).
    base: [B, S, V]; anchor_tokens: int32 [B].
    params: float32 [3, B * S], per draw (b, s) at b * S + s: 1 / T (1 where
      greedy), 1.0 where greedy (else 0), and the uniform.
    cache_rows: int32 [B * S], the flat cache row of each draw (-1 none), or
      None for the dense layout (draw (b, s) writes row b * S + s).

  Returns:
    (tokens int32 [B, S], cache float32 [num_cache_rows, V]).
  """
  B, S, V = base.shape
  base_flat = base.reshape(B * S, V)
  proj_dtype = head.proj.dtype
  gemm_precision = (jax.lax.Precision.HIGHEST if proj_dtype == jnp.float32
                    else jax.lax.Precision.DEFAULT)

  if config.select == "persistent":  # the whole draft in one launch
    cache, tokens = draft_pass(
        base_flat, head.embed, head.proj, anchor_tokens, params, cache_rows,
        cache, config=config, num_steps=S, num_cache_rows=num_cache_rows,
        interpret=interpret)
    return tokens.reshape(B, S), cache

  tail = config.select == "tail"

  def step(cache, tokens, counters, s):
    """One step; s is int32 [1]; tokens int32 [B * S] or None at step 0."""
    if config.method == "fused":
      # The block pass gathers the previous tokens' embedding rows itself.
      bias_or_head = (head.embed, head.proj, anchor_tokens)
      block_tokens = tokens
    else:
      prev = anchor_tokens if tokens is None else jax.lax.dynamic_index_in_dim(
          tokens.reshape(B, S), s[0] - 1, axis=1, keepdims=False)
      bias_or_head = jax.lax.dot_general(
          head.embed[prev], head.proj, (((1,), (1,)), ((), ())),
          precision=gemm_precision, preferred_element_type=jnp.float32)
      block_tokens = None  # the bias already holds the previous tokens
    out = block_pass(
        base_flat, bias_or_head, s, params, cache_rows, cache, block_tokens,
        counters, config=config, num_steps=S, num_cache_rows=num_cache_rows,
        interpret=interpret)
    if tail:  # the block pass drew the tokens itself
      cache, _, _, _, tokens, counters = out
      return cache, tokens, counters
    cache, bmax, bsum, barg = out
    tokens = select_pass(
        bmax, bsum, barg, cache, s, params, cache_rows, tokens, config=config,
        num_steps=S, interpret=interpret)
    return cache, tokens, counters

  # Step 0 creates the token array (and the cache when none is given), so the
  # steps after it update both in place. The tail select's counters start at
  # zero and every step leaves them there.
  counters = None
  if tail:
    counters = jnp.zeros((num_request_tiles(B, config.block_b),), jnp.int32)
  cache, tokens, counters = step(cache, None, counters,
                                 jnp.zeros((1,), jnp.int32))
  unroll = not interpret if config.unroll is None else config.unroll
  if unroll:
    # A Python loop: the step index of each launch is a constant, so each
    # step is 1-2 launches (+1 with the xla_bias GEMM), no slicing kernels.
    for s in range(1, S):
      cache, tokens, counters = step(cache, tokens, counters,
                                     jnp.full((1,), s, jnp.int32))
  elif S > 1:
    def body(carry, s):
      return step(*carry, s[None]), None

    (cache, tokens, counters), _ = jax.lax.scan(
        body, (cache, tokens, counters), jnp.arange(1, S, dtype=jnp.int32))
  return tokens.reshape(B, S), cache


def _draw_params(temperature, valid, u):
  """The kernels' per-draw parameters, float32 [3, B * S], from [B, S] arrays.

  Rows: 1 / T (1 where greedy), 1.0 where the draw is greedy, the uniform. One
  array, so XLA computes them in one fusion. A draw is greedy wherever NOT
  (T > 0), or padding: under jit a negative or NaN temperature cannot be
  refused, and greedy is the one reading of it that draws a valid token
  without inventing a distribution. 1 / T is floored at 2^-126
  (reference.draw_params) so that T = +inf keeps -inf logits at -inf (0 * -inf
  would be NaN) and draws uniformly over the finite logits.
  """
  scale, greedy = reference.draw_params(temperature)
  greedy = greedy | ~valid
  scale = jnp.where(greedy, 1.0, scale)
  return jnp.stack([scale, greedy.astype(jnp.float32), u]).reshape(3, -1)


_NOT_DIFFERENTIABLE = (
    "{name} is not differentiable: it draws discrete tokens, and the Pallas "
    "kernels have no derivative rules. For gradients of the logits, "
    "differentiate base_logits + jm.reference.bias(head, prev) (plain jnp), "
    "with the drawn tokens as prev; wrap the sampler's inputs in "
    "jax.lax.stop_gradient to draw inside a differentiated function.")


def _no_derivative(name):
  """An identity on pytrees that raises TypeError when differentiated.

  Without it, jax.grad / jax.jvp of the sampler stop at an AssertionError
  inside Pallas's interpreter or lowering, which names neither the sampler
  nor the reason. A custom_jvp is seen by every transformation that needs a
  derivative (grad, jvp, vjp, jacfwd, linearize), also through jit, and costs
  nothing otherwise.
  """
  @jax.custom_jvp
  def guard(x):
    return x

  @guard.defjvp
  def _(primals, tangents):
    raise TypeError(_NOT_DIFFERENTIABLE.format(name=name))

  return guard


_guard_draft = _no_derivative("jm.sample_draft")
_guard_draft_into = _no_derivative("jm.sample_draft_into")


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def _sample_draft(base, anchor_tokens, head, temperature, words, positions, *,
                  config, interpret):
  base, head, temperature = _guard_draft((base, head, temperature))
  B, S, V = base.shape
  u = rng.uniforms_from_words(words, positions)
  valid = jnp.ones((B, S), bool)
  params = _draw_params(jnp.broadcast_to(temperature[:, None], (B, S)), valid,
                        u)
  tokens, cache = _run_steps(None, base, anchor_tokens.astype(jnp.int32), head,
                             params, None, num_cache_rows=B * S,
                             config=config, interpret=interpret)
  return Draft(tokens, cache.reshape(B, S, V))


def _sample_draft_into_impl(cache, base, anchor_tokens, head, temperature,
                            words, idx_map, positions, *, config, interpret):
  cache, base, head, temperature = _guard_draft_into(
      (cache, base, head, temperature))
  B, S, V = base.shape
  N = cache.shape[0]
  idx_map = idx_map.astype(jnp.int32)
  # A row outside [0, N) is padding: refused when concrete, but under jit it
  # would make the kernels store and load past the cache (Triton does not
  # bounds-check), so it writes nothing instead.
  valid = (idx_map >= 0) & (idx_map < N)
  rows = jnp.where(valid, idx_map, 0)
  u = rng.uniforms_from_words(words[rows].reshape(B * S, 2),
                              positions.reshape(B * S, 1)).reshape(B, S)
  # Padding rows draw greedily: their token is any valid id by contract.
  params = _draw_params(temperature[rows], valid, u)
  steps = jnp.arange(S, dtype=jnp.int32)[None, :]
  cache_rows = jnp.where(valid, idx_map * S + steps, -1).reshape(B * S)
  tokens, cache = _run_steps(cache.reshape(N * S, V), base,
                             anchor_tokens.astype(jnp.int32), head, params,
                             cache_rows, num_cache_rows=N * S, config=config,
                             interpret=interpret)
  return tokens, cache.reshape(N, S, V)


_sample_draft_into = jax.jit(_sample_draft_into_impl,
                             static_argnames=("config", "interpret"))
_sample_draft_into_donated = jax.jit(_sample_draft_into_impl,
                                     static_argnames=("config", "interpret"),
                                     donate_argnums=(0,))


def _config(config, method, batch, vocab, rank, interpret):
  if config is not None:
    if method is not None and method != config.method:
      raise ValueError(f"method={method!r} disagrees with config.method="
                       f"{config.method!r}")
    return config
  return tuning.choose(method, batch, vocab, rank, interpret=interpret)


def sample_draft(base_logits, anchor_tokens, head: MarkovHead, temperature,
                 seeds, positions, *, interpret: bool | None = None,
                 method: str | None = None,
                 config: tuning.KernelConfig | None = None,
                 check_values: bool = True) -> Draft:
  """Drafts S tokens per request with the Markov head, in one jitted call.

  Step s draws token[b, s] from ``logits[b, s] = base_logits[b, s] +
  head.proj @ head.embed[prev[b]]`` where prev starts at ``anchor_tokens[b]``
  and becomes each drawn token. The draw is exactly the rule of
  :mod:`jax_markov.reference` with ``u = draft_uniforms(seeds, positions)``.

  Args:
    base_logits: [B, S, V] bf16, fp16 or fp32 backbone logits.
    anchor_tokens: int [B], the token before the first draft position.
    head: the Markov head (embed [V_in >= V, R], proj [V, R], one dtype).
    temperature: float [B] >= 0; 0 draws the argmax (lowest index on ties);
      +inf draws uniformly over the finite logits. Negative or NaN values are
      refused when concrete and draw greedily under jit.
    seeds: [B] integer seeds (int64 NumPy arrays keep all 64 bits), or uint32
      [B, 2] already split; see :func:`jax_markov.rng.seed_words`.
    positions: int [B, S] in [0, 2^31), the position each draw is keyed by.
    interpret: run the Pallas kernels in interpret mode; None picks it on any
      backend but GPU.
    method: "fused" (the bias dot inside the block pass) or "xla_bias" (the
      bias GEMM in XLA, as vLLM's design); None picks the faster one for the
      shape (kernels/tuning.py).
    config: a full launch configuration, overriding the tuning table.
    check_values: read concrete arguments to check their values (waits for
      device arrays; inside jit nothing is read either way).

  Returns:
    Draft(tokens int32 [B, S], logits float32 [B, S, V]), the logits being the
    pre-temperature values base + bias with the bias accumulated in float32.
    A row whose logits are all -inf or NaN draws token 0; NaN logits are never
    drawn and are returned in ``logits`` as computed.

  Raises:
    ValueError / TypeError, before anything compiles, for bad shapes, dtypes
    and (concrete) values; TypeError under jax.grad / jax.jvp (not
    differentiable). docs/limitations.md lists what jit leaves unchecked.
  """
  B, S, V = validate.check_common(base_logits, anchor_tokens, head, positions,
                                  check_values=check_values)
  validate.check_temperature(temperature, B, "B", check_values=check_values)
  words = rng.check_seeds(seeds, B, "B")
  interpret = _interpret_default(interpret)
  config = _config(config, method, B, V, head.rank, interpret)
  return _sample_draft(_as_array(base_logits), _as_array(anchor_tokens),
                       head, _as_array(temperature), words,
                       _as_array(positions), config=config,
                       interpret=interpret)


def sample_draft_into(cache, base_logits, anchor_tokens, head: MarkovHead,
                      temperature, seeds, idx_map, positions, *,
                      interpret: bool | None = None,
                      method: str | None = None,
                      config: tuning.KernelConfig | None = None,
                      donate: bool = True, check_values: bool = True):
  """The serving-engine layout: draws into a cache indexed by state rows.

  The logits of (request b, step s) go to ``cache[idx_map[b, s], s, :]``; the
  temperature and seed of that draw are ``temperature[idx_map[b, s]]`` and
  ``seeds[idx_map[b, s]]``. A row whose idx_map is -1 is padding: it writes
  nothing and its token is some valid id.

  Args:
    cache: float32 [N, S, V]. With ``donate=True`` (the default) its buffer is
      donated and updated in place (no copy of the cache per call): use the
      returned cache, not the argument, afterwards.
    base_logits, anchor_tokens, head, positions: as in :func:`sample_draft`.
    temperature: float [N] >= 0, per state row.
    seeds: [N] integer seeds or uint32 [N, 2], per state row.
    idx_map: int [B, S] in [-1, N); no state row twice within a step. Under
      jit, where it cannot be refused, a row outside [0, N) is padding.
    interpret, method, config, check_values: as in :func:`sample_draft`.
    donate: donate ``cache`` to the call.

  Returns:
    (tokens int32 [B, S], cache float32 [N, S, V]).

  Raises:
    As :func:`sample_draft`, and ValueError for a cache already donated to an
    earlier call. Every check runs before the call: a refused call writes
    nothing and donates nothing.
  """
  B, S, V = validate.check_common(base_logits, anchor_tokens, head, positions,
                                  check_values=check_values)
  N = validate.check_cache(cache, idx_map, B, S, V, check_values=check_values)
  validate.check_temperature(temperature, N, "N", check_values=check_values)
  words = rng.check_seeds(seeds, N, "N")
  interpret = _interpret_default(interpret)
  config = _config(config, method, B, V, head.rank, interpret)
  fn = _sample_draft_into_donated if donate else _sample_draft_into
  return fn(_as_array(cache), _as_array(base_logits),
            _as_array(anchor_tokens), head, _as_array(temperature), words,
            _as_array(idx_map), _as_array(positions), config=config,
            interpret=interpret)
