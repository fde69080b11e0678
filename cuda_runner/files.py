"""Writing files all-or-none: the one place that renames anything into place.

A set of files (a run's outputs, a bundle) is written as one transaction:

1. every destination is checked (name lengths, not a directory, parent usable);
2. the folders are locked (flock on the folder itself, so no lock file is
   left among the outputs): two writers into one folder are serialised and a
   reader never sees a mix of two runs;
3. leftovers of dead writers (temp files whose pid is gone) are removed;
4. every file is written to a temp file beside its destination and fsynced;
5. only then are they renamed into place; if a rename fails, the files
   already renamed are rolled back to their old contents (or removed), so the
   folder holds exactly the old set or exactly the new set.

Temp names carry the writer's host and pid: `.NAME.HOST.PID.RANDOM.tmp`; only
temp files of this host whose process is gone count as leftovers (a folder
on a network file system may be written from other hosts).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import secrets
import socket
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

from .errors import InputError, WriteError
from .opening import kind_of

_TEMP_PATTERN = re.compile(r"^\..+\.([0-9a-f]{8})\.(\d{1,10})\.[0-9a-f]{8}\.(?:tmp|old)$")
_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]

Writer = Callable[[BinaryIO], None]


def _name_max(directory: Path) -> int:
    try:
        return os.pathconf(directory if directory.exists() else ".", "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def check_destination(path: Path) -> None:
    """Refuse, before anything is written, a destination that cannot be written."""
    try:
        _check_destination(path)
    except OSError as error:  # a folder on the way that cannot be searched, say
        raise InputError(f"{path}: cannot write there: {error.strerror or error}") from None


def _check_destination(path: Path) -> None:
    limit = _name_max(path.parent)
    for part in path.parts:
        # The temp name adds about 24 bytes to the last component.
        extra = 24 if part == path.name else 0
        if len(os.fsencode(part)) + extra > limit:
            raise InputError(f"{path}: the path component {part[:40]!r}... is longer than this file system allows ({limit} bytes)")
    if path.is_dir():
        raise InputError(f"{path} is a directory; cannot write a file there")
    if path.exists() and not path.is_file():  # renaming over a FIFO or a device would replace it
        raise InputError(f"{path} is not a regular file (a {kind_of(path.stat().st_mode)}); cannot write a file there")
    for parent in path.parents:
        if os.path.islink(parent) and not parent.exists():
            raise InputError(f"{path}: {parent} is a symbolic link to nothing")
        if parent.exists():
            if not parent.is_dir():
                raise InputError(f"{path}: {parent} exists and is not a directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                raise InputError(f"{path}: {parent} is not writable")
            break


def _temp_name(path: Path, kind: str = "tmp") -> Path:
    return path.with_name(f".{path.name}.{_HOST}.{os.getpid()}.{secrets.token_hex(4)}.{kind}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # not ours to judge: keep the file
    return True


def remove_stale_temps(directory: Path) -> None:
    """Remove temp files that dead writers left behind in `directory`."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            match = _TEMP_PATTERN.match(entry.name)
            if match and match.group(1) == _HOST and int(match.group(2)) != os.getpid() and not _pid_alive(int(match.group(2))):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)


@contextlib.contextmanager
def folder_lock(directory: Path) -> Iterator[None]:
    """An exclusive advisory lock on `directory` itself (Linux flocks folders)."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _make_folders(paths: list[Path]) -> list[Path]:
    """Create missing parent folders; return those created, deepest first."""
    created: list[Path] = []
    for path in paths:
        missing = [parent for parent in reversed(path.parents) if not parent.exists()]
        for folder in missing:
            with contextlib.suppress(FileExistsError):
                folder.mkdir()
                created.append(folder)
    return list(reversed(created))


def _write_temp(path: Path, write: Writer) -> Path:
    temp = _temp_name(path)
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        with os.fdopen(fd, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        raise
    return temp


class _Commit:
    """Renames temp files into place, remembering how to undo each step."""

    def __init__(self) -> None:
        self.done: list[tuple[Path, Path | None]] = []  # (destination, backup of its old contents)

    def rename(self, temp: Path, path: Path) -> None:
        backup, moved = None, False
        if os.path.lexists(path):  # a dangling symlink is an old file too
            backup = _temp_name(path, "old")
            try:
                os.link(path, backup, follow_symlinks=False)
            except OSError:  # no hard links here (vfat, some FUSE mounts): move it aside instead
                os.rename(path, backup)
                moved = True
        try:
            os.replace(temp, path)
        except BaseException:
            if backup is not None:
                if moved:
                    os.replace(backup, path)
                else:
                    os.unlink(backup)
            raise
        self.done.append((path, backup))

    def roll_back(self) -> None:
        for path, backup in reversed(self.done):
            with contextlib.suppress(OSError):
                if backup is None:
                    os.unlink(path)
                else:
                    os.replace(backup, path)
        self.done = []

    def forget_backups(self) -> None:
        for _, backup in self.done:
            if backup is not None:
                with contextlib.suppress(OSError):
                    os.unlink(backup)


def write_files(writers: Mapping[Path, Writer]) -> list[Path]:
    """Write every file or none (see the module docstring); returns the paths."""
    paths = [Path(path) for path in writers]
    if len({os.path.abspath(path) for path in paths}) != len(paths):
        raise InputError("two outputs would be written to the same file")
    for path in paths:
        check_destination(path)
    created: list[Path] = []
    temps: dict[Path, Path] = {}
    try:
        created = _make_folders(paths)
        folders = sorted({path.parent.resolve() for path in paths})
        with contextlib.ExitStack() as locks:
            for folder in folders:
                locks.enter_context(folder_lock(folder))
                remove_stale_temps(folder)
            for path, write in zip(paths, writers.values()):
                temps[path] = _write_temp(path, write)
            _rename_all(temps)
            for folder in folders:
                with contextlib.suppress(OSError):  # the new set is in place; durability is best effort now
                    _fsync_folder(folder)
        return paths
    except BaseException as error:
        for temp in temps.values():
            with contextlib.suppress(OSError):
                os.unlink(temp)
        _remove_folders(created)
        if isinstance(error, OSError):
            raise WriteError(f"cannot write {error.filename or 'output'}: {error.strerror or error}") from None
        raise


def _rename_all(temps: dict[Path, Path]) -> None:
    """Rename every temp file into place, or roll back to the old files."""
    commit = _Commit()
    try:
        for path, temp in list(temps.items()):
            commit.rename(temp, path)
            del temps[path]
    except BaseException:
        commit.roll_back()
        raise
    commit.forget_backups()


def write_file(path: str | os.PathLike[str], write: Writer) -> Path:
    return write_files({Path(path): write})[0]


def _remove_folders(folders: list[Path]) -> None:
    for folder in folders:
        with contextlib.suppress(OSError):
            folder.rmdir()


def _fsync_folder(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.EROFS):
            raise
    finally:
        os.close(fd)
