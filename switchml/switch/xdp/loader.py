"""The XDP program's toolchain and loader: ``build_object`` compiles
``pipeline.bpf.c`` with clang into a cache, ``Program`` loads it with libbpf
(``libbpf.so.1``, through ctypes: no Python dependency), reads and writes its
maps, attaches its two programs to an interface (the pipeline to XDP, the
fan-out of results to TC ingress) and runs the pipeline with BPF_PROG_TEST_RUN;
``build_dispatcher`` builds the dispatcher (``dispatch.bpf.c``) through which
the XDP switches on one interface take their datagrams (``dispatch.py`` shares
it); ``unavailable()`` says what is missing where it cannot run.
``xdp/pipeline.py`` is the pipeline that drives it."""

from __future__ import annotations

import ctypes
import hashlib
import os
import pathlib
import re
import shutil
import socket
import struct
import subprocess
import sys
import tempfile

HERE = pathlib.Path(__file__).resolve().parent
SOURCE = HERE / "pipeline.bpf.c"
WIRE_H = HERE.parent.parent / "wire.h"
CFLAGS = ["-O2", "-g", "-target", "bpf", "-mcpu=v3", "-Wall", "-Werror"]
PROGRAM = "xdp_pipeline"
#: the TC program that sends each completed result to every rank
FAN_OUT_PROGRAM = "fan_out_results"
#: the XDP program that several switches on one interface share
DISPATCH_SOURCE = HERE / "dispatch.bpf.c"
DISPATCH_PROGRAM = "switchml_dispatch"


# ---------------------------------------------------------------- the toolchain
def _include_dirs() -> list[str]:
    """<asm/types.h>, which <linux/bpf.h> includes, lives in the host's multiarch
    directory, which clang does not search for -target bpf."""
    return [str(p.parent.parent) for p in pathlib.Path("/usr/include").glob("*/asm/types.h")]


def _has_bpf_capability() -> bool:
    """CAP_SYS_ADMIN, or CAP_BPF and CAP_NET_ADMIN (an XDP program): the effective
    set, not the uid, as a container's root may lack them."""
    try:
        status = pathlib.Path("/proc/self/status").read_text()
    except OSError:
        return os.geteuid() == 0
    found = re.search(r"CapEff:\s*([0-9a-f]+)", status)
    if found is None:
        return os.geteuid() == 0
    caps = int(found.group(1), 16)
    return bool(caps >> 21 & 1 or (caps >> 39 & 1 and caps >> 12 & 1))


def unavailable() -> str | None:
    """Why the XDP data plane cannot run here, or None when it can."""
    if not sys.platform.startswith("linux"):
        return "XDP needs Linux"
    if shutil.which("clang") is None:
        return "no clang to build the XDP program (make test installs clang, llvm, libbpf-dev " \
               "as root)"
    if not pathlib.Path("/usr/include/linux/bpf.h").exists() or not _include_dirs():
        return "no kernel headers (<linux/bpf.h>, <asm/types.h>: linux-libc-dev)"
    if not pathlib.Path("/usr/include/bpf/bpf_helpers.h").exists():
        return "no libbpf headers (<bpf/bpf_helpers.h>: libbpf-dev)"
    try:
        libbpf()
    except OSError as exc:
        return f"no libbpf.so.1: {exc}"
    if not _has_bpf_capability():
        return "loading an XDP program needs root (CAP_BPF and CAP_NET_ADMIN)"
    return None


def _cache_dir() -> pathlib.Path:
    given = os.environ.get("SWITCHML_XDP_CACHE")
    if given:
        return pathlib.Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return pathlib.Path(base) / "switchml" / "xdp"


def build_object(values: int) -> pathlib.Path:
    """The compiled program whose rows hold ``values`` values (a multiple of 8),
    built by clang on first use into the cache."""
    return _build(SOURCE, f"xdp_pipeline-{values}", [f"-DXDP_MAX_VALUES={values}"],
                  (SOURCE, WIRE_H))


def build_dispatcher() -> pathlib.Path:
    """The compiled dispatcher (``dispatch.bpf.c``), built on first use."""
    return _build(DISPATCH_SOURCE, "xdp_dispatch", [], (DISPATCH_SOURCE,))


