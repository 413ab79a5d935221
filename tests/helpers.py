"""Test helpers: random problems and the sound checks of a draft against the contract.

The contract is checked step by step with teacher forcing, so one legitimately
different draw (see below) cannot hide or fake an error in later steps:

* logits[b, s] must equal base[b, s] + proj @ embed[prev] with prev the draft's
  own previous token, in float64, within the float32 bound for a dot of length
  R: (R + 2) * 2^-24 * (|base| + sum_k |embed_k proj_k|) (Higham's bound).
* T not > 0 (0, and under jit negative or NaN): the token must be the lowest
  index of the max of the draft's own logits (exact: no arithmetic is involved).
* T > 0: with y = float32(x * max(float32(1/T), 2^-126)), p = exp(y - max y) and the CDF in
  float64, the token i must have p_i > 0 and u*Z in [cdf[i-1] - tol, cdf[i] + tol]
  with tol = CDF_TOL * Z. Two float32 implementations that sum in different
  orders (and round exp differently) can place u*Z on different sides of a CDF
  boundary: at V = 129280 that happens for a few percent of draws, and even at
  small V a 1-ulp difference in the logits can flip a draw that sits on a
  boundary. Two implementations are therefore compared with
  assert_drafts_agree (logits within twice the bound, tokens equal wherever the
  draw is decided beyond rounding), not with array_equal.
"""

from __future__ import annotations

import chex
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


def _scale(t):
  """1 / T in float32, floored at the smallest normal (reference.MIN_SCALE)."""
  with np.errstate(divide="ignore", over="ignore"):
    return np.maximum(np.float32(1.0) / np.float32(t), np.float32(jm.reference.MIN_SCALE))


def check_step(x32, token, t, u):
  """Checks one draw (x32 float32 [V] logits) against the rule. Returns None or an error."""
  x = np.where(np.isnan(x32), -np.inf, x32).astype(np.float32)
  greedy = not t > 0 or not np.isfinite(_scale(t))
  y = x if greedy else (x * _scale(t)).astype(np.float32)
  m = y.max()
  if greedy or not np.isfinite(m):
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


def logits_bound(base, prev, head):
  """The exact logits and Higham's float32 bound on any implementation's error.

  base [B, S, V], prev int [B, S] (the token each draw follows). Returns float64
  (want, bound), both [B, S, V]: a float32 ``base + proj @ embed[prev]`` over a
  dot of length R, in any summation order (FMA or not), lies within ``bound``
  of ``want``: (R + 2) * 2^-24 * (|base| + sum_k |embed_k proj_k|).
  """
  embed, proj = _f64(head.embed), _f64(head.proj)
  base = _f64(base)
  emb = embed[np.asarray(prev)]                       # [B, S, R]
  want = base + np.einsum("bsr,vr->bsv", emb, proj, optimize=True)  # BLAS
  bound = (proj.shape[1] + 2) * 2.0**-24 * (
      np.abs(base) + np.einsum("bsr,vr->bsv", np.abs(emb), np.abs(proj),
                               optimize=True)) + 1e-30
  return want, bound


def _prev(tokens, anchor):
  return np.concatenate([np.asarray(anchor)[:, None], np.asarray(tokens)[:, :-1]], axis=1)


def _within(logits, want, bound):
  """Elementwise: logits equal want within bound, NaN and inf where want has them."""
  with np.errstate(invalid="ignore"):  # inf - inf where both are -inf
    ok = (logits == want) | (np.abs(logits - want) <= bound)
  ok |= np.isnan(want) & np.isnan(logits)
  ok |= np.isinf(want) & (logits == want)
  return ok


def check_draft(tokens, logits, base, anchor, head, temperature_bs, u_bs, *,
                rows=None, _want_bound=None):
  """Checks a draft (tokens [B,S], logits [B,S,V]) step by step; see module doc.

  temperature_bs, u_bs: [B, S] per draw. rows: optional bool [B, S] of draws to
  check (padding excluded). _want_bound: logits_bound for these tokens, when
  the caller has it (at B = 256, V = 129280 it is seconds of float64 work).
  """
  tokens = np.asarray(tokens)
  logits = np.asarray(logits)
  B, S, V = logits.shape
  assert tokens.shape == (B, S) and tokens.dtype == np.int32, (tokens.shape, tokens.dtype)
  assert ((tokens >= 0) & (tokens < V)).all(), "token out of range"
  want, bound = _want_bound or logits_bound(base, _prev(tokens, anchor), head)
  ok = _within(logits, want, bound)
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


