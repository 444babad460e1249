"""blockswap.offload: the one line. Streams a module's block lists, or a diffusers pipeline's
denoiser and text encoders, within one device budget (the plan: _plan.py), on one Device with
blockswap's own hooks, and undoes it all at close().

Note [what offload places]
Each block list with K > 0 gets a ModelOffloader with ``hook_blocks=True`` on one shared Device
whose budget is what the plan leaves for slots. Everything else goes to the device and stays:
the parts outside the lists (embedders, norms, a pipeline's VAE), the lists the plan keeps whole
(K = 0), and what an offloader never packs (trainable parameters, buffers; it moves those
itself). A forward pre-hook on each component that holds lists readies its offloaders before
each pass (prepare_block_devices_before_forward), so a pipeline's ``__call__`` and a trainer's
``model(x)`` need nothing more. close() undoes it in reverse: the offloaders leave every block
an ordinary host tensor, and each tensor offload moved goes back to the device it came from.
"""

import inspect as _inspect
import os as _os
import weakref as _weakref

import torch as _torch

from . import _compat, _hooks, _module_casts, _plan
from ._offloader import ModelOffloader, _device_name, open_device

_C = _compat.load_extension()
InvalidArgumentError = _C.InvalidArgumentError

# Options offload sets itself, and why a user cannot.
_OWN = {
    "shared_device": "offload opens the one Device every list shares",
    "hook_blocks": "offload always hooks the blocks",
    "device_budget_bytes": "give device_budget",
    "optimizer": "full fine-tuning with a fused optimizer is ModelOffloader's (one per list)",
    "num_blocks": "offload counts the blocks", "block_type": "each list is named by its path",
}
_OFFLOADER_OPTIONS = set(_inspect.signature(ModelOffloader).parameters) - {
    "blocks", "blocks_to_swap", "supports_backward", "device"}


def _default_device(device):
    if device is not None:
        return _torch.device(_device_name(device))
    if not _torch.cuda.is_available():
        raise InvalidArgumentError("blockswap.offload: device defaults to the current CUDA "
                                   "device, and torch sees none here: pass device='cpu' for "
                                   "blockswap's emulated device")
    return _torch.device("cuda", _torch.cuda.current_device())


def _compresses(options):
    """Whether the offloaders compress their frozen weights (compress="on"): each list's decode
    buffer then comes out of the device budget."""
    return options.get("compress") in ("on", True)


def _check_options(options):
    for name in options:
        if name in _OWN:
            raise InvalidArgumentError(f"blockswap.offload: {name} is not an option here: "
                                       f"{_OWN[name]}")
        if name not in _OFFLOADER_OPTIONS:
            raise InvalidArgumentError(f"blockswap.offload got an unknown option {name!r}; "
                                       "the offloader's options are "
                                       f"{sorted(_OFFLOADER_OPTIONS - set(_OWN))}")


def _training(target, supports_backward):
    """supports_backward's default: a pipeline infers; a module trains when some of its
    parameters require grad and some do not (an adapter on frozen weights)."""
    if supports_backward is not None:
        return bool(supports_backward)
    if _plan.is_pipeline(target):
        return False
    flags = {p.requires_grad for _, m in _plan._components(target) for p in m.parameters()}
    return flags == {True, False}


class _Frozen:
    """Inference: every parameter of the target frozen (requires_grad False) while offloaded,
    as a pipeline's ``__call__`` runs them under no_grad anyway (from_pretrained leaves them
    requiring grad, and blockswap swaps only frozen weights); restore() gives the flags back."""

    def __init__(self, target, training):
        self.thawed = [] if training else [p for _, m in _plan._components(target)
                                           for p in m.parameters() if p.requires_grad]
        for p in self.thawed:
            p.requires_grad_(False)

    def restore(self):
        for p in self.thawed:
            p.requires_grad_(True)
        self.thawed = []


