"""Files that users name: read without ever blocking, written all-or-none.

Reading. Every path the runner reads (bundles, programs and their data
files, input arrays, references, keys, signatures) comes from outside and may
be a FIFO, a device, a directory, a dangling symlink or a file this process
may not read. `open_regular` refuses all of those with one line before any byte is
read: a FIFO is opened with O_NONBLOCK (so even one swapped in after the
check cannot hang the open) and refused on fstat; `read_small` caps what it
reads, so `/dev/zero` or a huge file given as a key cannot eat memory.

Writing. This is the one place that renames anything into place. A set of
files (a run's outputs, a bundle) is written as one transaction:

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

A process killed between two renames (kill -9, a power cut) cannot roll
back: the folder then holds some new files and some old ones. Where that
must be detectable (a batch set, which `--resume` may skip), the transaction
also keeps a *set record*, a small hidden file naming every file of the set
with its size and digest. The old record is moved aside before the first
rename and the new one is renamed into place after the last, so a record
that matches the files (`set_record_matches`) proves they are exactly the
set one transaction wrote.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import json
import os
import re
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import xxhash

from .errors import CudaRunnerError, InputError, WriteError, os_error

_TEMP_PATTERN = re.compile(r"^\..+\.([0-9a-f]{8})\.(\d{1,10})\.[0-9a-f]{8}\.(?:tmp|old)$")
# This machine's tag in temp names (os.uname and xxhash rather than socket and
# hashlib: those two imports cost about 14 ms of every command's start).
_HOST = xxhash.xxh32_hexdigest(os.uname().nodename.encode())

Writer = Callable[[BinaryIO], None]


# ---------------------------------------------------------------------------
# Reading


def kind_of(mode: int) -> str:
    """A file type in words, for messages."""
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def _stat(path: Path) -> os.stat_result:
    """What `path` is (following links), or an InputError saying why it cannot be known."""
    try:
        return os.stat(path)
    except FileNotFoundError:
        dangling = os.path.islink(path)
        raise InputError(f"{path} does not exist" + (" (a symbolic link to nothing)" if dangling else "")) from None
    except OSError as error:
        raise os_error(error, f"cannot read {path}", InputError) from None


def open_regular(path: str | os.PathLike[str], what: str, *, not_regular: type[CudaRunnerError] = InputError) -> BinaryIO:
    """`path` opened for reading, or an error naming `what` it should have been.

    A missing or unreadable path is an InputError (the user gave a wrong
    path); a path that exists but is no regular file raises `not_regular`
    (a bundle reader passes BundleError: such a thing is not a bundle)."""
    path = Path(path)
    info = _stat(path)
    if not stat.S_ISREG(info.st_mode):
        raise not_regular(f"{path} is not a regular file (a {kind_of(info.st_mode)}), so not {what}")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise os_error(error, f"cannot read {path}", InputError) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise not_regular(f"{path} is not a regular file (a {kind_of(mode)}), so not {what}")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_small(path: str | os.PathLike[str], what: str, limit: int, *, not_regular: type[CudaRunnerError] = InputError) -> bytes:
    """The whole of a small regular file (a key, a signature), at most `limit` bytes."""
    with open_regular(path, what, not_regular=not_regular) as handle:
        try:
            data = handle.read(limit + 1)
        except OSError as error:
            raise os_error(error, f"cannot read {path}", InputError) from None
    if len(data) > limit:
        raise not_regular(f"{path} is larger than {what} can be ({limit} bytes)")
    return data


def require_regular(path: str | os.PathLike[str], what: str, *, not_regular: type[CudaRunnerError] = InputError) -> None:
    """Check that `path` could be opened as `what`, for readers that open it themselves."""
    open_regular(path, what, not_regular=not_regular).close()


def require_folder(path: str | os.PathLike[str], what: str) -> None:
    """Check that `path` is a directory this process can list."""
    path = Path(path)
    info = _stat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise InputError(f"{path} is a {'regular file' if stat.S_ISREG(info.st_mode) else kind_of(info.st_mode)}, not {what}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise InputError(f"cannot read {path}: Permission denied")


# ---------------------------------------------------------------------------
# Writing

# The set record: its file name (beside the set's files) and its format.
SET_RECORD = ".cuda-runner-set.json"
# Version 2 adds the set's provenance (what wrote it); a version 1 record never matches.
_RECORD_SCHEMA = "cuda-runner/set-record/2"
_RECORD_LIMIT = 1 << 20  # bytes; a record names a few files


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
        raise os_error(error, f"{path}: cannot write there", InputError) from None


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
    return path.with_name(f".{path.name}.{_HOST}.{os.getpid()}.{os.urandom(4).hex()}.{kind}")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # not ours to judge: keep the file
    return True


def _is_this_host(tag: str) -> bool:
    return tag == _HOST or tag == _legacy_host_tag()


@functools.cache
def _legacy_host_tag() -> str:
    """The tag that earlier builds wrote (SHA-256 of the host name), so that
    their dead writers' leftovers are removed too. Worked out only when a temp
    of another tag turns up: hashlib loads OpenSSL."""
    import hashlib

    return hashlib.sha256(os.uname().nodename.encode()).hexdigest()[:8]


def remove_stale_temps(directory: Path) -> None:
    """Remove temp files that dead writers left behind in `directory`."""
    with contextlib.suppress(OSError):
        for entry in os.scandir(directory):
            match = _TEMP_PATTERN.match(entry.name)
            if match and _is_this_host(match.group(1)) and int(match.group(2)) != os.getpid() and not _pid_alive(int(match.group(2))):
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

    def set_aside(self, path: Path) -> None:
        """Move `path` out of the way (rolled back like a rename); nothing if it is absent."""
        backup = _temp_name(path, "old")
        try:
            os.rename(path, backup)
        except FileNotFoundError:
            return
        self.done.append((path, backup))  # roll_back puts it back; forget_backups removes it

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


def write_files(writers: Mapping[Path, Writer], *, record: Path | None = None, provenance: Mapping[str, Any] | None = None) -> list[Path]:
    """Write every file or none (see the module docstring); returns the paths.

    With `record`, the transaction also writes the set record there (in the
    folder of the files): moved aside before the first rename, written after
    the last, so that it exists only while the files are one whole set. It
    keeps `provenance` (JSON values: what wrote the set) for set_record_matches."""
    paths = [Path(path) for path in writers]
    every = [*paths, *([record] if record is not None else [])]
    if len({os.path.abspath(path) for path in every}) != len(every):
        raise InputError("two outputs would be written to the same file")
    if record is not None and any(os.path.abspath(path.parent) != os.path.abspath(record.parent) for path in paths):
        raise ValueError("a set record lives in the folder of the files it names")
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
            record_temp = None
            if record is not None:
                document = _record_document({path.name: temps[path] for path in paths}, provenance)
                record_temp = temps[record] = _write_temp(record, functools.partial(_write_bytes, document))
            _rename_all(temps, record, record_temp)
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
            raise os_error(error, f"cannot write {_destination_of(error.filename) or 'output'}", WriteError) from None
        raise


def _destination_of(filename: object) -> str | None:
    """The file a writer meant, for a message: a temp file's destination, else the name itself."""
    if not isinstance(filename, (str, os.PathLike)):
        return None
    path = Path(filename)
    match = _TEMP_PATTERN.match(path.name)
    if match is None:
        return str(path)
    return str(path.with_name(path.name[1:match.start(1) - 1]))  # ".NAME.HOST.PID.RANDOM.tmp" -> NAME


