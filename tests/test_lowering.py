"""Every kernel configuration lowers to Triton, checked without a GPU.

Lowering the jitted sampler for the "cuda" platform runs the Pallas Triton
lowering rules in Python on any machine: a kernel that uses a primitive or a
form the Triton backend does not lower fails here, in CI, instead of on the
GPU. (Compiling the Triton IR to PTX still needs the GPU: ``pytest -m gpu``.)
The number of Triton calls in the lowered program is each select's launch
count: 2 a step with the select pass, 1 a step with the tail select, 1 a
draft with the persistent draft.
"""

import jax
import jax.numpy as jnp
import pytest

import jax_markov as jm
from jax_markov import sampler
from jax_markov.kernels import draft_pass, tuning

S = 3
DSV4 = dict(V=129280, R=256)


def _triton_calls(config, B, V, R, into=False):
  """Lowers one draft for CUDA; returns how many Triton kernels it launches."""
  head = jm.MarkovHead(embed=jax.ShapeDtypeStruct((V, R), jnp.bfloat16),
                       proj=jax.ShapeDtypeStruct((V, R), jnp.bfloat16))
  spec = jax.ShapeDtypeStruct
  args = [spec((B, S, V), jnp.bfloat16), spec((B,), jnp.int32), head,
          spec((B,), jnp.float32), spec((B, 2), jnp.uint32),
          spec((B, S), jnp.int32)]
  fn = sampler._sample_draft
  if into:
    N = B + 2
    args = [spec((N, S, V), jnp.float32), args[0], args[1], head,
            spec((N,), jnp.float32), spec((N, 2), jnp.uint32),
            spec((B, S), jnp.int32), args[5]]
    fn = sampler._sample_draft_into
  lowered = fn.trace(*args, config=config, interpret=False).lower(
      lowering_platforms=("cuda",))
  return lowered.as_text().count("xla.gpu.triton")


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
    (_config(method="fused", block_b=1, block_v=256, block_k=128,
             num_warps=8, num_stages=2, bias_dot="fma", select="persistent"),
     1),
]


@pytest.mark.parametrize("into", [False, True])
@pytest.mark.parametrize("config,launches", CONFIGS)
def test_config_lowers_to_triton(config, launches, into):
  assert _triton_calls(config, 5, 1000, 64, into=into) == launches


@pytest.mark.parametrize("B", [1, 64, 256])
def test_table_entries_lower_at_deepseek_v4_shape(B):
  config = tuning.choose(None, B, DSV4["V"], DSV4["R"], interpret=False)
  launches = S if config.select == "tail" else 2 * S
  assert _triton_calls(config, B, **DSV4) == launches