def offload(target, device_budget=None, *, device=None, blocks_to_swap=None,
            supports_backward=None, block_lists=None, **options):
    """Streams ``target``'s block lists within ``device_budget``; returns an ``Offloaded``.

    ``target``: a ``torch.nn.Module`` or a diffusers pipeline (its denoiser and text encoders
    stream; its VAE and small parts are placed whole on the device). ``device_budget``: bytes
    or a size ('24GB', '22.5GiB') for the weights on the device; ``device``: as the seed's,
    default the current CUDA device ('cpu': the emulated device). ``blocks_to_swap``: K for
    the one list, or a dict by list name, instead of the planner's. ``supports_backward``:
    default False for a pipeline, and for a module True when some of its parameters require
    grad and some do not (an adapter on frozen weights); for inference every parameter is
    frozen until close(). ``block_lists``: the lists' names
    (``"transformer.transformer_blocks"``) instead of those found. Every other keyword is
    ModelOffloader's, with the same name and meaning (docs/python.md); ``host_budget_bytes``
    is shared among the lists that read a ``weights_file`` in proportion to the bytes each
    swaps, ``weights_file`` is a path (a module) or a dict by component (a pipeline), and
    ``trace`` writes one file per list (``trace.<list>.json``).
    """
    _check_options(options)
    if _plan.is_pipeline(target) and options.get("weights_file") is not None and not isinstance(
            options["weights_file"], dict):
        raise InvalidArgumentError("blockswap.offload of a pipeline takes weights_file as a dict "
                                   "by component, e.g. {'transformer': 'path/to/transformer'}")
    device = _default_device(device)
    training = _training(target, supports_backward)
    frozen = _Frozen(target, training)
    try:
        plan = _plan.plan(target, device_budget, device, training, blocks_to_swap, block_lists,
                          _compresses(options))
        return Offloaded(target, plan, device, options, frozen)
    except BaseException:
        frozen.restore()
        raise


def plan_offload(target, device_budget=None, *, device=None, blocks_to_swap=None,
                 supports_backward=None, block_lists=None, **options):
    """The plan ``offload`` would follow with the same arguments (``str()`` of it says it),
    changing nothing; the weights may be on the meta device, the model offloaded already."""
    _check_options(options)
    device = _default_device(device)
    training = _training(target, supports_backward)
    frozen = _Frozen(target, training)
    try:
        return _plan.plan(target, device_budget, device, training, blocks_to_swap, block_lists,
                          _compresses(options))
    finally:
        frozen.restore()


