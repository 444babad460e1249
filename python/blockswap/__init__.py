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

import functools as _functools
import os as _os
import weakref as _weakref

import torch as _torch

from . import _compat

_compat.check_torch()
_C = _compat.load_extension()

__all__ = ["ModelOffloader", "Device", "open_device", "Error", "OutOfMemoryError", "FusedSGD",
           "FusedAdamW", "node_memory_use"]

Error = _C.Error
OutOfMemoryError = _C.OutOfMemoryError
Device = _C.Device


def _compiler_disable(fn):
    """Excludes fn from torch.compile tracing. torch.compiler.disable's wrapper costs about a
    microsecond on every eager call (most of the verbs' host time per block, measured by
    bench/python/verb_overhead.py), so the disabled function is called only while dynamo
    traces: it then evaluates is_compiling() to True and breaks the graph at that call."""
    compiler = getattr(_torch, "compiler", None)
    disabled = compiler.disable(fn)
    is_compiling = compiler.is_dynamo_compiling

    @_functools.wraps(fn)
    def call(*args, **kwargs):
        if is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


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


class _FusedOptimizer(_torch.optim.Optimizer):
    """A torch.optim.Optimizer whose steps run inside backward, in the offloader it is given to
    (``ModelOffloader(..., optimizer=...)``): full fine-tuning of swapped blocks. ``step()`` and
    ``zero_grad()`` have nothing to do (the blocks' parameters never keep a ``.grad``); the
    learning rate in ``param_groups[0]['lr']`` (a scheduler changes it) is read as each forward
    starts. ``params`` are the blocks' parameters that train, every one of them."""

    _kind = ""

    def __init__(self, params, defaults):
        self._owner = None   # the ModelOffloader, weakly
        self._where = {}     # id(parameter) -> (block index, name in the block)
        self._steps_seen = 0  # the offloader's completed steps at the last step()
        self._closed = False  # its offloader was closed
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        """torch.optim's, for the one group of the blocks' parameters: a second group raises
        ``ValueError`` (its parameters would never step)."""
        if self.param_groups:
            raise ValueError(f"{type(self).__name__} takes one parameter group, the blocks' "
                             "parameters that train (given when it is built); optimize other "
                             "parameters with a torch.optim optimizer of their own")
        super().add_param_group(param_group)

    # torch.optim options whose steps the fused ones do not compute
    _unsupported = ("maximize", "amsgrad")

    def _check_groups(self, groups):
        if len(groups) != 1:
            raise ValueError(f"{type(self).__name__} takes one parameter group, got "
                             f"{len(groups)}")
        for key in self._unsupported:
            if groups[0].get(key):
                raise ValueError(f"{type(self).__name__} does not compute {key}=True steps "
                                 f"(a torch.optim option); set {key}=False in the parameter "
                                 "group, or step these parameters with torch.optim")

    @property
    def offloader(self):
        """The ModelOffloader this optimizer steps in, or None."""
        return self._owner() if self._owner is not None else None

    def _hyper(self):
        self._check_groups(self.param_groups)
        group = self.param_groups[0]
        self._check(group)
        return {k: float(v) for k, v in self._flat(group).items()}

    def _attach(self, offloader, where):
        self._steps_seen = 0
        self._closed = False
        self._owner = _weakref.ref(offloader)
        self._where = where
        self._push_state()

    def _detach(self):
        self._pull_state()  # the trained state stays readable after close()
        self._owner = None
        self._closed = True

    # Checkpoints in torch.optim's format: the state lives in the blocks' memory, and is
    # gathered here for state_dict() and scattered back by load_state_dict().

    def _state_names(self):
        raise NotImplementedError

    def _pull_state(self):
        offloader = self.offloader
        if offloader is None or offloader._impl is None:
            return
        offloader._impl.synchronize()  # host steps of a backward that raised part-way finish
        self.state.clear()
        by_block = {}
        for p in self.param_groups[0]["params"]:
            block, name = self._where[id(p)]
            if block not in by_block:
                by_block[block] = (offloader.optimizer_state(block),
                                   offloader.optimizer_steps(block))
            tensors, steps = by_block[block]
            if steps[name] == 0:
                continue  # never stepped: torch.optim has no state for it either
            self.state[p] = self._to_torch(steps[name],
                                           {n: tensors[f"{name}.{n}"].detach().clone()
                                            for n in self._state_names()})

    def _push_state(self):
        offloader = self.offloader
        if offloader is None or offloader._impl is None or not self.state:
            return
        offloader._impl.synchronize()  # host steps of a backward that raised land first
        with _torch.no_grad():
            for p, state in self.state.items():
                block, name = self._where[id(p)]
                steps, tensors = self._from_torch(state)
                targets = offloader.optimizer_state(block)
                for n, value in tensors.items():
                    targets[f"{name}.{n}"].copy_(value)
                offloader._impl.set_optimizer_steps(block, name, steps)
        self.state.clear()

    def state_dict(self):
        self._pull_state()
        try:
            return super().state_dict()
        finally:
            if self.offloader is not None:
                self.state.clear()

    def load_state_dict(self, state_dict):
        self._check_groups(state_dict["param_groups"])  # before anything changes
        super().load_state_dict(state_dict)
        self._push_state()

    @_torch.no_grad()
    def step(self, closure=None):
        """The steps ran during backward; this evaluates ``closure`` when given, and with
        ``gradient_accumulation_steps`` n checks that the step ran: raises ``blockswap.Error``
        when fewer than n backwards came since the last one (a micro-batch without backward
        would move every later step)."""
        loss = None
        if closure is not None:
            with _torch.enable_grad():
                loss = closure()
        offloader = self.offloader
        if offloader is None and self._closed and any(
                p.grad is not None for p in self.param_groups[0]["params"]):
            raise Error(f"{type(self).__name__}.step(): the offloader it stepped in was closed, "
                        "so nothing steps these parameters any more (their .grad is left "
                        "untouched); train with an open offloader, or with a torch.optim "
                        "optimizer")
        if offloader is not None and offloader._impl is not None:
            counted = offloader.accumulated_backwards
            done = offloader._impl.completed_steps()
            ran, self._steps_seen = done - self._steps_seen, done
            if ran > 1:
                raise Error(f"[{offloader.block_type}] the fused step ran {ran} times since the "
                            "last step(): each backward call counts as a micro-batch "
                            f"(gradient_accumulation_steps={offloader._accumulation}), so "
                            "two backward calls per micro-batch step twice. Sum the losses "
                            "into one backward, or count both in gradient_accumulation_steps")
            if counted != 0:
                n = offloader._accumulation
                raise Error(f"[{offloader.block_type}] step() came after {counted} of the "
                            f"{n} backwards of gradient_accumulation_steps={n}: the fused step "
                            f"runs inside every n-th backward, so a micro-batch without a "
                            "backward (or whose backward reached none of the blocks) would "
                            "step the blocks at other times than torch.optim does. Call "
                            "backward for every micro-batch and step() after every n-th")
        return loss

    def zero_grad(self, set_to_none=True):
        """The fused step leaves no ``.grad`` on the blocks' parameters; in the middle of an
        accumulation, the gradients summed so far are dropped, as torch.optim's zero_grad
        drops them from ``.grad``."""
        offloader = self.offloader
        if offloader is not None and offloader.accumulated_backwards != 0:
            offloader._impl.discard_accumulated_gradients()
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None


