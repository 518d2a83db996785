"""A ``longctx_*`` model without a sequence-parallel batch: exact attention in this process alone.

Why it exists beside :func:`hf_longctx.backends.segment_attention` (which it calls) and the backend ``local``: both
take documents already known, as segment boundaries or a shard plan; a model call that no batch was sharded for
brings transformers' own description of them instead, in one of three forms, and with a KV cache queries that are
only the last tokens of each row. :func:`unsharded_attention` turns that into segments.

Evaluation, ``generate()``, a padded batch or plain single-process training reach the attention
function with no ``longctx`` context. The documents are then found from what transformers and TRL
hand every attention function, in this order:

1. ``cu_seq_lens_q`` / ``cu_seq_lens_k`` (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``,
   TRL's padding-free collator): used as given;
2. a 2-D ``attention_mask`` (:func:`padding_mask` passes it through): padding tokens are dropped and
   every row is one sequence (transformers' sdpa, eager and flash paths do not look for packed
   documents when a mask is given, and neither does this);
3. ``position_ids`` (a packed batch): a new document wherever a position is not the previous one + 1,
   transformers' rule (:func:`~hf_longctx.layout.document_starts`); positions need not start at 0.

With a KV cache the queries are the last tokens of each row, so a segment has fewer queries than
keys and the kernels' bottom-right causal mask is exactly the decoding mask. Padded query rows get a
zero output (nothing reads them). The attention runs through
:func:`~hf_longctx.backends.segment_attention`: no process group is touched, so this works in any
process of a distributed run.
"""

from __future__ import annotations

import torch

from ...backends import segment_attention
from ...layout import document_starts
from .model_support import reads_dense_mask

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)