class Offloaded:
    """What ``offload`` returns: ``plan`` (print it), ``offloaders`` (by list name),
    ``device`` (the shared ``blockswap.Device``), ``stats()``, ``close()``; a context
    manager."""

    def __init__(self, target, plan, device, options, frozen):
        self.plan = plan
        self._frozen = frozen
        self.offloaders = {}
        self._moved = []  # (module, "_parameters" or "_buffers", key, original device)
        self._hooks = []
        self._closed = False
        for x in plan.lists:
            held = next((o for o in map(_module_casts.holder, x.blocks) if o is not None), None)
            if held is not None:
                raise _C.Error(f"[{x.name}] these blocks are already managed by another "
                               f"ModelOffloader ('{held.block_type}'): close it, or the handle "
                               "of the blockswap.offload that made it, first")
        streamed = [x for x in plan.lists if x.blocks_to_swap > 0]
        if (options.get("host_budget_bytes") is not None and streamed
                and all(_weights_file(options, x) is None for x in streamed)):
            raise InvalidArgumentError(
                "blockswap.offload: host_budget_bytes needs weights_file: the blocks over the "
                "budget are read from the model's file (the file tier, docs/guide.md)")
        # The Device's budget: what the fixed parts and the lists kept whole leave (at least
        # the streamed lists' slots; the rest is there for what else it allocates, such as
        # the activations' device buffers; with compress="on" the lists' decode buffers, which
        # the plan counts in fixed_bytes).
        left = 0 if plan.budget_bytes is None else (
            plan.budget_bytes - plan.fixed_bytes + plan.decode_buffer_bytes
            - sum(x.device_bytes for x in plan.lists if x.blocks_to_swap == 0))
        options = dict(options)
        link = options.pop("emulated_link_gbps", 0.0)
        capacity = options.pop("emulated_capacity_bytes", 0)
        self.device = open_device(device, budget_bytes=max(left, 0), link_gbps=link,
                                  capacity_bytes=capacity)
        try:
            for x in streamed:
                self.offloaders[x.name] = ModelOffloader(
                    x.name, x.blocks, len(x.blocks), x.blocks_to_swap, plan.training, device,
                    shared_device=self.device, hook_blocks=True,
                    **_list_options(options, x, streamed))
            self._place(_plan._components(target),
                        [(x.component, x.path, x.blocks) for x in streamed], device)
            for component, module in _plan._components(target):
                mine = [self.offloaders[x.name] for x in streamed if x.component == component]
                if mine:
                    self._hooks.append(module.register_forward_pre_hook(_Prepare(module, mine)))
        except BaseException:
            self.close()
            raise

    def _place(self, components, streamed, device):
        """Every tensor outside the streamed lists to the device (Note [what offload
        places]); none when one of them is on the meta device."""
        modules = list(_plan.outside_lists(components, streamed))
        for m in modules:
            for kind in ("_parameters", "_buffers"):
                for key, t in getattr(m, kind).items():
                    if t is not None and t.is_meta:
                        raise InvalidArgumentError(
                            f"blockswap.offload: {kind[1:-1]} '{key}' of a "
                            f"{type(m).__name__} that stays on the device is on the meta "
                            "device (it holds no values): load the model's weights first; only "
                            "the frozen weights of swapped blocks can come from weights_file")
        for m in modules:
            for kind in ("_parameters", "_buffers"):
                for key, t in getattr(m, kind).items():
                    if t is None or t.device == device:
                        continue
                    self._moved.append((m, kind, key, t.device))
                    if kind == "_parameters":
                        t.data = t.data.to(device)
                    else:
                        m._buffers[key] = t.to(device)

    def stats(self):
        """Each offloader's stats() by list name (the Device's memory: ``device.memory()``)."""
        return {name: o.stats() for name, o in self.offloaders.items()}

    def close(self):
        """Undoes everything: the model runs plain, where it was. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        for hook in self._hooks:
            hook.remove()
        for o in self.offloaders.values():
            o.close()
        for m, kind, key, original in reversed(self._moved):
            t = getattr(m, kind)[key]
            if kind == "_parameters":
                t.data = t.data.to(original)
            else:
                m._buffers[key] = t.to(original)
        self._moved = []
        self._frozen.restore()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        self.close()
        return False

    def __str__(self):
        return str(self.plan)

    __repr__ = __str__


class _Prepare:
    """A forward pre-hook: the component's offloaders ready for a pass. Inert in a copy or a
    pickle of the model, as blockswap's block hooks are (Note [hooks in copies], _hooks.py)."""
    __slots__ = ("_module", "_offloaders")

    def __init__(self, module, offloaders):
        self._module = _weakref.ref(module)
        self._offloaders = [_weakref.ref(o) for o in offloaders]

    def __call__(self, module, args):
        if module is not self._module():
            return
        for ref in self._offloaders:
            o = ref()
            if o is not None and o._impl is not None:
                o.prepare_block_devices_before_forward()

    def __deepcopy__(self, memo):
        return _hooks.inert

    def __reduce__(self):
        return _hooks._inert, ()


def _weights_file(options, x):
    weights = options.get("weights_file")
    return weights.get(x.component) if isinstance(weights, dict) else weights


def _list_options(options, x, streamed):
    """The offloader options for list `x` (offload's docstring): host_budget_bytes shared among
    the lists that read a weights_file, by the bytes each swaps."""
    mine = dict(options)
    mine["weights_file"] = _weights_file(options, x)
    if mine["weights_file"] is None:
        mine.pop("host_budget_bytes", None)
    elif options.get("host_budget_bytes") is not None:
        filed = [y for y in streamed if _weights_file(options, y) is not None]
        total = sum(y.blocks_to_swap * max(y.block_bytes) for y in filed)
        share = x.blocks_to_swap * max(x.block_bytes)
        mine["host_budget_bytes"] = int(options["host_budget_bytes"]) * share // total
    if mine["weights_file"] is not None and "weights_prefix" not in options:
        mine["weights_prefix"] = x.path + "."
    if options.get("trace") is not None:
        stem, ext = _os.path.splitext(_os.fspath(options["trace"]))
        mine["trace"] = f"{stem}.{x.name}{ext or '.json'}"
    return mine
