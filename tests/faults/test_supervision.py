"""`pagedserve up` supervises its children as Kubernetes would: a child that exits is restarted
on the same port (exponential back-off) and the router serves through it; a child that keeps
dying trips the crash-loop limit and stops `up` with a clear message. Real processes throughout:
`pagedserve up` with the tiny model, its redis-server, workers and router, killed with SIGKILL.

Streams in flight when a child is killed do not fail: a stream whose decode worker is lost
moves to another pair (here: the same worker, restarted), a prompt whose prefill worker is lost
is retried there, and Redis is only a hint (`test_streams_in_flight_survive_...`).
"""

from __future__ import annotations

import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest
from support.oracle import make_prompts
from support.processes import alive, children_of
from support.waits import wait_until

from pagedserve.client import Client
from pagedserve.sampling_params import SamplingParams
from pagedserve.supervisor import shm_segments

GREEDY = SamplingParams(temperature=0.0, max_tokens=16)
LONG = SamplingParams(temperature=0.0, max_tokens=160, ignore_eos=True)
PROMPTS = make_prompts((5, 21, 40), seed=171)
BACK_TIMEOUT_S = 90.0  # a restarted worker loads the model again (slow on a shared host)
LEASES_BACK_S = 10.0  # well under a KV lease's 30 s (prefill_worker/lease_table.py)


def start_up(model_dir, log_dir: pathlib.Path, *extra: str) -> tuple[subprocess.Popen, str]:
    stderr = (log_dir / "up.stderr").open("w")
    up = subprocess.Popen(
        [sys.executable, "-m", "pagedserve.cli", "up", "--model", str(model_dir), "--port", "0",
         "--kv-cache-memory", "4MiB", "--log-dir", str(log_dir), "--restart-backoff", "0.2",
         # NOTE: every prompt through the prefill worker, so that a restarted one is used
         # again and the decode worker maps its pool (`up` computes short ones locally)
         "--max-local-prefill-tokens", "0", *extra],
        stdout=subprocess.PIPE, stderr=stderr, text=True,
    )  # fmt: skip
    assert up.stdout is not None
    for line in up.stdout:
        if line.startswith("READY router"):
            return up, line.split()[2]
    up.wait(10)
    pytest.fail(f"pagedserve up did not start: {up_stderr(log_dir)}")


def up_stderr(log_dir: pathlib.Path) -> str:
    return (log_dir / "up.stderr").read_text()


def stop_up(up: subprocess.Popen) -> None:
    if up.poll() is None:
        up.send_signal(signal.SIGTERM)
        try:
            up.wait(30)
        except subprocess.TimeoutExpired:
            up.kill()
            up.wait(10)


def child_pid(up: subprocess.Popen, name: str) -> int | None:
    """The live child of `up` named `name` (a worker id, "router" or "redis")."""
    marker = {"redis": "redis-server", "router": " router "}.get(name, f"--worker-id {name} ")
    for pid in children_of(up.pid):
        if alive(pid) and marker in cmdline(pid) + " ":
            return pid
    return None


def cmdline(pid: int) -> str:
    try:
        return pathlib.Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


def greedy(router: str) -> list[list[int]]:
    with Client(router) as client:
        return [
            [t for part in client.generate(p, GREEDY, timeout=60) for t in part.token_ids]
            for p in PROMPTS
        ]


def restarts(router: str, worker_id: str) -> int:
    with Client(router) as client:
        return next(w.restarts for w in client.status().workers if w.worker_id == worker_id)


def worker_alive(router: str, worker_id: str) -> bool:
    with Client(router) as client:
        return any(w.worker_id == worker_id and w.alive for w in client.status().workers)


