"""The fused block pass as a Pallas Mosaic GPU (Hopper) kernel, for large B.

The fused mode of :mod:`block_pass` (select pass, no tail select, slots or
columns) for one step s of an S-step draft: it forms the pre-temperature
logits

  x[b, v] = base[b * S + s, v] + sum_r emb[b, r] * proj[v, r]   (float32)

stores them to the cache row of draw (b, s) (dense: b * S + s; state rows:
``cache_rows[b * S + s]``, none where < 0), and reduces each request's row
over every vocabulary block of ``block_v`` columns to the block's max, first
argmax and sum of exp of y = x / T, as :func:`block_pass.block_statistics`
does. The select pass draws from these (``stats_major="block"``).

Why a second kernel: the Triton block pass re-reads its embedding tile and
its proj tile from L2 in every program and streams ~265 MB a step at B = 256
at ~2.4 TB/s. Here a CTA keeps its request tile's embeddings in shared
memory for its whole run and streams only proj and base through TMA, with a
producer warpgroup running ahead of two consumer warpgroups (the structure
of JAX's hopper_matmul_mgpu.py and attention_mgpu.py). On the H200 a step
at B = 256 takes 99 us against the Triton pass's 120 (docs/perf-notes.md
change 34).

Kernel layout (all static, chosen by :func:`plan`):

* a batch that block_b does not divide (B >= 64, a multiple of 4): the
  last request tile is partial; each of its consumers computes the 64-row
  window that ends at row B (every load and store inside its array) and
  stores only the rows no consumer before it owns (docs/perf-notes.md
  change 50).
* grid (vocabulary workers, request tiles); Mosaic GPU maps the last grid
  axis to blockIdx.x, so the request tile is the fastest index: the CTAs
  that read the same proj tile run side by side and the second read hits
  L2. Worker c takes the vocabulary tiles c, c + G, c + 2G, ... of
  ``cta_v`` columns each (G workers, about one CTA per SM); with ``chunk``,
  the contiguous tiles c * chunk, ..., c * chunk + chunk - 1 instead, and
  its consumers carry each row's running max, sum and first argmax over
  them, stored once at the end as chunk statistics [NC, B] (what
  kernels/chunk_pass.py computes in a launch of its own).
* C consumer warpgroups and a producer: warpgroup C issues every TMA load;
  warpgroups 0 ... C - 1 each own a 64-request x ``block_v`` tile of every
  vocabulary tile: with ``block_b`` = 128 or 192 (C = 2 or 3) they split
  the requests (cta_v = block_v), with ``block_b`` = 64 (C = 2) they split
  the columns (cta_v = 2 * block_v). With ``store_warpgroup`` (warp row
  stores only) one more, warpgroup C + 1, stores the consumers' staged
  cache rows, so that they do not stop issuing WGMMA for their own stores.
  Three consumers (B = 129 to 192 in one request tile, so that proj streams
  through each SM once a step rather than once per 128-request tile) share
  the register file four ways: 152 registers a consumer thread, no store
  warpgroup (five warpgroups hung). Correct (bit for bit the 128-request
  tiles' outputs) but slower than the rule's 64-request tiles at B = 192
  on an H100 (docs/perf-notes.md change 61): in no table entry.
* shared memory: the [block_b, R] embedding tile (loaded once), a ring of
  ``max_concurrent_steps`` proj chunks [cta_v, 64] (R is walked in chunks of
  64 columns: one 128-byte swizzle row of bf16), a ring of 2 base tiles
  [block_b, cta_v], per consumer the cache staging (below) and one [64] row
  of each statistic.
* cache stores: dense, ``out_slots`` swizzled float32 [64, 64] staging tiles
  a consumer, one TMA box a tile. State rows (vLLM's state-indexed cache,
  whose rows TMA cannot scatter): with ``row_stores="warp"`` (the default)
  one padded [64, 72] tile a consumer, each warp then storing whole
  256-byte rows (:func:`_store_rows_by_warp`); with ``"tma"`` unswizzled
  [64, 64] tiles and one TMA a row (slow; the reference the other is
  checked against bit for bit).
* a dependent launch (``dependent_launch``): the producer loads the first
  tile's base and proj chunks, which no kernel of the draft writes, before
  ``griddepcontrol.wait``; every other load and store comes after a wait,
  so the step's ramp overlaps the select pass before it.
* 1 / T is read per draw from row 0 of the [3, B * S] draw parameters (a
  strided load of 64 values per consumer, once per CTA).
* the statistics leave the kernel vocabulary-block-major, [NB, B]: a TMA
  store into [B, NB] would need NB * 4 bytes to be a multiple of 16 (NB =
  1010 at V = 129280, block_v = 128 is not) and a box at least 16 bytes
  wide, and a [64]-row of [NB, B] is one contiguous 256-byte TMA. (Storing
  [B, NB] from the registers instead, 4 bytes a row and block, made the
  select 7 us faster a step at B = 256 and this pass 11 us slower:
  docs/perf-notes.md change 37.)

Mosaic GPU only: there is no interpreter path (use :mod:`block_pass` with
``interpret=True`` for CPU semantics). Importing this module never fails; a
call raises ImportError where Pallas Mosaic GPU is missing.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

try:  # Guarded: the module imports (and validates) without Mosaic GPU.
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  _IMPORT_ERROR = None
except ImportError as e:  # pragma: no cover - depends on the jaxlib build
  pl = plgpu = None
  _IMPORT_ERROR = e
try:  # The Mosaic GPU dialect helpers, for the warp row stores (inline_mgpu).
  from jax.experimental.mosaic import gpu as mgpu
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, vector
except ImportError:  # pragma: no cover - depends on the jaxlib build
  mgpu = ir = arith = llvm = vector = None

# Rows of one WGMMA accumulator: a consumer warpgroup owns 64 requests.
WG_ROWS = 64
# Columns of R per proj / embedding chunk: 64 bf16 are one 128-byte swizzle
# row, the widest TMA / WGMMA swizzle.
TILE_K = 64
# Columns of one cache staging tile: 64 float32 are two 128-byte rows.
EPI_V = 64
# Consumer warpgroups of a 64- or 128-request CTA; a 192-request CTA has 3.
NUM_COMPUTE_WGS = 2
# Requests a CTA (block_b): 64 (two consumers split each tile's columns),
# 128 or 192 (two or three consumers split the requests).
BLOCK_BS = (64, 128, 192)
# float32 words a row of the warp-store staging tile (row_stores="warp"):
# 8 words of padding put the 8 rows of one WGMMA-layout store in different
# banks (a 64-word pitch maps them all to the same 8).
STAGE_PITCH = EPI_V + 8
# Three consumers' staging tiles at that pitch leave room for only two proj
# chunks beside a 192-request tile's embeddings at R = 256: a 68-word pitch
# (4 words of padding, two rows of a store sharing banks) makes room for a
# third (plan).
NARROW_PITCH = EPI_V + 4
# Mosaic GPU places each shared-memory buffer at a multiple of 1024 bytes.
SMEM_ALIGN = 1024
ROW_STORES = ("tma", "warp")
# Stages a measurement may leave out (``_omit``; benchmarks/block_step.py
# --omit): the WGMMA, the cache stores, the statistics. A kernel without one
# computes wrong outputs; it exists to time the rest.
OMITTABLE = ("mma", "cache", "stats")
# Dynamic shared memory per CTA on sm_90 (227 KiB), less the 2048 bytes
# Mosaic GPU adds to the buffers and barriers (smem_bytes; measured by
# lowering every plan of the tests on the CPU).
SMEM_LIMIT = 227 * 1024 - 2048
DEFAULT_NUM_SMS = 132  # H100 SXM / H200
# The largest portable thread-block cluster.
MAX_CLUSTER = 8


@dataclasses.dataclass(frozen=True)
class Plan:
  """The static layout of one launch (see the module docstring)."""
  batch: int
  steps: int
  vocab: int
  rank: int
  block_b: int
  block_v: int
  cta_v: int          # columns a CTA covers per vocabulary tile
  split_v: bool       # the consumers split columns (block_b = 64) or rows
  num_k: int          # proj / embedding chunks of TILE_K columns
  stages: int         # proj chunks in flight (max_concurrent_steps)
  out_slots: int      # cache staging tiles per consumer
  row_stores: str     # state rows: "tma" (one TMA a row) or "warp" (below)
  num_b_tiles: int
  num_v_tiles: int
  grid_v: int         # vocabulary workers
  base_slots: int = 2  # base tiles in flight (the ring's slots)
  # CTAs of a cluster (the request tiles of one vocabulary tile) sharing each
  # proj chunk by TMA multicast; 1: no cluster.
  cluster: int = 1
  omit: tuple = ()    # stages left out, to time the others (OMITTABLE)
  # Blocks a vocabulary worker covers, contiguous, reduced in the epilogue to
  # chunk statistics [NC = grid_v, B]; 0: strided workers, no chunk outputs.
  chunk: int = 0
  state_rows: bool = False  # the cache is state-indexed (cache_rows given)
  # A fourth warpgroup stores the cache rows from out_slots staging tiles a
  # consumer (warp row stores only).
  store_wg: bool = False
  # float32 words a row of a warp-store staging tile.
  stage_pitch: int = STAGE_PITCH
  # Built for a programmatic dependent launch (see _kernel): the producer
  # issues the first tile's base and proj loads, then waits for the kernels
  # before; every other warpgroup waits first.
  dependent_launch: bool = False

  @property
  def num_blocks(self) -> int:
    return self.vocab // self.block_v

  @property
  def partial(self) -> bool:
    """The last request tile holds fewer than block_b requests."""
    return self.batch % self.block_b != 0

  @property
  def halves(self) -> int:
    """TMA boxes a request tile's rows load in: with a partial last tile
    one box of 64 rows a consumer (a 128-row box would not fit a B < 128,
    and each consumer waits for its own rows), else one box a tile."""
    return self.block_b // WG_ROWS if self.partial else 1

  @property
  def smem_bytes(self) -> int:
    return smem_bytes(self.block_b, self.cta_v, self.rank, self.block_v,
                      self.stages, self.out_slots,
                      "warp" if self.warp_rows else "tma", self.base_slots,
                      halves=self.halves, store_wg=self.store_wg,
                      cluster=self.cluster > 1, pitch=self.stage_pitch)

  @property
  def warp_rows(self) -> bool:
    """Cache rows are stored by warp through a staging tile: state rows
    with row_stores="warp", and every partial last tile."""
    return self.partial or (self.state_rows and self.row_stores == "warp")

  @property
  def consumers(self) -> int:
    """Consumer warpgroups a CTA (warpgroups 0 ... consumers - 1)."""
    return consumers(self.block_b)

  @property
  def num_wgs(self) -> int:
    """Warpgroups a CTA: the consumers, the producer and, with store_wg,
    the store warpgroup."""
    return self.consumers + 1 + int(self.store_wg)

  @property
  def launch_registers(self) -> int:
    """Registers a thread gets at launch: the 64K-register file over the
    CTA's threads, in the allocation's steps of 8 (one CTA a multiprocessor).
    setmaxnreg moves registers between the CTA's warpgroups within that
    allocation only."""
    return min(255, 65536 // (128 * self.num_wgs)) // 8 * 8

  @property
  def consumer_registers(self) -> int:
    """Registers a consumer thread may hold (setmaxnreg, a multiple of 8):
    what the CTA's launch allocation leaves beside 40 a thread of the
    producer (and of the store warpgroup), at most 232. setmaxnreg.inc
    blocks until the registers are free: asking for more than the
    allocation holds never returns."""
    pool = self.launch_registers * 128 * self.num_wgs
    free = pool - 40 * 128 * (self.num_wgs - self.consumers)
    return min(232, free // (128 * self.consumers) // 8 * 8)


def consumers(block_b: int) -> int:
  """Consumer warpgroups of a block_b-request CTA: 2 at block_b = 64 (they
  split the columns), else one per 64 requests."""
  return NUM_COMPUTE_WGS if block_b == WG_ROWS else block_b // WG_ROWS


def smem_bytes(block_b: int, cta_v: int, rank: int, block_v: int, stages: int,
               out_slots: int, row_stores: str = "tma",
               base_slots: int = 2, *, halves: int = 1,
               store_wg: bool = False, cluster: bool = False,
               pitch: int = STAGE_PITCH) -> int:
  """Shared memory of one CTA, in bytes, as Mosaic GPU lays it out: each
  buffer at a multiple of SMEM_ALIGN, then 8 bytes a barrier (its own 2048
  bytes on top are SMEM_LIMIT's margin). row_stores "warp": the cache is
  staged in [64, pitch] tiles for warp row stores, else [64, 64] TMA tiles."""
  wgs = consumers(block_b)
  align = lambda n: -(-n // SMEM_ALIGN) * SMEM_ALIGN
  if row_stores == "warp":
    out = wgs * (out_slots if store_wg else 1) * WG_ROWS * pitch * 4
  else:
    out = wgs * out_slots * WG_ROWS * EPI_V * 4
  buffers = (block_b * rank * 2,                  # embeddings
             stages * cta_v * TILE_K * 2,         # proj ring
             base_slots * block_b * cta_v * 2,    # base ring
             out,                                 # cache staging
             wgs * WG_ROWS * 4 if row_stores == "warp" else 4,  # cache rows
             *(3 * (wgs * WG_ROWS * 4,)))         # max, sum, argmax rows
  num_k = rank // TILE_K
  barriers = (num_k * halves + 2 * stages + base_slots * (halves + 1)
              + int(cluster) + (2 * wgs * out_slots if store_wg else 0))
  del block_v
  return sum(align(b) for b in buffers) + 8 * barriers


def available() -> tuple[bool, str]:
  """(whether this kernel runs on the default device, why not)."""
  if plgpu is None:
    return False, f"Pallas Mosaic GPU is not importable ({_IMPORT_ERROR})"
  try:
    device = jax.devices()[0]
  except RuntimeError as e:
    return False, f"no JAX device ({e})"
  if device.platform != "gpu":
    return False, f"the default device is {device.platform}, not a GPU"
  # wgmma is sm_90a only: neither Ampere nor Blackwell runs this kernel.
  capability = getattr(device, "compute_capability", "")
  if capability != "9.0":
    return False, f"compute capability {capability!r}, not 9.0 (Hopper)"
  return True, "a Hopper GPU with Pallas Mosaic GPU"


def _num_sms() -> int:
  try:
    device = jax.devices()[0]
    if device.platform == "gpu":
      return int(device.core_count)
  except Exception:  # pylint: disable=broad-except
    pass
  return DEFAULT_NUM_SMS


def default_chunk(batch: int, vocab: int, *, block_b: int | None = None,
                  block_v: int = 128, num_sms: int | None = None) -> int:
  """The ``chunk`` that keeps one CTA an SM: the vocabulary tiles split
  into ``num_sms // (B / block_b)`` contiguous runs (block_b = 128 or 192
  only: the chunk statistics need each consumer to see every block of its
  rows).

  At the DeepSeek-V4 shape, B = 256, block_v = 64 on 132 SMs: 2020 blocks
  in 66 runs of 31, the strided workers' 30-31 tiles each.
  """
  if block_b is None:
    block_b = 128 if batch % 128 == 0 else 64
  workers = max(1, (num_sms or _num_sms()) // -(-batch // block_b))
  return -(-(vocab // block_v) // workers)


def epilogue_chunk(config, batch: int, vocab: int,
                   num_sms: int | None = None) -> int | None:
  """The ``chunk`` a sampler passes for a KernelConfig (method "mosaic"):
  :func:`default_chunk` where the config folds the chunk statistics into
  this pass (``fold_chunks`` and block_b = 128 or 192), else None (a chunk
  pass reduces the block statistics)."""
  if not (config.fold_chunks and config.block_b in (128, 192)):
    return None
  return default_chunk(batch, vocab, block_b=config.block_b,
                       block_v=config.block_v,
                       num_sms=num_sms)


def plan(base_shape, emb_shape, proj_shape, *, num_steps: int,
         block_b: int | None, block_v: int,
         max_concurrent_steps: int | None, num_sms: int | None,
         row_stores: str = "tma", omit: tuple = (),
         base_slots: int = 2, multicast: bool = False,
         chunk: int | None = None, state_rows: bool = False,
         store_warpgroup: bool = False,
         dependent_launch: bool = False) -> Plan:
  """Checks the shapes and picks the tiles; raises ValueError if unsupported.

  row_stores ("tma" or "warp") is how state rows are stored; the dense
  layout ignores it (one TMA box a tile). state_rows: the cache is
  state-indexed (cache_rows given). chunk, store_warpgroup,
  dependent_launch: see mosaic_block_pass.
  """
  if not set(omit) <= set(OMITTABLE):
    raise ValueError(f"omit must be a subset of {OMITTABLE}, got {omit!r}")
  if row_stores not in ROW_STORES:
    raise ValueError(f"row_stores must be one of {ROW_STORES}, got "
                     f"{row_stores!r}")
  if base_slots < 2:
    raise ValueError(f"base_slots must be >= 2, got {base_slots}")
  if num_steps < 1:
    raise ValueError(f"num_steps must be >= 1, got {num_steps}")
  if len(base_shape) != 2 or base_shape[0] % num_steps:
    raise ValueError(f"base must be [B * S, V] with S = num_steps = "
                     f"{num_steps}, got {list(base_shape)}")
  batch, vocab = base_shape[0] // num_steps, base_shape[1]
  if len(emb_shape) != 2 or emb_shape[0] != batch:
    raise ValueError(f"emb must be [B, R] = [{batch}, R], got "
                     f"{list(emb_shape)}")
  rank = emb_shape[1]
  if tuple(proj_shape) != (vocab, rank):
    raise ValueError(f"proj must be [V, R] = [{vocab}, {rank}], got "
                     f"{list(proj_shape)}")
  if rank % TILE_K or rank == 0:
    raise ValueError(f"R = {rank} must be a positive multiple of {TILE_K}")
  if block_v not in (64, 128):
    raise ValueError(f"block_v must be 64 or 128, got {block_v}")
  if block_b is None:
    block_b = 128 if batch % 128 == 0 else 64
  if block_b not in BLOCK_BS:
    raise ValueError(f"block_b must be one of {BLOCK_BS}, got {block_b}")
  if batch % block_b and not (batch >= WG_ROWS and batch % 4 == 0):
    # A partial last tile loads 64-row TMA boxes (B >= 64) and stores its
    # statistics' [NB, B] rows by TMA (a row of B float32 a multiple of 16
    # bytes).
    raise ValueError(
        f"B = {batch} must be a multiple of block_b = {block_b}, or at least "
        f"{WG_ROWS} and a multiple of 4 (a partial last request tile)")
  if batch % block_b and (multicast or row_stores == "tma"):
    raise ValueError("a partial last request tile takes neither multicast "
                     "nor row_stores='tma'")
  split_v = block_b == WG_ROWS
  cta_v = block_v * (NUM_COMPUTE_WGS if split_v else 1)
  if vocab % block_v:
    raise ValueError(f"V = {vocab} must be a multiple of block_v = {block_v}")
  if vocab % cta_v:
    raise ValueError(
        f"V = {vocab} must be a multiple of {cta_v} (with block_b = 64 the "
        f"two consumer warpgroups take block_v = {block_v} columns each)")
  num_k = rank // TILE_K
  warp_rows = bool(batch % block_b) or (state_rows and row_stores == "warp")
  # Only warp row stores have a store warpgroup to hand off to (TMA stores
  # are asynchronous already); with the cache stores left out, nothing is.
  store_wg = store_warpgroup and warp_rows and "cache" not in omit
  if store_wg and multicast:
    raise ValueError("store_warpgroup and multicast do not combine (the "
                     "cluster's exit barrier counts three warpgroups)")
  if store_wg and consumers(block_b) == 3:
    # Five warpgroups (640 threads) hung on an H100 (session 34; no output
    # within 50 s where four warpgroups took 1 s). The likely cause: the
    # consumers then asked for 144 registers counted against the whole
    # 64K file, more than the CTA's launch allocation (96 a thread) leaves
    # them, and setmaxnreg.inc waits for them forever. consumer_registers
    # now counts the allocation (128 here), untested on a GPU: refused.
    raise ValueError("store_warpgroup does not run with block_b = 192 (five "
                     "warpgroups hung on a GPU; docs/perf-notes.md change 61)")
  if store_wg:
    # Double-buffered staging first: a consumer stages tile e + 1 while the
    # store warpgroup drains tile e.
    slot_choices = (2, 1)
  elif row_stores == "warp":
    # The consumers' own warp row stores stage one tile each (two
    # warpgroup barriers a tile order its reuse).
    slot_choices = (1,)
  else:
    slot_choices = (2, 1)
  if max_concurrent_steps is not None:
    if max_concurrent_steps < 2:
      raise ValueError("max_concurrent_steps (proj chunks in flight) must "
                       f"be >= 2, got {max_concurrent_steps}")
    candidates = [(max_concurrent_steps, e) for e in slot_choices]
  elif store_wg:
    candidates = [(p, e) for e in slot_choices
                  for p in range(2 * num_k, 1, -1)]
  else:
    # Prefer up to two whole proj tiles in flight (a step's chunks all land
    # during the step before it), then double-buffered cache staging.
    candidates = [(p, e) for p in range(2 * num_k, 1, -1)
                  for e in slot_choices]
  halves = block_b // WG_ROWS if batch % block_b else 1
  # The narrow staging pitch only where three consumers' staging tiles
  # would otherwise cost a proj chunk in flight (the two-consumer plans
  # keep the conflict-free pitch they were measured with).
  pitches = ((STAGE_PITCH, NARROW_PITCH) if consumers(block_b) == 3
             and warp_rows else (STAGE_PITCH,))
  size = lambda p, e, w: smem_bytes(
      block_b, cta_v, rank, block_v, p, e, "warp" if warp_rows else "tma",
      base_slots, halves=halves, store_wg=store_wg, cluster=multicast,
      pitch=w)
  fitting = [(p, e, w) for p, e in candidates for w in pitches
             if size(p, e, w) <= SMEM_LIMIT]
  if not fitting:
    need = size(candidates[-1][0], 1, pitches[-1])
    raise ValueError(
        f"block_b = {block_b}, block_v = {block_v}, R = {rank}, "
        f"max_concurrent_steps = {candidates[-1][0]} need {need} bytes of "
        f"shared memory, more than {SMEM_LIMIT}")
  stages, out_slots, stage_pitch = fitting[0]
  num_b_tiles = -(-batch // block_b)
  num_v_tiles = vocab // cta_v
  sms = num_sms or _num_sms()
  grid_v = max(1, min(num_v_tiles, sms // num_b_tiles))
  if chunk is not None:
    if split_v:
      raise ValueError(
          "chunk statistics need block_b = 128 or 192 (with 64 the two "
          "consumers split each tile's columns, and neither sees every block "
          "of a row)")
    if chunk < 1:
      raise ValueError(f"chunk must be >= 1 blocks, got {chunk}")
    if "stats" in omit:
      raise ValueError("chunk statistics are folded from the block "
                       "statistics: omit cannot drop 'stats'")
    if multicast:
      raise ValueError("chunk and multicast do not combine (a cluster's "
                       "CTAs must walk the same tiles)")
    # One worker a chunk: worker c takes blocks c * chunk ... (cta_v =
    # block_v here, a tile is a block).
    grid_v = -(-num_v_tiles // chunk)
  cluster = num_b_tiles if multicast else 1
  if dependent_launch and multicast:
    # Not built: multicast is an experiment's knob (change 37), in no plan
    # a runtime launches.
    raise ValueError("dependent_launch and multicast do not combine")
  if cluster > MAX_CLUSTER or TILE_K % cluster or cta_v % (8 * cluster):
    raise ValueError(
        f"multicast: the {num_b_tiles} request tiles of B = {batch} must form "
        f"a cluster of at most {MAX_CLUSTER} CTAs that split a proj chunk "
        f"[{cta_v}, {TILE_K}] into whole 8-row swizzle groups")
  return Plan(batch=batch, steps=num_steps, vocab=vocab, rank=rank,
              block_b=block_b, block_v=block_v, cta_v=cta_v, split_v=split_v,
              num_k=num_k, stages=stages, out_slots=out_slots,
              row_stores=row_stores, omit=tuple(omit), base_slots=base_slots,
              cluster=cluster, chunk=chunk or 0, state_rows=state_rows,
              store_wg=store_wg, stage_pitch=stage_pitch,
              dependent_launch=dependent_launch, num_b_tiles=num_b_tiles,
              num_v_tiles=num_v_tiles, grid_v=grid_v)


def _swizzled(dtype):
  """Tiling + 128-byte swizzle: the layout TMA writes and WGMMA reads."""
  elems = 128 // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128))


def _pointers(stage, rows, cache):
  """MLIR (inside inline_mgpu): the staging tile's, the rows' (shared
  memory) and the cache window's (global) pointers."""
  ptrs = [mgpu.utils.memref_ptr(stage)]
  if rows is not None:
    ptrs.append(mgpu.utils.memref_ptr(rows))
    ptrs.append(llvm.addrspacecast(llvm.PointerType.get(1),
                                   mgpu.utils.memref_ptr(cache)))
  return ptrs


