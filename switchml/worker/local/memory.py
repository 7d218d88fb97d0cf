"""A host's shared memory for the local stage: its layout, its file, and the
operations on it (the reference; ``_memory.c`` is their compiled twin).

One segment per host group, created by the group's first rank as a file in
``/dev/shm`` (mode 0600, sized with ``posix_fallocate`` so that a full
``/dev/shm`` fails here, with a clear error, never later with SIGBUS), renamed
into place once its header is written, mapped by every rank of the group, and
unlinked by the last rank to attach: from then on nothing outlives the job's
processes, whatever ends them.  The name holds the creator's PID, so that a
later job removes what a group that died during attachment left (``sweep``).

Layout: a header (``HEADER_FIELDS``, then one record of ``RECORD_FIELDS`` per
rank), then ``slots`` slots, each holding one input area per rank and one result
area of ``segment`` elements (4 bytes each).  Counters count segments over the
life of the group, so they only grow; a rank publishes one with a release store
and wakes the ranks waiting (a futex on ``generation``).

The operations ``reduce_into``, ``copy_into``, ``publish``, ``wait_for``,
``fail`` and ``attach`` exist twice, here in numpy (the reference, and what
runs without a C compiler) and in ``_memory.c`` under the same names; the
differential tests (tests/test_local.py) hold them equal.
"""

from __future__ import annotations

import errno
import mmap
import os
import select
import struct
import time
import types

import numpy as np

from ...config import LOCAL_SLOTS, pure_python
from ...errors import SwitchMLError

__all__ = ["Layout", "Segment", "reduce_into", "copy_into", "publish", "wait_for", "fail", "attach",
           "read_failure",
           "REACHED", "FAILED", "EXITED", "CLOSED", "TIMED_OUT", "sweep"]

MAGIC = 0x314C4D4C4D575328  # "(SWMLML1" little-endian: a segment of this layout
VERSION = 1
#: The header's fields (magic, version, ranks, shards, slots, segment) and their bytes.
HEADER_FIELDS = "<QIIIIQ"
HEADER_FIELDS_BYTES = struct.calcsize(HEADER_FIELDS)
SHM_DIR = "/dev/shm"
PREFIX = "switchml-"
#: Most ranks a host group holds (a header of one page and a bit).
MAX_RANKS = 256
SLOTS = LOCAL_SLOTS

# Header fields: byte offsets.
H_MAGIC, H_VERSION, H_RANKS, H_SHARDS, H_SLOTS, H_SEGMENT = 0, 8, 12, 16, 20, 24
H_GENERATION, H_WAITERS, H_ATTACHED, H_CLAIM, H_FAILED, H_FAILED_RANK = 32, 36, 40, 44, 48, 52
H_REASON, REASON_BYTES = 64, 256
RECORDS = H_REASON + REASON_BYTES
# A rank's record: byte offsets within it (all 64-bit).
R_PID, R_STATE, R_COPIED_IN, R_REDUCED, R_COPIED_OUT, R_CALL, R_ELEMENTS, R_KIND = \
    0, 8, 16, 24, 32, 40, 48, 56
RECORD_BYTES = 64
#: Record states.
ABSENT, ATTACHED, LEFT = 0, 1, 2
#: What ``wait_for`` returns (with an index: the peer, for EXITED, CLOSED and
#: TIMED_OUT, the first rank short of the target).
REACHED, FAILED, EXITED, CLOSED, TIMED_OUT = 0, 1, 2, 3, 4
#: Failure codes (``fail``): what error the ranks raise.
FAILED_TIMEOUT, FAILED_MISMATCH, FAILED_UNREACHABLE, FAILED_OTHER, FAILED_LIMIT = 1, 2, 3, 4, 5
PAGE = 4096


