"""The forward hooks blockswap puts on each block: the one that brackets a block's outputs in
autograd, and, with ``hook_blocks=True``, the wait before the block and the submit after it.

Note [hooks in copies]
Trainers copy a managed model (``copy.deepcopy`` for an EMA) and save it whole
(``torch.save(model)``); both take the blocks' hooks along. A hook that went along would act
on this offloader with another model's block, so each hook holds its offloader weakly, acts only
for the block it was made for, and becomes ``inert`` in a copy or a pickle: the copy is a plain
module. Holding the offloader weakly also lets ``del offloader`` free it at once.
"""

import weakref as _weakref

import torch as _torch

from . import _compat


def inert(*args):
    """A copied or unpickled blockswap hook: does nothing (Note [hooks in copies])."""
    return None


def _inert():
    return inert


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


class _Hook:
    __slots__ = ("_owner", "_block", "_index")

    def __init__(self, offloader, block, index):
        self._owner = _weakref.ref(offloader)
        self._block = _weakref.ref(block)
        self._index = index

    def _offloader(self, module):
        """The live offloader, when `module` is the block this hook was made for."""
        offloader = self._owner()
        if offloader is None or offloader._impl is None or module is not self._block():
            return None
        return offloader

    def __deepcopy__(self, memo):
        return inert

    def __reduce__(self):
        return _inert, ()


class WaitHook(_Hook):
    """A forward pre-hook: wait_for_block(i) before block i runs (hook_blocks=True)."""
    __slots__ = ()

    @_compat.compiler_disable
    def __call__(self, module, inputs):
        offloader = self._offloader(module)
        if offloader is None:
            return
        i = self._index
        # Blocks the model's forward skipped since the last one that ran (skip-layer guidance,
        # SD3's skip_layers) are submitted now, as musubi-tuner submits a skipped block: no
        # hook saw them. Blocks seen again in decreasing order are a new pass or a recompute.
        for skipped in range(offloader._next_block, i):
            offloader._impl.bracket_outputs(skipped, [])
            offloader.submit_move_blocks_forward(skipped)
        offloader.wait_for_block(i)  # at block 0 it may build the offloader again, which
        offloader._next_block = i + 1  # starts the count from 0 (Note [the model as it runs])


class OutputHook(_Hook):
    """A forward hook: block i's outputs, bracketed in autograd, so that before the block's
    backward runs its weights are brought back where its forward's saved tensors point (an
    inference offloader's too: a backward through it loads blocks on demand); then, with
    hook_blocks=True, submit_move_blocks_forward(i)."""
    __slots__ = ("_submit",)

    def __init__(self, offloader, block, index, submit):
        super().__init__(offloader, block, index)
        self._submit = submit

    @_compat.compiler_disable
    def __call__(self, module, inputs, output):
        offloader = self._offloader(module)
        if offloader is None:
            return None
        rebuilt = None
        impl = offloader._impl
        if not _torch.is_grad_enabled():
            # No backward can reach these outputs: the submit may be outside no_grad.
            impl.bracket_outputs(self._index, [])
        else:
            tensors = []
            _flatten(output, tensors)
            if tensors:
                rebuilt = _rebuild(output, iter(impl.bracket_outputs(self._index, tensors)))
        if self._submit:
            offloader.submit_move_blocks_forward(self._index)
        return rebuilt


class ActivationHook(_Hook):
    """With offload_activations=True, a forward pre-hook (``enter``) and a forward hook (run
    even when the forward raises) around block i: what autograd saves in between is block i's
    group of offloaded activations (Note [offloaded activations] in _activations.py). Unlike
    the other hooks it acts without an engine too (K = 0: activations alone)."""
    __slots__ = ("_enter",)

    def __init__(self, offloader, block, index, enter):
        super().__init__(offloader, block, index)
        self._enter = enter

    @_compat.compiler_disable
    def __call__(self, module, *args):
        offloader = self._owner()
        if offloader is None or offloader._activations is None or module is not self._block():
            return None
        context = offloader._activations[self._index]
        if self._enter:
            context.__enter__()
        else:
            context.__exit__(None, None, None)
        return None
