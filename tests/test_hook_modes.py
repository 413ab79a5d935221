"""The hook in DSpark's four modes against vLLM's loop as plain torch
(torch_bridge.testing.torch_dspark_loop): full-vocabulary sampling, greedy
drafting, a reduced draft vocabulary, the confidence head."""

import torch_bridge as tb  # first: sets XLA_PYTHON_CLIENT_PREALLOCATE

import numpy as np
import pytest
import torch

from helpers import torch_and_jax_gpu
from torch_bridge import testing as sd




_GPU = torch_and_jax_gpu()
M, S, V, R = 8, 3, 96, 8
# The native runtime needs CUDA: its cases are GPU tests (pytest -m gpu).
RUNTIMES = ["jax"] + ([pytest.param("native", marks=pytest.mark.gpu)]
                      if _GPU else [])


def _sampler(spec, runtime):
  w2 = spec.model.model.markov_head.markov_w2.weight
  return tb.FusedMarkovSampler(spec.max_num_reqs, w2.shape[0], w2.shape[1],
                               w2.dtype, runtime=runtime)


def _spec(device="cpu", **modes):
  spec = sd.SpeculatorDouble(max_num_reqs=M, num_steps=S, vocab=V, rank=R,
                             device=device)
  return sd.add_modes(spec, **modes)


