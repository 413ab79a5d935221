"""XLA command buffers per executable: wall and host issue time, round robin.

A draft is one jitted call of 10-20 kernels. XLA can record them into a CUDA
graph (a command buffer) and launch that instead of each kernel, which cuts
the host's work per call; at small B the host's work is of the order of the
GPU's (docs/perf-notes.md). The flags are XLA debug options; ``jax.jit``'s
``compiler_options`` sets them for one executable, so a library can choose
them without touching its caller's process-wide XLA_FLAGS.

This script compiles the sampler's jitted draft once per option set and times
the sets round robin in one process (host speed drifts between processes),
with the same inputs, checking that every set draws the same tokens:

    python -m benchmarks.command_buffers --batches 1 4 16 64 256

Per batch and option set: the median wall time per draft over groups of
``--group`` back-to-back calls (as the benchmark times it), and the median
host time to issue one call (no synchronisation inside the group).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import jax
import numpy as np

import jax_markov as jm  # noqa: E402
from benchmarks import common  # noqa: E402
from jax_markov.kernels import tuning  # noqa: E402

OPTION_SETS = {
    "default": {},
    "off": {"xla_gpu_enable_command_buffer": ""},
    "fusion+custom": {"xla_gpu_enable_command_buffer": "FUSION,CUSTOM_CALL",
                      "xla_gpu_graph_min_graph_size": 1},
    "all": {"xla_gpu_enable_command_buffer":
            "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL",
            "xla_gpu_graph_min_graph_size": 1},
}


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="dsv4", choices=sorted(common.SHAPES))
  p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--method", default=None)
  p.add_argument("--sets", nargs="+", default=list(OPTION_SETS),
                 choices=list(OPTION_SETS))
  p.add_argument("--rounds", type=int, default=20)
  p.add_argument("--group", type=int, default=5)
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  shape = common.SHAPES[a.shape]
  impl = jm.sampler._sample_draft.__wrapped__
  interpret = jax.default_backend() != "gpu"  # CPU: a smoke run only
  jits = {name: jax.jit(impl, static_argnames=("config", "interpret"),
                        compiler_options=OPTION_SETS[name] or None)
          for name in a.sets}
  rows = []
  for B in a.batches:
    draft = common.jax_draft(shape, B, a.temperature)
    cfg = tuning.choose(a.method, B, shape.V, shape.R, interpret=interpret)
    n_sets = len(draft.sets)

    def call(fn, k):
      return fn(*draft.args(k % n_sets), config=cfg, interpret=interpret)

    ref = {name: np.asarray(call(fn, 0).tokens) for name, fn in jits.items()}
    for name in jits:  # same kernels, same inputs: the same tokens
      if not np.array_equal(ref[name], ref[a.sets[0]]):
        raise AssertionError(f"B={B}: {name} drew other tokens than "
                             f"{a.sets[0]}")
    wall = {name: [] for name in jits}
    issue = {name: [] for name in jits}
    k = 0
    for name, fn in jits.items():  # clocks up, every executable loaded
      common.warm_up(lambda n, fn=fn: jax.block_until_ready(
          [call(fn, i) for i in range(n)]), 3, common.WARMUP_S)
    for _ in range(a.rounds):
      for name, fn in jits.items():
        out = None
        t0 = time.perf_counter()
        for _ in range(a.group):
          t1 = time.perf_counter()
          out = call(fn, k)
          issue[name].append((time.perf_counter() - t1) * 1e6)
          k += 1
        jax.block_until_ready(out)
        wall[name].append((time.perf_counter() - t0) * 1e3 / a.group)
    for name in jits:
      row = dict(shape=a.shape, batch=B, temperature=a.temperature,
                 option_set=name, options=OPTION_SETS[name],
                 config=str(cfg), ms=statistics.median(wall[name]),
                 issue_us=statistics.median(issue[name]))
      rows.append(row)
      print(f"B={B:4d} {name:14s} {row['ms']:.4f} ms/draft  issue "
            f"{row['issue_us']:6.1f} us/call", flush=True)
    if a.out:
      common.write_json(a.out, rows)
    del draft
  return 0


if __name__ == "__main__":
  sys.exit(main())
