"""Images in prompts for Pixtral's tower (Mistral Small 3.1's `Mistral3ForConditionalGeneration`):
each image at its own size, a feature a cell and a row-break token a row. Prompts and pixels
come from transformers' own Pixtral processor; logits and greedy tokens are checked against
transformers' whole model, through chunks that cut images, the prefix cache and batches."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aserve import LLM, SamplingParams
from tests.image_refs import (
    IMAGE,
    IMAGE_END,
    ROW_BREAK,
    chat_with_an_image,
    check_cache_and_batches,
    check_logits_and_tokens,
    grid_expanded,
    image_prompt,
)
from tests.tiny_models import (
    COMMON,
    FAMILIES,
    VISION,
    hf_greedy_tokens,
    make_tiny_vision_language,
    save_llava,
    write_word_tokenizer,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def picture(seed: int, size: tuple[int, int]) -> Any:
    """A random RGB image (Pillow) of `size` (height, width)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def mistral3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, Any]:
    """A tiny Mistral 3 (Pixtral tower, patches of 14 merged 2 x 2: cells of 28 pixels) with
    Pixtral's image processor (images up to 84 pixels a side) and processor_config.json as
    published checkpoints carry them."""
    import transformers

    folder = tmp_path_factory.mktemp("mistral3")
    hf = make_tiny_vision_language("Mistral3ForConditionalGeneration", folder)
    specials = {ROW_BREAK: "[IMG_BREAK]", IMAGE_END: "[IMG_END]"}
    write_word_tokenizer(folder, 320, IMAGE, specials)
    image_processor = transformers.PixtralImageProcessorPil(
        size={"longest_edge": 84}, patch_size={"height": 14, "width": 14}
    )
    image_processor.save_pretrained(folder)
    settings = {
        "processor_class": "PixtralProcessor",
        "patch_size": 14,
        "spatial_merge_size": 2,
        "image_token": "<image>",
        "image_break_token": "[IMG_BREAK]",
        "image_end_token": "[IMG_END]",
    }
    (folder / "processor_config.json").write_text(json.dumps(settings))
    return folder, hf, image_processor


def processed(image_processor: Any, prompt: list[int], images: list[Any]) -> dict[str, Any]:
    """What transformers' Pixtral processor gives (it needs torchvision, which this project
    does not install, so its steps are written out): pixels resized to whole 28-pixel cells,
    their sizes, and the prompt expanded (`grid_expanded`)."""
    pixels = image_processor(
        images=images, patch_size={"height": 28, "width": 28}, return_tensors="pt"
    )
    ids = grid_expanded(prompt, pixels["image_sizes"].tolist(), 28)
    return {"input_ids": torch.tensor([ids]), **pixels}


def hf_logits(hf: torch.nn.Module, inputs: dict[str, Any], continuation: list[int]) -> torch.Tensor:
    ids = torch.cat([inputs["input_ids"][0], torch.tensor(continuation)])
    with torch.inference_mode():
        out = hf(ids[None], pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"])
    return out.logits[0]


def hf_greedy(hf: torch.nn.Module, inputs: dict[str, Any], n: int, **extra: Any) -> list[int]:
    ids = inputs["input_ids"][0].tolist()
    with torch.inference_mode():
        return hf_greedy_tokens(
            hf,
            ids,
            n,
            pixel_values=inputs["pixel_values"],
            image_sizes=inputs["image_sizes"],
            **extra,
        )


@pytest.mark.parametrize(
    ("prompt", "sizes"),
    [
        ([5, 17, IMAGE, 99, 4], [(40, 70)]),  # 2 x 3 cells
        ([IMAGE, 9, 8], [(84, 30)]),  # 3 x 2
        ([7, IMAGE, 8, IMAGE, 9], [(20, 20), (60, 84)]),  # 1 x 1, then 3 x 3
    ],
)
def test_logits_and_tokens_match_transformers(
    mistral3: tuple[Path, torch.nn.Module, Any], prompt: list[int], sizes: list[tuple[int, int]]
) -> None:
    """Prefill and decode logits in chunks of 3 tokens that cut images and their row ends
    (pages of 4), and greedy tokens, as transformers' model gives them for its processor's
    prompt and pixels; the prompt aserve makes from one image token an image is the
    processor's."""
    folder, hf, processor = mistral3
    images = [picture(seed, size) for seed, size in enumerate(sizes)]
    inputs = processed(processor, prompt, images)
    assert inputs["input_ids"][0].tolist().count(IMAGE_END) == len(images)
    theirs = (partial(hf_logits, hf, inputs), partial(hf_greedy, hf, inputs))
    pixels = check_logits_and_tokens(folder, prompt, images, inputs, theirs, GREEDY)
    for ours_pixels, size in zip(pixels, inputs["image_sizes"].tolist(), strict=True):
        assert list(ours_pixels.shape[-2:]) == size


def test_the_image_matters_and_the_cache_tells_images_apart(
    mistral3: tuple[Path, torch.nn.Module, Any],
) -> None:
    """The same image again comes from the prefix cache with the same tokens; another image of
    the same size behind the same text is computed again and answers as transformers does for
    it; prompts with and without images batched give what each gives alone."""
    folder, hf, processor = mistral3
    prompt = [5, 17, 42, 9, IMAGE, 99, 4]

    def expected(image: object) -> list[int]:
        return hf_greedy(hf, processed(processor, prompt, [image]), 8)

    images = (picture(1, (56, 84)), picture(2, (56, 84)))
    check_cache_and_batches(folder, prompt, images, [5, 17, 42, 9, 99, 4], GREEDY, expected)


def test_repetition_penalty_counts_as_transformers_does(
    mistral3: tuple[Path, torch.nn.Module, Any],
) -> None:
    """transformers' repetition penalty counts the image token at each feature and the row
    ends as themselves; aserve's counts the same."""
    folder, hf, processor = mistral3
    prompt = [5, IMAGE, 6]
    image = picture(3, (84, 84))
    expected = hf_greedy(hf, processed(processor, prompt, [image]), 8, repetition_penalty=1.5)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, repetition_penalty=1.5)
    with LLM(str(folder)) as llm:
        assert llm.generate(image_prompt(prompt, image), params)[0].token_ids == expected


