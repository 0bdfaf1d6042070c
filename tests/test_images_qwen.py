"""Images in prompts for Qwen2-VL, Qwen2.5-VL and Qwen3-VL: the image processor's patches on
their grid, a feature a 2 x 2 block of patches, and M-RoPE (each image feature at its own
time, height and width position, the text after an image moved back by what the image
saves, generated tokens too; Qwen3-VL's coordinates interleaved over a head's pairs, and its
tower's inner features added after the language model's first layers). Logits and greedy
tokens are checked against transformers' whole model given the same patches, through
chunks that cut images, the prefix cache, batches beside text and speculative decoding's
verify steps."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.models.mrope import MropePositions
from tests.image_refs import (
    IMAGE,
    chat_with_an_image,
    check_cache_and_batches,
    check_logits_and_tokens,
    image_prompt,
)
from tests.tiny_models import (
    hf_greedy_tokens,
    make_tiny_vision_language,
    publish_transposed_experts,
    write_word_tokenizer,
)

ARCHITECTURES = [
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen3VLMoeForConditionalGeneration",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def picture(seed: int, size: tuple[int, int]) -> Any:
    """A random RGB image (Pillow) of `size` (height, width)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def qwen_vl(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, torch.nn.Module, Any]:
    """A tiny Qwen-VL (patches of 14, merged 2 x 2) with Qwen's image processor (images of
    28 x 28 to 112 x 112 pixels: 1 to 16 features) and a word-level tokenizer; Qwen3-VL-MoE's
    stacked experts in the layout Qwen publishes."""
    import transformers

    folder = tmp_path_factory.mktemp(request.param)
    hf = make_tiny_vision_language(request.param, folder)
    if request.param == "Qwen3VLMoeForConditionalGeneration":
        publish_transposed_experts(folder)
    write_word_tokenizer(folder, 320, IMAGE)
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=28 * 28, max_pixels=112 * 112
    )
    image_processor.save_pretrained(folder)
    return folder, hf, image_processor


