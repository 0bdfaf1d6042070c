"""The image side of a vision-language checkpoint: pixels in, one embedding a position of
the prompt that the image takes out. aserve runs the language model with its own layers and
leaves the encoder to transformers' own modules (the base model's `get_image_features`: the
vision tower, the layer and tokens its config selects, the projector), so the features are
transformers' to the bit on the same device and dtype.

Images run where the language model attends to them causally (`IMAGE_ARCHITECTURES`):
LLaVA over a CLIP or SigLIP tower, whose every image takes one fixed number of positions;
Pixtral's tower (Mistral Small 3.1, Pixtral 12B), whose image takes a feature a cell of its
grid, each row of cells closed by a row-break token and the last by an image-end token
(`ImageEncoder.layout`); and Qwen2-VL, Qwen2.5-VL and Qwen3-VL, whose image takes a feature
a 2 x 2 block of its patches, each at three rotary coordinates (models/mrope.py). Qwen3-VL's
tower also gives features of some of its inner layers ("DeepStack"), which the language
model adds to the image positions' hidden states after its first layers. Gemma 3's image
takes a fixed number of positions between its start and end tokens (and the blank lines
its processor writes around them), whose features attend to each other both ways
(`ImageSpan.both_ways`: every attention backend widens its causal mask over them, and the
planner never cuts them between chunks).
"""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from aserve.models.multimodal import VISION_PARTS

IMAGE_ARCHITECTURES = {
    "Gemma3ForConditionalGeneration": "Gemma3Model",
    "LlavaForConditionalGeneration": "LlavaModel",
    "Mistral3ForConditionalGeneration": "Mistral3Model",
    "Qwen2VLForConditionalGeneration": "Qwen2VLModel",
    "Qwen2_5_VLForConditionalGeneration": "Qwen2_5_VLModel",
    "Qwen3VLForConditionalGeneration": "Qwen3VLModel",
    "Qwen3VLMoeForConditionalGeneration": "Qwen3VLMoeModel",
}
"""Vision-language architectures whose images aserve runs -> transformers' base model class,
whose `get_image_features` encodes them."""
PATCH_ARCHITECTURES = (
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
)
"""Qwen-VL: the image processor gives an image's patches, flattened, and their grid (time,
height, width); the tower merges 2 x 2 patches a feature; the language model places each
feature at three position coordinates (models/mrope.py)."""
BOTH_WAYS_ARCHITECTURES = ("Gemma3ForConditionalGeneration",)
"""Whose image features attend to each other both ways (transformers' "blockwise" mask):
each image's features are computed in one chunk, their queries reading the whole image."""
FIXED_TOWERS = ("clip_vision_model", "siglip_vision_model")
"""Vision towers whose every image takes one fixed number of positions."""
GRID_TOWERS = ("pixtral",)
"""Vision towers that take an image at its own size, one feature a grid cell."""
IMAGE_TOWERS = FIXED_TOWERS + GRID_TOWERS
GRID_TOKENS = ("[IMG_BREAK]", "[IMG_END]")
"""What transformers' Pixtral processor names the tokens that close a row of an image's
cells and the image (a checkpoint's processor_config.json may name others)."""
PSEUDO_ID_RANGE = 1 << 30
"""Image positions hold `vocab_size + (hash of the pixels) % PSEUDO_ID_RANGE` in a prompt's
ids: the prefix cache then matches an image only to the same pixels (one id for all of an
image's positions: where they sit in the prompt tells them apart), and the model reads an
id past its vocabulary as "take the image's features here"."""


