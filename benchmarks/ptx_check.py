"""Compiles the tail-select block pass once and prints, from XLA's dump of the
compiled module, what the kernel does before its atomic count: the global
stores, CTA barriers and fences (is a barrier between the stores and the count?).

  XLA_FLAGS="--xla_dump_to=DIR --xla_gpu_dump_llvmir" \
    python benchmarks/ptx_check.py DIR
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
  pattern = (r"bar\.|st\.global|atom\.|fence|membar|\.entry|barrier|"
             r"atomicrmw|store .*addrspace\(1\)|^define")
  for path in sorted(glob.glob(f"{dump_dir}/**/*", recursive=True)):
    if not path.endswith((".ptx", ".ll")):
      continue
    lines = open(path).read().splitlines()
    for n, line in enumerate(lines):
      if "atom." in line or "atomicrmw" in line:
        print(f"== {path}:{n}")
        lo = max(k for k in range(n + 1)
                 if k == 0 or ".entry" in lines[k] or lines[k].startswith("define"))
        window = [f"{k}: {lines[k].strip()[:160]}" for k in range(lo, n + 3)
                  if re.search(pattern, lines[k])]
        print("\n".join(window[-40:]))


if __name__ == "__main__":
  main(sys.argv[1])
