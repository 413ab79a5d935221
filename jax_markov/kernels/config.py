"""KernelConfig: the static launch configuration every kernel wrapper takes.

One frozen (hashable) object, so it is a static argument of the jitted
sampler and of each kernel wrapper; the wrappers read their block sizes,
Triton parameters and variants from it instead of from one keyword each.
Its fields are keyword-only: a configuration names what it sets.
"""

from __future__ import annotations

import dataclasses

METHODS = ("fused", "xla_bias", "mosaic")
K_LOOPS = ("fori", "static")
BIAS_DOTS = ("mma", "fma")
SELECTS = ("pass", "tail", "persistent")
REMAINDER_PASSES = ("joint", "after")
L2_HINTS = ("none", "stream", "proj")


@dataclasses.dataclass(frozen=True, kw_only=True)
class KernelConfig:
  """Static launch configuration of one step's kernels.

  Attributes:
    method: "fused" (the bias dot inside the block pass) or "xla_bias" (an
      XLA GEMM writes the bias [B, V] to HBM and the block pass reads it:
      vLLM's design), or "mosaic": the fused block pass as a Pallas Mosaic
      GPU kernel (kernels/mosaic_block_pass.py; Hopper only, bfloat16, no
      reduced vocabulary, no greedy drafting, no interpreter), block_b 64,
      128 or 192 (three consumer warpgroups), block_v 64 or 128, num_stages its proj chunks in flight (< 2:
      as many as fit in shared memory); the select pass stays Triton.
    block_b: requests per block-pass program (1 for "xla_bias"), a power
      of two; method="mosaic" also 192.
    block_v: vocabulary columns per block-pass program (power of two).
    block_k: rank columns per dot, fused only (power of two >= 16).
    k_loop: fused only: "fori" loops over the rank chunks in a loop Triton
      software-pipelines (num_stages deep); "static" unrolls it in Python.
    num_warps, num_stages: Triton parameters of the block pass (and of the
      draft pass).
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
      a few requests; the block pass gives each request of the tile a 2D
      product of its own on the same proj chunk).
    select: "pass" draws in a second launch a step (the select pass); "tail"
      (fused, block_b = 1) draws in the block pass's program that finishes
      the step last, one launch a step; "persistent" (fused) runs the
      whole draft in one launch of persistent programs that meet at a
      barrier each step (kernels/draft_pass.py).
    programs: with select="persistent", the programs of the launch (each
      takes every P-th vocabulary block for every request); 0: one a
      multiprocessor (1 in the interpreter).
    held_blocks: with select="persistent", blocks of block_v proj rows each
      program loads once and keeps on chip for all S steps (registers on
      the CUDA cores, shared memory with the tensor cores; the rest of proj
      streams every step); 0: none.
    proj_l2_rows: fused only: the first proj_l2_rows rows of proj stay in L2
      across the steps (an evict_last hint on their loads, evict_first on
      every other stream); 0: no cache hints. The hint reaches the memory
      only where the proj loads are plain ld.global (the CUDA-core tile,
      k_loop="static"): Triton turns a pipelined loop's loads into cp.async
      copies, which carry no policy, and the branch between two pipelined
      loops doubles the tile's shared memory (docs/perf-notes.md changes 54
      to 56; touching the kept tile again after the loop, change 55, was
      12-21% slower on the H200 and is not kept).
    l2_hints: fused, step by step, proj_l2_rows=0: eviction hints without
      kept rows. "stream": base's loads and the cache's stores (each read or
      written once a draft) evict_first, proj's loads no hint, so that L2
      holds more of the proj blocks the step before read last, which the
      next step reads first (serpentine); "proj": as "stream", and proj's
      loads evict_last at every step (one static policy: no branch between
      two rank loops as proj_l2_rows takes). "none": no hints
      (docs/perf-notes.md change 54).
    fold_chunks: method="mosaic" with block_b = 128 or 192: each CTA walks one
      contiguous chunk of vocabulary blocks and its epilogue also reduces
      them to the chunk statistics the select pass reads, so there is no
      chunk pass a step (kernels/chunk_pass.py; docs/perf-notes.md change
      39). False, or block_b = 64: the chunk pass.
    early_proj: fused, step by step: the block pass loads the first
      early_proj rank chunks of its proj tile before the dependent-launch
      wait (proj does not depend on the previous token), so that a step's
      first programs stream proj while the kernel before them (the previous
      step's select) still runs; with proj_l2_rows, with the same eviction
      hints as the rank loop's loads; 0: every chunk after the wait, in the
      pipelined rank loop (docs/perf-notes.md changes 42 and 51).
    prefetch_proj: fused, step by step, no proj_l2_rows or early_proj, and
      only where the block pass is built for a dependent launch (the native
      runtime; elsewhere the kernel is the one without it): the programs
      touch one element of each 32-byte sector of the first prefetch_proj
      rank chunks of their proj tile before the wait and discard them right
      after it, so that the rank loop, unchanged, reads those chunks from
      L2; nothing is held in registers through the loop. The token's load
      waits for these loads: more than lands during the wait delays the
      step (docs/perf-notes.md change 44).
    prefetch_programs: with prefetch_proj, only the programs whose launch
      index (program_id(0) + program_id(1) * num_programs(0)) is below it
      prefetch: those resident while the step before ends (about the first
      wave); the others would only wait for the loads. 0: every program.
    early_dependents: select="pass", with dependent launches (the native
      runtime): the select pass lets the next kernel, the next step's block
      pass, launch before its own wait instead of after it, so that the
      block pass's programs take the multiprocessors the step's last wave
      leaves idle and load base (and early or prefetched proj) while it
      ends (kernels/dependent_launch.py says why that is safe;
      docs/perf-notes.md change 45). False: after the wait.
    remainder_b: fused, select="pass": where B = q * block_b + r with q >= 1
      and 0 < r <= remainder_b, the grid has q request tiles and the last
      one's programs also take the r rows past them, as a second tile (r
      rounded up to a power of two, at least 16 on the tensor cores) in the
      same rank loop: each proj chunk is loaded once for both, where a
      (q + 1)-th tile of r live rows would read the whole of proj again and
      add a program a vocabulary block (B = 72 on 64-request tiles;
      docs/perf-notes.md change 48). Below block_b; 0, or another B: the
      last tile is partial, as without it.
    remainder_pass: with remainder rows: "joint" runs them in the tile's
      rank loop (one proj load for both, and every program of the grid
      holds both accumulators), "after" in a second rank loop once the
      tile's epilogue is done (the proj tile read again, likely from L2;
      only the last tile's programs run it, and no program holds more
      registers than the tile's).
    partial_tiles: method="mosaic": the table may pick this entry for a
      batch that does not fill its request tiles (B >= 64, a multiple of
      4): the last tile's consumers then take 64-row windows that end at
      row B, rows they share with another consumer are computed twice and
      stored once (kernels/mosaic_block_pass.py; docs/perf-notes.md change
      50). False: the table picks the entry only where block_b divides B.
      A config passed to the sampler runs partial tiles either way.
    select_embed: method="mosaic": the select pass also writes the token it
      draws's row of embed to the [B, R] embeddings the next step's Mosaic
      pass reads (vLLM's select fetches the next embedding the same way),
      so no gather runs between the steps (the native runtime's embed_rows
      launch a step, XLA's gather in JAX); only step 0's embeddings, of
      the anchors, are gathered (docs/perf-notes.md change 53). False: a
      gather before every step.
    store_warpgroup: method="mosaic": where the Mosaic pass stores cache
      rows by warp (the native runtime's state-indexed cache, and every
      partial last tile), a fourth warpgroup stores them from two staging
      tiles a consumer, so the consumers go on to their next WGMMA instead
      of storing their own rows (kernels/mosaic_block_pass.py;
      docs/perf-notes.md change 58). Same bits. Ignored where the pass
      stores the cache by TMA (the dense layout's full tiles). Level with
      the consumers' own stores in the captured draft at B = 64, 128 and
      256 on an H100 (the stores cost their memory traffic, not the
      consumers' time): an option, in no table entry.
    block_programs: fused, step by step, the tensor cores, one request
      tile (B <= block_b): the block pass as this many programs, each
      walking the vocabulary blocks p, p + P, ... in one loop over (block,
      rank chunk) that Triton software-pipelines across the blocks, the
      block's epilogue (cache stores and statistics) under its last chunk,
      instead of a program a block that fills and drains its own pipeline
      (kernels/block_pass.py; docs/perf-notes.md "What is left"). The same
      arithmetic in the same order: the same bits. 0: a program a block.
      No remainder rows, early or prefetched proj chunks, L2-kept rows or
      hints, reduced vocabulary or tail select. An experiment, in no table
      entry: not yet run on a GPU.
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
  held_blocks: int = 0
  fold_chunks: bool = True
  early_proj: int = 0
  prefetch_proj: int = 0
  prefetch_programs: int = 0
  early_dependents: bool = False
  remainder_b: int = 0
  remainder_pass: str = "joint"
  partial_tiles: bool = False
  select_embed: bool = False
  store_warpgroup: bool = False
  l2_hints: str = "none"
  block_programs: int = 0

  def __post_init__(self):
    for name, allowed in (("method", METHODS), ("k_loop", K_LOOPS),
                          ("bias_dot", BIAS_DOTS), ("select", SELECTS),
                          ("remainder_pass", REMAINDER_PASSES),
                          ("l2_hints", L2_HINTS)):
      value = getattr(self, name)
      if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    for name in ("block_b", "block_v", "block_k", "num_warps"):
      value = getattr(self, name)
      # The Mosaic pass's three-consumer tile is the one block_b that is not
      # a power of two (its WGMMA tiles are 64 rows each).
      if name == "block_b" and self.method == "mosaic" and value == 192:
        continue
      if value < 1 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    fused = self.fused
    if fused and self.bias_dot == "mma" and (self.block_b < 16
                                             or self.block_k < 16):
      raise ValueError("fused with bias_dot='mma': block_b and block_k must "
                       f"be >= 16 (tensor-core tile), got block_b="
                       f"{self.block_b}, block_k={self.block_k}")
    if self.select == "tail" and not (fused and self.block_b == 1):
      # One request a program: its block statistics are single values, stored
      # by the thread that also counts, so the count's release covers them.
      raise ValueError("select='tail' needs the fused method with block_b=1, "
                       f"got method={self.method!r}, block_b={self.block_b}")
    if self.select == "persistent" and not (fused
                                            and self.proj_l2_rows == 0):
      # kernels/draft_pass.py: the fused bias, no cache hints (it holds
      # proj on chip instead).
      raise ValueError(
          "select='persistent' needs the fused method and proj_l2_rows=0, "
          f"got method={self.method!r}, proj_l2_rows={self.proj_l2_rows}")
    if self.method == "mosaic" and not (
        self.block_b in (64, 128, 192) and self.block_v in (64, 128)
        and self.select == "pass" and self.proj_l2_rows == 0):
      raise ValueError(
          "method='mosaic' needs block_b in (64, 128, 192), block_v in "
          "(64, 128), select='pass' and proj_l2_rows=0, got "
          f"block_b={self.block_b}, block_v={self.block_v}, "
          f"select={self.select!r}, proj_l2_rows={self.proj_l2_rows}")
    if self.proj_l2_rows < 0 or (self.proj_l2_rows and not fused):
      raise ValueError("proj_l2_rows must be >= 0 and needs the fused method, "
                       f"got {self.proj_l2_rows} (method={self.method!r})")
    if self.l2_hints != "none" and not (
        fused and self.select != "persistent" and self.proj_l2_rows == 0):
      raise ValueError(
          "l2_hints needs the fused method step by step with proj_l2_rows=0 "
          f"(which brings its own hints), got l2_hints={self.l2_hints!r} with "
          f"method={self.method!r}, select={self.select!r}, "
          f"proj_l2_rows={self.proj_l2_rows}")
    if self.programs < 0 or (self.programs and self.select != "persistent"):
      raise ValueError("programs must be >= 0 and is for select='persistent', "
                       f"got {self.programs} with select={self.select!r}")
    if self.held_blocks < 0 or (self.held_blocks
                                and self.select != "persistent"):
      raise ValueError("held_blocks must be >= 0 and is for "
                       f"select='persistent', got {self.held_blocks} with "
                       f"select={self.select!r}")

    if self.early_proj < 0 or (self.early_proj and not (
        fused and self.select != "persistent")):
      raise ValueError(
          "early_proj must be >= 0 and needs the fused method step by step, "
          f"got {self.early_proj} with method={self.method!r}, "
          f"select={self.select!r}")

    if self.prefetch_proj < 0 or (self.prefetch_proj and not (
        fused and self.select != "persistent" and self.proj_l2_rows == 0
        and self.early_proj == 0)):
      raise ValueError(
          "prefetch_proj must be >= 0 and needs the fused method step by step "
          f"with proj_l2_rows=0 and early_proj=0, got {self.prefetch_proj} "
          f"with method={self.method!r}, select={self.select!r}, "
          f"proj_l2_rows={self.proj_l2_rows}, early_proj={self.early_proj}")
    if self.prefetch_programs < 0 or (self.prefetch_programs
                                      and not self.prefetch_proj):
      raise ValueError("prefetch_programs must be >= 0 and is for "
                       f"prefetch_proj > 0, got {self.prefetch_programs} with "
                       f"prefetch_proj={self.prefetch_proj}")

    if self.remainder_b:
      if not 0 < self.remainder_b < self.block_b:
        raise ValueError(f"remainder_b must be in [0, block_b = "
                         f"{self.block_b}), got {self.remainder_b}")
      if not (fused and self.select == "pass"):
        raise ValueError(
            "remainder_b needs the fused method with the select pass, got "
            f"method={self.method!r}, select={self.select!r}")

    if self.select_embed and self.method != "mosaic":
      raise ValueError("select_embed is for method='mosaic' (the Triton "
                       "block pass gathers its embeddings itself), got "
                       f"method={self.method!r}")

    if self.store_warpgroup and self.method != "mosaic":
      raise ValueError("store_warpgroup is for method='mosaic', got "
                       f"method={self.method!r}")

    if self.partial_tiles and self.method != "mosaic":
      raise ValueError("partial_tiles is for method='mosaic', got "
                       f"method={self.method!r}")

    if self.block_programs:
      if not (self.block_programs > 0 and fused and self.select == "pass"
              and self.bias_dot == "mma" and self.k_loop == "fori"):
        raise ValueError(
            "block_programs must be >= 0 and needs the fused method on the "
            "tensor cores with the select pass and k_loop='fori', got "
            f"{self.block_programs} with method={self.method!r}, "
            f"select={self.select!r}, bias_dot={self.bias_dot!r}, "
            f"k_loop={self.k_loop!r}")
      if (self.remainder_b or self.early_proj or self.prefetch_proj
          or self.proj_l2_rows or self.l2_hints != "none"):
        raise ValueError(
            "block_programs takes no remainder_b, early_proj, prefetch_proj, "
            "proj_l2_rows or l2_hints")

    if self.early_dependents and self.select != "pass":
      raise ValueError("early_dependents is for the select pass "
                       f"(select='pass'), got select={self.select!r}")

  @property
  def fused(self) -> bool:
    """The bias dot runs inside the block pass."""
    return self.method == "fused"
