"""A server the run starts (engine.launch): ready when its health check answers, its output in
the log, stopped with its whole process group, no process left after a normal stop, a server
deaf to SIGTERM, a child that outlives it, or the harness killed with SIGKILL; a server that
never starts, exits or never answers is an error with its own last lines; a kept server is
taken again only by a run that would start the same one."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engines.openai import server_keeper
from engines.openai.launch_config import LaunchConfig
from engines.openai.launched import LaunchedServer, free_port
from engines.openai.server_process import ServerProcess, ServerStartError, group_alive

pytestmark = pytest.mark.serial  # asserts timings: run alone (Makefile's `test`)

FAKE = str(Path(__file__).resolve().parents[2] / "fixtures" / "servers" / "fake_server.py")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is gone for our purposes
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1][0] != "Z"


def eventually(condition: object, seconds: float = 15.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.05)
    return False


def start_fake(tmp_path: Path, *flags: str, log: Path | None = None) -> ServerProcess:
    port = free_port("127.0.0.1")
    command = [sys.executable, FAKE, "--port", str(port), *flags]
    return ServerProcess.start(command, f"http://127.0.0.1:{port}", {}, log)


@pytest.fixture(autouse=True)
def nothing_kept() -> Iterator[None]:
    yield
    server_keeper.stop_kept()


def test_ready_logged_and_stopped_with_nothing_left(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    server = start_fake(tmp_path, "--ready-after", "0.3", "--say", "hello from the server")
    server.log_to(log)
    server.wait_ready("/health", timeout_s=30)
    assert server.ready_s is not None and server.ready_s >= 0.3
    assert eventually(lambda: "hello from the server" in log.read_text())
    assert server.cores == sorted(os.sched_getaffinity(0))  # inherited from this process
    server.stop(grace_s=5)
    assert server.exit_status() == -signal.SIGTERM
    assert not group_alive(server.pid)


def test_the_health_check_never_goes_through_the_users_proxy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")
    launched = LaunchedServer.start(launch_config(startup_timeout_s=20), FIELDS, None)
    assert launched.version == "9.9.9"
    launched.release()


def test_a_server_deaf_to_sigterm_and_its_child_are_killed(tmp_path: Path) -> None:
    server = start_fake(tmp_path, "--ignore-term", "--child-ignoring-term")
    server.wait_ready("/health", timeout_s=30)
    assert eventually(lambda: "child pid" in server.tail())
    child = int(server.tail().split("child pid ")[1].split()[0])
    assert alive(child)
    started = time.monotonic()
    server.stop(grace_s=0.5)
    assert time.monotonic() - started < 10
    assert server.exit_status() == -signal.SIGKILL
    assert eventually(lambda: not alive(child))
    assert not group_alive(server.pid)


def test_a_bad_flag_is_the_servers_own_error(tmp_path: Path) -> None:
    server = start_fake(tmp_path, "--no-such-flag")
    with pytest.raises(ServerStartError) as error:
        server.wait_ready("/health", timeout_s=30)
    message = str(error.value)
    assert "exited with status 2 before it was ready" in message
    assert "unrecognized arguments: --no-such-flag" in message  # argparse's, from its log


def test_a_server_that_never_answers_is_stopped_at_the_timeout(tmp_path: Path) -> None:
    server = start_fake(tmp_path, "--never-ready")
    with pytest.raises(ServerStartError, match=r"within 1 s \(engine.launch.startup_timeout_s\)"):
        server.wait_ready("/health", timeout_s=1.0)
    assert server.exit_status() is not None
    assert not group_alive(server.pid)


def test_a_program_that_is_not_installed_is_named() -> None:
    with pytest.raises(ServerStartError, match="'vllm-not-installed' is not an executable"):
        ServerProcess.start(["vllm-not-installed", "serve"], "http://127.0.0.1:1", {}, None)


def killing_the_harness_ends_its_server(
    code: str, pid_file: Path, still_running: str = "the harness ended before its server ran"
) -> None:
    """Run `code` as a harness that starts a server and writes its pid to `pid_file`; once the
    server runs, SIGKILL the harness (no clean-up of ours runs): the server must go too."""
    harness = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert eventually(lambda: pid_file.exists() or harness.poll() is not None, 40)
        assert harness.poll() is None, still_running
        server_pid = int(pid_file.read_text())
        assert alive(server_pid)
        harness.kill()
        harness.wait()
        gone = eventually(lambda: not alive(server_pid))
    finally:
        if harness.poll() is None:
            harness.kill()
    if not gone:
        os.killpg(server_pid, signal.SIGKILL)  # clean up before failing
    assert gone, "the server outlived the harness that started it"


def test_the_server_dies_with_the_process_that_started_it(tmp_path: Path) -> None:
    """SIGKILL of the harness (no clean-up runs) still ends its server: the death signal."""
    pid_file = tmp_path / "server.pid"
    code = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})
        from engines.openai.launched import free_port
        from engines.openai.server_process import ServerProcess
        port = free_port("127.0.0.1")
        server = ServerProcess.start(
            [sys.executable, {FAKE!r}, "--port", str(port)],
            f"http://127.0.0.1:{{port}}", {{}}, None)
        server.wait_ready("/health", 30)
        open({str(pid_file)!r}, "w").write(str(server.pid))
        time.sleep(600)
        """
    )
    killing_the_harness_ends_its_server(code, pid_file)


