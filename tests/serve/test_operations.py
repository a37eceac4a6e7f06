"""atom.serve as an operator sees it (issue #19): drain keeps answering, a crash leaks nothing
that the next start does not remove, a dead tier neither hangs shutdown nor hides in /health,
and --api-key."""

from __future__ import annotations

import os
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from .conftest import ServeProcess

MODEL = "v41-tiny"


def wait_for(cond, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)  # allowed: polling interval of a bounded loop
    raise AssertionError(f"timed out waiting for {what}")


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def complete(proc: ServeProcess, **kw) -> httpx.Response:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "temperature": 0, **kw}
    return httpx.post(f"{proc.url}/v1/completions", json=body, timeout=120)


def test_drain_answers_503_and_health_while_in_flight_requests_finish():
    proc = ServeProcess("--drain-timeout", "60")
    proc.wait_ready()
    try:
        with ThreadPoolExecutor(1) as pool:
            long = pool.submit(complete, proc, max_tokens=300, ignore_eos=True)
            wait_for(
                lambda: httpx.get(f"{proc.url}/health").json()["engine"]["running"] == 1,
                what="the long request to run",
            )
            proc.proc.send_signal(signal.SIGTERM)
            health = wait_for(
                lambda: (h := httpx.get(f"{proc.url}/health")).json()["draining"] and h,
                what="/health to report draining",
            )
            assert health.status_code == 503 and health.json()["status"] == "draining"
            with httpx.Client() as fresh:  # a new connection during the drain
                r = fresh.post(
                    f"{proc.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, timeout=10
                )
            assert r.status_code == 503, r.text
            assert r.json()["error"]["type"] == "service_unavailable"
            done = long.result(timeout=120)
        assert done.status_code == 200, done.text
        assert done.json()["usage"]["completion_tokens"] == 300
        assert proc.proc.wait(60) == 0
    finally:
        proc.terminate()
    assert "Traceback" not in proc.text()


def children_of(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def test_sigkill_leaves_nothing_the_next_start_does_not_remove(tmp_path):
    proc = ServeProcess("--offload", "lmcache_mp", "--lmcache-l1-gb", "0.25")
    health = proc.wait_ready()
    pid = proc.proc.pid
    server_pid = health["tier"]["server_pid"]
    server_port = int(health["tier"]["url"].rsplit(":", 1)[1])
    lmcache = psutil.Process(server_pid)
    ports = [c.laddr.port for c in lmcache.net_connections(kind="tcp") if c.status == "LISTEN"]
    assert server_port in ports
    for c in lmcache.net_connections(kind="tcp"):
        if c.status == "LISTEN":
            assert c.laddr.ip == "127.0.0.1", f"LMCache listens on {c.laddr}"
    shm = list(Path("/dev/shm").glob(f"lmcache_kv_{pid}_*"))
    tmp = [p for p in Path("/tmp").glob(f"atom-lmcache-{pid}-*")]
    assert shm and tmp, (shm, tmp)

    proc.proc.kill()
    proc.proc.wait()
    t0 = time.monotonic()
    wait_for(lambda: not psutil.pid_exists(server_pid) or
             psutil.Process(server_pid).status() == psutil.STATUS_ZOMBIE,
             timeout_s=10, what="the owned LMCache server to die with its parent")  # fmt: skip
    assert time.monotonic() - t0 < 10
    for port in [proc.port, *ports]:
        wait_for(lambda p=port: port_free(p), timeout_s=5, what=f"port {port} to be free")
    assert all(p.exists() for p in shm + tmp), "left by the crash (removed by the next start)"

    again = ServeProcess("--offload", "lmcache_mp", "--lmcache-l1-gb", "0.25")
    try:
        again.wait_ready()
        assert not any(p.exists() for p in shm), shm
        assert not any(p.exists() for p in tmp), tmp
        assert "removed" in again.text() and "leftovers of dead processes" in again.text()
    finally:
        assert again.terminate() == 0, again.text()
    assert not list(Path("/dev/shm").glob(f"lmcache_kv_{again.proc.pid}_*"))
    assert not list(Path("/tmp").glob(f"atom-lmcache-{again.proc.pid}-*"))


def test_dead_tier_is_logged_in_health_and_does_not_hang_shutdown():
    drain = 6.0
    proc = ServeProcess(
        "--offload", "lmcache_mp", "--lmcache-l1-gb", "0.25", "--drain-timeout", str(drain)
    )
    health = proc.wait_ready()
    assert health["tier"]["healthy"] and health["tier"]["last_error"] == ""
    up_since = health["tier"]["since"]
    assert complete(proc).status_code == 200
    os.kill(health["tier"]["server_pid"], signal.SIGKILL)
    tier = wait_for(
        lambda: (t := httpx.get(f"{proc.url}/health").json()["tier"])["last_error"] and t,
        what="/health to show the tier's error",
    )
    assert tier["healthy"] is False and tier["since"] > up_since
    wait_for(lambda: "LMCache tier at" in proc.text() and "is down" in proc.text(), what="log")
    assert complete(proc).status_code == 200  # serving without the tier
    t0 = time.monotonic()
    proc.proc.send_signal(signal.SIGTERM)
    code = proc.proc.wait(drain + 30)
    took = time.monotonic() - t0
    assert code == 0, proc.text()
    assert took <= drain + 1.0, f"shutdown took {took:.1f} s with --drain-timeout {drain}"
    assert "Traceback" not in proc.text(), proc.text()
    assert not list(Path("/dev/shm").glob(f"lmcache_kv_{proc.proc.pid}_*"))


def test_tier_comes_back_is_logged(lmcache):
    proc = ServeProcess("--offload", "lmcache_mp", "--lmcache-url", lmcache.url)
    try:
        proc.wait_ready()
        lmcache.signal(signal.SIGSTOP)
        try:
            wait_for(lambda: "is down" in proc.text(), what="the tier to be seen down")
        finally:
            lmcache.signal(signal.SIGCONT)
        wait_for(lambda: "is back" in proc.text(), what="the tier to be seen back")
        tier = httpx.get(f"{proc.url}/health").json()["tier"]
        assert tier["healthy"] and "heartbeat" in tier["last_error"]
    finally:
        assert proc.terminate() == 0, proc.text()


def test_api_key():
    proc = ServeProcess("--api-key", "s3cret")
    proc.wait_ready()
    try:
        bad = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.post(f"{proc.url}/v1/completions", json={"model": MODEL, "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert httpx.post(f"{proc.url}/tokenize", json={"prompt": "x"}).status_code == 401
        good = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="s3cret", max_retries=0)
        assert [m.id for m in good.models.list().data] == [MODEL]
        out = good.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert out.usage.completion_tokens >= 1
        assert httpx.get(f"{proc.url}/health").status_code == 200  # probes stay open
        assert httpx.get(f"{proc.url}/metrics").status_code == 200
    finally:
        assert proc.terminate() == 0, proc.text()
