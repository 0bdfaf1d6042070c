"""Metrics as a Prometheus scraper reads them, and the SGLang-style stats lines."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from aserve.metrics import FINISH_REASONS, Metrics, SchedulerSnapshot, StatsLogger
from aserve.scheduler.request import FinishReason

ZERO_AT_START = [
    "aserve:prompt_tokens_total",
    "aserve:generation_tokens_total",
    "aserve:num_requests_running",
    "aserve:num_requests_waiting",
    "aserve:kv_cache_usage_perc",
    "aserve:swa_kv_cache_usage_perc",
    "aserve:prefix_cache_queries_total",
    "aserve:prefix_cache_hits_total",
    "aserve:prefix_cache_hit_rate",
    "aserve:num_preemptions_total",
    "aserve:time_to_first_token_seconds_count",
    "aserve:inter_token_latency_seconds_count",
    "aserve:e2e_request_latency_seconds_count",
    "aserve:request_prompt_tokens_count",
    "aserve:request_generation_tokens_count",
    *(f'aserve:request_success_total{{finished_reason="{r}"}}' for r in FINISH_REASONS),
]
SNAPSHOT = SchedulerSnapshot(
    running=4,
    waiting=2,
    used_kv_tokens=300,
    total_kv_tokens=1000,
    prompt_tokens_admitted_total=0,
    prompt_tokens_cached_total=0,
    retractions_total=0,
)


def scrape(metrics: Metrics) -> dict[str, float]:
    """One scrape as `name{label="value",...}` -> value; every sample must carry the
    instance's model_name, which the keys then leave out."""
    body, content_type = metrics.render()
    assert content_type.startswith("text/plain; version=")
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == metrics.model_name, sample
            extra = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
            samples[f"{sample.name}{{{extra}}}" if extra else sample.name] = sample.value
    return samples


def snapshot(admitted: int, cached: int, retractions: int, **gauges: int) -> SchedulerSnapshot:
    return SNAPSHOT._replace(
        prompt_tokens_admitted_total=admitted,
        prompt_tokens_cached_total=cached,
        retractions_total=retractions,
        **gauges,
    )


def test_fresh_scrape_has_every_vllm_named_series_at_zero() -> None:
    samples = scrape(Metrics("tiny"))
    assert {name: samples[name] for name in ZERO_AT_START} == dict.fromkeys(ZERO_AT_START, 0.0)
    for histogram in ("time_to_first_token", "inter_token_latency", "e2e_request_latency"):
        bounds = [
            float(key.split('le="')[1].rstrip('"}'))
            for key in samples
            if key.startswith(f"aserve:{histogram}_seconds_bucket") and "+Inf" not in key
        ]
        assert min(bounds) == 0.001 and max(bounds) >= 60, histogram


def test_token_hooks_count_tokens_and_observe_latencies_per_token() -> None:
    metrics = Metrics("tiny")
    metrics.on_first_token(0.3, prompt_tokens=7)
    metrics.on_tokens(1, 0.004)
    metrics.on_tokens(4, 0.16)
    samples = scrape(metrics)
    assert samples["aserve:prompt_tokens_total"] == 7
    assert samples["aserve:generation_tokens_total"] == 6
    assert samples["aserve:time_to_first_token_seconds_count"] == 1
    assert samples["aserve:time_to_first_token_seconds_sum"] == pytest.approx(0.3)
    assert samples['aserve:time_to_first_token_seconds_bucket{le="0.2"}'] == 0
    assert samples['aserve:time_to_first_token_seconds_bucket{le="0.5"}'] == 1
    assert samples["aserve:inter_token_latency_seconds_count"] == 5
    assert samples["aserve:inter_token_latency_seconds_sum"] == pytest.approx(0.164)
    assert samples['aserve:inter_token_latency_seconds_bucket{le="0.005"}'] == 1
    assert samples['aserve:inter_token_latency_seconds_bucket{le="0.05"}'] == 5


def test_finish_counts_requests_by_reason_and_observes_their_sizes() -> None:
    metrics = Metrics("tiny")
    metrics.on_finish("stop", 1.5, prompt_tokens=10, generation_tokens=20)
    metrics.on_finish(FinishReason.STOP, 2.5, prompt_tokens=30, generation_tokens=40)
    metrics.on_finish("length", 0.5, prompt_tokens=5, generation_tokens=16)
    metrics.on_finish(FinishReason.ERROR, 0.0, prompt_tokens=9000, generation_tokens=0)
    samples = scrape(metrics)
    by_reason = {
        r: samples[f'aserve:request_success_total{{finished_reason="{r}"}}'] for r in FINISH_REASONS
    }
    assert by_reason == {"stop": 2, "length": 1, "abort": 0, "error": 1}
    assert samples["aserve:e2e_request_latency_seconds_count"] == 4
    assert samples["aserve:e2e_request_latency_seconds_sum"] == pytest.approx(4.5)
    assert samples["aserve:request_prompt_tokens_sum"] == 9045
    assert samples['aserve:request_prompt_tokens_bucket{le="5000.0"}'] == 3
    assert samples["aserve:request_generation_tokens_sum"] == 76
    assert samples['aserve:request_generation_tokens_bucket{le="20.0"}'] == 3


