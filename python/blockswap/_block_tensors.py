"""What the engine packs of a block: its parameters and buffers by name, with the wrapper tensor
subclasses of quantized weights (torchao's Float8Tensor, ComfyUI's QuantizedTensor) opened into
the plain tensors they hold.

Note [wrapper subclasses]
A wrapper subclass has no storage of its own: its values are in inner tensors (``qdata`` and
``scale``, ``_qdata`` and its layout's scales) that ``__tensor_flatten__`` names. Rebinding the
wrapper (``param.data = x``) would leave those inner tensors where they were, the trap diffusers
and ai-toolkit fell into. blockswap packs and rebinds the inner tensors themselves, as frozen
weights named ``<parameter>.<attribute>``: the wrapper and its Parameter stay the objects the
model holds (so does any dynamo guard on them), and its scales travel packed with its block.
"""

import torch as _torch

from . import _compat

InvalidArgumentError = _compat.load_extension().InvalidArgumentError


def is_wrapper(tensor):
    """A tensor subclass whose values are in inner tensors (the __tensor_flatten__ protocol)."""
    return type(tensor) not in (_torch.Tensor, _torch.nn.Parameter) and hasattr(
        tensor, "__tensor_flatten__")


def _open(name, tensor, out):
    if not is_wrapper(tensor):
        out.append((name, tensor))
        return
    attributes, _ = tensor.__tensor_flatten__()
    for attribute in attributes:
        inner = getattr(tensor, attribute)
        if inner is not None:
            _open(f"{name}.{attribute}", inner, out)


def block_tensors(block, label, index):
    """([(name, parameter)], [(name, buffer)]) of one block as the engine packs them: each
    tensor once (named_parameters lists a Parameter once, whatever aliases it, such as peft's
    base_layer wrappers), wrapper subclasses opened (Note [wrapper subclasses])."""
    parameters, buffers = [], []
    for name, p in block.named_parameters():
        if is_wrapper(p) and p.requires_grad:
            raise InvalidArgumentError(
                f"[{label}] parameter '{name}' of block {index} is a {type(p).__name__} that "
                "requires grad: blockswap swaps quantized (tensor subclass) weights as frozen "
                "weights only; train an adapter beside them (LoRA) instead")
        _open(name, p, parameters)
    for name, b in block.named_buffers():
        _open(name, b, buffers)
    return parameters, buffers
