"""pallas_call over named operands.

A kernel's operands are two ordered dicts, inputs (name -> array) and
outputs (name -> ShapeDtypeStruct). An optional input is left out of the dict
(the kernel finds no ref of that name), and an output aliases the input of
the same name when that input is there. The pallas_call takes the inputs
then the outputs, each in the dicts' order: that is the order a native
runtime binds their pointers in.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import jax
from jax.experimental import pallas as pl


def named_call(kernel: Callable[..., None], inputs: Mapping[str, Any],
               outputs: Mapping[str, jax.ShapeDtypeStruct], *,
               aliased: Iterable[str] = (), **pallas_kwargs) -> dict[str, Any]:
  """Runs ``kernel(ins, outs)`` as one pallas_call; returns outputs by name.

  Args:
    kernel: called with ``ins`` and ``outs``, dicts name -> ref (inputs and
      outputs respectively). Where an input and an output share a name and
      buffer (``aliased``), ``ins[name]`` and ``outs[name]`` are the same
      memory on the GPU.
    inputs: name -> array, in operand order; None values are left out.
    outputs: name -> ShapeDtypeStruct, in result order.
    aliased: names of outputs that update the input of the same name in
      place when both are there (else the output is a new buffer, and the
      input is only read).
    **pallas_kwargs: grid, compiler_params, interpret, name, ...

  Returns:
    dict name -> array, in ``outputs``' order.
  """
  inputs = {name: x for name, x in inputs.items() if x is not None}
  in_names, out_names = tuple(inputs), tuple(outputs)
  aliases = {in_names.index(name): out_names.index(name)
             for name in aliased if name in inputs and name in outputs}

  def body(*refs):
    kernel(dict(zip(in_names, refs[:len(in_names)])),
           dict(zip(out_names, refs[len(in_names):])))

  results = pl.pallas_call(
      body, out_shape=tuple(outputs.values()), input_output_aliases=aliases,
      **pallas_kwargs)(*inputs.values())
  return dict(zip(out_names, results))

