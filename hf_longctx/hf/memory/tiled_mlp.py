"""Tiled MLP: each decoder layer's MLP runs over the sequence in chunks, so its intermediate
activations never exist for the whole sequence.

Why. A Llama MLP is ``down(act(gate(x)) * up(x))``. Its intermediates are T x intermediate_size
each: for a Llama-3-8B layer (14336) at 256K tokens per GPU that is 7 GiB per tensor in bf16, and
autograd keeps four of them (gate, up, act(gate), their product) for backward. Layer checkpointing
does not help at the peak: the recompute in backward materialises them again, all at once. The MLP
is per token, so chunks of tokens are independent: run them one at a time and the peak is
chunk x intermediate_size (the idea of DeepSpeed ALST's "TiledMLP"; this is our own code).

How. :class:`_TiledMLPFunction` is one ``torch.autograd.Function`` per MLP call taking the hidden
states AND the MLP's parameters as inputs. Forward runs the wrapped module chunk by chunk under
``no_grad`` and saves only ``x``. Backward recomputes one chunk at a time with grad enabled and
asks ``torch.autograd.grad`` for that chunk's dx and parameter gradients; parameter gradients are
summed over chunks and RETURNED from the Function, so autograd accumulates each parameter's
``.grad`` exactly once per backward. That is what DDP's reducer, FSDP and DeepSpeed need: their
hooks fire per accumulation and expect one per parameter per step (calling ``.backward()`` per
chunk inside backward would fire them once per chunk). Cost: one more MLP forward per layer step
(two with layer checkpointing, as DeepSpeed's TiledMLP), ~1/3 of the MLP's forward+backward FLOPs.

State-dict keys do not change. :class:`TiledMLP` is an :class:`~hf_longctx.wrapping.InPlaceWrapper`:
it does not hold the wrapped MLP as a child (that would rename ``layers.0.mlp.gate_proj.weight`` to
``layers.0.mlp.mlp.gate_proj.weight``); it shares the wrapped module's parameter, buffer and
child-module registries instead. So
``named_parameters()``, ``state_dict()``, ``load_state_dict()``, ``get_submodule()`` and attribute
access (``layer.mlp.gate_proj``) are exactly those of the untiled model: checkpoints saved with or
without tiling load either way, and everything that names parameters (optimizer groups,
weight-decay lists, tensor-parallel plans, PEFT target modules) keeps working. ``.to()``,
``load_state_dict(assign=True)`` or FSDP replacing a parameter go through the shared registries, so
the wrapped module always sees the current tensors. Not carried over: state-dict hooks or a custom
``_load_from_state_dict`` registered on the wrapped module itself (transformers' MLPs have none).

Requirements on the wrapped module: per-token (row i of the output depends only on row i of the
input: dense MLPs; not MoE blocks with capacity limits or router-logit side outputs), deterministic
(no dropout: backward recomputes), called with the hidden states alone, returning one tensor.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import nn

from ...wrapping import InPlaceWrapper

DEFAULT_CHUNK_TOKENS = 16384
"""Tokens per chunk. Llama-3-8B: 16384 x 14336 x 2 bytes = 448 MiB per intermediate (bf16), and the
GEMMs (16384 x 4096 x 14336) are still large enough to run at full speed on an H100/H200."""


def chunk_spans(length: int, max_rows: int) -> list[tuple[int, int]]:
    """(start, rows) of ``ceil(length / max_rows)`` chunks of balanced size (differing by at most one row).

    Balanced rather than ``max_rows`` and a remainder: the same bound on the peak, no tiny last GEMM.
    """
    if length <= 0:
        return []
    n = math.ceil(length / max(1, max_rows))
    base, extra = divmod(length, n)
    spans, start = [], 0
    for i in range(n):
        rows = base + (1 if i < extra else 0)
        spans.append((start, rows))
        start += rows
    return spans


def _run_chunks(module: nn.Module, x: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """``module`` applied to each span of ``x`` along dim -2, written into one output tensor."""
    out = None
    for start, rows in spans:
        xc = x.narrow(-2, start, rows)
        y = module(xc)
        if not isinstance(y, torch.Tensor) or y.shape[:-1] != xc.shape[:-1]:
            got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
            raise TypeError(f"TiledMLP needs a per-token module returning one tensor (..., T, H_out) for input "
                            f"(..., T, H); {type(module).__name__} returned {got} for {tuple(xc.shape)}")
        if out is None:
            out = y.new_empty((*y.shape[:-2], x.shape[-2], y.shape[-1]))
        out.narrow(-2, start, rows).copy_(y)
    return out


def _autocast_context(device_type: str):
    """Re-creates the forward's autocast state for the recompute in backward (as torch.utils.checkpoint does)."""
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return lambda: torch.autocast(device_type, dtype=dtype)
    return contextlib.nullcontext


