"""The native runtime: Pallas kernels lowered to Triton IR, compiled by triton,
launched on torch's stream (torch_bridge/native*.py).

CPU: every bucket's kernels lower for CUDA (the DeepSeek-V4 shape included),
the IR is well formed (triton parses and compiles it to a cubin for sm_90
when the triton package is installed), and the IR cache works. GPU (marked):
eager, captured and ``jm.sample_draft_into`` agree; capture below the bucket;
no allocation across replays; replay on a side stream; the fallback.
"""

import os

import torch_bridge as tb  # first: sets XLA_PYTHON_CLIENT_PREALLOCATE

import chex
import jax
import numpy as np
import pytest
import torch

from jax_markov.kernels.draw_params import ParamsLayout
from torch_bridge import buckets as tbb
from torch_bridge import modes, native, native_plan
from torch_bridge import testing as sd

import jax_markov as jm
from helpers import check_draft, torch_and_jax_gpu

try:
  import triton  # noqa: F401
  _TRITON = True
except ImportError:
  _TRITON = False




_GPU = torch_and_jax_gpu()


def _shape(m, s, v, r, *, dtype=torch.bfloat16, idx64=False):
  words = (("idx", m * s * (2 if idx64 else 1)), ("pos", 2 * m * s),
           ("seeds", 2 * m), ("ids", m * s + 4), ("anchor_idx", 2 * m))
  return native_plan.DraftShape(
      max_num_reqs=m, steps=s, vocab=v, rank=r, vocab_in=v + 5,
      base_dtype=dtype, head_dtype=dtype, temperature_dtype=torch.float32,
      words=words, layout=ParamsLayout(idx_wide=idx64, pos_wide=True))


def _well_formed(ir: native.KernelIR):
  assert ir.ttir.startswith("module"), ir.ttir[:80]
  assert f"tt.func public @{ir.name}(" in ir.ttir
  assert ir.ttir.count("!tt.ptr") >= ir.num_inputs + ir.num_outputs
  assert all(g >= 1 for g in ir.grid) and len(ir.grid) == 3


@pytest.mark.parametrize("m,s,v,r,compile_buckets", [
    (8, 3, 96, 8, (1, 2, 8)),
    # DeepSeek-V4: the tuning table's entries (B = 1 tail select, 64, 256).
    (256, 7, 129280, 256, (1, 64, 256)),
])
def test_every_bucket_lowers_to_triton_ir(tmp_path, m, s, v, r,
                                          compile_buckets):
  cache = native.IRCache(str(tmp_path))
  for bp in tbb.default_buckets(m):
    kernels = native_plan.lower_bucket(_shape(m, s, v, r), bp, cache)
    cfg = native_plan.config(bp, v, r)
    want = {"draw_params", "block_pass"} | (
        set() if cfg.select == "tail" else {"select_pass"})
    assert set(kernels) == want
    for name, (ir, path, names) in kernels.items():
      _well_formed(ir)
      assert len(names) == ir.num_inputs + ir.num_outputs, name
      assert os.path.exists(path)
      if _TRITON and bp in compile_buckets:
        compiled = native.compile_kernel(ir, path, (9, 0))
        assert compiled.asm["cubin"], name
  assert cache.misses > 0 and cache.hits == 0


@pytest.mark.parametrize("greedy,draft_vocab", [(True, None), (False, 40),
                                                (True, 40), (False, 96)])
def test_every_mode_lowers_and_compiles(tmp_path, greedy, draft_vocab):
  """Greedy drafting (no cache) and a reduced draft vocabulary (sampling:
  slots over the target columns; greedy: columns over the draft columns), at
  the tail select's bucket (1) and the select pass's (8)."""
  import dataclasses
  cache = native.IRCache(str(tmp_path))
  shape = dataclasses.replace(_shape(8, 3, 96, 8), greedy=greedy,
                              draft_vocab=draft_vocab)
  mapped = draft_vocab is not None
  for bp in (1, 8):
    kernels = native_plan.lower_bucket(shape, bp, cache)
    assert set(kernels) <= {"draw_params", "block_pass", "select_pass"}
    for name, (ir, path, names) in kernels.items():
      _well_formed(ir)
      assert len(names) == ir.num_inputs + ir.num_outputs, name
      assert ("slots" in names) == (mapped and not greedy and
                                    name == "block_pass")
      assert ("columns" in names) == (mapped and greedy and
                                      name in ("block_pass", "select_pass"))
      if greedy:
        assert "cache" not in names and "params" not in names[:1]
      if _TRITON and bp == 8:
        assert native.compile_kernel(ir, path, (9, 0)).asm["cubin"], name


@pytest.mark.parametrize("bucket,tile", [
    (1, dict(block_b=1, block_v=128, block_k=64, bias_dot="fma",
             num_warps=8, held_blocks=1)),
    (16, dict(block_b=16, block_v=128, block_k=64, bias_dot="mma",
              num_warps=8, held_blocks=1)),
])
def test_persistent_draft_is_planned_as_one_launch(tmp_path, monkeypatch,
                                                   bucket, tile):
  """Where the table picks the persistent draft, a bucket is draw_params and
  one draft pass (its counters bound to the scratch the plan zeroes), sized
  by the multiprocessors given; a reduced vocabulary or greedy drafting runs
  the same entry step by step."""
  import dataclasses
  from jax_markov.kernels import tuning
  cfg = jm.KernelConfig(method="fused", num_stages=2, select="persistent",
                        **tile)
  monkeypatch.setattr(tuning, "choose", lambda *a, **k: cfg)
  cache = native.IRCache(str(tmp_path))
  shape = _shape(256, 7, 129280, 256)
  kernels = native_plan.lower_bucket(shape, bucket, cache, (9, 0), 132)
  assert set(kernels) == {"draw_params", "draft_pass"}
  ir, path, names = kernels["draft_pass"]
  _well_formed(ir)
  assert ir.grid == (132, 1, 1)
  assert names == ["base", "embed", "proj", "anchors", "params", "cache_rows",
                   "cache", "counters", "cache", "block_max", "block_sum",
                   "block_argmax", "tokens", "counters"]
  assert native_plan.stat_rows(shape, bucket) == bucket * 7
  if _TRITON:
    assert native.compile_kernel(ir, path, (9, 0)).asm["cubin"]
  for other in (dataclasses.replace(shape, greedy=True),
                dataclasses.replace(shape, draft_vocab=32768)):
    stepwise = native_plan.lower_bucket(other, bucket, cache, (9, 0), 132)
    assert "draft_pass" not in stepwise and "block_pass" in stepwise
    assert native_plan.stat_rows(other, bucket) == bucket


