"""Registers, shared memory and programs a multiprocessor of the block pass, on the CPU.

  python -m benchmarks.occupancy --batches 4 64
  python -m benchmarks.occupancy --batches 16 --set k_loop=static proj_l2_rows=57344

For each batch: the tuning table's fused configuration (or, with ``--set``,
that configuration with the fields given), as the native runtime builds its
block pass for a Hopper GPU (sm_90, dependent launch, the bucket of that
batch), lowered to Triton IR, compiled by triton to PTX, and assembled by
triton's ptxas for sm_90a. Prints the registers a thread, the shared memory
a program, the bytes a thread spills to local memory, the programs a
multiprocessor those leave (the smaller of the register and shared-memory
bounds), the grid's programs and its waves on
132 multiprocessors, and what the PTX carries of the L2 hints (loads and
stores with an evict_first / evict_last policy; ``cp.async`` copies, which
triton 3.6 emits without one). No GPU needed; needs triton with its ptxas.

Why: a tile that loses a program a multiprocessor loses a third of its
loads in flight, and a sweep on the GPU shows only the time. Two of
docs/perf-notes.md's results were read this way (change 54: kept rows
double the tile's shared memory; the pipelined proj loads drop their
hints). Occupancy is not time: a tile is chosen by tune_graph.py.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

from benchmarks import common
from benchmarks.kernel_digest import CAPABILITY, NUM_SMS, draft_shape
from benchmarks.tune_graph import table_entry
from jax_markov.kernels import tuning
from torch_bridge import native, native_plan

# sm_90 (H100, H200; 132 multiprocessors, NUM_SMS): a multiprocessor's
# 32-bit registers, allocated to a warp in units of 256; its shared memory,
# less 1 KB the driver reserves a program; its threads.
REGISTERS = 65536
REGISTER_UNIT = 256
SHARED_BYTES = 228 * 1024
SHARED_RESERVED = 1024
MAX_WARPS = 64


def parse_fields(items: list[str]) -> dict:
  """``name=value`` pairs as KernelConfig fields (Python literals, else
  strings: ``k_loop=static``)."""
  fields = {}
  names = {f.name for f in dataclasses.fields(tuning.KernelConfig)}
  for item in items:
    name, sep, value = item.partition("=")
    if not sep or name not in names:
      raise ValueError(f"--set takes KernelConfig field=value, got {item!r}")
    try:
      fields[name] = ast.literal_eval(value)
    except (ValueError, SyntaxError):
      fields[name] = value
  return fields


def programs_per_sm(registers: int, shared: int, warps: int) -> dict:
  """Programs a multiprocessor: by registers, by shared memory, and both."""
  per_warp = -(-registers * 32 // REGISTER_UNIT) * REGISTER_UNIT
  by_registers = REGISTERS // (per_warp * warps)
  by_shared = SHARED_BYTES // (shared + SHARED_RESERVED)
  return dict(by_registers=by_registers, by_shared=by_shared,
              programs=min(by_registers, by_shared, MAX_WARPS // warps))


def ptxas_usage(ptx: str, path: str) -> dict:
  """Registers a thread and the bytes a thread spills to local memory
  (stores, loads), by triton's own ptxas for sm_90a. A tile at the
  255-register ceiling may spill: its local-memory traffic goes through L1
  and L2 beside the tile's own."""
  import triton  # pylint: disable=g-import-not-at-top
  ptxas = os.path.join(os.path.dirname(triton.__file__), "backends",
                       "nvidia", "bin", "ptxas")
  with open(path, "w") as f:
    f.write(ptx)
  out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o",
                        os.devnull], capture_output=True, text=True,
                       check=True)
  return parse_ptxas(out.stderr)


def parse_ptxas(report: str) -> dict:
  """Registers and spill bytes a thread from ``ptxas -v``'s report."""
  spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                     report)
  return dict(
      registers=int(re.search(r"Used (\d+) registers", report).group(1)),
      spill_stores=int(spills.group(1)) if spills else 0,
      spill_loads=int(spills.group(2)) if spills else 0)


