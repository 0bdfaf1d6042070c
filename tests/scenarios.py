"""Request scenarios that several test files drive through a live scheduler loop."""

from __future__ import annotations

from aserve import LLM, SamplingParams
from aserve.scheduler.request import FinishReason


def abort_one_of_two(
    llm: LLM,
    victim_prompt: list[int],
    survivor_prompt: list[int],
    params: SamplingParams,
    outputs_before_abort: int,
) -> tuple[FinishReason | None, list[int]]:
    """Submit two requests and abort the first once it produced `outputs_before_abort`
    outputs; returns its finish reason and every token the second produced. The LLM's
    scheduler loop must already run (call `generate` once before)."""
    scheduler = llm.scheduler

    async def scenario() -> tuple[FinishReason | None, list[int]]:
        victim = scheduler.make_request(victim_prompt, params)
        survivor = scheduler.make_request(survivor_prompt, params)
        scheduler.submit(victim)
        scheduler.submit(survivor)
        for _ in range(outputs_before_abort):
            await victim.channel.get()
        scheduler.abort(victim)
        reason = None
        while reason is None:
            reason = (await victim.channel.get()).finish_reason
        produced: list[int] = []
        while True:
            out = await survivor.channel.get()
            produced.extend(out.token_ids)
            if out.finish_reason is not None:
                return reason, produced

    return llm._loop.run_until_complete(scenario())
