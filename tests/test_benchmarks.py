"""Checks of the benchmark harness and its baselines (CPU; GPU ones marked).

The baselines are timed against jax_markov, so they must compute the same
thing: at temperature 0 the same tokens and cached logits as the plain-jnp
reference, at T > 0 a consistent chain (each step's logits built on the token
drawn at the step before).
"""

import dataclasses
import json
import os

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import common
from benchmarks import report
from benchmarks import run
from benchmarks.baselines import plain_jax
from jax_markov import reference, rng
from jax_markov.head import MarkovHead
from jax_markov.kernels import tuning

TINY = common.Shape("t", "t", V=300, R=16, S=3)


def _torch():
  return pytest.importorskip("torch")


def _has_gpu_torch():
  try:
    import torch
    return torch.cuda.is_available()
  except ImportError:
    return False


def _reference(d, temperature, batch, shape=TINY):
  seeds, positions = common.seeds_and_positions(batch, shape.S)
  tokens, logits = reference.sample_draft(
      d["base"], d["anchors"], MarkovHead(d["embed"], d["proj"]),
      jnp.full((batch,), temperature, jnp.float32), seeds, positions)
  return np.asarray(tokens), np.asarray(logits)


def _assert_chain(base, embed, proj, anchors, tokens, logits):
  """logits[b, s] == base[b, s] + proj @ embed[prev] with prev the token
  drawn at s - 1 (the anchor at s = 0); all in float64, exact here."""
  base, embed, proj = (np.asarray(x, np.float64) for x in (base, embed, proj))
  prev = np.asarray(anchors)
  for s in range(base.shape[1]):
    want = base[:, s] + embed[prev] @ proj.T
    np.testing.assert_array_equal(np.asarray(logits)[:, s], want)
    prev = np.asarray(tokens)[:, s]


def test_synthetic_inputs_identical_in_torch_and_jax():
  torch = _torch()
  for set_index in (0, 3):
    t = common.torch_inputs(TINY, 5, set_index, "cpu")
    j = common.jax_inputs(TINY, 5, set_index)
    for name in ("base", "embed", "proj"):
      np.testing.assert_array_equal(t[name].float().numpy(),
                                    np.asarray(j[name], np.float32))
    np.testing.assert_array_equal(t["anchors"].numpy(),
                                  np.asarray(j["anchors"]))
  chex.assert_shape(j["base"], (5, TINY.S, TINY.V))
  chex.assert_type(j["base"], jnp.bfloat16)
  assert t["anchors"].dtype == torch.int64
  # Another set is other data, and the base logits are not degenerate.
  assert not np.array_equal(np.asarray(common.jax_inputs(TINY, 5, 0)["base"]),
                            np.asarray(j["base"]))
  assert np.unique(np.asarray(j["base"], np.float32)).size > 200


def test_bias_is_exact_in_bf16_and_float32():
  torch = _torch()
  shape = common.Shape("w", "w", V=500, R=256, S=1)  # the largest rank
  d = common.torch_inputs(shape, 4, 0, "cpu")
  emb = d["embed"][torch.arange(500)]
  exact = emb.double() @ d["proj"].double().T
  np.testing.assert_array_equal(
      torch.nn.functional.linear(emb, d["proj"]).double().numpy(),
      exact.numpy())
  np.testing.assert_array_equal((emb.float() @ d["proj"].float().T).numpy(),
                                exact.numpy())


def test_floor_matches_the_issue_numbers():
  # 4.27 TB/s: 0.11, 0.19 and 0.43 ms at B = 1, 64, 256 for DeepSeek-V4.
  shape = common.SHAPES["dsv4"]
  assert common.floor_bytes(shape, 1) == (7 * 129280 * 256 * 2
                                          + 7 * 129280 * 2 + 7 * 129280 * 4)
  ms = [common.floor_bytes(shape, b) / 4.27e12 * 1e3 for b in (1, 64, 256)]
  np.testing.assert_allclose(ms, [0.11, 0.19, 0.43], atol=0.006)
  assert common.num_input_sets(shape, 256) == 1
  assert common.num_input_sets(common.SHAPES["small"], 1) > 1


def test_plain_jax_greedy_matches_reference():
  d = common.jax_inputs(TINY, 6, 0)
  tokens, cache = plain_jax.sample(
      d["base"], d["anchors"], d["embed"], d["proj"], jnp.zeros((6,)),
      jax.random.PRNGKey(0), greedy=True)
  chex.assert_shape(tokens, (6, TINY.S))
  chex.assert_type(tokens, jnp.int32)
  chex.assert_type(cache, jnp.float32)
  want_tokens, want_logits = _reference(d, 0.0, 6)
  np.testing.assert_array_equal(np.asarray(tokens), want_tokens)
  np.testing.assert_array_equal(np.asarray(cache), want_logits)


def test_plain_jax_sampling_is_a_consistent_chain():
  d = common.jax_inputs(TINY, 6, 1)
  tokens, cache = plain_jax.sample(
      d["base"], d["anchors"], d["embed"], d["proj"], jnp.full((6,), 1.0),
      jax.random.PRNGKey(3), greedy=False)
  tokens = np.asarray(tokens)
  assert tokens.min() >= 0 and tokens.max() < TINY.V
  _assert_chain(d["base"], d["embed"], d["proj"], d["anchors"], tokens, cache)
  # Sampling, not argmax: the first step differs from greedy somewhere.
  greedy, _ = _reference(d, 0.0, 6)
  assert not np.array_equal(tokens[:, 0], greedy[:, 0])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_vllm_loop_on_cpu(temperature):
  torch = _torch()
  from benchmarks.baselines.vllm_loop import VllmLoopSampler
  torch.manual_seed(0)
  t = common.torch_inputs(TINY, 6, 0, "cpu")
  smp = VllmLoopSampler(t["embed"], t["proj"], t["base"], t["anchors"],
                        torch.full((6,), temperature), temperature == 0.0)
  smp.run_steps()
  assert smp.tokens.shape == (6, TINY.S) and smp.cache.dtype == torch.float32
  j = common.jax_inputs(TINY, 6, 0)
  if temperature == 0.0:
    want_tokens, want_logits = _reference(j, 0.0, 6)
    np.testing.assert_array_equal(smp.tokens.numpy(), want_tokens)
    np.testing.assert_array_equal(smp.cache.numpy(), want_logits)
  else:
    _assert_chain(j["base"], j["embed"], j["proj"], j["anchors"],
                  smp.tokens.numpy(), smp.cache.numpy())


def _triton_sampler(name):
  """The Triton baseline class of that name (imports need triton)."""
  if name == "seed_design":
    from benchmarks.baselines.seed_design import SeedDesignSampler
    return lambda *a: SeedDesignSampler(*a)
  from benchmarks.baselines.f32_bias_design import F32BiasDesignSampler
  return lambda *a: F32BiasDesignSampler(*a, block=512)


