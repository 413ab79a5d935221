"""The hook's l2_persist: proj kept in L2 by a persisting access policy window.

CPU: the driver structures' layout (cuda.h's CUaccessPolicyWindow inside the
64-byte CUstreamAttrValue), the window arithmetic, the rows the persistent
draft holds on chip (which the window leaves out), which captured nodes
get the window (against a driver answering as a capture would), and the
refusals. GPU
(marked): the draft with the window is the draft without it bit for bit,
eager and captured; the stream carries no window after a call; the set-aside
is reserved and released; and a capture keeps the window in the kernel nodes
of the draft's own launches, not in torch's copy after them.
"""

import contextlib
import ctypes

import torch_bridge as tb  # first: sets XLA_PYTHON_CLIENT_PREALLOCATE

import pytest
import torch

from jax_markov.kernels import tuning
from jax_markov.kernels.draw_params import ParamsLayout
from torch_bridge import l2_window, native_plan
from torch_bridge import testing as sd
from helpers import torch_and_jax_gpu

_GPU = torch_and_jax_gpu()
MB = 1 << 20


def test_driver_structures_match_cuda_h():
  """CUaccessPolicyWindow: base_ptr, num_bytes, hitRatio, hitProp, missProp
  (8 + 8 + 4 + 4 + 4, padded to 32 bytes), at the start of the 64-byte
  union every CUstreamAttrValue / CUlaunchAttributeValue is."""
  w = l2_window.AccessPolicyWindow
  assert [getattr(w, f).offset for f in ("base_ptr", "num_bytes", "hitRatio",
                                         "hitProp", "missProp")] == [
                                             0, 8, 16, 20, 24]
  assert ctypes.sizeof(w) == 32
  assert ctypes.sizeof(l2_window.StreamAttrValue) == 64
  v = l2_window.window_value(0x7000_0000_0000, 48 * MB, 0.75)
  raw = bytes(v)
  assert int.from_bytes(raw[0:8], "little") == 0x7000_0000_0000
  assert int.from_bytes(raw[8:16], "little") == 48 * MB
  assert ctypes.c_float.from_buffer_copy(raw[16:20]).value == 0.75
  assert int.from_bytes(raw[20:24], "little") == 2  # persisting
  assert int.from_bytes(raw[24:28], "little") == 1  # streaming
  assert raw[32:] == bytes(32)
  none = bytes(l2_window.window_value(0, 0, 0.0))
  assert none[:20] == bytes(20)
  with pytest.raises(ValueError, match="hit_ratio"):
    l2_window.window_value(1, 1, 1.5)


class _CapturingDriver:
  """The driver calls of Window.mark_captured, as a capture would answer
  them: a stream whose capture's leaves are two kernel nodes and a memset
  node (or no capture at all)."""
  KERNEL, MEMSET = 0, 2

  def __init__(self, capturing: bool):
    self.capturing = capturing
    self.leaves = (ctypes.c_void_p * 3)(0x10, 0x20, 0x30)
    self.types = {0x10: self.KERNEL, 0x20: self.MEMSET, 0x30: self.KERNEL}
    self.set = []

  def cuCtxGetLimit(self, out, limit):
    out._obj.value = 0
    return 0

  def cuCtxGetDevice(self, out):
    out._obj.value = 0
    return 0

  def cuStreamGetCaptureInfo_v2(self, stream, status, ident, graph, deps,
                                count):
    status._obj.value = 1 if self.capturing else 0
    if self.capturing:
      deps._obj.contents = ctypes.c_void_p.from_buffer(self.leaves)
      count._obj.value = len(self.leaves)
    return 0

  def cuGraphNodeGetType(self, node, kind):
    kind._obj.value = self.types[node.value]
    return 0

  def cuGraphKernelNodeSetAttribute(self, node, attr, value):
    w = value._obj.accessPolicyWindow
    self.set.append((node.value, attr, w.base_ptr, w.num_bytes,
                     round(w.hitRatio, 6), w.hitProp, w.missProp))
    return 0


