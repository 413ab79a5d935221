"""A draft as a fixed list of kernel launches per batch bucket (the native runtime).

For a bucket of Bp requests the plan is::

    draw_params                 spec buffers -> params, cache rows, anchors
    for s in 0 .. S-1:
      block_pass (step s)       base + bias -> cache rows; block statistics
      [select_pass (step s)]    statistics + one cache block -> token s

every launch reading and writing buffers at fixed addresses: the spec's
buffers, the scratch allocated here once for ``max_num_reqs``, and the base
logits of the call. The step index and the number of live requests are read
from small tables on the device (row s of ``steps``, row n of ``counts``), so
a captured graph replays with no host work and a plan never changes with n.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import torch

from jax_markov.kernels import tuning
from jax_markov.kernels.block_pass import block_pass, num_request_tiles
from jax_markov.kernels.draw_params import ParamsLayout, draw_params
from jax_markov.kernels.select_pass import select_pass
from torch_bridge import native

_JNP = {torch.float32: jnp.float32, torch.float16: jnp.float16,
        torch.bfloat16: jnp.bfloat16, torch.int32: jnp.int32}
ROW = 8  # int32 entries a table row: 32 bytes, the kernels' pointer alignment


@dataclasses.dataclass(frozen=True)
class DraftShape:
  """Everything a draft's kernels are compiled for, besides the bucket.

  Attributes:
    max_num_reqs: M, the state rows of the cache, temperature and seeds.
    steps: S.
    vocab: V, columns of the base logits and rows of proj.
    rank: R.
    vocab_in: rows of the embedding table.
    base_dtype, head_dtype, temperature_dtype: torch dtypes.
    words: (name, int32 words) of each integer buffer (idx, pos, seeds, ids,
      anchor_idx), as the kernels read them.
    layout: which integer buffers are int64 word pairs.
  """
  max_num_reqs: int
  steps: int
  vocab: int
  rank: int
  vocab_in: int
  base_dtype: torch.dtype
  head_dtype: torch.dtype
  temperature_dtype: torch.dtype
  words: tuple[tuple[str, int], ...]
  layout: ParamsLayout

  def describe(self) -> dict:
    return {k: str(v) for k, v in dataclasses.asdict(self).items()}


def config(bucket: int, vocab: int, rank: int) -> tuning.KernelConfig:
  """The table's fused configuration, run step by step."""
  cfg = tuning.choose("fused", bucket, vocab, rank, interpret=False)
  if cfg.select == "persistent":  # one launch with a barrier: not planned
    cfg = dataclasses.replace(cfg, select="tail", programs=0)
  return cfg


def num_blocks(vocab: int, cfg: tuning.KernelConfig) -> int:
  return -(-vocab // cfg.block_v)


def _spec(shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), _JNP.get(dtype, dtype))


def lower_bucket(shape: DraftShape, bucket: int,
                 ir_cache: native.IRCache) -> dict:
  """Lowers a bucket's kernels (no GPU needed).

  Returns:
    {"draw_params" | "block_pass" | "select_pass": (KernelIR, ttir path)};
    no select pass where the configuration draws in the block pass.
  """
  sh, bp = shape, bucket
  m, s, v, r = sh.max_num_reqs, sh.steps, sh.vocab, sh.rank
  cfg = config(bp, v, r)
  words = dict(sh.words)
  desc = {"shape": sh.describe(), "bucket": bp, "config": repr(cfg)}
  i32, f32 = jnp.int32, jnp.float32
  out = {}

  def params_fn(idx, pos, temp, seeds, ids, aidx, count):
    return draw_params(idx, pos, temp, seeds, ids, aidx, count, batch=bp,
                       steps=s, vocab_in=sh.vocab_in, layout=sh.layout)

  out["draw_params"] = ir_cache.get_or_lower(
      {**desc, "kernel": "draw_params"}, params_fn,
      _spec((words["idx"],), i32), _spec((words["pos"],), i32),
      _spec((m,), sh.temperature_dtype), _spec((words["seeds"],), i32),
      _spec((words["ids"],), i32), _spec((words["anchor_idx"],), i32),
      _spec((1,), i32))

  tail = cfg.select == "tail"
  kw = dict(config=cfg, num_steps=s, num_cache_rows=m * s)

  def block_fn(base, embed, proj, anchors, tokens, step, params, rows, cache,
               *counters):
    return block_pass(base, (embed, proj, anchors), step, params, rows, cache,
                      tokens, counters[0] if tail else None, **kw)

  specs = [_spec((bp * s, v), sh.base_dtype),
           _spec((sh.vocab_in, r), sh.head_dtype),
           _spec((v, r), sh.head_dtype), _spec((bp,), i32),
           _spec((bp * s,), i32), _spec((1,), i32), _spec((3, bp * s), f32),
           _spec((bp * s,), i32), _spec((m * s, v), f32)]
  if tail:
    specs.append(_spec((num_request_tiles(bp, cfg.block_b),), i32))
  out["block_pass"] = ir_cache.get_or_lower(
      {**desc, "kernel": "block_pass"}, block_fn, *specs)
  if not tail:
    nb = num_blocks(v, cfg)

    def select_fn(bmax, bsum, barg, cache, step, params, rows, tokens):
      return select_pass(bmax, bsum, barg, cache, step, params, rows, tokens,
                         config=cfg, num_steps=s)

    out["select_pass"] = ir_cache.get_or_lower(
        {**desc, "kernel": "select_pass"}, select_fn,
        _spec((bp, nb), f32), _spec((bp, nb), f32), _spec((bp, nb), i32),
        _spec((m * s, v), f32), _spec((1,), i32), _spec((3, bp * s), f32),
        _spec((bp * s,), i32), _spec((bp * s,), i32))
  return out


