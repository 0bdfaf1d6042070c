"""Generated token ids to reply text, with stop strings: the one path that streamed and
non-streamed replies share, so both give the same text.

A stop string ends the reply at its first occurrence and never appears in it, even when it
arrives split over many tokens. Text that may still turn into a stop string is held back until
later text settles it. The result is exactly the whole text cut before the earliest-starting
occurrence of any stop string (at equal starts the shorter one counts as matched); the request
must therefore keep generating while a longer stop string could still begin earlier than a
complete shorter one.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import NamedTuple

from aserve.tokenizer import IncrementalDetokenizer, Tokenizer


def partial_marker_length(text: str, marker: str) -> int:
    """How many characters at the end of `text` could be the beginning of `marker`: what a
    stream holds back until later text settles whether the marker is coming."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class StopStringMatcher:
    """Finds stop strings in text that arrives in pieces, in O(len(piece) + longest stop) a push.

    An Aho-Corasick automaton over the stop strings follows the text; its state is the longest
    tail of the text that begins some stop string, which is exactly what must be held back. A
    complete stop string ends the reply once no possible one that starts earlier is pending.
    Empty stop strings are ignored; with none left the text passes through. Stop strings that
    end at or before `floor` (a position in the text; `open_from` sets it) do not count.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.matched: str | None = None
        self._goto: list[dict[str, int]] = [{}]
        self._depth = [0]
        self._match: list[str | None] = [None]
        for stop in dict.fromkeys(s for s in stops if s):
            self._add(stop)
        self._fail = self._link()
        self._state = 0
        self._position = 0
        self._held = ""
        self._best: tuple[int, str] | None = None
        self._floor = 0.0

    def open_from(self, floor: float) -> None:
        """Count only stop strings that end after text position `floor` (inf: none yet)."""
        self._floor = floor

    @property
    def position(self) -> int:
        """How much text has been pushed."""
        return self._position

    @property
    def stopped(self) -> bool:
        return self.matched is not None

    def push(self, text: str) -> tuple[str, bool]:
        """Text that is now safe to emit, and whether a stop string has ended the reply; once it
        has, nothing more comes out."""
        if self.matched is not None:
            return "", True
        if len(self._goto) == 1:
            return text, False
        buffer = self._held + text
        origin = self._position - len(self._held)
        goto, fail, depth, match = self._goto, self._fail, self._depth, self._match
        state, best = self._state, self._best
        for end, char in enumerate(text, self._position + 1):
            while state and char not in goto[state]:
                state = fail[state]
            state = goto[state].get(char, 0)
            found = match[state]
            if (
                found is not None
                and end > self._floor
                and (best is None or end - len(found) < best[0])
            ):
                best = (end - len(found), found)
            if best is not None and best[0] <= end - depth[state]:
                self.matched = best[1]
                return buffer[: best[0] - origin], True
        self._state, self._best = state, best
        self._position += len(text)
        cut = len(buffer) - depth[state]
        self._held = buffer[cut:]
        return buffer[:cut], False

    def flush(self) -> str:
        """The held-back text once generation has ended, cut before a stop string that was only
        waiting for a longer, earlier one to be ruled out."""
        if self.matched is not None:
            return ""
        held, self._held = self._held, ""
        if self._best is None:
            return held
        start, self.matched = self._best
        return held[: start - (self._position - len(held))]

    def _add(self, stop: str) -> None:
        node = 0
        for char in stop:
            if char not in self._goto[node]:
                self._goto[node][char] = len(self._goto)
                self._goto.append({})
                self._depth.append(self._depth[node] + 1)
                self._match.append(None)
            node = self._goto[node][char]
        self._match[node] = stop

    def _link(self) -> list[int]:
        """Failure links, breadth first; a node without its own stop string inherits the longest
        stop string that ends it."""
        fail = [0] * len(self._goto)
        queue = deque(self._goto[0].values())
        while queue:
            node = queue.popleft()
            for char, child in self._goto[node].items():
                suffix = fail[node]
                while suffix and char not in self._goto[suffix]:
                    suffix = fail[suffix]
                fail[child] = self._goto[suffix].get(char, 0)
                if self._match[child] is None:
                    self._match[child] = self._match[fail[child]]
                queue.append(child)
        return fail


class TextDelta(NamedTuple):
    text: str
    stopped: bool


class TextStream:
    """Token ids in, reply text out: incremental detokenizing, then stop strings, which count
    only once `min_tokens` tokens are out (vLLM's rule: a stop string must end in the text of
    a later token). With `include_stop` (vLLM's include_stop_str_in_output) the text ends
    with the stop string that ended it instead of before it."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] = (),
        stops: Sequence[str] = (),
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
        include_stop: bool = False,
        shown_special_ids: frozenset[int] = frozenset(),
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_ids, skip_special_tokens, shown_special_ids
        )
        self._stops = StopStringMatcher(stops)
        self._include_stop = include_stop
        self._short_by = min_tokens
        if min_tokens:
            self._stops.open_from(math.inf)

    @property
    def stopped(self) -> bool:
        return self._stops.stopped

    @property
    def matched(self) -> str | None:
        """The stop string that ended the reply, if one did."""
        return self._stops.matched

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        """New text for these tokens; `stopped` tells the caller to end the request."""
        if self._stops.stopped:
            return TextDelta("", True)
        if not self._short_by:
            return self._ending(*self._stops.push(self._detokenizer.push(token_ids)))
        early, late = token_ids[: self._short_by], token_ids[self._short_by :]
        self._short_by -= len(early)
        text, _ = self._stops.push(self._detokenizer.push(early))  # cannot stop yet
        if self._short_by:
            return TextDelta(text, False)
        self._stops.open_from(self._stops.position)
        more, stopped = self._stops.push(self._detokenizer.push(late))
        return self._ending(text + more, stopped)

    def finish(self) -> str:
        """The rest of the text once generation ended without a stop string; may still end at
        one (check `stopped`)."""
        if self._stops.stopped:
            return ""
        text, stopped = self._stops.push(self._detokenizer.flush())
        if not stopped:
            text += self._stops.flush()
        return self._ending(text, self._stops.stopped).text

    def _ending(self, text: str, stopped: bool) -> TextDelta:
        """The text with the stop string that ended it, when it is to be shown."""
        if stopped and self._include_stop and self._stops.matched is not None:
            text += self._stops.matched
        return TextDelta(text, stopped)
