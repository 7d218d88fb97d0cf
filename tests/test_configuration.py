"""One SwitchConfiguration for every way a switch starts: what the caller passes wins,
then SWITCHML_*, then the defaults; and the variables reach each entry point."""

import os
import subprocess
import sys

import pytest

from switchml import Switch, config
from switchml.cli import build_parser, fetch_stats, switch_configuration
from switchml.config import SwitchConfiguration
from switchml.switch.process import SwitchProcess

SMALL = {"SWITCHML_SLOTS": "24", "SWITCHML_PACKET_ELEMENTS": "512",
         "SWITCHML_MAX_JOBS": "3", "SWITCHML_SLOTS_PER_JOB": "6"}


@pytest.fixture
def small_env(monkeypatch):
    for name, value in SMALL.items():
        monkeypatch.setenv(name, value)


def test_given_beats_the_environment_beats_the_defaults():
    environ = {"SWITCHML_SLOTS": "24", "SWITCHML_PORT": "7400", "SWITCHML_DROP_RATE": "0.1",
               "SWITCHML_KEEPALIVE": ""}  # empty: unset
    c = SwitchConfiguration.from_env(environ=environ, defaults={"port": 7300, "max_jobs": 5},
                                     slots=16)
    assert (c.slots, c.port, c.drop_rate, c.max_jobs) == (16, 7400, 0.1, 5)
    assert c.keepalive == config.DEFAULT_KEEPALIVE and c.host == "127.0.0.1"
    assert SwitchConfiguration.from_env(environ={}) == SwitchConfiguration()


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="SWITCHML_SLOTS='many' is not a valid int"):
        SwitchConfiguration.from_env(environ={"SWITCHML_SLOTS": "many"})
    with pytest.raises(TypeError, match="unknown switch setting.*: slot\\b"):
        SwitchConfiguration.from_env(environ={}, slot=3)
    with pytest.raises(ValueError, match="drop_rate"):
        SwitchConfiguration(drop_rate=1.5)
    with pytest.raises(ValueError, match="keepalive"):
        SwitchConfiguration.from_env(environ={"SWITCHML_KEEPALIVE": "0"})
    for setting, value in (("port", 70000), ("port", -1), ("metrics_port", 65536)):
        with pytest.raises(ValueError, match=f"{setting} must be 0 to 65535"):
            SwitchConfiguration(**{setting: value})
    # empty: an unset variable passed as a flag; --token-file "" ran a switch open
    # to anyone
    for setting in ("token_file", "host", "metrics_host", "upstream"):
        with pytest.raises(ValueError, match=f"{setting} is empty"):
            SwitchConfiguration(**{setting: ""})
    for address in ("127.0.0.1:103267", ("127.0.0.1", 70000)):  # (a resolver wraps it)
        with pytest.raises(ValueError, match="a port is 0 to 65535"):
            config.parse_address(address)


def test_switch_reads_the_environment(small_env):
    sw = Switch()
    assert (sw.pipeline.slots, sw.pipeline.packet_elements) == (24, 512)
    assert (sw._max_jobs, sw._slots_per_job, sw._port) == (3, 6, 0)
    assert Switch(slots=16).pipeline.slots == 16  # a keyword argument wins
    given = SwitchConfiguration(slots=8, packet_elements=256)
    sw = Switch(configuration=given, max_jobs=2)  # a configuration as it is, no variables
    assert (sw.pipeline.slots, sw.pipeline.packet_elements, sw._max_jobs) == (8, 256, 2)


def test_switch_process_reads_the_environment_in_the_parent(small_env):
    with SwitchProcess() as sp:
        stats = fetch_stats(sp.address)
        assert (stats["slots"], stats["packet_elements"]) == (24, 512)
        assert stats["admission"]["max_jobs"] == 3
    # the child inherits the variables, but runs what the parent resolved
    with SwitchProcess(slots=16) as sp:
        assert fetch_stats(sp.address)["slots"] == 16
    with pytest.raises(ValueError, match="max_jobs"):
        SwitchProcess(max_jobs=0)  # in the parent, before any child


def test_switch_command_reads_the_environment():
    args = build_parser().parse_args(["switch"])
    assert switch_configuration(args, environ={}).port == config.DEFAULT_PORT
    c = switch_configuration(args, environ={"SWITCHML_PORT": "7401", **SMALL})
    assert (c.port, c.slots, c.packet_elements, c.max_jobs) == (7401, 24, 512, 3)
    args = build_parser().parse_args(["switch", "--port", "0", "--slots", "16"])
    c = switch_configuration(args, environ={"SWITCHML_PORT": "7401", **SMALL})
    assert (c.port, c.slots, c.packet_elements) == (0, 16, 512)  # the flags win


