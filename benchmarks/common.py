"""Shared pieces of the benchmark: shapes, synthetic inputs, HBM floor, timing.

Nothing here imports torch or JAX at module level: the torch processes must not
initialise JAX and the JAX processes must not initialise torch.

Synthetic inputs. Every implementation, in whichever framework and process,
must see bit-identical inputs so that their temperature-0 tokens can be
compared. The inputs are built on the device from an int32 hash of the element
index (only wrapping int32 multiply, xor, and, shifts: the same in torch and
JAX), and their values are chosen so that every sum the sampler forms is exact:

* embed entries in {-1, 0, 1}, proj entries in {-1, 0, 1} / 8, so the bias
  ``proj @ embed[prev]`` is k / 8 with an integer |k| <= R <= 256: exact in
  float32 whatever the summation order, and exact even when a baseline rounds
  the bias to bf16 (vLLM's loop does);
* base logits ``+-(128 + j) * 2**e / 256`` (j < 128, e < 4): exact in bf16
  and fp16, magnitudes in [0.5, 8), multiples of 2**-8;
* so base + bias is exact in float32, every implementation sees the same
  float32 logits, and the temperature-0 argmax (lowest index of the maximum)
  must agree exactly, ties included.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time
from typing import Callable, Sequence


@dataclasses.dataclass(frozen=True)
class Shape:
  """A benchmark shape.

  Attributes:
    name: short key used on the command line (``--shapes``).
    label: human-readable name for tables and plots.
    V: vocabulary size (also the embedding table's row count, V_in = V).
    R: Markov rank.
    S: draft steps.
    dtype: dtype name of base logits and weights ("bfloat16", "float16",
      "float32").
    Vd: a reduced draft vocabulary (EAGLE-style d2t), or None. Then base
      logits are [B, S, Vd] and proj [Vd, R] (draft ids), embed [V, R]
      (target ids), draft id j is target id ``draft_targets(shape)[j]`` (a
      sorted random subset of the target ids, fixed seed: vLLM's d2t gives an
      increasing map), and the cache and tokens are over the target V.
  """
  name: str
  label: str
  V: int
  R: int
  S: int
  dtype: str = "bfloat16"
  Vd: int | None = None

  @property
  def draft_vocab(self) -> int:
    """The base logits' (and proj's) vocabulary: Vd, or V without a map."""
    return self.V if self.Vd is None else self.Vd


SHAPES = {
    "dsv4": Shape("dsv4", "DeepSeek-V4", V=129280, R=256, S=7),
    # DeepSeek-V4 with a reduced draft vocabulary (vLLM's d2t mode).
    "dsv4r": Shape("dsv4r", "DeepSeek-V4, reduced draft vocabulary",
                   V=129280, R=256, S=7, Vd=32768),
    "v200k": Shape("v200k", "200k vocabulary", V=200064, R=256, S=7),
    "v152k": Shape("v152k", "152k vocabulary", V=151936, R=256, S=7),
    "small": Shape("small", "small", V=32000, R=64, S=4),
    # Not in the defaults: for tests and smoke runs on CPU.
    "tiny": Shape("tiny", "tiny", V=1000, R=16, S=3),
    "tinyr": Shape("tinyr", "tiny, reduced draft vocabulary", V=96, R=8, S=3,
                   Vd=40),
}
DEFAULT_SHAPES = ("dsv4", "dsv4r", "v200k", "v152k", "small")
# The greedy rows (tokens only) run on these shapes unless --impls names them.
GREEDY_DEFAULT_SHAPES = ("dsv4", "dsv4r")
DEFAULT_BATCHES = (1, 4, 16, 64, 256)
DEFAULT_TEMPERATURES = (0.0, 1.0)

# Implementation name -> the process family that runs it.
FAMILIES = {
    "jax_markov": "jax",
    "plain_jax": "jax",
    # vLLM's FusedMarkovSampler as it is: what speed claims are made against.
    "seed_design": "torch",
    "seed_design_graph": "torch",
    # A float32-bias variant of it (the bias round-trips HBM in float32).
    "f32_bias_design": "torch",
    "f32_bias_design_graph": "torch",
    "vllm_loop": "torch",
    "vllm_loop_graph": "torch",
    "torch_bridge": "bridge",
    "torch_bridge_graph": "bridge",
    # Greedy drafting: tokens only, no cache (temperature irrelevant).
    "jax_markov_greedy": "jax",
    "torch_bridge_greedy": "bridge",
    "torch_bridge_greedy_graph": "bridge",
    # Not in the defaults: jax_markov forced to method="xla_bias", the
    # reference design's bias GEMM in XLA then the block pass, for issue
    # comparisons.
    "jax_markov_xla_bias": "jax",
    # Not in the defaults: jax_markov forced to method="fused" (the Triton
    # block pass), to set the table's Mosaic GPU choice beside it in one run.
    "jax_markov_fused": "jax",
    # Not in the defaults: jax_markov with the configuration the native
    # runtime plans for the batch where that is the Mosaic GPU pass (B =
    # 128 on an H200, which a JAX call does not take by itself:
    # sampler._config), beside jax_markov in one run.
    "jax_markov_mosaic": "jax",
    # Not in the defaults: jm.sample_draft_into with the cache donated back
    # call after call (its buffers stay put: what a serving loop does), beside
    # jax_markov's new cache a call (perf-notes "The JAX call at B = 256").
    "jax_markov_into": "jax",
    # Not in the defaults: the captured hook with mosaic=True (the Mosaic GPU
    # block pass where the table has it; Hopper only) and with mosaic=False
    # (the Triton block pass everywhere), for A/B rows in one run.
    "torch_bridge_mosaic_graph": "bridge",
    "torch_bridge_triton_graph": "bridge",
}
# The hook's mosaic argument for those rows (the others: its default).
BRIDGE_MOSAIC = {"torch_bridge_mosaic_graph": True,
                 "torch_bridge_triton_graph": False}
IMPLS = ("jax_markov", "torch_bridge", "torch_bridge_graph", "seed_design",
         "seed_design_graph", "f32_bias_design", "f32_bias_design_graph",
         "vllm_loop", "vllm_loop_graph", "plain_jax", "jax_markov_greedy",
         "torch_bridge_greedy_graph")
# torch_bridge_greedy (eager) is not in the defaults: the CPU tests' path to
# the greedy hook (a CUDA graph needs a GPU).
ALL_IMPLS = IMPLS + ("torch_bridge_greedy", "jax_markov_xla_bias",
                     "jax_markov_fused", "jax_markov_mosaic",
                     "jax_markov_into",
                     "torch_bridge_mosaic_graph",
                     "torch_bridge_triton_graph")
# Tokens only (no cache): timed once, at temperature 0, in their own table.
GREEDY_IMPLS = ("jax_markov_greedy", "torch_bridge_greedy",
                "torch_bridge_greedy_graph")
# The baseline every speed claim is made against (report ratios, README).
BASELINE_IMPL = "seed_design_graph"
# Families run in this order; the first one's temperature-0 tokens are the
# ones the later ones are checked against (jax_markov first when it runs).
FAMILY_ORDER = ("jax", "torch", "bridge")

ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}

# Inputs smaller than this are replicated and rotated between calls, so that
# no call finds its operands in the L2 cache left warm by the call before
# (the H200's L2 is 50 MB; twice that keeps a set evicted by the others).
L2_FLUSH_BYTES = 2 * 50 * 2**20
MAX_INPUT_SETS = 8


def floor_bytes(shape: Shape, batch: int, cache: bool = True) -> int:
  """Bytes one S-step draft must move at the least.

  proj [Vd, R] read once a step, base logits [B, S, Vd] read once, and the
  float32 logit cache [B, S, V] written once (not with ``cache=False``: the
  greedy rows write tokens only). Vd = V without a reduced vocabulary. The
  embedding rows (B * S * R elements) and the tokens are negligible and not
  counted.
  """
  isz = ITEMSIZE[shape.dtype]
  vd = shape.draft_vocab
  return (shape.S * vd * shape.R * isz + batch * shape.S * vd * isz
          + (batch * shape.S * shape.V * 4 if cache else 0))


def input_set_bytes(shape: Shape, batch: int) -> int:
  """Distinct bytes one draft streams: proj, base logits and the cache.

  The embedding table is left out: a draft touches only B * S of its rows.
  """
  isz = ITEMSIZE[shape.dtype]
  vd = shape.draft_vocab
  return (vd * shape.R * isz + batch * shape.S * vd * isz
          + batch * shape.S * shape.V * 4)


# The seed of the reduced vocabulary's map (see draft_targets).
MAP_SEED = 19
_MAP_CACHE = {}


def draft_targets(shape: Shape):
  """NumPy int64 [Vd]: the target id of each draft id, or None without Vd.

  A sorted random subset of [0, V) from a fixed seed: the same in every
  process, and increasing, as vLLM's d2t (``j + d2t[j]``) gives it.
  """
  if shape.Vd is None:
    return None
  key = (shape.V, shape.Vd)
  if key not in _MAP_CACHE:
    import numpy as np
    ids = np.random.default_rng(MAP_SEED).choice(shape.V, shape.Vd,
                                                 replace=False)
    _MAP_CACHE[key] = np.sort(ids).astype(np.int64)
  return _MAP_CACHE[key].copy()


def num_input_sets(shape: Shape, batch: int) -> int:
  """How many input sets to rotate between timed calls (1 for large inputs)."""
  n = math.ceil(L2_FLUSH_BYTES / input_set_bytes(shape, batch))
  return max(1, min(MAX_INPUT_SETS, n))


def device_slug(name: str) -> str:
  """'NVIDIA H200' -> 'nvidia-h200'; used for the results file name."""
  slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
  return slug or "unknown"


# ---------------------------------------------------------------------------
# Synthetic inputs, written once for torch tensors and JAX arrays alike: the
# functions below use only Python operators on int32 arrays.

_SEED_STRIDE = 0x632BE5AB


def _to_i32(v: int) -> int:
  v &= 0xFFFFFFFF
  return v - (1 << 32) if v >= (1 << 31) else v


def mix32(x):
  """An int32 -> int32 hash (lowbias32) of a torch or JAX int32 array.

  Right shifts of int32 are arithmetic in both frameworks, so each is masked
  to act as the logical shift of the uint32 hash.
  """
  x = x ^ ((x >> 16) & 0xFFFF)
  x = x * _to_i32(0x7FEB352D)
  x = x ^ ((x >> 15) & 0x1FFFF)
  x = x * _to_i32(0x846CA68B)
  x = x ^ ((x >> 16) & 0xFFFF)
  return x


def stream_offset(stream: int, set_index: int) -> int:
  """int32 offset added to element indices, one per (tensor, input set)."""
  return _to_i32((stream * 7919 + set_index * 104729 + 1) * _SEED_STRIDE)


def base_numerators(index, offset: int):
  """int32 numerators n of the base logits n / 256 for flat element indices."""
  h = mix32(index + offset)
  sign = 1 - 2 * ((h >> 30) & 1)
  mantissa = 128 + ((h >> 8) & 127)
  return sign * (mantissa << ((h >> 16) & 3))


def ternary(index, offset: int):
  """int32 values in {-1, 0, 1} for flat element indices (embed; proj * 8)."""
  h = mix32(index + offset)
  return ((h >> 8) & 0xFFFF) % 3 - 1


def token_ids(index, offset: int, vocab: int):
  """int32 token ids in [0, vocab) for flat element indices."""
  h = mix32(index + offset)
  return ((h >> 1) & 0x3FFFFFFF) % vocab


# Streams of the hash, one per tensor.
STREAM_BASE, STREAM_EMBED, STREAM_PROJ, STREAM_ANCHOR = 1, 2, 3, 4
BASE_SCALE = 1.0 / 256.0
PROJ_SCALE = 1.0 / 8.0


def seeds_and_positions(batch: int, steps: int):
  """NumPy int64 seeds [B] and int32 positions [B, S] used by every run."""
  import numpy as np
  seeds = (np.arange(batch, dtype=np.int64) * 1_000_003 + (1 << 40) + 17)
  positions = (np.arange(steps, dtype=np.int32)[None, :] + 100
               + 3 * np.arange(batch, dtype=np.int32)[:, None])
  return seeds, positions.astype(np.int32)


# ---------------------------------------------------------------------------
# Progress and timing helpers.

class Progress:
  """Prints one line per event to stderr with the time since the run began."""

  def __init__(self, start_time: float | None = None, prefix: str = ""):
    self.start = time.time() if start_time is None else start_time
    self.prefix = prefix

  def __call__(self, msg: str) -> None:
    elapsed = time.time() - self.start
    print(f"[bench {elapsed:7.1f}s]{self.prefix} {msg}", file=sys.stderr,
          flush=True)


def median_of_groups(run_group: Callable[[int], float], repeats: int,
                     group: int) -> tuple[float, int]:
  """Median over groups of the per-call time.

  Args:
    run_group: runs ``n`` calls back to back and returns their total time in
      milliseconds (the caller does the synchronisation).
    repeats: total timed calls; at least one group is run.
    group: calls per group.

  Returns:
    (median per-call milliseconds, number of groups).
  """
  group = max(1, min(group, repeats))
  n_groups = max(1, repeats // group)
  times = [run_group(group) / group for _ in range(n_groups)]
  return statistics.median(times), n_groups


def round_robin(calls, finish: Callable | None = None) -> Callable[[int], None]:
  """A runner of ``count`` calls that rotates through ``calls`` (input sets).

  ``finish(last_result)``, if given, runs after each batch of calls: the
  synchronisation a wall-clock timer needs.
  """
  state = dict(k=0)

  def run(count: int) -> None:
    out = None
    for _ in range(count):
      out = calls[state["k"] % len(calls)]()
      state["k"] += 1
    if finish is not None:
      finish(out)
  return run


# Seconds of untimed calls before a point is timed (see warm_up).
WARMUP_S = 0.2


def warm_up(run: Callable[[int], None], calls: int, seconds: float,
            sync: Callable[[], None] | None = None) -> int:
  """Untimed calls: at least ``calls`` of them and ``seconds`` of wall time.

  A count alone is not enough: an idle GPU runs its SM clock low and takes
  tens of milliseconds of work to raise it, longer than a few sub-millisecond
  drafts, so the first point timed in a process would run slower than the
  rest (seen on the H200: B = 1, timed first, 0.31 ms against 0.20 ms in a
  warm process). ``sync`` (if given) drains the queue now and then, for
  runners that do not synchronise. Returns the number of calls made.
  """
  t0 = time.perf_counter()
  n = 0
  while n < calls or time.perf_counter() - t0 < seconds:
    run(1)
    n += 1
    if sync is not None and n % 8 == 0:
      sync()
  if sync is not None:
    sync()
  return n


def wall_clock_median(run: Callable[[int], None], repeats: int,
                      group: int) -> tuple[float, int]:
  """median_of_groups with each group timed by the host clock around ``run``."""
  def group_ms(count):
    t0 = time.perf_counter()
    run(count)
    return (time.perf_counter() - t0) * 1e3
  return median_of_groups(group_ms, repeats, group)


def host_call_median_ms(calls, count: int,
                        sync: Callable[[], None]) -> float:
  """Median host time of one call, in milliseconds.

  perf_counter around each call without synchronizing after it: what the
  caller's thread spends issuing the call. ``sync`` drains the device queue
  before each call (outside the timed span), so a full launch queue never
  blocks the call being timed.
  """
  times = []
  for k in range(max(1, count)):
    sync()
    t0 = time.perf_counter()
    calls[k % len(calls)]()
    times.append(time.perf_counter() - t0)
  sync()
  return statistics.median(times) * 1e3


def write_json(path: str, obj) -> None:
  """Writes ``obj`` as JSON atomically (a crash never leaves half a file)."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    json.dump(obj, f, indent=1)
  os.replace(tmp, path)