def _check_triton_design(name, device):
  """A Triton baseline against the jnp reference, same uniforms: tokens and
  cached logits exact (the synthetic bias is exact in bf16 and float32), with
  -inf, NaN and an all -inf row."""
  torch = _torch()
  pytest.importorskip("triton")
  make = _triton_sampler(name)
  shape = common.Shape("t", "t", V=1500, R=16, S=3)
  B = 4
  t = common.torch_inputs(shape, B, 0, device)
  j = common.jax_inputs(shape, B, 0)
  # Row 1 of step 0: some -inf and NaN logits; row 2 of step 1: all -inf.
  base = np.asarray(j["base"], np.float32)
  base[1, 0, ::3] = -np.inf
  base[1, 0, 1::7] = np.nan
  base[2, 1, :] = -np.inf
  j["base"] = jnp.asarray(base, jnp.bfloat16)
  t["base"] = torch.from_numpy(base).to(torch.bfloat16).to(device)
  seeds, positions = common.seeds_and_positions(B, shape.S)
  u = np.array(rng.draft_uniforms(seeds, positions))
  for temps in ([0.0] * B, [1.0] * B, [0.0, 0.7, 1.0, 3.0]):
    smp = make(
        t["embed"], t["proj"], t["base"], t["anchors"],
        torch.tensor(temps, dtype=torch.float32, device=device),
        torch.from_numpy(u).to(device))
    smp.run_steps()
    want_tokens, want_logits = reference.sample_draft(
        j["base"], j["anchors"], MarkovHead(j["embed"], j["proj"]),
        jnp.asarray(temps, jnp.float32), seeds, positions)
    np.testing.assert_array_equal(smp.tokens.cpu().numpy(),
                                  np.asarray(want_tokens))
    np.testing.assert_array_equal(smp.cache.cpu().numpy(),
                                  np.asarray(want_logits))
    assert smp.tokens[2, 1].item() == 0  # all -inf: token 0 by the rule


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="set TRITON_INTERPRET=1 to check the Triton "
                    "kernels on CPU (needs triton installed)")
@pytest.mark.parametrize("name", ["seed_design", "f32_bias_design"])
def test_triton_designs_interpreted(name):
  _check_triton_design(name, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu_torch(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["seed_design", "f32_bias_design"])
def test_triton_designs_on_gpu(name):
  # The jnp reference runs on the CPU: no JAX work on the GPU torch uses.
  with jax.default_device(jax.devices("cpu")[0]):
    _check_triton_design(name, "cuda")


def _torch_greedy_chain(torch, d):
  """Temperature-0 tokens by a plain torch loop (exact logits, argmax)."""
  prev = d["anchors"]
  tokens = []
  for s in range(d["base"].shape[1]):
    logits = (d["base"][:, s].float()
              + d["embed"][prev].float() @ d["proj"].float().T)
    prev = torch.argmax(logits, dim=-1)
    tokens.append(prev)
  return torch.stack(tokens, dim=1).cpu().numpy()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu_torch(), reason="needs a CUDA GPU")
def test_cuda_graphs_replay_the_eager_results():
  torch = _torch()
  pytest.importorskip("triton")
  from benchmarks.baselines.f32_bias_design import F32BiasDesignSampler
  from benchmarks.baselines.seed_design import SeedDesignSampler
  from benchmarks.baselines.vllm_loop import VllmLoopSampler
  shape = common.SHAPES["dsv4"]
  for B in (1, 64):
    d = common.torch_inputs(shape, B, 0, "cuda")
    temp = torch.zeros((B,), device="cuda")
    u = torch.rand((B, shape.S), device="cuda")
    want = _torch_greedy_chain(torch, d)
    for make in (
        lambda: SeedDesignSampler(d["embed"], d["proj"], d["base"],
                                  d["anchors"], temp, u),
        lambda: F32BiasDesignSampler(d["embed"], d["proj"], d["base"],
                                     d["anchors"], temp, u),
        lambda: VllmLoopSampler(d["embed"], d["proj"], d["base"],
                                d["anchors"], temp, True)):
      eager, captured = make(), make()
      eager.run_steps()
      captured.capture().replay()
      torch.cuda.synchronize()
      np.testing.assert_array_equal(eager.tokens.cpu().numpy(), want)
      np.testing.assert_array_equal(captured.tokens.cpu().numpy(), want)
      assert torch.equal(eager.cache, captured.cache)


def test_token_check_flags_a_mismatch(tmp_path):
  result = run._Result(str(tmp_path / "r.json"), {})
  quiet = lambda msg: None  # noqa: E731
  assert run._check_tokens(result, "k", "a", [[1, 2], [3, 4]], quiet)
  assert run._check_tokens(result, "k", "b", [[1, 2], [3, 4]], quiet)
  assert not run._check_tokens(result, "k", "c", [[1, 2], [3, 5]], quiet)
  assert result.data["mismatches"] == [
      "k: c differs from a in 1 of 4 temperature-0 tokens"]


def test_bench_quick_smoke(tmp_path, monkeypatch):
  # On a GPU machine this process's JAX may hold most of the GPU already.
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  out = tmp_path / "res.json"
  rc = run.main(["--quick", "--shapes", "tiny", "--batches", "2",
                 "--impls", "plain_jax,vllm_loop,vllm_loop_graph",
                 "--repeats", "2", "--out", str(out), "--report", "--plot",
                 "--docs-dir", str(tmp_path / "docs")])
  assert rc == 0
  rows = json.loads(out.read_text())
  keys = {"impl", "V", "R", "S", "dtype", "batch", "temperature", "median_ms",
          "floor_ms", "device"}
  assert all(keys <= set(r) for r in rows)
  impls = {"plain_jax", "vllm_loop"}
  if _has_gpu_torch():
    impls.add("vllm_loop_graph")
  assert {(r["impl"], r["temperature"]) for r in rows} == {
      (i, t) for i in impls for t in (0.0, 1.0)}
  assert all(r["median_ms"] > 0 and r["floor_ms"] > 0 for r in rows)
  assert all(r["tokens_match"] for r in rows)
  md = (tmp_path / "docs" / "benchmarks.md").read_text()
  assert "| 2 |" in md and "x fl" in md
  assert (tmp_path / "docs" / "benchmarks.png").stat().st_size > 0


def test_jax_markov_into_donates_one_cache_and_draws_as_jax_markov(
    tmp_path, monkeypatch):
  """The jax_markov_into row: jm.sample_draft_into over one cache donated
  back call after call, the same tokens as jax_markov's at T 0 and 1."""
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  out = tmp_path / "res.json"
  rc = run.main(["--quick", "--shapes", "tiny", "--batches", "2",
                 "--impls", "jax_markov,jax_markov_into", "--repeats", "2",
                 "--no-report", "--out", str(out)])
  assert rc == 0
  rows = json.loads(out.read_text())
  assert {(r["impl"], r["temperature"]) for r in rows} == {
      (i, t) for i in ("jax_markov", "jax_markov_into") for t in (0.0, 1.0)}
  assert all(r["tokens_match"] for r in rows)
  into = [r for r in rows if r["impl"] == "jax_markov_into"]
  assert all(r["timed"].startswith("jm.sample_draft_into") for r in into)


