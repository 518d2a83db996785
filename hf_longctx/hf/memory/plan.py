"""The memory plan: the memory options chosen for a run, what the model predicts for them, and how to switch them on.

A :class:`MemoryPlan` is what :func:`~.search.plan_memory` returns: per decoder layer its checkpointing and
whether its checkpoint waits on the host, the tiled loss's and tiled MLP's chunks, where AdamW lives, and the
predicted GPU and host peaks; ``str(plan)`` prints it as one short table, :meth:`MemoryPlan.apply` switches the
options on (through :func:`~.enable.enable_memory_options`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..settings.schema import GROUP_MODE, group_heads
from .adam_states import AdamStates
from .kernel_buffers import CALIBRATION_KERNEL
from .model import GiB, LayerChoice, ModelShape, format_gib

if TYPE_CHECKING:
    import torch


@dataclass
class MemoryPlan:
    """The chosen memory options and what the model predicts for them; ``str(plan)`` is a short table."""

    shape: ModelShape
    tokens_per_gpu: int
    sp_size: int
    layers: tuple[LayerChoice, ...]
    tiled_loss: int
    tiled_mlp: int
    optimizer_on_host: bool
    gpu_peak: int
    gpu_phase: str
    gpu_items: dict[str, int]
    gpu_usable: int
    gpu_total: int
    host_peak: int
    host_items: dict[str, int]
    host_total: int
    step_factor: float  # estimated step time / that of no checkpointing and no tiling
    fused_ops: bool = False  # Liger's RMSNorm, RoPE and (untiled) SwiGLU (.fused_ops)
    kernel: str = CALIBRATION_KERNEL  # the attention kernel whose buffers the plan counts (.kernel_buffers)
    adam_states: AdamStates = field(default_factory=AdamStates)  # how AdamW keeps its moments (.adam_states)
    layer_gpu: list[int] = field(default_factory=list)  # per layer, bytes kept on the GPU between the passes
    layer_host: list[int] = field(default_factory=list)  # per layer, pinned host bytes
    # per layer, predicted GPU bytes while it runs forward / backward (what layer_peaks.LayerPeakProbe measures)
    layer_forward_peak: list[int] = field(default_factory=list)
    layer_backward_peak: list[int] = field(default_factory=list)

    @property
    def checkpointing(self) -> str:
        """The most common checkpointing mode among the checkpointed layers ("none" if none is; a group is layer
        checkpointing)."""
        modes = ["layer" if c.checkpointing == GROUP_MODE else c.checkpointing for c in self.layers
                 if c.checkpointing != "none"]
        return max(set(modes), key=modes.count) if modes else "none"

    @property
    def offloaded_layers(self) -> int:
        return sum(c.offload for c in self.layers)

    @property
    def checkpointed_layers(self) -> int:
        return sum(c.checkpointing != "none" for c in self.layers)

    def memory_options(self) -> dict:
        """Keyword arguments of :func:`~.enable.enable_memory_options` for this plan."""
        return {"checkpointing": self.checkpointing, "offload": self.offloaded_layers > 0,
                "tiled_loss": self.tiled_loss, "tiled_mlp": self.tiled_mlp, "layers": list(self.layers)}

    def apply(self, model):
        """Switch this plan's options on (returns :class:`~.enable.MemoryOptions`).

        The optimizer is the caller's: :meth:`make_optimizer` builds the one this plan assumes (the Trainer
        takes :func:`~.optimizer_offload.trainer_optimizer_cls_and_kwargs` when
        ``optimizer_on_host``; the callback refuses a Trainer whose optimizer is not it).
        """
        from .enable import enable_memory_options

        if self.fused_ops:
            from .fused_ops import enable_fused_ops, uses_fused_norms

            if not uses_fused_norms(model):  # the Trainer's use_liger_kernel may have done it already
                enable_fused_ops(model, swiglu=not self.tiled_mlp)
        return enable_memory_options(model, **self.memory_options())

    def make_optimizer(self, params, lr: float, **adamw) -> torch.optim.Optimizer:
        """AdamW where this plan keeps it, with the states it counts: on the host (torchao's offload optimizer) or
        on the GPU (torch's fused AdamW, or torchao's low-bit one)."""
        import torch

        states = self.adam_states
        if self.optimizer_on_host:
            from .optimizer_offload import HostOffloadAdamW

            return HostOffloadAdamW(params, lr=lr, optimizer_class=states.optimizer_class(),
                                    **states.optimizer_kwargs(), **adamw)
        if states.low_bit:
            return states.optimizer_class()(params, lr=lr, **states.optimizer_kwargs(), **adamw)
        return torch.optim.AdamW(params, lr=lr, fused=torch.cuda.is_available(), **adamw)

    def checkpoint_runs(self) -> list[tuple[int, int, LayerChoice, int]]:
        """Runs of consecutive checkpoints made alike: (first layer, last layer, choice, layers per checkpoint); a
        run of groups is one run, not alternating ``layer`` and ``group`` layers."""
        heads = group_heads([c.checkpointing for c in self.layers])
        units: list[list] = []  # [first, last, choice, size] per checkpoint (or per layer without one)
        for i, c in enumerate(self.layers):
            if heads[i] != i:
                units[-1][1], units[-1][3] = i, units[-1][3] + 1
            else:
                units.append([i, i, c, 1])
        runs: list[tuple[int, int, LayerChoice, int]] = []
        for first, last, c, size in units:
            if runs and runs[-1][2:] == (c, size):
                runs[-1] = (runs[-1][0], last, c, size)
            else:
                runs.append((first, last, c, size))
        return runs

    def summary(self) -> dict:
        """The plan in a few JSON-friendly keys (for logs)."""
        return {"memory": "auto", "checkpointed_layers": self.checkpointed_layers,
                "offloaded_layers": self.offloaded_layers, "checkpointing": self.checkpointing,
                "tiled_loss": self.tiled_loss, "tiled_mlp": self.tiled_mlp,
                "optimizer_on_host": self.optimizer_on_host, "optimizer_state_bits": self.adam_states.bits,
                "fused_ops": self.fused_ops, "kernel": self.kernel,
                "predicted_gpu_gib": round(self.gpu_peak / GiB, 1),
                "predicted_host_gib": round(self.host_peak / GiB, 1), "step_factor": round(self.step_factor, 3)}

    def __str__(self) -> str:
        s = self.shape
        head = (f"memory plan: {s.layers} layers (hidden {s.hidden}), {self.tokens_per_gpu} tokens/GPU, "
                f"sp {self.sp_size}; GPU {format_gib(self.gpu_peak)} of {format_gib(self.gpu_usable)} GiB usable "
                f"(peak: {self.gpu_phase}), "
                f"host {format_gib(self.host_peak)} of {format_gib(self.host_total)} GiB; "
                f"step ~x{self.step_factor:.2f} of no checkpointing")
        rows = [f"  {'layers':<8}{'checkpointing':<21}{'kept on':<9}{'GPU GiB':>9}{'host GiB':>10}"]
        for first, last, c, size in self.checkpoint_runs():
            span = f"{first}" if first == last else f"{first}-{last}"
            mode = c.checkpointing if size == 1 else f"{c.checkpointing}, groups of {size}"
            where = "-" if c.checkpointing == "none" else ("host" if c.offload else "GPU")
            rows.append(f"  {span:<8}{mode:<21}{where:<9}{format_gib(sum(self.layer_gpu[first:last + 1])):>9}"
                        f"{format_gib(sum(self.layer_host[first:last + 1])):>10}")
        other = ", ".join(f"{k} {format_gib(v)}" for k, v in self.gpu_items.items()
                          if k not in ("checkpoints", "activations") and v)
        host = ", ".join(f"{k} {format_gib(v)}" for k, v in self.host_items.items() if v)
        rows.append(f"  at the peak: {other} GiB; host: " + (f"{host} GiB" if host else "nothing planned"))
        opt = ("host" if self.optimizer_on_host else "GPU") + (
            f" ({self.adam_states.bits}-bit states)" if self.adam_states.low_bit else "")
        fused = "Liger RMSNorm/RoPE" + ("" if self.tiled_mlp else "/SwiGLU") if self.fused_ops else "off"
        rows.append(f"  tiled loss {self.tiled_loss or 'off'}, tiled MLP {self.tiled_mlp or 'off'}, "
                    f"optimizer on {opt}, fused ops {fused}, kernel {self.kernel}")
        return "\n".join([head, *rows])

