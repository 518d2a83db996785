"""Process groups, overlapped P2P exchange, row gathers and traffic counters for sequence parallelism."""

from .gather import GatherPlan
from .groups import (
    current_device,
    group_rank_and_size,
    sequence_parallel_group,
)
from .p2p import (
    CommunicationError,
    PendingExchange,
    comm_stats,
    count_all_to_all,
    post_exchange,
    reset_comm_stats,
)

__all__ = [
    "CommunicationError",
    "GatherPlan",
    "PendingExchange",
    "comm_stats",
    "count_all_to_all",
    "reset_comm_stats",
    "current_device",
    "group_rank_and_size",
    "post_exchange",
    "sequence_parallel_group",
]
