"""PyTorch bridge: jax_markov as the Markov-step hook of a torch serving engine.

vLLM's ``DSparkSpeculator._sample_sequential`` hands its sequential Markov
steps to a hook ``sampler(spec, num_reqs, head_hidden) -> bool``.
:class:`FusedMarkovSampler` is such a hook backed by jax_markov: it reads the
speculator's torch buffers through DLPack (zero copy, imported once while they
stay at a fixed address), runs the chain of ``jm.sample_draft`` in one
compiled JAX program per batch bucket, and writes the drafted tokens and the
pre-temperature logits back into the speculator's buffers, ordered with
torch's current stream and without a device synchronize. See
docs/torch_bridge.md for the contract, the buckets, the ordering and the
limits (no CUDA graph capture).

Importing this module sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` unless it is
set: JAX must not grab most of the GPU in a process where torch allocates too.
It only takes effect if JAX has not initialised its GPU backend yet; a warning
says so otherwise.
"""

from __future__ import annotations

import os
import warnings

_PREALLOC = "XLA_PYTHON_CLIENT_PREALLOCATE"
_PREALLOC_USER_VALUE = os.environ.get(_PREALLOC)
os.environ.setdefault(_PREALLOC, "false")

# pylint: disable=wrong-import-position
import collections
import inspect
import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import torch

from jax_markov import head as _head
from torch_bridge import buckets as _buckets
from torch_bridge import dlpack as _dl

__all__ = ["FusedMarkovSampler", "BridgeInputError", "check_preallocation",
           "trace_count"]


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
  and was seen alongside illegal-address errors at large sizes. This bridge
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


class BridgeInputError(ValueError, TypeError):
  """A spec attribute has the wrong type, dtype, device, shape or layout."""


def _describe(t) -> str:
  if not isinstance(t, torch.Tensor):
    return f"an object of type {type(t).__name__}"
  s = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}"
  return s if t.is_contiguous() else s + " (non-contiguous)"


def _dtype_names(dtypes) -> str:
  return "/".join(str(d).removeprefix("torch.") for d in dtypes)


_INTS = (torch.int32, torch.int64)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)

# ----------------------------------------------------------------------------
# The compiled step: one program per (bucket, buffer layout).
# ----------------------------------------------------------------------------

_TRACES = 0
_draft_impl: tuple[Any, bool] | None = None


def trace_count() -> int:
  """How many times the bridge's step has been traced (one per compilation)."""
  return _TRACES


def _sample_draft_fn():
  """jm.sample_draft, or the reference while jax_markov exports none."""
  global _draft_impl
  if _draft_impl is None:
    import jax_markov  # pylint: disable=g-import-not-at-top
    fn = getattr(jax_markov, "sample_draft", None)
    if fn is None:
      from jax_markov import reference  # pylint: disable=g-import-not-at-top
      _draft_impl = (reference.sample_draft, False)
    else:
      params = inspect.signature(fn).parameters
      _draft_impl = (fn, "interpret" in params)
  return _draft_impl


class _Layout(NamedTuple):
  """Static layout flags: which int inputs arrive as int64 word pairs."""
  idx_wide: bool
  pos_wide: bool
  anchor_wide: bool
  ids_wide: bool
  seeds_wide: bool
  interpret: bool | None  # passed to jm.sample_draft (True on CPU)


def _narrow(words: jax.Array, wide: bool) -> jax.Array:
  # int64 crossed as [lo, hi] int32 pairs; every value here fits in int32.
  return words.reshape(-1, 2)[:, 0] if wide else words


