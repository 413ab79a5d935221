"""Test helpers: random problems and the sound checks of a draft against the contract.

The contract is checked step by step with teacher forcing, so one legitimately
different draw (see below) cannot hide or fake an error in later steps:

* logits[b, s] must equal base[b, s] + proj @ embed[prev] with prev the draft's
  own previous token, in float64, within the float32 bound for a dot of length
  R: (R + 2) * 2^-24 * (|base| + sum_k |embed_k proj_k|) (Higham's bound).
* T == 0: the token must be the lowest index of the max of the draft's own
  logits (exact: no arithmetic is involved).
* T > 0: with y = float32(x * float32(1/T)), p = exp(y - max y) and the CDF in
  float64, the token i must have p_i > 0 and u*Z in [cdf[i-1] - tol, cdf[i] + tol]
  with tol = CDF_TOL * Z. Two float32 implementations that sum in different
  orders (and round exp differently) can place u*Z on different sides of a CDF
  boundary: at V = 129280 that happens for a few percent of draws, so exact
  token equality across implementations is only asserted where V is small.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jax_markov as jm

CDF_TOL = 1e-5  # relative to Z; float32 summation and exp rounding sit well below


def make_problem(B, S, V, R, dtype=jnp.bfloat16, *, seed=0, v_in=None,
                 temperature=None, base_scale=3.0, head_scale=0.3):
  rng = np.random.default_rng(seed)
  v_in = V if v_in is None else v_in
  base = jnp.asarray(base_scale * rng.standard_normal((B, S, V)), dtype)
  embed = jnp.asarray(head_scale * rng.standard_normal((v_in, R)), dtype)
  proj = jnp.asarray(head_scale * rng.standard_normal((V, R)), dtype)
  anchor = jnp.asarray(rng.integers(0, V, B), jnp.int32)
  if temperature is None:
    temperature = np.where(np.arange(B) % 2 == 0, 1.0, 0.0)
  temperature = jnp.asarray(temperature, jnp.float32)
  seeds = rng.integers(-2**63, 2**63 - 1, B, dtype=np.int64)
  positions = jnp.asarray(rng.integers(0, 10_000, (B, 1)) + np.arange(S), jnp.int32)
  return base, anchor, jm.MarkovHead(embed, proj), temperature, seeds, positions


def _f64(x):
  return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


def check_step(x32, token, t, u):
  """Checks one draw (x32 float32 [V] logits) against the rule. Returns None or an error."""
  x = np.where(np.isnan(x32), -np.inf, x32).astype(np.float32)
  if t == 0:
    y = x
  else:
    y = (x * np.float32(1.0 / np.float32(t))).astype(np.float32)
  m = y.max()
  if t == 0 or not np.isfinite(m):
    want = int(np.argmax(y))
    return None if token == want else f"greedy: token {token}, want {want}"
  p = np.exp(y.astype(np.float64) - float(m))
  cdf = np.cumsum(p)
  z = cdf[-1]
  target = float(u) * z
  tol = CDF_TOL * z
  lo = cdf[token - 1] if token > 0 else 0.0
  if not (0 <= token < len(x)) or p[token] <= 0:
    return f"token {token} has p = 0"
  if not (lo - tol <= target <= cdf[token] + tol):
    want = int(np.sum(cdf <= target))
    return f"token {token}: u*Z={target / z:.8f} outside [{lo / z:.8f}, {cdf[token] / z:.8f}] (want ~{want})"
  return None


def check_draft(tokens, logits, base, anchor, head, temperature_bs, u_bs, *,
                rows=None):
  """Checks a draft (tokens [B,S], logits [B,S,V]) step by step; see module doc.

  temperature_bs, u_bs: [B, S] per draw. rows: optional bool [B, S] of draws to
  check (padding excluded).
  """
  tokens = np.asarray(tokens)
  logits = np.asarray(logits)
  B, S, V = logits.shape
  assert tokens.shape == (B, S) and tokens.dtype == np.int32, (tokens.shape, tokens.dtype)
  assert ((tokens >= 0) & (tokens < V)).all(), "token out of range"
  embed, proj = _f64(head.embed), _f64(head.proj)
  base = _f64(base)
  prev = np.concatenate([np.asarray(anchor)[:, None], tokens[:, :-1]], axis=1)
  emb = embed[prev]                                   # [B, S, R]
  want = base + np.einsum("bsr,vr->bsv", emb, proj)
  bound = (proj.shape[1] + 2) * 2.0**-24 * (
      np.abs(base) + np.einsum("bsr,vr->bsv", np.abs(emb), np.abs(proj))) + 1e-30
  with np.errstate(invalid="ignore"):  # inf - inf where both are -inf
    ok = (logits == want) | (np.abs(logits - want) <= bound)
  ok |= np.isnan(want) & np.isnan(logits)
  ok |= np.isinf(want) & (logits == want)
  if rows is not None:
    ok |= ~np.asarray(rows)[:, :, None]
  assert ok.all(), f"logits off by {np.nanmax(np.abs(logits - want) - bound):.3g} over the bound"
  errors = []
  for b in range(B):
    for s in range(S):
      if rows is not None and not rows[b, s]:
        continue
      err = check_step(logits[b, s], int(tokens[b, s]), float(temperature_bs[b, s]),
                       float(u_bs[b, s]))
      if err:
        errors.append(f"(b={b}, s={s}) {err}")
  assert not errors, "\n".join(errors[:10])


def check_sample_draft(draft, base, anchor, head, temperature, seeds, positions):
  u = np.asarray(jm.draft_uniforms(seeds, positions))
  t = np.broadcast_to(np.asarray(temperature)[:, None], u.shape)
  check_draft(draft.tokens, draft.logits, base, anchor, head, t, u)