def test_mark_captured_sets_the_window_on_the_capture_kernel_leaves(
    monkeypatch):
  """Under a capture, the window goes on the kernel nodes among the
  capture's current leaves (not a memset); outside one, on nothing."""
  for capturing in (True, False):
    fake = _CapturingDriver(capturing)
    monkeypatch.setattr(l2_window, "_driver", lambda fake=fake: fake)
    monkeypatch.setattr(l2_window, "_HOLDERS", {})
    window = l2_window.Window(0)
    got = window.mark_captured(0x99, 0x7000_0000, 48 * MB, 0.5)
    if capturing:
      assert got == 2
      assert fake.set == [
          (node, l2_window.CU_KERNEL_NODE_ATTRIBUTE_ACCESS_POLICY_WINDOW,
           0x7000_0000, 48 * MB, 0.5, l2_window.CU_ACCESS_PROPERTY_PERSISTING,
           l2_window.CU_ACCESS_PROPERTY_STREAMING) for node in (0x10, 0x30)]
    else:
      assert (got, fake.set) == (0, [])

  class Older(_CapturingDriver):  # a driver without the call
    cuStreamGetCaptureInfo_v2 = property()

  monkeypatch.setattr(l2_window, "_driver", lambda: Older(True))
  with pytest.raises(RuntimeError, match="no cuStreamGetCaptureInfo_v2"):
    l2_window.Window(0).mark_captured(0x99, 0x7000_0000, 48 * MB, 0.5)


