"""`pdserve up --api-key KEY` (a real `up`, real processes): the key reaches the gateway by
its environment, never its command line (/proc/PID/cmdline is readable by every user of
the host; /proc/PID/environ by this user only), no worker sees it, and it still works:
the API answers 401 without it and 200 with it."""

from __future__ import annotations

import secrets
import stat
from pathlib import Path

from tests.e2e import peers
from tests.e2e.cluster import DTYPE, _env, http
from tests.e2e.conftest import Reference
from tests.e2e.up_process import pdserve_up


def test_the_api_key_is_on_no_child_command_line_and_still_works(tmp_path: Path, reference: Reference) -> None:
    key, inherited = f"sk-{secrets.token_hex(16)}", f"sk-{secrets.token_hex(16)}"
    env = _env({"PDSERVE_API_KEYS": inherited})
    with pdserve_up(tmp_path / "up.log", "--api-key", key, "--num-blocks", "128", "--threads", "1",
                    "--dtype", DTYPE, env=env) as served:
        kids = peers.children(served.pid)
        gateway = next(pid for pid in kids if "gateway" in peers.cmdline(pid))
        assert key in peers.cmdline(served.pid)  # what the user typed (up warns about it)
        for pid in kids:
            assert key not in " ".join(peers.cmdline(pid)), peers.cmdline(pid)
            assert (key in peers.environ(pid)) == (pid == gateway), peers.cmdline(pid)
        assert stat.S_IMODE(Path(f"/proc/{gateway}/environ").stat().st_mode) == 0o400
        body = {"model": reference.model_name, "prompt": "hi", "max_tokens": 2}
        status, out = http("POST", f"{served.url}/completions", body)
        assert status == 401 and out["error"]["code"] == "invalid_api_key", out
        for k in (key, inherited):  # PDSERVE_API_KEYS already set is kept beside --api-key
            status, out = http("POST", f"{served.url}/completions", body, headers={"Authorization": f"Bearer {k}"})
            assert status == 200 and out["choices"][0]["text"] is not None, out
    assert "--api-key is visible in this process's command line" in (tmp_path / "up.log").read_text()
