"""The native runtime: jax_markov's Pallas kernels, compiled by triton, on torch's stream.

JAX is the compiler only. Each Pallas kernel of a draft is lowered for CUDA
(which works on any JAX backend, CPU included) to the Triton IR module that
JAX would hand to XLA; the ``triton`` package compiles that module; the
kernels then launch on torch's current stream with the torch tensors'
pointers. A call makes no JAX device buffer, no DLPack exchange, no XLA
executable, no host sync and no allocation, so it can be captured in a
torch CUDA graph.

A Pallas Triton kernel takes one pointer per operand, inputs then outputs; an
output aliased to an input (``input_output_aliases``) gets the same buffer.
Pointers must be 32-byte aligned (the IR declares ``tt.divisibility = 32``).

The IR comes from a JAX internal (``jax._src.pallas.triton.lowering``): the
tested JAX range is pinned in pyproject.toml, and :func:`available` says why
the runtime cannot run where it cannot.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import threading
from typing import Any, Callable, Sequence

import jax
import jax.extend

_LOCK = threading.Lock()  # the capture patches a module attribute


class BuildError(RuntimeError):
  """A kernel could not be lowered to Triton IR or compiled by triton."""


@dataclasses.dataclass(frozen=True)
class KernelIR:
  """One Pallas kernel lowered to Triton IR.

  Attributes:
    name: the kernel's symbol.
    ttir: the Triton IR module, as text.
    grid: (x, y, z) programs.
    num_warps, num_stages: the Triton launch parameters of the pallas_call.
    num_inputs, num_outputs: its operands; the kernel takes one pointer per
      operand, inputs first.
    aliases: (input, output) pairs that share a buffer.
  """
  name: str
  ttir: str
  grid: tuple[int, int, int]
  num_warps: int
  num_stages: int
  num_inputs: int
  num_outputs: int
  aliases: tuple[tuple[int, int], ...]

  def to_json(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_json(cls, d: dict) -> "KernelIR":
    return cls(d["name"], d["ttir"], tuple(d["grid"]), d["num_warps"],
               d["num_stages"], d["num_inputs"], d["num_outputs"],
               tuple(tuple(a) for a in d["aliases"]))


def _pallas_calls(jaxpr) -> list:
  """The pallas_call equations of a closed jaxpr, nested calls included."""
  found = []
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "pallas_call":
      found.append(eqn)
    for value in eqn.params.values():
      for sub in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          found.extend(_pallas_calls(sub.jaxpr))
        elif isinstance(sub, jax.extend.core.Jaxpr):
          found.extend(_pallas_calls(sub))
  return found


@contextlib.contextmanager
def _capture_triton_modules():
  """Records every Triton module that the Pallas lowering produces."""
  from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
  captured = []
  original = lowering.lower_jaxpr_to_triton_module

  def recording(*args, **kwargs):
    result = original(*args, **kwargs)
    captured.append((result.module.operation.get_asm(enable_debug_info=False),
                     tuple(result.grid)))
    return result

  with _LOCK:
    lowering.lower_jaxpr_to_triton_module = recording
    try:
      yield captured
    finally:
      lowering.lower_jaxpr_to_triton_module = original


def _target(capability: tuple[int, int] | None):
  """A context in which Pallas lowers Triton IR for ``capability``.

  JAX 0.11 resolves the GPU it lowers for from the default device's name
  (jax._src.pallas.triton.gpu_info): with no GPU visible to JAX, or one whose
  name is not in its list, the lowering fails. Here the target is the torch
  device's capability, named through an abstract device (registered once as
  its own kind). JAX 0.10 has no such module: it lowers for the GPU it sees,
  or for 9.0 without one, and this is a no-op.
  """
  if capability is None:
    return contextlib.nullcontext()
  try:
    from jax._src.pallas.triton import gpu_info  # pylint: disable=g-import-not-at-top
  except ImportError:
    return contextlib.nullcontext()
  major, minor = capability
  kind = f"jax_markov sm_{major}{minor}"
  gpu_info.registry.setdefault(kind, functools.partial(
      gpu_info.GpuInfo, gpu_version=None, arch_name=f"{major}.{minor}",
      compute_capability=major * 10 + minor))
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None,
                                       platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("_target",),
                                   abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def lower_kernel(fn: Callable, *arg_specs: jax.ShapeDtypeStruct,
                 capability: tuple[int, int] | None = None) -> KernelIR:
  """Lowers ``fn``, which must run exactly one pallas_call, to Triton IR.

  Args:
    fn: a function of arrays that calls one Pallas (Triton) kernel; its
      arguments reach the kernel in the order the kernel takes them.
    *arg_specs: the shapes and dtypes of fn's arguments.
    capability: the CUDA capability (major, minor) to lower for; None: what
      JAX picks (the GPU it sees; JAX 0.11 fails without one).

  Returns:
    The kernel's IR and launch parameters. Raises RuntimeError where the
    lowering produced no or several kernels.
  """
  closed = jax.make_jaxpr(fn)(*arg_specs)
  eqns = _pallas_calls(closed.jaxpr)
  if len(eqns) != 1:
    raise RuntimeError(f"expected one pallas_call, found {len(eqns)}")
  params = eqns[0].params
  compiler = params.get("compiler_params")
  if isinstance(compiler, dict):  # older JAX: {"triton": CompilerParams}
    compiler = compiler.get("triton")
  num_warps = getattr(compiler, "num_warps", None) or 4
  num_stages = getattr(compiler, "num_stages", None) or 3
  with _capture_triton_modules() as captured, _target(capability):
    jax.jit(fn).trace(*arg_specs).lower(lowering_platforms=("cuda",))
  if len(captured) != 1:
    raise RuntimeError(f"expected one Triton module, lowered {len(captured)}")
  ttir, grid = captured[0]
  grid = tuple(grid) + (1,) * (3 - len(grid))
  name = ttir.split("tt.func public @", 1)[1].split("(", 1)[0]
  return KernelIR(name=name, ttir=ttir, grid=grid, num_warps=num_warps,
                  num_stages=num_stages, num_inputs=len(eqns[0].invars),
                  num_outputs=len(eqns[0].outvars),
                  aliases=tuple(params["input_output_aliases"]))


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
  """A hash of the code a lowered kernel comes from.

  The jax_markov package (the kernel bodies and what they import) and the
  plan that calls them: a checkout that changes a kernel without a version
  bump must not load the IR of the old kernel from the cache, whose operands
  may no longer be the ones the plan binds.
  """
  import jax_markov  # pylint: disable=g-import-not-at-top
  root = os.path.dirname(jax_markov.__file__)
  paths = sorted(os.path.join(d, f) for d, _, files in os.walk(root)
                 for f in files if f.endswith(".py"))
  paths.append(os.path.join(os.path.dirname(__file__), "native_plan.py"))
  digest = hashlib.sha256()
  for path in paths:
    digest.update(os.path.relpath(path, os.path.dirname(root)).encode())
    with open(path, "rb") as f:
      digest.update(f.read())
  return digest.hexdigest()[:16]


def versions() -> dict:
  """What a lowered and compiled kernel depends on besides its arguments."""
  import jaxlib  # pylint: disable=g-import-not-at-top
  try:
    import triton  # pylint: disable=g-import-not-at-top
    triton_version = triton.__version__
  except ImportError:
    triton_version = None
  from jax_markov import __version__  # pylint: disable=g-import-not-at-top
  return {"jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "triton": triton_version, "jax_markov": __version__,
          "source": source_digest()}


def cache_dir() -> str:
  """Where lowered kernels are kept: $JAX_MARKOV_CACHE_DIR, else ~/.cache."""
  return os.environ.get("JAX_MARKOV_CACHE_DIR") or os.path.join(
      os.path.expanduser("~"), ".cache", "jax_markov", "native")


class IRCache:
  """Lowered kernels on disk, keyed by everything that changes them.

  The key hashes the caller's description of the kernel (its function,
  shapes, dtypes and static configuration) with :func:`versions`. Triton
  keeps the compiled binaries in its own cache (keyed by the IR), so a
  restarted engine neither lowers nor compiles again.
  """

  def __init__(self, directory: str | None = None):
    self.directory = directory or cache_dir()
    self.hits = 0
    self.misses = 0

  def key(self, description: Any) -> str:
    blob = json.dumps([description, versions()], sort_keys=True, default=repr)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]

  def get_or_lower(self, description: Any, fn: Callable, *arg_specs,
                   capability: tuple[int, int] | None = None
                   ) -> tuple[KernelIR, str]:
    """The kernel's IR and the path of its .ttir file (written if missing)."""
    key = self.key([description, capability])
    meta_path = os.path.join(self.directory, key + ".json")
    ttir_path = os.path.join(self.directory, key + ".ttir")
    try:
      with open(meta_path) as f:
        ir = KernelIR.from_json(json.load(f))
      if os.path.exists(ttir_path):
        self.hits += 1
        return ir, ttir_path
    except (OSError, ValueError, KeyError, TypeError):
      pass
    self.misses += 1
    ir = lower_kernel(fn, *arg_specs, capability=capability)
    os.makedirs(self.directory, exist_ok=True)
    # Written under a temporary name first: a concurrent reader never sees a
    # partial file.
    for path, text in ((ttir_path, ir.ttir),
                       (meta_path, json.dumps(ir.to_json()))):
      tmp = f"{path}.{os.getpid()}.tmp"
      with open(tmp, "w") as f:
        f.write(text)
      os.replace(tmp, path)
    return ir, ttir_path


