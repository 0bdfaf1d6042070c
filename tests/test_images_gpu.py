"""Images in prompts on CUDA in bf16 (FlashInfer prefill, decode graphs) against
transformers' whole model given the same pixels (run on the GPU machine; skipped without
CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from aserve import LLM, SamplingParams
from aserve.llm import GenerationOutput
from tests.image_refs import IMAGE, IMAGE_END, ROW_BREAK, expanded, grid_expanded, image_prompt
from tests.test_gpu import KERNEL_SHAPES
from tests.test_models import our_logits
from tests.tiny_models import make_tiny_vision_language, write_word_tokenizer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
PROMPTS = [[5, 17, IMAGE, 99, 4, 250], [IMAGE, 9, 8]]


def assert_as_transformers_and_cached(
    out: GenerationOutput,
    logits: torch.Tensor,
    prompt_length: int,
    llm: LLM,
    chunked: LLM,
    prompt: list[int],
    images: list[Any],
) -> None:
    """The greedy tokens' logprobs within 0.05 of transformers' `logits` (over its prompt,
    `prompt_length` tokens, then those tokens); teacher-forced logits after a prefix hit as
    in `chunked`'s chunks of 3, to bf16's rounding."""
    expected = torch.log_softmax(logits.float(), -1)[prompt_length - 1 : -1]
    theirs = expected.gather(1, torch.tensor(out.token_ids, device="cuda")[:, None])[:, 0]
    assert out.logprobs is not None
    ours = torch.tensor([lp.logprob for lp in out.logprobs], device="cuda")
    torch.testing.assert_close(ours, theirs, atol=0.05, rtol=0.05)
    continuation = [7, 123, 45, 2, 99]
    fresh = our_logits(chunked, prompt, continuation, images)
    cached = llm.scheduler.planner.prompt_tokens_cached
    hit = our_logits(llm, prompt, continuation, images)
    assert llm.scheduler.planner.prompt_tokens_cached > cached
    torch.testing.assert_close(hit, fresh, atol=0.06, rtol=0.03)


def test_llava_bf16_logprobs_close_to_transformers(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    """Greedy tokens' logprobs within 0.05 of transformers' bf16 whole model on the same
    pixels; teacher-forced logits from a prefix hit and in chunks of 3 that cut the image
    as a fresh prefill's, to bf16's rounding (the float32 test below asks the same tokens)."""
    hf = make_tiny_vision_language(
        "LlavaForConditionalGeneration", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64}
    )
    hf = hf.to(device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True)
    llm = make_llm(tmp_path, device="cuda", dtype="bfloat16")
    chunked = make_llm(tmp_path, device="cuda", dtype="bfloat16", max_prefill_length=3)
    assert type(llm.runtime.engine.attn).__name__ == "FlashInferBackend"
    assert llm.runtime.engine.graphs is not None and llm.runtime.engine.images is not None
    for seed, prompt in enumerate(PROMPTS):
        torch.manual_seed(seed)
        pixels = torch.randn(1, 3, 28, 28)
        out = llm.generate(image_prompt(prompt, pixels[0]), params)[0]
        ids = expanded(prompt) + out.token_ids
        with torch.inference_mode():
            logits = (
                hf(
                    torch.tensor([ids], device="cuda"),
                    pixel_values=pixels.to("cuda", torch.bfloat16),
                )
                .logits[0]
                .float()
            )
        assert_as_transformers_and_cached(
            out, logits, len(expanded(prompt)), llm, chunked, prompt, [pixels[0]]
        )


def test_llava_float32_prefix_hits_and_chunks_keep_tokens(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    """In float32 (torch attention on the GPU) the greedy tokens of an image prompt are the
    same from a prefix hit, in chunks of 3 that cut the image, and batched beside text."""
    make_tiny_vision_language(
        "LlavaForConditionalGeneration", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64}
    )
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = make_llm(tmp_path, device="cuda", dtype="float32", page_size=4)
    chunked = make_llm(tmp_path, device="cuda", dtype="float32", max_prefill_length=3)
    torch.manual_seed(0)
    pixels = torch.randn(1, 3, 28, 28)
    prompt = image_prompt(PROMPTS[0], pixels[0])
    first = llm.generate(prompt, greedy)[0].token_ids
    cached = llm.scheduler.planner.prompt_tokens_cached
    assert llm.generate(prompt, greedy)[0].token_ids == first
    assert llm.scheduler.planner.prompt_tokens_cached - cached >= 8
    assert chunked.generate(prompt, greedy)[0].token_ids == first
    batched = chunked.generate([[5, 6, 7, 8], prompt], greedy)
    assert batched[1].token_ids == first


def test_mistral3_bf16_logprobs_close_to_transformers(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    """Pixtral's tower (Mistral 3): two images of their own sizes (2 x 3 cells, then one
    cell) in one prompt, greedy tokens' logprobs within 0.05 of transformers' bf16 whole
    model; in chunks of 3 that cut the images and their row ends the same tokens' logits as
    a fresh prefill's, to bf16's rounding."""
    hf = make_tiny_vision_language(
        "Mistral3ForConditionalGeneration", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64}
    )
    write_word_tokenizer(tmp_path, 320, IMAGE, {ROW_BREAK: "[IMG_BREAK]", IMAGE_END: "[IMG_END]"})
    hf = hf.to(device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True)
    llm = make_llm(tmp_path, device="cuda", dtype="bfloat16")
    chunked = make_llm(tmp_path, device="cuda", dtype="bfloat16", max_prefill_length=3)
    assert llm.runtime.engine.images is not None and llm.runtime.engine.images.grid_cell == 28
    torch.manual_seed(0)
    pixels = [torch.randn(3, 56, 84), torch.randn(3, 28, 28)]
    prompt = [5, 17, IMAGE, 99, IMAGE, 4]
    sizes = [list(p.shape[-2:]) for p in pixels]
    out = llm.generate({"prompt_token_ids": prompt, "multi_modal_data": {"image": pixels}}, params)[
        0
    ]
    expanded_prompt = grid_expanded(prompt, sizes, 28)
    assert out.prompt_token_ids == expanded_prompt
    batch = torch.zeros(2, 3, 56, 84)  # transformers' processor pads a batch to its largest
    batch[0], batch[1, :, :28, :28] = pixels[0], pixels[1]
    with torch.inference_mode():
        logits = (
            hf(
                torch.tensor([expanded_prompt + out.token_ids], device="cuda"),
                pixel_values=batch.to("cuda", torch.bfloat16),
                image_sizes=torch.tensor(sizes, device="cuda"),
            )
            .logits[0]
            .float()
        )
    assert_as_transformers_and_cached(
        out, logits, len(expanded_prompt), llm, chunked, prompt, pixels
    )


QWEN_VL_SECTIONS = {  # heads of 64: 32 pairs
    "Qwen2_5_VLForConditionalGeneration": {"type": "mrope", "mrope_section": [8, 12, 12]},
    "Qwen3VLForConditionalGeneration": {
        "rope_type": "default",
        "mrope_section": [8, 12, 12],
        "mrope_interleaved": True,
    },
}
QWEN_VL_SECTIONS["Qwen3VLMoeForConditionalGeneration"] = QWEN_VL_SECTIONS[
    "Qwen3VLForConditionalGeneration"
]


@pytest.mark.parametrize("architecture", list(QWEN_VL_SECTIONS))
def test_qwen_vl_bf16_logprobs_close_to_transformers(
    make_llm: Callable[..., LLM], tmp_path: Path, architecture: str
) -> None:
    """Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE (M-RoPE; Qwen3-VL's interleaved, and its
    tower's inner features added after the first layers): an image of 2 x 3 features then
    text, greedy tokens' logprobs within 0.05 of transformers' bf16 whole model (decode
    graphs at shifted positions, the fused norm/RoPE/KV-write kernel reading each prefill
    token's own rows); in chunks of 3 that cut the image, the same logits as a prefix hit,
    to bf16's rounding."""
    overrides = {**KERNEL_SHAPES, "head_dim": 64, "rope_scaling": QWEN_VL_SECTIONS[architecture]}
    hf = make_tiny_vision_language(architecture, tmp_path, overrides=overrides)
    hf = hf.to(device="cuda", dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True)
    llm = make_llm(tmp_path, device="cuda", dtype="bfloat16")
    chunked = make_llm(tmp_path, device="cuda", dtype="bfloat16", max_prefill_length=3)
    assert llm.runtime.engine.graphs is not None and llm.runtime.engine.images is not None
    torch.manual_seed(0)
    patches = torch.randn(1, 4, 6, 3 * 2 * 14 * 14)  # one frame of 4 x 6 patches
    prompt = [5, 17, IMAGE, 99, 4, 250]
    out = llm.generate(image_prompt(prompt, patches), params)[0]
    ids = [t for token in prompt for t in ([token] * 6 if token == IMAGE else [token])]
    assert out.prompt_token_ids == ids
    whole = ids + out.token_ids
    with torch.inference_mode():
        logits = (
            hf(
                torch.tensor([whole], device="cuda"),
                pixel_values=patches.reshape(24, -1).to("cuda", torch.bfloat16),
                image_grid_thw=torch.tensor([[1, 4, 6]], device="cuda"),
                mm_token_type_ids=torch.tensor([[int(t == IMAGE) for t in whole]], device="cuda"),
            )
            .logits[0]
            .float()
        )
    assert_as_transformers_and_cached(out, logits, len(ids), llm, chunked, prompt, [patches])


def test_gemma3_bf16_logprobs_close_to_transformers(
    make_llm: Callable[..., LLM], tmp_path: Path
) -> None:
    """Gemma 3 (image features attending to each other both ways: FlashInfer's prefill with
    a mask, windowed layers included): greedy tokens' logprobs within 0.05 of transformers'
    bf16 whole model; in chunks of 3 (each image whole in one) the same logits as a prefix
    hit, to bf16's rounding."""
    from tests.test_images_gemma3 import BOI, NEWLINES, SOFT, processed

    hf = make_tiny_vision_language(
        "Gemma3ForConditionalGeneration", tmp_path, overrides={**KERNEL_SHAPES, "head_dim": 64}
    )
    hf = hf.to(device="cuda", dtype=torch.bfloat16)
    specials = {SOFT: "<image_soft_token>", 315: "<end_of_image>"}
    specials |= {token: "\n" * count for token, count in NEWLINES.items()}
    write_word_tokenizer(tmp_path, 320, BOI, specials)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True)
    llm = make_llm(tmp_path, device="cuda", dtype="bfloat16", page_size=4)
    chunked = make_llm(tmp_path, device="cuda", dtype="bfloat16", max_prefill_length=3)
    assert type(llm.runtime.engine.attn).__name__ == "FlashInferBackend"
    torch.manual_seed(0)
    pixels = torch.randn(1, 3, 28, 28)
    prompt = [5, 17, 301, BOI, 99, 4, 250, 8]
    out = llm.generate(image_prompt(prompt, pixels[0]), params)[0]
    ids = processed(prompt)
    assert out.prompt_token_ids == ids
    whole = ids + out.token_ids
    types = torch.tensor([[int(t == SOFT) for t in whole]], device="cuda")
    with torch.inference_mode():
        logits = hf(
            torch.tensor([whole], device="cuda"),
            pixel_values=pixels.to("cuda", torch.bfloat16),
            token_type_ids=types,
        ).logits[0]
    assert_as_transformers_and_cached(out, logits, len(ids), llm, chunked, prompt, [pixels[0]])
