"""The output channel between the scheduler and a request's reader."""

from __future__ import annotations

import asyncio

from aserve.sampling_params import TokenLogprob
from aserve.scheduler.request import FinishReason, OutputChannel, ReqOutput


def test_a_reader_that_fell_behind_gets_everything_pending_as_one_output() -> None:
    async def scenario() -> tuple[ReqOutput, ReqOutput]:
        channel = OutputChannel()
        channel.put_nowait(ReqOutput((5,), (TokenLogprob(5, -0.5, ()),)))
        channel.put_nowait(ReqOutput((6, 7), ()))
        channel.put_nowait(ReqOutput((8,), (), FinishReason.LENGTH))
        merged = await channel.get()
        channel.put_nowait(ReqOutput((), (), FinishReason.ABORT, "late"))
        return merged, await channel.get()

    merged, single = asyncio.run(scenario())
    assert merged.token_ids == (5, 6, 7, 8)
    assert [lp.token_id for lp in merged.logprobs] == [5]
    assert merged.finish_reason is FinishReason.LENGTH and merged.error is None
    assert single == ReqOutput((), (), FinishReason.ABORT, "late")


def test_a_waiting_reader_wakes_on_the_next_output() -> None:
    async def scenario() -> ReqOutput:
        channel = OutputChannel()
        reader = asyncio.create_task(channel.get())
        await asyncio.sleep(0)
        assert not reader.done()
        asyncio.get_running_loop().call_soon(channel.put_nowait, ReqOutput((9,), ()))
        return await asyncio.wait_for(reader, timeout=5)

    assert asyncio.run(scenario()) == ReqOutput((9,), ())


def test_a_listener_takes_outputs_in_the_putters_call_until_cleared() -> None:
    async def scenario() -> tuple[list[ReqOutput], ReqOutput]:
        channel = OutputChannel()
        taken: list[ReqOutput] = []
        channel.put_nowait(ReqOutput((1,), ()))
        channel.listen(taken.append)
        channel.put_nowait(ReqOutput((2,), ()))  # behind a pending output: it waits too
        assert taken == [] and channel.get_nowait() == ReqOutput((1, 2), ())
        channel.put_nowait(ReqOutput((3,), ()))
        channel.unlisten()
        channel.put_nowait(ReqOutput((4,), (), FinishReason.LENGTH))
        return taken, await asyncio.wait_for(channel.get(), timeout=5)

    taken, rest = asyncio.run(scenario())
    assert taken == [ReqOutput((3,), ())]
    assert rest == ReqOutput((4,), (), FinishReason.LENGTH)
    assert OutputChannel().get_nowait() is None


def test_a_listener_told_to_gather_gets_the_first_output_then_every_n_tokens_and_the_last() -> None:
    channel, taken = OutputChannel(), []
    channel.listen(taken.append, gather=3)
    for token in range(1, 8):
        channel.put_nowait(ReqOutput((token,), ()))
    channel.put_nowait(ReqOutput((8,), (), FinishReason.LENGTH))
    assert taken == [
        ReqOutput((1,), ()),
        ReqOutput((2, 3, 4), ()),
        ReqOutput((5, 6, 7), ()),
        ReqOutput((8,), (), FinishReason.LENGTH),
    ]
    # Stopped listening (a client that fell behind): what was gathered waits for the reader.
    channel, taken = OutputChannel(), []
    channel.listen(taken.append, gather=2)
    channel.put_nowait(ReqOutput((1,), ()))
    channel.put_nowait(ReqOutput((2,), ()))
    channel.unlisten()
    channel.put_nowait(ReqOutput((3,), ()))
    assert taken == [ReqOutput((1,), ())]
    assert channel.get_nowait() == ReqOutput((2, 3), ())
