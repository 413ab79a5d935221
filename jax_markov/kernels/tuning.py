"""Block sizes, warps and request tiles per shape: a committed table, no search.

``choose`` looks the shape up in ``GPU_TABLE`` for the caller's GPU family
where it names its device (an H100 differs from the H200 at B = 256), then
in ``TABLE`` (entries measured on an H200 with ``benchmarks/tune.py`` and
``tune_graph.py``; see docs/perf-notes.md), and otherwise falls back to a
rule:

* fused (the default at every batch): at B = 1 one request a program with
  the bias on the CUDA cores (bias_dot="fma"), 128 vocabulary columns, and
  the block pass's last program drawing the token (select="tail"); the
  table's DeepSeek-V4 entry also keeps the first 24 MB of proj in L2 across
  steps (proj_l2_rows; the rule does not: untuned elsewhere); above,
  request tiles of 16..64 on the tensor cores (their smallest M is 16), 256
  vocabulary columns per program (128 with 64-request tiles, so the float32
  accumulator stays in registers); rank chunks of 64 in a loop Triton
  pipelines 3 stages deep; the table's B = 4 and 16 entries (16 x 128
  tiles) also load two proj chunks before the dependent-launch wait
  (early_proj), and the B = 64 entry's first-wave programs prefetch one
  into L2 there (prefetch_proj); the B = 4 to 128 entries let the next
  step's block pass launch before the select pass waits (early_dependents);
* xla_bias (selectable; vLLM's design, the bias GEMM in XLA): one request
  per program, vocabulary blocks of 1024 at B <= 4 and 4096 above;
* mosaic (Hopper, the JAX sampler's dense layout; kernels/mosaic_block_pass.py):
  the table's entry where the caller says it can run it (``hopper``), else
  when asked for: 128-request tiles where they divide B, else 64, and 64
  vocabulary columns a statistics block.

The persistent draft (select="persistent": the whole draft in one launch,
request tiles on either dot, proj held on chip with held_blocks) is
selectable but in no entry: captured in the native runtime on the H200 its
best tile was 0.170 / 0.193 / 0.233 / 0.51 / 1.77 ms at B = 1 / 4 / 16 / 64
/ 256 against the table's 0.132 / 0.182 / 0.199 / 0.31 / 0.84
(benchmarks/results/tune-graph-persistent*-nvidia-h200-dsv4.json;
docs/perf-notes.md change 30), so it does not earn the default. Where an
entry picks it, a reduced vocabulary and greedy drafting run the same tile
step by step (:func:`stepwise`).
"""

from __future__ import annotations

import dataclasses
import functools

from jax_markov.kernels.config import METHODS, KernelConfig

__all__ = ["METHODS", "KernelConfig", "TABLE", "GPU_TABLE", "choose",
           "default_method", "gpu_family"]


def _next_pow2(n: int) -> int:
  return 1 << max(0, (n - 1).bit_length())


def _batch_bucket(batch: int) -> int:
  return _next_pow2(batch)


# early_proj=2: the first two proj chunks load before the dependent-launch
# wait (captured native draft, H100, T = 1 / 0: B = 4 0.1946 / 0.1921 ms
# against 0.2012 / 0.1980 without, B = 16 0.2196 / 0.2197 against 0.2262 /
# 0.2250; B = 64's 64 x 128 tile loses with it; docs/perf-notes.md change
# 42). early_dependents (here and at B = 64 and 128): the select pass lets
# the next step's block pass launch before its own wait, into the step's
# last wave (B = 4 / 16 / 64 / 128, T = 1: -2.4 / -4.7 / -7.2 / -9.5 us a
# captured draft on an H100; change 45).
_TILE_16X128 = KernelConfig(method="fused", block_b=16, block_v=128,
                            block_k=64, num_warps=4, num_stages=3,
                            early_proj=2, early_dependents=True)

# The most rows past a batch's one full request tile that the tile's
# programs also take (KernelConfig.remainder_b), at B = 65-127 on 64-request
# tiles: B = 72 and 80 run 64 + 8 / 16 rows in one grid instead of a second
# tile of 8 / 16 live rows that reads all of proj again (captured native
# draft, H200, T = 1: 0.3747 / 0.3847 ms against 0.3972 / 0.4044). A
# 32-row remainder tile loses (B = 88 and 96: +0.7% / +1.4%), and with two
# or more full tiles every program carries the remainder's registers (B =
# 136 and 200: +13% / +19%; docs/perf-notes.md change 48).
REMAINDER_B = 16