def compile_kernel(ir: KernelIR, ttir_path: str, capability: tuple[int, int],
                   *, launch_pdl: bool = False):
  """Compiles a lowered kernel with the triton package for a CUDA GPU.

  launch_pdl: launch it with CUDA's programmatic stream serialization
  attribute (a programmatic dependent launch: it may start before the
  kernel before it ends), for kernels lowered with dependent_launch=True
  (jax_markov.kernels.dependent_launch). Captured, the launch is a graph
  node with a programmatic edge.
  """
  import triton  # pylint: disable=g-import-not-at-top
  from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top
  target = GPUTarget("cuda", capability[0] * 10 + capability[1], 32)
  return triton.compile(ttir_path, target=target,
                        options={"num_warps": ir.num_warps,
                                 "num_stages": ir.num_stages,
                                 "launch_pdl": launch_pdl})


def available() -> tuple[bool, str]:
  """Whether the native runtime can run here, and why not if it cannot."""
  try:
    import torch  # pylint: disable=g-import-not-at-top
  except ImportError:
    return False, "torch is not installed"
  if not torch.cuda.is_available():
    return False, "no CUDA device is visible to torch"
  try:
    import triton  # pylint: disable=g-import-not-at-top,unused-import
    from triton.backends.compiler import GPUTarget  # pylint: disable=g-import-not-at-top,unused-import
  except ImportError as e:
    return False, f"the triton package is not importable ({e})"
  try:
    from jax._src.pallas.triton import lowering  # pylint: disable=g-import-not-at-top
    lowering.lower_jaxpr_to_triton_module  # noqa: B018
  except (ImportError, AttributeError) as e:
    return False, (f"this JAX ({jax.__version__}) has no Pallas Triton "
                   f"lowering to read the IR from ({e})")
  return True, "CUDA, triton and the Pallas Triton lowering are available"


