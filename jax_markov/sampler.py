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
import os

import jax
import jax.numpy as jnp

from jax_markov import reference, rng, validate
from jax_markov.head import Draft, MarkovHead
from jax_markov.kernels import tuning
from jax_markov.kernels.block_pass import block_pass, num_request_tiles
from jax_markov.kernels import chunk_pass as chunk_pass_module
from jax_markov.kernels.chunk_pass import chunk_pass
from jax_markov.kernels.draft_pass import draft_pass
from jax_markov.kernels import mosaic_block_pass
from jax_markov.kernels.select_pass import select_pass


def _as_array(x) -> jax.Array:
  # jnp.asarray on a jax.Array still costs tens of microseconds per call.
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


@functools.cache
def _default_backend() -> str:
  return jax.default_backend()  # ~3 us a call: looked up once


def _dtype(x):
  dtype = getattr(x, "dtype", None)  # (a NumPy dtype is falsy: no `or`)
  return jnp.dtype(jnp.asarray(x).dtype if dtype is None else dtype)


def _interpret_default(interpret: bool | None) -> bool:
  return _default_backend() != "gpu" if interpret is None else interpret


def _run_steps(cache, base, anchor_tokens, head, params, cache_rows,
               *, num_cache_rows: int, config: tuning.KernelConfig,
               interpret: bool, columns=None, slots=None,
               no_cache: bool = False):
  """Runs the S steps.

  Args:
    cache: float32 [num_cache_rows, V] updated in place, or None: step 0 then
      creates it (no memset: every row gets written by some step).
    base: [B, S, V]; anchor_tokens: int32 [B].
    params: float32 [3, B * S], per draw (b, s) at b * S + s: 1 / T (1 where
      greedy), 1.0 where greedy (else 0), and the uniform.
    cache_rows: int32 [B * S], the flat cache row of each draw (-1 none), or
      None for the dense layout (draw (b, s) writes row b * S + s).
    columns: greedy drafting with a reduced vocabulary: int32 [V] strictly
      increasing (see :func:`_column_map`), the target id of each draft
      column, or None.
    slots: sampling with a reduced vocabulary: int32 [V_target] (see
      :func:`_slot_map`), the draft column of each target column or -1; the
      cache and the statistics are then over the V_target target columns.
    no_cache: greedy drafting: cache, params and cache_rows are None, every
      draw is the argmax, and no cache exists (None is returned for it).

  Returns:
    (tokens int32 [B, S], cache float32 [num_cache_rows, V or V_target] or
    None with no_cache).
  """
  B, S, V = base.shape
  base_flat = base.reshape(B * S, V)
  proj_dtype = head.proj.dtype
  gemm_precision = (jax.lax.Precision.HIGHEST if proj_dtype == jnp.float32
                    else jax.lax.Precision.DEFAULT)

  if config.select == "persistent":  # the whole draft in one launch
    if columns is not None or slots is not None or no_cache:
      raise ValueError("select='persistent' supports neither draft_to_target "
                       "nor greedy_draft; use select='pass' or 'tail'")
    cache, tokens = draft_pass(
        base_flat, head.embed, head.proj, anchor_tokens, params, cache_rows,
        cache, config=config, num_steps=S, num_cache_rows=num_cache_rows,
        interpret=interpret)
    return tokens.reshape(B, S), cache

  tail = config.select == "tail"
  if config.method == "mosaic" and (
      interpret or columns is not None or slots is not None or no_cache):
    raise ValueError(
        "method='mosaic' runs on a Hopper GPU only, and not with a reduced "
        "vocabulary or greedy_draft (use 'fused' there)")

  fold = (mosaic_block_pass.epilogue_chunk(config, B, V)
          if config.method == "mosaic" else None)

  def mosaic_step(cache, tokens, emb, s):
    # The kernel keeps the previous tokens' embedding rows in shared memory:
    # XLA gathers them, or (select_embed) the select pass of the step before
    # wrote them, and at step 0 they are the anchors' (emb is None).
    if emb is None or not config.select_embed:
      prev = anchor_tokens if tokens is None else jax.lax.dynamic_index_in_dim(
          tokens.reshape(B, S), s[0] - 1, axis=1, keepdims=False)
      emb = head.embed[prev]
    cache, bmax, bsum, barg, *chunks = mosaic_block_pass.mosaic_block_pass(
        base_flat, emb, head.proj, params, s, cache, cache_rows,
        num_steps=S, num_cache_rows=num_cache_rows, block_b=config.block_b,
        block_v=config.block_v,
        max_concurrent_steps=(config.num_stages if config.num_stages >= 2
                              else None), chunk=fold,
        store_warpgroup=config.store_warpgroup)
    if fold is None:
      # The statistics are block-major: reduced over chunks of blocks first,
      # a request's draw reads a few short strided runs, not NB words.
      chunks = chunk_pass(bmax, bsum, barg)
    return cache, emb, (bmax, bsum, barg), tuple(chunks)

  def step(cache, tokens, carried, s):
    """One step; s is int32 [1]; tokens int32 [B * S] or None at step 0.

    carried: the tail select's counters, or the Mosaic pass's embeddings
    for this step with select_embed (None at step 0), else None.
    """
    if config.method == "mosaic":
      cache, emb, stats, chunks = mosaic_step(cache, tokens, carried, s)
      tokens = select_pass(*stats, cache, s, params, cache_rows,
                           tokens, config=config, num_steps=S, vocab=V,
                           stats_major="block", chunk_stats=chunks,
                           chunk=fold or chunk_pass_module.CHUNK,
                           embed=head.embed if config.select_embed else None,
                           emb=emb if config.select_embed else None)
      if config.select_embed:
        tokens, emb = tokens
        return cache, tokens, emb
      return cache, tokens, None
    counters = carried
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
        columns=columns, slots=slots, no_cache=no_cache, interpret=interpret)
    if no_cache:  # greedy drafting: block maxima and argmaxes, no cache
      if tail:
        _, _, tokens, counters = out
        return cache, tokens, counters
      bmax, barg = out
      bsum = None
    elif tail:  # the block pass drew the tokens itself
      cache, _, _, _, tokens, counters = out
      return cache, tokens, counters
    else:
      cache, bmax, bsum, barg = out
    tokens = select_pass(
        bmax, bsum, barg, cache, s, params, cache_rows, tokens, config=config,
        num_steps=S, columns=columns,
        vocab=V if slots is None else slots.shape[0], no_cache=no_cache,
        interpret=interpret)
    return cache, tokens, counters

  # Step 0 creates the token array (and the cache when none is given), so the
  # steps after it update both in place. The tail select's counters start at
  # zero and every step leaves them there.
  carried = None
  if tail:
    carried = jnp.zeros((num_request_tiles(B, config.block_b),), jnp.int32)
  cache, tokens, carried = step(cache, None, carried,
                                jnp.zeros((1,), jnp.int32))
  unroll = not interpret if config.unroll is None else config.unroll
  if unroll:
    # A Python loop: the step index of each launch is a constant, so each
    # step is 1-2 launches (+1 with the xla_bias GEMM), no slicing kernels.
    for s in range(1, S):
      cache, tokens, carried = step(cache, tokens, carried,
                                    jnp.full((1,), s, jnp.int32))
  elif S > 1:
    def body(carry, s):
      return step(*carry, s[None]), None

    (cache, tokens, carried), _ = jax.lax.scan(
        body, (cache, tokens, carried), jnp.arange(1, S, dtype=jnp.int32))
  return tokens.reshape(B, S), cache


