"""Vocabulary-parallel sampling: the S-step sampler with V sharded over a mesh axis.

Layout (n devices along the mesh axis ``axis``; V_pad = V rounded up to a
multiple of n, V_loc = V_pad / n; shard i holds columns [i * V_loc, (i+1) * V_loc)):

* base_logits [B, S, V]   sharded along V   (PartitionSpec(None, None, axis))
* head.proj   [V, R]      sharded along V   (PartitionSpec(axis, None))
* head.embed  [V_in, R]   replicated        (the lookup of the drawn token is local)
* the cache / returned logits [B, S, V] sharded along V, like base_logits
  (:func:`sample_draft_into_sharded`: the serving cache [N, S, V], sharded
  along V, each device writing its columns of the drawn rows in place)
* anchors, temperature, seeds, positions, tokens: replicated

One step on every device, inside ``shard_map`` over a ``lax.scan`` of the S steps:

1. the Pallas block pass (the same kernel as the single-device sampler) on the
   local shard: the logits of V_loc columns go to the local cache shard, and
   per vocabulary block and request the statistics (max, sum of exp) come out;
2. the statistics are all-gathered over ``axis`` (the only float exchange);
3. every device combines the same gathered statistics with the same u, so every
   device reaches the same decision: the global max m, the normaliser Z and the
   device that holds the draw (for T == 0: the first maximum);
4. that device finds the token in its local cache shard (level 2 of the
   inverse CDF: one block of logits read back), the others contribute 0, and a
   psum of the int32 token gives every device the token;
5. every device looks the token up in its replicated embedding table: the next
   step's embeddings, with no further exchange.

Two exchanges (``exchange=``):

* ``"shards"`` (default): each device reduces its blocks to one (max, sum) per
  request, so a step gathers 2 float32 per request per device; the owning
  device then walks its own blocks. The inverse CDF runs over the concatenated
  vocabulary in order, so the token is the single-device sampler's up to
  float32 summation order (the masses are summed per shard first).
* ``"blocks"``: the per-block (max, sum) are gathered, 2 float32 per request
  per block, and every device runs the single-device select pass's block-level
  arithmetic on them. When V_loc is a multiple of the block size (the blocks
  are then the single-device sampler's), the sums are the same sums in the
  same order: on the CPU interpreter the tokens are bit-for-bit the
  single-device sampler's.

What runs as Pallas: the block pass (the whole read of base logits and proj,
the bias dot, the cache write and the block statistics). The combination of
statistics and the level-2 search over one block (B * block_v logits) are jnp
in the same jitted program, mirroring ``kernels/select_pass.py`` step for step
(the Pallas select pass reads the block at ``k * block_v`` of a full-V cache,
which a shard does not hold).

A V that n does not divide is padded to V_pad with -inf base columns and zero
proj rows (never drawn: their probability is 0 and, all -inf rows aside, they
are never a maximum) and the logits are sliced back to V on return.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_markov import reference, rng, validate
from jax_markov.head import Draft, MarkovHead
from jax_markov.kernels import tuning
from jax_markov.kernels.block_pass import block_pass

EXCHANGES = ("shards", "blocks")


def _shard_map(f, mesh, in_specs, out_specs):
  """jax.shard_map (JAX >= 0.6) or jax.experimental.shard_map, checks off.

  The varying-across-devices check is off: with it on, pallas_call wants its
  out_shape annotated with how each output varies over the mesh (JAX 0.10
  raises otherwise), which the shared kernels do not do. The outputs declared
  replicated (the tokens) are psum results, so replicated indeed.
  """
  if hasattr(jax, "shard_map"):
    params = inspect.signature(jax.shard_map).parameters
    kwargs = {}
    for name in ("check_vma", "check_rep"):
      if name in params:
        kwargs[name] = False
        break
    return jax.shard_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         **kwargs)
  from jax.experimental.shard_map import shard_map  # older JAX only
  return shard_map(f, mesh, in_specs, out_specs, check_rep=False)


def _first_index(hit: jax.Array) -> jax.Array:
  """hit bool [B, n]: the first index along axis 1 that holds, clamped to n - 1.

  Returns int32 [B].
  """
  n = hit.shape[1]
  idx = jnp.arange(n, dtype=jnp.int32)[None, :]
  return jnp.minimum(jnp.min(jnp.where(hit, idx, n), axis=1), n - 1)


def _walk(mass: jax.Array, target: jax.Array, offset: jax.Array):
  """Level 1 of the inverse CDF over segments (blocks or shards).

  As in the select pass: the first segment whose running mass (plus the mass
  ``offset`` before the first segment) exceeds ``target``, clamped to the last
  segment with positive mass so float32 rounding never lands on a segment
  holding only -inf logits.

  Args:
    mass: float32 [B, n], >= 0 (request-major, as the block pass stores it).
    target: float32 [B], u * Z.
    offset: float32 [B] or scalar, the mass before segment 0.

  Returns:
    (k int32 [B] in [0, n), prefix float32 [B]: offset + mass before k).
  """
  n = mass.shape[1]
  offset = jnp.broadcast_to(offset, target.shape)
  idx = jnp.arange(n, dtype=jnp.int32)[None, :]
  running = jax.lax.cumsum(mass, axis=1) + offset[:, None]
  k = jnp.sum((running <= target[:, None]).astype(jnp.int32), axis=1)
  last = jnp.max(jnp.where(mass > 0, idx, -1), axis=1)
  k = jnp.clip(jnp.minimum(k, last), 0, n - 1)
  prefix = offset + jnp.sum(jnp.where(idx < k[:, None], mass, 0.0), axis=1)
  return k, prefix


def _finite(x):
  return (x > -jnp.inf) & (x < jnp.inf)


def _decide_blocks(bmax, bsum, u, greedy, *, axis: str, shard, num_local: int):
  """Gathers the block statistics; returns the owner's local block and sums.

  Every device computes the same values from the same gathered statistics:
  the arithmetic of ``select_pass`` over the blocks in vocabulary order.
  bmax, bsum: float32 [B, NB_loc], this shard's block statistics.

  Returns:
    (owner int32 [B], local block int32 [B] (meaningful on the owner),
     greedy bool [B], m_safe, prefix, target float32 [B]).
  """
  stats = jax.lax.all_gather(jnp.stack([bmax, bsum]), axis, axis=2,
                             tiled=True)                  # [2, B, NB]
  gmax, gsum = stats[0], stats[1]
  m = jnp.max(gmax, axis=1)
  finite = _finite(m)
  greedy = (greedy != 0) | ~finite
  first_max = _first_index(gmax == m[:, None])
  m_safe = jnp.where(finite, m, 0.0)
  mass = gsum * jnp.exp(gmax - m_safe[:, None])
  target = u * jnp.max(jax.lax.cumsum(mass, axis=1), axis=1)
  k, prefix = _walk(mass, target, 0.0)
  block = jnp.where(greedy, first_max, k)
  return (block // num_local, block - shard * num_local, greedy, m_safe,
          prefix, target)


def _decide_shards(bmax, bsum, u, greedy, *, axis: str, shard, num_local: int):
  """Gathers one (max, sum) per request and shard; same returns as above.

  The owner shard is chosen over the shards' masses; the local block over the
  owner's own block statistics, each device computing it for its own shard.
  """
  del num_local
  local_max = jnp.max(bmax, axis=1)                             # [B]
  local_safe = jnp.where(_finite(local_max), local_max, 0.0)
  local_sum = jnp.sum(bsum * jnp.exp(bmax - local_safe[:, None]), axis=1)
  stats = jax.lax.all_gather(jnp.stack([local_max, local_sum]), axis,
                             axis=2)                            # [2, B, n]
  smax, ssum = stats[0], stats[1]
  m = jnp.max(smax, axis=1)
  finite = _finite(m)
  greedy = (greedy != 0) | ~finite
  m_safe = jnp.where(finite, m, 0.0)
  # A shard with a +inf or all -inf max only matters when m is not finite,
  # where the draw is greedy and its (inf or nan) mass is not read.
  mass = ssum * jnp.exp(smax - m_safe[:, None])
  target = u * jnp.max(jax.lax.cumsum(mass, axis=1), axis=1)
  owner_sampled, shard_prefix = _walk(mass, target, 0.0)
  owner_greedy = _first_index(smax == m[:, None])
  owner = jnp.where(greedy, owner_greedy, owner_sampled)
  # The local walk, right on the owner (its shard_prefix is the mass of the
  # shards before it), ignored elsewhere.
  block_mass = bsum * jnp.exp(bmax - m_safe[:, None])
  k, prefix = _walk(block_mass, target, shard_prefix)
  first_max = _first_index(bmax == m[:, None])
  block = jnp.where(greedy, first_max, k)
  return owner, block, greedy, m_safe, prefix, target


def _pick(cache, rows, barg, block, greedy, m_safe, prefix, target, scale, *,
          block_v: int, vocab_local: int):
  """Level 2 on this shard: the token within local ``block``. int32 [B], local id.

  The select pass's level 2: read block ``block`` of each request's cache row,
  the first column whose running mass (plus ``prefix``) exceeds ``target``.
  """
  batch, num_local = barg.shape
  b = jnp.arange(batch)
  block = jnp.clip(block, 0, num_local - 1)
  block_arg = barg[b, block]
  v0 = block * block_v
  col = jnp.arange(block_v, dtype=jnp.int32)
  cols = v0[:, None] + col[None, :]                             # [B, block_v]
  v_mask = cols < vocab_local
  x = cache[rows[:, None], jnp.minimum(cols, vocab_local - 1)]
  x = jnp.where(v_mask, x, -jnp.inf)
  y = jnp.where(x == x, x, -jnp.inf) * scale[:, None]
  y = jnp.where(v_mask, y, -jnp.inf)
  p = jnp.exp(y - m_safe[:, None])
  running = jax.lax.cumsum(p, axis=1) + prefix[:, None]
  idx = jnp.sum((running <= target[:, None]).astype(jnp.int32), axis=1)
  last = jnp.max(jnp.where(p > 0, col[None, :], -1), axis=1)
  # p can underflow to 0 in a block whose mass was positive: that block's own
  # argmax is then the drawable token left.
  sampled = jnp.where(last >= 0, v0 + jnp.minimum(idx, last), block_arg)
  return jnp.where(greedy, block_arg, sampled)


def _local_steps(base, proj, embed, anchor_tokens, scale, greedy, u,
                 cache=None, cache_rows=None, *, axis: str, vocab: int,
                 exchange: str, config: tuning.KernelConfig,
                 interpret: bool):
  """The body of the shard_map: the S steps on one device's shard.

  Args:
    base: [B, S, V_loc] this shard's base logits; proj: [V_loc, R] its rows.
    embed: [V_in, R] (replicated); anchor_tokens: int32 [B].
    scale, greedy, u: [B, S] per draw (replicated).
    cache: None (the dense layout: a new cache, draw (b, s) in row b * S +
      s), or float32 [N * S, V_loc], this shard's columns of the serving
      cache, updated in place.
    cache_rows: with cache, int32 [B, S] (replicated): the row of draw
      (b, s), -1 for padding (nothing written; the draw must be greedy).

  Returns:
    (tokens int32 [B, S], identical on every device; cache float32
    [B * S or N * S, V_loc], this shard's logits.)
  """
  B, S, vocab_local = base.shape
  shard = jax.lax.axis_index(axis).astype(jnp.int32)
  offset = shard * vocab_local
  base_flat = base.reshape(B * S, vocab_local)
  if cache_rows is None:
    row_ids = jnp.arange(B, dtype=jnp.int32)[:, None] * S + jnp.arange(
        S, dtype=jnp.int32)[None, :]
    num_cache_rows, flat_rows = B * S, None
  else:
    # Level 2 reads a padding draw's row 0: in bounds, and its token is the
    # block argmax (padding draws are greedy), whatever that row holds.
    row_ids = jnp.maximum(cache_rows, 0)
    num_cache_rows, flat_rows = cache.shape[0], cache_rows.reshape(B * S)
  num_local = -(-vocab_local // config.block_v)
  decide = _decide_shards if exchange == "shards" else _decide_blocks
  gemm_precision = (jax.lax.Precision.HIGHEST if proj.dtype == jnp.float32
                    else jax.lax.Precision.DEFAULT)

  # The block pass reads row 0 (1 / T) of the draw parameters.
  params = scale.reshape(1, B * S)
  # The draw is the cross-device exchange below, never the tail select or
  # the persistent draft: the block pass runs with its plain outputs.
  block_config = dataclasses.replace(config, select="pass", programs=0)

  def step(cache, prev, s):
    """One step from the previous tokens prev int32 [B]."""
    rows = jax.lax.dynamic_index_in_dim(row_ids, s, axis=1, keepdims=False)
    if config.method == "fused":
      bias_or_head = (embed, proj, prev)
    else:
      bias_or_head = jax.lax.dot_general(
          embed[prev], proj, (((1,), (1,)), ((), ())),
          precision=gemm_precision, preferred_element_type=jnp.float32)
    cache, *stats = block_pass(
        base_flat, bias_or_head, jnp.reshape(s, (1,)).astype(jnp.int32),
        params, flat_rows, cache, config=block_config, num_steps=S,
        num_cache_rows=num_cache_rows, interpret=interpret)
    bmax, bsum, barg = stats  # [B, NB_loc], request-major
    owner, block, is_greedy, m_safe, prefix, target = decide(
        bmax, bsum, u[:, s], greedy[:, s], axis=axis, shard=shard,
        num_local=num_local)
    local = _pick(cache, rows, barg, block, is_greedy, m_safe, prefix, target,
                  scale[:, s], block_v=config.block_v, vocab_local=vocab_local)
    # Exactly one device owns each draw: the sum is its token.
    tokens = jax.lax.psum(jnp.where(owner == shard, local + offset, 0), axis)
    tokens = jnp.clip(tokens, 0, vocab - 1)  # padding columns are never drawn
    return cache, tokens

  cache, tokens0 = step(cache, anchor_tokens, 0)
  if S == 1:
    return tokens0[:, None], cache

  def body(carry, s):
    cache, prev = carry
    cache, tokens = step(cache, prev, s)
    return (cache, tokens), tokens

  (cache, _), tokens = jax.lax.scan(body, (cache, tokens0),
                                    jnp.arange(1, S, dtype=jnp.int32))
  return jnp.concatenate([tokens0[:, None], tokens.T], axis=1), cache


@functools.partial(jax.jit, static_argnames=("mesh", "axis", "data_axis",
                                             "exchange", "config",
                                             "interpret"))
def _sample_draft_sharded(base, anchor_tokens, head, temperature, words,
                          positions, *, mesh, axis, data_axis, exchange,
                          config, interpret):
  B, S, V = base.shape
  n = mesh.shape[axis]
  pad = -V % n
  proj = head.proj
  if pad:
    # -inf logits have probability 0 and are never a maximum over a row
    # holding any other value; zero proj rows keep the bias finite there.
    base = jnp.pad(base, ((0, 0), (0, 0), (0, pad)), constant_values=-jnp.inf)
    proj = jnp.pad(proj, ((0, pad), (0, 0)))
  u = rng.uniforms_from_words(words, positions)
  t = jnp.broadcast_to(temperature.astype(jnp.float32)[:, None], (B, S))
  scale, is_greedy = reference.draw_params(t)  # greedy wherever not T > 0
  anchor_tokens = anchor_tokens.astype(jnp.int32)
  pad_b = -B % mesh.shape[data_axis] if data_axis is not None else 0
  if pad_b:
    # Requests added so that the data axis divides B: greedy draws from
    # base 0 (any valid token), sliced off below.
    rows = lambda x: jnp.pad(x, ((0, pad_b),) + ((0, 0),) * (x.ndim - 1))  # noqa: E731
    base, anchor_tokens, scale, u = map(rows, (base, anchor_tokens, scale, u))
    is_greedy = jnp.pad(is_greedy, ((0, pad_b), (0, 0)), constant_values=True)
  body = functools.partial(_local_steps, axis=axis, vocab=V,
                           exchange=exchange, config=config,
                           interpret=interpret)
  # Requests over data_axis (None: replicated), each data shard drawing its
  # own; the vocabulary over axis, the exchanges within a data shard only.
  d = data_axis
  fn = _shard_map(
      body, mesh,
      in_specs=(P(d, None, axis), P(axis, None), P(), P(d), P(d, None),
                P(d, None), P(d, None)),
      out_specs=(P(d, None), P(d, axis)))
  tokens, cache = fn(base, proj, head.embed, anchor_tokens, scale,
                     is_greedy.astype(jnp.int32), u)
  logits = cache.reshape(B + pad_b, S, V + pad)
  if pad or pad_b:
    tokens, logits = tokens[:B], logits[:B, :, :V]
  return Draft(tokens, logits)


def _sample_draft_into_sharded_impl(cache, base, anchor_tokens, head,
                                    temperature, words, idx_map, positions,
                                    *, mesh, axis, exchange, config,
                                    interpret):
  B, S, V = base.shape
  N = cache.shape[0]
  idx_map = idx_map.astype(jnp.int32)
  # As the single-device sample_draft_into: a row outside [0, N) is padding
  # (refused when concrete; under jit it would store past the cache, which
  # Triton does not bounds-check), and a padding draw is greedy.
  valid = (idx_map >= 0) & (idx_map < N)
  rows = jnp.where(valid, idx_map, 0)
  u = rng.uniforms_from_words(words[rows].reshape(B * S, 2),
                              positions.reshape(B * S, 1)).reshape(B, S)
  scale, is_greedy = reference.draw_params(
      temperature.astype(jnp.float32)[rows])
  is_greedy = is_greedy | ~valid
  scale = jnp.where(is_greedy, 1.0, scale)
  steps = jnp.arange(S, dtype=jnp.int32)[None, :]
  cache_rows = jnp.where(valid, idx_map * S + steps, -1)
  body = functools.partial(_local_steps, axis=axis, vocab=V,
                           exchange=exchange, config=config,
                           interpret=interpret)
  fn = _shard_map(
      body, mesh,
      in_specs=(P(None, None, axis), P(axis, None), P(), P(), P(), P(), P(),
                P(None, axis), P()),
      out_specs=(P(), P(None, axis)))
  tokens, cache = fn(base, head.proj, head.embed,
                     anchor_tokens.astype(jnp.int32), scale,
                     is_greedy.astype(jnp.int32), u, cache.reshape(N * S, V),
                     cache_rows)
  return tokens, cache.reshape(N, S, V)


_INTO_STATICS = ("mesh", "axis", "exchange", "config", "interpret")
_sample_draft_into_sharded = jax.jit(_sample_draft_into_sharded_impl,
                                     static_argnames=_INTO_STATICS)
_sample_draft_into_sharded_donated = jax.jit(
    _sample_draft_into_sharded_impl, static_argnames=_INTO_STATICS,
    donate_argnums=(0,))


def _interpret_default(interpret: bool | None, mesh: Mesh) -> bool:
  if interpret is not None:
    return interpret
  return mesh.devices.flat[0].platform != "gpu"


def vocab_sharding(mesh: Mesh, axis: str = "vocab"):
  """The shardings :func:`sample_draft_sharded` expects its arrays in.

  Args:
    mesh: the device mesh; axis: the mesh axis that shards the vocabulary.

  Returns:
    dict of NamedSharding: "base_logits" and "logits" ([B, S, V] split along
    V), "proj" ([V, R] split along V), "replicated" (embed and every per
    request array).
  """
  return {
      "base_logits": NamedSharding(mesh, P(None, None, axis)),
      "logits": NamedSharding(mesh, P(None, None, axis)),
      "proj": NamedSharding(mesh, P(axis, None)),
      "replicated": NamedSharding(mesh, P()),
  }


def _check_mesh(mesh, axis, exchange, draft_to_target, name):
  if draft_to_target is not None:
    raise ValueError(f"{name} does not support draft_to_target (a reduced "
                     "draft vocabulary): use jm.sample_draft / "
                     "jm.sample_draft_into on one device")
  if not isinstance(mesh, Mesh):
    raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
  if axis not in mesh.axis_names:
    raise ValueError(f"axis {axis!r} is not an axis of the mesh "
                     f"{tuple(mesh.axis_names)}")
  if exchange not in EXCHANGES:
    raise ValueError(f"exchange must be one of {EXCHANGES}, got {exchange!r}")


def _config(config, method, batch, vocab_local, rank, interpret):
  """The caller's configuration, or the tuning table's for the per-shard
  vocabulary (its block_v applies per shard)."""
  if config is None:
    return tuning.choose(method, batch, vocab_local, rank,
                         interpret=interpret)
  if method is not None and method != config.method:
    raise ValueError(f"method={method!r} disagrees with config.method="
                     f"{config.method!r}")
  return config


def sample_draft_sharded(base_logits, anchor_tokens, head: MarkovHead,
                         temperature, seeds, positions, *, mesh: Mesh,
                         axis: str = "vocab", exchange: str = "shards",
                         data_axis: str | None = None,
                         interpret: bool | None = None,
                         method: str | None = None,
                         config: tuning.KernelConfig | None = None,
                         check_values: bool = True,
                         draft_to_target=None) -> Draft:
  """Drafts S tokens per request with the vocabulary sharded over a mesh axis.

  The same draws as :func:`jax_markov.sample_draft` (same logits, same rule,
  same uniforms), with base_logits, head.proj and the returned logits split
  along V over the ``n = mesh.shape[axis]`` devices of ``axis``; head.embed is
  replicated. One jitted call: a shard_map over the lax.scan of the S steps.
  Per step each device exchanges only block statistics (an all-gather) and the
  drawn tokens (a psum of int32 [B]); see the module docstring and
  docs/sharded.md.

  Args:
    base_logits: [B, S, V] bf16, fp16 or fp32, ideally placed with
      ``NamedSharding(mesh, P(None, None, axis))`` (other placements are
      resharded by the call).
    anchor_tokens: int [B], the token before the first draft position.
    head: MarkovHead; proj [V, R] ideally ``P(axis, None)``, embed [V_in, R]
      replicated (``P()``).
    temperature: float [B] >= 0; 0 draws the argmax (lowest index on ties).
    seeds: [B] integer seeds, or uint32 [B, 2]; see
      :func:`jax_markov.rng.seed_words`.
    positions: int [B, S] >= 0, the position each draw is keyed by.
    mesh: a ``jax.sharding.Mesh`` holding ``axis``. Other mesh axes see
      replicated arrays (every device of them runs the same work), but
      ``data_axis``.
    axis: the mesh axis that shards the vocabulary.
    data_axis: None, or another mesh axis that splits the requests (data
      parallelism): base_logits ``P(data_axis, None, axis)``, the per
      request arrays and the tokens ``P(data_axis)``; each data shard draws
      its own requests, exchanging only within its vocabulary group. A B
      that the axis does not divide is padded inside the call with greedy
      requests, sliced off on return.
    exchange: "shards" (2 float32 per request and device per step) or
      "blocks" (2 float32 per request and vocabulary block; bit-for-bit the
      single-device block arithmetic when V / n is a multiple of block_v).
    interpret: run the Pallas kernels in interpret mode; None picks it unless
      the mesh's devices are GPUs.
    method: "fused" or "xla_bias", as in :func:`jax_markov.sample_draft`;
      None picks by the tuning table for the per-shard vocabulary.
    config: a full launch configuration (its block_v applies per shard;
      its select field does not: the draw is always the cross-device
      exchange above, after a block pass without the tail select).
    check_values: read concrete arguments to check their values.
    draft_to_target: not supported here (a reduced draft vocabulary would
      need the map split with the vocabulary and the draw's order across
      shards kept in target-id order): anything but None raises ValueError.

  V need not be a multiple of n: the vocabulary is then padded inside the call
  with -inf base columns and zero proj rows, which are never drawn, and the
  logits are sliced back to V (their placement is then XLA's choice).

  Returns:
    Draft(tokens int32 [B, S] replicated (split over ``data_axis`` where
    given), logits float32 [B, S, V] sharded along V over ``axis`` when n
    divides V (and along B over ``data_axis`` when it divides B)).

  Raises:
    ValueError / TypeError: bad shapes, dtypes or values (as sample_draft), a
      mesh without ``axis``, a ``data_axis`` that is not another axis of
      the mesh, an unknown ``exchange``, or ``method`` disagreeing with
      ``config``.
  """
  _check_mesh(mesh, axis, exchange, draft_to_target, "sample_draft_sharded")
  if data_axis is not None and (data_axis not in mesh.axis_names
                                or data_axis == axis):
    raise ValueError(f"data_axis {data_axis!r} must be an axis of the mesh "
                     f"{tuple(mesh.axis_names)} other than axis {axis!r}")
  B, S, V = validate.check_common(base_logits, anchor_tokens, head, positions,
                                  check_values=check_values)
  validate.check_temperature(temperature, B, "B", check_values=check_values)
  words = rng.check_seeds(seeds, B, "B")
  interpret = _interpret_default(interpret, mesh)
  # The tile for the requests one device draws.
  local_b = -(-B // mesh.shape[data_axis]) if data_axis is not None else B
  config = _config(config, method, local_b, -(-V // mesh.shape[axis]),
                   head.rank, interpret)
  return _sample_draft_sharded(
      jnp.asarray(base_logits), jnp.asarray(anchor_tokens), head, jnp.asarray(temperature), words,
      jnp.asarray(positions), mesh=mesh, axis=axis, data_axis=data_axis,
      exchange=exchange, config=config, interpret=interpret)


def sample_draft_into_sharded(cache, base_logits, anchor_tokens,
                              head: MarkovHead, temperature, seeds, idx_map,
                              positions, *, mesh: Mesh, axis: str = "vocab",
                              exchange: str = "shards",
                              interpret: bool | None = None,
                              method: str | None = None,
                              config: tuning.KernelConfig | None = None,
                              donate: bool = True, check_values: bool = True,
                              draft_to_target=None):
  """The serving-engine layout of :func:`jax_markov.sample_draft_into`, with
  the vocabulary sharded over a mesh axis as in :func:`sample_draft_sharded`.

  The logits of (request b, step s) go to ``cache[idx_map[b, s], s, :]``,
  each device writing its own columns of its cache shard; the temperature
  and seed of that draw are ``temperature[idx_map[b, s]]`` and
  ``seeds[idx_map[b, s]]``; an idx_map of -1 is padding (nothing written,
  some valid token). The draws are sample_draft_into's on one device (same
  logits, rule and uniforms; the token up to float32 summation order with
  ``exchange="shards"``, as in :func:`sample_draft_sharded`). Per step each
  device exchanges block statistics (an all-gather) and the tokens (a psum
  of int32 [B]); the cache never moves.

  Args:
    cache: float32 [N, S, V], ideally placed with ``NamedSharding(mesh,
      P(None, None, axis))`` (``vocab_sharding(mesh)["logits"]``; another
      placement is resharded by the call, which then cannot update it in
      place). With ``donate=True`` (the default) its buffer is donated:
      use the returned cache, not the argument, afterwards.
    base_logits: [B, S, V] bf16, fp16 or fp32, ``P(None, None, axis)``.
    anchor_tokens, head, positions: as in :func:`sample_draft_sharded`.
    temperature: float [N] >= 0, per state row (replicated).
    seeds: [N] integer seeds or uint32 [N, 2], per state row.
    idx_map: int [B, S] in [-1, N); no state row twice within a step. Under
      jit, where it cannot be refused, a row outside [0, N) is padding.
    mesh, axis, exchange, interpret, method, config, check_values: as in
      :func:`sample_draft_sharded`.
    donate: donate ``cache`` to the call.
    draft_to_target: not supported (ValueError), as in
      :func:`sample_draft_sharded`.

  V must be a multiple of n = mesh.shape[axis]: the cache is the caller's
  buffer, which the call updates in place and so cannot pad (the dense
  :func:`sample_draft_sharded` pads inside the call).

  Returns:
    (tokens int32 [B, S] replicated, cache float32 [N, S, V] sharded along V
    over ``axis``).

  Raises:
    ValueError / TypeError, before anything runs: as
    :func:`jax_markov.sample_draft_into` (shapes, dtypes, values, a donated
    cache) and :func:`sample_draft_sharded` (mesh, axis, exchange, method),
    and for a V that n does not divide.
  """
  _check_mesh(mesh, axis, exchange, draft_to_target,
              "sample_draft_into_sharded")
  B, S, V = validate.check_common(base_logits, anchor_tokens, head, positions,
                                  check_values=check_values)
  N = validate.check_cache(cache, idx_map, B, S, V, check_values=check_values)
  validate.check_temperature(temperature, N, "N", check_values=check_values)
  words = rng.check_seeds(seeds, N, "N")
  n = mesh.shape[axis]
  if V % n:
    raise ValueError(f"sample_draft_into_sharded needs V a multiple of the "
                     f"{n} devices of mesh axis {axis!r}, got V = {V}: the "
                     "cache is updated in place and cannot be padded (pad the "
                     "vocabulary, as a vocabulary-parallel output layer "
                     "does, or use sample_draft_sharded)")
  interpret = _interpret_default(interpret, mesh)
  config = _config(config, method, B, V // n, head.rank, interpret)
  fn = (_sample_draft_into_sharded_donated if donate
        else _sample_draft_into_sharded)
  return fn(jnp.asarray(cache), jnp.asarray(base_logits),
            jnp.asarray(anchor_tokens), head, jnp.asarray(temperature), words,
            jnp.asarray(idx_map), jnp.asarray(positions), mesh=mesh,
            axis=axis, exchange=exchange, config=config, interpret=interpret)