def test_chat_with_an_image_part(mistral3: tuple[Path, torch.nn.Module, Any]) -> None:
    """LLM.chat with vLLM's offline `image_pil` part: the template's image token, the
    processor's pixels, transformers' tokens."""
    folder, hf, processor = mistral3
    image = picture(4, (30, 60))
    with LLM(str(folder)) as llm:
        tokens, written = chat_with_an_image(llm, image, GREEDY)
    assert tokens == hf_greedy(hf, processed(processor, written, [image]), 8)


def test_refusals(mistral3: tuple[Path, torch.nn.Module, Any], tmp_path: Path) -> None:
    """Pixels off the grid of cells, and a tokenizer without the row-end tokens: one-line
    errors."""
    folder, _, _ = mistral3
    with LLM(str(folder)) as llm, pytest.raises(ValueError, match="multiples of 28"):
        llm.generate(image_prompt([5, IMAGE, 6], torch.zeros(3, 28, 30)))
    bare = tmp_path / "bare"
    make_tiny_vision_language("Mistral3ForConditionalGeneration", bare)
    write_word_tokenizer(bare, 320, IMAGE)
    with LLM(str(bare)) as llm, pytest.raises(ValueError, match=r"\[IMG_BREAK\] and \[IMG_END\]"):
        llm.generate(image_prompt([5, IMAGE, 6], torch.zeros(3, 28, 28)))


def test_pixtral_12b_layout(tmp_path: Path) -> None:
    """Pixtral 12B's layout: LLaVA over a Pixtral tower, a feature a 14-pixel patch (no
    merge), every patch kept; greedy tokens as transformers' for an image of 2 x 3 patches."""

    text = {**COMMON, **FAMILIES["mistral"], "model_type": "mistral"}
    vision = {**VISION, "model_type": "pixtral", "num_hidden_layers": 1, "head_dim": 16}
    hf = save_llava(text, {**vision, "image_size": 42, "patch_size": 14}, tmp_path)
    write_word_tokenizer(tmp_path, 320, IMAGE, {ROW_BREAK: "[IMG_BREAK]", IMAGE_END: "[IMG_END]"})
    pixels = torch.randn(1, 3, 28, 42)
    prompt = [5, 17, IMAGE, 99, 4]
    ids = grid_expanded(prompt, [[28, 42]], 14)
    assert ids == [5, 17, *[IMAGE] * 3, ROW_BREAK, *[IMAGE] * 3, IMAGE_END, 99, 4]
    with torch.inference_mode():
        expected = hf_greedy_tokens(
            hf, ids, 8, pixel_values=pixels, image_sizes=torch.tensor([[28, 42]])
        )
    with LLM(str(tmp_path)) as llm:
        assert llm.runtime.engine.images is not None
        assert llm.runtime.engine.images.grid_cell == 14
        out = llm.generate(image_prompt(prompt, pixels[0]), GREEDY)[0]
    assert out.prompt_token_ids == ids
    assert out.token_ids == expected