def _column_map(draft_to_target, base, head, *, permute: bool):
  """Greedy drafting's view of a reduced draft vocabulary.

  Invariant the kernels rely on: the column map they get is strictly
  increasing, so draft-column order is target-id order (the first argmax
  over the draft columns is the one over the target row). With ``permute``
  (the map is not known to be increasing) the draft columns are sorted by
  target id here: ``order = argsort(draft_to_target)``, base and proj
  permuted with it (a copy of base [B, S, Vd] and proj [Vd, R]), which
  changes no logit: column j of the draft vocabulary is the same (base[j],
  proj[j]) pair at its sorted place.

  Args:
    draft_to_target: int [Vd], distinct target ids.
    base: [B, S, Vd]; head: proj [Vd, R].
    permute: sort (static); False only where the map is known increasing.

  Returns:
    (columns int32 [Vd] increasing, base, head).
  """
  columns = draft_to_target.astype(jnp.int32)
  if permute:
    order = jnp.argsort(columns)
    columns = columns[order]
    base = jnp.take(base, order, axis=2)
    head = MarkovHead(head.embed, jnp.take(head.proj, order, axis=0))
  return columns, base, head


def _slot_map(draft_to_target, target_vocab: int):
  """Sampling's view of a reduced draft vocabulary: int32 [target_vocab].

  Entry t is the draft column whose target id is t, or -1 where no draft id
  maps to t. The block pass walks the target columns with it, so any map
  order works and base and proj are used as they are. Ids outside [0,
  target_vocab) are dropped and of duplicates one wins (both refused when
  the map is concrete and checked; docs/limitations.md).
  """
  vd = draft_to_target.shape[0]
  return jnp.full((target_vocab,), -1, jnp.int32).at[
      draft_to_target.astype(jnp.int32)].set(
          jnp.arange(vd, dtype=jnp.int32), mode="drop")


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


