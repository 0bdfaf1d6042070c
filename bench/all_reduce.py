"""NCCL against the one-shot all-reduce over symmetric memory, per message size, on N GPUs;
then the all-reduce + residual add + RMSNorm of a decode step, separate against fused.

    python bench/all_reduce.py --tp 2

Each rank runs 20 calls inside a CUDA graph (as decode does) and rank 0 prints microseconds
per call. `one_shot.MAX_BYTES`, the size up to which aserve takes the one-shot path, comes
from the first table. The second times, at hidden size 4096 in bf16, the one-shot
all-reduce followed by FlashInfer's fused add+RMSNorm against the one fused kernel
(`distributed/fused_norm.py`), and stops with an error if their results differ by more than
bf16 rounding.
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from aserve.distributed.group import TPGroup, connect_store, create_store, join_group  # noqa: E402
from aserve.distributed.one_shot import OneShotAllReduce  # noqa: E402
from bench.common import us_per_call_in_graph  # noqa: E402

SIZES_KIB = (8, 32, 128, 256, 512, 1024, 2048)
TOKENS = (1, 2, 8, 32, 128, 256)
HIDDEN = 4096
REPLAYS = 20
TIMEOUT = timedelta(seconds=120)


def measure(store: Any, rank: int, size: int) -> list[tuple[int, float, float]]:
    """Join the group as `rank` and time both paths at every size (a collective call)."""
    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    group = join_group(store, rank, size, device, TIMEOUT, one_shot=False)
    fast = OneShotAllReduce.open(
        store, group.device_group, rank, size, device, max_bytes=max(SIZES_KIB) * 1024
    )
    rows = []
    for kib in SIZES_KIB:
        x = torch.randn(kib * 512, dtype=torch.bfloat16, device=device)
        nccl = us_per_call_in_graph(lambda x=x: group.device_group.allreduce([x]).wait(), REPLAYS)
        one_shot = us_per_call_in_graph(lambda x=x: fast.all_reduce(x), REPLAYS)
        rows.append((kib, nccl, one_shot))
    return rows, add_norm_rows(group, fast, rank, device)


def add_norm_rows(
    group: TPGroup, fast: OneShotAllReduce, rank: int, device: torch.device
) -> list[tuple[int, float, float]]:
    """(tokens, separate us, fused us) at each of TOKENS; checks the fused results first."""
    import flashinfer

    fused = fast.open_add_norm()
    torch.cuda.synchronize()
    group.agree_min(1)  # a barrier: every rank's -0.0 markers are in place before any sends
    generator = torch.Generator(device).manual_seed(rank)
    weight = torch.rand(HIDDEN, device=device, dtype=torch.bfloat16) + 0.5
    rows = []
    for tokens in TOKENS:
        x = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16, generator=generator)
        residual = torch.randn_like(x)
        summed = fast.all_reduce(x)
        assert summed is not None
        expected = residual.float() + summed.float()
        result = fused(x, residual.clone(), weight, 1e-5)
        assert result is not None
        normed, new_residual = result
        reference = torch.nn.functional.rms_norm(expected, (HIDDEN,), weight.float(), 1e-5)
        torch.testing.assert_close(new_residual.float(), expected, rtol=0.01, atol=0.02)
        torch.testing.assert_close(normed.float(), reference, rtol=0.02, atol=0.05)

        def separate(x: torch.Tensor = x, residual: torch.Tensor = residual) -> None:
            summed = fast.all_reduce(x)
            assert summed is not None
            flashinfer.fused_add_rmsnorm(summed, residual, weight, 1e-5)

        rows.append(
            (
                tokens,
                us_per_call_in_graph(separate, REPLAYS),
                us_per_call_in_graph(lambda x=x, r=residual: fused(x, r, weight, 1e-5), REPLAYS),
            )
        )
    return rows


def follower(rank: int, size: int, port: int) -> None:
    measure(connect_store(port, size, TIMEOUT), rank, size)
    os._exit(0)  # NCCL's teardown after graph capture may not return (engine/followers.py)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tp", type=int, default=2)
    args = p.parse_args()
    store = create_store(args.tp, TIMEOUT)
    context = torch.multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=follower, args=(rank, args.tp, store.port))
        for rank in range(1, args.tp)
    ]
    for worker in workers:
        worker.start()
    rows, add_norm = measure(store, 0, args.tp)
    print(f"all-reduce of bf16, {args.tp} GPUs, us per call (CUDA graph of {REPLAYS})")
    print(f"{'KiB':>6} {'NCCL':>8} {'one-shot':>9}")
    for kib, nccl, one_shot in rows:
        print(f"{kib:>6} {nccl:>8.1f} {one_shot:>9.1f}")
    print(f"all-reduce + residual add + RMSNorm, hidden {HIDDEN}, bf16, us per call")
    print(f"{'tokens':>6} {'separate':>9} {'fused':>8}")
    for tokens, separate, fused in add_norm:
        print(f"{tokens:>6} {separate:>9.1f} {fused:>8.1f}")
    for worker in workers:
        worker.join(60)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
