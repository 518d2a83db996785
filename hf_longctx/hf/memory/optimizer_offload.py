"""AdamW with its states in host memory (torchao's ``CPUOffloadOptimizer``), for one-GPU long-context runs.

Why: on one GPU the weights, gradients and AdamW states of an 8B model take most of an H100's memory,
which is what caps its context with ``memory: auto`` (measured: bench/results/2026-11-22_training-memory.md). torchao's
offload optimizer keeps a pinned host copy of every parameter and its gradient, runs AdamW on the CPU there (torch's,
or torchao's ``AdamW8bit`` / ``AdamW4bit`` whose block-quantized moments take a half or a quarter of the host
memory: :mod:`.adam_states`), and copies the updated parameters back; with ``offload_gradients`` each GPU gradient
is freed as soon as its copy has left, so neither the states nor the gradients stay on the GPU.

What it does not do on its own, and :class:`HostOffloadAdamW` adds, so a run with it is never silently
different from one without:

* **Gradient clipping.** The Trainer clips the GPU gradients after backward, but those are gone by
  then (and the host copies were taken before any clipping). Here the norm is accumulated on the GPU
  as each gradient arrives, and the clip is applied to the host gradients in :meth:`step`; the
  long-context callback moves the Trainer's ``max_grad_norm`` here and logs the norm.
* **Gradient accumulation** would overwrite the host gradient with each micro-batch's: a parameter
  whose gradient arrives twice between steps raises.
* **Several processes**: the copies are taken before DDP's all-reduce; refused. Use DeepSpeed's
  ``offload_optimizer`` there.

torchao's offload needs a CUDA (or XPU) device: on a CPU-only machine this module reports it as
unavailable (:func:`optimizer_offload_reason`) and the planner never chooses it.
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.distributed as dist

from .adam_states import adam_states_of_class, host_optimizer_of

MINIMAL_OFFLOAD_ELEMENTS = 4096
"""Parameters smaller than this stay with an on-GPU AdamW (torchao's default): many tiny copies cost more
than their states weigh."""


def optimizer_offload_reason(device: torch.device | str | None = None) -> str | None:
    """Why AdamW cannot keep its states on the host here, or None."""
    if importlib.util.find_spec("torchao") is None:
        return "torchao is not installed (pip install 'hf_longctx[offload]', or torchao)"
    on_gpu = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if not on_gpu:
        return "torchao's CPUOffloadOptimizer needs a CUDA device"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return ("the optimizer on the host serves one process (its gradient copies are taken before DDP's "
                "all-reduce); with several GPUs use DeepSpeed's zero_optimization.offload_optimizer")
    return None


def optimizer_offload_available(device: torch.device | str | None = None) -> bool:
    return optimizer_offload_reason(device) is None


def _offload_base():
    reason = optimizer_offload_reason()
    if reason is not None:
        raise RuntimeError(f"AdamW on the host requested but {reason}")
    from torchao.optim import CPUOffloadOptimizer

    return CPUOffloadOptimizer


def _flatten(params) -> list:
    """Parameter groups as torch optimizers take them: a list of dicts, each with a list of parameters."""
    groups = list(params)
    if not groups:
        raise ValueError("optimizer got an empty parameter list")
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    return [{**g, "params": list(g["params"])} for g in groups]


class HostOffloadAdamW(torch.optim.Optimizer):
    """AdamW whose states, and the gradients between backward and step, live in pinned host memory.

    Constructing it returns an instance of a subclass of torchao's ``CPUOffloadOptimizer`` (built on first
    use, so this module imports without torchao); being an ``Optimizer`` subclass itself, it is taken by
    ``Trainer(optimizer_cls_and_kwargs=(HostOffloadAdamW, {...}))`` as an optimizer class.
    ``max_grad_norm``: clip the global gradient norm in ``step`` (the callback sets it from
    ``TrainingArguments.max_grad_norm``). ``optimizer_class``: the AdamW that runs on the host, torch's or one of
    torchao's low-bit ones (anything else raises ValueError: the plan counts Adam's states). Extra ``kwargs`` go
    to it.
    """

    def __new__(cls, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                weight_decay: float = 0.01, max_grad_norm: float | None = None,
                optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, **kwargs):
        return _host_offload_class()(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                     max_grad_norm=max_grad_norm, optimizer_class=optimizer_class, **kwargs)


_CLASS = None


def _host_offload_class():
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    base = _offload_base()

    class _HostOffloadAdamW(base):
        """torchao's offload optimizer plus gradient clipping and a refusal of gradient accumulation."""

        is_host_offload = True

        def __init__(self, params, *, max_grad_norm: float | None = None,
                     optimizer_class: type[torch.optim.Optimizer] = torch.optim.AdamW, **adamw):
            states = adam_states_of_class(optimizer_class, adamw)
            if states is None:
                raise ValueError(f"the optimizer on the host runs AdamW (torch's, or torchao's AdamW8bit / AdamW4bit); "
                                 f"got {getattr(optimizer_class, '__name__', optimizer_class)!r}")
            self.adam_states = states
            groups = _flatten(params)
            self.max_grad_norm = max_grad_norm
            self.last_grad_norm: float | None = None
            self._arrivals: dict[torch.nn.Parameter, int] = {}
            self._sum_of_squares: torch.Tensor | None = None
            # registered before torchao's hooks, which free the GPU gradient once its copy is queued
            for group in groups:
                for p in group["params"]:
                    if p.requires_grad and p.numel() >= MINIMAL_OFFLOAD_ELEMENTS:
                        p.register_post_accumulate_grad_hook(self._arrived)
            super().__init__(groups, optimizer_class, offload_gradients=True,
                             minimal_size=MINIMAL_OFFLOAD_ELEMENTS, **adamw)

        def _arrived(self, p: torch.nn.Parameter) -> None:
            if p.grad is None:
                return
            self._arrivals[p] = self._arrivals.get(p, 0) + 1
            if self._arrivals[p] > 1:
                raise RuntimeError("a gradient arrived twice before the optimizer step: the optimizer on the host "
                                   "does not accumulate gradients over micro-batches; set "
                                   "gradient_accumulation_steps=1 (a longer sequence per step instead)")
            square = torch.linalg.vector_norm(p.grad, dtype=torch.float32).square()
            self._sum_of_squares = square if self._sum_of_squares is None else self._sum_of_squares + square

        @property
        def param_groups(self) -> list[dict]:
            """The groups the optimizers step with now. torchao's own list keeps the on-GPU optimizer's groups
            as first built, which ``load_state_dict`` replaces (accelerate round-trips the state when it
            prepares the optimizer): an LR scheduler then set the learning rate on groups nobody reads."""
            on_gpu = self.d_opt.param_groups if self.d_opt is not None else []
            return on_gpu + [g for optimizer in self.optim_dict.values() for g in optimizer.param_groups]

        def _on_gpu_grads(self) -> list[torch.Tensor]:
            groups = self.d_opt.param_groups if self.d_opt is not None else []
            return [p.grad for g in groups for p in g["params"] if p.grad is not None]

        @torch.no_grad()
        def step(self, closure=None):
            total = self._sum_of_squares
            for g in self._on_gpu_grads():
                square = torch.linalg.vector_norm(g, dtype=torch.float32).square()
                total = square if total is None else total + square
            self.last_grad_norm = math.sqrt(float(total)) if total is not None else 0.0
            if self.max_grad_norm and self.max_grad_norm > 0 and self.last_grad_norm > self.max_grad_norm:
                scale = self.max_grad_norm / (self.last_grad_norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s rule
                for event in self.queue.values():
                    event.synchronize()  # the host copies have landed
                for p_device in self.queue:
                    self.param_d2h_map[p_device].grad.mul_(scale)
                for g in self._on_gpu_grads():
                    g.mul_(scale)
            self._arrivals.clear()
            self._sum_of_squares = None
            return super().step(closure)

    _CLASS = _HostOffloadAdamW
    return _CLASS


def check_optimizer_place(plan, optimizer) -> None:
    """Refuse a run whose optimizer is on the GPU when its memory plan needs AdamW on the host."""
    if optimizer is None or not plan.optimizer_on_host or host_optimizer_of(optimizer) is not None:
        return
    from ..settings.schema import ConfigError

    raise ConfigError("memory: auto keeps AdamW on the host (the run does not fit with its states on the GPU), but "
                      "the Trainer's optimizer is on the GPU: build the Trainer with optimizer_cls_and_kwargs="
                      "hf_longctx.hf.trainer_optimizer_cls_and_kwargs(args) (scripts/train.py "
                      "does), or train a shorter context per GPU")


def trainer_optimizer_cls_and_kwargs(args) -> tuple:
    """``Trainer(optimizer_cls_and_kwargs=...)`` for :class:`HostOffloadAdamW` running the optimizer ``args`` names,
    as transformers resolves ``optim`` and ``optim_args`` (torch's AdamW, fused or not; torchao's 8- or 4-bit one).

    Raises ConfigError for any other ``optim``: the host runs AdamW, and the run would silently train with another
    optimizer than the one asked for.
    """
    from transformers import Trainer

    optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    if adam_states_of_class(optimizer_class, kwargs) is None:
        from ..settings.schema import ConfigError

        optim = str(getattr(args.optim, "value", args.optim))  # an OptimizerNames member or a string
        raise ConfigError(f"memory: auto keeps the optimizer on the host, which runs AdamW, but optim={optim!r} "
                          f"({optimizer_class.__name__}) is not AdamW: set optim to adamw_torch_fused, adamw_torch, "
                          "adamw_torch_8bit or adamw_torch_4bit, or train a shorter context per GPU")
    return HostOffloadAdamW, {"weight_decay": args.weight_decay, **kwargs, "optimizer_class": optimizer_class}
