"""The compile cache: the folder where generated Python and built C libraries are kept.

What is loaded from it runs as this user, so the folder must be private: a predictable name
in a shared temp dir could be created first by someone else, with a module planted under the
hashed name. Every open therefore checks the folder (``os.lstat``: a real folder, not a
symlink, owned by this user, writable by no one else), files are written to a fresh temp file
in the folder and renamed into place, and a file is used only when its content is the one its
name promises (the caller compares it, or keeps a digest beside it); otherwise it is rebuilt.
"""
from __future__ import annotations

import os
import stat
import tempfile

__all__ = ["CacheDirError", "cache_dir", "write_atomic", "read_or_none"]

ENV = "DTENSOR_COMPILE_CACHE"


class CacheDirError(PermissionError):
    """The compile cache folder is not private to this user."""


def _default() -> str:
    return os.path.join(tempfile.gettempdir(), f"dtensor-compile-{_uid()}")


def _uid() -> int:
    return os.getuid() if hasattr(os, "getuid") else 0


def cache_dir() -> str:
    """The cache folder (``$DTENSOR_COMPILE_CACHE``, else ``dtensor-compile-<uid>`` in the temp
    dir), created private (0700) if missing and checked on every call."""
    d = os.path.abspath(os.environ.get(ENV) or _default())
    parent = os.path.dirname(d)
    if not os.path.isdir(parent):
        os.makedirs(parent, exist_ok=True)
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    _check(d)
    return d


def _check(d: str) -> None:
    st = os.lstat(d)
    problem = None
    if stat.S_ISLNK(st.st_mode):
        problem = f"a symbolic link (to {os.path.realpath(d)!r})"
    elif not stat.S_ISDIR(st.st_mode):
        problem = "not a folder"
    elif hasattr(os, "getuid") and st.st_uid != os.getuid():
        problem = f"owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    elif st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        problem = (f"writable by its group or by others (mode {stat.S_IMODE(st.st_mode):04o}), "
                   f"so what is in it may have been planted")
    if problem:
        raise CacheDirError(
            f"dtensor.compile: the compile cache folder {d!r} is {problem}; code loaded from it "
            f"would run as you, so it is not used. Remove the folder (rm -rf {d}) to let "
            f"dtensor create it private (mode 0700), or set {ENV} to a folder of your own.")
    if st.st_mode & 0o077:  # ours and written by no one else: only readable, so close it
        os.chmod(d, 0o700)


def write_atomic(path: str, data: bytes) -> None:
    """Write ``data`` to ``path`` through a fresh temp file in its folder (O_EXCL, mode 0600)
    renamed into place: a reader sees the old file or the whole new one, never a half."""
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_or_none(path: str) -> bytes | None:
    """The bytes of a regular file at ``path`` (a symlink or anything else counts as absent)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    with open(path, "rb") as f:
        return f.read()
