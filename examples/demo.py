"""``python -m jax_markov demo``: what the sampler is for, in one command.

An example, not part of the library (the wheel holds ``jax_markov`` and
``torch_bridge`` only): run it from a source checkout, as
``python -m jax_markov demo`` or ``python -m examples.demo``.

Nothing is downloaded. From text that ships with Python (examples/corpus.py)
the demo builds

* a *target* language model: a character bigram model, logits
  ``log p(next | prev)`` of shape [V, V];
* a DSpark-style *draft*: base logits that ignore the previous token (the
  unigram log-frequencies) plus a low-rank Markov head (embed [V, R],
  proj [V, R]) fitted by truncated SVD so that ``base + proj @ embed[prev]``
  approximates the bigram log-probabilities.

Each round drafts S tokens per sequence with :func:`jax_markov.sample_draft`
(anchor = the last emitted token) and verifies them against the target by
standard speculative rejection sampling (Leviathan et al. 2023, Chen et al.
2023), reading the logits the sampler cached: drafted token x is accepted with
probability ``min(1, p(x) / q(x))``; on the first rejection a token is drawn
from the residual ``norm(max(0, p - q))``; when all S are accepted a bonus
token is drawn from the target. The emitted text then follows the target's
distribution exactly, whatever the draft; the Markov head only makes the
accepted blocks longer. The demo runs the same rounds with the head and with a
head of zeros (base logits only), prints both mean accepted lengths, checks
losslessness with a chi-square test, and times the rounds.
"""

from __future__ import annotations

import argparse
import functools
import math
import sys
import time
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from examples import corpus
from jax_markov import reference, rng
from jax_markov.head import MarkovHead

# Limits that keep a typo from becoming an out-of-memory traceback.
MAX_BATCH = 4096
MAX_STEPS = 256
MAX_ROUNDS = 100_000
# A low-rank head (V = 96). The fused kernel also fails today for ranks above
# 64 that are not multiples of 64 (block_k = 64 reads past R).
MAX_RANK = 64
# Losslessness check: FAIL below this p-value. Under a lossless sampler a
# fixed-seed run fails with probability 1e-3.
P_VALUE_THRESHOLD = 1e-3
# The verifier's keys are derived from the seed with this word XORed into its
# high half, so they never coincide with the draft's keys (seed + row).
_VERIFY_KEY_SALT = 0x9E3779B9


# ----------------------------------------------------------------------------
# Models.


class Models(NamedTuple):
  """The demo's target and draft.

  Attributes:
    target_logits: float32 [V, V]; row ``a`` is ``log p(. | prev = a)`` of the
      bigram target (normalized log-probabilities).
    base: float32 [V], the draft's base logits (unigram log-probabilities),
      the same for every position and every previous token.
    head: the fitted Markov head, embed float32 [V, R], proj float32 [V, R].
    unigram: float64 [V], the unigram distribution (weights for averages).
  """
  target_logits: np.ndarray
  base: np.ndarray
  head: MarkovHead
  unigram: np.ndarray


def fit_models(tokens: np.ndarray, vocab_size: int, rank: int,
               smoothing: float = 5.0, fit_steps: int = 500) -> Models:
  """Fits the bigram target and the unigram + Markov-head draft.

  The target smooths the bigram counts towards the unigram distribution
  (Dirichlet prior of weight ``smoothing``), so every token has p > 0. The
  draft's base logits are the unigram log-probabilities. The head starts as
  the rank-R truncated SVD of ``log p(next | prev) - base[next]`` (each row
  centered: a per-row constant does not change a softmax), then ``fit_steps``
  Adam steps minimize the cross-entropy of the draft against the target's
  rows, weighted by the unigram frequency of the previous token (the SVD
  alone spends its rank on the log-probabilities of rare tokens).

  Args:
    tokens: int [N] token ids in [0, vocab_size), N >= 2.
    vocab_size: V.
    rank: R, 1 <= R <= V.
    smoothing: weight of the unigram prior in each bigram row.
    fit_steps: Adam steps after the SVD (0 keeps the SVD).

  Returns:
    :class:`Models`.
  """
  tokens = np.asarray(tokens, np.int64)
  V = vocab_size
  uni_counts = np.bincount(tokens, minlength=V).astype(np.float64)
  unigram = (uni_counts + 1.0) / (uni_counts.sum() + V)
  bigram = np.zeros((V, V), np.float64)
  np.add.at(bigram, (tokens[:-1], tokens[1:]), 1.0)
  cond = (bigram + smoothing * unigram[None, :]) / (
      bigram.sum(axis=1, keepdims=True) + smoothing)
  target = np.log(cond)
  base = np.log(unigram)
  resid = target - base[None, :]
  resid -= resid.mean(axis=1, keepdims=True)
  u, s, vt = np.linalg.svd(resid)
  root = np.sqrt(s[:rank])
  params = (jnp.asarray(u[:, :rank] * root[None, :], jnp.float32),
            jnp.asarray(vt[:rank].T * root[None, :], jnp.float32))
  if fit_steps > 0:
    params = _fit_head(params, jnp.asarray(base, jnp.float32),
                       jnp.asarray(cond, jnp.float32),
                       jnp.asarray(unigram, jnp.float32), fit_steps)
  return Models(target.astype(np.float32), base.astype(np.float32),
                MarkovHead(*params), unigram)


