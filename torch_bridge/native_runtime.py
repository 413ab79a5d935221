"""The native runtime of the hook: a draft is kernel launches on torch's stream.

What a call does: the base logits (torch, ``model.compute_draft_logits``),
copied into the bucket's padded buffer only when num_reqs is not a bucket;
then the bucket's plan (native_plan.py): ``draw_params`` and one or two
kernels a step, writing ``spec.draft_logits.values`` in place; then one
copy of the int32 tokens into ``spec.draft_tokens``. Nothing is allocated
(the scratch is made at warmup for ``max_num_reqs``), nothing waits for the
device, and every launch uses torch's current stream, so the whole call can
be captured in a torch CUDA graph and replayed.
"""

from __future__ import annotations

import warnings

import torch

from torch_bridge import buckets as _buckets
from torch_bridge import checks
from torch_bridge import l2_window
from torch_bridge import modes
from torch_bridge import native
from torch_bridge import native_plan
from jax_markov.kernels.draw_params import ParamsLayout

# Buffers the kernels read, by the name the plans bind them to.
_BUFFERS = (
    ("embed", checks.W1, lambda s: s.model.model.markov_head.markov_w1.weight),
    ("proj", checks.W2, lambda s: s.model.model.markov_head.markov_w2.weight),
    ("idx", "spec.sample_idx_mapping", lambda s: s.sample_idx_mapping),
    ("pos", "spec.sample_pos", lambda s: s.sample_pos),
    ("temperature", "spec.temperature", lambda s: s.temperature),
    ("seeds", "spec.seeds", lambda s: s.seeds),
    ("ids", "spec.input_buffers.input_ids", lambda s: s.input_buffers.input_ids),
    ("anchor_idx", "spec._anchor_idx", lambda s: s._anchor_idx),  # noqa: SLF001
)
_CACHE = ("cache", checks.CACHE,
          lambda s: checks.cache_tensor(s.draft_logits))
_WORDS = ("idx", "pos", "seeds", "ids", "anchor_idx")


def _words(t: torch.Tensor) -> int:
  return t.numel() * (2 if t.dtype == torch.int64 else 1)