@dataclass
class ImageSpan:
    """One image of a prompt: its pixels as the checkpoint's image processor makes them
    (`[3, H, W]`; Qwen-VL's patches `[T, H, W, values]` on their grid), the positions it
    takes, the image token it stands in for, which feature each position takes
    (`feature_index`: -1 where a row-break or image-end token sits), Qwen-VL's grid of
    features (time, height, width: their rotary coordinates), and its features once
    encoded (`layer_features`: Qwen3-VL's `[layers, tokens, hidden]` for the language
    model's first layers to add). `both_ways`: its features attend to each other both ways
    (Gemma 3); they are contiguous, `features_start` to `features_end`."""

    pixels: torch.Tensor
    start: int
    token: int
    feature_index: torch.Tensor
    grid: tuple[int, int, int] | None = None
    both_ways: bool = False
    features: torch.Tensor | None = field(default=None, repr=False)
    layer_features: torch.Tensor | None = field(default=None, repr=False)

    @property
    def length(self) -> int:
        return len(self.feature_index)

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def features_start(self) -> int:
        return self.start + int(torch.nonzero(self.feature_index >= 0)[0])

    @property
    def features_end(self) -> int:
        return self.start + int(torch.nonzero(self.feature_index >= 0)[-1]) + 1

    def feature_positions(self) -> list[int]:
        """The prompt positions that take a feature (the image token's, to the vocabulary)."""
        offsets = torch.nonzero(self.feature_index >= 0).flatten().tolist()
        return [self.start + offset for offset in offsets]


@dataclass
class ImagePiece:
    """What one chunk takes of one image: the batch rows of its features (`rows`, in the
    step's flattened tokens) and which of the image's features they take (`chosen`)."""

    span: ImageSpan
    rows: list[int]
    chosen: torch.Tensor


@dataclass
class StepImages:
    """What a prefill step's chunks take of their requests' images: the features, piece by
    piece (`pieces`, in the order of the step's flattened tokens), and for each request the
    images that attend both ways whose positions its chunk holds (`blocks`, `[first, last)`
    of their features)."""

    pieces: list[ImagePiece]
    blocks: list[list[tuple[int, int]]]


def image_pieces(
    images: list[list[ImageSpan]], starts: list[int], lengths: list[int]
) -> StepImages:
    """A prefill step's images, chunk by chunk (request i's chunk `lengths[i]` tokens from
    position `starts[i]`)."""
    step = StepImages([], [])
    offset = 0
    for spans, start, length in zip(images, starts, lengths, strict=True):
        held: list[tuple[int, int]] = []
        for span in spans:
            first, last = max(start, span.start), min(start + length, span.end)
            if first >= last:
                continue
            if span.both_ways:
                held.append((span.features_start, span.features_end))
            index = span.feature_index[first - span.start : last - span.start]
            taken = index >= 0
            if taken.any():  # (not where a grid's row ends alone are in the chunk)
                rows = torch.arange(offset + first - start, offset + last - start)[taken]
                step.pieces.append(ImagePiece(span, rows.tolist(), index[taken]))
        step.blocks.append(held)
        offset += length
    return step


def pseudo_id(pixels: torch.Tensor, vocab_size: int) -> int:
    """The id that an image's positions hold (`PSEUDO_ID_RANGE`): a hash of its pixels."""
    digest = hashlib.sha256(pixels.detach().float().cpu().contiguous().numpy().tobytes())
    return vocab_size + int.from_bytes(digest.digest()[:8], "little") % PSEUDO_ID_RANGE


def image_support(hf_config: dict[str, Any], architecture: str | None) -> str | None:
    """Why this checkpoint's images cannot run (None where they can)."""
    if architecture not in IMAGE_ARCHITECTURES:
        return f"{architecture or 'a text model'} takes no images in aserve"
    if architecture in PATCH_ARCHITECTURES:  # one tower each
        return None
    tower = (hf_config.get("vision_config") or {}).get("model_type")
    if tower not in IMAGE_TOWERS:
        return f"a {tower!r} vision tower is not supported (aserve runs {', '.join(IMAGE_TOWERS)})"
    return None


