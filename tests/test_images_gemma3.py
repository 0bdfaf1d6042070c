"""Images in prompts for Gemma 3: an image's fixed number of features between its start and
end tokens and blank lines (merged with the newlines beside them as the tokenizer merges
them), the features attending to each other both ways. Logits and greedy tokens against
transformers' whole model given the same pixels, through chunks (which never cut an
image's features), prefix hits and batches beside text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.scheduler.plan import whole_images
from tests.image_refs import check_cache_and_batches
from tests.test_models import our_logits
from tests.tiny_models import hf_greedy_tokens, make_tiny_vision_language, write_word_tokenizer

SOFT, BOI, EOI = 300, 310, 315  # the tiny Gemma 3's image feature, start and end tokens
NEWLINES = {301: 1, 302: 2, 303: 3, 304: 4}  # ids of runs of 1-4 newlines
FEATURES = 4  # a 28-pixel image in patches of 14, a feature each
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny Gemma 3 (window of 4 on its first layer) with newline tokens, and its image
    start, end and feature tokens, in a word-level tokenizer."""
    folder = tmp_path_factory.mktemp("gemma3")
    hf = make_tiny_vision_language("Gemma3ForConditionalGeneration", folder)
    specials = {SOFT: "<image_soft_token>", EOI: "<end_of_image>"}
    specials |= {token: "\n" * count for token, count in NEWLINES.items()}
    write_word_tokenizer(folder, 320, BOI, specials)
    return folder, hf


def processed(prompt: list[int]) -> list[int]:
    """The prompt as transformers' processor and tokenizer give it: each image start a
    blank line, the start token, the features, the end token and a blank line, whose
    newlines join the runs beside them."""
    ids: list[int] = []
    for token in prompt:
        if token != BOI:
            ids.append(token)
            continue
        frame = [302, BOI, *[SOFT] * FEATURES, EOI, 302]
        if ids and ids[-1] in NEWLINES:
            frame[0] = 300 + NEWLINES[ids.pop()] + 2
        ids += frame
    merged: list[int] = []
    for token in ids:  # a frame's closing blank line and the newlines after it
        closing = len(merged) > 1 and merged[-2] == EOI and merged[-1] in NEWLINES
        if closing and token in NEWLINES:
            merged[-1] = 300 + NEWLINES[merged[-1]] + NEWLINES[token]
            continue
        merged.append(token)
    return merged


def hf_forward(
    hf: torch.nn.Module, ids: list[int], pixels: torch.Tensor, causal: bool = False
) -> Any:
    types = torch.tensor([[int(t == SOFT) for t in ids]])
    extra = {} if causal else {"token_type_ids": types}
    with torch.inference_mode():
        return hf(torch.tensor([ids]), pixel_values=pixels, **extra).logits[0]


def pixels(count: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(count, 3, 28, 28, generator=generator)


@pytest.mark.parametrize(
    "prompt",
    [
        [5, 17, BOI, 99, 4, 250],
        [BOI, 9, 8],
        [7, 301, BOI, 301, 9, 10],  # newlines around the image merge with its blank lines
        [7, BOI, 8, 9, 302, BOI, 10],
    ],
)
def test_logits_and_tokens_match_transformers(
    gemma3: tuple[Path, torch.nn.Module], prompt: list[int]
) -> None:
    """Prefill and decode logits in chunks of 3 tokens (each image's features whole in one
    chunk, past the budget where need be) and greedy tokens, as transformers' model gives
    them with its both-ways mask over each image; its causal-only logits differ."""
    folder, hf = gemma3
    images = pixels(prompt.count(BOI))
    ids = processed(prompt)
    continuation = [7, 123, 45, 2]
    with LLM(str(folder), page_size=4, max_prefill_length=3) as llm:
        ours = our_logits(llm, prompt, continuation, list(images))
        out = llm.generate(
            {"prompt_token_ids": prompt, "multi_modal_data": {"image": list(images)}}, GREEDY
        )[0]
    theirs = hf_forward(hf, ids + continuation, images)[len(ids) - 1 :]
    torch.testing.assert_close(ours, theirs, atol=2e-4, rtol=1e-4)
    causal = hf_forward(hf, ids + continuation, images, causal=True)[len(ids) - 1 :]
    assert (causal - theirs).abs().max() > 1e-2  # the both-ways mask matters here
    assert out.error is None and out.prompt_token_ids == ids
    types = torch.tensor([[int(t == SOFT) for t in ids]])
    with torch.inference_mode():
        expected = hf_greedy_tokens(hf, ids, 8, pixel_values=images, token_type_ids=types)
    assert out.token_ids == expected


def test_chunks_never_cut_an_image() -> None:
    """A chunk that would end inside an image's features stops before them, or runs to
    their end where it starts at or within them; a prompt that runs whole (an embedding
    model's that attends both ways) is taken whole."""

    class Span:
        both_ways, features_start, features_end = True, 10, 14

    class Request:
        images = [Span()]
        prompt_ids = list(range(20))
        whole_prompt = False

    req: Any = Request()
    req.whole_prompt = True
    assert whole_images(req, 0, 3) == 20
    req.whole_prompt = False
    assert whole_images(req, 0, 8) == 8  # ends before the image
    assert whole_images(req, 0, 12) == 10  # would cut it: stops before
    assert whole_images(req, 10, 2) == 4  # starts at it: the whole image, past the budget
    assert whole_images(req, 12, 1) == 2  # starts within it (a prefix hit): to its end
    assert whole_images(req, 8, 6) == 6  # ends with it


def test_prefix_hits_and_batches(gemma3: tuple[Path, torch.nn.Module]) -> None:
    """The same image again comes from the prefix cache with the same tokens; another image
    does not; an image prompt decoded beside text prompts gives what it gives alone."""
    folder, _ = gemma3
    prompt = [5, 17, 42, 9, BOI, 99, 4, 5, 17, 42]
    images = (pixels(1, 1)[0], pixels(1, 2)[0])
    check_cache_and_batches(folder, prompt, images, [5, 6, 7, 8, 5, 6, 7], GREEDY)