class Layout:
    """Where everything lies in a segment for ``ranks`` ranks, ``slots`` slots of
    ``segment`` elements."""

    def __init__(self, ranks: int, shards: int, slots: int, segment: int):
        if not 1 <= ranks <= MAX_RANKS:
            raise ValueError(f"a host group holds 1 to {MAX_RANKS} ranks, not {ranks}")
        if segment < 1 or segment % 1024:
            raise ValueError(f"segment must be a positive multiple of 1024 elements, "
                             f"not {segment}")
        if shards < 1 or slots < 1:
            raise ValueError(f"a host group has a shard and a slot at least, not {shards} "
                             f"and {slots}")
        self.ranks, self.shards, self.slots, self.segment = ranks, shards, slots, segment
        self.header_bytes = -(-(RECORDS + ranks * RECORD_BYTES) // PAGE) * PAGE
        self.area_bytes = segment * 4
        self.slot_bytes = (ranks + 1) * self.area_bytes
        self.size = self.header_bytes + slots * self.slot_bytes

    def record(self, index: int, field: int) -> int:
        """Byte offset of ``field`` of rank ``index``'s record."""
        return RECORDS + index * RECORD_BYTES + field

    def input_offset(self, slot: int, index: int) -> int:
        return self.header_bytes + slot * self.slot_bytes + index * self.area_bytes

    def result_offset(self, slot: int) -> int:
        return self.header_bytes + slot * self.slot_bytes + self.ranks * self.area_bytes

    def write_header(self, buf) -> None:
        struct.pack_into(HEADER_FIELDS, buf, 0, MAGIC, VERSION, self.ranks, self.shards,
                         self.slots, self.segment)

    @classmethod
    def read_header(cls, buf) -> Layout:
        magic, version, ranks, shards, slots, segment = struct.unpack_from(HEADER_FIELDS, buf, 0)
        if magic != MAGIC or version != VERSION:
            raise SwitchMLError("the local stage's shared memory has another layout "
                                f"(magic {magic:#x}, version {version}): every rank of a "
                                "host must run the same switchml release")
        try:
            return cls(ranks, shards, slots, segment)
        except ValueError as exc:  # a header no rank writes
            raise SwitchMLError(f"the local stage's shared memory has a header no rank "
                                f"writes: {exc}") from None


# ---------------------------------------------------------------- the operations (reference)
def reduce_into(dst: np.ndarray, srcs, threads: int = 1, kernel: str | None = None) -> None:
    """``dst`` = the sum of ``srcs`` element by element, in their order: float32
    arrays summed in float64 and rounded once, int32 ones modulo 2**32.  The C
    twin cuts the work over up to ``threads`` threads and sums float32 with the
    fastest of its kernels, or ``kernel`` (the same result every way).  ``dst``
    may be one of ``srcs``, or apart from each: a partial overlap is refused."""
    for src in srcs:
        if np.may_share_memory(dst, src) and not (
                src.__array_interface__["data"][0] == dst.__array_interface__["data"][0]
                and src.nbytes == dst.nbytes):
            raise ValueError("reduce_into: the destination overlaps a source without being it")
    if dst.dtype == np.float32:
        acc = srcs[0].astype(np.float64)
        for src in srcs[1:]:
            acc += src
        with np.errstate(over="ignore", invalid="ignore"):
            np.copyto(dst, acc, casting="same_kind")
    else:
        np.copyto(dst, srcs[0])
        for src in srcs[1:]:
            np.add(dst, src, out=dst)  # wraps modulo 2**32


def copy_into(dst: np.ndarray, src: np.ndarray, threads: int = 1) -> None:
    """``dst`` = ``src`` (contiguous, the same size in bytes); the C twin cuts the
    copy over up to ``threads`` threads."""
    if dst.nbytes != src.nbytes:
        raise ValueError("copy_into: the source and destination differ in size")
    np.copyto(dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8))


def _words(header, offset: int, dtype, count: int = 1) -> np.ndarray:
    return np.frombuffer(header, dtype=dtype, count=count, offset=offset)


def publish(header, offset: int, value: int) -> None:
    """Raise the 64-bit counter at ``offset`` to ``value`` (never lower it: a rank's
    counter may be published from two threads, its calls' and its switch worker's)
    and wake the waiting ranks."""
    word = _words(header, offset, np.uint64)
    word[0] = max(int(word[0]), value)
    _words(header, H_GENERATION, np.uint32)[0] += 1


