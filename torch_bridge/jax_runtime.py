"""The JAX runtime: the draft as one XLA program per bucket, over DLPack.

The speculator's torch buffers are imported into JAX through DLPack (zero
copy, imported once while they stay at a fixed address), the chain runs as
``jm.sample_draft`` in one compiled JAX program per batch bucket, and the
tokens and pre-temperature logits are written back into the speculator's
buffers on torch's current stream, without a device synchronize (see
dlpack.py for the ordering). For JAX-owned workflows and where the native
runtime cannot run; JAX work cannot be captured into a torch CUDA graph.

Importing this module sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless it
is set: JAX must not grab most of the GPU in a process where torch allocates
too. It only takes effect if JAX has not initialised its GPU backend yet; a
warning says so otherwise.
"""

from __future__ import annotations

import os
import warnings

_PREALLOC = "XLA_PYTHON_CLIENT_PREALLOCATE"
_PREALLOC_USER_VALUE = os.environ.get(_PREALLOC)
os.environ.setdefault(_PREALLOC, "false")

# pylint: disable=wrong-import-position
import collections
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

import jax_markov as jm
from jax_markov import head as _head
from torch_bridge import buckets as _buckets
from torch_bridge import checks
from torch_bridge import dlpack as _dl


def _backends_initialized() -> bool:
  try:
    from jax._src import xla_bridge  # pylint: disable=g-import-not-at-top
    return xla_bridge.backends_are_initialized()
  except Exception:  # pragma: no cover - private API moved
    return False


_BACKENDS_UP_AT_IMPORT = _backends_initialized()
_prealloc_warned = False


def check_preallocation() -> bool:
  """Warns (once) if JAX's GPU backend was initialised with preallocation.

  JAX's default preallocates 75% of GPU memory when its GPU backend starts;
  with torch (and Triton) allocating in the same process, that starves torch
  and was seen alongside illegal-address errors at large sizes. This module
  sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` on import, which only helps if
  JAX's backend starts afterwards.

  Returns:
    False if a GPU backend is up and was started with preallocation on (a
    RuntimeWarning is issued the first time), True otherwise.
  """
  global _prealloc_warned
  if not _backends_initialized():
    return True
  value = (_PREALLOC_USER_VALUE if _BACKENDS_UP_AT_IMPORT
           else os.environ.get(_PREALLOC))
  if value is not None and value.strip().lower() in ("false", "0"):
    return True
  try:
    has_gpu = any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    has_gpu = False
  if not has_gpu:
    return True
  if not _prealloc_warned:
    _prealloc_warned = True
    warnings.warn(
        "torch_bridge: JAX's GPU backend was initialised with memory "
        f"preallocation ({_PREALLOC}={value!r}); torch and JAX now compete for "
        f"GPU memory. Set {_PREALLOC}=false before JAX starts (import "
        "torch_bridge before any JAX computation).", RuntimeWarning,
        stacklevel=2)
  return False


if _BACKENDS_UP_AT_IMPORT:
  check_preallocation()

_TRACES = 0


def trace_count() -> int:
  """How many times the JAX runtime's step has been traced (one per compile)."""
  return _TRACES


class _Layout(NamedTuple):
  """Static layout flags: which int inputs arrive as int64 word pairs."""
  idx_wide: bool
  pos_wide: bool
  anchor_wide: bool
  ids_wide: bool
  seeds_wide: bool
  interpret: bool | None  # passed to jm.sample_draft (True on CPU)


def _narrow(words: jax.Array, wide: bool) -> jax.Array:
  """int32 values of an int buffer; int64 crossed as [lo, hi] int32 pairs.

  An int64 value outside the int32 range saturates to int32's min or max,
  never cut to its low word (which would alias a valid row, index or token):
  a state row then counts as padding, an anchor index or token is clamped.
  """
  if not wide:
    return words
  pairs = words.reshape(-1, 2)
  lo, hi = pairs[:, 0], pairs[:, 1]
  fits = hi == jnp.right_shift(lo, 31)  # hi is lo's sign extension
  info = jnp.iinfo(jnp.int32)
  return jnp.where(fits, lo, jnp.where(hi < 0, info.min, info.max))