def test_mosaic_bucket_is_planned(tmp_path):
  """Where the table picks the Mosaic GPU block pass (a Hopper GPU, bf16,
  sampling the full vocabulary), a bucket is draw_params then embed_rows,
  mosaic_block_pass (which also reduces its statistics over chunks of
  blocks) and a block-major select pass on those chunk statistics a step,
  the Mosaic kernel's pointers bound by name (its cache aliased in place);
  without the fold, a chunk pass between them; greedy drafting, a map,
  another dtype or no Hopper keep the Triton block pass."""
  import dataclasses
  pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  cache = native.IRCache(str(tmp_path))
  shape = dataclasses.replace(_shape(256, 7, 129280, 256), mosaic=True)
  kernels = native_plan.lower_bucket(shape, 256, cache, (9, 0), 132)
  assert set(kernels) == {"draw_params", "embed_rows", "mosaic_block_pass",
                          "select_pass"}
  ir, path, names = kernels["mosaic_block_pass"]
  assert path is None and ir.module
  assert names == ["base", "emb", "proj", "params", "step", "cache_rows",
                   "cache", "block_max", "block_sum", "block_argmax",
                   "chunk_max", "chunk_sum", "chunk_argmax", "cache"]
  assert kernels["embed_rows"][2] == ["embed", "anchors", "tokens", "step",
                                      "emb"]
  # The select also writes the next step's embeddings (select_embed, the
  # table's Mosaic entries): emb in place after tokens.
  assert kernels["select_pass"][2] == [
      "block_max", "block_sum", "block_argmax", "cache", "step", "params",
      "cache_rows", "tokens", "chunk_max", "chunk_sum", "chunk_argmax",
      "embed", "emb", "tokens", "emb"]
  # The device's name picks a per-GPU entry (tuning.GPU_TABLE).
  h100 = dataclasses.replace(shape, gpu="NVIDIA H100 80GB HBM3")
  assert native_plan.shape_config(h100, 256).num_stages == 4
  assert native_plan.shape_config(shape, 256).num_stages == 8
  # 2020 blocks in 66 chunks of 31 (one CTA an SM): the scratch holds them.
  cfg = native_plan.shape_config(shape, 256)
  assert native_plan.mosaic_chunks(129280, cfg, 256, 132) == 66
  # Without the fold (or with 64-request tiles): the chunk pass.
  monkey = dataclasses.replace(cfg, fold_chunks=False)
  unfolded = native_plan._lower_mosaic(  # pylint: disable=protected-access
      shape, 256, cache, (9, 0), monkey, {"shape": "unfolded"}, 132)
  assert set(unfolded) == {"embed_rows", "mosaic_block_pass", "chunk_pass",
                           "select_pass"}
  assert unfolded["mosaic_block_pass"][2][7:] == [
      "block_max", "block_sum", "block_argmax", "cache"]
  assert unfolded["chunk_pass"][2] == ["block_max", "block_sum",
                                       "block_argmax", "chunk_max",
                                       "chunk_sum", "chunk_argmax"]
  assert native_plan.mosaic_chunks(129280, monkey, 256, 132) == 64
  # Without select_embed: the plain select (embed_rows every step).
  assert cfg.select_embed
  gather = dataclasses.replace(cfg, select_embed=False)
  gathered = native_plan._lower_mosaic(  # pylint: disable=protected-access
      shape, 256, cache, (9, 0), gather, {"shape": "gather"}, 132)
  assert gathered["select_pass"][2] == [
      "block_max", "block_sum", "block_argmax", "cache", "step", "params",
      "cache_rows", "tokens", "chunk_max", "chunk_sum", "chunk_argmax",
      "tokens"]
  assert gathered["embed_rows"][2] == kernels["embed_rows"][2]
  # Dependent launches reach the Mosaic bucket only where opted in (the
  # next test).
  assert not native_plan.bucket_dependent_launch(shape, 256, True)
  # A vocabulary with no entry takes the Mosaic rule at 256, not at 128.
  v152k = dataclasses.replace(_shape(256, 7, 151936, 256), mosaic=True,
                              gpu="NVIDIA H100 80GB HBM3")
  rule = native_plan.shape_config(v152k, 256)
  assert (rule.method, rule.block_b, rule.num_stages) == ("mosaic", 128, 4)
  assert native_plan.mosaic_chunks(151936, rule, 256, 132) == 66
  assert native_plan.shape_config(v152k, 128).method == "fused"
  # Buckets the table leaves to Triton, and shapes Mosaic does not run.
  assert "block_pass" in native_plan.lower_bucket(shape, 64, cache, (9, 0))
  for other in (dataclasses.replace(shape, greedy=True),
                dataclasses.replace(shape, draft_vocab=32768),
                dataclasses.replace(shape, base_dtype=torch.float16),
                dataclasses.replace(shape, mosaic=False)):
    assert native_plan.shape_config(other, 256).method == "fused"


def test_mosaic_allowed(monkeypatch):
  pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  monkeypatch.delenv("JAX_MARKOV_MOSAIC", raising=False)
  assert native_plan.mosaic_allowed((9, 0))  # on where it runs
  assert not native_plan.mosaic_allowed((8, 0))
  monkeypatch.setenv("JAX_MARKOV_MOSAIC", "1")
  assert native_plan.mosaic_allowed((9, 0))
  assert not native_plan.mosaic_allowed((8, 0))
  assert not native_plan.mosaic_allowed((10, 0))  # no WGMMA on Blackwell
  monkeypatch.setenv("JAX_MARKOV_MOSAIC", "0")
  assert not native_plan.mosaic_allowed((9, 0))
  monkeypatch.setenv("JAX_MARKOV_MOSAIC", "yes")
  with pytest.raises(ValueError, match="JAX_MARKOV_MOSAIC"):
    native_plan.mosaic_allowed((9, 0))
  # The hook's argument wins over the variable; asked for, it must run.
  assert native_plan.mosaic_allowed((9, 0), True)
  assert not native_plan.mosaic_allowed((9, 0), False)
  with pytest.raises(ValueError, match="mosaic=True needs a Hopper GPU"):
    native_plan.mosaic_allowed((8, 9), True)


def test_hook_mosaic_argument():
  pytest.importorskip("torch")
  for value in (None, True, False):
    assert tb.FusedMarkovSampler(4, 64, 8, "bfloat16", runtime="jax",
                                 mosaic=value).mosaic is value
  with pytest.raises(ValueError, match="mosaic must be"):
    tb.FusedMarkovSampler(4, 64, 8, "bfloat16", runtime="jax", mosaic=1)


def test_dependent_launch_reaches_the_mosaic_bucket(tmp_path, monkeypatch):
  """Opted in ($JAX_MARKOV_MOSAIC_DEPENDENT_LAUNCH=1; off by default, not
  yet run on a GPU), with dependent_launch a Mosaic GPU bucket builds its
  select pass and
  draw_params to wait (launched with the attribute) and its Mosaic block
  pass to wait too (a module of its own, cached apart); embed_rows and
  the chunk pass stay plain. (Which launches get a programmatic edge, and
  that the captured draft is the plain one bit for bit: the GPU tests.)"""
  import dataclasses
  pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  cache = native.IRCache(str(tmp_path))
  shape = dataclasses.replace(_shape(256, 7, 129280, 256), mosaic=True)
  monkeypatch.setenv("JAX_MARKOV_MOSAIC_DEPENDENT_LAUNCH", "0")
  off = native_plan.lower_bucket(shape, 256, cache, (9, 0), 132,
                                 dependent_launch=True)
  monkeypatch.setenv("JAX_MARKOV_MOSAIC_DEPENDENT_LAUNCH", "1")
  assert native_plan.bucket_dependent_launch(shape, 256, True)
  assert not native_plan.bucket_dependent_launch(shape, 256, False)
  early = native_plan.lower_bucket(shape, 256, cache, (9, 0), 132,
                                   dependent_launch=True)
  plain = native_plan.lower_bucket(shape, 256, cache, (9, 0), 132)
  assert set(early) == set(plain)
  for name in ("draw_params", "select_pass"):
    assert early[name][0].ttir.count("griddepcontrol.wait") == 1, name
    assert "griddepcontrol" not in plain[name][0].ttir, name
    if _TRITON:
      # Compiled (sm_90, no GPU needed): launched with the attribute, and
      # no global load before the wait (the select pass writes the next
      # embeddings and reads the statistics only after it).
      ir, path, _ = early[name]
      kernel = native.compile_kernel(ir, path, (9, 0), launch_pdl=True)
      assert kernel.metadata.launch_pdl
      ptx = kernel.asm["ptx"]
      wait = ptx.index("griddepcontrol.wait")
      assert "ld.global" not in ptx[:wait], name
      assert "st.global" not in ptx[:wait], name
  assert "griddepcontrol" not in early["embed_rows"][0].ttir
  assert early["embed_rows"][0].ttir == plain["embed_rows"][0].ttir
  assert b"griddepcontrol" in early["mosaic_block_pass"][0].module
  assert b"griddepcontrol" not in plain["mosaic_block_pass"][0].module
  # Not opted in: the plain kernels.
  for name in off:
    assert (off[name][0].module == plain[name][0].module
            if name == "mosaic_block_pass"
            else off[name][0].ttir == plain[name][0].ttir), name
  monkeypatch.setenv("JAX_MARKOV_MOSAIC_DEPENDENT_LAUNCH", "yes")
  with pytest.raises(ValueError, match="MOSAIC_DEPENDENT_LAUNCH"):
    native_plan.bucket_dependent_launch(shape, 256, True)