@functools.partial(jax.jit, static_argnames=("config", "interpret",
                                             "target_vocab"))
def _sample_draft(base, anchor_tokens, head, temperature, words, positions, *,
                  config, interpret, draft_to_target=None, target_vocab=None):
  base, head, temperature = _guard_draft((base, head, temperature))
  B, S, V = base.shape
  u = rng.uniforms_from_words(words, positions)
  valid = jnp.ones((B, S), bool)
  params = _draw_params(jnp.broadcast_to(temperature[:, None], (B, S)), valid,
                        u)
  slots = None
  if draft_to_target is not None:
    slots = _slot_map(draft_to_target, target_vocab)
    V = target_vocab
  tokens, cache = _run_steps(None, base, anchor_tokens.astype(jnp.int32), head,
                             params, None, num_cache_rows=B * S,
                             config=config, interpret=interpret, slots=slots)
  return Draft(tokens, cache.reshape(B, S, V))


def _sample_draft_into_impl(cache, base, anchor_tokens, head, temperature,
                            words, idx_map, positions, *, config, interpret,
                            draft_to_target=None):
  cache, base, head, temperature = _guard_draft_into(
      (cache, base, head, temperature))
  B, S, V = base.shape
  N = cache.shape[0]
  slots = None
  if draft_to_target is not None:
    V = cache.shape[2]  # the target vocabulary
    slots = _slot_map(draft_to_target, V)
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
                             interpret=interpret, slots=slots)
  return tokens, cache.reshape(N, S, V)


_INTO_STATICS = ("config", "interpret")
_sample_draft_into = jax.jit(_sample_draft_into_impl,
                             static_argnames=_INTO_STATICS)
_sample_draft_into_donated = jax.jit(_sample_draft_into_impl,
                                     static_argnames=_INTO_STATICS,
                                     donate_argnums=(0,))


@functools.partial(jax.jit, static_argnames=("config", "interpret", "permute"))
def _greedy_draft(base, anchor_tokens, head, *, config, interpret,
                  draft_to_target=None, permute=False):
  B, S, _ = base.shape
  columns = None
  if draft_to_target is not None:
    columns, base, head = _column_map(draft_to_target, base, head,
                                      permute=permute)
  tokens, _ = _run_steps(None, base, anchor_tokens.astype(jnp.int32), head,
                         None, None, num_cache_rows=0, config=config,
                         interpret=interpret, columns=columns, no_cache=True)
  return tokens


