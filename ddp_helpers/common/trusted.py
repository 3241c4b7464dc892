"""Folders no other user can change: a path judged component by component from the root, and an output folder
opened through it (a directory descriptor) that creates, writes, lists and removes files only inside itself.

Another user who owns a folder on the way to an output, or can write one without the sticky bit, can rename
what is below it and put a link in its place after any check by name: the next write or unlink by name then
lands in a folder of the victim's choosing. So every component is judged (lstat: a link's own owner too, then
its target), and a write goes through descriptors opened one component at a time with O_NOFOLLOW, each judged
by fstat: what was judged is what is written into, whatever is renamed afterwards.
Standard library only: the command line checks its paths with it before torch loads.
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
from typing import Any, BinaryIO, Callable, List, Optional, Tuple

_HOPS = 40  # links followed on one path before giving up (the kernel's own limit, ELOOP)


def _dir_flags() -> int:
    """How a folder on the way is opened: O_PATH where there is one (Linux), so a folder this user may enter but
    not list (mode 0711) is still walked; else O_RDONLY, which needs it readable."""
    return os.O_DIRECTORY | getattr(os, "O_PATH", os.O_RDONLY)


def dir_fds_work() -> bool:
    """Can this platform open, make, stat, read links, rename and unlink relative to a folder's descriptor?
    (Linux and macOS can; Windows can't, and its outputs are judged and written by path.)"""
    needed = (os.open, os.mkdir, os.stat, os.readlink, os.rename, os.unlink)  # os.replace is os.rename's twin
    return all(f in os.supports_dir_fd for f in needed) and hasattr(os, "O_DIRECTORY")


def owner_text(uid: int) -> str:
    """'(uid 65534) named nobody' (the name where this machine knows it)."""
    try:
        import pwd

        return f"(uid {uid}) named {pwd.getpwuid(uid).pw_name}"
    except (ImportError, KeyError):
        return f"(uid {uid})"


def _group_shared(gid: int) -> bool:
    """Could a user other than this one be in group gid: listed as a member, or having it as their primary group?
    (The usual user-private group is not shared.) A group this machine can't look up is shared unless it is this
    user's own primary group."""
    try:
        import grp
        import pwd

        me = pwd.getpwuid(os.getuid()).pw_name
        listed = set(grp.getgrgid(gid).gr_mem) - {me}
        primary = {u.pw_name for u in pwd.getpwall() if u.pw_gid == gid} - {me}
    except (ImportError, KeyError):
        return gid != os.getgid()
    return bool(listed or primary)


def entry_problem(st: os.stat_result, shown: str) -> str:
    """Why another user could change what `shown` (a folder, or a link on the way) leads to ('' if none): its
    owner is another user (root's are the system's), or, a folder, others may write it without the sticky bit."""
    if not hasattr(os, "getuid"):  # Windows: no owners or modes of this kind
        return ""
    if st.st_uid not in (os.getuid(), 0):
        return f"{shown!r} is owned by another user {owner_text(st.st_uid)}"
    mode = stat.S_IMODE(st.st_mode)
    if not stat.S_ISDIR(st.st_mode) or mode & stat.S_ISVTX:
        return ""
    if mode & 0o002:
        return f"{shown!r} is writable by every user (mode {mode:04o}, without the sticky bit)"
    if mode & 0o020 and _group_shared(st.st_gid):
        return f"{shown!r} is writable by its group (gid {st.st_gid}; mode {mode:04o}, without the sticky bit)"
    return ""


def fix_for(problem: str, where: str = "") -> str:
    """What to do about an entry_problem; `where`: the first way out (by default, choosing another folder)."""
    where = where or ("choose a folder this user owns, in folders of this user's or root's only (under the home "
                      "folder, say; a missing one is made by the run)")
    if "owned by another user" in problem:
        return where
    return f"{where}, or have that folder's owner take others' write access away (chmod go-w) or set its sticky " \
           "bit (chmod +t)"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


class UntrustedFolder(PermissionError):
    """A folder on the way to an output that another user owns or can change; `problem` says which and why."""

    def __init__(self, problem: str, what: str = "the folder"):
        self.problem = problem
        super().__init__(f"{what} is not accepted: {problem}: another user could put a link in its place, and "
                         "redirect what is written or removed there; nothing was written. "
                         f"{_sentence(fix_for(problem))}")


def _parts(path: str) -> Tuple[str, List[str]]:
    """An absolute path's root and its components."""
    path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    drive, rest = os.path.splitdrive(path)
    return drive + os.sep, [p for p in rest.split(os.sep) if p]


class _Walk:
    """One walk from the root, by descriptor where the platform allows, by path elsewhere."""

    def __init__(self, root: str, by_fd: bool):
        self.root, self.by_fd = root, by_fd
        self.shown, self.fd = root, None
        if by_fd:
            self.fd = os.open(root, _dir_flags())
        self.judge(os.fstat(self.fd) if by_fd else os.lstat(root), root)

    def judge(self, st: os.stat_result, shown: str) -> None:
        problem = entry_problem(st, shown)
        if problem:
            self.close()
            raise UntrustedFolder(problem)

    def lstat(self, name: str) -> os.stat_result:
        if self.by_fd:
            return os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        return os.lstat(os.path.join(self.shown, name))

    def make(self, name: str) -> None:
        try:  # 0755 less the umask: never writable by others, whatever the umask
            if self.by_fd:
                os.mkdir(name, 0o755, dir_fd=self.fd)
            else:
                os.mkdir(os.path.join(self.shown, name), 0o755)
        except FileExistsError:
            pass  # made meanwhile (by another rank, or another user): judged like any other below

    def enter(self, name: str) -> None:
        shown = os.path.normpath(os.path.join(self.shown, name))
        if not self.by_fd:
            self.judge(os.lstat(shown), shown)
            self.shown = shown
            return
        fd = os.open(name, _dir_flags() | os.O_NOFOLLOW, dir_fd=self.fd)
        os.close(self.fd)
        self.fd, self.shown = fd, shown
        self.judge(os.fstat(fd), shown)  # the folder opened is the one judged, whatever is renamed later

    def restart(self) -> None:
        self.close()
        self.__init__(self.root, self.by_fd)  # type: ignore[misc]

    def readlink(self, name: str) -> str:
        return os.readlink(name, dir_fd=self.fd) if self.by_fd else os.readlink(os.path.join(self.shown, name))

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def walk(path: str, create: bool, by_fd: Optional[bool] = None) -> Tuple[Optional[int], str, bool]:
    """Judge every component of `path` from the root (links followed, each judged itself and its target's
    components too); returns (a descriptor of the folder, or None where by path, its real path, whether it
    exists). A component missing is made (create) or ends the walk. Raises UntrustedFolder, NotADirectoryError."""
    by_fd = dir_fds_work() if by_fd is None else by_fd
    root, todo = _parts(path)
    w = _Walk(root, by_fd)
    hops = 0
    try:
        while todo:
            name = todo.pop(0)
            if name == ".":
                continue
            try:
                st = w.lstat(name)
            except FileNotFoundError:
                if not create:
                    w.close()
                    return None, os.path.join(w.shown, name, *todo), False
                w.make(name)
                st = w.lstat(name)
            shown = os.path.normpath(os.path.join(w.shown, name))
            if stat.S_ISLNK(st.st_mode):
                w.judge(st, shown)  # in a sticky folder, a link of another user's is theirs to replace
                hops += 1
                if hops > _HOPS:
                    raise OSError(errno.ELOOP, f"too many links on the way to {path}")
                target = w.readlink(name)
                if os.path.isabs(target):
                    w.root, more = _parts(target)
                    w.restart()
                else:
                    more = [p for p in target.split(os.sep) if p]
                todo[:0] = more
                continue
            if not stat.S_ISDIR(st.st_mode):
                w.close()
                raise NotADirectoryError(errno.ENOTDIR, f"{shown!r} is a file, not a folder")
            w.enter(name)
    except BaseException:
        w.close()
        raise
    return w.fd, w.shown, True


def path_problem(path: str) -> str:
    """Why another user could change a folder on the way to `path` ('' if none; missing parts are made by the
    run). Judged by path, for the checks made before a run starts."""
    try:
        walk(path, create=False, by_fd=False)
    except UntrustedFolder as e:
        return e.problem
    except OSError:
        return ""  # a file in the way, a folder this user can't enter: the writability checks say so
    return ""


class OutputFolder:
    """A folder to write into, opened through a judged path (made where missing); its files are created, renamed
    and removed relative to it, so a folder renamed or replaced by a link after the check is never written into."""

    def __init__(self, path: str, what: str = "the folder", create: bool = True):
        self.path, self.what = os.path.expanduser(os.fspath(path)), what
        try:
            try:
                self.fd, self.real, found = walk(self.path, create)
            except PermissionError as e:
                if isinstance(e, UntrustedFolder) or hasattr(os, "O_PATH"):
                    raise
                # Without O_PATH (macOS) a folder on the way that may be entered but not listed can't be opened:
                # the path is judged and written by name instead, as on Windows.
                self.fd, self.real, found = walk(self.path, create, by_fd=False)
        except UntrustedFolder as e:
            raise UntrustedFolder(e.problem, what) from None
        if not found:
            raise FileNotFoundError(errno.ENOENT, f"{what} doesn't exist", self.path)

    def __fspath__(self) -> str:
        return self.path  # the path as given: what messages name

    def __enter__(self) -> "OutputFolder":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    def _at(self, name: str) -> Any:
        """The name and keyword that reach `name` inside this folder, whichever way it was opened."""
        return (name, {"dir_fd": self.fd}) if self.fd is not None else (os.path.join(self.real, name), {})

    def names(self) -> List[str]:
        """The names in this folder."""
        if self.fd is None:
            return os.listdir(self.real)
        fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY, dir_fd=self.fd)  # a listable descriptor of this folder
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def is_file(self, name: str) -> bool:
        """Is `name` here a regular file (not a link, not a folder)?"""
        where, kw = self._at(name)
        try:
            return stat.S_ISREG(os.stat(where, follow_symlinks=False, **kw).st_mode)
        except FileNotFoundError:
            return False

    def remove_file(self, name: str) -> bool:
        """Remove `name` if it is a regular file in this folder (a link or a folder is left alone); removed?"""
        if not self.is_file(name):
            return False
        where, kw = self._at(name)
        os.unlink(where, **kw)
        return True

    def write(self, name: str, write: Callable[[BinaryIO], None]) -> str:
        """Call write(fh) on a new temporary file here (O_EXCL, O_NOFOLLOW, an unpredictable name), then rename
        it to `name`: readers see the old file or the whole new one. Returns the path by the name given."""
        return self._replace(name, lambda fd, tmp_path: _write_fd(fd, write))

    def write_by_path(self, name: str, write: Callable[[str], None]) -> str:
        """As write, for a writer that needs a path (a plot's savefig, a decompressor): it gets the temporary
        file's path through this folder's judged real path, which no other user can change."""
        return self._replace(name, lambda fd, tmp_path: (os.close(fd), write(tmp_path)))

    def _replace(self, name: str, fill: Callable[[int, str], Any]) -> str:
        tmp = f".{name}.{secrets.token_hex(8)}.tmp"
        where, kw = self._at(tmp)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
        fd = os.open(where, flags, 0o600, **kw)
        try:
            fill(fd, os.path.join(self.real, tmp))
            if self.fd is not None:
                os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            else:
                os.replace(where, os.path.join(self.real, name))
        except BaseException:
            try:
                os.unlink(where, **kw)  # a failed write (a full disk, an interrupt) leaves no half-written file
            except OSError:
                pass
            raise
        return os.path.join(self.path, name)


def _write_fd(fd: int, write: Callable[[BinaryIO], None]) -> None:
    with os.fdopen(fd, "wb") as fh:
        write(fh)
