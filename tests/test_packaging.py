"""What `pip install .` puts in site-packages: the design card's folders and the
project's own name, nothing generic (`common`, `engine`, `worker`, `bench` would shadow
or be shadowed by other installed projects). setuptools' own `egg_info` writes the
`top_level.txt` and file list a wheel gets, without compiling anything."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_install_adds_only_the_card_packages_and_the_project_name(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "setup.py", "-q", "egg_info", "-e", str(tmp_path)], cwd=ROOT,
                   check=True, capture_output=True)
    (info,) = tmp_path.glob("*.egg-info")
    top = set((info / "top_level.txt").read_text().split())
    assert top == {"pdserve", "kv_transfer", "prefill_node", "decode_node", "gateway"}
    sources = (info / "SOURCES.txt").read_text().split()
    assert not [s for s in sources if s.startswith("bench/")]  # benchmarks are not installed
    assert "pdserve/loadgen/runner.py" in sources  # what `pdserve bench` runs is
    assert "pdserve/builtin/weights/tiny-llama.safetensors" in sources
