"""The forward hooks blockswap puts on each block: the one that brackets a block's outputs in
autograd, and, with ``hook_blocks=True``, the wait before the block and the submit after it.

Note [hooks in copies]
Trainers copy a managed model (``copy.deepcopy`` for an EMA) and save it whole
(``torch.save(model)``); both take the blocks' hooks along. A hook that went along would act
on this offloader with another model's block, so each hook holds its offloader weakly, acts only
for the block it was made for, and becomes ``inert`` in a copy or a pickle: the copy is a plain
module. Holding the offloader weakly also lets ``del offloader`` free it at once.

Note [kept state dicts]
``state_dict()`` returns tensors that share their parameters' memory. A swapped block's weights
are views of its host copy while it is off the device, which never changes; but while it is on
the device they are views of its slot, and a later load gives that slot to another block (in
inference every rotating block, in training a resident block lends its slot during the step).
A state dict kept past that (musubi-tuner keeps the inactive Wan 2.2 expert's) would then read
the other block's weights. In inference (forward-only) every pass does that, and a state dict
kept across passes would read other blocks' weights: there, a block on the device gives its
frozen weights to a state_dict as host copies of their values (one copy of the resident blocks'
weights per call, in inference only). In training every block is back in its own slot when a
step ends, so a state dict taken and read between steps (a checkpoint, a LoRA save, musubi-tuner's
expert switch) is exact and costs no copy; one read in the middle of a later step is not.
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


class StateDictHook(_Hook):
    """A state_dict hook on block i (Note [kept state dicts]): in inference, while the block is
    on the device, its swapped weights in a state_dict are host copies of their values, not
    views of its slot, which the next pass gives to another block."""
    __slots__ = ()

    def __call__(self, module, state_dict, prefix, local_metadata):
        offloader = self._offloader(module)
        if offloader is None:
            return None
        paths = {id(owner): path for path, owner in module.named_modules()}
        # Compressed frozen weights (Note [copies of compressed blocks]): their true values.
        decoded = {id(var): value for var, value in offloader._impl.frozen_values(self._index)}
        if decoded:
            for owner, name, p, _ in offloader._packed[self._index]:
                path = paths.get(id(owner))
                key = prefix + (f"{path}.{name}" if path else name)
                value = state_dict.get(key)
                if (id(p) in decoded and value is not None
                        and not isinstance(value, _torch.nn.Parameter)):
                    copy = decoded[id(p)]
                    state_dict[key] = copy
                    offloader._handed.append((_weakref.ref(copy), copy._version, owner, name, p))
            return None
        if not offloader.forward_only or not offloader._impl.is_resident(self._index):
            return None
        offloader._impl.synchronize()  # no load into the slot in flight
        for owner, name, p, _ in offloader._packed[self._index]:
            path = paths.get(id(owner))
            key = prefix + (f"{path}.{name}" if path else name)
            value = state_dict.get(key)
            if (value is not None and not isinstance(value, _torch.nn.Parameter)  # keep_vars
                    and owner._parameters.get(name) is p and not p.requires_grad):
                state_dict[key] = value.to("cpu", copy=True)
        return None


def take_state_dict_writes(offloader):
    """Note [writes into a state dict of compressed blocks]
    A state_dict() of a model whose frozen weights are compressed holds, for the blocks off the
    device, copies of their true values (StateDictHook), not views of the weights as without
    compression: a write into such an entry (``sd[k].copy_(ema[k])``, ``sd[k].mul_(0.5)``)
    would be lost. So each copy handed out is remembered with autograd's version counter, which
    every in-place write bumps, and at the next pass's start (and at close()) a copy written
    since is taken as the weight's new value: its Parameter is given those values (param.data =
    ..., which the offloader keeps exactly, Note [changed compressed weights] in
    src/torch/block_binder.cpp). The copies no longer referenced are forgotten."""
    handed, offloader._handed = offloader._handed, []
    for ref, version, owner, name, p in handed:
        copy = ref()
        if copy is None or copy._version == version or owner._parameters.get(name) is not p:
            continue
        with _torch.no_grad():
            p.data = copy.detach().clone()


class FrozenState:
    """Note [copies of compressed blocks]
    With compress="on" a block's frozen tensors have no elements off the device (Note
    [compressed frozen views] in src/torch/tier_views.cpp), and copy.deepcopy, pickle and
    torch.save copy a module's tensors as they are. So each module of such a block gets this as
    its own __getstate__ (the instance's attribute, which copy and pickle read before the
    class's): the module's state with every compressed frozen tensor replaced by its true values,
    decoded for this copy only. A copy is a plain module with the true weights, as without
    compression."""
    __slots__ = ("_owner", "_module", "_index", "__weakref__")

    def __init__(self, offloader, module, index):
        self._owner = _weakref.ref(offloader)
        self._module = _weakref.ref(module)
        self._index = index

    def __call__(self):
        module = self._module()
        state = dict(module.__dict__)
        state.pop("__getstate__", None)
        offloader = self._owner()
        if offloader is None or offloader._impl is None:
            return state
        decoded = {id(var): value for var, value in offloader._impl.frozen_values(self._index)}
        for key in ("_parameters", "_buffers"):
            entries = state.get(key)
            if not entries or not any(id(t) in decoded for t in entries.values()):
                continue
            state[key] = type(entries)(
                (name, t if id(t) not in decoded else
                 _torch.nn.Parameter(decoded[id(t)], requires_grad=t.requires_grad)
                 if isinstance(t, _torch.nn.Parameter) else decoded[id(t)])
                for name, t in entries.items())
        return state

    @staticmethod
    def install(offloader, block, index):
        """On every module of block `index`; returns the handles that remove them."""
        handles = []
        for module in block.modules():
            state = FrozenState(offloader, module, index)
            module.__dict__["__getstate__"] = state
            handles.append(_RemoveState(module, state))
        return handles


class LoadStateHook(_Hook):
    """Note [loading compressed blocks]
    ``load_state_dict`` copies each value into its parameter in place, after checking the
    shapes; a compressed block's frozen tensors have no elements off the device (Note
    [compressed frozen views] in src/torch/tier_views.cpp), so torch would refuse them, after
    having loaded the blocks before. So a pre-hook on each block (``pre``) binds the frozen
    tensors that the state dict holds to their true values, decoded, which torch then loads
    into as without compression; the post-hook, once the block and its modules are loaded,
    takes the changes at once (ModelOffloader::take_changes: the block's frozen bytes are
    encoded again, Note [changed compressed weights] in src/torch/block_binder.cpp), so that
    the decoded values do not stay in host memory. ``assign=True`` replaces the Parameters
    instead (blockswap takes those at the next pass, Note [the model as it runs]), after the
    same check of their shapes: the tensors are bound to their true values for it too."""
    __slots__ = ("_pre",)

    def __init__(self, offloader, block, index, pre):
        super().__init__(offloader, block, index)
        self._pre = pre

    def __call__(self, module, *args):
        offloader = self._offloader(module)
        if offloader is None:
            return None
        if not self._pre:
            offloader._impl.take_changes(self._index)
            return None
        state_dict, prefix = args[0], args[1]
        decoded = {id(var): value for var, value in offloader._impl.frozen_values(self._index)}
        if not decoded:
            return None
        paths = {id(owner): path for path, owner in module.named_modules()}
        for owner, name, p, _ in offloader._packed[self._index]:
            path = paths.get(id(owner))
            key = prefix + (f"{path}.{name}" if path else name)
            if (id(p) in decoded and p.numel() == 0 and key in state_dict
                    and owner._parameters.get(name) is p):  # off the device: no elements
                p.data = decoded[id(p)]
        return None

    @staticmethod
    def install(offloader, block, index):
        """The pre-hook and the post-hook on block `index`; returns their handles."""
        return [block._register_load_state_dict_pre_hook(
                    LoadStateHook(offloader, block, index, pre=True), with_module=True),
                block.register_load_state_dict_post_hook(
                    LoadStateHook(offloader, block, index, pre=False))]


class _RemoveState:
    __slots__ = ("_module", "_state")

    def __init__(self, module, state):
        self._module = _weakref.ref(module)
        self._state = state

    def remove(self):
        module = self._module()
        if module is not None and module.__dict__.get("__getstate__") is self._state:
            del module.__dict__["__getstate__"]


class ActivationHook(_Hook):
    """With offload_activations=True, a forward pre-hook (``enter``) and a forward hook (run
    even when the forward raises) around block i: what autograd saves in between is block i's
    group of offloaded activations (Note [offloaded activations] in
    include/blockswap/core/activation_rule.hpp). Unlike the other hooks it acts without an
    engine too (K = 0: activations alone)."""
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