def _map_statics(draft_to_target, config, increasing: bool | None):
  """(draft_to_target as an array or None, permute) for the jitted calls.

  permute is False only where the map is known strictly increasing (then
  base and proj go to the kernels as they are); a traced map, or a NumPy map
  with check_values off, is sorted inside the call.
  """
  if draft_to_target is None:
    return None, False
  if config is not None and config.select == "persistent":
    raise ValueError("draft_to_target is not supported with "
                     "select='persistent'; use select='pass' or 'tail'")
  return _as_array(draft_to_target), not increasing


def _target_map(draft_to_target, target_vocab, vocab, head, config,
                check_values) -> dict:
  """The jitted calls' map keywords for sample_draft and greedy_draft."""
  if draft_to_target is None:
    if target_vocab is not None:
      raise ValueError("target_vocab is for draft_to_target (a reduced draft "
                       "vocabulary); without it the vocabulary is base's V")
    return {}
  if target_vocab is None:
    target_vocab = validate._shape(head.embed)[0]
  increasing = validate.check_draft_to_target(
      draft_to_target, vocab, target_vocab, validate._shape(head.embed)[0],
      check_values=check_values)
  d2t, permute = _map_statics(draft_to_target, config, increasing)
  return dict(draft_to_target=d2t, permute=permute,
              target_vocab=int(target_vocab))


# The smallest batch bucket a JAX call runs the Mosaic GPU pass at (_config).
JAX_MOSAIC_FROM = 256


def _mosaic_available() -> bool:
  """Whether the tuning table may pick the Mosaic GPU block pass: a Hopper
  GPU, unless $JAX_MARKOV_MOSAIC is "0"."""
  if os.environ.get("JAX_MARKOV_MOSAIC") == "0":
    return False
  return _hopper()


@functools.cache
def _hopper() -> bool:
  return mosaic_block_pass.available()[0]


@functools.cache
def _gpu_name() -> str:
  """The default device's name, for the tuning table's per-GPU entries."""
  return getattr(jax.devices()[0], "device_kind", "")


def _config(config, method, batch, vocab, rank, interpret, stepwise=False,
            hopper=False):
  """The launch configuration: the caller's, or the tuning table's.

  vocab is the block pass's grid: V, or with a reduced vocabulary the
  target vocabulary when sampling (the grid walks target columns) and Vd
  when drafting greedily. ``stepwise``: the draft must run step by step (a
  reduced vocabulary, greedy drafting), which the one-launch persistent
  draft does not; the table's persistent choice then runs step by step with
  the same tile (tuning.stepwise; as the native runtime does). ``hopper``:
  the call could run the Mosaic GPU block pass (tuning.choose), if this
  machine can.
  """
  if config is not None:
    if method is not None and method != config.method:
      raise ValueError(f"method={method!r} disagrees with config.method="
                       f"{config.method!r}")
    return config
  # The Mosaic GPU pass from the 256 bucket up only: below it its custom
  # call's host cost (TMA descriptors encoded per call) outweighs its gain
  # in a JAX call (B = 128 on an H200: 0.593 against the Triton pass's
  # 0.517 ms; docs/perf-notes.md change 37 (d)), though not in the native
  # runtime's captured draft, which takes the H200's B = 128 entry.
  hopper = (hopper and not interpret and _mosaic_available()
            and tuning._batch_bucket(batch) >= JAX_MOSAIC_FROM)  # noqa: SLF001
  # The rule's partial last tiles (B = 136, 200) included: a JAX call ran
  # them 12% faster than the Triton pass on an H100 (change 58 (b)).
  config = tuning.choose(method, batch, vocab, rank, interpret=interpret,
                         hopper=hopper, gpu=_gpu_name() if hopper else None)
  return tuning.stepwise(config) if stepwise else config


