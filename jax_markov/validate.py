"""Argument checks that raise before anything compiles or runs.

Shapes and dtypes are checked always (they are static, also under jit); booleans
are refused where integers are expected. Values (negative or NaN temperature,
anchor ids outside the embedding table, positions outside [0, 2^31), state rows
outside the cache or named twice in a step) are checked when the argument is
concrete: a NumPy array, a Python value, or a jax.Array outside a trace when
``check_values`` is on; reading a device array's values waits for it, so hot
loops pass ``check_values=False``. Inside jit nothing is read; what then happens
is documented in docs/limitations.md. Every check runs before the jitted call,
so a refused call writes nothing and donates nothing.
"""

from __future__ import annotations

import functools
import weakref

import jax
import jax.numpy as jnp
import numpy as np


def _shape(x):
  shape = getattr(x, "shape", None)
  return tuple(shape) if shape is not None else np.shape(x)


def _dtype(x):
  return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def _concrete(x, check_values: bool):
  """The value of x as a NumPy array, or None where it is not to be read."""
  if isinstance(x, jax.core.Tracer):
    return None
  if isinstance(x, jax.Array):
    return np.asarray(x) if check_values else None
  return np.asarray(x)


def _require(cond: bool, msg, exc=ValueError):
  """Raises exc(msg) unless cond; msg may be a callable, formatted only then."""
  if not cond:
    raise exc(msg() if callable(msg) else msg)


# Cached: jnp.issubdtype costs microseconds, and these run on every call.
@functools.lru_cache(maxsize=None)
def _is_float(dtype) -> bool:
  return bool(jnp.issubdtype(dtype, jnp.floating))


@functools.lru_cache(maxsize=None)
def _is_int(dtype) -> bool:
  # bool is not an integer dtype to NumPy either: True as a token id, a
  # position or a state row is refused.
  return bool(jnp.issubdtype(dtype, jnp.integer))


POSITION_END = 1 << 31  # positions are non-negative int32


def _check_position_values(pos, where: str = ""):
  bad = (pos < 0) | (pos >= POSITION_END)
  _require(not bad.any(),
           lambda: f"{where}positions must be in [0, 2**31) (non-negative int32: "
           f"the draw's key takes 32 bits), got {pos[bad][:8].tolist()}")


def check_positions(positions, B: int, S: int | None, *, check_values: bool,
                    where: str = ""):
  """positions int [B, S] (any S when S is None), values in [0, 2^31)."""
  shape = _shape(positions)
  _require(len(shape) == 2 and shape[0] == B and (S is None or shape[1] == S),
           lambda: f"{where}positions must be [B, S] with B={B}"
           f"{'' if S is None else f', S={S}'}, got shape {shape}")
  _require(_is_int(_dtype(positions)),
           lambda: f"{where}positions must be integers, got {_dtype(positions)}",
           TypeError)
  pos = _concrete(positions, check_values)
  if pos is not None:
    _check_position_values(pos, where)


def _check_head(embed_shape, embed_dtype, proj_shape, proj_dtype, vocab: int):
  _require(len(embed_shape) == 2, lambda: f"head.embed must be [V_in, R], got shape {embed_shape}")
  _require(len(proj_shape) == 2, lambda: f"head.proj must be [V, R], got shape {proj_shape}")
  _require(_is_float(embed_dtype) and _is_float(proj_dtype),
           lambda: f"head weights must be floating point, got {embed_dtype} and {proj_dtype}",
           TypeError)
  _require(embed_dtype == proj_dtype,
           lambda: f"head.embed and head.proj must share a dtype, got {embed_dtype} and {proj_dtype}",
           TypeError)
  _require(embed_shape[1] == proj_shape[1],
           lambda: f"rank R disagrees: head.embed is {embed_shape}, head.proj is {proj_shape}")
  _require(proj_shape[1] >= 1, "rank R must be >= 1")
  _require(proj_shape[0] == vocab,
           lambda: f"V disagrees: base_logits has V={vocab}, head.proj has {proj_shape[0]} rows")
  _require(embed_shape[0] >= vocab,
           lambda: f"head.embed has {embed_shape[0]} rows but every drawn token (< V={vocab}) "
           "is looked up in it: V_in must be >= V")