class ImageEncoder:
    """transformers' base model of the checkpoint with an empty language model (no layers,
    a one-token vocabulary: aserve runs its own), whose vision tower and projector hold the
    checkpoint's weights, on `device` in `dtype`.

    A fixed tower's images each take `tokens_per_image` positions; a grid tower's (Pixtral)
    take one a `grid_cell`-pixel cell (its patch times the projector's merge) plus one a row
    for the row-break and image-end tokens, whose ids (`grid_token_ids`) the runtime sets
    from the tokenizer."""

    def __init__(
        self,
        hf_config: dict[str, Any],
        architecture: str,
        model_dir: Path,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        import transformers

        settings = {key: value for key, value in hf_config.items() if key != "model_type"}
        config = transformers.AutoConfig.for_model(str(hf_config["model_type"]), **settings)
        self.config = config
        hollow = copy.deepcopy(config)
        hollow.text_config.num_hidden_layers = 0
        hollow.text_config.vocab_size = 1
        with torch.device(device):
            base = getattr(transformers, IMAGE_ARCHITECTURES[architecture])(hollow)
        del base.language_model
        wanted = set(base.state_dict())
        loaded = base.load_state_dict(vision_tensors(model_dir, wanted), strict=False)
        if loaded.missing_keys:
            missing = loaded.missing_keys
            raise ValueError(f"the checkpoint lacks {len(missing)} vision tensors: {missing[:3]}")
        self.base = base.to(dtype).eval()
        self.device, self.dtype = device, dtype
        self.grid_cell: int | None = None
        self.grid_token_ids: tuple[int, int] | None = None
        self.tokens_per_image: int | None = None
        # Gemma 3: what the vocabulary holds at feature positions (its soft image token),
        # the tokens around an image's features and newline runs' ids by length (blank
        # lines merge with their neighbours as the tokenizer merges them); set by the
        # runtime from the tokenizer (`frame_image`).
        self.both_ways = architecture in BOTH_WAYS_ARCHITECTURES
        # the features an image gives a position: its own, and Qwen3-VL's inner layers'
        inner = getattr(config.vision_config, "deepstack_visual_indexes", None) or []
        self.levels = 1 + len(inner)
        self.feature_token: int | None = getattr(config, "image_token_index", None)
        self.frame: tuple[list[int], list[int]] | None = None
        self.newline_ids: dict[int, int] = {}
        vision = config.vision_config
        self.merges_cells = architecture == "Mistral3ForConditionalGeneration"
        self.patch_merge: int | None = None
        if architecture in PATCH_ARCHITECTURES:
            self.patch_merge = vision.spatial_merge_size
        elif vision.model_type in GRID_TOWERS:
            self.grid_cell = vision.patch_size * getattr(config, "spatial_merge_size", 1)
        else:
            size = vision.image_size
            self.tokens_per_image = self.encode(torch.zeros(1, 3, size, size))[0][0].shape[0]

    def describe(self) -> str:
        if self.patch_merge is not None:
            merge = self.patch_merge
            return f"a position a {merge} x {merge} block of an image's patches"
        if self.grid_cell is not None:
            return f"a position a {self.grid_cell}-pixel cell of an image, one a row"
        return f"{self.tokens_per_image} positions an image"

    def layout(self, pixels: torch.Tensor) -> list[int | None]:
        """What each position of an image of `pixels` `[3, H, W]` holds: None where a
        feature goes, else a token's id (a grid tower's row ends, in row-major order, as
        transformers' processor writes them). A ValueError for pixels a grid cannot take."""
        if self.patch_merge is not None:
            times, height, width = self.feature_grid(pixels)
            return [None] * (times * height * width)
        if self.grid_cell is None:
            assert self.tokens_per_image is not None
            if not self.both_ways:
                return [None] * self.tokens_per_image
            if self.frame is None:
                raise ValueError("images need the tokenizer's ids of the image's frame")
            before, after = self.frame
            return [*before, *[None] * self.tokens_per_image, *after]
        if self.grid_token_ids is None:
            raise ValueError(f"images need the tokenizer's ids of {' and '.join(GRID_TOKENS)}")
        height, width = pixels.shape[-2:]
        cell = self.grid_cell
        if height % cell or width % cell or pixels.dim() != 3:
            raise ValueError(
                f"pixels [3, H, W] with H and W multiples of {cell} (got {list(pixels.shape)})"
            )
        row_break, image_end = self.grid_token_ids
        positions: list[int | None] = ([None] * (width // cell) + [row_break]) * (height // cell)
        positions[-1] = image_end
        return positions

    def feature_grid(self, pixels: torch.Tensor) -> tuple[int, int, int]:
        """Qwen-VL: the grid of an image's features (time, height, width), from its patches
        `[T, H, W, values]` (H and W even: the tower merges 2 x 2 patches a feature)."""
        merge = self.patch_merge
        assert merge is not None
        vision = self.config.vision_config
        values = 3 * vision.temporal_patch_size * vision.patch_size**2
        if pixels.dim() != 4 or pixels.shape[1] % merge or pixels.shape[2] % merge:
            raise ValueError(
                f"Qwen-VL pixels are patches [T, H, W, {values}] with H and W multiples of "
                f"{merge} (got {list(pixels.shape)})"
            )
        if pixels.shape[3] != values:
            raise ValueError(f"Qwen-VL patches hold {values} values (got {pixels.shape[3]})")
        if pixels.shape[0] != 1:
            raise ValueError(f"an image is one frame of patches (got {pixels.shape[0]})")
        times, height, width = pixels.shape[:3]
        return times, height // merge, width // merge

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """Each image's features `[tokens, hidden]` from pixels `[images, 3, H, W]` (a grid
        tower's images all of one size), with Qwen3-VL's features for the language model's
        first layers `[layers, tokens, hidden]` (None for the other towers)."""
        if self.patch_merge is not None:  # one image at a time: [1, T, H, W, values]
            grid = torch.tensor([list(pixels.shape[1:4])], device=self.device)
            flat = pixels.reshape(-1, pixels.shape[-1]).to(self.device, self.dtype)
            out = self.base.get_image_features(pixel_values=flat, image_grid_thw=grid)
            inner = getattr(out, "deepstack_features", None)  # a tensor a layer (Qwen3-VL)
            layers = torch.stack([one_image(f) for f in inner]) if inner else None
            return [(one_image(out.pooler_output), layers)]
        layer = getattr(self.config, "vision_feature_layer", None)  # (Gemma 3: its last)
        options: dict[str, Any] = {} if layer is None else {"vision_feature_layer": layer}
        if hasattr(self.config, "vision_feature_select_strategy"):
            options["vision_feature_select_strategy"] = self.config.vision_feature_select_strategy
        if self.grid_cell is not None:
            options["image_sizes"] = torch.tensor([list(pixels.shape[-2:])] * len(pixels))
        pixels = pixels.to(self.device, self.dtype)
        if self.merges_cells and len(pixels) == 1:
            # Mistral 3's get_image_features squeezes a one-cell image's one row away and
            # then fails to split it: its tower and projector are called as it calls them.
            sizes = options["image_sizes"]
            tower = self.base.vision_tower(
                pixels, image_sizes=sizes, output_hidden_states=True, return_dict=True
            )
            layers = layer if isinstance(layer, list) else [layer]
            selected = torch.cat([tower.hidden_states[i][0] for i in layers], dim=-1)
            return [(self.base.multi_modal_projector(selected, sizes), None)]
        out = self.base.get_image_features(pixel_values=pixels, **options)
        features = getattr(out, "pooler_output", out)  # transformers 5 returns an output
        return [(image, None) for image in features]


def one_image(features: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """One image's features `[tokens, hidden]`, whether transformers split them by image (a
    tuple of one) or not (transformers 5.17 keeps Qwen3-VL's inner layers' whole)."""
    return torch.cat(list(features)) if isinstance(features, (list, tuple)) else features


def frame_image(encoder: ImageEncoder, vocab: dict[str, int]) -> str | None:
    """Set a Gemma 3 encoder's frame from the tokenizer's vocabulary: a blank line, the
    image's start token, its features, its end token, a blank line, as transformers'
    processor writes it. Returns what the vocabulary lacks (None where nothing)."""
    config = encoder.config
    newlines = {count: vocab["\n" * count] for count in range(1, 32) if "\n" * count in vocab}
    if 2 not in newlines:
        return "a blank-line token"
    encoder.newline_ids = newlines
    blank = newlines[2]
    encoder.frame = ([blank, config.boi_token_index], [config.eoi_token_index, blank])
    return None


def _merged_newlines(encoder: ImageEncoder, first: int, second: int) -> int | None:
    """The one token of two adjacent newline runs, where the vocabulary has it."""
    counts = {token: count for count, token in encoder.newline_ids.items()}
    if first not in counts or second not in counts:
        return None
    return encoder.newline_ids.get(counts[first] + counts[second])


def vision_tensors(model_dir: Path, wanted: set[str]) -> dict[str, torch.Tensor]:
    """The checkpoint's vision tower and projector tensors under the base model's names
    (`wanted`), wherever the publisher filed them: at the top or under `model.`, the tower's
    own model named (`vision_tower.vision_model.*`, as transformers 4 saved CLIP and SigLIP)
    or not (transformers 5)."""
    from aserve.models.weights import safetensors_files

    tensors = {}
    for file in safetensors_files(model_dir):
        with safe_open(str(file), framework="pt", device="cpu") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle is no dict)
                local = name.removeprefix("model.")
                if local.split(".")[0] not in VISION_PARTS:
                    continue
                unnamed = local.replace("vision_tower.vision_model.", "vision_tower.", 1)
                named = unnamed.replace("vision_tower.", "vision_tower.vision_model.", 1)
                target = next((n for n in (local, unnamed, named) if n in wanted), local)
                tensors[target] = handle.get_tensor(name)
    return tensors


def expand_images(
    prompt: list[int],
    images: list[torch.Tensor],
    image_token_id: int,
    encoder: ImageEncoder,
    vocab: int,
) -> tuple[list[int], list[ImageSpan]]:
    """The prompt with each image token made its image's positions as the encoder lays them
    out, a feature's holding its image's pseudo id (`PSEUDO_ID_RANGE`), in the order the
    images come, and their spans. One image token a image, as a chat template writes it; a
    count that differs from the images' is a ValueError."""
    marks = [i for i, token in enumerate(prompt) if token == image_token_id]
    if len(marks) != len(images):
        raise ValueError(
            f"the prompt holds {len(marks)} image tokens (id {image_token_id}) for "
            f"{len(images)} images: one a image"
        )
    ids: list[int] = []
    spans = []
    last = 0
    feature_token = encoder.feature_token if encoder.both_ways else None
    for mark, pixels in zip(marks, images, strict=True):
        ids += prompt[last:mark]
        last = mark + 1
        positions = encoder.layout(pixels)
        if encoder.newline_ids:  # the frame's blank lines join the newlines beside them
            assert positions[0] is not None and positions[-1] is not None
            merged = _merged_newlines(encoder, ids[-1], positions[0]) if ids else None
            if merged is not None:
                ids.pop()
                positions[0] = merged
            after = prompt[last] if last < len(prompt) else None
            merged = None if after is None else _merged_newlines(encoder, positions[-1], after)
            if merged is not None:
                positions[-1] = merged
                last += 1
        is_feature = torch.tensor([token is None for token in positions])
        index = torch.where(is_feature, torch.cumsum(is_feature, 0) - 1, -1)
        grid = None if encoder.patch_merge is None else encoder.feature_grid(pixels)
        token = image_token_id if feature_token is None else feature_token
        spans.append(ImageSpan(pixels, len(ids), token, index, grid, encoder.both_ways))
        image_id = pseudo_id(pixels, vocab)
        ids += [image_id if token is None else token for token in positions]
    return ids + prompt[last:], spans
