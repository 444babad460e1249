"""Activation offloading: what a block's forward saves for backward goes to host memory and
comes back just before the block's backward.

Note [offloaded activations]
``torch.autograd.graph.saved_tensors_hooks`` is pushed around each block's forward (the block
module's call, or ``ModelOffloader.offloading_activations(i)`` around any code). Its pack hook
sees every tensor autograd saves there. A tensor is kept as it is (on the device) when it is
small (its storage under the threshold), not on the offloader's device, not a plain strided
tensor (a wrapper subclass, a sparse tensor), or a block's own weight, buffer or adapter (their
storages are the slots and the host copies blockswap already manages; offloading them would
copy weights). Every other saved tensor is recorded by its *storage*: several views of one
storage (``chunk``, a transpose) are copied once, and each comes back with its own size,
strides and offset on the restored storage, so backward's kernels see exactly the layout they
would have seen (a compact copy of a strided view could change their rounding).

A block's group of storages is copied to host memory when the *next* group opens, not when
its own closes (one block behind): the group open when backward starts, the last block's, is
never copied, and its backward reads it where it is. In backward, the first unpack
of a group starts restoring the group saved before it (in the order groups were saved, every
offloader of the device together: FLUX's single blocks' first backward restores the last double
block's), so that a restore runs under one block's backward compute. A storage's device copy is
dropped once every view of it was unpacked; autograd holds what it unpacked for as long as it
needs it. A graph kept (``retain_graph=True``) unpacks again from the host copy.

On a GPU the copies run on two side streams, device→host and host→device, ordered by events
against the compute stream; the source of a device→host copy is kept from reuse by
``record_stream``. On the emulated device (``cpu``) the copies are synchronous.

A saved tensor written in place after it was saved raises at its unpack, as autograd does
without hooks, when the tensor is still alive (the version counter is checked); the values
offloaded are those at the time of the copy.
"""

import threading as _threading
import weakref as _weakref

import torch as _torch

from . import _compat

DEFAULT_THRESHOLD_BYTES = 1 << 20


def _allocate_host(nbytes, pin):
    """Host memory for one storage's copy (tests replace it to make a copy fail)."""
    return _torch.empty(nbytes, dtype=_torch.uint8, pin_memory=pin)


class _Storage:
    """One saved storage: on the device until its group is evicted, then a host copy, then,
    restored, a device copy again until every view of it was unpacked."""
    __slots__ = ("device", "host", "nbytes", "views", "unpacked", "d2h_done", "h2d_done",
                 "group", "store", "__weakref__")

    def __init__(self, store, device_bytes, group):
        self.store = store
        self.device = device_bytes  # a flat uint8 tensor over the storage, or None
        self.host = None
        self.nbytes = device_bytes.numel()
        self.views = 0
        self.unpacked = 0
        self.d2h_done = None
        self.h2d_done = None
        self.group = group

    def __del__(self):
        # autograd freed every saved view of it (the graph ran or was dropped)
        if self.device is not None:
            with self.store._lock:
                self.store.device_bytes -= self.nbytes


class _Packet:
    """What the pack hook returns for one saved tensor."""
    __slots__ = ("kept", "storage", "size", "stride", "offset", "dtype", "source", "version",
                 "unpacked", "store", "__weakref__")

    def __init__(self, store, kept=None, storage=None, tensor=None):
        self.store = store
        self.kept = kept
        self.storage = storage
        self.unpacked = False
        if storage is not None:
            self.size, self.stride = tensor.size(), tensor.stride()
            self.offset, self.dtype = tensor.storage_offset(), tensor.dtype
            self.source, self.version = _weakref.ref(tensor), tensor._version

    def __del__(self):
        store = self.store
        if store is not None and self.kept is not None:
            store._forget_kept(self.kept)


class _Group:
    """The storages one block's forward saved, in one pass."""
    __slots__ = ("label", "storages", "evicted", "restoring", "__weakref__")

    def __init__(self, label):
        self.label = label
        # (data_ptr, nbytes) -> _Storage, held weakly: each storage holds its group, and dies
        # with the saved tensors that refer to it (no cycle keeps device memory alive)
        self.storages = _weakref.WeakValueDictionary()
        self.evicted = False
        self.restoring = False


