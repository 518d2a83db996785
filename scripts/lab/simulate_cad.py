"""CPU simulation: attention balance and bytes of CAD against three ways to place documents.

For each length mix (the CAD paper's Pretrain and ProLong, ``hf_longctx.data.synthetic_lengths``),
tokens per rank and rank count, one global batch of documents (each capped at the tokens per rank)
is placed four ways and priced with the FLOPs cost model (one attention layer, forward):

(a) ``none``: contiguous placement, equal tokens per rank, documents cut at rank boundaries. A piece
    that continues a document fetches the KV of its earlier tokens (its offset).
(b) ``wlb``: variable-length chunks in the style of WLB-LLM: whole documents, longest first, each
    to the rank with the least attention cost that still has room under a 1.5x token cap. Documents
    are placed by the data loader, so no bytes move during attention, but token counts (memory)
    diverge.
(c) ``per-doc CP``: every document split over all ranks in 2 x ranks zig-zag chunks (rank r gets
    chunks r and 2R-1-r); KV all-gathered, so each rank receives the KV of all tokens it does not hold.
(d) ``CAD``: :func:`hf_longctx.backends.cad.scheduler.assign_servers` on the layout of (a), one server per
    rank, at each eps; bytes are what its tasks move (query rows, KV prefixes, outputs + lse).

Reports attention imbalance (max / mean cost per rank), token imbalance (max / mean tokens per rank),
MiB sent per rank (Llama-3-8B attention shapes, bf16) and the scheduler's wall time, as a markdown
table and a PNG. Run: ``python scripts/lab/simulate_cad.py`` (defaults take about a minute on 2 cores).
"""

from __future__ import annotations

import argparse
import heapq
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hf_longctx.backends.cad.cost_model import FlopsCostModel, ProfiledCostModel, TokenBytes
from hf_longctx.backends.cad.scheduler import assign_servers, parse_docs
from hf_longctx.data.synthetic_lengths import PARAMS, synthetic_doc_lengths

MIB = 2**20


@dataclass
class Row:
    mix: str
    tokens: int
    ranks: int
    method: str
    attn_imbalance: float
    token_imbalance: float
    mib_mean: float
    mib_max: float
    sched_ms: float | None = None


