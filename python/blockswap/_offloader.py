"""The seed's ModelOffloader on blockswap's engine (python/src/module.cpp), with the forward
hooks that bracket each block's outputs in autograd, and open_device."""

import operator as _operator
import os as _os
import warnings as _warnings

import torch as _torch

from . import _activations, _block_tensors, _compat, _distributed, _hooks, _module_casts, _peft
from ._optim import _FusedOptimizer

_C = _compat.load_extension()
InvalidArgumentError = _C.InvalidArgumentError


def _device_name(device):
    try:
        device = _torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(f"device {device!r} is not a device: {e}") from None
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"device {device} is not one blockswap runs on: cpu (the "
                                   "emulated device) or cuda")
    return str(device)


def _integer(where, name, value, least=0):
    """An int option (numpy and torch integers too; not a bool), >= least."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{where}{name} must be an int, got {value!r}")
    try:
        value = _operator.index(value)
    except TypeError:
        raise InvalidArgumentError(f"{where}{name} must be an int, got {value!r}") from None
    if value < least:
        raise InvalidArgumentError(f"{where}{name} must be an int >= {least}, got {value}")
    if value >= 2**63:
        raise InvalidArgumentError(f"{where}{name}={value} is out of range")
    return value


def _real(where, name, value):
    """A float option (an int or a float, numpy's too; not a bool)."""
    if isinstance(value, bool):
        raise InvalidArgumentError(f"{where}{name} must be a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise InvalidArgumentError(f"{where}{name} must be a number, got {value!r}") from None


def open_device(device="cuda", *, budget_bytes=0, link_gbps=0.0, capacity_bytes=0,
                pinnable_bytes=None):
    """A device that several offloaders share (a model's double and single blocks): one copy
    stream, one memory account, and a budget (bytes) for all their slots together.
    ``cpu`` is the emulated device; ``link_gbps`` and ``capacity_bytes`` are its link and memory,
    ``pinnable_bytes`` how much host memory it may page-lock (None: no cap), to try what a low
    ``ulimit -l`` or WSL does: past it, host copies are pageable and their loads are staged
    (guide: "When pinning fails"). A mistake in an argument is an InvalidArgumentError naming it.
    """
    where = "open_device: "
    link = _real(where, "link_gbps", link_gbps)
    if not (link == 0 or 0.001 <= link < float("inf")):
        raise InvalidArgumentError(f"{where}link_gbps must be 0 (unlimited) or a finite number "
                                   f">= 0.001, got {link_gbps!r}")
    pinnable = None if pinnable_bytes is None else _integer(where, "pinnable_bytes",
                                                            pinnable_bytes)
    return _C.open_device(_device_name(device), _integer(where, "budget_bytes", budget_bytes),
                          link, _integer(where, "capacity_bytes", capacity_bytes), pinnable)


def _path(block_type, path):
    """A weights_file argument as a str ('' for None)."""
    if path is None:
        return ""
    try:
        return _os.fspath(path)
    except TypeError:
        raise InvalidArgumentError(f"[{block_type}] weights_file must be a path (str or "
                                   f"os.PathLike), got {path!r}") from None



def _compress_name(block_type, compress):
    """compress= as Options::compress names it: "off", "on" or "auto" (True and False too)."""
    if isinstance(compress, bool):
        return "on" if compress else "off"
    if not isinstance(compress, str):
        raise InvalidArgumentError(f"[{block_type}] compress must be 'off', 'on' or 'auto', got "
                                   f"{compress!r}")
    return compress

class ModelOffloader:
    """The seed's ModelOffloader, positional arguments as the seed's, on blockswap's engine.

    ``block_type`` (the label in messages), ``blocks`` (the modules, in the order they run),
    ``num_blocks`` (their number), ``blocks_to_swap`` (K, the blocks that leave the device;
    0 or None: none; -1 with ``device_budget_bytes``: the planner chooses),
    ``supports_backward`` (False: inference only), ``device`` (``cuda``, ``cuda:N``, or
    ``cpu``, the emulated device), ``reentrant_activation_checkpointing`` (the blocks run in
    reentrant ``torch.utils.checkpoint``, which runs each block's forward again in backward),
    ``debug`` (the seed's log: a line for each move and wait).
    musubi-tuner passes ``use_pinned_memory`` where diffusion-pipe passes the reentrant flag:
    see docs/python.md, "Trainers". In place of musubi-tuner's ``LoRAStreamOffloader``
    (``--block_swap_h2d_only``) it takes that class's keywords: ``ring_size`` (B: the S =
    ``blocks_to_swap`` streamed blocks get B more slots; blockswap keeps the same device memory,
    N-S+B blocks, with K = S-B off the device and, in inference, B rotating slots) and
    ``use_pinned_memory`` (no effect: blockswap pins its host copy wherever it can).

    Keyword-only extras: ``rotating_slots`` (inference: slots the swapped blocks rotate
    through), ``training_rotating_slots`` (training, for a pipeline stage whose forwards or
    backwards come in a row: K+R blocks rotate through R slots, so each such turn reloads R
    blocks instead of K; docs/distributed.md, "Pipeline stages"), ``device_budget_bytes`` (with ``blocks_to_swap=-1`` the planner chooses K),
    ``shared_device`` (from ``open_device``: one device for several offloaders), ``trace`` (a
    Chrome trace file written at ``close()``), ``emulated_link_gbps`` and
    ``emulated_capacity_bytes`` (the emulated device, ``device='cpu'``), ``hook_blocks``
    (``True``: forward hooks wait for each block before it runs and submit its move after it,
    for a model whose own forward loops over the blocks, such as diffusers' classes; call
    ``prepare_block_devices_before_forward()`` before each pass yourself).

    Full fine-tuning: ``optimizer`` (a ``FusedSGD`` or ``FusedAdamW`` over the blocks'
    parameters that require grad) swaps those parameters with their blocks and steps each one
    during backward as soon as its gradient is complete; ``gradient_accumulation_steps``
    (a step every n-th backward, the gradients summed in the blocks' memory) and
    ``max_grad_norm_per_parameter`` (clipping each parameter's gradient alone), ``step_on``
    (``"device"``: the optimizer state swaps with the blocks; ``"host"``: gradients go to host
    memory and the CPU steps there; ``"auto"``: the faster one measured, the host on the
    emulated device ``'cpu'``, the device on a GPU).
    docs/guide.md, "Fine-tuning".

    Data-parallel training (``torch.distributed``, docs/distributed.md): ``process_group`` (a
    ``torch.distributed`` process group, e.g. ``torch.distributed.group.WORLD``) makes the ranks
    of each node read one host copy of the swapped weights, local rank 0's. Every rank builds
    the same offloaders in the same order (the constructor is collective); call
    ``exclude_from_ddp(model)`` before wrapping the model in ``DistributedDataParallel``.

    The model's file and the file tier (docs/guide.md, "When the model does not fit in host
    memory"): ``weights_file`` (the safetensors file holding the blocks' frozen weights, block
    i's tensor ``name`` as ``<weights_prefix>i.name``, peft's ``.base_layer`` left out; or a
    sharded checkpoint: its ``*.safetensors.index.json`` or the folder holding it),
    ``weights_prefix`` (``"transformer_blocks."``; empty: found from the file),
    ``weights_layout`` (how the file names the module's tensors: ``""``/``"auto"``,
    ``"diffusers"``, ``"flux"``: Black Forest Labs' original FLUX names, to_q/to_k/to_v and
    proj_mlp read as row slices of qkv and linear1; ComfyUI's ``model.diffusion_model.`` is
    found in any layout), ``weights_map`` (a dict or a callable from the module's tensor name
    ``<weights_prefix>i.name`` to the file's name, or to ``(name, (first row, end row))``),
    ``host_budget_bytes`` (this offloader's pinned host memory for the blocks that move, in
    block order, training's first; the
    others are read from the file for each load, and their tensors off the device are views of
    the file; None: every block in host memory), ``staging_buffers`` (the file tier's ring of
    pinned buffers, each a block's size), ``file_reads`` (``"direct"``: O_DIRECT; ``"drop"``:
    buffered reads each dropped from the page cache after, faster on some disks),
    ``weights_from_file`` (the frozen weights' values are
    read from the file whatever the tensors hold; None: when the blocks were built on the meta
    device, which the offloader then fills from the file without a second copy). Weights read
    from the file for each load must equal the file's (checked once) and cannot change.

    Compressed weights (docs/guide.md, "Compressed weights"): ``compress`` (``"on"``: the
    blocks' frozen weights are kept in host memory losslessly compressed and decoded on the
    device at each load: exact, less host memory, fewer bytes over the link; off the device
    their frozen tensors have no elements, and ``close()`` gives them their values back;
    ``"off"``, the default; ``"auto"``: on where it pays, when the weights are floating point
    and host memory is short, else off, chosen per offloader and reported in ``stats()`` and
    ``compression()`` with the reason; True and False are ``"on"`` and ``"off"``). Frozen
    weights changed between passes are encoded again (``param.data = new``,
    ``load_state_dict``, peft's merges); an in-place write into a compressed tensor off the
    device raises at the next pass (docs/guide.md, "Compressed weights").

    Activations (docs/guide.md, "Offloading activations"): ``offload_activations`` (what each
    block's forward saves for backward goes to host memory and comes back just before the
    block's backward; with ``blocks_to_swap=0`` too), ``activation_threshold_bytes`` (saved
    storages smaller than this stay on the device; default 1 MiB).

    With no blocks, or ``blocks_to_swap=0`` and neither an optimizer, a ``weights_file`` nor
    ``offload_activations``, it does nothing, like the seed: it allocates nothing, registers
    nothing and every verb returns at once.
    """

    def __init__(self, block_type, blocks, num_blocks, blocks_to_swap, supports_backward,
                 device, reentrant_activation_checkpointing=False, debug=False, *,
                 rotating_slots=0, training_rotating_slots=0, device_budget_bytes=0, shared_device=None, trace=None,
                 emulated_link_gbps=0.0, emulated_capacity_bytes=0, optimizer=None,
                 gradient_accumulation_steps=1, max_grad_norm_per_parameter=0.0,
                 step_on="auto", process_group=None, hook_blocks=False, weights_file=None,
                 weights_prefix="", weights_layout="", weights_map=None,
                 weights_from_file=None, host_budget_bytes=None,
                 staging_buffers=2, file_reads="direct", compress="off",
                 offload_activations=False,
                 activation_threshold_bytes=_activations.DEFAULT_THRESHOLD_BYTES,
                 ring_size=None, use_pinned_memory=None):
        # The arguments, to build it again after a cast (Note [casting a managed model]).
        self._arguments = ((block_type, blocks, num_blocks, blocks_to_swap, supports_backward,
                            device, reentrant_activation_checkpointing, debug),
                           dict(rotating_slots=rotating_slots,
                                training_rotating_slots=training_rotating_slots,
                                device_budget_bytes=device_budget_bytes,
                                shared_device=shared_device, trace=trace,
                                emulated_link_gbps=emulated_link_gbps,
                                emulated_capacity_bytes=emulated_capacity_bytes,
                                optimizer=optimizer,
                                gradient_accumulation_steps=gradient_accumulation_steps,
                                max_grad_norm_per_parameter=max_grad_norm_per_parameter,
                                step_on=step_on, process_group=process_group,
                                hook_blocks=hook_blocks, weights_file=weights_file,
                                weights_prefix=weights_prefix,
                                weights_layout=weights_layout, weights_map=weights_map,
                                weights_from_file=weights_from_file,
                                host_budget_bytes=host_budget_bytes,
                                staging_buffers=staging_buffers, file_reads=file_reads,
                                compress=compress,
                                offload_activations=offload_activations,
                                activation_threshold_bytes=activation_threshold_bytes,
                                ring_size=ring_size, use_pinned_memory=use_pinned_memory))
        self._rebuild = False
        self.block_type = block_type
        self.blocks = list(blocks) if blocks is not None else []
        self.num_blocks = num_blocks
        self.blocks_to_swap = blocks_to_swap
        self.supports_backward = bool(supports_backward)
        self.forward_only = not self.supports_backward
        self.reentrant_activation_checkpointing = bool(reentrant_activation_checkpointing)
        self.debug = debug
        self.optimizer = optimizer
        self.gradient_accumulation_steps = gradient_accumulation_steps
        self._impl = None
        self._hooks = []
        self._activations = None  # offload_activations: one context a block
        self._merge_originals = {}  # Note [peft merges]
        self._merge_adapters = {}
        self._submitted = set()  # blocks submitted since the last prepare (for its message)
        self._handed = []  # Note [writes into a state dict of compressed blocks] (_hooks.py)
        self._next_block = 0  # hook_blocks: the block expected next (skipped blocks)
        self._closed = False
        self._swap_disabled = False  # disable_block_swap() (kept when built again)
        self._carried = {}  # the counters of the engines it had before (built again) or closed
        self._trace = trace
        if not isinstance(block_type, str):
            raise InvalidArgumentError(f"block_type must be a str (the blocks' label), got "
                                       f"{block_type!r}")
        if num_blocks != len(self.blocks):
            raise ValueError(f"[{block_type}] num_blocks={num_blocks!r} but {len(self.blocks)} "
                             "blocks were given")
        if optimizer is not None and not isinstance(optimizer, _FusedOptimizer):
            raise InvalidArgumentError(f"[{block_type}] optimizer must be a blockswap.FusedSGD "
                                       f"or FusedAdamW, not a {type(optimizer).__name__}: a "
                                       "torch.optim optimizer cannot step parameters that swap")
        if process_group is not None and not _distributed.is_process_group(process_group):
            raise InvalidArgumentError(f"[{block_type}] process_group must be a "
                                       "torch.distributed process group (e.g. "
                                       f"torch.distributed.group.WORLD), got {process_group!r}")
        if trace is not None:
            self._check_trace(trace)
        if ring_size is not None:
            blocks_to_swap, rotating_slots = self._ring(blocks_to_swap, ring_size, rotating_slots)
            self.blocks_to_swap = blocks_to_swap
        # Options::check (C++) checks every option's range, once, for both languages.
        options = self._options(
            blocks_to_swap=0 if blocks_to_swap is None else blocks_to_swap,
            supports_backward=self.supports_backward,
            device=_device_name(device),
            reentrant_activation_checkpointing=self.reentrant_activation_checkpointing,
            debug=bool(debug), rotating_slots=rotating_slots,
            training_rotating_slots=training_rotating_slots,
            device_budget_bytes=device_budget_bytes, shared_device=shared_device,
            trace=_C.Trace() if trace is not None else None,
            emulated_link_gbps=emulated_link_gbps,
            emulated_capacity_bytes=emulated_capacity_bytes,
            gradient_accumulation_steps=gradient_accumulation_steps,
            max_grad_norm_per_parameter=max_grad_norm_per_parameter, step_on=step_on,
            clip_as_python=True, weights_file=_path(block_type, weights_file),
            weights_prefix=weights_prefix, weights_layout=weights_layout,
            weights_map=weights_map, weights_from_file=bool(weights_from_file),
            host_budget_bytes=host_budget_bytes, staging_buffers=staging_buffers,
            file_reads=file_reads, compress=_compress_name(block_type, compress))
        if optimizer is not None:
            options.set_optimizer(optimizer._kind, optimizer._hyper())
        self._recorder = options.trace
        if process_group is not None and optimizer is not None:
            # Options::check refuses node sharing with an optimizer, before any collective.
            options.share_node(lambda key, value: None, lambda key: "", 0, 1, "")
        if self.blocks:
            options.check(block_type, len(self.blocks))
        threshold = _integer(f"[{block_type}] ", "activation_threshold_bytes",
                             activation_threshold_bytes)
        if not isinstance(offload_activations, bool):
            raise InvalidArgumentError(f"[{block_type}] offload_activations must be True or "
                                       f"False, got {offload_activations!r}")
        if offload_activations and self.blocks:
            self._offload_activations(_device_name(device), threshold, shared_device)
        self._take_over(self.blocks)
        if not self.blocks or (options.blocks_to_swap == 0 and optimizer is None
                               and weights_file is None):
            return  # the seed does nothing either: the trainer's dummy, or no swapping
        if process_group is not None:
            options.share_node(*_distributed.node_sharing(process_group))
        for i, block in enumerate(self.blocks):
            if not isinstance(block, _torch.nn.Module):
                raise ValueError(f"[{block_type}] block {i} is a {type(block).__name__}, not a "
                                 "torch.nn.Module")
        replaced = []
        if weights_file is not None and weights_from_file is None:
            # Blocks built on the meta device get their frozen weights from the file.
            replaced = _block_tensors.materialize_meta(self.blocks, block_type)
            options.weights_from_file = bool(replaced)
        try:
            tensors = [_block_tensors.block_tensors(block, block_type, i)
                       for i, block in enumerate(self.blocks)]
            if optimizer is not None:
                if optimizer.offloader is not None:
                    raise ValueError(f"[{block_type}] this optimizer already belongs to the "
                                     f"offloader '{optimizer.offloader.block_type}'")
                self._check_optimizer_params(optimizer)
            self._impl = _C.Offloader(block_type, tensors, options)
        except BaseException:
            _block_tensors.put_back(replaced)  # all or nothing: the blocks as they were
            raise
        if optimizer is not None:
            optimizer._attach(self, {id(p): (i, name) for i, block in enumerate(self.blocks)
                                     for name, p in block.named_parameters() if p.requires_grad})
        self.blocks_to_swap = self._impl.blocks_to_swap()
        for context in self._activations or ():  # its Device counts the activations' copies
            context.counted_by = self._impl.device()
        _peft.manage(self, self.blocks)
        _module_casts.manage(self, self.blocks)
        self._packed = [self._split(block) for block in self.blocks]  # Note [the model as it runs]
        self._warned_trainable = False
        for i, block in enumerate(self.blocks):
            self._hooks.append(block._register_state_dict_hook(_hooks.StateDictHook(self, block, i)))
            if self._impl.compression()["on"]:  # Note [copies of compressed blocks]
                self._hooks += _hooks.FrozenState.install(self, block, i)
                self._hooks += _hooks.LoadStateHook.install(self, block, i)
            if hook_blocks:
                self._hooks.append(block.register_forward_pre_hook(
                    _hooks.WaitHook(self, block, i)))
            # With supports_backward=False too: a backward may still come (loads on demand).
            self._hooks.append(block.register_forward_hook(
                _hooks.OutputHook(self, block, i, submit=hook_blocks)))

    def _ring(self, blocks_to_swap, ring_size, rotating_slots):
        """musubi-tuner's LoRAStreamOffloader(..., ring_size=B): S = blocks_to_swap blocks stream
        through B more slots, N-S+B blocks of device memory. blockswap keeps the same memory
        with K = S-B blocks off the device and, in inference, R = B slots they rotate through
        (S loads a pass, as there; training loads 2(S-B) a step, there 2S-B). At least one block
        stays off the device: with B >= S that class still streams, and places every block at
        prepare, which the trainer relies on (musubi-tuner leaves the blocks on the host until
        then); with K = 0 blockswap would leave them where they are."""
        where = f"[{self.block_type}] "
        ring = _integer(where, "ring_size", ring_size, least=1)
        if rotating_slots:
            raise InvalidArgumentError(f"{where}ring_size (musubi-tuner's) and rotating_slots "
                                       "say the same thing: give one of them")
        if blocks_to_swap is None or isinstance(blocks_to_swap, bool):
            return blocks_to_swap, 0
        k = _integer(where, "blocks_to_swap", blocks_to_swap, least=-1)
        if k <= 0:  # none, or the planner's (-1): the ring says nothing then
            return k, 0
        k = min(max(1, k - ring), len(self.blocks) - 1)
        return k, min(ring, len(self.blocks) - k) if k > 0 else 0

    def _offload_activations(self, device, threshold, counted_by):
        """Hooks around each block's forward that offload what it saves (with K = 0 too);
        `counted_by`, a Device (shared_device; the engine's, once built), counts their copies."""
        store = _activations.store_for(device)
        self._activation_store = store
        self._activations = [_activations.BlockActivations(store, f"{self.block_type}.{i}",
                                                           block, threshold, counted_by)
                             for i, block in enumerate(self.blocks)]
        for i, block in enumerate(self.blocks):
            if not isinstance(block, _torch.nn.Module):
                raise ValueError(f"[{self.block_type}] block {i} is a {type(block).__name__}, "
                                 "not a torch.nn.Module")
            self._hooks.append(block.register_forward_pre_hook(
                _hooks.ActivationHook(self, block, i, enter=True)))
            self._hooks.append(block.register_forward_hook(
                _hooks.ActivationHook(self, block, i, enter=False), always_call=True))

    def offloading_activations(self, block_idx):
        """A context manager: what autograd saves inside it is offloaded as block
        ``block_idx``'s activations (``offload_activations=True``). The block's own call does
        this by itself; use it around code outside the block's call that saves for the block's
        backward, such as ``torch.utils.checkpoint`` wrapped around the block (diffusion-pipe)."""
        if self._activations is None:
            raise InvalidArgumentError(f"[{self.block_type}] offloading_activations() needs "
                                       "offload_activations=True")
        return self._activations[_operator.index(block_idx)]

    def _options(self, **fields):
        """An Options with each field set (python/src/module.cpp binds them by name). A value
        of the wrong type is an InvalidArgumentError naming the option; Options::check (C++)
        checks the ranges."""
        where = f"[{self.block_type}] "
        options = _C.Options()
        for name, value in fields.items():
            default = getattr(options, name)
            if name == "host_budget_bytes":
                value = None if value is None else _integer(where, name, value)
            elif name == "weights_map":
                if isinstance(value, dict):
                    value = dict(value).get  # a name it lacks: None, named by the C++ side
                elif value is not None and not callable(value):
                    raise InvalidArgumentError(f"{where}weights_map must be a dict or a callable "
                                               f"(the module's tensor name -> the file's), got "
                                               f"{value!r}")
            elif name in ("weights_file", "weights_prefix", "weights_layout", "file_reads",
                          "compress"):
                if not isinstance(value, str):
                    raise InvalidArgumentError(f"{where}{name} must be a str, got {value!r}")
            elif name == "shared_device":
                if value is not None and not isinstance(value, _C.Device):
                    raise InvalidArgumentError(f"{where}shared_device must be a blockswap.Device "
                                               f"(from blockswap.open_device), got {value!r}")
            elif isinstance(default, bool):
                value = bool(value)
            elif isinstance(default, int):
                value = _integer(where, name, value, least=-(2**63))
            elif isinstance(default, float):
                value = _real(where, name, value)
            try:
                setattr(options, name, value)
            except InvalidArgumentError as e:
                raise InvalidArgumentError(f"{where}{e}") from None
            except TypeError:
                # an unsigned field (bytes): a negative value, or one too large
                raise InvalidArgumentError(f"{where}{name} must be an int >= 0 that fits 64 "
                                           f"bits, got {value!r}") from None
        return options

    @staticmethod
    def _check_trace(trace):
        """The trace file must be writable: it is written at close(), after the whole run."""
        try:
            path = _os.fspath(trace)
        except TypeError:
            raise InvalidArgumentError(f"trace must be a file path, got {trace!r}") from None
        if isinstance(path, bytes):
            path = _os.fsdecode(path)
        parent = _os.path.dirname(_os.path.abspath(path)) if path else ""
        if not path or _os.path.isdir(path) or not _os.path.isdir(parent) or not _os.access(
                parent, _os.W_OK):
            raise InvalidArgumentError(f"trace={trace!r}: the trace file cannot be written there "
                                       "(a file path in a writable directory)")

    def exclude_from_ddp(self, model):
        """Makes ``DistributedDataParallel(model)`` leave the swapped frozen weights alone.

        DDP broadcasts every parameter of rank 0 when it is built; with ``process_group`` every
        rank already reads local rank 0's swapped weights, whose shared host copy may not be
        written (blockswap raises at the block's next move). Call before wrapping ``model``,
        the module given to DDP, which holds this offloader's blocks. Adds to any names DDP was
        told to ignore before."""
        _distributed.exclude_from_ddp(self, model)

    def _check_optimizer_params(self, optimizer):
        """The optimizer's parameters are exactly the blocks' parameters that require grad."""
        trainable = {id(p) for block in self.blocks for p in block.parameters() if p.requires_grad}
        given = {id(p) for p in optimizer.param_groups[0]["params"]}
        if given - trainable:
            raise ValueError(f"[{self.block_type}] the optimizer has {len(given - trainable)} "
                             "parameter(s) that are not trainable parameters of these blocks: "
                             "non-block parameters stay with the trainer's own optimizer")
        if trainable - given:
            raise ValueError(f"[{self.block_type}] {len(trainable - given)} trainable "
                             "parameter(s) of these blocks are not in the optimizer: give it "
                             "every block parameter that requires grad")

    # The seed's verbs.

    @_compat.compiler_disable
    def prepare_block_devices_before_forward(self, blocks=None):
        """Places the blocks for a pass: call before each forward pass (after a mode switch
        too). ``blocks``: musubi-tuner passes the block list again; it must be this
        offloader's."""
        if self._closed and self._impl is None and not self._rebuild:
            self._after_close("prepare_block_devices_before_forward()")
        if blocks is not None and self._impl is not None:
            self._check_same_blocks(blocks, "prepare_block_devices_before_forward")
        if self._impl is not None:
            self._adopt_model_changes("prepare_block_devices_before_forward()")
        if self._rebuild:
            self._build_again()
        self._prepare()

    def _prepare(self):
        if self._impl is not None:
            if self.optimizer is not None:  # a scheduler may have changed any of them
                self._impl.set_optimizer(self.optimizer._kind, self.optimizer._hyper())
            self._impl.prepare()
            self._submitted.clear()
            self._next_block = 0

    @_compat.compiler_disable
    def wait_for_block(self, block_idx):
        """Makes compute wait until block ``block_idx`` is on the device: call just before the
        block runs."""
        if self._closed and self._impl is None and not self._rebuild:
            self._after_close("wait_for_block()")
        if self._rebuild:
            self._build_again()
        if self._impl is not None:
            if block_idx == 0:  # a pass starts: the model as it is now (Note [the model as it runs])
                if self._adopt_model_changes("wait_for_block(0)"):
                    self._prepare()
                self._warn_if_nothing_swaps()
            else:
                # One parameter a block, cheaply: its first (0 <= i < N: the engine names others)
                packed = self._packed[block_idx] if 0 < block_idx < len(self.blocks) else None
                if packed and packed[0][0]._parameters.get(packed[0][1]) is not packed[0][2]:
                    raise _C.Error(
                        f"[{self.block_type}] block {block_idx}'s parameters were replaced by "
                        "other Parameter objects (load_state_dict(assign=True), or an "
                        "assignment) in the middle of a pass, after block 0 ran with the old "
                        "ones: replace them between passes (blockswap takes the new ones at the "
                        "next wait_for_block(0) or prepare_block_devices_before_forward())")
            self._impl.wait_for_block(block_idx)

    @_compat.compiler_disable
    def submit_move_blocks_forward(self, *args):
        """Starts the moves that follow block ``i``'s run: call just after it ran.
        ``submit_move_blocks_forward(i)``, or ``(blocks, i)`` as musubi-tuner calls it."""
        if self._closed and self._impl is None and not self._rebuild:
            self._after_close("submit_move_blocks_forward()")
        block_idx = args[-1]
        if self._rebuild:
            self._build_again()
        if self._impl is not None:
            if len(args) == 2 and 0 <= block_idx < len(self.blocks):  # musubi-tuner's (blocks, i)
                try:
                    given = args[0][block_idx]
                    same = getattr(given, "_orig_mod", given) is self.blocks[block_idx]
                except (IndexError, KeyError, TypeError):
                    same = False
                if not same:
                    self._check_same_blocks(args[0], "submit_move_blocks_forward")
            try:
                self._impl.submit(block_idx)
            except _C.Error as e:
                if block_idx not in self._submitted:
                    raise
                raise _C.Error(
                    f"[{self.block_type}] submit_move_blocks_forward({block_idx}) was called "
                    f"again after block {block_idx} had left the device: call it once each "
                    "time the block runs, after it ran, and prepare_block_devices_before_"
                    f"forward() before a pass that starts again from the first block ({e})"
                ) from None
            self._submitted.add(block_idx)

    @_compat.compiler_disable
    def disable_block_swap(self):
        """Stops swapping (the seed's eval switch): from the next prepare every block is placed
        on the device. Waits for the moves in flight."""
        self._swap_disabled = True
        if self._impl is not None:
            self._impl.synchronize()  # a mode switch waits for every move in flight
            self._impl.disable()

    @_compat.compiler_disable
    def enable_block_swap(self):
        """Swaps again from the next prepare. Waits for the moves in flight."""
        self._swap_disabled = False
        if self._impl is not None:
            self._impl.synchronize()
            self._impl.enable()

    @_compat.compiler_disable
    def set_forward_only(self, forward_only):
        """``True``: inference passes (the swapped blocks rotate through a few slots; no
        backward); ``False``: training passes. Waits for the moves in flight; call
        prepare_block_devices_before_forward() after it."""
        if forward_only is False and not self.supports_backward and self._impl is not None:
            raise ValueError(f"[{self.block_type}] set_forward_only(False) needs "
                             "supports_backward=True")
        self.forward_only = bool(forward_only)
        if self._impl is not None:
            self._impl.synchronize()
            self._impl.set_forward_only(self.forward_only)

    def _warn_if_nothing_swaps(self):
        """Trainable parameters stay on the device without an optimizer: a model left
        trainable (from_pretrained's default) when its blocks run swaps nothing. Once, at the
        first pass that runs so (a model frozen after the offloader was built swaps)."""
        if self._warned_trainable or self.optimizer is not None or self.blocks_to_swap <= 0:
            return
        self._warned_trainable = True
        frozen = trainable = 0
        for block in self.blocks:
            for p in block.parameters():
                if p.requires_grad:
                    trainable += p.numel() * p.element_size()
                else:  # (a wrapper subclass: about a byte an element, its inner data's)
                    frozen += p.numel() * (1 if _block_tensors.is_wrapper(p) else p.element_size())
        if trainable > 4 * frozen:  # not adapters beside their base: the base left trainable
            _warnings.warn(
                f"[{self.block_type}] {trainable} bytes of these blocks' parameters require "
                f"grad and stay on the device, against {frozen} bytes of frozen weights that "
                "swap: without an optimizer blockswap swaps frozen weights only. Freeze the base "
                "weights first (model.requires_grad_(False), then the adapters), or give a "
                "blockswap.FusedAdamW to train them all", stacklevel=4)

    def _after_close(self, verb):
        raise _C.Error(f"[{self.block_type}] {verb} after close(): this offloader no longer holds "
                       "its blocks (they are ordinary modules again); build a new ModelOffloader")

    def _check_same_blocks(self, blocks, verb):
        # musubi-tuner compiles its blocks after prepare (torch.compile(block) in the list): the
        # same blocks, each in an OptimizedModule
        blocks = list(blocks)
        self._refuse_fullgraph(blocks)
        given = [getattr(b, "_orig_mod", b) for b in blocks]
        if len(given) != len(self.blocks) or any(a is not b for a, b in zip(given, self.blocks)):
            raise InvalidArgumentError(f"[{self.block_type}] {verb}(blocks): these are not the "
                                       "blocks this offloader was built with")

    # Note [the model as it runs]
    # Trainers change the model under the offloader without telling it: musubi-tuner's
    # generate scripts build it while every weight still requires grad and freeze the model
    # afterwards; its Wan 2.2 training switches experts with load_state_dict(assign=True) on the
    # swapped blocks (other Parameter objects) and never calls prepare again. What is frozen
    # (swapped), trainable (resident) or replaced is therefore read from the model at each pass's
    # start, prepare_block_devices_before_forward() or wait_for_block(0): when it differs from
    # what was packed, the offloader is closed (every packed tensor keeps its values in host
    # memory, so a state_dict taken before still reads them) and built again over the model as
    # it is, and the pass goes on. Exact by construction; the cost is one packing of the blocks.
    # Where adopting cannot be exact it raises: inside a backward (a checkpoint's recompute),
    # with a fused optimizer (its state is in the old parameters' memory), or at another block
    # in the middle of a pass (wait_for_block checks one parameter per block for that).
    # A pass's check looks each parameter up where it is registered (a dict lookup), not through
    # module.parameters(), whose walk of the modules took about 20 times as long (a 40-block
    # diffusers Wan with LoRA, 45 parameters a block, this project's 2-core machine).
    # Parameters added to a block later (an adapter injected after the offloader was built) are
    # not seen; they are not packed either, so they stay where they are, which is exact.
    @staticmethod
    def _split(block):
        """(module, name, parameter, requires_grad) of each of a block's parameters: what
        packing read."""
        return [(owner, name, p, p.requires_grad) for owner in block.modules()
                for name, p in owner._parameters.items() if p is not None]

    def _model_changed(self):
        """The first block whose parameters are not what was packed, with what changed."""
        for i, packed in enumerate(self._packed):
            for owner, name, p, trainable in packed:
                now = owner._parameters.get(name)
                if now is not p:
                    return i, "replaced by other Parameter objects"
                if p.requires_grad != trainable:
                    return i, self._FLAGS
        return None

    _FLAGS = "made trainable or frozen (requires_grad)"

    def _adopt_model_changes(self, verb):
        """Builds the offloader again over the model as it is now, if it changed since packing
        (Note [the model as it runs]); True if it did."""
        self._refuse_fullgraph(self.blocks)
        _hooks.take_state_dict_writes(self)
        changed = self._model_changed()
        if changed is None:
            return False
        block, what = changed
        where = f"[{self.block_type}] block {block}'s parameters were {what} since they were packed"
        if self.optimizer is not None:
            raise InvalidArgumentError(
                f"{where}, while a fused optimizer steps them: close() the offloader and build "
                "a new one with an optimizer over the parameters as they are now")
        if _compat.in_backward():
            if what == self._FLAGS:
                # A checkpoint's recompute of a pass that ran with the old split: the weights'
                # values are the same, so the recompute runs as packed, and the next pass's
                # start outside the backward takes the new split.
                return False
            raise _C.Error(f"{where}, and {verb} runs inside a backward (a checkpoint's "
                           "recompute) of a pass that used the old ones: replace them between "
                           "a backward and the next forward")
        self.close()
        self._build_again()
        return True

    def _refuse_fullgraph(self, blocks):
        """Blocks compiled with fullgraph=True cannot run swapped: dynamo would stop at the
        first hook with a message that points the user the wrong way."""
        for i, block in enumerate(blocks):
            if _compat.compiled_fullgraph(block):
                raise InvalidArgumentError(
                    f"[{self.block_type}] block {i} is compiled with fullgraph=True "
                    "(torch.compile, Module.compile or diffusers' compile_repeated_blocks): "
                    "blockswap waits for each block's weights and brackets its outputs outside "
                    "the compiled graph, which fullgraph=True forbids. Compile the blocks with "
                    "fullgraph=False (the default): the graph breaks only around each block's "
                    "call, and swapping never makes a block recompile")

    def _take_over(self, blocks):
        """An offloader built over blocks that an older, live one holds takes them over: the
        old one is closed, with a warning (musubi-tuner's enable_block_swap(k) builds a new one
        over the same blocks while the old one still exists)."""
        older = {id(o): o for o in (_module_casts.holder(b) for b in blocks
                                    if isinstance(b, _torch.nn.Module))
                 if o is not None and o is not self}
        for old in older.values():
            _warnings.warn(
                f"[{self.block_type}] these blocks were swapped by another ModelOffloader "
                f"('{old.block_type}', still alive): it is closed and this one takes them over; "
                "the old one's verbs now raise", stacklevel=4)
            old.close()

    def _release_for_cast(self):
        """A cast reached this offloader's blocks (Note [casting a managed model])."""
        if self.optimizer is not None:
            raise InvalidArgumentError(
                f"[{self.block_type}] the model is being cast to another dtype while this "
                "offloader swaps its blocks with a fused optimizer, whose state is in the "
                "blocks' memory: close() the offloader, cast, and build a new one (with "
                "optimizer.state_dict() saved before and loaded after)")
        self.close()
        self._rebuild = True

    def _build_again(self):
        args, kwargs = self._arguments
        # The blocks hold their values now (a file's were read at the first build): what the
        # caller put in them since (load_state_dict(assign=True)) counts, never the file's over it.
        kwargs = dict(kwargs, weights_from_file=None)
        forward_only = self.forward_only
        disabled = getattr(self, "_swap_disabled", False)
        carried = self._carried
        try:
            self.__init__(*args, **kwargs)
        except BaseException:
            self._rebuild = True  # every verb tries again and raises, never a silent no-op
            self._arguments = (args, kwargs)
            raise
        finally:
            self._carried = carried
        if self.forward_only != forward_only:
            self.set_forward_only(forward_only)
        if disabled:
            self.disable_block_swap()

    # Extras.

    @property
    def _active(self):
        """Built and not closed (the fused optimizers ask)."""
        return self._impl is not None

    def _completed_steps(self):
        return self._impl.completed_steps()

    def _discard_accumulated_gradients(self):
        self._impl.discard_accumulated_gradients()

    def is_resident(self, block_idx):
        """Whether block ``block_idx``'s weights are on the device now."""
        if self._impl is None:
            return True
        return self._impl.is_resident(block_idx)

    def is_in_file(self, block_idx):
        """Whether block ``block_idx`` is read from ``weights_file`` for each load (the file
        tier, ``host_budget_bytes``)."""
        if self._impl is None:
            return False
        return self._impl.is_in_file(block_idx)

    def stats(self):
        """Bytes moved each way, moves, stall seconds, device bytes now and at most, bytes read
        from the file tier (``disk_bytes``), bytes staged from host memory the system would not
        pin (``staged_bytes``: a warning said so), the frozen bytes that crossed the link
        compressed (``compress="on"``: ``decoded_bytes`` as decoded, ``compressed_bytes`` as
        copied); and the host memory blockswap page-locks on
        this offloader's device, every offloader on it together (``Device.host_memory()``):
        ``pinned_host_bytes`` now and at most, the bytes those buffers hold
        (``kept_host_bytes``, ``peak_kept_host_bytes``), ``pageable_host_bytes``, and
        ``pinned_per_kept`` (the peaks' ratio: 1.0 is nothing wasted); ``device_bytes`` counts
        the decode buffer beside the slots; ``compression`` ("on" or "off") and
        ``compression_reason`` (what ``compress="auto"`` chose, and why)."""
        if self._impl is None:
            stats = {"h2d_bytes": 0, "d2h_bytes": 0, "moves": 0, "stall_seconds": 0.0,
                     "device_bytes": 0, "peak_device_bytes": 0, "disk_bytes": 0,
                     "staged_bytes": 0, "decoded_bytes": 0, "compressed_bytes": 0}
            host = {"pinned_host_bytes": 0, "peak_pinned_host_bytes": 0, "kept_host_bytes": 0,
                    "peak_kept_host_bytes": 0, "pageable_host_bytes": 0, "pinned_per_kept": 0.0}
        else:
            stats = self._impl.stats()
            host = self._impl.device().host_memory()
        # Counted on across a rebuild (Note [the model as it runs]) and after close().
        for name, value in self._carried.items():
            stats[name] = max(stats[name], value) if name.startswith("peak") else stats[name] + value
        stats.update(host)
        compression = self.compression()  # Note [automatic compression]: what auto chose, why
        stats["compression"] = "on" if compression["on"] else "off"
        stats["compression_reason"] = compression["reason"]
        if self._activations is not None:
            stats.update(self._activation_store.stats())
        return stats

    def compression(self):
        """With ``compress="on"``: the blocks whose frozen weights are stored compressed
        (``blocks``), those weights' bytes raw and compressed (``raw_bytes``,
        ``compressed_bytes``: the host memory saved is the difference), ``ratio`` (1.0 with
        none), the device bytes of the two decode buffers (``decode_buffer_bytes``), how many
        times a block was encoded again because its frozen weights changed
        (``encoded_again``: load_state_dict, a merge; the same values again are not encoded),
        whether compression is on (``on``: with ``compress="auto"``, what it chose) and why
        (``reason``)."""
        if self._impl is None:
            return {"blocks": 0, "raw_bytes": 0, "compressed_bytes": 0, "ratio": 1.0,
                    "decode_buffer_bytes": 0, "encoded_again": 0, "on": False,
                    "reason": "no engine (closed, or nothing to swap)"}
        return self._impl.compression()

    def reset_stats(self):
        """Sets the counters of stats() to zero (device_bytes stays, and peak_device_bytes
        starts again from it)."""
        self._carried = {}
        if self._impl is not None:
            self._impl.reset_stats()
        if self._activations is not None:
            self._activation_store.reset_stats()

    def optimizer_state(self, block_idx):
        """Block i's optimizer state by name (``"<parameter>.exp_avg"``, ...): tensors that
        read their true values and take what is copied into them, for checkpoints."""
        if self._impl is None:
            return {}
        return dict(self._impl.optimizer_state(block_idx))

    def optimizer_steps(self, block_idx):
        """How many steps each of block i's parameters took, by name."""
        if self._impl is None:
            return {}
        return dict(self._impl.optimizer_steps(block_idx))

    @property
    def step_on(self):
        """Where the fused steps run, ``"device"`` or ``"host"`` (``"auto"`` resolved)."""
        return "device" if self._impl is None else self._impl.step_on()

    @property
    def accumulated_backwards(self):
        """With ``gradient_accumulation_steps`` n: the backwards counted toward the next fused
        step, 0 right after the n-th (the optimizer's ``step()`` checks it)."""
        if self._impl is None:
            return 0
        self._impl.synchronize()  # a backward that raised part-way does not count
        return self._impl.accumulated_backwards()

    def set_optimizer_steps(self, block_idx, parameter, steps):
        """Restores the step count of block i's parameter (AdamW's bias correction)."""
        if self._impl is not None:
            self._impl.set_optimizer_steps(block_idx, parameter, int(steps))

    def synchronize(self):
        """Waits for every copy in flight."""
        if self._impl is not None:
            self._impl.synchronize()

    def close(self):
        """Waits for copies in flight, leaves every weight an ordinary host tensor with its
        values, removes the hooks and writes the trace. Safe to call twice."""
        if self._impl is not None:
            _hooks.take_state_dict_writes(self)
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self._activations = None
        if self.optimizer is not None and self.optimizer.offloader is self:
            self.optimizer._detach()
        impl, self._impl = self._impl, None
        self._closed = self._closed or impl is not None
        _peft.release(self)
        _module_casts.release(self)
        if impl is not None:
            self._carried = {name: value + self._carried.get(name, 0) if not name.startswith("peak")
                             else max(value, self._carried.get(name, 0))
                             for name, value in impl.stats().items() if name != "device_bytes"}
            impl.close()
            if self._trace is not None:
                self._recorder.write_chrome_json(_os.fspath(self._trace))

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            self.close()
        except Exception:
            if exc_type is None:
                raise  # the body's own error, when there is one, is the one to see
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:  # pragma: no cover - interpreter shutdown
            pass
