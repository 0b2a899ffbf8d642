"""The official `openai` client against `pdserve up` (gateway + 1P + 1D as real processes)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import pytest

from tests.e2e.cluster import ADMIN, DTYPE, http
from tests.e2e.conftest import Reference
from tests.e2e.up_process import pdserve_up

# Not the model's own limit (2048) nor the default block size (16): `up` must pass them on.
MAX_MODEL_LEN = 1000
BLOCK_SIZE = 8


@pytest.fixture(scope="module")
def up_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("up") / "up.log"
    with pdserve_up(log, "--num-blocks", "256", "--threads", "1", "--max-model-len", str(MAX_MODEL_LEN),
                    "--block-size", str(BLOCK_SIZE), "--dtype", DTYPE) as up:
        yield up.url
    leftover = ["?"]  # up exited 0; its process group must be empty too
    for _ in range(100):  # helpers (e.g. multiprocessing's resource tracker) exit shortly after
        leftover = subprocess.run(["pgrep", "-g", str(up.pid)], capture_output=True, text=True).stdout.split()
        if not leftover:
            break
        time.sleep(0.1)
    assert leftover == [], "pdserve up left processes behind"


def test_openai_client_against_up(up_url: str, reference: Reference) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=up_url, api_key="unused")
    models = client.models.list()
    model = models.data[0].id
    assert model == reference.model_name

    prompt = "The gateway speaks"
    want = reference.text(reference.generate(reference.completion_ids(prompt), max_tokens=10, temperature=0.0)[0])
    comp = client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
    assert comp.choices[0].text == want
    assert comp.usage is not None and comp.usage.completion_tokens == 10
    streamed = "".join(
        ch.choices[0].text
        for ch in client.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, stream=True)
        if ch.choices
    )
    assert streamed == want

    messages = [{"role": "user", "content": "Hello there"}]
    want_chat = reference.text(reference.generate(reference.chat_ids(messages), max_tokens=8, temperature=0.0)[0])
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == want_chat
    assert chat.choices[0].finish_reason in ("length", "stop")
    chunks = list(client.chat.completions.create(  # type: ignore[call-overload]
        model=model, messages=messages, max_tokens=8, temperature=0, stream=True,  # type: ignore[arg-type]
        stream_options={"include_usage": True},
    ))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want_chat
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8

    seeded = [
        client.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=1.0, seed=99).choices[0].text
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
    want_seeded = reference.generate(reference.completion_ids(prompt), max_tokens=12, temperature=1.0, seed=99)[0]
    assert seeded[0] == reference.text(want_seeded)


def test_up_passes_max_model_len_and_block_size(up_url: str) -> None:
    """The gateway enforces `up --max-model-len` (and says so in /v1/models); every
    worker runs with `up --block-size`."""
    status, models = http("GET", f"{up_url}/models")
    card = models["data"][0]
    assert status == 200 and card["max_model_len"] == MAX_MODEL_LEN, models
    body = {"model": card["id"], "prompt": "Hi", "max_tokens": MAX_MODEL_LEN}
    status, err = http("POST", f"{up_url}/completions", body)
    assert status == 400 and f"maximum context length is {MAX_MODEL_LEN}" in err["error"]["message"], err
    status, workers = http("GET", f"{up_url}/workers", headers=ADMIN)
    assert status == 200 and sorted(w["block_size"] for w in workers["data"]) == [BLOCK_SIZE] * 2, workers