@functools.partial(jax.jit, static_argnums=(4,))
def _fit_head(params, base, cond, weights, steps, lr=0.05):
  """Adam on sum_a w_a * CE(cond[a], softmax(base + proj @ embed[a]))."""
  def loss(params):
    embed, proj = params
    logq = jax.nn.log_softmax(base[None, :] + embed @ proj.T, axis=-1)
    return -jnp.sum(weights[:, None] * cond * logq)

  def step(carry, t):
    params, m1, m2 = carry
    grad = jax.grad(loss)(params)
    m1 = jax.tree.map(lambda m, g: 0.9 * m + 0.1 * g, m1, grad)
    m2 = jax.tree.map(lambda m, g: 0.999 * m + 0.001 * g * g, m2, grad)
    params = jax.tree.map(
        lambda x, m, v: x - lr * (m / (1 - 0.9**t)) / (
            jnp.sqrt(v / (1 - 0.999**t)) + 1e-8), params, m1, m2)
    return (params, m1, m2), None

  zeros = jax.tree.map(jnp.zeros_like, params)
  (params, _, _), _ = jax.lax.scan(
      step, (params, zeros, zeros), jnp.arange(1, steps + 1, dtype=jnp.float32))
  return params


def zero_head(head: MarkovHead) -> MarkovHead:
  """A head of zeros of the same shapes: the draft without the Markov head."""
  return MarkovHead(jnp.zeros_like(head.embed), jnp.zeros_like(head.proj))


def softmax_t(logits: np.ndarray, temperature: float) -> np.ndarray:
  """float64 softmax(logits / T) over the last axis; T == 0: one-hot argmax."""
  x = np.asarray(logits, np.float64)
  if temperature == 0:
    return np.eye(x.shape[-1])[np.argmax(x, axis=-1)]
  y = x / temperature
  y = np.exp(y - y.max(axis=-1, keepdims=True))
  return y / y.sum(axis=-1, keepdims=True)


def acceptance_rate(models: Models, head: MarkovHead,
                    temperature: float) -> float:
  """Expected per-token acceptance ``sum_x min(p(x), q(x))``.

  Averaged over the previous token with unigram weights; p is the target's row
  and q the draft's (base + head bias), both at ``temperature``.
  """
  prev = jnp.arange(models.target_logits.shape[0])
  draft = models.base[None, :] + np.asarray(reference.bias(head, prev))
  p = softmax_t(models.target_logits, temperature)
  q = softmax_t(draft, temperature)
  return float(models.unigram @ np.minimum(p, q).sum(axis=1))


# ----------------------------------------------------------------------------
# Verification: standard speculative sampling on the cached draft logits.


