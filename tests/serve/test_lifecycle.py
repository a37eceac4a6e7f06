"""atom.serve's lifecycle: the tier across restarts, clean SIGTERM, an owned LMCache server,
config printing and refusals."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from atom.tier.server.lmcache_server import probe

from .conftest import TINY_FLAGS, ServeProcess

LONG = "a long prompt that is repeated to fill several blocks of the tiny model. " * 4


def ask(proc: ServeProcess, prompt: str) -> dict:
    r = httpx.post(
        f"{proc.url}/v1/completions",
        timeout=60,
        json={
            "model": "v41-tiny",
            "prompt": prompt,
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()


def shm_of(pid: int) -> list[str]:
    return [p.name for p in Path("/dev/shm").glob(f"lmcache_kv_{pid}_*")]


def test_restart_against_the_same_lmcache_server_serves_from_tier(lmcache):
    first = ServeProcess("--offload", "lmcache_mp", "--lmcache-url", lmcache.url)
    first.wait_ready()
    a = ask(first, LONG)
    assert a["usage"]["prompt_tokens_details"]["tier_tokens"] == 0
    assert first.terminate() == 0  # pending saves complete before exit
    second = ServeProcess("--offload", "lmcache_mp", "--lmcache-url", lmcache.url)
    second.wait_ready()
    b = ask(second, LONG)
    n = a["usage"]["prompt_tokens"]
    assert b["usage"]["prompt_tokens_details"]["tier_tokens"] == (n - 1) // 16 * 16
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert second.terminate() == 0


def test_sigterm_with_owned_lmcache_server_exits_cleanly():
    proc = ServeProcess("--offload", "lmcache_mp", "--lmcache-l1-gb", "0.25")
    health = proc.wait_ready()
    tier = health["tier"]
    assert tier["owned"] and tier["healthy"]
    assert ask(proc, LONG)["usage"]["completion_tokens"] == 6
    pid = proc.proc.pid
    assert proc.terminate() == 0
    log = proc.text()
    assert "shutdown complete" in log
    assert "stopped LMCache server" in log
    frozen = re.search(r"froze (\d+) objects of the started server", log)
    assert frozen and int(frozen.group(1)) > 10_000  # the engine's heap, out of the GC's scans
    assert not probe(tier["url"], 1.0), "the owned LMCache server outlived atom.serve"
    assert shm_of(pid) == []


def test_unreachable_tier_is_reported_not_fatal():
    from atom.tier.server.lmcache_server import free_port

    proc = ServeProcess(
        "--offload",
        "lmcache_mp",
        "--lmcache-url",
        f"tcp://127.0.0.1:{free_port()}",
        "--lmcache-rpc-timeout",
        "1",
    )
    health = proc.wait_ready()
    assert health["status"] == "ok" and health["tier"]["healthy"] is False
    assert ask(proc, LONG)["usage"]["completion_tokens"] == 6
    assert "unavailable" in proc.text()
    assert proc.terminate() == 0


def run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false")
    return subprocess.run(
        [sys.executable, "-m", "atom.serve", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def test_print_config_resolves_yaml_and_flags(tmp_path):
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("model: v41-tiny\nmax_num_seqs: 3\nlmcache:\n  l1_size_gb: 0.5\n")
    r = run_cli(
        "--config",
        str(cfg),
        "--max-num-seqs",
        "5",
        "--device",
        "cpu",
        "--offload",
        "lmcache_mp",
        "--print-config",
    )
    assert r.returncode == 0, r.stderr
    out = yaml.safe_load(r.stdout)
    assert out["max_num_seqs"] == 5 and out["block_size"] == 16
    assert out["offload"] == "lmcache_mp" and out["lmcache"]["l1_size_gb"] == 0.5


def test_bad_config_names_field_and_value(tmp_path):
    r = run_cli(*TINY_FLAGS[:2], "--max-num-seqs", "0", "--print-config")
    assert r.returncode == 2 and "max_num_seqs=0" in r.stderr
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("model: v41-tiny\nmax_num_sequences: 3\n")
    r = run_cli("--config", str(cfg), "--print-config")
    assert r.returncode == 2 and "max_num_sequences=3: unknown field" in r.stderr
    r = run_cli(
        "--model",
        "v41-tiny",
        "--offload",
        "lmcache_mp",
        "--lmcache-url",
        "nonsense",
        "--print-config",
    )
    assert r.returncode == 2 and "lmcache.url" in r.stderr


def _tier_flag(flag: str, value: str):
    """``--print-config`` with the tier on and ``--{flag} {value}``."""
    return run_cli(
        *TINY_FLAGS[:2], "--offload", "lmcache_mp", f"--{flag}", value, "--print-config"
    )  # fmt: skip


@pytest.mark.parametrize(
    "flag,key,good,bad,named",
    [
        ("lmcache-load-mode", "load_mode", "lmcache_driven", "server", "engine_driven"),
        ("lmcache-load-copy", "load_copy", "kernel", "dma", "copy_engine"),
    ],
)
def test_load_flags_set_the_tier_config_and_refuse_unknown_values(flag, key, good, bad, named):
    r = _tier_flag(flag, good)
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["lmcache"][key] == good
    r = _tier_flag(flag, bad)
    assert r.returncode == 2
    assert f"lmcache.{key}='{bad}'" in r.stderr and named in r.stderr  # the value and a fix


def test_load_streams_flag_sets_the_tier_config_and_refuses_a_count_out_of_range():
    r = run_cli(*TINY_FLAGS[:2], "--offload", "lmcache_mp", "--print-config")
    assert yaml.safe_load(r.stdout)["lmcache"]["load_streams"] == 1  # the default
    r = _tier_flag("lmcache-load-streams", "2")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["lmcache"]["load_streams"] == 2
    r = _tier_flag("lmcache-load-streams", "9")
    assert r.returncode == 2
    assert "lmcache.load_streams=9" in r.stderr and "1 to 4 copy streams" in r.stderr


def test_loads_copy_through_the_copy_engines_by_default():
    r = run_cli(*TINY_FLAGS[:2], "--offload", "lmcache_mp", "--print-config")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["lmcache"]["load_copy"] == "copy_engine"


def test_save_mode_flag_sets_the_tier_config_prints_it_and_refuses_unknown_modes():
    r = run_cli(*TINY_FLAGS[:2], "--offload", "lmcache_mp", "--print-config")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["lmcache"]["save_mode"] == "lmcache_driven"  # the default
    r = run_cli(
        *TINY_FLAGS[:2], "--offload", "lmcache_mp", "--lmcache-save-mode", "auto",
        "--print-config",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["lmcache"]["save_mode"] == "engine_driven"  # one rank
    r = run_cli(
        *TINY_FLAGS[:2], "--offload", "lmcache_mp", "--lmcache-save-mode", "engine",
        "--print-config",
    )  # fmt: skip
    assert r.returncode == 2
    assert "lmcache.save_mode='engine'" in r.stderr and "engine_driven" in r.stderr


def test_rank_collapse_flag_sets_the_tier_config_and_refuses_unknown_values():
    r = run_cli(
        *TINY_FLAGS[:2], "--offload", "lmcache_mp", "--tensor-parallel-size", "2",
        "--lmcache-tp-rank-collapse", "false", "--print-config",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    cfg = yaml.safe_load(r.stdout)
    assert cfg["lmcache"]["tp_rank_collapse"] == "false" and cfg["tensor_parallel_size"] == 2
    assert cfg["lmcache"]["load_mode"] == "engine_driven"  # auto: each rank copies its own
    r = run_cli(
        *TINY_FLAGS[:2], "--offload", "lmcache_mp", "--lmcache-tp-rank-collapse", "yes",
        "--print-config",
    )  # fmt: skip
    assert r.returncode == 2
    assert "tp_rank_collapse" in r.stderr and "auto" in r.stderr


def test_load_mode_prints_resolved_and_engine_driven_without_collapse_is_accepted():
    r = run_cli(*TINY_FLAGS[:2], "--offload", "lmcache_mp", "--print-config")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["lmcache"]["load_mode"] == "engine_driven"  # auto, one rank
    r = run_cli(
        *TINY_FLAGS[:2], "--offload", "lmcache_mp", "--tensor-parallel-size", "2",
        "--print-config",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    # auto across ranks with rank collapse (auto: one shared copy): every rank copies
    assert yaml.safe_load(r.stdout)["lmcache"]["load_mode"] == "engine_driven"
    r = run_cli(
        *TINY_FLAGS[:2], "--offload", "lmcache_mp", "--tensor-parallel-size", "2",
        "--lmcache-tp-rank-collapse", "false", "--lmcache-load-mode", "engine_driven",
        "--print-config",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr  # every rank copies its own objects
    assert yaml.safe_load(r.stdout)["lmcache"]["load_mode"] == "engine_driven"
    r = run_cli(
        *TINY_FLAGS[:2], "--offload", "lmcache_mp", "--tensor-parallel-size", "2",
        "--lmcache-tp-rank-collapse", "false", "--lmcache-load-mode", "lmcache_driven",
        "--print-config",
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["lmcache"]["load_mode"] == "lmcache_driven"


def test_moe_grouped_mm_flag_sets_the_config_and_refuses_a_bad_value():
    r = run_cli(*TINY_FLAGS[:2], "--moe-grouped-mm", "false", "--print-config")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["moe_grouped_mm"] is False
    r = run_cli(*TINY_FLAGS[:2], "--moe-grouped-mm", "maybe", "--print-config")
    assert r.returncode == 2 and "moe_grouped_mm='maybe': use true or false" in r.stderr


def test_batch_invariant_flag_sets_the_config_and_refuses_tensor_parallelism():
    r = run_cli(*TINY_FLAGS[:2], "--batch-invariant", "true", "--print-config")
    assert r.returncode == 0, r.stderr
    assert yaml.safe_load(r.stdout)["batch_invariant"] is True
    flags = ("--batch-invariant", "true", "--tensor-parallel-size", "2", "--print-config")
    r = run_cli(*TINY_FLAGS[:2], *flags)
    assert r.returncode == 2 and "tensor_parallel_size=2 with batch_invariant=true" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "flags, needle",
    [
        (["--model", "v41-nope"], "model='v41-nope' is neither a preset"),
        (["--model", "v41-tiny", "--speculative-tokens", "2"], "has no drafter"),
        (["--model", "v41-tiny", "--num-blocks", "1"], "num_blocks=1: the pool needs"),
    ],
)
def test_errors_found_when_the_engine_would_be_built_exit_2_without_a_traceback(flags, needle):
    """Values only the model, the pool or the drafter can judge are checked before anything
    starts, and reported as a bad flag is: one `error:` line, exit 2."""
    r = run_cli(*flags, "--device", "cpu")
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("error: ") and needle in r.stderr
    assert "Traceback" not in r.stderr