def _build(source: pathlib.Path, stem: str, defines: list[str],
           inputs: tuple[pathlib.Path, ...]) -> pathlib.Path:
    """``source`` compiled with ``defines`` into the cache, named by a hash of
    ``inputs``, clang's version and the flags: built once."""
    clang = shutil.which("clang")
    if clang is None:
        raise RuntimeError(unavailable() or "no clang")
    version = subprocess.run([clang, "--version"], capture_output=True, text=True,
                             check=True).stdout
    flags = CFLAGS + defines + [f"-I{d}" for d in _include_dirs()]
    digest = hashlib.sha256()
    for part in [p.read_bytes() for p in inputs] + [version.encode(), " ".join(flags).encode()]:
        digest.update(part)
        digest.update(b"\0")
    cache = _cache_dir()
    target = cache / f"{stem}-{digest.hexdigest()[:16]}.o"
    if _whole_object(target):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=cache, suffix=".o.tmp")
    os.close(fd)
    try:
        done = subprocess.run([clang, *flags, "-c", str(source), "-o", tmp],
                              capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"clang failed on {source.name}:\n{done.stderr}")
        with open(tmp, "rb") as built:  # on disk before its name: a crash leaves no
            os.fsync(built.fileno())    # empty object under it
        os.replace(tmp, target)  # atomic: a concurrent build finds a whole object
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _whole_object(path: pathlib.Path) -> bool:
    """Whether ``path`` is a whole 64-bit ELF object (its section headers, which
    clang writes last, within the file): a cached one cut short or overwritten
    (a crash, a full disk) is built again, not loaded and refused."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            size = os.fstat(f.fileno()).st_size
    except OSError:
        return False
    if len(head) < 64 or head[:5] != b"\x7fELF\x02":
        return False
    shoff, = struct.unpack_from("<Q", head, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
    return 0 < shoff and shoff + shentsize * shnum <= size


# ---------------------------------------------------------------- libbpf
class TestRunOpts(ctypes.Structure):
    """struct bpf_test_run_opts (libbpf's bpf.h)."""

    _fields_ = [("sz", ctypes.c_size_t), ("data_in", ctypes.c_void_p),
                ("data_out", ctypes.c_void_p), ("data_size_in", ctypes.c_uint32),
                ("data_size_out", ctypes.c_uint32), ("ctx_in", ctypes.c_void_p),
                ("ctx_out", ctypes.c_void_p), ("ctx_size_in", ctypes.c_uint32),
                ("ctx_size_out", ctypes.c_uint32), ("retval", ctypes.c_uint32),
                ("repeat", ctypes.c_int), ("duration", ctypes.c_uint32),
                ("flags", ctypes.c_uint32), ("cpu", ctypes.c_uint32),
                ("batch_size", ctypes.c_uint32)]


class _LinkCreateOpts(ctypes.Structure):
    """The head of struct bpf_link_create_opts (libbpf's bpf.h): ``sz`` tells
    libbpf that the fields past ``flags`` are not given."""

    _fields_ = [("sz", ctypes.c_size_t), ("flags", ctypes.c_uint32)]


#: enum bpf_attach_type's BPF_XDP and BPF_TCX_INGRESS (kernel 6.6; the uapi
#: headers of older distributions lack it); if_link.h's XDP_FLAGS_SKB_MODE
BPF_XDP = 37
BPF_TCX_INGRESS = 46
XDP_FLAGS_SKB_MODE = 1 << 1
#: if_link.h's XDP_FLAGS_DRV_MODE: the driver's own XDP hook
XDP_FLAGS_DRV_MODE = 1 << 2
#: bpf.h's BPF_F_LOCK: a map element's copy in or out under its bpf_spin_lock
BPF_F_LOCK = 4

_LIBBPF: ctypes.CDLL | None = None


def libbpf() -> ctypes.CDLL:
    global _LIBBPF
    if _LIBBPF is not None:
        return _LIBBPF
    lib = ctypes.CDLL("libbpf.so.1", use_errno=True)
    vp, cp, u32, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_uint32, ctypes.c_int
    for name, res, args in [
        ("bpf_object__open_file", vp, [cp, vp]),
        ("bpf_object__find_map_by_name", vp, [vp, cp]),
        ("bpf_object__find_program_by_name", vp, [vp, cp]),
        ("bpf_map__set_max_entries", i, [vp, u32]),
        ("bpf_map__fd", i, [vp]),
        ("bpf_program__fd", i, [vp]),
        ("bpf_program__set_log_buf", i, [vp, vp, ctypes.c_size_t]),
        ("bpf_program__set_log_level", i, [vp, u32]),
        ("bpf_object__load", i, [vp]),
        ("bpf_object__close", None, [vp]),
        ("bpf_map_update_elem", i, [i, vp, vp, ctypes.c_uint64]),
        ("bpf_map_lookup_elem", i, [i, vp, vp]),
        ("bpf_map_lookup_elem_flags", i, [i, vp, vp, ctypes.c_uint64]),
        ("bpf_map_delete_elem", i, [i, vp]),
        ("bpf_prog_test_run_opts", i, [i, vp]),
        ("libbpf_num_possible_cpus", i, []),
        ("bpf_link_create", i, [i, i, i, vp]),
        ("bpf_map_get_next_key", i, [i, vp, vp]),
        ("bpf_obj_get_info_by_fd", i, [i, vp, ctypes.POINTER(u32)]),
        ("bpf_prog_get_fd_by_id", i, [u32]),
        ("bpf_map_get_fd_by_id", i, [u32]),
        ("bpf_link_get_fd_by_id", i, [u32]),
        ("bpf_link_get_next_id", i, [u32, ctypes.POINTER(u32)]),
        ("bpf_xdp_query", i, [i, i, vp]),
        ("bpf_enable_stats", i, [i]),
        ("bpf_prog_query", i, [i, i, u32, vp, vp, ctypes.POINTER(u32)]),
    ]:
        fn = getattr(lib, name)
        fn.restype = res
        fn.argtypes = args
    _LIBBPF = lib
    return lib


#: where struct bpf_prog_info (linux/bpf.h) keeps run_time_ns and run_cnt, and its
#: size up to them; enum bpf_stats_type's BPF_STATS_RUN_TIME
_INFO_RUN_TIME_NS, _INFO_SIZE = 192, 208
BPF_STATS_RUN_TIME = 0


def count_run_time() -> int:
    """Turn on the kernel's count of every BPF program's runs and their time (two
    reads of the clock a run) while the returned fd is open: BPF_ENABLE_STATS,
    which, unlike the ``kernel.bpf_stats_enabled`` setting, stays on behind no
    process that died."""
    fd = libbpf().bpf_enable_stats(BPF_STATS_RUN_TIME)
    _check(fd, "turning on BPF run-time statistics")
    return fd


def run_time_counted_always() -> bool:
    """Whether the ``kernel.bpf_stats_enabled`` setting keeps run-time statistics
    on (then they count whether or not ``count_run_time`` asked)."""
    try:
        with open("/proc/sys/kernel/bpf_stats_enabled") as f:
            return f.read().strip() != "0"
    except OSError:
        return False


def run_time(prog_fd: int) -> tuple[int, int]:
    """(nanoseconds, runs) the kernel has counted for a program so far: it counts
    while run-time statistics are on (``count_run_time``)."""
    info = _info(prog_fd, ctypes.create_string_buffer(_INFO_SIZE))
    ns, runs = struct.unpack_from("=QQ", info.raw, _INFO_RUN_TIME_NS)
    return ns, runs


def _link_xdp(prog_fd: int, ifindex: int, flags: int) -> int:
    """A BPF link attaching XDP program ``prog_fd`` to interface ``ifindex`` in the
    mode of ``flags``: its fd, or minus the error (EBUSY: one is there)."""
    opts = _LinkCreateOpts(sz=ctypes.sizeof(_LinkCreateOpts), flags=flags)
    return libbpf().bpf_link_create(prog_fd, ifindex, BPF_XDP, ctypes.byref(opts))


def _check(rc: int, what: str) -> None:
    if rc < 0:
        raise OSError(-rc, f"{what}: {os.strerror(-rc)}")


class _Refused(OSError):
    """The kernel refused the program (the verifier's log is in the message)."""


def load(path: pathlib.Path, max_entries: dict[str, int]) -> Program:
    """Load the program; when the verifier refuses it, load it again with the
    verifier's whole log (level 1, slower) to say why."""
    try:
        return Program(path, max_entries)
    except _Refused:
        return Program(path, max_entries, log_level=1, log_size=1 << 26)


class Program:
    """The loaded object: its maps by name, its program, BPF_PROG_TEST_RUN."""

    def __init__(self, path: pathlib.Path, max_entries: dict[str, int], log_level: int = 4,
                 log_size: int = 1 << 16):
        lib = libbpf()
        self._lib = lib
        self._obj = lib.bpf_object__open_file(str(path).encode(), None)
        if not self._obj:
            err = ctypes.get_errno()
            raise OSError(err, f"libbpf could not open {path}: {os.strerror(err)}")
        try:
            for name, entries in max_entries.items():
                _check(lib.bpf_map__set_max_entries(self._map(name), entries),
                       f"max_entries of {name}")
            progs = {name: lib.bpf_object__find_program_by_name(self._obj, name.encode())
                     for name in (PROGRAM, FAN_OUT_PROGRAM)}
            # log level 4: the verifier's statistics alone; on a refusal, the load
            # is tried again with the whole log, which is what the error shows
            self._logs = {name: ctypes.create_string_buffer(log_size) for name in progs}
            for name, prog in progs.items():
                lib.bpf_program__set_log_buf(prog, self._logs[name], len(self._logs[name]))
                lib.bpf_program__set_log_level(prog, log_level)
            rc = lib.bpf_object__load(self._obj)
            if rc < 0:
                log = "\n".join(f"{name}: {buf.value.decode(errors='replace')[-6000:]}"
                                for name, buf in self._logs.items() if buf.value)
                raise _Refused(-rc, f"the kernel refused {path.name}: {os.strerror(-rc)}; "
                               f"the verifier's log ends:\n{log}")
            self.verifier_stats = self._logs[PROGRAM].value.decode(errors="replace").strip()
            self.prog_fd = lib.bpf_program__fd(progs[PROGRAM])
            self.fan_out_fd = lib.bpf_program__fd(progs[FAN_OUT_PROGRAM])
            #: the kernel's ids of the two programs (what a dispatcher records:
            #: the fan-out program, which only this object holds, tells that the
            #: switch is there)
            self.prog_id = prog_info(self.prog_fd).id
            self.fan_out_id = prog_info(self.fan_out_fd).id
            self.fds = {name: lib.bpf_map__fd(self._map(name)) for name in
                        ("config", "members", "rank_addresses", "jobs", "mismatches", "sets",
                         "rows", "counts", "ports")}
            self.cpus = lib.libbpf_num_possible_cpus()
            _check(self.cpus, "libbpf_num_possible_cpus")
        except BaseException:
            self.close()
            raise

    def _map(self, name: str):
        found = self._lib.bpf_object__find_map_by_name(self._obj, name.encode())
        if not found:
            raise RuntimeError(f"{SOURCE.name} has no map {name}")
        return found

    def close(self) -> None:
        if self._obj:
            self._lib.bpf_object__close(self._obj)
            self._obj = None

    def run_times(self) -> dict[str, tuple[int, int]]:
        """(nanoseconds, runs) of each of the object's programs (``run_time``)."""
        return {PROGRAM: run_time(self.prog_fd), FAN_OUT_PROGRAM: run_time(self.fan_out_fd)}

    def update(self, name: str, key, value, locked: bool = False) -> None:
        """``locked``: a value that holds a bpf_spin_lock is written under that
        lock (BPF_F_LOCK), so that the program's locked sections see it whole
        or not yet."""
        _check(self._lib.bpf_map_update_elem(self.fds[name], ctypes.byref(key),
                                             ctypes.byref(value),
                                             BPF_F_LOCK if locked else 0), f"update {name}")

    def lookup(self, name: str, key, value, locked: bool = False):
        """``locked``: such a value is read under its lock (BPF_F_LOCK)."""
        _check(self._lib.bpf_map_lookup_elem_flags(self.fds[name], ctypes.byref(key),
                                                   ctypes.byref(value),
                                                   BPF_F_LOCK if locked else 0),
               f"lookup {name}")
        return value

    def delete(self, name: str, key) -> None:
        self._lib.bpf_map_delete_elem(self.fds[name], ctypes.byref(key))

    def attach(self, ifindex: int, driver: bool = False) -> int:
        """Attach the program to interface ``ifindex`` in generic (skb) mode, which
        every driver has (veth, lo...), or with ``driver`` in the driver's own
        (native) mode, where the driver supports XDP (veth, most NICs; not a
        bridge), through a BPF link: the link's fd, whose close detaches it, also
        when the process dies (nothing stays attached behind a crashed switch,
        unlike a netlink attach)."""
        fd = _link_xdp(self.prog_fd, ifindex, XDP_FLAGS_DRV_MODE if driver else
                       XDP_FLAGS_SKB_MODE)
        _check(fd, f"attaching the XDP program to interface {ifindex}")
        return fd

    def attach_fan_out(self, ifindex: int) -> int:
        """Attach the fan-out program to the TC ingress of interface ``ifindex``
        (tcx, kernel 6.6), through a BPF link as ``attach``: the link's fd."""
        opts = _LinkCreateOpts(sz=ctypes.sizeof(_LinkCreateOpts), flags=0)
        fd = self._lib.bpf_link_create(self.fan_out_fd, ifindex, BPF_TCX_INGRESS,
                                       ctypes.byref(opts))
        _check(fd, f"attaching the fan-out program to the TC ingress of interface {ifindex}")
        return fd

    def test_run(self, frame: bytes, room: int = 0) -> tuple[int, bytes]:
        """Run the program once on ``frame``: (its XDP action, the frame it left,
        of at most ``room`` bytes or the frame's length and a page)."""
        return run_xdp(self.prog_fd, frame, room)


def run_xdp(prog_fd: int, frame: bytes, room: int = 0) -> tuple[int, bytes]:
    """Run XDP program ``prog_fd`` once on ``frame`` (BPF_PROG_TEST_RUN): its
    action and the frame it left, of at most ``room`` bytes or the frame's
    length and a page."""
    data_in = ctypes.create_string_buffer(bytes(frame), len(frame))
    data_out = ctypes.create_string_buffer(max(room, len(frame) + 4096))
    opts = test_run_opts(data_in, data_out)
    _check(libbpf().bpf_prog_test_run_opts(prog_fd, ctypes.byref(opts)), "BPF_PROG_TEST_RUN")
    return opts.retval, data_out.raw[: opts.data_size_out]


def test_run_opts(data_in, data_out) -> TestRunOpts:
    """BPF_PROG_TEST_RUN's options for one run on the frame in buffer ``data_in``
    (all of it), the frame it leaves into buffer ``data_out`` (at most all of it)."""
    return TestRunOpts(sz=ctypes.sizeof(TestRunOpts),
                       data_in=ctypes.cast(data_in, ctypes.c_void_p),
                       data_out=ctypes.cast(data_out, ctypes.c_void_p),
                       data_size_in=len(data_in), data_size_out=len(data_out), repeat=1)


# ---------------------------------------------------------------- sharing an interface
class _ProgInfo(ctypes.Structure):
    """The head of struct bpf_prog_info (linux/bpf.h), up to its name."""

    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32),
                ("tag", ctypes.c_uint8 * 8), ("jited_prog_len", ctypes.c_uint32),
                ("xlated_prog_len", ctypes.c_uint32), ("jited_prog_insns", ctypes.c_uint64),
                ("xlated_prog_insns", ctypes.c_uint64), ("load_time", ctypes.c_uint64),
                ("created_by_uid", ctypes.c_uint32), ("nr_map_ids", ctypes.c_uint32),
                ("map_ids", ctypes.c_uint64), ("name", ctypes.c_char * 16)]


