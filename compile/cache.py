"""The compile cache: the folder where generated Python and built C libraries are kept.

What is loaded from it runs as this user, so the folder must be private: a predictable name
in a shared temp dir could be created first by someone else, with a module planted under the
hashed name. Every open therefore checks the folder (``os.lstat``: a real folder, not a
symlink, owned by this user, writable by no one else) and every folder above it, following the
symlinks on the way as OpenSSH's StrictModes does (each owned by root or this user, and writable
by no one else unless sticky, as /tmp): an ancestor someone else can write lets them swap the
folder after the check. Files are written to a fresh temp file in the folder and renamed into
place, a file is used only when its content is the one its name promises (the caller compares
it, or keeps a digest beside it), otherwise it is rebuilt, and a file to run is read from one
descriptor opened without following links and checked to be this user's (``open_private``).
"""
from __future__ import annotations

import os
import stat
import tempfile

__all__ = ["CacheDirError", "cache_dir", "write_atomic", "read_or_none", "open_private"]

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
    _check_ancestors(d, parent)  # before creating anything under a folder we could not trust
    if not os.path.isdir(parent):
        old = os.umask(0o022)  # folders we create are not writable by others, whatever umask
        try:
            os.makedirs(parent, mode=0o755, exist_ok=True)
        finally:
            os.umask(old)
        _check_ancestors(d, parent)
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    _check(d)
    return d


def _refuse(d: str, problem: str, fix: str | None = None) -> None:
    fix = fix or f"Remove the folder (rm -rf {d}) to let dtensor create it private (mode 0700)"
    raise CacheDirError(
        f"dtensor.compile: the compile cache folder {d!r} {problem}; code loaded from it "
        f"would run as you, so it is not used. {fix}, or set {ENV} to a folder of your own "
        f"under folders only you (or root) can write.")


def _check_ancestors(d: str, parent: str) -> None:
    """Every folder from / down to ``parent``, and each symlink on the way (resolved by hand,
    so each link and each folder its target passes through is seen), is owned by root or this
    user and writable by no one else unless sticky. A missing tail is fine: it is created."""
    ok_uids = (0, _uid())

    def refuse(problem, fix):
        _refuse(d, problem, fix)

    todo = [c for c in parent.split(os.sep) if c][::-1]  # a stack: next component last
    cur, links = os.sep, 0
    while True:
        st = os.lstat(cur)
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if st.st_uid not in ok_uids:
                refuse(f"is under the symbolic link {cur!r}, owned by uid {st.st_uid} (not "
                       f"root or you), who could point it elsewhere at any time",
                       "Replace the link with one of yours")
            if links > 40:
                refuse(f"is under a loop of symbolic links at {cur!r}", "Fix the links")
            target = os.readlink(cur)
            todo += [c for c in target.split(os.sep) if c][::-1]
            cur = os.sep if os.path.isabs(target) else os.path.dirname(cur)
            continue
        if not stat.S_ISDIR(st.st_mode):
            refuse(f"is under {cur!r}, which is not a folder", f"Move {cur!r} away")
        if st.st_uid not in ok_uids:
            refuse(f"is under the folder {cur!r}, owned by uid {st.st_uid} (not root or you), "
                   f"who could put another folder in its place", "Use another location")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
            refuse(f"is under the folder {cur!r}, writable by its group or by others without "
                   f"the sticky bit (mode {stat.S_IMODE(st.st_mode):04o}), so they could rename "
                   f"the cache folder and put theirs in its place",
                   f"Run chmod go-w {cur} (or chmod +t, as /tmp)")
        while todo and todo[-1] in (".", ".."):
            if todo.pop() == "..":
                cur = os.path.dirname(cur)
        if not todo:
            return
        nxt = os.path.join(cur, todo.pop())
        if not os.path.lexists(nxt):
            return
        cur = nxt


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
        _refuse(d, f"is {problem}")
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


def open_private(path: str) -> tuple[int, bytes] | None:
    """A descriptor on the regular file at ``path`` and its bytes, read from that descriptor,
    or None if it is absent, a symlink (O_NOFOLLOW), not a regular file, or not private (owned
    by someone else, or writable by its group or others: it may have been planted). Whoever
    loads the file through the descriptor (``/proc/self/fd/N``) runs the bytes checked here
    even if the name is swapped meanwhile; the caller closes it."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:  # absent, or a symlink (ELOOP)
        return None
    try:
        st = os.fstat(fd)
        if (not stat.S_ISREG(st.st_mode) or st.st_uid != _uid()
                or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)):
            os.close(fd)
            return None
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        os.lseek(fd, 0, os.SEEK_SET)
        return fd, b"".join(chunks)
    except BaseException:
        os.close(fd)
        raise