# (method, vocab, rank, batch bucket) -> KernelConfig, the fastest of
# benchmarks/tune.py's or tune_graph.py's sweep on an H200
# (benchmarks/results/tune-*.json).
TABLE: dict[tuple[str, int, int, int], KernelConfig] = {
    # B = 1: 57344 L2-kept rows (28 MB), as the rule keeps: 0.1591 / 0.1609
    # ms against 0.1655 / 0.1633 with 49152 in two captured sweeps on an
    # H100 (docs/perf-notes.md change 46).
    ("fused", 129280, 256, 1): KernelConfig(
        method="fused", block_b=1, block_v=128, block_k=64, num_warps=4,
        num_stages=3, bias_dot="fma", select="tail", proj_l2_rows=57344),
    # B = 4 and 16: benchmarks/tune_graph.py (GPU time of the captured
    # native draft; the host hides these tiles' difference in tune.py):
    # 0.181 / 0.200 ms against the rule's 16 x 256 tile's 0.193 / 0.217.
    ("fused", 129280, 256, 4): _TILE_16X128,
    ("fused", 129280, 256, 16): _TILE_16X128,
    # prefetch_proj=1: the first wave's programs (3 an SM on 132 SMs) bring
    # their first proj chunk into L2 before the dependent-launch wait
    # (captured native draft, H100, T = 1 / 0: 0.3430 / 0.3399 ms against
    # 0.3498 / 0.3490 without; 2 or 4 chunks are slower; docs/perf-notes.md
    # change 44). The JAX path (no dependent launch) runs the tile without
    # it.
    ("fused", 129280, 256, 64): KernelConfig(
        method="fused", block_b=64, block_v=128, block_k=64, num_warps=4,
        num_stages=3, prefetch_proj=1, prefetch_programs=396,
        early_dependents=True),
    # B = 128 (the rule's tile, two request tiles) with early_dependents;
    # B = 65 to 127 that leave up to REMAINDER_B rows past the first tile
    # run them in its programs (remainder_b).
    ("fused", 129280, 256, 128): KernelConfig(
        method="fused", block_b=64, block_v=128, block_k=64, num_warps=4,
        num_stages=3, early_dependents=True, remainder_b=REMAINDER_B),
    # B = 129 to 256 where the Mosaic GPU entry does not run (off Hopper, B
    # not a multiple of 128): the B = 128 tile, early_dependents included.
    ("fused", 129280, 256, 256): KernelConfig(
        method="fused", block_b=64, block_v=128, block_k=64, num_warps=4,
        num_stages=3, early_dependents=True),
    # The Mosaic GPU block pass (Hopper), picked by choose(hopper=True) for
    # batches it divides into request tiles: one step alone on an H200,
    # B = 256: 93-99 us against the Triton entry's 120 us; the JAX draft
    # 0.705 against 0.859 ms back to back (docs/perf-notes.md change 34),
    # the captured native draft 0.686 against 0.820 (change 36).
    # Every Mosaic entry and the Mosaic rule take select_embed: the select
    # pass writes the next step's embeddings, no embed_rows launch a step
    # (captured native draft, Mosaic pass at B = 128, H100, T = 1: 0.5419
    # against 0.5528 ms, seed_design_graph 0.677; the same tokens and cache
    # bit for bit; docs/perf-notes.md change 53).
    ("mosaic", 129280, 256, 256): KernelConfig(
        method="mosaic", block_b=128, block_v=64, num_stages=8,
        select_embed=True),
    ("xla_bias", 129280, 256, 1): KernelConfig(
        method="xla_bias", block_b=1, block_v=4096, block_k=64, num_warps=8,
        num_stages=1),
}


# Entries for one GPU family, looked up before TABLE (whose entries were
# measured on an H200) where the caller names its GPU. Keys: (family, method,
# vocab, rank, batch bucket).
GPU_TABLE: dict[tuple[str, str, int, int, int], KernelConfig] = {
    # The H100 (HBM3) prefers 4 proj chunks in flight to the H200's 8: the
    # captured native draft at B = 256, T = 1, 0.818 / 0.819 against 0.888
    # in two sessions on two machines (benchmarks/results/
    # tune-graph-fold*-nvidia-h100-dsv4.json; docs/perf-notes.md change 40).
    ("h100", "mosaic", 129280, 256, 256): KernelConfig(
        method="mosaic", block_b=128, block_v=64, num_stages=4,
        select_embed=True),
    # B = 128 on the H200: the Mosaic pass, 4 proj chunks in flight, the
    # chunk statistics folded: 0.4257 ms against the Triton entry's 0.4528
    # and seed_design_graph's 0.5377 (captured native draft, T = 1;
    # benchmarks/results/tune-graph-mosaic-nvidia-h200-dsv4.json,
    # docs/perf-notes.md change 49). On an H100 the Triton entry wins there
    # (0.511 against 0.553, results/mosaic-b128-nvidia-h100.json).
    ("h200", "mosaic", 129280, 256, 128): KernelConfig(
        method="mosaic", block_b=128, block_v=64, num_stages=4,
        select_embed=True),
}


