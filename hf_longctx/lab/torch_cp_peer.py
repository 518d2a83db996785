"""The peer we measure against: PyTorch's native context parallelism, set up the way accelerate does it.

``Accelerator(parallelism_config=ParallelismConfig(cp_size=N))`` shards the model with FSDP2 over the
context-parallel ranks and, inside ``accelerator.maybe_context_parallel(...)``, splits the listed
buffers along the sequence (load-balanced) and routes SDPA through torch's ring attention. It has no
document masking (one causal sequence only) and no GQA path in the ring, so key/value heads are
repeated, as its users must. Used by ``scripts/bench_train.py --backend torch_cp``; nothing else in
the package depends on it (accelerate refuses ``cp_size`` on CPU, so it runs on GPUs only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

PEER_ATTENTION = "torch_cp_sdpa"


def _peer_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """Causal SDPA over (1, H, S, D) with repeated KV heads; torch CP makes it a ring inside its context."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register_peer_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PEER_ATTENTION, _peer_attention)
    AttentionMaskInterface.register(PEER_ATTENTION, lambda *a, **k: None)  # causal is built into the call
    return PEER_ATTENTION


class TorchCPTrainer:
    """One training step of the peer: accelerate's FSDP2 + context-parallel path on one causal sequence."""

    def __init__(self, model: torch.nn.Module, optimizer, world: int, device: torch.device):
        from accelerate import Accelerator
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import FullyShardedDataParallelPlugin

        layer_cls = type(model.model.layers[0]).__name__
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                                transformer_cls_names_to_wrap=[layer_cls],
                                                state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True)
        self.accelerator = Accelerator(parallelism_config=ParallelismConfig(cp_size=world, dp_shard_size=1),
                                       fsdp_plugin=plugin, cpu=device.type == "cpu")
        self.model, self.optimizer = self.accelerator.prepare(model, optimizer)

    def step(self, input_ids: torch.Tensor, position_ids: torch.Tensor, shift_labels: torch.Tensor) -> torch.Tensor:
        # the context shards its buffers in place: hand it fresh copies every step
        buffers = [input_ids.clone(), position_ids.clone(), shift_labels.clone()]
        with self.accelerator.maybe_context_parallel(buffers=buffers, buffer_seq_dims=[1, 1, 1],
                                                     no_restore_buffers=set(buffers)):
            # transformers computes a loss only when labels are given; shift_labels says they are shifted already
            loss = self.model(input_ids=buffers[0], position_ids=buffers[1], labels=buffers[2],
                              shift_labels=buffers[2]).loss
            self.accelerator.backward(loss)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss.detach()


def one_sequence_batch(ids: torch.Tensor, device) -> dict:
    """``ids`` (1, T) as one causal document: ids, positions and next-token targets (unsharded)."""
    ids = ids.to(device)
    total = ids.shape[1]
    shift = torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], -100)], dim=1)
    return {"input_ids": ids, "position_ids": torch.arange(total, device=device)[None], "shift_labels": shift}
