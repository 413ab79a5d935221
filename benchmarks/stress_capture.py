"""Replays captured native drafts as the benchmark harness does, bit for bit
(the hook-lifetime defect, docs/limitations.md).

  python -m benchmarks.stress_capture --shape dsv4 --batches 1 4 16 64 256 \\
      --dependent-launch on --rounds 2
  compute-sanitizer --tool memcheck python -m benchmarks.stress_capture ...

In the benchmark harness (``python -m benchmarks``), captured native drafts
failed with an illegal memory access in their first replays (sessions 7, 8
and 11). The cause (session 12): the harness kept only each graph's
``replay`` and dropped the hook that owns the scratch the graph writes, then
emptied torch's cache between batch sizes. This replays captured drafts as
the harness does (a fresh hook for each batch size in one process, captured
with ``vllm_loop.capture_graph``, replayed back to back) for ``--rounds``
rounds over the batches, keeping each hook, and checks every batch's
replayed tokens and cache bit for bit against what its eager calls wrote;
``--drop-hook`` reproduces the harness's old mistake (expect a fault). A CUDA
error propagates (the process exits non-zero); a mismatch exits 1.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

import torch_bridge as tb  # noqa: F401,E402 -- before JAX starts (preallocation)
from benchmarks import common  # noqa: E402
from benchmarks.tune_graph import captured_draft  # noqa: E402


def stress(shape, batch, round_index, temperature, replays,
           dependent_launch, drop_hook=False) -> tuple[bool, float]:
  """One batch: capture, replay ``replays`` times back to back, compare.

  drop_hook: drop the hook after the capture and empty torch's cache before
  the replays, as the benchmark harness did until session 12 (the graph
  then replays into scratch memory it no longer owns).

  Returns:
    (whether every replay left the eager draft's tokens and cache, ms per
    replay).
  """
  inputs = common.torch_inputs(shape, batch, round_index,
                               torch.device("cuda"))
  graph, spec, hook = captured_draft(shape, batch, inputs, temperature,
                                     dependent_launch)
  torch.cuda.synchronize()
  if drop_hook:
    del hook
    gc.collect()
    torch.cuda.empty_cache()
  # The capture ran nothing: the buffers hold the eager calls' draft.
  want_tokens = spec.draft_tokens.clone()
  want_cache = spec.draft_logits.values.clone()
  start = time.perf_counter()
  for _ in range(replays):
    graph.replay()
  torch.cuda.synchronize()
  ms = (time.perf_counter() - start) * 1e3 / replays
  same = (torch.equal(spec.draft_tokens, want_tokens)
          and torch.equal(spec.draft_logits.values, want_cache))
  return same, ms


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--shape", default="dsv4", choices=sorted(common.SHAPES))
  p.add_argument("--batches", type=int, nargs="+",
                 default=[1, 4, 16, 64, 256])
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--replays", type=int, default=200)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--dependent-launch", default="auto",
                 choices=("auto", "on", "off"),
                 help="the hook's dependent_launch (auto: its default)")
  p.add_argument("--drop-hook", action="store_true",
                 help="drop each hook after its capture (the harness's old "
                 "defect: expect a fault or a mismatch)")
  args = p.parse_args(argv)
  if not torch.cuda.is_available():
    print("stress_capture needs a CUDA GPU", file=sys.stderr)
    return 2
  shape = common.SHAPES[args.shape]
  dependent = dict(auto=None, on=True, off=False)[args.dependent_launch]
  for r in range(args.rounds):
    for batch in args.batches:
      same, ms = stress(shape, batch, r, args.temperature, args.replays,
                        dependent, args.drop_hook)
      print(f"round {r} {shape.name} B={batch:4d}: {args.replays} replays, "
            f"{ms:.4f} ms each, {'bit for bit' if same else 'MISMATCH'}",
            flush=True)
      if not same:
        return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
