"""Sub-groups of a torch.distributed group, made as torch needs them: by every rank of the world, in one order.

Why: torch makes a process group with every rank of the world taking part (gloo cannot split a group, and groups
made by their members alone do not connect on it). A rank that wants sub-groups of its group (e.g. the inner and
outer groups of a two-dimensional mesh, :mod:`hf_longctx.backends.ulysses_mesh`) therefore asks at a point where
every rank of the world asks too, as in training, where every data-parallel replica runs the same layers: one
``all_gather_object`` over the world tells each rank every replica's wanted groups, and every rank makes all of them
in one order (sorted member lists). The groups made are kept per parent group object, setting and member lists, so
that later asks make no collective, until :func:`forget_sub_groups` (called by
:func:`~hf_longctx.comm.groups.release_groups`) lets them go.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch.distributed as dist


class SubGroupMismatch(ValueError):
    """The ranks of one group asked for sub-groups made from different settings. Raised by every rank that took part
    in the ask (torch.distributed: the world; an emulated hub: the group) at the same call, so that no rank is left
    waiting to make a group.

    ``settings``: the global ranks of each group whose ranks disagreed -> the settings they gave (sorted)."""

    def __init__(self, settings: dict[tuple[int, ...], list]) -> None:
        self.settings = settings
        super().__init__(f"the ranks of a group ask for sub-groups made from different settings ({settings}: "
                         "the group's global ranks -> settings)")


_MADE: dict[tuple, list[Any]] = {}  # (parent group, setting, member lists) -> the groups, in the lists' order


def make_sub_groups(group: Any, group_ranks: Sequence[int], members: Sequence[Sequence[int]], setting: Hashable
                    ) -> list[Any]:
    """The process groups of ``members`` (lists of ranks of ``group``, whose global ranks are ``group_ranks``), in
    the order of ``members``; a list of one rank gives None (no process group is made for it), a list this rank is
    not in torch's non-member placeholder. Made at the first ask for this group object, setting and lists, by every
    rank of the world (see the module docstring); ``setting`` (orderable, e.g. an int) is what the lists were made
    from: where the ranks of any group give different ones, every rank of the world raises :class:`SubGroupMismatch`
    (every rank sees every ask), and none makes a group."""
    lists = tuple(tuple(m) for m in members)
    key = (group, setting, lists)
    if key not in _MADE:
        wanted_here = [tuple(group_ranks[r] for r in m) for m in lists]
        everyone: list = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, (tuple(group_ranks), setting, wanted_here))
        settings: dict[tuple[int, ...], set] = {}
        for ranks, given, _ in everyone:
            settings.setdefault(tuple(ranks), set()).add(given)
        mixed = {ranks: sorted(s) for ranks, s in settings.items() if len(s) > 1}
        if mixed:  # every rank saw the same asks: the whole world raises together, nobody waits in new_group
            raise SubGroupMismatch(mixed)
        wanted = {tuple(m) for _, _, asked in everyone for m in asked}
        made = {ranks: dist.new_group(list(ranks)) if len(ranks) > 1 else None for ranks in sorted(wanted)}
        _MADE[key] = [made[m] for m in wanted_here]
    return list(_MADE[key])


def forget_sub_groups() -> None:
    """Let go of every sub-group made here (the next ask makes them anew, every rank of the world alike)."""
    _MADE.clear()