@jax.jit
def verify(key: jax.Array, draft_tokens: jax.Array, draft_logits: jax.Array,
           anchor_tokens: jax.Array, target_logits: jax.Array,
           temperature: jax.Array):
  """Speculative rejection sampling of a drafted block against the target.

  For T > 0, with p = softmax(target_logits[prev] / T) and q =
  softmax(draft_logits / T): drafted token ``x_s`` is accepted with
  probability ``min(1, p_s(x_s) / q_s(x_s))``, left to right; at the first
  rejected position the emitted token is drawn from ``norm(max(0, p - q))``;
  if all S are accepted a bonus token is drawn from the target given the last
  drafted token. For T == 0 the verifier is greedy: it accepts while the
  drafted token is the target's argmax and then emits the target's argmax.

  Args:
    key: a JAX PRNG key (the verifier's own randomness, independent of the
      draft's uniforms).
    draft_tokens: int32 [B, S], the drafted tokens.
    draft_logits: float32 [B, S, V], the pre-temperature logits the tokens
      were drawn from (``jm.Draft.logits``).
    anchor_tokens: int [B], the token before the first drafted one.
    target_logits: float [V_in, V], the bigram target: row a holds the logits
      of the next token after token a.
    temperature: float32 [B] >= 0.

  Returns:
    (num_accepted int32 [B] in [0, S], next_token int32 [B]): the sequence
    continues with ``draft_tokens[b, :num_accepted[b]]`` and then
    ``next_token[b]`` (the residual draw, or the bonus token when all S were
    accepted).
  """
  B, S, V = draft_logits.shape
  rows = jnp.arange(B)
  prev = jnp.concatenate([anchor_tokens[:, None].astype(jnp.int32),
                          draft_tokens], axis=1)            # [B, S + 1]
  tl = target_logits[prev].astype(jnp.float32)              # [B, S + 1, V]
  t = temperature.astype(jnp.float32)
  greedy = t == 0
  inv_t = jnp.where(greedy, 1.0, 1.0 / jnp.where(greedy, 1.0, t))
  p = jax.nn.softmax(tl * inv_t[:, None, None], axis=-1)
  q = jax.nn.softmax(draft_logits.astype(jnp.float32) * inv_t[:, None, None],
                     axis=-1)
  px = jnp.take_along_axis(p[:, :S], draft_tokens[..., None], axis=-1)[..., 0]
  qx = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
  key_accept, key_residual = jax.random.split(key)
  u = jax.random.uniform(key_accept, (B, S), jnp.float32)
  # u < min(1, px / qx) without dividing (qx > 0 for a drawn token, u < 1).
  accept = jnp.where(greedy[:, None],
                     draft_tokens == jnp.argmax(tl[:, :S], axis=-1),
                     u * qx < px)
  num_accepted = jnp.sum(jnp.cumprod(accept.astype(jnp.int32), axis=1), axis=1)
  # Position S has no draft: q = 0 there makes the residual the target itself,
  # i.e. the bonus token.
  q_ext = jnp.concatenate([q, jnp.zeros((B, 1, V), q.dtype)], axis=1)
  p_n = p[rows, num_accepted]
  residual = jnp.maximum(p_n - q_ext[rows, num_accepted], 0.0)
  # p == q exactly is never rejected; the guard only keeps the draw defined.
  residual = jnp.where(residual.sum(-1, keepdims=True) > 0, residual, p_n)
  sampled = jax.random.categorical(key_residual, jnp.log(residual), axis=-1)
  greedy_next = jnp.argmax(tl[rows, num_accepted], axis=-1)
  next_token = jnp.where(greedy, greedy_next, sampled).astype(jnp.int32)
  return num_accepted.astype(jnp.int32), next_token


# ----------------------------------------------------------------------------
# Generation.

SampleFn = Callable[..., tuple]


class Run(NamedTuple):
  """What :func:`generate` did.

  Attributes:
    sequences: list of B int32 arrays: prompt + emitted tokens, per sequence.
    drafted: int32 [rounds, B, S], the drafted tokens of each round.
    num_accepted: int32 [rounds, B].
    next_token: int32 [rounds, B], the token emitted after the accepted ones.
    first_round_s: seconds of the first round (includes compilation).
    draft_s: seconds spent drafting in the other rounds.
    verify_s: seconds spent verifying in the other rounds.
  """
  sequences: list
  drafted: np.ndarray
  num_accepted: np.ndarray
  next_token: np.ndarray
  first_round_s: float
  draft_s: float
  verify_s: float

  @property
  def emitted_after_first_round(self) -> int:
    return int((self.num_accepted[1:] + 1).sum())


def verify_key(seed: int, round_index: int) -> jax.Array:
  """The verifier's key for a round: seed words with a salted high word."""
  words = np.asarray(rng.seed_words(np.int64(seed)))
  words = np.array([words[0] ^ np.uint32(_VERIFY_KEY_SALT), words[1]],
                   np.uint32)
  key = jax.random.wrap_key_data(jnp.asarray(words), impl="threefry2x32")
  return jax.random.fold_in(key, round_index)