def _emit_stage(x, row_i, col_i, stage_ptr, *, pitch: int):
  """MLIR (inside inline_mgpu): each register pair of x to the staging tile
  at its (row, column). Arguments as :func:`_store_rows_by_warp`'s."""
  i32 = ir.IntegerType.get_signless(32)
  f32 = ir.F32Type.get()
  first = ir.DenseI64ArrayAttr.get([0])
  for xr, rr, cr in zip(x.registers.flat, row_i.registers.flat,
                        col_i.registers.flat, strict=True):
    r = vector.extract(rr, dynamic_position=[], static_position=first)
    j = vector.extract(cr, dynamic_position=[], static_position=first)
    off = arith.addi(arith.muli(r, arith.constant(i32, pitch)), j)
    llvm.store(xr, mgpu.utils.getelementptr(stage_ptr, [off], f32),
               alignment=8)


def _emit_row_stores(stage_ptr, rows_ptr, cache_ptr, *, vocab: int,
                     pitch: int):
  """MLIR (inside inline_mgpu): warp w of the warpgroup stores rows w, w + 4,
  ..., w + 60 of the staging tile, each one 256-byte row of the cache (lane
  l: columns 2l and 2l + 1), skipping rows whose cache row is < 0."""
  i32 = ir.IntegerType.get_signless(32)
  i64 = ir.IntegerType.get_signless(64)
  f32 = ir.F32Type.get()
  pair = ir.VectorType.get((2,), f32)
  c = lambda v, t=i32: arith.constant(t, v)
  tid = mgpu.utils.thread_idx()
  lane = arith.andi(tid, c(31))
  warp = arith.andi(arith.shrui(tid, c(5)), c(3))
  col = arith.muli(lane, c(2))
  col64 = arith.extui(i64, col)
  stride = c(vocab, i64)
  zero = c(0)
  for k in range(WG_ROWS // 4):
    r = arith.addi(warp, c(4 * k))
    v = llvm.load(pair, mgpu.utils.getelementptr(
        stage_ptr, [arith.addi(arith.muli(r, c(pitch)), col)], f32))
    row = llvm.load(i32, mgpu.utils.getelementptr(rows_ptr, [r], i32))
    with mgpu.utils.when(arith.cmpi(arith.CmpIPredicate.sge, row, zero)):
      # int64: N * V can pass 2**31 (M = 2048, S = 8 at V = 129280).
      off = arith.addi(arith.muli(arith.extsi(i64, row), stride), col64)
      llvm.store(v, mgpu.utils.getelementptr(cache_ptr, [off], f32),
                 alignment=8)


def _store_rows_by_warp(x, row_i, col_i, stage, rows, cache, *, vocab: int):
  """cache[rows[i], j] = x[i, j] for the 64 rows of one [64, EPI_V] tile.

  x float32, row_i and col_i int32 (its row and column indices), all
  [64, EPI_V] in the WGMMA layout (each register of x is 2 consecutive
  columns of one row; the matching registers of row_i and col_i hold that
  row and its first column); stage the consumer's float32
  [64, pitch] staging tile (Plan.stage_pitch words a row); rows its int32
  [64] cache rows (< 0: padding, not stored) in shared memory; cache the
  [N, EPI_V] column window of the [N, vocab] cache this tile goes to.

  Why: a state-indexed cache scatters a request tile's rows. One TMA a
  256-byte row costs more than the step (docs/perf-notes.md change 34), and
  stores straight from the WGMMA registers cover 8 rows a warp instruction
  (change 35). Here the tile goes through shared memory once, so that each
  warp store is one whole row: lane l writes columns 2l and 2l + 1.
  """
  layout = plgpu.Layout.WGMMA
  pitch = stage.shape[-1]

  @plgpu.inline_mgpu(arg_types=(layout, layout, layout, plgpu.RefType(),
                                plgpu.RefType(), plgpu.RefType()))
  def store(ctx, x, row_i, col_i, stage, rows, cache):
    del ctx
    stage_ptr, rows_ptr, cache_ptr = _pointers(stage, rows, cache)
    _emit_stage(x, row_i, col_i, stage_ptr, pitch=pitch)
    # Every thread's pairs are in the tile before any warp reads a row.
    mgpu.utils.warpgroup_barrier()
    _emit_row_stores(stage_ptr, rows_ptr, cache_ptr, vocab=vocab,
                     pitch=pitch)
    # Every warp has read the tile before the next one is staged.
    mgpu.utils.warpgroup_barrier()

  store(x, row_i, col_i, stage, rows, cache)


def _stage_rows(x, row_i, col_i, stage):
  """The first half of :func:`_store_rows_by_warp` (store_wg: a consumer's):
  x to the staging tile. The consumer's arrival on the tile's barrier
  (release) then hands it to the store warpgroup."""
  layout = plgpu.Layout.WGMMA
  pitch = stage.shape[-1]

  @plgpu.inline_mgpu(arg_types=(layout, layout, layout, plgpu.RefType()))
  def stage_tile(ctx, x, row_i, col_i, stage):
    del ctx
    _emit_stage(x, row_i, col_i, *_pointers(stage, None, None), pitch=pitch)

  stage_tile(x, row_i, col_i, stage)


def _store_staged_rows(stage, rows, cache, *, vocab: int):
  """The second half of :func:`_store_rows_by_warp` (store_wg: the store
  warpgroup's), after its wait on the tile's barrier (acquire)."""
  pitch = stage.shape[-1]

  @plgpu.inline_mgpu(arg_types=(plgpu.RefType(), plgpu.RefType(),
                                plgpu.RefType()))
  def store(ctx, stage, rows, cache):
    del ctx
    _emit_row_stores(*_pointers(stage, rows, cache), vocab=vocab,
                     pitch=pitch)

  store(stage, rows, cache)


def _kernel(base_gmem, emb_gmem, proj_gmem, params_gmem, step_gmem,
            rows_gmem, cache_gmem, bmax_gmem, bsum_gmem, barg_gmem,
            cmax_gmem=None, csum_gmem=None, carg_gmem=None, *, p: Plan):
  """One CTA: request tile lax.axis_index("b"), worker lax.axis_index("v").

  base_gmem is a [B, S, V] view: a TMA box indexes the step as a squeezed
  middle dimension, so only rows b * S + step are read. params_gmem is the
  [3, B, S] view of the per-draw parameters (row 0: 1 / T). Dense layout
  (rows_gmem None): cache_gmem is a [B, S, V] view, stored like base. State
  rows: rows_gmem is the [B, S] view of the cache rows and cache_gmem the
  [N, V] cache, stored one row at a time (a row < 0 is padding: not stored).
  b{max,sum,arg}_gmem are [NB, B]; c{max,sum,arg}_gmem (p.chunk > 0 only)
  are [NC, B], row c the chunk of worker c.

  A partial last request tile (p.partial; B >= 64): each consumer's 64-row
  window starts at min(its first row, B - 64), so every load and store is
  inside its array, and rows the window shares with another consumer are
  computed twice from the same operands (the same bits). Their statistics
  are stored twice, the same values; their cache rows only by the
  consumer that owns them (rows before its first row are masked), always
  by warp row stores: cache_gmem is then the [N, V] cache also in the
  dense layout (rows_gmem None: draw (b, s) is row b * S + s).
  """
  block_b, block_v, cta_v = p.block_b, p.block_v, p.cta_v
  num_k, stages, out_slots = p.num_k, p.stages, p.out_slots
  n_epi = block_v // EPI_V
  bf16, f32 = jnp.bfloat16, jnp.float32

  b_tile = lax.axis_index("b")
  worker = lax.axis_index("v")
  wg = lax.axis_index("wg")
  b0 = b_tile * block_b
  halves = p.halves

  def window(first):
    """The first row of a 64-row window from row ``first`` (in bounds)."""
    if not p.partial:
      return first
    return jnp.minimum(first, jnp.int32(p.batch - WG_ROWS))
  if p.chunk:
    # Tiles worker * chunk ... worker * chunk + chunk - 1 (the last worker
    # fewer): a chunk of contiguous blocks, reduced in the epilogue.
    first_t = worker * p.chunk
    num_t = jnp.minimum(jnp.int32(p.chunk),
                        jnp.int32(p.num_v_tiles) - first_t)

    def tile_v0(t):
      return (first_t + t) * cta_v
  else:
    # Tiles worker, worker + G, ...: every worker gets floor or ceil of
    # num_v_tiles / G of them.
    grid_v = jnp.int32(p.grid_v)
    num_t = lax.div(jnp.int32(p.num_v_tiles) - worker + grid_v - 1, grid_v)

    def tile_v0(t):
      return (worker + t * grid_v) * cta_v

  warp_rows = p.warp_rows
  assert warp_rows == ((rows_gmem is not None and p.row_stores == "warp")
                       or p.partial), "plan(state_rows=) disagrees"

  def body(emb_smem, proj_smem, base_smem, out_smem, rows_smem, max_smem,
           sum_smem, arg_smem, emb_bar, proj_bar, base_bar, proj_free, base_free,
           *extra):
    # A cluster's exit barrier, or the store warpgroup's two barrier arrays
    # (consumer c's staging tile o is index c * out_slots + o): staged, the
    # consumer has written it; drained, the store warpgroup has read it.
    done = extra[0] if p.cluster > 1 else None
    staged, drained = extra if p.store_wg else (None, None)
    # Every waiter waits on every phase of the barriers it uses (Mosaic keeps
    # one parity bit per barrier per thread): consumers on each proj chunk
    # and base tile, the producer on each release of a slot it refills.

    # What a dependent launch may load before its wait: base (written
    # before the draft), proj (weights) and the first tile's slots, free at
    # the start. Everything else (the embeddings the select pass before
    # wrote, the statistics it reads, the cache) comes after it.
    early_k = min(stages, num_k) if p.dependent_launch else 0

    @pl.when(wg == p.consumers)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")
      step = step_gmem[0]  # written once, before any draft

      def load_base(v0, slot):
        if halves == 1:
          plgpu.copy_gmem_to_smem(
              base_gmem.at[pl.ds(window(b0), block_b), step, pl.ds(v0, cta_v)],
              base_smem.at[slot], base_bar.at[slot])
        for h in range(halves if halves > 1 else 0):
          plgpu.copy_gmem_to_smem(
              base_gmem.at[pl.ds(window(b0 + h * WG_ROWS), WG_ROWS), step,
                           pl.ds(v0, cta_v)],
              base_smem.at[slot, pl.ds(h * WG_ROWS, WG_ROWS)],
              base_bar.at[slot * halves + h])

      def load_proj(v0, k, ps):
        # With a cluster, each CTA loads 1 / cluster of the chunk's rows
        # and multicasts them: every CTA's barrier counts the whole chunk.
        plgpu.copy_gmem_to_smem(
            proj_gmem.at[pl.ds(v0, cta_v), pl.ds(k * TILE_K, TILE_K)],
            proj_smem.at[ps], proj_bar.at[ps],
            collective_axes="b" if p.cluster > 1 else None)

      if p.dependent_launch:
        @pl.when(num_t > 0)
        def _():
          load_base(tile_v0(0), 0)
          for k in range(early_k):
            load_proj(tile_v0(0), k, k)

        plgpu.griddepcontrol_wait()
        plgpu.griddepcontrol_launch_dependents()
      for k in range(num_k):  # once per CTA; separate barriers, one per TMA
        if halves == 1:
          plgpu.copy_gmem_to_smem(
              emb_gmem.at[pl.ds(window(b0), block_b),
                          pl.ds(k * TILE_K, TILE_K)],
              emb_smem.at[k], emb_bar.at[k])
          continue
        for h in range(halves):  # each consumer's window of a partial tile
          plgpu.copy_gmem_to_smem(
              emb_gmem.at[pl.ds(window(b0 + h * WG_ROWS), WG_ROWS),
                          pl.ds(k * TILE_K, TILE_K)],
              emb_smem.at[k, pl.ds(h * WG_ROWS, WG_ROWS)],
              emb_bar.at[k * halves + h])

      @pl.loop(0, num_t)
      def _load(t):
        v0 = tile_v0(t)
        slot = lax.rem(t, p.base_slots)

        @pl.when(t >= p.base_slots)
        def _():
          plgpu.barrier_wait(base_free.at[slot])

        if p.dependent_launch:
          # Tile 0's base went before the wait.
          pl.when(t > 0)(lambda: load_base(v0, slot))
        else:
          load_base(v0, slot)
        for k in range(num_k):
          g = t * num_k + k  # proj chunks are numbered across tiles
          ps = lax.rem(g, stages)

          @pl.when(g >= stages)
          def _():
            plgpu.barrier_wait(proj_free.at[ps])

          if k < early_k:
            # Tile 0's first chunks went before the wait.
            pl.when(t > 0)(functools.partial(load_proj, v0, k, ps))
          else:
            load_proj(v0, k, ps)

    if p.store_wg:
      @pl.when(wg == p.consumers + 1)
      def _storer():
        # Takes the consumers' staging tiles in the order they fill them
        # (tile t, epilogue tile e, consumer 0 then 1) and stores their rows
        # by warp while the consumers go on to the next WGMMA.
        plgpu.set_max_registers(40, action="decrease")
        if p.dependent_launch:
          plgpu.griddepcontrol_wait()
          plgpu.griddepcontrol_launch_dependents()

        @pl.loop(0, num_t)
        def _store(t):
          for e in range(n_epi):
            o = lax.rem(t * n_epi + e, out_slots)
            for c in range(p.consumers):
              v0 = tile_v0(t) + (c * block_v if p.split_v else 0)
              i = c * out_slots + o
              plgpu.barrier_wait(staged.at[i])
              _store_staged_rows(
                  out_smem.at[c, o], rows_smem.at[c],
                  cache_gmem.at[:, pl.ds(v0 + e * EPI_V, EPI_V)],
                  vocab=p.vocab)
              # Every thread arrives after its own loads (release): the
              # consumer may stage into the tile again.
              plgpu.barrier_arrive(drained.at[i])

    @pl.when(wg < p.consumers)
    def _consumer():
      # Two consumers: 232 registers (216 beside a store warpgroup); three:
      # 152 (144).
      plgpu.set_max_registers(p.consumer_registers, action="increase")
      if p.dependent_launch:
        # Before any load or store: the statistics this writes are what the
        # select pass before reads.
        plgpu.griddepcontrol_wait()
        plgpu.griddepcontrol_launch_dependents()
      step = step_gmem[0]
      row_off = 0 if p.split_v else wg * WG_ROWS
      col_off = wg * block_v if p.split_v else 0
      r0 = window(b0 + row_off)
      row_layout = plgpu.Layout.WGMMA.reduce(1)
      scale = plgpu.load(params_gmem.at[0, pl.ds(r0, WG_ROWS), step], (),
                         layout=row_layout, optimized=False)
      # The emb and base half this consumer waits for (one box a tile
      # unless the last tile is partial).
      half = wg if halves > 1 else 0
      if warp_rows:
        # The same rows for every tile: read once (the first tile's barrier
        # orders this store before the reads).
        if rows_gmem is None:  # a partial tile, dense: row b * S + s
          rows = (plgpu.broadcasted_iota(jnp.int32, (WG_ROWS,), 0,
                                         layout=row_layout) + r0) * p.steps
          rows = rows + step
        else:
          rows = plgpu.load(rows_gmem.at[pl.ds(r0, WG_ROWS), step], (),
                            layout=row_layout, optimized=False)
        if p.partial:
          # Rows before this consumer's own first row belong to another
          # consumer (which stores them): not stored here.
          own = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS,), 0,
                                       layout=row_layout) + r0
          rows = jnp.where(own >= b0 + row_off, rows, -1)
        rows_smem[wg] = rows
        epi_rows, epi_cols = (
            plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, EPI_V), d,
                                   layout=plgpu.Layout.WGMMA) for d in (0, 1))
      elif rows_gmem is not None:
        # The same rows for every tile: read once.
        row_of = [rows_gmem[r0 + i, step] for i in range(WG_ROWS)]
      scale_tile = lax.broadcast_in_dim(scale, (WG_ROWS, block_v), [0])
      cols = plgpu.broadcasted_iota(jnp.int32, (WG_ROWS, block_v), 1,
                                    layout=plgpu.Layout.WGMMA)
      for k in range(num_k):
        plgpu.barrier_wait(emb_bar.at[k] if halves == 1
                           else emb_bar.at[k * halves + half])

      def tile(t):
        """Tile t: MMA, cache stores, block statistics; returns this
        consumer's (max, sum, argmax) rows, None with stats omitted."""
        v0 = tile_v0(t) + col_off  # this warpgroup's first column
        slot = lax.rem(t, p.base_slots)

        def mma(acc_ref):
          prev = None
          for k in range(num_k):
            ps = lax.rem(t * num_k + k, stages)
            plgpu.barrier_wait(proj_bar.at[ps])
            # emb [64, 64] @ proj chunk^T: proj rows are vocabulary-major.
            if "mma" not in p.omit:
              plgpu.wgmma(acc_ref,
                          emb_smem.at[k, pl.ds(row_off, WG_ROWS)],
                          plgpu.transpose_ref(
                              proj_smem.at[ps, pl.ds(col_off, block_v)],
                              (1, 0)))
            if prev is not None:
              # The chunk before has been read by the tensor cores once at
              # most one WGMMA is in flight: hand its slot back.
              plgpu.wgmma_wait(1)
              plgpu.barrier_arrive(proj_free.at[prev])
            prev = ps
          plgpu.wgmma_wait(0)
          plgpu.barrier_arrive(proj_free.at[prev])
          return acc_ref[...]

        acc = pl.run_scoped(mma, plgpu.ACC((WG_ROWS, block_v), f32))

        plgpu.barrier_wait(base_bar.at[slot] if halves == 1
                           else base_bar.at[slot * halves + half])
        base = base_smem.at[slot, pl.ds(row_off, WG_ROWS),
                            pl.ds(col_off, block_v)][...]
        x = acc + base.astype(f32)
        # Every thread arrives after its own loads (release): the producer
        # may refill the slot.
        plgpu.barrier_arrive(base_free.at[slot])

        # The cache holds pre-temperature logits. Its stores are issued
        # before the statistics so the TMA runs under their arithmetic.
        for e in range(0 if "cache" in p.omit else n_epi):
          if p.store_wg:
            u = t * n_epi + e
            o = lax.rem(u, out_slots)
            i = wg * out_slots + o

            # The store warpgroup has read what this tile held out_slots
            # epilogue tiles ago.
            @pl.when(u >= out_slots)
            def _():
              plgpu.barrier_wait(drained.at[i])

            _stage_rows(plgpu.layout_cast(x[:, e * EPI_V:(e + 1) * EPI_V],
                                          plgpu.Layout.WGMMA),
                        epi_rows, epi_cols, out_smem.at[wg, o])
            # Every thread arrives after its own stores (release).
            plgpu.barrier_arrive(staged.at[i])
            continue
          if warp_rows:
            _store_rows_by_warp(
                plgpu.layout_cast(x[:, e * EPI_V:(e + 1) * EPI_V],
                                  plgpu.Layout.WGMMA),
                epi_rows, epi_cols, out_smem.at[wg], rows_smem.at[wg],
                cache_gmem.at[:, pl.ds(v0 + e * EPI_V, EPI_V)], vocab=p.vocab)
            continue
          if out_slots == 1:
            o = 0
          else:
            o = lax.rem(t * n_epi + e, out_slots)
          # The staging tile's last store (out_slots tiles ago, possibly a
          # statistics group in between) has been read.
          plgpu.wait_smem_to_gmem(out_slots - 1, wait_read_only=True)
          out_smem[wg, o] = x[:, e * EPI_V:(e + 1) * EPI_V]
          plgpu.commit_smem()
          if rows_gmem is None:
            plgpu.copy_smem_to_gmem(
                out_smem.at[wg, o],
                cache_gmem.at[pl.ds(r0, WG_ROWS), step,
                              pl.ds(v0 + e * EPI_V, EPI_V)])
          else:
            for i in range(WG_ROWS):
              @pl.when(row_of[i] >= 0)
              def _(i=i):
                plgpu.copy_smem_to_gmem(
                    out_smem.at[wg, o, pl.ds(i, 1)],
                    cache_gmem.at[pl.ds(row_of[i], 1),
                                  pl.ds(v0 + e * EPI_V, EPI_V)],
                    commit_group=False)
            # One bulk group per staging tile, as in the dense layout.
            plgpu.commit_smem_to_gmem_group()

        if "stats" in p.omit:
          return None
        # block_statistics: NaN counts as -inf; the first max column wins.
        y = jnp.where(x == x, x, -jnp.inf) * scale_tile
        y_max = y.max(axis=1)
        y_max_tile = lax.broadcast_in_dim(y_max, y.shape, [0])
        first = jnp.where(y == y_max_tile, cols, block_v).min(axis=1)
        # An all -inf block sums to 0 (not exp(nan)); a +inf max gives inf.
        finite = jnp.where((y_max > -jnp.inf) & (y_max < jnp.inf), y_max, 0.0)
        y_sum = jnp.exp(
            y - lax.broadcast_in_dim(finite, y.shape, [0])).sum(axis=1)

        # The previous tile's statistics group (issued before this tile's
        # n_epi cache groups, if TMA stored them) has been read.
        plgpu.wait_smem_to_gmem(
            0 if warp_rows or "cache" in p.omit else n_epi,
            wait_read_only=True)
        max_smem[wg] = y_max
        sum_smem[wg] = y_sum
        arg_smem[wg] = first + v0
        plgpu.commit_smem()
        j = lax.div(v0, jnp.int32(block_v))
        rows = pl.ds(r0, WG_ROWS)
        plgpu.copy_smem_to_gmem(max_smem.at[wg], bmax_gmem.at[j, rows],
                                commit_group=False)
        plgpu.copy_smem_to_gmem(sum_smem.at[wg], bsum_gmem.at[j, rows],
                                commit_group=False)
        plgpu.copy_smem_to_gmem(arg_smem.at[wg], barg_gmem.at[j, rows])
        return y_max, y_sum, first + v0

      if not p.chunk:
        @pl.loop(0, num_t)
        def _tile(t):
          tile(t)
      else:
        def fold(t, carry):
          # chunk_pass's reduction, online over the chunk's blocks in
          # vocabulary order: sums relative to the running max where finite
          # (else 0); the first block holding the max gives the argmax.
          c_max, c_sum, c_arg = carry
          b_max, b_sum, b_arg = tile(t)
          n_max = jnp.maximum(c_max, b_max)
          finite = lambda m: (m > -jnp.inf) & (m < jnp.inf)
          old = jnp.where(finite(c_max), c_max, 0.0)
          new = jnp.where(finite(n_max), n_max, 0.0)
          # A zero sum (only -inf blocks so far) stays 0: exp(old - new) may
          # overflow, and 0 * inf is NaN.
          n_sum = (jnp.where(c_sum > 0, c_sum * jnp.exp(old - new), 0.0)
                   + b_sum * jnp.exp(b_max - new))
          n_arg = jnp.where((b_max > c_max) | (c_arg < 0), b_arg, c_arg)
          return n_max, n_sum, n_arg

        init = (jnp.full((WG_ROWS,), -jnp.inf, f32),
                jnp.zeros((WG_ROWS,), f32),
                jnp.full((WG_ROWS,), -1, jnp.int32))
        init = tuple(plgpu.layout_cast(x, row_layout) for x in init)
        c_max, c_sum, c_arg = lax.fori_loop(0, num_t, fold, init)
        # The last tile's statistics group has been read.
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        max_smem[wg] = c_max
        sum_smem[wg] = c_sum
        arg_smem[wg] = c_arg
        plgpu.commit_smem()
        rows = pl.ds(r0, WG_ROWS)
        plgpu.copy_smem_to_gmem(max_smem.at[wg], cmax_gmem.at[worker, rows],
                                commit_group=False)
        plgpu.copy_smem_to_gmem(sum_smem.at[wg], csum_gmem.at[worker, rows],
                                commit_group=False)
        plgpu.copy_smem_to_gmem(arg_smem.at[wg], carg_gmem.at[worker, rows])

      # Shared memory must outlive the stores that read it.
      plgpu.wait_smem_to_gmem(0)

    if p.cluster > 1:
      # The consumers arrive on every CTA's proj_free and the producers
      # multicast into every CTA's proj ring: no CTA of the cluster leaves
      # (its shared memory and barriers gone) before all have arrived here.
      plgpu.barrier_arrive(done)
      plgpu.barrier_wait(done)

  pl.run_scoped(
      body,
      plgpu.SMEM((num_k, block_b, TILE_K), bf16, transforms=_swizzled(bf16)),
      plgpu.SMEM((stages, cta_v, TILE_K), bf16, transforms=_swizzled(bf16)),
      plgpu.SMEM((p.base_slots, block_b, cta_v), bf16, transforms=_swizzled(bf16)),
      # Row stores need single-row slices: no tiling in the state-row layout.
      (plgpu.SMEM((p.consumers, out_slots, WG_ROWS, p.stage_pitch), f32)
       if p.store_wg else
       plgpu.SMEM((p.consumers, WG_ROWS, p.stage_pitch), f32) if warp_rows
       else plgpu.SMEM((p.consumers, out_slots, WG_ROWS, EPI_V), f32,
                       transforms=(_swizzled(f32) if rows_gmem is None
                                   else ()))),
      # Each consumer's cache rows (warp row stores; else a placeholder).
      plgpu.SMEM((p.consumers, WG_ROWS) if warp_rows else (1,),
                 jnp.int32),
      plgpu.SMEM((p.consumers, WG_ROWS), f32),
      plgpu.SMEM((p.consumers, WG_ROWS), f32),
      plgpu.SMEM((p.consumers, WG_ROWS), jnp.int32),
      plgpu.Barrier(num_barriers=num_k * p.halves),
      plgpu.Barrier(num_barriers=stages),
      plgpu.Barrier(num_barriers=p.base_slots * p.halves),
      # Released by both consumers (of every CTA of a cluster: a multicast
      # refills the slot in all of them).
      (plgpu.ClusterBarrier(collective_axes=("b",),
                            num_arrivals=p.consumers, num_barriers=stages)
       if p.cluster > 1 else
       plgpu.Barrier(num_arrivals=p.consumers, num_barriers=stages)),
      plgpu.Barrier(num_arrivals=p.consumers, num_barriers=p.base_slots),
      # Every warpgroup of the cluster, at the end.
      *([plgpu.ClusterBarrier(collective_axes=("b",),
                              num_arrivals=p.consumers + 1)]
        if p.cluster > 1 else []),
      # staged (a consumer arrives), drained (the store warpgroup arrives).
      *([plgpu.Barrier(num_barriers=p.consumers * out_slots),
         plgpu.Barrier(num_barriers=p.consumers * out_slots)]
        if p.store_wg else []),
      collective_axes="wg",
  )


