"""LMCache L2 adapters under the tier: validation, health, metrics (their server flags:
``lmcache_server.server_args``).

An L2 adapter sits under an LMCache MP server's L1: every object stored in L1 is written
through to it, and a lookup that L1 misses asks it and prefetches what it holds into L1 before
answering. Servers that share one L2 (one Redis, one shared directory) share objects: a prefix
that one engine stored is a hit for every engine with the same namespace.

Tested here: ``fs`` (a directory, local or a shared filesystem) and ``resp`` (a Redis-protocol
server). The other adapter types of lmcache 0.5.6 pass through to the server as given, with a
warning that they are untested. Credentials never enter the config: the ``resp`` adapter reads
``LMCACHE_RESP_USERNAME`` / ``LMCACHE_RESP_PASSWORD`` from the environment, which the owned
server inherits, so they appear in no command line, log line, /health answer or error.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import urllib.request
from typing import Any

log = logging.getLogger("atom.offload")

# lmcache 0.5.6's own argparse choices (lmcache.v1.distributed.config.add_storage_manager_args;
# tests/offload/test_l2.py checks they still match the installed lmcache).
STORE_POLICIES = ("default", "skip_l1")
PREFETCH_POLICIES = ("default", "retain")
# lmcache 0.5.6's registered L2 adapter types (l2_adapters.config.get_registered_l2_adapter_types)
KNOWN_TYPES = (
    "aerospike",
    "bigtable",
    "dax",
    "fault_inject",
    "fs",
    "fs_native",
    "hf3fs",
    "hfbucket",
    "mock",
    "mooncake_store",
    "native_plugin",
    "nixl_native",
    "p2p",
    "plugin",
    "raw_block",
    "resp",
    "s3",
    "sagemaker-hyperpod",
    "valkey",
)
TESTED_TYPES = ("fs", "resp")
# keys LMCache's config parser accepts on every adapter (l2_adapters.config.parse_args)
COMMON_KEYS = {"type", "affinity_tag", "shared", "eviction", "persist", "serde"}
FS_KEYS = {"base_path", "relative_tmp_dir", "read_ahead_size", "use_odirect"}
RESP_KEYS = {"host", "port", "num_workers", "max_capacity_gb"}
SECRET_WORDS = ("password", "secret", "token", "credential", "auth", "access_key", "username")


def _where(i: int, d: dict) -> str:
    return f"l2_adapters[{i}] (type {d.get('type')!r})"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_adapter(raw: Any, i: int = 0) -> dict[str, Any]:
    """One adapter spec (a dict, or its JSON text) checked as far as atom knows it; returns
    the dict. Errors name the entry, the field and the value."""
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"l2_adapters[{i}]: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"l2_adapters[{i}]: expected a mapping with a 'type', got {raw!r}")
    d = dict(raw)
    kind = d.get("type")
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"l2_adapters[{i}]: 'type' is missing (one of {', '.join(KNOWN_TYPES)})")
    if kind not in KNOWN_TYPES:
        raise ValueError(
            f"l2_adapters[{i}].type={kind!r}: unknown L2 adapter type; lmcache 0.5.6 knows "
            f"{', '.join(KNOWN_TYPES)}"
        )
    where = _where(i, d)
    if kind == "fs":
        _check_keys(d, FS_KEYS, where)
        path = d.get("base_path")
        if not isinstance(path, str) or not path:
            raise ValueError(f"{where}.base_path={path!r}: a non-empty directory path is required")
        if not os.path.isabs(path):
            raise ValueError(
                f"{where}.base_path={path!r}: must be absolute (each server resolves it in "
                "its own working directory)"
            )
    elif kind == "resp":
        for secret in ("username", "password"):
            if secret in d:
                raise ValueError(
                    f"{where}.{secret}: credentials are not taken from the config; set "
                    f"LMCACHE_RESP_{secret.upper()} in the environment (the owned server "
                    "inherits it)"
                )
        _check_keys(d, RESP_KEYS, where)
        host, port = d.get("host"), d.get("port")
        if not isinstance(host, str) or not host:
            raise ValueError(f"{where}.host={host!r}: a non-empty host name or address is required")
        if not _is_int(port) or not 0 < port < 65536:
            raise ValueError(f"{where}.port={port!r}: an integer port 1-65535 is required")
        workers = d.get("num_workers", 8)
        if not _is_int(workers) or workers < 1:
            raise ValueError(f"{where}.num_workers={workers!r}: must be an integer >= 1")
        cap = d.get("max_capacity_gb", 0)
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0:
            raise ValueError(f"{where}.max_capacity_gb={cap!r}: must be a number >= 0")
    for key in ("affinity_tag",):
        if key in d and (not isinstance(d[key], str) or not d[key].strip()):
            raise ValueError(f"{where}.{key}={d[key]!r}: must be a non-empty string")
    return d


def _check_keys(d: dict, allowed: set[str], where: str) -> None:
    extra = sorted(set(d) - allowed - COMMON_KEYS)
    if extra:
        allowed_s = ", ".join(sorted(allowed | COMMON_KEYS))
        raise ValueError(f"{where}.{extra[0]}: unknown field; allowed: {allowed_s}")


def redacted(items: Any) -> Any:
    """``items`` with the value of every secret-looking key replaced (they are refused anyway,
    and an error must not echo them)."""

    def one(d: Any) -> Any:
        if isinstance(d, str):
            try:
                d = json.loads(d)
            except json.JSONDecodeError:
                return d
        if not isinstance(d, dict):
            return d
        return {
            k: ("***" if any(w in k.lower() for w in SECRET_WORDS) else v) for k, v in d.items()
        }

    if isinstance(items, (list, tuple)):
        return [one(d) for d in items]
    return one(items)


def validate_adapters(items: Any) -> tuple[dict[str, Any], ...]:
    if items is None:
        return ()
    if isinstance(items, (str, dict)):
        items = [items]
    out = tuple(validate_adapter(raw, i) for i, raw in enumerate(items))
    for d in out:
        if d["type"] not in TESTED_TYPES:
            log.warning(
                "L2 adapter type %r is passed to LMCache as given; atom tests only %s",
                d["type"],
                " and ".join(TESTED_TYPES),
            )
    return out


def target(d: dict) -> str:
    """Where an adapter keeps its objects, without secrets: a path, host:port, or a name."""
    kind = d.get("type")
    if kind in ("fs", "fs_native", "hf3fs"):
        return str(d.get("base_path") or d.get("path") or "")
    if "host" in d:
        return f"{d['host']}:{d.get('port', '')}"
    for key in ("url", "endpoint", "bucket", "base_path", "path", "address"):
        value = d.get(key)
        if isinstance(value, str) and not any(w in key.lower() for w in SECRET_WORDS):
            return value.split("@")[-1]  # drop user:pass@ of a URL
    return ""


def reachable(d: dict, timeout_s: float = 0.3) -> bool | None:
    """Whether the adapter's backend answers now: a TCP connect for host:port adapters, an
    existing writable directory for fs; None where atom cannot tell."""
    if d.get("type") in ("fs", "fs_native"):
        path = d.get("base_path", "")
        return os.path.isdir(path) and os.access(path, os.W_OK)
    host, port = d.get("host"), d.get("port")
    if isinstance(host, str) and _is_int(port):
        try:
            with socket.create_connection((host, port), timeout=timeout_s):
                return True
        except OSError:
            return False
    return None


class L2Status:
    """The /health entries of the adapters (type, target, reachable), refreshed at most every
    ``ttl_s`` (the serve loop asks every second)."""

    def __init__(self, adapters, owned: bool, ttl_s: float = 2.0):
        self.adapters, self.owned, self.ttl_s = tuple(adapters), owned, ttl_s
        self._at, self._cached = -1e9, []
        self._lock = threading.Lock()

    def entries(self) -> list[dict]:
        with self._lock:
            if time.monotonic() - self._at > self.ttl_s:
                self._cached = [
                    {
                        "type": d["type"],
                        "target": target(d),
                        "reachable": reachable(d),
                        # with an external server, atom does not configure its L2
                        "configured_by": "atom" if self.owned else "external server",
                    }
                    for d in self.adapters
                ]
                self._at = time.monotonic()
            return [dict(e) for e in self._cached]


# LMCache's own L2 metrics (OpenTelemetry through its Prometheus exporter, names as exported)
L2_METRIC_PREFIXES = (
    "lmcache_mp_l2_",
    "lmcache_mp_lookup_hit_l2",
    "lmcache_mp_num_inflight_l2_",
)


class ServerMetrics:
    """Reads an LMCache server's Prometheus endpoint and keeps its L2 series, cached for
    ``ttl_s``; an unreachable endpoint gives no series (and ``up`` = 0), never an error."""

    def __init__(self, url: str | None, ttl_s: float = 1.0, timeout_s: float = 0.5):
        self.url, self.ttl_s, self.timeout_s = url, ttl_s, timeout_s
        self._at, self._series, self.up = -1e9, {}, False
        self._lock = threading.Lock()

    def series(self) -> dict[str, float]:
        """``name{labels}`` -> value for every L2 series LMCache exports now."""
        if not self.url:
            return {}
        with self._lock:
            if time.monotonic() - self._at > self.ttl_s:
                self._at = time.monotonic()
                try:
                    with urllib.request.urlopen(self.url, timeout=self.timeout_s) as resp:
                        text = resp.read().decode("utf-8", "replace")
                    self._series, self.up = parse_l2_series(text), True
                except (OSError, ValueError):
                    self._series, self.up = {}, False
            return dict(self._series)

    def read_up(self) -> float:
        self.series()
        return 1.0 if self.up else 0.0

    def totals(self) -> dict[str, float]:
        """Series summed over their labels, by name (what /metrics re-exports)."""
        out: dict[str, float] = {}
        for key, value in self.series().items():
            name = key.split("{", 1)[0]
            out[name] = out.get(name, 0.0) + value
        return out


def parse_l2_series(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        if not line.startswith(L2_METRIC_PREFIXES):
            continue
        key, _, value = line.rpartition(" ")
        try:
            out[key] = float(value)
        except ValueError:
            continue
    return out
