"""OpenAI's Responses API replies: a chat reply's reasoning, text and tool calls as output
items (reasoning, message, function_call), whole or as the API's typed stream events.

The request runs as the chat request it amounts to (openai.parse_responses), so templates,
tool syntax, reasoning parsers and constraints behave as on /v1/chat/completions; only the
shape of what goes back differs.
"""

from __future__ import annotations

import secrets
from typing import Any

import orjson

from aserve.server.generation import Choice, Delta
from aserve.server.openai import GenerationRequest, ResponseHead
from aserve.server.responses import ReplySplitter


def item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


class ResponsesShaper:
    """The reply of one /v1/responses request (its one choice). Streamed, each output item
    opens with `response.output_item.added` when its first text is ready and closes with
    `response.output_item.done`; a tool call's item opens as the call does (closing the
    message before it), its arguments stream as `function_call_arguments.delta` where the
    syntax streams them (ReplySplitter) and it closes when the call does; text after calls
    comes at the end in a message of its own; `response.completed` carries the whole
    response."""

    DONE = b""  # the Responses stream ends with response.completed, no [DONE]

    def __init__(self, parsed: GenerationRequest, head: ResponseHead, choice: Choice) -> None:
        assert parsed.responses_api is not None
        self.parsed = parsed
        self.head = head
        self.choice = choice
        self.echoed = parsed.responses_api
        self._splitter = ReplySplitter(parsed)
        self._sequence = 0
        self._reasoning: list[str] | None = None  # the open reasoning item's text
        self._reasoning_id = ""
        self._message: list[str] | None = None  # the open message's text
        self._message_id = ""
        self._output: list[dict[str, Any]] = []  # the items closed so far
        # function_call items open while their arguments stream, by call id, with the text
        # sent; the call ids by chat delta index
        self._open_calls: dict[str, tuple[dict[str, Any], list[str]]] = {}
        self._call_ids: dict[int, str] = {}

    # ---- whole replies -----------------------------------------------------------------

    def full_body(self, results: list[list[Delta]]) -> dict[str, Any]:
        deltas = results[0]
        reasoning, text, calls = "", "", []
        for delta in deltas:
            more_reasoning, more_text, more_calls = self._splitter.push(delta)
            reasoning, text = reasoning + more_reasoning, text + more_text
            calls += more_calls
        finish = deltas[-1].finish_reason if deltas else "abort"
        output = []
        if reasoning:
            output.append(_reasoning_item(item_id("rs"), reasoning))
        if text or not calls:
            output.append(_message_item(item_id("msg"), text, _item_status(finish)))
        output += [_call_item(call.id, call.name, call.arguments, "completed") for call in calls]
        return self._response(output, finish)

    def _response(self, output: list[dict[str, Any]], finish: str | None) -> dict[str, Any]:
        status = "in_progress" if finish is None else "completed"
        details = None
        if finish == "length":
            status, details = "incomplete", {"reason": "max_output_tokens"}
        elif finish == "abort":
            status, details = "incomplete", {"reason": "aborted"}
        return {
            "id": self.head.id,
            "object": "response",
            "created_at": self.head.created,
            "status": status,
            "incomplete_details": details,
            "error": None,
            "model": self.head.model,
            "output": output,
            **self.echoed,
            "usage": None if finish is None else self._usage(),
        }

    def _usage(self) -> dict[str, Any]:
        choice = self.choice
        prompt, completion = len(choice.prompt_ids), choice.completion_tokens
        cached = choice.req.cached_tokens if choice.req is not None else 0
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": completion,
            "output_tokens_details": {"reasoning_tokens": self._splitter.reasoning_tokens},
            "total_tokens": prompt + completion,
        }

    # ---- streams -------------------------------------------------------------------------

    def opening_events(self) -> bytes:
        response = self._response([], None)
        created = self._event("response.created", response=response)
        return _frame(created) + _frame(self._event("response.in_progress", response=response))

    def closing_events(self) -> bytes:
        return b""  # response.completed went out with the last delta

    def delta_events(self, index: int, delta: Delta) -> bytes:
        reasoning, text, closed = self._splitter.push(delta)
        final = delta.finish_reason is not None
        events = []
        if reasoning:
            events += self._reasoning_delta(reasoning)
        if text and not final:  # content before a call (the rest waits for the end)
            events += self._close_reasoning()
            events += self._message_delta(text)
        for piece in self._splitter.take_call_deltas():
            events += self._call_piece(piece)
        for call in closed:
            events += self._close_call(call.id, "completed")
        if final:
            events += self._close_reasoning()
            for call_id in list(self._open_calls):  # cut while its arguments streamed
                events += self._close_call(call_id, "incomplete")
            if text:
                events += self._message_delta(text)
            if self._message is None and not self._splitter.called:
                events += self._message_delta("")  # a reply with no text has an empty message
            events += self._close_message(_item_status(delta.finish_reason))
            response = self._response(self._output, delta.finish_reason)
            done = response["status"] == "completed"
            events.append(
                self._event(f"response.{'completed' if done else 'incomplete'}", response=response)
            )
        return b"".join(_frame(event) for event in events)

    def _reasoning_delta(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._reasoning is None:
            self._reasoning, self._reasoning_id = [], item_id("rs")
            added = {"type": "reasoning", "id": self._reasoning_id, "summary": [], "content": []}
            events.append(self._item_event("response.output_item.added", added))
        self._reasoning.append(text)
        events.append(
            self._event(
                "response.reasoning_text.delta",
                item_id=self._reasoning_id,
                output_index=len(self._output),
                content_index=0,
                delta=text,
            )
        )
        return events

    def _close_reasoning(self) -> list[dict[str, Any]]:
        if self._reasoning is None:
            return []
        text, self._reasoning = "".join(self._reasoning), None
        index = len(self._output)
        done = self._event(
            "response.reasoning_text.done",
            item_id=self._reasoning_id,
            output_index=index,
            content_index=0,
            text=text,
        )
        item = _reasoning_item(self._reasoning_id, text)
        return [done, self._item_done(item)]

    def _message_delta(self, text: str) -> list[dict[str, Any]]:
        events = []
        if self._message is None:
            self._message, self._message_id = [], item_id("msg")
            opened = _message_item(self._message_id, "", "in_progress")
            opened["content"] = []
            events.append(self._item_event("response.output_item.added", opened))
            events.append(self._part_event("response.content_part.added", ""))
        if text:
            self._message.append(text)
            events.append(self._text_event("response.output_text.delta", delta=text))
        return events

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        if self._message is None:
            return []
        text, self._message = "".join(self._message), None
        return [
            self._text_event("response.output_text.done", text=text),
            self._part_event("response.content_part.done", text),
            self._item_done(_message_item(self._message_id, text, status)),
        ]

    def _call_piece(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat `tool_calls` entry as the Responses API's events: a call's opening (or a
        whole call) opens a function_call item, after the message so far; its arguments'
        text goes out as `function_call_arguments.delta`."""
        events = []
        arguments = piece["function"]["arguments"]
        if "id" in piece:
            events += self._close_reasoning() + self._close_message("completed")
            item = _call_item(piece["id"], piece["function"]["name"], "", "in_progress")
            self._open_calls[piece["id"]] = (item, [])
            self._call_ids[piece["index"]] = piece["id"]
            events.append(self._item_event("response.output_item.added", item))
        item, sent = self._open_calls[self._call_ids[piece["index"]]]
        if arguments:
            sent.append(arguments)
            where = {"item_id": item["id"], "output_index": len(self._output)}
            events.append(
                self._event("response.function_call_arguments.delta", **where, delta=arguments)
            )
        return events

    def _close_call(self, call_id: str, status: str) -> list[dict[str, Any]]:
        """A call's item done: its arguments the text sent as deltas."""
        if call_id not in self._open_calls:
            return []
        item, sent = self._open_calls.pop(call_id)
        done = {**item, "arguments": "".join(sent), "status": status}
        where = {"item_id": item["id"], "output_index": len(self._output)}
        arguments = done["arguments"]
        return [
            self._event("response.function_call_arguments.done", **where, arguments=arguments),
            self._item_done(done),
        ]

    def _item_event(self, kind: str, item: dict[str, Any]) -> dict[str, Any]:
        return self._event(kind, output_index=len(self._output), item=item)

    def _item_done(self, item: dict[str, Any]) -> dict[str, Any]:
        event = self._item_event("response.output_item.done", item)
        self._output.append(item)
        return event

    def _part_event(self, kind: str, text: str) -> dict[str, Any]:
        return self._event(
            kind,
            item_id=self._message_id,
            output_index=len(self._output),
            content_index=0,
            part=_text_part(text),
        )

    def _text_event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return self._event(
            kind,
            item_id=self._message_id,
            output_index=len(self._output),
            content_index=0,
            logprobs=[],
            **fields,
        )

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}


def _frame(event: dict[str, Any]) -> bytes:
    """An SSE frame as OpenAI sends it: the event's type, then its JSON."""
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


def _item_status(finish: str | None) -> str:
    """A message cut short (max_output_tokens, an abort) is incomplete, as OpenAI marks it."""
    return "completed" if finish == "stop" else "incomplete"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message_item(identifier: str, text: str, status: str) -> dict[str, Any]:
    return {
        "type": "message",
        "id": identifier,
        "status": status,
        "role": "assistant",
        "content": [_text_part(text)],
    }


def _reasoning_item(identifier: str, text: str) -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": identifier,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
    }


def _call_item(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id("fc"),
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