def processed(image_processor: Any, prompt: list[int], images: list[Any]) -> dict[str, Any]:
    """transformers' inputs (what Qwen's processor gives, written out: it needs
    torchvision): the image processor's patches and grids, each image token repeated once a
    feature, and the token types that its M-RoPE reads."""
    pixels = image_processor(images=images, return_tensors="pt")
    features = iter((pixels["image_grid_thw"].prod(-1) // 4).tolist())
    ids = [t for token in prompt for t in ([token] * next(features) if token == IMAGE else [token])]
    types = torch.tensor([[int(t == IMAGE) for t in ids]])
    return {"input_ids": torch.tensor([ids]), "mm_token_type_ids": types, **pixels}


def hf_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in inputs.items() if k != "input_ids"}


def hf_logits(hf: torch.nn.Module, inputs: dict[str, Any], continuation: list[int]) -> torch.Tensor:
    ids = torch.cat([inputs["input_ids"][0], torch.tensor(continuation)])[None]
    types = torch.cat([inputs["mm_token_type_ids"], torch.zeros(1, len(continuation))], 1)
    extra = {**hf_inputs(inputs), "mm_token_type_ids": types.int()}
    with torch.inference_mode():
        return hf(ids, **extra).logits[0]


def hf_greedy(hf: torch.nn.Module, inputs: dict[str, Any], n: int, **extra: Any) -> list[int]:
    with torch.inference_mode():
        ids = inputs["input_ids"][0].tolist()
        return hf_greedy_tokens(hf, ids, n, **hf_inputs(inputs), **extra)


@pytest.mark.parametrize(
    ("prompt", "sizes"),
    [
        ([5, 17, IMAGE, 99, 4], [(56, 84)]),  # 2 x 3 features
        ([IMAGE, 9, 8], [(112, 28)]),  # 4 x 1
        ([7, IMAGE, 8, IMAGE, 9, 10], [(28, 28), (84, 112)]),  # 1 x 1, then 3 x 4
    ],
)
def test_logits_and_tokens_match_transformers(
    qwen_vl: tuple[Path, torch.nn.Module, Any], prompt: list[int], sizes: list[tuple[int, int]]
) -> None:
    """Prefill and decode logits in chunks of 3 tokens that cut images (pages of 4), and
    greedy tokens, as transformers' model gives them for the same patches: the decode steps'
    logits hold only where the generated tokens keep the prompt's M-RoPE shift."""
    folder, hf, image_processor = qwen_vl
    images = [picture(seed, size) for seed, size in enumerate(sizes)]
    inputs = processed(image_processor, prompt, images)
    theirs = (partial(hf_logits, hf, inputs), partial(hf_greedy, hf, inputs))
    check_logits_and_tokens(folder, prompt, images, inputs, theirs, GREEDY)


def test_positions_as_transformers_places_them(qwen_vl: tuple[Path, torch.nn.Module, Any]) -> None:
    """Every token's three coordinates and the generated tokens' shift, against
    transformers' `get_rope_index` for two images of different grids."""
    folder, hf, image_processor = qwen_vl
    prompt = [7, IMAGE, 8, 9, IMAGE, 10]
    inputs = processed(image_processor, prompt, [picture(0, (56, 112)), picture(1, (84, 28))])
    expected, delta = hf.model.get_rope_index(
        inputs["input_ids"],
        mm_token_type_ids=inputs["mm_token_type_ids"],
        image_grid_thw=inputs["image_grid_thw"],
    )
    with LLM(str(folder)) as llm:
        pixels = llm.runtime.image_processor.pixels([picture(0, (56, 112)), picture(1, (84, 28))])
        req = llm.scheduler.make_request(prompt, SamplingParams(max_tokens=1), pixels)
    positions: MropePositions = req.mrope
    ours = torch.tensor(positions.coordinates(0, len(req.prompt_ids)))
    assert torch.equal(ours, expected[:, 0])
    assert positions.shift == int(delta)
    assert positions.text_position(len(req.prompt_ids) + 5) == len(req.prompt_ids) + 5 + int(delta)


def test_prefix_cache_batches_and_speculation(qwen_vl: tuple[Path, torch.nn.Module, Any]) -> None:
    """The same image again comes from the prefix cache with the same tokens; another image
    of the same size behind the same text is computed again; an image prompt decoded in one
    batch with text prompts (shifted positions beside plain ones) and with n-gram drafts
    (verify rows at shifted positions) gives what it gives alone."""
    folder, hf, image_processor = qwen_vl
    prompt = [5, 17, 42, 9, IMAGE, 99, 4, 5, 17, 42]
    first = picture(1, (56, 56))

    def expected(image: object) -> list[int]:
        return hf_greedy(hf, processed(image_processor, prompt, [image]), 8)

    images = (first, picture(4, (56, 56)))
    check_cache_and_batches(folder, prompt, images, [5, 6, 7, 8, 5, 6, 7], GREEDY, expected)
    long = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    with LLM(str(folder)) as llm:
        plain = llm.generate(image_prompt(prompt, first), long)[0].token_ids
    with LLM(str(folder), speculative_algorithm="ngram") as llm:
        drafted = llm.generate(image_prompt(prompt, first), long)[0].token_ids
        assert llm.scheduler.planner.draft_tokens > 0
    assert drafted == plain


def test_chat_with_an_image_part(qwen_vl: tuple[Path, torch.nn.Module, Any]) -> None:
    """LLM.chat with vLLM's offline `image_pil` part: the template's image token, the
    processor's patches, transformers' tokens."""
    folder, hf, image_processor = qwen_vl
    image = picture(4, (40, 90))
    with LLM(str(folder)) as llm:
        tokens, written = chat_with_an_image(llm, image, GREEDY)
    assert tokens == hf_greedy(hf, processed(image_processor, written, [image]), 8)


def test_refusals(qwen_vl: tuple[Path, torch.nn.Module, Any]) -> None:
    """Pixels that are not patches on an even grid, or more than one frame: one-line
    errors."""
    folder, _, _ = qwen_vl
    values = 3 * 2 * 14 * 14
    with LLM(str(folder)) as llm:
        for pixels, message in [
            (torch.zeros(3, 28, 28), r"patches \[T, H, W, 1176\]"),
            (torch.zeros(1, 2, 3, values), "multiples of 2"),
            (torch.zeros(1, 2, 2, 7), "hold 1176 values"),
            (torch.zeros(2, 2, 2, values), "one frame"),
        ]:
            with pytest.raises(ValueError, match=message):
                llm.generate(image_prompt([5, IMAGE, 6], pixels))