def test_report_ratios_and_plot(tmp_path):
  rows = []
  for impl, ms in (("jax_markov", 0.2), ("seed_design_graph", 0.25)):
    for batch in (1, 4):
      rows.append(dict(impl=impl, shape="dsv4", V=129280, R=256, S=7,
                       dtype="bfloat16", batch=batch, temperature=1.0,
                       median_ms=ms * batch, floor_ms=0.1 * batch,
                       device="NVIDIA H200", copy_bw_gbs=4270.0,
                       **({"host_ms": 0.05} if impl == "jax_markov" else {})))
  path = tmp_path / "r.json"
  path.write_text(json.dumps(rows))
  md_path, png_path = report.write_report(str(path), str(tmp_path),
                                          with_plot=True)
  md = open(md_path).read()
  assert ("| 4 | 0.400 | 0.800 (2.00x fl, 0.80x seed) | "
          "1.000 (2.50x fl, 1.00x seed) |") in md
  assert "4.27 TB/s" in md
  assert "| B | jax_markov |\n| ---: | ---: |\n| 1 | 50 |" in md
  assert os.path.getsize(png_path) > 1000
  assert "jax_markov" in report.text_summary(rows)
  # Without the plot (the default): no image, and no link to one.
  md_path, png_path = report.write_report(str(path), str(tmp_path / "np"))
  assert png_path is None and "![" not in open(md_path).read()


class _FakeRunner:
  """A family runner whose "bad" impl raises and "skip" impl cannot run."""
  is_gpu = False

  def bandwidth_gbs(self):
    return 1.0

  def make_inputs(self, shape, batch, n_sets):
    pass

  def same_rng(self, impl, key):
    return False

  def prepare(self, impl, shape, batch, temp):
    if impl == "skip":
      raise run._Skip("not here")
    if impl == "bad":
      raise RuntimeError("boom")
    return run._Prepared([lambda: None], lambda: [[1] * shape.S] * batch)

  def time(self, prep, repeats, group, warmup, warmup_s):
    return 0.5, 2

  def release(self, inputs=False):
    pass


def test_a_failing_impl_is_reported_and_the_others_run(tmp_path):
  result = run._Result(str(tmp_path / "r.json"), {})
  cfg = dict(measure_bandwidth=False, temperatures=[0.0, 1.0],
             shapes=["tiny"], batches=[1, 2], impls=["good", "bad", "skip"],
             repeats=4, group=2, warmup=1, warmup_s=0.0)
  run._run_family(cfg, _FakeRunner(), result, lambda msg: None)
  rows = result.data["rows"]
  assert {(r["impl"], r["batch"], r["temperature"]) for r in rows} == {
      ("good", b, t) for b in (1, 2) for t in (0.0, 1.0)}
  notices = result.data["notices"]
  assert any(n.startswith("bad failed at tiny|1 T=0") and "boom" in n
             for n in notices)
  assert "skip skipped: not here" in notices


def test_tune_and_profile_scripts_smoke(tmp_path):
  """benchmarks/tune.py (the sweep behind kernels/tuning.py's table) and
  benchmarks/profile_draft.py (the ncu target) run end to end on the tiny shape."""
  from benchmarks import profile_draft, tune
  out = tmp_path / "tune.json"
  assert tune.main(["--shape", "tiny", "--batches", "2", "--only-default",
                    "--inspect", "--repeats", "1", "--group", "1",
                    "--out", str(out)]) == 0
  rows = json.loads(out.read_text())
  assert len(rows) == 1 and rows[0]["batch"] == 2 and rows[0]["ms"] > 0
  assert rows[0]["method"] == "fused" and rows[0]["k_loop"] == "fori"
  assert set(rows[0]["launches"]) == {"pallas", "fusions", "gemms",
                                      "command_buffers"}
  cfgs = list(tune.candidates(64, "full", common.SHAPES["dsv4"]))
  assert {c.method for c in cfgs} == {"fused", "xla_bias"}
  assert {c.k_loop for c in cfgs} == {"fori", "static"}
  assert profile_draft.main(["--shape", "tiny", "--batch", "2", "--drafts", "1"]) == 0
  fma = list(tune.candidates(1, "fma", common.SHAPES["dsv4"]))
  assert fma[0] == tuning.choose(None, 1, 129280, 256, interpret=False)
  assert {c.bias_dot for c in fma[1:]} == {"fma"} and {c.block_b for c in fma[1:]} == {1}


def test_tune_graph_records_the_configuration_that_ran():
  """A sweep's row records what the native runtime planned with the
  candidate in the table (tune_graph.planned_config reads
  native_plan.shape_config): a Mosaic candidate runs as asked, while the
  Mosaic entry a batch's tiles do not fill, without partial_tiles (the
  --grid mosaic default at B = 200 before change 57), yields to the rule,
  which a row must not report as the entry."""
  torch = pytest.importorskip("torch")
  from benchmarks import tune_graph
  from torch_bridge import native_plan
  from jax_markov.kernels.draw_params import ParamsLayout
  V, R, S = 129280, 256, 7

  def shape(batch):
    words = (("idx", batch * S), ("pos", 2 * batch * S), ("seeds", 2 * batch),
             ("ids", batch * S + 4), ("anchor_idx", 2 * batch))
    return native_plan.DraftShape(
        max_num_reqs=batch, steps=S, vocab=V, rank=R, vocab_in=V,
        base_dtype=torch.bfloat16, head_dtype=torch.bfloat16,
        temperature_dtype=torch.float32, words=words,
        layout=ParamsLayout(idx_wide=False, pos_wide=True), mosaic=True,
        gpu="NVIDIA H200")

  for cfg in tune_graph.mosaic_candidates(200, V, R):
    with tune_graph.table_entry(cfg, V, R, 200):
      assert native_plan.shape_config(shape(200), 200) == cfg
  entry = tuning.KernelConfig(method="mosaic", block_b=128, block_v=64,
                              num_stages=4, select_embed=True)
  with tune_graph.table_entry(entry, V, R, 200):
    ran = native_plan.shape_config(shape(200), 200)
  assert ran != entry
  assert (ran.method, ran.block_b, ran.partial_tiles) == ("mosaic", 64, True)