def _position_keys(words: jax.Array, count: int, wide: bool) -> jax.Array:
  """The int32 key ``pos - 1`` of each draw, pos clamped into [1, 2**31].

  A position outside (unchecked without check_values) is clamped, never cut
  to its low word: that would reuse another position's uniform.
  """
  if not wide:
    pos = words[:count]
    return jnp.where(pos >= 1, pos - 1, 0)
  pairs = words[:2 * count].reshape(count, 2)
  lo, hi = pairs[:, 0], pairs[:, 1]
  int_min = jnp.iinfo(jnp.int32).min
  in_range = (hi == 0) & ((lo >= 1) | (lo == int_min))
  too_low = (hi < 0) | ((hi == 0) & (lo == 0))
  return jnp.where(in_range, lo - 1,  # wraps 2**31 to 2**31 - 1
                   jnp.where(too_low, 0, jnp.iinfo(jnp.int32).max))


def _anchors(input_ids, anchor_idx, bp, vocab_in, live, layout):
  """input_ids[anchor_idx[b]] per request, clamped into the embedding."""
  ids = _narrow(input_ids, layout.ids_wide)
  aidx = _narrow(anchor_idx, layout.anchor_wide)[:bp]
  aidx = jnp.where(aidx < 0, aidx + ids.shape[0], aidx)
  anchor = jnp.take(ids, aidx, mode="clip")
  return jnp.where(live, jnp.clip(anchor, 0, vocab_in - 1), 0)


def _greedy_impl(base, w1, w2, input_ids, anchor_idx, n, targets=None, *,
                 layout: _Layout, target_vocab: int | None = None):
  """Greedy drafting (no cache): int32 [Bp * S] tokens (target ids)."""
  global _TRACES
  _TRACES += 1
  bp = base.shape[0]
  live = jnp.arange(bp) < n
  anchor = _anchors(input_ids, anchor_idx, bp, w1.shape[0], live, layout)
  tokens = jm.greedy_draft(base, anchor, _head.MarkovHead(w1, w2),
                           draft_to_target=targets, target_vocab=target_vocab,
                           interpret=layout.interpret, check_values=False)
  return tokens.reshape(-1).astype(jnp.int32)


_greedy = jax.jit(_greedy_impl, static_argnames=("layout", "target_vocab"))


