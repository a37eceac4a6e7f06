"""This host's identity, as the server module and the engine both state it: two processes agree
on it only on the same host and boot, which is what lets an engine map (and write) the server's
shared-memory L1."""

from __future__ import annotations


def boot_id() -> str:
    """This host's boot id (Linux): equal in two processes only on the same host and boot."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""
