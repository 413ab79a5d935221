"""The Mosaic GPU block pass lowers for CUDA, checked without a GPU.

In the Mosaic GPU "lane" lowering, the Pallas kernel is lowered to the
Mosaic GPU MLIR module in Python while JAX lowers the jitted wrapper, so
shared-memory layouts, TMA slicing, WGMMA operands and register layouts that
Mosaic GPU does not support fail here, on any machine. (Compiling that
module to a cubin, and running it, still needs a Hopper GPU:
mosaic_check.py.)
"""

import dataclasses
import functools
import itertools
import re

import chex
import numpy as np
import jax
import jax.numpy as jnp
import pytest

import jax_markov as jm
from helpers import make_problem
from jax_markov.kernels import mosaic_block_pass as mbp
from jax_markov.kernels import tuning

DSV4 = dict(V=129280, R=256, S=7)
spec = jax.ShapeDtypeStruct


def _specs(B, V, R, S, **dtypes):
  d = dict(base=jnp.bfloat16, emb=jnp.bfloat16, proj=jnp.bfloat16,
           params=jnp.float32, step=jnp.int32, cache=jnp.float32)
  d.update(dtypes)
  shapes = dict(base=(B * S, V), emb=(B, R), proj=(V, R), params=(3, B * S),
                step=(1,), cache=(B * S, V))
  return [spec(shapes[k], d[k]) for k in shapes]


def _lower(B, V, R, S, **kw):
  return mbp.mosaic_block_pass.trace(
      *_specs(B, V, R, S), num_steps=S, num_sms=132, **kw).lower(
          lowering_platforms=("cuda",))


@pytest.fixture(scope="module", autouse=True)
def _mosaic_gpu_available():
  if mbp.plgpu is None:
    pytest.skip(f"Pallas Mosaic GPU not importable: {mbp._IMPORT_ERROR}")
  try:
    _lower(128, 512, 64, 2, block_v=64)
  except (ImportError, NotImplementedError) as e:
    pytest.skip(f"Mosaic GPU lowering unavailable here: {e!r}")


@pytest.mark.parametrize("B,V,R,S,kw", [
    pytest.param(256, DSV4["V"], DSV4["R"], DSV4["S"], {}, id="dsv4-B256"),
    pytest.param(64, DSV4["V"], DSV4["R"], DSV4["S"], {}, id="dsv4-B64"),
    pytest.param(256, DSV4["V"], DSV4["R"], DSV4["S"], dict(block_v=64),
                 id="dsv4-B256-v64"),
    pytest.param(64, DSV4["V"], DSV4["R"], DSV4["S"], dict(block_v=64),
                 id="dsv4-B64-v64"),
    pytest.param(192, DSV4["V"], DSV4["R"], DSV4["S"],
                 dict(block_b=192, block_v=64), id="dsv4-B192-three"),
    pytest.param(136, DSV4["V"], DSV4["R"], DSV4["S"],
                 dict(block_b=192, block_v=64, chunk=16),
                 id="dsv4-B136-three-partial-folded"),
    pytest.param(128, 1024, 128, 3, {}, id="small"),
    pytest.param(64, 512, 64, 2, dict(block_v=64), id="tiny-v64"),
])
def test_lowers_to_one_mosaic_gpu_call(B, V, R, S, kw):
  text = _lower(B, V, R, S, **kw).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
  # The cache is an aliased operand: updated in place, not copied.
  assert "output_operand_alias" in text
  assert "tf.aliasing_output = 0" in text  # the jit donates the cache


