"""FusedMarkovSampler: jax_markov as the Markov-step hook of a torch speculator.

vLLM's ``DSparkSpeculator._sample_sequential`` hands its sequential Markov
steps to a hook ``sampler(spec, num_reqs, head_hidden) -> bool``; this is
such a hook. Two runtimes run the draft (docs/torch_bridge.md):

* "native" (the default where CUDA and triton exist): the Pallas kernels,
  compiled by triton, launched on torch's current stream; capturable in a
  torch CUDA graph (native_runtime.py);
* "jax": one XLA program per bucket over DLPack, for JAX-owned workflows
  (jax_runtime.py); not capturable.
"""

from __future__ import annotations

import logging
import operator
import threading
import warnings

import numpy as np
import torch

from torch_bridge import buckets as _buckets
from torch_bridge import checks
from torch_bridge import modes
from torch_bridge import native
from torch_bridge.checks import BridgeInputError

log = logging.getLogger("torch_bridge")
RUNTIMES = ("native", "jax")


def _choose_runtime(runtime: str | None) -> tuple[str, str]:
  """The runtime to run and why."""
  if runtime not in (None, *RUNTIMES):
    raise ValueError(f"runtime must be one of {RUNTIMES} or None, got "
                     f"{runtime!r}")
  ok, why = native.available()
  if runtime == "jax":
    return "jax", "asked for (runtime='jax')"
  if runtime == "native":
    if not ok:
      raise RuntimeError(f"runtime='native' cannot run here: {why}")
    return "native", "asked for (runtime='native')"
  if ok:
    return "native", why
  return "jax", f"the native runtime cannot run here: {why}"


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

  Thread safety: one sampler may be called from several threads at once
  (each with its own speculator); calls are serialized by a lock, as the
  padded base-logits buffer, the import cache and the runtime's scratch are
  shared. With the native runtime a call on another stream than the previous
  call's waits for it.

  Checks (docs/limitations.md, "torch_bridge: what is checked in each
  mode"): layouts always, before anything is written; values only with
  ``check_values=True`` outside capture. Unchecked bad values never write
  out of bounds: state rows outside [0, M) are padding, negative or NaN
  temperatures draw greedily, positions and anchors are clamped.

  Returns False without touching anything for configurations the hook does
  not cover (logged once each), so the engine runs its own path.

  Attributes:
    max_num_reqs, vocab_size, rank, dtype: as constructed.
    buckets: the batch sizes compiled for (docs/torch_bridge.md).
    runtime: "native" or "jax", the runtime that runs; runtime_reason: why.
  """

  def __init__(self, max_num_reqs: int, vocab_size: int, rank: int, dtype,
               *, runtime: str | None = None, buckets=None,
               check_values: bool = False, on_capture: str = "raise",
               cache_dir: str | None = None,
               dependent_launch: bool | None = None,
               mosaic: bool | None = None, l2_persist: bool = False):
    """Builds the hook.

    Args:
      max_num_reqs: M, the speculator's request capacity; the number of state
        rows of ``spec.temperature``, ``spec.seeds`` and the logits cache.
      vocab_size: V, the draft vocabulary (columns of the base logits, rows
        of ``markov_w2``).
      rank: R, the Markov head's rank.
      dtype: the head's dtype (a torch dtype, or its name, e.g. "bfloat16").
      runtime: "native", "jax", or None: native where CUDA, triton and the
        Pallas Triton lowering exist, else jax. Logged at init (logger
        "torch_bridge"); if native kernels later fail to lower or compile,
        the hook warns once and continues with the jax runtime.
      buckets: batch sizes to compile for (default: powers of two below M,
        and M); see :func:`torch_bridge.buckets.normalize_buckets`.
      check_values: also verify the values of the index buffers on every
        call (state rows in range and distinct within a step, positions in
        [1, 2**31], temperatures >= 0 and not NaN at the rows in use, anchors
        in the vocabulary), after the layout of what it reads. Costs a
        device-to-host copy and sync per call, and is skipped under capture.
      on_capture: the jax runtime under torch CUDA graph capture: "raise"
        (default) or "fallback" (return False, so the engine captures its
        own eager path). The native runtime is captured.
      cache_dir: where lowered kernels are kept (default
        $JAX_MARKOV_CACHE_DIR or ~/.cache/jax_markov/native).
      dependent_launch: the native runtime's select-pass buckets (B > 1)
        as programmatic dependent launches, each kernel starting while the
        one before it ends (compute capability 9.0 or newer;
        docs/torch_bridge.md): 2-15% faster captured drafts at B >= 16 on
        an H200. True, False, or None (default):
        $JAX_MARKOV_DEPENDENT_LAUNCH ("1" / "0") where set, else wherever
        the GPU has them.
      mosaic: the native runtime's buckets that the tuning table gives to
        the Mosaic GPU block pass (Hopper; B = 256 at the DeepSeek-V4 shape;
        sampling the full vocabulary in bf16) run it (docs/torch_bridge.md).
        True (raises at the first draft on a GPU that cannot), False, or
        None (default): wherever the GPU can run it, unless
        $JAX_MARKOV_MOSAIC == "0". At B = 256 it made the captured draft
        0.69 ms against the Triton block pass's 0.82 on an H200
        (docs/perf-notes.md change 36).
      l2_persist: the native runtime keeps as much of proj as the device's
        persisting-L2 set-aside holds in L2 across a draft's steps
        (torch_bridge/l2_window.py): it reserves the set-aside (a device-wide
        context limit) at the first warmup or draft outside a capture, and
        sets an access policy window over proj's streamed rows on the
        stream around each draft's launches. Proj's persisting lines then
        stay in L2 after the draft, leaving other kernels that much less
        until :meth:`release_l2`. Same results either way. Off by default:
        on an H100 it made the captured draft slower at every batch, 3-5%
        at B = 1 to 4 and 21-133% at B = 16 to 256 (docs/perf-notes.md
        change 60). The jax runtime ignores it.

    The hook owns the scratch its draft uses (statistics, draw parameters,
    tokens): keep it alive as long as any CUDA graph captured with it may be
    replayed. A graph does not hold the hook; replayed after the hook is
    gone, it writes into memory the allocator has handed to others, or,
    once that memory is released, faults with an illegal memory access.
    """
    if isinstance(dtype, str):
      dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if dtype not in checks.FLOATS:
      raise ValueError(f"dtype must be one of "
                       f"{checks.dtype_names(checks.FLOATS)}, got {dtype!r}")
    if on_capture not in ("raise", "fallback"):
      raise ValueError(f"on_capture must be 'raise' or 'fallback', got "
                       f"{on_capture!r}")
    for name, value in (("max_num_reqs", max_num_reqs),
                        ("vocab_size", vocab_size), ("rank", rank)):
      if isinstance(value, bool) or operator.index(value) < 1:
        raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    self.max_num_reqs = operator.index(max_num_reqs)
    self.vocab_size = operator.index(vocab_size)
    self.rank = operator.index(rank)
    self.dtype = dtype
    self.buckets = _buckets.normalize_buckets(buckets, self.max_num_reqs)
    self.check_values = check_values
    self.on_capture = on_capture
    if dependent_launch not in (None, True, False):
      raise ValueError("dependent_launch must be True, False or None, got "
                       f"{dependent_launch!r}")
    self.dependent_launch = dependent_launch
    if not (mosaic is None or isinstance(mosaic, bool)):
      raise ValueError(f"mosaic must be True, False or None, got {mosaic!r}")
    self.mosaic = mosaic
    if not isinstance(l2_persist, bool):
      raise ValueError(f"l2_persist must be True or False, got {l2_persist!r}")
    self.l2_persist = l2_persist
    self.runtime, self.runtime_reason = _choose_runtime(runtime)
    log.info("torch_bridge.FusedMarkovSampler: runtime %r (%s)", self.runtime,
             self.runtime_reason)
    self._ir_cache = native.IRCache(cache_dir)
    self._impl = self._make_runtime(self.runtime)
    self._lock = threading.Lock()
    self._checked: dict[str, tuple] = {}
    self._rules: dict[int, dict] = {}
    self._device: torch.device | None = None
    self._declined: set[str] = set()
    self._map: tuple | None = None  # (identity of d2t, modes.ColumnMap)

  def _make_runtime(self, name: str):
    if name == "native":
      from torch_bridge import native_runtime  # pylint: disable=g-import-not-at-top
      return native_runtime.NativeRuntime(self, self._ir_cache)
    from torch_bridge import jax_runtime  # pylint: disable=g-import-not-at-top
    return jax_runtime.JaxRuntime(self)

  def _fall_back(self, error: Exception) -> None:
    """The native kernels failed to lower or compile: one warning, then jax."""
    warnings.warn(
        f"torch_bridge: the native runtime failed ({type(error).__name__}: "
        f"{error}); continuing with the jax runtime (DLPack, not "
        "capturable)", RuntimeWarning, stacklevel=3)
    self.runtime = "jax"
    self.runtime_reason = f"fell back: native failed with {error!r}"
    self._impl = self._make_runtime("jax")
    if self._device is not None:
      self._impl.reset(self._device)

  # -- public helpers ---------------------------------------------------------

  def release_l2(self) -> None:
    """With ``l2_persist``: gives the hook's persisting-L2 set-aside up
    (host calls, not in a capture). Hooks of one device share the
    context's set-aside: the last one to release it turns the persisting
    lines (proj's) back to normal and the set-aside back to what it was
    before the first reserved it; the others keep theirs. The next draft
    outside a capture reserves it again."""
    release = getattr(self._impl, "release_l2", None)
    if release is not None:
      release()

  @property
  def import_count(self) -> int:
    """DLPack imports so far (jax runtime; cached buffers count once)."""
    imports = getattr(self._impl, "imports", None)
    return 0 if imports is None else imports.imports

  def is_zero_copy(self, slot: str) -> bool | None:
    """Whether the jax runtime's import of ``slot`` aliases torch's memory."""
    imports = getattr(self._impl, "imports", None)
    return None if imports is None else imports.is_alias(slot)

  def warmup(self, spec, base_dtype=None) -> int:
    """Compiles the draft for every bucket without writing anything.

    Args:
      spec: the speculator (its buffers are validated).
      base_dtype: dtype of ``compute_draft_logits``'s output (default: the
        head dtype).

    Returns:
      The number of buckets compiled.
    """
    base_dtype = self.dtype if base_dtype is None else base_dtype
    with self._lock:
      s_len = self._num_steps(spec)
      self._set_device(spec.model.model.markov_head.markov_w2.weight.device)
      mode = self._mode(spec, s_len)
      try:
        return self._impl.warmup(spec, s_len, base_dtype, mode)
      except native.BuildError as e:
        self._fall_back(e)
        return self._impl.warmup(spec, s_len, base_dtype, mode)

  # -- the hook ---------------------------------------------------------------

  def __call__(self, spec, num_reqs: int, head_hidden: torch.Tensor) -> bool:
    """Drafts ``spec.num_speculative_steps`` tokens for ``num_reqs`` requests.

    Args:
      spec: the speculator (see the class docstring for what is read).
      num_reqs: requests in this batch, 0 <= num_reqs <= max_num_reqs.
      head_hidden: [T, H] hidden states the base logits are computed from;
        its device is the device of every spec buffer.

    Returns:
      True once the writes are queued on torch's current stream (nothing is
      synchronized). False, with nothing written, for configurations the
      hook does not cover.

    Raises:
      BridgeInputError: ``num_reqs`` is not an int in range, or a spec
        attribute has the wrong type, dtype, device, shape, layout (or, with
        check_values, value), or a written buffer is an inference tensor
        outside inference mode; the message names it. Nothing has been
        written.
      RuntimeError: the jax runtime called during torch CUDA graph capture
        (on_capture="raise").
    """
    if isinstance(num_reqs, (bool, np.bool_)) or (
        isinstance(num_reqs, torch.Tensor) and num_reqs.dtype == torch.bool):
      raise BridgeInputError(f"num_reqs: expected an int, got {num_reqs!r}")
    try:
      n = operator.index(num_reqs)
    except TypeError:
      raise BridgeInputError(
          f"num_reqs: expected an int, got {num_reqs!r}") from None
    if not 0 <= n <= self.max_num_reqs:
      raise BridgeInputError(
          f"num_reqs: expected 0 <= num_reqs <= max_num_reqs="
          f"{self.max_num_reqs}, got {n}")
    reason = self._unsupported(spec)
    if reason is not None:
      if reason not in self._declined:
        self._declined.add(reason)
        log.warning("torch_bridge.FusedMarkovSampler declines: %s; the "
                    "engine runs its own path", reason)
      return False
    if not isinstance(head_hidden, torch.Tensor):
      raise BridgeInputError(
          f"head_hidden: expected a torch.Tensor, got "
          f"{checks.describe(head_hidden)}")
    capturing = (head_hidden.device.type == "cuda" and
                 torch.cuda.is_current_stream_capturing())
    if capturing and not self._impl.capturable:
      if self.on_capture == "fallback":
        return False
      raise RuntimeError(
          "torch_bridge.FusedMarkovSampler (runtime 'jax') was called during "
          "torch CUDA graph capture; JAX work cannot be captured into a torch "
          "graph. Use the native runtime (CUDA + triton), run the draft step "
          "uncaptured, or pass on_capture='fallback'.")
    with self._lock, torch.no_grad():
      self._set_device(head_hidden.device)
      s_len = self._num_steps(spec)
      if n == 0:
        return True
      # Everything the call writes is checked before anything is written.
      mode = self._mode(spec, s_len)
      conf = modes.confidence(spec)
      if conf is not None:
        self._check_confidence(spec, conf, s_len)
      if self.check_values and not capturing:
        # The layout of what the value checks read, first.
        for name, get in checks.VALUE_READS:
          self.check_buffer(name, get(spec), s_len)
        checks.check_values(
            spec, n, s_len, self.max_num_reqs,
            one_row_per_request=self._impl.one_row_per_request)
      base = self._base_logits(spec, n, s_len, head_hidden)
      try:
        self._impl.run(spec, n, s_len, base, mode)
      except native.BuildError as e:
        if capturing:  # the capture is broken already: say so, do not hide it
          raise
        self._fall_back(e)
        self._impl.run(spec, n, s_len, base, mode)
      if conf is not None:
        modes.apply_confidence(spec, n, s_len, head_hidden,
                               float(conf.threshold))
    return True

  # -- internals --------------------------------------------------------------

  def _check_confidence(self, spec, conf, s_len: int) -> None:
    threshold = getattr(conf, "threshold", None)
    if isinstance(threshold, bool) or not isinstance(
        threshold, (int, float, np.floating, np.integer)) or threshold != threshold:
      raise BridgeInputError(
          "spec.confidence_config.threshold: expected a number, got "
          f"{threshold!r}")
    for name in ("compute_confidence_logits", "markov_embed"):
      if not callable(getattr(spec.model, name, None)):
        raise BridgeInputError(
            f"spec.model.{name}: the confidence head needs it callable")
    self.check_buffer("spec.confidence_logits", spec.confidence_logits, s_len)
    self.check_buffer("spec.confidence_prefix_lengths",
                      spec.confidence_prefix_lengths, s_len)

  def _unsupported(self, spec) -> str | None:
    """Why the hook declines this configuration, or None.

    Every DSpark mode is covered (modes.py); what is left outside is a
    speculator without the attributes the hook reads, which is an error
    (BridgeInputError), not a decline.
    """
    del spec
    return None

  def _mode(self, spec, s_len: int) -> modes.Mode:
    """The call's mode, its written buffers checked (cached per identity)."""
    self.check_buffer("spec.draft_tokens", spec.draft_tokens, s_len)
    greedy = spec.draft_logits is None
    d2t = getattr(spec.model, "draft_id_to_target_id", None)
    if greedy:
      cache = None
      target_vocab = (self.vocab_size if d2t is None else
                      spec.model.model.markov_head.markov_w1.weight.shape[0])
    else:
      cache = checks.cache_tensor(spec.draft_logits)
      self.check_buffer(checks.CACHE, cache, s_len, mapped=d2t is not None)
      target_vocab = cache.shape[-1]
    cmap = None
    if d2t is not None:
      key = (checks.tensor_key(d2t) if isinstance(d2t, torch.Tensor) else
             id(d2t), target_vocab)
      if self._map is None or self._map[0] != key:
        v_in = spec.model.model.markov_head.markov_w1.weight.shape[0]
        if target_vocab > v_in:
          raise BridgeInputError(
              f"{checks.W1}: the next step's embedding is looked up by target "
              f"id, so it needs >= {target_vocab} rows (the target "
              f"vocabulary), got {v_in}")
        self._map = (key, modes.column_map(d2t, self.vocab_size, target_vocab,
                                           self._device))
      cmap = self._map[1]
    return modes.Mode(greedy=greedy, cmap=cmap)

  def _set_device(self, device: torch.device):
    if device != self._device:
      # Everything cached was validated against the old device.
      self._checked.clear()
      self._device = device
      self._impl.reset(device)

  def _num_steps(self, spec) -> int:
    s_len = getattr(spec, "num_speculative_steps", None)
    if isinstance(s_len, bool) or not isinstance(s_len, (int, np.integer)) \
        or s_len < 1:
      raise BridgeInputError(
          f"spec.num_speculative_steps: expected an int >= 1, got {s_len!r}")
    return int(s_len)

  def check_buffer(self, name: str, t, s_len: int, *, force: bool = False,
                   aligned: bool = False, mapped: bool = False) -> None:
    """Checks a spec buffer against its rule, once per buffer identity.

    The identity includes whether inference mode is on: whether an inference
    tensor may be written depends on it. ``mapped``: a reduced draft
    vocabulary, whose cache is as wide as the target vocabulary.
    """
    key = (checks.tensor_key(t), torch.is_inference_mode_enabled(), mapped) \
        if isinstance(t, torch.Tensor) else None
    if not force and key is not None and self._checked.get(name) == key:
      return
    rules = self._rules.get((s_len, mapped))
    if rules is None:
      rules = self._rules[(s_len, mapped)] = checks.rules(
          self.max_num_reqs, s_len, self.vocab_size, self.rank, self.dtype,
          mapped=mapped)
    checks.check(name, t, rules[name], self._device, aligned=aligned)
    self._checked[name] = key

  def _base_logits(self, spec, n: int, s_len: int, head_hidden):
    """The base logits [n, S, V], computed as the reference hook does."""
    vocab = self.vocab_size
    rows = n * s_len
    self.check_buffer("spec.sample_indices", spec.sample_indices, s_len)
    base = spec.model.compute_draft_logits(
        head_hidden[spec.sample_indices[:rows]])
    if (not isinstance(base, torch.Tensor) or base.device != self._device or
        base.dtype not in checks.FLOATS or tuple(base.shape) != (rows, vocab)):
      raise BridgeInputError(
          f"spec.model.compute_draft_logits(...): expected "
          f"{checks.dtype_names(checks.FLOATS)} [num_reqs * S = {rows}, "
          f"vocab_size = {vocab}] on {self._device}, got "
          f"{checks.describe(base)}")
    return base.view(n, s_len, vocab) if base.is_contiguous() else \
        base.reshape(n, s_len, vocab)