def test_walking_programs_in_the_native_runtime(tmp_path, monkeypatch):
  """A bucket whose table entry walks the vocabulary (block_programs) at the
  DeepSeek-V4 shape: the native runtime lowers its block pass to a grid of
  block_programs programs, built for a dependent launch (one wait, before
  any global access), and triton compiles it for sm_90 (on the CPU) with
  the plain tile's occupancy at 32 x 128 (ptxas: at most 168 registers, 3
  programs a multiprocessor)."""
  import dataclasses
  from jax_markov.kernels import tuning
  walk = dataclasses.replace(
      tuning.choose("fused", 32, 129280, 256, interpret=False),
      block_programs=396)
  monkeypatch.setitem(tuning.TABLE, ("fused", 129280, 256, 32), walk)
  tuning.choose.cache_clear()
  try:
    shape = _shape(32, 7, 129280, 256)
    assert native_plan.shape_config(shape, 32) == walk
    kernels = native_plan.lower_bucket(shape, 32,
                                       native.IRCache(str(tmp_path)), (9, 0),
                                       132, dependent_launch=True)
  finally:
    tuning.choose.cache_clear()
  ir, path, _ = kernels["block_pass"]
  assert ir.grid == (396, 1, 1)
  assert ir.ttir.count("griddepcontrol.wait") == 1
  if _TRITON:
    from benchmarks import occupancy
    kernel = native.compile_kernel(ir, path, (9, 0), launch_pdl=True)
    ptx = kernel.asm["ptx"]
    assert "ld.global" not in ptx[:ptx.index("griddepcontrol.wait")]
    usage = occupancy.ptxas_usage(ptx, str(tmp_path / "walk.ptx"))
    assert usage["registers"] <= 168 and not usage["spill_stores"], usage


class _FakeDriver:
  """The three driver functions programmatic_dependency calls, as C
  callbacks with their CUDA 12.3 signatures (so the arguments cross
  ctypes as they would to the driver): a capture in ``status`` with the
  pending ``nodes`` of the given ``types``; records what the update sets."""

  def __init__(self, status=1, nodes=(0xAB0,), types=(0,), error=0):
    import ctypes
    from torch_bridge import mosaic_launch as ml
    self.status, self.types, self.error = status, dict(zip(nodes, types)), error
    self.nodes = (ctypes.c_void_p * len(nodes))(*nodes)
    self.updates = []
    sig = ml.DRIVER_SIGNATURES

    def info(stream, status, cid, graph, deps, edges, count):
      del graph, edges
      self.stream = stream
      status[0] = self.status
      cid[0] = 7
      deps[0] = ctypes.cast(self.nodes, ctypes.POINTER(ctypes.c_void_p))
      count[0] = len(self.nodes)
      return self.error

    def node_type(node, kind):
      kind[0] = self.types[node]
      return 0

    def update(stream, deps, edges, count, flags):
      self.updates.append((stream, deps[0], edges[0].from_port,
                           edges[0].to_port, edges[0].type, count, flags))
      return 0

    self.fns = {
        "cuStreamGetCaptureInfo": ctypes.CFUNCTYPE(*sig[
            "cuStreamGetCaptureInfo"])(info),
        "cuGraphNodeGetType": ctypes.CFUNCTYPE(*sig[
            "cuGraphNodeGetType"])(node_type),
        "cuStreamUpdateCaptureDependencies": ctypes.CFUNCTYPE(*sig[
            "cuStreamUpdateCaptureDependencies"])(update),
    }


def test_programmatic_dependency_sets_one_programmatic_edge(monkeypatch):
  """Under an active capture whose one pending node is a kernel, the
  stream's dependency becomes that node through a programmatic edge (from
  the programmatic port, CU_STREAM_SET_CAPTURE_DEPENDENCIES); anything else
  (no capture, two pending nodes, a memset node, no driver) changes
  nothing, and a failing driver call raises. The driver is faked by C
  callbacks with the driver's signatures (the GPU tests use the real one)."""
  from torch_bridge import mosaic_launch as ml
  fake = _FakeDriver()
  monkeypatch.setattr(ml, "_driver", lambda: fake.fns)
  assert ml.programmatic_dependency(0x5000)
  assert fake.stream == 0x5000
  assert fake.updates == [(0x5000, 0xAB0, 1, 0, 1, 1, 1)]
  for kw in (dict(status=0), dict(status=2), dict(nodes=(1, 2), types=(0, 0)),
             dict(types=(8,))):
    fake = _FakeDriver(**kw)
    monkeypatch.setattr(ml, "_driver", lambda f=fake: f.fns)
    assert not ml.programmatic_dependency(0x5000), kw
    assert not fake.updates, kw
  fake = _FakeDriver(error=900)
  monkeypatch.setattr(ml, "_driver", lambda: fake.fns)
  with pytest.raises(RuntimeError, match="cuStreamGetCaptureInfo"):
    ml.programmatic_dependency(0x5000)
  monkeypatch.setattr(ml, "_driver", lambda: None)
  assert not ml.programmatic_dependency(0x5000)


@pytest.mark.parametrize("greedy,draft_vocab", [(False, None), (True, None),
                                                (False, 40)])
def test_dependent_launch_is_built_into_the_step_kernels(tmp_path, greedy,
                                                         draft_vocab):
  """With dependent_launch, a select-pass bucket's draw_params and block
  and select passes wait for the kernels before them (then let the next
  start) once, after the block pass's base load (the select pass with
  early_dependents lets the next start first); compiled, triton launches
  them with the attribute. Without it, or in a tail-select bucket (B = 1),
  no wait and no attribute; the two are cached apart."""
  import dataclasses
  cache = native.IRCache(str(tmp_path))
  shape = dataclasses.replace(_shape(8, 3, 96, 8), greedy=greedy,
                              draft_vocab=draft_vocab)
  for bp in (1, 8):  # the tail select, the select pass
    early = native_plan.lower_bucket(shape, bp, cache, (9, 0),
                                     dependent_launch=True)
    plain = native_plan.lower_bucket(shape, bp, cache, (9, 0))
    assert set(early) == set(plain)
    assert set(early) <= set(native_plan.DEPENDENT_LAUNCH_KERNELS)
    used = native_plan.bucket_dependent_launch(shape, bp, True)
    assert used == (native_plan.shape_config(shape, bp).select == "pass")
    assert used == (bp == 8)
    for name, (ir, path, _) in early.items():
      assert "griddepcontrol" not in plain[name][0].ttir, name
      if not used:
        assert ir.ttir == plain[name][0].ttir, name
        continue
      assert ir.ttir.count("griddepcontrol.wait") == 1, name
      assert path != plain[name][1]
      if _TRITON:
        kernel = native.compile_kernel(ir, path, (9, 0), launch_pdl=True)
        assert kernel.metadata.launch_pdl
        ptx = kernel.asm["ptx"]
        wait = ptx.index("griddepcontrol.wait")
        signal = ptx.index("griddepcontrol.launch_dependents")
        # The select pass signals first where the tile has early_dependents
        # (the rule's, above B = 1); every other kernel after its wait.
        early = (name == "select_pass"
                 and native_plan.shape_config(shape, bp).early_dependents)
        assert (signal < wait) == early, name
        # Nothing the draft's kernels write is read before the wait: the
        # block pass reads only the step table and base there, the others
        # no global memory at all.
        if name == "block_pass":
          assert "ld.global" in ptx[:wait]
        else:
          assert "ld.global" not in ptx[:wait], name
        assert not native.compile_kernel(
            plain[name][0], plain[name][1], (9, 0)).metadata.launch_pdl


