"""`aserve --dp 2`: two replicas of the embedded model behind SGLang's router, on loopback.

One fleet serves the whole module (its start costs ~15 s on a 2-core box); the fault tests
kill or stop one replica and wait until the launcher has started it again, so each test finds
two ready replicas. The launcher's log names each replica's URL and pid.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aserve import replicas
from aserve.replicas import free_port, http_status, place_on_cpus, place_on_gpus

KEY = "fleet-key"
MODEL = "SmolLM2-135M-Instruct"

needs_router = pytest.mark.skipif(
    importlib.util.find_spec("sglang_router") is None,
    reason='SGLang\'s router is not installed: pip install -e ".[router]"',
)


# ---- placement (no processes) -------------------------------------------------------


def test_replicas_take_their_own_gpus_or_share_them_by_memory() -> None:
    four = place_on_gpus(2, 2, ["0", "1", "2", "3"], 0.9)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in four] == ["0,1", "2,3"]
    assert [(p.memory_ratio, p.wave) for p in four] == [(None, 0), (None, 0)]
    shared = place_on_gpus(3, 1, ["5", "7"], 0.9)
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in shared] == ["5", "7", "5"]
    # GPU 5 holds replicas 0 and 2: the first may fill it to half the ratio, the second to all.
    assert [p.memory_ratio for p in shared] == [pytest.approx(0.45), None, pytest.approx(0.9)]
    assert [p.wave for p in shared] == [0, 0, 1]
    with pytest.raises(Exception, match="--tp 2 needs 2 GPUs"):
        place_on_gpus(2, 2, ["0"], 0.9)


def test_replicas_split_the_cpu_cores() -> None:
    split = place_on_cpus(2, [0, 1, 2, 3, 4])
    assert [p.cpus for p in split] == [(0, 1), (2, 3)]
    assert [p.env["OMP_NUM_THREADS"] for p in split] == ["2", "2"]
    crowded = place_on_cpus(3, [0, 1])
    assert [p.cpus for p in crowded] == [(0, 1)] * 3
    assert {p.env["OMP_NUM_THREADS"] for p in crowded} == {"1"}


def test_free_port_skips_ports_handed_out_to_processes_not_yet_listening(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The system may give a port out again until someone binds it: the router's port and
    the replicas' must not come back as another's."""
    handed = iter([4001, 4002, 4003])

    class OneBind:
        def __enter__(self) -> OneBind:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def bind(self, address: tuple[str, int]) -> None:
            self.port = next(handed)

        def getsockname(self) -> tuple[str, int]:
            return ("127.0.0.1", self.port)

    monkeypatch.setattr(replicas.socket, "socket", OneBind)
    assert free_port(avoid={4001, 4002}) == 4003


def test_replica_and_router_commands_follow_the_options() -> None:
    """Each replica runs the same command line with later options that win (its own port on
    loopback, --dp 1, a drain delay); the router gets --host/--port, the policy, the fast
    health checks and --router-args last."""
    from aserve.cli import parse_config
    from aserve.replicas import DRAIN_DELAY_S, Launcher, StopSignals

    argv = ["--dp", "2", "--host", "0.0.0.0", "--port", "8080", "--max-running-requests", "8"]
    argv += ["--router-policy", "round_robin", "--router-args", "--retry-max-retries 3"]
    config, args = parse_config(argv)
    launcher = Launcher(config, args, argv, StopSignals())
    waves = launcher.plan()
    replicas = [r for wave in waves for r in wave]
    assert len(replicas) == 2 and len({r.port for r in replicas}) == 2
    for replica in replicas:
        mine, mine_args = parse_config(replica.command[3:])
        assert (mine.host, mine.port, mine_args.dp_size) == ("127.0.0.1", replica.port, 1)
        assert mine_args.drain_delay == DRAIN_DELAY_S
        assert mine.scheduler.max_running_requests == 8
    router = launcher.router_command()
    assert router[1:3] == ["-m", "sglang_router.launch_router"]
    urls = [f"http://127.0.0.1:{r.port}" for r in replicas]
    joined = " ".join(router)
    workers = " ".join(urls)
    assert f"--host 0.0.0.0 --port 8080 --worker-urls {workers} --policy round_robin" in joined
    assert "--health-check-interval-secs 2 --health-failure-threshold 2" in joined
    assert "--cb-timeout-duration-secs 4" in joined
    assert router[-2:] == ["--retry-max-retries", "3"]


