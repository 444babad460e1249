"""Activation offloading: what a block's forward saves for backward goes to host memory and
comes back just before the block's backward.

The store that records, moves and counts the saved tensors is the C++ one
(src/torch/activation_store.cpp, Note [saved storages]), and the rule of when they go and come
back is core's (Note [offloaded activations] in include/blockswap/core/activation_rule.hpp).
This module hands them to it: ``torch.autograd.graph.saved_tensors_hooks`` pushed around each
block's forward (the block module's call, or ``ModelOffloader.offloading_activations(i)`` around
any code), whose pack and unpack are the store's.
"""

import atexit as _atexit

import torch as _torch

from . import _compat

_C = _compat.load_extension()

DEFAULT_THRESHOLD_BYTES = 1 << 20

# Host memory for one storage's copy, as the store allocates it: (nbytes, pin) -> a uint8
# tensor. Tests replace it to make a copy fail; a replacement counts from the next block's call.
_allocate_host = _C.allocate_activation_host
_default_allocate_host = _allocate_host
_installed_allocate_host = _allocate_host


def _use_allocate_host():
    global _installed_allocate_host
    if _allocate_host is not _installed_allocate_host:
        replaced = _allocate_host is not _default_allocate_host
        _C.set_activation_host_allocator(_allocate_host if replaced else None)
        _installed_allocate_host = _allocate_host


@_atexit.register
def _release_allocate_host():
    _C.set_activation_host_allocator(None)  # no Python function left in C++ at exit


class ActivationStore:
    """The counters of the saved activations of every offloader on one torch device (the C++
    store's); offloaders get it with ``store_for(device)``."""

    def __init__(self, device):
        self.device = device

    def stats(self):
        return _C.activation_stats(self.device)

    def reset_stats(self):
        _C.reset_activation_stats(self.device)


def store_for(device):
    """The ActivationStore of a torch device (``cuda:0``; ``cpu``: the emulated device)."""
    return ActivationStore(_torch.device(device))


def block_storages(block):
    """The data pointers of a block's parameters' and buffers' storages (its weights where
    they are now: a slot, a host copy, an adapter)."""
    pointers = set()
    for t in list(block.parameters()) + list(block.buffers()):
        try:
            pointers.add(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without one storage
            pass
    return pointers


def _pack_into(group):
    def pack(tensor):
        if isinstance(tensor, _torch.nn.Parameter):
            return tensor  # a weight or an adapter, as autograd would hold it
        if type(tensor) is not _torch.Tensor:
            return group.keep(tensor)  # a subclass: kept, to come back as the same object
        return group.pack(tensor)
    return pack


def _unpack(saved):
    return saved if isinstance(saved, _torch.Tensor) else saved.unpack()


class BlockActivations:
    """A context that offloads what autograd saves inside it as block `label`'s group. It does
    nothing under no_grad, inside backward (a recompute reads its tensors at once), and where
    other saved-tensor hooks are in charge already (a non-reentrant checkpoint around the
    block's call, ``save_on_cpu``). ``counted_by``, a blockswap Device or None, counts what
    it moves (``Device.transfers()``)."""

    def __init__(self, store, label, block, threshold_bytes, counted_by=None):
        self._store, self._label, self._block = store, label, block
        self._threshold = threshold_bytes
        self.counted_by = counted_by
        self._stack = []

    def __enter__(self):
        if (not _torch.is_grad_enabled() or _compat.in_backward()
                or _compat.saved_tensors_hooks_active()):
            self._stack.append(None)
            return self
        _use_allocate_host()
        block = self._block
        group = _C.ActivationGroup(self._store.device, self._label, lambda: block_storages(block),
                                   self._threshold, self.counted_by)
        hooks = _torch.autograd.graph.saved_tensors_hooks(_pack_into(group), _unpack)
        hooks.__enter__()
        self._stack.append(hooks)
        return self

    def __exit__(self, exc_type, exc, tb):
        hooks = self._stack.pop() if self._stack else None
        if hooks is not None:
            hooks.__exit__(exc_type, exc, tb)
        return False


def saved_activation_bytes(block, *args, **kwargs):
    """Runs ``block(*args, **kwargs)`` with grad on and returns ``(output, bytes)``: the bytes
    of the distinct storages its forward saves for backward, its own parameters and buffers
    left out: what ``offload_activations`` would move for it (with threshold 0), and what
    ``blockswap plan --activation-bytes`` takes. The output's graph is live: backward it, or
    drop it."""
    weights = block_storages(block)
    seen = {}

    def pack(tensor):
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError):  # a wrapper subclass without one storage
            return tensor
        if storage.data_ptr() not in weights and not isinstance(tensor, _torch.nn.Parameter):
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with _torch.enable_grad(), _torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        output = block(*args, **kwargs)
    return output, sum(seen.values())
