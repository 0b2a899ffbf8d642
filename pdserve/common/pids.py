"""Whether a process id still names a process: the stale-file sweeps (shared-memory pools,
KV tier temp files, cluster key folders) name their files by the creator's pid."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """True while process `pid` exists, also one owned by another user; False for pid <= 0."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True
