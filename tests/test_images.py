"""Images in prompts (LLaVA over CLIP): logits and greedy tokens against transformers' whole
model given the same pixels; the same through prefix hits, chunks that split an image and
batches; a cache that never mistakes one image for another; offline chat with a data URL;
refusals."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from aserve import LLM, SamplingParams
from tests.image_refs import IMAGE, TOKENS, check_cache_and_batches, expanded, image_prompt
from tests.server_utils import ServerProcess, serving
from tests.test_models import our_logits
from tests.test_server import post, run
from tests.tiny_models import (
    COMMON,
    FAMILIES,
    hf_greedy_tokens,
    make_tiny_model,
    make_tiny_vision_language,
    save_llava,
    write_word_tokenizer,
)

LLAVA = "LlavaForConditionalGeneration"
PROMPTS = [[5, 17, IMAGE, 99, 4, 250], [IMAGE, 9, 8], [7, 8, 9, 10, 11, IMAGE]]
"""One image each, at the middle, the start and the end of the prompt."""


def picture(seed: int, size: tuple[int, int] = (40, 50)) -> object:
    """A random RGB image (Pillow)."""
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (*size, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module]:
    """A tiny LLaVA with CLIP's image processor (28 pixels) and a word-level tokenizer."""
    import transformers

    folder = tmp_path_factory.mktemp("llava")
    hf = make_tiny_vision_language(LLAVA, folder)
    size = {"shortest_edge": 28}
    transformers.CLIPImageProcessor(
        size=size, crop_size={"height": 28, "width": 28}
    ).save_pretrained(folder)
    write_word_tokenizer(folder, 320, IMAGE)
    return folder, hf


def pixels_of(folder: Path, image: object) -> torch.Tensor:
    import transformers

    processor = transformers.AutoImageProcessor.from_pretrained(folder)
    return processor(images=[image], return_tensors="pt")["pixel_values"]


def hf_logits(hf: torch.nn.Module, ids: list[int], pixels: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return hf(torch.tensor([ids]), pixel_values=pixels).logits[0]


def hf_greedy(
    hf: torch.nn.Module, prompt: list[int], pixels: torch.Tensor, n: int, **inputs: Any
) -> list[int]:
    """transformers' greedy tokens of the prompt expanded as its processor expands it."""
    with torch.inference_mode():
        return hf_greedy_tokens(hf, expanded(prompt), n, pixel_values=pixels, **inputs)


GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


def test_logits_and_tokens_match_transformers(llava: tuple[Path, torch.nn.Module]) -> None:
    """The prefill's and five decode steps' logits, in chunks of 3 tokens that cut the
    images (pages of 4), and the greedy tokens, as transformers' whole model gives them
    from the same pixels; another image moves them."""
    folder, hf = llava
    with LLM(str(folder), page_size=4, max_prefill_length=3) as llm:
        assert llm.runtime.engine.images is not None
        assert llm.runtime.engine.images.tokens_per_image == TOKENS
        for seed, prompt in enumerate(PROMPTS):
            image = picture(seed)
            pixels = pixels_of(folder, image)
            continuation = [7, 123, 45, 2, 99]
            ours = our_logits(llm, prompt, continuation, [pixels[0]])
            theirs = hf_logits(hf, expanded(prompt) + continuation, pixels)
            torch.testing.assert_close(
                ours, theirs[len(expanded(prompt)) - 1 :], atol=2e-4, rtol=1e-4
            )
            other = hf_logits(hf, expanded(prompt) + continuation, pixels_of(folder, picture(99)))
            assert (other - theirs).abs().max() > 0.1  # the image matters to these logits
            out = llm.generate(image_prompt(prompt, image), GREEDY)[0]
            assert out.error is None
            assert out.token_ids == hf_greedy(hf, prompt, pixels, 10)
            assert out.prompt_token_ids == expanded(prompt)


def test_prefix_cache_batches_and_images_told_apart(llava: tuple[Path, torch.nn.Module]) -> None:
    """The same image again comes from the prefix cache with the same tokens; another image
    behind the same text is computed, not taken from the cache, and gets its own tokens;
    prompts with and without images batched give what each gives alone."""
    folder, hf = llava
    prompt = [5, 17, 42, 9, IMAGE, 99, 4]

    def expected(image: object) -> list[int]:
        return hf_greedy(hf, prompt, pixels_of(folder, image), 10)

    images = (picture(1), picture(2))
    check_cache_and_batches(folder, prompt, images, [5, 17, 42, 9, 99, 4], GREEDY, expected)


def test_repetition_penalty_counts_the_image_token(llava: tuple[Path, torch.nn.Module]) -> None:
    """transformers' repetition penalty counts the image token at each image position, as
    aserve's does."""
    folder, hf = llava
    image = picture(3)
    prompt = PROMPTS[0]
    expected = hf_greedy(hf, prompt, pixels_of(folder, image), 10, repetition_penalty=1.5)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, repetition_penalty=1.5)
    with LLM(str(folder)) as llm:
        assert llm.generate(image_prompt(prompt, image), params)[0].token_ids == expected


