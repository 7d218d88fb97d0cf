"""A switch's share of an interface's XDP dispatcher (``dispatch.bpf.c``): the
program the XDP switches of one interface attach once and share, each at its UDP
port (``switchml_progs``: the pipeline to run; ``switchml_owners``: who registered
it, alive while a program only that switch holds exists).  ``Dispatcher`` joins the
one attached or attaches it, registers a switch's pipeline, sweeps the ports of
switches gone, and lets go; loader.py builds and loads the programs."""

from __future__ import annotations

import ctypes
import errno
import os

from .loader import (
    DISPATCH_PROGRAM,
    PROGRAM,
    XDP_FLAGS_DRV_MODE,
    XDP_FLAGS_SKB_MODE,
    _check,
    _ifname,
    _info,
    _link_xdp,
    _LinkInfo,
    _links,
    _MapInfo,
    build_dispatcher,
    libbpf,
    prog_info,
    xdp_attached,
)


class _Owner(ctypes.Structure):
    """dispatch.bpf.c's struct switchml_owner."""

    _fields_ = [("pid", ctypes.c_uint32), ("prog_id", ctypes.c_uint32),
                ("alive_id", ctypes.c_uint32)]


#: The key of ``switchml_owners`` no switch serves (UDP port 0): there, where
#: present, the mark that the switches of the interface turned its GRO on.
GRO_MARK = 0


#: linux/bpf.h's BPF_LINK_TYPE_XDP, BPF_NOEXIST and BPF_ANY
BPF_LINK_TYPE_XDP = 6
BPF_NOEXIST, BPF_ANY = 1, 0


class InterfaceTaken(RuntimeError):
    """The interface (or the port on it) is not free for this switch: the
    message says what holds it."""


def load_dispatcher() -> tuple[int, int]:
    """The dispatcher loaded, not attached: its libbpf object (for
    ``dispatcher_map_fd``; ``libbpf().bpf_object__close`` unloads it) and its
    program's fd."""
    lib = libbpf()
    path = build_dispatcher()
    obj = lib.bpf_object__open_file(str(path).encode(), None)
    if not obj:
        err = ctypes.get_errno()
        raise OSError(err, f"libbpf could not open {path}: {os.strerror(err)}")
    rc = lib.bpf_object__load(obj)
    if rc < 0:
        lib.bpf_object__close(obj)
        raise OSError(-rc, f"the kernel refused {path.name}: {os.strerror(-rc)}")
    return obj, lib.bpf_program__fd(lib.bpf_object__find_program_by_name(
        obj, DISPATCH_PROGRAM.encode()))


def dispatcher_map_fd(obj: int, name: str) -> int:
    """The fd of map ``name`` (switchml_progs, switchml_owners) of a dispatcher
    object that ``load_dispatcher`` loaded."""
    lib = libbpf()
    return lib.bpf_map__fd(lib.bpf_object__find_map_by_name(obj, name.encode()))


def _alive(owner: _Owner) -> bool:
    """Whether the switch that registered ``owner`` is still there: its
    ``alive_id`` program, which only its process holds, is not freed."""
    fd = libbpf().bpf_prog_get_fd_by_id(owner.alive_id)
    if fd < 0:
        return False
    os.close(fd)
    return True


