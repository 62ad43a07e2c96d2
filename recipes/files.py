"""Writing a user's file so that a failure never leaves half of it: `publish` writes beside
the file and renames over it, so a reader (or the next command) sees the old file whole or
the new one whole, never a mix, and a write that fails or is killed leaves the old one."""

from __future__ import annotations

import os
from pathlib import Path

PARTIAL = ".partial"  # the suffix of a file being written


def publish(path: str | Path, data: bytes | str) -> Path:
    """Writes `data` (str: UTF-8) to `path` through `path.partial` and one rename (fsynced
    first); the parent directory is made if missing. Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + PARTIAL)
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