def data_url(image: object) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")  # type: ignore[attr-defined]
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def test_chat_with_a_data_url(llava: tuple[Path, torch.nn.Module]) -> None:
    """An OpenAI `image_url` part (a PNG data URL) in LLM.chat: the template's image token,
    the decoded PNG's pixels, the same tokens as the prompt written out."""
    folder, hf = llava
    image = picture(4)
    message = {
        "role": "user",
        "content": [
            {"type": "text", "text": "w5 w6"},
            {"type": "image_url", "image_url": {"url": data_url(image)}},
        ],
    }
    with LLM(str(folder)) as llm:
        out = llm.chat([message], GREEDY)[0]
        written = llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": [{"type": "text", "text": "w5 w6"}, {"type": "image"}]}]
        )
        assert written.count(IMAGE) == 1
        assert out.token_ids == hf_greedy(hf, written, pixels_of(folder, image), 10)


def test_refusals(llava: tuple[Path, torch.nn.Module], tmp_path: Path) -> None:
    """Images without their image tokens (or tokens without images), prompt logprobs with
    images, and images for a model that takes none: one-line errors."""
    folder, _ = llava
    image = picture(5)
    with LLM(str(folder)) as llm:
        with pytest.raises(ValueError, match="1 image tokens .* for 2 images"):
            llm.generate(
                {"prompt_token_ids": PROMPTS[0], "multi_modal_data": {"image": [image, image]}}
            )
        with pytest.raises(ValueError, match="0 image tokens"):
            llm.generate(image_prompt([5, 6, 7], image))
        scored = SamplingParams(max_tokens=2, prompt_logprobs=1)
        out = llm.generate(image_prompt(PROMPTS[0], image), scored)[0]
        assert out.finish_reason == "error" and "prompt logprobs" in (out.error or "")
    text = make_tiny_model("llama", tmp_path / "text")
    with LLM(str(text)) as llm, pytest.raises(ValueError, match="takes no images"):
        llm.generate(image_prompt([5, 300, 6], torch.zeros(3, 28, 28)))


@pytest.fixture(scope="module")
def llava_server(llava: tuple[Path, torch.nn.Module]) -> Iterator[ServerProcess]:
    yield from serving(ServerProcess(["--model", str(llava[0]), "--served-model-name", "llava"]))


