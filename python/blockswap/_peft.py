"""peft's merge_adapter() / unmerge_adapter() (and diffusers' fuse_lora / unfuse_lora, which call
the same layer methods) on blocks that blockswap swaps.

Note [peft merges]
peft merges an adapter by writing the base weight through ``.data`` (``weight.data += delta``),
a write autograd's version counter does not see, into wherever the weight is bound right then:
a slot that the next eviction discards, or the host copy itself, which is authoritative. Left
alone, a merge would be lost at the next move or would change the base weights for good. So
each managed tuner layer's merge first rebinds its base weights to a private copy of their
true values, on the device the adapter is on; peft merges into that copy, and blockswap, which
sees the rebinding, takes the merged values into the host copy and the slot at the block's next
move (Note [changed tensors] in block_binder.cpp). The merged sample is the one peft computes
without blockswap, bit for bit. The first merge keeps the weights' original values, and an unmerge
with nothing written since (the base weights and the adapters keep autograd's version) puts them
back exactly: the host copy ends as it was, where peft's own subtraction would leave rounding
behind. Otherwise (weights loaded while merged, adapters changed, a merge from before the
offloader) the unmerge is peft's own subtraction, into a private copy too, as without blockswap.

The layer classes are patched once, and the patch does nothing for a layer no live offloader
holds: copies (``copy.deepcopy``), pickles and models without blockswap see peft's own methods.
"""

import sys as _sys
import weakref as _weakref

import torch as _torch

# tuner layer -> weak reference to the offloader that swaps its block
_managed = _weakref.WeakKeyDictionary()
_patched = set()


def _tuner_layer_class():
    tuners = _sys.modules.get("peft.tuners.tuners_utils")
    return getattr(tuners, "BaseTunerLayer", None) if tuners is not None else None


def _owner(layer):
    reference = _managed.get(layer)
    return reference() if reference is not None else None


def _base_tensors(layer):
    return [p for _, p in layer.get_base_layer().named_parameters(recurse=False)
            if not p.requires_grad]


def _adapter_tensors(layer, base):
    return [q for q in layer.parameters() if all(q is not b for b in base)]


def _true_values(offloader, base):
    """The base weights' values: with compress="on" those of a block off the device are
    decoded (they have no elements there; Note [copies of compressed blocks] in _hooks.py)."""
    empty = [p for p in base if p.numel() == 0]
    values = {}
    if not empty or offloader._impl is None:
        return values
    for i, packed in enumerate(offloader._packed):
        if any(entry[2] is p for entry in packed for p in empty):
            values.update((id(var), value) for var, value in offloader._impl.frozen_values(i))
    return values


def _private_copies(offloader, layer, base):
    """Rebinds the base weights to private copies of their true values, on the adapters'
    device: peft's write through .data lands there, and blockswap sees the rebinding (a
    compressed block's frozen weights are encoded again: Note [changed compressed weights] in
    src/torch/block_binder.cpp)."""
    adapters = _adapter_tensors(layer, base)
    device = adapters[0].device if adapters else None
    values = _true_values(offloader, base)
    for p in base:
        p.data = values.get(id(p), p.detach()).to(device or p.device, copy=True)


def _routed(original, body):
    """peft's layer method `original`, through ``body(offloader, layer, call)`` for a layer a
    live offloader swaps (``call()`` runs peft's own), as itself for any other."""
    def method(self, *args, **kwargs):
        offloader = _owner(self)
        if offloader is None or not offloader._active:
            return original(self, *args, **kwargs)
        offloader.synchronize()
        return body(offloader, self, lambda: original(self, *args, **kwargs))

    method.__wrapped__ = original
    return method


def _merge(offloader, layer, call):
    base = _base_tensors(layer)
    originals = offloader._merge_originals
    values = _true_values(offloader, base)
    for p in base:
        if id(p) not in originals:
            originals[id(p)] = [p, values.get(id(p), p.detach()).to("cpu", copy=True), None]
    _private_copies(offloader, layer, base)
    result = call()
    # What a later unmerge checks: nobody wrote the weights or the adapters since.
    for p in base:
        originals[id(p)][2] = p._version
    offloader._merge_adapters[id(layer)] = [(q, q._version)
                                            for q in _adapter_tensors(layer, base)]
    return result


def _unmerge(offloader, layer, call):
    base = _base_tensors(layer)
    originals = offloader._merge_originals
    adapters = offloader._merge_adapters.pop(id(layer), None)
    untouched = (adapters is not None and all(q._version == v for q, v in adapters)
                 and all(id(p) in originals and originals[id(p)][2] == p._version for p in base))
    _private_copies(offloader, layer, base)
    result = call()
    for p in base:
        saved = originals.pop(id(p), None)
        # Nothing written since the merge: the original values come back exactly. Else peft's
        # subtraction stands, as without blockswap.
        if untouched and saved is not None and not layer.merged:
            p.data = saved[1].to(p.device, copy=True)
    return result


def manage(offloader, blocks):
    """Routes the merges of the peft tuner layers in `blocks` through Note [peft merges]."""
    tuner = _tuner_layer_class()
    if tuner is None:
        return
    for block in blocks:
        for module in block.modules():
            if not isinstance(module, tuner):
                continue
            cls = type(module)
            if cls not in _patched and hasattr(cls, "merge") and hasattr(cls, "unmerge"):
                cls.merge = _routed(cls.merge, _merge)
                cls.unmerge = _routed(cls.unmerge, _unmerge)
                _patched.add(cls)
            _managed[module] = _weakref.ref(offloader)


def release(offloader):
    for module in [m for m, r in _managed.items() if r() is offloader or r() is None]:
        del _managed[module]
    offloader._merge_originals.clear()
    offloader._merge_adapters.clear()
