"""`interlock serve`: startup, SIGHUP reload under a running stream, graceful SIGTERM shutdown
and the forced one on a second signal, unknown config keys, and the exit codes of a gateway that
cannot start. Signals are real (sent to this process, or to an `interlock serve` subprocess)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import msgspec
import pytest
import trio

from events.log import list_segments, read_events
from events.types import RunStopped
from fixtures.node import serve_nodes
from interlock.serve import serve

from harness import (
    MODEL,
    CapturedLog,
    chat,
    completions_to,
    config_text,
    node_specs,
    nodes_and_gateway,
    serve_process,
    sse_events,
)

PROJECT_ROOT = Path(__file__).resolve().parent.parent
CHAT = "/v1/chat/completions"


async def test_sighup_mid_stream_the_stream_finishes_on_the_old_snapshot_and_new_requests_use_the_new(tmp_path):
    specs = node_specs(2, tokens=20, tpot=0.05)
    async with nodes_and_gateway(tmp_path, specs[:1]) as (_, gateway), serve_nodes(specs[1:]) as [second]:
        first = gateway.control_plane.view.snapshot.nodes
        async with gateway.http.stream("POST", gateway.url + CHAT, json=chat(stream=True)) as old_stream:
            assert old_stream.headers["x-served-by"] == "n1"
            chunks = old_stream.aiter_text()
            text = await chunks.__anext__()

            # The new config has only the second node, and one more model.
            gateway.config_path.write_text(config_text([second], models=[(MODEL, ""), ("extra", "")]))
            os.kill(os.getpid(), signal.SIGHUP)
            await gateway.wait_for(lambda: gateway.logged("config reloaded"))
            assert list(gateway.control_plane.view.snapshot.nodes) == [second.host] != list(first)

            response = await gateway.http.post(gateway.url + CHAT, json=chat())
            assert response.status_code == 200 and response.headers["x-served-by"] == "n2"
            models = (await gateway.http.get(gateway.url + "/v1/models")).json()
            assert [model["id"] for model in models["data"]] == [MODEL, "extra"]

            async for chunk in chunks:
                text += chunk
        events = sse_events(text)
        assert len(events) == 21 and events[-1] == "[DONE]"
        assert all(msgspec.json.decode(event)["id"] == msgspec.json.decode(events[0])["id"] for event in events[:-1])
        assert len(completions_to(second)) == 1


async def test_sigterm_drains_a_running_stream_then_stops_the_control_plane_and_exits_0(tmp_path):
    async with nodes_and_gateway(tmp_path, node_specs(1, tokens=10, tpot=0.05)) as (_, gateway):
        async with gateway.http.stream("POST", gateway.url + CHAT, json=chat(stream=True)) as stream:
            chunks = stream.aiter_text()
            text = await chunks.__anext__()
            os.kill(os.getpid(), signal.SIGTERM)
            async for chunk in chunks:
                text += chunk
        assert await gateway.exited() == 0
    assert sse_events(text)[-1] == "[DONE]"
    messages = gateway.log.messages()
    assert messages.index("shutting down") < messages.index("gateway stopped") == len(messages) - 1


async def test_a_request_in_flight_at_sigterm_is_still_retried_and_reported(tmp_path):
    # n1 sends its headers and no first chunk: the request is still waiting on n1 when SIGTERM
    # comes, and is retried on n2 (`retry_unanswered`) while the listeners drain; its attempt's
    # end is recorded by a gateway that has not stopped yet.
    specs = node_specs(2, tokens=5, tpot=0.02)
    specs[0].behaviour.completion = "no_first_chunk"
    timeouts = {"first_byte_timeout": "1s", "retry_unanswered": True}
    async with nodes_and_gateway(tmp_path, specs, **timeouts) as (nodes, gateway):
        answers = []

        async def stream() -> None:
            async with gateway.http.stream("POST", gateway.url + CHAT, json=chat(stream=True)) as response:
                answers.append((response.headers["x-served-by"], await response.aread()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            await gateway.wait_for(lambda: completions_to(nodes[0]))
            os.kill(os.getpid(), signal.SIGTERM)
        assert await gateway.exited() == 0
    [(served_by, body)] = answers
    assert served_by == "n2" and sse_events(body.decode())[-1] == "[DONE]"
    messages = gateway.log.messages()
    assert (
        messages.index("shutting down")
        < messages.index("retrying after streaming failure before first chunk")
        < messages.index("gateway stopped")
        == len(messages) - 1
    )


async def test_an_invalid_config_is_fatal_with_exit_1(tmp_path, capsys):
    config_path = tmp_path / "gateway.toml"
    config_path.write_text("[gateway]\nhealth_fail_threshold = -1\n")
    assert await serve(str(config_path), version="test", log=CapturedLog()) == 1
    assert capsys.readouterr().err.startswith(f"fatal: loading config: {config_path}")


STARTUP_MESSAGES = {
    "starting gateway",
    "config loaded",
    "standalone nodes serving non-ring models",
    "ring nodes",
    "model routed to ring",
    "api server listening",
    "metrics server listening",
}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def test_interlock_serve_starts_logs_plinths_lines_and_stops_on_sigterm(tmp_path):
    async with serve_nodes(node_specs(2)) as nodes:
        api_port, metrics_port = _free_port(), _free_port()
        config_path = tmp_path / "gateway.toml"
        config_path.write_text(
            config_text(nodes, rings={"n2": "r1"}, models=[(MODEL, ""), ("big", "r1")])
            .replace('listen = "127.0.0.1:0"', f'listen = "127.0.0.1:{api_port}"', 1)
            .replace('metrics_listen = "127.0.0.1:0"', f'metrics_listen = "127.0.0.1:{metrics_port}"')
        )
        process = await trio.lowlevel.open_process(
            [sys.executable, "-m", "interlock.cli", "serve", "--config", str(config_path)],
            stdout=subprocess.PIPE,
            cwd=PROJECT_ROOT,
        )
        output = b""
        try:
            with trio.fail_after(60):
                while b'"metrics server listening"' not in output:
                    output += await process.stdout.receive_some()
                async with httpx.AsyncClient() as client:
                    assert (await client.get(f"http://127.0.0.1:{api_port}/health")).status_code == 200
                    metrics = (await client.get(f"http://127.0.0.1:{metrics_port}/metrics")).text
                    assert "gateway_requests_total" in metrics and "_created" not in metrics
                process.send_signal(signal.SIGTERM)
                while chunk := await process.stdout.receive_some():
                    output += chunk
                assert await process.wait() == 0
        finally:
            if process.returncode is None:
                process.kill()
                await process.wait()

    lines = [msgspec.json.decode(line) for line in output.splitlines()]
    startup = [
        (line["msg"], {key: value for key, value in line.items() if key not in ("msg", "level", "timestamp", "seq")})
        for line in lines
        if line["msg"] in STARTUP_MESSAGES  # model discovery runs meanwhile, and logs too
    ]
    assert startup == [
        ("starting gateway", {"cluster": ""}),
        ("config loaded", {"nodes": "2", "models": "2"}),
        ("standalone nodes serving non-ring models", {"nodes": "n1"}),
        ("ring nodes", {"ring": "r1", "nodes": "n2"}),
        ("model routed to ring", {"model": "big", "ring": "r1"}),
        ("api server listening", {"addr": f"127.0.0.1:{api_port}"}),
        ("metrics server listening", {"addr": f"127.0.0.1:{metrics_port}"}),
    ]
    assert [line["msg"] for line in lines][-2:] == ["shutting down", "gateway stopped"]


# --- `interlock serve` as a subprocess -----------------------------------------------------------


def _listening_on(text: str, key: str, address: str) -> str:
    return text.replace(f'{key} = "127.0.0.1:0"', f'{key} = "{address}"', 1)


@pytest.mark.parametrize("key", ["listen", "metrics_listen"])
async def test_an_address_in_use_names_address_and_key_and_exits_1_before_probing_or_logging(tmp_path, key):
    event_log = tmp_path / "events.jsonl"
    async with serve_nodes(node_specs(1)) as nodes:
        with socket.socket() as taken:
            taken.bind(("127.0.0.1", 0))
            taken.listen()
            address = f"127.0.0.1:{taken.getsockname()[1]}"
            config_path = tmp_path / "gateway.toml"
            config_path.write_text(_listening_on(config_text(nodes, event_log=str(event_log)), key, address))
            async with serve_process(config_path) as gateway:
                code, lines, errors = await gateway.exit()
        assert list(nodes[0].requests) == []
    assert (code, errors) == (1, "")
    assert [(line["level"], line["msg"], line["error"]) for line in lines] == [
        ("error", "server error", f"cannot listen on {address} ({key}): address already in use")
    ]
    assert list_segments(event_log) == []


async def test_a_listen_address_serve_cannot_use_is_a_config_error(tmp_path):
    config_path = tmp_path / "gateway.toml"
    config_path.write_text(_listening_on(config_text([]) + '[[nodes]]\nip = "10.0.0.1"\n', "listen", "8000"))
    async with serve_process(config_path) as gateway:
        code, lines, errors = await gateway.exit()
    assert (code, lines) == (1, [])
    why = 'gateway.listen: invalid listen address "8000": missing port in address'
    assert errors == f"fatal: loading config: {config_path}: {why}\n"


async def test_unknown_keys_are_warned_at_start_and_on_reload(tmp_path):
    async with serve_nodes(node_specs(1)) as nodes:
        config_path = tmp_path / "gateway.toml"
        config_path.write_text(config_text(nodes, helth_interval="1s") + "[provision]\nssh_port = 22\n")
        async with serve_process(config_path) as gateway:
            await gateway.wait_for_log("metrics server listening")
            config_path.write_text(config_text(nodes).replace("vllm_port", "vlm_port") + '[gatway]\nlisten = ":1"\n')
            gateway.process.send_signal(signal.SIGHUP)
            await gateway.wait_for_log("config reloaded")
            gateway.process.send_signal(signal.SIGTERM)
            code, lines, errors = await gateway.exit()
    assert (code, errors) == (0, "")
    warnings = [
        (line["msg"], {key: value for key, value in line.items() if key not in ("msg", "timestamp")})
        for line in lines
        if line["level"] == "warn" and line["msg"] != "node reports no models"
    ]
    path = str(config_path)
    assert warnings == [
        (
            "unknown config key",
            {"level": "warn", "file": path, "key": "gateway.helth_interval", "did_you_mean": "gateway.health_interval"},
        ),
        (
            "unknown config key",
            {"level": "warn", "file": path, "key": "nodes[0].vlm_port", "did_you_mean": "nodes[0].vllm_port"},
        ),
        ("unknown config key", {"level": "warn", "file": path, "key": "gatway", "did_you_mean": "gateway"}),
    ]
    messages = [line["msg"] for line in lines]
    assert messages.index("metrics server listening") < messages.index("config reloaded")
    assert messages[-1] == "gateway stopped"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize(("signum", "workers"), [(signal.SIGTERM, 1), (signal.SIGINT, 1), (signal.SIGTERM, 2)])
async def test_a_second_signal_during_the_drain_forces_the_shutdown_and_still_exits_0(tmp_path, signum, workers):
    # A stream of 1,000 tokens at 20 a second keeps the drain busy far longer than the test.
    async with serve_nodes(node_specs(1, tokens=1000, tpot=0.05)) as nodes:
        api_port = _free_port()
        config_path = tmp_path / "gateway.toml"
        event_log = tmp_path / "events.jsonl"
        text = config_text(nodes, event_log=str(event_log), workers=workers)
        config_path.write_text(_listening_on(text, "listen", f"127.0.0.1:{api_port}"))
        async with serve_process(config_path) as gateway:
            await gateway.wait_for_log("metrics server listening")
            received = b""
            async with httpx.AsyncClient(timeout=60) as client:
                url = f"http://127.0.0.1:{api_port}{CHAT}"
                async with client.stream("POST", url, json=chat(stream=True)) as stream:
                    chunks = stream.aiter_bytes()
                    received += await chunks.__anext__()
                    gateway.process.send_signal(signum)
                    await gateway.wait_for_log("shutting down")
                    gateway.process.send_signal(signum)
                    await gateway.wait_for_log("forced shutdown")
                    gateway.process.send_signal(signum)  # a late one: ignored, or re-raised into SIG_IGN
                    with pytest.raises(httpx.RemoteProtocolError):
                        async for chunk in chunks:
                            received += chunk
            code, lines, errors = await gateway.exit()
    assert (code, errors) == (0, "")
    assert b"[DONE]" not in received
    messages = [line["msg"] for line in lines]
    assert messages.index("shutting down") < messages.index("forced shutdown") < messages.index("gateway stopped")
    assert messages[-1] == "gateway stopped"
    [forced] = [line for line in lines if line["msg"] == "forced shutdown"]
    assert (forced["level"], forced["reason"]) == ("warn", f"second {signum.name}")
    assert isinstance(list(read_events([event_log]))[-1], RunStopped)  # the event log was flushed
    worker_pids = [int(line["pid"]) for line in lines if line["msg"] == "worker started"]
    assert len(worker_pids) == (workers if workers > 1 else 0)
    assert not any(_running(pid) for pid in worker_pids)  # killed, not left draining


def test_serve_help_documents_the_signals_and_exit_codes():
    result = subprocess.run(
        [sys.executable, "-m", "interlock.cli", "serve", "--help"],
        capture_output=True,
        text=True,
        check=False,
        cwd=PROJECT_ROOT,
    )
    assert result.returncode == 0
    help_text = " ".join(result.stdout.split())
    for promise in [
        "SIGHUP reload the config file",
        "SIGTERM, SIGINT graceful shutdown",
        "finish (for up to --shutdown-grace; a stream still open then ends with an error event)",
        "a second one forced shutdown: connections still open are closed at once",
        "any more are ignored",
        "exit codes: 0 after a shutdown by signal, 1 if the gateway cannot start",
    ]:
        assert promise in help_text
