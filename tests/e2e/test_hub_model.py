"""`pdserve up --model org/name` (gateway + 1P + 1D as real processes) serves a model from
an offline Hugging Face cache: resolved once by `up`, the children get the directory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from pdserve.common.transport import free_port
from tests.e2e.cluster import DTYPE, ROOT, _env, http
from tests.e2e.conftest import Reference
from tests.helpers.hf_cache import add_to_cache

REPO = "acme/tiny-llama"


def test_up_serves_a_repo_id_from_an_offline_cache(tmp_path: Path, model_dir: Path, reference: Reference) -> None:
    snapshot = add_to_cache(tmp_path / "hf" / "hub", REPO, model_dir)
    env = _env({"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    env.pop("HF_HUB_CACHE", None)
    port = free_port()
    log = tmp_path / "up.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pdserve", "up", "--model", REPO, "--port", str(port), "--num-blocks", "128",
             "--threads", "1", "--dtype", DTYPE],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=out, start_new_session=True,
        )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline().decode()  # blocks until ready (or exit)
        assert line.startswith("pdserve ready at "), f"{line!r}\n{log.read_text()[-3000:]}"
        url = line.split()[-1]
        group = subprocess.run(["pgrep", "-a", "-g", str(proc.pid)], capture_output=True, text=True).stdout
        children = [c for c in group.splitlines() if " -m pdserve " in c and not c.startswith(f"{proc.pid} ")]
        assert len(children) == 3, group  # gateway, prefill, decode
        assert all(f"--model {snapshot} " in c for c in children), group

        status, models = http("GET", f"{url}/models")
        assert status == 200 and [m["id"] for m in models["data"]] == [REPO]
        prompt = "The gateway speaks"
        want = reference.text(reference.generate(reference.completion_ids(prompt), max_tokens=10, temperature=0.0)[0])
        status, body = http("POST", f"{url}/completions",
                            {"model": REPO, "prompt": prompt, "max_tokens": 10, "temperature": 0})
        assert status == 200, body
        assert body["choices"][0]["text"] == want and body["usage"]["completion_tokens"] == 10
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    assert rc == 0, log.read_text()[-3000:]