class _LimitDriver:
  """The context limit calls, as a driver would answer them: the set-aside
  rounded up to 1 MB, and the resets counted."""

  def __init__(self, limit: int):
    self.limit, self.resets, self.sets = limit, 0, []

  def cuCtxGetDevice(self, out):
    out._obj.value = 3
    return 0

  def cuCtxGetLimit(self, out, which):
    assert which == l2_window.CU_LIMIT_PERSISTING_L2_CACHE_SIZE
    out._obj.value = self.limit
    return 0

  def cuCtxSetLimit(self, which, value):
    self.sets.append(value)
    self.limit = -(-value // MB) * MB
    return 0

  def cuCtxResetPersistingL2Cache(self):
    self.resets += 1
    return 0


@pytest.mark.parametrize("order", ["first_out_first", "last_out_first"])
def test_windows_share_the_set_aside(monkeypatch, order):
  """Two hooks' Windows on one device: each raises the set-aside to what it
  needs and never lowers it; releasing one leaves the other's set-aside
  and persisting lines alone; the last release resets the lines and
  restores the limit from before the first; a release twice is one."""
  fake = _LimitDriver(2 * MB)  # another part of the process set 2 MB
  monkeypatch.setattr(l2_window, "_driver", lambda: fake)
  monkeypatch.setattr(l2_window, "_HOLDERS", {})
  a = l2_window.Window(30 * MB + 1)
  assert (a.reserved, fake.limit) == (31 * MB, 31 * MB)  # rounded up
  b = l2_window.Window(20 * MB)  # less than held: not lowered
  assert (b.reserved, fake.sets) == (31 * MB, [30 * MB + 1])
  c = l2_window.Window(40 * MB)
  assert (c.reserved, fake.limit) == (40 * MB, 40 * MB)
  assert a._previous == b._previous == c._previous == 2 * MB  # noqa: SLF001
  first, *rest = (a, b, c) if order == "first_out_first" else (c, b, a)
  first.release()
  first.release()
  rest[0].release()
  assert (fake.limit, fake.resets) == (40 * MB, 0)
  rest[1].release()
  assert (fake.limit, fake.resets) == (2 * MB, 1)
  assert l2_window._HOLDERS == {}  # noqa: SLF001
  d = l2_window.Window(0)  # a new first one remembers the limit now
  assert d.reserved == d._previous == 2 * MB  # noqa: SLF001
  d.release()
  assert (fake.limit, fake.resets, fake.sets[-1]) == (2 * MB, 2, 2 * MB)


def test_a_refused_set_aside_leaves_no_holder(monkeypatch):
  """A context that refuses the limit: the Window raises and counts no
  holder, so the next Window is the device's first and its release
  restores the limit and resets the lines."""

  class Refusing(_LimitDriver):
    def cuCtxSetLimit(self, which, value):
      self.sets.append(value)
      return 1  # CUDA_ERROR_INVALID_VALUE

  fake = Refusing(0)
  monkeypatch.setattr(l2_window, "_driver", lambda: fake)
  monkeypatch.setattr(l2_window, "_HOLDERS", {})
  with pytest.raises(RuntimeError, match="cuCtxSetLimit"):
    l2_window.Window(30 * MB)
  assert l2_window._HOLDERS == {}  # noqa: SLF001
  w = l2_window.Window(0)  # nothing to raise: no call
  assert (w.reserved, w.device, l2_window._HOLDERS) == (  # noqa: SLF001
      0, 3, {3: [0, 1]})
  w.release()
  assert (fake.resets, l2_window._HOLDERS) == (1, {})  # noqa: SLF001


def test_runtime_drafts_without_the_window_where_the_set_aside_is_refused(
    monkeypatch):
  """Where the set-aside cannot be reserved (no driver library, a context
  that refuses the limit), the native runtime warns once and drafts
  without a window, under a capture too (the same results: it is a cache
  policy); a hook moved to another device asks again."""
  from torch_bridge import native_runtime

  calls = []

  def refuse():
    calls.append(1)
    raise RuntimeError("cuCtxSetLimit(PERSISTING_L2_CACHE_SIZE) failed "
                       "with CUresult 1")

  monkeypatch.setattr(l2_window, "limits", refuse)
  # No CUDA device here to make current: the refusal comes from limits().
  monkeypatch.setattr(native_runtime.torch.cuda, "device",
                      lambda device: contextlib.nullcontext())

  class Plans:
    shape, num_sms = _shape(), 132

  hook = tb.FusedMarkovSampler(256, 129280, 256, "bfloat16", runtime="jax",
                               l2_persist=True)
  rt = native_runtime.NativeRuntime(hook, None)
  with pytest.warns(RuntimeWarning, match="could not reserve the persisting"):
    assert rt._l2_window({"proj": 0x1000}, Plans, 1, False) is None  # noqa: SLF001
  assert rt._l2_window({"proj": 0x1000}, Plans, 4, False) is None  # noqa: SLF001
  assert rt._l2_window({"proj": 0x1000}, Plans, 1, True) is None  # noqa: SLF001
  assert (len(calls), rt._window) == (1, None)  # noqa: SLF001
  rt.reset(torch.device("cpu"))
  with pytest.warns(RuntimeWarning, match="could not reserve the persisting"):
    assert rt._l2_window({"proj": 0x1000}, Plans, 1, False) is None  # noqa: SLF001
  assert len(calls) == 2


def test_plan_window():
  """The window: at most the device's largest; the set-aside at most its
  largest persisting size (or what was reserved); the hit ratio the share
  of the window the set-aside holds (1 where it holds all of it)."""
  lim = l2_window.Limits(l2=50 * MB, max_persisting=30 * MB,
                         max_window=128 * MB)
  assert l2_window.plan_window(66 * MB, lim) == (30 * MB, 66 * MB,
                                                 pytest.approx(30 / 66))
  assert l2_window.plan_window(20 * MB, lim) == (20 * MB, 20 * MB, 1.0)
  aside, size, ratio = l2_window.plan_window(66 * MB, lim, reserve=12 * MB)
  assert (aside, size) == (12 * MB, 66 * MB)
  assert ratio == pytest.approx(12 / 66)
  small = l2_window.Limits(l2=50 * MB, max_persisting=30 * MB,
                           max_window=32 * MB)
  assert l2_window.plan_window(66 * MB, small)[1:] == (32 * MB, 30 / 32)
  assert l2_window.plan_window(0, lim) == (0, 0, 0.0)
  none = l2_window.Limits(l2=4 * MB, max_persisting=0, max_window=0)
  assert l2_window.plan_window(66 * MB, none) == (0, 0, 0.0)


def _shape(m=256, s=7, v=129280, r=256):
  words = (("idx", m * s), ("pos", 2 * m * s), ("seeds", 2 * m),
           ("ids", m * s + 4), ("anchor_idx", 2 * m))
  return native_plan.DraftShape(
      max_num_reqs=m, steps=s, vocab=v, rank=r, vocab_in=v,
      base_dtype=torch.bfloat16, head_dtype=torch.bfloat16,
      temperature_dtype=torch.float32, words=words,
      layout=ParamsLayout(pos_wide=True))


def test_window_rows(monkeypatch):
  """The window covers the proj rows a bucket's kernels keep in L2 or
  stream: B = 1's tail select asks L2 to keep its first proj_l2_rows rows
  (evict_last; the rest evict_first): those; a step-by-step bucket, every
  row; a persistent draft holding blocks on chip (P x held_blocks x block_v
  leading rows, loaded once), the rows after them."""
  shape = _shape()
  b1 = native_plan.shape_config(shape, 1)
  assert b1.proj_l2_rows > 0  # the table's B = 1 entry
  assert native_plan.l2_window_rows(shape, 1, 132) == (0, b1.proj_l2_rows)
  for bucket in (4, 16, 64, 256):
    assert native_plan.shape_config(shape, bucket).proj_l2_rows == 0
    assert native_plan.l2_window_rows(shape, bucket, 132) == (0, shape.vd)
    assert native_plan.held_proj_rows(shape, bucket, 132) == 0
  persistent = tuning.KernelConfig(method="fused", block_b=1, block_v=128,
                                   block_k=64, bias_dot="fma",
                                   select="persistent", held_blocks=2)
  monkeypatch.setattr(native_plan, "shape_config",
                      lambda shape, bucket: persistent)
  held = native_plan.held_proj_rows(shape, 1, 132)
  assert held == 2 * 132 * 128
  assert native_plan.l2_window_rows(shape, 1, 132) == (held,
                                                       shape.vd - held)
  many = tuning.KernelConfig(method="fused", block_b=1, block_v=128,
                             block_k=64, bias_dot="fma", select="persistent",
                             held_blocks=100)  # more than a program has
  monkeypatch.setattr(native_plan, "shape_config",
                      lambda shape, bucket: many)
  assert native_plan.held_proj_rows(shape, 1, 132) == (
      (-(-shape.vocab // 128) // 132) * 132 * 128)


def test_hook_refuses_a_non_bool_and_needs_a_driver():
  with pytest.raises(ValueError, match="l2_persist"):
    tb.FusedMarkovSampler(8, 96, 8, "float32", runtime="jax", l2_persist=1)
  hook = tb.FusedMarkovSampler(8, 96, 8, "float32", runtime="jax",
                               l2_persist=True)
  assert hook.l2_persist
  hook.release_l2()  # the jax runtime keeps no window: nothing to release
  try:
    ctypes.CDLL("libcuda.so.1")
  except OSError:
    with pytest.raises(RuntimeError, match="driver library"):
      l2_window.limits()


def _sampler(spec, **kw):
  w2 = spec.model.model.markov_head.markov_w2.weight
  return tb.FusedMarkovSampler(spec.max_num_reqs, spec.vocab, w2.shape[1],
                               w2.dtype, runtime="native", **kw)


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU for torch and JAX")
def test_gpu_l2_persist_is_the_plain_draft_bit_for_bit():
  """DeepSeek-V4 shape, B = 1 (the tail select's kept rows), 16 and 64, on
  a side stream (as an engine drafts): the hook with l2_persist writes the
  tokens and the cache of the hook without it, eager and captured; the
  window is set and no window is left on the stream after a call; a
  capture records the window in the draft's own kernel nodes and not in
  torch's copy after them; release_l2 drops the set-aside."""
  pytest.importorskip("triton")
  lim = l2_window.limits()
  if lim.max_persisting <= 0:
    pytest.skip("this device has no persisting L2 set-aside")
  m, s, v, r, buckets = 64, 7, 129280, 256, (1, 16, 64)
  spec = sd.SpeculatorDouble(max_num_reqs=m, num_steps=s, vocab=v, rank=r,
                             hidden=64, dtype=torch.bfloat16, device="cuda")
  plain = _sampler(spec, buckets=buckets)
  kept = _sampler(spec, buckets=buckets, l2_persist=True)
  plain.warmup(spec)
  kept.warmup(spec)
  window = kept._impl._window  # noqa: SLF001
  assert 0 < window.reserved
  print(f"limits {lim}, set-aside {window.reserved} bytes")
  proj = spec.model.model.markov_head.markov_w2.weight
  # What stream capture keeps of a stream's window by itself (printed: the
  # driver's choice), and Window.mark_captured setting it on the node.
  x = torch.ones(1 << 20, device="cuda")
  side = torch.cuda.Stream()
  found = []
  for mark in (False, True):
    probe = torch.cuda.CUDAGraph(keep_graph=True)
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
      with torch.cuda.graph(probe, stream=side):
        window.set(side.cuda_stream, x.data_ptr(), x.nbytes, 0.5)
        x.mul_(2)
        if mark:
          assert window.mark_captured(side.cuda_stream, x.data_ptr(),
                                      x.nbytes, 0.5) == 1
        window.clear(side.cuda_stream)
    found.append(l2_window.graph_kernel_windows(int(probe.raw_cuda_graph())))
  print(f"a capture keeps the stream's window by itself: {found[0]}")
  (got,) = found[1]
  assert got[:2] == (x.data_ptr(), x.nbytes) and got[3] == 2
  assert got[2] == pytest.approx(0.5)
  assert window.mark_captured(side.cuda_stream, 0, 0, 0.0) == 0  # not capturing
  stream = torch.cuda.Stream()
  for n in (1, 16, 64):
    hidden = spec.prepare(n, greedy=(0,))
    tokens0 = spec.draft_tokens.clone()
    cache0 = spec.draft_logits.values.clone()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
      assert plain(spec, n, hidden)
    torch.cuda.synchronize()
    want = (spec.draft_tokens.clone(), spec.draft_logits.values.clone())
    spec.draft_tokens.copy_(tokens0)
    spec.draft_logits.values.copy_(cache0)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
      assert kept(spec, n, hidden)
    torch.cuda.synchronize()
    assert stream.cuda_stream not in kept._impl._no_window  # noqa: SLF001
    assert torch.equal(spec.draft_tokens, want[0])
    assert torch.equal(spec.draft_logits.values, want[1])
    assert window.get(stream.cuda_stream).num_bytes == 0
    start, size, ratio = kept._impl._windows[  # noqa: SLF001
        (proj.data_ptr(), n)]
    assert proj.data_ptr() <= start < proj.data_ptr() + proj.nbytes
    assert 0 < size <= proj.nbytes and 0 < ratio <= 1

    graph = torch.cuda.CUDAGraph(keep_graph=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
      with torch.cuda.graph(graph, stream=side):
        assert kept(spec, n, hidden)
    torch.cuda.synchronize()
    windows = l2_window.graph_kernel_windows(int(graph.raw_cuda_graph()))
    marked = [w for w in windows if w[1]]
    # The draft's kernels carry the window, torch's token copy after them
    # does not.
    assert marked, f"the capture kept no window: {windows}"
    assert len(marked) < len(windows)
    for base, num_bytes, hit_ratio, hit in marked:
      assert (base, num_bytes, hit) == (start, size, 2)
      assert hit_ratio == pytest.approx(ratio)
    graph.instantiate()
    spec.draft_tokens.copy_(tokens0)
    spec.draft_logits.values.copy_(cache0)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(spec.draft_tokens, want[0])
    assert torch.equal(spec.draft_logits.values, want[1])
  previous = window._previous  # noqa: SLF001 -- the limit before the hook's
  kept.release_l2()
  assert kept._impl._window is None  # noqa: SLF001
  probe = l2_window.Window(0)
  assert probe.reserved == previous  # restored, not lowered
  probe.release()


def test_runtime_drafts_without_the_window_where_a_stream_refuses_it():
  """Where the driver refuses the window on a stream, the native runtime
  warns once for that stream and drafts without it (the same results: it
  is a cache policy); without l2_persist it never asks for one."""
  from torch_bridge import native_runtime

  class Refusing:
    calls = 0

    def set(self, *args):
      Refusing.calls += 1
      raise RuntimeError("cuStreamSetAttribute(ACCESS_POLICY_WINDOW) failed "
                         "with CUresult 400")

  hook = tb.FusedMarkovSampler(8, 96, 8, "float32", runtime="jax",
                               l2_persist=True)
  rt = native_runtime.NativeRuntime(hook, None)
  rt._window = Refusing()  # noqa: SLF001
  with pytest.warns(RuntimeWarning, match="drafting without it"):
    assert rt._set_window(0, (1, 2, 0.5)) is None  # noqa: SLF001
  assert rt._set_window(0, (1, 2, 0.5)) is None  # noqa: SLF001 -- no retry
  assert Refusing.calls == 1

  class Launch:
    count = 0

    def __call__(self, bindings, stream):
      Launch.count += 1

  class RefusingNodes:
    calls = 0

    def mark_captured(self, *args):
      RefusingNodes.calls += 1
      raise RuntimeError("cuGraphKernelNodeSetAttribute failed with "
                         "CUresult 1")

  rt._window = RefusingNodes()  # noqa: SLF001
  with pytest.warns(RuntimeWarning, match="the graph keeps the stream's"):
    rt._run_marked([Launch(), Launch()], {}, 5, (1, 2, 0.5))  # noqa: SLF001
  rt._run_marked([Launch()], {}, 5, (1, 2, 0.5))  # noqa: SLF001 -- no retry
  assert (Launch.count, RefusingNodes.calls) == (3, 1)
  assert 5 not in rt._no_window  # noqa: SLF001 -- eager drafts keep theirs
  plain = tb.FusedMarkovSampler(8, 96, 8, "float32", runtime="jax")
  assert native_runtime.NativeRuntime(plain, None)._l2_window(  # noqa: SLF001
      {}, None, 1, False) is None
