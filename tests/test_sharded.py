"""jax_markov.sharded.sample_draft_sharded: the sampler with V sharded over a mesh axis.

The multi-device cases need 8 host CPU devices, which must be set before JAX
initialises; this process has initialised JAX already, so they run once in a
subprocess (tests/_sharded_worker.py, interpret mode) and the tests here check
what it wrote: tokens and logits against the single-device sampler run in the
same subprocess, the contract step by step, the output placement and the
collectives of the program. The GPU tests (pytest -m gpu) use every GPU.
"""

import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jax_markov as jm
from jax_markov import sharded
from helpers import assert_sample_drafts_agree, check_sample_draft, make_problem

import _sharded_worker as worker

CASES = sorted(worker.CASES)
# Every dense case: the vocabulary split alone, and with the requests split
# over a data axis too.
DENSE_CASES = CASES + sorted(worker.DATA_CASES)


@pytest.fixture(scope="module")
def results(tmp_path_factory):
  out = tmp_path_factory.mktemp("sharded")
  env = dict(os.environ)
  env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") +
                      " --xla_force_host_platform_device_count=8").strip()
  env["JAX_PLATFORMS"] = "cpu"
  # The worker imports the jax_markov of this checkout (the repository root),
  # as pytest does through its ``pythonpath`` setting.
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = os.pathsep.join(
      p for p in (root, env.get("PYTHONPATH")) if p)
  proc = subprocess.run([sys.executable, worker.__file__, str(out)], env=env,
                        capture_output=True, text=True, timeout=900)
  if proc.returncode != 0:
    pytest.fail(f"sharded worker failed (rc={proc.returncode}):\n"
                f"{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
  with open(out / "meta.json") as f:
    meta = json.load(f)
  arrays = dict(np.load(out / "results.npz"))
  return meta, arrays


def _case(results, name):
  meta, arrays = results
  m = meta[name]
  V = m["V"]
  return (m, arrays[f"{name}/tokens"], arrays[f"{name}/logits"],
          arrays[f"single{V}/tokens"], arrays[f"single{V}/logits"])


def test_cases_cover_shard_counts():
  assert sorted({worker.CASES[c][0][-1] for c in CASES}) == [1, 2, 4, 8]
  assert any(V % shape[-1] for shape, _, V, _ in worker.CASES.values())
  # A data axis that divides B, and one that B is padded for.
  assert sorted(worker.B % shape[0] == 0
                for shape, _, _ in worker.DATA_CASES.values()) == [False, True]


@pytest.mark.parametrize("name", DENSE_CASES)
def test_equals_single_device(results, name):
  m, tokens, logits, want_tokens, want_logits = _case(results, name)
  B, S, V = worker.B, worker.S, m["V"]
  chex.assert_shape(tokens, (B, S))
  chex.assert_type(tokens, np.int32)
  chex.assert_shape(logits, (B, S, V))
  chex.assert_type(logits, np.float32)
  # Each logit is the same kernel's dot over the same rank columns, but in
  # another program (shard_map, another block count): equal within float32
  # rounding, the draws wherever they are decided beyond it.
  assert_sample_drafts_agree((tokens, logits), (want_tokens, want_logits),
                             *worker.problem(V))


@pytest.mark.parametrize("name", DENSE_CASES)
def test_contract(results, name):
  m, tokens, logits, _, _ = _case(results, name)
  args = worker.problem(m["V"])
  check_sample_draft(jm.Draft(tokens, logits), *args)
  assert (tokens[3] == 0).all()                       # all -inf row
  assert np.isin(tokens[2], [5, 600, 611, 620, m["V"] - 10, m["V"] - 1]).all()
  assert (tokens[4] >= 300).all()                     # NaN never drawn
  assert tokens[5, 1] == 700                          # first +inf


@pytest.mark.parametrize("name", CASES)
def test_placement(results, name):
  m = results[0][name]
  assert m["tokens_replicated"]
  if m["V"] % m["n"] == 0:
    assert m["logits_shard_shapes"] == [[worker.B, worker.S, m["V"] // m["n"]]]


@pytest.mark.parametrize("name", sorted(
    name for name, (shape, _, _) in worker.DATA_CASES.items()
    if worker.B % shape[0] == 0))
def test_data_axis_splits_the_requests(results, name):
  """With data_axis dividing B the tokens are split over it and the
  logits over both axes (a B padded inside the call comes back as XLA
  places the slice: its values are test_equals_single_device's)."""
  m = results[0][name]
  B, S, V, n, d = worker.B, worker.S, m["V"], m["n"], m["data"]
  assert m["tokens_shard_shapes"] == [[B // d, S]]
  assert m["logits_shard_shapes"] == [[B // d, S, V // n]]


def test_rejects_a_data_axis_that_is_not_another_axis():
  args = make_problem(2, 2, 64, 4, seed=37)
  mesh = _mesh1(("data", "vocab"))
  for bad in ("vocab", "dp"):
    with pytest.raises(ValueError, match="data_axis"):
      sharded.sample_draft_sharded(*args, mesh=mesh, data_axis=bad)
  draft = sharded.sample_draft_sharded(*args, mesh=mesh, data_axis="data")
  want = jm.sample_draft(*args)
  np.testing.assert_array_equal(np.asarray(draft.tokens),
                                np.asarray(want.tokens))


@pytest.mark.parametrize("name", worker.COLLECTIVE_CASES)
def test_exchange_is_statistics_and_tokens(results, name):
  m = results[0][name]
  B, n = worker.B, m["n"]
  # (max, sum) per request and block ("blocks") or per request ("shards").
  blocks = -(-m["V"] // n // worker.CONFIG.block_v) if m["exchange"] == "blocks" else 1
  gather = ("all_gather", f"tensor<2x{B}x{blocks}xf32>",
            f"tensor<2x{B}x{n * blocks}xf32>")
  psum = ("all_reduce", f"tensor<{B}xi32>", f"tensor<{B}xi32>")
  # Step 0 and the scanned step: one gather and one psum each, nothing else.
  assert sorted(map(tuple, m["collectives"])) == sorted([gather, psum] * 2)


def _into_case(results, name):
  """The serving-layout case as dense drafts of its live requests: (meta,
  sharded (tokens, logits), single-device (tokens, logits), the dense
  problem of those requests, the two caches, the live state rows)."""
  meta, arrays = results
  m = meta[name]
  V = m["V"]
  _, *_, rows = worker.into_problem(V)
  live = rows >= 0
  base, anchor, head, temperature, seeds, positions = worker.problem(V)
  dense = (base[live], anchor[live], head, temperature[live], seeds[live],
           positions[live])
  drafts = []
  for key in (name, f"single_into{V}"):
    tokens, cache = arrays[f"{key}/tokens"], arrays[f"{key}/cache"]
    # Request b keeps state row rows[b] at every step: cache[rows[b], s] is
    # the logits of its draw s.
    drafts.append((tokens[live], cache[rows[live]]))
  return (m, drafts[0], drafts[1], dense, arrays[f"{name}/cache"],
          arrays[f"single_into{V}/cache"], rows[live])


@pytest.mark.parametrize("name", sorted(worker.INTO_CASES))
def test_into_equals_single_device_sample_draft_into(results, name):
  """sample_draft_into_sharded: the draws of jm.sample_draft_into on one
  device (within float32 rounding of the logits, the tokens wherever they
  are decided beyond it), each by the rule; nothing written outside the
  live requests' rows, the padding request's included."""
  m, got, want, dense, cache, single_cache, live_rows = _into_case(results,
                                                                  name)
  V = m["V"]
  chex.assert_shape(cache, (worker.N_ROWS, worker.S, V))
  chex.assert_type(cache, np.float32)
  assert_sample_drafts_agree(got, want, *dense)
  check_sample_draft(jm.Draft(*got), *dense)
  untouched = np.setdiff1d(np.arange(worker.N_ROWS), live_rows)
  assert len(untouched) > 0
  assert (cache[untouched] == worker.SENTINEL).all()
  assert (single_cache[untouched] == worker.SENTINEL).all()
  tokens = got[0]
  assert (tokens[3] == 0).all()                       # all -inf row
  assert (tokens[4] >= 300).all()                     # NaN never drawn


@pytest.mark.parametrize("name", sorted(worker.INTO_CASES))
def test_into_placement_and_donation(results, name):
  m = results[0][name]
  assert m["tokens_replicated"] and m["donated"]
  assert m["cache_shard_shapes"] == [[worker.N_ROWS, worker.S,
                                      m["V"] // m["n"]]]


def test_into_refuses_a_vocabulary_the_shards_do_not_divide(results):
  assert "multiple of the 8 devices" in results[0]["into_refused"]


def test_into_rejects_bad_arguments_like_sample_draft_into():
  base, anchor, head, t, seeds, pos = make_problem(2, 2, 64, 4, seed=35)
  cache = jnp.zeros((3, 2, 64), jnp.float32)
  idx = np.array([[0, 0], [2, 2]], np.int32)
  mesh = _mesh1()
  with pytest.raises(ValueError, match="temperature must be"):
    sharded.sample_draft_into_sharded(cache, base, anchor, head, t, seeds,
                                      idx, pos, mesh=mesh)  # [B], not [N]
  t3, s3 = np.ones(3, np.float32), np.arange(3)
  with pytest.raises(ValueError, match="idx_map"):
    sharded.sample_draft_into_sharded(cache, base, anchor, head, t3, s3,
                                      idx[:1], pos, mesh=mesh)
  with pytest.raises(ValueError, match="draft_to_target"):
    sharded.sample_draft_into_sharded(cache, base, anchor, head, t3, s3, idx,
                                      pos, mesh=mesh,
                                      draft_to_target=np.arange(64))
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    sharded.sample_draft_into_sharded(cache, base, anchor, head, t3, s3, idx,
                                      pos, mesh=mesh, axis="tp")
  tokens, out = sharded.sample_draft_into_sharded(
      cache, base, anchor, head, t3, s3, idx, pos, mesh=mesh)
  chex.assert_shape(tokens, (2, 2))
  with pytest.raises(ValueError, match="donated"):
    sharded.sample_draft_into_sharded(cache, base, anchor, head, t3, s3, idx,
                                      pos, mesh=mesh)
  want, _ = jm.sample_draft_into(out, base, anchor, head, t3, s3, idx, pos)
  np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))


def _mesh1(names=("vocab",)):
  return Mesh(np.array(jax.devices()[:1]).reshape((1,) * len(names)), names)


def test_rejects_bad_mesh_axis_and_exchange():
  args = make_problem(2, 2, 64, 4, seed=31)
  with pytest.raises(ValueError, match="not an axis of the mesh"):
    sharded.sample_draft_sharded(*args, mesh=_mesh1(), axis="tp")
  with pytest.raises(ValueError, match="exchange must be one of"):
    sharded.sample_draft_sharded(*args, mesh=_mesh1(), exchange="ring")
  with pytest.raises(TypeError, match="jax.sharding.Mesh"):
    sharded.sample_draft_sharded(*args, mesh=jax.devices())
  with pytest.raises(ValueError, match="disagrees with config.method"):
    sharded.sample_draft_sharded(*args, mesh=_mesh1(), method="xla_bias",
                                 config=jm.KernelConfig(method="fused"))


def test_rejects_bad_shapes_like_sample_draft():
  base, anchor, head, t, seeds, pos = make_problem(2, 2, 64, 4, seed=32)
  with pytest.raises(ValueError, match="V disagrees"):
    sharded.sample_draft_sharded(base[:, :, :60], anchor, head, t, seeds, pos,
                                 mesh=_mesh1())
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    sharded.sample_draft_sharded(base, anchor, head, -t - 1, seeds, pos,
                                 mesh=_mesh1())


def test_vocab_sharding_specs():
  mesh = _mesh1(("data", "vocab"))
  place = sharded.vocab_sharding(mesh, "vocab")
  assert place["base_logits"].spec == jax.sharding.PartitionSpec(None, None, "vocab")
  assert place["proj"].spec == jax.sharding.PartitionSpec("vocab", None)
  assert place["replicated"].spec == jax.sharding.PartitionSpec()


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", sharded.EXCHANGES)
def test_gpu_all_devices_small(exchange):
  devices = jax.devices()
  n = len(devices)
  mesh = Mesh(np.array(devices), ("vocab",))
  V = 1024 * n
  args = make_problem(16, 3, V, 64, seed=33)
  # V / n = 4 blocks per shard
  config = jm.KernelConfig(method="fused", block_b=16, block_v=256, block_k=64)
  draft = sharded.sample_draft_sharded(*args, mesh=mesh, exchange=exchange,
                                       config=config)
  single = jm.sample_draft(*args, config=config)
  assert_sample_drafts_agree(draft, single, *args)


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", sharded.EXCHANGES)
def test_gpu_into_all_devices_small(exchange):
  """The serving layout over every GPU: jm.sample_draft_into's draws and
  cache rows, a padding request writing nothing."""
  devices = jax.devices()
  n = len(devices)
  mesh = Mesh(np.array(devices), ("vocab",))
  B, S, V, N = 16, 3, 1024 * n, 20
  base, anchor, head, t, seeds, pos = make_problem(B, S, V, 64, seed=36)
  rows = np.random.default_rng(36).permutation(N)[:B].astype(np.int32)
  rows[-1] = -1
  idx = np.repeat(rows[:, None], S, axis=1)
  t_rows, s_rows = np.ones(N, np.float32), np.arange(N, dtype=np.int64)
  t_rows[rows[:-1]], s_rows[rows[:-1]] = np.asarray(t)[:-1], np.asarray(
      seeds)[:-1]
  config = jm.KernelConfig(method="fused", block_b=16, block_v=256, block_k=64)
  cache = jax.device_put(jnp.full((N, S, V), 7.0, jnp.float32),
                         sharded.vocab_sharding(mesh)["logits"])
  tokens, out = sharded.sample_draft_into_sharded(
      cache, base, anchor, head, t_rows, s_rows, idx, pos, mesh=mesh,
      exchange=exchange, config=config)
  want_tokens, want = jm.sample_draft_into(
      jnp.full((N, S, V), 7.0, jnp.float32), base, anchor, head, t_rows,
      s_rows, idx, pos, config=config)
  live = rows >= 0
  dense = (np.asarray(base)[live], np.asarray(anchor)[live], head,
           np.asarray(t)[live], np.asarray(seeds)[live], np.asarray(pos)[live])
  out, want = np.asarray(out), np.asarray(want)
  assert_sample_drafts_agree(
      (np.asarray(tokens)[live], out[rows[live]]),
      (np.asarray(want_tokens)[live], want[rows[live]]), *dense)
  untouched = np.setdiff1d(np.arange(N), rows[live])
  assert (out[untouched] == 7.0).all()


@pytest.mark.gpu
@pytest.mark.parametrize("exchange", sharded.EXCHANGES)
def test_gpu_deepseek_v4_shape(exchange):
  devices = jax.devices()
  mesh = Mesh(np.array(devices), ("vocab",))
  B = 16
  args = make_problem(B, 7, 129280, 256, jnp.bfloat16, seed=34, head_scale=0.1,
                      temperature=np.where(np.arange(B) % 4 == 0, 0.0, 1.0))
  base, anchor, head, t, seeds, pos = args
  if 129280 % len(devices) == 0:
    place = sharded.vocab_sharding(mesh)
    base = jax.device_put(base, place["base_logits"])
    head = jm.MarkovHead(jax.device_put(head.embed, place["replicated"]),
                         jax.device_put(head.proj, place["proj"]))
  draft = sharded.sample_draft_sharded(base, anchor, head, t, seeds, pos,
                                       mesh=mesh, exchange=exchange)
  assert draft.tokens.shape == (B, 7) and draft.logits.shape == (B, 7, 129280)
  check_sample_draft(draft, *args)
