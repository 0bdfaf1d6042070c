"""Admission: how many sequences the server has accepted and not yet answered.

A request takes its place the moment its handler starts, before its body is read, parsed or
tokenized, and gives it back on whatever terminal reply it gets. So the count holds under
any burst: counting only what reached the scheduler's queue let every request still being
parsed or tokenized through together. The places are sequences (a request with `n: 4`, or a
completion of four prompts, holds four), since that is what takes a running slot.

The capacity is `--max-running-requests` + `--max-queued-requests`: what can run plus what
may wait for a slot. The tokenizer pool only works for requests that hold places, so its
backlog has the same bound.
"""

from __future__ import annotations

from types import TracebackType

from aserve.server.openai import APIError


class Admission:
    def __init__(self, capacity: int | None) -> None:
        self.capacity = capacity
        self.in_use = 0

    def reserve(self, count: int = 1) -> Reservation:
        """Places for `count` sequences, or a 503 that says the server is full."""
        reservation = Reservation(self)
        reservation.resize(count)
        return reservation

    def _take(self, count: int) -> None:
        if self.capacity is not None and count > 0 and self.in_use + count > self.capacity:
            raise APIError(
                f"the server is full: {self.in_use} of its {self.capacity} places for running "
                "and queued sequences are taken; retry later",
                503,
                error_type="server_error",
                code="queue_full",
            )
        self.in_use += count


class Reservation:
    """Places held by one request; release it in a `with` block or a `finally`."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self.count = 0

    def resize(self, count: int) -> None:
        """Hold `count` places in all (a request learns its size once parsed)."""
        self._admission._take(count - self.count)
        self.count = count

    def release(self) -> None:
        self._admission.in_use -= self.count
        self.count = 0

    def __enter__(self) -> Reservation:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