class DraftPlans:
  """The compiled kernels and the scratch of one :class:`DraftShape`."""

  def __init__(self, shape: DraftShape, buckets, device: torch.device,
               ir_cache: native.IRCache):
    self.shape = shape
    self.device = device
    self.ir_cache = ir_cache
    self.capability = torch.cuda.get_device_capability(device)
    m, s, v = shape.max_num_reqs, shape.steps, shape.vocab
    i32 = dict(dtype=torch.int32, device=device)
    # Tables read through a pointer to one row: step s, live requests n.
    self.steps = torch.zeros((s, ROW), **i32)
    self.steps[:, 0] = torch.arange(s, **i32)
    self.counts = torch.zeros((m + 1, ROW), **i32)
    self.counts[:, 0] = torch.arange(m + 1, **i32)
    # Scratch for the largest bucket; a bucket uses the leading part.
    nb_max = max(num_blocks(v, config(b, v, shape.rank)) for b in buckets)
    self.params = torch.empty(3 * m * s, dtype=torch.float32, device=device)
    self.cache_rows = torch.empty(m * s, **i32)
    self.anchors = torch.empty(m, **i32)
    self.tokens = torch.zeros(m * s, **i32)
    self.bmax = torch.empty(m * nb_max, dtype=torch.float32, device=device)
    self.bsum = torch.empty(m * nb_max, dtype=torch.float32, device=device)
    self.barg = torch.empty(m * nb_max, **i32)
    self.counters = torch.zeros(m, **i32)  # the tail select leaves them at 0
    self.pad = torch.zeros((m, s, v), dtype=shape.base_dtype, device=device)
    self._plans: dict[int, list[native.Launch]] = {}

  def plan(self, bucket: int) -> list[native.Launch]:
    """The launches of a draft of ``bucket`` requests (compiled once)."""
    launches = self._plans.get(bucket)
    if launches is None:
      launches = self._build(bucket)
      self._plans[bucket] = launches
    return launches

  def _build(self, bp: int) -> list[native.Launch]:
    try:
      return self._launches(bp)
    except native.BuildError:
      raise
    except Exception as e:  # pylint: disable=broad-except
      # Lowering, compiling or loading a kernel failed: the hook falls back.
      raise native.BuildError(f"bucket {bp}: {type(e).__name__}: {e}") from e

  def _launches(self, bp: int) -> list[native.Launch]:
    kernels = {
        name: (ir, native.compile_kernel(ir, path, self.capability))
        for name, (ir, path) in lower_bucket(self.shape, bp,
                                             self.ir_cache).items()}
    ptr = lambda t: t.data_ptr()
    params, rows, anchors, tokens = map(
        ptr, (self.params, self.cache_rows, self.anchors, self.tokens))
    stats = [ptr(self.bmax), ptr(self.bsum), ptr(self.barg)]
    ir, kernel = kernels["draw_params"]
    launches = [native.Launch(ir, kernel, [
        "idx", "pos", "temperature", "seeds", "ids", "anchor_idx", "count",
        params, rows, anchors])]
    block_ir, block_kernel = kernels["block_pass"]
    tail = "select_pass" not in kernels
    for step in range(self.shape.steps):
      step_ptr = ptr(self.steps[step])
      args = ["base", "embed", "proj", anchors, tokens, step_ptr, params,
              rows, "cache"]
      if tail:
        args += [ptr(self.counters), "cache", *stats, tokens,
                 ptr(self.counters)]
      else:
        args += ["cache", *stats]
      launches.append(native.Launch(block_ir, block_kernel, args))
      if not tail:
        ir, kernel = kernels["select_pass"]
        launches.append(native.Launch(ir, kernel, [
            *stats, "cache", step_ptr, params, rows, tokens, tokens]))
    return launches
