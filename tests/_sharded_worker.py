"""Runs jm.sample_draft_(into_)sharded on 8 host CPU devices; tests/test_sharded.py reads the results.

The host device count must be set before JAX initialises, and pytest's process
has initialised it already, so test_sharded.py runs this file in a fresh
process:  python tests/_sharded_worker.py OUT_DIR

For every case it writes to OUT_DIR/results.npz the sharded draft and the
single-device draft (jm.sample_draft, same kernel configuration, same process;
for the serving layout, jm.sample_draft_into_sharded and jm.sample_draft_into),
and to OUT_DIR/meta.json how the outputs are placed and which collectives the
program runs. It asserts nothing: the tests do.
"""

import json
import os
import re
import sys

if __name__ == "__main__":
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = (flags + " --xla_force_host_platform_device_count=8").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

import jax_markov as jm  # noqa: E402
from jax_markov import sharded  # noqa: E402

B, S, R = 6, 3, 8
CONFIG = jm.KernelConfig(method="fused", block_b=16, block_v=128, block_k=16)

# name: (vocabulary shards, mesh shape and axis names, V, exchange)
CASES = {
    "n1": ((1,), ("vocab",), 1020, "shards"),
    "n2_blocks": ((2,), ("vocab",), 1020, "blocks"),   # 510 per shard: partial blocks
    "n4_mesh2d": ((2, 4), ("data", "vocab"), 1020, "shards"),
    "n8_padded": ((8,), ("vocab",), 1020, "shards"),   # padded to 1024
    "n8_blocks": ((8,), ("vocab",), 1024, "blocks"),   # 128 per shard = block_v
}
COLLECTIVE_CASES = ("n2_blocks", "n8_padded")  # one per exchange
# The requests split over the mesh's "data" axis too (data_axis="data"):
# name: (mesh shape, V, exchange); B = 6 over 2 data shards, and over 4
# (padded to 8 inside the call).
DATA_CASES = {
    "dp2_n4": ((2, 4), 1020, "shards"),
    "dp4_n2_padded": ((4, 2), 1024, "blocks"),
}
# sample_draft_into_sharded: name: (shards, mesh shape and axis names, V,
# exchange); V a multiple of the shards (the cache is not padded).
INTO_CASES = {
    "into_n4_mesh2d": ((2, 4), ("data", "vocab"), 1020, "shards"),
    "into_n8_blocks": ((8,), ("vocab",), 1024, "blocks"),
}
N_ROWS = 9        # state rows of the serving cache
SENTINEL = 7.0    # what the cache holds where no draw writes


def into_problem(V):
  """problem(V) in the serving layout: request b keeps state row
  ``rows[b]`` at every step (the last request is padding, -1), the state
  rows' temperatures and seeds are the requests', the other rows' are
  others; the cache holds SENTINEL.

  Returns (cache, base, anchor, head, temperature [N], seeds [N], idx_map,
  positions, rows)."""
  base, anchor, head, temperature, seeds, positions = problem(V)
  rng = np.random.default_rng(31)
  rows = rng.permutation(N_ROWS)[:B].astype(np.int32)
  rows[-1] = -1
  idx_map = np.repeat(rows[:, None], S, axis=1)
  t_rows = rng.uniform(0.5, 2.0, N_ROWS).astype(np.float32)
  s_rows = rng.integers(-2**63, 2**63 - 1, N_ROWS, dtype=np.int64)
  t_rows[rows[:-1]], s_rows[rows[:-1]] = temperature[:-1], seeds[:-1]
  cache = np.full((N_ROWS, S, V), SENTINEL, np.float32)
  return (cache, base, anchor, head, t_rows, s_rows, idx_map, positions,
          rows)


def problem(V, seed=30):
  """A draft problem with the edge rows spread over the shards.

  Rows: 0 T=1; 1 T=0; 2 T=20 with only a few tokens in shard 0, the middle and
  the last shard drawable; 3 all -inf (token 0); 4 T=1 with NaN in [0, 300);
  5 T=0.5 with +inf at 700 and V-5 at step 1 (token 700 there).
  """
  rng = np.random.default_rng(seed)
  base = 3.0 * rng.standard_normal((B, S, V)).astype(np.float32)
  allowed = np.zeros(V, bool)
  allowed[[5, 600, 611, 620, V - 10, V - 1]] = True
  base[2, :, ~allowed] = -np.inf
  base[3] = -np.inf
  base[4, :, :300] = np.nan
  base[5, 1, [700, V - 5]] = np.inf
  embed = 0.3 * rng.standard_normal((V, R))
  proj = 0.3 * rng.standard_normal((V, R))
  head = jm.MarkovHead(jnp.asarray(embed, jnp.bfloat16), jnp.asarray(proj, jnp.bfloat16))
  anchor = rng.integers(0, V, B).astype(np.int32)
  temperature = np.array([1.0, 0.0, 20.0, 1.0, 1.0, 0.5], np.float32)
  seeds = rng.integers(-2**63, 2**63 - 1, B, dtype=np.int64)
  positions = (rng.integers(0, 10_000, (B, 1)) + np.arange(S)).astype(np.int32)
  return jnp.asarray(base, jnp.bfloat16), anchor, head, temperature, seeds, positions


def collectives(args, mesh, axis, exchange):
  """The collectives of the lowered program: [(op, operand type, result type)]."""
  base, anchor, head, temperature, seeds, positions = args
  text = sharded._sample_draft_sharded.lower(
      jnp.asarray(base), jnp.asarray(anchor), head, jnp.asarray(temperature),
      jm.rng.seed_words(seeds), jnp.asarray(positions), mesh=mesh, axis=axis,
      data_axis=None, exchange=exchange, config=CONFIG,
      interpret=True).as_text()
  found = []
  pattern = r'"stablehlo\.(all_gather|all_reduce|all_to_all|reduce_scatter|collective_permute|collective_broadcast)"'
  for match in re.finditer(pattern, text):
    sig = re.search(r": \((tensor<[^>]*>)\) -> (tensor<[^>]*>)", text[match.end():])
    found.append((match.group(1), sig.group(1), sig.group(2)))
  return found


