"""A running server end to end over HTTP (scripts/device-run.sh's `http-check` step: a dummy
Qwen3-0.6B shape on the GPU): /generate's logprobs from logprob_start_len, penalised streams
aborted by rid and by a dropped connection while others run (an abort there once took the
process down with a device-side assert), health and greedy tokens after them, /v1/responses.
Usage: python3 scripts/gpu_http_check.py [max tokens of the penalised streams, 400]"""

import asyncio
import json
import sys

import aiohttp

BASE = "http://127.0.0.1:1919"
PROMPT = list(range(100, 140))


async def post(session, path, body):
    async with session.post(BASE + path, json=body) as r:
        return r.status, await r.json()


async def stream_until(session, body, stop_after, abort=None):
    """Stream `body`; after `stop_after` events abort it by rid (abort='rid') or drop the
    connection (abort='drop'); returns (events, last finish reason)."""
    events = []
    async with session.post(BASE + "/generate", json={**body, "stream": True}) as r:
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            events.append(json.loads(line[6:]))
            if len(events) == stop_after and abort == "rid":
                async with aiohttp.ClientSession() as other:
                    await post(other, "/abort_request", {"rid": body["rid"]})
            if len(events) == stop_after and abort == "drop":
                r.close()
                return events, "dropped"
    return events, events[-1]["meta_info"]["finish_reason"]


async def main() -> int:
    failures = []
    async with aiohttp.ClientSession() as s:
        body = {
            "input_ids": PROMPT,
            "sampling_params": {"temperature": 0, "max_new_tokens": 16, "ignore_eos": True},
            "return_logprob": True,
            "top_logprobs_num": 2,
        }
        _, whole = await post(s, "/generate", {**body, "logprob_start_len": 0})
        _, tail = await post(s, "/generate", {**body, "logprob_start_len": 30})
        m, t = whole["meta_info"], tail["meta_info"]
        print(
            "generate:",
            len(m["input_token_logprobs"]),
            len(m["output_token_logprobs"]),
            "cached",
            t["cached_tokens"],
            m["finish_reason"],
        )
        if len(m["input_token_logprobs"]) != 40 or len(t["input_token_logprobs"]) != 10:
            failures.append("input logprob counts")
        diff = max(
            abs(a[0] - b[0])
            for a, b in zip(m["input_token_logprobs"][30:], t["input_token_logprobs"])
        )
        print("start 30 vs the whole prompt's tail, max |diff|:", round(diff, 4))
        if diff > 0.1 or whole["output_ids"] != tail["output_ids"]:
            failures.append("tail logprobs or tokens differ")
        # penalised streams (the server's crash before 05733fe): 4 aborted by rid, 4 dropped,
        # 4 left to finish
        sampling = {
            "max_new_tokens": int(sys.argv[1]) if len(sys.argv) > 1 else 400,
            "ignore_eos": True,
            "repetition_penalty": 1.3,
            "temperature": 0.7,
        }
        jobs = []
        for i in range(12):
            job = {"input_ids": PROMPT[: 10 + i], "rid": f"p{i}", "sampling_params": sampling}
            mode = "rid" if i < 4 else "drop" if i < 8 else None
            jobs.append(stream_until(s, job, 3 + i % 3, mode))
        results = await asyncio.gather(*jobs)
        reasons = [r[1] if isinstance(r[1], str) else r[1]["type"] for r in results]
        print("penalised streams:", reasons)
        if reasons[:4] != ["abort"] * 4 or reasons[8:] != ["length"] * 4:
            failures.append("aborts")
        async with s.get(BASE + "/health") as r:
            print("health after the aborts:", r.status)
            if r.status != 200:
                failures.append("health")
        _, again = await post(s, "/generate", {**body, "logprob_start_len": 0})
        if again["output_ids"] != whole["output_ids"]:
            failures.append("greedy output changed after the aborts")
        status, resp = await post(
            s,
            "/v1/responses",
            {"input": "<t5> <t6> <t7>", "temperature": 0, "max_output_tokens": 8},
        )
        print(
            "responses:",
            status,
            resp.get("status"),
            [o["type"] for o in resp.get("output", [])],
            resp.get("usage"),
        )
        if status != 200 or resp["usage"]["output_tokens"] != 8:
            failures.append("responses")
    print("FAILURES:", failures)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