class Dispatcher:
    """A switch's hold on the dispatcher of an interface (``dispatch.bpf.c``):
    ``Dispatcher(ifindex)`` finds the one attached there (by another switch, of
    this process or another) and takes its own file descriptors of its BPF link
    and maps, or attaches one when the interface runs no XDP program: in
    generic mode, or with ``driver`` in the driver's native mode (an OSError
    where the driver has none: a bridge, loopback); ``mode`` says which mode
    the dispatcher it holds runs in ("generic" or "driver"), its own or the
    one it joined.  ``register(port, ...)`` puts a switch's pipeline at its
    port, ``close()`` takes it out and lets go: the kernel detaches the
    dispatcher when the last switch holding its link closes it (or dies).
    ``InterfaceTaken`` when another XDP program is on the interface (a switch
    attached alone, ``serve(..., driver=True)``, or another tool's): it is left
    alone."""

    def __init__(self, ifindex: int, driver: bool = False):
        self.ifindex = ifindex
        self._lib = libbpf()
        self._obj: int | None = None  # the dispatcher's object, where this one loaded it
        self.link_fd = self.progs_fd = self.owners_fd = -1
        self.port: int | None = None
        self._prog_id = 0  # register's
        self._mine: tuple = (None, -1)  # register's: its owner entry and program fd
        self._driver = driver
        self.mode = "driver" if driver else "generic"  # _join's, where it joined one
        try:
            for _ in range(8):  # another switch may attach or detach meanwhile: again
                if self._join() or self._attach():
                    return
            raise InterfaceTaken(f"the XDP program of interface {ifindex} kept changing "
                                 f"while this switch tried to share it")
        except BaseException:
            self.close()
            raise

    def _attach(self) -> bool:
        """Load the dispatcher and attach it; False when another program got
        there first (then ``_join`` it)."""
        if xdp_attached(self.ifindex).prog_id:
            return False
        lib = self._lib
        obj, prog = load_dispatcher()
        fd = _link_xdp(prog, self.ifindex,
                       XDP_FLAGS_DRV_MODE if self._driver else XDP_FLAGS_SKB_MODE)
        if fd < 0:
            lib.bpf_object__close(obj)
            if -fd in (errno.EBUSY, errno.EEXIST):  # another one got there first
                return False
            _check(fd, f"attaching the XDP dispatcher to {_ifname(self.ifindex)} in "
                       f"{self.mode} mode")
        self._obj, self.link_fd = obj, fd
        self.progs_fd = dispatcher_map_fd(obj, "switchml_progs")
        self.owners_fd = dispatcher_map_fd(obj, "switchml_owners")
        return True

    def _join(self) -> bool:
        """Take file descriptors of the dispatcher attached to the interface (its
        link, its two maps); False when none is (any more)."""
        lib = self._lib
        attached = xdp_attached(self.ifindex)
        if not attached.prog_id:
            return False
        prog = lib.bpf_prog_get_fd_by_id(attached.prog_id)
        if prog < 0:
            return False  # detached meanwhile
        try:
            map_ids = (ctypes.c_uint32 * 8)()
            info = prog_info(prog, map_ids)
            name = info.name.decode(errors="replace")
            if name != DISPATCH_PROGRAM[:15] or attached.prog_id not in (
                    attached.skb_prog_id, attached.drv_prog_id):
                mode = "generic" if attached.skb_prog_id else "driver" \
                    if attached.drv_prog_id else "hardware"
                raise InterfaceTaken(
                    f"interface {_ifname(self.ifindex)} runs XDP program {name!r} (id "
                    f"{attached.prog_id}, {mode} mode), not the dispatcher that XDP switches "
                    f"share" + (" (a switch's program attached there alone, as "
                                "serve(..., driver=True) attaches it)" if name == PROGRAM
                                else ""))
            for map_id in map_ids[: min(info.nr_map_ids, len(map_ids))]:
                fd = lib.bpf_map_get_fd_by_id(map_id)
                if fd < 0:
                    continue
                kind = _info(fd, _MapInfo()).name
                if kind == b"switchml_progs" and self.progs_fd < 0:
                    self.progs_fd = fd
                elif kind == b"switchml_owners" and self.owners_fd < 0:
                    self.owners_fd = fd
                else:
                    os.close(fd)
            if self.progs_fd < 0 or self.owners_fd < 0:
                raise InterfaceTaken(f"the XDP dispatcher of interface "
                                     f"{_ifname(self.ifindex)} has not switchml's maps")
            # the mode the switches there chose: every switch of an interface shares it
            self.mode = "generic" if attached.skb_prog_id == attached.prog_id else "driver"
            # the link's own fd: it keeps the dispatcher attached while this
            # switch runs, whoever attached it
            for link in _links():
                if link.type == BPF_LINK_TYPE_XDP and link.prog_id == attached.prog_id:
                    fd = lib.bpf_link_get_fd_by_id(link.id)
                    if fd >= 0 and _info(fd, _LinkInfo()).ifindex == self.ifindex:
                        self.link_fd = fd
                        return True
                    if fd >= 0:
                        os.close(fd)
            self._close_fds()  # attached without a link, or its link went meanwhile
            if xdp_attached(self.ifindex).prog_id == attached.prog_id:
                raise InterfaceTaken(f"the XDP dispatcher of interface "
                                     f"{_ifname(self.ifindex)} is attached without a BPF "
                                     f"link, which switches cannot share")
            return False
        finally:
            os.close(prog)

    def _owner(self, port: int) -> _Owner | None:
        owner = _Owner()
        rc = self._lib.bpf_map_lookup_elem(self.owners_fd, ctypes.byref(ctypes.c_uint32(port)),
                                           ctypes.byref(owner))
        return owner if rc == 0 else None

    def _remove(self, port: int) -> None:
        key = ctypes.c_uint32(port)
        self._lib.bpf_map_delete_elem(self.progs_fd, ctypes.byref(key))  # first: not run
        self._lib.bpf_map_delete_elem(self.owners_fd, ctypes.byref(key))

    def _ports(self):
        """The ports switches registered (``switchml_owners``' keys but the GRO
        mark's), as the map holds them while it is read."""
        key, at = ctypes.c_uint32(), None
        while self._lib.bpf_map_get_next_key(self.owners_fd, at, ctypes.byref(key)) == 0:
            port = key.value
            at = ctypes.byref(ctypes.c_uint32(port))
            if port != GRO_MARK:
                yield port

    def sweep(self) -> list[int]:
        """Take out the ports whose switch is gone (killed: the program only
        it held is freed); the ports taken out."""
        gone = []
        for port in self._ports():
            owner = self._owner(port)
            if owner is not None and not _alive(owner):
                gone.append((port, owner.alive_id))
        taken = []
        for port, alive_id in gone:
            # looked up again: a switch that took the port meanwhile keeps it
            owner = self._owner(port)
            if owner is not None and owner.alive_id == alive_id:
                self._remove(port)
                taken.append(port)
        return taken

    def register(self, port: int, prog_fd: int, prog_id: int, alive_id: int) -> None:
        """The dispatcher runs program ``prog_fd`` (id ``prog_id``) on the
        interface's datagrams to UDP ``port``, while program ``alive_id`` (one
        that only this switch holds) exists; ``InterfaceTaken`` if another
        switch still running serves that port there."""
        self.sweep()
        key = ctypes.c_uint32(port)
        mine = _Owner(os.getpid(), prog_id, alive_id)
        rc = self._lib.bpf_map_update_elem(self.owners_fd, ctypes.byref(key),
                                           ctypes.byref(mine), BPF_NOEXIST)
        if rc == -errno.EEXIST:
            owner = self._owner(port)
            if owner is not None and _alive(owner):
                raise InterfaceTaken(f"port {port} of interface {_ifname(self.ifindex)} is "
                                     f"served by another XDP switch (process {owner.pid})")
            rc = self._lib.bpf_map_update_elem(self.owners_fd, ctypes.byref(key),
                                               ctypes.byref(mine), BPF_ANY)
        _check(rc, f"registering port {port} with the XDP dispatcher")
        self.port, self._prog_id = port, prog_id
        self._mine = (mine, prog_fd)
        rc = self._lib.bpf_map_update_elem(self.progs_fd, ctypes.byref(key),
                                           ctypes.byref(ctypes.c_uint32(prog_fd)), BPF_ANY)
        if rc < 0:
            self._remove(port)
            self.port = None
            _check(rc, f"putting the switch's program in the XDP dispatcher at port {port}")

    def reclaim(self) -> bool:
        """This switch's port, taken out by another switch's sweep (which looked at
        a killed switch's entry of the port just before this switch took it,
        then removed this one's: maps have no compare-and-delete), put back;
        whether it had to be.  A port another switch holds now is left to it."""
        if self.port is None or self.owners_fd < 0 or self._owner(self.port) is not None:
            return False
        mine, prog_fd = self._mine
        key = ctypes.c_uint32(self.port)
        if self._lib.bpf_map_update_elem(self.owners_fd, ctypes.byref(key), ctypes.byref(mine),
                                         BPF_NOEXIST) < 0:
            return False
        self._lib.bpf_map_update_elem(self.progs_fd, ctypes.byref(key),
                                      ctypes.byref(ctypes.c_uint32(prog_fd)), BPF_ANY)
        return True

    def mark_gro_turned_on(self) -> None:
        """Say, in the dispatcher's maps, that a switch turned GRO on for this
        interface: the last switch to leave it turns it off (``close``)."""
        rc = self._lib.bpf_map_update_elem(self.owners_fd,
                                           ctypes.byref(ctypes.c_uint32(GRO_MARK)),
                                           ctypes.byref(_Owner()), BPF_ANY)
        _check(rc, f"marking GRO on {_ifname(self.ifindex)} as the XDP switches'")

    def close(self) -> bool:
        """Take this switch's port out, if it is still its own (and those of
        switches gone), and let go of the dispatcher.  True where this switch
        was the last on an interface whose GRO switches turned on
        (``mark_gro_turned_on``): the caller turns it off again."""
        gro_back_off = False
        if self.owners_fd >= 0:
            if self.port is not None:
                owner = self._owner(self.port)
                if owner is not None and \
                        (owner.pid, owner.prog_id) == (os.getpid(), self._prog_id):
                    self._remove(self.port)
                self.port = None
            self.sweep()
            if self._owner(GRO_MARK) is not None and next(self._ports(), None) is None:
                self._lib.bpf_map_delete_elem(self.owners_fd,
                                              ctypes.byref(ctypes.c_uint32(GRO_MARK)))
                gro_back_off = True
        self._close_fds()
        return gro_back_off

    def _close_fds(self) -> None:
        if self._obj is not None:  # the object's own fds of the maps
            self._lib.bpf_object__close(self._obj)
            self._obj = None
            self.progs_fd = self.owners_fd = -1
        for name in ("link_fd", "progs_fd", "owners_fd"):
            fd = getattr(self, name)
            setattr(self, name, -1)
            if fd >= 0:
                os.close(fd)
