"""A draft as a fixed list of kernel launches per batch bucket (the native runtime).

For a bucket of Bp requests the plan is::

    draw_params                 spec buffers -> params, cache rows, anchors
    for s in 0 .. S-1:
      block_pass (step s)       base + bias -> cache rows; block statistics
      [select_pass (step s)]    statistics + one cache block -> token s

or, where the table picks the Mosaic GPU block pass (``DraftShape.mosaic``:
a Hopper GPU, bf16, no map, sampling; kernels/mosaic_block_pass.py),
``embed_rows`` (the previous tokens' embeddings), ``mosaic_block_pass``
(which with 128-request tiles also reduces its block-major statistics over
chunks of blocks; else a ``chunk_pass`` follows it) and ``select_pass`` a
step (with ``select_embed`` the select pass writes the next step's
embeddings and ``embed_rows`` runs at step 0 only), the Mosaic kernel
launched by :mod:`torch_bridge.mosaic_launch` on the same stream;

every launch reading and writing buffers at fixed addresses: the spec's
buffers, the scratch allocated here once for ``max_num_reqs``, and the base
logits of the call. The step index and the number of live requests are read
from small tables on the device (row s of ``steps``, row n of ``counts``), so
a captured graph replays with no host work and a plan never changes with n.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import torch

from jax_markov.kernels import dependent_launch
from jax_markov.kernels import tuning
from jax_markov.kernels import block_pass as block_pass_module
from jax_markov.kernels import draft_pass as draft_pass_module
from jax_markov.kernels import embed_rows as embed_rows_module
from jax_markov.kernels import chunk_pass as chunk_pass_module
from jax_markov.kernels import mosaic_block_pass as mosaic_module
from jax_markov.kernels import select_pass as select_pass_module
from jax_markov.kernels.block_pass import block_pass, num_request_tiles
from jax_markov.kernels.draft_pass import draft_pass
from jax_markov.kernels.draw_params import ParamsLayout, draw_params
from jax_markov.kernels.select_pass import select_pass
from torch_bridge import mosaic_launch
from torch_bridge import native

_JNP = {torch.float32: jnp.float32, torch.float16: jnp.float16,
        torch.bfloat16: jnp.bfloat16, torch.int32: jnp.int32}
ROW = 8  # int32 entries a table row: 32 bytes, the kernels' pointer alignment
# The kernels of a step-by-step draft built for, and launched as,
# programmatic dependent launches (jax_markov.kernels.dependent_launch): each
# starts while the one before it finishes, and waits before reading what it
# wrote.
DEPENDENT_LAUNCH_KERNELS = ("draw_params", "block_pass", "select_pass")
# The kernels launched once a step (the rest once a draft).
_STEP_KERNELS = ("embed_rows", "block_pass", "mosaic_block_pass",
                 "chunk_pass", "select_pass")


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
    draft_vocab: Vd with a reduced draft vocabulary (the base logits and proj
      have Vd columns / rows; sampling walks the V target columns with
      ``slots`` int32 [V], greedy drafting the Vd draft columns with the
      increasing ``columns`` int32 [Vd]), else None (Vd = V, no map).
    greedy: greedy drafting: tokens only, no cache (vLLM's draft_logits None).
    mosaic: the GPU can run the Mosaic GPU block pass (see
      :func:`mosaic_allowed`); the table then picks it where it has an
      entry (:func:`shape_config`).
    gpu: the device's name, for the table's per-GPU entries
      (tuning.GPU_TABLE); "" for none.
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
  draft_vocab: int | None = None
  greedy: bool = False
  mosaic: bool = False
  gpu: str = ""

  @property
  def vd(self) -> int:
    """Columns of the base logits and rows of proj (the draft vocabulary)."""
    return self.vocab if self.draft_vocab is None else self.draft_vocab

  @property
  def mapped(self) -> bool:
    """A reduced draft vocabulary (Vd < V, or a map with Vd == V)."""
    return self.draft_vocab is not None

  @property
  def grid_vocab(self) -> int:
    """The block pass's columns: V when sampling (with a map, the target
    columns), Vd when drafting greedily."""
    return self.vd if self.greedy else self.vocab

  def describe(self) -> dict:
    return {k: str(v) for k, v in dataclasses.asdict(self).items()}


def use_dependent_launch(asked: bool | None,
                         capability: tuple[int, int]) -> bool:
  """Whether the plans may use programmatic dependent launches: ``asked``,
  or (None) $JAX_MARKOV_DEPENDENT_LAUNCH ("1" or "0") where it is set, else
  wherever the GPU has them (compute capability 9.0 or newer). Which buckets
  use them: :func:`bucket_dependent_launch`. Raises ValueError where asked
  for (argument or variable) on a GPU below sm_90."""
  supported = tuple(capability) >= dependent_launch.MIN_CAPABILITY
  if asked is None:
    env = os.environ.get("JAX_MARKOV_DEPENDENT_LAUNCH")
    if env is None:
      return supported
    if env not in ("0", "1"):
      raise ValueError("JAX_MARKOV_DEPENDENT_LAUNCH must be '0' or '1', got "
                       f"{env!r}")
    asked = env == "1"
  if asked and not supported:
    raise ValueError("dependent_launch=True needs compute capability "
                     f"{dependent_launch.MIN_CAPABILITY} or newer, this GPU "
                     f"has {tuple(capability)}")
  return bool(asked)


def mosaic_dependent_launch() -> bool:
  """Whether Mosaic GPU buckets take dependent launches too (where
  :func:`bucket_dependent_launch` is enabled): $JAX_MARKOV_MOSAIC_DEPENDENT_
  LAUNCH="1". Off by default: built and checked on the CPU in session 35,
  not yet run on a GPU (docs/perf-notes.md change 62). Raises ValueError
  for a value other than "0" or "1"."""
  env = os.environ.get("JAX_MARKOV_MOSAIC_DEPENDENT_LAUNCH", "0")
  if env not in ("0", "1"):
    raise ValueError("JAX_MARKOV_MOSAIC_DEPENDENT_LAUNCH must be '0' or "
                     f"'1', got {env!r}")
  return env == "1"


def bucket_dependent_launch(shape: "DraftShape", bucket: int,
                            enabled: bool) -> bool:
  """Whether a bucket's kernels are built and launched as dependent
  launches: where enabled and the bucket runs the select pass. Not with the
  tail select (the table's choice at B = 1): measured 10% slower there at
  the DeepSeek-V4 shape (docs/perf-notes.md change 32); not for the
  persistent draft (one launch, after a memset). A Mosaic GPU bucket only
  where :func:`mosaic_dependent_launch` opts in: its block pass is
  launched by its own host code, which sets no launch attribute, so a
  capture gives it a programmatic edge from the select pass before it
  instead (mosaic_launch.programmatic_dependency); its embed_rows and
  chunk pass launch plainly."""
  cfg = shape_config(shape, bucket)
  return (enabled and cfg.select == "pass"
          and (cfg.method != "mosaic" or mosaic_dependent_launch()))


def mosaic_allowed(capability: tuple[int, int],
                   asked: bool | None = None) -> bool:
  """Whether plans may use the Mosaic GPU block pass (where the tuning table
  picks it): on a Hopper GPU (sm_90: WGMMA) with Pallas Mosaic GPU
  importable, unless turned off (``asked`` False, or with None
  $JAX_MARKOV_MOSAIC=0). On by default since its state-row stores go one
  warp store a row (docs/perf-notes.md change 36: the DeepSeek-V4 draft at
  B = 256 0.69 ms against the Triton pass's 0.82 on an H200). Raises
  ValueError where asked for (argument True) on a GPU or a JAX that cannot
  run it."""
  supported = (tuple(capability) == (9, 0)
               and mosaic_module.plgpu is not None)
  if asked is None:
    env = os.environ.get("JAX_MARKOV_MOSAIC")
    if env not in (None, "0", "1"):
      raise ValueError(f"JAX_MARKOV_MOSAIC must be '0' or '1', got {env!r}")
    return env != "0" and supported
  if asked and not supported:
    raise ValueError(
        "mosaic=True needs a Hopper GPU (compute capability 9.0) and Pallas "
        f"Mosaic GPU; this GPU has {tuple(capability)}"
        + ("" if mosaic_module.plgpu is not None else
           f", and Mosaic GPU is not importable ({mosaic_module._IMPORT_ERROR})"))  # pylint: disable=protected-access
  return bool(asked)


def config(bucket: int, vocab: int, rank: int, *,
           stepwise: bool = False) -> tuning.KernelConfig:
  """The table's fused configuration; ``stepwise`` (a reduced vocabulary,
  greedy drafting): run step by step, as the sampler runs it."""
  cfg = tuning.choose("fused", bucket, vocab, rank, interpret=False)
  return tuning.stepwise(cfg) if stepwise else cfg


def shape_config(shape: DraftShape, bucket: int) -> tuning.KernelConfig:
  """The configuration a bucket of ``shape`` runs: the table's Mosaic GPU
  entry where the shape allows it (sampling the full vocabulary in bf16 on
  a Hopper GPU), else its fused one."""
  if (shape.mosaic and not shape.mapped and not shape.greedy
      and shape.base_dtype == torch.bfloat16
      and shape.head_dtype == torch.bfloat16):
    cfg = tuning.choose(None, bucket, shape.vocab, shape.rank,
                        interpret=False, hopper=True, gpu=shape.gpu or None)
    if cfg.method == "mosaic":
      return cfg
  return config(bucket, shape.grid_vocab, shape.rank,
                stepwise=shape.mapped or shape.greedy)


def stat_rows(shape: DraftShape, bucket: int) -> int:
  """Rows of the block statistics: one a request (step by step, reused
  every step) or one a draw (the persistent draft)."""
  persistent = shape_config(shape, bucket).select == "persistent"
  return bucket * shape.steps if persistent else bucket


def num_blocks(vocab: int, cfg: tuning.KernelConfig) -> int:
  return -(-vocab // cfg.block_v)


def held_proj_rows(shape: DraftShape, bucket: int, num_sms: int) -> int:
  """The leading rows of proj a bucket's draft loads once and keeps on chip
  (the persistent draft's held blocks: P programs x held_blocks x block_v);
  the rest streams every step. 0 step by step."""
  cfg = shape_config(shape, bucket)
  if cfg.select != "persistent":
    return 0
  programs = draft_pass_module.num_programs(cfg, interpret=False,
                                            num_sms=num_sms)
  held = min(cfg.held_blocks,
             num_blocks(shape.grid_vocab, cfg) // programs)
  return min(held * programs * cfg.block_v, shape.vd)


def l2_window_rows(shape: DraftShape, bucket: int,
                   num_sms: int) -> tuple[int, int]:
  """(first row, rows) of proj that the hook's l2_persist window covers for
  a bucket: the rows its kernel already asks L2 to keep (proj_l2_rows, with
  evict_last hints, and the rest evict_first: B = 1's tail select), else
  every row it streams every step (all of them, less the persistent
  draft's held rows)."""
  cfg = shape_config(shape, bucket)
  if cfg.proj_l2_rows:
    return 0, min(cfg.proj_l2_rows, shape.vd)
  held = held_proj_rows(shape, bucket, num_sms)
  return held, shape.vd - held


def _spec(shape, dtype) -> jax.ShapeDtypeStruct:
  return jax.ShapeDtypeStruct(tuple(shape), _JNP.get(dtype, dtype))


def _lower(ir_cache, description, call, specs: dict, capability):
  """Lowers ``call(**arrays)`` for the named operand specs."""
  names = list(specs)
  return ir_cache.get_or_lower(
      description, lambda *arrays: call(**dict(zip(names, arrays))),
      *specs.values(), capability=capability)


def operands(inputs, outputs, given_in, given_out) -> list[str]:
  """A kernel's operand names in pallas_call order: given inputs, outputs."""
  return ([n for n in inputs if n in given_in] +
          [n for n in outputs if n in given_out])


def lower_bucket(shape: DraftShape, bucket: int, ir_cache: native.IRCache,
                 capability: tuple[int, int] | None = None,
                 num_sms: int | None = None,
                 dependent_launch: bool = False) -> dict:
  """Lowers a bucket's kernels (no GPU needed) for a CUDA capability.

  num_sms: the GPU's multiprocessors, which size the persistent draft's
  grid (needed where the table picks it).
  dependent_launch: build draw_params and the block and select passes for
  a programmatic dependent launch (see :data:`DEPENDENT_LAUNCH_KERNELS`;
  sm_90 or newer) where :func:`bucket_dependent_launch` says the bucket
  uses them.

  Returns:
    {kernel: (KernelIR, ttir path, operand names)} for "draw_params" and
    either "draft_pass" (the persistent draft), "block_pass" and
    "select_pass" (unless the block pass draws, tail), or (Mosaic GPU)
    "embed_rows", "mosaic_block_pass", "chunk_pass" and "select_pass".
  """
  sh, bp = shape, bucket
  dependent_launch = bucket_dependent_launch(sh, bp, dependent_launch)
  m, s, v, vd, r = sh.max_num_reqs, sh.steps, sh.vocab, sh.vd, sh.rank
  grid = sh.grid_vocab
  cfg = shape_config(sh, bp)
  words = dict(sh.words)
  desc = {"shape": sh.describe(), "bucket": bp, "config": repr(cfg),
          "dependent_launch": dependent_launch}
  if cfg.select == "persistent":
    desc["num_sms"] = num_sms
  i32, f32 = jnp.int32, jnp.float32
  out = {}

  def params_call(idx, pos, temperature, seeds, ids, anchor_idx, count):
    return draw_params(idx, pos, temperature, seeds, ids, anchor_idx, count,
                       batch=bp, steps=s, vocab_in=sh.vocab_in,
                       layout=sh.layout, dependent_launch=dependent_launch)

  specs = dict(idx=_spec((words["idx"],), i32), pos=_spec((words["pos"],), i32),
               temperature=_spec((m,), sh.temperature_dtype),
               seeds=_spec((words["seeds"],), i32),
               ids=_spec((words["ids"],), i32),
               anchor_idx=_spec((words["anchor_idx"],), i32),
               count=_spec((1,), i32))
  out["draw_params"] = (*_lower(ir_cache, {**desc, "kernel": "draw_params"},
                                params_call, specs, capability),
                        [*specs, "params", "cache_rows", "anchors"])

  cache_spec = _spec((m * s, v), f32)
  if cfg.select == "persistent":
    def draft_call(base, embed, proj, anchors, params, cache_rows, cache,
                   counters):
      del counters  # made by draft_pass; the runtime zeroes its own
      return draft_pass(base, embed, proj, anchors, params, cache_rows, cache,
                        config=cfg, num_steps=s, num_cache_rows=m * s,
                        num_sms=num_sms)

    specs = dict(base=_spec((bp * s, v), sh.base_dtype),
                 embed=_spec((sh.vocab_in, r), sh.head_dtype),
                 proj=_spec((v, r), sh.head_dtype), anchors=_spec((bp,), i32),
                 params=_spec((3, bp * s), f32),
                 cache_rows=_spec((bp * s,), i32), cache=cache_spec,
                 counters=_spec((draft_pass_module.NUM_COUNTERS,), i32))
    out["draft_pass"] = (
        *_lower(ir_cache, {**desc, "kernel": "draft_pass"}, draft_call, specs,
                capability),
        operands(draft_pass_module.INPUTS, draft_pass_module.OUTPUTS, specs,
                 draft_pass_module.OUTPUTS))
    return out
  if cfg.method == "mosaic":
    out.update(_lower_mosaic(sh, bp, ir_cache, capability, cfg, desc,
                             num_sms, dependent_launch))
    return out
  tail = cfg.select == "tail"
  # The map: sampling walks the target columns by slot, greedy drafting
  # the draft columns (tokens mapped by columns in the select).
  column_map = {}
  if sh.mapped:
    column_map = (dict(columns=_spec((vd,), i32)) if sh.greedy
                  else dict(slots=_spec((v,), i32)))
  kw = dict(config=cfg, num_steps=s, num_cache_rows=m * s,
            no_cache=sh.greedy, dependent_launch=dependent_launch)

  def block_call(base, embed, proj, anchors, tokens, step, params=None,
                 cache_rows=None, cache=None, counters=None, columns=None,
                 slots=None):
    return block_pass(base, (embed, proj, anchors), step, params, cache_rows,
                      cache, tokens, counters, columns=columns, slots=slots,
                      **kw)

  specs = dict(base=_spec((bp * s, vd), sh.base_dtype),
               embed=_spec((sh.vocab_in, r), sh.head_dtype),
               proj=_spec((vd, r), sh.head_dtype), anchors=_spec((bp,), i32),
               tokens=_spec((bp * s,), i32), step=_spec((1,), i32))
  if not sh.greedy:
    specs.update(params=_spec((3, bp * s), f32),
                 cache_rows=_spec((bp * s,), i32), cache=cache_spec)
  if tail:
    specs["counters"] = _spec((num_request_tiles(bp, cfg.block_b),), i32)
  specs.update(column_map)
  outs = {"block_max", "block_argmax"} | (
      set() if sh.greedy else {"cache", "block_sum"}) | (
          {"tokens", "counters"} if tail else set())
  out["block_pass"] = (
      *_lower(ir_cache, {**desc, "kernel": "block_pass"}, block_call, specs,
              capability),
      operands(block_pass_module.INPUTS, block_pass_module.OUTPUTS, specs,
               outs))
  if not tail:
    nb = num_blocks(grid, cfg)

    def select_call(block_max, block_argmax, step, tokens, block_sum=None,
                    cache=None, params=None, cache_rows=None, columns=None):
      return select_pass(block_max, block_sum, block_argmax, cache, step,
                         params, cache_rows, tokens, config=cfg, num_steps=s,
                         columns=columns, vocab=grid, no_cache=sh.greedy,
                         dependent_launch=dependent_launch)

    specs = dict(block_max=_spec((bp, nb), f32),
                 block_argmax=_spec((bp, nb), i32), step=_spec((1,), i32),
                 tokens=_spec((bp * s,), i32))
    if not sh.greedy:
      specs.update(block_sum=_spec((bp, nb), f32), cache=cache_spec,
                   params=_spec((3, bp * s), f32),
                   cache_rows=_spec((bp * s,), i32))
    if sh.greedy:
      specs.update(column_map)
    out["select_pass"] = (
        *_lower(ir_cache, {**desc, "kernel": "select_pass"}, select_call,
                specs, capability),
        operands(select_pass_module.INPUTS, select_pass_module.OUTPUTS,
                 specs, ("tokens",)))
  return out


def _lower_mosaic(sh: DraftShape, bp: int, ir_cache: native.IRCache,
                  capability, cfg: tuning.KernelConfig, desc: dict,
                  num_sms: int | None, dependent_launch: bool = False) -> dict:
  """embed_rows (Triton), mosaic_block_pass (Mosaic GPU: a MosaicIR, no
  Triton path) and the select pass on block-major statistics; with
  dependent_launch the block and select passes are built for dependent
  launches (embed_rows and the chunk pass are not)."""
  m, s, v, r = sh.max_num_reqs, sh.steps, sh.vocab, sh.rank
  i32, f32 = jnp.int32, jnp.float32
  out = {}

  def rows_call(embed, anchors, tokens, step):
    return embed_rows_module.embed_rows(embed, anchors, tokens, step,
                                        num_steps=s)

  specs = dict(embed=_spec((sh.vocab_in, r), sh.head_dtype),
               anchors=_spec((bp,), i32), tokens=_spec((bp * s,), i32),
               step=_spec((1,), i32))
  out["embed_rows"] = (
      *_lower(ir_cache, {**desc, "kernel": "embed_rows"}, rows_call, specs,
              capability),
      operands(embed_rows_module.INPUTS, embed_rows_module.OUTPUTS, specs,
               embed_rows_module.OUTPUTS))

  specs = dict(base=_spec((bp * s, v), sh.base_dtype),
               emb=_spec((bp, r), sh.head_dtype),
               proj=_spec((v, r), sh.head_dtype),
               params=_spec((3, bp * s), f32), step=_spec((1,), i32),
               cache=_spec((m * s, v), f32), cache_rows=_spec((bp * s,), i32))

  fold = mosaic_module.epilogue_chunk(cfg, bp, v, num_sms)

  def block_call(base, emb, proj, params, step, cache, cache_rows):
    return mosaic_module.mosaic_block_pass(
        base, emb, proj, params, step, cache, cache_rows, num_steps=s,
        num_cache_rows=m * s, block_b=cfg.block_b, block_v=cfg.block_v,
        max_concurrent_steps=cfg.num_stages if cfg.num_stages >= 2 else None,
        num_sms=num_sms, chunk=fold, store_warpgroup=cfg.store_warpgroup,
        dependent_launch=dependent_launch)

  ir = mosaic_launch.lower(block_call, *specs.values(),
                           name="mosaic_block_pass")
  names = list(specs)
  results = ["block_max", "block_sum", "block_argmax"]
  if fold is not None:
    results += list(chunk_pass_module.OUTPUTS)
  results.append("cache")
  out["mosaic_block_pass"] = (
      ir, None, [names[i] for i in ir.operands] + [
          results[k] if alias is None else names[ir.operands[alias]]
          for k, alias in enumerate(ir.results)])

  nb = num_blocks(v, cfg)
  chunk = fold or chunk_pass_module.CHUNK
  nc = chunk_pass_module.num_chunks(nb, chunk)
  if fold is None:
    def chunk_call(block_max, block_sum, block_argmax):
      return chunk_pass_module.chunk_pass(block_max, block_sum, block_argmax)

    specs = dict(block_max=_spec((nb, bp), f32),
                 block_sum=_spec((nb, bp), f32),
                 block_argmax=_spec((nb, bp), i32))
    out["chunk_pass"] = (
        *_lower(ir_cache, {**desc, "kernel": "chunk_pass"}, chunk_call, specs,
                capability),
        operands(chunk_pass_module.INPUTS, chunk_pass_module.OUTPUTS, specs,
                 chunk_pass_module.OUTPUTS))

  def select_call(block_max, block_sum, block_argmax, cache, step, params,
                  cache_rows, tokens, chunk_max, chunk_sum, chunk_argmax,
                  embed=None, emb=None):
    return select_pass(block_max, block_sum, block_argmax, cache, step,
                       params, cache_rows, tokens, config=cfg, num_steps=s,
                       vocab=v, stats_major="block",
                       chunk_stats=(chunk_max, chunk_sum, chunk_argmax),
                       chunk=chunk, embed=embed, emb=emb,
                       dependent_launch=dependent_launch)

  specs = dict(block_max=_spec((nb, bp), f32), block_sum=_spec((nb, bp), f32),
               block_argmax=_spec((nb, bp), i32), cache=_spec((m * s, v), f32),
               step=_spec((1,), i32), params=_spec((3, bp * s), f32),
               cache_rows=_spec((bp * s,), i32), tokens=_spec((bp * s,), i32),
               chunk_max=_spec((nc, bp), f32), chunk_sum=_spec((nc, bp), f32),
               chunk_argmax=_spec((nc, bp), i32))
  updated = ("tokens",)
  if cfg.select_embed:
    # The select writes the next step's embeddings (embed_rows then runs
    # at step 0 only: _launches).
    specs.update(embed=_spec((sh.vocab_in, r), sh.head_dtype),
                 emb=_spec((bp, r), sh.head_dtype))
    updated = ("tokens", "emb")
  out["select_pass"] = (
      *_lower(ir_cache, {**desc, "kernel": "select_pass"}, select_call, specs,
              capability),
      operands(select_pass_module.INPUTS, select_pass_module.OUTPUTS, specs,
               updated))
  return out


def mosaic_chunks(vocab: int, cfg: tuning.KernelConfig, bp: int,
                  num_sms: int | None) -> int:
  """NC, the chunk statistics' rows of a Mosaic GPU bucket."""
  nb = num_blocks(vocab, cfg)
  fold = mosaic_module.epilogue_chunk(cfg, bp, vocab, num_sms)
  return chunk_pass_module.num_chunks(nb, fold or chunk_pass_module.CHUNK)


class DraftPlans:
  """The compiled kernels and the scratch of one :class:`DraftShape`."""

  def __init__(self, shape: DraftShape, buckets, device: torch.device,
               ir_cache: native.IRCache,
               dependent_launch: bool | None = None):
    self.shape = shape
    self.device = device
    self.ir_cache = ir_cache
    self.capability = torch.cuda.get_device_capability(device)
    self.dependent_launch = use_dependent_launch(dependent_launch,
                                                 self.capability)
    m, s = shape.max_num_reqs, shape.steps
    i32 = dict(dtype=torch.int32, device=device)
    # Tables read through a pointer to one row: step s, live requests n.
    self.steps = torch.zeros((s, ROW), **i32)
    self.steps[:, 0] = torch.arange(s, **i32)
    self.counts = torch.zeros((m + 1, ROW), **i32)
    self.counts[:, 0] = torch.arange(m + 1, **i32)
    self.num_sms = torch.cuda.get_device_properties(
        device).multi_processor_count
    # Scratch for the largest bucket; a bucket uses the leading part.
    grid = shape.grid_vocab
    stats = max(stat_rows(shape, b) * num_blocks(grid, shape_config(shape, b))
                for b in buckets)
    self.params = torch.empty(3 * m * s, dtype=torch.float32, device=device)
    self.cache_rows = torch.empty(m * s, **i32)
    self.anchors = torch.empty(m, **i32)
    self.tokens = torch.zeros(m * s, **i32)
    self.bmax = torch.empty(stats, dtype=torch.float32, device=device)
    self.bsum = torch.empty(stats, dtype=torch.float32, device=device)
    self.barg = torch.empty(stats, **i32)
    # The chunk statistics, [NC, Bp] (Mosaic GPU buckets only; NC at most
    # the chunk pass's or the block pass's workers, whichever makes them).
    chunks = max([mosaic_chunks(grid, cfg, b, self.num_sms) * b
                  for b in buckets
                  for cfg in [shape_config(shape, b)]
                  if cfg.method == "mosaic"], default=0)
    self.cmax = torch.empty(chunks, dtype=torch.float32, device=device)
    self.csum = torch.empty(chunks, dtype=torch.float32, device=device)
    self.carg = torch.empty(chunks, **i32)
    # The tail select leaves its counters at 0; the persistent draft's are
    # zeroed before each launch (native.Zero).
    self.counters = torch.zeros(max(m, draft_pass_module.NUM_COUNTERS), **i32)
    self.pad = torch.zeros((m, s, shape.vd), dtype=shape.base_dtype,
                           device=device)
    # The Mosaic GPU block pass's embeddings operand (embed_rows fills it).
    self.emb = torch.empty((m, shape.rank), dtype=shape.head_dtype,
                           device=device)
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
    ptr = lambda t: t.data_ptr()
    # Every operand by name: scratch pointers here, the call's buffers as
    # names looked up in its bindings ("base", "cache", "count", ...).
    fixed = dict(params=ptr(self.params), cache_rows=ptr(self.cache_rows),
                 anchors=ptr(self.anchors), tokens=ptr(self.tokens),
                 block_max=ptr(self.bmax), block_sum=ptr(self.bsum),
                 block_argmax=ptr(self.barg), counters=ptr(self.counters),
                 chunk_max=ptr(self.cmax), chunk_sum=ptr(self.csum),
                 chunk_argmax=ptr(self.carg),
                 emb=ptr(self.emb))
    launches = []
    cfg = shape_config(self.shape, bp)
    dependent = bucket_dependent_launch(self.shape, bp, self.dependent_launch)
    for name, (ir, path, names) in lower_bucket(
        self.shape, bp, self.ir_cache, self.capability, self.num_sms,
        self.dependent_launch).items():
      if name == "mosaic_block_pass":
        kernel = mosaic_launch.MosaicKernel(ir)
      else:
        kernel = native.compile_kernel(
            ir, path, self.capability,
            launch_pdl=name in DEPENDENT_LAUNCH_KERNELS and dependent)
      steps = range(self.shape.steps) if name in _STEP_KERNELS else (None,)
      if name == "embed_rows" and cfg.select_embed:
        steps = (0,)  # later steps' embeddings: the select pass before
      for step in steps:
        table = dict(fixed)
        if step is not None:
          table["step"] = ptr(self.steps[step])
        args = [table.get(n, n) for n in names]
        # From step 1 with select_embed the select pass (built dependent:
        # it signals after its wait) is the kernel before the Mosaic pass.
        programmatic = dependent and cfg.select_embed and step != 0
        launches.append((name, step, native.MosaicLaunch(
            kernel, args, programmatic=programmatic)
                         if name == "mosaic_block_pass"
                         else native.Launch(ir, kernel, args)))
      if name == "draft_pass":
        # Its barriers count up from 0 every draft.
        launches.append(("zero_counters", None, native.Zero(
            self.counters[:draft_pass_module.NUM_COUNTERS])))
    # In draft order: draw_params, then block [select] a step, or the
    # counters zeroed and the draft pass.
    rank = {"draw_params": 0, "zero_counters": 1, "draft_pass": 2,
            "embed_rows": 0, "block_pass": 1, "mosaic_block_pass": 1,
            "chunk_pass": 2, "select_pass": 3}
    launches.sort(key=lambda x: (x[1] is not None, x[1] or 0, rank[x[0]]))
    return [launch for _, _, launch in launches]