@pytest.mark.parametrize("early_proj", [1, 4])
def test_early_proj_loads_come_before_the_wait(tmp_path, monkeypatch,
                                               early_proj):
  """With early_proj, the block pass's first proj chunks load before its
  dependent-launch wait (they do not depend on the previous token): the
  compiled kernel issues more global loads ahead of the wait than the same
  tile without. Needs triton (PTX, no GPU)."""
  import dataclasses
  if not _TRITON:
    pytest.skip("needs triton to compile the kernel")
  shape = _shape(64, 3, 1024, 256)
  base = native_plan.shape_config(shape, 64)
  loads = {}
  for early in (0, early_proj):
    cfg = dataclasses.replace(base, proj_l2_rows=0, early_proj=early)
    monkeypatch.setattr(native_plan, "shape_config", lambda *_, c=cfg: c)
    cache = native.IRCache(str(tmp_path / str(early)))
    ir, path, _ = native_plan.lower_bucket(shape, 64, cache, (9, 0),
                                           dependent_launch=True)["block_pass"]
    ptx = native.compile_kernel(ir, path, (9, 0), launch_pdl=True).asm["ptx"]
    head = ptx[:ptx.index("griddepcontrol.wait")]
    loads[early] = head.count("ld.global") + head.count("cp.async")
  assert loads[early_proj] > loads[0], loads


def _ptxas_registers(ptx: str, path) -> int:
  """Registers a thread of a PTX kernel for sm_90a, by triton's ptxas."""
  import re  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import triton  # pylint: disable=g-import-not-at-top
  ptxas = os.path.join(os.path.dirname(triton.__file__),
                       "backends", "nvidia", "bin", "ptxas")
  if not os.path.exists(ptxas):
    pytest.skip("this triton has no ptxas of its own")
  path.write_text(ptx)
  out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(path), "-o",
                        os.devnull], capture_output=True, text=True, check=True)
  return int(re.search(r"Used (\d+) registers", out.stderr).group(1))


def test_l2_hints_keep_the_tiles_registers(tmp_path, monkeypatch):
  """l2_hints="stream" puts an L2 evict_first policy on base's loads and the
  cache's stores of the B = 64 tile and costs no register and no shared
  memory: ptxas counts the registers of the tile without hints, and
  triton the same shared memory, where proj_l2_rows, whose two pipelined
  rank loops one branch picks, takes more of both (at DeepSeek-V4: 176
  registers against 168 and 144 KB against 72 KB, one program a
  multiprocessor against three: the B = 64 loss of docs/perf-notes.md
  change 54). Needs triton (PTX, no GPU)."""
  import dataclasses
  if not _TRITON:
    pytest.skip("needs triton to compile the kernel")
  shape = _shape(64, 3, 1024, 256)
  base = dataclasses.replace(native_plan.shape_config(shape, 64),
                             early_proj=0, prefetch_proj=0,
                             prefetch_programs=0)
  ptxs, regs, smem = {}, {}, {}
  for name, cfg in (("none", base),
                    ("stream", dataclasses.replace(base, l2_hints="stream")),
                    ("rows", dataclasses.replace(base, proj_l2_rows=256))):
    monkeypatch.setattr(native_plan, "shape_config", lambda *_, c=cfg: c)
    cache = native.IRCache(str(tmp_path / name))
    ir, path, _ = native_plan.lower_bucket(
        shape, 64, cache, (9, 0), dependent_launch=True)["block_pass"]
    kernel = native.compile_kernel(ir, path, (9, 0), launch_pdl=True)
    ptxs[name], smem[name] = kernel.asm["ptx"], kernel.metadata.shared
    regs[name] = _ptxas_registers(ptxs[name], tmp_path / f"{name}.ptx")
  assert "evict_first" not in ptxs["none"]
  assert "createpolicy.fractional.L2::evict_first" in ptxs["stream"]
  assert (regs["stream"], smem["stream"]) == (regs["none"], smem["none"])
  assert regs["rows"] > regs["none"], regs
  assert smem["rows"] > smem["none"], smem


def test_prefetch_loads_come_before_the_wait_in_the_first_programs(
    tmp_path, monkeypatch):
  """With prefetch_proj, the block pass's first proj chunk loads before
  its dependent-launch wait, predicated on the program's launch index
  (prefetch_programs), and nothing of it is held through the rank loop:
  the registers a thread are those of the tile without it (ptxas's count
  is the kernel's peak, the loop's). Built without a dependent launch (the
  JAX path), the kernel is the tile without prefetch, TTIR for TTIR. Needs
  triton (PTX, no GPU)."""
  import dataclasses
  if not _TRITON:
    pytest.skip("needs triton to compile the kernel")
  shape = _shape(64, 3, 1024, 256)
  base = dataclasses.replace(native_plan.shape_config(shape, 64),
                             early_proj=0, prefetch_proj=0,
                             prefetch_programs=0)
  heads, regs, ttirs = {}, {}, {}
  for name, cfg in (("plain", base),
                    ("prefetch", dataclasses.replace(
                        base, prefetch_proj=1, prefetch_programs=396))):
    monkeypatch.setattr(native_plan, "shape_config", lambda *_, c=cfg: c)
    for dependent in (True, False):
      cache = native.IRCache(str(tmp_path / f"{name}{dependent}"))
      ir, path, _ = native_plan.lower_bucket(
          shape, 64, cache, (9, 0), dependent_launch=dependent)["block_pass"]
      if not dependent:
        ttirs[name] = ir.ttir
        continue
      kernel = native.compile_kernel(ir, path, (9, 0), launch_pdl=True)
      ptx = kernel.asm["ptx"]
      heads[name] = ptx[:ptx.index("griddepcontrol.wait")]
      regs[name] = _ptxas_registers(ptx, tmp_path / f"{name}.ptx")
  assert (heads["prefetch"].count("ld.global")
          > heads["plain"].count("ld.global")), heads
  assert "396" in heads["prefetch"]  # the launch-index bound
  assert regs["prefetch"] == regs["plain"], regs
  strip = lambda t: "\n".join(l.split(" loc(")[0] for l in t.splitlines()
                              if not l.startswith("#loc"))
  assert strip(ttirs["prefetch"]) == strip(ttirs["plain"])


def test_early_dependents_signal_before_the_select_waits(tmp_path,
                                                         monkeypatch):
  """With early_dependents the select pass lets the next kernel launch
  before its wait; without, after it; the block pass signals after its wait
  either way (what makes the early start safe: kernels/dependent_launch.py).
  Needs triton (PTX, no GPU)."""
  import dataclasses
  if not _TRITON:
    pytest.skip("needs triton to compile the kernel")
  shape = _shape(64, 3, 1024, 256)
  for early in (False, True):
    cfg = dataclasses.replace(native_plan.shape_config(shape, 64),
                              early_dependents=early)
    monkeypatch.setattr(native_plan, "shape_config", lambda *_, c=cfg: c)
    kernels = native_plan.lower_bucket(
        shape, 64, native.IRCache(str(tmp_path / str(early))), (9, 0),
        dependent_launch=True)
    for name in ("select_pass", "block_pass"):
      ir, path, _ = kernels[name]
      ptx = native.compile_kernel(ir, path, (9, 0), launch_pdl=True).asm["ptx"]
      first = (ptx.index("griddepcontrol.launch_dependents")
               < ptx.index("griddepcontrol.wait"))
      assert first == (early and name == "select_pass"), (name, early)


