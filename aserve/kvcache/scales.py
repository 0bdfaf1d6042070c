"""Calibrated FP8 KV-cache scales that published checkpoints carry, one K and one V scale a
layer (a stored value is `k / k_scale`). Without them an FP8 cache stores K and V unscaled
(1.0, vLLM's default too): values past 448 saturate, which models with large keys (those
with a K bias, say) reach.

Publishers spell them differently, all meaning the same per-layer scale:
`self_attn.k_scale` / `v_scale` (llm-compressor's `kv_cache_scheme`), `self_attn.kv_scale`
(one for both: early AutoFP8), `self_attn.k_proj.k_scale` / `v_proj.v_scale` (NVIDIA's
ModelOpt) and `self_attn.k_proj.output_scale` / `v_proj.output_scale` (AMD's Quark).
Scales of FP8 queries or attention probabilities (`q_scale`, `prob_scale`) are dropped:
aserve computes both in the model's dtype."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from aserve.kvcache.pool import KVPool
from aserve.layers.weight import read_whole

logger = logging.getLogger(__name__)

_SCALE = re.compile(
    r"layers\.(\d+)\.self_attn\.(?:(?:attn|k_proj|v_proj)\.)?(k|v|kv|q|prob)_scale$"
    r"|layers\.(\d+)\.self_attn\.(k|v)_proj\.output_scale$"
)


class KVScales:
    """Takes the KV-cache scales out of a checkpoint's tensor stream as it is read, and sets
    them on the pool once it exists."""

    def __init__(self) -> None:
        self.k: dict[int, float] = {}
        self.v: dict[int, float] = {}
        self.per_head = False

    def take(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """`weights` without the scale tensors, which are kept here."""
        for name, tensor in weights:
            found = _SCALE.search(name)
            if found is None:
                yield name, tensor
                continue
            layer, kind = found.group(1) or found.group(3), found.group(2) or found.group(4)
            if kind in ("q", "prob"):
                continue
            scale = self._value(name, tensor)
            if kind in ("k", "kv"):
                self.k[int(layer)] = scale
            if kind in ("v", "kv"):
                self.v[int(layer)] = scale

    def _value(self, name: str, tensor: Any) -> float:
        values = read_whole(tensor).float().reshape(-1)
        if values.numel() == 0 or not bool(torch.isfinite(values).all() and (values > 0).all()):
            raise ValueError(f"checkpoint tensor {name} is no KV-cache scale: {values.tolist()}")
        # A scale per KV head: the largest serves them all (nothing saturates; the other
        # heads keep a little less precision).
        self.per_head |= values.numel() > 1
        return float(values.max())

    def apply(self, pool: KVPool) -> None:
        """Set the scales on an FP8 `pool` (before anything is stored); say what was done."""
        layers = len(pool.kv)
        if not pool.scaled:
            if self.k or self.v:
                logger.info(
                    "the checkpoint's FP8 KV-cache scales are unused: the cache is in %s "
                    "(--kv-cache-dtype fp8_e4m3 takes them)",
                    str(pool.storage_dtype).removeprefix("torch."),
                )
            return
        for layer in range(layers):
            pool.set_scales(layer, self.k.get(layer, 1.0), self.v.get(layer, 1.0))
        scaled = set(self.k) | set(self.v)
        if not scaled:
            logger.warning(
                "the FP8 KV cache stores K and V unscaled (scale 1.0): the checkpoint has no "
                "calibrated KV-cache scales, and values past 448 saturate"
            )
        elif len(self.k) < layers or len(self.v) < layers:
            logger.warning(
                "the checkpoint has KV-cache scales for %d of %d layers' K and %d of V: the "
                "others store unscaled (1.0)",
                len(self.k),
                layers,
                len(self.v),
            )
        else:
            logger.info(
                "FP8 KV cache: the checkpoint's scales%s, K %.3g to %.3g, V %.3g to %.3g",
                " (the largest of each layer's per-head ones)" if self.per_head else "",
                min(self.k.values()),
                max(self.k.values()),
                min(self.v.values()),
                max(self.v.values()),
            )
