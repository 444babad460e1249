"""What depends on the torch version, for the Python package: the supported range, checked at
import before the compiled module loads, and the check that the module was compiled against
the torch that runs it."""

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