class _MapInfo(ctypes.Structure):
    """The head of struct bpf_map_info, up to its name."""

    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32),
                ("key_size", ctypes.c_uint32), ("value_size", ctypes.c_uint32),
                ("max_entries", ctypes.c_uint32), ("map_flags", ctypes.c_uint32),
                ("name", ctypes.c_char * 16)]


class _LinkInfo(ctypes.Structure):
    """The head of struct bpf_link_info, with its xdp and tcx members' ifindex."""

    _fields_ = [("type", ctypes.c_uint32), ("id", ctypes.c_uint32),
                ("prog_id", ctypes.c_uint32), ("pad", ctypes.c_uint32),
                ("ifindex", ctypes.c_uint32), ("attach_type", ctypes.c_uint32)]


class _XdpQueryOpts(ctypes.Structure):
    """struct bpf_xdp_query_opts (libbpf 1.1's libbpf.h)."""

    _fields_ = [("sz", ctypes.c_size_t), ("prog_id", ctypes.c_uint32),
                ("drv_prog_id", ctypes.c_uint32), ("hw_prog_id", ctypes.c_uint32),
                ("skb_prog_id", ctypes.c_uint32), ("attach_mode", ctypes.c_uint8)]


def _info(fd: int, info):
    size = ctypes.c_uint32(ctypes.sizeof(info))
    _check(libbpf().bpf_obj_get_info_by_fd(fd, ctypes.byref(info), ctypes.byref(size)),
           "bpf_obj_get_info_by_fd")
    return info


