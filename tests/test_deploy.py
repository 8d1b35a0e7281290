"""Running Interlock as a service: the systemd unit, its system user and example config
(`deploy/`), checked with systemd's own tools; and the container image, built and run with podman.

systemd is not PID 1 here, so the unit is verified (`systemd-analyze verify`, `security`), not
started. The image is built from a Debian bookworm root made by debootstrap (the registries that
serve base images are out of reach) and a wheelhouse made on the host, then run with a simulated
node inside the same container.
"""

from __future__ import annotations

import fcntl
import json
import resource
import shutil
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import pytest

from controlplane.infrastructure.config import load_config

from harness import required_program

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "interlock.service"
SHIPPED_INTERLOCK = "/opt/interlock/.venv/bin/interlock"


def unit_settings(text: str) -> dict[str, list[str]]:
    """Every `Key=value` of a unit file (a key may repeat), ignoring sections and comments."""
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", ";", "[")):
            key, value = line.split("=", 1)
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


SETTINGS = unit_settings(UNIT.read_text())


def unit_for_this_venv(tmp_path: Path, text: str | None = None) -> Path:
    """The unit with ExecStart pointing at this venv's interlock (verify wants an existing binary)."""
    tmp_path.mkdir(exist_ok=True)
    unit = tmp_path / "interlock.service"
    unit.write_text(
        (text or UNIT.read_text()).replace(SHIPPED_INTERLOCK, str(Path(sys.executable).parent / "interlock"))
    )
    return unit


def run(*command: object, timeout: float = 120, **options) -> subprocess.CompletedProcess:
    command_line = [str(part) for part in command]
    return subprocess.run(command_line, check=False, capture_output=True, text=True, timeout=timeout, **options)


# --- the systemd unit ------------------------------------------------------------------------


def test_the_unit_runs_the_gateway_as_its_own_user_reloads_on_sighup_and_restarts_on_failure():
    assert SETTINGS["ExecStart"] == [f"{SHIPPED_INTERLOCK} serve --config /etc/interlock/gateway.toml"]
    assert SETTINGS["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert SETTINGS["Restart"] == ["on-failure"]
    assert SETTINGS["User"] == SETTINGS["Group"] == ["interlock"]
    assert (SETTINGS["ConfigurationDirectory"], SETTINGS["StateDirectory"], SETTINGS["LogsDirectory"]) == (
        ["interlock"],
        ["interlock"],
        ["interlock"],
    )


def test_systemd_analyze_verifies_the_unit_without_a_warning(tmp_path):
    systemd_analyze = required_program("systemd-analyze", "apt-get install systemd")
    result = run(systemd_analyze, "verify", unit_for_this_venv(tmp_path))
    assert result.returncode == 0, result.stderr
    assert "interlock.service" not in result.stderr  # verify names the unit in each of its complaints
    # ... as it does for a mistake in it, which would not change the exit code:
    broken = unit_for_this_venv(
        tmp_path / "broken", UNIT.read_text().replace("Restart=on-failure", "Restart=on-failur")
    )
    complaint = run(systemd_analyze, "verify", broken).stderr
    assert "interlock.service" in complaint and "on-failur" in complaint


def test_the_unit_is_hardened(tmp_path):
    """systemd's exposure score of the unit (0 best, 10 worst) stays at 2.0 or below."""
    systemd_analyze = required_program("systemd-analyze", "apt-get install systemd")
    unit = unit_for_this_venv(tmp_path)
    result = run(systemd_analyze, "security", "--offline=true", "--threshold=20", unit)
    assert result.returncode == 0, result.stdout[-2000:]
    assert "Overall exposure level for interlock.service" in result.stdout
    for setting in ("NoNewPrivileges", "ProtectSystem", "PrivateTmp", "PrivateDevices", "RestrictSUIDSGID"):
        assert SETTINGS[setting] in (["yes"], ["strict"])
    assert SETTINGS["CapabilityBoundingSet"] == [""]


def test_sysusers_creates_the_services_dedicated_user(tmp_path):
    sysusers = required_program("systemd-sysusers", "apt-get install systemd")
    (tmp_path / "etc").mkdir()
    result = run(sysusers, f"--root={tmp_path}", DEPLOY / "interlock.sysusers")
    assert result.returncode == 0, result.stderr
    users = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    _, _, uid, _, _, home, shell = users["interlock"]
    assert int(uid) < 1000  # a system user
    assert home == "/var/lib/" + SETTINGS["StateDirectory"][0]
    assert shell in ("/usr/sbin/nologin", "/sbin/nologin")
    assert "interlock:" in (tmp_path / "etc/group").read_text()


def test_the_example_config_loads_and_writes_only_where_the_unit_lets_it():
    config_path = SETTINGS["ExecStart"][0].split("--config ")[1]
    assert config_path == f"/etc/{SETTINGS['ConfigurationDirectory'][0]}/gateway.toml"
    gateway = load_config(DEPLOY / "gateway.toml").gateway
    assert Path(gateway.event_log).parent == Path("/var/lib", SETTINGS["StateDirectory"][0])
    assert Path(gateway.decision_log).parent == Path("/var/log", SETTINGS["LogsDirectory"][0])
    assert SETTINGS["ProtectSystem"] == ["strict"]  # so nothing else is writable


# --- the container image ---------------------------------------------------------------------

BASE_IMAGE = "localhost/interlock-test-base:bookworm"
"""What docker.io/library/debian:bookworm-slim would be, made with debootstrap; kept between runs."""
CONTAINER_CONFIG = """
[gateway]
listen = "127.0.0.1:8000"
metrics_listen = "127.0.0.1:9090"
health_interval = "200ms"
event_log = "/var/lib/interlock/events.jsonl"
decision_log = "/var/log/interlock/decisions.jsonl"

[[nodes]]
ip = "127.0.0.2"
name = "simulated"

[models]
default = "test-model"

[[models.available]]
name = "test-model"
"""
HTTP_IN_CONTAINER = """
import json, sys, urllib.request
body = sys.argv[2].encode() or None
request = urllib.request.Request(sys.argv[1], data=body, headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=10) as response:
    print(json.dumps({"status": response.status, "body": json.loads(response.read())}))
"""


class Podman:
    """podman with the options this machine needs: runc (crun refuses its hybrid cgroups) and
    resource limits no higher than ours (podman's defaults need CAP_SYS_RESOURCE, which root lacks here)."""

    def __init__(self, program: str):
        nofile = resource.getrlimit(resource.RLIMIT_NOFILE)
        self.program = program
        self.limits = ["--ulimit", f"nofile={nofile[0]}:{nofile[1]}", "--ulimit", "nproc=4096:4096"]

    def __call__(self, *arguments: object, check: bool = True, timeout: float = 600, **options):
        result = run(self.program, "--runtime", "runc", *arguments, timeout=timeout, **options)
        if check and result.returncode != 0:
            pytest.fail(f"podman {' '.join(map(str, arguments))}: {result.stderr[-3000:]}")
        return result


def ensure_base_image(podman: Podman, workdir: Path) -> None:
    """Import a debootstrapped Debian bookworm as BASE_IMAGE unless an earlier run did (one run at a time)."""
    with open("/var/tmp/interlock-test-base.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if podman("image", "exists", BASE_IMAGE, check=False).returncode == 0:
            return
        debootstrap = required_program("debootstrap", "apt-get install debootstrap")
        root = workdir / "rootfs"
        made = run(debootstrap, "--variant=minbase", "bookworm", root, "http://deb.debian.org/debian", timeout=1800)
        assert made.returncode == 0, made.stdout[-3000:]
        with subprocess.Popen(["tar", "-C", str(root), "-c", "."], stdout=subprocess.PIPE) as tar:
            podman("import", "-", BASE_IMAGE, stdin=tar.stdout)
        shutil.rmtree(root)


SOURCE_ONLY_DEPENDENCIES = ("nkeys",)
"""Dependencies PyPI has as source distributions only (pure Python): their wheels are built
here, as README's `pip wheel` builds them, since a download for the image's platform takes
wheels only."""


def wheelhouse(context: Path) -> None:
    """Interlock's wheel and its dependencies' for the image's Python (3.11), in context/wheels."""
    source = context / "source"
    source.mkdir()
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source)
    for package in dict.fromkeys(name.split(".")[0] for name in project["tool"]["setuptools"]["packages"]):
        shutil.copytree(REPO / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    wheels = context / "wheels"
    pip = [sys.executable, "-m", "pip", "--quiet", "--disable-pip-version-check"]
    built = run(*pip, "wheel", "--no-deps", "--wheel-dir", wheels, source, timeout=600)
    assert built.returncode == 0, built.stderr[-3000:]
    platform = ["--implementation", "cp", "--python-version", "3.11", "--abi", "cp311", "--only-binary=:all:"]
    platform += ["--platform", "manylinux2014_x86_64", "--platform", "manylinux_2_28_x86_64"]
    source_only = [r for r in project["project"]["dependencies"] if r.startswith(SOURCE_ONLY_DEPENDENCIES)]
    made = run(*pip, "wheel", "--no-deps", "--wheel-dir", wheels, *source_only, timeout=600)
    assert made.returncode == 0, made.stderr[-3000:]
    wheel = next(wheels.glob("interlock-*.whl"))
    fetched = run(*pip, "download", "--dest", wheels, "--find-links", wheels, *platform, wheel, timeout=600)
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    shutil.rmtree(source)


def test_the_container_image_builds_serves_reloads_and_stops(tmp_path):
    podman = Podman(required_program("podman", "apt-get install podman runc"))
    required_program("runc", "apt-get install runc")
    ensure_base_image(podman, tmp_path)
    context = tmp_path / "context"
    context.mkdir()
    for name in ("Containerfile", "gateway.toml"):
        shutil.copy(DEPLOY / name, context)
    wheelhouse(context)
    image = f"localhost/interlock-test:{uuid.uuid4().hex[:12]}"
    container = image.rsplit(":", 1)[1]
    config = tmp_path / "gateway.toml"
    config.write_text(CONTAINER_CONFIG)
    config.chmod(0o644)
    python = "/opt/interlock/.venv/bin/python"

    def http(url: str, body: dict | None = None) -> dict:
        """GET (or POST `body` to) a URL from inside the container: {"status", "body"}, or {} if it failed."""
        data = json.dumps(body) if body else ""
        answer = podman("exec", container, python, "-c", HTTP_IN_CONTAINER, url, data, check=False)
        return json.loads(answer.stdout) if answer.returncode == 0 else {}

    def node_models_state() -> str:
        details = http("http://127.0.0.1:8000/health").get("body", {}).get("details") or [{}]
        return details[0].get("models", {}).get("state", "")

    def wait_for(condition) -> None:
        deadline = time.monotonic() + 120  # a hang guard, not a speed check
        while not condition():
            assert time.monotonic() < deadline, podman("logs", container).stdout[-3000:]
            time.sleep(0.3)

    try:
        podman("build", "--network", "host", *podman.limits, "--build-arg", f"BASE={BASE_IMAGE}", "-t", image, context)
        # The config the image carries loads.
        check = ["check-config", "/etc/interlock/gateway.toml"]
        assert podman("run", "--rm", "--network", "none", *podman.limits, image, *check).stdout.startswith("ok\n")
        # The gateway and a simulated node in the container's own network namespace (no ports on the host).
        volume = ["-v", f"{config}:/etc/interlock/gateway.toml:ro"]
        podman("run", "-d", "--name", container, "--network", "none", *podman.limits, *volume, image)
        # The simulated node is not in the wheel: it comes from the checkout.
        podman("cp", str(REPO / "fixtures"), f"{container}:/tmp/fixtures")
        node = ["-m", "fixtures.node", "--host", "127.0.0.2", "--base-port", "8000", "--metrics-base-port", "9100"]
        podman("exec", "-d", "--workdir", "/tmp", container, python, *node, "--models", "test-model")
        wait_for(lambda: node_models_state() == "known")
        chat = {"model": "test-model", "messages": [{"role": "user", "content": "hello"}]}
        answer = http("http://127.0.0.1:8000/v1/chat/completions", chat)
        assert answer["status"] == 200 and answer["body"]["choices"][0]["message"]["content"]

        podman("kill", "--signal", "HUP", container)
        wait_for(lambda: '"msg":"config reloaded"' in podman("logs", container).stdout)
        podman("stop", "--time", "60", container)
        exit_code = podman("inspect", container, "--format", "{{.State.ExitCode}}").stdout.strip()
        log = podman("logs", container).stdout
        assert exit_code == "0" and '"msg":"gateway stopped"' in log, log[-3000:]
        # The decision and event logs were written where the unit keeps them too.
        podman("cp", f"{container}:/var/log/interlock/decisions.000001.jsonl", tmp_path / "decisions.jsonl")
        decisions = [json.loads(line) for line in (tmp_path / "decisions.jsonl").read_text().splitlines()]
        assert [(decision["model"], decision["status"]) for decision in decisions] == [("test-model", 200)]
        podman("cp", f"{container}:/var/lib/interlock/events.000001.jsonl", tmp_path / "events.jsonl")
        assert '"type":"run_stopped"' in (tmp_path / "events.jsonl").read_text().splitlines()[-1]
    finally:
        podman("rm", "--force", container, check=False)
        podman("rmi", "--force", image, check=False)


# --- the license -----------------------------------------------------------------------------


def test_the_license_file_is_the_license_pyproject_names():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license-files"] == ["LICENSE"]
    assert (REPO / "LICENSE").read_text().splitlines()[0] == f"{project['license']} License"
