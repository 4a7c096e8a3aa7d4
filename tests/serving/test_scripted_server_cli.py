"""`python -m serving.scripted_server`: a port it cannot use is one line that names its own
option, never a traceback or another port."""

from __future__ import annotations

import socket

import pytest

from serving import scripted_server


def test_a_port_out_of_range_is_refused_not_wrapped(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the socket layer takes a port modulo 65536: 99999 listened on 34463
    def serve(*args: object, **kwargs: object) -> None:
        raise AssertionError("the server started")

    monkeypatch.setattr(scripted_server.uvicorn.Server, "run", serve)
    with pytest.raises(SystemExit) as stop:
        scripted_server.main(["--port", "99999"])
    assert stop.value.code == 2
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith("error: --port: 99999 is invalid; allowed: 0..65535 (0: any free port)")
    )


def test_a_port_in_use_is_one_line_naming_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(SystemExit) as stop:
            scripted_server.main(["--port", str(port)])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error == (
        f"python -m serving.scripted_server: error: port: cannot listen on 127.0.0.1:{port}: "
        "Address already in use (is another server using it? choose another --port, or "
        "--port 0 for any free one)"
    )
