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

import os as _os

import torch as _torch

from . import _C

__all__ = ["ModelOffloader", "Device", "open_device", "Error", "OutOfMemoryError"]

Error = _C.Error
OutOfMemoryError = _C.OutOfMemoryError
Device = _C.Device


def _compiler_disable(fn):
    """Excludes fn from torch.compile tracing where this torch has torch.compiler.disable."""
    disable = getattr(getattr(_torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


def _device_name(device):
    device = _torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device} is not one blockswap runs on: cpu (the emulated "
                         "device) or cuda")
    return str(device)


def open_device(device="cuda", *, budget_bytes=0, link_gbps=0.0, capacity_bytes=0):
    """A device that several offloaders share (a model's double and single blocks): one copy
    stream, one memory account, and a budget (bytes) for all their slots together.
    ``cpu`` is the emulated device; ``link_gbps`` and ``capacity_bytes`` are its link and memory.
    """
    return _C.open_device(_device_name(device), int(budget_bytes), float(link_gbps),
                          int(capacity_bytes))


def _flatten(value, out):
    """The tensors in a block's output (a tensor, or tuples, lists and dicts of them)."""
    if isinstance(value, _torch.Tensor):
        out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _flatten(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _flatten(v, out)


def _rebuild(value, tensors):
    if isinstance(value, _torch.Tensor):
        return next(tensors)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_rebuild(v, tensors) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_rebuild(v, tensors) for v in value)
    if isinstance(value, dict):
        return type(value)((k, _rebuild(v, tensors)) for k, v in value.items())
    return value


class ModelOffloader:
    """The seed's ModelOffloader, positional arguments as the seed's, on blockswap's engine.

    Keyword-only extras: ``rotating_slots`` (inference: slots the swapped blocks rotate
    through), ``device_budget_bytes`` (with ``blocks_to_swap=-1`` the planner chooses K),
    ``shared_device`` (from ``open_device``: one device for several offloaders), ``trace`` (a
    Chrome trace file written at ``close()``), ``emulated_link_gbps`` and
    ``emulated_capacity_bytes`` (the emulated device, ``device='cpu'``).

    With no blocks or ``blocks_to_swap=0`` it does nothing, like the seed: it allocates
    nothing, registers nothing and every verb returns at once.
    """

    def __init__(self, block_type, blocks, num_blocks, blocks_to_swap, supports_backward,
                 device, reentrant_activation_checkpointing, debug=False, *,
                 rotating_slots=0, device_budget_bytes=0, shared_device=None, trace=None,
                 emulated_link_gbps=0.0, emulated_capacity_bytes=0):
        self.block_type = block_type
        self.blocks = list(blocks) if blocks is not None else []
        self.num_blocks = num_blocks
        self.blocks_to_swap = blocks_to_swap
        self.supports_backward = bool(supports_backward)
        self.forward_only = not self.supports_backward
        self.reentrant_activation_checkpointing = bool(reentrant_activation_checkpointing)
        self.debug = debug
        self._impl = None
        self._hooks = []
        self._trace = trace
        if num_blocks != len(self.blocks):
            raise ValueError(f"[{block_type}] num_blocks={num_blocks} but {len(self.blocks)} "
                             "blocks were given")
        if not self.blocks or blocks_to_swap in (0, None):
            return  # the seed does nothing either: the trainer's dummy, or no swapping
        n = len(self.blocks)
        if not isinstance(blocks_to_swap, int) or isinstance(blocks_to_swap, bool):
            raise ValueError(f"[{block_type}] blocks_to_swap must be an int, got "
                             f"{blocks_to_swap!r}")
        mode = "training" if self.supports_backward else "forward-only"
        max_k = _C.max_blocks_to_swap(n, self.supports_backward)
        if blocks_to_swap == -1:
            if device_budget_bytes <= 0 and (shared_device is None
                                             or shared_device.budget_bytes == 0):
                raise ValueError(f"[{block_type}] blocks_to_swap=-1 asks the planner to choose "
                                 "K, which needs device_budget_bytes > 0 or a shared_device "
                                 "with a budget")
        elif not 0 <= blocks_to_swap <= max_k:
            raise ValueError(f"[{block_type}] blocks_to_swap K={blocks_to_swap} is out of range "
                             f"for N={n} blocks in {mode} mode: expected 0 <= K <= {max_k}")
        if rotating_slots and not 0 <= rotating_slots <= n:
            raise ValueError(f"[{block_type}] rotating_slots={rotating_slots} is out of range "
                             f"for N={n} blocks")
        for i, block in enumerate(self.blocks):
            if not isinstance(block, _torch.nn.Module):
                raise ValueError(f"[{block_type}] block {i} is a {type(block).__name__}, not a "
                                 "torch.nn.Module")
        # named_parameters lists each Parameter once, whatever aliases it (peft's base_layer
        # wrappers); the C++ side packs each tensor once too.
        tensors = [([(name, p) for name, p in block.named_parameters()],
                    [(name, b) for name, b in block.named_buffers()]) for block in self.blocks]
        self._impl = _C.Offloader(
            block_type, tensors, blocks_to_swap, self.supports_backward,
            _device_name(device) if shared_device is None else "cpu",
            self.reentrant_activation_checkpointing, bool(debug), int(rotating_slots),
            int(device_budget_bytes), shared_device, trace is not None,
            float(emulated_link_gbps), int(emulated_capacity_bytes))
        self.blocks_to_swap = self._impl.blocks_to_swap()
        if self.supports_backward:
            for i, block in enumerate(self.blocks):
                self._hooks.append(block.register_forward_hook(self._forward_hook(i)))

    def _forward_hook(self, index):
        # A block's outputs, bracketed in autograd: before the block's backward runs, its
        # weights are brought back where its forward's saved tensors point.
        def hook(module, inputs, output):
            if self._impl is None or not _torch.is_grad_enabled():
                return None
            tensors = []
            _flatten(output, tensors)
            if not tensors:
                return None
            return _rebuild(output, iter(self._impl.bracket_outputs(index, tensors)))

        return _compiler_disable(hook)

    # The seed's verbs.

    @_compiler_disable
    def prepare_block_devices_before_forward(self):
        if self._impl is not None:
            self._impl.prepare()

    @_compiler_disable
    def wait_for_block(self, block_idx):
        if self._impl is not None:
            self._impl.wait_for_block(block_idx)

    @_compiler_disable
    def submit_move_blocks_forward(self, *args):
        """``submit_move_blocks_forward(i)``; ``(blocks, i)`` as musubi-tuner calls it."""
        block_idx = args[-1]
        if self._impl is not None:
            self._impl.submit(block_idx)

    @_compiler_disable
    def disable_block_swap(self):
        if self._impl is not None:
            self._impl.synchronize()  # a mode switch waits for every move in flight
            self._impl.disable()

    @_compiler_disable
    def enable_block_swap(self):
        if self._impl is not None:
            self._impl.synchronize()
            self._impl.enable()

    @_compiler_disable
    def set_forward_only(self, forward_only):
        if forward_only is False and not self.supports_backward and self._impl is not None:
            raise ValueError(f"[{self.block_type}] set_forward_only(False) needs "
                             "supports_backward=True")
        self.forward_only = bool(forward_only)
        if self._impl is not None:
            self._impl.synchronize()
            self._impl.set_forward_only(self.forward_only)

    # Extras.

    def is_resident(self, block_idx):
        if self._impl is None:
            return True
        return self._impl.is_resident(block_idx)

    def stats(self):
        """Bytes moved each way, moves, stall seconds, device bytes now and at most."""
        if self._impl is None:
            return {"h2d_bytes": 0, "d2h_bytes": 0, "moves": 0, "stall_seconds": 0.0,
                    "device_bytes": 0, "peak_device_bytes": 0}
        return self._impl.stats()

    def reset_stats(self):
        if self._impl is not None:
            self._impl.reset_stats()

    def synchronize(self):
        if self._impl is not None:
            self._impl.synchronize()

    def close(self):
        """Waits for copies in flight, leaves every weight an ordinary host tensor with its
        values, removes the hooks and writes the trace. Safe to call twice."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        impl, self._impl = self._impl, None
        if impl is not None:
            if self._trace is not None:
                impl.write_trace(_os.fspath(self._trace))
            impl.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