def match_dtypes(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in one dtype: the autocast dtype under autocast, else they must already agree.

    Under ``torch.autocast`` with float32 weights the projections return the autocast dtype but RoPE
    returns q and k in float32; SDPA and transformers' flash path cast to the autocast dtype, and so
    does this (the kernels then accumulate in float32 as always). Outside autocast mixed dtypes mean
    a half-cast model, which is an error worth stating.
    """
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):
        target = torch.get_autocast_dtype(device_type)
        query, key, value = (t.to(target) if t.dtype in _CASTABLE and t.dtype != target else t
                             for t in (query, key, value))
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(
            f"hf_longctx attention got q {query.dtype}, k {key.dtype}, v {value.dtype} outside autocast: cast the "
            "whole model to one dtype (model.to(torch.bfloat16)) or run it under torch.autocast (Trainer: bf16=True)"
        )
    return query, key, value


def without_autocast(like: torch.Tensor):
    """Autocast off for the kernels: they take q, k, v in one dtype and accumulate in float32 on purpose.

    Left on, autocast would run the reference kernel's float32 products in bf16 again.
    """
    return torch.autocast(like.device.type, enabled=False)


def padding_mask(batch_size: int, q_length: int, kv_length: int, *args, attention_mask=None, mask_function=None,
                 config=None, **kwargs):
    """Mask function of ``longctx_*``: what the attention function needs to know of transformers' mask, as a
    (B, kv) tensor of document ids (0: padding), or None when every row is one sequence.

    No (q x kv) mask is ever built: causality and windows come from the kernels. A 2-D ``attention_mask``
    (padding) is passed on as it is (sliced from the right, as a sliding cache does); even an all-ones one,
    since its presence alone tells transformers not to split the rows into packed documents. Without a
    mask, the documents transformers found (packed ``position_ids`` with ``use_cache=False``, chunked
    attention) are read off its own ``mask_function``: a new document starts at every token that may not
    see the token before it. This is what the attention function cannot see when a model does not hand
    it ``position_ids``.
    """
    reason = reads_dense_mask(config)
    if reason is not None:
        raise ValueError(f"{type(config).__name__}: {reason}; use attn_implementation='eager' (or 'sdpa' where the "
                         "model has it)")
    if attention_mask is not None and attention_mask.dim() == 2:
        return attention_mask[:, -kv_length:]
    if attention_mask is not None or mask_function is None or q_length != kv_length or kv_length < 2:
        return None
    device = kwargs.get("device") or "cpu"
    q_idx = torch.arange(1, kv_length, device=device)
    rows = torch.arange(batch_size, device=device)[:, None]
    sees_previous = torch.as_tensor(mask_function(rows, torch.zeros_like(rows), q_idx[None, :], q_idx[None, :] - 1),
                                    device=device).expand(batch_size, kv_length - 1)
    if bool(sees_previous.all()):
        return None
    starts = torch.cat([torch.ones(batch_size, 1, dtype=torch.long, device=device), (~sees_previous).long()], dim=1)
    return starts.cumsum(1)  # document 1, 2, ... of each row


def _segments(batch: int, sq: int, sk: int, mask: torch.Tensor | None, position_ids: torch.Tensor | None):
    """Row indices of the kept queries and keys (into the flattened (B*S) tensors) and their cu_seqlens.

    ``mask`` (B, >= sk) holds 0 at padding and a document id elsewhere (a 0/1 padding mask: one document
    per row); without it, documents come from ``position_ids`` when there is no cache.
    """
    q_rows, k_rows, cu_q, cu_k = [], [], [0], [0]
    for b in range(batch):
        if mask is None:
            ids = torch.ones(sk, dtype=torch.long, device=position_ids.device if position_ids is not None else None)
            q_span = (sk - sq, sk)
            if sq == sk and position_ids is not None:  # packed documents, no cache, no mask
                pos = position_ids[b if position_ids.shape[0] > 1 else 0]
                starts = torch.zeros(sk, dtype=torch.long, device=pos.device)
                starts[document_starts(pos)] = 1
                ids = starts.cumsum(0)
        else:
            row = mask[b].long()
            ids = torch.zeros(sk, dtype=torch.long, device=row.device)
            ids[: row.shape[0]] = row  # keys past the mask (static cache slots) are empty
            q_span = (row.shape[0] - sq, row.shape[0])
        keys = torch.nonzero(ids).flatten()
        queries = keys[(keys >= q_span[0]) & (keys < q_span[1])]
        if queries.numel() == 0:
            continue
        key_ids = ids[keys]
        bounds = [0] + (torch.nonzero(key_ids[1:] != key_ids[:-1]).flatten() + 1).tolist() + [keys.numel()]
        if len(bounds) > 2 and sq != sk:
            raise ValueError("a KV cache over several documents of one row: decode one document per row")
        if sq == sk:
            for a, z in zip(bounds, bounds[1:]):
                cu_q.append(cu_q[-1] + z - a)
                cu_k.append(cu_k[-1] + z - a)
            q_rows.append(keys + b * sq)
            k_rows.append(keys + b * sk)
        else:
            cu_q.append(cu_q[-1] + queries.numel())
            cu_k.append(cu_k[-1] + keys.numel())
            q_rows.append(queries - q_span[0] + b * sq)
            k_rows.append(keys + b * sk)
    return q_rows, k_rows, cu_q, cu_k


def unsharded_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    position_ids: torch.Tensor | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    kernel: str = "auto",
    window: int | None = None,
    causal: bool = True,
    one_document_only: str | None = None,
) -> torch.Tensor:
    """HF-layout (B, H, S, D) q/k/v -> (B, Sq, Hq, D) exact attention per document (module docstring).

    ``causal=False`` (a layer whose module says ``is_causal = False``): every query sees every key of its
    document (and, with a KV cache, every cached key). ``one_document_only``: the reason this model
    cannot take packed documents (see :mod:`.model_support`); a row of several documents then raises.
    """
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"longctx_* attention takes a 2-D padding mask (or none), got a {attention_mask.dim()}-D mask: custom "
            "attention masks are not supported; pass position_ids restarting per document for packed sequences"
        )
    batch, hq, sq, dim = query.shape
    sk = key.shape[2]
    q = query.transpose(1, 2).reshape(batch * sq, hq, dim)
    k = key.transpose(1, 2).reshape(batch * sk, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(batch * sk, value.shape[1], value.shape[-1])
    run = {"softmax_scale": scaling, "kernel": kernel, "window": window, "causal": causal}
    if attention_mask is None and cu_seq_lens_q is not None and cu_seq_lens_k is not None and batch == 1:
        cu_q, cu_k = cu_seq_lens_q.tolist(), cu_seq_lens_k.tolist()
        if cu_q[-1] == sq and cu_k[-1] == sk:
            if one_document_only and len(cu_q) > 2:
                raise ValueError(f"this batch packs several documents in a row, but {one_document_only}; give each "
                                 "document a row of its own (padded), or use attn_implementation='sdpa'")
            return segment_attention(q, k, v, cu_q, cu_k, **run).view(batch, sq, hq, dim)
    q_rows, k_rows, cu_q, cu_k = _segments(batch, sq, sk, attention_mask, position_ids)
    if one_document_only and len(cu_q) - 1 > len(q_rows):
        raise ValueError(f"this batch packs several documents in a row, but {one_document_only}; give each document a "
                         "row of its own (padded), or use attn_implementation='sdpa'")
    if len(q_rows) == batch and cu_q[-1] == batch * sq and cu_k[-1] == batch * sk:  # nothing dropped
        return segment_attention(q, k, v, cu_q, cu_k, **run).view(batch, sq, hq, dim)
    out = q.new_zeros(q.shape)
    if q_rows:
        qi, ki = torch.cat(q_rows).to(q.device), torch.cat(k_rows).to(k.device)
        kept = segment_attention(q[qi], k[ki], v[ki], cu_q, cu_k, **run)
        out = out.index_copy(0, qi, kept.to(out.dtype))
    return out.view(batch, sq, hq, dim)