def generate(sample_fn: SampleFn, models: Models, head: MarkovHead,
             prompt: np.ndarray, *, batch: int, steps: int,
             temperature: float, seed: int, rounds: int,
             progress: Callable[[int], None] | None = None) -> Run:
  """Runs ``rounds`` rounds of draft-then-verify for ``batch`` sequences.

  Sequence b uses the draft seed ``seed + b``; the draw at step s of a round
  is keyed by position ``len_b - 1 + s`` (the position of the token before
  the drafted one), so the draft's uniforms depend only on the seed and the
  position. The verifier's keys come from :func:`verify_key`.

  Args:
    sample_fn: ``jm.sample_draft`` or ``jm.reference.sample_draft``: returns
      (tokens int32 [B, S], logits float32 [B, S, V]).
    models: the target and the draft's base logits.
    head: the draft's Markov head (``models.head`` or :func:`zero_head`).
    prompt: int [P >= 1], the common start of every sequence.
    batch, steps, temperature, seed, rounds: B, S, T, seed, number of rounds.
    progress: called with the number of rounds done after each round.

  Returns:
    :class:`Run`.
  """
  B, S = batch, steps
  V = models.base.shape[0]
  seqs = np.zeros((B, len(prompt) + rounds * (S + 1)), np.int32)
  seqs[:, :len(prompt)] = prompt
  lens = np.full(B, len(prompt), np.int64)
  base = jnp.broadcast_to(jnp.asarray(models.base), (B, S, V))
  target = jnp.asarray(models.target_logits)
  temps = jnp.full((B,), temperature, jnp.float32)
  seeds = np.int64(seed) + np.arange(B, dtype=np.int64)
  drafted = np.zeros((rounds, B, S), np.int32)
  num_accepted = np.zeros((rounds, B), np.int32)
  next_token = np.zeros((rounds, B), np.int32)
  first_round_s = draft_s = verify_s = 0.0
  rows = np.arange(B)
  for r in range(rounds):
    anchor = seqs[rows, lens - 1]
    positions = (lens - 1)[:, None] + np.arange(S)[None, :]
    t0 = time.perf_counter()
    tokens, logits = sample_fn(base, jnp.asarray(anchor), head, temps, seeds,
                               jnp.asarray(positions, jnp.int32))
    tokens.block_until_ready()
    t1 = time.perf_counter()
    n_acc, nxt = verify(verify_key(seed, r), tokens, logits,
                        jnp.asarray(anchor), target, temps)
    n_acc, nxt, tokens = np.asarray(n_acc), np.asarray(nxt), np.asarray(tokens)
    t2 = time.perf_counter()
    if r == 0:
      first_round_s = t2 - t0
    else:
      draft_s += t1 - t0
      verify_s += t2 - t1
    for b in range(B):
      k = n_acc[b]
      seqs[b, lens[b]:lens[b] + k] = tokens[b, :k]
      seqs[b, lens[b] + k] = nxt[b]
    lens += n_acc + 1
    drafted[r], num_accepted[r], next_token[r] = tokens, n_acc, nxt
    if progress is not None:
      progress(r + 1)
  sequences = [seqs[b, :lens[b]] for b in range(B)]
  return Run(sequences, drafted, num_accepted, next_token, first_round_s,
             draft_s, verify_s)


# ----------------------------------------------------------------------------
# Losslessness check.


class ChiSquare(NamedTuple):
  """A Pearson chi-square goodness-of-fit result."""
  statistic: float
  dof: int
  p_value: float
  num_samples: int


def chi2_sf(statistic: float, dof: int) -> float:
  """P(X >= statistic) for X ~ chi-square(dof)."""
  if math.isinf(statistic):
    return 0.0
  if dof <= 0:
    return 1.0
  return float(jax.scipy.special.gammaincc(
      jnp.float32(dof / 2.0), jnp.float32(statistic / 2.0)))


