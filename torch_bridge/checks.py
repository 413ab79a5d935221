"""What the hook's spec buffers must be, checked before anything is written.

Layout checks (type, dtype, device, shape, contiguity, alignment) run when a
buffer is first seen and again whenever its identity (address, shape,
strides, dtype, device) changes, so a serving loop pays them once. Value
checks (state rows, positions, temperatures, anchors) read the buffers on
the host: they run only with ``check_values=True`` and never under CUDA graph
capture, where values cannot be read (docs/limitations.md says what happens
to bad values there).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

INTS = (torch.int32, torch.int64)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
W1 = "spec.model.model.markov_head.markov_w1.weight"
W2 = "spec.model.model.markov_head.markov_w2.weight"
CACHE = "spec.draft_logits.values"
ALIGN = 32  # bytes: the native kernels' pointer divisibility


class BridgeInputError(ValueError, TypeError):
  """A spec attribute has the wrong type, dtype, device, shape, layout or value."""


def describe(t) -> str:
  if not isinstance(t, torch.Tensor):
    return f"an object of type {type(t).__name__}"
  s = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device}"
  return s if t.is_contiguous() else s + " (non-contiguous)"


def dtype_names(dtypes) -> str:
  return "/".join(str(d).removeprefix("torch.") for d in dtypes)


def cache_tensor(dl) -> torch.Tensor:
  # torch.Tensor has a .values method (sparse), so test the type first.
  return dl if isinstance(dl, torch.Tensor) else dl.values


def tensor_key(t: torch.Tensor) -> tuple:
  """A buffer's identity: (address, shape, strides, dtype, device)."""
  return (t.data_ptr(), t.shape, t.stride(), t.dtype, t.device)


class Rule(NamedTuple):
  """What a spec buffer must be: dtypes, a shape test and its description."""
  dtypes: tuple
  shape_ok: Any
  shape_desc: str
  contiguous: bool = True
  written: bool = False  # the hook writes it: no inference tensor outside
                         # inference mode (torch would refuse the write)


# What check_values reads, layout-checked before it reads them.
VALUE_READS = (
    ("spec.sample_idx_mapping", lambda s: s.sample_idx_mapping),
    ("spec.sample_pos", lambda s: s.sample_pos),
    ("spec.temperature", lambda s: s.temperature),
    ("spec.input_buffers.input_ids", lambda s: s.input_buffers.input_ids),
    ("spec._anchor_idx", lambda s: s._anchor_idx),  # noqa: SLF001
    (W1, lambda s: s.model.model.markov_head.markov_w1.weight),
)


def overlaps(t: torch.Tensor) -> bool:
  """Whether two elements of ``t`` may share memory (stride 0, or strides
  that interleave); conservative: False only where they cannot."""
  dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape) if sz > 1)
  extent = 1  # elements spanned by the smaller-stride dimensions so far
  for st, sz in dims:
    if st < extent:
      return True
    extent = st * (sz - 1) + extent
  return False


def rules(m: int, s_len: int, vocab: int, rank: int, dtype) -> dict[str, Rule]:
  """What each spec buffer must be, for M = m, S = s_len."""
  rows_ok = (lambda s: (len(s) == 2 and s[0] >= m and s[1] == s_len) or
             (len(s) == 1 and s[0] >= m * s_len))
  rows_desc = f"[max_num_reqs, S] = [{m}, {s_len}] or [{m * s_len}]"
  return {
      W1: Rule((dtype,), lambda s: len(s) == 2 and s[0] >= vocab and s[1] == rank,
               f"[V_in >= vocab_size = {vocab}, rank = {rank}]"),
      W2: Rule((dtype,), lambda s: s == (vocab, rank),
               f"[vocab_size, rank] = [{vocab}, {rank}]"),
      "spec.input_buffers.input_ids": Rule(
          INTS, lambda s: len(s) == 1 and s[0] >= 1, "[num_tokens]"),
      "spec._anchor_idx": Rule(INTS, lambda s: len(s) == 1 and s[0] >= m,
                               f"[>= max_num_reqs = {m}]"),
      "spec.temperature": Rule(FLOATS, lambda s: s == (m,),
                               f"[max_num_reqs = {m}]"),
      "spec.seeds": Rule(INTS, lambda s: s == (m,), f"[max_num_reqs = {m}]"),
      "spec.sample_idx_mapping": Rule(INTS, rows_ok, rows_desc),
      "spec.sample_pos": Rule(INTS, rows_ok, rows_desc),
      CACHE: Rule((torch.float32,), lambda s: s == (m, s_len, vocab),
                  f"[max_num_reqs, S, vocab_size] = [{m}, {s_len}, {vocab}]",
                  written=True),
      "spec.draft_tokens": Rule(
          INTS, lambda s: len(s) == 2 and s[0] >= m and s[1] >= s_len,
          f"[max_num_reqs = {m}, >= S = {s_len}]", contiguous=False,
          written=True),
      "spec.confidence_logits": Rule(
          FLOATS, lambda s: len(s) == 2 and s[0] >= m and s[1] >= s_len,
          f"[max_num_reqs = {m}, >= S = {s_len}]", contiguous=False,
          written=True),
      "spec.confidence_prefix_lengths": Rule(
          INTS, lambda s: len(s) == 1 and s[0] >= m, f"[>= max_num_reqs = {m}]",
          contiguous=False, written=True),
      "spec.sample_indices": Rule(
          INTS, lambda s: len(s) == 1 and s[0] >= m * s_len,
          f"[>= max_num_reqs * S = {m * s_len}]", contiguous=False),
  }


