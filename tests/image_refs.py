"""What the image tests on CPU and on CUDA share: the tiny LLaVA's image token, how many
positions its images take, prompts as transformers' processors expand them (LLaVA's and
Pixtral's) and as the offline API takes them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

IMAGE = 300  # the tiny LLaVA's image token
TOKENS = 4  # a 28-pixel image in patches of 14, the class token left out
ROW_BREAK, IMAGE_END = 305, 306  # the tiny Pixtral checkpoints' [IMG_BREAK] and [IMG_END]


def expanded(prompt: list[int]) -> list[int]:
    """The prompt as transformers' processor gives it: each image token `TOKENS` times."""
    return [t for token in prompt for t in ([token] * TOKENS if token == IMAGE else [token])]


def image_prompt(prompt: list[int], image: object) -> dict[str, object]:
    return {"prompt_token_ids": prompt, "multi_modal_data": {"image": image}}


def grid_expanded(prompt: list[int], sizes: list[list[int]], cell: int) -> list[int]:
    """The prompt as transformers' Pixtral processor gives it (written out: the processor
    needs torchvision): each image token, in turn, the rows of cells of an image of `sizes`
    (height, width), each row closed by ROW_BREAK and the last by IMAGE_END."""
    ids: list[int] = []
    images = iter(sizes)
    for token in prompt:
        if token != IMAGE:
            ids.append(token)
            continue
        height, width = next(images)
        rows = [[IMAGE] * (width // cell) + [ROW_BREAK] for _ in range(height // cell)]
        rows[-1][-1] = IMAGE_END
        ids += [t for row in rows for t in row]
    return ids


def chat_with_an_image(llm: Any, image: object, params: Any) -> tuple[list[int], list[int]]:
    """LLM.chat with vLLM's offline `image_pil` part after the text "w5 w6": the reply's
    tokens, and the prompt that the chat template writes for it (one image token)."""
    content = [{"type": "text", "text": "w5 w6"}, {"type": "image_pil", "image_pil": image}]
    out = llm.chat([{"role": "user", "content": content}], params)[0]
    template = [{"role": "user", "content": [{"type": "text", "text": "w5 w6"}, {"type": "image"}]}]
    return out.token_ids, llm.tokenizer.apply_chat_template(template)


def check_cache_and_batches(
    folder: Path,
    prompt: list[int],
    images: tuple[object, object],
    text: list[int],
    params: Any,
    expected: Callable[[object], list[int]] | None = None,
) -> None:
    """The same image again comes from the prefix cache with the same tokens; another image
    behind the same text is computed again (only the text before the image comes from the
    cache) and gets tokens of its own; prompts with and without images batched give what
    each gives alone. With `expected`, each image's tokens are transformers' (`expected`)."""
    from aserve import LLM

    first, second = images
    with LLM(str(folder), page_size=4) as llm:
        planner = llm.scheduler.planner
        alone = llm.generate(image_prompt(prompt, first), params)[0].token_ids
        assert expected is None or alone == expected(first)
        cached = planner.prompt_tokens_cached
        assert llm.generate(image_prompt(prompt, first), params)[0].token_ids == alone
        assert planner.prompt_tokens_cached - cached >= 8
        cached = planner.prompt_tokens_cached
        other = llm.generate(image_prompt(prompt, second), params)[0].token_ids
        assert planner.prompt_tokens_cached - cached <= 4  # the text before the image alone
        assert other != alone and (expected is None or other == expected(second))
        text_alone = llm.generate([text], params)[0].token_ids
    with LLM(str(folder), page_size=4, cache_type="naive") as llm:
        batched = llm.generate(
            [image_prompt(prompt, first), text, image_prompt(prompt, second)], params
        )
    assert [o.token_ids for o in batched] == [alone, text_alone, other]


def check_logits_and_tokens(
    folder: Path,
    prompt: list[int],
    images: list[object],
    inputs: dict[str, Any],
    theirs: tuple[Callable[[list[int]], Any], Callable[[int], list[int]]],
    params: Any,
) -> list[Any]:
    """Prefill and decode logits in chunks of 3 tokens (pages of 4) and greedy tokens
    against transformers' (`theirs`: its logits over its prompt, `inputs`, then a
    continuation; its greedy tokens), and the prompt aserve makes of the images as
    transformers' processor makes it. Returns the pixels aserve's image processor made."""
    import torch

    from aserve import LLM
    from tests.test_models import our_logits

    logits_of, greedy_of = theirs
    expected_prompt = inputs["input_ids"][0].tolist()
    continuation = [7, 123, 45, 2]
    with LLM(str(folder), page_size=4, max_prefill_length=3) as llm:
        pixels = llm.runtime.image_processor.pixels(images)
        ours = our_logits(llm, prompt, continuation, pixels)
        expected = logits_of(continuation)[len(expected_prompt) - 1 :]
        torch.testing.assert_close(ours, expected, atol=2e-4, rtol=1e-4)
        request = {"prompt_token_ids": prompt, "multi_modal_data": {"image": images}}
        out = llm.generate(request, params)[0]
    assert out.error is None
    assert out.prompt_token_ids == expected_prompt
    assert out.token_ids == greedy_of(len(out.token_ids))
    return pixels