def attach(header) -> int:
    """Count this rank as attached; the number attached now."""
    word = _words(header, H_ATTACHED, np.uint32)
    word[0] += 1
    _words(header, H_GENERATION, np.uint32)[0] += 1
    return int(word[0])


def fail(header, code: int, rank: int, reason: bytes) -> bool:
    """Record the group's failure (the first one only); whether this one is it."""
    claim = _words(header, H_CLAIM, np.uint32)
    if claim[0]:
        return False
    claim[0] = 1
    reason = reason[:REASON_BYTES]
    padded = reason + bytes(REASON_BYTES - len(reason))
    _words(header, H_REASON, np.uint8, REASON_BYTES)[:] = np.frombuffer(padded, np.uint8)
    _words(header, H_FAILED_RANK, np.int32)[0] = rank
    _words(header, H_FAILED, np.uint32)[0] = code
    _words(header, H_GENERATION, np.uint32)[0] += 1
    return True


def read_failure(header) -> tuple[int, int, str] | None:
    """The group's recorded failure, as ``fail`` wrote it: (code, rank, reason), or
    None while there is none."""
    code = int(_words(header, H_FAILED, np.uint32)[0])
    if not code:
        return None
    rank = int(_words(header, H_FAILED_RANK, np.int32)[0])
    raw = _words(header, H_REASON, np.uint8, REASON_BYTES).tobytes()
    return code, rank, raw.rstrip(b"\0").decode(errors="replace")


def wait_for(header, records, field: int, target: int, timeout: float,
             pidfds=()) -> tuple[int, int]:
    """Wait until ``field`` (a 64-bit counter) of every record at ``records`` (byte
    offsets of the awaited ranks' records) is at least ``target``: (REACHED, 0).
    Sooner: (FAILED, 0) when the group failed, (EXITED, i) when the process of
    ``pidfds[i]`` (-1: none to watch) ended, (CLOSED, i) when the rank of
    ``records[i]`` left; after ``timeout`` seconds, (TIMED_OUT, i), i the first
    rank short of the target."""
    deadline = time.monotonic() + timeout
    poll = select.poll()
    for fd in pidfds:
        if fd >= 0:
            poll.register(fd, select.POLLIN)
    fds = list(pidfds)
    pause = 0.00002
    while True:
        if _words(header, H_FAILED, np.uint32)[0]:
            return FAILED, 0
        short = next((i for i, rec in enumerate(records)
                      if _words(header, rec + field, np.uint64)[0] < target), None)
        if short is None:
            return REACHED, 0
        for i, rec in enumerate(records):
            if _words(header, rec + R_STATE, np.uint64)[0] == LEFT:
                return CLOSED, i
        for fd, _ in poll.poll(0):
            return EXITED, fds.index(fd)
        if time.monotonic() >= deadline:
            return TIMED_OUT, short
        time.sleep(pause)
        pause = min(pause * 2, 0.001)


def _compiled():
    if pure_python():
        return None
    try:
        from . import _memory  # type: ignore[attr-defined]  # compiled: no stubs
    except ImportError:  # not built (no C compiler at install): the reference
        return None
    return _memory


#: The reference operations, whatever this process runs (the differential tests).
REFERENCE = types.SimpleNamespace(reduce_into=reduce_into, copy_into=copy_into,
                                  publish=publish, attach=attach, fail=fail,
                                  wait_for=wait_for)
#: The operations this process runs: the C twin where it is built.
OPS = _compiled()
if OPS is not None:
    reduce_into = OPS.reduce_into  # noqa: F811  (the same operation, compiled)
    copy_into = OPS.copy_into  # noqa: F811
    publish = OPS.publish  # noqa: F811
    attach = OPS.attach  # noqa: F811
    fail = OPS.fail  # noqa: F811
    wait_for = OPS.wait_for  # noqa: F811


