"""Which code this is: the installed version and the commit it was built from, for
`--version`, `archipelago.commit()` and `/metrics`' `archipelago_build_info`. A module of its
own, importing nothing of the project but its root: the control plane and the library both
read it."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

DISTRIBUTION = "archipelago-diloco"


def version() -> str:
    """The installed distribution's version ("unknown" from a checkout on PYTHONPATH)."""
    import archipelago

    return str(archipelago.__version__)


@functools.cache
def commit() -> str:
    """The commit this code is built from: the image's (`ARCHIPELAGO_COMMIT`, set by
    k8s/image/build.sh), pip's record of a VCS install, or the checkout's own (git, with
    `+dirty` when its files differ from it); "unknown" where none says."""
    if stated := os.environ.get("ARCHIPELAGO_COMMIT"):
        return stated
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        recorded = distribution(DISTRIBUTION).read_text("direct_url.json")
        vcs = json.loads(recorded).get("vcs_info", {}) if recorded else {}
        if vcs.get("commit_id"):
            return str(vcs["commit_id"])[:12]
    except (PackageNotFoundError, ValueError):
        pass
    source = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "--short=12", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(source), "diff", "--quiet", "HEAD"], timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}+dirty" if dirty.returncode else head