def python(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    """This interpreter run with `args`, its output captured as text."""
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=timeout_s
    )


def test_dp_refuses_shell_mode_in_one_line() -> None:
    done = python("-m", "aserve", "--dp", "2", "--shell")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "aserve: error: --shell-mode chats with one server: leave out --dp (see aserve --help)"
    ]


def test_dp_without_the_router_is_one_line() -> None:
    hide_router = "import sys; sys.modules['sglang_router'] = None; from aserve.cli import main; "
    done = python("-c", hide_router + "sys.exit(main(['--dp', '2']))")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "aserve: error: --dp runs the replicas behind SGLang's router, which is not installed: "
        'pip install "aserve[router]"'
    ]


@needs_router
def test_a_replica_that_cannot_start_stops_the_launch_in_one_line(tmp_path: Path) -> None:
    # A folder with neither config.json nor a GGUF: the options pass, the replicas' loads fail.
    done = python("-m", "aserve", "--dp", "2", "--model", str(tmp_path), timeout_s=300)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert re.fullmatch(r"aserve: error: replica\d exited with code 2 before it was ready.*", last)


@needs_router
def test_replicas_do_not_outlive_a_killed_launcher(smollm2_dir: Path, tmp_path: Path) -> None:
    """SIGKILL to the launcher (no chance to stop anything): its replicas get SIGTERM from
    the kernel (PR_SET_PDEATHSIG) and exit."""
    log = tmp_path / "launcher.log"
    with log.open("w") as out:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "aserve", "--dp", "2", "--model", str(smollm2_dir)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    deadline = time.monotonic() + 120
    while len(pids := re.findall(r"started replica\d \(pid (\d+)\)", log.read_text())) < 2:
        assert time.monotonic() < deadline and launcher.poll() is None, log.read_text()
        time.sleep(0.2)
    launcher.kill()
    launcher.wait()
    deadline = time.monotonic() + 60
    while any(alive(int(pid)) for pid in pids):
        assert time.monotonic() < deadline, f"replicas {pids} outlived the launcher"
        time.sleep(0.2)


# ---- the fleet -------------------------------------------------------------------------


class Fleet:
    def __init__(self, model_dir: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("w")
        self.proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "aserve", "--dp", "2", "--model", str(model_dir)),
                *("--port", str(self.port), "--api-key", KEY, "--num-pages", "8192"),
                *("--served-model-name", MODEL),
                # The replies are compared across batchings, which change a prompt's K/V in
                # float32's last bits (a prefill step's rows past BLAS_ROWS go through BLAS):
                # a float16 cache, the default, can round those to neighbouring values and
                # part a near-tie (1 run in 3 did, at one of 64 replies).
                *("--kv-cache-dtype", "float32"),
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def wait_for(self, pattern: str, timeout_s: float = 300.0, after: int = 0) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(pattern, self.log()[after:])
            if found:
                return found
            if self.proc.poll() is not None:
                raise RuntimeError(f"the launcher exited:\n{self.log()}")
            time.sleep(0.2)
        raise TimeoutError(f"no '{pattern}' in {timeout_s} s:\n{self.log()}")

    def replica_url(self, index: int) -> str:
        return self.wait_for(rf"replica {index}: (http://127\.0\.0\.1:\d+)").group(1)

    def replica_pid(self, index: int) -> int:
        return int(re.findall(rf"started replica{index} \(pid (\d+)\)", self.log())[-1])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        return int(self.proc.returncode)


def alive(pid: int) -> bool:
    """Running: not gone, and not a zombie that nobody has reaped yet (an orphan's zombie
    waits for whatever reaps orphans here)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture(scope="module")
def fleet(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    if importlib.util.find_spec("sglang_router") is None:
        pytest.skip('SGLang\'s router is not installed: pip install -e ".[router]"')
    running = Fleet(smollm2_dir, tmp_path_factory.mktemp("fleet") / "launcher.log")
    pids: list[int] = []
    try:
        running.wait_for(r"ready: 2 replicas behind SGLang's router")
        yield running
        pids = [running.replica_pid(0), running.replica_pid(1)]
    finally:
        code = running.stop()
    assert code == 0, running.log()
    assert not any(alive(pid) for pid in pids), "a replica outlived its launcher"


def client(base_url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def metric(base_url: str, name: str) -> float:
    """The sum of one metric's samples on one replica (0 if it has none yet)."""
    with urllib.request.urlopen(base_url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == f"aserve:{name}"
    )