def gpu_family(name: str | None) -> str | None:
  """The GPU_TABLE family of a device name ("NVIDIA H100 80GB HBM3" ->
  "h100"), or None for a GPU with no entries of its own.

  The entries differ by memory bandwidth (the H200's HBM3e against the
  H100's HBM3), so a Grace Hopper GH200 goes by its memory: the HBM3e
  module ("NVIDIA GH200 144G HBM3e") as an H200, the HBM3 one ("NVIDIA
  GH200 480GB", 96 GB) as an H100. Neither was measured here.
  """
  name = (name or "").lower()
  if "gh200" in name:
    return "h200" if ("hbm3e" in name or "144g" in name) else "h100"
  for family in ("h200", "h100"):
    if family in name:
      return family
  return None


def _entry(method: str, vocab: int, rank: int, batch: int,
           gpu: str | None) -> KernelConfig | None:
  family = gpu_family(gpu)
  key = (method, vocab, rank, _batch_bucket(batch))
  if family is not None and (family, *key) in GPU_TABLE:
    return GPU_TABLE[(family, *key)]
  return TABLE.get(key)


def default_method(batch: int, vocab: int, rank: int) -> str:
  """The faster method for a shape, by the sweep (docs/perf-notes.md).

  With the rank loop software-pipelined, fused beat the best xla_bias config
  at every batch swept at the DeepSeek-V4 shape (B = 1: 0.246 vs 0.265 ms;
  B = 256: 0.88 vs 1.20 ms).
  """
  del batch, vocab, rank
  return "fused"


def stepwise(config: KernelConfig) -> KernelConfig:
  """A persistent configuration run step by step, the same tile: the tail
  select with one request a tile, else the select pass. For what the
  one-launch draft does not run (a reduced vocabulary, greedy drafting)."""
  if config.select != "persistent":
    return config
  return dataclasses.replace(
      config, select="tail" if config.block_b == 1 else "pass", programs=0,
      held_blocks=0)


def _mosaic_rule(batch: int, gpu: str | None = None) -> KernelConfig:
  # The H100 keeps 4 proj chunks in flight, as its DeepSeek-V4 entry does
  # (GPU_TABLE); elsewhere as many as fit. 64-request tiles where B does
  # not fill 128-request ones: their chunk statistics take the chunk pass.
  # B that fills neither (B = 136, 200): a partial last 64-request tile,
  # as many chunks in flight as fit on every GPU (H100, captured native
  # draft, T = 1: B = 136 0.5772 ms, B = 200 0.7025, against 0.5713 /
  # 0.7263 with 4 chunks and the Triton pass's 0.6137 / 0.8129; docs/
  # perf-notes.md change 57).
  partial = batch % 64 != 0
  return KernelConfig(method="mosaic", block_b=128 if batch % 128 == 0 else 64,
                      block_v=64,
                      num_stages=(4 if gpu_family(gpu) == "h100"
                                  and not partial else 0),
                      select_embed=True, partial_tiles=partial)


# Shapes with no Mosaic GPU entry of their own take the Mosaic rule from
# this batch bucket up, where the shape tiles (docs/perf-notes.md change 41:
# at B = 256 the Triton pass is bound by L2 traffic at every vocabulary;
# change 47: B = 192 on 64-request tiles), and so does a batch of the bucket
# that fills neither 128- nor 64-request tiles where the last tile can be
# partial (B >= 64, a multiple of 4; change 57: B = 136 and 200 1.24x and
# 1.31x seed_design_graph on an H100 against the Triton pass's 1.16x and
# 1.13x). Other batches (B = 137) stay on the Triton pass, whose request
# tiles take any batch.
MOSAIC_RULE_FROM = 256


def _mosaic_rule_applies(batch: int, vocab: int, rank: int) -> bool:
  # Every B of the bucket is >= 129: a multiple of 4 fills 64-request
  # tiles or takes a partial last one.
  return (_batch_bucket(batch) >= MOSAIC_RULE_FROM and batch % 4 == 0
          and vocab % 64 == 0 and rank % 64 == 0)


