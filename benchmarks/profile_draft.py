"""Runs a few drafts at one shape and batch: a target for Nsight Compute.

  ncu --clock-control none -k regex:markov --launch-skip 16 --launch-count 2 \
      --section SpeedOfLight --section LaunchStats --section Occupancy \
      python -m benchmarks.profile_draft --shape dsv4 --batch 256

The first draft compiles; with S = 7 the fused method launches 2 Pallas
kernels a step, so skipping 2 * S + 2 launches lands on step 1 of the second
draft (a step that reads the cache the step before wrote, as every later one
does). Uses the benchmark's synthetic inputs and the tuning table's config
unless one is given.
"""

from __future__ import annotations

import argparse
import os
import sys

import jax
import jax.numpy as jnp

import jax_markov as jm  # noqa: E402
from benchmarks import common  # noqa: E402
from jax_markov.kernels import tuning  # noqa: E402


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="dsv4", choices=sorted(common.SHAPES))
  p.add_argument("--batch", type=int, default=1)
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--method", default=None, choices=tuning.METHODS)
  p.add_argument("--drafts", type=int, default=3)
  a = p.parse_args(argv)
  shape = common.SHAPES[a.shape]
  d = common.jax_inputs(shape, a.batch, 0)
  head = jm.MarkovHead(d["embed"], d["proj"])
  seeds, positions = common.seeds_and_positions(a.batch, shape.S)
  words = jm.rng.seed_words(seeds)
  cfg = tuning.choose(a.method, a.batch, shape.V, shape.R, interpret=False)
  print(cfg, flush=True)
  temperature = jnp.full((a.batch,), a.temperature, jnp.float32)
  jax.block_until_ready(d)
  for _ in range(a.drafts):
    out = jm.sample_draft(d["base"], d["anchors"], head, temperature, words,
                          jnp.asarray(positions), config=cfg,
                          check_values=False)
    jax.block_until_ready(out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