def test_tune_graph_candidates_and_cpu_refusal():
  """benchmarks/tune_graph.py: valid candidates at each batch (one-request
  CUDA-core tiles only where few requests share proj), and a clear refusal
  without a GPU (it times captured CUDA graphs)."""
  torch = pytest.importorskip("torch")
  from benchmarks import tune_graph
  for batch in (4, 16, 64, 256):
    cfgs = list(tune_graph.candidates(batch))
    assert len(cfgs) == len(set(cfgs)) >= 5
    assert all(c.select in ("pass", "tail") for c in cfgs)
    assert all(c.block_b <= max(16, batch) for c in cfgs)
    assert any(c.bias_dot == "fma" for c in cfgs) == (batch <= 16)
    cfgs = list(tune_graph.candidates(batch + 8))  # between two buckets
    assert all(c.block_b & (c.block_b - 1) == 0 for c in cfgs)
  # Batches between the buckets: power-of-two tiles, at most 4 a batch.
  for batch, sizes in ((24, {16, 32}), (72, {32, 64, 128}),
                       (136, {64, 128}), (200, {64, 128})):
    cfgs = list(tune_graph.partial_candidates(batch))
    assert len(cfgs) == len(set(cfgs))
    assert {c.block_b for c in cfgs} == sizes
    assert all(c.early_dependents and c.select == "pass" for c in cfgs)
  # Remainder rows: without, then every bound that takes the rest in.
  for batch, bounds in ((72, [0, 16, 32, 63, 63]), (112, [0, 63, 63]),
                        (128, [0])):
    cfgs = list(tune_graph.remainder_candidates(batch))
    assert [c.remainder_b for c in cfgs] == bounds
    assert [c.remainder_pass for c in cfgs].count("after") == (batch != 128)
    assert all(c.block_b == 64 for c in cfgs)
  # B = 24 fills 24 of the 32-request tile: also 16 + 8 remainder rows.
  cfgs = list(tune_graph.remainder_candidates(24))
  assert [(c.block_b, c.remainder_b) for c in cfgs] == [(32, 0), (16, 15)]
  # Mosaic GPU tiles: only those that divide B and fit in shared memory.
  # A batch past one consumer's 64 rows that the tiles do not divide: the
  # last tile partial (partial_tiles).
  # From B = 129 the three-consumer tile (192) too.
  for batch, sizes in ((64, {64}), (128, {64, 128}), (256, {64, 128, 192}),
                       (72, {64, 128}), (200, {64, 128, 192})):
    cfgs = list(tune_graph.mosaic_candidates(batch))
    assert len(cfgs) == len(set(cfgs)) >= 2
    assert {c.block_b for c in cfgs} == sizes
    assert all(c.method == "mosaic" for c in cfgs)
    assert all(c.partial_tiles == (batch % c.block_b != 0) for c in cfgs)
    assert all(c.select_embed for c in cfgs)  # as every Mosaic entry
  assert not list(tune_graph.mosaic_candidates(66))  # not a multiple of 4
  # The store warpgroup: the Mosaic entry with it, at its own, all and 4
  # proj chunks in flight; nothing for a Triton entry.
  for batch in (64, 136, 256):
    table = tune_graph.stores_default(batch, 129280, 256, hopper=True,
                                      gpu="NVIDIA H200")
    assert table.method == "mosaic"
    # At 136 the hook's own plan (the rule's partial last tile).
    assert table.partial_tiles == (batch == 136)
    cfgs = list(tune_graph.stores_candidates(table))
    assert cfgs[0] == dataclasses.replace(table, store_warpgroup=True)
    assert {c.num_stages for c in cfgs} == {table.num_stages, 0, 4}
    assert all(c.store_warpgroup and c == dataclasses.replace(
        table, store_warpgroup=True, num_stages=c.num_stages) for c in cfgs)
  assert not list(tune_graph.stores_candidates(
      tuning.choose("fused", 64, 129280, 256, interpret=False)))
  assert not list(tune_graph.mosaic_candidates(32))
  # --grid consumers: 192-request tiles (folded, chunk pass) from B = 129,
  # a partial last tile where 192 does not divide.
  for batch in (136, 192, 200):
    cfgs = list(tune_graph.consumers_candidates(batch))
    assert [(c.block_b, c.block_v, c.fold_chunks, c.store_warpgroup)
            for c in cfgs] == [(192, 64, True, False), (192, 64, False, False)]
    assert all(c.partial_tiles == (batch != 192) and c.select_embed
               for c in cfgs)
  assert not list(tune_graph.consumers_candidates(128))
  assert not list(tune_graph.consumers_candidates(138))  # not a multiple of 4
  # --grid between: one partial 128-request tile for B = 65 to 127 (and
  # any batch 128 does not divide), as many chunks as fit and 4, folded.
  for batch in (72, 96, 124, 200):
    cfgs = list(tune_graph.between_candidates(batch))
    assert [(c.block_b, c.block_v, c.num_stages, c.fold_chunks)
            for c in cfgs] == [(128, 64, 0, True), (128, 64, 4, True)]
    assert all(c.partial_tiles and c.select_embed for c in cfgs)
  for batch in (64, 128, 256, 74):  # filled tiles, too few rows, not 4k
    assert not list(tune_graph.between_candidates(batch))
  # --grid walk: the table's tile at one request tile, walking (2-5
  # programs a multiprocessor; 64 x 64 blocks too at 64 requests), without
  # the early or prefetched chunks it does not take.
  for batch in (4, 32, 64):
    table = tuning.choose("fused", batch, 129280, 256, interpret=False)
    cfgs = list(tune_graph.walk_candidates(batch))
    assert [c.block_programs for c in cfgs][:4] == [264, 396, 528, 660]
    assert len(cfgs) == (6 if batch == 64 else 4)
    for c in cfgs:
      assert c == dataclasses.replace(
          table, early_proj=0, prefetch_proj=0, prefetch_programs=0,
          block_v=c.block_v, block_programs=c.block_programs)
  assert not list(tune_graph.walk_candidates(1))    # the tail select
  assert not list(tune_graph.walk_candidates(128))  # two request tiles
  for batch in (4, 64):  # the table's tile, other select warps only
    cfgs = list(tune_graph.select_candidates(batch))
    table = tuning.choose("fused", batch, 129280, 256, interpret=False)
    assert {c.select_warps for c in cfgs} == {1, 2, 8}
    assert all(c == dataclasses.replace(table, select_warps=c.select_warps)
               for c in cfgs)
  assert not list(tune_graph.select_candidates(1))  # the tail select
  for batch in (4, 64, 128):  # the table's tile with each l2_hints
    table = tuning.choose("fused", batch, 129280, 256, interpret=False)
    assert list(tune_graph.hints_candidates(batch)) == [
        dataclasses.replace(table, l2_hints=h) for h in ("stream", "proj")]
  assert not list(tune_graph.hints_candidates(1))  # its kept rows' hints
  for batch in (1, 4, 64):  # the table's tile without L2 rows, 0-4 early
    cfgs = list(tune_graph.early_candidates(batch))
    table = tuning.choose("fused", batch, 129280, 256, interpret=False)
    assert [c.early_proj for c in cfgs[:4]] == [0, 1, 2, 4]
    assert all(c == dataclasses.replace(table, proj_l2_rows=0,
                                        early_proj=c.early_proj,
                                        prefetch_proj=0, prefetch_programs=0)
               for c in cfgs[:4])
    # 64-request tiles also with 32-wide rank chunks, 0 or 1 early; B = 1
    # also with its L2-kept rows and 1, 2, 4 early.
    assert [(c.block_k, c.early_proj) for c in cfgs[4:]] == (
        [(32, 0), (32, 1)] if batch == 64 else
        [(64, 1), (64, 2), (64, 4)] if batch == 1 else [])
    assert all(c == dataclasses.replace(table, early_proj=c.early_proj)
               for c in cfgs[4:] if c.proj_l2_rows)
    assert sum(bool(c.proj_l2_rows) for c in cfgs) == (3 if batch == 1
                                                        else 0)
  for batch in (4, 64):  # the table's tile without, then 1-2 prefetched
    cfgs = list(tune_graph.prefetch_candidates(batch))
    table = tuning.choose("fused", batch, 129280, 256, interpret=False)
    plain = dataclasses.replace(table, early_proj=0, prefetch_proj=0,
                                prefetch_programs=0)
    assert cfgs[0] == plain
    assert all(c == dataclasses.replace(plain, prefetch_proj=c.prefetch_proj,
                                        prefetch_programs=c.prefetch_programs)
               for c in cfgs)
    assert {c.prefetch_proj for c in cfgs} == {0, 1, 2, 4}
    assert 132 * (3 if batch == 64 else 4) in {c.prefetch_programs
                                               for c in cfgs}
  assert not list(tune_graph.prefetch_candidates(1))  # the tail select
  for batch in (4, 64, 128):  # early_dependents, then one more chunk ahead
    cfgs = list(tune_graph.dependents_candidates(batch))
    table = tuning.choose("fused", batch, 129280, 256, interpret=False)
    assert cfgs[0] == dataclasses.replace(table, early_dependents=True)
    assert all(c.early_dependents for c in cfgs)
    assert [c.early_proj + c.prefetch_proj for c in cfgs[1:]] == (
        [] if batch == 128 else
        [table.early_proj + table.prefetch_proj + 1])
  assert not list(tune_graph.dependents_candidates(1))  # no select pass
  mosaic = tuning.KernelConfig(method="mosaic", block_b=128, block_v=64)
  assert list(tune_graph.embed_candidates(mosaic)) == [
      dataclasses.replace(mosaic, select_embed=True)]
  assert not list(tune_graph.embed_candidates(
      tuning.choose("fused", 64, 129280, 256, interpret=False)))
  for batch in (1, 16):  # rows: 2 to 8 requests only
    assert not list(tune_graph.rows_candidates(batch))
  cfgs = list(tune_graph.rows_candidates(3))  # B = 1's tile, 4 rows a tile
  one = tuning.choose("fused", 1, 129280, 256, interpret=False)
  assert all(c.block_b == 4 and c.bias_dot == "fma" and c.select == "pass"
             for c in cfgs)
  assert [(c.block_v, c.proj_l2_rows, c.early_proj) for c in cfgs] == [
      (128, one.proj_l2_rows, 0), (128, one.proj_l2_rows, 2), (128, 0, 0),
      (128, 0, 2), (64, 0, 2), (256, 0, 2)]
  for batch in (4, 64):  # the L2 rows alone, no loads ahead of the wait
    cfgs = list(tune_graph.l2_candidates(batch))
    assert not any(c.early_proj or c.prefetch_proj for c in cfgs)
    # then the unrolled rank loop (its proj loads keep their hints): the
    # control without rows, then with them.
    assert [(c.k_loop, bool(c.proj_l2_rows)) for c in cfgs] == (
        [("fori", True)] * 5 + [("static", False)] + [("static", True)] * 2)
  if not torch.cuda.is_available():
    assert tune_graph.main(["--batches", "4"]) == 2