@functools.lru_cache(maxsize=256)  # runs on every call of the sampler
def choose(method: str | None, batch: int, vocab: int, rank: int, *,
           interpret: bool, hopper: bool = False,
           gpu: str | None = None) -> KernelConfig:
  """The configuration for a shape: the table's entry, else the rule above.

  gpu: the device's name (e.g. torch.cuda.get_device_name()); a GPU_TABLE
  entry for its family wins over TABLE's. None: TABLE only.

  hopper: the caller can run the Mosaic GPU block pass (a Hopper GPU, bf16
  operands, the dense layout, no reduced vocabulary: see
  :func:`mosaic_block_pass.available`); with method None the table's
  "mosaic" entry for the shape (or the Mosaic rule, on 64-request tiles
  where the batch does not fill the entry's) then wins where the batch
  fills its request tiles. method="mosaic" asks for it whatever the table
  says.
  """
  if method is None:
    method = default_method(batch, vocab, rank)
    entry = _entry("mosaic", vocab, rank, batch, gpu)
    if (entry is None and (method, vocab, rank, _batch_bucket(batch))
        not in TABLE and _mosaic_rule_applies(batch, vocab, rank)):
      entry = _mosaic_rule(batch, gpu)
    if (entry is not None and batch % entry.block_b
        and not entry.partial_tiles
        and _mosaic_rule_applies(batch, vocab, rank)):
      # B = 192 does not fill the 256 bucket's 128-request tiles: the
      # rule's 64-request tiles, 1.31x seed_design_graph against the Triton
      # pass's 1.26x on an H100 (docs/perf-notes.md change 47); B = 136 and
      # 200 on them with a partial last tile (change 57). An entry that
      # takes partial tiles itself runs as it is.
      entry = _mosaic_rule(batch, gpu)
    if (hopper and not interpret and entry is not None
        and (batch % entry.block_b == 0
             or (entry.partial_tiles and batch >= 64 and batch % 4 == 0))):
      return entry
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS} or None, got {method!r}")
  if method == "mosaic":
    if interpret:
      raise ValueError("method='mosaic' has no interpreter: it runs on a "
                       "Hopper GPU only (use 'fused' on the CPU)")
    return (_entry(method, vocab, rank, batch, gpu)
            or _mosaic_rule(batch, gpu))
  if interpret:
    # The interpreter loops over the grid on the CPU: few, large programs.
    if method == "xla_bias":
      return KernelConfig(method=method, block_b=1,
                          block_v=min(512, _next_pow2(vocab)), block_k=64,
                          num_warps=4)
    return KernelConfig(method=method, block_b=16,
                        block_v=min(512, max(16, _next_pow2(vocab))),
                        block_k=min(64, max(16, _next_pow2(rank))),
                        num_warps=4)
  entry = _entry(method, vocab, rank, batch, gpu)
  if entry is not None:
    return entry
  if method == "xla_bias":
    block_v = 1024 if batch <= 4 else 4096
    return KernelConfig(method=method, block_b=1,
                        block_v=min(block_v, _next_pow2(vocab)), block_k=64,
                        num_warps=8 if batch <= 4 else 4)
  if batch == 1:
    # One request: the bias on the CUDA cores, and the first 57344 rows of
    # proj (28 MB at R = 256, about half the H100's and H200's L2) kept in L2
    # across the steps; at the 152k and 200k vocabularies that is 1.30-1.35x
    # seed_design_graph against 1.14-1.22x without (docs/perf-notes.md,
    # changes 22 and 46).
    return KernelConfig(method=method, block_b=1,
                        block_v=min(128, max(16, _next_pow2(vocab))),
                        block_k=min(64, _next_pow2(rank)), num_warps=4,
                        num_stages=3, bias_dot="fma", select="tail",
                        proj_l2_rows=57344)
  block_b = min(64, max(16, _next_pow2(batch)))
  block_k = min(64, max(16, _next_pow2(rank)))
  # The select pass lets the next step's block pass launch into its last
  # wave (early_dependents), and 16-request tiles load their first two proj
  # chunks before the dependent-launch wait (early_proj): the DeepSeek-V4
  # entries' choices (changes 42 and 45), which only a dependent launch (the
  # native runtime) uses. 16-request tiles take 128 columns as those entries
  # do, and 32-request tiles too (change 46: 1.31-1.33x seed_design_graph
  # at B = 32 and three vocabularies, against 1.15-1.23x with 256 columns).
  # A batch between one and two tiles that leaves a few rows over runs them
  # in the tile's programs (remainder_b; change 48).
  return KernelConfig(method=method, block_b=block_b,
                      block_v=min(128, max(16, _next_pow2(vocab))),
                      block_k=block_k, num_warps=4, num_stages=3,
                      early_proj=2 if block_b == 16 else 0,
                      early_dependents=True,
                      remainder_b=(REMAINDER_B
                                   if block_b < batch < 2 * block_b else 0))
