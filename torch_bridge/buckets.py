"""Batch buckets: the bounded set of batch sizes the bridge compiles for.

A call with ``num_reqs`` requests runs the compiled step of the smallest
bucket ``>= num_reqs``; the rows past ``num_reqs`` are padding (state row -1:
they write nothing). The default buckets are the powers of two below
``max_num_reqs`` and ``max_num_reqs`` itself, so at most
``ceil(log2(max_num_reqs)) + 1`` programs are ever compiled and no bucket
pads more than 2x.
"""

from __future__ import annotations

import bisect
from typing import Iterable, Sequence


def default_buckets(max_num_reqs: int) -> tuple[int, ...]:
  """Returns the default buckets for ``max_num_reqs`` (>= 1).

  Returns:
    ``(1, 2, 4, ..., max_num_reqs)``: the powers of two below
    ``max_num_reqs``, then ``max_num_reqs``; increasing.
  """
  if max_num_reqs < 1:
    raise ValueError(f"max_num_reqs must be >= 1, got {max_num_reqs}")
  out = []
  b = 1
  while b < max_num_reqs:
    out.append(b)
    b *= 2
  out.append(max_num_reqs)
  return tuple(out)


def normalize_buckets(buckets: Iterable[int] | None,
                      max_num_reqs: int) -> tuple[int, ...]:
  """Validates user buckets and makes them cover ``[1, max_num_reqs]``.

  Args:
    buckets: batch sizes to compile for, or None for :func:`default_buckets`.
      Each must be in ``[1, max_num_reqs]``; ``max_num_reqs`` is added when
      missing, so every ``num_reqs <= max_num_reqs`` has a bucket. Matching
      them to the serving engine's padded batch sizes (e.g. vLLM's CUDA graph
      capture sizes) avoids the padding copy of the base logits.
    max_num_reqs: the largest batch.

  Returns:
    The sorted, de-duplicated buckets, ending with ``max_num_reqs``.
  """
  if buckets is None:
    return default_buckets(max_num_reqs)
  out = sorted({int(b) for b in buckets})
  bad = [b for b in out if not 1 <= b <= max_num_reqs]
  if bad:
    raise ValueError(
        f"buckets must lie in [1, max_num_reqs={max_num_reqs}], got {bad}")
  if not out or out[-1] != max_num_reqs:
    out.append(max_num_reqs)
  return tuple(out)


def bucket_for(buckets: Sequence[int], num_reqs: int) -> int:
  """The smallest bucket ``>= num_reqs`` (``buckets`` sorted, last = max)."""
  i = bisect.bisect_left(buckets, num_reqs)
  if i == len(buckets):
    raise ValueError(
        f"num_reqs={num_reqs} exceeds the largest bucket {buckets[-1]}")
  return buckets[i]