def test_scheduler_snapshots_set_gauges_and_turn_totals_into_counter_increments() -> None:
    metrics = Metrics("tiny")
    metrics.update_scheduler(snapshot(100, 40, 1, running=3, waiting=2, used_kv_tokens=256))
    metrics.update_scheduler(snapshot(150, 90, 1, running=1, waiting=0, used_kv_tokens=500))
    samples = scrape(metrics)
    assert samples["aserve:num_requests_running"] == 1
    assert samples["aserve:num_requests_waiting"] == 0
    assert samples["aserve:kv_cache_usage_perc"] == 0.5
    assert samples["aserve:swa_kv_cache_usage_perc"] == 0  # no sliding-window pool
    metrics.update_scheduler(
        snapshot(150, 90, 1, running=1, used_kv_tokens=500, used_window_tokens=200)._replace(
            total_window_tokens=800
        )
    )
    samples = scrape(metrics)
    assert samples["aserve:swa_kv_cache_usage_perc"] == 0.25
    assert samples["aserve:prefix_cache_queries_total"] == 150
    assert samples["aserve:prefix_cache_hits_total"] == 90
    assert samples["aserve:prefix_cache_hit_rate"] == pytest.approx(0.6)
    assert samples["aserve:num_preemptions_total"] == 1


def test_totals_that_restart_count_from_zero_again() -> None:
    metrics = Metrics("tiny")
    metrics.update_scheduler(snapshot(100, 40, 3))
    metrics.update_scheduler(snapshot(30, 10, 1))
    samples = scrape(metrics)
    assert samples["aserve:prefix_cache_queries_total"] == 130
    assert samples["aserve:prefix_cache_hits_total"] == 50
    assert samples["aserve:num_preemptions_total"] == 4


def test_instances_share_no_state_and_leave_the_global_registry_alone() -> None:
    busy, idle = Metrics("same"), Metrics("same")
    busy.on_first_token(0.1, prompt_tokens=5)
    busy.on_finish("abort", 1.0, prompt_tokens=5, generation_tokens=1)
    busy.update_scheduler(snapshot(10, 5, 2))
    samples = scrape(idle)
    assert {name: samples[name] for name in ZERO_AT_START} == dict.fromkeys(ZERO_AT_START, 0.0)
    assert scrape(busy)["aserve:prompt_tokens_total"] == 5
    assert b"aserve:" not in generate_latest(REGISTRY)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stats_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "aserve.stats"]


def test_every_prefill_batch_logs_an_sglang_line(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="aserve.stats")
    stats = StatsLogger(clock=FakeClock())
    stats.on_step("prefill", SNAPSHOT, 0.1, 120, new_seqs=2, cached_tokens=64)
    stats.on_step("prefill", SNAPSHOT._replace(waiting=0), 0.1, 8, new_seqs=1)
    assert stats_lines(caplog) == [
        "Prefill batch. #new-seq: 2, #new-token: 120, #cached-token: 64, token usage: 0.30, "
        "#running-req: 4, #queue-req: 2",
        "Prefill batch. #new-seq: 1, #new-token: 8, #cached-token: 0, token usage: 0.30, "
        "#running-req: 4, #queue-req: 0",
    ]


def test_a_sliding_window_pool_adds_its_usage_as_sglang_writes_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="aserve.stats")
    stats = StatsLogger(clock=FakeClock())
    windowed = SNAPSHOT._replace(used_window_tokens=50, total_window_tokens=800)
    stats.on_step("prefill", windowed, 0.1, 120, new_seqs=2, cached_tokens=64)
    assert stats_lines(caplog) == [
        "Prefill batch. #new-seq: 2, #new-token: 120, #cached-token: 64, token usage: 0.30, "
        "swa token usage: 0.06, #running-req: 4, #queue-req: 2",
    ]


def test_decode_line_comes_once_per_interval_with_throughput_over_busy_time(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="aserve.stats")
    clock = FakeClock()
    stats = StatsLogger(clock=clock)
    for _ in range(4):
        clock.now += 1.0
        stats.on_step("decode", SNAPSHOT, 1.0, 4)
    assert stats_lines(caplog) == []
    clock.now += 1.0
    stats.on_step("decode", SNAPSHOT, 1.0, 4, cuda_graph=True)
    first = (
        "Decode batch. #running-req: 4, #token: 300, token usage: 0.30, cuda graph: True, "
        "gen throughput (token/s): 4.00, #queue-req: 2"
    )
    assert stats_lines(caplog) == [first]
    clock.now += 0.5
    stats.on_step("decode", SNAPSHOT, 0.5, 3)
    clock.now += 60.0
    stats.on_step("prefill", SNAPSHOT, 1.0, 50, new_seqs=1)
    clock.now += 0.5
    stats.on_step("decode", SNAPSHOT._replace(running=5, used_kv_tokens=420), 0.5, 3)
    assert stats_lines(caplog)[2:] == [
        "Decode batch. #running-req: 5, #token: 420, token usage: 0.42, cuda graph: False, "
        "gen throughput (token/s): 3.00, #queue-req: 2"
    ]


def test_silent_logger_emits_nothing(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="aserve.stats")
    clock = FakeClock()
    stats = StatsLogger(interval_s=1.0, silent=True, clock=clock)
    for kind in ("prefill", "decode", "decode", "decode"):
        clock.now += 2.0
        stats.on_step(kind, SNAPSHOT, 2.0, 10, new_seqs=1)
    assert stats_lines(caplog) == []