def test_dependent_launch_choice(monkeypatch):
  use = native_plan.use_dependent_launch
  monkeypatch.delenv("JAX_MARKOV_DEPENDENT_LAUNCH", raising=False)
  assert use(True, (9, 0)) and use(True, (10, 0))
  # By default wherever the GPU has them.
  assert use(None, (9, 0)) and use(None, (10, 0)) and not use(None, (8, 0))
  assert not use(False, (9, 0))
  monkeypatch.setenv("JAX_MARKOV_DEPENDENT_LAUNCH", "0")
  assert not use(None, (9, 0)) and use(True, (9, 0))
  monkeypatch.setenv("JAX_MARKOV_DEPENDENT_LAUNCH", "1")
  assert use(None, (9, 0))
  with pytest.raises(ValueError, match="capability"):
    use(None, (8, 0))
  monkeypatch.setenv("JAX_MARKOV_DEPENDENT_LAUNCH", "yes")
  with pytest.raises(ValueError, match="JAX_MARKOV_DEPENDENT_LAUNCH"):
    use(None, (9, 0))
  monkeypatch.delenv("JAX_MARKOV_DEPENDENT_LAUNCH")
  with pytest.raises(ValueError, match="capability"):
    use(True, (8, 6))
  with pytest.raises(ValueError, match="dependent_launch"):
    tb.FusedMarkovSampler(8, 96, 8, "bfloat16", runtime="jax",
                          dependent_launch="yes")


def test_dependent_launch_is_refused_in_the_interpreter():
  from jax_markov.kernels import block_pass, select_pass
  B, S, V, R = 2, 3, 64, 8
  f32, i32 = jax.numpy.float32, jax.numpy.int32
  z = lambda *shape, dtype=f32: jax.numpy.zeros(shape, dtype)
  cfg = jm.KernelConfig(method="fused", block_b=2, block_v=32, block_k=8,
                        bias_dot="fma")
  with pytest.raises(ValueError, match="interpreter"):
    block_pass.block_pass(z(B * S, V), (z(V, R), z(V, R), z(B, dtype=i32)),
                          z(1, dtype=i32), z(3, B * S), config=cfg,
                          num_steps=S, num_cache_rows=B * S,
                          dependent_launch=True, interpret=True)
  with pytest.raises(ValueError, match="interpreter"):
    select_pass.select_pass(z(B, 2), z(B, 2), z(B, 2, dtype=i32),
                            z(B * S, V), z(1, dtype=i32), z(3, B * S),
                            config=cfg, num_steps=S, dependent_launch=True,
                            interpret=True)


def test_ir_cache_hits_and_keys(tmp_path):
  cache = native.IRCache(str(tmp_path))
  shape = _shape(4, 2, 64, 8)
  first = native_plan.lower_bucket(shape, 2, cache)
  misses = cache.misses
  again = native_plan.lower_bucket(shape, 2, native.IRCache(str(tmp_path)))
  assert {k: v[0] for k, v in first.items()} == {k: v[0]
                                                 for k, v in again.items()}
  assert {k: v[1] for k, v in first.items()} == {k: v[1]
                                                 for k, v in again.items()}
  assert cache.misses == misses
  # A different layout (int64 state rows) is a different kernel.
  other = native_plan.lower_bucket(_shape(4, 2, 64, 8, idx64=True), 2, cache)
  assert other["draw_params"][1] != first["draw_params"][1]
  assert cache.misses > misses


def test_lower_kernel_refuses_two_kernels():
  with pytest.raises(RuntimeError, match="one pallas_call"):
    native.lower_kernel(lambda x: x + 1, jax.ShapeDtypeStruct((4,), "float32"))


def test_runtime_choice_is_said(caplog):
  spec = sd.SpeculatorDouble(max_num_reqs=4, num_steps=2, vocab=32, rank=4)
  with caplog.at_level("INFO", logger="torch_bridge"):
    sampler = tb.FusedMarkovSampler(4, 32, 4, torch.float32)
  ok, why = native.available()
  assert sampler.runtime == ("native" if ok else "jax")
  assert sampler.runtime in caplog.text and sampler.runtime_reason
  with pytest.raises(ValueError, match="runtime"):
    tb.FusedMarkovSampler(4, 32, 4, torch.float32, runtime="xla")
  if not ok:
    with pytest.raises(RuntimeError, match="cannot run here"):
      tb.FusedMarkovSampler(4, 32, 4, torch.float32, runtime="native")
  del spec


# ----------------------------------------------------------------------------
# GPU
# ----------------------------------------------------------------------------

