"""Check every CUDA kernel against the fp64 reference, then time them against torch SDPA.

Run on the GPU machine: ``python scripts/check_kernels_gpu.py`` (``--quick`` for a CPU smoke run).
Correctness: bf16 kernels vs the fp64 reference kernel on random packed documents (varlen, GQA,
rows with no visible key, sliding windows), relative error ||x - ref|| / ||ref|| of out, lse, dq, dk, dv below 1e-2.
Timing: causal H=32, D=128 packed batches of 16K..128K tokens (one document and equal-length
documents), forward and forward+backward TFLOP/s of each kernel and of torch SDPA (flash, cuDNN)
on the same tokens as a dense batch. Prints a markdown table last.
"""

from __future__ import annotations

import argparse
import math
import sys
import traceback

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from hf_longctx.benchmarking import attention_tflops, table_header, timed
from hf_longctx.kernels import attention_backward, attention_forward, available_kernels


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    finite = torch.isfinite(ref)
    if not torch.equal(finite, torch.isfinite(x)):
        return float("inf")
    x, ref = torch.where(finite, x, 0), torch.where(finite, ref, 0)
    return ((x - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def correctness(device: str, kernels: list[str]) -> list[str]:
    cases = [  # (name, q lens, k lens, causal, hq, hkv, d, window)
        ("one doc causal", [4096], [4096], True, 16, 4, 128, None),
        ("4 equal docs causal", [1024] * 4, [1024] * 4, True, 8, 8, 64, None),
        ("varlen docs causal", [1, 700, 33, 2000, 129], [1, 700, 33, 2000, 129], True, 8, 2, 128, None),
        ("kv longer than q (bottom-right)", [300, 50], [900, 50], True, 8, 2, 64, None),
        ("q longer than kv: empty rows", [600], [200], True, 8, 8, 128, None),
        ("full block, one doc", [1500], [2500], False, 32, 8, 128, None),
        ("sliding window 256, varlen causal", [1, 700, 33, 2000], [1, 900, 33, 2000], True, 8, 2, 128, 256),
        ("sliding window 1, q longer than kv", [600], [200], True, 8, 8, 64, 1),
        ("window band open to the right", [1500], [2500], False, 8, 2, 128, 300),
    ]
    lines, failures = [], 0
    for name, lq, lk, causal, hq, hkv, d, window in cases:
        g = torch.Generator(device="cpu").manual_seed(len(name))
        q = torch.randn(sum(lq), hq, d, generator=g).to(device)
        k = torch.randn(sum(lk), hkv, d, generator=g).to(device)
        v = torch.randn(sum(lk), hkv, d, generator=g).to(device)
        dout = torch.randn(sum(lq), hq, d, generator=g).to(device)
        cu_q = [0]
        cu_k = [0]
        for a, b in zip(lq, lk):
            cu_q.append(cu_q[-1] + a)
            cu_k.append(cu_k[-1] + b)
        ref = attention_forward(q.double(), k.double(), v.double(), cu_q, cu_k, max(lq), max(lk), causal=causal,
                                kernel="reference", window=window)
        ref_g = attention_backward(dout.double(), q.double(), k.double(), v.double(), *ref, cu_q, cu_k, max(lq),
                                   max(lk), causal=causal, kernel="reference", window=window)
        for kernel in kernels:
            if kernel == "reference":
                continue
            try:
                qb, kb, vb, db = (t.bfloat16() for t in (q, k, v, dout))
                out, lse = attention_forward(qb, kb, vb, cu_q, cu_k, max(lq), max(lk), causal=causal, kernel=kernel,
                                             window=window)
                grads = attention_backward(db, qb, kb, vb, out, lse, cu_q, cu_k, max(lq), max(lk), causal=causal,
                                           kernel=kernel, window=window)
                errs = [rel_err(out, ref[0]), rel_err(lse, ref[1])] + [rel_err(a, b) for a, b in zip(grads, ref_g)]
                ok = all(e < 1e-2 for e in errs)
                failures += not ok
                cells = " | ".join(f"{e:.1e}" for e in errs)
                lines.append(f"| {name} | {kernel} | {cells} | {'ok' if ok else 'FAIL'} |")
            except ValueError as exc:
                lines.append(f"| {name} | {kernel} | not served: {exc} | | | | | skip |")
            except Exception as exc:  # noqa: BLE001 - report and go on: one call checks every kernel
                failures += 1
                lines.append(f"| {name} | {kernel} | ERROR {type(exc).__name__}: {str(exc)[:120]} | | | | | FAIL |")
                traceback.print_exc()
    print("\n| case | kernel | out | lse | dq | dk | dv | verdict |\n|---|---|---|---|---|---|---|---|")
    print("\n".join(lines))
    return [f"correctness failures: {failures}"] if failures else []


def probe_cudnn_native_gqa(device: str) -> None:
    """Does the dense cuDNN op take fewer KV heads than query heads without repeating them?"""
    try:
        g = torch.Generator(device="cpu").manual_seed(0)
        q = torch.randn(1, 16, 1024, 128, generator=g).to(device, torch.bfloat16)
        k = torch.randn(1, 4, 1024, 128, generator=g).to(device, torch.bfloat16)
        v = torch.randn(1, 4, 1024, 128, generator=g).to(device, torch.bfloat16)
        out = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)[0]
        ref = F.scaled_dot_product_attention(q.double(), k.double().repeat_interleave(4, 1),
                                             v.double().repeat_interleave(4, 1), is_causal=True)
        print(f"probe: cuDNN native GQA runs, rel err {rel_err(out, ref):.1e}")
    except Exception as exc:  # noqa: BLE001
        print(f"probe: cuDNN native GQA fails: {type(exc).__name__}: {str(exc)[:200]}")


def _time_kernel(kernel, q, k, v, dout, cu, length, reps):
    def fwd():
        return attention_forward(q, k, v, cu, cu, length, length, kernel=kernel)

    out, lse = fwd()

    def fwd_bwd():
        o, l_ = fwd()
        attention_backward(dout, q, k, v, o, l_, cu, cu, length, length, kernel=kernel)

    return timed(fwd, reps), timed(fwd_bwd, reps)


def _time_sdpa(backend, q, k, v, reps):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    gqa = q.shape[1] != k.shape[1]
    grad = torch.randn_like(q)

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    return timed(fwd, reps), timed(lambda: torch.autograd.backward(fwd(), grad), reps)


def time_case(device, kernels, total, ndocs, hq, hkv, d, reps) -> dict[str, tuple[float, float]]:
    """TFLOP/s (forward, forward+backward) of every kernel on one packed batch of equal-length documents."""
    length = total // ndocs
    flops = 2 * ndocs * length * length * hq * d  # causal forward
    g = torch.Generator(device="cpu").manual_seed(total + ndocs)
    q = torch.randn(total, hq, d, generator=g).to(device, torch.bfloat16)
    k = torch.randn(total, hkv, d, generator=g).to(device, torch.bfloat16)
    v = torch.randn(total, hkv, d, generator=g).to(device, torch.bfloat16)
    dout = torch.randn_like(q)
    cu = [i * length for i in range(ndocs + 1)]
    results = {}
    for kernel in [name for name in kernels if name != "reference"] + ["auto"]:
        try:
            t_f, t_fb = _time_kernel(kernel, q, k, v, dout, cu, length, reps)
            results[kernel] = attention_tflops(flops, t_f, t_fb)
        except ValueError:
            continue
        except Exception as exc:  # noqa: BLE001 - one call checks every kernel; report and go on
            print(f"timing {kernel} {total} {ndocs} {hkv}: {type(exc).__name__}: {str(exc)[:200]}")
    dense = [t.view(ndocs, length, t.shape[1], d).transpose(1, 2) for t in (q, k, v)]
    for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION), ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
        try:
            t_f, t_fb = _time_sdpa(backend, *dense, reps)
            results[name] = attention_tflops(flops, t_f, t_fb)
        except Exception as exc:  # noqa: BLE001
            print(f"timing {name} {total} {ndocs} {hkv}: {type(exc).__name__}: {str(exc)[:200]}")
    return results


