"""The Dockerfile cannot be built here (no Docker engine): check it against the project statically."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _pinned_sglang() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(d.split("==")[1] for d in deps if d.startswith("sglang=="))


def _readme_main_command() -> str:
    blocks = re.findall(r"```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S)
    return next(b for b in blocks if "launch_server" in b)


def test_base_image_matches_pinned_sglang():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    base = re.search(r"^FROM\s+(\S+)", dockerfile, re.M).group(1)
    assert base == f"lmsysorg/sglang:v{_pinned_sglang()}"


def test_install_and_start_commands_match_readme():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    main = _readme_main_command()
    assert "pip install -e ." in main and re.search(r"pip install [^\n]*-e \.", dockerfile)
    module = re.search(r"python -m (\S+)", main).group(1)
    assert f'"-m", "{module}"' in dockerfile
    model = re.search(r"--model-path (\S+)", main).group(1)
    assert f'"--model-path", "{model}"' in dockerfile
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        for path in line.split()[:-1]:  # the last word is the destination
            assert (ROOT / path).exists(), f"Dockerfile copies {path}, which is not in the repository"
