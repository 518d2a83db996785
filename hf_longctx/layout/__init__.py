"""Packed-document layouts and sequence-parallel shard plans: pure tensors and ints."""

from .packed import PackedBatch, document_starts
from .pairs import Exchange, Pair, band_work, clip_pair, exchange_plan, pair_between_slots, pairs_between_slots
from .plan import SHARD_STRATEGIES, Piece, ShardPlan, Slot, register_strategy, shard_plan

__all__ = [
    "SHARD_STRATEGIES",
    "Exchange",
    "PackedBatch",
    "Pair",
    "Piece",
    "ShardPlan",
    "Slot",
    "band_work",
    "clip_pair",
    "document_starts",
    "exchange_plan",
    "pair_between_slots",
    "pairs_between_slots",
    "register_strategy",
    "shard_plan",
]
