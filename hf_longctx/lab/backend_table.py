"""The "which backend when" table: every backend and ``auto`` on the three length mixes at several group sizes, on
one GPU, each W-rank group emulated with two link tiers.

A cell is one mix at one group size W: one packed batch of ``tokens_per_gpu x W`` tokens of the mix, Llama-3-8B's
attention shape in bf16. Every backend ``auto`` may choose runs at its own placement (the 2-D compositions past one
node, Ulysses over each node's GPUs), emulated: every rank's kernels timed on the device, its sends priced by link
tier (NVLink inside a node, the network between nodes; :class:`~hf_longctx.comm.links.LinkTiers`), the step being
the slowest rank's kernels plus the slowest rank's transfers. ``auto`` then decides as the product does
(:mod:`hf_longctx.lab.emulation.choose`): it prices the batch, takes the best placement, and its shortlist's emulated
steps stand in for the timing on a real group. Its row says what it chose, what that costs against the best backend
measured on the same batch, and how far each backend's price was from its emulated step.

A backend whose step would make more than ``max_calls`` kernel calls on a rank (TASP at large W: W - 1 cycles of
W - 1 hops) is not emulated, unless ``auto`` shortlists it; its row shows the price alone, marked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from hf_longctx.backends import get_backend
from hf_longctx.backends.auto import PLACEMENTS, AutoOptions, price
from hf_longctx.backends.contract import Candidate
from hf_longctx.backends.prediction import AttentionShape, KernelRates, StepPrediction
from hf_longctx.benchmarking import timed
from hf_longctx.kernels import attention_backward, attention_forward
from hf_longctx.lab.emulation.choose import choose
from hf_longctx.lab.emulation.runner import EmulatedStep, emulate_step_or_stage, release_memory
from hf_longctx.lab.emulation.workloads import doc_lengths, global_tensors
from hf_longctx.layout import PackedBatch, shard_plan

MAX_CALLS = 3000  # kernel calls per rank above which a backend that auto does not shortlist is priced, not emulated


@dataclass
class Entry:
    """One backend in one cell: its price, and its emulated step unless it was too many calls to emulate."""

    candidate: Candidate
    prediction: StepPrediction
    step: EmulatedStep | None
    staged: bool = False

    @property
    def emulated_s(self) -> float | None:
        return None if self.step is None else self.step.predicted_step_s


@dataclass
class Cell:
    mix: str
    world: int
    tokens: int
    docs: int
    entries: list[Entry] = field(default_factory=list)
    auto: Candidate | None = None
    auto_placement: str = ""
    auto_reason: str = ""
    one_gpu_s: float | None = None  # the whole batch on one GPU (real), forward + backward

    def entry(self, candidate: Candidate) -> Entry:
        return next(e for e in self.entries if e.candidate == candidate)

    @property
    def best(self) -> Entry:
        return min((e for e in self.entries if e.step is not None), key=lambda e: e.emulated_s)

    @property
    def auto_ratio(self) -> float:
        """auto's emulated step over the best emulated step of the cell (1.0: auto chose the best)."""
        return self.entry(self.auto).emulated_s / self.best.emulated_s

    def as_json(self) -> dict:
        return {"mix": self.mix, "world": self.world, "tokens": self.tokens, "docs": self.docs,
                "one_gpu_ms": None if self.one_gpu_s is None else self.one_gpu_s * 1e3,
                "auto": self.auto.label if self.auto else None, "auto_placement": self.auto_placement,
                "auto_ratio": self.auto_ratio if self.auto else None, "auto_reason": self.auto_reason,
                "best": self.best.candidate.label,
                "backends": [{"label": e.candidate.label, "placement": e.candidate.strategy,
                              "predicted_ms": e.prediction.step_s * 1e3,
                              "emulated_ms": None if e.step is None else e.emulated_s * 1e3,
                              "kernel_ms_max": None if e.step is None else max(e.step.kernel_s) * 1e3,
                              "imbalance": None if e.step is None else e.step.imbalance,
                              "transfer_ms_max": None if e.step is None else
                              max(r.transfer_s for r in e.step.ranks) * 1e3,
                              "staged_on_host": e.staged} for e in self.entries]}


def table_candidates(predictions: dict[Candidate, StepPrediction]) -> list[Candidate]:
    """One candidate per backend: at the backend's own placement where it is priced there, else its first."""
    chosen: dict[str, Candidate] = {}
    for c in predictions:
        own = get_backend(c.backend).default_strategy
        if c.backend not in chosen or (c.strategy == own and chosen[c.backend].strategy != own):
            chosen[c.backend] = c
    return list(chosen.values())


