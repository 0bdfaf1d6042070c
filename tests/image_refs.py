"""What the image tests on CPU and on CUDA share: the tiny LLaVA's image token, how many
positions its images take, prompts as transformers' processors expand them (LLaVA's and
Pixtral's) and as the offline API takes them."""

from __future__ import annotations

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
