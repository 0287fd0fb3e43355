#!/usr/bin/env python3
"""Set up and run durable's jobs on a fresh machine that has only python3 (stdlib only).

    python3 scripts/dev.py demo    # venv + core install, then the example pipeline
    python3 scripts/dev.py test    # venv + every extra + test servers, then lint, types, tests

Both are idempotent: a second run reuses .venv and the installed servers. `.ci/run` is
exactly `python3 scripts/dev.py test`.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VENV = ROOT / ".venv"
BIN = VENV / "bin"
PY = BIN / "python"


def run(*cmd: str | Path, check: bool = True, env: dict[str, str] | None = None) -> int:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, check=check, env=env).returncode


def ensure_venv(extras: str) -> None:
    if not PY.exists():
        venv.EnvBuilder(with_pip=True).create(VENV)
    if not (BIN / "uv").exists():
        # uv resolves and installs the full test set in seconds rather than a minute.
        run(PY, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "uv")
    run(BIN / "uv", "pip", "install", "--quiet", "--python", PY, "-e", f".[{extras}]")


def demo(args: list[str]) -> int:
    ensure_venv("demo")
    return run(PY, "examples/pipeline.py", *args, check=False)


def test(args: list[str]) -> int:
    ensure_venv("dev")
    run(PY, "scripts/install_azurite.py")
    # mkdocs-material prints an end-of-life banner on every build; it is not a warning.
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    failed = 0
    failed |= run(BIN / "ruff", "check", "src", "tests", "examples", "benchmarks",
                  "scripts", check=False)
    failed |= run(BIN / "mypy", check=False)
    if (ROOT / "mkdocs.yml").exists():
        failed |= run(PY, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                      str(ROOT / ".cache" / "site"), check=False, env=env)
    rc = run(PY, "-m", "pytest", "-q", *args, check=False, env=env)
    if rc == 5:
        print("pytest collected no tests: that is a failure here", file=sys.stderr)
    return 1 if (failed or rc) else 0


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] not in ("demo", "test"):
        print(__doc__, file=sys.stderr)
        return 2
    job, args = sys.argv[1], sys.argv[2:]
    return demo(args) if job == "demo" else test(args)


if __name__ == "__main__":
    sys.exit(main())
