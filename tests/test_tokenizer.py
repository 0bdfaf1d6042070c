"""Token ids to reply text on the embedded SmolLM2 tokenizer (byte-level BPE): streamed text is
the one-shot decode whatever the chunking, never carries a broken character, stays cheap per
push, and never shows a stop string, also one split across tokens and pushes. A small
SentencePiece-style tokenizer covers what byte-level BPE cannot show: the space that decoding
drops before a first word, and byte-fallback runs that decode as a whole."""

from __future__ import annotations

import asyncio
import json
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, normalizers, pre_tokenizers

import aserve.tokenizer
from aserve.textstream import StopStringMatcher, TextStream
from aserve.tokenizer import (
    INLINE_CHARS,
    INLINE_TURN_CHARS,
    IncrementalDetokenizer,
    Tokenizer,
    _groups,
)

TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Héllo wörld: naïve café, crème brûlée, São Paulo, Ærøskøbing, façade.",
    "Emoji 😀😃🎉 family 👩‍👩‍👧‍👦 flags 🇫🇷🇯🇵 skin tone 👍🏽 keycap 1️⃣",
    "中文字符和日本語の文章、한국어 문장도 있습니다。",
    "Ελληνικά, русский текст, עברית, العربية, हिन्दी",
    "Math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√∞ ≠ ≤ ≥, music 𝄞, the replacement character \ufffd itself",
    "  leading spaces, tabs\tand\nnew lines\n\n    indented = 1\n",
)
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir: Path) -> Iterator[Tokenizer]:
    tok = Tokenizer(smollm2_dir)
    yield tok
    tok.close()


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tokenizer]:
    """Llama-2-style: "▁" marks spaces, the decode strips the first one, and characters
    outside the vocabulary fall back to one token per UTF-8 byte."""
    pieces = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    pieces += [(f"<0x{byte:02X}>", -10.0) for byte in range(256)]
    words = ["▁", "▁Hello", "▁world", "▁the", "▁cat", "▁café", "▁naïve", "é", "!", ","]
    pieces += [(word, -1.0) for word in words] + [(c, -5.0) for c in "abcdefghijklmnopqrstuvwxyz"]
    backend = Backend(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    folder = tmp_path_factory.mktemp("sentencepiece")
    backend.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(folder)
    yield tok
    tok.close()


@pytest.fixture(scope="module")
def stray_bytes(tokenizer: Tokenizer) -> list[int]:
    """Tokens that are no character on their own: pieces of multi-byte UTF-8 sequences."""
    return [i for i in range(len(tokenizer.hf)) if tokenizer.decode([i]) == REPLACEMENT]


def chunked(ids: Sequence[int], rng: random.Random, max_size: int) -> list[list[int]]:
    pieces, start = [], 0
    while start < len(ids):
        size = rng.randint(1, max_size)
        pieces.append(list(ids[start : start + size]))
        start += size
    return pieces


def detokenize(detokenizer: IncrementalDetokenizer, pieces: list[list[int]]) -> list[str]:
    return [detokenizer.push(piece) for piece in pieces] + [detokenizer.flush()]


def assert_clean_pieces(pieces: list[str], full: str) -> None:
    """Every piece is text a client can show: UTF-8 encodable, and without U+FFFD unless the
    full text has one."""
    for piece in pieces:
        assert isinstance(piece, str)
        piece.encode("utf-8")
        assert REPLACEMENT not in piece or REPLACEMENT in full, pieces


def cut_at_first_stop(text: str, stops: Sequence[str]) -> tuple[str, str | None]:
    """The reference: text before the earliest-starting stop string (shorter first at a tie)."""
    hits = [(text.find(stop), len(stop), stop) for stop in stops if stop and stop in text]
    if not hits:
        return text, None
    start, _, stop = min(hits)
    return text[:start], stop


def test_decode_is_the_transformers_decode(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    samples = [tokenizer.encode(text) for text in TEXTS]
    samples += [[rng.randrange(len(tokenizer.hf)) for _ in range(40)] for _ in range(50)]
    samples += [[0, 1, 2, 5, *tokenizer.encode("a 😀 b"), 2]]
    for ids in samples:
        for skip in (True, False):
            assert tokenizer.decode(ids, skip) == tokenizer.hf.decode(ids, skip_special_tokens=skip)


def test_special_ids_are_what_skipping_removes(tokenizer: Tokenizer) -> None:
    added = tokenizer.hf.added_tokens_decoder
    assert tokenizer.special_ids == {i for i, token in added.items() if token.special}
    assert {tokenizer.hf.eos_token_id, tokenizer.hf.convert_tokens_to_ids("<file_sep>")} <= (
        tokenizer.special_ids
    )


def test_texts_split_characters_across_tokens(tokenizer: Tokenizer, stray_bytes: list[int]) -> None:
    """The corpus exercises the hold-back: many of its tokens end inside a character."""
    stray = set(stray_bytes)
    split = [sum(i in stray for i in tokenizer.encode(text)) for text in TEXTS]
    assert sum(split) >= 50 and split[2] >= 10


@pytest.mark.parametrize("max_chunk", [1, 2, 3, 5, 16, 10_000])
@pytest.mark.parametrize("seed", range(3))
def test_any_chunking_gives_the_full_decode(
    tokenizer: Tokenizer, max_chunk: int, seed: int
) -> None:
    rng = random.Random(seed)
    for text in (*TEXTS, "".join(TEXTS)):
        ids = tokenizer.encode(text)
        full = tokenizer.hf.decode(ids, skip_special_tokens=True)
        pieces = detokenize(IncrementalDetokenizer(tokenizer), chunked(ids, rng, max_chunk))
        assert "".join(pieces) == full
        assert_clean_pieces(pieces, full)


@pytest.mark.parametrize("seed", range(5))
def test_one_token_at_a_time_releases_each_character_once_complete(
    tokenizer: Tokenizer, seed: int
) -> None:
    """Text is held back only while the decode so far ends inside a character."""
    ids = tokenizer.encode(random.Random(seed).choice(TEXTS[1:6]))
    detokenizer = IncrementalDetokenizer(tokenizer)
    released = ""
    for end in range(1, len(ids) + 1):
        released += detokenizer.push(ids[end - 1 : end])
        so_far = tokenizer.hf.decode(ids[:end])
        assert so_far.startswith(released)
        assert released == so_far or so_far.endswith(REPLACEMENT)
    assert detokenizer.flush() == ""


@pytest.mark.parametrize("skip", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_special_tokens_in_the_output(tokenizer: Tokenizer, skip: bool, seed: int) -> None:
    rng = random.Random(seed)
    specials = sorted(tokenizer.special_ids)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        for _ in range(6):
            at = rng.randrange(len(ids) + 1)
            ids[at:at] = [rng.choice(specials)] * rng.randint(1, 12)
        full = tokenizer.hf.decode(ids, skip_special_tokens=skip)
        detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
        pieces = detokenize(detokenizer, chunked(ids, rng, 4))
        assert "".join(pieces) == full
        assert_clean_pieces(pieces, full)


@pytest.mark.parametrize("which", ["tokenizer", "sentencepiece"])
@pytest.mark.parametrize("burst", [True, False])
def test_prompts_arriving_together_are_encoded_by_one_call(
    which: str, burst: bool, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Same ids every way. A turn's long prompts are one call: in the pool when they are more
    than INLINE_TURN_CHARS in all (a burst), on the loop when fewer; a prompt of at most
    INLINE_CHARS never waits for the turn."""
    tok: Tokenizer = request.getfixturevalue(which)
    calls: list[tuple[str, int]] = []
    encode_many = tok.encode_many

    def spied(texts: list[str], special: bool) -> list[list[int]]:
        calls.append((threading.current_thread().name, len(texts)))
        return encode_many(texts, special)

    monkeypatch.setattr(tok, "encode_many", spied)
    size = INLINE_TURN_CHARS // 4 if burst else INLINE_CHARS * 2
    longs = [((text + " ") * (size // len(text) + 1))[:size] for text in TEXTS]
    longs = longs if burst else longs[:1]
    prompts = [TEXTS[0], *longs]
    chats = [[{"role": "user", "content": text}] for text in prompts]
    with_template = bool(tok.hf.chat_template)

    async def arrive_together() -> tuple[list[list[int]], list[list[int]]]:
        chat_ids = asyncio.gather(
            *(tok.apply_chat_template_async(c) for c in (chats if with_template else []))
        )
        plain_ids = asyncio.gather(*(tok.encode_async(t) for t in prompts))
        return await chat_ids, await plain_ids

    chat_ids, plain_ids = asyncio.run(arrive_together())
    assert chat_ids == [tok.apply_chat_template(c) for c in (chats if with_template else [])]
    assert plain_ids == [tok.encode(t) for t in prompts]
    # one call for the long plain prompts, one for the long chats where there is a template
    assert [n for _, n in calls] == [len(longs)] * (1 + with_template)
    loop_thread = threading.current_thread().name
    assert all((name != loop_thread) == burst for name, _ in calls)


def test_groups_are_consecutive_and_close_at_the_size() -> None:
    assert _groups(["ab", "cd", "e", "fgh"], 3) == [(0, 2), (2, 4)]
    assert _groups(["abcdef", "g"], 3) == [(0, 1), (1, 2)]
    assert _groups(["a"], 100) == [(0, 1)]
    assert _groups([], 3) == []


def test_a_burst_is_handed_out_group_by_group(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first group's requests get their ids while the pool still encodes the next: the
    second call waits for the first request to resume, which times out (and fails the batch)
    if ids were handed out only once the whole burst was encoded."""
    group = INLINE_TURN_CHARS
    monkeypatch.setattr(aserve.tokenizer, "POOL_GROUP_CHARS", group)
    prompts = [(f"prompt {i} " + "word " * group)[: group // 2] for i in range(6)]
    calls: list[int] = []
    first_answered = threading.Event()
    encode_many = tokenizer.encode_many

    def spied(texts: list[str], special: bool) -> list[list[int]]:
        calls.append(len(texts))
        if len(calls) == 2 and not first_answered.wait(5):
            raise TimeoutError("the first group was not handed out before the second ran")
        return encode_many(texts, special)

    monkeypatch.setattr(tokenizer, "encode_many", spied)

    async def one(i: int) -> list[int]:
        ids = await tokenizer.encode_async(prompts[i])
        if i == 0:
            first_answered.set()
        return ids

    async def burst() -> list[list[int]]:
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    assert asyncio.run(burst()) == [tokenizer.encode(p) for p in prompts]
    assert calls == [2, 2, 2]


@pytest.mark.parametrize("chars", [INLINE_CHARS * 2, INLINE_TURN_CHARS * 2])
def test_a_failed_batch_fails_its_requests_and_not_the_next(
    chars: int, tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the loop and in the pool alike."""
    long = "word " * (chars // 5)
    encode_many = tokenizer.encode_many

    def broken(texts: list[str], special: bool) -> list[list[int]]:
        raise RuntimeError("tokenizer broke")

    async def ask() -> list[int]:
        return await tokenizer.encode_async(long)

    monkeypatch.setattr(tokenizer, "encode_many", broken)
    with pytest.raises(RuntimeError, match="tokenizer broke"):
        asyncio.run(ask())
    monkeypatch.setattr(tokenizer, "encode_many", encode_many)
    assert asyncio.run(ask()) == tokenizer.encode(long)


def test_prompt_tokens_are_context_only(tokenizer: Tokenizer) -> None:
    rng = random.Random(7)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "Say hi 😀"}])
    emoji_end = tokenizer.encode("ends with an emoji 🎉")
    prompts = [chat, emoji_end, emoji_end[:-1], tokenizer.encode("中文"), [1, 2, 0], []]
    for prompt in prompts:
        for text in TEXTS:
            ids = tokenizer.encode(text)
            pieces = detokenize(IncrementalDetokenizer(tokenizer, prompt), chunked(ids, rng, 3))
            full = tokenizer.hf.decode(ids, skip_special_tokens=True)
            assert "".join(pieces) == full, prompt
            assert_clean_pieces(pieces, full)


def test_prompt_ending_inside_a_character_is_no_context(tokenizer: Tokenizer) -> None:
    """Output that completes the prompt's last character decodes as it would on its own."""
    for text in TEXTS:
        ids = tokenizer.encode(text)
        for cut in range(1, len(ids)):
            if tokenizer.decode(ids[:cut]).endswith(REPLACEMENT):
                detokenizer = IncrementalDetokenizer(tokenizer, ids[:cut])
                pieces = detokenize(detokenizer, [[i] for i in ids[cut:]])
                assert "".join(pieces) == tokenizer.hf.decode(ids[cut:])


@pytest.mark.parametrize("seed", range(20))
def test_random_token_ids(tokenizer: Tokenizer, stray_bytes: list[int], seed: int) -> None:
    """Whatever a model emits, including runs of bytes that never form characters."""
    rng = random.Random(seed)
    vocab = len(tokenizer.hf)
    ids = [
        rng.choice(stray_bytes) if rng.random() < 0.6 else rng.randrange(vocab)
        for _ in range(rng.randint(1, 200))
    ]
    skip = seed % 2 == 0
    full = tokenizer.hf.decode(ids, skip_special_tokens=skip)
    detokenizer = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hi"), skip)
    assert "".join(detokenize(detokenizer, chunked(ids, rng, 1 + seed % 4))) == full


@pytest.mark.parametrize("seed", range(8))
def test_sentencepiece_keeps_spaces_and_byte_runs(sentencepiece: Tokenizer, seed: int) -> None:
    """Context tokens keep the space of a word that starts a window, skipped special tokens are
    no context, and windows start where a byte run's character starts."""
    rng = random.Random(seed)
    texts = ["Hello world, the cat!", "the café 😀😃 naïve 中文字符 world", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 the 語"]
    eos = sentencepiece.hf.eos_token_id
    for text in texts:
        ids = sentencepiece.encode(text)
        for _ in range(3):
            at = rng.randrange(len(ids) + 1)
            ids[at:at] = [eos] * rng.randint(1, 8)
        full = sentencepiece.hf.decode(ids, skip_special_tokens=True)
        for max_chunk in (1, 2, 3, 7):
            pieces = detokenize(IncrementalDetokenizer(sentencepiece), chunked(ids, rng, max_chunk))
            assert "".join(pieces) == full
            assert_clean_pieces(pieces, full)
        for prompt_text in [*texts, "the 中文字符"]:
            prompt = sentencepiece.encode(prompt_text)
            detokenizer = IncrementalDetokenizer(sentencepiece, prompt)
            whole = sentencepiece.hf.decode(prompt + ids, skip_special_tokens=True)
            continuation = whole[len(sentencepiece.hf.decode(prompt)) :]
            assert continuation.startswith(" ") and continuation[1:] == full
            assert "".join(detokenize(detokenizer, chunked(ids, rng, 3))) == continuation

    prompt = sentencepiece.encode("the 中文字符")
    bytes_first = sentencepiece.encode("語𝔘 the cat")[1:]
    detokenizer = IncrementalDetokenizer(sentencepiece, prompt)
    whole = sentencepiece.hf.decode(prompt + bytes_first)
    pieces = detokenize(detokenizer, chunked(bytes_first, rng, 2))
    assert "".join(pieces) == whole[len(sentencepiece.hf.decode(prompt)) :] == "語𝔘 the cat"


def spy_on_decode(tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Patch the tokenizer to record how many ids each decode call gets."""
    sizes: list[int] = []
    decode: Callable[..., str] = tokenizer.decode

    def recording(token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        sizes.append(len(token_ids))
        return decode(token_ids, skip_special_tokens)

    monkeypatch.setattr(tokenizer, "decode", recording)
    return sizes


def test_each_push_decodes_a_few_tokens(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = tokenizer.encode(" ".join(TEXTS) * 20)
    sizes = spy_on_decode(tokenizer, monkeypatch)
    detokenizer = IncrementalDetokenizer(
        tokenizer, tokenizer.encode("A prompt, rather long. " * 50)
    )
    text = "".join(detokenize(detokenizer, [[i] for i in ids]))
    assert text == tokenizer.hf.decode(ids)
    assert len(ids) > 1000 and max(sizes) <= 8 and sum(sizes) <= 8 * len(ids)


def test_a_byte_level_decoder_decodes_once_a_push_and_sentencepiece_twice(
    tokenizer: Tokenizer, sentencepiece: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where decoding joins (byte-level BPE), the text a push read is its tokens' own decode,
    so the next push's context costs no second decode; SentencePiece keeps decoding it."""
    assert tokenizer.concatenative and not sentencepiece.concatenative
    for tok in (tokenizer, sentencepiece):
        ids, prompt = tok.encode(" ".join(TEXTS) * 5), tok.encode("A prompt.")
        whole = tok.hf.decode(prompt + ids)[len(tok.hf.decode(prompt)) :]
        detokenizer = IncrementalDetokenizer(tok, prompt)
        sizes = spy_on_decode(tok, monkeypatch)
        assert "".join(detokenize(detokenizer, [[i] for i in ids])) == whole
        calls_a_push = len(sizes) / len(ids)
        assert calls_a_push < 1.2 if tok is tokenizer else calls_a_push > 1.8


def test_stray_bytes_do_not_grow_the_window(
    tokenizer: Tokenizer, stray_bytes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model stuck on tokens that never complete a character still costs O(1) a token."""
    continuation = next(i for i in stray_bytes if tokenizer.decode([i, i]) == REPLACEMENT * 2)
    ids = [continuation] * 500 + tokenizer.encode(" back to text 😀") + [continuation] * 300
    sizes = spy_on_decode(tokenizer, monkeypatch)
    pieces = detokenize(IncrementalDetokenizer(tokenizer), [[i] for i in ids])
    assert "".join(pieces) == tokenizer.hf.decode(ids)
    assert max(sizes) <= 24
    assert sum(map(len, pieces[:-1])) >= 700


def run_matcher(matcher: StopStringMatcher, pieces: Sequence[str]) -> tuple[str, bool, int]:
    """Pushes pieces, checking that nothing comes after a stop; returns the text, whether it
    stopped, and the most text held back between pushes."""
    out, stopped, consumed, held = "", False, 0, 0
    for piece in pieces:
        if stopped:
            assert matcher.push(piece) == ("", True)
            continue
        text, stopped = matcher.push(piece)
        out += text
        consumed += len(piece)
        if not stopped:
            held = max(held, consumed - len(out))
    if not stopped:
        out += matcher.flush()
    return out, stopped or matcher.matched is not None, held


@pytest.mark.parametrize("seed", range(40))
def test_stop_matcher_is_the_whole_text_cut_at_the_first_stop(seed: int) -> None:
    rng = random.Random(seed)
    alphabet = rng.choice(["ab", "abc", "ab\n", "aé😀"])
    for _ in range(100):
        stops = [
            "".join(rng.choices(alphabet, k=rng.randint(0, 6))) for _ in range(rng.randint(0, 4))
        ]
        text = "".join(rng.choices(alphabet + "xy", k=rng.randint(0, 60)))
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randint(0, 12))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        matcher = StopStringMatcher(stops)
        out, stopped, held = run_matcher(matcher, pieces)
        expected, stop = cut_at_first_stop(text, stops)
        assert (out, matcher.matched) == (expected, stop), (text, stops, pieces)
        assert stopped == (stop is not None)
        assert held <= max((len(stop) - 1 for stop in stops if stop), default=0)


def test_stop_matcher_cases() -> None:
    assert run_matcher(StopStringMatcher(["Hello"]), ["Hello world"])[:2] == ("", True)
    assert run_matcher(StopStringMatcher(["\n\n"]), ["a\n", "\nb"])[:2] == ("a", True)
    assert run_matcher(StopStringMatcher(["STOP"]), list("go STOP now"))[:2] == ("go ", True)
    assert run_matcher(StopStringMatcher(["abcd", "bc"]), ["ab", "cx"])[:2] == ("a", True)
    assert run_matcher(StopStringMatcher(["abcd", "bc"]), ["ab", "cd"])[:2] == ("", True)
    assert run_matcher(StopStringMatcher(["abcd", "bc"]), ["xab", "c"])[:2] == ("xa", True)
    assert run_matcher(StopStringMatcher(["", "zz"]), ["a", "b"])[:2] == ("ab", False)

    held = StopStringMatcher(["Hello", "Help!"])
    assert held.push("Say Hel") == ("Say ", False)
    assert held.push("lo") == ("", True) and held.matched == "Hello"

    released = StopStringMatcher(["Hello", "Help!"])
    assert released.push("Say Hel") == ("Say ", False)
    assert released.push("p me") == ("Help me", False)
    assert released.flush() == "" and released.matched is None

    passthrough = StopStringMatcher([])
    assert [passthrough.push(piece) for piece in ["He", "llo", ""]] == [
        ("He", False),
        ("llo", False),
        ("", False),
    ]


def stops_across_token_boundaries(
    tokenizer: Tokenizer, ids: list[int], rng: random.Random
) -> list[str]:
    """Substrings of the decoded text that straddle a token boundary where the text before is
    complete, so they arrive over several tokens."""
    full = tokenizer.hf.decode(ids)
    ends = {
        len(text)
        for k in range(1, len(ids))
        if not (text := tokenizer.decode(ids[:k])).endswith(REPLACEMENT)
    }
    inside = sorted(end for end in ends if 0 < end < len(full))
    return [
        full[max(0, end - rng.randint(1, 6)) : end + rng.randint(1, 6)]
        for end in rng.sample(inside, min(len(inside), 6))
    ]


def run_stream(stream: TextStream, pieces: list[list[int]]) -> tuple[list[str], bool]:
    out: list[str] = []
    for at, piece in enumerate(pieces):
        delta = stream.push(piece)
        out.append(delta.text)
        if delta.stopped:
            assert all(stream.push(rest) == ("", True) for rest in pieces[at + 1 :])
            assert stream.finish() == ""
            return out, True
    out.append(stream.finish())
    return out, stream.stopped


@pytest.mark.parametrize("seed", range(6))
def test_stop_strings_split_across_tokens_never_show(tokenizer: Tokenizer, seed: int) -> None:
    rng = random.Random(seed)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        full = tokenizer.hf.decode(ids)
        for stop in stops_across_token_boundaries(tokenizer, ids, rng):
            stops = [stop, "never in the text"]
            expected, matched = cut_at_first_stop(full, stops)
            outputs = []
            for max_chunk in (1, 3, len(ids)):
                stream = TextStream(tokenizer, tokenizer.encode("Q: "), stops)
                pieces, stopped = run_stream(stream, chunked(ids, rng, max_chunk))
                assert stopped and stream.matched == matched == stop
                assert "".join(pieces) == expected
                assert all(stop not in piece for piece in pieces)
                assert_clean_pieces(pieces, full)
                outputs.append("".join(pieces))
            assert len(set(outputs)) == 1


def test_text_stream_without_a_stop_is_the_full_decode(tokenizer: Tokenizer) -> None:
    rng = random.Random(3)
    for text in TEXTS:
        ids = tokenizer.encode(text) + [tokenizer.hf.eos_token_id]
        stream = TextStream(tokenizer, (), ["never in the text", "\n\n\n\n"])
        pieces, stopped = run_stream(stream, chunked(ids, rng, 2))
        assert not stopped and stream.matched is None
        assert "".join(pieces) == tokenizer.hf.decode(ids, skip_special_tokens=True)

    raw = TextStream(tokenizer, (), [], skip_special_tokens=False)
    ids = tokenizer.encode("Hi") + [tokenizer.hf.eos_token_id]
    assert "".join(run_stream(raw, [ids])[0]) == "Hi<|im_end|>"


def test_stop_strings_count_only_once_min_tokens_are_out(tokenizer: Tokenizer) -> None:
    """A stop string that ends within the first min_tokens tokens' text is text like any
    other; one that ends later (even if it began earlier) stops the reply, however the
    tokens arrive."""
    ids = tokenizer.encode("one. two. three. four.")
    count = len(tokenizer.encode("one. two."))
    full = tokenizer.hf.decode(ids)
    for pieces in ([ids], [[t] for t in ids], [ids[:2], ids[2:]]):
        early = TextStream(tokenizer, (), ["."], min_tokens=count)
        text, stopped = run_stream(early, pieces)
        assert stopped and "".join(text) == "one. two. three"
        anywhere = TextStream(tokenizer, (), ["."], min_tokens=0)
        assert "".join(run_stream(anywhere, pieces)[0]) == "one"
    straddling = TextStream(tokenizer, (), ["two. three"], min_tokens=count)
    text, stopped = run_stream(straddling, [[t] for t in ids])
    assert stopped and "".join(text) == "one. "
    never = TextStream(tokenizer, (), ["."], min_tokens=len(ids) + 1)
    text, stopped = run_stream(never, [[t] for t in ids])
    assert not stopped and "".join(text) == full


def test_stop_that_only_the_end_of_generation_settles(tokenizer: Tokenizer) -> None:
    """A stop string found while a longer one that starts earlier may still complete waits for
    the end of generation to settle it."""
    stream = TextStream(tokenizer, (), ["B1B2B3", "B2"])
    ids = tokenizer.encode("x B1B2")
    assert stream.push(ids) == ("x ", False)
    assert stream.finish() == "B1" and stream.stopped and stream.matched == "B2"
    shown = TextStream(tokenizer, (), ["B1B2B3", "B2"], include_stop=True)
    assert shown.push(ids) == ("x ", False)
    assert shown.finish() == "B1B2" and shown.matched == "B2"


def test_include_stop_keeps_the_stop_string(tokenizer: Tokenizer) -> None:
    """vLLM's include_stop_str_in_output: the text runs to the end of the stop string that
    ended it, however the tokens arrive."""
    ids = tokenizer.encode("one. two. three.")
    for pieces in ([ids], [[t] for t in ids]):
        stream = TextStream(tokenizer, (), [". t", "never"], include_stop=True)
        text, stopped = run_stream(stream, pieces)
        assert stopped and "".join(text) == "one. t"


def test_text_length_bound_is_a_true_bound(tokenizer: Tokenizer, stray_bytes: list[int]) -> None:
    """No text tokenizes to fewer tokens than its characters over the bound: the server
    refuses prompts by that before tokenizing them."""
    bound = tokenizer.max_chars_per_token
    assert bound == max(len(piece) for piece in tokenizer.hf.get_vocab())
    rng = random.Random(0)
    texts = [*TEXTS, " " * 5000, "#" * 4000, "\n" + " " * 80, "<|im_start|>" * 50]
    texts += [tokenizer.decode(rng.sample(range(len(tokenizer.hf)), 64)) for _ in range(20)]
    for text in texts:
        assert len(tokenizer.encode(text)) * bound >= len(text), text[:40]


def bpe_backend(**options: object) -> Backend:
    from tokenizers import pre_tokenizers

    vocab = {"<unk>": 0, "a": 1, "b": 2, "ab": 3, "abab": 4}
    backend = Backend(models.BPE(vocab, [("a", "b"), ("ab", "ab")], unk_token="<unk>", **options))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return backend


def test_text_length_bound_only_where_it_holds(sentencepiece: Tokenizer) -> None:
    """BPE bounds a token by its longest piece, four times that behind a normalizer; BPE
    that fuses a run of unknown characters into one token, and Unigram, give no bound."""
    from transformers import PreTrainedTokenizerFast

    from aserve.tokenizer import chars_per_token_bound

    def bound(backend: Backend) -> int | None:
        return chars_per_token_bound(PreTrainedTokenizerFast(tokenizer_object=backend))

    assert bound(bpe_backend()) == 5
    fused = bpe_backend(fuse_unk=True)
    assert bound(fused) is None
    assert len(fused.encode("xyzxyzxyz").ids) == 1
    assert bound(bpe_backend(fuse_unk=True, byte_fallback=True)) == 5
    normalized = bpe_backend()
    normalized.normalizer = normalizers.NFC()
    assert bound(normalized) == 5 * 4
    assert sentencepiece.max_chars_per_token is None


def test_tokenizer_loads_without_the_model_config_class(smollm2_dir: Path, tmp_path: Path) -> None:
    """The light stand-in config gives the tokenizer AutoTokenizer picks by itself, the same ids
    and chat prompt; without a tokenizer_class it steps aside so the model type decides."""
    from transformers import AutoTokenizer

    from aserve.tokenizer import light_model_config

    ours = Tokenizer(smollm2_dir)
    try:
        reference = AutoTokenizer.from_pretrained(str(smollm2_dir))
        assert type(ours.hf) is type(reference)
        for text in TEXTS:
            assert ours.hf.encode(text) == reference.encode(text)
        messages = [{"role": "user", "content": TEXTS[0]}]
        assert ours.hf.apply_chat_template(messages, tokenize=False) == (
            reference.apply_chat_template(messages, tokenize=False)
        )
    finally:
        ours.close()
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    assert light_model_config(tmp_path) is None


@pytest.mark.parametrize("which", ["tokenizer", "sentencepiece"])
def test_the_named_class_loads_what_auto_tokenizer_loads(
    which: str, request: pytest.FixtureRequest
) -> None:
    """The class tokenizer_config.json names, loaded directly, is AutoTokenizer's tokenizer:
    same class, ids, decode, special tokens and chat prompt."""
    from transformers import AutoTokenizer

    tok: Tokenizer = request.getfixturevalue(which)
    folder = Path(tok.hf.name_or_path)
    auto = AutoTokenizer.from_pretrained(str(folder))
    assert type(tok.hf) is type(auto)
    assert tok.hf.all_special_ids == auto.all_special_ids
    for text in TEXTS:
        for special in (True, False):
            ids = tok.hf.encode(text, add_special_tokens=special)
            assert ids == auto.encode(text, add_special_tokens=special)
            assert tok.hf.decode(ids) == auto.decode(ids)
    if auto.chat_template:
        chat = [{"role": "user", "content": TEXTS[1]}]
        assert tok.hf.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(
            chat, tokenize=False
        )


def test_loading_a_named_class_leaves_transformers_auto_classes_unimported(
    smollm2_dir: Path,
) -> None:
    """In a fresh interpreter, as the server starts."""
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from aserve.tokenizer import Tokenizer; "
        f"Tokenizer(Path({str(smollm2_dir)!r})).close(); "
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.auto')))"
    )
    shown = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert shown.stdout.strip().splitlines()[-1] == "[]"


def test_keeping_the_last_tokens_is_transformers_left_truncation(tmp_path: Path) -> None:
    """`encode_keeping_last` (vLLM's truncate_prompt_tokens) gives what transformers' own
    truncation from the left gives, for a text ([CLS] and [SEP] kept) and for a pair
    (longest part first, ties included), on a BERT tokenizer and on one that adds BOS and
    EOS; a text that fits is `encode`'s, and a limit within the special tokens is refused."""
    import transformers
    from tokenizers import processors

    words = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "far", "away"]
    bert = tmp_path / "bert"
    bert.mkdir()
    (bert / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", *words]))
    transformers.BertTokenizerFast(str(bert / "vocab.txt")).save_pretrained(bert)
    bos = tmp_path / "bos"
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(["<s>", "</s>", *words])}))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A </s>", pair="<s> $A </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 1)]
    )
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(bos)
    first, second = " ".join(words + words[:3]), " ".join(words[2:8])
    for folder in (bert, bos):
        ours = Tokenizer(folder)
        theirs = transformers.AutoTokenizer.from_pretrained(folder)
        theirs.truncation_side = "left"
        for limit in (3, 4, 9, 14, 15, 16, 40):
            expected = theirs(first, truncation=True, max_length=limit)["input_ids"]
            assert ours.encode_keeping_last(limit, first) == expected
            assert len(expected) == min(limit, len(ours.encode(first)))
            pair = theirs(first, second, truncation=True, max_length=limit + 2)["input_ids"]
            assert ours.encode_keeping_last(limit + 2, first, second) == pair
        assert ours.encode_keeping_last(100, first) == ours.encode(first)
        assert ours.encode_keeping_last(100, first, second) == ours.encode_pair(first, second)
        with pytest.raises(ValueError, match="2 special tokens"):
            ours.encode_keeping_last(2, first)
