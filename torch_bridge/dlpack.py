"""DLPack transfers between torch tensors and JAX arrays.

Zero copy both ways where the buffers allow it; the stream protocol orders
the work of the two runtimes on GPU:

* torch -> JAX (:func:`import_tensor`): the consumer (JAX) passes its
  external-ready-events stream to ``tensor.__dlpack__(stream=...)``; torch
  makes that stream wait on torch's *current* stream (an event), and JAX marks
  the imported buffer ready only once that stream reaches it. A JAX
  computation that takes the imported array therefore starts after every
  torch op queued on the current stream before the import.
* JAX -> torch (:func:`export_array`): torch's current stream is passed to
  ``array.__dlpack__(stream=...)``, and JAX makes that stream wait until the
  array is ready. Torch ops queued after the export see the result.

On CPU there are no streams: a JAX array is exported only once it is ready
(the export blocks), and torch's CPU ops are synchronous.

Importing costs host time (tens of microseconds), so buffers that stay at a
fixed address are imported once and cached (:class:`ImportCache`).

JAX without x64 has no int64, so int64 tensors cross as int32 word pairs
(:func:`int32_words`, little-endian: ``[lo, hi]`` per element) and are
narrowed or bitcast on the JAX side; no copy in torch.
"""

from __future__ import annotations

import sys
from typing import Any, NamedTuple

import jax
import torch

# DLPack device types (dlpack.h).
_KDL_CPU = 1
_KDL_CUDA = 2
_KDL_ROCM = 10
_PLATFORM = {_KDL_CPU: "cpu", _KDL_CUDA: "cuda", _KDL_ROCM: "rocm"}

# Dtypes the fast import path may return as is: JAX canonicalizes nothing here.
_FAST_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int32,
                torch.uint8, torch.int8, torch.int16, torch.bool)

if sys.byteorder != "little":  # int32_words relies on [lo, hi] order
  raise ImportError("torch_bridge supports little-endian hosts only")

# Private fast paths (tens of microseconds less per transfer than the public
# jax.dlpack.from_dlpack / torch.from_dlpack, which add dtype canonicalisation
# and argument checks). Probed once on first use; any failure falls back to
# the public functions for the rest of the process.
try:
  from jax._src.lib import _jax as _jaxext  # jaxlib >= 0.7
  from jax._src.lib import jaxlib_extension_version as _EXT_VERSION
except Exception:  # pragma: no cover - depends on the jaxlib build
  _jaxext = None
  _EXT_VERSION = 0
_fast_import_ok: bool | None = None if _jaxext is not None else False
_fast_export_ok: bool | None = None if _jaxext is not None else False

_device_cache: dict[tuple[int, int], Any] = {}


def jax_device(t: torch.Tensor):
  """The JAX device that holds ``t``'s memory (cpu, or the same GPU)."""
  dl_type, dl_id = t.__dlpack_device__()
  key = (int(dl_type), int(dl_id))
  dev = _device_cache.get(key)
  if dev is None:
    platform = _PLATFORM.get(key[0])
    if platform is None:
      raise TypeError(f"tensor on unsupported device {t.device}")
    devs = [d for d in jax.local_devices(backend=platform)
            if d.local_hardware_id == key[1]]
    if not devs:
      raise ValueError(f"JAX has no {platform} device for torch's {t.device}")
    dev = devs[0]
    _device_cache[key] = dev
  return dev


def _ready_stream(dev) -> int | None:
  if dev.platform == "cpu":
    return None
  try:
    return dev.get_stream_for_external_ready_events()
  except Exception:  # UNIMPLEMENTED on some backends: no stream protocol
    return None


def _fast_import(t: torch.Tensor, dev) -> jax.Array:
  dl_type, _ = t.__dlpack_device__()
  stream = _ready_stream(dev)
  capsule = t.__dlpack__(stream=stream)
  if _EXT_VERSION >= 467:
    return _jaxext.dlpack_managed_tensor_to_buffer(capsule, dev, stream, None,
                                                   int(dl_type))
  return _jaxext.dlpack_managed_tensor_to_buffer(capsule, dev, stream, None)


def import_tensor(t: torch.Tensor) -> jax.Array:
  """Imports a torch tensor into JAX, zero copy when layout and alignment allow.

  Args:
    t: a tensor of a dtype JAX supports without x64 (no int64/float64: pass
      those through :func:`int32_words` or convert first). Must not require
      grad (pass ``t.detach()``).

  Returns:
    A JAX array on the tensor's device with its shape and dtype. It aliases
    ``t`` unless JAX had to copy (misaligned or non-compact strides), which
    :func:`is_alias` tells. On GPU it is ready once torch's current stream
    reaches this point (see the module docstring).
  """
  global _fast_import_ok
  dev = jax_device(t)
  if _fast_import_ok and t.dtype in _FAST_DTYPES:
    return _fast_import(t, dev)
  if _fast_import_ok is None and t.dtype in _FAST_DTYPES:
    try:
      arr = _fast_import(t, dev)
      ok = (tuple(arr.shape) == tuple(t.shape) and
            str(arr.dtype) == str(t.dtype).removeprefix("torch.") and
            arr.devices() == {dev})
    except Exception:
      ok = False
    _fast_import_ok = ok
    if ok:
      return arr
  return jax.dlpack.from_dlpack(t)


