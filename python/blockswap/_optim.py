"""blockswap's fused optimizers: torch.optim.Optimizer subclasses whose steps run inside
backward, per parameter, in the ModelOffloader they are given to, bitwise as torch.optim's
(src/torch/fused_optimizers.cpp); checkpoints in torch.optim's own state format."""

import weakref as _weakref

import torch as _torch

from . import _compat

_C = _compat.load_extension()
Error = _C.Error


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
        if offloader is None or not offloader._active:
            return
        offloader.synchronize()  # host steps of a backward that raised part-way finish
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
        if offloader is None or not offloader._active or not self.state:
            return
        offloader.synchronize()  # host steps of a backward that raised land first
        with _torch.no_grad():
            for p, state in self.state.items():
                block, name = self._where[id(p)]
                steps, tensors = self._from_torch(state)
                targets = offloader.optimizer_state(block)
                for n, value in tensors.items():
                    targets[f"{name}.{n}"].copy_(value)
                offloader.set_optimizer_steps(block, name, steps)
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
        if offloader is not None and offloader._active:
            counted = offloader.accumulated_backwards
            done = offloader._completed_steps()
            ran, self._steps_seen = done - self._steps_seen, done
            if ran > 1:
                raise Error(f"[{offloader.block_type}] the fused step ran {ran} times since the "
                            "last step(): each backward call counts as a micro-batch "
                            "(gradient_accumulation_steps="
                            f"{offloader.gradient_accumulation_steps}), so "
                            "two backward calls per micro-batch step twice. Sum the losses "
                            "into one backward, or count both in gradient_accumulation_steps")
            if counted != 0:
                n = offloader.gradient_accumulation_steps
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
            offloader._discard_accumulated_gradients()
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
