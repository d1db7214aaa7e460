"""Files a command writes get the permissions of any new file: 0666 less the umask. Some writers (safetensors)
create theirs owner-only, which leaves the weights unreadable to another user or a container's uid."""
from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process's umask, read without changing it where Linux reports it (/proc), else set and restored."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """Give `path` (a file, or every file in a folder) the mode a new file gets: 0666 less the umask."""
    mode = 0o666 & ~current_umask()
    files = [p for p in path.rglob("*") if p.is_file()] if path.is_dir() else [path]
    for file in files:
        os.chmod(file, mode)