def launch_config(port_flag: str = "--port", **extra: object) -> LaunchConfig:
    return LaunchConfig.from_dict(
        {
            "command": ["{python}", FAKE, port_flag, "{port}"],
            "version_path": "/version",
            "stop_timeout_s": 2,
            **extra,
        }
    )


FIELDS = {"python": sys.executable, "threads": 1}


def test_a_kept_server_is_taken_by_the_next_run_of_the_same_command(tmp_path: Path) -> None:
    launch = launch_config()
    first = LaunchedServer.start(launch, FIELDS, tmp_path / "a.log")
    assert (first.reused, first.version) == (False, "9.9.9")
    first.release()
    assert server_keeper.kept_server() is first.server
    second = LaunchedServer.start(launch, FIELDS, tmp_path / "b.log")
    assert second.reused and second.server is first.server and second.version == "9.9.9"
    assert second.describe()["reused"] is True
    # another command: the kept one is stopped before the new one starts
    second.release()
    other = LaunchedServer.start(launch_config(args=["--say", "other"]), FIELDS, None)
    assert not other.reused
    assert not group_alive(first.server.pid)
    other.release()
    server_keeper.stop_kept()
    assert not group_alive(other.server.pid)


def test_reuse_off_stops_the_server_when_the_run_ends(tmp_path: Path) -> None:
    launched = LaunchedServer.start(launch_config(reuse=False), FIELDS, None)
    launched.release()
    assert server_keeper.kept_server() is None
    assert not group_alive(launched.server.pid)


def test_a_server_that_exits_during_the_run_is_the_backends_failure(tmp_path: Path) -> None:
    launched = LaunchedServer.start(launch_config(args=["--exit-after", "0.5"]), FIELDS, None)
    assert launched.failure() is None
    assert eventually(lambda: launched.failure() is not None)
    failure = launched.failure()
    assert failure is not None and "exited with status 3 during the run" in failure
    assert "crashing on purpose" in failure
    launched.release()  # an exited server is never kept
    assert server_keeper.kept_server() is None


def test_the_program_is_looked_up_on_the_path_the_server_gets(tmp_path: Path) -> None:
    """engine.launch.env.PATH that adds the server's folder finds it (the harness's own PATH
    does not have it); a null env value removes the variable from the server's environment."""
    folder = tmp_path / "bin"
    folder.mkdir()
    program = folder / "my-server"
    program.write_text(f'#!/bin/sh\necho "GONE=${{H38_GONE-unset}}"\nexec {sys.executable} "$@"\n')
    program.chmod(0o755)
    port = free_port("127.0.0.1")
    env = {"PATH": f"{folder}:{os.environ.get('PATH', '')}", "H38_GONE": None}
    os.environ["H38_GONE"] = "set"
    try:
        server = ServerProcess.start(
            ["my-server", FAKE, "--port", str(port)], f"http://127.0.0.1:{port}", env, None
        )
    finally:
        del os.environ["H38_GONE"]
    try:
        server.wait_ready("/health", 15.0)
        assert "GONE=unset" in server.tail()
    finally:
        server.stop(2.0)


def test_a_huge_line_of_the_log_is_cut_in_the_error(tmp_path: Path) -> None:
    """A server that writes megabytes on one line and dies: the error holds its last lines,
    each cut, not the megabytes (they are in server.log)."""
    code = "import sys; sys.stdout.write('x' * 3_000_000 + '\\nreal error\\n'); sys.exit(3)"
    server = ServerProcess.start(
        [sys.executable, "-c", code], "http://127.0.0.1:1", {}, tmp_path / "s.log"
    )
    with pytest.raises(ServerStartError) as caught:
        server.wait_ready("/health", 15.0)
    server.stop(1.0)
    message = str(caught.value)
    assert "status 3" in message and "real error" in message
    assert len(message) < 10_000 and "more bytes in the log" in message
    assert (tmp_path / "s.log").stat().st_size > 3_000_000


