"""A MoE router's top-k in one Triton kernel: softmax in float32, the k largest, renormalised;
or DeepSeek-V3's sigmoid scores chosen by the scores plus a bias, in one group (GLM-4.5's).

`moe.route` in torch ops is five small kernels a layer (softmax, top-k, sum, divide, cast),
which a decode step of a 48-layer MoE pays 48 times. Here one program a token does all of it:
the k largest found one after another, so the experts come in the same descending order.
Of experts whose probabilities tie (bf16 logits can be equal) it takes the lower one, where
torch's top-k makes a choice of its own: either is a top-k. Imported only on CUDA and under
Triton's interpreter (it imports Triton).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _route_kernel(
    logits_ptr,
    correction_ptr,
    weights_ptr,
    ids_ptr,
    num_experts,
    stride,
    scaling,
    TOP_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SIGMOID: tl.constexpr,
    EXPERTS: tl.constexpr,
    SLOTS: tl.constexpr,
):
    """One token: the TOP_K largest softmax probabilities of its row of logits and their
    experts, in descending order (SLOTS: TOP_K rounded up to a power of two), times `scaling`
    (DeepSeek-V2's `routed_scaling_factor`; 1 elsewhere). With SIGMOID the experts of the
    TOP_K largest sigmoid scores plus `correction`, weighed by the scores alone,
    renormalised as transformers does it (a sum plus 1e-20), times `scaling`."""
    token = tl.program_id(0)
    expert = tl.arange(0, EXPERTS)
    ok = expert < num_experts
    logits = tl.load(logits_ptr + token * stride + expert, mask=ok, other=float("-inf"))
    logits = logits.to(tl.float32)
    if SIGMOID:
        values = 1.0 / (1.0 + tl.exp(-logits))
        left = values + tl.load(correction_ptr + expert, mask=ok, other=0.0)
    else:
        exps = tl.exp(logits - tl.max(logits, axis=0))
        values = exps / tl.sum(exps, axis=0)
        left = values
    left = tl.where(ok, left, float("-inf"))
    slots = tl.arange(0, SLOTS)
    picked = tl.zeros((SLOTS,), dtype=tl.float32)
    picked_ids = tl.zeros((SLOTS,), dtype=tl.int64)
    for slot in tl.static_range(TOP_K):
        best = tl.max(left, axis=0)
        chosen = tl.min(tl.where(left == best, expert, EXPERTS), axis=0)
        value = tl.sum(tl.where(expert == chosen, values, 0.0), axis=0)
        picked = tl.where(slots == slot, value, picked)
        picked_ids = tl.where(slots == slot, chosen.to(tl.int64), picked_ids)
        left = tl.where(expert == chosen, float("-inf"), left)
    if RENORMALIZE:
        if SIGMOID:
            picked = picked / (tl.sum(picked, axis=0) + 1e-20)
        else:
            picked = picked / tl.sum(picked, axis=0)
    picked = picked * scaling
    out = token * TOP_K + slots
    tl.store(weights_ptr + out, picked.to(weights_ptr.dtype.element_ty), mask=slots < TOP_K)
    tl.store(ids_ptr + out, picked_ids, mask=slots < TOP_K)


def route_kernel(
    logits: torch.Tensor,
    top_k: int,
    renormalize: bool,
    correction: torch.Tensor | None = None,
    scaling: float = 1.0,
    dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`moe.route(logits, top_k, renormalize)` in one launch (its weights times `scaling`),
    or with a float32 `correction` `moe.route_deepseek`'s sigmoid choice in one group:
    weights in `dtype` (default logits'), ids int64."""
    tokens, num_experts = logits.shape
    weights = torch.empty(tokens, top_k, dtype=dtype or logits.dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=logits.device)
    _route_kernel[(tokens,)](
        logits,
        logits if correction is None else correction,
        weights,
        ids,
        num_experts,
        logits.stride(0),
        scaling,
        TOP_K=top_k,
        RENORMALIZE=renormalize,
        SIGMOID=correction is not None,
        EXPERTS=triton.next_power_of_2(num_experts),
        SLOTS=triton.next_power_of_2(top_k),
        num_warps=1,
    )
    return weights, ids
