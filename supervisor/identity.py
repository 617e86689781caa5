"""corral's name and version, and the package it must not share an environment with.

Standard library only. See docs/decisions.md ("Packaging: three import
packages, the `supervisor` name kept") and docs/operations.md ("Install: a
virtual environment of its own").
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

DIST = "corral"
FOREIGN_DIST = "supervisor"  # supervisord's distribution name on PyPI
FOREIGN_SCRIPTS = frozenset({"supervisord", "supervisorctl"})


def version() -> str:
    """corral's version, from the installed distribution's metadata."""
    try:
        return metadata.version(DIST)
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def foreign_supervisor(paths: Sequence[str] | None = None,
                       package_dir: Path | None = None) -> str | None:
    """What shows that supervisord is installed beside corral, or None.

    Looks for a `supervisor` distribution, any distribution but corral that
    installs a `supervisord`/`supervisorctl` command, and supervisord's
    `supervisord.py` inside our package directory (`paths`: where to look for
    distributions, default sys.path; `package_dir`: our package's directory)."""
    found: list[str] = []
    dists = (metadata.distributions(path=list(paths)) if paths is not None
             else metadata.distributions())
    for dist in dists:
        name = (dist.metadata["Name"] or "").lower()
        if name == DIST:
            continue
        scripts = {ep.name for ep in dist.entry_points if ep.group == "console_scripts"}
        if name == FOREIGN_DIST or scripts & FOREIGN_SCRIPTS:
            where = getattr(dist, "_path", None)
            found.append(f"the distribution {dist.metadata['Name']} {dist.version}"
                         + (f" ({Path(str(where)).parent})" if where else ""))
    here = package_dir if package_dir is not None else Path(__file__).resolve().parent
    if (here / "supervisord.py").exists():
        found.append(f"supervisord's supervisord.py inside {here}")
    if not found:
        return None
    return ("supervisord is installed in the same environment as corral ("
            + "; ".join(sorted(set(found)))
            + "): both use the import package `supervisor`, so installing, upgrading or "
              "removing either breaks the other. Give corral a virtual environment of its "
              "own: python -m venv ~/.venvs/corral && ~/.venvs/corral/bin/pip install corral "
              "(docs/operations.md)")