def _check_operands(base, emb, proj, params, step, cache, cache_rows,
                    num_cache_rows, p: Plan):
  bs = p.batch * p.steps
  want = dict(base=(base, jnp.bfloat16, (bs, p.vocab)),
              emb=(emb, jnp.bfloat16, (p.batch, p.rank)),
              proj=(proj, jnp.bfloat16, (p.vocab, p.rank)),
              params=(params, jnp.float32, (3, bs)),
              step=(step, jnp.int32, (1,)),
              cache=(cache, jnp.float32, (num_cache_rows, p.vocab)),
              cache_rows=(cache_rows, jnp.int32, (bs,)))
  for name, (x, dtype, shape) in want.items():
    if x is None:
      continue
    if x.dtype != dtype or tuple(x.shape) != shape:
      raise ValueError(f"{name} must be {jnp.dtype(dtype).name}{list(shape)}, "
                       f"got {x.dtype}{list(x.shape)}")
  if cache_rows is not None and cache is None:
    raise ValueError("cache_rows (the state-row layout) needs the cache to "
                     "write into")


@functools.partial(
    jax.jit,
    static_argnames=("num_steps", "num_cache_rows", "block_b", "block_v",
                     "max_concurrent_steps", "num_sms", "row_stores",
                     "chunk", "store_warpgroup", "dependent_launch",
                     "_omit", "_base_slots", "_multicast"),
    donate_argnames=("cache",))
