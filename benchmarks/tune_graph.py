"""Sweeps block-pass configurations timed as torch_bridge_graph (GPU time only).

  python -m benchmarks.tune_graph --shape dsv4 --batches 4 16 --out tune.json

benchmarks/tune.py times jax_markov from the host, and below B = 64 the host's
issue time (100-230 us a draft) is of the order of the GPU's, so two
configurations that differ by a few microseconds a step time the same there.
This sweep times what a captured engine runs: for each candidate it puts the
configuration in ``tuning.TABLE`` for the batch's bucket, builds a fresh
``torch_bridge.FusedMarkovSampler`` (native runtime) on the benchmark's
synthetic inputs, captures one draft in a CUDA graph and times replays with
CUDA events (median of groups of back-to-back replays). The tokens of every
candidate are checked equal to the first's at T = 0 (the draws do not depend on
the tile). Winners go into jax_markov/kernels/tuning.py's TABLE by hand; the
JAX path then runs them too.

``--grid mosaic`` sweeps the Mosaic GPU block pass (Hopper) the same way,
through the table's "mosaic" entry for the bucket (which the native runtime
then picks where the batch fills its request tiles); the Triton grids run
with the hook's ``mosaic=False``, so that a bucket the table gives to Mosaic
GPU (B = 256) times the Triton candidate and not the table's Mosaic entry.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import statistics
import sys

import torch

import torch_bridge as tb  # noqa: E402 -- before JAX starts (preallocation)
from benchmarks import common  # noqa: E402
from benchmarks.baselines.vllm_loop import capture_graph  # noqa: E402
from jax_markov.kernels import tuning  # noqa: E402
from jax_markov.kernels.config import KernelConfig  # noqa: E402
from torch_bridge import native_plan  # noqa: E402
from torch_bridge.testing import speculator_from_tensors  # noqa: E402


def candidates(batch: int):
  """The table's current choice first, then tiles near it."""
  fma = dict(method="fused", block_b=1, bias_dot="fma")
  if batch <= 16:
    for bv, bk, w, st, sel in ((128, 64, 4, 3, "tail"), (128, 64, 4, 3, "pass"),
                               (256, 64, 8, 3, "tail"), (64, 64, 4, 3, "tail"),
                               (512, 64, 8, 2, "tail")):
      yield KernelConfig(**fma, block_v=bv, block_k=bk, num_warps=w,
                         num_stages=st, select=sel)
    for bv, bk, w, st in ((128, 64, 4, 3), (256, 64, 4, 3), (256, 64, 8, 3),
                          (128, 128, 4, 2), (512, 64, 8, 2)):
      yield KernelConfig(method="fused", block_b=16, block_v=bv, block_k=bk,
                         num_warps=w, num_stages=st)
    if 1 < batch <= 8:
      # One tile of all the requests on the CUDA cores: proj read once from
      # HBM as at B = 1, B times B = 1's products (narrow rank chunks keep
      # the [B, block_v, block_k] product in registers), with and without
      # B = 1's L2-kept rows (which lost on the tensor-core tiles only).
      bb = 1 << (batch - 1).bit_length()
      for bv, bk, w, st, keep in ((128, 16, 4, 3, 0), (128, 32, 4, 3, 0),
                                  (256, 16, 8, 3, 0), (256, 32, 8, 3, 0),
                                  (64, 32, 4, 3, 0), (128, 16, 4, 3, 49152),
                                  (128, 32, 4, 3, 49152),
                                  (256, 16, 8, 3, 49152)):
        yield KernelConfig(method="fused", block_b=bb, block_v=bv,
                           block_k=bk, num_warps=w, num_stages=st,
                           bias_dot="fma", proj_l2_rows=keep)
    return
  for bb, bv, bk, w, st in ((32, 128, 64, 4, 3), (32, 256, 64, 8, 3),
                            (64, 128, 64, 4, 3), (64, 128, 64, 4, 4),
                            (64, 256, 64, 8, 3), (128, 128, 64, 8, 3),
                            # 64-column blocks: twice the programs (2020).
                            (64, 64, 64, 4, 3), (64, 64, 64, 4, 4),
                            # narrower rank chunks, deeper pipelines
                            (64, 128, 32, 4, 4), (64, 128, 32, 4, 5),
                            (64, 256, 32, 8, 3)):
    yield KernelConfig(method="fused",
                       block_b=min(bb, max(16, tuning._next_pow2(batch))),  # noqa: SLF001
                       block_v=bv, block_k=bk, num_warps=w, num_stages=st)


