"""Programmatic dependent launch (Hopper): a kernel that starts early.

A kernel launched with CUDA's programmatic stream serialization attribute may
start while the kernel before it on the stream is still running: its
programs get scheduled once every program of that kernel has signalled
(``griddepcontrol.launch_dependents``) or exited. Such a kernel must execute
``griddepcontrol.wait`` before it reads anything an earlier kernel wrote, or
writes anything an earlier kernel reads: the wait returns when the kernels
before it have completed and their writes are visible.

The kernels here do both in one place, :func:`wait_for_prior_kernels`: wait,
then signal the next kernel. Signalling after the wait, not before, is what
makes reads before the wait safe for inputs written before the *previous*
kernel: kernel k + 1 starts only once every program of kernel k has passed
its wait, so kernel k - 1 and everything before it has completed. The block
pass loads its base tile (the backbone's logits, written before the draft's
first kernel, which waits first thing) before the wait, so that load
overlaps the previous kernel's tail. The select pass may signal first
(``signal_first``, KernelConfig.early_dependents): the next step's block
pass then starts during the step's last wave; it still starts only after
every program of the block pass before the select has passed its wait, so
the same holds one kernel further back.

The wait is inline PTX whose result, an int32 zero, is added to the indices
of every load and store that must come after it: the compiler cannot issue
them before the value exists (the Pallas Triton lowering marks inline
assembly pure, so ordering by data is what holds). Without the launch
attribute (XLA's launches, a plain launch) the wait returns at once: the
kernels stay correct anywhere sm_90 PTX runs. The interpreter has no inline
assembly: there the kernels take ``dependent_launch=False``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental.pallas import triton as plgpu

# griddepcontrol needs PTX ISA 7.8 on sm_90 or newer.
MIN_CAPABILITY = (9, 0)

_ASM = ("griddepcontrol.wait;\n\t"
        "griddepcontrol.launch_dependents;\n\t"
        "mov.u32 $0, 0;")


# The select pass's form with early_dependents: the next kernel may launch
# before this one waits (see signal_first).
_ASM_SIGNAL_FIRST = ("griddepcontrol.launch_dependents;\n\t"
                     "griddepcontrol.wait;\n\t"
                     "mov.u32 $0, 0;")


def wait_for_prior_kernels(enabled: bool = True, *,
                           signal_first: bool = False) -> jax.Array | int:
  """Waits for the kernels before this one, then lets the next one start.

  Args:
    enabled: whether the kernel is built for a dependent launch (static).
      The kernels call this only when they are (so that without it their
      Triton IR is what it was before), and pass True.
    signal_first: let the next kernel start before the wait instead (the
      select pass, KernelConfig.early_dependents). Safe only in a kernel
      the next of which reads, ahead of its own wait, nothing written
      after the draft's first kernel: the block pass, which loads base and
      proj there. Its start then still follows the wait of the kernel
      before this one, which signals after its wait (the block pass), so
      everything before that kernel's predecessor has completed.

  Returns:
    An int32 zero computed after the wait (enabled), to add to the indices
    of every access that must follow it; the Python int 0 otherwise.
  """
  if not enabled:
    return 0
  # A [1] tensor from a [1] operand (unused), reduced to a scalar: the
  # lowering types a 0-d result as a 0-d tensor, and Triton's verifier wants
  # a tensor operand beside a tensor result.
  [zero] = plgpu.elementwise_inline_asm(
      _ASM_SIGNAL_FIRST if signal_first else _ASM,
      args=[jnp.zeros((1,), jnp.int32)], constraints="=r,r", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
  return jnp.sum(zero)


def zero_after(value: jax.Array) -> jax.Array:
  """An int32 zero computed from ``value`` (a float32 scalar).

  Adding it to an index makes a load whose result is otherwise unused (a
  prefetch) survive the compiler, and places the reduction that forms
  ``value`` before that index's access.
  """
  [zero] = plgpu.elementwise_inline_asm(
      "mov.u32 $0, 0;", args=[jnp.full((1,), value, jnp.float32)],
      constraints="=r,f", pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct((1,), jnp.int32)])
  return jnp.sum(zero)


def check(enabled: bool, *, interpret: bool) -> None:
  """Raises ValueError for a dependent launch in the interpreter."""
  if enabled and interpret:
    raise ValueError("dependent_launch=True needs the GPU (inline PTX); the "
                     "interpreter runs kernels one after another anyway")
