"""Tests of the demo: the command line, the corpus, and the verifier's losslessness.

The losslessness tests are statistical with fixed seeds: a lossless pipeline
fails them with probability below 1e-4 (the p-value threshold), and the same
checks applied to the draft alone (a lossy "verifier" that accepts everything)
must fail, so the test can fail.
"""

from __future__ import annotations

import itertools
import re

import jax.numpy as jnp
import numpy as np
import pytest

import jax_markov as jm
from examples import corpus, demo

P_THRESHOLD = 1e-4


# ----------------------------------------------------------------------------
# The command line.


def test_main_default_sampler_prints_the_demo(capsys):
  rc = demo.main(["--batch", "4", "--steps", "3", "--rounds", "30",
                  "--no-progress"])
  out = capsys.readouterr().out
  assert rc == 0, out
  for text in ("with Markov head", "without Markov head", "mean accepted "
               "length", "lossless check", "ms/round", "tokens/s", "jm.sample_draft"):
    assert text in out, text
  assert not re.search(r"FAIL$", out, re.M), out
  assert len(re.findall(r"PASS$", out, re.M)) == 2, out


def test_main_greedy_reference_sampler(capsys):
  rc = demo.main(["--batch", "2", "--steps", "4", "--rounds", "5",
                  "--temperature", "0", "--sampler", "reference",
                  "--no-progress"])
  out = capsys.readouterr().out
  assert rc == 0, out
  assert "lossless check (greedy)" in out
  assert len(re.findall(r"PASS$", out, re.M)) == 2, out


def test_main_reports_progress_on_stderr(capsys):
  demo.main(["--batch", "1", "--steps", "2", "--rounds", "2", "--sampler",
             "reference"])
  assert "rounds (the first call compiles)" in capsys.readouterr().err