class _TiledMLPFunction(torch.autograd.Function):
    """y = module(x) chunk by chunk; saves x only; returns (dx, *dparams) with dparams summed over chunks."""

    @staticmethod
    def forward(ctx, module: nn.Module, spans: list[tuple[int, int]], x: torch.Tensor, *params: torch.Tensor):
        with torch.no_grad():
            out = _run_chunks(module, x, spans)
        ctx.module, ctx.spans = module, spans
        # Parameters are persistent leaves: keep references rather than saved tensors, so activation
        # offloading (saved_tensors_hooks such as save_on_cpu) never copies weights.
        ctx.params = params
        ctx.autocast = _autocast_context(x.device.type)
        ctx.save_for_backward(x)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        (x,) = ctx.saved_tensors
        module, params = ctx.module, ctx.params
        current = tuple(module.parameters())
        if len(current) != len(params) or any(a is not b for a, b in zip(current, params)):
            raise RuntimeError(
                f"the parameters of the tiled {type(module).__name__} were replaced between forward and backward; "
                "TiledMLP recomputes in backward with the module's current parameters and needs the same tensors "
                "as in forward (do not swap parameter objects during a step, or disable tiled MLP)"
            )
        need_x = ctx.needs_input_grad[2]
        wanted = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + i]]
        dx = torch.zeros_like(x) if need_x else None
        acc: list[torch.Tensor | None] = [None] * len(params)
        for start, rows in ctx.spans:
            xc = x.narrow(-2, start, rows).detach().requires_grad_(need_x)
            with torch.enable_grad(), ctx.autocast():
                y = module(xc)
            inputs = ([xc] if need_x else []) + [params[i] for i in wanted]
            grads = torch.autograd.grad(y, inputs, grad_out.narrow(-2, start, rows), allow_unused=True)
            if need_x:
                if grads[0] is not None:
                    dx.narrow(-2, start, rows).copy_(grads[0])
                grads = grads[1:]
            for i, g in zip(wanted, grads):
                if g is None:
                    continue
                if acc[i] is None:
                    # a copy (never a view of grad_out) in at least float32: reduced-precision gradients
                    # are summed over chunks in float32 and rounded once, as a single GEMM would
                    acc[i] = g.to(torch.promote_types(g.dtype, torch.float32), copy=True)
                else:
                    acc[i].add_(g)
        dparams = [None if a is None else a.to(p.dtype) for a, p in zip(acc, params)]
        return None, None, dx, *dparams


