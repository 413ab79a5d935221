import os, sys, torch
import torch_bridge as tb
from torch_bridge import testing as sd
for (m, s, v, vd, r) in [(8, 3, 96, 40, 8), (1, 7, 129280, 32768, 256)]:
  spec = sd.SpeculatorDouble(max_num_reqs=m, num_steps=s, vocab=v, rank=r, hidden=16, dtype=torch.bfloat16, device="cuda")
  sd.add_modes(spec, draft_vocab=vd)
  w2 = spec.model.model.markov_head.markov_w2.weight
  smp = tb.FusedMarkovSampler(m, vd, r, torch.bfloat16, runtime="native")
  h = spec.prepare(m); smp(spec, m, h); torch.cuda.synchronize(); print("eager ok", v, flush=True)
  g = torch.cuda.CUDAGraph(); st = torch.cuda.Stream(); st.wait_stream(torch.cuda.current_stream())
  with torch.cuda.stream(st):
    smp(spec, m, h)
    with torch.cuda.graph(g, stream=st):
      smp(spec, m, h)
  torch.cuda.synchronize(); print("captured", flush=True)
  g.replay(); torch.cuda.synchronize(); print("replay ok", v, flush=True)
