"""How AdamW keeps its two moments: in the parameters' dtype (torch's AdamW) or block-quantized (torchao's).

torchao's ``AdamW8bit`` and ``AdamW4bit`` (what ``TrainingArguments(optim="adamw_torch_8bit" / "adamw_torch_4bit")``
builds) keep each moment of a large parameter as 8- or 4-bit codes plus one float32 scale per block of
``block_size`` elements; a parameter under 4096 elements, or one whose size the block does not divide, keeps plain
moments in its own dtype. For an 8B model in bf16 that is 16.3 GB of moments in 8 bits, 8.5 GB in 4, against 32.1
GB: on one GPU with AdamW on the host (``memory: auto``), the difference is host memory that can hold checkpoints
of a longer context instead.

The moments are an approximation of AdamW's (the update is not the same): the plan never chooses them. It counts
the ones the run has (the Trainer's ``optim``, or the optimizer it built), keeps them where it puts AdamW, and names
them as a way to fit when nothing fits otherwise.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import torch

TORCHAO_MIN_QUANTIZED_ELEMENTS = 4096
"""torchao quantizes the moments of parameters with at least this many elements (and a whole number of blocks)."""

LOW_BIT_CLASS_NAMES = {8: "AdamW8bit", 4: "AdamW4bit"}
LOW_BIT_DEFAULT_BLOCK = {8: 256, 4: 128}
SCALE_BYTES = 4  # one float32 scale per block
QUANTIZATION_MAP_BYTES = {8: 256 * 4, 4: 16 * 4}  # each quantized state's own float32 code book


@dataclass(frozen=True)
class AdamStates:
    """AdamW's moments: ``bits`` None keeps them in the parameters' dtype (torch's AdamW); 8 or 4, torchao's
    block-quantized ones, one scale per ``block_size`` elements."""

    bits: int | None = None
    block_size: int = 256

    def __post_init__(self):
        if self.bits not in (None, 8, 4):
            raise ValueError(f"AdamW's states are kept in the parameters' dtype (bits None) or in 8 or 4 bits "
                             f"(torchao); got bits={self.bits!r}")
        if self.block_size < 1:
            raise ValueError(f"block_size must be positive, got {self.block_size!r}")

    @property
    def low_bit(self) -> bool:
        return self.bits is not None

    def state_bytes(self, tensor_elements: list[int], element_bytes: int) -> int:
        """Bytes of both moments of parameters of ``tensor_elements`` elements each; ``element_bytes``: one element
        of a moment kept in the parameters' dtype."""
        if not self.low_bit:
            return 2 * element_bytes * sum(tensor_elements)
        total = 0
        for n in tensor_elements:
            if n >= TORCHAO_MIN_QUANTIZED_ELEMENTS and n % self.block_size == 0:
                total += 2 * (math.ceil(n * self.bits / 8) + n // self.block_size * SCALE_BYTES
                              + QUANTIZATION_MAP_BYTES[self.bits])
            else:
                total += 2 * n * element_bytes
        return total

    def optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The optimizer class that keeps these states: torch's AdamW, or torchao's low-bit one."""
        if not self.low_bit:
            return torch.optim.AdamW
        import torchao.optim

        return getattr(torchao.optim, LOW_BIT_CLASS_NAMES[self.bits])

    def optimizer_kwargs(self) -> dict:
        return {"block_size": self.block_size} if self.low_bit else {}


def _torchao_adam_classes() -> dict[type, int]:
    """torchao's low-bit Adam classes and their bits, where torchao's optimizers are imported already (no object
    can be one of them otherwise, and importing torchao takes seconds)."""
    ao = sys.modules.get("torchao.optim")
    if ao is None:
        return {}
    return {getattr(ao, name): bits for name, bits in (("AdamW8bit", 8), ("Adam8bit", 8), ("AdamW4bit", 4),
                                                       ("Adam4bit", 4), ("AdamWFp8", 8), ("AdamFp8", 8))
            if hasattr(ao, name)}


def adam_states_of_class(optimizer_class: type, kwargs: dict | None = None) -> AdamStates | None:
    """The states an optimizer of this class (built with ``kwargs``) keeps; None for one that is not Adam's."""
    if isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Adam | torch.optim.AdamW):
        return AdamStates()
    bits = next((b for cls, b in _torchao_adam_classes().items() if optimizer_class is cls), None)
    if bits is None:
        return None
    return AdamStates(bits, int((kwargs or {}).get("block_size", LOW_BIT_DEFAULT_BLOCK[bits])))


def host_optimizer_of(optimizer):
    """The :class:`~.optimizer_offload.HostOffloadAdamW` instance behind ``optimizer`` (an accelerate wrapper or
    itself), or None."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if getattr(candidate, "is_host_offload", False):
            return candidate
    return None


def adam_states_of(optimizer) -> AdamStates | None:
    """The states ``optimizer`` keeps (a torch or torchao Adam, accelerate's wrapper of one, or the host offload
    optimizer); None for an optimizer that is not Adam's."""
    host = host_optimizer_of(optimizer)
    if host is not None:
        return host.adam_states  # the AdamW it runs on the host
    inner = getattr(optimizer, "optimizer", optimizer)
    states = adam_states_of_class(type(inner))
    if states is not None and states.low_bit:
        states = AdamStates(states.bits, int(getattr(inner, "block_size", states.block_size)))
    return states


def trainer_adam_states(args) -> AdamStates | None:
    """The states the Trainer's optimizer will keep, from ``args.optim`` (and ``optim_args``), as transformers
    resolves them; None for an optimizer that is not Adam's."""
    from transformers import Trainer

    optimizer_class, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    return adam_states_of_class(optimizer_class, kwargs)
