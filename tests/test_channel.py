"""The output channel between the scheduler and a request's reader."""

from __future__ import annotations

import asyncio

from aserve.sampling_params import TokenLogprob
from aserve.scheduler.request import (
    AUTO_MIN_STREAMS,
    AUTO_RETRY_STEPS,
    FinishReason,
    OutputChannel,
    ReqOutput,
    StreamPace,
)


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
    channel.listen(taken.append, StreamPace(3), phase=2)  # due when tokens put + 2 is 3k
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
    channel.listen(taken.append, StreamPace(2), phase=1)
    channel.put_nowait(ReqOutput((1,), ()))
    channel.put_nowait(ReqOutput((2,), ()))
    channel.unlisten()
    channel.put_nowait(ReqOutput((3,), ()))
    assert taken == [ReqOutput((1,), ())]
    assert channel.get_nowait() == ReqOutput((2, 3), ())


def test_gathering_streams_of_other_phases_send_in_other_steps() -> None:
    """Eight streams switched to two tokens an event at the same step: from then on each
    step hands events to half of them (a token each step to every stream), not to all of
    them every other step."""
    pace = StreamPace(1)
    channels, taken = [OutputChannel() for _ in range(8)], [[] for _ in range(8)]
    for phase, (channel, out) in enumerate(zip(channels, taken)):
        channel.listen(out.append, pace, phase=phase)
        channel.put_nowait(ReqOutput((0,), ()))
    pace.gather = 2
    sent_each_step = []
    for step in range(1, 8):
        before = sum(map(len, taken))
        finish = FinishReason.LENGTH if step == 7 else None
        for channel in channels:
            channel.put_nowait(ReqOutput((step,), (), finish))
        sent_each_step.append(sum(map(len, taken)) - before)
    assert sent_each_step == [4] * 6 + [8]  # the finish goes to every stream
    for out in taken:  # every token arrives once, in order, at most two an event
        assert [t for o in out for t in o.token_ids] == list(range(8))
        assert max(len(o.token_ids) for o in out) <= 2


def test_auto_pace_gathers_two_tokens_only_while_many_streams_keep_the_gpu_waiting() -> None:
    pace = StreamPace(None)
    pace.on_decode_step(1, gpu_wait_share=1.0)  # one stream: its own launch is the wait
    pace.on_decode_step(AUTO_MIN_STREAMS - 1, gpu_wait_share=1.0)
    assert pace.gather == 1
    pace.on_decode_step(256, gpu_wait_share=0.4)
    assert pace.gather == 1
    pace.on_decode_step(256, gpu_wait_share=0.6)
    assert pace.gather == 2
    pace.on_decode_step(129, gpu_wait_share=0.0)  # kept until the batch has halved
    assert pace.gather == 2
    pace.on_decode_step(127, gpu_wait_share=0.0)
    assert pace.gather == 1
    # A batch that stays large: one token an event again once the GPU has not waited a while.
    pace.on_decode_step(256, gpu_wait_share=0.9)
    for _ in range(AUTO_RETRY_STEPS - 2):
        pace.on_decode_step(256, gpu_wait_share=0.0)
    pace.on_decode_step(256, gpu_wait_share=0.2)  # a wait resets the count
    for _ in range(AUTO_RETRY_STEPS - 1):
        pace.on_decode_step(256, gpu_wait_share=0.0)
    assert pace.gather == 2
    pace.on_decode_step(256, gpu_wait_share=0.0)
    assert pace.gather == 1
    fixed = StreamPace(3)
    fixed.on_decode_step(1, gpu_wait_share=0.0)
    fixed.on_decode_step(256, gpu_wait_share=1.0)
    assert fixed.gather == 3


def test_a_pace_that_drops_back_to_one_sends_what_was_held_with_the_next_token() -> None:
    pace, channel, taken = StreamPace(2), OutputChannel(), []
    channel.listen(taken.append, pace, phase=1)
    channel.put_nowait(ReqOutput((1,), ()))
    channel.put_nowait(ReqOutput((2,), ()))  # held: one token of two
    pace.gather = 1
    channel.put_nowait(ReqOutput((3,), ()))
    channel.put_nowait(ReqOutput((4,), ()))
    assert taken == [ReqOutput((1,), ()), ReqOutput((2, 3), ()), ReqOutput((4,), ())]


def test_the_gpu_wait_share_follows_the_last_decode_launches() -> None:
    from types import SimpleNamespace

    from aserve.cli import parse_config
    from aserve.scheduler.scheduler import Scheduler

    scheduler = SimpleNamespace(gpu_wait_share=0.0)
    for _ in range(16):
        Scheduler.note_decode_launch(scheduler, True)  # type: ignore[arg-type]
    assert scheduler.gpu_wait_share > 0.8
    for _ in range(16):
        Scheduler.note_decode_launch(scheduler, False)  # type: ignore[arg-type]
    assert scheduler.gpu_wait_share < 0.2
    assert parse_config([])[0].stream_interval is None  # auto
    assert parse_config(["--stream-interval", "2"])[0].stream_interval == 2
    assert parse_config(["--stream-interval", "auto"])[0].stream_interval is None
