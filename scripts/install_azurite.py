"""Install azurite (the Azure Blob emulator, an npm package) into <repo>/.cache/azurite.

Why a script: azurite is not on PyPI, and a fresh machine (a developer's or CI's) keeps
nothing installed by hand, so the repo must install it itself. Stdlib only, so it runs
before any Python dependency is installed. Idempotent: does nothing if it is there.

    python scripts/install_azurite.py [--force]

`durable.testing.servers.start_azurite()` looks for the binary this installs.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PREFIX = REPO / ".cache" / "azurite"
BINARY = PREFIX / "node_modules" / ".bin" / "azurite-blob"
PACKAGE = "azurite@3"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force", action="store_true", help="reinstall even if present")
    args = parser.parse_args(argv)

    if BINARY.exists() and not args.force:
        print(f"azurite already installed: {BINARY}")
        return 0
    npm = shutil.which("npm")
    if npm is None:
        print("npm not found: install Node.js (>= 18) and npm first", file=sys.stderr)
        return 1
    PREFIX.mkdir(parents=True, exist_ok=True)
    cmd = [npm, "install", "--no-audit", "--no-fund", "--prefix", str(PREFIX), PACKAGE]
    print("+", " ".join(cmd), flush=True)
    result = subprocess.run(cmd, check=False)
    if result.returncode != 0:
        return result.returncode
    if not BINARY.exists():
        print(f"npm finished but {BINARY} is missing", file=sys.stderr)
        return 1
    print(f"azurite installed: {BINARY}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