def parse_list(text: str | None, default: Sequence, cast=str) -> list:
  """'1,4,16' -> [1, 4, 16]; None -> list(default)."""
  if text is None:
    return list(default)
  return [cast(t) for t in text.split(",") if t.strip()]


# ---------------------------------------------------------------------------
# The synthetic inputs as torch tensors or JAX arrays.

def torch_inputs(shape: Shape, batch: int, set_index: int, device):
  """Synthetic inputs as torch tensors on ``device``.

  Returns:
    dict with base [B, S, Vd] (shape.dtype), embed [V, R] and proj [Vd, R]
    (shape.dtype), anchors int64 [B] (target ids), and with a reduced
    vocabulary ``targets`` int64 [Vd] (:func:`draft_targets`); Vd = V
    without one.
  """
  import torch
  dtype = getattr(torch, shape.dtype)
  V, R, S, Vd = shape.V, shape.R, shape.S, shape.draft_vocab

  def idx(start, n):
    return torch.arange(start, start + n, dtype=torch.int32, device=device)

  row = S * Vd
  base = torch.empty((batch, S, Vd), dtype=dtype, device=device)
  chunk = max(1, (64 << 20) // row)  # rows per chunk: bounded temporaries
  off = stream_offset(STREAM_BASE, set_index)
  for b0 in range(0, batch, chunk):
    b1 = min(batch, b0 + chunk)
    n = base_numerators(idx(b0 * row, (b1 - b0) * row), off)
    values = (n.to(torch.float32) * BASE_SCALE).view(b1 - b0, S, Vd)
    base[b0:b1] = values.to(dtype)
  embed = ternary(idx(0, V * R), stream_offset(STREAM_EMBED, set_index))
  embed = embed.to(torch.float32).view(V, R).to(dtype)
  proj = ternary(idx(0, Vd * R), stream_offset(STREAM_PROJ, set_index))
  proj = (proj.to(torch.float32) * PROJ_SCALE).view(Vd, R).to(dtype)
  anchors = token_ids(idx(0, batch), stream_offset(STREAM_ANCHOR, set_index), V)
  out = dict(base=base, embed=embed, proj=proj,
             anchors=anchors.to(torch.int64))
  if shape.Vd is not None:
    out["targets"] = torch.from_numpy(draft_targets(shape)).to(device)
  return out


_JAX_GEN_CACHE = {}


@dataclasses.dataclass
class JaxDraft:
  """Everything to time ``jm.sample_draft`` at one shape, batch and temperature.

  Attributes:
    sets, heads: the input sets (dicts from :func:`jax_inputs`) and their
      MarkovHeads, rotated between calls.
    words, positions, temperature: the seed words uint32 [B, 2], positions
      int32 [B, S] and temperature float32 [B] every call uses.
  """
  sets: list
  heads: list
  words: object
  positions: object
  temperature: object
  mapped: dict = dataclasses.field(default_factory=dict)

  def args(self, k: int = 0) -> tuple:
    """sample_draft's positional arguments with input set k."""
    d = self.sets[k]
    return (d["base"], d["anchors"], self.heads[k], self.temperature,
            self.words, self.positions)

  def calls(self, config, interpret: bool = False) -> list:
    """One call per input set, with ``config`` and no value checks.

    With a reduced vocabulary the call is the jitted draft behind
    ``jm.sample_draft`` with the (increasing) map on the device, checked
    once, as a serving loop holds it (``mapped``: its keyword arguments).
    """
    import jax_markov as jm
    if self.mapped:
      return [(lambda k=k: jm.sampler._sample_draft(  # noqa: SLF001
          *self.args(k), config=config, interpret=interpret, **self.mapped))
              for k in range(len(self.sets))]
    return [(lambda k=k: jm.sample_draft(*self.args(k), config=config,
                                         check_values=False))
            for k in range(len(self.sets))]


def jax_draft(shape: Shape, batch: int, temperature: float) -> JaxDraft:
  """The synthetic inputs of a jax_markov draft, as the tuning scripts time it."""
  import jax.numpy as jnp
  import jax_markov as jm
  sets = [jax_inputs(shape, batch, k)
          for k in range(num_input_sets(shape, batch))]
  seeds, positions = seeds_and_positions(batch, shape.S)
  mapped = {}
  if shape.Vd is not None:
    import numpy as np
    targets = draft_targets(shape)
    assert (np.diff(targets) > 0).all()
    mapped = dict(draft_to_target=jnp.asarray(targets, jnp.int32),
                  target_vocab=shape.V)
  return JaxDraft(sets, [jm.MarkovHead(d["embed"], d["proj"]) for d in sets],
                  jm.rng.seed_words(seeds), jnp.asarray(positions),
                  jnp.full((batch,), temperature, jnp.float32), mapped)


def jax_inputs(shape: Shape, batch: int, set_index: int):
  """The same synthetic inputs as :func:`torch_inputs`, as JAX arrays.

  Returns:
    dict with base [B, S, Vd], embed [V, R], proj [Vd, R] (shape.dtype) and
    anchors int32 [B], on JAX's default device; with a reduced vocabulary
    also ``targets``, the NumPy int64 map [Vd] (:func:`draft_targets`).
  """
  import jax
  import jax.numpy as jnp
  key = (shape, batch)
  if key not in _JAX_GEN_CACHE:
    dtype = jnp.dtype(shape.dtype)
    V, R, S, Vd = shape.V, shape.R, shape.S, shape.draft_vocab

    @jax.jit
    def gen(offsets):
      # offsets: int32 [4], one per stream; traced so one compile per shape.
      bi = jnp.arange(batch * S * Vd, dtype=jnp.int32)
      wi = jnp.arange(V * R, dtype=jnp.int32)
      pi = jnp.arange(Vd * R, dtype=jnp.int32)
      base = (base_numerators(bi, offsets[0]).astype(jnp.float32)
              * BASE_SCALE).astype(dtype).reshape(batch, S, Vd)
      embed = ternary(wi, offsets[1]).astype(jnp.float32).astype(dtype)
      proj = (ternary(pi, offsets[2]).astype(jnp.float32)
              * PROJ_SCALE).astype(dtype)
      anchors = token_ids(jnp.arange(batch, dtype=jnp.int32), offsets[3], V)
      return base, embed.reshape(V, R), proj.reshape(Vd, R), anchors
    _JAX_GEN_CACHE[key] = gen
  streams = (STREAM_BASE, STREAM_EMBED, STREAM_PROJ, STREAM_ANCHOR)
  offsets = jnp.asarray([stream_offset(s, set_index) for s in streams],
                        dtype=jnp.int32)
  base, embed, proj, anchors = _JAX_GEN_CACHE[key](offsets)
  out = dict(base=base, embed=embed, proj=proj, anchors=anchors)
  if shape.Vd is not None:
    out["targets"] = draft_targets(shape)
  return out