gpu = [pytest.mark.gpu,
       pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU for torch and JAX")]


def _sampler(spec, **kw):
  w2 = spec.model.model.markov_head.markov_w2.weight
  return tb.FusedMarkovSampler(spec.max_num_reqs, spec.vocab, w2.shape[1],
                               w2.dtype, runtime="native", **kw)


def _captured(call) -> "torch.cuda.CUDAGraph":
  """A CUDA graph of ``call()`` (which must return True), captured on a
  side stream."""
  graph = torch.cuda.CUDAGraph()
  stream = torch.cuda.Stream()
  stream.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(stream):
    with torch.cuda.graph(graph, stream=stream):
      assert call()
  torch.cuda.synchronize()
  return graph


def _snapshot(spec):
  return spec.draft_tokens.clone(), spec.draft_logits.values.clone()


def _agrees_with_jm(spec, n, hidden, tokens, cache, cache0, *,
                    max_checked=8):
  """The draft against the contract and against jm.sample_draft_into.

  Step by step with teacher forcing (helpers.check_draft): logits = base +
  bias of the draft's own previous token within the float32 bound, and each
  token the inverse CDF at jm.draft_uniforms away from boundaries, for the
  first max_checked requests. The kernels are compiled by triton here and by
  XLA's Triton in jm: a 1-ulp difference can move a draw across a CDF
  boundary at a large V, after which the chains legitimately differ, so
  equality with jm is asserted only at the small vocabularies.
  """
  x = spec.inputs(n, hidden)
  idx = x["idx"]
  valid = idx >= 0
  k = min(n, max_checked)
  steps = torch.arange(idx.shape[1]).expand_as(idx)
  rows = torch.where(valid, idx, 0)
  logits = cache.cpu()[rows, steps][:k].numpy()
  tok = tokens.cpu()[:n, :idx.shape[1]][:k].numpy().astype(np.int32)
  seeds = x["seeds"][rows[:k].reshape(-1)].numpy()
  u = np.asarray(jm.draft_uniforms(
      seeds, torch.clamp(x["positions"][:k], min=0).reshape(-1, 1).numpy()))
  temp = x["temperature"][rows[:k]].numpy()
  temp = np.where(valid[:k].numpy(), temp, 0.0)
  head = jm.MarkovHead(x["w1"].float().numpy(), x["w2"].float().numpy())
  check_draft(tok, logits, x["base"][:k].float().numpy(),
              x["anchors"][:k].numpy(), head, temp, u.reshape(k, -1),
              rows=valid[:k].numpy())
  if spec.vocab <= 1024:
    want_tokens, want_cache = sd.jm_sample_draft_into(cache0.cpu(), x, "gpu")
    np.testing.assert_array_equal(tokens.cpu()[:n][valid], want_tokens[valid])
    np.testing.assert_allclose(cache.cpu(), want_cache, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("m,s,v,r,dtype,calls", [
    (8, 3, 96, 8, torch.float32, (5, 8, 1)),
    (8, 3, 130, 8, torch.bfloat16, (6, 3)),
    (256, 7, 129280, 256, torch.bfloat16, (1, 64, 256)),
])
def test_gpu_eager_captured_and_jm_agree(m, s, v, r, dtype, calls):
  _eager_captured_and_jm_agree(m, s, v, r, dtype, calls)


def test_gpu_engine_batch_sizes_agree():
  """Buckets at an engine's CUDA-graph batch sizes, DeepSeek-V4 shape: B =
  72 (a 64-request tile and one of 8 rows), B = 136 (on Hopper the Mosaic
  pass's 64-request tiles, the last partial: perf-notes change 57) and B =
  192 (the Mosaic pass on 64-request tiles on Hopper, the Triton pass
  elsewhere) draft the contract's draft, eager and captured; a call of 130
  requests pads the 136 bucket."""
  _eager_captured_and_jm_agree(256, 7, 129280, 256, torch.bfloat16,
                               (72, 136, 130, 192), buckets=(72, 136, 192))


@pytest.mark.parametrize("m,s,v,r,dtype,calls", [
    (8, 3, 130, 8, torch.bfloat16, (1, 6, 3)),
    (256, 7, 129280, 256, torch.bfloat16, (1, 16, 64)),
])
def test_gpu_persistent_draft_eager_captured_and_jm_agree(
    monkeypatch, m, s, v, r, dtype, calls):
  """With the persistent draft in the table (one request on the CUDA
  cores, else 16-row tiles on the tensor cores, proj held on chip): the
  native runtime's draft is the contract's, the captured graph replays it
  bit for bit twice (the memset zeroes the barrier counters each replay),
  padding rows write nothing."""
  from jax_markov.kernels import tuning
  one = jm.KernelConfig(method="fused", block_b=1, block_v=128, block_k=64,
                        bias_dot="fma", num_warps=8, num_stages=2,
                        select="persistent", held_blocks=1)
  tile = jm.KernelConfig(method="fused", block_b=16, block_v=128, block_k=64,
                         num_warps=8, num_stages=2, select="persistent",
                         held_blocks=2)
  original = tuning.choose

  def choose(method, batch, vocab, rank, *, interpret, hopper=False,
             gpu=None):
    del gpu  # the persistent tiles below, whatever the GPU
    if interpret or hopper:  # the Mosaic GPU entry is not this test's
      return original(method, batch, vocab, rank, interpret=interpret)
    return one if batch == 1 else tile

  monkeypatch.setattr(tuning, "choose", choose)
  _eager_captured_and_jm_agree(m, s, v, r, dtype, calls, replays=2)


@pytest.mark.parametrize("m,s,v,r,calls,runs", [
    (128, 3, 2048, 128, (128, 100, 64), False),
    (128, 3, 2048, 128, (128, 100, 64), True),
    (256, 7, 129280, 256, (256, 200), False),
    (256, 7, 129280, 256, (256, 200), True),
])
def test_gpu_mosaic_eager_captured_and_jm_agree(monkeypatch, m, s, v, r,
                                                calls, runs):
  """The Mosaic GPU block pass in the native runtime (Hopper only; at every
  bucket of 64 requests and more here): the draft is the contract's, padding
  rows write nothing, and the captured graph (the Mosaic launch recorded
  on the capture stream) replays it bit for bit twice. State rows random,
  or with runs request b in slot b."""
  from jax_markov.kernels import mosaic_block_pass as mbp
  from jax_markov.kernels import tuning
  if _GPU and torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the Mosaic GPU block pass needs a Hopper GPU")
  original = tuning.choose

  def choose(method, batch, vocab, rank, *, interpret, hopper=False,
             gpu=None):
    del gpu  # the Mosaic tiles below, whatever the GPU
    if hopper and not interpret and batch >= 64:
      return jm.KernelConfig(method="mosaic", block_b=64 if batch == 64
                             else 128, block_v=64)
    return original(method, batch, vocab, rank, interpret=interpret)

  monkeypatch.setattr(tuning, "choose", choose)
  monkeypatch.setenv("JAX_MARKOV_MOSAIC", "1")  # whatever the environment
  launched = []
  original_call = mbp.mosaic_block_pass
  monkeypatch.setattr(mbp, "mosaic_block_pass", lambda *a, **k: (
      launched.append(k["block_b"]), original_call(*a, **k))[1])
  _eager_captured_and_jm_agree(m, s, v, r, torch.bfloat16, calls, replays=2,
                               rows=torch.arange if runs else None)
  assert launched  # the plans were built with the Mosaic kernel


def _eager_captured_and_jm_agree(m, s, v, r, dtype, calls, replays=1,
                                 rows=None, buckets=None):
  """rows: None (random state rows) or n -> the state rows of n requests.
  buckets: the hook's (None: its default)."""
  pytest.importorskip("triton")
  if not _GPU:
    pytest.skip("needs a CUDA GPU")
  spec = sd.SpeculatorDouble(max_num_reqs=m, num_steps=s, vocab=v, rank=r,
                             hidden=64, dtype=dtype, device="cuda")
  sampler = _sampler(spec, buckets=buckets)
  sampler.warmup(spec)
  for n in calls:
    hidden = spec.prepare(n, greedy=(0,),
                          rows=None if rows is None else rows(n))
    tokens0, cache0 = _snapshot(spec)
    assert sampler(spec, n, hidden)
    torch.cuda.synchronize()
    eager_tokens, eager_cache = _snapshot(spec)
    _agrees_with_jm(spec, n, hidden, eager_tokens, eager_cache, cache0)
    # The same call captured, replayed from the same inputs: bit for bit.
    spec.draft_tokens.copy_(tokens0)
    spec.draft_logits.values.copy_(cache0)
    graph = _captured(lambda: sampler(spec, n, hidden))
    for _ in range(replays):
      spec.draft_tokens.copy_(tokens0)
      spec.draft_logits.values.copy_(cache0)
      graph.replay()
      torch.cuda.synchronize()
      assert torch.equal(spec.draft_tokens, eager_tokens)
      assert torch.equal(spec.draft_logits.values, eager_cache)


@pytest.mark.parametrize("m,s,v,r,modes,calls", [
    (8, 3, 130, 8, {}, (1, 5, 8)),
    (8, 3, 130, 8, dict(greedy=True), (1, 8)),
    (8, 3, 130, 8, dict(draft_vocab=40, shuffled=True), (1, 8)),
    (256, 7, 129280, 256, {}, (1, 4, 16, 64, 256)),
])
def test_gpu_dependent_launch_is_the_plain_launch_bit_for_bit(m, s, v, r,
                                                              modes, calls):
  """The step kernels as programmatic dependent launches (each starting
  while the one before it ends) draft what plain launches draft, bit for
  bit, eager and captured. The captured graph is replayed back to back on
  two alternating inputs: a kernel that read the token, statistics or
  parameters of the step before, or base, ahead of its wait would see the
  other input's values from the replay before and disagree."""
  pytest.importorskip("triton")
  if not _GPU:
    pytest.skip("needs a CUDA GPU")
  spec = sd.add_modes(sd.SpeculatorDouble(
      max_num_reqs=m, num_steps=s, vocab=v, rank=r, hidden=64,
      dtype=torch.bfloat16, device="cuda"), **modes)
  w2 = spec.model.model.markov_head.markov_w2.weight  # [Vd, R] with a map
  early, plain = (tb.FusedMarkovSampler(m, w2.shape[0], r, w2.dtype,
                                        runtime="native", dependent_launch=on)
                  for on in (True, False))
  early.warmup(spec)
  plain.warmup(spec)
  for n in calls:
    _assert_dependent_is_plain(spec, n, early, plain, greedy=(0,))


def _mosaic_edges(hook) -> int:
  """Programmatic edges the hook's Mosaic GPU launches have recorded."""
  return sum(launch.edges for plans in hook._impl._plans.values()  # pylint: disable=protected-access
             for launches in plans._plans.values()  # pylint: disable=protected-access
             for launch in launches
             if isinstance(launch, native.MosaicLaunch))


def test_gpu_mosaic_dependent_launch_is_the_plain_launch_bit_for_bit(
    monkeypatch):
  """Mosaic GPU buckets with dependent launches: the select pass launched
  with the attribute, and the block pass, captured, with a programmatic
  edge from the select pass before it at steps 1 to S - 1 (it loads its
  first tile's base and proj chunks before its wait). They draft what
  plain launches draft, bit for bit, eager and captured (the graph replayed
  back to back on alternating inputs): B = 256 (folded chunk statistics),
  192 (64-request tiles, the chunk pass between the two) and 136 (a
  partial last tile)."""
  pytest.importorskip("triton")
  if not _GPU:
    pytest.skip("needs a CUDA GPU")
  if torch.cuda.get_device_capability() != (9, 0):
    pytest.skip("the Mosaic GPU block pass needs a Hopper GPU")
  monkeypatch.setenv("JAX_MARKOV_MOSAIC_DEPENDENT_LAUNCH", "1")
  m, s, v, r = 256, 7, 129280, 256
  spec = sd.SpeculatorDouble(max_num_reqs=m, num_steps=s, vocab=v, rank=r,
                             hidden=64, dtype=torch.bfloat16, device="cuda")
  early, plain = (tb.FusedMarkovSampler(m, v, r, torch.bfloat16,
                                        runtime="native", mosaic=True,
                                        buckets=(136, 192, 256),
                                        dependent_launch=on)
                  for on in (True, False))
  early.warmup(spec)
  plain.warmup(spec)
  for n in (256, 192, 136):
    before = _mosaic_edges(early)
    _assert_dependent_is_plain(spec, n, early, plain, greedy=(0,))
    assert native_plan.shape_config(next(iter(early._impl._plans)), n).method == "mosaic"  # pylint: disable=protected-access
    # One capture: S - 1 programmatic edges (none eager, none at step 0).
    assert _mosaic_edges(early) - before == s - 1, n
  assert _mosaic_edges(plain) == 0


def _assert_dependent_is_plain(spec, n, early, plain, *, greedy):
  """Hook ``early`` (dependent launches) drafts what hook ``plain`` drafts
  for ``n`` requests, bit for bit, eager and captured, the graph replayed
  back to back on two alternating inputs: a kernel that read the token,
  statistics or parameters of the step before, or base, ahead of its wait
  would see the other input's values from the replay before."""
  cached = spec.draft_logits is not None

  def outputs():
    return (spec.draft_tokens.clone(),
            spec.draft_logits.values.clone() if cached else None)

  hidden = spec.prepare(n, greedy=greedy)
  other = torch.randn_like(hidden)
  want = []
  for h in (hidden.clone(), other):
    assert plain(spec, n, h)
    want.append(outputs())
    assert early(spec, n, h)
    got = outputs()
    assert torch.equal(got[0], want[-1][0])
    if cached:
      assert torch.equal(got[1], want[-1][1])
  fixed = hidden.clone()
  graph = _captured(lambda: early(spec, n, fixed))
  results = []
  for _ in range(4):
    for h in (hidden, other):
      fixed.copy_(h)
      graph.replay()
      results.append(outputs())
  torch.cuda.synchronize()
  for k, got in enumerate(results):
    assert torch.equal(got[0], want[k % 2][0]), (n, k)
    if cached:
      assert torch.equal(got[1], want[k % 2][1]), (n, k)


@pytest.mark.parametrize("bucket,changes", [
    (16, dict(early_proj=0, prefetch_proj=2, prefetch_programs=528)),
    (64, dict(prefetch_proj=1, prefetch_programs=396)),
    (64, dict(prefetch_proj=2, prefetch_programs=0)),
    (16, dict(early_proj=3, early_dependents=True)),
    (64, dict(prefetch_proj=2, prefetch_programs=396,
              early_dependents=True)),
])
def test_gpu_loads_ahead_of_the_wait_are_the_plain_launch_bit_for_bit(
    monkeypatch, bucket, changes):
  """The table's tile at the DeepSeek-V4 shape with proj loaded or
  prefetched before the dependent-launch wait (in the first programs or
  all), and with the select pass letting the next block pass launch before
  its own wait, drafts what plain launches of the same tile (no wait, no
  prefetch) draft, bit for bit, eager and captured on alternating inputs:
  none of it changes arithmetic, and a block pass started early must still
  read the token and write the cache only after the step before."""
  pytest.importorskip("triton")
  if not _GPU:
    pytest.skip("needs a CUDA GPU")
  import dataclasses  # pylint: disable=g-import-not-at-top
  from jax_markov.kernels import tuning  # pylint: disable=g-import-not-at-top
  m, s, v, r = bucket, 7, 129280, 256
  cfg = dataclasses.replace(tuning.choose("fused", m, v, r, interpret=False),
                            **changes)
  monkeypatch.setitem(tuning.TABLE, ("fused", v, r, m), cfg)
  tuning.choose.cache_clear()
  try:
    spec = sd.SpeculatorDouble(max_num_reqs=m, num_steps=s, vocab=v, rank=r,
                               hidden=64, dtype=torch.bfloat16, device="cuda")
    early, plain = (_sampler(spec, buckets=(m,), dependent_launch=on)
                    for on in (True, False))
    early.warmup(spec)
    plain.warmup(spec)
    _assert_dependent_is_plain(spec, m, early, plain, greedy=(0, 5))
  finally:
    tuning.choose.cache_clear()


def test_gpu_select_embed_is_the_gathered_draft_bit_for_bit(monkeypatch):
  """The Mosaic GPU bucket (B = 256, DeepSeek-V4 shape) with the select
  pass writing the next step's embeddings (select_embed, the table's
  entries: embed_rows at step 0 only) drafts what the bucket with
  embed_rows every step drafts, bit for bit, eager and captured on alternating inputs (an embedding row left from
  the replay before would change the draft)."""
  pytest.importorskip("triton")
  pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  if not _GPU or torch.cuda.get_device_capability()[0] != 9:
    pytest.skip("needs a Hopper GPU")
  import dataclasses  # pylint: disable=g-import-not-at-top
  from jax_markov.kernels import tuning  # pylint: disable=g-import-not-at-top
  m, s, v, r = 256, 7, 129280, 256
  spec = sd.SpeculatorDouble(max_num_reqs=m, num_steps=s, vocab=v, rank=r,
                             hidden=64, dtype=torch.bfloat16, device="cuda")
  fetch = _sampler(spec, buckets=(m,))
  fetch.warmup(spec)
  [shape] = list(fetch._impl._plans)  # pylint: disable=protected-access
  cfg = native_plan.shape_config(shape, m)
  assert cfg.method == "mosaic" and cfg.select_embed, cfg
  for table, key in ([(tuning.TABLE, k) for k in tuning.TABLE] +
                     [(tuning.GPU_TABLE, k) for k in tuning.GPU_TABLE]):
    if key[-4:] == ("mosaic", v, r, m):
      monkeypatch.setitem(table, key, dataclasses.replace(
          table[key], select_embed=False))
  tuning.choose.cache_clear()
  try:
    plain = _sampler(spec, buckets=(m,))
    plain.warmup(spec)
    assert not native_plan.shape_config(shape, m).select_embed
    _assert_dependent_is_plain(spec, m - 3, fetch, plain, greedy=(0, 5))
  finally:
    tuning.choose.cache_clear()


@pytest.mark.parametrize("_", [0])
def test_gpu_capture_below_bucket_replays_without_allocating(_):
  pytest.importorskip("triton")
  if not _GPU:
    pytest.skip("needs a CUDA GPU")
  spec = sd.SpeculatorDouble(max_num_reqs=8, num_steps=3, vocab=96, rank=8,
                             device="cuda")
  sampler = _sampler(spec)
  sampler.warmup(spec)
  n = 5  # bucket 8: rows 5..7 are padding and must write nothing
  hidden = spec.prepare(n)
  graph = torch.cuda.CUDAGraph()
  stream = torch.cuda.Stream()
  stream.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(stream):
    with torch.cuda.graph(graph, stream=stream):
      sampler(spec, n, hidden)
  torch.cuda.synchronize()
  for trial in range(3):
    hidden.copy_(spec.prepare(n, padding=(trial,)))
    tokens0, cache0 = _snapshot(spec)
    before = torch.cuda.memory_allocated()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == before
    tokens, cache = _snapshot(spec)
    _agrees_with_jm(spec, n, hidden, tokens, cache, cache0)
    assert torch.equal(tokens[n:], tokens0[n:])


def test_gpu_replay_on_side_stream_orders_with_work_around_it():
  pytest.importorskip("triton")
  if not _GPU:
    pytest.skip("needs a CUDA GPU")
  spec = sd.SpeculatorDouble(max_num_reqs=8, num_steps=3, vocab=96, rank=8,
                             device="cuda")
  sampler = _sampler(spec)
  n = 4
  hidden = spec.prepare(n)
  side = torch.cuda.Stream()
  side.wait_stream(torch.cuda.current_stream())
  graph = torch.cuda.CUDAGraph()
  with torch.cuda.stream(side):
    sampler(spec, n, hidden)  # warm (compiles) outside the capture
    with torch.cuda.graph(graph, stream=side):
      sampler(spec, n, hidden)
  torch.cuda.synchronize()
  real_seeds = spec.seeds.clone()
  x = spec.inputs(n, hidden)
  cache0 = spec.draft_logits.values.clone()
  with torch.cuda.stream(side):
    spec.seeds.fill_(99)
    torch.cuda._sleep(100_000_000)  # pylint: disable=protected-access
    spec.seeds.copy_(real_seeds)  # must land before the replay reads it
    graph.replay()
    got = spec.draft_tokens.clone()  # must see the replay's writes
    spec.seeds.fill_(7)
  torch.cuda.synchronize()
  want_tokens, _ = sd.jm_sample_draft_into(cache0.cpu(), x, "gpu")
  valid = x["idx"] >= 0
  np.testing.assert_array_equal(got.cpu()[:n][valid], want_tokens[valid])
  spec.seeds.copy_(real_seeds)


def test_gpu_fallback_when_compilation_fails(monkeypatch, tmp_path):
  pytest.importorskip("triton")
  if not _GPU:
    pytest.skip("needs a CUDA GPU")

  def broken(*args, **kwargs):
    raise RuntimeError("triton says no")

  monkeypatch.setattr(native, "compile_kernel", broken)
  spec = sd.SpeculatorDouble(max_num_reqs=8, num_steps=3, vocab=96, rank=8,
                             device="cuda")
  sampler = _sampler(spec, cache_dir=str(tmp_path))
  assert sampler.runtime == "native"
  hidden = spec.prepare(4)
  with pytest.warns(RuntimeWarning, match="triton says no"):
    assert sampler(spec, 4, hidden)
  assert sampler.runtime == "jax"
  torch.cuda.synchronize()
  chex.assert_shape(spec.draft_tokens.cpu().numpy(), (8, 3))



def test_native_runtime_reads_the_spec_layout(tmp_path):
  """The host side of the native runtime (no GPU needed): the compile shape
  a spec's buffers give, and that it lowers."""
  from torch_bridge import native_runtime
  spec = sd.SpeculatorDouble(max_num_reqs=4, num_steps=2, vocab=32, rank=4,
                             idx_dtype=torch.int64)
  hook = tb.FusedMarkovSampler(4, 32, 4, torch.float32, runtime="jax")
  cache = native.IRCache(str(tmp_path))
  runtime = native_runtime.NativeRuntime(hook, cache)
  shape = runtime._shape(spec, 2, torch.bfloat16, modes.Mode())  # pylint: disable=protected-access
  assert shape.layout == ParamsLayout(idx_wide=True, pos_wide=True,
                                      seeds_wide=True, ids_wide=False,
                                      anchor_idx_wide=True)
  assert dict(shape.words) == {"idx": 16, "pos": 16, "seeds": 8,
                               "ids": spec.num_tokens, "anchor_idx": 8}
  assert shape.vocab_in == 37 and shape.base_dtype == torch.bfloat16
  assert set(native_plan.lower_bucket(shape, 4, cache)) >= {"draw_params",
                                                            "block_pass"}


for _name in list(globals()):
  if _name.startswith("test_gpu_"):
    _fn = globals()[_name]
    for _mark in gpu:
      _fn = _mark(_fn)
    globals()[_name] = _fn


def test_ir_cache_key_follows_the_kernel_source(tmp_path, monkeypatch):
  # A kernel edited without a version bump is a different kernel: its cached
  # IR (whose operands may have changed) must not be loaded.
  import jax_markov
  pkg = tmp_path / "jax_markov"
  (pkg / "kernels").mkdir(parents=True)
  (pkg / "__init__.py").write_text("")
  kernel = pkg / "kernels" / "block_pass.py"
  kernel.write_text("INPUTS = ('base', 'proj')\n")
  monkeypatch.setattr(jax_markov, "__file__", str(pkg / "__init__.py"))
  cache = native.IRCache(str(tmp_path / "ir"))
  native.source_digest.cache_clear()
  try:
    before = cache.key({"kernel": "block_pass"})
    kernel.write_text("INPUTS = ('proj', 'base')\n")
    native.source_digest.cache_clear()
    after = cache.key({"kernel": "block_pass"})
  finally:
    monkeypatch.undo()
    native.source_digest.cache_clear()
  assert before != after
  assert native.versions()["source"] == native.source_digest()


_LOWER_WITHOUT_A_GPU = r"""
import sys, tempfile
sys.path[:0] = [{root!r}, {tests!r}]
import torch
import test_native as t
from torch_bridge import native, native_plan
cache = native.IRCache(tempfile.mkdtemp())
for cap in ((9, 0), (8, 0)):
  kernels = native_plan.lower_bucket(t._shape(4, 2, 64, 8), 4, cache, cap)
  for ir, _, _ in kernels.values():
    t._well_formed(ir)
print("lowered", sorted(kernels))
"""


def test_kernels_lower_for_a_capability_with_jax_on_cpu(tmp_path):
  # The native runtime's JAX only compiles: with no GPU visible to JAX
  # (JAX_PLATFORMS=cpu) it still lowers for the torch device's capability
  # (JAX 0.11 resolves its target from the device name, native._target).
  import subprocess
  import sys
  here = os.path.dirname(os.path.abspath(__file__))
  code = _LOWER_WITHOUT_A_GPU.format(root=os.path.dirname(here), tests=here)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             JAX_MARKOV_CACHE_DIR=str(tmp_path))
  out = subprocess.run([sys.executable, "-c", code], env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "lowered ['block_pass', 'draw_params', 'select_pass']" in out.stdout


def test_three_consumer_bucket_is_planned(tmp_path):
  """A 192-request Mosaic tile (block_b=192, kernels/mosaic_block_pass.py)
  plans as the 128-request one does: the fold in its epilogue (2020 blocks
  of 64 in 127 chunks of 16, one CTA a worker) or the chunk pass, at B =
  192 and with a partial last tile at 136."""
  import dataclasses
  pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  cache = native.IRCache(str(tmp_path))
  for batch in (192, 136):
    shape = dataclasses.replace(_shape(batch, 7, 129280, 256), mosaic=True)
    for fold in (True, False):
      cfg = jm.KernelConfig(method="mosaic", block_b=192, block_v=64,
                            select_embed=True, fold_chunks=fold,
                            partial_tiles=batch != 192)
      kernels = native_plan._lower_mosaic(  # pylint: disable=protected-access
          shape, batch, cache, (9, 0), cfg, {"shape": f"{batch}-{fold}"}, 132)
      assert set(kernels) == {"embed_rows", "mosaic_block_pass",
                              "select_pass"} | ({"chunk_pass"} if not fold
                                                else set())
      assert native_plan.mosaic_chunks(129280, cfg, batch, 132) == (
          127 if fold else 64)
