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


def materialize_meta(blocks, label):
    """Blocks built on the meta device (``torch.device("meta")``, accelerate's
    ``init_empty_weights``) for an offloader with ``weights_file``: each frozen meta parameter
    becomes an empty host Parameter (``torch.empty``: memory never touched) in its module, whose
    values the offloader reads from the file. Returns what it replaced, for put_back (empty:
    nothing was meta); a mix of meta and loaded frozen weights is an InvalidArgumentError (which
    values would count?)."""
    meta, loaded = [], None
    for i, block in enumerate(blocks):
        for module_name, module in block.named_modules():
            for key, p in module._parameters.items():
                if p is None or p.requires_grad:
                    continue
                name = f"{module_name}.{key}" if module_name else key
                if p.is_meta:
                    meta.append((module, key, p))
                elif loaded is None:
                    loaded = (i, name)
    if not meta:
        return []
    if loaded is not None:
        raise InvalidArgumentError(
            f"[{label}] some of the blocks' frozen weights are on the meta device and some hold "
            f"values (block {loaded[0]}'s '{loaded[1]}'): build every block empty and let "
            "weights_file fill them, or load them all first")
    for module, key, p in meta:
        module._parameters[key] = _torch.nn.Parameter(
            _torch.empty(p.shape, dtype=p.dtype), requires_grad=False)
    return meta


def put_back(replaced):
    """Undoes materialize_meta (the offloader's constructor failed): the meta Parameters again,
    never empty tensors that would compute with garbage."""
    for module, key, p in replaced:
        module._parameters[key] = p
