"""Block sizes, warps and request tiles per shape: a committed table, no search.

``choose`` looks the shape up in ``TABLE`` (entries measured on an H200 with
``benchmarks/tune.py``; see docs/perf-notes.md) and otherwise falls back to a
rule:

* fused (the default at every batch): at B = 1 one request a program with
  the bias on the CUDA cores (bias_dot="fma"), 128 vocabulary columns, and
  the block pass's last program drawing the token (select="tail"); the
  table's DeepSeek-V4 entry also keeps the first 24 MB of proj in L2 across
  steps (proj_l2_rows; the rule does not: untuned elsewhere); above,
  request tiles of 16..64 on the tensor cores (their smallest M is 16), 256
  vocabulary columns per program (128 with 64-request tiles, so the float32
  accumulator stays in registers); rank chunks of 64 in a loop Triton
  pipelines 3 stages deep;
* reference design (selectable): one request per program, vocabulary blocks
  of 1024 at B <= 4 and 4096 above.

The persistent draft (select="persistent": the whole draft in one launch) is
selectable but in no entry: level with the table at B = 1 (perf-notes.md,
change 24).
"""

from __future__ import annotations

import dataclasses
import functools

from jax_markov.kernels import block_pass

METHODS = ("fused", "reference")


@dataclasses.dataclass(frozen=True)
class KernelConfig:
  """Static launch configuration of one step's kernels.

  Attributes:
    method: "fused" (bias dot inside the block pass) or "reference" (XLA GEMM
      writes the bias, the block pass reads it).
    block_b: requests per block-pass program (1 for "reference").
    block_v: vocabulary columns per block-pass program (power of two).
    block_k: rank columns per dot, fused only (power of two >= 16).
    k_loop: fused only: "fori" loops over the rank chunks in a loop Triton
      software-pipelines (num_stages deep); "static" unrolls it in Python.
    num_warps, num_stages: Triton parameters of the block pass.
    select_warps: Triton warps of the select pass.
    unroll: unroll the steps; None: unroll when compiled. On GPU a rolled
      loop reads its trip predicate back to the host every step; unrolled,
      all 2S launches are queued at once with constant step indices. The
      interpreter compiles faster rolled.
    serpentine: the block pass walks the vocabulary backwards on odd steps,
      so each step starts on the proj blocks that L2 still holds from the
      step before (proj is read every step and is larger than L2).
    bias_dot: fused only: "mma" computes the bias tile on the tensor cores
      (block_b and block_k >= 16), "fma" on the CUDA cores (any block_b: for
      a few requests).
    select: "pass" draws in a second launch a step (the select pass); "tail"
      (fused, block_b = 1) draws in the block pass's program that finishes
      the step last, one launch a step; "persistent" (fused, block_b = 1,
      bias_dot="fma") runs the whole draft in one launch of persistent
      programs that meet at a barrier each step and all draw
      (kernels/draft_pass.py).
    programs: with select="persistent", programs per request; 0: one per
      multiprocessor split over the requests (1 in the interpreter).
    proj_l2_rows: fused only: the first proj_l2_rows rows of proj stay in L2
      across the steps (an evict_last hint on their loads, evict_first on
      every other stream); 0: no cache hints.
  """
  method: str = "fused"
  block_b: int = 16
  block_v: int = 256
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 1
  select_warps: int = 4
  unroll: bool | None = None
  k_loop: str = "fori"
  serpentine: bool = True
  bias_dot: str = "mma"
  select: str = "pass"
  proj_l2_rows: int = 0
  programs: int = 0

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"method must be one of {METHODS}, got {self.method!r}")
    for name in ("block_b", "block_v", "block_k", "num_warps"):
      value = getattr(self, name)
      if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    block_pass.check_options(
        fused=self.method == "fused", block_b=self.block_b,
        block_k=self.block_k, k_loop=self.k_loop, bias_dot=self.bias_dot,
        select=self.select, proj_l2_rows=self.proj_l2_rows)
    if self.programs < 0 or (self.programs and self.select != "persistent"):
      raise ValueError("programs must be >= 0 and is for select='persistent', "
                       f"got {self.programs} with select={self.select!r}")


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _batch_bucket(batch: int) -> int:
  return _next_pow2(batch)


# (method, vocab, rank, batch bucket) -> KernelConfig, the fastest of
# benchmarks/tune.py's sweep on an H200 (benchmarks/results/tune-*.json).
TABLE: dict[tuple[str, int, int, int], KernelConfig] = {
    ("fused", 129280, 256, 1): KernelConfig("fused", 1, 128, 64, 4, 3,
                                            bias_dot="fma", select="tail",
                                            proj_l2_rows=49152),
    ("fused", 129280, 256, 64): KernelConfig("fused", 64, 128, 64, 4, 3),
    ("fused", 129280, 256, 256): KernelConfig("fused", 64, 128, 64, 4, 3),
    ("reference", 129280, 256, 1): KernelConfig("reference", 1, 4096, 64, 8, 1),
}


def default_method(batch: int, vocab: int, rank: int) -> str:
  """The faster method for a shape, by the sweep (docs/perf-notes.md).

  With the rank loop software-pipelined, fused won at every batch swept at the
  DeepSeek-V4 shape (B = 1: 0.246 vs 0.265 ms for the best reference config;
  B = 256: 0.88 vs 1.20 ms).
  """
  del batch, vocab, rank
  return "fused"


@functools.lru_cache(maxsize=256)  # runs on every call of the sampler
def choose(method: str | None, batch: int, vocab: int, rank: int, *,
           interpret: bool) -> KernelConfig:
  """The configuration for a shape: the table's entry, else the rule above."""
  if method is None:
    method = default_method(batch, vocab, rank)
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS} or None, got {method!r}")
  if interpret:
    # The interpreter loops over the grid on the CPU: few, large programs.
    if method == "reference":
      return KernelConfig(method, 1, min(512, _next_pow2(vocab)), 64, 4)
    return KernelConfig(method, 16, min(512, max(16, _next_pow2(vocab))),
                        min(64, max(16, _next_pow2(rank))), 4)
  entry = TABLE.get((method, vocab, rank, _batch_bucket(batch)))
  if entry is not None:
    return entry
  if method == "reference":
    block_v = 1024 if batch <= 4 else 4096
    return KernelConfig(method, 1, min(block_v, _next_pow2(vocab)), 64,
                        8 if batch <= 4 else 4)
  if batch == 1:  # one request: the bias on the CUDA cores (docs/perf-notes.md)
    return KernelConfig(method, 1, min(128, max(16, _next_pow2(vocab))),
                        min(64, _next_pow2(rank)), 4, 3, bias_dot="fma",
                        select="tail")
  block_b = min(64, max(16, _next_pow2(batch)))
  block_v = 128 if block_b == 64 else 256  # the accumulator fits in registers
  return KernelConfig(method, block_b, min(block_v, max(16, _next_pow2(vocab))),
                      min(64, max(16, _next_pow2(rank))), 4, 3)