def chat_with_image(server: ServerProcess, text: str, url: str) -> tuple[int, Any]:
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    body = {
        "model": "llava",
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": 10,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return run(post(server.base_url + "/v1/chat/completions", body))


def test_server_chat_with_an_image(
    llava_server: ServerProcess, llava: tuple[Path, torch.nn.Module]
) -> None:
    """A chat request with a PNG data URL: the offline API's tokens; usage counts the
    image's positions; the same text with another image answers otherwise."""
    folder, hf = llava
    image = picture(6)
    status, reply = chat_with_image(llava_server, "w5 w6", data_url(image))
    assert status == 200, reply
    message = {
        "role": "user",
        "content": [{"type": "text", "text": "w5 w6"}, {"type": "image"}],
    }
    with LLM(str(folder)) as llm:
        written = llm.tokenizer.apply_chat_template([message])
    assert reply["choices"][0]["token_ids"] == hf_greedy(hf, written, pixels_of(folder, image), 10)
    assert reply["usage"]["prompt_tokens"] == len(written) - 1 + TOKENS
    status, other = chat_with_image(llava_server, "w5 w6", data_url(picture(7)))
    assert status == 200 and other["choices"][0]["token_ids"] != reply["choices"][0]["token_ids"]


def test_native_generate_with_image_data(
    llava_server: ServerProcess, llava: tuple[Path, torch.nn.Module]
) -> None:
    """SGLang's /generate with `image_data`: token ids or text holding the image token, an
    image as a data URL or bare base64, a batch with an entry a prompt; the offline API's
    tokens; one-line refusals for a batch's count and nested lists."""
    folder, _ = llava
    first, second = picture(11), picture(12)
    sampling = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with LLM(str(folder)) as llm:
        greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        expected = [
            llm.generate(image_prompt(PROMPTS[0], image), greedy)[0].token_ids
            for image in (first, second)
        ]
    url = llava_server.base_url + "/generate"
    bare = data_url(second).partition(",")[2]
    body = {"input_ids": PROMPTS[0], "image_data": data_url(first), "sampling_params": sampling}
    status, reply = run(post(url, body))
    assert status == 200, reply
    assert reply["output_ids"] == expected[0]
    text = " ".join(f"w{t}" if t != IMAGE else "<image>" for t in PROMPTS[0])
    body = {"text": text, "image_data": [bare], "sampling_params": sampling}
    status, reply = run(post(url, body))
    assert status == 200, reply
    assert reply["output_ids"] == expected[1]
    batch = {
        "input_ids": [PROMPTS[0], PROMPTS[0], [5, 6]],
        "image_data": [data_url(first), [bare], None],
        "sampling_params": sampling,
    }
    status, replies = run(post(url, batch))
    assert status == 200, replies
    assert [r["output_ids"] for r in replies[:2]] == expected
    for bad, message in [
        ({**batch, "image_data": [data_url(first)]}, "an entry (a string, a list or null)"),
        ({**body, "image_data": [[bare]]}, "a string or strings"),
        ({**body, "image_data": "@@@"}, "base64 does not decode"),
    ]:
        status, reply = run(post(url, bad))
        assert status == 400 and message in reply["error"]["message"], reply


@pytest.mark.parametrize(
    ("text", "url", "message"),
    [
        ("w5", "data:image/png;base64,!!!", "base64 does not decode"),
        ("w5", "data:text/plain;base64,aGk=", "data:image/<type>;base64"),
        ("w5", "data:image/png;base64,aGVsbG8=", "does not decode"),
        ("w5", "ftp://example.com/a.png", "data: URL or an http(s) one"),
        ("w5", "http://127.0.0.1:9/a.png", "fetching http://127.0.0.1:9/a.png failed"),
        ("w5 <image>", "PNG", "2 image tokens (id 300) for 1 images"),
    ],
)
def test_server_refuses_bad_images(
    llava_server: ServerProcess, text: str, url: str, message: str
) -> None:
    if url == "PNG":
        url = data_url(picture(8))
    status, reply = chat_with_image(llava_server, text, url)
    assert status == 400, reply
    assert message in reply["error"]["message"]


def test_siglip_tower_over_qwen2(tmp_path: Path) -> None:
    """LLaVA-Interleave's layout: a SigLIP tower (no class token, its last layer, every
    patch kept) before a Qwen2 language model; pixels given as a tensor."""

    text = {**COMMON, **FAMILIES["qwen2"], "model_type": "qwen2"}
    vision = {
        "model_type": "siglip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_attention_heads": 2,
        "num_hidden_layers": 2,
        "image_size": 28,
        "patch_size": 7,
    }
    hf = save_llava(text, vision, tmp_path)
    pixels = torch.randn(1, 3, 28, 28)
    prompt = [5, 17, IMAGE, 99, 4]
    ids = [t for token in prompt for t in ([token] * 16 if token == IMAGE else [token])]
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([ids]),
            pixel_values=pixels,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    with LLM(str(tmp_path)) as llm:
        assert llm.runtime.engine.images is not None
        assert llm.runtime.engine.images.tokens_per_image == 16  # (28 / 7) ** 2 patches
        got = llm.generate(image_prompt(prompt, pixels[0]), GREEDY)[0]
    assert got.token_ids == out[0, len(ids) :].tolist()


def test_server_tokenize_counts_an_image_as_its_token(llava_server: ServerProcess) -> None:
    """/tokenize renders the template: one image token an image (as vLLM's does)."""
    content = [{"type": "text", "text": "w5"}, {"type": "image_url", "image_url": {"url": "x"}}]
    body = {"messages": [{"role": "user", "content": content}]}
    status, reply = run(post(llava_server.base_url + "/tokenize", body))
    assert status == 200 and reply["tokens"].count(IMAGE) == 1


def test_server_responses_api_with_an_input_image(llava_server: ServerProcess) -> None:
    """The Responses API's `input_image` (a user turn's) answers as chat's `image_url`; in
    another turn it is a 400."""
    url = data_url(picture(9))
    status, chat = chat_with_image(llava_server, "w5 w6", url)
    assert status == 200, chat
    content = [{"type": "input_text", "text": "w5 w6"}, {"type": "input_image", "image_url": url}]
    body = {
        "model": "llava",
        "input": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_output_tokens": 10,
    }
    status, reply = run(post(llava_server.base_url + "/v1/responses", body))
    assert status == 200, reply
    text = "".join(
        part["text"]
        for item in reply["output"]
        if item["type"] == "message"
        for part in item["content"]
    )
    assert text == chat["choices"][0]["message"]["content"]
    body["input"] = [{"role": "system", "content": content}]
    status, reply = run(post(llava_server.base_url + "/v1/responses", body))
    assert status == 400 and "input_image parts go in user turns" in reply["error"]["message"]