def is_alias(arr: jax.Array, t: torch.Tensor) -> bool:
  """Whether ``arr`` (from :func:`import_tensor`) shares ``t``'s memory."""
  try:
    return arr.unsafe_buffer_pointer() == t.data_ptr()
  except Exception:
    return False


def _torch_stream_arg(arr: jax.Array):
  dev = next(iter(arr.devices()))
  if dev.platform == "cpu":
    return None
  stream = torch.cuda.current_stream(dev.local_hardware_id).cuda_stream
  # DLPack: 1 names the legacy default stream (whose handle is 0).
  return 1 if stream == 0 else stream


def _fast_export(arr: jax.Array) -> torch.Tensor:
  capsule = _jaxext.buffer_to_dlpack_managed_tensor(
      arr, stream=_torch_stream_arg(arr))
  return torch.utils.dlpack.from_dlpack(capsule)


def export_array(arr: jax.Array) -> torch.Tensor:
  """Exports a single-device JAX array to torch, zero copy.

  On GPU, torch's current stream waits until ``arr`` is ready; on CPU the call
  blocks until it is. The tensor aliases JAX's buffer: it must not be written,
  and ``arr`` must stay alive until torch's last use of the tensor has run
  on the device (JAX reuses the memory once the array is freed, and does not
  know about torch's queued reads).
  """
  global _fast_export_ok
  if _fast_export_ok:
    return _fast_export(arr)
  if _fast_export_ok is None:
    try:
      t = _fast_export(arr)
      ok = (tuple(t.shape) == tuple(arr.shape) and
            t.data_ptr() == arr.unsafe_buffer_pointer())
    except Exception:
      ok = False
    _fast_export_ok = ok
    if ok:
      return t
  return torch.from_dlpack(arr)


def int32_words(t: torch.Tensor) -> torch.Tensor:
  """A flat int32 view of a contiguous int32 or int64 tensor; no copy.

  Returns:
    int32 ``[t.numel()]`` for int32 input; int32 ``[2 * t.numel()]`` for int64
    input, the words of element ``i`` at ``[2i, 2i + 1]`` = ``[lo, hi]``.
  """
  flat = t.detach().view(-1)
  if flat.dtype == torch.int64:
    return flat.view(torch.int32)
  return flat


def tensor_key(t: torch.Tensor) -> tuple:
  """A buffer's identity: (address, shape, strides, dtype, device)."""
  return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


def tensor_version(t: torch.Tensor) -> int | None:
  """Torch's in-place write counter of ``t``; None for inference tensors."""
  try:
    return t._version
  except RuntimeError:  # inference tensors track no version
    return None


class _Entry(NamedTuple):
  source: torch.Tensor
  key: tuple
  version: int | None
  array: jax.Array
  alias: bool


class ImportCache:
  """JAX imports of torch buffers that stay at a fixed address, one per slot.

  A slot (e.g. ``"spec.seeds"``) holds the import of the tensor last seen
  there. :meth:`lookup` returns it again while the tensor has the same
  :func:`tensor_key` and either the import aliases the tensor (then torch's
  later in-place writes are visible through it) or torch's version counter is
  unchanged (the import was a copy: a write makes it stale). A new tensor in
  the slot replaces the entry, which releases the old import (and with it the
  reference it held to the old tensor). For the very tensor object imported
  before, only its address and shape are compared (the rest of the key can
  change only through ``as_strided_``-like metadata surgery, which is not
  detected).

  Cached imports carry no ordering: JAX orders a computation after torch's
  current stream only through an array imported for that call
  (:func:`import_tensor`), so every call must import at least one fresh
  array that the computation consumes.
  """

  def __init__(self):
    self._entries: dict[str, _Entry] = {}
    self.imports = 0  # number of actual imports, for tests and benchmarks

  def lookup(self, slot: str, source: torch.Tensor) -> jax.Array | None:
    """The cached import of ``source`` in ``slot``; None if missing or stale."""
    e = self._entries.get(slot)
    if e is None:
      return None
    if e.source is source:
      if e.key[0] != source.data_ptr() or e.key[1] != source.shape:
        return None
    elif e.key != tensor_key(source):
      return None
    if e.alias:
      return e.array
    v = tensor_version(source)
    return e.array if v is not None and v == e.version else None

  def store(self, slot: str, source: torch.Tensor,
            derived: torch.Tensor) -> jax.Array:
    """Imports ``derived`` (a view of ``source``) and caches it under ``slot``.

    Args:
      slot: the cache slot, named after the spec attribute.
      source: the tensor whose key and version identify the entry.
      derived: what is actually imported: ``source`` itself or a view of it
        (e.g. :func:`int32_words`), sharing its memory and version counter.

    Returns:
      The imported array.
    """
    arr = import_tensor(derived)
    self.imports += 1
    self._entries[slot] = _Entry(source, tensor_key(source),
                                 tensor_version(source), arr,
                                 is_alias(arr, derived))
    return arr

  def is_alias(self, slot: str) -> bool | None:
    """Whether the cached import of ``slot`` aliases torch's memory."""
    e = self._entries.get(slot)
    return None if e is None else e.alias

  def clear(self):
    self._entries.clear()
