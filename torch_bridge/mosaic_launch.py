"""Mosaic GPU kernels launched from torch on torch's stream (capturable).

JAX lowers a function holding one Mosaic GPU kernel (here the Hopper block
pass, jax_markov/kernels/mosaic_block_pass.py) to a StableHLO module whose
``mosaic_gpu_v2`` custom call carries the kernel's Mosaic GPU module. The
CUDA plugin's ``MosaicGpuCompile`` turns that module into a host function
that builds the kernel's TMA descriptors on the host, passes them as kernel
parameters and launches on the stream it is given: no device allocation, no
synchronisation, so the launch is recorded by a CUDA graph capture like any
kernel. (JAX's ``plgpu.as_torch_kernel`` does the same but launches on the
default stream and allocates its outputs per call; here the caller binds
every pointer, scratch included, and passes ``torch.cuda.current_stream``.)

That host code launches with no launch attributes, so it cannot ask for a
programmatic dependent launch itself. Where a CUDA graph captures the
launch, :func:`programmatic_dependency` gives the kernel node a
programmatic edge from the kernel before it instead (what capturing a
launch with CUDA's programmatic-stream-serialization attribute records):
the kernel, built with ``dependent_launch`` (it waits with
``griddepcontrol.wait`` before it reads what earlier kernels wrote), then
starts while the kernel before it ends. Outside a capture the launch stays
plain, and the wait returns at once.

Only reshapes may sit between the function's arguments and the kernel's
operands: they are views of the same memory, so a pointer of an argument is
the pointer of the operand.

The host function's calling convention is the CUDA plugin's: JAX 0.11
passes (function, stream, buffer array) directly, JAX 0.10 packs pointers
to (context, stream, buffer array) in MLIR's C interface (what each
version's own ``jax.experimental.mosaic.gpu.core`` torch interop does; only
the 0.11 form has run on a GPU here, JAX 0.10 having no CUDA 13 plugin on
the test machine).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax


@dataclasses.dataclass(frozen=True)
class MosaicIR:
  """One Mosaic GPU kernel lowered from a JAX function.

  Attributes:
    name: for messages.
    module: the Mosaic GPU module (MLIR bytecode) MosaicGpuCompile takes.
    operands: per kernel operand, the index of the function argument it is
      (a view of).
    results: per kernel result, the kernel operand it aliases (updated in
      place: the same pointer), or None for a buffer of its own.
  """
  name: str
  module: bytes
  operands: tuple[int, ...]
  results: tuple[int | None, ...]


def lower(fn: Callable, *arg_specs: jax.ShapeDtypeStruct,
          name: str = "mosaic") -> MosaicIR:
  """Lowers ``fn(*args)`` (one Mosaic GPU call, reshapes around it) for CUDA.

  Raises:
    ValueError: the function holds no Mosaic GPU call, more than one, or an
      operation other than a reshape of an argument.
  """
  from jax._src.lib.mlir import passmanager
  from jax._src.lib.mlir.dialects import func
  import jax.experimental.mosaic.gpu as mgpu

  module = jax.jit(fn).trace(*arg_specs).lower(
      lowering_platforms=("cuda",)).compiler_ir()
  with module.context:
    # jax.jit outlines nested jitted functions: inline them into main.
    mgpu.dialect.register_inliner_extensions(module.context)
    passmanager.PassManager.parse(
        "builtin.module(inline{default-pipeline=})").run(module.operation)
    mains = [op for op in module.body.operations
             if isinstance(op, func.FuncOp) and op.name.value == "main"]
    if len(mains) != 1:
      raise ValueError(f"{name}: expected one main function")
    block = mains[0].body.blocks[0]
    source = {arg: i for i, arg in enumerate(block.arguments)}
    call = None
    for op in block.operations:
      op = op.operation
      if op.name == "stablehlo.reshape":
        # A view of an argument (before the call) or of a result (after).
        if op.operands[0] in source:
          source[op.results[0]] = source[op.operands[0]]
      elif (op.name == "stablehlo.custom_call"
            and op.attributes["call_target_name"].value == "mosaic_gpu_v2"):
        if call is not None:
          raise ValueError(f"{name}: more than one Mosaic GPU call")
        call = op
      elif op.name != "func.return":
        raise ValueError(f"{name}: unsupported operation {op.name} around "
                         "the Mosaic GPU call")
    if call is None:
      raise ValueError(f"{name}: no Mosaic GPU call")
    try:
      operands = tuple(source[v] for v in call.operands)
    except KeyError:
      raise ValueError(f"{name}: a kernel operand is not an argument") from None
    from jax._src.lib.mlir.dialects import hlo
    results: list[int | None] = [None] * len(call.results)
    if "output_operand_aliases" in call.attributes:
      for alias in call.attributes["output_operand_aliases"]:
        alias = hlo.OutputOperandAlias(alias)
        [out] = alias.output_tuple_indices or (0,)
        results[out] = alias.operand_index
    module_bytes = call.attributes["mhlo.backend_config"]["module"].value_bytes
  return MosaicIR(name=name, module=bytes(module_bytes), operands=operands,
                  results=tuple(results))


# JAX 0.11's MosaicGpuCompile returns a host function taking its arguments
# directly; JAX 0.10's, pointers to them (see the module docstring).
_DIRECT_CALL = tuple(jax.__version_info__[:2]) >= (0, 11)


@functools.cache
def _plugin():
  """(MosaicGpuCompile, MosaicGpuUnload) of JAX's CUDA plugin."""
  try:
    try:
      import jax_plugins.xla_cuda13 as cuda_plugin
    except ImportError:
      import jax_plugins.xla_cuda12 as cuda_plugin
  except ImportError:
    dll = ctypes.CDLL(None)
  else:
    dll = ctypes.CDLL(cuda_plugin._get_library_path())  # pylint: disable=protected-access
  compile_fn = dll.MosaicGpuCompile
  compile_fn.argtypes = [ctypes.c_char_p, ctypes.c_int]
  compile_fn.restype = ctypes.POINTER(ctypes.c_void_p)
  unload_fn = dll.MosaicGpuUnload
  unload_fn.argtypes = [compile_fn.restype]
  unload_fn.restype = None
  return compile_fn, unload_fn