def main(out_dir):
  devices = np.array(jax.devices())
  assert len(devices) >= 8, f"need 8 host devices, have {len(devices)}"
  arrays, meta = {}, {}
  problems = {V: problem(V) for V in sorted({c[2] for c in CASES.values()})}
  for V, args in problems.items():
    single = jm.sample_draft(*args, config=CONFIG)
    arrays[f"single{V}/tokens"] = np.asarray(single.tokens)
    arrays[f"single{V}/logits"] = np.asarray(single.logits)
  for name, (shape, names, V, exchange) in CASES.items():
    mesh = Mesh(devices[:int(np.prod(shape))].reshape(shape), names)
    base, anchor, head, temperature, seeds, positions = problems[V]
    n = mesh.shape["vocab"]
    if V % n == 0:  # placed as docs/sharded.md says; a padded V cannot be
      place = sharded.vocab_sharding(mesh, "vocab")
      base = jax.device_put(base, place["base_logits"])
      head = jm.MarkovHead(jax.device_put(head.embed, place["replicated"]),
                           jax.device_put(head.proj, place["proj"]))
    draft = sharded.sample_draft_sharded(base, anchor, head, temperature, seeds,
                                         positions, mesh=mesh, axis="vocab",
                                         exchange=exchange, config=CONFIG)
    arrays[f"{name}/tokens"] = np.asarray(draft.tokens)
    arrays[f"{name}/logits"] = np.asarray(draft.logits)
    meta[name] = {
        "V": V, "n": n, "exchange": exchange,
        "tokens_replicated": bool(draft.tokens.sharding.is_fully_replicated),
        "logits_shard_shapes": sorted({tuple(s.data.shape)
                                       for s in draft.logits.addressable_shards}),
    }
    if name in COLLECTIVE_CASES:
      meta[name]["collectives"] = collectives(problems[V], mesh, "vocab", exchange)
  for name, (shape, V, exchange) in DATA_CASES.items():
    mesh = Mesh(devices[:int(np.prod(shape))].reshape(shape),
                ("data", "vocab"))
    base, anchor, head, temperature, seeds, positions = problems[V]
    draft = sharded.sample_draft_sharded(
        base, anchor, head, temperature, seeds, positions, mesh=mesh,
        axis="vocab", data_axis="data", exchange=exchange, config=CONFIG)
    arrays[f"{name}/tokens"] = np.asarray(draft.tokens)
    arrays[f"{name}/logits"] = np.asarray(draft.logits)
    meta[name] = {
        "V": V, "n": mesh.shape["vocab"], "data": mesh.shape["data"],
        "exchange": exchange,
        "tokens_shard_shapes": sorted({tuple(s.data.shape)
                                       for s in draft.tokens.addressable_shards}),
        "logits_shard_shapes": sorted({tuple(s.data.shape)
                                       for s in draft.logits.addressable_shards}),
    }
  into_problems = {V: into_problem(V)
                   for V in sorted({c[2] for c in INTO_CASES.values()})}
  for V, (cache, *args, rows) in into_problems.items():
    tokens, out = jm.sample_draft_into(jnp.asarray(cache), *args,
                                       config=CONFIG, donate=False)
    arrays[f"single_into{V}/tokens"] = np.asarray(tokens)
    arrays[f"single_into{V}/cache"] = np.asarray(out)
  for name, (shape, names, V, exchange) in INTO_CASES.items():
    mesh = Mesh(devices[:int(np.prod(shape))].reshape(shape), names)
    cache, base, anchor, head, t_rows, s_rows, idx_map, positions, _ = (
        into_problems[V])
    place = sharded.vocab_sharding(mesh, "vocab")
    cache = jax.device_put(jnp.asarray(cache), place["logits"])
    base = jax.device_put(base, place["base_logits"])
    head = jm.MarkovHead(jax.device_put(head.embed, place["replicated"]),
                         jax.device_put(head.proj, place["proj"]))
    tokens, out = sharded.sample_draft_into_sharded(
        cache, base, anchor, head, t_rows, s_rows, idx_map, positions,
        mesh=mesh, axis="vocab", exchange=exchange, config=CONFIG)
    arrays[f"{name}/tokens"] = np.asarray(tokens)
    arrays[f"{name}/cache"] = np.asarray(out)
    meta[name] = {
        "V": V, "n": mesh.shape["vocab"], "exchange": exchange,
        "donated": bool(cache.is_deleted()),
        "tokens_replicated": bool(tokens.sharding.is_fully_replicated),
        "cache_shard_shapes": sorted({tuple(s.data.shape)
                                      for s in out.addressable_shards}),
    }
  # A V the shards do not divide: refused before anything runs.
  mesh = Mesh(devices[:8], ("vocab",))
  cache, *args, _ = into_problem(1020)
  try:
    sharded.sample_draft_into_sharded(jnp.asarray(cache), *args, mesh=mesh,
                                      config=CONFIG)
    meta["into_refused"] = None
  except ValueError as e:
    meta["into_refused"] = str(e)
  np.savez(os.path.join(out_dir, "results.npz"), **arrays)
  with open(os.path.join(out_dir, "meta.json"), "w") as f:
    json.dump(meta, f, indent=1)


if __name__ == "__main__":
  main(sys.argv[1])
