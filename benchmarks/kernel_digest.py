"""Digests of the Triton IR the native runtime launches, per bucket, on the CPU.

  python -m benchmarks.kernel_digest --batches 1 4 16 64
  git stash; python -m benchmarks.kernel_digest --out /tmp/before.json; ...

For each batch: the kernels of the tuning table's configuration for a GPU
(``--gpu``, default the H200: its per-GPU and Mosaic GPU entries) as the
native runtime lowers them (sm_90, 132 multiprocessors), with and without a
programmatic dependent launch; for each kernel, the SHA-1 of its IR text
(Triton's TTIR, which the lowering writes without source locations, or the
Mosaic GPU module printed without them) and its length. No GPU needed, and no triton: JAX
lowers.

Why: GPU time is scarce and a kernel change must pass ``pytest -m gpu``.
Where a change only adds an opt-in variant, the digests of the table's
kernels before and after it show whether the kernels that run by default
are still, text for text, the ones a GPU run tested (docs/perf-notes.md
change 55). Equal digests say the TTIR is the same; triton's later passes
and the GPU are the same too only for the same triton and JAX.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
import tempfile

import torch

from benchmarks import common
from jax_markov.kernels.draw_params import ParamsLayout
from torch_bridge import native, native_plan

# Self-contained beyond native_plan (no other benchmark module), so that the
# file can be copied into an older checkout to take its digests too.
NUM_SMS = 132  # H100 and H200
CAPABILITY = (9, 0)


def draft_shape(shape: common.Shape, batch: int) -> native_plan.DraftShape:
  """The native runtime's DraftShape of a benchmark shape at one batch:
  int32 index buffers, bf16, the full vocabulary, sampling."""
  if shape.Vd is not None:
    raise ValueError("reads the full-vocabulary kernels; "
                     f"{shape.name} has a reduced draft vocabulary")
  m, s = batch, shape.S
  words = (("idx", m * s), ("pos", 2 * m * s), ("seeds", 2 * m),
           ("ids", m * s + 4), ("anchor_idx", 2 * m))
  return native_plan.DraftShape(
      max_num_reqs=m, steps=s, vocab=shape.V, rank=shape.R,
      vocab_in=shape.V, base_dtype=torch.bfloat16,
      head_dtype=torch.bfloat16, temperature_dtype=torch.float32,
      words=words, layout=ParamsLayout(idx_wide=False, pos_wide=True))


def mosaic_text(module: bytes) -> str:
  """A serialized Mosaic GPU module as text without source locations (its
  bytecode carries them, so a line moved in any file would change it)."""
  # pylint: disable=g-import-not-at-top
  from jax._src.interpreters import mlir as jax_mlir
  from jax._src.lib.mlir import ir
  ctx = jax_mlir.make_ir_context()
  # Printed, not verified or run: the module's own dialect need not load.
  ctx.allow_unregistered_dialects = True
  with ctx:
    return ir.Module.parse(module).operation.get_asm(enable_debug_info=False)


def bucket_kernels(shape: common.Shape, batch: int, workdir: str, *,
                   gpu: str, dependent_launch: bool) -> dict:
  """native_plan.lower_bucket's kernels of one bucket for a GPU.

  gpu: the device name whose table entries to take (a Hopper GPU: the
  Mosaic GPU entries too); "": the table without per-GPU entries.
  """
  draft = dataclasses.replace(draft_shape(shape, batch), mosaic=bool(gpu),
                              gpu=gpu)
  return native_plan.lower_bucket(
      draft, batch, native.IRCache(workdir), CAPABILITY, num_sms=NUM_SMS,
      dependent_launch=dependent_launch)


def kernel_digests(shape: common.Shape, batch: int, workdir: str, *,
                   gpu: str, dependent_launch: bool) -> dict:
  """{kernel: (sha1 hex of its IR, bytes)} of one bucket (bucket_kernels)."""
  kernels = bucket_kernels(shape, batch, workdir, gpu=gpu,
                           dependent_launch=dependent_launch)
  out = {}
  for name, (ir, path, _) in sorted(kernels.items()):
    if path is None:  # Mosaic GPU: the module, printed without locations
      data = mosaic_text(ir.module).encode()
    else:
      with open(path, "rb") as f:
        data = f.read()
    out[name] = (hashlib.sha1(data).hexdigest(), len(data))
  return out


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--shape", default="dsv4",
                 choices=sorted(k for k, v in common.SHAPES.items()
                                if v.Vd is None))
  p.add_argument("--batches", type=int, nargs="+",
                 default=[1, 4, 16, 64, 128, 256])
  p.add_argument("--gpu", default="NVIDIA H200",
                 help="the device name whose table entries the buckets take "
                 "(a Hopper GPU: Mosaic entries too); '' for the table "
                 "without per-GPU entries")
  p.add_argument("--out", default=None, help="also write the digests as JSON")
  args = p.parse_args(argv)
  shape = common.SHAPES[args.shape]
  rows = []
  with tempfile.TemporaryDirectory() as tmp:
    for batch in args.batches:
      for dependent in (False, True):
        digests = kernel_digests(shape, batch, f"{tmp}/{batch}{dependent}",
                                 gpu=args.gpu, dependent_launch=dependent)
        for name, (digest, chars) in digests.items():
          rows.append(dict(batch=batch, dependent_launch=dependent,
                           kernel=name, sha1=digest, chars=chars))
          print(f"B={batch:4d} dependent_launch={dependent!s:5} "
                f"{name:18s} {digest[:12]} {chars}", flush=True)
  if args.out:
    with open(args.out, "w", encoding="utf-8") as f:
      json.dump(dict(shape=shape.name, gpu=args.gpu, rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
