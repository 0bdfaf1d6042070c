"""Schemathesis against the server's own /openapi.json, on the embedded model.

Every operation gets requests generated from its schema (positive) and requests that break
it (negative, for operations with a body). Each reply must conform to the description
(status code, content type, JSON body schema, headers), be no 5xx, come within the timeout,
and every schema-breaking request must be refused with a 4xx. Schemathesis's "positive data
acceptance" check is off: a request that fits the schema can still be refused for what a
schema cannot say (a prompt and max_tokens that together overflow the context, token ids
beyond this model's vocabulary, another model's name), and those 400s are right.

The context is cut to 64 tokens and unset max_tokens default to 8, so each generation is
short and the run takes a minute or two on two CPU cores. Examples are drawn from a fixed
seed so CI is repeatable; ASERVE_FUZZ_EXAMPLES raises their number for a longer hunt.
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.server_utils import ServerProcess, serving

schemathesis = pytest.importorskip("schemathesis", reason="needs the test extra: schemathesis")
hypothesis = pytest.importorskip("hypothesis", reason="schemathesis needs hypothesis")

API_KEY = "fuzz-key"
EXAMPLES = int(os.environ.get("ASERVE_FUZZ_EXAMPLES", "40"))


@pytest.fixture(scope="module")
def fuzz_server(smollm2_dir: Path) -> Iterator[ServerProcess]:
    yield from serving(
        ServerProcess(
            [
                "--model",
                str(smollm2_dir),
                "--max-seq-len-override",
                "64",
                "--default-sampling",
                '{"max_tokens": 8}',
                "--num-pages",
                "2048",
                "--max-running-requests",
                "16",
                "--api-key",
                API_KEY,
                "--silent-output",
            ]
        )
    )


def fuzz(
    operation: schemathesis.APIOperation,
    mode: schemathesis.GenerationMode,
    url: str,
    statuses: Counter[tuple[str, int]],
    failures: list[str],
) -> None:
    """Run one operation's examples of one mode, counting replies and collecting failures."""
    from hypothesis import HealthCheck, Phase, given, settings

    auth = {"Authorization": f"Bearer {API_KEY}"}

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        database=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def call(case: schemathesis.Case) -> None:
        response = case.call(base_url=url, headers=auth, timeout=60)
        statuses[(operation.label, response.status_code)] += 1
        try:
            case.validate_response(response, headers=auth)
        except Exception as error:
            failures.append(f"{operation.label} ({mode.value}): {error}"[:3000])

    call()


@pytest.mark.slow
def test_fuzz_against_the_openapi_description(
    fuzz_server: ServerProcess, capsys: pytest.CaptureFixture[str]
) -> None:
    from schemathesis import GenerationMode

    url = fuzz_server.base_url
    config = schemathesis.Config.from_dict(
        {"checks": {"positive_data_acceptance": {"enabled": False}}}
    )
    schema = schemathesis.openapi.from_url(url + "/openapi.json", config=config)
    statuses: Counter[tuple[str, int]] = Counter()
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    for operation in operations:
        modes = [GenerationMode.POSITIVE]
        if operation.body:
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            fuzz(operation, mode, url, statuses, failures)

    total = sum(statuses.values())
    by_class = Counter(status // 100 for (_, status) in statuses.elements())
    with capsys.disabled():
        print(f"\nfuzz: {total} requests over {len(operations)} operations:", end=" ")
        print(", ".join(f"{k}xx {by_class[k]}" for k in sorted(by_class)))
        for label in sorted({label for label, _ in statuses}):
            counts = {s: n for (op, s), n in sorted(statuses.items()) if op == label}
            print(f"  {label}: {counts}")
    assert by_class[5] == 0, [key for key in statuses if key[1] >= 500]
    assert not failures, "\n\n".join(failures[:5])
    labels = {label for label, _ in statuses}
    assert {"POST /v1/chat/completions", "POST /v1/completions", "POST /generate"} <= labels
    assert by_class[2] >= 50 and by_class[4] >= 50
    assert fuzz_server.health() == 200
