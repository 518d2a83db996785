"""What the peers share: which attention and fused kernels they get here, and how a Trainer reports its steps.

Attention: ``flash_attention_2`` where the ``flash_attn`` package imports (it masks packed documents from
``position_ids``, as varlen calls), else ``sdpa``. transformers gives SDPA a packed row's document mask as a dense
``(seq, seq)`` tensor (16 GiB at 128K tokens), which no long context survives; ArcticTraining's trainer removes
that mask for SDPA under sequence parallelism (it registers a mask function that returns None) so that SDPA runs
one causal row. :func:`choose_attention` does the same unless ``sdpa_mask="packed"`` asks for transformers' own
mask; the row's positions still restart at every document (RoPE as the others), but documents see each other.

Liger-Kernel (Triton): only on a GPU where ``liger_kernel`` imports; elsewhere each peer says what it used instead.
"""

from __future__ import annotations

import importlib.util

import torch


def flash_attention_installed() -> bool:
    """FlashAttention-2 as transformers can use it (FlashAttention-4 installs a ``flash_attn.cute`` package too,
    which transformers' ``flash_attention_2`` cannot run)."""
    from transformers.utils import is_flash_attn_2_available

    return is_flash_attn_2_available()


def liger_available(device: torch.device) -> bool:
    """Liger's kernels are Triton kernels: a CUDA device and the package."""
    return device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None


def choose_attention(sdpa_mask: str) -> tuple[str, bool]:
    """(transformers attention implementation, whether documents are masked from each other) for a peer."""
    if flash_attention_installed():
        return "flash_attention_2", True
    if sdpa_mask == "packed":
        return "sdpa", True
    if sdpa_mask != "causal":
        raise ValueError(f"sdpa_mask is 'causal' or 'packed', got {sdpa_mask!r}")
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    ALL_MASK_ATTENTION_FUNCTIONS.register("sdpa", lambda *args, **kwargs: None)  # SDPA then runs is_causal=True
    return "sdpa", False


class OneBatch(torch.utils.data.Dataset):
    """The same packed row at every index: a Trainer's dataset of ``length`` steps."""

    def __init__(self, batch: dict[str, torch.Tensor], length: int) -> None:
        self.batch, self.length = {k: v[0] for k, v in batch.items()}, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.batch


def row_dataset(batch: dict[str, torch.Tensor], length: int):
    """The same packed row ``length`` times as a ``datasets.Dataset`` in torch format (TRL's trainers take no
    other dataset)."""
    import datasets

    columns = {k: [v[0].tolist()] * length for k, v in batch.items()}
    return datasets.Dataset.from_dict(columns).with_format("torch")


def stack_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The collator: the rows stacked as they are (already packed; no padding, no new positions)."""
    return {k: torch.stack([r[k] for r in rows]) for k in rows[0]}


def step_callback(clock):
    """A ``TrainerCallback`` that hands each optimizer step's begin and end to ``clock`` (:class:`~.measure.StepClock`)
    and the logged loss to its list."""
    from transformers import TrainerCallback

    class _Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            clock.begin()

        def on_step_end(self, args, state, control, **kwargs):
            clock.end()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                clock.losses.append(float(logs["loss"]))

    return _Clock()


def trainer_arguments(cls, output_dir: str, steps: int, lr: float, device: torch.device, **kwargs):
    """``TrainingArguments`` (or TRL's ``SFTConfig``, ``cls``) for ``steps`` optimizer steps of one row each, logging
    every step and saving nothing; bf16 on a GPU."""
    return cls(output_dir=output_dir, max_steps=steps, per_device_train_batch_size=1, gradient_accumulation_steps=1,
               learning_rate=lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, logging_steps=1,
               save_strategy="no", report_to=[], bf16=device.type == "cuda", use_cpu=device.type != "cuda",
               dataloader_num_workers=0, remove_unused_columns=False, disable_tqdm=True, seed=0, **kwargs)