def _step_impl(base, w1, w2, input_ids, anchor_idx, temperature, seeds,
               idx_map, sample_pos, cache_row0, n, targets=None, *,
               layout: _Layout, target_vocab: int | None = None):
  """Runs the chain for one bucket and lays out the results for torch.

  Args:
    base: [Bp, S, V] base logits (bf16/fp16/fp32); rows >= n are padding.
    w1, w2: the head, [V_in, R] and [V, R].
    input_ids, anchor_idx: flat int32 words; anchor of request b is
      ``input_ids[anchor_idx[b]]``.
    temperature: [N] float; seeds: flat int32 words of [N] seeds.
    idx_map, sample_pos: flat int32 words, request-major, >= Bp * S entries.
    cache_row0: float32 [V], the current ``cache[0, 0]`` (see below).
    n: int32 scalar, the number of live requests.
    targets: int32 [Vd], the target id of each draft column (a reduced draft
      vocabulary; base and w2 have Vd columns / rows), or None.
    layout: static flags.
    target_vocab: V with targets (the cache's width).

  Returns:
    ints: int32 [3 * Bp * S]: first Bp * S int64 (as [lo, hi] pairs) flat
      destination rows into ``cache.view(N * S, V)``, then the tokens [Bp, S].
    logits: float32 [Bp * S, V], the row to write at each destination.
    Torch copies the first ``n * S`` rows. A step that writes nothing (state
    row -1) gets the destination and row of the first step that writes (a
    duplicate write of identical bytes), or, if no step writes, destination
    0 with the current ``cache[0, 0]`` (a write of what is there), so the
    copy is a fixed-size ``index_copy_`` without a host sync.
  """
  global _TRACES
  _TRACES += 1
  bp, s_len, vocab = base.shape
  num_rows = temperature.shape[0]
  live = jnp.arange(bp) < n
  idx = _narrow(idx_map, layout.idx_wide)[:bp * s_len].reshape(bp, s_len)
  keys = _position_keys(sample_pos, bp * s_len, layout.pos_wide).reshape(
      bp, s_len)
  # Out-of-range state rows are treated as padding: they must never reach
  # torch's index_copy_ (a device-side assert on CUDA).
  valid = live[:, None] & (idx >= 0) & (idx < num_rows)

  # One state row per request (vLLM's layout): its first valid step's row.
  has = jnp.any(valid, axis=1)
  s0 = jnp.argmax(valid, axis=1)
  row = jnp.where(has, jnp.take_along_axis(idx, s0[:, None], axis=1)[:, 0], 0)
  temp = jnp.where(has, temperature[row].astype(jnp.float32), 0.0)
  # Unchecked values draw greedily rather than from an inverted (T < 0) or
  # NaN distribution: the same rule as the native runtime's.
  temp = jnp.where(temp > 0, temp, 0.0)
  if layout.seeds_wide:
    pairs = seeds.reshape(-1, 2)
    lo, hi = pairs[:, 0], pairs[:, 1]
  else:  # int32 seeds sign-extend, as rng.seed_words does
    lo = seeds
    hi = jnp.where(seeds < 0, -1, 0).astype(jnp.int32)
  words = jax.lax.bitcast_convert_type(jnp.stack([hi, lo], axis=-1),
                                       jnp.uint32)[row]
  positions = jnp.where(valid, keys, 0)

  anchor = _anchors(input_ids, anchor_idx, bp, w1.shape[0], live, layout)
  tokens, logits = jm.sample_draft(base, anchor, _head.MarkovHead(w1, w2),
                                   temp, words, positions,
                                   interpret=layout.interpret,
                                   draft_to_target=targets,
                                   target_vocab=target_vocab,
                                   check_values=False)
  vocab = logits.shape[-1]

  rows = bp * s_len
  logits = logits.reshape(rows, vocab).astype(jnp.float32)
  flat = (idx * s_len + jnp.arange(s_len, dtype=idx.dtype)[None]).reshape(-1)
  valid_f = valid.reshape(-1)
  any_valid = jnp.any(valid_f)
  first = jnp.argmax(valid_f)
  dst = jnp.where(valid_f, flat, jnp.where(any_valid, flat[first], 0))
  fill = jnp.where(any_valid, logits[first], cache_row0.astype(jnp.float32))
  needs_fill = jnp.repeat(live, s_len) & ~valid_f
  fix = jnp.where(needs_fill, jnp.arange(rows), rows)  # rows: dropped
  logits = logits.at[fix].set(jnp.broadcast_to(fill, logits.shape),
                              mode="drop")
  dst_words = jnp.stack([dst.astype(jnp.int32), jnp.zeros_like(dst, jnp.int32)],
                        axis=-1).reshape(-1)
  ints = jnp.concatenate([dst_words, tokens.reshape(-1).astype(jnp.int32)])
  return ints, logits


_step = jax.jit(_step_impl, static_argnames=("layout", "target_vocab"))

_MAX_PENDING = 8

# The imported spec buffers, in _step's argument order after the base:
# (name, getter, how it is imported). "words": int32 words of an int tensor;
# "row0": only the first row of the cache.
_SLOTS = (
    (checks.W1, lambda s: s.model.model.markov_head.markov_w1.weight,
     "tensor"),
    (checks.W2, lambda s: s.model.model.markov_head.markov_w2.weight,
     "tensor"),
    ("spec.input_buffers.input_ids", lambda s: s.input_buffers.input_ids,
     "words"),
    ("spec._anchor_idx", lambda s: s._anchor_idx, "words"),  # noqa: SLF001
    ("spec.temperature", lambda s: s.temperature, "tensor"),
    ("spec.seeds", lambda s: s.seeds, "words"),
    ("spec.sample_idx_mapping", lambda s: s.sample_idx_mapping, "words"),
    ("spec.sample_pos", lambda s: s.sample_pos, "words"),
    (checks.CACHE, lambda s: checks.cache_tensor(s.draft_logits), "row0"),
)


