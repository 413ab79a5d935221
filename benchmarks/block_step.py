"""Times one block pass step alone on a GPU: Triton against Mosaic GPU.

  python -m benchmarks.block_step --batches 64 256 --out step.json

Each variant runs a step ``--reps`` times inside one jitted fori_loop (the
cache carried and updated in place, the step index cycling through 0..S-1),
so the time per step is GPU time without the host's dispatch. Variants (the
DeepSeek-V4 shape, bf16):

* triton: the fused Triton block pass, the table's configuration, dense;
* triton_rows: the same with state rows (the native runtime's layout);
* mosaic: the Mosaic GPU pass, dense (a TMA store a [64, 64] tile);
* mosaic_rows: Mosaic GPU with state rows (row_stores="warp": one warp
  store a row through shared memory);
* mosaic_rows_tma: the same with row_stores="tma" (a TMA store a row);
* *_rows_id*: state rows, request b in slot b.

State rows (not _id) are a random permutation of the N = B slots, as a
serving engine's request slots can be. Statistics only: the select pass is
not run.

``--omit`` times the Mosaic GPU variants with stages left out ("mma",
"cache", "stats"; outputs then wrong), so that the differences place the
step's time without hardware counters (H200.md's advice where ncu cannot
read them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from jax_markov.kernels import block_pass as bp
from jax_markov.kernels import mosaic_block_pass as mbp
from jax_markov.kernels import tuning

VARIANTS = ("triton", "triton_rows", "triton_rows_id", "mosaic",
            "mosaic_rows", "mosaic_rows_id", "mosaic_rows_tma",
            "mosaic_rows_id_tma")


def _inputs(B, S, V, R, seed=0):
  rng = np.random.default_rng(seed)
  bf16 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)
  params = jnp.stack([jnp.ones(B * S, jnp.float32), jnp.zeros(B * S),
                      jnp.full(B * S, 0.5)])
  rows = np.repeat(rng.permutation(B)[:, None] * S, S, axis=1) + np.arange(S)
  return dict(rows_id=jnp.arange(B * S, dtype=jnp.int32),base=bf16(B * S, V), emb=bf16(B, R), embed=bf16(V, R),
              proj=bf16(V, R) * 0.05, params=params,
              anchors=jnp.asarray(rng.integers(0, V, B), jnp.int32),
              rows=jnp.asarray(rows.reshape(-1), jnp.int32))


def step_fn(variant, B, S, V, R, *, mosaic_cfg, triton_cfg, omit=(),
            base_slots=2, multicast=False, num_sms=None):
  """A jitted (inputs, cache, reps) -> (cache, statistics...) running the
  step reps times.

  The loop carries the cache and the last step's statistics: both are
  outputs, so that no stage's results are dead code (a kernel whose cache
  stores are omitted would otherwise be removed whole).
  """
  def one(x, carry, s):
    cache = carry[0]
    step = jnp.reshape(s % S, (1,)).astype(jnp.int32)
    if variant.startswith("triton"):
      rows = dict(triton_rows=x["rows"],
                  triton_rows_id=x["rows_id"]).get(variant)
      out = bp.block_pass(x["base"], (x["embed"], x["proj"], x["anchors"]),
                          step, x["params"], rows, cache, config=triton_cfg,
                          num_steps=S, num_cache_rows=B * S)
      return out
    rows = dict(mosaic_rows=x["rows"], mosaic_rows_id=x["rows_id"]).get(
        variant.removesuffix("_tma"))
    out = mbp.mosaic_block_pass(
        x["base"], x["emb"], x["proj"], x["params"], step, cache, rows,
        num_steps=S, block_b=mosaic_cfg.block_b, block_v=mosaic_cfg.block_v,
        max_concurrent_steps=(mosaic_cfg.num_stages
                              if mosaic_cfg.num_stages >= 2 else None),
        row_stores="tma" if variant.endswith("_tma") else "warp",
        _omit=tuple(omit), _base_slots=base_slots, _multicast=multicast,
        num_sms=num_sms, store_warpgroup=mosaic_cfg.store_warpgroup)
    return out

  def loop(x, cache, reps):
    first = one(x, (cache,), 0)
    return jax.lax.fori_loop(1, reps, lambda i, c: one(x, c, i), first)

  return jax.jit(loop, static_argnums=2, donate_argnums=1)


def time_variant(variant, B, *, S=7, V=129280, R=256, reps=50, repeats=5,
                 omit=(), base_slots=2, stages=None, multicast=False,
                 num_sms=None, block_b=None, block_v=None,
                 store_warpgroup=None):
  x = _inputs(B, S, V, R)
  omit = () if variant.startswith("triton") else tuple(omit)
  mosaic_cfg = tuning.choose("mosaic", B, V, R, interpret=False)
  if stages is not None:
    mosaic_cfg = dataclasses.replace(mosaic_cfg, num_stages=stages)
  if block_b is not None:
    mosaic_cfg = dataclasses.replace(mosaic_cfg, block_b=block_b)
  if block_v is not None:
    mosaic_cfg = dataclasses.replace(mosaic_cfg, block_v=block_v)
  if store_warpgroup is not None:
    mosaic_cfg = dataclasses.replace(mosaic_cfg,
                                     store_warpgroup=store_warpgroup)
  triton_cfg = tuning.choose("fused", B, V, R, interpret=False)
  fn = step_fn(variant, B, S, V, R, mosaic_cfg=mosaic_cfg,
               triton_cfg=triton_cfg, omit=omit, base_slots=base_slots,
               multicast=multicast, num_sms=num_sms)
  cache = jnp.zeros((B * S, V), jnp.float32)
  cache = fn(x, cache, reps)[0].block_until_ready()  # compile + warm
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    cache = fn(x, cache, reps)[0].block_until_ready()
    times.append((time.perf_counter() - t0) / reps * 1e6)
  cfg = triton_cfg if variant.startswith("triton") else mosaic_cfg
  return dict(variant=variant, batch=B, us_per_step=float(np.median(times)),
              us_min=float(np.min(times)), config=str(cfg), omit=list(omit),
              base_slots=base_slots, multicast=multicast, num_sms=num_sms)


def parser() -> argparse.ArgumentParser:
  """The command line (tests check the GPU queue's steps against it)."""
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
  ap.add_argument("--variants", nargs="+", default=list(VARIANTS),
                  choices=VARIANTS)
  ap.add_argument("--reps", type=int, default=50)
  ap.add_argument("--omit", nargs="*", default=[], choices=mbp.OMITTABLE,
                  help="Mosaic GPU variants only: stages to leave out")
  ap.add_argument("--base-slots", type=int, default=2,
                  help="Mosaic GPU variants: base tiles in flight")
  ap.add_argument("--stages", type=int, default=None,
                  help="Mosaic GPU variants: proj chunks in flight "
                  "(default: the table's)")
  ap.add_argument("--multicast", action="store_true",
                  help="Mosaic GPU variants: the request tiles as a cluster "
                  "sharing proj by TMA multicast")
  ap.add_argument("--block-b", type=int, default=None,
                  help="Mosaic GPU variants: requests a CTA (default: the "
                  "table's)")
  ap.add_argument("--block-v", type=int, default=None, choices=(64, 128),
                  help="Mosaic GPU variants: columns a statistics block "
                  "(default: the table's)")
  ap.add_argument("--store-warpgroup", choices=("on", "off"), default=None,
                  help="Mosaic GPU variants: cache rows stored by a fourth "
                  "warpgroup (default: the table's)")
  ap.add_argument("--num-sms", type=int, default=None,
                  help="Mosaic GPU variants: CTAs to aim for")
  ap.add_argument("--out", default=None)
  return ap


def main(argv=None):
  args = parser().parse_args(argv)
  ok, why = mbp.available()
  if not ok:
    print(f"block_step: needs a Hopper GPU ({why})", file=sys.stderr)
    return 2
  rows = []
  for B in args.batches:
    for v in args.variants:
      try:
        r = time_variant(v, B, reps=args.reps, omit=args.omit,
                         base_slots=args.base_slots, stages=args.stages,
                         multicast=args.multicast, num_sms=args.num_sms,
                         block_b=args.block_b, block_v=args.block_v,
                         store_warpgroup=(None if args.store_warpgroup is None
                                          else args.store_warpgroup == "on"))
      except Exception as e:  # pylint: disable=broad-except
        r = dict(variant=v, batch=B, error=f"{type(e).__name__}: {e}"[:300])
      print(json.dumps(r), flush=True)
      rows.append(r)
  if args.out:
    with open(args.out, "w") as f:
      json.dump(dict(device=str(jax.devices()[0]), rows=rows), f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