class NativeRuntime:
  """Runs a hook's draft as compiled Pallas kernels (see the module docstring).

  Each (request, step) draws with the temperature and seed of its own state
  row, exactly as ``jm.sample_draft_into``.
  """

  name = "native"
  capturable = True
  one_row_per_request = False

  def __init__(self, hook, ir_cache: native.IRCache):
    self.hook = hook
    self.ir_cache = ir_cache
    self._plans: dict[native_plan.DraftShape, native_plan.DraftPlans] = {}
    # (buffer identities, S, base dtype) -> plans: a serving loop looks its
    # plans up without rebuilding the compile shape.
    self._plans_by_key: dict[tuple, native_plan.DraftPlans] = {}
    self._bound: tuple | None = None  # (identity of the buffers, bindings)
    self._device = None
    # The scratch is shared by every call: a call on another stream than the
    # last one waits for the last one's kernels first.
    self._last_stream = None
    self._done = None
    # What a captured graph reads besides the spec's buffers (the scratch, a
    # column map, a sorted proj): kept for the hook's life once captured, so
    # a replay never reads memory freed by a later rebinding or reset.
    self._captured: dict[int, tuple] = {}
    # l2_persist: the set-aside (reserved outside a capture) and, per
    # (proj pointer, bucket), the window over the proj rows that stream.
    self._window: l2_window.Window | None = None
    self._windows: dict[tuple, tuple[int, int, float]] = {}
    # Streams the window could not be set on (warned once each).
    self._no_window: set[int] = set()
    # Streams whose captures the window could not be set on the kernel
    # nodes of (warned once each).
    self._no_marking: set[int] = set()
    # Why the set-aside could not be reserved (warned once; the hook then
    # drafts without a window), or None.
    self._l2_refused: str | None = None

  def reset(self, device: torch.device) -> None:
    self._plans.clear()
    self._plans_by_key.clear()
    self._bound = None
    self._device = device
    self._windows.clear()
    # The set-aside is the old device's context's: given back (outside a
    # capture, where host calls may run), and the new device asked anew.
    if not (torch.cuda.is_available()
            and torch.cuda.is_current_stream_capturing()):
      self.release_l2()
    self._l2_refused = None

  def release_l2(self) -> None:
    if self._window is not None:
      # Its calls act on the current context: the window's device's.
      with torch.cuda.device(self._window.device):
        self._window.release()
      self._window = None

  def _l2_window(self, bindings: dict, plans, bp: int,
                 capturing: bool) -> tuple[int, int, float] | None:
    """(start, bytes, hitRatio) of the window over the proj rows bucket bp
    keeps in L2 (native_plan.l2_window_rows), reserving the set-aside first
    where none is."""
    if not self.hook.l2_persist or self._l2_refused is not None:
      return None
    key = (bindings["proj"], bp)
    window = self._windows.get(key)
    if window is not None and self._window is not None:
      return window
    if self._window is None and capturing:
      raise RuntimeError(
          "l2_persist: the persisting-L2 set-aside is a context limit, which "
          "a CUDA graph cannot hold: warm the hook up (or draft once) "
          "outside the capture first")
    shape = plans.shape
    elem = torch.empty((), dtype=shape.head_dtype).element_size()
    row = shape.rank * elem
    first, rows = native_plan.l2_window_rows(shape, bp, plans.num_sms)
    # The driver calls act on the current context: this device's.
    try:
      with torch.cuda.device(self._device):
        lim = l2_window.limits()
        if self._window is None:
          # Enough for all of proj (no bucket's window is larger).
          aside, _, _ = l2_window.plan_window(shape.vd * row, lim)
          self._window = l2_window.Window(aside)
    except RuntimeError as e:
      # No driver library, or a context that refuses the limit (the window
      # is a cache policy: the draft is the same without it).
      self._l2_refused = str(e)
      warnings.warn(f"torch_bridge: l2_persist could not reserve the "
                    f"persisting-L2 set-aside ({e}); drafting without an L2 "
                    f"window", RuntimeWarning, stacklevel=4)
      return None
    aside, size, ratio = l2_window.plan_window(rows * row, lim,
                                               self._window.reserved)
    window = (bindings["proj"] + first * row, size, ratio)
    self._windows[key] = window
    return window

  def _mosaic(self) -> bool:
    """Whether this device's plans may use the Mosaic GPU block pass."""
    device = torch.device(self._device) if self._device is not None else None
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
      return False
    return native_plan.mosaic_allowed(torch.cuda.get_device_capability(device),
                                      self.hook.mosaic)

  def _shape(self, spec, s_len: int, base_dtype,
             mode: modes.Mode) -> native_plan.DraftShape:
    t = {name: get(spec) for name, _, get in _BUFFERS}
    layout = ParamsLayout(**{f"{k}_wide": t[k].dtype == torch.int64
                             for k in _WORDS})
    cmap = mode.cmap
    vocab = self.hook.vocab_size if cmap is None else cmap.target_vocab
    mosaic = self._mosaic()
    return native_plan.DraftShape(
        max_num_reqs=self.hook.max_num_reqs, steps=s_len, vocab=vocab,
        rank=self.hook.rank, vocab_in=t["embed"].shape[0],
        base_dtype=base_dtype, head_dtype=self.hook.dtype,
        temperature_dtype=t["temperature"].dtype,
        words=tuple((k, _words(t[k])) for k in _WORDS), layout=layout,
        draft_vocab=None if cmap is None else self.hook.vocab_size,
        greedy=mode.greedy,
        mosaic=mosaic,
        gpu=torch.cuda.get_device_name(self._device) if mosaic else "")

  def plans(self, spec, s_len: int, base_dtype,
            mode: modes.Mode) -> native_plan.DraftPlans:
    shape = self._shape(spec, s_len, base_dtype, mode)
    plans = self._plans.get(shape)
    if plans is None:
      plans = native_plan.DraftPlans(shape, self.hook.buckets, self._device,
                                     self.ir_cache,
                                     self.hook.dependent_launch)
      self._plans[shape] = plans
    return plans

  def _set_window(self, stream: int, window: tuple) -> tuple | None:
    """Sets the window on ``stream``; where the driver refuses it (the
    legacy default stream may not take stream attributes), one warning for
    the stream and the draft runs without it (the same results)."""
    if stream in self._no_window:
      return None
    try:
      self._window.set(stream, *window)
    except RuntimeError as e:
      self._no_window.add(stream)
      warnings.warn(f"torch_bridge: l2_persist could not set the L2 window "
                    f"on stream {stream:#x} ({e}); drafting without it there",
                    RuntimeWarning, stacklevel=4)
      return None
    return window

  def _run_marked(self, launches, bindings: dict, stream: int,
                  window: tuple) -> None:
    """The plan's launches under a capture, each kernel node it records
    carrying the window (where the driver refuses that, one warning and
    the graph keeps what stream capture gave it: the same results)."""
    for launch in launches:
      launch(bindings, stream)
      if stream in self._no_marking:
        continue
      try:
        self._window.mark_captured(stream, *window)
      except RuntimeError as e:
        self._no_marking.add(stream)
        warnings.warn(f"torch_bridge: l2_persist could not set the L2 window "
                      f"on the captured kernel nodes of stream {stream:#x} "
                      f"({e}); the graph keeps the stream's", RuntimeWarning,
                      stacklevel=4)

  def warmup(self, spec, s_len: int, base_dtype, mode: modes.Mode) -> int:
    bindings = self._bindings(spec, s_len, mode)
    plans = self.plans(spec, s_len, base_dtype, mode)
    for bp in self.hook.buckets:
      plans.plan(bp)
      self._l2_window(bindings, plans, bp,
                      torch.cuda.is_current_stream_capturing())
    return len(self.hook.buckets)

  def _bindings(self, spec, s_len: int, mode: modes.Mode) -> dict:
    """Pointers of the spec's buffers, checked once per buffer identity."""
    buffers = _BUFFERS if mode.greedy else (*_BUFFERS, _CACHE)
    tensors = [get(spec) for _, _, get in buffers]
    key = (tuple(checks.tensor_key(t) if isinstance(t, torch.Tensor) else id(t)
                 for t in tensors), mode)
    if self._bound is not None and self._bound[0] == key:
      return self._bound[1]
    mapped = mode.cmap is not None
    for (_, attr, _), t in zip(buffers, tensors):
      self.hook.check_buffer(attr, t, s_len, force=True, aligned=True,
                             mapped=mapped and attr == checks.CACHE)
    bindings = {name: t.data_ptr() for (name, _, _), t in zip(buffers,
                                                              tensors)}
    if mapped and not mode.greedy:
      # Sampling walks the target columns by slot: base and proj as they are.
      bindings["slots"] = mode.cmap.slots.data_ptr()
    elif mapped:
      cmap = mode.cmap
      bindings["columns"] = cmap.columns.data_ptr()
      if cmap.order is not None:
        # Greedy drafting walks the draft columns sorted by target id: proj
        # permuted once here (the weights are fixed while bound), base
        # permuted every call.
        proj = tensors[1].index_select(0, cmap.order).contiguous()
        bindings["proj"] = proj.data_ptr()
        bindings["_proj_sorted"] = proj  # keeps it alive while bound
    self._bound = (key, bindings)
    return bindings

  def run(self, spec, n: int, s_len: int, base: torch.Tensor,
          mode: modes.Mode) -> None:
    """Drafts for n requests from base [n, S, Vd]; writes tokens and cache."""
    bindings = self._bindings(spec, s_len, mode)
    key = (self._bound[0], s_len, base.dtype)
    plans = self._plans_by_key.get(key)
    if plans is None:
      plans = self._plans_by_key[key] = self.plans(spec, s_len, base.dtype,
                                                   mode)
    bp = _buckets.bucket_for(self.hook.buckets, n)
    order = (None if mode.cmap is None or not mode.greedy
             else mode.cmap.order)
    if order is not None:
      torch.index_select(base, 2, order, out=plans.pad[:n])
      base = plans.pad
    elif bp != n or not base.is_contiguous() or base.data_ptr() % checks.ALIGN:
      # Rows past n hold stale logits of earlier calls: padding, which the
      # kernels read but never write from.
      plans.pad[:n].copy_(base)
      base = plans.pad
    launches = plans.plan(bp)
    bindings = {**bindings, "base": base.data_ptr(),
                "count": plans.counts[n].data_ptr()}
    stream = torch.cuda.current_stream(self._device)
    capturing = torch.cuda.is_current_stream_capturing()
    if capturing:
      self._captured.setdefault(id(self._bound[1]),
                                (self._bound[1], mode.cmap, plans))
    if (self._done is not None and stream != self._last_stream
        and not capturing):
      stream.wait_event(self._done)
    window = self._l2_window(bindings, plans, bp, capturing)
    if window is not None:
      # The stream's attribute applies to the work enqueued after it: this
      # draft's launches only (cleared right after them).
      window = self._set_window(stream.cuda_stream, window)
    if window is not None and capturing:
      self._run_marked(launches, bindings, stream.cuda_stream, window)
    else:
      native.run_plan(launches, bindings, stream.cuda_stream)
    if window is not None:
      self._window.clear(stream.cuda_stream)
    spec.draft_tokens[:n, :s_len].copy_(
        plans.tokens[:n * s_len].view(n, s_len))
    if not capturing:  # events recorded in a capture belong to the graph
      if self._done is None:
        self._done = torch.cuda.Event()
      self._done.record(stream)
      self._last_stream = stream