class Launch:
  """One kernel launch of a plan: a compiled kernel and its pointers.

  ``args`` holds an int pointer per operand (inputs, then outputs) or the
  name of a buffer the call supplies (looked up in the call's bindings).
  The launch goes straight to triton's launcher (the public
  ``kernel[grid](*args)`` adds a closure and launch hooks per call: tens of
  microseconds of host time over a draft), with no launch hooks.
  """

  def __init__(self, ir: KernelIR, kernel, args: list):
    if len(args) != ir.num_inputs + ir.num_outputs:
      raise RuntimeError(
          f"{ir.name}: {len(args)} pointers for {ir.num_inputs} inputs and "
          f"{ir.num_outputs} outputs")
    if getattr(kernel.metadata, "global_scratch_size", 0):
      raise BuildError(f"{ir.name}: needs triton global scratch memory, which "
                       "a captured launch cannot allocate")
    self.ir = ir
    self.kernel = kernel  # owns the loaded module the function lives in
    self.args = args
    self.dynamic = [i for i, a in enumerate(args) if isinstance(a, str)]
    kernel[ir.grid]  # pylint: disable=pointless-statement  # loads the module
    self._launch = kernel.run
    self._head = (*ir.grid, None, kernel.function, kernel.packed_metadata,
                  None, None, None)

  def __call__(self, bindings: dict, stream: int) -> None:
    args = list(self.args)
    for i in self.dynamic:
      args[i] = bindings[args[i]]
    gx, gy, gz, _, function, packed, meta, enter, leave = self._head
    self._launch(gx, gy, gz, stream, function, packed, meta, enter, leave,
                 *args)


class MosaicLaunch:
  """One launch of a Mosaic GPU kernel (torch_bridge.mosaic_launch): its
  pointers as :class:`Launch` takes them (ints, or names of the call's
  bindings), launched by the kernel's own host code on ``stream``.

  programmatic: the kernel is built for a dependent launch and follows a
  kernel that signals its dependents: a capture records the launch with a
  programmatic edge from that kernel (mosaic_launch.programmatic_dependency;
  ``edges`` counts the launches that got one)."""

  def __init__(self, kernel, args: list, *, programmatic: bool = False):
    if len(args) != kernel.num_pointers:
      raise RuntimeError(f"{kernel.ir.name}: {len(args)} pointers for "
                         f"{kernel.num_pointers} operands and results")
    self.kernel = kernel
    self.args = args
    self.dynamic = [i for i, a in enumerate(args) if isinstance(a, str)]
    self.programmatic = programmatic
    self.edges = 0

  def __call__(self, bindings: dict, stream: int) -> None:
    args = list(self.args)
    for i in self.dynamic:
      args[i] = bindings[args[i]]
    self.edges += bool(self.kernel(args, stream,
                                   programmatic=self.programmatic))


class Zero:
  """A step of a plan that zeroes a torch tensor (a memset node when captured).

  It runs on torch's current stream, which is the stream the runtime passes
  to :func:`run_plan` (the hook always launches on the current stream).
  """

  def __init__(self, tensor):
    self.tensor = tensor

  def __call__(self, bindings: dict, stream: int) -> None:
    del bindings, stream
    self.tensor.zero_()


def run_plan(launches: Sequence[Launch | MosaicLaunch | Zero], bindings: dict,
             stream: int) -> None:
  """Launches a plan's kernels in order on ``stream``."""
  for launch in launches:
    launch(bindings, stream)
