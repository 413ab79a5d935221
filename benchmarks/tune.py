"""Sweeps kernel configurations for one shape on a GPU; prints the best per batch.

  python -m benchmarks.tune --shape dsv4 --batches 1 64 256 --out tune.json

The winners go into jax_markov/kernels/tuning.py's TABLE by hand (a committed
table: no search at call time). Inputs are the benchmark's synthetic ones
(benchmarks/common.py), rotated between calls when they would fit in L2, and
each configuration is timed as the benchmark times jax_markov: groups of calls
issued back to back, the host clock around each group, the median per call.
So a tuning time and a benchmark time of the same configuration agree.

``--inspect`` also prints what the compiled draft launches: the number of
Pallas kernels, other kernels (fusions, GEMMs) and command-buffer (CUDA
graph) regions in the optimised HLO, which shows what XLA_FLAGS changed.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import os
import re
import sys

import jax

import jax_markov as jm  # noqa: E402
from benchmarks import common  # noqa: E402
from jax_markov.kernels import tuning  # noqa: E402


def candidates(batch: int, grid: str, shape: common.Shape):
  """Configurations to try at a batch size ("full", "quick", "refine", "fma",
  "tail", "wide", "keep", "persistent").

  "refine" varies what "full" holds fixed (rank chunk, pipeline depth) over
  hand-picked tiles near the table's entries.
  """
  if grid == "fma":
    # The bias on the CUDA cores, one request a program (the 2D product
    # Triton lays out well), beside the table's current choice.
    yield tuning.choose(None, batch, shape.V, shape.R, interpret=False)
    for bv, bk, w, st in ((128, 64, 4, 3), (128, 64, 4, 4), (128, 32, 4, 4),
                          (128, 128, 4, 3), (64, 64, 4, 3), (64, 64, 2, 3),
                          (256, 32, 4, 3), (128, 64, 2, 3)):
      yield jm.KernelConfig(method="fused", block_b=1, block_v=bv, block_k=bk,
                            num_warps=w, num_stages=st, bias_dot="fma")
    return
  if grid == "tail":
    # One launch a step (the block pass's last program draws) against the
    # select pass, on the CUDA-core tiles the tail select needs.
    for bv, bk, w, st in ((128, 64, 4, 3), (128, 64, 4, 4), (64, 64, 4, 3),
                          (256, 64, 4, 3), (128, 32, 4, 4)):
      for select in ("pass", "tail"):
        yield jm.KernelConfig(method="fused", block_b=1, block_v=bv,
                              block_k=bk, num_warps=w, num_stages=st,
                              bias_dot="fma", select=select)
    return
  if grid == "wide":
    # 128-request tiles (less L2 traffic a logit: the proj block is re-read by
    # B / 128 programs instead of B / 64) with 8 warps, beside the table's tile.
    yield tuning.choose(None, batch, shape.V, shape.R, interpret=False)
    for bb, bv, bk, w, st in ((128, 128, 64, 8, 3), (128, 128, 64, 8, 2),
                              (128, 128, 32, 8, 4), (128, 128, 32, 8, 3),
                              (64, 128, 128, 4, 2), (64, 128, 64, 8, 3),
                              (256, 64, 32, 8, 3)):
      yield jm.KernelConfig(method="fused", block_b=min(bb, max(16, batch)),
                            block_v=bv, block_k=bk, num_warps=w,
                            num_stages=st)
    return
  if grid == "persistent":
    # The whole draft in one launch (kernels/draft_pass.py), one program a
    # multiprocessor split over the requests, beside the table's choice.
    yield tuning.choose(None, batch, shape.V, shape.R, interpret=False)
    for bv, bk, w, st in ((128, 64, 4, 3), (128, 64, 8, 3), (256, 64, 8, 3),
                          (256, 64, 8, 4), (256, 128, 8, 2), (512, 64, 16, 3),
                          (512, 32, 8, 4), (128, 128, 4, 2)):
      yield jm.KernelConfig(method="fused", block_b=1, block_v=bv, block_k=bk,
                            num_warps=w, num_stages=st, bias_dot="fma",
                            select="persistent")
    return
  if grid == "keep":
    # The table's tile with the first rows of proj kept in L2 across the
    # steps (evict_last; every other stream evict_first): 0 to all of it.
    table = tuning.choose(None, batch, shape.V, shape.R, interpret=False)
    row_bytes = shape.R * 2
    for mb in (0, 8, 16, 24, 32, 48, 64):
      yield dataclasses.replace(table, proj_l2_rows=mb * 2**20 // row_bytes,
                                early_proj=0, prefetch_proj=0,
                                prefetch_programs=0)
    return
  if grid == "refine":
    if batch <= 16:
      tiles = [(16, 128, 64, 8, 3), (16, 128, 128, 8, 2), (16, 256, 64, 8, 3),
               (16, 256, 128, 8, 2), (16, 512, 64, 8, 2), (16, 256, 64, 4, 3)]
    else:
      tiles = [(64, 128, 64, 4, 3), (64, 128, 64, 4, 2), (64, 128, 32, 4, 3),
               (64, 256, 32, 8, 3), (64, 256, 32, 8, 2), (64, 64, 64, 4, 3),
               (min(128, batch), 128, 32, 8, 3), (min(128, batch), 128, 64, 8, 2)]
    for bb, bv, bk, w, st in tiles:
      yield jm.KernelConfig(method="fused", block_b=bb, block_v=bv, block_k=bk,
                            num_warps=w, num_stages=st)
    return
  pipelines = [("fori", 3), ("fori", 4), ("static", 1)]
  if grid == "quick":
    pipelines = [("fori", 3), ("static", 1)]
  if batch <= 16:
    tiles = [(16, v) for v in (128, 256, 512)]
  else:
    tiles = [(bb, v) for bb in (32, 64) for v in (128, 256)]
    if batch >= 128:
      tiles.append((128, 64))
  for (bb, v), w, (loop, st) in itertools.product(tiles, (4, 8), pipelines):
    yield jm.KernelConfig(method="fused", block_b=bb, block_v=v, block_k=64,
                          num_warps=w, num_stages=st, k_loop=loop)
  for v, w in itertools.product((1024, 4096), (4, 8)):
    yield jm.KernelConfig(method="xla_bias", block_b=1, block_v=v, block_k=64,
                          num_warps=w, num_stages=1)


def launch_counts(fn, *args, **kwargs) -> dict:
  """Kernels the compiled function launches, read off its optimised HLO."""
  text = fn.lower(*args, **kwargs).compile().as_text()
  return dict(
      pallas=len(re.findall(r"custom_call_target=\"__gpu\$xla\.gpu\.triton\"",
                            text)),
      fusions=len(re.findall(r" fusion\(.*kind=k", text)),
      gemms=len(re.findall(r"custom_call_target=\"__cublas", text)),
      command_buffers=len(re.findall(r"command_buffer", text)),
  )


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="dsv4", choices=sorted(common.SHAPES))
  p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--repeats", type=int, default=60)
  p.add_argument("--group", type=int, default=5)
  p.add_argument("--grid", choices=("full", "quick", "refine", "fma", "tail",
                                       "wide", "keep", "persistent"),
                 default="full")
  p.add_argument("--only-default", action="store_true",
                 help="time the table's choice only (e.g. to compare XLA_FLAGS)")
  p.add_argument("--inspect", action="store_true")
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  shape = common.SHAPES[a.shape]
  rows = []
  for B in a.batches:
    draft = common.jax_draft(shape, B, a.temperature)
    cfgs = ([tuning.choose(None, B, shape.V, shape.R, interpret=False)]
            if a.only_default else list(candidates(B, a.grid, shape)))
    best = None
    for cfg in cfgs:
      run = common.round_robin(draft.calls(cfg), finish=jax.block_until_ready)
      try:
        # Clocks up before each config, not only the first one timed.
        common.warm_up(run, 3, common.WARMUP_S)
        ms, _ = common.wall_clock_median(run, a.repeats, a.group)
      except Exception as e:  # noqa: BLE001 -- a config Triton cannot build
        print(f"B={B} {cfg}: failed {type(e).__name__}: {str(e)[:200]}",
              file=sys.stderr, flush=True)
        continue
      row = dict(shape=a.shape, batch=B, temperature=a.temperature, ms=ms,
                 xla_flags=os.environ.get("XLA_FLAGS", ""),
                 **dataclasses.asdict(cfg))
      if a.inspect:
        row["launches"] = launch_counts(
            jm.sampler._sample_draft, *draft.args(), config=cfg,
            interpret=jax.default_backend() != "gpu")
      rows.append(row)
      print(f"B={B:4d} {cfg.method:9s} bb={cfg.block_b:3d} bv={cfg.block_v:5d} "
            f"bk={cfg.block_k:3d} w={cfg.num_warps} st={cfg.num_stages} "
            f"sw={cfg.select_warps} {cfg.k_loop:6s} {cfg.bias_dot} {cfg.select} "
            f"l2={cfg.proj_l2_rows}: "
            f"{ms:.4f} ms {row.get('launches', '')}", flush=True)
      if best is None or ms < best[0]:
        best = (ms, cfg)
    if best:
      print(f"BEST B={B}: {best[0]:.4f} ms {best[1]}", flush=True)
    if a.out:  # after each batch: a run cut short keeps what it measured
      common.write_json(a.out, rows)
    del draft
  return 0


if __name__ == "__main__":
  sys.exit(main())