def transition_chi_square(sequences: Sequence[np.ndarray], start: int,
                          probs: np.ndarray,
                          min_expected: float = 5.0) -> ChiSquare:
  """Tests that each emitted token follows ``probs[previous token]``.

  Counts the transitions (prev -> next) for every token at index >= start of
  every sequence and compares them, per previous token, with the expected
  counts ``n_prev * probs[prev]``: the Anderson-Goodman test of a Markov
  chain's transition probabilities, asymptotically chi-square with
  sum_prev (cells_prev - 1) degrees of freedom. The cells of a previous token
  are formed from the expected counts alone: tokens in decreasing order of
  probability are grouped until a group's expected count reaches
  ``min_expected``, the remainder joining the last group. An emitted token of
  probability exactly 0 makes the statistic infinite.

  Args:
    sequences: int token sequences.
    start: index of the first emitted token (the prompt length, >= 1).
    probs: float [V_in, V], row a = the distribution of the token after a.
    min_expected: the smallest expected count of a cell.

  Returns:
    :class:`ChiSquare`; dof == 0 means too few tokens for a test (p = 1).
  """
  counts = np.zeros(probs.shape, np.float64)
  for seq in sequences:
    seq = np.asarray(seq, np.int64)
    np.add.at(counts, (seq[start - 1:-1], seq[start:]), 1.0)
  stat, dof = 0.0, 0
  for a in np.nonzero(counts.sum(axis=1))[0]:
    obs = counts[a]
    expected = obs.sum() * np.asarray(probs[a], np.float64)
    if np.any((expected == 0) & (obs > 0)):
      stat = math.inf
    order = np.argsort(-expected, kind="stable")
    cells_obs, cells_exp = [], []
    cur_obs = cur_exp = 0.0
    for i in order:
      cur_obs += obs[i]
      cur_exp += expected[i]
      if cur_exp >= min_expected:
        cells_obs.append(cur_obs)
        cells_exp.append(cur_exp)
        cur_obs = cur_exp = 0.0
    if cells_exp:
      cells_obs[-1] += cur_obs
      cells_exp[-1] += cur_exp
    if len(cells_exp) < 2:
      continue
    cells_obs, cells_exp = np.asarray(cells_obs), np.asarray(cells_exp)
    stat += float(np.sum((cells_obs - cells_exp) ** 2 / cells_exp))
    dof += len(cells_exp) - 1
  return ChiSquare(stat, dof, chi2_sf(stat, dof), int(counts.sum()))


def greedy_mismatches(sequences: Sequence[np.ndarray], start: int,
                      target_logits: np.ndarray) -> int:
  """Number of emitted tokens that are not the target's argmax (T == 0)."""
  argmax = np.argmax(target_logits, axis=-1)
  return sum(int(np.sum(argmax[seq[start - 1:-1]] != seq[start:]))
             for seq in sequences)


# ----------------------------------------------------------------------------
# The command line.


def _int_in(lo: int, hi: int, what: str):
  def parse(text: str) -> int:
    try:
      value = int(text)
    except ValueError:
      raise argparse.ArgumentTypeError(
          f"{what} must be an integer, got {text!r}") from None
    if not lo <= value <= hi:
      raise argparse.ArgumentTypeError(
          f"{what} must be in [{lo}, {hi}], got {value}")
    return value
  return parse