def served(base_url: str) -> float:
    return metric(base_url, "request_success_total")


def router_sees_healthy(fleet: Fleet, url: str) -> bool:
    with urllib.request.urlopen(fleet.url + "/workers", timeout=10) as response:
        workers = json.loads(response.read())["workers"]
    return any(w["url"] == url and w["is_healthy"] for w in workers)


def wait_restarted(fleet: Fleet, index: int, old_pid: int, timeout_s: float = 300.0) -> None:
    """Until the launcher has a new process for replica `index`, it answers /health and the
    router counts it healthy again (its health check runs every 2 s)."""
    url = fleet.replica_url(index)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        restarted = fleet.replica_pid(index) != old_pid
        if restarted and http_status(url + "/health", 5) == 200 and router_sees_healthy(fleet, url):
            return
        time.sleep(0.5)
    raise TimeoutError(f"replica {index} did not come back:\n{fleet.log()}")


async def chat(base_url: str, content: str, max_tokens: int, **extra: Any) -> str:
    async with client(base_url) as api:
        reply = await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=0,
            **extra,
        )
    return reply.choices[0].message.content or ""


async def stream_chat(base_url: str, content: str, max_tokens: int) -> str | None:
    """The finish reason of a streamed chat, or None if the stream broke off without one."""
    reason = None
    async with client(base_url) as api:
        stream = await api.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].finish_reason:
                reason = chunk.choices[0].finish_reason
    return reason


async def finish_reason(base_url: str, messages: list[dict[str, str]]) -> str:
    async with client(base_url) as api:
        reply = await api.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, temperature=0
        )
    return reply.choices[0].finish_reason


def busier_replica(fleet: Fleet) -> int:
    """The replica running more requests now (prompts that differ from their first
    characters spread over both; the fault tests hit one that holds streams)."""
    running = [metric(fleet.replica_url(i), "num_requests_running") for i in range(2)]
    assert max(running) > 0, running
    return int(running[1] > running[0])


def test_64_chats_through_the_router_equal_one_servers(fleet: Fleet) -> None:
    """All answered, greedy replies identical to a single server's (replica 0 asked directly),
    and both replicas served some of them (the prompts differ from their first characters:
    the cache-aware router keeps prompts that share most of their text on one replica)."""
    prompts = [f"{i} is a number. Name one thing about it." for i in range(64)]
    replicas = [fleet.replica_url(0), fleet.replica_url(1)]
    before = [served(url) for url in replicas]

    async def ask_all(base_url: str) -> list[str]:
        return list(await asyncio.gather(*(chat(base_url, p, 12) for p in prompts)))

    routed = asyncio.run(ask_all(fleet.url))
    spread = [served(url) - b for url, b in zip(replicas, before)]
    direct = asyncio.run(ask_all(replicas[0]))
    assert all(routed) and routed == direct
    assert sum(spread) == 64 and min(spread) > 0, spread


def test_api_key_is_checked_by_the_replicas_behind_the_router(fleet: Fleet) -> None:
    anonymous = openai.OpenAI(base_url=fleet.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        anonymous.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1
        )