@pytest.fixture(scope="module")
def cluster(make_tiny, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("up-supervised")
    up, router = start_up(make_tiny("llama"), log_dir)
    try:
        yield up, router, log_dir, greedy(router)  # the undisturbed run
    finally:
        stop_up(up)
    assert up.returncode == 0, up_stderr(log_dir)


def kill_and_wait_back(up, log_dir: pathlib.Path, name: str) -> float:
    """SIGKILL child `name`; seconds until `up` reports it back (READY again)."""
    victim = child_pid(up, name)
    assert victim is not None, name
    backs = up_stderr(log_dir).count(f"{name} is back")
    started = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    back = wait_until(lambda: up_stderr(log_dir).count(f"{name} is back") > backs, BACK_TIMEOUT_S)
    assert back, up_stderr(log_dir)
    assert up.poll() is None, "pagedserve up stopped"
    assert child_pid(up, name) not in (None, victim)
    return time.monotonic() - started


@pytest.mark.parametrize("name", ["decode-0", "prefill-0"])
def test_a_killed_worker_is_restarted_and_used_again(cluster, name):
    up, router, log_dir, undisturbed = cluster
    victim = child_pid(up, name)
    assert victim is not None
    victim_segments = shm_segments(victim)  # a decode worker maps the prefill worker's pool
    assert victim_segments
    seconds = kill_and_wait_back(up, log_dir, name)
    print(f"{name}: back {seconds:.1f} s after SIGKILL")
    assert f"{name} exited (killed by SIGKILL)" in up_stderr(log_dir)
    # the router finds it again at the same address (its only worker of that role), and
    # `pagedserve status` counts the restart (a new incarnation in the registry)
    assert wait_until(lambda: worker_alive(router, name), 10.0)
    assert wait_until(lambda: restarts(router, name) >= 1, 10.0)
    assert greedy(router) == undisturbed
    # a killed prefill worker's KV segment is removed by `up`, not leaked; a killed decode
    # worker's mapping of the prefill worker's live pool is left alone
    left = [path for path in victim_segments if os.path.exists(path)]
    assert left == ([] if name.startswith("prefill") else victim_segments)


@pytest.mark.parametrize("name", ["decode-0", "prefill-0", "redis"])
def test_streams_in_flight_survive_a_killed_child(cluster, name):
    """16 streams run when `name` is SIGKILLed: every one finishes, equal to an undisturbed
    run; the child is back; the pools are at their baseline afterwards."""
    up, router, log_dir, undisturbed = cluster
    prompts = make_prompts((24,) * 16, seed=172)
    with Client(router) as client:
        want = [
            [t for part in client.generate(p, LONG, timeout=120) for t in part.token_ids]
            for p in prompts
        ]
    results: dict[int, list[int] | str] = {}
    first = threading.Barrier(len(prompts) + 1, timeout=60)

    def run(i: int) -> None:
        with Client(router) as client:
            stream = client.generate(prompts[i], LONG, timeout=180)
            try:
                parts = [next(stream)]
                first.wait()
                parts += list(stream)
                results[i] = [t for p in parts for t in p.token_ids]
            except grpc.RpcError as err:
                results[i] = f"{err.code().name}: {err.details()}"

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(16)]
    for t in threads:
        t.start()
    first.wait()
    if name == "redis":  # NOTE: redis prints no READY line: `up` says when it restarted it
        restarts = up_stderr(log_dir).count("redis restarted")
        os.kill(child_pid(up, "redis"), signal.SIGKILL)
        assert wait_until(lambda: up_stderr(log_dir).count("redis restarted") > restarts, 30.0)
    else:
        kill_and_wait_back(up, log_dir, name)
    for t in threads:
        t.join(180)
    assert [results.get(i) for i in range(16)] == want
    assert up.poll() is None
    # NOTE: and requests right after the restart hand their leases back at once: the decode
    # worker's channel to a restarted prefill worker used to sit in gRPC's reconnect back-off,
    # its pulls and releases failed, and the leases held their blocks until they expired (30 s)
    assert greedy(router) == undisturbed
    assert wait_until(lambda: blocks_in_use(router) == 0, LEASES_BACK_S), blocks_in_use(router)


def blocks_in_use(router: str) -> int:
    with Client(router) as client:
        return sum(
            w.load.kv_blocks_total - w.load.kv_blocks_free - w.load.kv_blocks_cached
            for w in client.status().workers
        )


def test_a_killed_redis_comes_back_on_its_port_and_requests_go_on(cluster):
    up, router, log_dir, undisturbed = cluster
    victim = child_pid(up, "redis")
    assert victim is not None
    port = int(re.search(r":(\d+)", cmdline(victim)).group(1))  # "redis-server 127.0.0.1:N"
    os.kill(victim, signal.SIGKILL)
    assert greedy(router) == undisturbed  # Redis is a hint: served by load meanwhile

    def redis_answers() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), 0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    assert wait_until(redis_answers, 30.0), up_stderr(log_dir)
    assert child_pid(up, "redis") not in (None, victim)
    assert "redis exited (killed by SIGKILL)" in up_stderr(log_dir)
    assert greedy(router) == undisturbed
    assert up.poll() is None


def test_a_child_that_keeps_dying_trips_the_crash_loop_limit(make_tiny, tmp_path):
    up, _ = start_up(make_tiny("llama"), tmp_path, "--max-restarts", "2", "--restart-window", "300")
    try:
        killed: set[int] = set()
        deadline = time.monotonic() + 120
        while up.poll() is None and time.monotonic() < deadline:
            pid = child_pid(up, "decode-0")
            if pid is not None and pid not in killed:
                os.kill(pid, signal.SIGKILL)  # as soon as each incarnation appears
                killed.add(pid)
            time.sleep(0.02)
        rc = up.wait(30)
    finally:
        stop_up(up)
    err = up_stderr(tmp_path)
    assert rc == 1, err
    assert len(killed) == 3  # the first start and two restarts
    assert "decode-0 is crash-looping: it exited 3 times within 300 s" in err
    assert "killed by SIGKILL" in err
    children = [p for p in children_of(up.pid) if alive(p)]
    assert not children  # `up` stopped every other child on its way out