class FusedSGD(_FusedOptimizer):
    """SGD as ``torch.optim.SGD`` computes it (momentum, dampening, weight_decay, nesterov),
    run per parameter inside backward by the offloader it is given to. ``foreach`` and
    ``fused`` are torch.optim's: the step is bitwise that implementation's (None: torch.optim's
    default for the device, foreach on CUDA, the for-loop on the CPU)."""

    _kind = "sgd"

    def __init__(self, params, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, *, foreach=None, fused=None):
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening,
                        weight_decay=weight_decay, nesterov=nesterov, foreach=foreach,
                        fused=fused)
        self._check(defaults)
        super().__init__(params, defaults)

    @staticmethod
    def _check(group):
        for key in ("lr", "momentum", "dampening", "weight_decay"):
            if not group[key] >= 0:
                raise ValueError(f"FusedSGD: invalid {key} {group[key]}: it must be >= 0")
        if group["nesterov"] and (group["momentum"] <= 0 or group["dampening"] != 0):
            raise ValueError("FusedSGD: Nesterov momentum requires a momentum and zero dampening")
        _compat.optimizer_kernel(group.get("foreach"), group.get("fused"))

    @staticmethod
    def _flat(group):
        flat = {k: group[k] for k in ("lr", "momentum", "dampening", "weight_decay", "nesterov")}
        return dict(flat, kernel=_compat.optimizer_kernel(group.get("foreach"), group.get("fused")))

    def _state_names(self):
        return ["momentum_buffer"] if self.param_groups[0]["momentum"] != 0 else []

    @staticmethod
    def _to_torch(steps, tensors):
        return {"momentum_buffer": tensors.get("momentum_buffer")}

    @staticmethod
    def _from_torch(state):
        buffer = state.get("momentum_buffer")
        # the fused SGD starts its buffer on a parameter's first step, as torch.optim does
        return (1, {"momentum_buffer": buffer}) if buffer is not None else (0, {})


