"""POSIX shared-memory segments for the slot windows (paper §6.1, §6.3).

Both the ``host`` and the ``ipc`` transport keep their flag pages (``flags``) in these
segments; ``host`` keeps its slots there too.

``ShmSegment`` is a file ``/dev/shm/sparsp-<tag>-<rank>`` created with
``O_CREAT | O_EXCL`` and mode 0600, mapped with ``mmap`` and exposed as a ``torch.uint8``
tensor. ``multiprocessing.shared_memory`` is deliberately not used: its resource tracker
unlinks segments it believes leaked (and warns) behind our back, including segments that a
peer still has to open. Lifecycle:

- the group agrees on a tag (``agree_tag``: rank 0 draws one and broadcasts it, or the user
  passes a name, or ``SPARSP_SHM_TAG``); each rank creates its segment, the group passes a
  barrier, every rank opens its peers' segments read/write, a second barrier, and the owner
  unlinks the name at once: the mappings stay valid, and a crash after that leaves nothing;
- until then the name is unlinked by ``close()``, by a ``weakref.finalize`` that also runs at
  interpreter exit (normal exit and exit through an exception), and never twice (the
  finalizer checks the inode, so it cannot remove a newer file that reuses the name);
- a segment left by a crash during that short window is cleaned at the next start: the
  4 KiB header records the creator (pid, process start time, pid namespace, boot id);
  ``create`` reclaims a same-named segment whose creator is gone and refuses one whose creator
  still runs, and ``sweep_stale`` removes any ``sparsp-*`` segment of this user whose creator
  is gone.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import re
import secrets
import stat
import struct
import time
import weakref

import numpy as np
import torch
import torch.distributed as dist

from .. import env

SHM_DIR = "/dev/shm"
PREFIX = "sparsp-"
HEADER_BYTES = 4096  # one page: the payload that follows stays page aligned
PAGE = 4096
_MAGIC = b"SPARSP01"
# magic, creator pid, creator start time (clock ticks since boot), pid namespace inode,
# boot id, segment size
_HEADER = struct.Struct("<8sqQQ16sQ")
_TAG_RE = re.compile(r"[A-Za-z0-9_.]{1,64}")
_ORPHAN_AGE_S = 600.0  # a header-less sparsp-* file older than this is a crashed create


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def segment_name(tag: str, rank: int) -> str:
    return f"{PREFIX}{tag}-{rank}"


# --------------------------------------------------------------------------- owner identity


@dataclasses.dataclass(frozen=True, slots=True)
class _Identity:
    pid: int
    start: int
    pidns: int
    boot: bytes


_IDENTITY: _Identity | None = None


def _start_time(pid: int) -> int | None:
    """Start time of ``pid`` (field 22 of /proc/<pid>/stat), None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after the last ')'
    fields = raw[raw.rfind(b")") + 2 :].split()
    return int(fields[19])


def _identity() -> _Identity:
    global _IDENTITY
    pid = os.getpid()
    if _IDENTITY is None or _IDENTITY.pid != pid:
        try:
            pidns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            pidns = 0
        try:
            with open("/proc/sys/kernel/random/boot_id") as f:
                boot = bytes.fromhex(f.read().strip().replace("-", ""))[:16]
        except (OSError, ValueError):
            boot = bytes(16)
        _IDENTITY = _Identity(pid, _start_time(pid) or 0, pidns, boot)
    return _IDENTITY


def _owner_alive(raw: bytes) -> bool | None:
    """True/False when the header names a live/gone creator, None without a valid header."""
    if len(raw) < _HEADER.size:
        return None
    magic, pid, start, pidns, boot, _size = _HEADER.unpack_from(raw)
    if magic != _MAGIC:
        return None
    me = _identity()
    if boot != me.boot:
        return False  # created before the last reboot
    if pidns != me.pidns:
        return True  # another pid namespace: its pids mean nothing here, leave it alone
    return _start_time(pid) == start  # a reused pid has another start time


def _unlink_if_same(path: str, dev: int, ino: int) -> None:
    """Unlink ``path`` only if it is still the file we created (not a newer one)."""
    try:
        st = os.stat(path, follow_symlinks=False)
        if (st.st_dev, st.st_ino) == (dev, ino):
            os.unlink(path)
    except FileNotFoundError:
        pass


