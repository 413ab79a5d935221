"""Every kernel configuration lowers to Triton, checked without a GPU.

Lowering the jitted sampler for the "cuda" platform runs the Pallas Triton
lowering rules in Python on any machine: a kernel that uses a primitive or a
form the Triton backend does not lower fails here, in CI, instead of on the
GPU. (Compiling the Triton IR to PTX still needs the GPU: ``pytest -m gpu``.)
The number of Triton calls in the lowered program is each select's launch
count: 2 a step with the select pass, 1 a step with the tail select, 1 a
draft with the persistent draft.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jax_markov as jm
from jax_markov import sampler
from jax_markov.kernels import block_pass, draft_pass, tuning

S = 3
DSV4 = dict(V=129280, R=256)


def _triton_calls(config, B, V, R, into=False, draft_vocab=None):
  """Lowers one draft for CUDA; returns how many Triton kernels it launches.

  draft_vocab: with a reduced draft vocabulary of that size (a
  draft_to_target map), base and proj have draft_vocab columns / rows and
  the cache V.
  """
  vd = V if draft_vocab is None else draft_vocab
  head = jm.MarkovHead(embed=jax.ShapeDtypeStruct((V, R), jnp.bfloat16),
                       proj=jax.ShapeDtypeStruct((vd, R), jnp.bfloat16))
  spec = jax.ShapeDtypeStruct
  args = [spec((B, S, vd), jnp.bfloat16), spec((B,), jnp.int32), head,
          spec((B,), jnp.float32), spec((B, 2), jnp.uint32),
          spec((B, S), jnp.int32)]
  kw = {}
  if draft_vocab is not None:
    kw = dict(draft_to_target=spec((vd,), jnp.int32))
  fn = sampler._sample_draft
  if into:
    N = B + 2
    args = [spec((N, S, V), jnp.float32), args[0], args[1], head,
            spec((N,), jnp.float32), spec((N, 2), jnp.uint32),
            spec((B, S), jnp.int32), args[5]]
    fn = sampler._sample_draft_into
  elif draft_vocab is not None:
    kw["target_vocab"] = V
  lowered = fn.trace(*args, config=config, interpret=False, **kw).lower(
      lowering_platforms=("cuda",))
  return lowered.as_text().count("xla.gpu.triton")


def _greedy_triton_calls(config, B, V, R, draft_vocab=None):
  """Lowers one jm.greedy_draft for CUDA; returns its Triton launches."""
  vd = V if draft_vocab is None else draft_vocab
  spec = jax.ShapeDtypeStruct
  head = jm.MarkovHead(embed=spec((V, R), jnp.bfloat16),
                       proj=spec((vd, R), jnp.bfloat16))
  kw = {}
  if draft_vocab is not None:
    kw = dict(draft_to_target=spec((vd,), jnp.int32), permute=True)
  lowered = sampler._greedy_draft.trace(
      spec((B, S, vd), jnp.bfloat16), spec((B,), jnp.int32), head,
      config=config, interpret=False, **kw).lower(lowering_platforms=("cuda",))
  text = lowered.as_text()
  # No cache: no [B * S, V] or [B, S, V] float32 anywhere; fused, no [*, V]
  # float32 at all (xla_bias has its per-step bias [B, Vd]).
  for shape in (f"{B * S}x{V}", f"{B * S}x{vd}", f"x{S}x{V}", f"x{S}x{vd}"):
    assert f"{shape}xf32>" not in text, shape
  if config.fused:
    assert f"x{V}xf32>" not in text and f"x{vd}xf32>" not in text
  return text.count("xla.gpu.triton")


@pytest.fixture(autouse=True)
def _h200_multiprocessors(monkeypatch):
  # The persistent draft sizes its grid by the GPU's multiprocessors.
  monkeypatch.setattr(draft_pass, "multiprocessors", lambda: 132)


def _config(**kw):
  """A KernelConfig; num_warps=4, num_stages=3 unless given (most entries)."""
  return jm.KernelConfig(**{"num_warps": 4, "num_stages": 3, **kw})


CONFIGS = [
    (_config(method="xla_bias", block_b=1, block_v=256, block_k=64,
             num_warps=8, num_stages=1), 2 * S),
    (_config(method="fused", block_b=16, block_v=128, block_k=32), 2 * S),
    (_config(method="fused", block_b=16, block_v=128, block_k=32,
             num_stages=1, k_loop="static"), 2 * S),
    (_config(method="fused", block_b=16, block_v=128, block_k=32,
             proj_l2_rows=256), 2 * S),
    (_config(method="fused", block_b=1, block_v=128, block_k=64,
             bias_dot="fma"), 2 * S),
    (_config(method="fused", block_b=4, block_v=128, block_k=16,
             bias_dot="fma"), 2 * S),
    (_config(method="fused", block_b=1, block_v=128, block_k=64,
             bias_dot="fma", select="tail", proj_l2_rows=256), S),
    (_config(method="fused", block_b=16, block_v=128, block_k=32,
             early_proj=1), 2 * S),
    (_config(method="fused", block_b=16, block_v=128, block_k=32,
             l2_hints="proj"), 2 * S),
    (_config(method="fused", block_b=1, block_v=128, block_k=64,
             bias_dot="fma", select="tail", early_proj=2), S),
    (_config(method="fused", block_b=1, block_v=128, block_k=64,
             bias_dot="fma", select="tail", early_proj=2,
             proj_l2_rows=256), S),
    (_config(method="fused", block_b=1, block_v=256, block_k=128,
             num_warps=8, num_stages=2, bias_dot="fma", select="persistent"),
     1),
    (_config(method="fused", block_b=16, block_v=128, block_k=64,
             num_warps=8, num_stages=2, select="persistent", held_blocks=1),
     1),
    (_config(method="fused", block_b=4, block_v=128, block_k=32,
             num_warps=8, num_stages=2, bias_dot="fma", select="persistent",
             held_blocks=2), 1),
]


@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize("config,launches", CONFIGS)
def test_config_lowers_to_triton(config, launches, into):
  assert _triton_calls(config, 5, 1000, 64, into=into) == launches


# The step-by-step configurations (the persistent draft refuses a map and
# greedy drafting).
STEPWISE = [(c, n) for c, n in CONFIGS if c.select != "persistent"]


@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize("config,launches", STEPWISE)
def test_reduced_draft_vocab_lowers_to_triton(config, launches, into):
  """draft_to_target: the block pass over the target columns (gathers by
  slot) lowers, with the same launches as without a map."""
  assert _triton_calls(config, 5, 1000, 64, into=into,
                       draft_vocab=600) == launches
  assert _triton_calls(config, 5, 1000, 64, into=into,
                       draft_vocab=1000) == launches


@pytest.mark.parametrize("config,launches", STEPWISE)
def test_greedy_draft_lowers_to_triton(config, launches):
  """The no-cache block pass and the greedy-only select (or tail) lower,
  with and without the map, and the program holds no [*, V] float32."""
  assert _greedy_triton_calls(config, 5, 1000, 64) == launches
  assert _greedy_triton_calls(config, 5, 1000, 64, draft_vocab=600) == launches


@pytest.mark.parametrize("into", [False, True])
def test_walking_programs_lower_to_triton(into):
  """block_programs (programs walking the vocabulary): the same launches,
  sampling (both layouts) and greedy; a map is refused (one request tile
  of the full vocabulary only)."""
  config = _config(method="fused", block_b=16, block_v=128, block_k=32,
                   block_programs=3)
  assert _triton_calls(config, 5, 1000, 64, into=into) == 2 * S
  assert _greedy_triton_calls(config, 5, 1000, 64) == 2 * S
  with pytest.raises(ValueError, match="block_programs"):
    _triton_calls(config, 5, 1000, 64, into=into, draft_vocab=600)


def test_persistent_draft_refuses_a_map():
  config = CONFIGS[-1][0]
  assert config.select == "persistent"
  with pytest.raises(ValueError, match="persistent"):
    _triton_calls(config, 5, 1000, 64, draft_vocab=600)


@pytest.mark.parametrize("B", [1, 64])
def test_reduced_draft_vocab_lowers_at_deepseek_v4_shape(B):
  """A 32k draft vocabulary of the 129k target, with the configuration
  sample_draft picks (the table's for the target vocabulary: the block pass
  walks the target columns)."""
  config = sampler._config(None, None, B, DSV4["V"], DSV4["R"], False,
                           stepwise=True)
  launches = S if config.select == "tail" else 2 * S
  assert _triton_calls(config, B, DSV4["V"], DSV4["R"],
                       draft_vocab=32768) == launches


@pytest.mark.parametrize("B", [1, 2, 4, 8, 16, 32, 64, 128, 256])
def test_table_entries_lower_at_deepseek_v4_shape(B):
  config = tuning.choose(None, B, DSV4["V"], DSV4["R"], interpret=False)
  launches = S if config.select == "tail" else 2 * S
  assert _triton_calls(config, B, **DSV4) == launches


@pytest.mark.parametrize("B,vocab", [(72, DSV4["V"]), (80, DSV4["V"]),
                                     (76, 200064)])
def test_remainder_rows_lower(B, vocab):
  """Batches a few rows past one tile (the table's 64-request tile at 129k,
  the rule's at 200k) run their remainder rows in the tile's programs, with
  and without the reduced draft vocabulary and greedy drafting; two tiles
  and more, or more rows over, take none."""
  config = tuning.choose(None, B, vocab, DSV4["R"], interpret=False)
  assert config.remainder_b and B % config.block_b <= config.remainder_b
  for other in (88, 136, 200):
    cfg = tuning.choose(None, other, vocab, DSV4["R"], interpret=False)
    assert block_pass.request_tiles(other, cfg)[1] == 0
  assert _triton_calls(config, B, vocab, DSV4["R"]) == 2 * S
  assert _triton_calls(config, B, vocab, DSV4["R"], into=True) == 2 * S
  after = dataclasses.replace(config, remainder_pass="after")
  assert _triton_calls(after, B, vocab, DSV4["R"]) == 2 * S
  if vocab == DSV4["V"] and B == 72:
    assert _triton_calls(config, B, vocab, DSV4["R"],
                         draft_vocab=32768) == 2 * S
    assert _greedy_triton_calls(config, B, vocab, DSV4["R"]) == 2 * S


@pytest.mark.parametrize("B", [1, 8, 32, 64])
def test_rule_lowers_at_a_200k_vocabulary(B):
  """The rule (no table entry at this vocabulary): L2-kept rows at B = 1,
  loads ahead of the wait and early dependents above it."""
  config = tuning.choose(None, B, 200064, 256, interpret=False)
  assert (config.proj_l2_rows > 0) == (B == 1)
  assert config.early_dependents == (B > 1)
  launches = S if config.select == "tail" else 2 * S
  assert _triton_calls(config, B, 200064, 256) == launches


def _pallas_operands(fn, *args):
  """(the operand positions in args, input_output_aliases) of fn's one
  pallas_call, traced on args (arrays or None)."""
  given = [i for i, a in enumerate(args) if a is not None]
  jaxpr = jax.make_jaxpr(
      lambda *xs: fn(*[xs[given.index(i)] if i in given else None
                       for i in range(len(args))]))(
          *[args[i] for i in given]).jaxpr
  (eqn,) = [e for e in jaxpr.eqns if e.primitive.name == "pallas_call"]
  order = [given[jaxpr.invars.index(v)] for v in eqn.invars]
  return order, eqn.params["input_output_aliases"]


def test_one_step_operand_order_for_a_native_runtime():
  """The operand order each wrapper's docstring promises (a native runtime
  binds its buffers' pointers in it): the given inputs in the module's INPUTS
  order, then the outputs, which alias the inputs of the same name."""
  from jax_markov.kernels import block_pass, select_pass
  spec = jax.ShapeDtypeStruct
  B, V, R, rows = 4, 256, 32, 2 * 4 * S
  base, embed, proj = (spec((B * S, V), jnp.bfloat16),
                       spec((V, R), jnp.bfloat16), spec((V, R), jnp.bfloat16))
  i32 = lambda *shape: spec(shape, jnp.int32)  # noqa: E731
  anchors, step, tokens, cache_rows = i32(B), i32(1), i32(B * S), i32(B * S)
  params, cache = spec((3, B * S), jnp.float32), spec((rows, V), jnp.float32)
  statics = dict(num_steps=S, num_cache_rows=rows)

  tail = jm.KernelConfig(method="fused", block_b=1, block_v=64, block_k=16,
                         bias_dot="fma", select="tail")
  fn = lambda b, e, p, a, s, q, r, c, t, n: block_pass.block_pass(  # noqa: E731
      b, (e, p, a), s, q, r, c, t, n, config=tail, **statics)
  # base, embed, proj, anchors, tokens, step, params, cache_rows, cache,
  # counters -> cache, block_max, block_sum, block_argmax, tokens, counters.
  order, aliases = _pallas_operands(fn, base, embed, proj, anchors, step,
                                    params, cache_rows, cache, tokens, i32(B))
  assert order == [0, 1, 2, 3, 8, 4, 5, 6, 7, 9]
  assert dict(aliases) == {8: 0, 4: 4, 9: 5}

  xla_bias = jm.KernelConfig(method="xla_bias", block_b=1, block_v=64)
  fn = lambda b, bias, s, q, r, c: block_pass.block_pass(  # noqa: E731
      b, bias, s, q, r, c, config=xla_bias, **statics)
  order, aliases = _pallas_operands(fn, base, spec((B, V), jnp.float32), step,
                                    params, None, cache)
  assert order == [0, 1, 2, 3, 5] and dict(aliases) == {4: 0}

  stats = spec((B, V // 64), jnp.float32)
  fn = lambda *xs: select_pass.select_pass(  # noqa: E731
      *xs, config=tail, num_steps=S)
  order, aliases = _pallas_operands(fn, stats, stats, i32(B, V // 64), cache,
                                    step, params, cache_rows, tokens)
  assert order == list(range(8)) and dict(aliases) == {7: 0}
  # New optional operands go last, so the order above holds without them.
  assert block_pass.INPUTS == ("base", "embed", "proj", "anchors", "tokens",
                               "bias", "step", "params", "cache_rows",
                               "cache", "counters", "columns", "slots")
  assert select_pass.INPUTS == ("block_max", "block_sum", "block_argmax",
                                "cache", "step", "params", "cache_rows",
                                "tokens", "columns", "chunk_max",
                                "chunk_sum", "chunk_argmax", "embed", "emb")
  assert select_pass.OUTPUTS == ("tokens", "emb")
  # The select that also writes the next embeddings (select_embed): embed
  # and emb after the plain operands, emb updated in place.
  fn = lambda *xs: select_pass.select_pass(  # noqa: E731
      *xs[:8], config=tail, num_steps=S, embed=xs[8], emb=xs[9])
  order, aliases = _pallas_operands(fn, stats, stats, i32(B, V // 64), cache,
                                    step, params, cache_rows, tokens, embed,
                                    spec((B, R), jnp.bfloat16))
  assert order == list(range(10)) and dict(aliases) == {7: 0, 9: 1}

  # Sampling with a map: slots [V target] after every other given input
  # (base and proj over the draft columns).
  vd = V // 2
  fn = lambda b, e, p, a, s, q, r, c, t, n, m: block_pass.block_pass(  # noqa: E731
      b, (e, p, a), s, q, r, c, t, n, config=tail, slots=m, **statics)
  order, aliases = _pallas_operands(
      fn, spec((B * S, vd), jnp.bfloat16), embed, spec((vd, R), jnp.bfloat16),
      anchors, step, params, cache_rows, cache, tokens, i32(B), i32(V))
  assert order == [0, 1, 2, 3, 8, 4, 5, 6, 7, 9, 10]
  # Greedy with a map: columns [Vd] last; no cache, params or sums.
  fn = lambda b, e, p, a, s, t, n, m: block_pass.block_pass(  # noqa: E731
      b, (e, p, a), s, None, None, None, t, n, config=tail, columns=m,
      num_steps=S, num_cache_rows=0, no_cache=True)
  order, _ = _pallas_operands(
      fn, spec((B * S, vd), jnp.bfloat16), embed, spec((vd, R), jnp.bfloat16),
      anchors, step, tokens, i32(B), i32(vd))
  assert order == [0, 1, 2, 3, 5, 4, 6, 7]
  fn = lambda bm, ba, s, t, m: select_pass.select_pass(  # noqa: E731
      bm, None, ba, None, s, None, None, t, config=tail, num_steps=S,
      columns=m, no_cache=True)
  order, _ = _pallas_operands(fn, stats, i32(B, V // 64), step, tokens,
                              i32(V))
  assert order == list(range(5))