def test_stress_capture_cpu_refusal():
  """benchmarks/stress_capture.py replays captured drafts: a clear refusal
  without a GPU."""
  torch = pytest.importorskip("torch")
  from benchmarks import stress_capture
  if not torch.cuda.is_available():
    assert stress_capture.main(["--batches", "4", "--dependent-launch",
                                "on"]) == 2


def test_jax_markov_mosaic_takes_the_native_runtimes_mosaic_plan(
    monkeypatch):
  """benchmarks/run.py's jax_markov_mosaic row: the configuration the
  native runtime plans for the batch on this GPU where it is the Mosaic GPU
  pass (B = 136's partial last tile, which a JAX call does not take by
  itself), skipped with a reason elsewhere (here, without a Hopper GPU;
  with one, at a batch the table gives the Triton pass)."""
  from benchmarks import run
  from jax_markov import sampler
  shape = common.SHAPES["dsv4"]
  with pytest.raises(run._Skip, match="Hopper"):  # this CPU machine
    run._native_mosaic_config(shape, 136)
  monkeypatch.setattr(sampler, "_mosaic_available", lambda: True)
  monkeypatch.setattr(sampler, "_gpu_name", lambda: "NVIDIA H200")
  cfg = run._native_mosaic_config(shape, 136)
  assert cfg == tuning.choose(None, 136, shape.V, shape.R, interpret=False,
                              hopper=True, gpu="NVIDIA H200")
  assert (cfg.method, cfg.block_b, cfg.partial_tiles) == ("mosaic", 64, True)
  # A JAX call takes the same plan there by itself (sampler._config).
  assert sampler._config(None, None, 136, shape.V, shape.R, False,
                         hopper=True) == cfg
  with pytest.raises(run._Skip, match="fused"):
    run._native_mosaic_config(shape, 64)
  with pytest.raises(run._Skip, match="bfloat16"):
    run._native_mosaic_config(common.SHAPES["dsv4r"], 136)


def test_block_step_inputs_and_cpu_refusal():
  """benchmarks/block_step.py times one step of the Triton and Mosaic GPU
  block passes: its state rows give every draw of a step its own row (a
  permutation of the slots, and the identity), and it refuses clearly where
  no Hopper GPU is."""
  from benchmarks import block_step
  from jax_markov.kernels import mosaic_block_pass as mbp
  B, S = 16, 3
  x = block_step._inputs(B, S, 256, 64)
  for name in ("rows", "rows_id"):
    rows = np.asarray(x[name]).reshape(B, S)
    np.testing.assert_array_equal(np.sort(rows.reshape(-1)), np.arange(B * S))
    np.testing.assert_array_equal(rows % S, np.broadcast_to(np.arange(S),
                                                            (B, S)))
  if not mbp.available()[0]:
    assert block_step.main(["--batches", "64"]) == 2


def test_timeline_script_smoke(tmp_path):
  """benchmarks/timeline.py runs end to end on the tiny shape (on CPU the
  trace has no GPU kernels; the host issue times and the overrides still count)."""
  from benchmarks import timeline
  out = tmp_path / "tl.json"
  assert timeline.main(["--shape", "tiny", "--batches", "2", "--group", "1",
                        "--set", "serpentine=False", "--set", "block_v=64",
                        "--out", str(out)]) == 0
  (row,) = json.loads(out.read_text())
  assert row["config"]["serpentine"] is False and row["config"]["block_v"] == 64
  assert row["issue_us"] > 0 and row["issue_jit_us"] > 0 and row["issue_noop_us"] > 0
  # The summary of a GPU trace, on made-up kernel events (ns): two drafts.
  events = [("a", 0, 10_000), ("b", 12_000, 4_000), ("a", 20_000, 10_000),
            ("b", 30_000, 4_000)]
  summary = timeline.summarize(events, drafts=2)
  assert summary["span_us"] == 17.0 and summary["busy_us"] == 14.0
  assert summary["gap_us"] == 3.0 and summary["kernels"] == 2.0
  assert summary["by_kernel"]["a"] == dict(count=1.0, mean_us=10.0, total_us=10.0)