def test_cache_aware_routing_keeps_a_system_prompt_on_one_replica(fleet: Fleet) -> None:
    """Three long system prompts, four questions each, asked in turn: the cache-aware router
    sends every question of a prompt to one replica, a round-robin router over the same
    replicas spreads them, and the replicas' prefix-cache hit rate shows the difference."""
    replicas = [fleet.replica_url(0), fleet.replica_url(1)]
    filler = " ".join(f"Rule {k}: answer briefly and politely, in plain words." for k in range(24))
    systems = [f"You are assistant {name}. {filler}" for name in ("Ada", "Bo", "Cy")]
    rr_port = free_port()
    rr_router = subprocess.Popen(
        [
            *(sys.executable, "-m", "sglang_router.launch_router", "--policy", "round_robin"),
            *("--host", "127.0.0.1", "--port", str(rr_port), "--worker-urls", *replicas),
            *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())),
            *("--log-level", "warn"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def flush() -> None:
        for url in replicas:
            request = urllib.request.Request(
                url + "/flush_cache", method="POST", headers={"Authorization": f"Bearer {KEY}"}
            )
            with urllib.request.urlopen(request, timeout=30) as response:
                assert response.status == 200

    def run_phase(router_url: str) -> tuple[float, list[set[int]]]:
        flush()
        hits0 = [metric(u, "prefix_cache_hits_total") for u in replicas]
        queries0 = [metric(u, "prefix_cache_queries_total") for u in replicas]
        placed: list[set[int]] = [set() for _ in systems]
        for question in range(4):
            for group, system in enumerate(systems):
                before = [served(u) for u in replicas]
                messages = [
                    {"role": "system", "content": system},
                    {"role": "user", "content": f"Question {question}: what is {question} + 1?"},
                ]
                assert asyncio.run(finish_reason(router_url, messages))
                after = [served(u) for u in replicas]
                placed[group] |= {i for i in range(2) if after[i] > before[i]}
        hits = sum(metric(u, "prefix_cache_hits_total") for u in replicas) - sum(hits0)
        queries = sum(metric(u, "prefix_cache_queries_total") for u in replicas) - sum(queries0)
        return hits / queries, placed

    try:
        deadline = time.monotonic() + 120
        rr_url = f"http://127.0.0.1:{rr_port}"
        while http_status(rr_url + "/readiness", 5) != 200 and time.monotonic() < deadline:
            time.sleep(0.5)
        aware_rate, aware_placed = run_phase(fleet.url)
        robin_rate, robin_placed = run_phase(f"http://127.0.0.1:{rr_port}")
    finally:
        rr_router.terminate()
        rr_router.wait(30)
    print(f"\nprefix-cache hit rate: cache-aware {aware_rate:.3f}, round-robin {robin_rate:.3f}")
    assert all(len(p) == 1 for p in aware_placed), aware_placed
    assert all(len(p) == 2 for p in robin_placed), robin_placed
    assert aware_rate > robin_rate + 0.1


def test_sigterm_of_a_replica_under_load_loses_no_request(fleet: Fleet) -> None:
    """32 streams, then SIGTERM to a replica running some of them and 8 more requests while
    it drains: every one finishes normally; the launcher then starts that replica again."""

    async def scenario() -> tuple[int, int, list[str | None], list[str]]:
        streams = [
            asyncio.create_task(stream_chat(fleet.url, f"{i} is my number. Tell a story.", 48))
            for i in range(32)
        ]
        await asyncio.sleep(2.0)
        victim = busier_replica(fleet)
        pid = fleet.replica_pid(victim)
        os.kill(pid, signal.SIGTERM)
        late = []
        for i in range(8):
            late.append(asyncio.create_task(chat(fleet.url, f"{i}: a late question.", 4)))
            await asyncio.sleep(0.75)
        finished = list(await asyncio.gather(*streams))
        return victim, pid, finished, list(await asyncio.gather(*late))

    victim, pid, finished, late = asyncio.run(asyncio.wait_for(scenario(), 300))
    assert finished == ["length"] * 32
    assert all(late)
    wait_restarted(fleet, victim, pid)


def test_sigkill_of_a_replica_under_load(fleet: Fleet) -> None:
    """32 streams, then SIGKILL to a replica running some of them: every stream ends
    (finished, or broken off with an error; none hangs), the next 16 requests all succeed on
    the survivor, and once the launcher has started the dead one again the router uses it
    again: the prompts that broke, asked again, go where the cache-aware router had put them."""
    prompts = [f"{i} is a colour. Describe it." for i in range(32)]

    async def scenario() -> tuple[int, int, list[str | None | BaseException]]:
        streams = [asyncio.create_task(stream_chat(fleet.url, p, 64)) for p in prompts]
        await asyncio.sleep(2.0)
        victim = busier_replica(fleet)
        pid = fleet.replica_pid(victim)
        os.kill(pid, signal.SIGKILL)
        return victim, pid, list(await asyncio.gather(*streams, return_exceptions=True))

    victim, pid, outcomes = asyncio.run(asyncio.wait_for(scenario(), 180))
    broken = [p for p, o in zip(prompts, outcomes) if o != "length"]
    assert 0 < len(broken) < 32, outcomes
    for outcome in outcomes:
        assert outcome in ("length", None) or isinstance(outcome, openai.APIError), repr(outcome)

    async def ask(questions: list[str]) -> list[str]:
        return list(await asyncio.gather(*(chat(fleet.url, q, 4) for q in questions)))

    assert all(asyncio.run(ask([f"{i}, after the fault." for i in range(16)])))
    wait_restarted(fleet, victim, pid)
    back = fleet.replica_url(victim)
    assert served(back) == 0  # a new process
    assert all(asyncio.run(ask(broken)))
    assert served(back) > 0
