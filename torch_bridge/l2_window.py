"""Keeping proj in L2 across a draft's steps: CUDA's persisting-L2 window.

Every step of a draft reads all of proj ([V, R] bf16: 66 MB at the
DeepSeek-V4 shape), more than the 50 MB L2 of an H100 / H200, so each step
streams most of it from HBM again (docs/perf-notes.md, "The block pass at B =
1 to 16"). Eviction hints on the loads gave ~8 MB a step more from L2
(change 22); a reservation is what the hardware offers beyond that: the
context's persisting-L2 set-aside (``cuCtxSetLimit(PERSISTING_L2_CACHE_SIZE)``,
device-wide) and an access policy window on the stream that marks a fraction
(``hitRatio``) of the lines of one address range persisting, the rest
streaming. Persisting lines are evicted only by other persisting lines, so
the same part of proj stays in L2 from one step to the next.

This module is the driver API through ctypes (libcuda, which every CUDA
driver installs; triton loads it the same way), so that it needs no CUDA
toolkit and works on torch's current context and stream:

* :func:`limits` reads the device's maximum set-aside and window size;
* :class:`Window` reserves the set-aside once (not capturable: before a
  capture) and sets / clears the window on a stream around launches
  (``cuStreamSetAttribute``: not a stream operation, so it does not
  synchronise), and under a capture also sets it on the kernel nodes the
  capture records (:meth:`Window.mark_captured`), so that a CUDA graph
  holds it whether or not stream capture copies the stream's attribute.

Costs: the set-aside is the context's for as long as it is set, and proj's
persisting lines stay in L2 after the draft, so other kernels' normal
accesses have that much less L2 until :meth:`Window.release` (which also
returns the limit to what it was).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools

# cuda.h
CU_LIMIT_PERSISTING_L2_CACHE_SIZE = 0x06
CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE = 38
CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE = 108
CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE = 109
CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1
CU_ACCESS_PROPERTY_NORMAL = 0
CU_ACCESS_PROPERTY_STREAMING = 1
CU_ACCESS_PROPERTY_PERSISTING = 2


class AccessPolicyWindow(ctypes.Structure):
  """CUaccessPolicyWindow."""
  _fields_ = [("base_ptr", ctypes.c_void_p), ("num_bytes", ctypes.c_size_t),
              ("hitRatio", ctypes.c_float), ("hitProp", ctypes.c_int),
              ("missProp", ctypes.c_int)]


class StreamAttrValue(ctypes.Union):
  """CUstreamAttrValue (CUlaunchAttributeValue: a 64-byte union)."""
  _fields_ = [("pad", ctypes.c_char * 64),
              ("accessPolicyWindow", AccessPolicyWindow)]


@functools.lru_cache(maxsize=None)
def _driver():
  """libcuda, or RuntimeError saying why not."""
  try:
    lib = ctypes.CDLL("libcuda.so.1")
  except OSError as e:
    raise RuntimeError(f"the CUDA driver library is not loadable ({e})") from e
  for name, args in (
      ("cuCtxSetLimit", (ctypes.c_int, ctypes.c_size_t)),
      ("cuCtxGetLimit", (ctypes.POINTER(ctypes.c_size_t), ctypes.c_int)),
      ("cuCtxGetDevice", (ctypes.POINTER(ctypes.c_int),)),
      ("cuDeviceGetAttribute", (ctypes.POINTER(ctypes.c_int), ctypes.c_int,
                                ctypes.c_int)),
      ("cuStreamSetAttribute", (ctypes.c_void_p, ctypes.c_int,
                                ctypes.POINTER(StreamAttrValue))),
      ("cuStreamGetAttribute", (ctypes.c_void_p, ctypes.c_int,
                                ctypes.POINTER(StreamAttrValue))),
      ("cuCtxResetPersistingL2Cache", ()),
      ("cuGraphGetNodes", (ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p),
                           ctypes.POINTER(ctypes.c_size_t))),
      ("cuGraphNodeGetType", (ctypes.c_void_p, ctypes.POINTER(ctypes.c_int))),
      ("cuGraphKernelNodeGetAttribute", (ctypes.c_void_p, ctypes.c_int,
                                         ctypes.POINTER(StreamAttrValue))),
      ("cuGraphKernelNodeSetAttribute", (ctypes.c_void_p, ctypes.c_int,
                                         ctypes.POINTER(StreamAttrValue))),
      # The CUDA 11.3 signature, which drivers keep exporting for binaries
      # built against it (CUDA 13 renamed the edge-data form).
      ("cuStreamGetCaptureInfo_v2", (
          ctypes.c_void_p, ctypes.POINTER(ctypes.c_int),
          ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_void_p),
          ctypes.POINTER(ctypes.POINTER(ctypes.c_void_p)),
          ctypes.POINTER(ctypes.c_size_t)))):
    try:
      fn = getattr(lib, name)
    except AttributeError:
      # A driver without it: the calls that need it say so (RuntimeError)
      # where they are made, the others work.
      continue
    fn.argtypes = args
    fn.restype = ctypes.c_int
  return lib


def _check(result: int, what: str) -> None:
  if result != 0:
    raise RuntimeError(f"{what} failed with CUresult {result}")


@dataclasses.dataclass(frozen=True)
class Limits:
  """What the current context's device allows, in bytes."""
  l2: int               # the L2 cache
  max_persisting: int   # the largest set-aside for persisting lines
  max_window: int       # the largest access policy window