def test_timeline_reduced_shape_and_graph_trace(tmp_path):
  """timeline.py on a reduced-vocabulary shape (the jitted draft with the
  map on the device, the target vocabulary's configuration), and
  timeline_graph.py's reading of a torch chrome trace: kernels only, in start
  order, microseconds to nanoseconds; without a GPU it refuses clearly."""
  torch = pytest.importorskip("torch")
  from benchmarks import timeline, timeline_graph
  out = tmp_path / "tl.json"
  assert timeline.main(["--shape", "tinyr", "--batches", "2", "--group", "1",
                        "--out", str(out)]) == 0
  (row,) = json.loads(out.read_text())
  assert row["shape"] == "tinyr" and row["issue_jit_us"] > 0
  trace = tmp_path / "trace.json"
  trace.write_text(json.dumps({"traceEvents": [
      {"cat": "kernel", "name": "markov_block_pass", "ts": 12.5, "dur": 3.0},
      {"cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1.0,
       "dur": 5.0},
      {"cat": "kernel", "name": "markov_draw_params", "ts": 10.0, "dur": 1.5},
      {"cat": "kernel", "name": "no duration", "ts": 20.0},
  ]}))
  assert timeline_graph.kernel_events(str(trace)) == [
      ("markov_draw_params", 10_000, 1_500),
      ("markov_block_pass", 12_500, 3_000)]
  if not torch.cuda.is_available():
    assert timeline_graph.main(["--batches", "1"]) == 2


def test_warm_up_runs_for_a_count_and_a_time():
  """Untimed calls go on until both the count and the wall time are reached."""
  import time
  calls = []
  run = lambda n: (calls.append(n), time.sleep(0.005))  # noqa: E731
  syncs = []
  assert common.warm_up(run, 3, 0.0) == 3
  calls.clear()
  n = common.warm_up(run, 1, 0.06, sync=lambda: syncs.append(1))
  assert n == len(calls) and n >= 10  # 60 ms of 5 ms calls
  assert len(syncs) == n // 8 + 1  # every 8 calls, and once at the end


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bridge_rows_double_matches_the_reference(temperature):
  """The torch_bridge rows' speculator (torch_bridge.testing's double over the
  synthetic tensors) makes the hook draw the jnp reference's draft: same
  tokens and logits, state row b = request b, draws keyed by the positions."""
  torch = _torch()
  from torch_bridge import FusedMarkovSampler
  from torch_bridge.testing import speculator_from_tensors
  B = 2
  t = common.torch_inputs(TINY, B, 0, "cpu")
  j = common.jax_inputs(TINY, B, 0)
  seeds, positions = common.seeds_and_positions(B, TINY.S)
  spec = speculator_from_tensors(t["base"], t["embed"], t["proj"],
                                 t["anchors"], torch.full((B,), temperature),
                                 seeds, positions)
  sampler = FusedMarkovSampler(B, TINY.V, TINY.R, torch.bfloat16,
                               check_values=True)
  assert sampler(spec, B, spec.head_hidden)
  want_tokens, want_logits = _reference(j, temperature, B)
  np.testing.assert_array_equal(spec.draft_tokens.numpy(), want_tokens)
  np.testing.assert_array_equal(spec.draft_logits.values.numpy(), want_logits)


# ---------------------------------------------------------------------------
# The reduced draft vocabulary (dsv4r; tinyr on CPU) and the greedy rows.

TINYR = common.SHAPES["tinyr"]


def test_reduced_shape_inputs_and_map():
  torch = _torch()
  assert common.SHAPES["dsv4r"].V == 129280 and common.SHAPES["dsv4r"].Vd == 32768
  m = common.draft_targets(common.SHAPES["dsv4r"])
  assert m.shape == (32768,) and (np.diff(m) > 0).all()
  assert m[0] >= 0 and m[-1] < 129280
  t = common.torch_inputs(TINYR, 3, 0, "cpu")
  j = common.jax_inputs(TINYR, 3, 0)
  assert tuple(t["base"].shape) == (3, TINYR.S, 40)
  assert tuple(t["proj"].shape) == (40, TINYR.R)
  assert tuple(t["embed"].shape) == (96, TINYR.R)
  for name in ("base", "embed", "proj"):
    np.testing.assert_array_equal(t[name].float().numpy(),
                                  np.asarray(j[name], np.float32))
  np.testing.assert_array_equal(t["targets"].numpy(), j["targets"])
  # No cache for the greedy rows; Vd columns of base and proj, V of cache.
  isz = 2
  assert common.floor_bytes(TINYR, 2) == (3 * 40 * 8 * isz + 2 * 3 * 40 * isz
                                          + 2 * 3 * 96 * 4)
  assert common.floor_bytes(TINYR, 2, cache=False) == (3 * 40 * 8 * isz
                                                       + 2 * 3 * 40 * isz)


def _reduced_reference(j, temperature, batch, shape=TINYR):
  seeds, positions = common.seeds_and_positions(batch, shape.S)
  tokens, logits = reference.sample_draft(
      j["base"], j["anchors"], MarkovHead(j["embed"], j["proj"]),
      jnp.full((batch,), temperature, jnp.float32), seeds, positions,
      draft_to_target=j["targets"], target_vocab=shape.V)
  return np.asarray(tokens), np.asarray(logits)


def test_vllm_loop_reduced_vocabulary_on_cpu():
  torch = _torch()
  from benchmarks.baselines.vllm_loop import VllmLoopSampler
  B = 4
  t = common.torch_inputs(TINYR, B, 0, "cpu")
  j = common.jax_inputs(TINYR, B, 0)
  smp = VllmLoopSampler(t["embed"], t["proj"], t["base"], t["anchors"],
                        torch.zeros((B,)), True, targets=t["targets"],
                        target_vocab=TINYR.V)
  smp.run_steps()
  want_tokens, want_logits = _reduced_reference(j, 0.0, B)
  np.testing.assert_array_equal(smp.tokens.numpy(), want_tokens)
  np.testing.assert_array_equal(smp.cache.numpy(), want_logits)
  smp = VllmLoopSampler(t["embed"], t["proj"], t["base"], t["anchors"],
                        torch.ones((B,)), False, targets=t["targets"])
  smp.run_steps()
  assert set(smp.tokens.reshape(-1).tolist()) <= set(t["targets"].tolist())


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("shape", [TINYR, TINY], ids=["tinyr", "tiny"])
def test_bridge_modes_double_matches_the_torch_loop(shape, greedy):
  """The rows' double in the reduced-vocabulary / greedy modes: the hook
  (jax runtime on CPU) draws the tokens of torch_dspark_loop (vLLM's loop in
  plain torch) and of jm at temperature 0."""
  torch = _torch()
  import jax_markov as jm
  from torch_bridge import FusedMarkovSampler
  from torch_bridge.testing import speculator_from_tensors, torch_dspark_loop
  B = 3
  t = common.torch_inputs(shape, B, 0, "cpu")
  j = common.jax_inputs(shape, B, 0)
  seeds, positions = common.seeds_and_positions(B, shape.S)
  spec = speculator_from_tensors(
      t["base"], t["embed"], t["proj"], t["anchors"], torch.zeros((B,)),
      seeds, positions, draft_to_target=t.get("targets"), greedy=greedy)
  sampler = FusedMarkovSampler(B, shape.draft_vocab, shape.R, torch.bfloat16,
                               check_values=True)
  assert sampler(spec, B, spec.head_hidden)
  want = torch_dspark_loop(spec, B, spec.head_hidden)
  np.testing.assert_array_equal(spec.draft_tokens.numpy(),
                                want["tokens"].numpy())
  head = MarkovHead(j["embed"], j["proj"])
  kw = ({} if shape.Vd is None else
        dict(draft_to_target=j["targets"], target_vocab=shape.V))
  jm_tokens = np.asarray(jm.greedy_draft(j["base"], j["anchors"], head, **kw))
  np.testing.assert_array_equal(spec.draft_tokens.numpy(), jm_tokens)
  if greedy:
    assert spec.draft_logits is None
  else:
    np.testing.assert_array_equal(spec.draft_logits.values.numpy(),
                                  want["logits"].numpy())


