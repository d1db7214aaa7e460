"""What a path the user names is, when it is not the regular file a key or flag asks for: reading a FIFO
blocks until a writer comes, a folder or a device is no list, so every named file is checked before it is
opened.

Files a command writes get the permissions of any new file: 0666 less the umask. Some writers (safetensors)
create theirs owner-only, which leaves the weights unreadable to another user or a container's uid.

Files a command writes for the user: strict JSON written atomically, and the check that an output path
can be written, made before any work."""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Optional

from imgcls.core.errors import ConfigError

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

# files that mark a training run's directory, which only train.py writes into
RUN_DIR_MARKERS = ("config.yaml", "last.pt", "best.pt", "summary.json")


def print_table(text: str) -> bool:
    """`text` on stdout, flushed. A reader that closed the pipe early (`infer.py ... | head -4`) has what it
    wanted: stdout then goes to os.devnull (the interpreter's last flush would raise again, see the Python
    docs' note on SIGPIPE), the command carries on with its files and stderr, and this returns False."""
    import sys

    try:
        print(text, flush=True)
        return True
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return False


def finite_or_null(value):
    """Strict JSON for dashboards: a non-finite float (a NaN loss, the loss of an empty split) becomes null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_null(v) for v in value]
    return value


def write_json(doc, path: Optional[str | os.PathLike]) -> None:
    """`doc` as strict, indented JSON at `path` (nothing when `path` is None): written to a temp file beside
    it and renamed over it, so a reader never sees half a file; its folder is created."""
    if not path:
        return
    write_text_atomic(json.dumps(finite_or_null(doc), indent=2, allow_nan=False, default=str) + "\n", path)


def write_text_atomic(text: str, path: str | os.PathLike) -> None:
    """`text` at `path`, written to a temp file beside it and renamed over it; its folder is created."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def check_output_file(flag: str, path: Optional[str], suffix: Optional[str] = None,
                      outside_runs: bool = False) -> None:
    """ConfigError (exit 2) before any work when an output file cannot be written where asked: the name is a
    folder, a part of the path above it is a file, it lacks `suffix`, or (`outside_runs`) its folder is a
    training run's directory."""
    if not path:
        return
    target = Path(path)
    if target.is_dir():
        raise ConfigError(f"{flag} {path}: is a folder; pass a file name (for example "
                          f"{target / 'out'}{target.suffix or suffix or '.json'})")
    if suffix and target.suffix.lower() != suffix:
        raise ConfigError(f"{flag} {path}: must end in {suffix}")
    for parent in target.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(f"{flag} {path}: {parent} is a file, not a folder")
            break
    if outside_runs and any((target.parent / marker).exists() for marker in RUN_DIR_MARKERS):
        raise ConfigError(f"{flag} {path}: {target.parent} is a run directory; this command writes nothing "
                          f"into runs, choose another folder")


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def check_outputs_distinct(outputs: dict) -> None:
    """ConfigError (exit 2) before any work when two of a command's outputs (flag -> file, including the files
    it derives from a given name) are one file: the second would replace the first."""
    seen: dict = {}
    for flag, out in outputs.items():
        if not out:
            continue
        target = os.path.realpath(out)
        if target in seen:
            first, first_path = seen[target]
            raise ConfigError(f"{flag} {out}: is also {first} {first_path}, which this command writes too; give each "
                              f"output a file of its own")
        seen[target] = (flag, out)


def check_outputs_apart(outputs: dict, input_files: dict, input_dirs: dict = None, output_dirs: dict = None
                        ) -> None:
    """ConfigError (exit 2) before any work when a command would write over what it reads. `outputs`:
    flag -> output file; `output_dirs`: flag -> a folder the command writes files into; `input_files`: role ->
    the files it reads (an input image or list, the classes file, the checkpoint); `input_dirs`: role -> the
    folders it reads from (the data root, an input folder). Refused: an output file that is an input file or
    lies inside an input folder; an output folder that holds an input file or overlaps an input folder.
    Paths compare resolved (symlinks followed, relative to the working directory)."""
    real = os.path.realpath
    check_outputs_distinct(outputs)
    files = [(role, f, real(f)) for role, paths in input_files.items() for f in (paths or ()) if f]
    dirs = [(role, d, real(d)) for role, paths in (input_dirs or {}).items() for d in (paths or ()) if d]
    for flag, out in outputs.items():
        if not out:
            continue
        target = real(out)
        for role, f, rf in files:
            if target == rf:
                raise ConfigError(f"{flag} {out}: is the {role} {f}, which this command reads; name a new file")
        for role, d, rd in dirs:
            if _inside(target, rd):
                raise ConfigError(f"{flag} {out}: lies inside the {role} {d}, which this command reads from; "
                                  f"write it elsewhere")
    for flag, out in (output_dirs or {}).items():
        if not out:
            continue
        target = real(out)
        for role, f, rf in files:
            if _inside(rf, target):
                raise ConfigError(f"{flag} {out}: holds the {role} {f}, which this command reads; name a folder "
                                  f"that holds no input")
        for role, d, rd in dirs:
            if _inside(target, rd) or _inside(rd, target):
                raise ConfigError(f"{flag} {out}: overlaps the {role} {d}, which this command reads from; name a "
                                  f"folder outside it")
