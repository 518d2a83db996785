"""What every system of the side-by-side trains: one model shape, one packed batch, one FLOPs formula.

The shape is Llama-3-8B's (hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, vocabulary 128256), with
``layers`` fewer for smoke runs, or a tiny one that runs on a CPU in seconds. The batch is one row of ``seq``
tokens packed from a ProLong-style length mix (:func:`hf_longctx.data.synthetic_lengths.synthetic_doc_lengths`,
as ``scripts/bench_train.py`` packs it): random token ids, positions restarting at every document, and labels
with ``-100`` at every document's first token, so that no system is asked to predict a document from the one
before it (transformers shifts ``labels`` by one: the target of a document's last token is then ignored, as
``hf_longctx``'s per-document shift ignores it).

FLOPs: :func:`hf_longctx.benchmarking.training_mfu`'s formula for every system (6 x matmul parameters per token
plus the attention of the batch's visible pairs inside documents), and the same plus one more forward of every
decoder layer (:func:`recompute_flops`), what a step that checkpoints every layer and recomputes it does. A system
that attends across documents (SDPA over the whole row) does more attention work than it is credited with: its
MFU counts the useful work only, the same numerator for all.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from hf_longctx.benchmarking import FORWARD_BACKWARD_FACTOR, attention_flops, model_flops_per_token

LLAMA3_8B = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "rope_theta": 500000.0}
LLAMA3_8B_LAYERS = 32
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 512, "rope_theta": 10000.0}


@dataclass(frozen=True)
class Workload:
    """One measurement's settings, the same for every system (what the worker process gets as JSON)."""

    seq: int
    layers: int = LLAMA3_8B_LAYERS
    tiny: bool = False
    mix: str = "prolong"
    seed: int = 0
    steps: int = 3
    warmup: int = 1
    lr: float = 1e-5
    sdpa_mask: str = "causal"  # SDPA peers: "causal" (one causal row, documents not masked) or "packed"

    def to_dict(self) -> dict:
        return asdict(self)

    def model_config(self, attn_implementation: str):
        """The transformers ``LlamaConfig`` of this shape."""
        from transformers import LlamaConfig

        shape = TINY if self.tiny else LLAMA3_8B
        return LlamaConfig(**shape, num_hidden_layers=self.layers, max_position_embeddings=max(1 << 17, self.seq),
                           attn_implementation=attn_implementation, use_cache=False, tie_word_embeddings=False)


def train_dtype(device: torch.device) -> torch.dtype:
    """bf16 on a GPU (the benchmark's weights), fp32 on a CPU (where the smoke runs check plumbing, not speed)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def build_model(work: Workload, attn_implementation: str, device: torch.device, seed: int | None = None):
    """A randomly initialised Llama of the workload's shape, on ``device`` in :func:`train_dtype`. The seed makes
    every system start from the same weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(work.seed if seed is None else seed)
    with torch.device(device):
        model = LlamaForCausalLM(work.model_config(attn_implementation))
    return model.to(train_dtype(device))


def doc_lengths(work: Workload) -> list[int]:
    """The packed row's document lengths: the length mix filled to exactly ``seq`` tokens (``one``: a single
    document)."""
    from hf_longctx.data.synthetic_lengths import synthetic_doc_lengths

    if work.mix == "one":
        return [work.seq]
    return synthetic_doc_lengths(work.mix, work.seq, seed=work.seed, max_doc_len=work.seq)


def packed_batch(work: Workload, vocab_size: int) -> dict[str, torch.Tensor]:
    """``input_ids``, ``position_ids`` and ``labels`` of the packed row, each (1, seq), on the CPU."""
    from hf_longctx.layout import PackedBatch

    packed = PackedBatch.from_doc_lens(doc_lengths(work))
    ids = torch.randint(0, vocab_size, (1, work.seq), generator=torch.Generator().manual_seed(work.seed))
    labels = ids.clone()
    labels[0, list(packed.doc_starts)] = -100
    return {"input_ids": ids, "position_ids": packed.position_ids[None].clone(), "labels": labels}


def causal_pairs(work: Workload) -> int:
    """Visible (query, key) pairs inside the documents of the packed row: the attention every system is credited."""
    from hf_longctx.layout import PackedBatch

    return PackedBatch.from_doc_lens(doc_lengths(work)).causal_pairs()


def decoder_flops_per_token(model) -> float:
    """6 x the decoder layers' parameters (the part of :func:`model_flops_per_token` that a layer recompute runs
    again)."""
    return 6.0 * sum(p.numel() for p in model.model.layers.parameters())


@dataclass(frozen=True)
class StepFlops:
    """A step's FLOPs by the one formula: ``model`` (no recomputation) and ``with_recompute`` (one more forward of
    every decoder layer, attention included)."""

    model: float
    with_recompute: float

    @classmethod
    def of(cls, work: Workload) -> StepFlops:
        """Counted on a model of the shape on the meta device: no system's sharding hides parameters from it."""
        from transformers import LlamaForCausalLM

        with torch.device("meta"):
            model = LlamaForCausalLM(work.model_config("sdpa"))
        attention = attention_flops(model.config, causal_pairs(work))
        base = work.seq * model_flops_per_token(model) + attention
        recompute = work.seq * decoder_flops_per_token(model) / 3.0 + attention / FORWARD_BACKWARD_FACTOR
        return cls(model=base, with_recompute=base + recompute)


def mfu(flops: float, seconds: float, peak: float | None) -> float | None:
    """``flops`` done in ``seconds`` over one device's dense bf16 ``peak`` (None where the peak is unknown)."""
    if not peak or not seconds or seconds != seconds:
        return None
    return flops / seconds / peak
