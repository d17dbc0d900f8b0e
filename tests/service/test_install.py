"""`make run` installs what serving needs, not the tests', lint's and evaluation's tools
(those come with `make test`)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DEV_ONLY = ("pytest", "ruff", "mypy", "ranx", "bm25s", "matplotlib", "cohere", "grpc_tools")


def test_make_runs_install_serves_without_the_dev_tools(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run(
        ["make", "-C", str(ROOT), f"VENV={venv}", "install-serve"],
        check=True,
        capture_output=True,
        timeout=900,
    )
    python = str(venv / "bin" / "python")
    for tool in ("rerank-server", "rerank-client"):
        subprocess.run(
            [str(venv / "bin" / tool), "--help"], check=True, capture_output=True, timeout=60
        )
    # Everything `rerank-server --managed` loads to serve both APIs, and prepare.
    subprocess.run(
        [
            python,
            "-c",
            "import rerank_server.server, rerank_server.workers, "
            "rerank_server.http_api.app, rerank_server.managed.assets",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    found = subprocess.run(
        [
            python,
            "-c",
            "import importlib.util as u; "
            f"print(' '.join(m for m in {DEV_ONLY!r} if u.find_spec(m)))",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout.split()
    assert found == []
