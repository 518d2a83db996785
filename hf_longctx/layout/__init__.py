"""Packed-document layouts and sequence-parallel shard plans: pure tensors and ints."""

from .packed import PackedBatch, document_starts
from .pairs import Exchange, Pair, clip_pair, exchange_plan, pairs_between_slots
from .plan import SHARD_STRATEGIES, Piece, ShardPlan, shard_plan

__all__ = [
    "SHARD_STRATEGIES",
    "Exchange",
    "PackedBatch",
    "Pair",
    "Piece",
    "ShardPlan",
    "clip_pair",
    "document_starts",
    "exchange_plan",
    "pairs_between_slots",
    "shard_plan",
]
