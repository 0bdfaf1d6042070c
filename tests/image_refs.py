"""What the image tests on CPU and on CUDA share: the tiny LLaVA's image token, how many
positions its images take, prompts as transformers' processor expands them and as the
offline API takes them."""

from __future__ import annotations

IMAGE = 300  # the tiny LLaVA's image token
TOKENS = 4  # a 28-pixel image in patches of 14, the class token left out


def expanded(prompt: list[int]) -> list[int]:
    """The prompt as transformers' processor gives it: each image token `TOKENS` times."""
    return [t for token in prompt for t in ([token] * TOKENS if token == IMAGE else [token])]


def image_prompt(prompt: list[int], image: object) -> dict[str, object]:
    return {"prompt_token_ids": prompt, "multi_modal_data": {"image": image}}