COLUMNS = ("fa4", "cudnn_varlen", "cudnn", "torch_flash", "auto", "sdpa_flash", "sdpa_cudnn")


def timing(device: str, kernels: list[str], sizes: list[int], reps: int, hq=32, d=128) -> list[str]:
    rows, problems = [], []
    for total in sizes:
        for ndocs in (1, 4, 16):
            for hkv in (hq // 4, hq):
                results = time_case(device, kernels, total, ndocs, hq, hkv, d, reps)
                best = max((results[n][1] for n in ("sdpa_flash", "sdpa_cudnn") if n in results), default=math.nan)
                auto = results.get("auto", (math.nan, math.nan))[1]
                cells = " | ".join(f"{results[n][0]:.0f} / {results[n][1]:.0f}" if n in results else "-"
                                   for n in COLUMNS)
                rows.append(f"| {total // 1024}K | {ndocs} | {hkv} | {cells} | {auto / best:.2f} |")
                print(rows[-1], flush=True)
    print("\n" + table_header(["tokens", "docs", "kv heads", *COLUMNS, "auto / best sdpa (fwd+bwd)"]))
    print("\n".join(rows))
    print("cells: forward / forward+backward TFLOP/s (causal FLOPs 2*L^2*H*D per document forward, x3.5 fwd+bwd)")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, any device (smoke test)")
    parser.add_argument("--sizes", default="16384,32768,65536,131072")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kernels = available_kernels(device)
    print(f"device {device} {torch.cuda.get_device_name() if device == 'cuda' else ''} torch {torch.__version__} "
          f"kernels {kernels}")
    problems = correctness(device, kernels) if device == "cuda" else []
    if device == "cuda":
        probe_cudnn_native_gqa(device)
    sizes = [256] if args.quick else [int(s) for s in args.sizes.split(",")]
    problems += timing(device, kernels, sizes, 2 if args.quick else args.reps, hq=4 if args.quick else 32,
                       d=16 if args.quick else 128)
    print("\n".join(problems) or "all checks passed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