def sample_draft(base_logits, anchor_tokens, head: MarkovHead, temperature,
                 seeds, positions, *, interpret: bool | None = None,
                 method: str | None = None,
                 config: tuning.KernelConfig | None = None,
                 check_values: bool = True, draft_to_target=None,
                 target_vocab: int | None = None) -> Draft:
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
    method: "fused" (the bias dot inside the block pass), "xla_bias" (the
      bias GEMM in XLA, as vLLM's design) or "mosaic" (the fused block pass
      as a Mosaic GPU kernel: Hopper, bfloat16, B a multiple of 64, V of
      128, R of 64; no draft_to_target); None picks the faster one for the
      shape (kernels/tuning.py), Mosaic GPU only where the table has it and
      the GPU is a Hopper.
    config: a full launch configuration, overriding the tuning table.
    check_values: read concrete arguments to check their values (waits for
      device arrays; inside jit nothing is read either way).
    draft_to_target: int [Vd] or None: a reduced draft vocabulary. base_logits
      is then [B, S, Vd] and head.proj [Vd, R] (the draft ids), and draft id
      j is target id ``draft_to_target[j]`` (vLLM's ``j + d2t[j]``), distinct
      values in [0, target_vocab); head.embed is indexed by target ids. The
      logits come back over the target vocabulary, -inf at every target id no
      draft id maps to, and the tokens are target ids, drawn by the rule over
      that target row (so in target-id order, ties to the lowest target id).
      Base and proj are read only at the Vd mapped columns; an unmapped
      column costs a -inf store; any map order costs the same (docs/api.md).
    target_vocab: with draft_to_target, the target vocabulary V (the logits'
      width); None: head.embed's rows.

  Returns:
    Draft(tokens int32 [B, S], logits float32 [B, S, V]), the logits being the
    pre-temperature values base + bias with the bias accumulated in float32.
    A row whose logits are all -inf or NaN draws token 0 (with a map, the
    lowest mapped target id); NaN logits are never drawn and are returned in
    ``logits`` as computed.

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
  map_kw = _target_map(draft_to_target, target_vocab, V, head, config,
                       check_values)
  map_kw.pop("permute", None)  # any map order: the slots are in target order
  # With a map the block pass walks the target columns.
  # The Mosaic GPU block pass takes bfloat16 and the plain layout only.
  hopper = (not map_kw and _dtype(base_logits) == jnp.bfloat16
            and head.proj.dtype == jnp.bfloat16)
  config = _config(config, method, B, map_kw.get("target_vocab", V),
                   head.rank, interpret, stepwise=bool(map_kw), hopper=hopper)
  return _sample_draft(_as_array(base_logits), _as_array(anchor_tokens),
                       head, _as_array(temperature), words,
                       _as_array(positions), config=config,
                       interpret=interpret, **map_kw)


def sample_draft_into(cache, base_logits, anchor_tokens, head: MarkovHead,
                      temperature, seeds, idx_map, positions, *,
                      interpret: bool | None = None,
                      method: str | None = None,
                      config: tuning.KernelConfig | None = None,
                      donate: bool = True, check_values: bool = True,
                      draft_to_target=None):
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
    draft_to_target: int [Vd] or None: a reduced draft vocabulary, as in
      :func:`sample_draft`, with the target vocabulary V the cache's width:
      cache [N, S, V], base_logits [B, S, Vd], head.proj [Vd, R]. Each row
      written holds -inf at the target ids no draft id maps to; the tokens
      are target ids.

  Returns:
    (tokens int32 [B, S], cache float32 [N, S, V]).

  Raises:
    As :func:`sample_draft`, and ValueError for a cache already donated to an
    earlier call. Every check runs before the call: a refused call writes
    nothing and donates nothing.
  """
  B, S, V = validate.check_common(base_logits, anchor_tokens, head, positions,
                                  check_values=check_values)
  cache_vocab = V
  if draft_to_target is not None:
    cache_shape = validate._shape(cache)
    cache_vocab = cache_shape[2] if len(cache_shape) == 3 else V
    increasing = validate.check_draft_to_target(
        draft_to_target, V, cache_vocab, validate._shape(head.embed)[0],
        check_values=check_values)
  N = validate.check_cache(cache, idx_map, B, S, cache_vocab,
                           check_values=check_values)
  validate.check_temperature(temperature, N, "N", check_values=check_values)
  words = rng.check_seeds(seeds, N, "N")
  interpret = _interpret_default(interpret)
  # The Mosaic GPU block pass takes bfloat16 and the plain layout only.
  hopper = (draft_to_target is None and _dtype(base_logits) == jnp.bfloat16
            and head.proj.dtype == jnp.bfloat16)
  config = _config(config, method, B, cache_vocab, head.rank, interpret,
                   stepwise=draft_to_target is not None, hopper=hopper)
  map_kw = {}
  if draft_to_target is not None:
    d2t, _ = _map_statics(draft_to_target, config, increasing)
    map_kw = dict(draft_to_target=d2t)
  fn = _sample_draft_into_donated if donate else _sample_draft_into
  return fn(_as_array(cache), _as_array(base_logits),
            _as_array(anchor_tokens), head, _as_array(temperature), words,
            _as_array(idx_map), _as_array(positions), config=config,
            interpret=interpret, **map_kw)


def greedy_draft(base_logits, anchor_tokens, head: MarkovHead, *,
                 draft_to_target=None, target_vocab: int | None = None,
                 interpret: bool | None = None,
                 config: tuning.KernelConfig | None = None,
                 check_values: bool = True) -> jax.Array:
  """Greedy drafting without a cache: the argmax chain, nothing written.

  Step s takes ``tokens[b, s] = argmax(base_logits[b, s] + head.proj @
  head.embed[prev[b]])`` (lowest index on ties, NaN as -inf; 0 for a row with
  nothing finite), prev starting at ``anchor_tokens[b]``: exactly the tokens
  of :func:`sample_draft` at temperature 0. No logits are stored and no
  [*, V] float32 array is allocated: the block pass keeps only each block's
  max and first argmax, and the select pass reads those.

  Args:
    base_logits: [B, S, V] (or [B, S, Vd] with draft_to_target) bf16, fp16 or
      fp32.
    anchor_tokens: int [B], the token before the first draft position.
    head: the Markov head (embed [V_in, R], proj [V or Vd, R]).
    draft_to_target: int [Vd] or None, a reduced draft vocabulary as in
      :func:`sample_draft`: the tokens are then target ids, the argmax in
      target-id order over the mapped ids. Only the Vd draft columns are
      computed (nothing is stored); a map not known to be increasing is
      sorted in the call, with a permuted copy of base and proj.
    target_vocab: with draft_to_target, the target vocabulary V (checked
      against the map's values); None: head.embed's rows.
    interpret: run the Pallas kernels in interpret mode; None picks it on any
      backend but GPU.
    config: a launch configuration (select "pass" or "tail"), overriding the
      tuning table.
    check_values: read concrete arguments to check their values.

  Returns:
    tokens int32 [B, S].
  """
  B, S, V = validate.check_greedy(base_logits, anchor_tokens, head,
                                  check_values=check_values)
  interpret = _interpret_default(interpret)
  config = _config(config, None, B, V, head.rank, interpret, stepwise=True)
  if config.select == "persistent":
    raise ValueError("greedy_draft runs step by step: config.select must be "
                     "'pass' or 'tail', got 'persistent'")
  map_kw = _target_map(draft_to_target, target_vocab, V, head, config,
                       check_values)
  map_kw.pop("target_vocab", None)
  return _greedy_draft(_as_array(base_logits), _as_array(anchor_tokens), head,
                       config=config, interpret=interpret, **map_kw)
