"""Which code this is: the installed version and the commit it was built from, for
`--version`, `archipelago.commit()` and `/metrics`' `archipelago_build_info`. A module of its
own, importing nothing of the project: the package's root, the control plane and the
library all read it."""

from __future__ import annotations

import functools
import json
import os
import subprocess
from pathlib import Path

DISTRIBUTION = "archipelago-diloco"


@functools.cache
def version() -> str:
    """The installed distribution's version ("unknown" from a checkout on PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown"


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
    source = Path(__file__).resolve().parents[1]  # the checkout this file is in, if it is one
    try:
        top = subprocess.run(
            ["git", "-C", str(source), "rev-parse", "--show-toplevel"],
            capture_output=True,
            text=True,
            timeout=5,
            check=True,
        ).stdout.strip()
        if Path(top).resolve() != source:  # a wheel in a venv inside another project's checkout
            return "unknown"
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