@pytest.mark.parametrize("argv, option", [
    (["--batch", "0"], "--batch"),
    (["--batch", "two"], "--batch"),
    (["--steps", "0"], "--steps"),
    (["--steps", "-3"], "--steps"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--temperature", "nan"], "--temperature"),
    (["--temperature", "inf"], "--temperature"),
    (["--rounds", "0"], "--rounds"),
    (["--rank", "0"], "--rank"),
    (["--rank", str(demo.MAX_RANK + 1)], "--rank"),
    (["--seed", "-1"], "--seed"),
    (["--prompt", ""], "--prompt"),
    (["--prompt", "caf\u00e9"], "--prompt"),
    (["--sampler", "magic"], "--sampler"),
    (["--no-such-option"], "unrecognized"),
])
def test_bad_options_exit_2_with_one_line(capsys, argv, option):
  with pytest.raises(SystemExit) as exc:
    demo.main(argv)
  assert exc.value.code == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert option in err[-1] and "error:" in err[-1], err
  assert "Traceback" not in "\n".join(err)


# ----------------------------------------------------------------------------
# The corpus and the models.


def test_corpus_roundtrip_and_escaping():
  text = corpus.load_text(max_chars=5000)
  assert len(text) == 5000
  assert corpus.decode(corpus.encode(text)) == text
  tokens = corpus.encode(text)
  assert tokens.dtype == np.int32
  assert tokens.min() >= 0 and tokens.max() < corpus.VOCAB_SIZE
  assert corpus.printable("a\nb\x07") == "a\\nb\\x07"
  with pytest.raises(ValueError, match="not in the demo vocabulary"):
    corpus.encode("\u00e9")


def test_head_raises_the_acceptance_rate():
  tokens = corpus.encode(corpus.load_text())
  models = demo.fit_models(tokens, corpus.VOCAB_SIZE, rank=8)
  assert models.head.embed.shape == (corpus.VOCAB_SIZE, 8)
  assert models.head.proj.shape == (corpus.VOCAB_SIZE, 8)
  np.testing.assert_allclose(np.exp(models.target_logits).sum(1), 1.0,
                             rtol=1e-5)
  with_head = demo.acceptance_rate(models, models.head, 1.0)
  without = demo.acceptance_rate(models, demo.zero_head(models.head), 1.0)
  assert with_head > without + 0.2, (with_head, without)


def test_chi2_sf_matches_scipy():
  stats = pytest.importorskip("scipy.stats")
  for x, k in [(3.0, 1), (50.0, 40), (500.0, 420), (100.0, 30)]:
    np.testing.assert_allclose(demo.chi2_sf(x, k), stats.chi2.sf(x, k),
                               rtol=1e-3, atol=1e-12)


# ----------------------------------------------------------------------------
# Losslessness: the emitted tokens follow the target exactly.

V, R, S = 4, 2, 2
NUM_SEQ = 20_000
TEMPERATURE = 0.7


def _tiny_models():
  """A random bigram target and a deliberately poor random draft."""
  rng = np.random.default_rng(0)
  target = (0.6 * rng.normal(size=(V, V))).astype(np.float32)
  target -= np.log(np.exp(target).sum(1, keepdims=True))
  base = rng.normal(size=V).astype(np.float32)
  head = jm.MarkovHead(jnp.asarray(rng.normal(size=(V, R)), jnp.float32),
                       jnp.asarray(rng.normal(size=(V, R)), jnp.float32))
  return demo.Models(target, base, head, np.full(V, 1.0 / V))


@pytest.fixture(scope="module")
def tiny_run():
  # The plain-jnp sampler: the same draws as jm.sample_draft (tests/
  # test_sampler.py), without interpret mode's cost at 20k rows; the kernel
  # runs end to end in test_main_default_sampler_prints_the_demo.
  models = _tiny_models()
  prompt = np.array([1], np.int32)
  run = demo.generate(jm.reference.sample_draft, models, models.head, prompt,
                      batch=NUM_SEQ, steps=S, temperature=TEMPERATURE,
                      seed=123, rounds=3)
  return models, prompt, run


def _joint_chi_square(first_tokens: np.ndarray, anchor: int, probs):
  """Pearson chi-square of the first 3 emitted tokens vs the target chain."""
  observed = np.zeros((V,) * 3)
  np.add.at(observed, tuple(first_tokens.T), 1.0)
  expected = np.zeros((V,) * 3)
  for a, b, c in itertools.product(range(V), repeat=3):
    expected[a, b, c] = probs[anchor, a] * probs[a, b] * probs[b, c]
  expected *= len(first_tokens)
  assert expected.min() >= 5  # the chi-square approximation holds
  stat = float(np.sum((observed - expected) ** 2 / expected))
  return demo.chi2_sf(stat, V**3 - 1)


def test_emitted_tokens_follow_the_target_jointly(tiny_run):
  models, prompt, run = tiny_run
  # Every path of the verifier shows up: rejections and full acceptances.
  assert 0 < run.num_accepted.mean() < S
  assert (run.num_accepted == S).any() and (run.num_accepted == 0).any()
  first = np.stack([seq[1:4] for seq in run.sequences])
  probs = demo.softmax_t(models.target_logits, TEMPERATURE)
  p_value = _joint_chi_square(first, int(prompt[0]), probs)
  assert p_value > P_THRESHOLD, p_value
  chi = demo.transition_chi_square(run.sequences, 1, probs)
  assert chi.dof > 0 and chi.p_value > P_THRESHOLD, chi


def test_the_check_detects_the_draft_alone(tiny_run):
  # The draft's own tokens (everything accepted, no residual) are not
  # target-distributed: the same checks must reject them.
  models, prompt, run = tiny_run
  drafted = run.drafted[0]                       # round 0: [B, S], anchor 1
  probs = demo.softmax_t(models.target_logits, TEMPERATURE)
  seqs = [np.concatenate([prompt, d]) for d in drafted]
  chi = demo.transition_chi_square(seqs, 1, probs)
  assert chi.p_value < P_THRESHOLD, chi


def test_verify_single_position_distribution():
  # One drafted token, many draws: the emitted token must follow the target
  # row, exercising acceptance and the residual without any generate() logic.
  models = _tiny_models()
  B = 40_000
  anchor = jnp.full((B,), 2, jnp.int32)
  temps = jnp.full((B,), TEMPERATURE, jnp.float32)
  base = jnp.broadcast_to(jnp.asarray(models.base), (B, 1, V))
  tokens, logits = jm.reference.sample_draft(
      base, anchor, models.head, temps, np.arange(B, dtype=np.int64),
      np.zeros((B, 1), np.int32))
  n_acc, nxt = demo.verify(demo.verify_key(7, 0), tokens, logits, anchor,
                           jnp.asarray(models.target_logits), temps)
  n_acc, nxt, tokens = map(np.asarray, (n_acc, nxt, tokens))
  first = np.where(n_acc == 1, tokens[:, 0], nxt)
  observed = np.bincount(first, minlength=V)
  expected = B * demo.softmax_t(models.target_logits, TEMPERATURE)[2]
  stat = float(np.sum((observed - expected) ** 2 / expected))
  assert demo.chi2_sf(stat, V - 1) > P_THRESHOLD, (observed, expected)
  assert 0 < n_acc.mean() < 1


def test_greedy_emits_the_target_argmax_chain():
  models = _tiny_models()
  prompt = np.array([0], np.int32)
  run = demo.generate(jm.reference.sample_draft, models, models.head, prompt,
                      batch=3, steps=4, temperature=0.0, seed=5, rounds=6)
  assert demo.greedy_mismatches(run.sequences, 1, models.target_logits) == 0
  # Greedy drafting and verification are deterministic: rows agree.
  assert all(np.array_equal(s, run.sequences[0]) for s in run.sequences)
  # A corrupted chain is caught.
  bad = [np.concatenate([s[:-1], [(s[-1] + 1) % V]]) for s in run.sequences]
  assert demo.greedy_mismatches(bad, 1, models.target_logits) == 3
