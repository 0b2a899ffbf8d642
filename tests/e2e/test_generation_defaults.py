"""generation_config.json's sampling defaults change what a real cluster returns, and a
request's own value overrides them (gateway + colocated worker as processes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from tests.e2e.cluster import Cluster, http
from tests.e2e.conftest import Reference

PROMPT = "The defaults come from the model"
MAX_TOKENS = 8
SEED = 1234


def test_generation_config_temperature_is_the_default_and_a_request_overrides_it(
    log_dir: Path, model_dir: Path, reference: Reference
) -> None:
    d = log_dir / "model"
    shutil.copytree(model_dir, d)
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.0}))

    ids = reference.completion_ids(PROMPT)
    greedy = reference.text(reference.generate(ids, max_tokens=MAX_TOKENS, temperature=0.0)[0])
    sampled = reference.text(reference.generate(ids, max_tokens=MAX_TOKENS, temperature=1.0, seed=SEED)[0])
    assert sampled != greedy  # else the test could not tell the default was applied

    c = Cluster(log_dir)
    try:
        c.start_gateway("--model", str(d))
        c.add_worker("worker", "--model", str(d))
        c.wait_roles(colocated=1)
        body = {"model": d.name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "seed": SEED}
        status, out = http("POST", f"{c.url}/v1/completions", body)
        assert status == 200, out
        assert out["choices"][0]["text"] == greedy  # temperature 0 from generation_config.json
        status, out = http("POST", f"{c.url}/v1/completions", {**body, "temperature": 1.0})
        assert status == 200, out
        assert out["choices"][0]["text"] == sampled  # the request's temperature wins
        c.wait_idle()
    finally:
        c.stop()