def test_bench_reduced_and_greedy_rows_smoke(tmp_path, monkeypatch):
  """The new rows' code paths through the harness on CPU: every impl's
  temperature-0 tokens agree (the harness checks them against jax_markov's),
  seed_design is skipped on the reduced shape, the greedy rows are timed
  once, and the report says x seed is n/a there."""
  monkeypatch.setenv("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  out = tmp_path / "res.json"
  rc = run.main(["--quick", "--shapes", "tinyr,tiny", "--batches", "2",
                 "--impls", "jax_markov,jax_markov_greedy,seed_design,"
                 "vllm_loop,torch_bridge,torch_bridge_greedy,"
                 "torch_bridge_greedy_graph", "--repeats", "2",
                 "--out", str(out), "--report",
                 "--docs-dir", str(tmp_path / "docs")])
  assert rc == 0
  rows = json.loads(out.read_text())
  got = {(r["impl"], r["shape"], r["temperature"]) for r in rows}
  for shape in ("tinyr", "tiny"):
    for impl in ("jax_markov", "vllm_loop", "torch_bridge"):
      assert {(impl, shape, 0.0), (impl, shape, 1.0)} <= got
    for impl in ("jax_markov_greedy", "torch_bridge_greedy"):
      assert [r["temperature"] for r in rows
              if r["impl"] == impl and r["shape"] == shape] == [0.0]
  assert not any(r["impl"] == "seed_design" and r["shape"] == "tinyr"
                 for r in rows)
  assert all(r["tokens_match"] for r in rows)
  assert all(r.get("Vd") == 40 for r in rows if r["shape"] == "tinyr")
  greedy = [r for r in rows if r["impl"] == "jax_markov_greedy"]
  assert all(r["floor_bytes"] == common.floor_bytes(
      common.SHAPES[r["shape"]], 2, cache=False) for r in greedy)
  md = (tmp_path / "docs" / "benchmarks.md").read_text()
  assert "Vd=40" in md and "## Greedy drafting (tokens only, no cache)" in md
  assert report.NO_SEED in md
  assert "n/a (vLLM's fused sampler does not cover this mode; vllm_loop is " \
      "the baseline)" in report.NO_SEED


def test_default_greedy_rows_only_on_dsv4_shapes():
  assert set(common.GREEDY_DEFAULT_SHAPES) == {"dsv4", "dsv4r"}
  assert {"jax_markov_greedy", "torch_bridge_greedy_graph"} <= set(common.IMPLS)
  assert "torch_bridge_greedy" not in common.IMPLS
  assert "dsv4r" in common.SHAPES and "tinyr" not in common.DEFAULT_SHAPES


def test_greedy_impls_skip_other_shapes_from_the_defaults(tmp_path):
  result = run._Result(str(tmp_path / "r.json"), {})
  cfg = dict(measure_bandwidth=False, temperatures=[0.0, 1.0],
             shapes=["tiny", "tinyr"], batches=[1],
             impls=["good", "jax_markov_greedy"], repeats=2, group=1,
             warmup=1, warmup_s=0.0, greedy_shapes=["tinyr"])
  run._run_family(cfg, _FakeRunner(), result, lambda msg: None)
  got = sorted((r["impl"], r["shape"], r["temperature"])
               for r in result.data["rows"])
  assert got == sorted([("good", "tiny", 0.0), ("good", "tiny", 1.0),
                        ("good", "tinyr", 0.0), ("good", "tinyr", 1.0),
                        ("jax_markov_greedy", "tinyr", 0.0)])


def test_bridge_rows_keep_their_hooks(tmp_path):
  """A captured graph does not hold the hook whose scratch it writes: the
  harness keeps the hooks with the calls (docs/limitations.md; dropping them
  was the illegal access of sessions 7, 8 and 11)."""
  _torch()
  from benchmarks import run
  from torch_bridge import FusedMarkovSampler
  result = run._Result(str(tmp_path / "r.json"), {})  # noqa: SLF001
  fam = run._BridgeFamily(dict(uniforms={}), result, lambda _: None)  # noqa: SLF001
  shape = common.SHAPES["tiny"]
  fam.make_inputs(shape, 2, 2)
  prep = fam.prepare("torch_bridge", shape, 2, 1.0)
  samplers, specs = prep.keep
  assert len(samplers) == len(specs) == len(prep.calls) == 2
  assert all(isinstance(s, FusedMarkovSampler) for s in samplers)


def test_occupancy_reads_registers_shared_memory_and_hints(tmp_path):
  """benchmarks/occupancy.py compiles the native block pass for sm_90a on
  the CPU: the programs a multiprocessor follow from the registers and
  shared memory it reads, kept rows on the pipelined tensor-core loop take
  more shared memory than the same tile without (two rank loops), and only
  the unrolled loop carries their evict_last into the PTX."""
  pytest.importorskip("torch")
  pytest.importorskip("triton")
  from benchmarks import common, occupancy
  from jax_markov.kernels.config import KernelConfig
  # The arithmetic alone (sm_90): 168 registers x 4 warps -> 3 programs;
  # 72 KB -> 3; 63 registers and no shared memory -> 8.
  assert occupancy.programs_per_sm(168, 73728, 4) == dict(
      by_registers=3, by_shared=3, programs=3)
  assert occupancy.programs_per_sm(63, 0, 4)["programs"] == 8
  assert occupancy.parse_fields(["k_loop=static", "proj_l2_rows=64"]) == dict(
      k_loop="static", proj_l2_rows=64)
  with pytest.raises(ValueError, match="field=value"):
    occupancy.parse_fields(["tile=64"])
  # ptxas -v's report of a tile at the register ceiling that spills.
  assert occupancy.parse_ptxas(
      "ptxas info    : Compiling entry function 'k' for 'sm_90a'\n"
      "ptxas info    : Function properties for k\n"
      "    16 bytes stack frame, 24 bytes spill stores, 20 bytes spill loads\n"
      "ptxas info    : Used 255 registers, used 1 barriers") == dict(
          registers=255, spill_stores=24, spill_loads=20)
  shape = common.SHAPES["small"]  # R = 64: four rank chunks to pipeline
  tile = KernelConfig(method="fused", block_b=16, block_v=128, block_k=16,
                      num_warps=4, num_stages=3)
  rows = {}
  for name, cfg in (("plain", tile),
                    ("rows", dataclasses.replace(tile, proj_l2_rows=256)),
                    ("static", dataclasses.replace(tile, k_loop="static",
                                                   proj_l2_rows=256))):
    rows[name] = occupancy.block_pass_occupancy(shape, 4, cfg,
                                                str(tmp_path / name))
  plain = rows["plain"]
  assert plain["grid_programs"] == 250  # cdiv(32000, 128) blocks, 1 tile
  assert plain["programs"] == min(plain["by_registers"], plain["by_shared"])
  assert plain["cp_async"] > 0 and plain["hinted"] == 0
  assert plain["spill_stores"] == plain["spill_loads"] == 0
  assert rows["rows"]["shared_bytes"] > plain["shared_bytes"]
  assert rows["rows"]["evict_last"] == 0  # cp.async drops the policy
  assert rows["static"]["evict_last"] > 0 and rows["static"]["cp_async"] == 0
  with pytest.raises(ValueError, match="method 'fused'"):
    occupancy.block_pass_occupancy(
        shape, 4, KernelConfig(method="xla_bias", block_b=1, block_v=128),
        str(tmp_path / "xla"))


def test_kernel_digest_names_the_kernels_a_bucket_launches(tmp_path,
                                                           monkeypatch):
  """benchmarks/kernel_digest.py: the same kernels give the same digests
  (whatever the IR cache's directory), a changed configuration changes the
  block pass's and nothing else, and the Mosaic GPU module is digested
  without its source locations (they move with every edited line)."""
  pytest.importorskip("torch")
  from benchmarks import kernel_digest
  from torch_bridge import native_plan
  small = common.SHAPES["small"]
  one, two = [kernel_digest.kernel_digests(
      small, 4, str(tmp_path / name), gpu="", dependent_launch=True)
              for name in ("a", "b")]
  assert one == two
  assert set(one) == {"block_pass", "draw_params", "select_pass"}
  table = native_plan.shape_config(kernel_digest.draft_shape(small, 4), 4)
  rows = dataclasses.replace(table, proj_l2_rows=256)
  monkeypatch.setattr(native_plan, "shape_config", lambda *_: rows)
  three = kernel_digest.kernel_digests(small, 4, str(tmp_path / "c"), gpu="",
                                       dependent_launch=True)
  assert {k for k in one if one[k] != three[k]} == {"block_pass"}
  monkeypatch.undo()
  # B = 128 on an H200 runs the Mosaic GPU pass (select_embed: embed_rows
  # gathers step 0's embeddings), digested as text without locations.
  kernels = kernel_digest.bucket_kernels(
      common.SHAPES["dsv4"], 128, str(tmp_path / "m"), gpu="NVIDIA H200",
      dependent_launch=False)
  assert "mosaic_block_pass" in kernels and "block_pass" not in kernels
  text = kernel_digest.mosaic_text(kernels["mosaic_block_pass"][0].module)
  assert "mosaic_gpu" in text and "loc(" not in text


def test_gpu_queue_runs_steps_in_order_within_its_budget(tmp_path):
  # benchmarks/gpu_queue.sh: each step's log, its exit status, a step the
  # budget would cut below 30 s skipped, a name filter; no GPU involved.
  # The logs and the steps' outputs come back as one archive (a device call
  # returns at most 8 files).
  import subprocess
  import tarfile
  queue = tmp_path / "queue.txt"
  queue.write_text("# a comment\n"
                   "first 20 echo one; echo $OUT > $OUT/where\n"
                   "failing 20 exit 3\n"
                   "slow 2 sleep 20\n"
                   "cut 1000 sleep 20\n")
  out = tmp_path / "out"
  script = os.path.join(os.path.dirname(__file__), "..", "benchmarks",
                        "gpu_queue.sh")
  # LIMIT 25: "cut" would get at most 18 s, below 30, so it is skipped.
  env = dict(os.environ, OUT=str(out), LIMIT="25")
  subprocess.run(["bash", script, str(queue)], env=env, check=True,
                 capture_output=True, timeout=60)
  steps = (out / "steps.txt").read_text().splitlines()
  assert [s.split()[:2] for s in steps] == [
      ["first", "rc=0"], ["failing", "rc=3"], ["slow", "rc=124"],
      ["cut", "skipped"]]
  assert sorted(p.name for p in out.iterdir()) == ["queue.tgz", "steps.txt"]
  with tarfile.open(out / "queue.tgz") as tar:
    files = {m.name.removeprefix("./"): m for m in tar.getmembers()
             if m.isfile()}
    assert set(files) == {"first.log", "failing.log", "slow.log", "where",
                          "steps.txt"}
    read = lambda name: tar.extractfile(files[name]).read().decode()
    assert read("first.log") == "one\n"
    assert read("steps.txt").splitlines() == steps
    # The steps' $OUT is a work folder of their own, not the destination.
    assert read("where").strip() != str(out)
  out2 = tmp_path / "out2"
  env = dict(os.environ, OUT=str(out2), LIMIT="25")
  subprocess.run(["bash", script, str(queue), "^fail"], env=env, check=True,
                 capture_output=True, timeout=60)
  assert [s.split()[0] for s in
          (out2 / "steps.txt").read_text().splitlines()] == ["failing"]


def test_gpu_queue_steps_name_what_exists():
  """Every step of benchmarks/gpu_queue.txt parses with its module's
  command line (tune_graph, block_step, run), and every pytest step's -k
  expression selects at least one GPU test of the files it names: a typo
  found here costs no device time (device calls are few and short)."""
  import shlex
  import subprocess
  import sys
  from _pytest.mark.expression import Expression
  from benchmarks import block_step, run, tune_graph
  root = os.path.join(os.path.dirname(__file__), "..")
  parsers = {"benchmarks.tune_graph": tune_graph.parser,
             "benchmarks.block_step": block_step.parser,
             "benchmarks.run": run._parser}  # noqa: SLF001
  pytest_steps, names = [], []
  with open(os.path.join(root, "benchmarks", "gpu_queue.txt")) as f:
    for line in f:
      if not line.strip() or line.startswith("#"):
        continue
      name, seconds, command = line.split(None, 2)
      names.append(name)
      assert int(seconds) > 0, name
      lexer = shlex.shlex(command.replace("$OUT", "/tmp/out"), posix=True,
                          punctuation_chars=";")
      lexer.whitespace_split = True
      parts, words = [], []
      for token in lexer:
        if token == ";":
          parts.append(words)
          words = []
        else:
          words.append(token)
      for words in parts + [words]:
        if not words or words[0] in ("for", "do") or "-m" not in words:
          continue  # a shell loop's body is checked where it is plain
        while "=" in words[0]:  # VAR=value before the command
          words.pop(0)
        module = words[words.index("-m") + 1]
        args = words[words.index("-m") + 2:]
        if module == "pytest":
          k = args[args.index("-k") + 1] if "-k" in args else None
          files = [a for a in args if a.startswith("tests/")]
          pytest_steps.append((name, k, files))
        elif module in parsers:
          try:
            parsers[module]().parse_args(args)
          except SystemExit:
            pytest.fail(f"queue step {name}: {module} refuses {args}")
  assert len(names) == len(set(names)), "queue step names repeat"
  files = sorted({f for _, _, fs in pytest_steps for f in fs})
  out = subprocess.run(
      [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
       "-p", "no:cacheprovider", *files], cwd=root, capture_output=True,
      text=True, timeout=300)
  ids = [l for l in out.stdout.splitlines() if "::" in l]
  assert ids, out.stdout[-2000:] + out.stderr[-2000:]
  for name, k, step_files in pytest_steps:
    chosen = [i for i in ids if i.split("::")[0] in step_files]
    if k is not None:
      expr = Expression.compile(k)
      chosen = [i for i in chosen
                if expr.evaluate(lambda word, i=i: word.lower() in i.lower())]
    assert chosen, f"queue step {name}: -k {k!r} selects no GPU test"
