"""DSpark's four hook modes, as the hook reads them from the speculator.

vLLM's ``DSparkSpeculator._sample_sequential`` drafts in one of:

* full-vocabulary sampling (the default): ``spec.draft_logits`` is a cache;
* greedy drafting: ``spec.draft_logits is None``: tokens only, the argmax of
  base + bias (mapped to target ids with a reduced vocabulary);
* a reduced draft vocabulary: ``spec.model.draft_id_to_target_id`` (d2t) is
  set: the base logits and proj cover Vd draft ids, draft id j is target id
  ``j + d2t[j]``, the draw is over the target vocabulary (every other target
  column -inf), the tokens are target ids;
* the confidence head (with either of the above): ``spec.confidence_config
  .enabled``: per step a score from the hidden state and the previous
  token's Markov embedding; from the first step whose sigmoid is below the
  threshold on, the tokens become -1.
"""

from __future__ import annotations

import dataclasses

import torch

from torch_bridge import checks
from torch_bridge.checks import BridgeInputError

D2T = "spec.model.draft_id_to_target_id"


@dataclasses.dataclass(frozen=True, eq=False)  # compared by identity
class ColumnMap:
  """A reduced draft vocabulary, as the kernels take it.

  Attributes:
    targets: int32 [Vd] on the device, the target id of each draft id.
    slots: int32 [V], the draft id of each target id, -1 where none maps to
      it: sampling's map (the block pass walks the target columns, any map
      order, base and proj as they are).
    columns: int32 [Vd], ``targets`` in increasing order: greedy drafting's
      map (its invariant: draft-column order is target order).
    order: int64 [Vd], the permutation that sorts the draft columns (greedy
      drafting permutes base and proj with it), or None where targets
      increase.
    target_vocab: V.
  """
  targets: torch.Tensor
  slots: torch.Tensor
  columns: torch.Tensor
  order: torch.Tensor | None
  target_vocab: int


def column_map(d2t, draft_vocab: int, target_vocab: int,
               device: torch.device) -> ColumnMap:
  """Validates vLLM's d2t offsets and builds the kernels' column map.

  Reads the map on the host (once per map: the hook caches the result), so
  it cannot run under CUDA graph capture.

  Raises:
    BridgeInputError naming ``spec.model.draft_id_to_target_id``.
  """
  if (not isinstance(d2t, torch.Tensor) or d2t.dtype not in checks.INTS or
      tuple(d2t.shape) != (draft_vocab,) or d2t.device != device):
    raise BridgeInputError(
        f"{D2T}: expected int32/int64 [vocab_size = {draft_vocab}] on "
        f"{device}, got {checks.describe(d2t)}")
  if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
    raise BridgeInputError(
        f"{D2T}: the map is read and checked once, on the host, which a CUDA "
        "graph capture cannot do: call sampler.warmup(spec) (or the hook once "
        "eagerly) before capturing")
  targets = torch.arange(draft_vocab, device=device) + d2t.to(torch.int64)
  host = targets.cpu()
  bad = (host < 0) | (host >= target_vocab)
  if bad.any():
    raise BridgeInputError(
        f"{D2T}: target ids j + d2t[j] must lie in [0, {target_vocab}), got "
        f"{host[bad][:8].tolist()}")
  if len(torch.unique(host)) != draft_vocab:
    raise BridgeInputError(
        f"{D2T}: two draft ids map to the same target id")
  increasing = bool((host[1:] > host[:-1]).all())
  order = None if increasing else torch.argsort(targets)
  columns = targets if increasing else targets[order]
  slots = torch.full((target_vocab,), -1, dtype=torch.int32, device=device)
  slots[targets] = torch.arange(draft_vocab, dtype=torch.int32, device=device)
  return ColumnMap(targets=targets.to(torch.int32), slots=slots,
                   columns=columns.to(torch.int32).contiguous(), order=order,
                   target_vocab=target_vocab)


@dataclasses.dataclass(frozen=True)
class Mode:
  """What a call drafts: greedy (no cache) or sampling; with a column map."""
  greedy: bool = False
  cmap: ColumnMap | None = None


def confidence(spec) -> object | None:
  """The confidence config when the head is enabled, else None."""
  conf = getattr(spec, "confidence_config", None)
  return conf if conf is not None and getattr(conf, "enabled", False) else None


def apply_confidence(spec, n: int, s_len: int, head_hidden,
                     threshold: float) -> None:
  """The confidence head after the draft, as vLLM's loop computes it.

  Step i's score is ``compute_confidence_logits(hidden of draw i,
  markov_embed(token before step i))``; it depends only on tokens already
  drawn, so all S scores are one batched call after the draft (the head is
  row-wise). From the first step whose sigmoid is below the threshold on,
  the tokens become -1; the prefix lengths count the tokens kept. Torch ops
  only: captured with the rest of the call.
  """
  model = spec.model
  tokens = spec.draft_tokens[:n, :s_len]
  anchors = spec.input_buffers.input_ids[spec._anchor_idx[:n]]  # pylint: disable=protected-access
  prev = torch.cat([anchors[:, None].to(tokens.dtype), tokens[:, :-1]], 1)
  embed = model.markov_embed(prev.reshape(-1))
  hidden = head_hidden[spec.sample_indices[:n * s_len]]
  scores = model.compute_confidence_logits(hidden, embed).reshape(n, s_len)
  spec.confidence_logits[:n, :s_len].copy_(scores)
  below = torch.sigmoid(scores.float()) < threshold
  keep = torch.cumprod((~below).to(torch.int32), dim=1).bool()
  tokens.masked_fill_(~keep, -1)
  spec.confidence_prefix_lengths[:n].copy_(keep.sum(dim=1))