def _decided(x32, delta, t, u):
  """The token a draw must be whatever the logits' last bits, or None when close.

  x32: float32 [V] logits of one draw; delta: the largest difference another
  correct implementation's logits may have from these. None where a change of
  every logit by up to delta (and CDF_TOL of float32 summation) could move the
  draw to another token: within that margin of a CDF boundary (T > 0) or with
  the top two logits within 2 * delta (T == 0).
  """
  x = np.where(np.isnan(x32), -np.inf, x32).astype(np.float64)
  if not t > 0 or not np.isfinite(_scale(t)) or not np.isfinite(np.max(x)):
    if not np.isfinite(np.max(x)):   # +inf or all -inf: fixed by the pattern of
      return int(np.argmax(x))       # infinities, which both share
    top2 = np.sort(x[np.isfinite(x)])[-2:]
    if len(top2) == 2 and top2[1] - top2[0] <= 2 * delta:
      return None
    return int(np.argmax(x))
  scale = float(_scale(t))
  y = x * scale
  p = np.exp(y - y.max())
  cdf = np.cumsum(p)
  z = cdf[-1]
  target = float(u) * z
  # exp(y +- delta * scale) moves every partial sum by at most this share of Z.
  margin = (CDF_TOL + 2 * np.expm1(min(2 * delta * scale, 50.0))) * z
  if np.min(np.abs(cdf - target)) <= margin:
    return None
  return int(np.sum(cdf <= target))


def assert_drafts_agree(a, b, base, anchor, head, temperature_bs, u_bs, *,
                        rows=None):
  """Two float32 implementations of one draft agree as far as float32 allows.

  a, b: (tokens [B, S], logits [B, S, V]) each. Two correct implementations may
  sum the bias in another order (or contract to FMA differently), so their
  logits may differ in the last bits and a draw at a CDF boundary may go either
  way. Asserted:

  * each satisfies the contract on its own logits (check_draft);
  * wherever both drew step s after the same token, their logits agree within
    twice Higham's bound (each is within one bound of the exact value), and
    their tokens are equal unless the draw lies within the logits' difference
    (plus CDF_TOL) of a CDF boundary or of a tie (_decided). After a legitimate
    split a request's later steps follow other tokens: only the contract
    applies to them.

  A stale read, a wrong bias row or a wrong uniform moves logits far past the
  bound or draws a token away from any boundary, so this keeps the power of
  an equality test. rows: optional bool [B, S] of draws to compare (padding out).
  """
  (ta, la), (tb, lb) = [(np.asarray(t), np.asarray(x)) for t, x in (a, b)]
  chex.assert_equal_shape([ta, tb])
  chex.assert_equal_shape([la, lb])
  chex.assert_type([ta, tb], np.int32)
  chex.assert_type([la, lb], np.float32)
  prev_a, prev_b = _prev(ta, anchor), _prev(tb, anchor)
  bound_a = logits_bound(base, prev_a, head)
  bound_b = (bound_a if np.array_equal(prev_a, prev_b)
             else logits_bound(base, prev_b, head))
  check_draft(ta, la, base, anchor, head, temperature_bs, u_bs, rows=rows,
              _want_bound=bound_a)
  check_draft(tb, lb, base, anchor, head, temperature_bs, u_bs, rows=rows,
              _want_bound=bound_b)
  B, S, V = la.shape
  _, bound = bound_a
  rows = np.ones((B, S), bool) if rows is None else np.asarray(rows)
  compared = rows & (prev_a == prev_b)
  ok = _within(lb, la.astype(np.float64), 2 * bound) | ~compared[:, :, None]
  assert ok.all(), (
      f"logits of the two drafts differ by up to "
      f"{np.nanmax(np.where(ok, 0, np.abs(lb - la.astype(np.float64)) / bound)):.3g} "
      "Higham bounds")
  errors = []
  for i, s in zip(*np.nonzero(compared)):
    if ta[i, s] == tb[i, s]:
      continue
    fin = np.isfinite(la[i, s]) & np.isfinite(lb[i, s])
    delta = float(np.max(np.abs(la[i, s][fin].astype(np.float64) - lb[i, s][fin]),
                         initial=0.0))
    delta = max(delta, float(np.max(2 * bound[i, s][fin], initial=0.0)))
    want = _decided(la[i, s], delta, float(temperature_bs[i, s]), float(u_bs[i, s]))
    if want is not None:
      errors.append(f"(b={i}, s={s}) tokens {ta[i, s]} and {tb[i, s]}, the draw "
                    f"is {want} beyond any rounding")
  assert not errors, "\n".join(errors[:10])


def check_sample_draft(draft, base, anchor, head, temperature, seeds, positions):
  u = np.asarray(jm.draft_uniforms(seeds, positions))
  t = np.broadcast_to(np.asarray(temperature)[:, None], u.shape)
  check_draft(draft.tokens, draft.logits, base, anchor, head, t, u)


def assert_sample_drafts_agree(a, b, base, anchor, head, temperature, seeds, positions):
  """assert_drafts_agree for two jm.Draft of the dense layout."""
  u = np.asarray(jm.draft_uniforms(seeds, positions))
  t = np.broadcast_to(np.asarray(temperature)[:, None], u.shape)
  assert_drafts_agree(tuple(a), tuple(b), base, anchor, head, t, u)


def torch_and_jax_gpu() -> bool:
  """Whether torch sees a CUDA device and JAX runs on a GPU (the bridge's GPU
  tests need both)."""
  import torch  # pylint: disable=g-import-not-at-top
  if not torch.cuda.is_available():
    return False
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False