@pytest.mark.parametrize("host", ["8.8.8.8", "no-such-host.invalid"])
def test_a_host_nothing_can_listen_on_is_named(host: str) -> None:
    with pytest.raises(ServerStartError, match=r"engine\.launch\.host: cannot listen on"):
        LaunchedServer.start(launch_config(host=host), FIELDS, None)


def _running_with(text: str) -> list[int]:
    """The processes whose command line holds `text`."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text in (entry / "cmdline").read_text(errors="replace"):
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile
            continue
    return pids


def test_a_log_that_cannot_be_written_starts_no_server(tmp_path: Path) -> None:
    """server.log unwritable (a folder in its place): an error naming the log, and no server
    left running beside the next job's."""
    say = f"unwritable-log-{os.getpid()}"
    port = free_port("127.0.0.1")
    with pytest.raises(ServerStartError, match=r"server's log .* cannot be written"):
        ServerProcess.start(
            [sys.executable, FAKE, "--port", str(port), "--say", say],
            f"http://127.0.0.1:{port}",
            {},
            tmp_path,  # a folder
        )
    assert eventually(lambda: not [p for p in _running_with(say) if alive(p)])


def test_a_kept_server_whose_next_log_cannot_be_written_is_stopped(tmp_path: Path) -> None:
    first = LaunchedServer.start(launch_config(), FIELDS, tmp_path / "a.log")
    first.release()
    assert server_keeper.kept_server() is first.server
    with pytest.raises(ServerStartError, match="cannot be written"):
        LaunchedServer.start(launch_config(), FIELDS, tmp_path)  # a folder
    assert server_keeper.kept_server() is None
    assert not group_alive(first.server.pid)


def test_a_failing_reset_path_is_said_not_silent(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A reset_path the server does not serve: a new server per job, as documented, and a
    warning naming the key (else every job cold-starts without a word)."""
    first = LaunchedServer.start(launch_config(reset_path="/nope"), FIELDS, None)
    first.release()
    with caplog.at_level("WARNING", logger="engines.openai.launched"):
        second = LaunchedServer.start(launch_config(reset_path="/nope"), FIELDS, None)
    assert not second.reused
    assert any(
        "engine.launch.reset_path: POST /nope failed" in r.getMessage() for r in caplog.records
    )
    second.release()


def test_a_server_started_from_a_thread_outlives_the_thread_not_the_process(
    tmp_path: Path,
) -> None:
    """The death signal follows the thread that started the child (prctl(2)): a server
    started from a worker thread that has finished still runs, and still dies with the
    process (SIGKILL of the harness)."""
    pid_file = tmp_path / "server.pid"
    code = textwrap.dedent(
        f"""
        import sys, threading, time
        sys.path.insert(0, {str(Path(__file__).resolve().parents[3])!r})
        from engines.openai.launched import free_port
        from engines.openai.server_process import ServerProcess
        port = free_port("127.0.0.1")
        box = []
        def start():
            box.append(ServerProcess.start(
                [sys.executable, {FAKE!r}, "--port", str(port)],
                f"http://127.0.0.1:{{port}}", {{}}, None))
            box[0].wait_ready("/health", 30)  # as LaunchedServer.start does, in the thread
        worker = threading.Thread(target=start)
        worker.start()
        worker.join()
        time.sleep(1.0)  # the thread is long gone
        box[0].wait_ready("/health", 5)
        open({str(pid_file)!r}, "w").write(str(box[0].pid))
        time.sleep(600)
        """
    )
    killing_the_harness_ends_its_server(
        code, pid_file, still_running="the server died with the thread that started it"
    )


def test_a_server_never_ready_is_stopped_within_stop_timeout_s() -> None:
    """At the start-up timeout the server is stopped with engine.launch.stop_timeout_s between
    SIGTERM and SIGKILL (it waited 5 s for one deaf to SIGTERM, whatever the option said)."""
    launch = launch_config(
        args=["--never-ready", "--ignore-term"], startup_timeout_s=0.5, stop_timeout_s=0
    )
    began = time.monotonic()
    with pytest.raises(ServerStartError, match="startup_timeout_s"):
        LaunchedServer.start(launch, FIELDS, None)
    assert time.monotonic() - began < 4.0