@pytest.mark.parametrize("rows", [False, True])
def test_stages_left_out_for_timing_lower(rows):
  """_omit (benchmarks/block_step.py --omit) lowers with each stage left
  out, and refuses a stage it does not know."""
  B, V, R, S, N = 128, 1024, 128, 3, 500
  specs = _specs(B, V, R, S)
  kw = {}
  if rows:
    specs = specs[:5] + [spec((N, V), jnp.float32), spec((B * S,), jnp.int32)]
    kw = dict(num_cache_rows=N)
  for omit in (("mma",), ("cache",), ("stats",), mbp.OMITTABLE):
    text = mbp.mosaic_block_pass.trace(
        *specs, num_steps=S, num_sms=132, _omit=omit, **kw).lower(
            lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
  with pytest.raises(ValueError, match="omit must be a subset"):
    mbp.mosaic_block_pass.trace(*specs, num_steps=S, num_sms=132,
                                _omit=("select",), **kw)


def test_output_shapes():
  B, V, R, S = 64, DSV4["V"], DSV4["R"], DSV4["S"]
  for block_v in (64, 128):
    out = jax.eval_shape(
        lambda *a, bv=block_v: mbp.mosaic_block_pass(
            *a, num_steps=S, block_v=bv, num_sms=132), *_specs(B, V, R, S))
    nb = V // block_v
    chex.assert_shape(out, [(B * S, V), (nb, B), (nb, B), (nb, B)])
    chex.assert_type(out, [jnp.float32, jnp.float32, jnp.float32, jnp.int32])


@pytest.mark.parametrize("B,block_b", [(256, 128), (128, 64)])
def test_experiment_knobs_lower(B, block_b):
  """_base_slots and _multicast (benchmarks/block_step.py) lower at the
  DeepSeek-V4 shape into state rows; a cluster needs more than one request
  tile to be one, and refuses what it cannot split."""
  V, R, S = DSV4["V"], DSV4["R"], DSV4["S"]
  specs = _specs(B, V, R, S) + [spec((B * S,), jnp.int32)]
  for kw in (dict(_base_slots=3), dict(_multicast=True),
             dict(_multicast=True, _base_slots=3)):
    text = mbp.mosaic_block_pass.trace(
        *specs, num_steps=S, num_sms=132, block_b=block_b, block_v=64,
        **kw).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
  p = mbp.plan((B * S, V), (B, R), (V, R), num_steps=S, block_b=block_b,
               block_v=64, max_concurrent_steps=None, num_sms=132,
               row_stores="warp", multicast=True)
  assert p.cluster == B // block_b and p.grid_v * p.cluster <= 132
  with pytest.raises(ValueError, match="base_slots"):
    mbp.plan((B * S, V), (B, R), (V, R), num_steps=S, block_b=block_b,
             block_v=64, max_concurrent_steps=None, num_sms=132, base_slots=1)
  with pytest.raises(ValueError, match="multicast"):
    mbp.plan((16 * 64 * S, V), (16 * 64, R), (V, R), num_steps=S,
             block_b=64, block_v=64, max_concurrent_steps=None, num_sms=132,
             multicast=True)


def test_plan_fits_shared_memory():
  for B, block_v, row_stores in itertools.product((64, 128, 256), (64, 128),
                                                 mbp.ROW_STORES):
    p = mbp.plan((B * 7, DSV4["V"]), (B, 256), (DSV4["V"], 256),
                 num_steps=7, block_b=None, block_v=block_v,
                 max_concurrent_steps=None, num_sms=132,
                 row_stores=row_stores)
    assert p.smem_bytes <= mbp.SMEM_LIMIT
    assert p.stages >= 2
    assert p.num_b_tiles * p.grid_v <= 132


@pytest.mark.parametrize("B,V,R,S,kw,dtypes,match", [
    (60, 1024, 128, 3, {}, {}, "multiple of block_b"),  # B < 64
    (98, 1024, 128, 3, {}, {}, "multiple of 4"),  # [NB, B] TMA rows
    (96, 1024, 128, 3, {}, {}, None),  # a partial last tile: fine
    (96, 1024, 128, 3, dict(_multicast=True), {}, "partial"),
    (256, 1024, 128, 3, dict(block_b=128), {}, None),  # fine: control
    (128, 1000, 128, 3, {}, {}, "multiple of block_v"),
    (64, 1152, 128, 3, dict(block_v=64), {}, None),  # fine: control
    (64, 1088, 128, 3, dict(block_v=64), {}, "multiple of 128"),
    (128, 1024, 96, 3, {}, {}, "multiple of 64"),
    (128, 1024, 128, 3, dict(block_v=32), {}, "block_v must be"),
    (128, 1024, 128, 3, dict(block_b=256), {}, "block_b must be"),
    (128, 1024, 128, 3, dict(max_concurrent_steps=1), {}, ">= 2"),
    (128, 1024, 128, 3, dict(row_stores="dma"), {}, "row_stores must be"),
    (128, 1024, 256, 3, dict(max_concurrent_steps=16), {}, "shared memory"),
    (128, 1024, 128, 3, {}, dict(base=jnp.float32), "base must be bfloat16"),
    (128, 1024, 128, 3, {}, dict(emb=jnp.float32), "emb must be bfloat16"),
    (128, 1024, 128, 3, {}, dict(proj=jnp.float16), "proj must be bfloat16"),
    (128, 1024, 128, 3, {}, dict(params=jnp.bfloat16), "params must be float32"),
    (128, 1024, 128, 3, {}, dict(step=jnp.uint32), "step must be int32"),
    (128, 1024, 128, 3, {}, dict(cache=jnp.bfloat16), "cache must be float32"),
])
def test_validation(B, V, R, S, kw, dtypes, match):
  specs = _specs(B, V, R, S, **dtypes)
  run = lambda: mbp.mosaic_block_pass.trace(*specs, num_steps=S, num_sms=132,
                                            **kw)
  if match is None:
    run()
  else:
    with pytest.raises(ValueError, match=match):
      run()


@pytest.mark.parametrize("which,shape,match", [
    ("base", (7 * 128 + 1, 1024), r"base must be \[B \* S, V\]"),
    ("emb", (64, 128), r"emb must be \[B, R\]"),
    ("proj", (1024, 64), r"proj must be \[V, R\]"),
    ("params", (3, 64), r"params must be float32\[3, 896\]"),
    ("step", (2,), r"step must be int32\[1\]"),
    ("cache", (7 * 128, 512), r"cache must be float32\[896, 1024\]"),
])
def test_validation_shapes(which, shape, match):
  names = ["base", "emb", "proj", "params", "step", "cache"]
  specs = _specs(128, 1024, 128, 7)
  i = names.index(which)
  specs[i] = spec(shape, specs[i].dtype)
  with pytest.raises(ValueError, match=match):
    mbp.mosaic_block_pass.trace(*specs, num_steps=7, num_sms=132)


def test_new_cache_is_an_output():
  """cache=None (the sampler's step 0): the cache is a kernel output, written
  only at the step's rows; no operand aliased, no memset."""
  specs = _specs(128, 1024, 128, 3)[:5]
  lowered = mbp.mosaic_block_pass.trace(
      *specs, None, num_steps=3, num_sms=132).lower(
          lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
  assert "output_operand_alias" not in text
  chex.assert_shape(lowered.out_info[0], (3 * 128, 1024))


@pytest.mark.parametrize("row_stores,B,block_v", [
    ("warp", 128, 128), ("warp", 64, 64), ("tma", 128, 128)])
def test_state_rows_lower_and_alias_the_cache(row_stores, B, block_v):
  """cache_rows: the cache [N, V] is aliased (updated in place) and stored
  one row at a time; a cache_rows without a cache is refused."""
  V, R, S, N = 1024, 128, 3, 500
  specs = _specs(B, V, R, S)[:5] + [spec((N, V), jnp.float32),
                                    spec((B * S,), jnp.int32)]
  lowered = mbp.mosaic_block_pass.trace(
      *specs, num_steps=S, num_cache_rows=N, num_sms=132, block_v=block_v,
      row_stores=row_stores).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
  assert "output_operand_alias" in text
  chex.assert_shape(lowered.out_info[0], (N, V))
  with pytest.raises(ValueError, match="cache must be float32"):
    mbp.mosaic_block_pass.trace(*specs, num_steps=S, num_sms=132)
  with pytest.raises(ValueError, match="needs the cache"):
    mbp.mosaic_block_pass.trace(*specs[:5], None, specs[6], num_steps=S,
                                num_cache_rows=N, num_sms=132)


@pytest.mark.parametrize("B,block_b,block_v,rows", [
    (64, 64, 64, True), (64, 64, 128, True), (256, 128, 64, True),
    (136, 64, 64, False), (136, 64, 64, True), (200, 128, 64, False)])
def test_store_warpgroup_lowers(B, block_b, block_v, rows):
  """store_warpgroup where rows are stored by warp (state rows, a partial
  last tile): four warpgroups, two staging tiles a consumer where they fit
  (fewer proj chunks in flight for them), within shared memory; the kernel
  lowers at the DeepSeek-V4 shape and differs from the one without."""
  V, R, S = DSV4["V"], DSV4["R"], DSV4["S"]
  kw = dict(num_steps=S, block_b=block_b, block_v=block_v,
            max_concurrent_steps=None, num_sms=132, row_stores="warp",
            state_rows=rows)
  off = mbp.plan((B * S, V), (B, R), (V, R), **kw)
  on = mbp.plan((B * S, V), (B, R), (V, R), store_warpgroup=True, **kw)
  assert on.warp_rows and on.store_wg and on.num_wgs == 4
  assert not off.store_wg and off.num_wgs == 3
  assert on.smem_bytes <= mbp.SMEM_LIMIT and on.stages >= 2
  assert on.out_slots in (1, 2) and on.stages <= off.stages
  # Two staging tiles a consumer where two proj chunks still fit beside
  # them (at block_v = 128 and 64-request tiles they do not).
  if mbp.smem_bytes(on.block_b, on.cta_v, R, block_v, 2, 2, "warp",
                    halves=on.halves, store_wg=True) <= mbp.SMEM_LIMIT:
    assert on.out_slots == 2
  specs = _specs(B, V, R, S)
  if rows:
    specs = specs + [spec((B * S,), jnp.int32)]
  texts = [mbp.mosaic_block_pass.trace(
      *specs, num_steps=S, num_sms=132, block_b=block_b, block_v=block_v,
      store_warpgroup=w).lower(lowering_platforms=("cuda",)).as_text()
           for w in (False, True)]
  for text in texts:
    assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
  assert texts[0] != texts[1]


def test_store_warpgroup_plans_fit_everywhere_they_apply():
  """Every plan with store_warpgroup (B = 64-516 in steps of 4, both tile
  sizes, both block widths, R = 128-512, state rows or dense): within
  shared memory with at least two proj chunks in flight, a store
  warpgroup exactly where rows are stored by warp, never more chunks or
  fewer staging slots than without it where it applies, and the plan
  without it otherwise unchanged."""
  V = DSV4["V"]
  for B, bb, bv, R, rows in itertools.product(
      range(64, 520, 4), (64, 128), (64, 128), (128, 256, 512),
      (False, True)):
    kw = dict(num_steps=7, block_b=bb, block_v=bv, max_concurrent_steps=None,
              num_sms=132, row_stores="warp", state_rows=rows)
    shapes = ((B * 7, V), (B, R), (V, R))
    try:
      off = mbp.plan(*shapes, **kw)
    except ValueError:
      with pytest.raises(ValueError):
        mbp.plan(*shapes, store_warpgroup=True, **kw)
      continue
    on = mbp.plan(*shapes, store_warpgroup=True, **kw)
    assert on.store_wg == on.warp_rows == off.warp_rows
    assert on.smem_bytes <= mbp.SMEM_LIMIT and on.stages >= 2
    if on.store_wg:
      assert on.num_wgs == on.consumers + 2 and on.stages <= off.stages
      assert on.out_slots >= off.out_slots
    else:
      assert on == off


def test_store_warpgroup_is_ignored_where_tma_stores_the_cache():
  """Dense full tiles store the cache by TMA (asynchronous already): the
  option changes nothing there, nor with the cache stores left out; it
  refuses multicast, and is for method='mosaic' only."""
  V, R, S, B = DSV4["V"], DSV4["R"], DSV4["S"], 256
  kw = dict(num_steps=S, block_b=128, block_v=64, max_concurrent_steps=None,
            num_sms=132, row_stores="warp")
  for extra in (dict(state_rows=False), dict(state_rows=True, omit=("cache",))):
    p = mbp.plan((B * S, V), (B, R), (V, R), store_warpgroup=True,
                 **kw, **extra)
    assert not p.store_wg and p.num_wgs == 3
    assert p == mbp.plan((B * S, V), (B, R), (V, R), **kw, **extra)
  texts = [_lower(B, V, R, S, block_b=128, block_v=64,
                  store_warpgroup=w).as_text() for w in (False, True)]
  assert texts[0] == texts[1]
  with pytest.raises(ValueError, match="multicast"):
    mbp.plan((B * S, V), (B, R), (V, R), store_warpgroup=True,
             state_rows=True, multicast=True, **kw)
  with pytest.raises(ValueError, match="store_warpgroup is for"):
    jm.KernelConfig(method="fused", store_warpgroup=True)
  jm.KernelConfig(method="mosaic", block_b=128, block_v=64,
                  store_warpgroup=True)  # fine


# --- the sampler with method="mosaic" --------------------------------------

def _sampler_text(B, V, R, S, config):
  from jax_markov import sampler
  head = jm.MarkovHead(embed=spec((V, R), jnp.bfloat16),
                       proj=spec((V, R), jnp.bfloat16))
  traced = sampler._sample_draft.trace(
      spec((B, S, V), jnp.bfloat16), spec((B,), jnp.int32), head,
      spec((B,), jnp.float32), spec((B, 2), jnp.uint32), spec((B, S), jnp.int32),
      config=config, interpret=False)
  return traced.lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("B,block_b,block_v,fold", [
    (256, 128, 64, True), (256, 128, 64, False), (64, 64, 128, True)])
def test_sampler_lowers_mosaic_block_pass_and_triton_select(B, block_b,
                                                           block_v, fold):
  config = jm.KernelConfig(method="mosaic", block_b=block_b, block_v=block_v,
                           num_stages=0, fold_chunks=fold)
  text = _sampler_text(B, DSV4["V"], DSV4["R"], DSV4["S"], config)
  # Two kernel variants (step 0 makes the cache, the others update it),
  # called once a step; a select pass (a Triton call a step) follows each,
  # after a chunk pass (one Triton call in a function called once a step)
  # unless the block pass folds the chunk statistics (block_b = 128).
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 2
  chunk_passes = 0 if fold and block_b == 128 else DSV4["S"]
  assert text.count("call @chunk_pass(") == chunk_passes
  assert text.count("__gpu$xla.gpu.triton") == DSV4["S"] + (
      0 if chunk_passes == 0 else 1)


@pytest.mark.parametrize("gpu", ["NVIDIA H200", "NVIDIA H100 80GB HBM3"])
def test_jax_calls_take_the_native_runtimes_mosaic_plan_from_256(
    monkeypatch, gpu):
  """A JAX call on Hopper takes what the native runtime plans from the 256
  bucket up: the table's Mosaic entry where the batch fills its tiles (B =
  192, 256) and the rule's partial last tile at B = 136 and 200 (12% under
  the Triton pass in a JAX call on an H100, perf-notes change 58 (b));
  below the bucket (B = 128, 64) the Triton pass, as the custom call's host
  cost outweighs the gain there (change 37 (d)); B = 137 (not a multiple
  of 4) the Triton pass."""
  from jax_markov import sampler
  monkeypatch.setattr(sampler, "_mosaic_available", lambda: True)
  monkeypatch.setattr(sampler, "_gpu_name", lambda: gpu)
  V, R = DSV4["V"], DSV4["R"]
  pick = lambda B, method=None: sampler._config(  # noqa: SLF001
      None, method, B, V, R, interpret=False, hopper=True)
  assert pick(256).method == pick(192).method == "mosaic"
  for B in (136, 200, 192, 256):
    assert pick(B) == tuning.choose(None, B, V, R, interpret=False,
                                    hopper=True, gpu=gpu)
  for B in (136, 200):
    assert (pick(B).method, pick(B).block_b, pick(B).partial_tiles) == (
        "mosaic", 64, True)
  for B in (64, 128, 137):
    assert pick(B) == tuning.choose(None, B, V, R, interpret=False)
    assert pick(B).method == "fused"
  assert pick(128, "mosaic").method == "mosaic"


@pytest.mark.parametrize("B", [136, 200])
def test_sampler_lowers_the_rules_partial_tiles(B):
  """B = 136 and 200 fill neither request tile: the rule's choice (64
  requests a tile, the last partial, select_embed) lowers in the JAX
  sampler as a Mosaic pass and a chunk pass a step (perf-notes change 57)."""
  config = tuning.choose(None, B, DSV4["V"], DSV4["R"], interpret=False,
                         hopper=True)
  assert (config.method, config.block_b, config.partial_tiles) == (
      "mosaic", 64, True)
  text = _sampler_text(B, DSV4["V"], DSV4["R"], DSV4["S"], config)
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 2
  assert text.count("call @chunk_pass(") == DSV4["S"]


def test_sampler_with_select_embed_gathers_at_step_0_only():
  """select_embed: the select pass writes the next step's embeddings, so
  XLA gathers embed rows for step 0 only (the anchors') instead of every
  step; the kernels launched are the same."""
  def lowered(fetch):
    config = jm.KernelConfig(method="mosaic", block_b=128, block_v=64,
                             num_stages=0, select_embed=fetch)
    return _sampler_text(256, DSV4["V"], DSV4["R"], DSV4["S"], config)
  plain, fetched = lowered(False), lowered(True)
  for call in ("stablehlo.custom_call @mosaic_gpu", "__gpu$xla.gpu.triton"):
    assert fetched.count(call) == plain.count(call)
  assert plain.count("stablehlo.gather") == DSV4["S"] * fetched.count(
      "stablehlo.gather")


@pytest.mark.parametrize("B,V,block_v,sms,chunk,nc", [
    (256, DSV4["V"], 64, 132, 31, 66),   # 2020 blocks in 66 runs of 31
    (256, DSV4["V"], 128, 132, 16, 64),  # 1010 in 64 runs of 16 (the last 2)
    (256, 151936, 64, 132, 36, 66),      # the rule's shapes: 2374 blocks
    (256, 200064, 64, 132, 48, 66),      # and 3126, the last run shorter
    (128, 1024, 64, 132, 1, 16),         # fewer blocks than SMs
    (384, 4096, 128, 100, 1, 32),
])
def test_folded_chunk_statistics_lower(B, V, block_v, sms, chunk, nc):
  """chunk: each worker a contiguous run of blocks, three more [NC, B]
  outputs after the block statistics; default_chunk keeps one CTA an SM."""
  R, S = 128, 2
  assert mbp.default_chunk(B, V, block_b=128, block_v=block_v,
                           num_sms=sms) == chunk
  p = mbp.plan((B * S, V), (B, R), (V, R), num_steps=S, block_b=128,
               block_v=block_v, max_concurrent_steps=None, num_sms=sms,
               chunk=chunk)
  assert p.grid_v == nc and p.chunk == chunk
  assert p.grid_v * (B // 128) <= sms
  lowered = mbp.mosaic_block_pass.trace(
      *_specs(B, V, R, S), num_steps=S, num_sms=sms, block_v=block_v,
      chunk=chunk).lower(lowering_platforms=("cuda",))
  assert lowered.as_text().count("stablehlo.custom_call @mosaic_gpu") == 1
  shapes = [(x.shape, x.dtype) for x in lowered.out_info]
  nb = V // block_v
  assert shapes == [((B * S, V), jnp.float32), ((nb, B), jnp.float32),
                    ((nb, B), jnp.float32), ((nb, B), jnp.int32),
                    ((nc, B), jnp.float32), ((nc, B), jnp.float32),
                    ((nc, B), jnp.int32)]


def test_folded_chunk_statistics_refuse_what_they_do_not_run():
  B, V, R, S = 128, 1024, 128, 2
  specs = _specs(B, V, R, S)
  kw = dict(num_steps=S, num_sms=132)
  with pytest.raises(ValueError, match="block_b = 128"):
    mbp.mosaic_block_pass.trace(*specs, block_b=64, chunk=4, **kw)
  with pytest.raises(ValueError, match="chunk must be >= 1"):
    mbp.mosaic_block_pass.trace(*specs, chunk=0, **kw)
  with pytest.raises(ValueError, match="omit cannot drop 'stats'"):
    mbp.mosaic_block_pass.trace(*specs, chunk=4, _omit=("stats",), **kw)
  with pytest.raises(ValueError, match="multicast"):
    mbp.mosaic_block_pass.trace(*_specs(256, V, R, S), chunk=4,
                                _multicast=True, **kw)
  # epilogue_chunk: only where the config folds and its tile allows it.
  cfg = jm.KernelConfig(method="mosaic", block_b=128, block_v=64)
  assert mbp.epilogue_chunk(cfg, 256, DSV4["V"], 132) == 31
  assert mbp.epilogue_chunk(jm.KernelConfig(
      method="mosaic", block_b=128, block_v=64, fold_chunks=False),
      256, DSV4["V"], 132) is None
  assert mbp.epilogue_chunk(jm.KernelConfig(
      method="mosaic", block_b=64, block_v=64), 64, DSV4["V"], 132) is None


def test_config_validation():
  with pytest.raises(ValueError, match="method='mosaic' needs"):
    jm.KernelConfig(method="mosaic", block_b=16, block_v=64)
  with pytest.raises(ValueError, match="method='mosaic' needs"):
    jm.KernelConfig(method="mosaic", block_b=128, block_v=256)
  with pytest.raises(ValueError, match="needs"):
    jm.KernelConfig(method="mosaic", block_b=128, block_v=64, select="tail")
  with pytest.raises(ValueError, match="needs"):
    jm.KernelConfig(method="mosaic", block_b=128, block_v=64,
                    select="persistent")
  jm.KernelConfig(method="mosaic", block_b=64, block_v=128)  # fine


def test_choose_picks_mosaic_only_where_asked_and_it_runs():
  V, R = DSV4["V"], DSV4["R"]
  choose = tuning.choose
  assert choose(None, 256, V, R, interpret=False, hopper=True).method == "mosaic"
  # Not on other GPUs, not in the interpreter, not where the last request
  # tile cannot be partial (B not a multiple of 4), not at batches the
  # table leaves to Triton.
  assert choose(None, 256, V, R, interpret=False).method == "fused"
  assert choose(None, 256, V, R, interpret=True, hopper=True).method == "fused"
  assert choose(None, 137, V, R, interpret=False, hopper=True).method == "fused"
  assert choose(None, 202, V, R, interpret=False, hopper=True).method == "fused"
  assert choose(None, 64, V, R, interpret=False, hopper=True).method == "fused"
  assert choose(None, 72, V, R, interpret=False, hopper=True).method == "fused"
  # B = 136 and 200 fill neither tile: the rule's 64-request tiles with a
  # partial last one, as many proj chunks in flight as fit, on the H100 too
  # (perf-notes change 57).
  for b in (136, 200):
    for gpu in (None, "NVIDIA H100 80GB HBM3", "NVIDIA H200"):
      rule = choose(None, b, V, R, interpret=False, hopper=True, gpu=gpu)
      assert (rule.method, rule.block_b, rule.num_stages, rule.partial_tiles,
              rule.select_embed) == ("mosaic", 64, 0, True, True)
    assert choose(None, b, V, R, interpret=False).method == "fused"
  # B = 192 does not fill 128-request tiles: the rule's 64-request tiles.
  b192 = choose(None, 192, V, R, interpret=False, hopper=True,
                gpu="NVIDIA H100 80GB HBM3")
  assert (b192.method, b192.block_b, b192.num_stages) == ("mosaic", 64, 4)
  # Shapes without entries: the Mosaic rule from B = 256 where B fills
  # 128-request tiles and V and R tile by 64 (4 proj chunks in flight on
  # the H100, as its entry at the DeepSeek-V4 shape).
  for vocab in (151936, 200064):
    rule = choose(None, 256, vocab, R, interpret=False, hopper=True)
    assert (rule.method, rule.block_b, rule.block_v, rule.num_stages) == (
        "mosaic", 128, 64, 0)
    h100 = choose(None, 512, vocab, R, interpret=False, hopper=True,
                  gpu="NVIDIA H100 80GB HBM3")
    assert (h100.method, h100.num_stages) == ("mosaic", 4)
    b192 = choose(None, 192, vocab, R, interpret=False, hopper=True)
    assert (b192.method, b192.block_b) == ("mosaic", 64)
    b200 = choose(None, 200, vocab, R, interpret=False, hopper=True)
    assert (b200.method, b200.block_b, b200.partial_tiles) == (
        "mosaic", 64, True)
    assert choose(None, 256, vocab, R, interpret=False).method == "fused"
    assert choose(None, 128, vocab, R, interpret=False,
                  hopper=True).method == "fused"
  assert choose(None, 256, 151936 + 32, R, interpret=False,
                hopper=True).method == "fused"
  asked = choose("mosaic", 192, 4096, 128, interpret=False)
  assert (asked.method, asked.block_b) == ("mosaic", 64)
  with pytest.raises(ValueError, match="no interpreter"):
    choose("mosaic", 256, V, R, interpret=True)


@pytest.mark.parametrize("B,block_b,kw", [
    (72, 128, {}), (72, 64, {}), (136, 128, dict(chunk=8)), (200, 64, {}),
    (200, 128, dict(chunk=4))])
@pytest.mark.parametrize("rows", [False, True])
def test_partial_last_tile_lowers(B, block_b, kw, rows):
  """B not a multiple of block_b: the last tile's consumers take 64-row
  windows ending at row B (plan: partial, one TMA box a consumer), and store
  their cache rows by warp, also in the dense layout (the [B * S, V] cache,
  not the [B, S, V] view). The full-tile modules are unchanged by this path
  (compared without debug locations when it was added; perf-notes change
  50)."""
  V, R, S, N = 1024, 128, 3, 700
  p = mbp.plan((B * S, V), (B, R), (V, R), num_steps=S, block_b=block_b,
               block_v=64, max_concurrent_steps=None, num_sms=132,
               row_stores="warp", chunk=kw.get("chunk"))
  assert p.partial and p.num_b_tiles == -(-B // block_b)
  assert p.halves == block_b // 64
  specs = _specs(B, V, R, S)
  if rows:
    specs = specs[:5] + [spec((N, V), jnp.float32), spec((B * S,), jnp.int32)]
    kw = dict(kw, num_cache_rows=N)
  text = mbp.mosaic_block_pass.trace(
      *specs, num_steps=S, num_sms=132, block_b=block_b, block_v=64,
      **kw).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
  assert f"tensor<{N if rows else B * S}x{V}xf32>" in text
  if not rows:  # no [B, S, V] view of the cache
    assert f"tensor<{B}x{S}x{V}xf32>" not in text
  with pytest.raises(ValueError, match="partial"):
    mbp.plan((B * S, V), (B, R), (V, R), num_steps=S, block_b=block_b,
             block_v=64, max_concurrent_steps=None, num_sms=132,
             row_stores="tma")


@pytest.mark.parametrize("vocab", [DSV4["V"], 151936, 200064])
def test_choose_gives_a_mosaic_plan_for_every_batch_it_picks(vocab):
  """Every batch 1..520 on a Hopper GPU (H100, H200, unnamed): where
  choose() picks the Mosaic pass, mosaic_block_pass.plan accepts the batch
  with that tile (the native runtime's state rows), a partial last tile
  only where the config says so; without Hopper, never the Mosaic pass."""
  R = DSV4["R"]
  for gpu in (None, "NVIDIA H100 80GB HBM3", "NVIDIA H200"):
    for B in range(1, 521):
      cfg = tuning.choose(None, B, vocab, R, interpret=False, hopper=True,
                          gpu=gpu)
      assert tuning.choose(None, B, vocab, R, interpret=False,
                           gpu=gpu).method != "mosaic"
      if cfg.method != "mosaic":
        continue
      assert cfg.partial_tiles == (B % cfg.block_b != 0), (gpu, B, cfg)
      p = mbp.plan((B * 7, vocab), (B, R), (vocab, R), num_steps=7,
                   block_b=cfg.block_b, block_v=cfg.block_v,
                   max_concurrent_steps=cfg.num_stages or None, num_sms=132,
                   row_stores="warp")
      assert p.partial == cfg.partial_tiles


def test_partial_tiles_entries():
  """A Mosaic entry with partial_tiles is chosen for a batch its tiles do
  not divide (B > 64 and a multiple of 4); without it, or for other
  batches, the Triton entry runs; partial_tiles is for Mosaic only."""
  V, R = DSV4["V"], DSV4["R"]
  kw = dict(interpret=False, hopper=True)
  key = ("mosaic", V, R, 128)
  cfg = jm.KernelConfig(method="mosaic", block_b=128, block_v=64,
                        num_stages=4, partial_tiles=True)
  old = tuning.TABLE.get(key)
  tuning.TABLE[key] = cfg
  tuning.choose.cache_clear()
  try:
    assert tuning.choose(None, 72, V, R, **kw) == cfg
    assert tuning.choose(None, 128, V, R, **kw) == cfg
    assert tuning.choose(None, 74, V, R, **kw).method == "fused"  # % 4
    assert tuning.choose(None, 72, V, R, interpret=False).method == "fused"
    tuning.TABLE[key] = dataclasses.replace(cfg, partial_tiles=False)
    tuning.choose.cache_clear()
    assert tuning.choose(None, 72, V, R, **kw).method == "fused"
  finally:
    if old is None:
      tuning.TABLE.pop(key, None)
    else:
      tuning.TABLE[key] = old
    tuning.choose.cache_clear()
  with pytest.raises(ValueError, match="partial_tiles"):
    jm.KernelConfig(method="fused", partial_tiles=True)


def test_per_gpu_entries():
  """GPU_TABLE's entry for the named GPU's family wins over TABLE's (the
  H100 runs 4 proj chunks in flight at B = 256, the H200 TABLE's 8); other
  GPUs, no name, other shapes and batches keep TABLE's."""
  V, R = DSV4["V"], DSV4["R"]
  assert tuning.gpu_family("NVIDIA H100 80GB HBM3") == "h100"
  assert tuning.gpu_family("NVIDIA H200") == "h200"
  assert tuning.gpu_family("NVIDIA A100-SXM4-80GB") is None
  # Grace Hopper by its memory: HBM3e as the H200, HBM3 as the H100.
  assert tuning.gpu_family("NVIDIA GH200 144G HBM3e") == "h200"
  assert tuning.gpu_family("NVIDIA GH200 480GB") == "h100"
  assert tuning.gpu_family(None) is None
  table = tuning.TABLE[("mosaic", V, R, 256)]
  kw = dict(interpret=False, hopper=True)
  h100 = tuning.choose(None, 256, V, R, gpu="NVIDIA H100 80GB HBM3", **kw)
  assert h100 == tuning.GPU_TABLE[("h100", "mosaic", V, R, 256)]
  assert (h100.method, h100.num_stages) == ("mosaic", 4)
  assert tuning.choose("mosaic", 256, V, R, interpret=False,
                       gpu="NVIDIA H100 80GB HBM3") == h100
  assert tuning.choose(None, 256, V, R, gpu="NVIDIA GH200 480GB",
                       **kw) == h100
  for gpu in ("NVIDIA H200", None, "NVIDIA GH200 144G HBM3e"):
    assert tuning.choose(None, 256, V, R, gpu=gpu, **kw) == table
  # Not on the CPU, and not for the Triton entries.
  assert tuning.choose(None, 256, V, R, interpret=True, hopper=True,
                       gpu="NVIDIA H100 80GB HBM3").method == "fused"
  assert tuning.choose(None, 64, V, R, gpu="NVIDIA H100 80GB HBM3",
                       **kw) == tuning.TABLE[("fused", V, R, 64)]
  # B = 128: the Mosaic pass on the H200 only (change 49); B = 72 in that
  # bucket does not fill its 128-request tile and takes the Triton entry
  # with its remainder rows.
  h200 = tuning.choose(None, 128, V, R, gpu="NVIDIA H200", **kw)
  assert h200 == tuning.GPU_TABLE[("h200", "mosaic", V, R, 128)]
  assert (h200.method, h200.block_b, h200.num_stages) == ("mosaic", 128, 4)
  for gpu in ("NVIDIA H100 80GB HBM3", None):
    assert tuning.choose(None, 128, V, R, gpu=gpu, **kw).method == "fused"
  b72 = tuning.choose(None, 72, V, R, gpu="NVIDIA H200", **kw)
  assert (b72.method, b72.block_b, b72.remainder_b) == ("fused", 64, 16)


@pytest.mark.parametrize("store_warpgroup", [False, True])
def test_sampler_lowers_mosaic_into_state_rows(store_warpgroup):
  from jax_markov import sampler
  B, S, V, R, N = 256, DSV4["S"], DSV4["V"], DSV4["R"], 300
  config = jm.KernelConfig(method="mosaic", block_b=128, block_v=64,
                           store_warpgroup=store_warpgroup)
  head = jm.MarkovHead(embed=spec((V, R), jnp.bfloat16),
                       proj=spec((V, R), jnp.bfloat16))
  traced = sampler._sample_draft_into_donated.trace(
      spec((N, S, V), jnp.float32), spec((B, S, V), jnp.bfloat16),
      spec((B,), jnp.int32), head, spec((N,), jnp.float32),
      spec((N, 2), jnp.uint32), spec((B, S), jnp.int32),
      spec((B, S), jnp.int32), config=config, interpret=False)
  text = traced.lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("stablehlo.custom_call @mosaic_gpu") == 1
  # The block pass folds the chunk statistics: no chunk pass.
  assert text.count("call @chunk_pass(") == 0
  assert text.count("__gpu$xla.gpu.triton") == S


def test_sampler_refuses_mosaic_where_it_does_not_run():
  args = make_problem(64, 2, 256, 64, seed=3)
  config = jm.KernelConfig(method="mosaic", block_b=64, block_v=64)
  with pytest.raises(ValueError, match="Hopper GPU only"):
    jm.sample_draft(*args, config=config, interpret=True)
  with pytest.raises(ValueError, match="greedy_draft"):
    jm.greedy_draft(*args[:3], config=config, interpret=True)


# --- the select pass on block-major statistics (interpreter) ----------------

def test_select_pass_reads_block_major_statistics():
  """stats_major="block" ([NB, B], the Mosaic GPU block pass's layout) draws
  bit for bit the tokens of the same statistics [B, NB]: the same arithmetic,
  only the loads differ. Sampled and greedy draws (every third), rows with
  -inf blocks, a NaN block and a +inf."""
  from jax_markov.kernels.block_pass import block_pass
  from jax_markov.kernels.select_pass import select_pass
  B, S, V, R = 8, 2, 256, 16
  base, anchor, head, _, _, _ = make_problem(B, S, V, R, jnp.float32, seed=5)
  base = base.reshape(B * S, V).at[1, :100].set(-jnp.inf)
  base = base.at[2, 32:64].set(jnp.nan).at[3, 200].set(jnp.inf)
  rng = jax.random.PRNGKey(0)
  t = jnp.where(jnp.arange(B * S) % 3 == 0, 0.0, 0.8)
  params = jnp.stack([jnp.where(t > 0, 1 / jnp.maximum(t, 1e-9), 1.0),
                      (t == 0).astype(jnp.float32),
                      jax.random.uniform(rng, (B * S,))])
  config = jm.KernelConfig(method="fused", block_b=16, block_v=32, block_k=16)
  for s in range(S):
    step = jnp.full((1,), s, jnp.int32)
    cache, bmax, bsum, barg = block_pass(
        base, (head.embed, head.proj, anchor), step, params, None, None, None,
        config=config, num_steps=S, num_cache_rows=B * S, interpret=True)
    chex.assert_shape(bmax, (B, V // 32))
    a = select_pass(bmax, bsum, barg, cache, step, params, config=config,
                    num_steps=S, interpret=True)
    b = select_pass(bmax.T, bsum.T, barg.T, cache, step, params,
                    config=config, num_steps=S, stats_major="block",
                    interpret=True)
    rows = jnp.arange(B) * S + s
    np.testing.assert_array_equal(np.asarray(a)[rows], np.asarray(b)[rows])
  with pytest.raises(ValueError, match="stats_major"):
    select_pass(bmax, bsum, barg, cache, step, params, config=config,
                num_steps=S, stats_major="column", interpret=True)


@pytest.mark.parametrize("stats_major,chunked", [("request", False),
                                                 ("block", False),
                                                 ("block", True)])
def test_select_pass_writes_the_next_embeddings(stats_major, chunked):
  """With embed (KernelConfig.select_embed), the select pass also writes
  each request's drawn token's row of embed to emb, in place where emb is
  given, and draws the tokens it draws without: what embed_rows gathers
  for the next step; R not a power of two. Bad operands are refused."""
  from jax_markov.kernels.block_pass import block_pass
  from jax_markov.kernels.chunk_pass import chunk_pass
  from jax_markov.kernels.embed_rows import embed_rows
  from jax_markov.kernels.select_pass import select_pass
  B, S, V, R = 6, 2, 256, 24
  base, anchor, head, _, _, _ = make_problem(B, S, V, R, jnp.bfloat16, seed=9)
  base = base.reshape(B * S, V)
  t = jnp.where(jnp.arange(B * S) % 3 == 0, 0.0, 1.0)
  params = jnp.stack([jnp.where(t > 0, 1 / jnp.maximum(t, 1e-9), 1.0),
                      (t == 0).astype(jnp.float32),
                      jax.random.uniform(jax.random.PRNGKey(3), (B * S,))])
  config = jm.KernelConfig(method="fused", block_b=16, block_v=32, block_k=16)
  step = jnp.zeros((1,), jnp.int32)
  cache, bmax, bsum, barg = block_pass(
      base, (head.embed, head.proj, anchor), step, params, None, None, None,
      config=config, num_steps=S, num_cache_rows=B * S, interpret=True)
  stats = (bmax, bsum, barg)
  kw = dict(config=config, num_steps=S, interpret=True)
  if stats_major == "block":
    stats = tuple(x.T for x in stats)
    kw["stats_major"] = "block"
    if chunked:
      kw.update(chunk_stats=chunk_pass(*stats, chunk=4, interpret=True),
                chunk=4)
  plain = select_pass(*stats, cache, step, params, **kw)
  emb0 = jnp.zeros((B, R), jnp.bfloat16)
  tokens, emb = select_pass(*stats, cache, step, params, embed=head.embed,
                            emb=emb0, **kw)
  chex.assert_shape(emb, (B, R))
  chex.assert_type(emb, jnp.bfloat16)
  rows = jnp.arange(B) * S
  np.testing.assert_array_equal(np.asarray(tokens)[rows],
                                np.asarray(plain)[rows])
  # What embed_rows gathers at step 1 from these tokens.
  gathered = embed_rows(head.embed, anchor, tokens, jnp.ones((1,), jnp.int32),
                        num_steps=S, interpret=True)
  np.testing.assert_array_equal(np.asarray(emb, np.float32),
                                np.asarray(gathered, np.float32))
  np.testing.assert_array_equal(
      np.asarray(emb, np.float32),
      np.asarray(head.embed[np.asarray(tokens)[rows]], np.float32))
  # Without emb: a new buffer, the same rows.
  _, fresh = select_pass(*stats, cache, step, params, embed=head.embed, **kw)
  np.testing.assert_array_equal(np.asarray(fresh, np.float32),
                                np.asarray(emb, np.float32))
  with pytest.raises(ValueError, match="needs embed"):
    select_pass(*stats, cache, step, params, emb=emb0, **kw)
  with pytest.raises(ValueError, match="embed must be"):
    select_pass(*stats, cache, step, params, embed=head.embed[:V - 1], **kw)
  with pytest.raises(ValueError, match="emb must be"):
    select_pass(*stats, cache, step, params, embed=head.embed,
                emb=emb0.astype(jnp.float32), **kw)


def test_embed_rows_gathers_the_previous_tokens_rows():
  """kernels/embed_rows.py (the native runtime's operand of the Mosaic GPU
  block pass): anchors at step 0, the step before's tokens after; R not a
  power of two."""
  from jax_markov.kernels.embed_rows import embed_rows
  B, S, V, R = 5, 3, 40, 24
  embed = jax.random.normal(jax.random.PRNGKey(1), (V, R)).astype(jnp.bfloat16)
  anchors = jnp.array([3, 0, 39, 7, 7], jnp.int32)
  tokens = jax.random.randint(jax.random.PRNGKey(2), (B * S,), 0, V, jnp.int32)
  for s in range(S):
    out = embed_rows(embed, anchors, tokens, jnp.full((1,), s, jnp.int32),
                     num_steps=S, interpret=True)
    chex.assert_shape(out, (B, R))
    chex.assert_type(out, jnp.bfloat16)
    prev = anchors if s == 0 else tokens.reshape(B, S)[:, s - 1]
    np.testing.assert_array_equal(np.asarray(out, np.float32),
                                  np.asarray(embed[prev], np.float32))


def test_mosaic_launch_lowers_one_call_and_refuses_more():
  """torch_bridge.mosaic_launch.lower: operands traced back to arguments
  through reshapes, the cache result aliased; any XLA op beside the call is
  refused (the native runtime launches the kernel alone)."""
  pytest.importorskip("torch")
  from torch_bridge import mosaic_launch
  specs = _specs(128, 1024, 128, 3)
  run = lambda *a: mbp.mosaic_block_pass(*a, num_steps=3, num_sms=132)
  ir = mosaic_launch.lower(run, *specs, name="t")
  assert ir.operands == (0, 1, 2, 3, 4, 5) and ir.module
  assert ir.results == (None, None, None, 5)
  with pytest.raises(ValueError, match="unsupported operation"):
    mosaic_launch.lower(lambda *a: run(*a)[1] + 1.0, *specs, name="t")
  with pytest.raises(ValueError, match="more than one Mosaic GPU call"):
    mosaic_launch.lower(lambda *a: (run(*a), run(*a)), *specs, name="t")


def test_sample_draft_into_takes_the_tables_mosaic_choice(monkeypatch):
  """sample_draft_into (the state-indexed cache) runs the Mosaic GPU pass
  where sample_draft does: the table's B = 256 entry on a Hopper GPU, bf16,
  no map; with a map it keeps the Triton pass (checked on the CPU: the
  launch is replaced, only the configuration it gets is read)."""
  from jax_markov import sampler
  monkeypatch.setattr(sampler, "_mosaic_available", lambda: True)
  seen = []
  monkeypatch.setattr(sampler, "_sample_draft_into_donated",
                      lambda *a, config, **k: seen.append(config))
  B, S, V, R, N = 256, 2, DSV4["V"], DSV4["R"], 260
  head = jm.MarkovHead(embed=jnp.zeros((V, R), jnp.bfloat16),
                       proj=jnp.zeros((V, R), jnp.bfloat16))
  args = (jnp.zeros((N, S, V), jnp.float32), jnp.zeros((B, S, V), jnp.bfloat16),
          jnp.zeros(B, jnp.int32), head, jnp.ones(N, jnp.float32),
          np.arange(N, dtype=np.int64), jnp.zeros((B, S), jnp.int32),
          jnp.zeros((B, S), jnp.int32))
  jm.sample_draft_into(*args, interpret=False, check_values=False)
  assert seen[-1].method == "mosaic"
  jm.sample_draft_into(*args[:1], args[1].astype(jnp.float32), *args[2:],
                       interpret=False, check_values=False)
  assert seen[-1].method == "fused"


@pytest.mark.parametrize("B,block_b,rows,kw", [
    (256, 128, False, {}), (256, 128, True, {}), (64, 64, True, {}),
    (136, 64, True, dict(store_warpgroup=True)),
    (256, 128, True, dict(_multicast=True)),
    (192, 192, False, {}), (192, 192, True, {}),
    (136, 192, True, {}), (384, 192, False, dict(chunk=31))])
def test_plan_counts_shared_memory_as_mosaic_lays_it_out(monkeypatch, B,
                                                         block_b, rows, kw):
  """Plan.smem_bytes plus Mosaic GPU's own 2048 bytes is the figure the
  lowering checks against the device's 227 KB (1024-byte aligned buffers
  and the barriers), so a plan never picks proj chunks that do not fit."""
  from jax.experimental.mosaic.gpu import core
  jax.clear_caches()  # an earlier test's lowering would skip the count
  seen = []
  size = core._smem_tree_size  # noqa: SLF001
  monkeypatch.setattr(core, "_smem_tree_size",
                      lambda t: seen.append(size(t)) or seen[-1])
  V, R, S = DSV4["V"], DSV4["R"], DSV4["S"]
  p = mbp.plan((B * S, V), (B, R), (V, R), num_steps=S, block_b=block_b,
               block_v=64, max_concurrent_steps=None, num_sms=132,
               row_stores="warp", state_rows=rows,
               store_warpgroup=kw.get("store_warpgroup", False),
               multicast=kw.get("_multicast", False), chunk=kw.get("chunk"))
  specs = _specs(B, V, R, S)
  extra = {}
  if rows:
    specs = specs[:5] + [spec((B * S + 9, V), jnp.float32),
                         spec((B * S,), jnp.int32)]
    extra = dict(num_cache_rows=B * S + 9)
  mbp.mosaic_block_pass.trace(
      *specs, num_steps=S, num_sms=132, block_b=block_b, block_v=64,
      **extra, **kw).lower(lowering_platforms=("cuda",))
  assert seen == [p.smem_bytes + 2048]
  assert p.smem_bytes <= mbp.SMEM_LIMIT == 227 * 1024 - 2048


def test_three_consumer_plans():
  """block_b = 192: three consumers splitting the rows (one request tile
  from B = 129 to 192), the producer at 40 registers and each consumer at
  152 within the 64K register file, 64 statistics columns only (128 do not
  fit beside 96 KB of embeddings), the narrow staging pitch only where rows
  are stored by warp and it buys a proj chunk; the chunk statistics fold as
  with 128. No store warpgroup (five warpgroups hung on an H100): refused
  where it would apply, ignored where TMA stores the cache."""
  V, R, S = DSV4["V"], DSV4["R"], DSV4["S"]
  kw = dict(num_steps=S, block_b=192, max_concurrent_steps=None, num_sms=132,
            row_stores="warp")
  for B in range(132, 400, 4):
    for rows, swg in itertools.product((False, True), (False, True)):
      if swg and (rows or B % 192):
        with pytest.raises(ValueError, match="store_warpgroup"):
          mbp.plan((B * S, V), (B, R), (V, R), block_v=64, state_rows=rows,
                   store_warpgroup=swg, **kw)
        continue
      p = mbp.plan((B * S, V), (B, R), (V, R), block_v=64, state_rows=rows,
                   store_warpgroup=swg, **kw)
      assert p.consumers == 3 and not p.split_v and p.cta_v == 64
      assert p.num_b_tiles == -(-B // 192) and p.halves == (
          3 if B % 192 else 1)
      assert not p.store_wg and p.num_wgs == 4
      assert p.consumer_registers == 152
      assert 40 * 128 + 3 * 128 * p.consumer_registers <= 65536
      assert p.stages >= 2 and p.smem_bytes <= mbp.SMEM_LIMIT
      assert p.stage_pitch == (mbp.NARROW_PITCH if p.warp_rows
                               else mbp.STAGE_PITCH)
    with pytest.raises(ValueError, match="shared memory"):
      mbp.plan((B * S, V), (B, R), (V, R), block_v=128, **kw)
  # Two-consumer plans keep their pitch and their registers.
  p = mbp.plan((136 * S, V), (136, R), (V, R), num_steps=S, block_b=128,
               block_v=64, max_concurrent_steps=None, num_sms=132,
               row_stores="warp", state_rows=True)
  assert (p.stage_pitch, p.consumer_registers, p.num_wgs) == (
      mbp.STAGE_PITCH, 232, 3)
  assert mbp.default_chunk(192, V, block_b=192, block_v=64) == 16
  cfg = jm.KernelConfig(method="mosaic", block_b=192, block_v=64)
  assert mbp.epilogue_chunk(cfg, 192, V, 132) == 16
  with pytest.raises(ValueError, match="power of two"):
    jm.KernelConfig(method="fused", block_b=192)
  with pytest.raises(ValueError, match="block_b must be one of"):
    mbp.plan((96 * S, V), (96, R), (V, R), num_steps=S, block_b=96,
             block_v=64, max_concurrent_steps=None, num_sms=132)


def test_consumer_registers_fit_the_launch_allocation():
  """setmaxnreg moves registers within the CTA's launch allocation (the
  64K file over its threads, 8 at a time) and an increase waits until
  they are free: every plan's warpgroups fit that allocation (producer and
  store warpgroup at 40), at the counts the GPU ran: 232 with two
  consumers, 216 beside a store warpgroup, 152 with three. Five
  warpgroups (three consumers and a store warpgroup: 96 a thread at
  launch) would leave 128, not the 144 that hung."""
  import dataclasses
  V = DSV4["V"]
  seen = set()
  for B, bb, bv, rows, swg in itertools.product(
      (64, 72, 136, 192, 256), (64, 128, 192), (64, 128), (False, True),
      (False, True)):
    try:
      p = mbp.plan((B * 7, V), (B, 256), (V, 256), num_steps=7, block_b=bb,
                   block_v=bv, max_concurrent_steps=None, num_sms=132,
                   row_stores="warp", state_rows=rows, store_warpgroup=swg)
    except ValueError:
      continue
    others = p.num_wgs - p.consumers
    assert (40 * 128 * others + p.consumer_registers * 128 * p.consumers
            <= p.launch_registers * 128 * p.num_wgs <= 65536)
    seen.add((p.consumers, p.num_wgs, p.consumer_registers))
  assert seen == {(2, 3, 232), (2, 4, 216), (3, 4, 152)}
  p = mbp.plan((136 * 7, V), (136, 256), (V, 256), num_steps=7, block_b=192,
               block_v=64, max_concurrent_steps=None, num_sms=132,
               row_stores="warp", state_rows=True)
  five = dataclasses.replace(p, store_wg=True)
  assert (five.launch_registers, five.consumer_registers) == (96, 128)


@pytest.mark.parametrize("B,kw", [
    (256, dict(block_b=128, block_v=64, chunk=31)),
    (192, dict(block_b=64, block_v=64)),
    (136, dict(block_b=64, block_v=64, store_warpgroup=True)),
])
def test_dependent_launch_waits_after_the_first_tiles_loads_only(B, kw):
  """Built for a dependent launch, the producer issues the first tile's
  base and its first proj chunks (what no kernel of the draft writes),
  then griddepcontrol.wait, then the embeddings; every other warpgroup
  waits before anything else; each signals its dependents after its wait.
  Without it, no griddepcontrol at all. (The jaxpr of the kernel body
  lists each warpgroup's operations in program order.)"""
  S, V, R = DSV4["S"], DSV4["V"], DSV4["R"]
  specs = _specs(B, V, R, S)
  rows = specs[:5] + [spec((B * S, V), jnp.float32),
                      spec((B * S,), jnp.int32)]
  texts = {}
  for dependent in (False, True):
    texts[dependent] = str(jax.make_jaxpr(functools.partial(
        mbp.mosaic_block_pass, num_steps=S, num_sms=132,
        dependent_launch=dependent, **kw))(*rows))
  assert "griddepcontrol" not in texts[False]
  text = texts[True]
  p = mbp.plan((B * S, V), (B, R), (V, R), num_steps=S,
               block_b=kw["block_b"], block_v=kw["block_v"],
               max_concurrent_steps=None, num_sms=132, row_stores="warp",
               state_rows=True, chunk=kw.get("chunk"),
               store_warpgroup=kw.get("store_warpgroup", False))
  # The kernel body's jaxprs by name ("let jaxpr3 = { ... }").
  heads = list(re.finditer(r"let (jaxpr\d*) = ", text))
  blocks = {h.group(1): text[h.end():(heads[k + 1].start()
                                      if k + 1 < len(heads) else None)]
            for k, h in enumerate(heads)}
  # The producer: a branch (num_t > 0) holding the early loads, the wait,
  # the signal, then the num_k embedding loads.
  [producer] = [b for b in blocks.values()
                if "set_max_registers_p[action=decrease] 40" in b
                and "griddepcontrol_wait" in b and "copy_gmem_to_smem" in b]
  wait = producer.index("griddepcontrol_wait")
  assert producer.index("griddepcontrol_launch_dependents") > wait
  assert producer[:wait].count("copy_gmem_to_smem") == 0  # in the branch
  assert producer[wait:].count("copy_gmem_to_smem") == p.num_k * p.halves
  # The branch: one base box a consumer window, min(stages, num_k) chunks,
  # nothing else.
  branches = [name for name in re.findall(r"(jaxpr\d+)\n", producer[:wait])
              if blocks[name].count("copy_gmem_to_smem")
              == p.halves + min(p.stages, p.num_k)]
  assert len(branches) == 1, branches
  assert not re.search(r"barrier_wait|wgmma|griddep|<- ",
                       blocks[branches[0]])
  # Every warpgroup but the producer (which reads the step index, written
  # once before any draft, and branches) waits first thing after setting
  # its registers, then signals: consumers and a store warpgroup.
  firsts = []
  for mark in re.finditer(r"set_max_registers_p\[action=\w+\]", text):
    ops = re.findall(r"griddepcontrol_\w+|barrier_\w+|copy_gmem_to_smem|"
                     r"<- |wgmma|cond\[", text[mark.end():])
    firsts.append(tuple(ops[:2]))
  waits = ("griddepcontrol_wait", "griddepcontrol_launch_dependents")
  assert sorted(firsts) == sorted([("<- ", "cond[")]
                                  + [waits] * (1 + p.store_wg)), firsts
  assert text.count("griddepcontrol_wait") == 2 + p.store_wg
  with pytest.raises(ValueError, match="dependent_launch and multicast"):
    mbp.plan((256 * S, V), (256, R), (V, R), num_steps=S, block_b=128,
             block_v=64, max_concurrent_steps=None, num_sms=132,
             multicast=True, dependent_launch=True)