def _run(spec, sampler, n, **prepare):
  hidden = spec.prepare(n, **prepare)
  tokens0 = spec.draft_tokens.clone()
  assert sampler(spec, n, hidden) is True
  if spec.device.type == "cuda":
    torch.cuda.synchronize()
  want = sd.torch_dspark_loop(spec, n, hidden)
  x = spec.inputs(n, hidden)
  valid = (x["idx"] >= 0)
  got = spec.draft_tokens.cpu()
  # Later requests' tokens are untouched.
  assert torch.equal(got[n:], tokens0[n:].cpu())
  return got[:n], want, valid


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("threshold", [0.0, 0.5, 1.0])
def test_confidence_head_masks_like_vllm(runtime, threshold):
  device = "cuda" if runtime == "native" else "cpu"
  spec = _spec(device, confidence_threshold=threshold)
  sampler = _sampler(spec, runtime)
  for n, padding in ((5, (1,)), (8, ())):
    got, want, valid = _run(spec, sampler, n, padding=padding)
    rows = valid.all(dim=1)  # padding requests: tokens are any valid id
    np.testing.assert_array_equal(got[rows], want["tokens"][rows])
    np.testing.assert_allclose(spec.confidence_logits[:n].cpu(),
                               want["confidence"], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(spec.confidence_prefix_lengths[:n].cpu(),
                                  want["prefix"])
    if threshold == 0.0:  # keeps everything
      assert (want["prefix"] == S).all() and (got[rows] >= 0).all()
    if threshold == 1.0:  # a sigmoid is never >= 1 here: masks everything
      assert (want["prefix"] == 0).all() and (got == -1).all()


def test_confidence_buffers_are_checked():
  spec = _spec(confidence_threshold=0.5)
  sampler = _sampler(spec, "jax")
  hidden = spec.prepare(4)
  spec.confidence_logits = spec.confidence_logits[:, :1]
  tokens0 = spec.draft_tokens.clone()
  with pytest.raises(tb.BridgeInputError, match="spec.confidence_logits"):
    sampler(spec, 4, hidden)
  assert torch.equal(spec.draft_tokens, tokens0)
  spec = _spec(confidence_threshold=None)
  spec.confidence_config = sd.SimpleNamespace(enabled=True, threshold="x")
  with pytest.raises(tb.BridgeInputError, match="threshold"):
    _sampler(spec, "jax")(spec, 4, spec.prepare(4))


def _check_sampling(spec, got, want, valid, n, cache0):
  """Tokens and the target-vocabulary cache rows against the torch loop."""
  rows = valid.all(dim=1)
  np.testing.assert_array_equal(got[rows], want["tokens"][rows])
  idx = spec.inputs(n, None if False else spec._last_hidden)["idx"]
  cache = spec.draft_logits.values.cpu()
  steps = torch.arange(S).expand_as(idx)
  np.testing.assert_allclose(cache[idx[valid], steps[valid]],
                             want["logits"][valid], rtol=1e-5, atol=1e-4)
  written = torch.zeros(cache.shape[:2], dtype=torch.bool)
  written[idx[valid], steps[valid]] = True
  assert torch.equal(cache[~written], cache0[~written])


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("vd,shuffled", [(40, False), (40, True), (V, True)])
def test_reduced_vocabulary_matches_vllm(runtime, vd, shuffled):
  device = "cuda" if runtime == "native" else "cpu"
  spec = _spec(device, draft_vocab=vd, shuffled=shuffled)
  sampler = _sampler(spec, runtime)
  targets = set((torch.arange(vd) + spec.model.draft_id_to_target_id.cpu())
                .tolist())
  for n, padding, greedy in ((5, (1,), (2,)), (8, (), ())):
    cache0 = spec.draft_logits.values.cpu().clone()
    hidden = spec.prepare(n, padding=padding, greedy=greedy)
    spec._last_hidden = hidden  # pylint: disable=protected-access
    assert sampler(spec, n, hidden)
    if device == "cuda":
      torch.cuda.synchronize()
    want = sd.torch_dspark_loop(spec, n, hidden)
    x = spec.inputs(n, hidden)
    valid = x["idx"] >= 0
    got = spec.draft_tokens.cpu()[:n]
    assert set(got[valid.all(dim=1)].reshape(-1).tolist()) <= targets
    _check_sampling(spec, got, want, valid, n, cache0)
    # Unmapped target columns of written rows are -inf.
    if vd < V:
      unmapped = sorted(set(range(V)) - targets)
      idx = x["idx"]
      cache = spec.draft_logits.values.cpu()
      steps = torch.arange(S).expand_as(idx)
      rows = cache[idx[valid], steps[valid]]
      assert torch.isneginf(rows[:, unmapped]).all()


@pytest.mark.parametrize("runtime", RUNTIMES)
@pytest.mark.parametrize("vd", [None, 40])
def test_greedy_drafting_matches_vllm(runtime, vd):
  device = "cuda" if runtime == "native" else "cpu"
  spec = _spec(device, greedy=True, draft_vocab=vd, shuffled=vd is not None)
  sampler = _sampler(spec, runtime)
  for n in (5, 8):
    got, want, valid = _run(spec, sampler, n, padding=(0,) if n == 5 else ())
    rows = valid.all(dim=1)
    np.testing.assert_array_equal(got[rows], want["tokens"][rows])


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_reduced_vocabulary_greedy_with_confidence(runtime):
  device = "cuda" if runtime == "native" else "cpu"
  spec = _spec(device, greedy=True, draft_vocab=40, confidence_threshold=0.5)
  sampler = _sampler(spec, runtime)
  got, want, valid = _run(spec, sampler, 6)
  np.testing.assert_array_equal(got, want["tokens"])
  np.testing.assert_array_equal(spec.confidence_prefix_lengths[:6].cpu(),
                                want["prefix"])


def test_bad_map_is_refused_with_nothing_written():
  spec = _spec(draft_vocab=40)
  sampler = _sampler(spec, "jax")
  hidden = spec.prepare(4)
  tokens0 = spec.draft_tokens.clone()
  cache0 = spec.draft_logits.values.clone()
  d2t = spec.model.draft_id_to_target_id
  for bad, match in ((-torch.arange(40), "same target id"),
                     (d2t + V, r"\[0, 96\)"),
                     (d2t[:10], "vocab_size = 40"),
                     (d2t.float(), "int32/int64")):
    spec.model.draft_id_to_target_id = bad
    with pytest.raises(tb.BridgeInputError, match=match):
      sampler(spec, 4, hidden)
    assert torch.equal(spec.draft_tokens, tokens0)
    assert torch.equal(spec.draft_logits.values, cache0)


@pytest.mark.gpu
@pytest.mark.skipif(not _GPU, reason="needs a CUDA GPU for torch and JAX")
def test_gpu_captured_map_outlives_a_rebinding():
  # A shuffled map: the native runtime binds a column map and a proj sorted
  # by target id, derived tensors the graph reads. Binding another spec (and
  # map) afterwards must not free them under the graph.
  pytest.importorskip("triton")
  spec = _spec("cuda", draft_vocab=40, shuffled=True, seed=1)
  sampler = _sampler(spec, "native")
  n = 6
  hidden = spec.prepare(n, greedy=(1,))
  side = torch.cuda.Stream()
  side.wait_stream(torch.cuda.current_stream())
  graph = torch.cuda.CUDAGraph()
  tokens0 = spec.draft_tokens.clone()
  cache0 = spec.draft_logits.values.clone()
  with torch.cuda.stream(side):
    assert sampler(spec, n, hidden)  # reads the map, outside the capture
    torch.cuda.synchronize()
    eager_tokens = spec.draft_tokens.clone()
    eager_cache = spec.draft_logits.values.clone()
    with torch.cuda.graph(graph, stream=side):
      assert sampler(spec, n, hidden)
  torch.cuda.synchronize()
  other = _spec("cuda", draft_vocab=40, shuffled=True, seed=2)
  assert sampler(other, n, other.prepare(n))
  del other
  torch.cuda.synchronize()
  # Whatever memory was freed is handed out again and overwritten.
  junk = [torch.full((1 << k,), float("nan"), device="cuda")
          for k in range(4, 16) for _ in range(8)]
  spec.draft_tokens.copy_(tokens0)
  spec.draft_logits.values.copy_(cache0)
  graph.replay()
  torch.cuda.synchronize()
  del junk
  assert torch.equal(spec.draft_tokens, eager_tokens)
  assert torch.equal(spec.draft_logits.values, eager_cache)