def limits() -> Limits:
  """The limits of the current context's device (torch.cuda initialised
  and its device current). Raises RuntimeError without a driver."""
  lib = _driver()
  dev = ctypes.c_int()
  _check(lib.cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
  out = []
  for attr in (CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE,
               CU_DEVICE_ATTRIBUTE_MAX_PERSISTING_L2_CACHE_SIZE,
               CU_DEVICE_ATTRIBUTE_MAX_ACCESS_POLICY_WINDOW_SIZE):
    v = ctypes.c_int()
    _check(lib.cuDeviceGetAttribute(ctypes.byref(v), attr, dev),
           f"cuDeviceGetAttribute({attr})")
    out.append(v.value)
  return Limits(*out)


def window_value(base_ptr: int, num_bytes: int, hit_ratio: float,
                 hit: int = CU_ACCESS_PROPERTY_PERSISTING,
                 miss: int = CU_ACCESS_PROPERTY_STREAMING) -> StreamAttrValue:
  """The stream attribute value of one window (num_bytes 0: none)."""
  if not 0.0 <= hit_ratio <= 1.0:
    raise ValueError(f"hit_ratio must be in [0, 1], got {hit_ratio}")
  value = StreamAttrValue()
  value.accessPolicyWindow = AccessPolicyWindow(
      ctypes.c_void_p(base_ptr or None), num_bytes, hit_ratio, hit, miss)
  return value


def plan_window(num_bytes: int, lim: Limits,
                reserve: int | None = None) -> tuple[int, int, float]:
  """(set-aside, window bytes, hitRatio) for keeping num_bytes from a
  window's start in L2: the window is at most the device's largest, the
  set-aside at most its largest persisting size (or ``reserve``), and the
  hit ratio the share of the window that fits in the set-aside, so that
  persisting lines do not evict each other."""
  if num_bytes <= 0:
    return 0, 0, 0.0
  window = min(num_bytes, lim.max_window)
  aside = min(window, lim.max_persisting if reserve is None
              else min(reserve, lim.max_persisting))
  if aside <= 0:
    return 0, 0, 0.0
  return aside, window, min(1.0, aside / window)


CU_GRAPH_NODE_TYPE_KERNEL = 0
CU_STREAM_CAPTURE_STATUS_ACTIVE = 1
CU_KERNEL_NODE_ATTRIBUTE_ACCESS_POLICY_WINDOW = 1


def graph_kernel_windows(graph: int) -> list[tuple[int, int, float, int]]:
  """(base_ptr, num_bytes, hitRatio, hitProp) of each kernel node's access
  policy window in a CUDA graph (a CUgraph as an int: torch's
  ``CUDAGraph(keep_graph=True).raw_cuda_graph()``), in the graph's node
  order; num_bytes 0 where a node has none. What tells whether a capture
  kept the stream's window in the kernels it recorded."""
  lib = _driver()
  count = ctypes.c_size_t()
  _check(lib.cuGraphGetNodes(ctypes.c_void_p(graph), None,
                             ctypes.byref(count)), "cuGraphGetNodes")
  nodes = (ctypes.c_void_p * count.value)()
  _check(lib.cuGraphGetNodes(ctypes.c_void_p(graph), nodes,
                             ctypes.byref(count)), "cuGraphGetNodes")
  out = []
  for node in nodes:
    kind = ctypes.c_int()
    _check(lib.cuGraphNodeGetType(node, ctypes.byref(kind)),
           "cuGraphNodeGetType")
    if kind.value != CU_GRAPH_NODE_TYPE_KERNEL:
      continue
    value = StreamAttrValue()
    _check(lib.cuGraphKernelNodeGetAttribute(
        node, CU_KERNEL_NODE_ATTRIBUTE_ACCESS_POLICY_WINDOW,
        ctypes.byref(value)), "cuGraphKernelNodeGetAttribute")
    w = value.accessPolicyWindow
    out.append((w.base_ptr or 0, w.num_bytes, w.hitRatio, w.hitProp))
  return out


# Per device: [the set-aside before the first live Window, live Windows].
# The limit is the context's, shared by every hook of the process: the
# first Window remembers what it was, the last one released restores it.
_HOLDERS: dict[int, list[int]] = {}


class Window:
  """Reserves a persisting-L2 set-aside and sets one window on streams.

  Built where torch's device is current, outside any capture (the limit is
  a context setting, which a CUDA graph cannot hold). Windows of one device
  share its set-aside: each raises it to what it needs (never lowers it),
  and it returns to what it was before the first only when the last is
  released.
  """

  def __init__(self, reserve: int):
    lib = _driver()
    self._lib = lib
    dev = ctypes.c_int()
    _check(lib.cuCtxGetDevice(ctypes.byref(dev)), "cuCtxGetDevice")
    self._device = dev.value
    self._held = False
    limit = self._limit()
    if reserve > limit:  # never lower what another part set
      _check(lib.cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE, reserve),
             "cuCtxSetLimit(PERSISTING_L2_CACHE_SIZE)")
    # Counted only once reserved: a refused limit leaves no holder behind
    # that would keep the last release from restoring the limit.
    held = _HOLDERS.setdefault(self._device, [limit, 0])
    held[1] += 1
    self._held = True
    # The driver rounds the set-aside to its granularity.
    self.reserved = self._limit()

  @property
  def device(self) -> int:
    """The device ordinal whose context holds the set-aside: the context
    :meth:`release` must run in."""
    return self._device

  @property
  def _previous(self) -> int:
    """The set-aside before the first live Window of this device."""
    return _HOLDERS[self._device][0]

  def _limit(self) -> int:
    got = ctypes.c_size_t()
    _check(self._lib.cuCtxGetLimit(ctypes.byref(got),
                                   CU_LIMIT_PERSISTING_L2_CACHE_SIZE),
           "cuCtxGetLimit(PERSISTING_L2_CACHE_SIZE)")
    return int(got.value)

  def set(self, stream: int, base_ptr: int, num_bytes: int,
          hit_ratio: float) -> None:
    """Marks [base_ptr, base_ptr + num_bytes) on ``stream`` (a
    cudaStream_t as an int): hit_ratio of its lines persisting, the rest
    streaming, for the work enqueued after this call."""
    value = window_value(base_ptr, num_bytes, hit_ratio)
    _check(self._lib.cuStreamSetAttribute(
        ctypes.c_void_p(stream), CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW,
        ctypes.byref(value)), "cuStreamSetAttribute(ACCESS_POLICY_WINDOW)")

  def get(self, stream: int) -> AccessPolicyWindow:
    """The window set on ``stream`` now."""
    value = StreamAttrValue()
    _check(self._lib.cuStreamGetAttribute(
        ctypes.c_void_p(stream), CU_STREAM_ATTRIBUTE_ACCESS_POLICY_WINDOW,
        ctypes.byref(value)), "cuStreamGetAttribute(ACCESS_POLICY_WINDOW)")
    return value.accessPolicyWindow

  def mark_captured(self, stream: int, base_ptr: int, num_bytes: int,
                    hit_ratio: float) -> int:
    """Sets the window on the kernel nodes that a capture on ``stream``
    has just recorded (the capture's current leaves), and returns how many.

    A stream's window is what eager launches read; whether stream capture
    copies it into the kernel nodes it records is the driver's business,
    so a capture sets it on the nodes themselves (host calls at capture
    time only; a replay pays nothing)."""
    lib = self._lib
    if not hasattr(lib, "cuStreamGetCaptureInfo_v2"):
      raise RuntimeError("this CUDA driver has no cuStreamGetCaptureInfo_v2")
    status, graph = ctypes.c_int(), ctypes.c_void_p()
    ident, count = ctypes.c_uint64(), ctypes.c_size_t()
    deps = ctypes.POINTER(ctypes.c_void_p)()
    _check(lib.cuStreamGetCaptureInfo_v2(
        ctypes.c_void_p(stream), ctypes.byref(status), ctypes.byref(ident),
        ctypes.byref(graph), ctypes.byref(deps), ctypes.byref(count)),
        "cuStreamGetCaptureInfo_v2")
    if status.value != CU_STREAM_CAPTURE_STATUS_ACTIVE:
      return 0
    value = window_value(base_ptr, num_bytes, hit_ratio)
    marked = 0
    for i in range(count.value):
      node = ctypes.c_void_p(deps[i])
      kind = ctypes.c_int()
      _check(lib.cuGraphNodeGetType(node, ctypes.byref(kind)),
             "cuGraphNodeGetType")
      if kind.value != CU_GRAPH_NODE_TYPE_KERNEL:
        continue
      _check(lib.cuGraphKernelNodeSetAttribute(
          node, CU_KERNEL_NODE_ATTRIBUTE_ACCESS_POLICY_WINDOW,
          ctypes.byref(value)), "cuGraphKernelNodeSetAttribute")
      marked += 1
    return marked

  def clear(self, stream: int) -> None:
    """No window on ``stream`` for the work enqueued after this call."""
    self.set(stream, 0, 0, 0.0)

  def release(self) -> None:
    """Where this is the device's last live Window: every persisting line
    of the context back to normal and the set-aside back to what it was
    before the first (host calls on the current context, which must be
    :attr:`device`'s; not in a capture); the others keep theirs.
    Idempotent."""
    if not self._held:
      return
    self._held = False
    held = _HOLDERS[self._device]
    held[1] -= 1
    if held[1] == 0:
      del _HOLDERS[self._device]
      _check(self._lib.cuCtxResetPersistingL2Cache(),
             "cuCtxResetPersistingL2Cache")
      if self._limit() != held[0]:
        _check(self._lib.cuCtxSetLimit(CU_LIMIT_PERSISTING_L2_CACHE_SIZE,
                                       held[0]),
               "cuCtxSetLimit(PERSISTING_L2_CACHE_SIZE)")
    self.reserved = 0
