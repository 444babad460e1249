"""The seed's ModelOffloader (DESIGN.md section 1), written from its description, for the GPU
benchmark: the baseline blockswap is measured against (T_seed / T_swap).

A move swaps two blocks of the same structure through the same device memory: the outgoing
block's weights are copied device->host, then the incoming block's weights are copied
host->device into the freed memory, tensor by tensor, on a fresh side stream, with full
host-side synchronisations before and after, on a single worker thread.
"""
from concurrent.futures import ThreadPoolExecutor
import contextlib
import time

import torch


def _sync_device(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _weights(block):
    return [p for p in block.parameters() if not p.requires_grad]


class SeedOffloader:
    def __init__(self, block_type, blocks, blocks_to_swap, supports_backward, device, debug=False):
        self.block_type = block_type
        self.blocks = blocks
        self.num_blocks = len(blocks)
        self.blocks_to_swap = blocks_to_swap
        self.supports_backward = supports_backward
        self.forward_only = not supports_backward
        self.device = device
        self.debug = debug
        self.pool = ThreadPoolExecutor(max_workers=1)
        self.futures = {}
        self.loads = 0  # blocks moved host -> device
        self.handles = []
        if supports_backward:
            for i, block in enumerate(blocks):
                hook = self._backward_hook(i)
                if hook is not None:
                    self.handles.append(block.register_full_backward_hook(hook))

    # --- the move -------------------------------------------------------------------------
    def _swap(self, block_to_host, block_to_device):
        # On the CPU (a rehearsal of the real-size benchmark) streams are no-ops and the
        # copies are clones: the same moves, none of them overlapped.
        cuda = self.device.type == "cuda"
        sync = (lambda s: s.synchronize()) if cuda else (lambda s: None)
        if cuda:
            torch.cuda.current_stream().synchronize()
        stream = torch.cuda.Stream() if cuda else None
        with torch.cuda.stream(stream) if cuda else contextlib.nullcontext():
            pairs = list(zip(_weights(block_to_host), _weights(block_to_device)))
            slots = []
            for outgoing, incoming in pairs:
                slot = outgoing.data
                if cuda:
                    slot.record_stream(stream)
                outgoing.data = slot.to("cpu", non_blocking=cuda)  # device -> host
                if not cuda:
                    outgoing.data = outgoing.data.clone()
                slots.append(slot)
            sync(stream)
            for (outgoing, incoming), slot in zip(pairs, slots):
                slot.copy_(incoming.data, non_blocking=cuda)  # host -> device, same memory
                incoming.data = slot
        sync(stream)
        if cuda:
            torch.cuda.current_stream().synchronize()
        self.loads += 1

    def _submit(self, index_to_host, index_to_device):
        def move():
            start = time.perf_counter()
            self._swap(self.blocks[index_to_host], self.blocks[index_to_device])
            if self.debug:
                print(f"[{self.block_type}] Moved blocks {index_to_host} and {index_to_device} "
                      f"in {time.perf_counter() - start:.2f}s")
            return index_to_host, index_to_device

        self.futures[index_to_device] = self.pool.submit(move)

    # --- the verbs ------------------------------------------------------------------------
    def prepare_block_devices_before_forward(self):
        if not self.blocks_to_swap:
            for b in self.blocks:
                b.to(self.device)
            return
        n, k = self.num_blocks, self.blocks_to_swap
        for b in self.blocks[: n - k]:
            b.to(self.device)
        for b in self.blocks[n - k:]:
            b.to(self.device)  # trainable adapters stay on the device
            for p in _weights(b):
                p.data = p.data.to("cpu")
        _sync_device(self.device)

    def wait_for_block(self, index):
        if not self.blocks_to_swap or index not in self.futures:
            return
        start = time.perf_counter()
        self.futures.pop(index).result()
        if self.debug:
            print(f"[{self.block_type}] Waited for block {index}: {time.perf_counter() - start:.2f}s")

    def submit_move_blocks_forward(self, index):
        if not self.blocks_to_swap:
            return
        if not self.forward_only and index >= self.blocks_to_swap:
            return
        to_device = self.num_blocks - self.blocks_to_swap + index
        if self.forward_only:
            to_device %= self.num_blocks
        self._submit(index, to_device)

    def set_forward_only(self, forward_only):
        self.forward_only = forward_only

    def _backward_hook(self, index):
        propagated = self.num_blocks - index - 1
        swapping = 0 < propagated <= self.blocks_to_swap
        waiting = 0 < index <= self.blocks_to_swap
        if not swapping and not waiting:
            return None
        to_host = self.num_blocks - propagated
        to_device = self.blocks_to_swap - propagated

        def hook(module, grad_input, grad_output):
            if swapping:
                self._submit(to_host, to_device)
            if waiting:
                self.wait_for_block(index - 1)
            return None

        return hook