# The CUDA driver's names and values (cuda.h, CUDA 12.3 and newer).
_CAPTURE_ACTIVE = 1              # CU_STREAM_CAPTURE_STATUS_ACTIVE
_NODE_KERNEL = 0                 # CU_GRAPH_NODE_TYPE_KERNEL
_PORT_PROGRAMMATIC = 1           # CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
_DEPENDENCY_PROGRAMMATIC = 1     # CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC
_SET_DEPENDENCIES = 1            # CU_STREAM_SET_CAPTURE_DEPENDENCIES


class _EdgeData(ctypes.Structure):
  """CUgraphEdgeData."""
  _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte),
              ("type", ctypes.c_ubyte), ("reserved", ctypes.c_ubyte * 5)]


_P, _VP = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)
# The driver functions programmatic_dependency calls: (result, *arguments).
DRIVER_SIGNATURES = {
    # (stream, status, id, graph, dependencies, edge data, count)
    "cuStreamGetCaptureInfo": (
        ctypes.c_int, _P, ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_uint64), _VP, ctypes.POINTER(_VP),
        ctypes.POINTER(ctypes.POINTER(_EdgeData)),
        ctypes.POINTER(ctypes.c_size_t)),
    # (stream, dependencies, edge data, count, flags)
    "cuStreamUpdateCaptureDependencies": (
        ctypes.c_int, _P, _VP, ctypes.POINTER(_EdgeData), ctypes.c_size_t,
        ctypes.c_uint),
    # (node, type)
    "cuGraphNodeGetType": (ctypes.c_int, _P, ctypes.POINTER(ctypes.c_int)),
}


@functools.cache
def _driver():
  """The functions of DRIVER_SIGNATURES by CUDA 12.3's signatures
  (cuGetProcAddress at version 12030: the same ABI whatever the driver's
  own version), or None where the driver lacks them."""
  try:
    cuda = ctypes.CDLL("libcuda.so.1")
    get = cuda.cuGetProcAddress_v2  # CUDA 12.0 and newer
  except (OSError, AttributeError):
    return None
  get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p),
                  ctypes.c_int, ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
  get.restype = ctypes.c_int
  out = {}
  for name, signature in DRIVER_SIGNATURES.items():
    fn, found = ctypes.c_void_p(), ctypes.c_int()
    if get(name.encode(), ctypes.byref(fn), 12030, 0,
           ctypes.byref(found)) or not fn.value:
      return None
    out[name] = ctypes.CFUNCTYPE(*signature)(fn.value)
  return out


