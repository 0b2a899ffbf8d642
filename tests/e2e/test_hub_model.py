"""`pdserve up --model org/name` (gateway + 1P + 1D as real processes) serves a model from
an offline Hugging Face cache: resolved once by `up`, the children get the directory."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.e2e.cluster import DTYPE, _env, http
from tests.e2e.conftest import Reference
from tests.e2e.up_process import pdserve_up
from tests.helpers.hf_cache import add_to_cache

REPO = "acme/tiny-llama"


def test_up_serves_a_repo_id_from_an_offline_cache(tmp_path: Path, model_dir: Path, reference: Reference) -> None:
    snapshot = add_to_cache(tmp_path / "hf" / "hub", REPO, model_dir)
    env = _env({"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    env.pop("HF_HUB_CACHE", None)
    log = tmp_path / "up.log"
    with pdserve_up(log, "--model", REPO, "--num-blocks", "128", "--threads", "1", "--dtype", DTYPE, env=env) as up:
        url = up.url
        group = subprocess.run(["pgrep", "-a", "-g", str(up.pid)], capture_output=True, text=True).stdout
        children = [c for c in group.splitlines() if " -m pdserve " in c and not c.startswith(f"{up.pid} ")]
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