def _temperature(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(
        f"temperature must be a number, got {text!r}") from None
  if not math.isfinite(value) or value < 0:
    raise argparse.ArgumentTypeError(
        f"temperature must be finite and >= 0 (0 = greedy), got {text}")
  return value


def build_parser() -> argparse.ArgumentParser:
  """The demo's options; bad values exit with status 2 and a one-line error."""
  parser = argparse.ArgumentParser(
      prog="python -m jax_markov demo",
      description=(
          "Draft S tokens a round with jax_markov's Markov-head sampler, "
          "verify them against a target model by speculative sampling, and "
          "compare the accepted length with and without the Markov head. "
          "Uses only text that ships with Python; downloads nothing."))
  parser.add_argument("--batch", type=_int_in(1, MAX_BATCH, "batch"),
                      default=8, help="sequences per round (default 8)")
  parser.add_argument("--steps", "-S", type=_int_in(1, MAX_STEPS, "steps"),
                      default=8, help="drafted tokens per round, S (default 8)")
  parser.add_argument("--temperature", "-T", type=_temperature, default=1.0,
                      help="sampling temperature, >= 0; 0 = greedy "
                           "(default 1.0)")
  parser.add_argument("--seed", type=_int_in(0, 2**62, "seed"), default=0,
                      help="random seed (default 0)")
  parser.add_argument("--rounds", type=_int_in(1, MAX_ROUNDS, "rounds"),
                      default=200, help="rounds per run (default 200)")
  parser.add_argument("--rank", type=_int_in(1, MAX_RANK, "rank"),
                      default=8, help="rank R of the Markov head (default 8)")
  parser.add_argument("--prompt", default="The ",
                      help="text every sequence starts from (default 'The ')")
  parser.add_argument("--sampler", choices=("kernel", "reference"),
                      default="kernel",
                      help="jm.sample_draft (Pallas kernels; interpret mode "
                           "off GPU) or jm.reference.sample_draft (plain jnp)"
                           " (default kernel)")
  parser.add_argument("--no-progress", action="store_true",
                      help="do not report progress on stderr")
  return parser


class _Progress:
  """Reports progress on stderr once a task has run for a few seconds."""

  def __init__(self, label: str, total: int, enabled: bool,
               after_s: float = 2.0, every_s: float = 2.0):
    self.label, self.total, self.enabled = label, total, enabled
    self.after_s, self.every_s = after_s, every_s
    self.start = time.perf_counter()
    self.last = None
    self.tty = sys.stderr.isatty()
    if enabled:
      print(f"  {label}: {total} rounds (the first call compiles)...",
            file=sys.stderr, flush=True)

  def __call__(self, done: int) -> None:
    if not self.enabled:
      return
    now = time.perf_counter()
    elapsed = now - self.start
    due = (elapsed >= self.after_s if self.last is None
           else now - self.last >= self.every_s)
    if not due and not (done == self.total and self.last is not None):
      return
    self.last = now
    line = f"  {self.label}: round {done}/{self.total}, {elapsed:.1f} s"
    if self.tty:
      end = "\n" if done == self.total else ""
      print("\r" + line, end=end, file=sys.stderr, flush=True)
    else:
      print(line, file=sys.stderr, flush=True)


def _quote(tokens) -> str:
  return '"' + corpus.printable(corpus.decode(tokens)) + '"'


def _print_rounds(run: Run, steps: int, greedy: bool, shown: int = 6):
  """Row 0's first rounds: drafted tokens split at the first rejection."""
  print("    row 0, first rounds (drafted: accepted|rejected, then the "
        "target's token):")
  for r in range(min(shown, run.drafted.shape[0])):
    k = int(run.num_accepted[r, 0])
    acc = corpus.printable(corpus.decode(run.drafted[r, 0, :k]))
    rej = corpus.printable(corpus.decode(run.drafted[r, 0, k:]))
    how = ("bonus" if k == steps else
           "target's argmax" if greedy else "residual")
    print(f"      round {r + 1:2d}: \"{acc}|{rej}\"  accepted {k}/{steps}, "
          f"+ {_quote([run.next_token[r, 0]])} ({how})")


def _print_run(name: str, run: Run, steps: int, batch: int,
               greedy: bool) -> float:
  mean_acc = float(run.num_accepted.mean())
  print(f"  {name}")
  _print_rounds(run, steps, greedy)
  for b in range(min(2, batch)):
    text = corpus.printable(corpus.decode(run.sequences[b]))
    if len(text) > 100:
      text = text[:97] + "..."
    print(f"    text, row {b}: \"{text}\"")
  print(f"    mean accepted length: {mean_acc:.2f} of {steps} drafted "
        f"tokens/round ({mean_acc + 1:.2f} tokens emitted/round)")
  timed_rounds = run.num_accepted.shape[0] - 1
  if timed_rounds > 0:
    total_s = run.draft_s + run.verify_s
    print(f"    time: draft {1e3 * run.draft_s / timed_rounds:.1f} ms/round, "
          f"verify {1e3 * run.verify_s / timed_rounds:.1f} ms/round, "
          f"{run.emitted_after_first_round / max(total_s, 1e-9):,.0f} "
          f"tokens/s emitted (first round, compiling on first use: "
          f"{run.first_round_s:.2f} s)")
  else:
    print(f"    time: {run.first_round_s:.2f} s for the single round "
          f"(incl. compilation)")
  return mean_acc


def main(argv: Sequence[str] | None = None) -> int:
  """Runs the demo. Returns 0, or 1 when the losslessness check fails.

  Bad options exit through argparse with status 2 and a one-line message.
  """
  parser = build_parser()
  args = parser.parse_args(argv)
  try:
    prompt = corpus.encode(args.prompt)
  except ValueError as e:
    parser.error(f"argument --prompt: {e}")
  if len(prompt) == 0:
    parser.error("argument --prompt: must not be empty")

  if args.sampler == "kernel":
    import jax_markov as jm  # pylint: disable=import-outside-toplevel
    sample_fn = jm.sample_draft
    backend = jax.default_backend()
    sampler_name = ("jm.sample_draft (Pallas kernels"
                    + (")" if backend == "gpu" else
                       f", interpret mode on {backend}: slow, for correctness"
                       ")"))
  else:
    sample_fn = reference.sample_draft
    sampler_name = "jm.reference.sample_draft (plain jnp)"

  B, S, T = args.batch, args.steps, args.temperature
  start = time.perf_counter()
  text = corpus.load_text()
  tokens = corpus.encode(text)
  V = corpus.VOCAB_SIZE
  models = fit_models(tokens, V, args.rank)
  no_head = zero_head(models.head)

  print("jax-markov demo: DSpark-style drafting with a Markov head, verified "
        "by speculative sampling")
  print(f"  text: {len(text):,} characters (Zen of Python + docstrings of "
        f"{len(corpus.MODULES)} stdlib modules, Python "
        f"{sys.version_info.major}.{sys.version_info.minor}); vocabulary "
        f"V = {V} (newline + printable ASCII)")
  print(f"  target: character bigram model, logits [{V}, {V}]")
  print(f"  draft: unigram base logits (ignore the previous token) + Markov "
        f"head of rank {args.rank} (embed [{V}, {args.rank}], proj "
        f"[{V}, {args.rank}]) fitted to the bigram (SVD, then cross-entropy)")
  if T > 0:
    print(f"  expected per-token acceptance at T = {T:g}: "
          f"{acceptance_rate(models, models.head, T):.3f} with the head, "
          f"{acceptance_rate(models, no_head, T):.3f} without")
  print(f"  sampler: {sampler_name}; backend {jax.default_backend()}")
  print(f"  run: batch {B}, S = {S} drafted tokens/round, temperature {T:g}, "
        f"seed {args.seed}, {args.rounds} rounds, prompt "
        f"{_quote(prompt)}")
  print(flush=True)

  runs = {}
  for name, head in (("with Markov head", models.head),
                     ("without Markov head (head of zeros)", no_head)):
    progress = _Progress(name, args.rounds, not args.no_progress)
    runs[name] = generate(sample_fn, models, head, prompt, batch=B, steps=S,
                          temperature=T, seed=args.seed, rounds=args.rounds,
                          progress=progress)
  means = [_print_run(name, run, S, B, T == 0)
           for name, run in runs.items()]
  print()
  ratio = (f" ({means[0] / means[1]:.1f}x)" if means[1] > 0 else "")
  print(f"  mean accepted length: {means[0]:.2f} with the Markov head vs "
        f"{means[1]:.2f} without{ratio}, of S = {S}")

  ok = True
  if T == 0:
    print("  lossless check (greedy): every emitted token is the target's "
          "argmax given the token before it")
    for name, run in runs.items():
      bad = greedy_mismatches(run.sequences, len(prompt), models.target_logits)
      n = sum(len(s) - len(prompt) for s in run.sequences)
      ok &= bad == 0
      print(f"    {name}: {bad} of {n} tokens differ  "
            f"{'PASS' if bad == 0 else 'FAIL'}")
  else:
    probs = softmax_t(models.target_logits, T)
    print("  lossless check: each emitted token vs the target's distribution "
          "given the token before it")
    print(f"    (Pearson chi-square over transitions; FAIL if p < "
          f"{P_VALUE_THRESHOLD:g})")
    for name, run in runs.items():
      chi = transition_chi_square(run.sequences, len(prompt), probs)
      if chi.dof == 0 and math.isfinite(chi.statistic):
        print(f"    {name}: no test possible over {chi.num_samples:,} "
              f"tokens (too few, or the target near-deterministic at this "
              f"temperature; raise --rounds or --batch)  SKIPPED")
        continue
      passed = chi.p_value >= P_VALUE_THRESHOLD
      ok &= passed
      print(f"    {name}: chi2 = {chi.statistic:.1f}, dof = {chi.dof}, "
            f"p = {chi.p_value:.3g} over {chi.num_samples:,} tokens  "
            f"{'PASS' if passed else 'FAIL'}")
  print(f"  total time: {time.perf_counter() - start:.1f} s")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
