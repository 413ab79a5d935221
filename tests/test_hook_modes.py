"""The hook in DSpark's four modes against vLLM's loop as plain torch
(torch_bridge.testing.torch_dspark_loop): full-vocabulary sampling, greedy
drafting, a reduced draft vocabulary, the confidence head."""

import torch_bridge as tb  # first: sets XLA_PYTHON_CLIENT_PREALLOCATE

import jax
import numpy as np
import pytest
import torch

from torch_bridge import testing as sd


def _gpu() -> bool:
  if not torch.cuda.is_available():
    return False
  try:
    return any(d.platform == "gpu" for d in jax.devices())
  except RuntimeError:
    return False


_GPU = _gpu()
M, S, V, R = 8, 3, 96, 8
RUNTIMES = ["jax"] + (["native"] if _GPU else [])


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
