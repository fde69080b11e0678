"""Opening files that users name, for reading, without ever blocking.

Every path the runner reads (bundles, programs and their data files, input
arrays, references, keys, signatures) comes from outside and may be a FIFO,
a device, a directory, a dangling symlink or a file this process may not
read. `open_regular` refuses all of those with one line before any byte is
read: a FIFO is opened with O_NONBLOCK (so even one swapped in after the
check cannot hang the open) and refused on fstat; `read_small` caps what it
reads, so `/dev/zero` or a huge file given as a key cannot eat memory.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from .errors import CudaRunnerError, InputError


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
        raise InputError(f"cannot read {path}: {error.strerror or error}") from None


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
        raise InputError(f"cannot read {path}: {error.strerror or error}") from None
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
            raise InputError(f"cannot read {path}: {error.strerror or error}") from None
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
