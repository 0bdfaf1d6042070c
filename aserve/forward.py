"""ForwardBatch: everything one forward step needs, passed explicitly down the model.

It sits low in the house: attention backends, models, graphs and the sampler read it, and it
imports none of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import torch


class ForwardMode(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    """One step over B requests and T new tokens, flattened request after request.

    `prefix_lens[i]` tokens of request i already have KV in the pool; this step computes
    `extend_lens[i]` more (1 in decode), so its KV length becomes `seq_lens[i]`. Host-side
    lengths and `row_ids` (the page-table rows, `rows` on the device) are plain lists, so
    backends can plan without reading device memory. The per-token inputs are the rows of
    one `[3, T]` tensor (`[4, T]` where sliding-window layers keep their own pages: their
    slots, beside `window_page_table`), so a CUDA graph takes them with one copy;
    `record_index` is where each request's sampled token goes in the token table
    (flattened). Logits are computed at
    `logit_indices`; where that holds more than each request's last token (prompt logprobs),
    `sample_rows` are the rows of those last tokens among them. `halfway`, where set, is
    recorded on the stream once half of the layers are queued (see Scheduler.run).
    In a prefill with images, the tokens at `image_rows` take `image_embeds` (the image
    encoder's features) in place of their ids' embeddings (models/vision.py), and Qwen3-VL's
    `image_layer_embeds[i]` join their hidden states after layer i, and Gemma 3's images
    whose features the chunk computes are `both_ways[i]` (request i's `[first, last)`
    positions, whose queries read the whole block: every backend widens its causal mask
    so); with LoRA adapters, `adapter_ids` `[T]` are each token's adapter (None where no
    token takes one); with Qwen-VL's
    images, `mrope_positions` `[3, T]` are each token's three rotary coordinates
    (models/mrope.py), whose cos/sin rows the model looks up once a step (`rope_rows`).
    """

    mode: ForwardMode
    token_inputs: torch.Tensor
    rows: torch.Tensor
    row_ids: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    seq_lens: list[int]
    logit_indices: torch.Tensor
    record_index: torch.Tensor
    page_table: torch.Tensor
    sample_rows: torch.Tensor | None = None
    window_page_table: torch.Tensor | None = None
    attn_metadata: Any = None
    halfway: torch.cuda.Event | None = None
    image_rows: torch.Tensor | None = None
    image_embeds: torch.Tensor | None = None
    image_layer_embeds: torch.Tensor | None = None
    image_levels: int = 0
    both_ways: list[list[tuple[int, int]]] | None = None
    mrope_positions: torch.Tensor | None = None
    rope_rows: Any = None  # layers/rotary.RopeRows, set by the model from mrope_positions
    adapter_ids: torch.Tensor | None = None  # each token's LoRA adapter (0: none; aserve/lora/)

    @property
    def input_ids(self) -> torch.Tensor:
        return self.token_inputs[0]

    @property
    def out_slots(self) -> torch.Tensor:
        """The KV slot each token's K and V are written to."""
        return self.token_inputs[1]

    @property
    def positions(self) -> torch.Tensor:
        return self.token_inputs[2]

    def slots_of(self, windowed: bool) -> torch.Tensor:
        """`out_slots` of a layer, in the sliding-window pages where `windowed`."""
        return self.token_inputs[3] if windowed else self.token_inputs[1]

    def table_of(self, windowed: bool) -> torch.Tensor:
        """`page_table` of a layer, the sliding-window pages' where `windowed`."""
        if not windowed:
            return self.page_table
        assert self.window_page_table is not None
        return self.window_page_table

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE
