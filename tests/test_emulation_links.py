"""What an emulated step sends, per call and peer, and what the links make of it.

The hub records each call's bytes per destination (ranks of the emulated world); a step prices them on one NVLink
node (no tiers: the formula of before, call by call on its total) or on two link tiers, where the bytes a rank sends
to another node cross the network. Checked against a count by hand of the ring on one document, where every block
is sent whole.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest
import torch

from hf_longctx.comm.links import LINKS, MB, ONE_NODE, LinkTiers
from hf_longctx.lab.emulation import RankStep, emulate_step
from hf_longctx.layout import PackedBatch

WORLD, SHARD, KV_HEADS, HEAD_DIM = 4, 6, 2, 8
BLOCK = SHARD * KV_HEADS * HEAD_DIM * 8  # bytes of one rank's keys (or values), float64


def one_document_ring(tiers: LinkTiers | None = None):
    """The ring at W = 4 on one document of 4 x 6 tokens: contiguous shards of 6 tokens, each rank's block whole."""
    batch = PackedBatch.from_doc_lens([WORLD * SHARD])
    g = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(WORLD * SHARD, h, HEAD_DIM, generator=g, dtype=torch.float64)
                     for h in (4, KV_HEADS, KV_HEADS, 4))
    return emulate_step(batch, WORLD, (q, k, v, dout), "ring", kernel="reference", tiers=tiers)


def ring_calls_by_hand(rank: int) -> Counter:
    """Causal attention on one document: rank r's queries need the keys of every rank j <= r. The ring's owner of
    keys sends them straight to the rank that needs them (rank j to rank j + s at step s), its keys and values in
    one call, in the forward and again in the backward; a rank that used another's keys sends their gradients
    (dk, dv) back to it, one call per owner."""
    later = [("p2p", ((r, 2 * BLOCK),)) for r in range(rank + 1, WORLD)]
    earlier = [("p2p", ((j, 2 * BLOCK),)) for j in range(rank)]
    return Counter(later * 2 + earlier)


def _calls(traffic) -> Counter:
    return Counter((kind, tuple(sorted(bytes_to.items()))) for kind, bytes_to in traffic)


def test_the_ring_sends_each_peer_what_a_count_by_hand_says():
    step = one_document_ring()
    for r in step.ranks:
        assert _calls(r.traffic) == ring_calls_by_hand(r.rank), r.rank
        assert r.sent_bytes == 2 * BLOCK * (2 * (WORLD - 1 - r.rank) + r.rank)
    assert step.sent_bytes == [r.sent_bytes for r in step.ranks]


def test_two_tiers_split_and_price_the_bytes_that_leave_a_node():
    """Nodes of two ranks, 20 GB/s between them: rank 0 keeps its sends to rank 1 inside its node and sends those to
    ranks 2 and 3 over the network; every call goes to one peer, so it takes that peer's link's time."""
    tiers = LinkTiers(node_size=2, inter_node_bytes_per_s=20e9)
    step = one_document_ring(tiers)
    assert step.tiers == tiers and all(r.tiers == tiers for r in step.ranks)
    p2p = LINKS["p2p"].seconds(2 * BLOCK)
    network = 2 * BLOCK / 20e9
    # (intra-node bytes, inter-node bytes, seconds) of every rank, by hand from ring_calls_by_hand
    want = {0: (4 * BLOCK, 8 * BLOCK, 2 * p2p + 4 * network),
            1: (2 * BLOCK, 8 * BLOCK, p2p + 4 * network),
            2: (4 * BLOCK, 4 * BLOCK, 2 * p2p + 2 * network),
            3: (2 * BLOCK, 4 * BLOCK, p2p + 2 * network)}
    for r in step.ranks:
        intra, inter, seconds = want[r.rank]
        assert r.node_bytes == (intra, inter), r.rank
        assert r.transfer_s == pytest.approx(seconds, rel=1e-12), r.rank
    assert step.intra_node_bytes == [want[r][0] for r in range(WORLD)]
    assert step.inter_node_bytes == [want[r][1] for r in range(WORLD)]
    assert step.predicted_step_s == pytest.approx(max(step.kernel_s) + want[0][2], rel=1e-12)
    assert step.predicted_overlapped_s == max(max(r.kernel_s, r.transfer_s) for r in step.ranks)


def test_without_tiers_a_step_is_priced_as_before_on_one_node():
    """No tiers: every call on the NVLink curve of its kind at its total bytes (the formula of before per-peer
    traffic), all bytes inside the node; tiers of one node big enough for the group price it the same."""
    step = one_document_ring()
    assert step.tiers is None
    for r in step.ranks:
        old = sum(LINKS[kind].seconds(sum(bytes_to.values())) for kind, bytes_to in r.traffic)
        assert r.transfer_s == old and old > 0
        assert ONE_NODE.seconds(r.rank, r.traffic) == old
        assert r.node_bytes == (r.sent_bytes, 0)
        assert dataclasses.replace(r, tiers=LinkTiers(node_size=WORLD)).transfer_s == old
    assert step.predicted_step_s == max(step.kernel_s) + max(
        sum(LINKS[kind].seconds(sum(b.values())) for kind, b in r.traffic) for r in step.ranks)
    assert step.inter_node_bytes == [0] * WORLD and step.intra_node_bytes == step.sent_bytes
    # a call to several peers is one message of its total size (above 16 MB the curve is not linear)
    big = RankStep(0, 0.0, 0.0, 0, [("a2a", {1: 20 * MB, 2: 20 * MB}), ("p2p", {3: 100 * MB})])
    assert big.transfer_s == LINKS["a2a"].seconds(40 * MB) + LINKS["p2p"].seconds(100 * MB)
    assert big.transfer_s < 2 * LINKS["a2a"].seconds(20 * MB) + LINKS["p2p"].seconds(100 * MB)


def test_a_call_to_peers_on_both_tiers_lasts_as_long_as_the_slower_link():
    tiers = LinkTiers(node_size=4, inter_node_bytes_per_s=10e9)
    bytes_to = {1: 32 * MB, 6: 2 * MB, 4: 1 * MB, 3: 0}  # rank 2: ranks 1 and 3 share its node, 4 and 6 do not
    assert tiers.split(2, bytes_to) == (32 * MB, 3 * MB)
    assert tiers.call_seconds("a2a", 2, bytes_to) == LINKS["a2a"].seconds(32 * MB)  # NVLink the slower here
    assert tiers.call_seconds("a2a", 2, {6: 64 * MB, 1: MB}) == 64 * MB / 10e9  # the network the slower here
    assert tiers.seconds(2, [("a2a", bytes_to), ("p2p", {5: MB})]) == LINKS["a2a"].seconds(32 * MB) + MB / 10e9