# Cached on the shapes and dtypes (errors are not cached: they raise again): a
# serving loop calls with the same signature every time, and these checks
# would otherwise cost tens of microseconds of Python per call.
@functools.lru_cache(maxsize=256)
def _check_common_shapes(base_shape, base_dtype, embed_shape, embed_dtype,
                         proj_shape, proj_dtype, anchors_shape, anchors_dtype,
                         positions_shape, positions_dtype):
  shape = base_shape
  _require(len(shape) == 3, lambda: f"base_logits must be [B, S, V], got shape {shape}")
  B, S, V = shape
  _require(B >= 1 and S >= 1 and V >= 1, lambda: f"base_logits has an empty dimension: {shape}")
  _require(_is_float(base_dtype),
           lambda: f"base_logits must be bf16, fp16 or fp32, got {base_dtype}", TypeError)
  _check_head(embed_shape, embed_dtype, proj_shape, proj_dtype, V)
  _require(anchors_shape == (B,),
           lambda: f"anchor_tokens must be [B]=[{B}], got shape {anchors_shape}")
  _require(_is_int(anchors_dtype),
           lambda: f"anchor_tokens must be integers, got {anchors_dtype}", TypeError)
  _require(positions_shape == (B, S),
           lambda: f"positions must be [B, S]=[{B}, {S}], got shape {positions_shape}")
  _require(_is_int(positions_dtype),
           lambda: f"positions must be integers, got {positions_dtype}", TypeError)
  return B, S, V


def check_common(base_logits, anchor_tokens, head, positions, *, check_values: bool):
  """Checks what both layouts share. Returns (B, S, V)."""
  B, S, V = _check_common_shapes(
      _shape(base_logits), _dtype(base_logits), _shape(head.embed),
      _dtype(head.embed), _shape(head.proj), _dtype(head.proj),
      _shape(anchor_tokens), _dtype(anchor_tokens), _shape(positions),
      _dtype(positions))
  anchors = _concrete(anchor_tokens, check_values)
  if anchors is not None:
    v_in = _shape(head.embed)[0]
    bad = (anchors < 0) | (anchors >= v_in)
    _require(not bad.any(),
             lambda: f"anchor_tokens outside the embedding table [0, {v_in}): "
             f"{anchors[bad][:8].tolist()}")
  pos = _concrete(positions, check_values)
  if pos is not None:
    _check_position_values(pos)
  return B, S, V


def check_temperature(temperature, n: int, what: str, *, check_values: bool):
  _require(_shape(temperature) == (n,),
           lambda: f"temperature must be [{what}]=[{n}], got shape {_shape(temperature)}")
  _require(_is_float(_dtype(temperature)) or _is_int(_dtype(temperature)),
           lambda: f"temperature must be real numbers, got {_dtype(temperature)}", TypeError)
  t = _concrete(temperature, check_values)
  if t is not None:
    _require(not np.isnan(t).any(), "temperature must not be NaN")
    _require(not (t < 0).any(), lambda: f"temperature must be >= 0, got {t[t < 0][:8].tolist()}")


def check_cache(cache, idx_map, B: int, S: int, V: int, *, check_values: bool):
  """Checks the state-indexed layout. Returns N, the cache's rows."""
  _require(not (isinstance(cache, jax.Array) and not isinstance(cache, jax.core.Tracer)
                and cache.is_deleted()),
           "cache has been deleted: it was donated to an earlier sample_draft_into "
           "call (donate=True, the default, updates the cache in place). Pass the "
           "cache that call returned, or donate=False to keep the argument")
  shape = _shape(cache)
  _require(len(shape) == 3 and shape[1:] == (S, V),
           lambda: f"cache must be [N, S, V]=[N, {S}, {V}], got shape {shape}")
  _require(_dtype(cache) == jnp.float32, lambda: f"cache must be float32, got {_dtype(cache)}",
           TypeError)
  _require(_shape(idx_map) == (B, S),
           lambda: f"idx_map must be [B, S]=[{B}, {S}], got shape {_shape(idx_map)}")
  _require(_is_int(_dtype(idx_map)), lambda: f"idx_map must be integers, got {_dtype(idx_map)}",
           TypeError)
  n = shape[0]
  idx = _concrete(idx_map, check_values)
  if idx is not None:
    bad = (idx < -1) | (idx >= n)
    _require(not bad.any(), lambda: f"idx_map outside [-1, N={n}): {idx[bad][:8].tolist()}")
    for s in range(S):
      rows = idx[:, s][idx[:, s] >= 0]
      _require(len(np.unique(rows)) == len(rows),
               lambda: f"idx_map[:, {s}] names a state row twice: two requests would write "
               "the same cache row")
  return n


