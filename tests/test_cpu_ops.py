"""aserve's CPU kernels for the decoder's small steps (layers/cpu_ops.py) against the layers'
plain PyTorch formulas, which the float path runs and Hugging Face matches op for op."""

from __future__ import annotations

import pytest
import torch

from aserve.layers.cpu_ops import CpuKernels
from aserve.layers.norm import RMSNorm
from aserve.layers.rotary import RotaryEmbedding
from aserve.quant.native import native_kernels

pytestmark = pytest.mark.skipif(
    not native_kernels(), reason="aserve's CPU kernels did not build (no C++ compiler here)"
)
CLOSE = {"rtol": 1e-5, "atol": 1e-5}


def test_norms_match_the_plain_formula() -> None:
    generator = torch.Generator().manual_seed(0)
    plain, fused = RMSNorm(96, 1e-6), RMSNorm(96, 1e-6, CpuKernels())
    weight = torch.rand(96, generator=generator) + 0.5
    plain.weight.data.copy_(weight)
    fused.weight.data.copy_(weight)
    wide = torch.randn(5, 160, generator=generator)
    x = wide[:, 32:128]  # a strided view, as Q and K are in the fused QKV output
    torch.testing.assert_close(fused(x), plain(x), **CLOSE)
    residual = torch.randn(5, 96, generator=generator)
    expected_out, expected_residual = plain.add_and_norm(x.clone(), residual.clone())
    out, new_residual = fused.add_and_norm(x.contiguous(), residual.clone())
    torch.testing.assert_close(new_residual, expected_residual, **CLOSE)
    torch.testing.assert_close(out, expected_out, **CLOSE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_norm_rope_store_matches_the_plain_steps(qk_norm: bool, dtype: torch.dtype) -> None:
    """Q/K norm, RoPE and the KV write in one call against the layers' plain formulas: Q
    rotated in place, K rotated and V as it is at each token's slot of the pool (rounded to
    float16 as torch rounds, for such a pool), K in the QKV output and the other slots
    untouched."""
    generator = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim = 4, 2, 32
    rotary = RotaryEmbedding(head_dim, 128, 10000.0, None)
    q_norm, k_norm = RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6)
    q_norm.weight.data.copy_(torch.rand(head_dim, generator=generator) + 0.5)
    k_norm.weight.data.copy_(torch.rand(head_dim, generator=generator) + 0.5)
    positions = torch.tensor([0, 5, 17, 127, 3])
    wide = torch.randn(5, (heads + 2 * kv_heads) * head_dim + 8, generator=generator)
    qkv = wide[:, : (heads + 2 * kv_heads) * head_dim]  # rows strided, as in the QKV output
    q_size = heads * head_dim
    expected = qkv.clone()
    if qk_norm:
        q_norm.norm_heads(expected[:, :q_size], head_dim)
        k_norm.norm_heads(expected[:, q_size : q_size + kv_heads * head_dim], head_dim)
    rotary(positions, expected[:, : q_size + kv_heads * head_dim], q_size)
    kv_before = qkv[:, q_size:].clone()
    cache = torch.zeros(64, 2, kv_heads, head_dim, dtype=dtype)
    slots = torch.tensor([9, 3, 40, 63, 0])
    q, kv = qkv.split([q_size, 2 * kv_heads * head_dim], -1)
    CpuKernels().norm_rope_store(
        q, kv, positions, rotary.cos_sin, q_norm.weight if qk_norm else None,
        k_norm.weight if qk_norm else None, 1e-6, cache, slots, head_dim,
    )  # fmt: skip
    torch.testing.assert_close(q, expected[:, :q_size], **CLOSE)
    assert torch.equal(qkv[:, q_size:], kv_before)
    stored = expected[:, q_size:].view(5, 2, kv_heads, head_dim)
    # K may differ from the plain steps' in float32's last bit, which can round to the next
    # float16 (2^-11 relative)
    near = CLOSE if dtype == torch.float32 else {"rtol": 2**-10, "atol": 1e-5}
    torch.testing.assert_close(cache[slots].float(), stored.to(dtype).float(), **near)
    assert torch.equal(cache[slots, 1], stored[:, 1].to(dtype))
    others = torch.ones(64, dtype=torch.bool)
    others[slots] = False
    assert not cache[others].any()


