"""Compiles the tail-select block pass once and prints what the PTX does
around its atomic count (is a CTA barrier between the stores and the count?).

  XLA_FLAGS=--xla_dump_to=DIR python benchmarks/ptx_check.py DIR
"""
import glob
import re
import sys

import jax.numpy as jnp
import numpy as np

import jax_markov as jm


def main(dump_dir):
  rng = np.random.default_rng(0)
  B, S, V, R = 1, 2, 4096, 64
  base = jnp.asarray(rng.standard_normal((B, S, V)), jnp.bfloat16)
  head = jm.MarkovHead(jnp.asarray(rng.standard_normal((V, R)), jnp.bfloat16),
                       jnp.asarray(rng.standard_normal((V, R)), jnp.bfloat16))
  cfg = jm.KernelConfig("fused", 1, 128, 64, 4, 3, bias_dot="fma", select="tail")
  d = jm.sample_draft(base, jnp.zeros((B,), jnp.int32), head,
                      jnp.ones((B,), jnp.float32), np.arange(B),
                      jnp.arange(S)[None], config=cfg)
  d.tokens.block_until_ready()
  for path in glob.glob(f"{dump_dir}/**/*.ptx", recursive=True):
    text = open(path).read()
    if "atom." not in text:
      continue
    lines = text.splitlines()
    for n, line in enumerate(lines):
      if "atom." in line:
        print(f"== {path}:{n}")
        lo = max(k for k in range(n) if ".entry" in lines[k] or k == 0)
        window = [f"{k}: {lines[k].strip()}" for k in range(lo, n + 3)
                  if re.search(r"bar\.|st\.global|atom\.|fence|membar|\.entry",
                               lines[k])]
        print("\n".join(window))


if __name__ == "__main__":
  main(sys.argv[1])
