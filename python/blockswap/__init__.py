"""blockswap: block swapping for models larger than device memory.

``blockswap.ModelOffloader`` replaces the trainers' class (diffusion-pipe's
``utils.offloading.ModelOffloader``) with one changed import line::

    from blockswap import ModelOffloader

    offloader = ModelOffloader('blocks', blocks, len(blocks), blocks_to_swap=8,
                               supports_backward=True, device=torch.device('cuda'),
                               reentrant_activation_checkpointing=False)
    offloader.prepare_block_devices_before_forward()
    for i, block in enumerate(blocks):
        offloader.wait_for_block(i)
        x = block(x)                       # call the block: its outputs are seen by a hook
        offloader.submit_move_blocks_forward(i)

Training is exact in any order of forward and backward: the weights a block's backward reads
are put back where its forward's saved tensors point. docs/python.md has the whole story.
"""

from . import _compat

_compat.check_torch()
_C = _compat.load_extension()

from ._activations import saved_activation_bytes  # noqa: E402
from ._distributed import node_memory_use  # noqa: E402
from ._offload import Offloaded, offload, plan_offload  # noqa: E402
from ._offloader import ModelOffloader, open_device  # noqa: E402
from ._optim import FusedAdamW, FusedSGD  # noqa: E402
from ._pipeline import stage_loads  # noqa: E402

__all__ = ["offload", "plan_offload", "Offloaded", "ModelOffloader", "Device", "open_device", "Error", "InvalidArgumentError",
           "OutOfMemoryError", "FusedSGD", "FusedAdamW", "node_memory_use",
           "saved_activation_bytes", "stage_loads"]

Error = _C.Error
InvalidArgumentError = _C.InvalidArgumentError  # an option out of range; also a ValueError
OutOfMemoryError = _C.OutOfMemoryError
Device = _C.Device