class TiledMLP(InPlaceWrapper):
    """Runs a per-token MLP over the sequence in chunks; same outputs and gradients, bounded activations.

    The wrapped module's parameters, buffers and submodules are this module's own (shared registries,
    not a child), so state-dict keys and parameter names are those of the untiled model: see the
    module docstring. Give ``chunk_tokens`` (tokens per chunk, counted over the batch; default
    :data:`DEFAULT_CHUNK_TOKENS`) or ``num_chunks`` (chunks per call), not both. Chunks split the
    sequence dimension (-2) of (B, T, H) or (T, H) hidden states into pieces of balanced size.
    """

    def __init__(self, mlp: nn.Module, chunk_tokens: int | None = None, num_chunks: int | None = None):
        if isinstance(mlp, TiledMLP):
            raise TypeError("this MLP is already tiled; change its chunk_tokens / num_chunks instead")
        for name, sub in mlp.named_modules():
            if isinstance(sub, nn.modules.dropout._DropoutNd) and sub.p > 0:
                raise ValueError(f"TiledMLP recomputes the MLP in backward, so dropout ({name or 'the MLP'}, "
                                 f"p={sub.p}) would draw a different mask; set the MLP's dropout to 0")
            if getattr(sub, "group_size", 1) > 1 and hasattr(sub, "expert_start"):
                # ranks with different token counts would run different numbers of chunks, each a collective
                raise ValueError(f"{name} runs expert-parallel collectives, which TiledMLP's per-rank chunks "
                                 "would leave unmatched; tile it with apply_expert_parallel(..., chunk_tokens=N)")
        super().__init__(mlp)  # shares mlp's registries: keys stay those of the untiled model
        self.chunk_tokens: int | None = None
        self.num_chunks: int | None = None
        self.set_chunking(chunk_tokens, num_chunks)

    @property
    def mlp(self) -> nn.Module:
        """The wrapped MLP (shares this module's parameters; not a registered child)."""
        return self._wrapped

    def set_chunking(self, chunk_tokens: int | None = None, num_chunks: int | None = None) -> None:
        """Tokens per chunk, or chunks per call (exactly one; neither means :data:`DEFAULT_CHUNK_TOKENS`)."""
        if chunk_tokens is not None and num_chunks is not None:
            raise ValueError("give chunk_tokens or num_chunks, not both")
        if chunk_tokens is None and num_chunks is None:
            chunk_tokens = DEFAULT_CHUNK_TOKENS
        for name, value in (("chunk_tokens", chunk_tokens), ("num_chunks", num_chunks)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        self.chunk_tokens, self.num_chunks = chunk_tokens, num_chunks

    def spans(self, x: torch.Tensor) -> list[tuple[int, int]]:
        """The (start, rows) chunks of ``x`` along its sequence dimension (-2)."""
        length = x.shape[-2]
        if self.num_chunks is not None:
            return chunk_spans(length, math.ceil(length / self.num_chunks))
        tokens_per_row = math.prod(x.shape[:-2])  # a chunk of r rows holds r x batch tokens
        return chunk_spans(length, self.chunk_tokens // max(1, tokens_per_row))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"TiledMLP takes (..., T, H) hidden states, got shape {tuple(x.shape)}")
        spans = self.spans(x)
        if not spans:  # no tokens
            return self._wrapped(x)
        params = tuple(self._wrapped.parameters())
        if any(hasattr(p, "ds_id") for p in params):
            # ZeRO-3 frees a partitioned weight after each forward; the chunked backward would read it
            raise ValueError("tiled MLP does not work with DeepSpeed ZeRO-3 parameter partitioning; "
                             "use ZeRO-2 (or ZeRO-1) with tiled_mlp, or set tiled_mlp: 0")
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params)):
            return _TiledMLPFunction.apply(self._wrapped, spans, x, *params)
        return _run_chunks(self._wrapped, x, spans)  # no graph wanted: chunking still bounds the peak

    def extra_repr(self) -> str:
        if self.num_chunks is not None:
            return f"num_chunks={self.num_chunks}, wraps={type(self._wrapped).__name__}"
        return f"chunk_tokens={self.chunk_tokens}, wraps={type(self._wrapped).__name__}"


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    """``layers`` of a transformers decoder: model.model.layers, model.layers, or get_decoder().layers."""
    candidates = [getattr(model, "model", None), model]
    get_decoder = getattr(model, "get_decoder", None)
    if callable(get_decoder):
        with contextlib.suppress(Exception):
            candidates.append(get_decoder())
    for owner in candidates:
        layers = getattr(owner, "layers", None) if isinstance(owner, nn.Module) else None
        if isinstance(layers, nn.ModuleList) and len(layers) > 0 and all(
            isinstance(getattr(layer, "mlp", None), nn.Module) for layer in layers
        ):
            return layers
    raise ValueError(
        f"enable_tiled_mlp needs a transformers Llama-family model whose decoder layers are at "
        f"model.model.layers[i] with an .mlp module; {type(model).__name__} has none. Wrap the MLP modules "
        f"yourself: layer.mlp = hf_longctx.hf.TiledMLP(layer.mlp, chunk_tokens=...)"
    )


def enable_tiled_mlp(model: nn.Module, chunk_tokens: int | None = None, num_chunks: int | None = None) -> int:
    """Replace ``layer.mlp`` of every decoder layer by a :class:`TiledMLP` around it; returns how many changed.

    Module instances are replaced, no transformers class is patched. Idempotent: an already tiled
    layer is left alone, or only has its chunking updated (and counts as changed) when it differs.
    Parameter names and state-dict keys do not change, so this can run before or after loading
    weights, and before creating the optimizer or wrapping in DDP/FSDP.
    """
    changed = 0
    for layer in _decoder_layers(model):
        if isinstance(layer.mlp, TiledMLP):
            before = (layer.mlp.chunk_tokens, layer.mlp.num_chunks)
            layer.mlp.set_chunking(chunk_tokens, num_chunks)
            changed += (layer.mlp.chunk_tokens, layer.mlp.num_chunks) != before
        else:
            layer.mlp = TiledMLP(layer.mlp, chunk_tokens, num_chunks)
            changed += 1
    return changed


def disable_tiled_mlp(model: nn.Module) -> int:
    """Put the original MLP modules back (same parameters); returns the number of layers changed."""
    changed = 0
    for layer in _decoder_layers(model):
        if isinstance(layer.mlp, TiledMLP):
            layer.mlp = layer.mlp.mlp
            changed += 1
    return changed