# ---------------------------------------------------------------- the segment's file
def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep(older_than: float = 60.0) -> list[str]:
    """Remove this user's segment files whose creator is gone (a group that died
    while attaching, every rank at once); the names removed."""
    removed: list[str] = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    now = time.time()
    for name in names:
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        path = os.path.join(SHM_DIR, name)
        try:
            st = os.stat(path)
            if (st.st_uid == os.getuid() and pid.isdigit() and not _pid_alive(int(pid))
                    and now - st.st_mtime > older_than):
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue
    return removed


def segment_name(creator_pid: int, nonce: str, group: int) -> str:
    return f"{PREFIX}{creator_pid}-{nonce}-{group}"


def unlink_segment(name: str) -> None:
    """Remove segment ``name``'s file, whole or still being made (``.partial``):
    for a rank that outlives the segment's creator, whose job on the host is
    over, and which may be the only one left to remove it."""
    path = os.path.join(SHM_DIR, name)
    _unlink(path)
    _unlink(path + ".partial")


class Segment:
    """A mapped segment: ``buf`` (the whole mapping, writable) and ``layout``.

    ``create`` (the group's first rank) or ``open`` (the others) it; ``unlink``
    removes its name (the last to attach does); ``close`` unmaps it once no
    array uses it any longer.
    """

    def __init__(self, name: str, mapping: mmap.mmap, layout: Layout):
        self.name = name
        self.path = os.path.join(SHM_DIR, name)
        self._mapping = mapping
        self.buf = np.frombuffer(mapping, dtype=np.uint8)
        self.layout = layout

    @classmethod
    def create(cls, name: str, layout: Layout) -> Segment:
        """Create, size and map the segment, its header written; the name appears
        only once it is whole.  An error that names the cause (no room in
        /dev/shm, no /dev/shm) otherwise."""
        sweep()
        path = os.path.join(SHM_DIR, name)
        partial = path + ".partial"
        try:
            fd = os.open(partial, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except OSError as exc:
            raise SwitchMLError(f"the local stage cannot create its shared memory "
                                f"{partial}: {exc}; set SWITCHML_LOCAL_STAGE=0 to go "
                                "without it") from None
        try:
            try:
                os.posix_fallocate(fd, 0, layout.size)
            except OSError as exc:
                why = ("no room: enlarge /dev/shm (docker run --shm-size)"
                       if exc.errno == errno.ENOSPC else exc.strerror)
                raise SwitchMLError(
                    f"the local stage needs {layout.size / 2**20:.1f} MiB of shared memory "
                    f"in {SHM_DIR} for {layout.ranks} ranks and cannot have it: {why}; "
                    "set SWITCHML_LOCAL_SEGMENT smaller, or SWITCHML_LOCAL_STAGE=0 to go "
                    "without it") from None
            mapping = mmap.mmap(fd, layout.size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
            layout.write_header(mapping)
            os.rename(partial, path)
        except BaseException:
            _unlink(partial)
            raise
        finally:
            os.close(fd)
        return cls(name, mapping, layout)

    @classmethod
    def open(cls, name: str) -> Segment | None:
        """Map the segment if its name is there (None if not yet)."""
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size < HEADER_FIELDS_BYTES:  # not one of ours (or cut short)
                raise SwitchMLError(f"the local stage's shared memory {path} has {size} "
                                    f"bytes, less than its header")
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        try:
            layout = Layout.read_header(mapping)
        except SwitchMLError:
            mapping.close()
            raise
        if layout.size != size:
            mapping.close()
            raise SwitchMLError(f"the local stage's shared memory {path} has {size} bytes, "
                                f"its header says {layout.size}")
        return cls(name, mapping, layout)

    def unlink(self) -> None:
        _unlink(self.path)

    def view(self, offset: int, count: int, dtype) -> np.ndarray:
        """``count`` elements of ``dtype`` from byte ``offset``."""
        return self.buf[offset:offset + count * np.dtype(dtype).itemsize].view(dtype)

    def close(self) -> None:
        """Unmap; arrays that still view the mapping keep it until they go."""
        self.buf = None  # type: ignore[assignment]
        try:
            self._mapping.close()
        except BufferError:  # a view outlives us: the mapping goes with it
            pass


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