def programmatic_dependency(stream: int) -> bool:
  """Makes the next operation captured on ``stream`` depend on the kernel
  before it by a programmatic edge, where the stream is being captured and
  its one pending dependency is a kernel node.

  The next operation must be a kernel launch built for a dependent launch
  (it waits before it reads what the kernel before it wrote), and the
  kernel before it should signal its dependents
  (``griddepcontrol.launch_dependents``; without a signal the edge fires
  when that kernel ends, as a plain edge does).

  Returns:
    True where the edge was set; False where nothing changed: the stream is
    not capturing, its dependency is not one kernel node, or the driver is
    older than CUDA 12.3.

  Raises:
    RuntimeError: a driver call failed.
  """
  fns = _driver()
  if fns is None:
    return False
  status, capture_id = ctypes.c_int(), ctypes.c_uint64()
  graph = ctypes.c_void_p()
  deps = ctypes.POINTER(ctypes.c_void_p)()
  edges = ctypes.POINTER(_EdgeData)()
  count = ctypes.c_size_t()
  err = fns["cuStreamGetCaptureInfo"](
      stream, ctypes.byref(status), ctypes.byref(capture_id),
      ctypes.byref(graph), ctypes.byref(deps), ctypes.byref(edges),
      ctypes.byref(count))
  if err:
    raise RuntimeError(f"cuStreamGetCaptureInfo failed: CUresult {err}")
  if status.value != _CAPTURE_ACTIVE or count.value != 1:
    return False
  node = ctypes.c_void_p(deps[0])  # the driver's array: copied before reuse
  kind = ctypes.c_int()
  err = fns["cuGraphNodeGetType"](node, ctypes.byref(kind))
  if err:
    raise RuntimeError(f"cuGraphNodeGetType failed: CUresult {err}")
  if kind.value != _NODE_KERNEL:
    return False
  edge = _EdgeData(from_port=_PORT_PROGRAMMATIC, to_port=0,
                   type=_DEPENDENCY_PROGRAMMATIC)
  err = fns["cuStreamUpdateCaptureDependencies"](
      stream, ctypes.byref(node), ctypes.byref(edge), 1, _SET_DEPENDENCIES)
  if err:
    raise RuntimeError(
        f"cuStreamUpdateCaptureDependencies failed: CUresult {err}")
  return True


class MosaicKernel:
  """A compiled Mosaic GPU kernel: ``kernel(pointers, stream)`` launches it.

  pointers: one device pointer per kernel operand, then one per result (an
  aliased result repeats its operand's pointer), as ints. The CUDA context
  of torch's current device must be current (torch.cuda.init() and a tensor
  on the device are enough).
  """

  def __init__(self, ir: MosaicIR):
    compile_fn, self._unload = _plugin()
    self.ir = ir
    self._compiled = compile_fn(ctypes.c_char_p(ir.module), len(ir.module))
    if not self._compiled:
      raise RuntimeError(f"{ir.name}: MosaicGpuCompile failed")
    function, launch = self._compiled[0], self._compiled[1]
    self._direct = _DIRECT_CALL
    if self._direct:
      self._function = function
      self._launch = ctypes.CFUNCTYPE(
          None, ctypes.c_void_p, ctypes.c_void_p,
          ctypes.POINTER(ctypes.c_void_p))(launch)
    else:
      self._ctx = ctypes.pointer(ctypes.c_void_p(function))
      self._launch = ctypes.CFUNCTYPE(None, ctypes.c_void_p)(launch)
    self.num_pointers = len(ir.operands) + len(ir.results)

  def __call__(self, pointers: Sequence[int], stream: int, *,
               programmatic: bool = False) -> bool:
    """Launches the kernel on ``stream``.

    programmatic: where a capture records the launch, its edge from the
    kernel before it is programmatic (:func:`programmatic_dependency`; the
    kernel must be built with dependent_launch).

    Returns:
      Whether the launch got a programmatic edge.
    """
    if len(pointers) != self.num_pointers:
      raise ValueError(f"{self.ir.name}: {len(pointers)} pointers for "
                       f"{self.num_pointers} operands and results")
    edge = programmatic and programmatic_dependency(stream)
    buffers = (ctypes.c_void_p * len(pointers))(*pointers)
    if self._direct:
      self._launch(self._function, stream, buffers)
      return edge
    stream_arg = ctypes.c_void_p(stream)
    # The host program's arguments in MLIR's C calling convention: a pointer
    # to each argument (context, stream, pointer to the buffer array).
    args = (ctypes.POINTER(ctypes.c_void_p) * 3)()
    args[0] = self._ctx
    args[1] = ctypes.pointer(stream_arg)
    args[2] = ctypes.cast(ctypes.pointer(ctypes.pointer(buffers)),
                          ctypes.POINTER(ctypes.c_void_p))
    self._launch(args)
    return edge

  def __del__(self):
    compiled = getattr(self, "_compiled", None)
    if compiled:
      self._unload(compiled)
      self._compiled = None