def contiguous_layout(lengths: np.ndarray, ranks: int, tokens: int) -> list[list]:
    """Documents end to end, ``tokens`` per rank; a cut document continues as a (length, offset) piece."""
    docs: list[list] = [[] for _ in range(ranks)]
    ends = np.cumsum(lengths)
    starts = ends - lengths
    first_rank = (starts // tokens).tolist()
    last_rank = ((ends - 1) // tokens).tolist()
    for length, start, r0, r1 in zip(lengths.tolist(), starts.tolist(), first_rank, last_rank):
        if r0 == r1:
            docs[r0].append(length)
            continue
        for r in range(r0, r1 + 1):
            a, b = max(start, r * tokens), min(start + length, (r + 1) * tokens)
            docs[r].append((b - a, a - start) if a > start else b - a)
    return docs


def imbalance(x: np.ndarray) -> float:
    return float(x.max() / x.mean()) if x.mean() > 0 else 1.0


def no_balancing(docs, cm, tb, ranks, tokens) -> Row:
    loads = np.zeros(ranks)
    fetched = np.zeros(ranks)
    for r, items in enumerate(docs):
        arr = np.array([d if isinstance(d, tuple) else (d, 0) for d in items], dtype=np.int64).reshape(-1, 2)
        loads[r] = cm.cost_array(arr[:, 0], arr[:, 1] + arr[:, 0]).sum()
        fetched[r] = arr[:, 1].sum() * tb.kv
    return Row("", tokens, ranks, "none (contiguous)", imbalance(loads), 1.0, fetched.mean() / MIB, fetched.max() / MIB)


def wlb_chunks(lengths: np.ndarray, cm, ranks, tokens, cap_factor: float = 1.5) -> Row:
    """Longest-processing-time placement of whole documents under a token cap."""
    cost = cm.cost_array(lengths, lengths)
    order = np.argsort(-cost, kind="stable")
    cap = cap_factor * tokens
    loads = np.zeros(ranks)
    used = np.zeros(ranks, dtype=np.int64)
    heap = [(0.0, r) for r in range(ranks)]  # ranks with room for the current document, by load
    parked: list[tuple[int, float, int]] = []  # ranks too full for it, by free tokens (lengths only shrink)
    for i in order.tolist():
        length = int(lengths[i])
        while parked and -parked[0][0] >= length:
            _, load, r = heapq.heappop(parked)
            heapq.heappush(heap, (load, r))
        while heap and used[heap[0][1]] + length > cap:
            load, r = heapq.heappop(heap)
            heapq.heappush(parked, (-(cap - used[r]), load, r))
        if heap:
            _, r = heapq.heappop(heap)
        else:  # no rank has room: the one with the most free tokens overflows
            _, _, r = heapq.heappop(parked)
        loads[r] += cost[i]
        used[r] += length
        heapq.heappush(heap, (loads[r], r))
    return Row("", tokens, ranks, "wlb (whole docs, 1.5x cap)", imbalance(loads), imbalance(used.astype(float)),
               0.0, 0.0)


def per_doc_cp(lengths: np.ndarray, cm, tb, ranks, tokens) -> Row:
    """Zig-zag split of every document over all ranks; cost per rank computed chunk by chunk."""
    loads = np.zeros(ranks)
    j = np.arange(2 * ranks + 1)
    rank_of_chunk = np.concatenate([np.arange(ranks), np.arange(ranks)[::-1]])
    batch = max(1, (1 << 21) // (2 * ranks + 1))
    for a in range(0, len(lengths), batch):
        L = lengths[a:a + batch, None]
        bounds = (L * j[None, :]) // (2 * ranks)
        q = np.diff(bounds, axis=1)
        chunk_cost = cm.cost_array(q, bounds[:, 1:]).sum(axis=0)
        loads += np.bincount(rank_of_chunk, weights=chunk_cost, minlength=ranks)
    gathered = (ranks - 1) * tokens * tb.kv  # all-gather: every rank receives everyone else's KV
    return Row("", tokens, ranks, "per-doc CP (zig-zag, all-gather KV)", imbalance(loads), 1.0,
               gathered / MIB, gathered / MIB)


def cad(docs, cm, tb, ranks, tokens, eps: float, reps: int, width: int = 1) -> Row:
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        sched = assign_servers(docs, ranks, eps=eps, cost_model=cm, token_bytes=tb, search_width=width)
        best = min(best, time.perf_counter() - t)
    label = f"CAD eps={eps:g}" + (f" (search width {width})" if width != 1 else "")
    b = sched.bytes_per_rank
    return Row("", tokens, ranks, label, sched.imbalance, 1.0, b.mean() / MIB, b.max() / MIB, best * 1e3)


def simulate(mixes, tokens_list, ranks_list, eps_list, seed, reps, widths) -> list[Row]:
    cm, tb = FlopsCostModel(), TokenBytes()
    rows: list[Row] = []
    for mix in mixes:
        for tokens in tokens_list:
            for ranks in ranks_list:
                t0 = time.perf_counter()
                lengths = np.asarray(synthetic_doc_lengths(mix, ranks * tokens, seed=seed, max_doc_len=tokens))
                docs = contiguous_layout(lengths, ranks, tokens)
                found = [no_balancing(docs, cm, tb, ranks, tokens), wlb_chunks(lengths, cm, ranks, tokens),
                         per_doc_cp(lengths, cm, tb, ranks, tokens)]
                found += [cad(docs, cm, tb, ranks, tokens, eps, reps) for eps in eps_list]
                found += [cad(docs, cm, tb, ranks, tokens, 0.1, reps, width=w) for w in widths if w != 1]
                for row in found:
                    row.mix = mix
                rows += found
                print(f"{mix} {tokens // 1024}K x {ranks}: {len(lengths)} docs, {time.perf_counter() - t0:.1f} s; "
                      + ", ".join(f"{r.method}: {r.attn_imbalance:.2f}" for r in found), flush=True)
    return rows


def priced_loads(docs, sched, model) -> np.ndarray:
    """Per-server cost of a schedule's tasks under ``model`` (e.g. a FLOPs schedule priced by a profile)."""
    _, off, _, _ = parse_docs(docs)
    first = np.cumsum([0] + [len(d) for d in docs])[:-1]
    item = first[sched.task_owner] + sched.task_piece
    cost = model.cost_array(sched.task_q_end - sched.task_q_start, off[item] + sched.task_q_end)
    return np.bincount(sched.task_server, weights=cost, minlength=sched.num_servers)


def simulate_profiled(mixes, tokens_list, ranks_list, seed, profile_path: Path, interpolate: str,
                      eps: float = 0.1) -> list[Row]:
    """Attention time balance under a measured cost grid: no balancing, CAD scheduled with FLOPs, and CAD
    scheduled with the profile itself (all priced by the profile)."""
    prof, flops, tb = ProfiledCostModel.load(profile_path, interpolate), FlopsCostModel(), TokenBytes()
    rows: list[Row] = []
    for mix in mixes:
        for tokens in tokens_list:
            for ranks in ranks_list:
                lengths = np.asarray(synthetic_doc_lengths(mix, ranks * tokens, seed=seed, max_doc_len=tokens))
                docs = contiguous_layout(lengths, ranks, tokens)
                base = no_balancing(docs, prof, tb, ranks, tokens)
                found = [base]
                for label, model in (("FLOPs", flops), ("profile", prof)):
                    t = time.perf_counter()
                    sched = assign_servers(docs, ranks, eps=eps, cost_model=model, token_bytes=tb)
                    ms = (time.perf_counter() - t) * 1e3
                    b = sched.bytes_per_rank
                    found.append(Row(mix, tokens, ranks, f"CAD eps={eps:g}, scheduled with {label}",
                                     imbalance(priced_loads(docs, sched, prof)), 1.0, b.mean() / MIB, b.max() / MIB,
                                     ms))
                for row in found:
                    row.mix = mix
                rows += found
    return rows


def profile_section(rows: list[Row], profile_path: Path, interpolate: str) -> list[str]:
    prof = ProfiledCostModel.load(profile_path)
    meta = json.loads(profile_path.read_text()).get("meta", {})
    lines = [
        "",
        "## Balance in measured attention time",
        "",
        f"Cost grid measured by `scripts/lab/profile_cad.py` on {meta.get('device', '?')} "
        f"(torch {meta.get('torch', '?')}, "
        f"{meta.get('mode', '?')}, H={meta.get('heads')}, Hkv={meta.get('kv_heads')}, D={meta.get('head_dim')}, "
        f"{meta.get('dtype')}, kernel {meta.get('kernel')}): ms per segment of q_len queries over kv_len keys "
        f"inside a fused batch (cells extrapolated by FLOPs: {meta.get('extrapolated', [])}).",
        "",
        "| q_len \\ kv_len | " + " | ".join(f"{int(k)}" for k in prof.kv_lens) + " |",
        "|---|" + "---|" * len(prof.kv_lens),
    ]
    for q, row in zip(prof.q_lens, prof.table):
        lines.append(f"| {int(q)} | " + " | ".join(f"{v:.4g}" for v in row) + " |")
    lines += [
        "",
        f"Every schedule below is priced with that grid, interpolated by {interpolate} "
        "(imbalance = max / mean measured time per rank). "
        "\"scheduled with FLOPs\" balances FLOPs and is then timed; \"scheduled with profile\" balances the "
        "measured times directly.",
        "",
        "| mix | tokens/rank | ranks | method | time max/mean | MiB sent/rank mean | max | sched ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines += [table_row(r, token_imbalance=False) for r in rows]
    return lines


def table_row(r: Row, token_imbalance: bool) -> str:
    """One markdown row: mix, size, method, imbalance(s), bytes sent, scheduler time."""
    ms = f"{r.sched_ms:.1f}" if r.sched_ms is not None else "-"
    tokens = f"{r.token_imbalance:.2f} | " if token_imbalance else ""
    return (f"| {r.mix} | {r.tokens // 1024}K | {r.ranks} | {r.method} | {r.attn_imbalance:.3f} | {tokens}"
            f"{r.mib_mean:,.0f} | {r.mib_max:,.0f} | {ms} |")


def markdown(rows: list[Row], args, command: str, elapsed: float) -> str:
    tb = TokenBytes()
    lines = [
        "# CAD scheduler: CPU simulation",
        "",
        f"Date: 2026-11-22. Machine: 2-core CPU ({platform.processor() or platform.machine()}), "
        f"Python {platform.python_version()}, numpy {np.__version__}; whole run {elapsed:.0f} s.",
        "",
        f"Command: `{command}`",
        "",
        "What is compared (one attention layer, forward; cost = exact causal FLOPs):",
        "",
        "- **none**: contiguous placement, equal tokens per rank, documents cut at rank boundaries; a piece "
        "fetches the KV of its document's earlier tokens.",
        "- **wlb**: WLB-LLM-style variable-length chunks: whole documents, longest first, to the least-loaded "
        "rank under a 1.5x token cap; no bytes during attention, but tokens (memory) per rank diverge.",
        "- **per-doc CP**: every document split over all ranks (zig-zag, 2 chunks per rank), KV all-gathered: "
        "each rank receives the KV of every token it does not hold.",
        "- **CAD**: `hf_longctx.backends.cad.scheduler.assign_servers` on the contiguous layout, one in-place "
        "attention server per rank, min_shard 128; bytes = query rows + KV prefixes not already on the "
        "server + outputs and lse back.",
        "",
        f"Documents: `synthetic_doc_lengths(mix, ranks * tokens, seed={args.seed}, max_doc_len=tokens)`; "
        + "; ".join(f"{m}: lognormal mu {p.mu}, sigma {p.sigma}, {p.long_token_share:.0%} of tokens from "
                    f"log-uniform [{p.long_min // 1024}K, cap] documents" for m, p in PARAMS.items()) + ".",
        f"Bytes per token (Llama-3-8B attention, bf16): Q {tb.q:.0f}, KV {tb.kv:.0f}, out + lse {tb.out:.0f}. "
        "MiB are per rank for one layer's forward; scheduler time is the best of "
        f"{args.reps} calls of `assign_servers()` on this CPU.",
        "",
        "Attention imbalance = max / mean attention cost per rank (the straggler factor of the layer); "
        "token imbalance = max / mean tokens per rank (memory).",
        "",
        "![CAD simulation](cad_simulation.png)",
        "",
        "| mix | tokens/rank | ranks | method | attn max/mean | tokens max/mean | MiB sent/rank mean | max "
        "| sched ms |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [table_row(r, token_imbalance=True) for r in rows]
    lines += ["", "## Summary at the largest scale", ""]
    top_r, top_t = max(args.ranks), max(args.tokens)
    for mix in args.mixes:
        sel = {r.method: r for r in rows if r.mix == mix and r.ranks == top_r and r.tokens == top_t}
        if not sel:
            continue
        base, cp = sel["none (contiguous)"], sel["per-doc CP (zig-zag, all-gather KV)"]
        wlb = sel["wlb (whole docs, 1.5x cap)"]
        cad01 = sel.get("CAD eps=0.1")
        if cad01 is None:
            continue
        lines.append(
            f"- {mix}, {top_r} ranks x {top_t // 1024}K tokens: attention imbalance {base.attn_imbalance:.2f} "
            f"without balancing, {wlb.attn_imbalance:.2f} with whole-document placement (tokens max/mean "
            f"{wlb.token_imbalance:.2f}), {cad01.attn_imbalance:.3f} with CAD at eps 0.1, moving "
            f"{cad01.mib_mean:,.0f} MiB per rank on average (max {cad01.mib_max:,.0f}) against "
            f"{cp.mib_mean:,.0f} MiB for per-document CP's all-gather; the scheduler took {cad01.sched_ms:.1f} ms.")
    lines += [
        "",
        "Reading the table: CAD's mean bytes grow with the tokens per rank, not with the rank count (a rank "
        "sends only the shards it gives away), while per-document CP's all-gather grows with both. The "
        "largest per-rank figure belongs to the rank that holds the longest document: every server that "
        "computes a head-tail ring of it needs the KV prefix up to the ring's tail, so a document whose cost "
        "is several times the per-rank target ships most of its KV several times. Whole-document placement "
        "cannot get below the cost of the largest document divided by the target, and costs memory balance.",
        "",
    ]
    wide = [(r, next(x for x in rows if x.mix == r.mix and x.tokens == r.tokens and x.ranks == r.ranks
                     and x.method == "CAD eps=0.1")) for r in rows if "search width" in r.method]
    if wide:
        ratio_mean = np.exp(np.mean([np.log(max(w.mib_mean, 1e-9) / max(b.mib_mean, 1e-9)) for w, b in wide]))
        ratio_max = np.exp(np.mean([np.log(max(w.mib_max, 1e-9) / max(b.mib_max, 1e-9)) for w, b in wide]))
        lines += [
            "Search width: `assign_servers()` prices, for the largest deficit, the items of the largest-surplus server "
            "(width 1, the default). Pricing the top 4 surplus servers at every step (rows \"search width 4\") "
            f"changes mean bytes per rank by a factor {ratio_mean:.2f} and max bytes by {ratio_max:.2f} "
            f"(geometric means over the {len(wide)} configurations), and costs more scheduler time: the locally "
            "best-priced move fills large deficits with smaller items first, so long documents end up cut into "
            "more rings, each shipping its own KV prefix.",
            "",
        ]
    if args.profile is not None:
        lines += profile_section(args.profiled_rows, args.profile, args.profile_interpolate)
    return "\n".join(lines) + "\n"


def plot(rows: list[Row], path: Path, mixes, tokens: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(mixes), figsize=(6 * len(mixes), 8), squeeze=False)
    for c, mix in enumerate(mixes):
        sel = [r for r in rows if r.mix == mix and r.tokens == tokens]
        methods = list(dict.fromkeys(r.method for r in sel))
        for m in methods:
            pts = sorted((r.ranks, r.attn_imbalance, r.mib_mean) for r in sel if r.method == m)
            x = [p[0] for p in pts]
            style = "--" if m.startswith("CAD") else "-"
            axes[0][c].plot(x, [p[1] for p in pts], style, marker="o", label=m)
            if m.startswith("wlb"):
                continue
            axes[1][c].plot(x, [max(p[2], 1e-3) for p in pts], style, marker="o", label=m)
        axes[0][c].set_title(f"{mix}, {tokens // 1024}K tokens/rank: attention max/mean")
        axes[1][c].set_title(f"{mix}: MiB sent per rank (mean, one layer fwd)")
        for ax in (axes[0][c], axes[1][c]):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("ranks")
            ax.grid(True, which="both", alpha=0.3)
        axes[0][c].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mixes", type=lambda s: s.split(","), default=["pretrain", "prolong"])
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[131072, 524288],
                   help="tokens per rank")
    p.add_argument("--ranks", type=lambda s: [int(x) for x in s.split(",")], default=[8, 32, 128, 512])
    p.add_argument("--eps", type=lambda s: [float(x) for x in s.split(",")], default=[0, 0.05, 0.1, 0.15, 0.2])
    p.add_argument("--widths", type=lambda s: [int(x) for x in s.split(",")], default=[4],
                   help="extra CAD rows at eps 0.1 with these search widths")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--reps", type=int, default=3, help="assign_servers() calls timed per row (best is kept)")
    p.add_argument("--profile", type=Path, default=None,
                   help="JSON from scripts/lab/profile_cad.py: add a section priced in measured time")
    p.add_argument("--profile-interpolate", choices=["time", "rate"], default="rate",
                   help="how the profile is interpolated between grid points (see ProfiledCostModel)")
    p.add_argument("--out", type=Path, default=None, help="markdown file (e.g. bench/cad_simulation.md)")
    p.add_argument("--png", type=Path, default=None, help="plot (default: next to --out)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = simulate(args.mixes, args.tokens, args.ranks, args.eps, args.seed, args.reps, args.widths)
    if args.profile is not None:
        args.profiled_rows = simulate_profiled(args.mixes, args.tokens, args.ranks, args.seed, args.profile,
                                               args.profile_interpolate)
    elapsed = time.perf_counter() - t0
    from hf_longctx.benchmarking import portable_command

    command = portable_command("scripts/lab/simulate_cad.py", sys.argv[1:] if argv is None else argv,
                               Path(__file__).resolve().parents[2])
    text = markdown(rows, args, command, elapsed)
    if args.out:
        args.out.write_text(text)
        png = args.png or args.out.with_suffix(".png")
        plot(rows, png, args.mixes, max(args.tokens))
        print(f"wrote {args.out} and {png}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