def check_draft_to_target(draft_to_target, draft_vocab: int, target_vocab: int,
                          embed_rows: int, *, check_values: bool):
  """Checks a reduced draft vocabulary's map (``draft_to_target``).

  draft_to_target: int [Vd] with Vd the base logits' last dimension (and
  proj's rows), the target id of each draft id; values in [0, V) and
  distinct when concrete. V (target_vocab) >= Vd, and embed, which the
  drawn target ids index, must have V_in >= V rows.

  Returns:
    Whether the map is strictly increasing (the kernels then take base and
    proj as they are), or None where its values were not read.
  """
  shape = _shape(draft_to_target)
  _require(_is_int(_dtype(draft_to_target)),
           lambda: f"draft_to_target must be integers (the target id of each "
           f"draft id), got {_dtype(draft_to_target)}", TypeError)
  _require(shape == (draft_vocab,),
           lambda: f"draft_to_target must be [Vd]=[{draft_vocab}] (base_logits' "
           f"last dimension and head.proj's rows), got shape {shape}")
  _require(target_vocab >= draft_vocab,
           lambda: f"draft_to_target: the target vocabulary V={target_vocab} is "
           f"smaller than the draft vocabulary Vd={draft_vocab}")
  _require(embed_rows >= target_vocab,
           lambda: f"draft_to_target: head.embed has {embed_rows} rows but the "
           f"drawn target ids (< V={target_vocab}) are looked up in it: V_in "
           "must be >= V")
  device_map = (isinstance(draft_to_target, jax.Array) and
                not isinstance(draft_to_target, jax.core.Tracer))
  if device_map:
    # A jax.Array is immutable: its map is read and checked once per array
    # object (one host sync), whatever check_values says, so a serving loop
    # neither re-checks nor re-sorts it per call.
    hit = _MAP_FACTS.get(id(draft_to_target))
    if hit is not None and hit[0]() is draft_to_target and hit[1] == target_vocab:
      return hit[2]
    d2t = np.asarray(draft_to_target)
  else:
    d2t = _concrete(draft_to_target, check_values)
  if d2t is None:
    return None
  bad = (d2t < 0) | (d2t >= target_vocab)
  _require(not bad.any(),
           lambda: f"draft_to_target outside the target vocabulary [0, "
           f"{target_vocab}): {d2t[bad][:8].tolist()}")
  values, counts = np.unique(d2t, return_counts=True)
  _require(len(values) == len(d2t),
           lambda: "draft_to_target maps two draft ids to the same target "
           f"id: {values[counts > 1][:8].tolist()}")
  increasing = bool((np.diff(d2t.astype(np.int64)) > 0).all())
  if device_map:
    key = id(draft_to_target)
    _MAP_FACTS[key] = (weakref.ref(draft_to_target,
                                   lambda _, k=key: _MAP_FACTS.pop(k, None)),
                       target_vocab, increasing)
  return increasing


# id(jax.Array map) -> (weakref, target_vocab, increasing): see
# check_draft_to_target.
_MAP_FACTS: dict[int, tuple] = {}


def check_greedy(base_logits, anchor_tokens, head, *, check_values: bool):
  """check_common for :func:`jax_markov.greedy_draft` (no positions). (B, S, V)."""
  shape = _shape(base_logits)
  positions_shape = shape[:2] if len(shape) == 3 else (None, None)
  B, S, V = _check_common_shapes(
      shape, _dtype(base_logits), _shape(head.embed), _dtype(head.embed),
      _shape(head.proj), _dtype(head.proj), _shape(anchor_tokens),
      _dtype(anchor_tokens), positions_shape, np.dtype(np.int32))
  anchors = _concrete(anchor_tokens, check_values)
  if anchors is not None:
    v_in = _shape(head.embed)[0]
    bad = (anchors < 0) | (anchors >= v_in)
    _require(not bad.any(),
             lambda: f"anchor_tokens outside the embedding table [0, {v_in}): "
             f"{anchors[bad][:8].tolist()}")
  return B, S, V