def _rename_all(temps: dict[Path, Path], record: Path | None = None, record_temp: Path | None = None) -> None:
    """Rename every temp file into place, or roll back to the old files. A set
    record goes aside first (durably: on disk before any file changes) and its
    successor comes last."""
    commit = _Commit()
    try:
        if record is not None and os.path.lexists(record):
            commit.set_aside(record)
            _fsync_folder(record.parent)
        for path, temp in list(temps.items()):
            if path != record:
                commit.rename(temp, path)
                del temps[path]
        if record is not None and record_temp is not None:
            commit.rename(record_temp, record)
            del temps[record]
    except BaseException:
        commit.roll_back()
        raise
    commit.forget_backups()


def _write_bytes(data: bytes, handle: BinaryIO) -> None:
    handle.write(data)


def file_digest(path: Path) -> str:
    """The xxh3-128 digest of a file's bytes, as set records name them."""
    digest = xxhash.xxh3_128()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return f"xxh3-128:{digest.hexdigest()}"


def _record_document(files: Mapping[str, Path], provenance: Mapping[str, Any] | None) -> bytes:
    """The set record for files (by name) as written to `files[name]`: size,
    digest and identity (inode and mtime survive the rename into place), and
    the set's provenance."""
    entries = {}
    for name, temp in files.items():
        info = os.stat(temp)
        entries[name] = {"size": info.st_size, "digest": file_digest(temp), "inode": info.st_ino, "mtime_ns": info.st_mtime_ns}
    return json.dumps({"schema": _RECORD_SCHEMA, "provenance": provenance, "files": entries}, sort_keys=True).encode()


def set_record_matches(record: Path, paths: Sequence[Path], provenance: Mapping[str, Any] | None = None) -> bool:
    """Whether `record` names exactly the files `paths`, each as the
    transaction that wrote the record left it (same size, and the same inode
    and mtime or else, a copied folder, the same digest), and was written with
    this `provenance`: the same model, method and inputs."""
    document = _read_record(record)
    if document is None:
        return False
    if document.get("provenance") != json.loads(json.dumps(provenance, sort_keys=True)):  # compared as JSON values
        return False
    entries = document.get("files")
    if not isinstance(entries, dict) or set(entries) != {path.name for path in paths}:
        return False
    for path in paths:
        entry = entries[path.name]
        try:
            info = os.lstat(path)
        except OSError:
            return False
        if not isinstance(entry, dict) or not stat.S_ISREG(info.st_mode) or entry.get("size") != info.st_size:
            return False
        if (entry.get("inode"), entry.get("mtime_ns")) == (info.st_ino, info.st_mtime_ns):
            continue
        try:
            if entry.get("digest") != file_digest(path):
                return False
        except OSError:
            return False
    return True


def _read_record(record: Path) -> dict[str, Any] | None:
    try:
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, _RECORD_LIMIT + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > _RECORD_LIMIT:
        return None
    try:
        document = json.loads(data)
    except ValueError:
        return None
    return document if isinstance(document, dict) and document.get("schema") == _RECORD_SCHEMA else None


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