def prog_info(fd: int, map_ids=None) -> _ProgInfo:
    """The kernel's description of program ``fd``; with ``map_ids`` (an array of
    c_uint32), the ids of its maps too, in it (``nr_map_ids`` of them)."""
    info = _ProgInfo()
    if map_ids is not None:
        info.nr_map_ids = len(map_ids)
        info.map_ids = ctypes.addressof(map_ids)
    return _info(fd, info)


def xdp_attached(ifindex: int) -> _XdpQueryOpts:
    """What XDP program interface ``ifindex`` runs: prog_id (0: none), and in
    which mode (skb_prog_id: generic; drv_prog_id: the driver's)."""
    opts = _XdpQueryOpts(sz=ctypes.sizeof(_XdpQueryOpts))
    _check(libbpf().bpf_xdp_query(ifindex, 0, ctypes.byref(opts)),
           f"querying the XDP program of interface {ifindex}")
    if not opts.prog_id:  # one in each of two modes (driver and hardware): either
        opts.prog_id = opts.drv_prog_id or opts.hw_prog_id or opts.skb_prog_id
    return opts


def tcx_programs(ifindex: int) -> list[int]:
    """The ids of the programs on the tcx (TC ingress) hook of interface
    ``ifindex`` of this network namespace, in the order they run."""
    ids = (ctypes.c_uint32 * 64)()
    count = ctypes.c_uint32(len(ids))
    _check(libbpf().bpf_prog_query(ifindex, BPF_TCX_INGRESS, 0, None, ids, ctypes.byref(count)),
           f"querying the TC ingress programs of interface {ifindex}")
    return list(ids[: count.value])


