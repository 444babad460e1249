"""What depends on the torch version, for the Python package: the supported range, checked at
import before the compiled module loads, the check that the module was compiled against the
torch that runs it, and every call into torch that is private or differs between versions
(torch.compiler.disable, c10d's default store, DistributedDataParallel's ignore list, the
saved-tensor hooks on top, dynamo's fullgraph flag). A torch 2.15 difference goes here."""

import functools as _functools

import torch as _torch

SUPPORTED = ((2, 7), (2, 14))  # the oldest and the newest minor versions blockswap supports
_REBUILD = "pip install --no-build-isolation --no-deps --force-reinstall ."


def _minor(version):
    return tuple(int(x) for x in version.split("+")[0].split(".")[:2])


def check_torch():
    """Raises ImportError for a torch older than the supported range."""
    (lo_major, lo_minor), (hi_major, hi_minor) = SUPPORTED
    if _minor(_torch.__version__) < SUPPORTED[0]:
        raise ImportError(f"blockswap needs torch {lo_major}.{lo_minor} to {hi_major}.{hi_minor}; "
                          f"this is torch {_torch.__version__}: upgrade torch, then rebuild "
                          f"blockswap in that environment ({_REBUILD})")


@_functools.cache
def load_extension():
    """The compiled module _C, after checking that it was built against this torch."""
    try:
        from . import _C
    except ImportError as e:
        raise ImportError(f"blockswap's compiled module does not load with torch "
                          f"{_torch.__version__} ({e}); it was probably built against another "
                          f"torch: rebuild it in this environment ({_REBUILD})") from e
    built = _C.torch_version.split("+")[0]
    running = _torch.__version__.split("+")[0]
    if built != running:
        raise ImportError(f"blockswap was built against torch {built}, and this is torch "
                          f"{running}: rebuild it in this environment ({_REBUILD})")
    return _C


# torch.optim's implementations, as blockswap's C++ numbers them (python/src/module.cpp).
KERNELS = {"default": 0, "for_loop": 1, "foreach": 2, "fused": 3}


def optimizer_kernel(foreach, fused):
    """The kernel number for torch.optim's foreach= and fused= arguments (None: torch.optim's
    default for the device, foreach on CUDA and the for-loop elsewhere)."""
    if fused and foreach:
        raise ValueError("foreach and fused cannot both be True (as in torch.optim)")
    if fused:
        return KERNELS["fused"]
    if foreach is None:
        return KERNELS["default"]
    return KERNELS["foreach"] if foreach else KERNELS["for_loop"]


def compiler_disable(fn):
    """Excludes fn from torch.compile tracing. torch.compiler.disable's wrapper costs about a
    microsecond on every eager call (most of the verbs' host time per block, measured by
    bench/python/verb_overhead.py), so the disabled function is called only while dynamo
    traces: it then evaluates is_compiling() to True and breaks the graph at that call."""
    compiler = getattr(_torch, "compiler", None)
    disabled = compiler.disable(fn)
    is_compiling = compiler.is_dynamo_compiling

    @_functools.wraps(fn)
    def call(*args, **kwargs):
        if is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def default_store():
    """The c10d store of torch.distributed's default process group (a private call)."""
    import torch.distributed as dist
    return dist.distributed_c10d._get_default_store()


def ddp_ignore(model, names):
    """Makes DistributedDataParallel(model) leave the parameters `names` alone (a private
    call, the one DDP offers)."""
    _torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
        model, names)


def in_backward():
    """Whether autograd's engine is running a backward on this thread (a reentrant
    checkpoint's recompute)."""
    return _torch._C._current_graph_task_id() != -1


_autograd = _torch._C._autograd
_top_saved_tensors_hooks = getattr(_autograd, "_top_saved_tensors_default_hooks", None)


def saved_tensors_hooks_active():
    """Whether saved-tensor hooks were pushed already on this thread: a non-reentrant
    checkpoint's, ``torch.autograd.graph.save_on_cpu``'s (activation offloading leaves them
    in charge). As torch answers it from 2.8 on: the top of this thread's stack of default
    hooks, unless dynamo is tracing (then autograd applies none)."""
    if _top_saved_tensors_hooks is not None:
        return _top_saved_tensors_hooks(False) is not None
    return _saved_tensors_hooks_pushed()


def _saved_tensors_hooks_pushed():
    """torch 2.7, which has no _top_saved_tensors_default_hooks: whether this thread's stack of
    default saved-tensor hooks is not empty, read from the one call that looks at it. Disabling
    the hooks (what ``torch.autograd.graph.disable_saved_tensors_hooks`` does) raises while the
    stack has a pair, and succeeds, changing nothing else, when it is empty; the message it sets
    is put back at once either way (that raise sets it too). Costs about 0.3 us with the stack
    empty, 15 us with hooks on it (a C++ exception): once per block forward."""
    tracing = _autograd._saved_tensors_hooks_set_tracing(False)
    if tracing:  # dynamo is tracing: autograd applies no default hooks
        _autograd._saved_tensors_hooks_set_tracing(True)
        return False
    previous = _autograd._saved_tensors_hooks_get_disabled_error_message()
    try:
        _autograd._saved_tensors_hooks_disable("blockswap: is a saved-tensor hook on top?")
    except RuntimeError:
        pushed = True
    else:
        pushed = False
    try:
        if previous is None:
            _autograd._saved_tensors_hooks_enable()
        else:
            _autograd._saved_tensors_hooks_disable(previous)
    except RuntimeError:  # hooks on the stack while disabled: the message is back all the same
        pass
    return pushed


def compiled_fullgraph(module):
    """Whether `module` runs compiled with fullgraph=True: torch.compile(module, fullgraph=True)
    (an OptimizedModule) or module.compile(fullgraph=True) (diffusers' compile_repeated_blocks).
    Reads dynamo's private context; False where this torch keeps it elsewhere."""
    context = getattr(module, "dynamo_ctx", None)
    if context is None:
        compiled = getattr(module, "_compiled_call_impl", None)
        for cell in getattr(compiled, "__closure__", None) or ():
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            if hasattr(value, "fullgraph") or hasattr(value, "first_ctx"):  # 2.7: no fullgraph
                context = value
                break
    if hasattr(context, "fullgraph"):
        return bool(context.fullgraph)
    # torch 2.7's context has no fullgraph: its callback, dynamo's frame converter, converts
    # frames itself with one_graph=True under fullgraph=True (ConvertFrameAssert), and through
    # an inner converter with one_graph=False otherwise (ConvertFrame).
    convert = getattr(getattr(context, "callback", None), "_torchdynamo_orig_callable", None)
    return bool(getattr(convert, "_one_graph", False))
