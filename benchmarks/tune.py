"""Sweeps kernel configurations for one shape on a GPU; prints the best per batch.

  python benchmarks/tune.py --vocab 129280 --rank 256 --steps 7 --batches 1 64 256

The winners go into jax_markov/kernels/tuning.py's TABLE by hand (a committed
table: no search at call time). Times are medians of jitted calls timed to
block_until_ready, inputs rotated over 4 copies so proj/base do not sit in L2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import jax_markov as jm


def _time(fn, args_list, repeats):
  for a in args_list:
    jax.block_until_ready(fn(*a))
  ts = []
  for i in range(repeats):
    a = args_list[i % len(args_list)]
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*a))
    ts.append(time.perf_counter() - t0)
  return 1e3 * float(np.median(ts))


def candidates(batch):
  for v, w, st in itertools.product((128, 256, 512), (4, 8), (1, 3)):
    for bb in sorted({16, min(64, max(16, 1 << (batch - 1).bit_length()))}):
      yield jm.KernelConfig("fused", bb, v, 64, w, st)
  for v, w in itertools.product((1024, 2048, 4096), (4, 8)):
    yield jm.KernelConfig("reference", 1, v, 64, w, 1)


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--vocab", type=int, default=129280)
  p.add_argument("--rank", type=int, default=256)
  p.add_argument("--steps", type=int, default=7)
  p.add_argument("--batches", type=int, nargs="+", default=[1, 64, 256])
  p.add_argument("--repeats", type=int, default=40)
  p.add_argument("--out", default=None)
  a = p.parse_args(argv)
  rows = []
  V, R, S = a.vocab, a.rank, a.steps
  for B in a.batches:
    rng = np.random.default_rng(B)
    args_list = []
    for c in range(4):
      base = jnp.asarray(rng.standard_normal((B, S, V)), jnp.bfloat16)
      head = jm.MarkovHead(jnp.asarray(0.1 * rng.standard_normal((V, R)), jnp.bfloat16),
                           jnp.asarray(0.1 * rng.standard_normal((V, R)), jnp.bfloat16))
      anchor = jnp.asarray(rng.integers(0, V, B), jnp.int32)
      t = jnp.ones((B,), jnp.float32)
      words = jm.rng.seed_words(np.arange(B, dtype=np.int64) + c)
      pos = jnp.tile(jnp.arange(S, dtype=jnp.int32), (B, 1))
      args_list.append((base, anchor, head, t, words, pos))
    best = None
    for cfg in candidates(B):
      fn = lambda *x, cfg=cfg: jm.sample_draft(*x, config=cfg, check_values=False)
      try:
        ms = _time(fn, args_list, a.repeats)
      except Exception as e:  # a config Triton cannot compile (shared memory)
        print(f"B={B} {cfg}: failed {type(e).__name__}", file=sys.stderr, flush=True)
        continue
      rows.append(dict(batch=B, ms=ms, **cfg.__dict__))
      print(f"B={B:4d} {cfg.method:9s} bb={cfg.block_b:3d} bv={cfg.block_v:5d} "
            f"w={cfg.num_warps} st={cfg.num_stages}: {ms:.4f} ms", flush=True)
      if best is None or ms < best[0]:
        best = (ms, cfg)
    print(f"BEST B={B}: {best[0]:.4f} ms {best[1]}", flush=True)
    del args_list
  if a.out:
    with open(a.out, "w") as f:
      json.dump(rows, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