class ActivationStore:
    """The saved activations of every offloader on one torch device (Note [offloaded
    activations]); offloaders get it with ``store_for(device)``."""

    def __init__(self, device):
        self.device = _torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._lock = _threading.RLock()
        self._groups = []  # weak references, in the order the groups were saved
        self._kept = {}  # storage data_ptr -> [views, nbytes]: small tensors kept, counted
        if self._cuda:
            self._d2h = _torch.cuda.Stream(self.device)
            self._h2d = _torch.cuda.Stream(self.device)
        self.reset_stats()

    def reset_stats(self):
        with self._lock:
            self.offloaded_bytes = 0
            self.restored_bytes = 0
            self.device_bytes = self._live_bytes() if hasattr(self, "_groups") else 0
            self.peak_device_bytes = self.device_bytes

    def stats(self):
        with self._lock:
            return {"activation_offloaded_bytes": self.offloaded_bytes,
                    "activation_restored_bytes": self.restored_bytes,
                    "activation_device_bytes": self.device_bytes,
                    "peak_activation_bytes": self.peak_device_bytes}

    # Accounting: device bytes held by saved activations.

    def _live_bytes(self):
        total = sum(nbytes for _, nbytes in self._kept.values())
        for ref in self._groups:
            group = ref()
            if group is not None:
                total += sum(s.nbytes for s in list(group.storages.values())
                             if s.device is not None)
        return total

    def _add(self, nbytes):
        self.device_bytes += nbytes
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def _keep(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        with self._lock:
            entry = self._kept.get(key)
            if entry is None:
                self._kept[key] = [1, storage.nbytes()]
                if tensor.device == self.device:
                    self._add(storage.nbytes())
            else:
                entry[0] += 1
        return _Packet(self, kept=tensor)

    def _forget_kept(self, tensor):
        key = tensor.untyped_storage().data_ptr()
        with self._lock:
            entry = self._kept.get(key)
            if entry is None:
                return
            entry[0] -= 1
            if entry[0] == 0:
                del self._kept[key]
                if tensor.device == self.device:
                    self.device_bytes -= entry[1]

    # A group's life.

    def open_group(self, label):
        """A block's forward starts: every earlier group still on the device is copied to host
        memory (on a GPU, under this block's compute), and a new group is opened."""
        group = _Group(label)
        with self._lock:
            self._groups = [ref for ref in self._groups if ref() is not None]
            for ref in self._groups:
                earlier = ref()
                if earlier is not None and not earlier.evicted and not earlier.restoring:
                    self._evict(earlier)
            self._groups.append(_weakref.ref(group))
        return group

    def _evict(self, group):
        group.evicted = True
        storages = [s for s in list(group.storages.values()) if s.device is not None]
        if not storages:
            return
        if self._cuda:
            compute = _torch.cuda.current_stream(self.device)
            self._d2h.wait_stream(compute)
            with _torch.cuda.stream(self._d2h):
                for s in storages:
                    self._copy_out(s, pin=True)
                    s.device.record_stream(self._d2h)
                    s.d2h_done = _torch.cuda.Event()
                    s.d2h_done.record(self._d2h)
        else:
            for s in storages:
                self._copy_out(s, pin=False)
        for s in storages:
            s.device = None
            self.device_bytes -= s.nbytes
            self.offloaded_bytes += s.nbytes

    def _copy_out(self, storage, pin):
        try:
            host = _allocate_host(storage.nbytes, pin)
            host.copy_(storage.device, non_blocking=pin)
        except Exception as e:
            raise RuntimeError(
                f"blockswap: offloading {storage.nbytes} bytes of block "
                f"{storage.group.label}'s saved activations to host memory failed ({e}); the "
                "activations stay on the device and nothing was lost. Free host memory, raise "
                "activation_threshold_bytes, or set offload_activations=False") from e
        storage.host = host

    def _restore(self, group):
        """Enqueues the copy back of every evicted storage of `group` (on CUDA, on the
        host→device stream after the device→host copy; on the emulated device, now)."""
        group.restoring = True
        for s in list(group.storages.values()):
            if s.device is None and s.host is not None and s.views > s.unpacked:
                self._copy_in(s)

    def _copy_in(self, s):
        if self._cuda:
            compute = _torch.cuda.current_stream(self.device)
            device = _torch.empty(s.nbytes, dtype=_torch.uint8, device=self.device)
            self._h2d.wait_stream(compute)  # the memory's earlier users on the compute stream
            if s.d2h_done is not None:
                self._h2d.wait_event(s.d2h_done)
            with _torch.cuda.stream(self._h2d):
                device.copy_(s.host, non_blocking=True)
                s.h2d_done = _torch.cuda.Event()
                s.h2d_done.record(self._h2d)
            device.record_stream(self._h2d)  # dropped before its unpack: not reused mid-copy
        else:
            device = s.host.clone()
        s.device = device
        self._add(s.nbytes)
        self.restored_bytes += s.nbytes

    def _previous(self, group):
        previous = None
        for ref in self._groups:
            g = ref()
            if g is group:
                return previous
            if g is not None and g.evicted and not g.restoring:
                previous = g
        return None

    # The hooks.

    def hooks(self, group, weights, threshold_bytes):
        """The (pack, unpack) pair for one block's forward; `weights()` gives the data pointers
        of the block's own weights, buffers and adapters where they are while its forward runs
        (asked at the first pack: before that, the block's wait may still bind them to a slot);
        storages under `threshold_bytes` stay on the device."""
        skip = []

        def pack(tensor):
            if isinstance(tensor, _torch.nn.Parameter):
                return tensor  # a weight or an adapter, as autograd would hold it
            if (type(tensor) is not _torch.Tensor or tensor.layout != _torch.strided
                    or tensor.device != self.device or tensor.is_meta or _compat.in_backward()):
                return self._keep(tensor)  # a recompute inside backward reads it at once
            storage = tensor.untyped_storage()
            key = (storage.data_ptr(), storage.nbytes())
            if not skip:
                skip.append(weights())
            if key[0] in skip[0]:
                return tensor  # a view of a weight (a slot, a host copy): not an activation
            if key[1] < threshold_bytes or key[0] == 0:
                return self._keep(tensor)
            with self._lock:
                s = group.storages.get(key)
                if s is None:
                    flat = _torch.empty(0, dtype=_torch.uint8, device=tensor.device)
                    flat.set_(storage)
                    s = _Storage(self, flat, group)
                    group.storages[key] = s
                    self._add(s.nbytes)
                s.views += 1
            return _Packet(self, storage=s, tensor=tensor)

        def unpack(packet):
            if type(packet) is not _Packet:
                return packet
            if packet.kept is not None:
                return packet.kept
            s = packet.storage
            source = packet.source()
            if source is not None and source._version != packet.version:
                raise RuntimeError(
                    f"blockswap: a tensor block {s.group.label} saved for backward was modified "
                    f"by an inplace operation after it was saved (version {packet.version}, now "
                    f"{source._version}); with offload_activations its saved value is the one "
                    "copied to host memory. Clone it before writing it in place")
            with self._lock:
                group_ = s.group
                if not group_.restoring:
                    group_.restoring = True
                    previous = self._previous(group_)
                    if previous is not None:
                        self._restore(previous)  # one group ahead, under this one's backward
                if s.device is None:
                    self._copy_in(s)
                device = s.device
                if s.h2d_done is not None:
                    _torch.cuda.current_stream(self.device).wait_event(s.h2d_done)
                    device.record_stream(_torch.cuda.current_stream(self.device))
                if not packet.unpacked:
                    packet.unpacked = True
                    s.unpacked += 1
                    if s.unpacked >= s.views and s.host is not None:
                        s.device = None  # autograd holds what it unpacked
                        s.h2d_done = None
                        self.device_bytes -= s.nbytes
                        s.unpacked = 0  # a retained graph unpacks again from the host copy
            view = _torch.empty(0, dtype=packet.dtype, device=device.device)
            view.set_(device.untyped_storage(), packet.offset, packet.size, packet.stride)
            return view

        return pack, unpack


_stores = {}
_stores_lock = _threading.Lock()


def store_for(device):
    """The one ActivationStore of a torch device (``cuda:0``; ``cpu``: the emulated device)."""
    device = _torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = _torch.device("cuda", _torch.cuda.current_device())
    with _stores_lock:
        store = _stores.get(str(device))
        if store is None:
            store = _stores[str(device)] = ActivationStore(device)
        return store


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


class BlockActivations:
    """A context that offloads what autograd saves inside it as block `label`'s group. It does
    nothing under no_grad, inside backward (a recompute reads its tensors at once), and where
    other saved-tensor hooks are in charge already (a non-reentrant checkpoint around the
    block's call, ``save_on_cpu``)."""

    def __init__(self, store, label, block, threshold_bytes):
        self._store, self._label, self._block = store, label, block
        self._threshold = threshold_bytes
        self._stack = []

    def __enter__(self):
        if (not _torch.is_grad_enabled() or _compat.in_backward()
                or _compat.saved_tensors_hooks_active()):
            self._stack.append(None)
            return self
        store = self._store
        group = store.open_group(self._label)
        block = self._block
        pack, unpack = store.hooks(group, lambda: block_storages(block), self._threshold)
        hooks = _torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        hooks.__enter__()
        self._stack.append((group, hooks))
        return self

    def __exit__(self, exc_type, exc, tb):
        entry = self._stack.pop() if self._stack else None
        if entry is None:
            return False
        group, hooks = entry
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