def partial_candidates(batch: int):
  """Request tiles for a batch that does not fill its bucket's (B = 72 on
  the 128 bucket's 64-request tiles: a second tile of 8 rows re-reads all
  of proj from L2 and doubles the programs): every power-of-two tile from
  16 requests to the bucket, 128 columns, the select pass letting the next
  step launch early (as the table's entries do), and 128-request tiles on
  8 warps (their accumulator does not fit 4); no more than 4 request
  tiles (each re-reads proj)."""
  top = max(16, tuning._next_pow2(batch))  # noqa: SLF001
  bb = 16
  while bb <= min(top, 64):
    if -(-batch // bb) <= 4:
      yield KernelConfig(method="fused", block_b=bb, block_v=128,
                         block_k=64, num_warps=4, num_stages=3, early_dependents=True,
                         early_proj=2 if bb == 16 else 0)
    bb *= 2
  if top >= 128:
    for bv, bk, st in ((128, 64, 3), (64, 64, 3), (128, 32, 4)):
      yield KernelConfig(method="fused", block_b=128, block_v=bv,
                         block_k=bk, num_warps=8, num_stages=st,
                         early_dependents=True)


def remainder_candidates(batch: int, vocab: int = 129280, rank: int = 256):
  """The table's fused tile for a batch past its first request tile, with
  the rows past the last full tile run in that tile's programs
  (remainder_b) or as a tile of their own (remainder_b=0), and the
  remainder bound at every power of two up to the tile: B = 112 leaves 48
  rows, which only remainder_b >= 48 takes in; then the widest bound with
  the remainder's rank loop after the tile's (remainder_pass="after",
  which keeps the tile's registers: it wins where "joint" costs a program
  a multiprocessor). A batch that does not fill
  the table's one tile (B = 24 on 32-request tiles) also tries the tile of
  half the rows with the rest as its remainder (16 + 8 at B = 24; the
  16-request tile with its early proj chunks, as the table's entries)."""
  cfg = tuning.choose("fused", batch, vocab, rank, interpret=False)
  if cfg.method != "fused" or cfg.select != "pass":
    return
  yield dataclasses.replace(cfg, remainder_b=0)
  half = cfg.block_b // 2
  if half >= 16 and half < batch < cfg.block_b:
    yield dataclasses.replace(cfg, block_b=half, remainder_b=half - 1,
                              early_proj=2 if half == 16 else 0)
  rest = batch % cfg.block_b
  if batch < cfg.block_b or not rest:
    return
  bound = 16
  while bound < cfg.block_b:
    if bound >= rest:
      yield dataclasses.replace(cfg, remainder_b=bound)
    bound *= 2
  yield dataclasses.replace(cfg, remainder_b=cfg.block_b - 1)
  # The remainder's own rank loop after the tile's (remainder_pass).
  yield dataclasses.replace(cfg, remainder_b=cfg.block_b - 1,
                            remainder_pass="after")


def rows_candidates(batch: int, vocab: int = 129280, rank: int = 256):
  """One request tile of all the requests (2 to 8) on the CUDA cores, each
  request a row of its own in the block pass (B = 1's 2D product once per
  row of the same proj chunk; change 52): B = 1's tile with its L2-kept
  rows or without, and with 0 or 2 proj chunks loaded before the wait, then
  64- and 256-column blocks."""
  if not 1 < batch <= 8:
    return
  one = tuning.choose("fused", 1, vocab, rank, interpret=False)
  tile = dataclasses.replace(one, block_b=_pow2(batch), select="pass",
                             early_dependents=True)
  for keep in (one.proj_l2_rows, 0):
    for early in (0, 2):
      yield dataclasses.replace(tile, proj_l2_rows=keep, early_proj=early)
  for bv, warps in ((64, 2), (256, 8)):
    yield dataclasses.replace(tile, block_v=bv, num_warps=warps,
                              proj_l2_rows=0, early_proj=2)


def _pow2(n: int) -> int:
  return tuning._next_pow2(n)  # noqa: SLF001


def l2_candidates(batch: int, vocab: int = 129280, rank: int = 256):
  """The table's fused tile with the first rows of proj kept in L2 across
  the steps (proj_l2_rows: evict_last on those rows, evict_first on every
  other stream), as the B = 1 entry keeps 57344 rows (28 MB); on the
  tensor cores also the unrolled rank loop (k_loop="static") without and
  with rows, the one form whose proj loads carry the hints (Triton's
  pipelined loop issues cp.async copies, which drop the policy:
  docs/perf-notes.md changes 54-56)."""
  cfg = tuning.choose("fused", batch, vocab, rank, interpret=False)
  if cfg.select == "persistent" or cfg.method != "fused":
    return
  for rows in (16384, 32768, 49152, 57344, 65536):
    # The rows alone: early_proj beside them is the early grid's.
    yield dataclasses.replace(cfg, proj_l2_rows=rows, early_proj=0,
                              prefetch_proj=0, prefetch_programs=0)
  if cfg.bias_dot == "mma":
    static = dataclasses.replace(cfg, k_loop="static", early_proj=0,
                                 prefetch_proj=0, prefetch_programs=0)
    yield static
    for rows in (49152, 57344):
      yield dataclasses.replace(static, proj_l2_rows=rows)


def hints_candidates(batch: int, vocab: int = 129280, rank: int = 256):
  """The table's fused tile with eviction hints and no kept rows (l2_hints):
  base and the cache evict_first, then also proj evict_last; for a tile
  without proj_l2_rows (which bring their own hints)."""
  cfg = tuning.choose("fused", batch, vocab, rank, interpret=False)
  if (cfg.method != "fused" or cfg.select == "persistent"
      or cfg.proj_l2_rows):
    return
  for hints in ("stream", "proj"):
    yield dataclasses.replace(cfg, l2_hints=hints)


def mosaic_candidates(batch: int, vocab: int = 129280, rank: int = 256):
  """Mosaic GPU block-pass tiles that run at this shape: 128- or 64-request
  tiles, and from B = 129 192-request ones (three consumers: B = 129 to 192
  in one tile), a partial last tile where they do not divide B
  (partial_tiles), 64- or 128-column statistics blocks, the proj chunks in
  flight as many as fit (num_stages 0) or 4, and with 128- or 192-request
  tiles the chunk statistics folded into the pass's epilogue or left to the
  chunk pass (fold_chunks); what does not fit in shared memory
  (mosaic_block_pass.plan) is left out. Each takes select_embed (the select
  pass writes the next step's embeddings), as the table's Mosaic entries."""
  from jax_markov.kernels import mosaic_block_pass as mbp
  for bb in ((192, 128, 64) if batch > 128 else (128, 64)):
    # A batch that does not fill the tiles: the last one partial
    # (partial_tiles; B a multiple of 4 past one consumer's 64 rows).
    partial = batch % bb != 0
    if partial and not (batch > 64 and batch % 4 == 0):
      continue
    for bv in (64, 128):
      for stages in (0, 4):
        try:
          # The native runtime's layout: state rows, stored by warp.
          mbp.plan((batch, vocab), (batch, rank), (vocab, rank),
                   num_steps=1, block_b=bb, block_v=bv,
                   max_concurrent_steps=stages or None, num_sms=132,
                   row_stores="warp")
        except ValueError:
          continue
        for fold in ((True, False) if bb != 64 else (True,)):
          # select_embed: as every Mosaic entry and the rule (change 53).
          yield KernelConfig(method="mosaic", block_b=bb, block_v=bv,
                             num_stages=stages, fold_chunks=fold,
                             partial_tiles=partial, select_embed=True)


def consumers_candidates(batch: int, vocab: int = 129280, rank: int = 256):
  """The Mosaic pass on one 192-request tile a 192 requests (three consumer
  warpgroups; a partial last tile where 192 does not divide B), as many
  proj chunks in flight as fit: the chunk statistics folded or left to the
  chunk pass (no store warpgroup: with three consumers it hung).
  Timed after the hook's default (``--grid consumers``), whose Mosaic rule
  runs B = 129 to 192 on two or three request tiles of 128 or 64."""
  from jax_markov.kernels import mosaic_block_pass as mbp
  if not (batch > 128 and batch % 4 == 0):
    return
  try:
    mbp.plan((batch, vocab), (batch, rank), (vocab, rank), num_steps=1,
             block_b=192, block_v=64, max_concurrent_steps=None, num_sms=132,
             row_stores="warp", state_rows=True)
  except ValueError:
    return
  tile = KernelConfig(method="mosaic", block_b=192, block_v=64,
                      num_stages=0, partial_tiles=batch % 192 != 0,
                      select_embed=True)
  yield tile
  yield dataclasses.replace(tile, fold_chunks=False)


def between_candidates(batch: int, vocab: int = 129280, rank: int = 256):
  """The Mosaic pass on 128-request tiles for a batch they do not fill (B =
  65 to 127 in one partial tile: proj streams once a step, as on the
  Triton pass's tile with its remainder rows), as many proj chunks in
  flight as fit and 4, the chunk statistics folded: the tiles that led at
  B = 72 on an H100 (docs/perf-notes.md change 57). Timed after the hook's
  default (``--grid between``), the Triton pass at B = 65 to 127."""
  from jax_markov.kernels import mosaic_block_pass as mbp
  if batch % 128 == 0 or not (batch > 64 and batch % 4 == 0):
    return
  for stages in (0, 4):
    try:
      mbp.plan((batch, vocab), (batch, rank), (vocab, rank), num_steps=1,
               block_b=128, block_v=64, max_concurrent_steps=stages or None,
               num_sms=132, row_stores="warp", state_rows=True)
    except ValueError:
      continue
    yield KernelConfig(method="mosaic", block_b=128, block_v=64,
                       num_stages=stages, partial_tiles=True,
                       select_embed=True)


def walk_candidates(batch: int, vocab: int = 129280, rank: int = 256):
  """The table's fused tile at a batch of one request tile, as P programs
  walking the vocabulary blocks in one pipelined (block, rank chunk) loop
  (block_programs; without the table's early or prefetched proj chunks,
  which it does not take), P = 2 to 5 programs a multiprocessor of 132
  (ptxas on the CPU, session 35: 16 x 128 and 32 x 128 tiles keep their
  registers' occupancy, 5 and 3 a multiprocessor; 64 x 128 rises to 255
  registers, 2), and at 64 requests also 64 x 64 blocks (159 registers, 3).
  Timed after the hook's default (``--grid walk``)."""
  cfg = tuning.choose("fused", batch, vocab, rank, interpret=False)
  if (cfg.method != "fused" or cfg.select != "pass" or cfg.bias_dot != "mma"
      or batch > cfg.block_b):
    return
  plain = dataclasses.replace(cfg, early_proj=0, prefetch_proj=0,
                              prefetch_programs=0, remainder_b=0)
  for per_sm in (2, 3, 4, 5):
    yield dataclasses.replace(plain, block_programs=per_sm * 132)
  if cfg.block_b == 64:
    for per_sm in (3, 4):
      yield dataclasses.replace(plain, block_v=64, block_programs=per_sm * 132)


def embed_candidates(table: KernelConfig):
  """The Mosaic GPU entry ``table`` (timed first, as every grid's default)
  with the select pass writing the next step's embeddings instead
  (select_embed: no embed_rows launch a step)."""
  if table.method == "mosaic":
    yield dataclasses.replace(table, select_embed=not table.select_embed)


def stores_default(batch: int, vocab: int, rank: int, *, hopper: bool,
                   gpu: str) -> KernelConfig:
  """The Mosaic entry ``--grid stores`` starts from: the hook's own where
  that is the Mosaic pass (the rule's partial last tile at B = 136, which
  the hook would run in place of the bucket's full-tile entry), else the
  table's Mosaic entry for the bucket (B = 64, where the hook runs the
  Triton pass)."""
  hook = tuning.choose(None, batch, vocab, rank, interpret=False,
                       hopper=hopper, gpu=gpu)
  if hook.method == "mosaic":
    return hook
  return tuning.choose("mosaic", batch, vocab, rank, interpret=False,
                       hopper=hopper, gpu=gpu)


def stores_candidates(table: KernelConfig):
  """The Mosaic GPU entry ``table`` (timed first, as every grid's default)
  with its cache rows stored by a fourth warpgroup (store_warpgroup): at
  the entry's proj chunks in flight, as many as fit beside two staging
  tiles a consumer (num_stages 0), and 4."""
  if table.method != "mosaic":
    return
  on = dataclasses.replace(table, store_warpgroup=True)
  yield on
  for stages in (0, 4):
    yield dataclasses.replace(on, num_stages=stages)


def select_candidates(batch: int, vocab: int = 129280, rank: int = 256):
  """The table's fused tile with 1 to 8 warps a select-pass program (the
  table's 4 was chosen with the block pass, never swept on its own)."""
  cfg = tuning.choose("fused", batch, vocab, rank, interpret=False)
  if cfg.select != "pass":
    return
  for warps in (1, 2, 8):
    if warps != cfg.select_warps:
      yield dataclasses.replace(cfg, select_warps=warps)


def early_candidates(batch: int, vocab: int = 129280, rank: int = 256):
  """The table's fused tile without L2-kept rows and with 0, 1, 2 and all
  of its rank chunks of proj loaded before the dependent-launch wait
  (early_proj); where the table keeps rows in L2 (B = 1), then its tile
  with them and 1, 2 and all chunks early (the early loads under the same
  hints)."""
  table = tuning.choose("fused", batch, vocab, rank, interpret=False)
  if table.select == "persistent":
    return
  cfg = dataclasses.replace(table, proj_l2_rows=0, prefetch_proj=0,
                            prefetch_programs=0)
  chunks = -(-rank // cfg.block_k)
  counts = [early for early in sorted({0, 1, 2, chunks}) if early <= chunks]
  for early in counts:
    yield dataclasses.replace(cfg, early_proj=early)
  if cfg.block_b >= 64 and cfg.block_k > 32:
    # A 64-request tile has the registers for half a chunk at most (change
    # 42: a whole 64-wide chunk cost it a program a multiprocessor).
    for early in (0, 1):
      yield dataclasses.replace(cfg, block_k=32, early_proj=early)
  if table.proj_l2_rows:
    for early in counts[1:]:
      yield dataclasses.replace(table, early_proj=early)


def prefetch_candidates(batch: int, vocab: int = 129280, rank: int = 256):
  """The table's tile without early loads, then prefetching 1, 2 or all 4
  proj chunks into L2 before the dependent-launch wait (prefetch_proj), in
  about the first wave's programs (prefetch_programs: 132 multiprocessors x
  the tile's programs a multiprocessor, read from ptxas on the CPU
  (benchmarks.occupancy): 3 for 64-request tiles at 168 registers and for
  32-request tiles at 134, 4 for 16-request tiles at 85-90; the prefetch
  touches a sector and keeps them) or all 4 in every program."""
  cfg = tuning.choose("fused", batch, vocab, rank, interpret=False)
  if cfg.select != "pass" or cfg.block_b < 16:
    return
  cfg = dataclasses.replace(cfg, proj_l2_rows=0, early_proj=0,
                            prefetch_proj=0, prefetch_programs=0)
  wave = 132 * (3 if cfg.block_b >= 32 else 4)
  yield cfg
  for chunks, programs in ((1, wave), (2, wave), (4, wave), (4, 0)):
    yield dataclasses.replace(cfg, prefetch_proj=chunks,
                              prefetch_programs=programs)


def dependents_candidates(batch: int, vocab: int = 129280, rank: int = 256):
  """The table's tile with the select pass letting the next step's block
  pass launch before its wait (early_dependents), and with one more proj
  chunk loaded or prefetched ahead of the block pass's wait, which then has
  the step's last wave to land in."""
  cfg = tuning.choose("fused", batch, vocab, rank, interpret=False)
  if cfg.select != "pass":
    return
  yield dataclasses.replace(cfg, early_dependents=True)
  if cfg.prefetch_proj:
    yield dataclasses.replace(cfg, early_dependents=True,
                              prefetch_proj=cfg.prefetch_proj + 1)
  elif cfg.early_proj:
    yield dataclasses.replace(cfg, early_dependents=True,
                              early_proj=cfg.early_proj + 1)


def persistent_candidates(batch: int):
  """The persistent draft (one launch a draft) on 16-row tiles on the tensor
  cores (Triton stages their proj chunks through shared memory, so
  num_stages sets the loads in flight on each multiprocessor's one
  program), with 0 to 3 blocks of proj held on chip across the steps (Triton
  keeps a held block in shared memory beside the stage buffers; the
  shared-memory sizes were read from ptxas on the CPU: 128 x 32 chunks with
  three held 128-row blocks take 218 KB at 3 stages, the 227 KB limit at 4).
  The sweeps before (benchmarks/results/tune-graph-persistent*-*.json) found
  the CUDA-core tiles and 2-stage pipelines 1.8-6x slower than the table,
  and 128 x 64 / 256 x 32 tiles at 6 stages no better than these.
  """
  del batch  # the same tiles at every batch: a program loops over tiles
  for bv, bk, stages, held in ((256, 64, 3, 0), (256, 64, 4, 0),
                               (256, 64, 3, 1), (256, 32, 4, 1),
                               (128, 64, 3, 2), (128, 64, 4, 2),
                               (128, 32, 3, 3), (128, 32, 4, 3)):
    yield KernelConfig(method="fused", select="persistent", block_b=16,
                       bias_dot="mma", block_v=bv, block_k=bk, num_warps=8,
                       num_stages=stages, held_blocks=held)


def captured_draft(shape, batch, inputs, temperature, dependent_launch=None,
                   mosaic=None, l2_persist=False):
  """A native-runtime hook's draft on the synthetic inputs, captured.

  dependent_launch, mosaic, l2_persist: the hook's options (None: its
  default).

  Returns:
    (graph, spec, hook): the torch CUDA graph of one hook call (all
    ``batch`` requests, the tuning table's configuration), the speculator
    double it writes and the hook.
  """
  temp = torch.full((batch,), temperature, dtype=torch.float32, device="cuda")
  seeds, positions = common.seeds_and_positions(batch, shape.S)
  kw = {}
  if shape.Vd is not None:
    kw["draft_to_target"] = inputs["targets"]
  spec = speculator_from_tensors(inputs["base"], inputs["embed"],
                                 inputs["proj"], inputs["anchors"], temp,
                                 seeds, positions, **kw)
  hook = tb.FusedMarkovSampler(batch, shape.draft_vocab, shape.R,
                               getattr(torch, shape.dtype), runtime="native",
                               buckets=(batch,), check_values=False,
                               dependent_launch=dependent_launch,
                               mosaic=mosaic, l2_persist=l2_persist)
  hook.warmup(spec)
  graph = capture_graph(lambda: hook(spec, batch, spec.head_hidden))
  return graph, spec, hook


@contextlib.contextmanager
def table_entry(cfg: KernelConfig, vocab: int, rank: int, batch: int):
  """``cfg`` as the tuning table's entry for the batch's bucket (of its
  method), a per-GPU entry for the key set aside; restored after."""
  key = (cfg.method, vocab, rank, tuning._batch_bucket(batch))  # noqa: SLF001
  old = tuning.TABLE.get(key)
  tuning.TABLE[key] = cfg
  # A per-GPU entry for the key would win over the candidate: set aside.
  per_gpu = {k: tuning.GPU_TABLE.pop(k) for k in list(tuning.GPU_TABLE)
             if k[1:] == key}
  tuning.choose.cache_clear()
  try:
    yield
  finally:
    if old is None:
      tuning.TABLE.pop(key, None)
    else:
      tuning.TABLE[key] = old
    tuning.GPU_TABLE.update(per_gpu)
    tuning.choose.cache_clear()


def planned_config(hook, batch: int) -> KernelConfig:
  """The configuration the hook's native runtime planned for ``batch``: not
  always the table entry a sweep set (a Mosaic entry whose request tiles
  the batch does not fill yields to the Mosaic rule or the Triton pass;
  tuning.choose), so a row records what ran."""
  if hook.runtime != "native":
    raise RuntimeError(f"the hook runs {hook.runtime!r}: {hook.runtime_reason}")
  shapes = list(hook._impl._plans)  # noqa: SLF001 -- one draft shape here
  if len(shapes) != 1:
    raise RuntimeError(f"expected one planned draft shape, got {len(shapes)}")
  return native_plan.shape_config(shapes[0], batch)


def time_config(shape, batch, cfg, inputs, temperature, repeats, group,
                dependent_launch=None, l2_persist=False):
  """Median ms of one captured draft with ``cfg`` in the table, its tokens
  and the configuration that ran (:func:`planned_config`). With
  l2_persist, the hook's persisting-L2 set-aside is released after the
  timing, so that the next row starts without proj's persisting lines."""
  # The block pass's grid: sampling walks the V target columns, with a
  # reduced vocabulary too.
  mosaic = cfg.method == "mosaic"
  with table_entry(cfg, shape.V, shape.R, batch):
    graph, spec, hook = captured_draft(shape, batch, inputs, temperature,
                                       dependent_launch, mosaic, l2_persist)
    ran = planned_config(hook, batch)
    for _ in range(5):
      graph.replay()
    times = []
    for _ in range(repeats):
      a = torch.cuda.Event(enable_timing=True)
      b = torch.cuda.Event(enable_timing=True)
      a.record()
      for _ in range(group):
        graph.replay()
      b.record()
      torch.cuda.synchronize()
      times.append(a.elapsed_time(b) / group)
    hook.release_l2()
    return statistics.median(times), spec.draft_tokens[:batch].tolist(), ran


def time_seed(shape, batch, inputs, temperature, repeats, group):
  """Median ms of one draft of ``seed_design_graph`` (the reference design
  captured in a CUDA graph, benchmarks/baselines/seed_design.py) on the same
  inputs, timed as :func:`time_config` times a configuration."""
  from benchmarks.baselines.seed_design import SeedDesignSampler
  temps = torch.full((batch,), temperature, dtype=torch.float32,
                     device="cuda")
  uniforms = torch.rand((batch, shape.S), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
  sampler = SeedDesignSampler(inputs["embed"], inputs["proj"],
                              inputs["base"], inputs["anchors"], temps,
                              uniforms)
  graph = sampler.capture()
  for _ in range(5):
    graph.replay()
  times = []
  for _ in range(repeats):
    a = torch.cuda.Event(enable_timing=True)
    b = torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(group):
      graph.replay()
    b.record()
    torch.cuda.synchronize()
    times.append(a.elapsed_time(b) / group)
  return statistics.median(times)


def parser() -> argparse.ArgumentParser:
  """The command line (tests check the GPU queue's steps against it)."""
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="dsv4", choices=sorted(common.SHAPES))
  p.add_argument("--batches", type=int, nargs="+", default=[4, 16])
  p.add_argument("--temperature", type=float, default=0.0)
  p.add_argument("--repeats", type=int, default=30)
  p.add_argument("--group", type=int, default=5)
  p.add_argument("--out", default=None)
  p.add_argument("--grid", default="tiles",
                 choices=("tiles", "partial", "remainder", "persistent",
                          "mosaic", "embed", "stores", "l2", "hints", "rows",
                          "select", "early", "prefetch", "dependents",
                          "consumers", "between", "walk", "table"),
                 help="tiles: step-by-step tiles near the table's; "
                 "partial: every request-tile size for a batch that does "
                 "not fill its bucket (partial_candidates); "
                 "remainder: the table's tile with the rows past its last "
                 "full request tile in that tile's programs, or not "
                 "(remainder_candidates); "
                 "persistent: the one-launch draft (persistent_candidates); "
                 "mosaic: the Mosaic GPU block pass (mosaic_candidates, "
                 "Hopper); embed: the Mosaic entry with and without the "
                 "select pass writing the next embeddings "
                 "(embed_candidates); stores: the Mosaic entry (the "
                 "hook's where it runs one, else the bucket's; "
                 "stores_default) with its cache rows stored by a fourth "
                 "warpgroup (stores_candidates); l2: the table's tile keeping proj rows in L2 "
                 "(l2_candidates); hints: the table's tile with eviction "
                 "hints on base and the cache, then on proj too "
                 "(hints_candidates); rows: all of 2-8 requests in one "
                 "CUDA-core tile, a row each (rows_candidates); select: the table's tile with other "
                 "select-pass warps (select_candidates); early: the table's "
                 "tile loading proj chunks before the dependent-launch wait "
                 "(early_candidates); prefetch: the table's tile prefetching "
                 "proj chunks into L2 before the wait (prefetch_candidates); "
                 "dependents: the select pass launching the next block pass "
                 "before its wait (dependents_candidates); "
                 "consumers: the hook's default, then the Mosaic pass on "
                 "192-request tiles (consumers_candidates); "
                 "between: the hook's default, then the Mosaic pass on "
                 "partial 128-request tiles (between_candidates); "
                 "walk: the hook's default, then its tile as programs "
                 "walking the vocabulary (walk_candidates); "
                 "table: the hook's default entry only (Mosaic GPU where "
                 "the table has one for a Hopper GPU)")
  p.add_argument("--dependent-launch", default="auto",
                 choices=("auto", "on", "off", "both"),
                 help="the hook's dependent_launch (auto: its default, on "
                 "for sm_90+ unless $JAX_MARKOV_DEPENDENT_LAUNCH=0); both: "
                 "each configuration off, then on")
  p.add_argument("--l2-persist", default="off",
                 choices=("off", "on", "both"),
                 help="the hook's l2_persist (a persisting-L2 window over "
                 "proj; torch_bridge/l2_window.py): both: each "
                 "configuration without, then with it")
  p.add_argument("--seed", action="store_true",
                 help="also time seed_design_graph (the reference design, "
                 "captured) on the same inputs, first and last per batch")
  return p


def main(argv=None):
  args = parser().parse_args(argv)
  if not torch.cuda.is_available():
    print("tune_graph needs a CUDA GPU", file=sys.stderr)
    return 2
  shape = common.SHAPES[args.shape]
  rows = []
  for batch in args.batches:
    inputs = common.torch_inputs(shape, batch, 0, torch.device("cuda"))
    # table: what the hook runs by default (the Mosaic GPU entry where the
    # table has one for a Hopper GPU); the grids: their method's entry.
    method = dict(mosaic="mosaic", embed="mosaic", stores="mosaic",
                  table=None, consumers=None, between=None,
                  walk=None).get(args.grid, "fused")
    hopper = torch.cuda.get_device_capability()[0] == 9
    gpu = torch.cuda.get_device_name()
    default = tuning.choose(method, batch, shape.V, shape.R, interpret=False,
                            hopper=hopper, gpu=gpu)
    if args.grid == "stores":
      default = stores_default(batch, shape.V, shape.R, hopper=hopper,
                               gpu=gpu)
    seen, ref_tokens = [], None
    grid = dict(tiles=candidates, partial=partial_candidates,
                remainder=lambda b: remainder_candidates(b, shape.V, shape.R),
                persistent=persistent_candidates,
                mosaic=lambda b: mosaic_candidates(b, shape.V, shape.R),
                embed=lambda _: embed_candidates(default),
                stores=lambda _: stores_candidates(default),
                l2=lambda b: l2_candidates(b, shape.V, shape.R),
                hints=lambda b: hints_candidates(b, shape.V, shape.R),
                rows=lambda b: rows_candidates(b, shape.V, shape.R),
                select=lambda b: select_candidates(b, shape.V, shape.R),
                early=lambda b: early_candidates(b, shape.V, shape.R),
                prefetch=lambda b: prefetch_candidates(b, shape.V, shape.R),
                dependents=lambda b: dependents_candidates(b, shape.V,
                                                           shape.R),
                consumers=lambda b: consumers_candidates(b, shape.V, shape.R),
                between=lambda b: between_candidates(b, shape.V, shape.R),
                walk=lambda b: walk_candidates(b, shape.V, shape.R),
                table=lambda _: ())[args.grid](batch)
    launches = [(d, keep) for d in dict(
        auto=(None,), on=(True,), off=(False,),
        both=(False, True))[args.dependent_launch]
                for keep in dict(off=(False,), on=(True,),
                                 both=(False, True))[args.l2_persist]]
    def seed_row(when):
      try:
        ms = time_seed(shape, batch, inputs, args.temperature, args.repeats,
                       args.group)
      except Exception as e:  # noqa: BLE001 -- the sweep goes on without it
        print(f"B={batch} seed_design_graph: {type(e).__name__}: {e}"[:300],
              flush=True)
        return
      rows.append(dict(shape=shape.name, batch=batch, ms=ms,
                       impl="seed_design_graph", when=when))
      print(f"B={batch:4d} {ms:.4f} ms seed_design_graph ({when})",
            flush=True)

    if args.seed:
      seed_row("first")
    for cfg in [default, *grid]:
      if cfg in seen:
        continue
      seen.append(cfg)
      for dependent, keep in launches:
        try:
          ms, tokens, ran = time_config(shape, batch, cfg, inputs,
                                        args.temperature, args.repeats,
                                        args.group, dependent, keep)
        except Exception as e:  # noqa: BLE001 -- a tile that does not build
          print(f"B={batch} {cfg}: {type(e).__name__}: {e}"[:300],
                flush=True)
          continue
        if ref_tokens is None:
          ref_tokens = tokens
        agree = tokens == ref_tokens
        row = dict(shape=shape.name, batch=batch, ms=ms,
                   default=cfg == default, tokens_agree=agree,
                   dependent_launch=dependent, l2_persist=keep,
                   # $JAX_MARKOV_MOSAIC_DEPENDENT_LAUNCH: whether a Mosaic
                   # bucket takes dependent launches too (change 62).
                   mosaic_dependent_launch=(
                       native_plan.mosaic_dependent_launch()),
                   config=dataclasses.asdict(ran))
        if ran != cfg:  # the hook ran another configuration than asked
          row["asked"] = dataclasses.asdict(cfg)
        rows.append(row)
        print(f"B={batch:4d} {ms:.4f} ms {'(table) ' if cfg == default else ''}"
              f"{'' if ran == cfg else f'(asked {cfg}, ran) '}"
              # At T > 0 another reduction order moves draws that sit on a
              # CDF boundary: expected; at T = 0 a difference is an error.
              f"{'' if agree else 'TOKENS DIFFER ' if args.temperature == 0 else '(tokens differ, T > 0) '}"
              f"dependent_launch={dependent} "
              f"{'l2_persist ' if keep else ''}{ran}", flush=True)
      if args.out:  # after every row: a sweep cut short keeps what it timed
        _write(args.out, shape, args.temperature, rows)
    if args.seed:
      seed_row("last")
      if args.out:
        _write(args.out, shape, args.temperature, rows)
    best = min((r for r in rows if r["batch"] == batch and "config" in r),
               key=lambda r: r["ms"])
    print(f"B={batch:4d} best {best['ms']:.4f} ms: {best['config']}",
          flush=True)
  return 0


def _write(path, shape, temperature, rows):
  with open(path, "w") as f:
    json.dump(dict(device=torch.cuda.get_device_name(), shape=shape.name,
                   temperature=temperature, rows=rows), f, indent=1)


if __name__ == "__main__":
  sys.exit(main())