def run_cell(mix: str, world: int, tokens: int, shape: AttentionShape, dtype: torch.dtype, device: torch.device,
             rates: KernelRates, options: AutoOptions, *, kernel: str = "auto", reps: int = 1, warmup: int = 1,
             seed: int = 0, max_calls: int = MAX_CALLS, log: Callable[[str], None] = print) -> Cell:
    """Every backend and ``auto`` on one mix at ``world`` ranks (see the module docstring)."""
    lens = doc_lengths(mix, tokens, seed)
    batch = PackedBatch.from_doc_lens(lens)
    tensors = global_tensors(tokens, shape.heads, shape.kv_heads, shape.head_dim, dtype, device, seed)
    tiers = options.tiers(world)
    plans = {s: shard_plan(batch, world, s) for s in PLACEMENTS}
    predictions = price(plans, shape, rates, options)
    cell = Cell(mix, world, tokens, len(lens))

    def emulate(candidate: Candidate) -> EmulatedStep:
        step, staged = emulate_step_or_stage(batch, world, tensors, candidate.backend, strategy=candidate.strategy,
                                             options=candidate.options, kernel=kernel, reps=reps, warmup=warmup,
                                             tiers=tiers)
        cell.entries = [e for e in cell.entries if e.candidate != candidate]  # a priced-only entry auto shortlisted
        cell.entries.append(Entry(candidate, predictions[candidate], step, staged))
        release_memory(device)
        log(f"  {mix} W={world} {candidate.label}@{candidate.strategy}: emulated "
            f"{step.predicted_step_s * 1e3:.2f} ms (kernels max {max(step.kernel_s) * 1e3:.2f}, max/mean "
            f"{step.imbalance:.3f}), priced {predictions[candidate].step_s * 1e3:.2f} ms")
        return step

    measured = {}
    for candidate in table_candidates(predictions):
        work = get_backend(candidate.backend).rank_work(plans[candidate.strategy], shape, candidate.options)
        if max(w.calls for w in work) > max_calls:
            cell.entries.append(Entry(candidate, predictions[candidate], None))
            log(f"  {mix} W={world} {candidate.label}: {max(w.calls for w in work)} kernel calls on a rank, priced "
                f"only ({predictions[candidate].step_s * 1e3:.2f} ms)")
            continue
        measured[candidate] = emulate(candidate)
    choice = choose(batch, world, shape, rates, options, emulate, measured)
    cell.auto, cell.auto_placement, cell.auto_reason = choice.candidate, choice.placement, choice.reason
    cell.one_gpu_s = one_device_seconds(batch, tensors, kernel, reps=max(reps, 1))
    release_memory(device)
    return cell


def one_device_seconds(batch: PackedBatch, tensors: tuple[torch.Tensor, ...], kernel: str, reps: int = 1) -> float:
    """Seconds of one forward+backward of the whole batch on its device, one call each (real, not emulated): what W
    ranks' step is measured against."""
    q, k, v, dout = tensors
    cu = batch.cu_seqlens.tolist()

    def step() -> None:
        out, lse = attention_forward(q, k, v, cu, cu, batch.max_seqlen, batch.max_seqlen, kernel=kernel)
        attention_backward(dout, q, k, v, out, lse, cu, cu, batch.max_seqlen, batch.max_seqlen, kernel=kernel)

    with torch.no_grad():
        return timed(step, reps=reps, warmup=1) / 1e3


def _ms_text(ms: float | None) -> str:
    return "-" if ms is None or not math.isfinite(ms) else f"{ms:.1f}"


def markdown(cells: Sequence[dict], marks: str) -> str:
    """The table of ``cells`` (:meth:`Cell.as_json` rows): one row per mix and W, the whole batch on one GPU (real),
    one column per backend (emulated ms, ``(.. p)`` where priced only), then auto's choice and its step over the
    best's, rows by mix (in order of first appearance), then W, whichever run measured them. ``marks`` is the line
    that says where and how it ran."""
    mixes = list(dict.fromkeys(cell["mix"] for cell in cells))
    cells = sorted(cells, key=lambda cell: (mixes.index(cell["mix"]), cell["world"]))
    names: list[str] = []
    for cell in cells:
        for b in cell["backends"]:
            name = b["label"].split("(")[0]
            if name not in names:
                names.append(name)
    head = ["mix", "W", "tokens", "one GPU (real)"] + names + ["auto's choice", "auto / best"]
    legend = ("n/a: not a candidate at this W (Ulysses needs the query heads to split over the W ranks; the 2-D "
              "compositions run past one node).")
    lines = [marks, "", legend, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in cells:
        by: dict[str, dict] = {}
        for b in cell["backends"]:  # the backend at its own placement (entered first), not auto's other placements
            by.setdefault(b["label"].split("(")[0], b)
        best = cell["best"].split("(")[0]
        row = [cell["mix"], str(cell["world"]), f"{cell['tokens'] // 1024}K", _ms_text(cell.get("one_gpu_ms"))]
        for name in names:
            b = by.get(name)
            if b is None:
                row.append("n/a")
            elif b["emulated_ms"] is None:
                row.append(f"({_ms_text(b['predicted_ms'])} p)")
            else:
                text = _ms_text(b["emulated_ms"])
                row.append(f"**{text}**" if name == best else text)
        row += [f"{cell['auto']} ({cell['auto_placement']})", f"{cell['auto_ratio']:.3f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def read_json(paths: Sequence[str]) -> tuple[list[dict], list[dict]]:
    """(cells, metas) of JSON-lines files :class:`JsonLines` wrote, in file order. A file whose run was cut short
    still gives its finished cells."""
    cells, metas = [], []
    for path in paths:
        with open(path) as f:
            for line in f:
                row = json.loads(line)
                if "meta" in row:
                    metas.append(row["meta"])
                elif "end" not in row:
                    cells.append(row)
    return cells, metas


class JsonLines:
    """A run's cells as JSON lines, each written (and flushed) as it is finished, after one line of the run's meta,
    so that a run stopped by a time limit keeps every cell it finished."""

    def __init__(self, path, meta: dict) -> None:
        self._file = open(path, "w")
        self._write({"meta": meta})

    def _write(self, row: dict) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def cell(self, cell: dict) -> None:
        """One finished cell (a :meth:`Cell.as_json` row)."""
        self._write(cell)

    def close(self, end: dict) -> None:
        """The run's end: how long it took and which cells the budget left out."""
        self._write({"end": end})
        self._file.close()