def _reclaim(path: str) -> None:
    """Remove a same-named segment left by a crashed run; refuse one whose creator is alive."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return
    try:
        st = os.fstat(fd)
        raw = os.pread(fd, _HEADER.size, 0)
    finally:
        os.close(fd)
    if st.st_uid != os.getuid():
        raise FileExistsError(f"{path} exists and belongs to uid {st.st_uid}; use another tag")
    if _owner_alive(raw):
        pid = _HEADER.unpack_from(raw)[1]
        raise FileExistsError(
            f"{path} is in use by the live process {pid}; give this group another tag")
    _unlink_if_same(path, st.st_dev, st.st_ino)


def sweep_stale(directory: str = SHM_DIR) -> list[str]:
    """Unlink this user's ``sparsp-*`` segments whose creating process is gone.

    Safe to run from every rank at once. Segments of live processes, of other users and of
    other pid namespaces are left alone. Returns the removed names.
    """
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue
            fd = os.open(entry.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                raw = os.pread(fd, _HEADER.size, 0)
            finally:
                os.close(fd)
            alive = _owner_alive(raw)
            if alive is None:
                # no header yet: either a create in progress or one that crashed long ago
                alive = time.time() - st.st_mtime < _ORPHAN_AGE_S
            if not alive:
                _unlink_if_same(entry.path, st.st_dev, st.st_ino)
                removed.append(entry.name)
        except OSError:
            continue  # raced with its owner or another sweeper
    return removed


# --------------------------------------------------------------------------- segments


class ShmSegment:
    """One mapped shared-memory segment: ``tensor`` (uint8) covers it all, header included."""

    def __init__(self, path: str, fd: int, size: int, owner: bool) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self.size = size
        self.owner = owner
        self._fd = fd
        self._mm = mmap.mmap(fd, size)  # MAP_SHARED, read/write
        self.tensor = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.ptr = self.tensor.data_ptr()
        st = os.fstat(fd)
        self._finalizer = None
        if owner:
            self._finalizer = weakref.finalize(self, _unlink_if_same, path, st.st_dev, st.st_ino)

    @classmethod
    def create(cls, tag: str, rank: int, size: int, directory: str = SHM_DIR) -> ShmSegment:
        """Create ``sparsp-<tag>-<rank>`` (0600, exclusive), reclaiming a crashed run's leftover.

        Its pages are allocated here, on the NUMA node this thread runs on."""
        if not _TAG_RE.fullmatch(tag):
            raise ValueError(f"shared-memory tag {tag!r} must match {_TAG_RE.pattern}")
        size = round_up(max(size, HEADER_BYTES), PAGE)
        path = os.path.join(directory, segment_name(tag, rank))
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(path, flags, 0o600)
        except FileExistsError:
            _reclaim(path)
            fd = os.open(path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # the umask can only clear bits; say it anyway
            # allocate now: a tmpfs that is too small fails here with ENOSPC instead of
            # killing the process with SIGBUS on first touch of the mapping
            os.posix_fallocate(fd, 0, size)
            seg = cls(path, fd, size, owner=True)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        me = _identity()
        # magic last: a reader that sees it sees a complete header
        _HEADER.pack_into(seg._mm, 0, b"\0" * 8, me.pid, me.start, me.pidns, me.boot, size)
        seg._mm[0:8] = _MAGIC
        return seg

    @classmethod
    def open(cls, tag: str, rank: int, size: int | None = None,
             directory: str = SHM_DIR) -> ShmSegment:
        """Map a peer's segment read/write (after the group barrier that follows creation)."""
        path = os.path.join(directory, segment_name(tag, rank))
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            actual = os.fstat(fd).st_size
            if size is not None and actual != round_up(max(size, HEADER_BYTES), PAGE):
                raise RuntimeError(f"{path}: size {actual}, expected {size}")
            seg = cls(path, fd, actual, owner=False)
        except BaseException:
            os.close(fd)
            raise
        if bytes(seg._mm[0:8]) != _MAGIC:
            seg.close()
            raise RuntimeError(f"{path} is not a sparsp segment (no header)")
        return seg

    def view(self, offset: int, nbytes: int) -> torch.Tensor:
        return self.tensor[offset : offset + nbytes]

    def words(self, offset: int, count: int) -> np.ndarray:
        """uint32 view (flags): numpy scalar loads/stores are single aligned 32-bit accesses."""
        return np.frombuffer(self._mm, dtype=np.uint32, count=count, offset=offset)

    def fstat(self) -> os.stat_result:
        return os.fstat(self._fd)

    def unlink(self) -> None:
        """Remove the name (owner only); the mapping stays valid for everyone who has it."""
        if self._finalizer is not None:
            self._finalizer()  # runs at most once, then detaches

    def close(self) -> None:
        self.unlink()
        self.tensor = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        try:
            self._mm.close()
        except BufferError:
            pass  # views handed out are still alive: the mapping goes with the last of them


def agree_tag(group, tag: str | None = None, device=None) -> str:
    """The segment-name tag every rank of ``group`` uses: user-given, ``SPARSP_SHM_TAG``, or drawn.

    A drawn tag (uid, pid of rank 0, random token) is new for every transport, so two jobs or
    two transports never collide; a given tag makes names stable across restarts, so that
    ``ShmSegment.create`` finds and reclaims what a crashed run left.
    """
    explicit = tag if tag is not None else env.shm_tag()
    if explicit is not None and not _TAG_RE.fullmatch(explicit):
        raise ValueError(f"shared-memory tag {explicit!r} must match {_TAG_RE.pattern}")
    if dist.get_world_size(group) == 1:
        return explicit or f"{os.getuid()}.{os.getpid()}.{secrets.token_hex(4)}"
    rank = dist.get_rank(group)
    mine = explicit or f"{os.getuid()}.{os.getpid()}.{secrets.token_hex(4)}"
    box = [mine if rank == 0 else None]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group, device=device)
    if explicit is not None and box[0] != explicit:
        raise ValueError(f"rank {rank}: shared-memory tag {explicit!r} differs from rank 0's "
                         f"{box[0]!r}; every rank must pass the same tag")
    return box[0]