class FusedAdamW(_FusedOptimizer):
    """AdamW as ``torch.optim.AdamW`` computes it (decoupled weight decay, bias correction, a
    step count per parameter), run per parameter inside backward by the offloader it is given
    to. ``foreach`` and ``fused`` are torch.optim's: the step is bitwise that implementation's
    (None: torch.optim's default for the device, foreach on CUDA, the for-loop on the CPU)."""

    _kind = "adamw"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, *,
                 foreach=None, fused=None):
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        foreach=foreach, fused=fused)
        self._check(defaults)
        super().__init__(params, defaults)

    @staticmethod
    def _check(group):
        for key in ("lr", "eps", "weight_decay"):
            if not group[key] >= 0:
                raise ValueError(f"FusedAdamW: invalid {key} {group[key]}: it must be >= 0")
        for i, beta in enumerate(group["betas"]):
            if not 0.0 <= beta < 1.0:
                raise ValueError(f"FusedAdamW: invalid beta parameter at index {i}: {beta} "
                                 "(it must be in [0, 1))")
        _compat.optimizer_kernel(group.get("foreach"), group.get("fused"))

    @staticmethod
    def _flat(group):
        return dict(lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    kernel=_compat.optimizer_kernel(group.get("foreach"), group.get("fused")))

    def _state_names(self):
        return ["exp_avg", "exp_avg_sq"]

    @staticmethod
    def _to_torch(steps, tensors):
        return {"step": _torch.tensor(float(steps)), **tensors}

    @staticmethod
    def _from_torch(state):
        return int(float(state["step"])), {"exp_avg": state["exp_avg"],
                                            "exp_avg_sq": state["exp_avg_sq"]}


def _node_sharing(process_group):
    """The job's store, and this rank's place among its node's ranks (Options::node_sharing)."""
    import socket
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("process_group needs torch.distributed initialized "
                         "(torch.distributed.init_process_group) first")
    ranks = [None] * dist.get_world_size(process_group)
    dist.all_gather_object(ranks, (socket.gethostname(), dist.get_rank()), group=process_group)
    hosts = [host for host, _ in ranks]
    me = dist.get_rank(process_group)
    local_rank = sum(1 for r in range(me) if hosts[r] == hosts[me])
    local_world_size = sum(1 for h in hosts if h == hosts[me])
    store = dist.distributed_c10d._get_default_store()
    # A subgroup meets through the default group's store too: its keys name it.
    group = ""
    if len(ranks) != dist.get_world_size():
        import hashlib
        group = hashlib.sha1(repr(sorted(r for _, r in ranks)).encode()).hexdigest()[:16]

    def node_set(key, value):
        store.set(key, value)

    def node_get(key):
        return store.get(key).decode()

    return node_set, node_get, local_rank, local_world_size, group


def node_memory_use():
    """The node-shared host memory this process maps (process_group), from /proc/self/smaps:
    a dict of ``private_bytes`` (pages only this process maps), ``shared_bytes`` (pages other
    processes map too) and ``proportional_bytes`` (this process's share of all of them)."""
    return _C.node_memory_use()