def mosaic_block_pass(base: jax.Array, emb: jax.Array, proj: jax.Array,
                      params: jax.Array, step: jax.Array,
                      cache: jax.Array | None,
                      cache_rows: jax.Array | None = None, *,
                      num_steps: int, num_cache_rows: int | None = None,
                      block_b: int | None = None, block_v: int = 128,
                      max_concurrent_steps: int | None = None,
                      num_sms: int | None = None,
                      row_stores: str = "warp", chunk: int | None = None,
                      store_warpgroup: bool = False,
                      dependent_launch: bool = False,
                      _omit: tuple = (),
                      _base_slots: int = 2, _multicast: bool = False):
  """Runs one step of the fused block pass on Hopper (Mosaic GPU).

  Draw (b, s) is row ``b * S + s`` of base and of the per-draw arrays; this
  call reads and writes the draws of step ``step[0]`` only. No interpreter
  mode: this lowers only to Mosaic GPU (sm_90a); :func:`block_pass.block_pass`
  is the portable reference.

  Args:
    base: bfloat16 [B * S, V], the base logits, request-major rows.
    emb: bfloat16 [B, R], each request's previous-token embedding row.
    proj: bfloat16 [V, R], the projection (vocabulary-major rows).
    params: float32 [3, B * S], per draw: 1 / T (1 where greedy), the greedy
      flag and the uniform (as the select pass takes them; row 0 is read).
    step: int32 [1], the step s (data, not static).
    cache: float32 [num_cache_rows, V], updated in place (donated; inside an
      outer jit, donate the outer argument to avoid a copy). Dense layout
      (no cache_rows): [B * S, V], row b * S + s gets draw (b, s); None:
      a new dense cache of which only this step's rows are written (the rest
      uninitialised), as the sampler's step 0 makes it.
    cache_rows: int32 [B * S], the state-row layout: the cache row of each
      draw (< 0: padding, not stored); None: the dense layout.
    num_steps: S (static).
    num_cache_rows: the cache's rows (static); None: B * S.
    block_b: requests per CTA (static): 128 or 192 (two or three consumer
      warpgroups of 64 requests each) or 64 (two consumers split each
      vocabulary tile's columns); None: 128 where B % 128 == 0, else 64. Where it does not divide B
      (B >= 64 and a multiple of 4), the last tile is partial: each of its
      consumers takes the 64-row window that ends at row B (rows shared
      with another consumer are computed twice, their cache rows stored
      once), and cache rows are stored by warp in either layout.
    block_v: vocabulary columns per statistics block (static), 64 or 128.
    max_concurrent_steps: proj chunks ([cta_v, 64] bf16) in flight (static,
      >= 2); None: the most that fit in shared memory, up to two tiles.
    num_sms: CTAs to aim for (static); None: the GPU's SM count, or 132.
    row_stores: how state rows are stored (static; the dense layout always
      stores a TMA box a [64, 64] tile): "warp" (default), through a padded
      shared-memory tile, one warp store a 256-byte row; "tma", one TMA
      store a row (slow: kept to check the other against).
    chunk: blocks a chunk (static; block_b = 128 or 192), or None. Given, each
      vocabulary worker takes ``chunk`` contiguous blocks (NC = ceil(NB /
      chunk) workers a request tile; :func:`default_chunk` keeps one CTA an
      SM) and also returns their chunk statistics, as
      :func:`jax_markov.kernels.chunk_pass.chunk_pass` computes them from
      the block statistics (sums in another order): the select pass's
      ``chunk_stats`` without a chunk pass.
    store_warpgroup: where cache rows are stored by warp (state rows with
      row_stores="warp", or a partial last tile; static; not with block_b =
      192), a fourth warpgroup stores them: each consumer stages a [64, 64] tile into one
      of two shared-memory slots and goes on to its next WGMMA while the
      store warpgroup writes the rows out (the consumers otherwise stop
      issuing WGMMA for their own stores). The same bits either way.
      Ignored where the cache is stored by TMA. Level in the captured
      draft on an H100 (docs/perf-notes.md change 58): off by default.
    dependent_launch: built for a programmatic dependent launch (static;
      the native runtime's capture gives the launch a programmatic edge
      from the select pass before it, torch_bridge/mosaic_launch.py): the
      producer loads the first vocabulary tile's base and its first proj
      chunks (nothing an earlier kernel of the draft writes), then every
      warpgroup executes ``griddepcontrol.wait`` before it reads the
      embeddings or writes anything, then lets the next kernel launch.
      Launched plainly the wait returns at once: the same bits either way.
    _omit: stages to leave out, for timing the rest only (a subset of
      OMITTABLE; the outputs are then wrong): "mma", "cache", "stats".
    _base_slots: base tiles in flight (>= 2; an experiment's knob).
    _multicast: the request tiles of a vocabulary tile run as one cluster
      that shares each proj chunk by TMA multicast (an experiment's knob).

  Returns:
    (cache, block_max, block_sum, block_argmax): the cache; per block of
    ``block_v`` columns and request, vocabulary-block-major (NB = V //
    block_v; the select pass takes them with ``stats_major="block"``):
    float32 [NB, B] max of y = x * params[0] (NaN counts as -inf), float32
    [NB, B] sum of exp(y - m) with m the max where finite, else 0, int32
    [NB, B] vocabulary index of the first max. With ``chunk``, then
    (chunk_max, chunk_sum, chunk_argmax), float32 / float32 / int32
    [NC, B].

  Operands of the Mosaic GPU call (the order a native runtime binds
  pointers in): base, emb, proj, params, step, [cache_rows], [cache], then
  the outputs block_max, block_sum, block_argmax [, chunk_max, chunk_sum,
  chunk_argmax] [, cache when None was given]; a given cache is aliased in
  and out.

  Raises:
    ValueError: shapes or dtypes other than the above, B % block_b != 0
      with B < 64 or B % 4 != 0 (or with multicast or row_stores="tma"),
      V % block_v != 0 (V % (2 * block_v) with block_b = 64), R % 64 != 0,
      or tiles that do not fit in shared memory (block_v = 128 with
      block_b = 192), store_warpgroup with block_b = 192 where rows are
      stored by warp.
    ImportError: Pallas Mosaic GPU is not available.
  """
  p = plan(base.shape, emb.shape, proj.shape, num_steps=num_steps,
           block_b=block_b, block_v=block_v,
           max_concurrent_steps=max_concurrent_steps, num_sms=num_sms,
           row_stores=row_stores, omit=_omit, base_slots=_base_slots,
           multicast=_multicast, chunk=chunk,
           state_rows=cache_rows is not None,
           store_warpgroup=store_warpgroup, dependent_launch=dependent_launch)
  B, S, V = p.batch, p.steps, p.vocab
  if num_cache_rows is None:
    num_cache_rows = B * S
  _check_operands(base, emb, proj, params, step, cache, cache_rows,
                  num_cache_rows, p)
  if plgpu is None:
    raise ImportError("Pallas Mosaic GPU is unavailable") from _IMPORT_ERROR
  stats = jax.ShapeDtypeStruct((p.num_blocks, B), jnp.float32)
  out_type = (stats, stats, jax.ShapeDtypeStruct((p.num_blocks, B), jnp.int32))
  names_out = ["bmax", "bsum", "barg"]
  if p.chunk:
    chunks = jax.ShapeDtypeStruct((p.grid_v, B), jnp.float32)
    out_type += (chunks, chunks,
                 jax.ShapeDtypeStruct((p.grid_v, B), jnp.int32))
    names_out += ["cmax", "csum", "carg"]
  # [B, S, *] views are bitcasts. A Ref operand of a Mosaic GPU kernel is
  # aliased in and out, which is the in-place cache update.
  operands = [base.reshape(B, S, V), emb, proj, params.reshape(3, B, S), step]
  names = ["base", "emb", "proj", "params", "step"]
  if cache_rows is not None:
    operands.append(cache_rows.reshape(B, S))
    names.append("rows")
  cache_ref = None
  # The dense layout's [B, S, V] view takes a TMA box a tile; a partial last
  # request tile stores rows by warp, into the [B * S, V] cache.
  view_3d = cache_rows is None and not p.partial
  if cache is not None:
    cache_ref = jax.new_ref(cache.reshape(B, S, V) if view_3d else cache)
    operands.append(cache_ref)
    names.append("cache")
  names += names_out
  if cache is None:
    # A new cache is a kernel output: only this step's rows are written (the
    # sampler's steps after it write the others), so there is no memset.
    out_type += (jax.ShapeDtypeStruct((B, S, V) if view_3d else (B * S, V),
                                      jnp.float32),)
    names.append("cache")

  def body(*refs):
    r = dict(zip(names, refs, strict=True))
    _kernel(r["base"], r["emb"], r["proj"], r["params"], r["step"],
            r.get("rows"), r["cache"], r["bmax"], r["bsum"], r["barg"],
            r.get("cmax"), r.get("csum"), r.get("carg"), p=p)

  # pl.kernel on a plgpu.Mesh rather than plgpu.kernel: the latter wraps the
  # call in a custom_vmap that does not take Ref operands (the aliased cache).
  if p.cluster > 1:
    # The request tiles of a worker are the CTAs of one cluster.
    mesh = plgpu.Mesh(grid=(p.grid_v,), grid_names=("v",),
                      cluster=(p.cluster,), cluster_names=("b",),
                      num_threads=p.num_wgs, thread_name="wg")
  else:
    mesh = plgpu.Mesh(grid=(p.grid_v, p.num_b_tiles), grid_names=("v", "b"),
                      num_threads=p.num_wgs, thread_name="wg")
  kernel = pl.kernel(
      body,
      out_type=out_type,
      mesh=mesh,
      compiler_params=plgpu.CompilerParams(),
      name="mosaic_block_pass",
  )
  out = kernel(*operands)
  if cache is None:
    *stats_out, new_cache = out
  else:
    stats_out = list(out)
    new_cache = jax.freeze(cache_ref)
  return (new_cache.reshape(num_cache_rows, V), *stats_out)
