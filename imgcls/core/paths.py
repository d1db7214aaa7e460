"""What a path the user names is, when it is not the regular file a key or flag asks for: reading a FIFO
blocks until a writer comes, a folder or a device is no list, so every named file is checked before it is
opened."""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Optional

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


def not_a_regular_file(path: str | Path) -> Optional[str]:
    """None for a regular file (links followed); else what the path is instead ("no such file", "a folder",
    "a named pipe (FIFO)", ...), for a message that says so."""
    try:
        mode = os.stat(Path(path).expanduser()).st_mode
    except FileNotFoundError:
        return "a broken link" if os.path.islink(path) else "no such file"
    except OSError as err:
        return f"cannot be read: {err.strerror or type(err).__name__}"
    if stat.S_ISREG(mode):
        return None
    return next((kind for test, kind in _KINDS if test(mode)), "not a regular file")
