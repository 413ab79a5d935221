"""Quick compiled-kernel check on a GPU: both methods against the reference, and a timing."""
import sys, time
import numpy as np, jax, jax.numpy as jnp
import jax_markov as jm

print(jax.__version__, jax.devices())
def make(B, S, V, R, dtype, seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 5)
  base = (3 * jax.random.normal(k[0], (B, S, V))).astype(dtype)
  head = jm.MarkovHead((jax.random.normal(k[1], (V, R)) * 0.2).astype(dtype),
                       (jax.random.normal(k[2], (V, R)) * 0.2).astype(dtype))
  anchor = jax.random.randint(k[3], (B,), 0, V)
  temp = jnp.where(jnp.arange(B) % 2 == 0, 1.0, 0.0)
  seeds = np.arange(B, dtype=np.int64) * 7919 + 11
  pos = np.tile(np.arange(S), (B, 1)) + 100
  return base, anchor, head, temp, seeds, pos
for (B, S, V, R) in [(3, 4, 300, 8), (8, 7, 129280, 256), (64, 7, 129280, 256)]:
  args = make(B, S, V, R, jnp.bfloat16)
  t, l = jm.reference.sample_draft(*args)
  for method in ["reference", "fused"]:
    try:
      d = jm.sample_draft(*args, method=method)
      jax.block_until_ready(d)
      ok = np.array_equal(np.asarray(d.tokens), np.asarray(t))
      err = float(jnp.max(jnp.abs(d.logits - l)))
      f = lambda: jm.sample_draft(*args, method=method, check_values=False)
      for _ in range(3): jax.block_until_ready(f())
      ts = []
      for _ in range(20):
        t0 = time.perf_counter(); jax.block_until_ready(f()); ts.append(time.perf_counter() - t0)
      print(f"B={B} V={V} {method}: tokens_equal={ok} max_logit_err={err:.2e} median_ms={1e3*np.median(ts):.3f}", flush=True)
      if not ok: print(np.asarray(t)[:4], np.asarray(d.tokens)[:4])
    except Exception as e:
      import traceback; traceback.print_exc(); print(f"B={B} V={V} {method}: FAILED {type(e).__name__}", flush=True)