class JaxRuntime:
  """Runs a hook's draft through JAX (see the module docstring).

  Per request the chain uses the temperature and seed of the request's state
  row: every valid step of a request must map to the same row, as vLLM lays
  it out (``check_values=True`` verifies it).
  """

  name = "jax"
  capturable = False
  one_row_per_request = True

  def __init__(self, hook):
    self.hook = hook
    self.imports = _dl.ImportCache()
    self._pad: torch.Tensor | None = None
    self._n_arrays: dict[tuple[Any, int], jax.Array] = {}
    self._pending: collections.deque = collections.deque()
    self._free_events: list = []
    self._cache_flat: tuple[tuple, torch.Tensor] | None = None
    self._layout: _Layout | None = None
    self._device = None
    self._prealloc_checked = False

  def reset(self, device: torch.device) -> None:
    """Forgets what was validated against another device."""
    self.imports.clear()
    self._layout = None
    self._cache_flat = None
    self._pad = None
    self._device = device

  def _call(self, base_j, args, n_arr, layout, mode):
    """The jitted draft for this mode: (ints, logits) or (tokens, None)."""
    cmap = mode.cmap
    extra = () if cmap is None else (args[-1],)
    kw = {} if cmap is None else {"target_vocab": cmap.target_vocab}
    if mode.greedy:
      return _greedy(base_j, *args[:4], n_arr, *extra, layout=layout,
                     **kw), None
    nargs = len(_SLOTS)
    return _step(base_j, *args[:nargs], n_arr, *extra, layout=layout, **kw)

  def warmup(self, spec, s_len: int, base_dtype, mode) -> int:
    args, layout = self._cached_args(spec, s_len, mode)
    w2 = spec.model.model.markov_head.markov_w2.weight
    jdev = _dl.jax_device(w2)
    jdtype = jnp.dtype(str(base_dtype).removeprefix("torch."))
    for bp in self.hook.buckets:
      base = jax.device_put(
          jnp.zeros((bp, s_len, self.hook.vocab_size), jdtype), jdev)
      out = self._call(base, args, self._n_array(jdev, 0), layout, mode)
      jax.block_until_ready(out[0])
    return len(self.hook.buckets)

  def run(self, spec, n: int, s_len: int, base: torch.Tensor, mode) -> None:
    """Drafts for n requests from base [n, S, Vd]; writes tokens and cache."""
    if self._device.type == "cuda":
      if not self._prealloc_checked:
        self._prealloc_checked = True
        check_preallocation()
      self._retire()
    bp = _buckets.bucket_for(self.hook.buckets, n)
    base_src = base if bp == n and base.is_contiguous() else \
        self._padded(base, n, bp, s_len)
    args, layout = self._cached_args(spec, s_len, mode)
    # The fresh import of the base logits is what orders this JAX call
    # after torch's current stream (cached imports carry no ordering).
    base_j = _dl.import_tensor(base_src)
    self.imports.imports += 1
    ints, logits = self._call(base_j, args, self._n_array(base_j.device, n),
                              layout, mode)
    ints_t = _dl.export_array(ints)
    logits_t = None
    if mode.greedy:
      spec.draft_tokens[:n, :s_len].copy_(
          ints_t[:n * s_len].view(n, s_len))
    else:
      logits_t = _dl.export_array(logits)
      rows = n * s_len
      dst = ints_t[:2 * bp * s_len].view(torch.int64)[:rows]
      tokens = ints_t[2 * bp * s_len:].view(bp, s_len)[:n]
      spec.draft_tokens[:n, :s_len].copy_(tokens)
      self._flat_cache(spec.draft_logits).index_copy_(0, dst,
                                                      logits_t[:rows])
    if self._device.type == "cuda":
      # JAX frees its outputs and torch frees the base logits as soon as
      # they are dropped, neither knowing the other's queued work: hold
      # them until the copies above have run.
      event = self._free_events.pop() if self._free_events else \
          torch.cuda.Event()
      event.record(torch.cuda.current_stream(self._device))
      self._pending.append(
          (event, (base, base_src, base_j, ints, logits, ints_t, logits_t)))

  # -- internals --------------------------------------------------------------

  def _retire(self):
    """Releases what the finished calls held; bounds what is held."""
    while self._pending and self._pending[0][0].query():
      self._free_events.append(self._pending.popleft()[0])
    while len(self._pending) > _MAX_PENDING:
      event, _ = self._pending.popleft()
      event.synchronize()
      self._free_events.append(event)

  def _padded(self, base, n, bp, s_len):
    pad = self._pad
    if pad is None or pad.shape[1] != s_len or pad.dtype != base.dtype:
      # Rows past n hold stale logits of earlier calls: they are padding and
      # write nothing.
      pad = torch.zeros((self.hook.max_num_reqs, s_len, self.hook.vocab_size),
                        dtype=base.dtype, device=self._device)
      self._pad = pad
    if self._pending:
      # The previous call's JAX program may still read the buffer; torch's
      # current stream is ordered after it already, unless the engine
      # switched streams since.
      torch.cuda.current_stream(self._device).wait_event(self._pending[-1][0])
    pad[:n].copy_(base)
    return pad[:bp]

  def _n_array(self, jdev, n: int) -> jax.Array:
    key = (jdev, n)
    arr = self._n_arrays.get(key)
    if arr is None:
      arr = jax.device_put(np.int32(n), jdev)
      self._n_arrays[key] = arr
    return arr

  def _cached_args(self, spec, s_len: int, mode):
    """The cached imports of every fixed spec buffer, and the layout flags.

    Greedy drafting has no cache (its slot is skipped); a reduced vocabulary
    adds the target id of each draft column, last.
    """
    imports = self.imports
    imports_before = imports.imports
    arrays = []
    slots = _SLOTS[:-1] if mode.greedy else _SLOTS
    for name, get, kind in slots:
      t = get(spec)
      arr = imports.lookup(name, t) if isinstance(t, torch.Tensor) else None
      if arr is None:  # new or changed buffer: validate, then import
        self.hook.check_buffer(name, t, s_len, force=True,
                               mapped=mode.cmap is not None)
        if kind == "words":
          derived = _dl.int32_words(t)
        elif kind == "row0":  # only cache[0, 0] is read, see _step_impl
          derived = t.detach()[0, 0]
        else:
          derived = t.detach()
        arr = imports.store(name, t, derived)
      arrays.append(arr)
    if mode.cmap is not None:
      targets = mode.cmap.targets
      arr = imports.lookup("map", targets)
      arrays.append(arr if arr is not None else
                    imports.store("map", targets, targets))
    layout = self._layout
    if layout is None or imports.imports != imports_before:
      # Dtypes can only have changed with a re-import.
      wide = [get(spec).dtype == torch.int64 for _, get, _ in _SLOTS[2:8]]
      layout = self._layout = _Layout(
          ids_wide=wide[0], anchor_wide=wide[1], seeds_wide=wide[3],
          idx_wide=wide[4], pos_wide=wide[5],
          interpret=True if self._device.type == "cpu" else None)
    return tuple(arrays), layout

  def _flat_cache(self, dl) -> torch.Tensor:
    """``spec.draft_logits.values`` viewed as [M * S, V] (validated before)."""
    cache = checks.cache_tensor(dl)
    key = _dl.tensor_key(cache)
    if self._cache_flat is None or self._cache_flat[0] != key:
      self._cache_flat = (key, cache.view(-1, cache.shape[-1]))
    return self._cache_flat[1]