def l2_hints(ptx: str) -> dict:
  """Instructions of the PTX that carry an L2 policy, and cp.async copies."""
  lines = ptx.splitlines()
  return dict(
      evict_first=sum("createpolicy" in l and "evict_first" in l
                      for l in lines),
      evict_last=sum("createpolicy" in l and "evict_last" in l
                     for l in lines),
      hinted=sum("L2::cache_hint" in l for l in lines),
      cp_async=sum(l.lstrip().startswith("cp.async.") and "shared.global" in l
                   for l in lines))


def block_pass_occupancy(shape: common.Shape, batch: int,
                         cfg: tuning.KernelConfig, workdir: str) -> dict:
  """One row: the configuration's block pass (or persistent draft pass)
  compiled for sm_90a, as the native runtime builds it."""
  if not cfg.fused:
    raise ValueError("occupancy reads the Triton block pass (method "
                     f"'fused'), got method={cfg.method!r}")
  with table_entry(cfg, shape.V, shape.R, batch):
    kernels = native_plan.lower_bucket(
        draft_shape(shape, batch), batch, native.IRCache(workdir),
        CAPABILITY, num_sms=NUM_SMS, dependent_launch=True)
  name = "draft_pass" if "draft_pass" in kernels else "block_pass"
  ir, path, _ = kernels[name]
  compiled = native.compile_kernel(ir, path, CAPABILITY,
                                   launch_pdl=name == "block_pass")
  ptx = compiled.asm["ptx"]
  usage = ptxas_usage(ptx, os.path.join(workdir, f"{name}.ptx"))
  shared = compiled.metadata.shared
  occ = programs_per_sm(usage["registers"], shared, cfg.num_warps)
  programs = ir.grid[0] * ir.grid[1] * ir.grid[2]
  return dict(shape=shape.name, batch=batch, kernel=name, **usage,
              shared_bytes=shared, **occ,
              grid_programs=programs,
              waves=programs / (NUM_SMS * occ["programs"]),
              **l2_hints(ptx), config=dataclasses.asdict(cfg))


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shape", default="dsv4",
                 choices=sorted(k for k, v in common.SHAPES.items()
                                if v.Vd is None))
  p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64])
  p.add_argument("--set", nargs="*", default=[], metavar="FIELD=VALUE",
                 help="KernelConfig fields to replace in the table's "
                 "configuration (e.g. k_loop=static proj_l2_rows=57344)")
  p.add_argument("--out", default=None, help="also write the rows as JSON")
  args = p.parse_args(argv)
  try:
    import triton  # noqa: F401  pylint: disable=g-import-not-at-top,unused-import
  except ImportError:
    print("occupancy needs triton (it compiles and assembles the kernel)",
          file=sys.stderr)
    return 2
  shape = common.SHAPES[args.shape]
  fields = parse_fields(args.set)
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for batch in args.batches:
      cfg = tuning.choose("fused", batch, shape.V, shape.R, interpret=False)
      try:
        cfg = dataclasses.replace(cfg, **fields)
      except ValueError as e:  # --set made the table's entry invalid here
        print(f"B={batch:4d} skipped: {e}", flush=True)
        continue
      row = block_pass_occupancy(shape, batch, cfg,
                                 os.path.join(tmp, str(batch)))
      rows.append(row)
      print(f"B={batch:4d} {row['kernel']}: {row['registers']} registers "
            f"(spills: {row['spill_stores']} B stored, {row['spill_loads']} "
            f"B loaded a thread), "
            f"{row['shared_bytes'] // 1024} KB shared, {row['programs']} "
            f"programs/SM (registers {row['by_registers']}, shared "
            f"{row['by_shared']}), {row['grid_programs']} programs = "
            f"{row['waves']:.2f} waves; L2 policies evict_first "
            f"{row['evict_first']} evict_last {row['evict_last']}, hinted "
            f"{row['hinted']}, cp.async {row['cp_async']}; {cfg}",
            flush=True)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(shape=shape.name, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