def test_a_switch_server_says_so_by_flag_or_variable():
    """shared_link: the --shared-link flag, SWITCHML_SHARED_LINK (1/0, yes/no, ...)."""
    plain = build_parser().parse_args(["switch"])
    flagged = build_parser().parse_args(["switch", "--shared-link"])
    assert not switch_configuration(plain, environ={}).shared_link
    assert switch_configuration(flagged, environ={}).shared_link
    assert switch_configuration(plain, environ={"SWITCHML_SHARED_LINK": "1"}).shared_link
    assert not switch_configuration(plain, environ={"SWITCHML_SHARED_LINK": "no"}).shared_link
    with pytest.raises(ValueError, match="SWITCHML_SHARED_LINK='maybe' is not a valid flag"):
        SwitchConfiguration.from_env(environ={"SWITCHML_SHARED_LINK": "maybe"})


def test_a_bad_variable_is_a_clear_error_of_the_switch_command():
    done = subprocess.run([sys.executable, "-m", "switchml.cli", "switch", "--port", "0"],
                          env={**{k: v for k, v in os.environ.items()
                                  if not k.startswith("SWITCHML_")}, "SWITCHML_MAX_JOBS": "lots"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "SWITCHML_MAX_JOBS='lots' is not a valid int" in done.stderr


def test_a_torch_jobs_own_switch_reads_the_environment(monkeypatch):
    pytest.importorskip("torch")
    from switchml.torch import _JobSwitch

    for name in SMALL:
        monkeypatch.delenv(name, raising=False)
    c = _JobSwitch.configuration()
    # room for max_jobs groups at slots_per_job each, unless SWITCHML_SLOTS says
    assert c.slots == config.DEFAULT_SLOTS_PER_JOB * config.DEFAULT_MAX_JOBS
    monkeypatch.setenv("SWITCHML_SLOTS_PER_JOB", "8")
    monkeypatch.setenv("SWITCHML_PACKET_ELEMENTS", "1024")
    c = _JobSwitch.configuration()
    assert (c.slots, c.slots_per_job, c.packet_elements) == (
        8 * config.DEFAULT_MAX_JOBS, 8, 1024)
    monkeypatch.setenv("SWITCHML_SLOTS", "100")
    assert _JobSwitch.configuration().slots == 100


def test_a_given_data_plane_choice_wins_over_the_environments_other_one():
    """fastpath and data_plane choose the same thing: the one a caller gives
    wins where the environment's (or a default's) other disagrees; both given
    must agree."""
    xdp = {"SWITCHML_DATA_PLANE": "xdp"}
    assert SwitchConfiguration.from_env(environ=xdp, fastpath=True).data_plane is None
    assert SwitchConfiguration.from_env(environ=xdp, fastpath=False).data_plane == "xdp"
    c = {"fastpath": True}  # an entry point's default
    assert SwitchConfiguration.from_env(c, {}, data_plane="python").fastpath is None
    assert SwitchConfiguration.from_env(c, {}, data_plane="c").fastpath is True
    with pytest.raises(ValueError, match="contradicts"):
        SwitchConfiguration.from_env(environ={}, fastpath=True, data_plane="xdp")
    # a rack switch runs the Python data plane, whatever the environment says
    rack = SwitchConfiguration.from_env(environ=xdp, upstream="127.0.0.1:7300")
    assert rack.data_plane is None and rack.upstream == "127.0.0.1:7300"
    with pytest.raises(ValueError, match="rack switch"):
        SwitchConfiguration.from_env(environ={}, upstream="127.0.0.1:7300", data_plane="xdp")


@pytest.mark.parametrize("variable, value", [
    ("SWITCHML_TIMEOUT", "-1"), ("SWITCHML_TIMEOUT", "nan"), ("SWITCHML_TIMEOUT", "0"),
    ("SWITCHML_WAIT_FOR_SLOTS", "inf"), ("SWITCHML_WAIT_FOR_SLOTS", "-1"),
    ("SWITCHML_PURE_PYTHON", "maybe")])
def test_a_workers_setting_out_of_its_range_is_named_at_once(variable, value, monkeypatch):
    """A timeout of 0, a negative or NaN failed deep in the sockets (blaming the
    switch); an infinite wait for slots overflowed a timestamp; a flag's unknown
    word was taken as off.  Each is now the variable's own error."""
    import switchml
    from switchml.config import pure_python

    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"{variable}={value!r} is not a valid"):
        if variable == "SWITCHML_PURE_PYTHON":
            pure_python()
        else:
            switchml.Worker("127.0.0.1:9", 0, 1, local_stage=False)
    monkeypatch.delenv(variable)
    with pytest.raises(ValueError, match="timeout must be a finite number of seconds"):
        switchml.Worker("127.0.0.1:9", 0, 1, timeout=-1.0, local_stage=False)


@pytest.mark.parametrize("argument, value, error", [
    ("rejoin_within", float("nan"), ValueError), ("rejoin_within", -1.0, ValueError),
    ("threads", 0, ValueError), ("threads", -1, ValueError), ("threads", 65, ValueError),
    ("job", 5, TypeError),
])
def test_a_workers_argument_out_of_its_range_is_named_at_once(argument, value, error):
    """rejoin_within=NaN waited for a dead switch for ever, threads=0 or -1 ran one
    thread unsaid, a job named 5 raised len()'s TypeError."""
    import switchml

    with pytest.raises(error, match=argument if argument != "job" else "job's name"):
        switchml.Worker("127.0.0.1:9", 0, 1, local_stage=False, **{argument: value})