def check(name: str, t, rule: Rule, device: torch.device, *,
          aligned: bool = False) -> None:
  """Raises BridgeInputError naming ``name`` unless ``t`` fits ``rule``."""
  bad = (not isinstance(t, torch.Tensor) or t.device != device or
         t.dtype not in rule.dtypes or not rule.shape_ok(tuple(t.shape)) or
         (rule.contiguous and not t.is_contiguous()))
  if bad:
    layout = " (contiguous)" if rule.contiguous else ""
    raise BridgeInputError(
        f"{name}: expected {dtype_names(rule.dtypes)} {rule.shape_desc}"
        f"{layout} on {device}, got {describe(t)}")
  if rule.written and overlaps(t):
    raise BridgeInputError(
        f"{name}: expected a buffer whose elements do not share memory, got "
        f"{describe(t)} with strides {t.stride()} (an expanded view?)")
  if rule.written and t.is_inference() and not torch.is_inference_mode_enabled():
    raise BridgeInputError(
        f"{name}: an inference tensor can only be written inside "
        "torch.inference_mode(); call the hook there, or allocate the buffer "
        "outside inference mode")
  if aligned and rule.contiguous and t.data_ptr() % ALIGN:
    raise BridgeInputError(
        f"{name}: the native runtime needs {ALIGN}-byte aligned buffers, got "
        f"address {t.data_ptr():#x} (a view at an offset?)")


def check_values(spec, n: int, s_len: int, m: int, *,
                 one_row_per_request: bool) -> None:
  """Host-side checks of the values a batch reads (check_values=True).

  Args:
    spec: the speculator.
    n, s_len, m: live requests, S, max_num_reqs.
    one_row_per_request: the runtime draws a request's chain with one state
      row's temperature and seed (the JAX runtime), so every valid step of a
      request must map to the same row.
  """
  idx = spec.sample_idx_mapping.reshape(-1)[:n * s_len].view(n, s_len)
  idx = idx.to("cpu", torch.int64)
  if ((idx < -1) | (idx >= m)).any():
    raise BridgeInputError(
        f"spec.sample_idx_mapping: expected state rows in [-1, {m}), got "
        f"{idx.tolist()}")
  for s in range(s_len):
    rows = idx[:, s][idx[:, s] >= 0]
    if len(torch.unique(rows)) != len(rows):
      raise BridgeInputError(
          f"spec.sample_idx_mapping: step {s} maps two requests to one state "
          f"row ({idx[:, s].tolist()}): both would write the same cache row "
          "and the verifier would read the wrong logits for one of them")
  if one_row_per_request:
    for b in range(n):
      rows = {int(v) for v in idx[b].tolist()}
      if len(rows - {-1}) > 1 or (len(rows) > 1 and -1 in rows):
        raise BridgeInputError(
            f"spec.sample_idx_mapping: request {b} maps its steps to state "
            f"rows {idx[b].tolist()}; the JAX runtime needs one state row per "
            "request (or -1 for all its steps)")
  pos = spec.sample_pos.reshape(-1)[:n * s_len].view(n, s_len)
  pos = pos.to("cpu", torch.int64)
  bad = ((pos < 1) | (pos > 2**31)) & (idx >= 0)
  if bad.any():
    raise BridgeInputError(
        f"spec.sample_pos: expected positions in [1, 2**31] at valid steps "
        f"(a draw is keyed by the int32 position - 1), got {pos[bad].tolist()[:8]}")
  temp = spec.temperature.to("cpu", torch.float32)
  used = idx[idx >= 0].unique()
  bad_t = temp[used]
  if torch.isnan(bad_t).any() or (bad_t < 0).any():
    raise BridgeInputError(
        f"spec.temperature: expected temperatures >= 0 (0 = greedy) at the "
        f"state rows in use, got {bad_t.tolist()[:8]}")
  ids = spec.input_buffers.input_ids
  aidx = spec._anchor_idx[:n].to("cpu", torch.int64)  # pylint: disable=protected-access
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