def _step_impl(base, w1, w2, input_ids, anchor_idx, temperature, seeds,
               idx_map, sample_pos, cache_row0, n, *, layout: _Layout):
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
    layout: static flags.

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
  pos = _narrow(sample_pos, layout.pos_wide)[:bp * s_len].reshape(bp, s_len)
  # Out-of-range state rows are treated as padding: they must never reach
  # torch's index_copy_ (a device-side assert on CUDA).
  valid = live[:, None] & (idx >= 0) & (idx < num_rows)

  # One state row per request (vLLM's layout): its first valid step's row.
  has = jnp.any(valid, axis=1)
  s0 = jnp.argmax(valid, axis=1)
  row = jnp.where(has, jnp.take_along_axis(idx, s0[:, None], axis=1)[:, 0], 0)
  temp = jnp.where(has, temperature[row].astype(jnp.float32), 0.0)
  if layout.seeds_wide:
    pairs = seeds.reshape(-1, 2)
    lo, hi = pairs[:, 0], pairs[:, 1]
  else:  # int32 seeds sign-extend, as rng.seed_words does
    lo = seeds
    hi = jnp.where(seeds < 0, -1, 0).astype(jnp.int32)
  words = jax.lax.bitcast_convert_type(jnp.stack([hi, lo], axis=-1),
                                       jnp.uint32)[row]
  positions = jnp.where(valid, jnp.maximum(pos - 1, 0), 0)

  ids = _narrow(input_ids, layout.ids_wide)
  aidx = _narrow(anchor_idx, layout.anchor_wide)[:bp]
  aidx = jnp.where(aidx < 0, aidx + ids.shape[0], aidx)
  anchor = jnp.take(ids, aidx, mode="clip")
  anchor = jnp.where(live, jnp.clip(anchor, 0, w1.shape[0] - 1), 0)

  fn, takes_interpret = _sample_draft_fn()
  kwargs = {"interpret": layout.interpret} if takes_interpret else {}
  tokens, logits = fn(base, anchor, _head.MarkovHead(w1, w2), temp, words,
                      positions, **kwargs)

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


_step = jax.jit(_step_impl, static_argnames=("layout",))

# ----------------------------------------------------------------------------
# The hook.
# ----------------------------------------------------------------------------

_MAX_PENDING = 8
_W1 = "spec.model.model.markov_head.markov_w1.weight"
_W2 = "spec.model.model.markov_head.markov_w2.weight"
_CACHE = "spec.draft_logits.values"


class _Rule(NamedTuple):
  """What a spec buffer must be: dtypes, a shape test and its description."""
  dtypes: tuple
  shape_ok: Any
  shape_desc: str
  contiguous: bool = True


def _cache_tensor(dl) -> torch.Tensor:
  # torch.Tensor has a .values method (sparse), so test the type first.
  return dl if isinstance(dl, torch.Tensor) else dl.values


# The imported spec buffers, in _step's argument order after the base:
# (name, getter, how it is imported). "words": int32 words of an int tensor;
# "row0": only the first row of the cache.
_SLOTS = (
    (_W1, lambda s: s.model.model.markov_head.markov_w1.weight, "tensor"),
    (_W2, lambda s: s.model.model.markov_head.markov_w2.weight, "tensor"),
    ("spec.input_buffers.input_ids", lambda s: s.input_buffers.input_ids,
     "words"),
    ("spec._anchor_idx", lambda s: s._anchor_idx, "words"),  # noqa: SLF001
    ("spec.temperature", lambda s: s.temperature, "tensor"),
    ("spec.seeds", lambda s: s.seeds, "words"),
    ("spec.sample_idx_mapping", lambda s: s.sample_idx_mapping, "words"),
    ("spec.sample_pos", lambda s: s.sample_pos, "words"),
    (_CACHE, lambda s: _cache_tensor(s.draft_logits), "row0"),
)