class ModelOffloader:
    """The seed's ModelOffloader, positional arguments as the seed's, on blockswap's engine.

    Keyword-only extras: ``rotating_slots`` (inference: slots the swapped blocks rotate
    through), ``device_budget_bytes`` (with ``blocks_to_swap=-1`` the planner chooses K),
    ``shared_device`` (from ``open_device``: one device for several offloaders), ``trace`` (a
    Chrome trace file written at ``close()``), ``emulated_link_gbps`` and
    ``emulated_capacity_bytes`` (the emulated device, ``device='cpu'``).

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

    With no blocks, or ``blocks_to_swap=0`` and no optimizer, it does nothing, like the seed:
    it allocates nothing, registers nothing and every verb returns at once.
    """

    def __init__(self, block_type, blocks, num_blocks, blocks_to_swap, supports_backward,
                 device, reentrant_activation_checkpointing, debug=False, *,
                 rotating_slots=0, device_budget_bytes=0, shared_device=None, trace=None,
                 emulated_link_gbps=0.0, emulated_capacity_bytes=0, optimizer=None,
                 gradient_accumulation_steps=1, max_grad_norm_per_parameter=0.0,
                 step_on="auto", process_group=None):
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
        self.optimizer = optimizer
        self._accumulation = gradient_accumulation_steps
        if num_blocks != len(self.blocks):
            raise ValueError(f"[{block_type}] num_blocks={num_blocks} but {len(self.blocks)} "
                             "blocks were given")
        if optimizer is not None and not isinstance(optimizer, _FusedOptimizer):
            raise ValueError(f"[{block_type}] optimizer must be a blockswap.FusedSGD or "
                             f"FusedAdamW, not a {type(optimizer).__name__}: a torch.optim "
                             "optimizer cannot step parameters that swap")
        if (not isinstance(gradient_accumulation_steps, int)
                or isinstance(gradient_accumulation_steps, bool)
                or gradient_accumulation_steps < 1):
            raise ValueError(f"[{block_type}] gradient_accumulation_steps must be an int >= 1, "
                             f"got {gradient_accumulation_steps!r}")
        if not max_grad_norm_per_parameter >= 0:
            raise ValueError(f"[{block_type}] max_grad_norm_per_parameter must be >= 0 (0: no "
                             f"clipping), got {max_grad_norm_per_parameter!r}")
        if step_on not in ("auto", "device", "host"):
            raise ValueError(f"[{block_type}] step_on must be 'auto', 'device' or 'host', got "
                             f"{step_on!r}")
        if optimizer is None and (gradient_accumulation_steps != 1
                                  or max_grad_norm_per_parameter):
            raise ValueError(f"[{block_type}] gradient_accumulation_steps and "
                             "max_grad_norm_per_parameter are for the fused step: pass "
                             "optimizer= too")
        if process_group is not None and optimizer is not None:
            raise ValueError(f"[{block_type}] process_group shares the blocks' host copy with "
                             "the node's other ranks read-only, so nothing may train in it: "
                             "with process_group, train adapters (LoRA) and leave optimizer "
                             "unset")
        if not self.blocks or (blocks_to_swap in (0, None) and optimizer is None):
            return  # the seed does nothing either: the trainer's dummy, or no swapping
        if blocks_to_swap is None:
            blocks_to_swap = 0
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
        if optimizer is not None:
            if optimizer.offloader is not None:
                raise ValueError(f"[{block_type}] this optimizer already belongs to the "
                                 f"offloader '{optimizer.offloader.block_type}'")
            self._check_optimizer_params(optimizer)
        node = (None, None, 0, 1, "") if process_group is None else _node_sharing(process_group)
        self._impl = _C.Offloader(
            block_type, tensors, blocks_to_swap, self.supports_backward,
            _device_name(device) if shared_device is None else "cpu",
            self.reentrant_activation_checkpointing, bool(debug), int(rotating_slots),
            int(device_budget_bytes), shared_device, trace is not None,
            float(emulated_link_gbps), int(emulated_capacity_bytes),
            optimizer._kind if optimizer is not None else "",
            optimizer._hyper() if optimizer is not None else {},
            int(gradient_accumulation_steps), float(max_grad_norm_per_parameter), str(step_on),
            *node)
        if optimizer is not None:
            optimizer._attach(self, {id(p): (i, name) for i, block in enumerate(self.blocks)
                                     for name, p in block.named_parameters() if p.requires_grad})
        self.blocks_to_swap = self._impl.blocks_to_swap()
        if self.supports_backward:
            for i, block in enumerate(self.blocks):
                self._hooks.append(block.register_forward_hook(self._forward_hook(i)))

    def exclude_from_ddp(self, model):
        """Makes ``DistributedDataParallel(model)`` leave the swapped frozen weights alone.

        DDP broadcasts every parameter of rank 0 when it is built; with ``process_group`` every
        rank already reads local rank 0's swapped weights, whose shared host copy may not be
        written (blockswap raises at the block's next move). Call before wrapping ``model``,
        the module given to DDP, which holds this offloader's blocks. Adds to any names DDP was
        told to ignore before."""
        frozen = {id(p) for block in self.blocks for p in block.parameters()
                  if not p.requires_grad}
        names = [name for name, p in model.named_parameters() if id(p) in frozen]
        if len(names) != len(frozen):
            raise ValueError(f"[{self.block_type}] {len(frozen) - len(names)} swapped weight(s) "
                             "are not parameters of the model given: pass the module you wrap "
                             "in DistributedDataParallel")
        ignored = list(getattr(model, "_ddp_params_and_buffers_to_ignore", []))
        _torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, ignored + [n for n in names if n not in ignored])

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

    def _forward_hook(self, index):
        # A block's outputs, bracketed in autograd: before the block's backward runs, its
        # weights are brought back where its forward's saved tensors point.
        def hook(module, inputs, output):
            if self._impl is None:
                return None
            if not _torch.is_grad_enabled():
                # No backward can reach this block's outputs: its submit may be outside no_grad.
                self._impl.bracket_outputs(index, [])
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
            if self.optimizer is not None:  # a scheduler may have changed any of them
                self._impl.set_optimizer(self.optimizer._kind, self.optimizer._hyper())
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
        if self._impl is not None:
            self._impl.synchronize()

    def close(self):
        """Waits for copies in flight, leaves every weight an ordinary host tensor with its
        values, removes the hooks and writes the trace. Safe to call twice."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        if self.optimizer is not None and self.optimizer.offloader is self:
            self.optimizer._detach()
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
