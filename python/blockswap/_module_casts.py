"""``model.to(...)``, ``.half()``, ``.cuda()`` (torch's Module._apply) on a model whose blocks
blockswap swaps.

Note [casting a managed model]
Module._apply rebinds each tensor to fn(tensor) through ``.data``, module after module. A
swapped block's frozen tensors are views of blockswap's packed memory, in a fixed dtype and
placed by the schedule, so the two kinds of call are taken apart:
- a move (the dtype of every swapped tensor stays): it reaches the block's adapters and buffers
  and leaves the swapped tensors where the schedule put them, as a trainer moving "everything
  but the swapped blocks" (musubi-tuner's move_to_device_except_swap_blocks) wants;
- a cast (a swapped tensor's dtype changes): the offloader is closed as the cast reaches its
  first block (every tensor an ordinary host tensor with its values), the cast runs as without
  blockswap, and the offloader is built again over the cast blocks, with the same arguments,
  at its next verb. Nothing is left half cast. With a fused optimizer, whose state lives in
  the blocks' memory, the cast is refused instead, at the first block it reaches, before that
  block changes (modules the cast reached earlier are cast).
The blocks' classes are patched once; the patch does nothing for a module no live offloader
holds (copies, models without blockswap).
"""

import weakref as _weakref

import torch as _torch

# block -> weak reference to the offloader that swaps it
_managed = _weakref.WeakKeyDictionary()
_patched = set()


def _swapped(module, offloader):
    """(owner module, name) of each parameter under `module` that blockswap swaps: the frozen
    ones, and with a fused optimizer the trainable ones too."""
    every = offloader.optimizer is not None
    return [(owner, name) for owner in module.modules()
            for name, p in owner._parameters.items()
            if p is not None and (every or not p.requires_grad)]


def _changes_dtype(module, offloader, fn):
    for owner, name in _swapped(module, offloader):
        p = owner._parameters[name]
        with _torch.no_grad():
            probe = fn(_torch.empty(0, dtype=p.dtype, device=p.device))
        if probe.dtype != p.dtype:
            return True
    return False


def _patch(cls):
    original = cls._apply

    def _apply(self, fn, *args, **kwargs):
        reference = _managed.get(self)
        offloader = reference() if reference is not None else None
        if offloader is None or not offloader._active:
            return original(self, fn, *args, **kwargs)
        if _changes_dtype(self, offloader, fn):
            offloader._release_for_cast()
            return original(self, fn, *args, **kwargs)
        # A move: the swapped tensors stay out of it (each module's parameters keep their order).
        owners = {id(owner): owner for owner, _ in _swapped(self, offloader)}.values()
        before = [(owner, owner._parameters) for owner in owners]
        for owner, parameters in before:
            held = {name for o, name in _swapped(owner, offloader) if o is owner}
            owner.__dict__["_parameters"] = {k: p for k, p in parameters.items()
                                             if k not in held}
        try:
            return original(self, fn, *args, **kwargs)
        finally:
            for owner, parameters in before:
                moved = owner._parameters
                owner.__dict__["_parameters"] = parameters
                parameters.update(moved)

    _apply.__wrapped__ = original
    cls._apply = _apply


def manage(offloader, blocks):
    for block in blocks:
        cls = type(block)
        if cls not in _patched:
            _patch(cls)
            _patched.add(cls)
        _managed[block] = _weakref.ref(offloader)


def holder(block):
    """The live offloader that swaps `block`, or None."""
    reference = _managed.get(block)
    offloader = reference() if reference is not None else None
    return offloader if offloader is not None and offloader._active else None


def release(offloader):
    for block in [b for b, r in _managed.items() if r() is offloader or r() is None]:
        del _managed[block]
