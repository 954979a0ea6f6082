"""Output paths checked before any work: a command that would profile for minutes and then fail to write its
result refuses the path first, naming it and why."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from .errors import OutputWriteError, Pi2Error


def check_output(path: str | Path, what: str) -> Path:
    """path (as given, ~ expanded) if a file can be written there: not a directory, in an existing directory
    this process may create files in (outputs are written to a temp file beside the path, then renamed over
    it, so that is what is tried: a file is created there and removed). OutputWriteError naming `what`
    ("sidecar", "-o", "--png") and the path otherwise."""
    p = Path(path).expanduser()
    if p.is_dir():
        raise OutputWriteError(f"{what} {p}: is a directory; give the file to write")
    parent = p.parent
    if not parent.exists():
        raise OutputWriteError(f"{what} {p}: directory {parent} does not exist")
    if not parent.is_dir():
        raise OutputWriteError(f"{what} {p}: {parent} is not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".probe", dir=parent)
    except OSError as e:
        raise OutputWriteError(f"{what} {p}: cannot create files in {parent}: {e.strerror or e}") from None
    os.close(fd)
    os.unlink(probe)
    return p


def write_png(fig: Any, path: str | Path, what: str = "--png") -> Path:
    """Writes a matplotlib figure to path as PNG, atomically (a temp file beside it, renamed over it); the path
    checked as check_output does, and OutputWriteError naming `what` when the write fails."""
    out = check_output(path, what)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(tmp, format="png", dpi=100)
        tmp.replace(out)
    except OSError as e:
        raise OutputWriteError(f"cannot write {what} {out}: {e.strerror or e}") from e
    finally:
        tmp.unlink(missing_ok=True)
    return out


def read_head(path: str | Path, what: str, error: type[Pi2Error], n: int = 4) -> tuple[Path, bytes]:
    """(path, its first n bytes) of an existing regular file (a FIFO would block its reader), or `error`
    naming the file as `what` ("model file", "profile") and what is wrong: not found (a dangling symbolic
    link says where it points), not a file, or unreadable."""
    p = Path(path).expanduser()
    if not p.exists():
        if p.is_symlink():
            raise error(f"{what} {p} is a symbolic link to {os.readlink(p)}, which does not exist")
        raise error(f"{what} not found: {p}")
    if not p.is_file():
        raise error(f"{what} path is not a file: {p}")
    try:
        with p.open("rb") as f:
            return p, f.read(n)
    except OSError as e:
        raise error(f"cannot read {what} {p}: {e.strerror or e}") from e