class FusedMarkovSampler:
  """The DSpark Markov-step hook for torch speculators, backed by jax_markov.

  ``sampler(spec, num_reqs, head_hidden)`` does what the eager loop of
  ``DSparkSpeculator._sample_sequential`` does, reading from ``spec`` (S =
  ``spec.num_speculative_steps``, M = ``max_num_reqs``, N = M state rows):

  * base logits: ``spec.model.compute_draft_logits(head_hidden[
    spec.sample_indices[:num_reqs * S]])``, [num_reqs * S, V] request-major,
    bf16/fp16/fp32 (computed in torch, as the reference hook does);
  * anchors: ``spec.input_buffers.input_ids[spec._anchor_idx[:num_reqs]]``;
  * head: ``spec.model.model.markov_head.markov_w1.weight`` [V_in, R] and
    ``.markov_w2.weight`` [V, R], of ``dtype``;
  * ``spec.sample_idx_mapping`` int32/int64 [M * S] or [M, S]: the state row
    of each (request, step), -1 = padding; ``spec.temperature`` float [N] and
    ``spec.seeds`` int64/int32 [N] per state row; ``spec.sample_pos``
    int32/int64 like the mapping: the predicted token's position, and the
    draw is keyed by ``sample_pos - 1``.

  It writes ``spec.draft_tokens[:num_reqs, :S]`` (int64/int32 [M, >= S]) and,
  for every valid (b, s), row ``spec.draft_logits.values[idx[b, s], s]``
  (float32 [M, S, V], contiguous) with the pre-temperature float32 logits,
  the same tokens and rows as ``jm.sample_draft_into``; nothing else changes.

  The chain runs per request with the temperature and seed of the request's
  state row (``jm.sample_draft``): every valid step of a request must map to
  the same state row, as vLLM lays it out; steps that map to -1 write
  nothing. ``check_values=True`` verifies this (with a host sync).

  Returns False without touching anything for configurations the hook does
  not cover, so the engine runs its own path: ``spec.draft_logits is None``
  (greedy drafting), a reduced draft vocabulary
  (``spec.model.draft_id_to_target_id`` set) or the confidence head enabled
  (``spec.confidence_config.enabled``).

  Attributes:
    max_num_reqs, vocab_size, rank, dtype: as constructed.
    buckets: the batch sizes compiled for (docs/torch_bridge.md).
  """

  def __init__(self, max_num_reqs: int, vocab_size: int, rank: int, dtype,
               *, buckets=None, check_values: bool = False,
               on_capture: str = "raise"):
    """Builds the hook.

    Args:
      max_num_reqs: M, the speculator's request capacity; the number of state
        rows of ``spec.temperature``, ``spec.seeds`` and the logits cache.
      vocab_size: V, the draft vocabulary (columns of the base logits, rows
        of ``markov_w2``).
      rank: R, the Markov head's rank.
      dtype: the head's dtype (a torch dtype, or its name, e.g. "bfloat16").
      buckets: batch sizes to compile for (default: powers of two below M,
        and M); see :func:`torch_bridge.buckets.normalize_buckets`.
      check_values: also verify the values of the index buffers on every
        call (state rows in range and one per request, anchors in the
        vocabulary, positions >= 1). Costs a device-to-host copy and sync per
        call: for debugging.
      on_capture: what a call inside torch CUDA graph capture does; JAX work
        cannot be captured into a torch graph. "raise" (default): raise
        RuntimeError. "fallback": return False, so the engine captures its
        own eager path instead.
    """
    if isinstance(dtype, str):
      dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if dtype not in _FLOATS:
      raise ValueError(f"dtype must be one of {_dtype_names(_FLOATS)}, "
                       f"got {dtype!r}")
    if on_capture not in ("raise", "fallback"):
      raise ValueError(f"on_capture must be 'raise' or 'fallback', got "
                       f"{on_capture!r}")
    self.max_num_reqs = operator.index(max_num_reqs)
    self.vocab_size = operator.index(vocab_size)
    self.rank = operator.index(rank)
    self.dtype = dtype
    self.buckets = _buckets.normalize_buckets(buckets, self.max_num_reqs)
    self.check_values = check_values
    self.on_capture = on_capture
    self._imports = _dl.ImportCache()
    self._checked: dict[str, tuple] = {}
    self._device: torch.device | None = None
    self._pad: torch.Tensor | None = None
    self._n_arrays: dict[tuple[Any, int], jax.Array] = {}
    self._pending: collections.deque = collections.deque()
    self._free_events: list = []
    self._cache_flat: tuple[tuple, torch.Tensor] | None = None
    self._layout: _Layout | None = None
    self._rule_cache: dict[int, dict[str, _Rule]] = {}
    self._prealloc_checked = False

  # -- public helpers ---------------------------------------------------------

  @property
  def import_count(self) -> int:
    """Number of DLPack imports so far (cached buffers count once)."""
    return self._imports.imports

  def is_zero_copy(self, slot: str) -> bool | None:
    """Whether the cached import of ``slot`` (e.g. "spec.seeds") aliases."""
    return self._imports.is_alias(slot)

  def warmup(self, spec, base_dtype=None) -> int:
    """Compiles the step for every bucket without writing anything.

    Args:
      spec: the speculator (its buffers are validated and imported).
      base_dtype: dtype of ``compute_draft_logits``'s output (default: the
        head dtype).

    Returns:
      The number of buckets compiled.
    """
    base_dtype = self.dtype if base_dtype is None else base_dtype
    s_len = self._num_steps(spec)
    w2 = spec.model.model.markov_head.markov_w2.weight
    self._set_device(w2.device)
    args, layout = self._cached_args(spec, s_len)
    jdev = _dl.jax_device(w2)
    jdtype = jnp.dtype(str(base_dtype).removeprefix("torch."))
    for bp in self.buckets:
      base = jax.device_put(jnp.zeros((bp, s_len, self.vocab_size), jdtype),
                            jdev)
      out = _step(base, *args, self._n_array(jdev, 0), layout=layout)
      jax.block_until_ready(out)
    return len(self.buckets)

  # -- the hook ---------------------------------------------------------------

  def __call__(self, spec, num_reqs: int, head_hidden: torch.Tensor) -> bool:
    """Drafts ``spec.num_speculative_steps`` tokens for ``num_reqs`` requests.

    Args:
      spec: the speculator (see the class docstring for what is read).
      num_reqs: requests in this batch, 0 <= num_reqs <= max_num_reqs.
      head_hidden: [T, H] hidden states the base logits are computed from;
        its device is the device of every spec buffer.

    Returns:
      True once the writes are queued (on GPU: on torch's current stream,
      after the JAX work; nothing is synchronized). False, with nothing
      written, for the configurations listed in the class docstring.

    Raises:
      BridgeInputError: a spec attribute has the wrong type, dtype, device,
        shape or layout; the message names it.
      RuntimeError: called during torch CUDA graph capture (on_capture=
        "raise").
    """
    n = operator.index(num_reqs)
    if not 0 <= n <= self.max_num_reqs:
      raise BridgeInputError(
          f"num_reqs: expected 0 <= num_reqs <= max_num_reqs="
          f"{self.max_num_reqs}, got {n}")
    dl = getattr(spec, "draft_logits", None)
    if dl is None:
      return False
    if getattr(spec.model, "draft_id_to_target_id", None) is not None:
      return False
    conf = getattr(spec, "confidence_config", None)
    if conf is not None and getattr(conf, "enabled", False):
      return False
    if not isinstance(head_hidden, torch.Tensor):
      raise BridgeInputError(
          f"head_hidden: expected a torch.Tensor, got {_describe(head_hidden)}")
    device = head_hidden.device
    is_cuda = device.type == "cuda"
    if is_cuda:
      if torch.cuda.is_current_stream_capturing():
        if self.on_capture == "fallback":
          return False
        raise RuntimeError(
            "torch_bridge.FusedMarkovSampler was called during torch CUDA "
            "graph capture; JAX work cannot be captured into a torch graph. "
            "Run the draft step uncaptured (e.g. vLLM cudagraph mode "
            "PIECEWISE or NONE), or pass on_capture='fallback'.")
      if not self._prealloc_checked:
        self._prealloc_checked = True
        check_preallocation()
      self._retire()
    self._set_device(device)
    s_len = self._num_steps(spec)
    if n == 0:
      return True

    with torch.no_grad():
      base_src, base = self._base_logits(spec, n, s_len, head_hidden)
      bp = base_src.shape[0]
      args, layout = self._cached_args(spec, s_len)
      if self.check_values:
        self._check_values(spec, n, s_len)
      # The fresh import of the base logits is what orders this JAX call
      # after torch's current stream (cached imports carry no ordering).
      base_j = _dl.import_tensor(base_src)
      self._imports.imports += 1
      ints, logits = _step(base_j, *args, self._n_array(base_j.device, n),
                           layout=layout)
      ints_t = _dl.export_array(ints)
      logits_t = _dl.export_array(logits)
      rows = n * s_len
      dst = ints_t[:2 * bp * s_len].view(torch.int64)[:rows]
      tokens = ints_t[2 * bp * s_len:].view(bp, s_len)[:n]
      spec.draft_tokens[:n, :s_len].copy_(tokens)
      self._flat_cache(dl).index_copy_(0, dst, logits_t[:rows])
      if is_cuda:
        # JAX frees its outputs and torch frees the base logits as soon as
        # they are dropped, neither knowing the other's queued work: hold
        # them until the copies above have run.
        event = self._free_events.pop() if self._free_events else \
            torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        self._pending.append(
            (event, (base, base_src, base_j, ints, logits, ints_t, logits_t)))
    return True

  # -- internals --------------------------------------------------------------

  def _retire(self):
    """Releases what the finished calls held; bounds what is held."""
    while self._pending and self._pending[0][0].query():
      self._free_events.append(self._pending.popleft()[0])
    while len(self._pending) > _MAX_PENDING:
      event, _ = self._pending.popleft()
      event.synchronize()
      self._free_events.append(event)

  def _set_device(self, device: torch.device):
    if device != self._device:
      # Everything cached was validated against the old device.
      self._imports.clear()
      self._checked.clear()
      self._layout = None
      self._cache_flat = None
      self._pad = None
      self._device = device

  def _num_steps(self, spec) -> int:
    s_len = getattr(spec, "num_speculative_steps", None)
    if isinstance(s_len, bool) or not isinstance(s_len, (int, np.integer)) \
        or s_len < 1:
      raise BridgeInputError(
          f"spec.num_speculative_steps: expected an int >= 1, got {s_len!r}")
    return int(s_len)

  def _n_array(self, jdev, n: int) -> jax.Array:
    key = (jdev, n)
    arr = self._n_arrays.get(key)
    if arr is None:
      arr = jax.device_put(np.int32(n), jdev)
      self._n_arrays[key] = arr
    return arr

  def _rules(self, s_len: int) -> dict[str, _Rule]:
    """What each spec buffer must be, for S = s_len (built once per S)."""
    rules = self._rule_cache.get(s_len)
    if rules is not None:
      return rules
    m, vocab, r = self.max_num_reqs, self.vocab_size, self.rank
    rows_ok = (lambda s: (len(s) == 2 and s[0] >= m and s[1] == s_len) or
               (len(s) == 1 and s[0] >= m * s_len))
    rows_desc = f"[max_num_reqs, S] = [{m}, {s_len}] or [{m * s_len}]"
    rules = {
        _W1: _Rule((self.dtype,),
                   lambda s: len(s) == 2 and s[0] >= vocab and s[1] == r,
                   f"[V_in >= vocab_size = {vocab}, rank = {r}]"),
        _W2: _Rule((self.dtype,), lambda s: s == (vocab, r),
                   f"[vocab_size, rank] = [{vocab}, {r}]"),
        "spec.input_buffers.input_ids": _Rule(
            _INTS, lambda s: len(s) == 1 and s[0] >= 1, "[num_tokens]"),
        "spec._anchor_idx": _Rule(_INTS, lambda s: len(s) == 1 and s[0] >= m,
                                  f"[>= max_num_reqs = {m}]"),
        "spec.temperature": _Rule(_FLOATS, lambda s: s == (m,),
                                  f"[max_num_reqs = {m}]"),
        "spec.seeds": _Rule(_INTS, lambda s: s == (m,),
                            f"[max_num_reqs = {m}]"),
        "spec.sample_idx_mapping": _Rule(_INTS, rows_ok, rows_desc),
        "spec.sample_pos": _Rule(_INTS, rows_ok, rows_desc),
        _CACHE: _Rule((torch.float32,), lambda s: s == (m, s_len, vocab),
                      f"[max_num_reqs, S, vocab_size] = [{m}, {s_len}, "
                      f"{vocab}]"),
        "spec.draft_tokens": _Rule(
            _INTS, lambda s: len(s) == 2 and s[0] >= m and s[1] >= s_len,
            f"[max_num_reqs = {m}, >= S = {s_len}]", contiguous=False),
        "spec.sample_indices": _Rule(
            _INTS, lambda s: len(s) == 1 and s[0] >= m * s_len,
            f"[>= max_num_reqs * S = {m * s_len}]", contiguous=False),
    }
    self._rule_cache[s_len] = rules
    return rules

  def _check(self, name: str, t, rule: _Rule):
    """Raises BridgeInputError naming ``name`` unless ``t`` fits ``rule``."""
    bad = (not isinstance(t, torch.Tensor) or t.device != self._device or
           t.dtype not in rule.dtypes or not rule.shape_ok(tuple(t.shape)) or
           (rule.contiguous and not t.is_contiguous()))
    if bad:
      layout = " (contiguous)" if rule.contiguous else ""
      raise BridgeInputError(
          f"{name}: expected {_dtype_names(rule.dtypes)} {rule.shape_desc}"
          f"{layout} on {self._device}, got {_describe(t)}")

  def _checked_once(self, name: str, t, s_len: int):
    """_check, skipped while ``t`` keeps the layout it last passed with."""
    key = _dl.tensor_key(t) if isinstance(t, torch.Tensor) else None
    if key is None or self._checked.get(name) != key:
      self._check(name, t, self._rules(s_len)[name])
      self._checked[name] = key

  def _base_logits(self, spec, n: int, s_len: int, head_hidden):
    """Computes the base logits as the reference hook does; pads to a bucket.

    Returns:
      (src, base): src [Bp, S, V] is what JAX imports (base itself when
      n == Bp, else the persistent padded buffer); base is torch's output.
    """
    m, vocab = self.max_num_reqs, self.vocab_size
    rows = n * s_len
    sample_indices = spec.sample_indices
    self._checked_once("spec.sample_indices", sample_indices, s_len)
    base = spec.model.compute_draft_logits(head_hidden[sample_indices[:rows]])
    if (not isinstance(base, torch.Tensor) or base.device != self._device or
        base.dtype not in _FLOATS or tuple(base.shape) != (rows, vocab)):
      raise BridgeInputError(
          f"spec.model.compute_draft_logits(...): expected "
          f"{_dtype_names(_FLOATS)} [num_reqs * S = {rows}, vocab_size = "
          f"{vocab}] on {self._device}, got {_describe(base)}")
    base = base.view(n, s_len, vocab) if base.is_contiguous() else \
        base.reshape(n, s_len, vocab)
    bp = _buckets.bucket_for(self.buckets, n)
    if bp == n and base.is_contiguous():
      return base, base
    pad = self._pad
    if pad is None or pad.shape[1] != s_len or pad.dtype != base.dtype:
      # Rows past n hold stale logits of earlier calls: they are padding and
      # write nothing.
      pad = torch.zeros((m, s_len, vocab), dtype=base.dtype,
                        device=self._device)
      self._pad = pad
    if self._pending:
      # The previous call's JAX program may still read the buffer; torch's
      # current stream is ordered after it already, unless the engine
      # switched streams since.
      torch.cuda.current_stream(self._device).wait_event(self._pending[-1][0])
    pad[:n].copy_(base)
    return pad[:bp], base

  def _cached_args(self, spec, s_len: int):
    """The cached imports of every fixed spec buffer, and the layout flags."""
    imports = self._imports
    imports_before = imports.imports
    arrays = []
    for name, get, kind in _SLOTS:
      t = get(spec)
      arr = imports.lookup(name, t) if isinstance(t, torch.Tensor) else None
      if arr is None:  # new or changed buffer: validate, then import
        self._check(name, t, self._rules(s_len)[name])
        if kind == "words":
          derived = _dl.int32_words(t)
        elif kind == "row0":  # only cache[0, 0] is read, see _step_impl
          derived = t.detach()[0, 0]
        else:
          derived = t.detach()
        arr = imports.store(name, t, derived)
      arrays.append(arr)
    self._checked_once("spec.draft_tokens", spec.draft_tokens, s_len)
    layout = self._layout
    if layout is None or imports.imports != imports_before:
      # Dtypes can only have changed with a re-import.
      wide = [get(spec).dtype == torch.int64 for _, get, _ in _SLOTS[2:]]
      layout = self._layout = _Layout(
          ids_wide=wide[0], anchor_wide=wide[1], seeds_wide=wide[3],
          idx_wide=wide[4], pos_wide=wide[5],
          interpret=True if self._device.type == "cpu" else None)
    return tuple(arrays), layout

  def _flat_cache(self, dl) -> torch.Tensor:
    """``spec.draft_logits.values`` viewed as [M * S, V] (validated before)."""
    cache = _cache_tensor(dl)
    key = _dl.tensor_key(cache)
    if self._cache_flat is None or self._cache_flat[0] != key:
      self._cache_flat = (key, cache.view(-1, cache.shape[-1]))
    return self._cache_flat[1]

  def _check_values(self, spec, n: int, s_len: int):
    """Host-side checks of the index values (check_values=True)."""
    m = self.max_num_reqs
    idx = spec.sample_idx_mapping.reshape(-1)[:n * s_len].view(n, s_len)
    idx = idx.to("cpu", torch.int64)
    if ((idx < -1) | (idx >= m)).any():
      raise BridgeInputError(
          f"spec.sample_idx_mapping: expected state rows in [-1, {m}), got "
          f"{idx.tolist()}")
    for b in range(n):
      rows = {int(v) for v in idx[b].tolist()}
      if len(rows - {-1}) > 1 or (len(rows) > 1 and -1 in rows):
        raise BridgeInputError(
            f"spec.sample_idx_mapping: request {b} maps its steps to state "
            f"rows {idx[b].tolist()}; the bridge needs one state row per "
            "request (or -1 for all its steps)")
    pos = spec.sample_pos.reshape(-1)[:n * s_len].view(n, s_len)
    pos = pos.to("cpu", torch.int64)
    if ((pos < 1) & (idx >= 0)).any():
      raise BridgeInputError(
          f"spec.sample_pos: expected positions >= 1 at valid steps, got "
          f"{pos.tolist()}")
    ids = spec.input_buffers.input_ids
    aidx = spec._anchor_idx[:n].to("cpu", torch.int64)  # pylint: disable=W0212
    if ((aidx < 0) | (aidx >= ids.shape[0])).any():
      raise BridgeInputError(
          f"spec._anchor_idx: expected indices into input_ids [0, "
          f"{ids.shape[0]}), got {aidx.tolist()}")
    anchors = ids.to("cpu", torch.int64)[aidx]
    v_in = spec.model.model.markov_head.markov_w1.weight.shape[0]
    if ((anchors < 0) | (anchors >= v_in)).any():
      raise BridgeInputError(
          f"spec.input_buffers.input_ids: expected anchor tokens in [0, "
          f"{v_in}), got {anchors.tolist()}")