def _links():
    """Every BPF link's _LinkInfo (links closed meanwhile left out)."""
    lib = libbpf()
    at = ctypes.c_uint32(0)
    while lib.bpf_link_get_next_id(at.value, ctypes.byref(at)) == 0:
        fd = lib.bpf_link_get_fd_by_id(at.value)
        if fd < 0:
            continue
        try:
            yield _info(fd, _LinkInfo())
        finally:
            os.close(fd)


def bridge_ports(ifindex: int) -> list[int] | None:
    """The interfaces of bridge ``ifindex`` (its ports' indices, in order), or
    None where it is not a bridge."""
    name = _ifname(ifindex)
    base = pathlib.Path("/sys/class/net") / name
    if not (base / "bridge").is_dir():
        return None
    ports = []
    for port in sorted(p.name for p in (base / "brif").iterdir()):
        try:
            ports.append(socket.if_nametoindex(port))
        except OSError:  # gone meanwhile
            pass
    return ports


def is_virtual(ifindex: int) -> bool:
    """Whether interface ``ifindex`` is no NIC (a veth, a bridge, loopback): no
    device behind it in sysfs."""
    return not (pathlib.Path("/sys/class/net") / _ifname(ifindex) / "device").exists()


def _ifname(ifindex: int) -> str:
    try:
        return socket.if_indextoname(ifindex)
    except OSError:
        return f"#{ifindex}"
