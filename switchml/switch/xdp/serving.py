"""The XDP switch on an interface: ``InterfaceServing``, ``XdpPipeline``'s
attach and detach (pipeline.py holds the pipeline itself).

Where: in the driver's native mode where the interface has one (a veth, most
NICs), in XDP's generic (skb) mode where it has none (loopback) or refuses
(the reason is in the switch's log line, in ``mode`` and ``mode_reason``,
and the stats say ``xdp_mode``).  A bridge has no driver mode, but the
frames for its address come in by its ports: the switch on a bridge attaches
to each of its ports in their driver mode, with the fan-out program on each
port's TC ingress (its copies go out of the bridge, as from the bridge's
own), and the program learns ranks' Ethernet addresses there (the ``ports``
map); where a port refuses, the bridge itself is served in generic mode,
nothing left on the ports.  (A port added to the bridge later has no program:
its frames reach the switch's socket, and ``passed_up`` runs each through the
program.)  ``SWITCHML_XDP_MODE=generic``
(``serve(..., mode="generic")``) asks for generic mode: a native program
on a veth has the kernel turn the peer's TCP and UDP segmentation offloads
off while it runs, for all its traffic (other containers' on a shared bridge
too).  Driver
mode is the
faster: the program runs in the driver's receive loop on batches of frames,
with no socket buffer built for what it drops (on the 2-core testbed at MTU
1500, a 64 MiB allreduce in 0.58 s against generic mode's 1.03:
docs/benchmarks.md).

An interface runs one XDP program, and several XDP switches may serve one
(other ports, of one process or several: several ``Switch(data_plane="xdp")``
on 127.0.0.1): the interface's program is a dispatcher
(``dispatch.bpf.c``, ``dispatch.Dispatcher``), which the first switch
attaches through a BPF link and the later ones join (their own file
descriptors of its link and maps, found from the attached program's id).  It
tail-calls, for each UDP datagram, the program of the switch that serves its
destination port (each switch keeps its own object and maps) and passes the
rest to the host.  The switches on an interface share the mode of the first.
The kernel detaches it when the last switch holding its
link closes it, or dies; a switch that closes takes its port out; the port of
a switch that was killed (its program, still in the dispatcher, takes that
port's datagrams meanwhile) is taken out by the switches still serving
there, which look every second (``sweep_gone_switches``, from the switch's
loop), or by the next that joins or leaves.  An interface whose XDP
program is not the dispatcher (a switch attached alone in driver mode,
another tool's program) is left alone:
``serve`` raises ``DataPlaneUnavailableError`` naming it.  Each switch's
fan-out program has a tcx link of its own on the TC ingress, and passes on
(TCX_NEXT) what is not its own.  ``serve(address, driver=True)``
(bench/xdp_driver.py) attaches the switch's program alone, in the driver's
native mode, without the dispatcher: it is the interface's only XDP switch.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import pathlib
import socket
from typing import Any

from ... import ethtool, netutil
from ...errors import DataPlaneUnavailableError
from .dispatch import Dispatcher, InterfaceTaken
from .loader import bridge_ports, is_virtual, xdp_attached

log = logging.getLogger("switchml.switch")

#: The offload feature (``ethtool -k``'s name) of GRO, which merges results into runs.
GRO = "rx-gro"
#: The UDP segmentation offload's, which sends a run whole.
USO = "tx-udp-segmentation"


def _is_loopback(ifindex: int) -> bool:
    """Whether interface ``ifindex`` is a loopback one (IFF_LOOPBACK)."""
    flags = pathlib.Path(f"/sys/class/net/{socket.if_indextoname(ifindex)}/flags")
    try:
        return bool(int(flags.read_text(), 16) & 0x8)
    except OSError:
        return False


def interface_of(host: str) -> int:
    """The index of the interface that holds IPv4 address ``host``; ValueError
    when none does (0.0.0.0 among them: the program serves one interface)."""
    try:
        address = socket.gethostbyname(host)
    except OSError as exc:
        raise ValueError(f"the XDP data plane needs an IPv4 address of this host: "
                         f"{host!r}: {exc}") from None
    name = netutil.interface_of(address)
    if name is not None:
        return socket.if_nametoindex(name)
    raise ValueError(f"the XDP data plane attaches to the interface that holds the "
                     f"switch's address; no interface holds {host}")


class InterfaceServing:
    """``XdpPipeline``'s serving of an interface: what it uses of the pipeline is
    its loaded program (``_prog``), ``port`` and ``_configure``, which writes
    the program's settings (the interface served, the ports of a bridge)."""

    #: The bridge ports the program serves in driver mode at most (its ``ports`` map).
    max_bridge_ports: int
    _prog: Any
    port: int
    address: tuple
    ifindex: int | None
    mode: str | None
    mode_reason: str
    takes_gso_runs: bool
    merges_results: bool
    _link: int | None
    _dispatches: list[Dispatcher]
    _fan_out_links: list[int]
    _ports: list[int]
    _ports_refused: set[int]
    _answers_by_stack: bool
    _gro_turned_on: list[str]

    def _configure(self, ifindex: int) -> None:
        raise NotImplementedError

    def serve(self, address, driver: bool = False, mode: str = "auto") -> int:
        """Serve the switch's UDP ``address`` (host, port) for real: the program
        takes the datagrams to that port on the interface that holds the host's
        IPv4 address (``interface_of``), through the interface's dispatcher,
        which the XDP switches there share, and the fan-out program on that
        interface's TC ingress sends each completed result to every rank (not
        on a loopback interface: its ranks are this host's, which the switch's
        socket reaches; nor where the kernel refuses it, logged: the socket
        sends the results).  Returns the interface's index.

        ``mode`` "auto": in the driver's native mode where it has one (a veth,
        most NICs; for a bridge, which has none, on each of its ports, when
        every one takes it), else generic mode (loopback, a bridge with a port
        that refuses, a kernel without tcx for the fan-out); "generic":
        generic mode.  A dispatcher already on the interface is joined in its
        mode.  ``self.mode`` and ``self.mode_reason`` say which and why.  With
        ``driver``, the switch's program alone, without the dispatcher, in
        driver mode: an error where the driver has none, or where another XDP
        program is attached (bench/xdp_driver.py).  ``detach()`` (or
        ``close()``) undoes it."""
        if mode not in ("auto", "generic"):
            raise ValueError(f"the XDP attach mode is 'auto' or 'generic', not {mode!r}")
        host, port = address
        ifindex = interface_of(host)
        host = socket.gethostbyname(host)  # once, at the start: "localhost" as 127.0.0.1
        self.port = port
        self.address = (host, port)
        self.detach()
        name = socket.if_indextoname(ifindex)
        try:
            if driver:  # the program alone on the interface, as a benchmark wants it
                self._configure(ifindex)
                self._link = self._prog.attach(ifindex, driver)
                self.mode, self.mode_reason = "driver", "the program alone (driver=True)"
                self._attach_fan_out([ifindex], required=False)
            else:  # shared with the other XDP switches there, through the dispatcher
                if mode == "auto":
                    self._serve_in_driver_mode(ifindex)
                if self.mode is None:
                    if mode == "generic":
                        self.mode_reason = "generic mode asked for"
                    self._dispatches = [Dispatcher(ifindex)]
                    self.mode = self._dispatches[0].mode
                    if self.mode == "driver":  # another switch's, joined
                        self.mode_reason = "the dispatcher there runs in driver mode"
                        self._answers_by_stack = is_virtual(ifindex)
                    self._configure(ifindex)
                    self._attach_fan_out([ifindex], required=self._answers_by_stack)
                for dispatch in self._dispatches:
                    dispatch.register(port, self._prog.prog_fd, self._prog.prog_id,
                                      self._prog.fan_out_id)
        except InterfaceTaken as exc:
            self.detach()
            raise DataPlaneUnavailableError(
                f"data_plane='xdp' cannot serve {host}:{port}: {exc}") from None
        except OSError as exc:
            self.detach()
            if driver and exc.errno in (errno.EBUSY, errno.EEXIST):  # taken
                attached = xdp_attached(ifindex)
                raise DataPlaneUnavailableError(
                    f"data_plane='xdp' cannot serve {host}:{port} in driver mode: interface "
                    f"{name} already runs XDP program {attached.prog_id} (other XDP "
                    f"switches there?); in driver mode the switch's program is the "
                    f"interface's only one: serve in generic mode (driver=False), which "
                    f"XDP switches share") from exc
            raise
        except BaseException:
            self.detach()
            raise
        self.ifindex = ifindex
        self.takes_gso_runs = self.mode == "driver"
        return ifindex

    def _serve_in_driver_mode(self, ifindex: int) -> None:
        """The dispatchers in driver mode, and the fan-out program beside each,
        where the interface (or each port of the bridge it is) takes them:
        ``self.mode`` "driver"; else nothing held, ``self.mode_reason`` saying
        why (then generic mode)."""
        name = socket.if_indextoname(ifindex)
        ports = bridge_ports(ifindex)
        if ports is None:
            devices = [ifindex]
        elif xdp_attached(ifindex).prog_id:
            self.mode_reason = f"XDP switches serve bridge {name} in generic mode already"
            return
        elif not ports:
            self.mode_reason = f"bridge {name} has no ports (a bridge has no driver mode)"
            return
        elif len(ports) > self.max_bridge_ports:
            self.mode_reason = (f"bridge {name} has {len(ports)} ports, more than the "
                                f"{self.max_bridge_ports} the switch serves in driver mode")
            return
        else:  # the frames for the bridge's address come in by its ports
            devices = ports
        at = name
        try:
            for device in devices:
                at = name if ports is None else \
                    f"{socket.if_indextoname(device)}, a port of bridge {name}"
                self._dispatches.append(Dispatcher(device, driver=True))
                if self._dispatches[-1].mode != "driver":
                    raise InterfaceTaken("its dispatcher runs in generic mode")
            at = name if ports is None else f"the ports of bridge {name}"
            self._ports = ports or []
            # A veth's XDP_TX reaches its peer only where the peer polls with
            # NAPI, which the switch can neither tell nor set: answers go out by
            # the stack there (pipeline.bpf.c, answers_by_stack)
            self._answers_by_stack = any(is_virtual(d) for d in devices)
            self._attach_fan_out(devices, required=True)
            if self._answers_by_stack:
                self._merge_results_on(devices)
            self._configure(ifindex)
        except (OSError, InterfaceTaken) as exc:
            why = os.strerror(exc.errno) if isinstance(exc, OSError) and exc.errno else str(exc)
            self.mode_reason = f"no driver mode on {at} ({why})"
            self.detach()
            return
        self.mode = "driver"
        self.mode_reason = (f"{name}'s driver" if ports is None else
                            f"on the {len(ports)} port(s) of bridge {name}")

    def _merge_results_on(self, devices: list[int]) -> None:
        """Results in runs on these veths (``results_in_runs``), where each sends a
        run whole (its UDP segmentation offload on: else the kernel would cut
        each copy of a run into datagrams as it leaves, more work than copies
        made a datagram at a time): GRO on each where it is off, marked in the
        device's dispatcher as the switches' (the last switch there to ``detach``
        turns it off again); the switch's socket takes UDP_GRO
        (``merges_results``)."""
        names = [socket.if_indextoname(device) for device in devices]
        try:  # a device that will not say or change: results one by one, still driver mode
            state = {name: ethtool.features(name) for name in names}
            if not all(state[name].get(USO, False) for name in names):
                return
            for device, name in zip(devices, names):
                self._gro_on(device, name, state[name])
        except (OSError, ValueError):
            self._gro_back_off()
            return
        self.merges_results = True

    def _gro_on(self, device: int, name: str, features: dict) -> None:
        """GRO on ``device`` where it is off, marked in its dispatcher as the
        switches' (the last switch there to ``detach`` turns it off again)."""
        if not features.get(GRO, True):
            ethtool.set_features(name, {GRO: True})
            self._gro_turned_on.append(name)
            next(d for d in self._dispatches if d.ifindex == device).mark_gro_turned_on()

    def _gro_back_off(self) -> None:
        """GRO off again on the devices of ``_gro_turned_on``: those
        ``_merge_results_on`` turned it on for when it fails, those this switch
        was the last on when it detaches (a device gone with its namespace:
        nothing to do)."""
        turned_on, self._gro_turned_on = getattr(self, "_gro_turned_on", []), []
        for name in turned_on:
            with contextlib.suppress(OSError, ValueError):
                ethtool.set_features(name, {GRO: False})

    def _attach_fan_out(self, devices: list[int], required: bool) -> None:
        """The fan-out program on the TC ingress of each of ``devices`` (none on
        a loopback interface); ``required``: a refusal raises (driver mode, whose
        answers it sends), else it is logged and the socket sends the results."""
        for device in devices:
            if _is_loopback(device):
                continue
            try:
                self._fan_out_links.append(self._prog.attach_fan_out(device))
            except OSError as exc:  # a kernel before 6.6 (no tcx): the socket sends them
                if required:
                    raise
                log.warning("results go to the ranks from the switch's socket, not the "
                            "kernel: %s", exc)

    @property
    def fans_out(self) -> bool:
        """Whether the fan-out program sends completed results (``serve``)."""
        return bool(self._fan_out_links)

    def detach(self) -> None:
        """Detach the programs from their interface, if ``serve`` attached them."""
        links, self._fan_out_links = getattr(self, "_fan_out_links", []), []
        link, self._link = getattr(self, "_link", None), None
        for fd in links + ([link] if link is not None else []):
            os.close(fd)
        dispatches, self._dispatches = getattr(self, "_dispatches", []), []
        self._gro_turned_on = []
        for dispatch in dispatches:  # its port out; the last switch's close detaches it
            if dispatch.close():  # the last switch on a device whose GRO switches turned on
                with contextlib.suppress(OSError):  # (a device gone with its namespace)
                    self._gro_turned_on.append(socket.if_indextoname(dispatch.ifindex))
        self.mode = None
        self.takes_gso_runs = False
        self._answers_by_stack = False
        self.merges_results = False
        self._gro_back_off()
        ports, self._ports = getattr(self, "_ports", []), []
        self._ports_refused = set()
        if getattr(self, "_prog", None) is not None:  # no interface: nothing to learn from
            self._configure(ifindex=0)
            for device in ports:
                self._prog.delete("ports", ctypes.c_uint32(device))

    def adopt_new_ports(self) -> list[str]:
        """In driver mode on a bridge's ports: serve the ports added to the bridge
        since (a container started after the switch), as ``serve`` served the
        first (the dispatcher, the fan-out program, GRO where results go in runs),
        so that their ranks' frames meet the program, not the switch's socket.
        A port that refuses driver mode is left so, logged: its frames reach the
        socket (``passed_up``), correct and slower.  Ports gone keep what was
        attached for them until ``detach`` (the kernel took their programs off).
        The names of the ports taken."""
        if self.mode != "driver" or not self._ports or self.ifindex is None:
            return []
        known = {d.ifindex for d in self._dispatches} | self._ports_refused
        added: list[str] = []
        for device in bridge_ports(self.ifindex) or []:
            if device in known:
                continue
            if len(self._ports) >= self.max_bridge_ports:  # the program's map of them is full
                log.warning("port %d of the bridge is not served in driver mode (the switch "
                            "serves %d ports at most): its ranks' frames reach the switch's "
                            "socket", device, self.max_bridge_ports)
                self._ports_refused.add(device)
                continue
            try:
                name = socket.if_indextoname(device)
                dispatch = Dispatcher(device, driver=True)
            except (OSError, InterfaceTaken) as exc:  # (or gone meanwhile)
                log.warning("port %d of the bridge is not served in driver mode (%s): its "
                            "ranks' frames reach the switch's socket", device, exc)
                self._ports_refused.add(device)  # not tried again
                continue
            try:
                if dispatch.mode != "driver":
                    raise InterfaceTaken("its dispatcher runs in generic mode")
                dispatch.register(self.port, self._prog.prog_fd, self._prog.prog_id,
                                  self._prog.fan_out_id)
            except (OSError, InterfaceTaken) as exc:  # another switch serves the port there
                dispatch.close()
                log.warning("port %s of the bridge is not served in driver mode (%s): its "
                            "ranks' frames reach the switch's socket", name, exc)
                self._ports_refused.add(device)
                continue
            self._dispatches.append(dispatch)
            try:
                self._attach_fan_out([device], required=False)
                if self.merges_results:  # results go in runs: merged where they arrive
                    features = ethtool.features(name)
                    if features.get(USO, False):
                        self._gro_on(device, name, features)
            except (OSError, ValueError) as exc:
                log.warning("port %s of the bridge: %s", name, exc)
            if is_virtual(device):
                self._answers_by_stack = True  # (pipeline.bpf.c, answers_by_stack)
            self._ports.append(device)
            self._configure(self.ifindex)
            added.append(name)
        return added

    def sweep_gone_switches(self) -> list[int]:
        """Take the ports of the XDP switches gone from this interface (killed,
        not closed) out of its dispatchers, which frees their programs and maps;
        the ports taken out (``Dispatcher.sweep``)."""
        gone = sorted({port for d in self._dispatches for port in d.sweep()})
        for dispatch in self._dispatches:  # another's sweep may have taken ours meanwhile
            if dispatch.reclaim():
                log.warning("this switch's port %s on %s was taken out of the XDP dispatcher "
                            "by another switch's sweep: put back", self.port,
                            socket.if_indextoname(dispatch.ifindex))
        return gone
