"""Files paramstore reads or creates outside its own private root, opened so that nobody else's
link or file is followed.

An export directory and a model directory of assets belong to the user, but another local user may
be able to write into them (a shared scratch space). Two rules hold here:

- A file created there is created new, never opened through a name that exists: a leftover
  (``*.partial`` of an interrupted export) is unlinked first (which removes a link, not its
  target), then the file is made with ``O_CREAT | O_EXCL | O_NOFOLLOW``. A link planted between the
  two makes the open fail; nothing else is ever written.
- A file replaced atomically (:func:`write_atomic`: a ``*.partial`` written, then renamed over
  it) is written through :func:`create_new` too: in a group store's root, which members may write,
  a member could plant that ``*.partial`` name as a link to any file the trainer can write.
- A folder the library writes into (:func:`own_directory`) must be a real folder of this user's,
  not a link or a folder someone else made first.
- A file read from there is opened with ``O_NOFOLLOW`` and must be a regular file no larger than
  the limit given: a link to ``/proc/self/environ`` or ``~/.aws/credentials`` is refused, not read
  into a version.

Example:
    >>> import os, tempfile
    >>> d = tempfile.mkdtemp()
    >>> with create_new(os.path.join(d, "a.partial")) as f:
    ...     _ = f.write(b"x")
    >>> read_regular(os.path.join(d, "a.partial"), limit=10)
    b'x'
    >>> os.symlink("/etc/hostname", os.path.join(d, "b"))
    >>> read_regular(os.path.join(d, "b"), limit=10)
    Traceback (most recent call last):
    ...
    paramstore.errors.InvalidArgumentError: ... is a symbolic link; ...
"""

from __future__ import annotations

import errno
import os
import stat
from typing import IO

from .errors import InvalidArgumentError, UnsafeStoreError

__all__ = ["create_new", "write_atomic", "own_directory", "read_regular", "check_own_directory"]

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def create_new(path: str, mode: int = 0o644) -> IO[bytes]:
    """Open ``path`` for writing as a file made now (``w+b``): whatever had that name (a leftover,
    or a link someone planted) is unlinked first, and the open refuses to follow or reuse a name
    that reappears meanwhile (FileExistsError, or OSError ELOOP)."""
    try:
        os.unlink(path)  # a link is removed itself; its target is untouched
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW | _CLOEXEC, mode)
    return os.fdopen(fd, "w+b")


def write_atomic(path: str, data: bytes, *, mode: int = 0o644) -> None:
    """Replace ``path`` with ``data`` atomically: written to ``<path>.<pid>.partial`` (made new, see
    :func:`create_new`), fsynced, given ``mode`` (whatever the umask), renamed over ``path``."""
    tmp = f"{path}.{os.getpid()}.partial"
    try:
        with create_new(tmp, mode) as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def own_directory(path: str, mode: int) -> None:
    """Make the folder ``path`` with ``mode`` (whatever the umask) if it is missing; an existing one
    must be a folder, not a link, owned by this user (it is left as it is).

    Raises UnsafeStoreError otherwise: whoever made it could plant files or links in it."""
    try:
        os.mkdir(path, mode)
        os.chmod(path, mode)  # mkdir's mode is filtered by the umask
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeStoreError(f"{path} is not a folder ({'a link' if stat.S_ISLNK(st.st_mode) else 'a file'}): "
                               "someone with write access to the store put it there. Remove it, then retry")
    if st.st_uid != os.geteuid():
        raise UnsafeStoreError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}), who "
                               "writes into it: whoever made it could plant files or links in it. Remove it "
                               "(rm -r), then retry")


def read_regular(path: str, *, limit: int) -> bytes:
    """The bytes of the regular file ``path``, read without following a link.

    Raises InvalidArgumentError: a link, not a regular file (a FIFO, a device, ``/proc``'s files of
    unknown size...), larger than ``limit`` bytes, or unreadable.
    """
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW | _CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise InvalidArgumentError(f"{path!r} is a symbolic link; paramstore reads only regular files "
                                       "here (copy the file in)") from None
        raise InvalidArgumentError(f"cannot read {path!r}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InvalidArgumentError(f"{path!r} is not a regular file")
        if st.st_size > limit:
            raise InvalidArgumentError(f"{path!r} is {st.st_size} bytes, more than the {limit} an asset may be")
        data = f.read(limit + 1)
    if len(data) > limit:  # grew while read
        raise InvalidArgumentError(f"{path!r} is more than the {limit} bytes an asset may be")
    return data


def check_own_directory(path: str) -> None:
    """Refuse a directory (``path``, links resolved) owned by another user than this process's: its
    owner could swap or read what is created there. InvalidArgumentError if so."""
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise InvalidArgumentError(f"{path} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()}): "
                                   "export into a directory of your own")