def reference_attention(
    q: torch.Tensor,
    pool: torch.Tensor,
    table: torch.Tensor,
    rows: list[int],
    lens: list[int],
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax attention in float64 over each request's slots, K/V heads shared by groups;
    with `sinks`, each head's softmax also over its sink logit, which weighs no value."""
    heads, kv_heads, head_dim = q.shape[1], pool.shape[2], q.shape[2]
    outputs = []
    for i, (row, length) in enumerate(zip(rows, lens)):
        slots = table[row, :length].long()
        k = pool[slots, 0].double().repeat_interleave(heads // kv_heads, dim=1)
        v = pool[slots, 1].double().repeat_interleave(heads // kv_heads, dim=1)
        scores = torch.einsum("hd,thd->ht", q[i].double(), k) / head_dim**0.5
        if sinks is not None:
            scores = torch.cat((scores, sinks.double()[:, None]), -1)
        weights = scores.softmax(-1)[:, :length]
        outputs.append(torch.einsum("ht,thd->hd", weights, v))
    return torch.stack(outputs).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("head_dim", [64, 40], ids=["vectors", "scalar-head"])
@pytest.mark.parametrize("group", [1, 2, 3, 8, 12], ids=lambda g: f"group{g}")
def test_decode_attention_matches_float64_softmax(
    head_dim: int, dtype: torch.dtype, group: int
) -> None:
    """Contexts on both sides of the kernel's 256-position blocks, its passes of 8 / group
    rows and its 128-position pieces (255 to 1,100 are cut in two to nine, joined after),
    scattered slots, a strided query (as Q sits in the fused QKV output), in a float32 and a
    float16 pool; 1 to 12 query heads a KV head (more than 8 take two passes of heads)."""
    generator = torch.Generator().manual_seed(2)
    kv_heads, slots = 2, 4096
    heads = group * kv_heads
    pool = torch.randn(slots, 2, kv_heads, head_dim, generator=generator).to(dtype)
    lens = [1, 7, 8, 9, 255, 256, 257, 700, 1100]
    table = torch.zeros(len(lens) + 2, 1200, dtype=torch.int32)
    order = torch.randperm(slots, generator=generator).to(torch.int32)
    rows = [3, 0, 9, 1, 5, 2, 8, 4, 10]
    first = 0
    for row, length in zip(rows, lens):
        table[row, :length] = order[first : first + length]
        first += length
    qkv = torch.randn(len(lens), (heads + 2 * kv_heads) * head_dim, generator=generator) * 3
    q = qkv[:, : heads * head_dim].view(len(lens), heads, head_dim)
    out = torch.ops.aserve_cpu.decode_attention(
        q, pool, table, torch.tensor(rows), torch.tensor(lens), head_dim**-0.5
    )
    expected = reference_attention(q, pool, table, rows, lens)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_decode_attention_of_a_request_does_not_depend_on_its_batch(dtype: torch.dtype) -> None:
    """Each request's output bit for bit the same alone, in a batch, and at another position
    in the batch: one fixed order of operations per (request, head)."""
    generator = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim = 9, 3, 64
    pool = torch.randn(4096, 2, kv_heads, head_dim, generator=generator).to(dtype)
    lens = [300, 40, 1, 1000]  # the first in three pieces, the last in eight
    table = torch.arange(4 * 1024, dtype=torch.int32).view(4, 1024)
    q = torch.randn(4, heads, head_dim, generator=generator)
    scale = head_dim**-0.5

    def attend(picked: list[int]) -> torch.Tensor:
        return torch.ops.aserve_cpu.decode_attention(
            q[picked], pool, table, torch.tensor(picked), torch.tensor([lens[i] for i in picked]),
            scale,
        )  # fmt: skip

    together = attend([0, 1, 2, 3])
    reversed_batch = attend([3, 2, 1, 0])
    for i in range(4):
        alone = attend([i])[0]
        assert torch.equal(together[i], alone)
        assert torch.equal(reversed_batch[3 - i], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
@pytest.mark.parametrize(
    ("group", "head_dim"), [(3, 64), (12, 64), (2, 40)], ids=["group3", "group12", "scalar-head"]
)
def test_a_prefills_tokens_attend_as_each_would_alone(
    dtype: torch.dtype, group: int, head_dim: int
) -> None:
    """A prefill's new tokens as requests of their own lengths (one page-table row, lengths
    rising by one), which the kernel takes in runs of up to 8 sharing the reads of K: every
    token's output bit for bit its output alone (its decode), beside a lone request and
    across runs cut anywhere, and within float32 rounding of float64 softmax."""
    generator = torch.Generator().manual_seed(4)
    kv_heads = 2
    heads = group * kv_heads
    pool = torch.randn(2048, 2, kv_heads, head_dim, generator=generator).to(dtype)
    table = torch.randperm(2048, generator=generator).to(torch.int32).view(2, 1024).contiguous()
    # a lone request of 90 on row 0, then tokens 250..269 and 600..612 of row 1
    lens = [90, *range(251, 271), *range(601, 614)]
    rows = [0] + [1] * (len(lens) - 1)
    q = torch.randn(len(lens), heads, head_dim, generator=generator)
    scale = head_dim**-0.5

    def attend(picked: list[int]) -> torch.Tensor:
        return torch.ops.aserve_cpu.decode_attention(
            q[picked], pool, table, torch.tensor([rows[i] for i in picked]),
            torch.tensor([lens[i] for i in picked]), scale,
        )  # fmt: skip

    together = attend(list(range(len(lens))))
    for i in range(len(lens)):
        assert torch.equal(attend([i])[0], together[i]), i
    assert torch.equal(attend(list(range(5, 12)))[0], together[5])
    expected = reference_attention(q, pool, table, rows, lens)
    torch.testing.assert_close(together, expected, rtol=1e-5, atol=2e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["float32", "float16"])
def test_sinks_join_each_heads_softmax(dtype: torch.dtype) -> None:
    """gpt-oss's sinks: each head's softmax also sums e^sink (sinks from far below to far
    above the scores), for lone requests cut into pieces and for a prefill's runs of tokens,
    within float32 rounding of float64; none given is the plain softmax."""
    generator = torch.Generator().manual_seed(5)
    kv_heads, group, head_dim = 2, 4, 64
    heads = kv_heads * group
    pool = torch.randn(2048, 2, kv_heads, head_dim, generator=generator).to(dtype)
    table = torch.randperm(2048, generator=generator).to(torch.int32).view(2, 1024).contiguous()
    lens = [1, 300, *range(41, 53)]  # two lone requests of row 0, then a run of row 1
    rows = [0, 0] + [1] * (len(lens) - 2)
    q = torch.randn(len(lens), heads, head_dim, generator=generator)
    sinks = torch.tensor([-30.0, -2.0, 0.0, 0.5, 1.0, 2.0, 4.0, 30.0])
    args = (q, pool, table, torch.tensor(rows), torch.tensor(lens), head_dim**-0.5, 0)
    out = torch.ops.aserve_cpu.decode_attention(*args, sinks)
    expected = reference_attention(q, pool, table, rows, lens, sinks)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=2e-6)
    assert out[:, -1].abs().max() < 1e-6  # a sink far above the scores takes all the weight
    plain = torch.ops.aserve_cpu.decode_attention(*args)
    assert torch.equal(plain, torch.ops.aserve_cpu.decode_attention(*args, None))
    torch.testing.assert_close(plain, reference_attention(q, pool, table, rows, lens))
    with pytest.raises(RuntimeError, match="one a head"):
        torch.ops.aserve_cpu.decode_attention(*args, sinks[:4])


def other_build_attention_operands() -> list[tuple]:
    """Operands of `decode_attention` that another build of the kernels (an x86 one without
    AVX-512, an ARM one under QEMU) attends over to compare bits with this one: float32 and
    float16 pools, 3, 4 and 12 query heads a KV head, heads of 64 and 128 values, contexts in
    one to eight pieces, and a prefill's run of ten tokens beside lone requests."""
    generator = torch.Generator().manual_seed(12)
    operands = []
    kinds = ((torch.float32, 4, 64), (torch.float16, 3, 128), (torch.float16, 12, 64))
    for dtype, group, head_dim in kinds:
        kv_heads = 2
        pool = torch.randn(2048, 2, kv_heads, head_dim, generator=generator).to(dtype)
        table = torch.randperm(2048, generator=generator).to(torch.int32).view(2, 1024).contiguous()
        lens = [300, 9, 1, 1000, *range(251, 261)]
        rows = [0, 0, 0, 0] + [1] * 10
        q = torch.randn(len(lens), group * kv_heads, head_dim, generator=generator)
        operands.append((q, pool, table, torch.tensor(rows), torch.tensor(lens), head_dim**-0.5))
    return operands


def test_decode_attention_refuses_what_it_cannot_read() -> None:
    pool = torch.zeros(16, 2, 1, 8)
    q = torch.zeros(1, 2, 8)
    table = torch.zeros(1, 4, dtype=torch.int32)
    op = torch.ops.aserve_cpu.decode_attention
    with pytest.raises(RuntimeError, match="outside the page table"):
        op(q, pool, table, torch.tensor([0]), torch.tensor([5]), 1.0)
    with pytest.raises(RuntimeError, match="float32 or float16"):
        op(q, pool.bfloat16(), table, torch.tensor([0]), torch.tensor([1]), 1.0)


def test_norm_rope_store_refuses_what_it_cannot_write() -> None:
    """The K/V write's slot and the rope table's row are checked before anything is written."""
    cache = torch.zeros(16, 2, 1, 8)
    q, kv = torch.zeros(1, 16), torch.zeros(1, 16)
    cos_sin = torch.zeros(32, 8)
    ops = CpuKernels()
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.norm_rope_store(
            q, kv, torch.tensor([0]), cos_sin, None, None, 1e-6, cache, torch.tensor([16]), 8
        )
    with pytest.raises(RuntimeError, match="past the rope table"):
        ops.norm_rope_store(
            q, kv, torch.tensor([32]), cos_sin, None, None, 1e-6, cache, torch.tensor([3]), 8
        )
    assert not cache.any()
