"""Config loading and validation (plinth §1): messages, order, defaults, Go durations."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from controlplane.infrastructure.config import ConfigError, Overrides, UnknownKey, load_config
from controlplane.infrastructure.gocompat import format_go_duration, go_quote, parse_go_duration, parse_listen_address
from events.config import (
    DEFAULT_HEALTH_INTERVAL,
    DEFAULT_LOAD_SCRAPE_INTERVAL,
    DEFAULT_MAX_BUFFERED_RESPONSE_BYTES,
    DEFAULT_MAX_REQUEST_BODY_BYTES,
    AdmissionConfig,
    Config,
    FleetConfig,
    GatewayConfig,
    ModelEntry,
    ModelsConfig,
    NodeConfig,
    RoutingConfig,
    UpstreamTimeouts,
)
from interlock.describe import describe_config
from fixtures.tokenizer_dir import write_tokenizer_dir

REPO_ROOT = Path(__file__).resolve().parent.parent

ONE_NODE = """
[[nodes]]
ip = "10.0.0.1"
name = "gpu-node-1"
"""


def write_config(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gateway.toml"
    path.write_text(text, encoding="utf-8")
    return path


def load_text(tmp_path: Path, text: str) -> Config:
    return load_config(write_config(tmp_path, text))


def load_error(tmp_path: Path, text: str) -> ConfigError:
    path = write_config(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.path == str(path)
    return caught.value


def gateway_with(line: str) -> str:
    return f"[gateway]\n{line}\n{ONE_NODE}"


# --- validation messages ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('health_interval = "0"', "health_interval must be greater than zero"),
        ('health_interval = "-1s"', "health_interval must be greater than zero"),
        ('health_interval = "0.1ns"', "health_interval must be greater than zero"),
        ("health_fail_threshold = -1", "health_fail_threshold must be greater than zero"),
        (
            "max_buffered_response_bytes = -2",
            "max_buffered_response_bytes must be -1 (unlimited) or non-negative",
        ),
        (
            "max_request_body_bytes = -1",
            "max_request_body_bytes must be non-negative (0 uses the default)",
        ),
        ('probe_timeout = "0s"', "probe_timeout must be greater than zero"),
        ('probe_timeout = "-5s"', "probe_timeout must be greater than zero"),
        ("event_log_max_bytes = -1", "event_log_max_bytes must be greater than zero"),
        ('request_body_timeout = "0s"', "request_body_timeout must be greater than zero"),
        ('request_body_idle_timeout = "-1s"', "request_body_idle_timeout must be greater than zero"),
        ('request_body_idle_timeout = "10"', 'parsing request_body_idle_timeout: time: missing unit in duration "10"'),
        ('response_body_timeout = "0s"', "response_body_timeout must be greater than zero"),
        ('connect_timeout = "0s"', "connect_timeout must be greater than zero"),
        ('first_byte_timeout = "-1s"', "first_byte_timeout must be greater than zero"),
        ('response_timeout = "0s"', "response_timeout must be greater than zero"),
        ('response_timeout = "5"', 'parsing response_timeout: time: missing unit in duration "5"'),
        ("response_timeout = 300", 'parsing config: response_timeout must be a duration string such as "1s", "500ms" or "2m" (got 300)'),
        ('shutdown_grace = "-1s"', "shutdown_grace must be non-negative"),
        ('shutdown_grace = "90"', 'parsing shutdown_grace: time: missing unit in duration "90"'),
        ("event_log_retain_bytes = -1", "event_log_retain_bytes must be non-negative (0: no bound)"),
        ('event_log_retain_age = "-1h"', "event_log_retain_age must be non-negative (0: no bound)"),
        ("decision_log_max_bytes = -1", "decision_log_max_bytes must be greater than zero"),
        ("decision_log_retain_bytes = -1", "decision_log_retain_bytes must be non-negative (0: no bound)"),
        ('decision_log_retain_age = "-1s"', "decision_log_retain_age must be non-negative (0: no bound)"),
        ('decision_log_retain_age = "a week"', 'parsing decision_log_retain_age: time: invalid duration "a week"'),
        ('decision_log = "var/log.jsonl"\nevent_log = "var/log.jsonl"', "decision_log must not be the event log's path"),
        ('health_interval = "3"', 'parsing health_interval: time: missing unit in duration "3"'),
        ('health_interval = "soon"', 'parsing health_interval: time: invalid duration "soon"'),
        ('probe_timeout = "5x"', 'parsing probe_timeout: time: unknown unit "x" in duration "5x"'),
    ],
)
def test_gateway_value_errors(tmp_path: Path, line: str, message: str) -> None:
    key = "gateway." + line.split(" = ")[0]
    error = load_error(tmp_path, gateway_with(line))
    assert (error.key, error.message) == (key, message)
    assert str(error) == f"{error.path}: {key}: {message}"


def test_no_nodes(tmp_path: Path) -> None:
    error = load_error(tmp_path, '[cluster]\nname = "empty"\n')
    assert error.message == "at least one node must be configured"
    assert error.key == "nodes"


def test_duplicate_node_ip_is_go_quoted(tmp_path: Path) -> None:
    text = '[[nodes]]\nip = "10.0.0.1"\n[[nodes]]\nip = "10.0.0.2"\n[[nodes]]\nip = "10.0.0.1"\n'
    error = load_error(tmp_path, text)
    assert error.message == 'duplicate node IP "10.0.0.1": plinth node identity is IP-based'
    assert str(error) == f"{error.path}: nodes[2].ip: {error.message}"

    escaped = load_error(tmp_path, '[[nodes]]\nip = "a\\"b\\n"\n[[nodes]]\nip = "a\\"b\\n"\n')
    assert escaped.message == 'duplicate node IP "a\\"b\\n": plinth node identity is IP-based'


def test_model_ring_without_nodes(tmp_path: Path) -> None:
    text = ONE_NODE + (
        '[[models.available]]\nname = "a"\n'
        '[[models.available]]\nname = "big"\nring = "ring-x"\n'
    )
    error = load_error(tmp_path, text)
    assert error.message == 'model "big" references ring "ring-x", but no node belongs to that ring'
    assert error.key == "models.available[1].ring"


def test_ringless_model_without_standalone_node(tmp_path: Path) -> None:
    text = '[[nodes]]\nip = "10.0.0.3"\nring = "ring-a"\n[[models.available]]\nname = "small"\n'
    error = load_error(tmp_path, text)
    assert error.message == 'model "small" has no ring, but every node belongs to a ring'
    assert str(error) == f"{error.path}: models.available[0].ring: {error.message}"


def test_models_default_is_not_validated(tmp_path: Path) -> None:
    config = load_text(tmp_path, ONE_NODE + '[models]\ndefault = "served-nowhere"\n')
    assert config.models.default == "served-nowhere"


def test_empty_node_ip_is_not_validated(tmp_path: Path) -> None:
    assert load_text(tmp_path, "[[nodes]]\nname = 'no-ip'\n").nodes[0].ip == ""


# --- Interlock's checks after plinth's ---------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [
        (gateway_with('listen = "8000"'), "gateway.listen", 'invalid listen address "8000": missing port in address'),
        (
            gateway_with('metrics_listen = "localhost:99999"'),
            "gateway.metrics_listen",
            'invalid listen address "localhost:99999": invalid port "99999"',
        ),
        (
            gateway_with('listen = ":9100"\nmetrics_listen = ":9100"'),
            "gateway.metrics_listen",
            'metrics_listen ":9100" and listen ":9100" both bind port 9100',
        ),
        (
            gateway_with('listen = ":8000"\nmetrics_listen = "127.0.0.1:8000"'),
            "gateway.metrics_listen",
            'metrics_listen "127.0.0.1:8000" and listen ":8000" both bind port 8000',
        ),
        (
            gateway_with('listen = "[::]:8000"\nmetrics_listen = "127.0.0.1:8000"'),
            "gateway.metrics_listen",
            'metrics_listen "127.0.0.1:8000" and listen "[::]:8000" both bind port 8000',
        ),
        (
            ONE_NODE + '[[nodes]]\nip = "10.0.0.2"\n[[nodes]]\nip = "10.0.0.256"\n',
            "nodes[2].ip",
            'invalid node IP "10.0.0.256": not a valid IPv4 address',
        ),
        ('[[nodes]]\nip = "10.0.0"\n', "nodes[0].ip", 'invalid node IP "10.0.0": not a valid IPv4 address'),
        (
            '[[nodes]]\nip = "10.0.0.1:8000"\n',
            "nodes[0].ip",
            'invalid node IP "10.0.0.1:8000": not a valid IPv6 address (ports go in vllm_port and metrics_port)',
        ),
        (
            '[[nodes]]\nip = "http://gpu-1"\n',
            "nodes[0].ip",
            'invalid node IP "http://gpu-1": not a valid IPv6 address (ports go in vllm_port and metrics_port)',
        ),
        (ONE_NODE + "vllm_port = 70000\n", "nodes[0].vllm_port", "vllm_port must be between 1 and 65535 (got 70000)"),
        (
            ONE_NODE + 'scheduling = "lifo"\n',
            "nodes[0].scheduling",
            'scheduling must be one of fcfs, priority (got "lifo")',
        ),
        (
            ONE_NODE + "metrics_port = -1\n",
            "nodes[0].metrics_port",
            "metrics_port must be between 1 and 65535 (got -1)",
        ),
        (
            '[[nodes]]\nip = "10.0.0.1"\n[[nodes]]\nip = "10.0.0.3"\nring = "ring-a"\n'
            '[[models.available]]\nname = "big"\n[[models.available]]\nname = "small"\n'
            '[[models.available]]\nname = "big"\nring = "ring-a"\n',
            "models.available[2].name",
            'model "big" is listed twice: models.available[0] (standalone) and models.available[2] (ring "ring-a")',
        ),
    ],
)
def test_addresses_ports_and_models_plinth_accepts_and_serve_cannot_use(
    tmp_path: Path, text: str, key: str, message: str
) -> None:
    error = load_error(tmp_path, text)
    assert (error.key, error.message) == (key, message)


@pytest.mark.parametrize(
    "text",
    [
        gateway_with('listen = "127.0.0.1:0"\nmetrics_listen = "127.0.0.1:0"'),  # two free ports
        gateway_with('listen = "127.0.0.1:8000"\nmetrics_listen = "127.0.0.2:8000"'),
        gateway_with('listen = "[::1]:8000"\nmetrics_listen = "localhost:9090"'),
        '[[nodes]]\nip = "gpu-node-1.cluster.internal"\n[[nodes]]\nip = "fe80::1"\n[[nodes]]\nip = ""\n',
        ONE_NODE + "vllm_port = 65535\nmetrics_port = 1\n",
    ],
)
def test_addresses_and_ports_serve_can_use_are_accepted(tmp_path: Path, text: str) -> None:
    load_text(tmp_path, text)


def test_plinths_checks_come_first(tmp_path: Path) -> None:
    text = gateway_with('listen = "8000"') + '[[models.available]]\nname = "m"\nring = "nowhere"\n'
    assert load_error(tmp_path, text).key == "models.available[0].ring"


# --- validation order -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("gateway_lines", "nodes", "expected"),
    [
        # health_interval before health_fail_threshold
        ('health_interval = "0s"\nhealth_fail_threshold = -1', ONE_NODE, "health_interval must"),
        # threshold before the buffered-response limit
        (
            "health_fail_threshold = -1\nmax_buffered_response_bytes = -5",
            ONE_NODE,
            "health_fail_threshold must",
        ),
        # buffered-response limit before the request-body limit
        (
            "max_request_body_bytes = -1\nmax_buffered_response_bytes = -5",
            ONE_NODE,
            "max_buffered_response_bytes must",
        ),
        # request-body limit before Interlock's own keys
        ('max_request_body_bytes = -1\nprobe_timeout = "0s"', ONE_NODE, "max_request_body_bytes must"),
        # gateway keys before the node checks
        ("event_log_max_bytes = -1", "", "event_log_max_bytes must"),
        # a duration that does not parse fails before any validation
        ('health_fail_threshold = -1\nhealth_interval = "x"', ONE_NODE, "parsing health_interval"),
        # a wrong TOML type fails before the durations are parsed
        ('health_interval = "x"\nlisten = 8000', ONE_NODE, "parsing config"),
    ],
)
def test_first_failure_wins(tmp_path: Path, gateway_lines: str, nodes: str, expected: str) -> None:
    error = load_error(tmp_path, f"[gateway]\n{gateway_lines}\n{nodes}")
    assert error.message.startswith(expected)


def test_duplicate_ip_before_ring_checks(tmp_path: Path) -> None:
    text = ONE_NODE + ONE_NODE + '[[models.available]]\nname = "m"\nring = "nowhere"\n'
    assert load_error(tmp_path, text).message.startswith("duplicate node IP")


def test_models_are_checked_in_order(tmp_path: Path) -> None:
    text = (
        '[[nodes]]\nip = "10.0.0.3"\nring = "ring-a"\n'
        '[[models.available]]\nname = "first"\n'
        '[[models.available]]\nname = "second"\nring = "nowhere"\n'
    )
    error = load_error(tmp_path, text)
    assert error.message == 'model "first" has no ring, but every node belongs to a ring'


# --- reading and decoding ---------------------------------------------------------------------


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    error = caught.value
    assert error.key == ""
    assert error.message == f"reading config: [Errno 2] No such file or directory: '{path}'"
    assert str(error) == f"{path}: reading config: [Errno 2] No such file or directory: '{path}'"


def test_directory_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(tmp_path)
    assert caught.value.message == f"reading config: [Errno 21] Is a directory: '{tmp_path}'"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path: Path) -> None:
    path = write_config(tmp_path, ONE_NODE)
    path.chmod(0)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.message == f"reading config: [Errno 13] Permission denied: '{path}'"


def test_toml_syntax_error(tmp_path: Path) -> None:
    error = load_error(tmp_path, "[gateway\nlisten = ':8000'\n")
    assert error.key == ""
    assert error.message.startswith("parsing config: ")
    assert "line 1" in error.message


def test_invalid_utf8(tmp_path: Path) -> None:
    path = tmp_path / "gateway.toml"
    path.write_bytes(b'[cluster]\nname = "\xff"\n')
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert caught.value.message.startswith("parsing config: ")


NODE_2 = '[[nodes]]\nip = "10.0.0.2"\n'
DURATION_FORM = 'must be a duration string such as "1s", "500ms" or "2m"'


@pytest.mark.parametrize(
    ("text", "key", "message"),
    [
        (gateway_with('health_fail_threshold = "3"'), "gateway.health_fail_threshold", "Expected `int`, got `str`"),
        (gateway_with("listen = 8000"), "gateway.listen", "Expected `str`, got `int`"),
        (gateway_with("health_interval = 3"), "gateway.health_interval", f"health_interval {DURATION_FORM} (got 3)"),
        (gateway_with("probe_timeout = 1.5"), "gateway.probe_timeout", f"probe_timeout {DURATION_FORM} (got 1.5)"),
        (gateway_with("max_request_body_bytes = 1.5"), "gateway.max_request_body_bytes", "Expected `int`, got `float`"),
        (gateway_with('retry_unanswered = "yes"'), "gateway.retry_unanswered", "Expected `bool`, got `str`"),
        (ONE_NODE + NODE_2 + 'vllm_port = "8000"\n', "nodes[1].vllm_port", "Expected `int`, got `str`"),
        (ONE_NODE + "[[models.available]]\nname = 7\n", "models.available[0].name", "Expected `str`, got `int`"),
        ('gateway = "fast"\n' + ONE_NODE, "gateway", "Expected `object`, got `str`"),
        ('[nodes]\nip = "10.0.0.1"\n', "nodes", "Expected `array`, got `object`"),
    ],
)
def test_wrong_toml_type_names_the_key(tmp_path: Path, text: str, key: str, message: str) -> None:
    error = load_error(tmp_path, text)
    assert (error.key, error.message) == (key, f"parsing config: {message}")
    assert str(error) == f"{error.path}: {key}: parsing config: {message}"


def load_reporting_unknown_keys(tmp_path: Path, text: str) -> tuple[Config, list[tuple[str, str]]]:
    path = write_config(tmp_path, text)
    unknown: list[UnknownKey] = []
    config = load_config(path, warn=unknown.append)
    assert {key.path for key in unknown} <= {str(path)}
    return config, [(key.key, key.closest) for key in unknown]


def test_unknown_keys_are_ignored_and_reported(tmp_path: Path) -> None:
    text = (
        'top_level = 1\n[cluster]\nname = "c"\nregion = "eu"\n'
        "[gateway]\nrequest_overload_threshold = 3\n"
        '[[nodes]]\nip = "10.0.0.1"\ngpu_count = 8\n'
        '[[models.available]]\nname = "m"\nquantization = "q4"\n'
        "[telemetry]\nenabled = true\n"
    )
    config, unknown = load_reporting_unknown_keys(tmp_path, text)
    assert config.cluster.name == "c"
    assert config.nodes == (NodeConfig(ip="10.0.0.1"),)
    assert config.models.available == (ModelEntry(name="m"),)
    assert unknown == [
        ("top_level", ""),
        ("cluster.region", ""),
        ("gateway.request_overload_threshold", "gateway.request_body_timeout"),
        ("nodes[0].gpu_count", ""),
        ("models.available[0].quantization", ""),
        ("telemetry", ""),
    ]


def test_misspelt_keys_are_reported_with_the_closest_known_key(tmp_path: Path) -> None:
    text = (
        '[gateway]\nhelth_interval = "1s"\nListen = ":8100"\n'
        '[gatway]\nlisten = ":8200"\n'
        '[[nodes]]\nip = "10.0.0.1"\n[[nodes]]\nip = "10.0.0.2"\nvlm_port = 8001\n'
        '[models]\ndefualt = "m"\n'
    )
    config, unknown = load_reporting_unknown_keys(tmp_path, text)
    assert config.gateway.health_interval == 3.0  # the misspelt key is ignored, as plinth does
    assert config.nodes[1].vllm_port == 8000
    assert unknown == [
        ("gateway.helth_interval", "gateway.health_interval"),
        ("gatway", "gateway"),
        ("nodes[1].vlm_port", "nodes[1].vllm_port"),
        ("models.defualt", "models.default"),
    ]


def test_unknown_keys_are_reported_before_a_validation_error(tmp_path: Path) -> None:
    path = write_config(tmp_path, '[[node]]\nip = "10.0.0.1"\n')
    unknown: list[UnknownKey] = []
    with pytest.raises(ConfigError) as caught:
        load_config(path, warn=unknown.append)
    assert caught.value.message == "at least one node must be configured"
    assert [str(key) for key in unknown] == [f"{path}: node: unknown key (did you mean nodes?)"]


def test_keys_match_case_insensitively(tmp_path: Path) -> None:
    text = (
        '[Cluster]\nNAME = "loud"\n'
        '[GATEWAY]\nListen = ":8100"\nHEALTH_INTERVAL = "10s"\nHealth_Fail_Threshold = 5\nProbe_Timeout = "2s"\n'
        '[[Nodes]]\nIP = "10.0.0.1"\nVllm_Port = 8001\nRing = "r"\n'
        '[Models]\nDefault = "m"\n[[Models.Available]]\nNAME = "m"\nRING = "r"\n'
    )
    config = load_text(tmp_path, text)
    assert config.cluster.name == "loud"
    assert config.gateway.listen == ":8100"
    assert config.gateway.health_interval == 10.0
    assert config.gateway.health_fail_threshold == 5
    assert config.gateway.probe_timeout == 2.0
    assert config.nodes == (NodeConfig(ip="10.0.0.1", vllm_port=8001, ring="r"),)
    assert config.models == ModelsConfig(default="m", available=(ModelEntry(name="m", ring="r"),))


def test_wrong_type_under_a_differently_cased_key_names_the_field(tmp_path: Path) -> None:
    error = load_error(tmp_path, '[Gateway]\nLISTEN = 8000\n' + ONE_NODE)
    assert error.key == "gateway.listen"


def test_provision_section_is_ignored_without_a_warning(tmp_path: Path) -> None:
    text = ONE_NODE + '[Provision]\nssh_port = 70000\nssh_key = 5\nweights_dir = "~/weights"\n'
    config, unknown = load_reporting_unknown_keys(tmp_path, text)
    assert config.nodes[0].ip == "10.0.0.1"
    assert unknown == []


def test_keys_matched_case_insensitively_are_not_unknown(tmp_path: Path) -> None:
    text = '[GATEWAY]\nListen = ":8100"\n[[Nodes]]\nIP = "10.0.0.1"\n[Models]\n[[Models.Available]]\nNAME = "m"\n'
    assert load_reporting_unknown_keys(tmp_path, text)[1] == []


# --- routing ----------------------------------------------------------------------------------


def routing_with(line: str) -> str:
    return f"{ONE_NODE}\n[routing]\n{line}\n"


POLICY_CHOICES = "round_robin, least_load, power_of_two, prefix_affinity, kv_aware"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('policy = "fastest"', f'policy must be one of {POLICY_CHOICES} (got "fastest")'),
        ('policy = "Least_Load"', f'policy must be one of {POLICY_CHOICES} (got "Least_Load")'),
        ('load_scrape_interval = "-1s"', "load_scrape_interval must be non-negative (0: never)"),
        ('load_scrape_interval = "2"', 'parsing load_scrape_interval: time: missing unit in duration "2"'),
        ("load_scrape_interval = 2", f"parsing config: load_scrape_interval {DURATION_FORM} (got 2)"),
        ("prefix_messages = -1", "prefix_messages must be non-negative (0: every message)"),
        ("prefix_bytes = 0", "prefix_bytes must be greater than zero"),
        ("load_bound = 0.99", "load_bound must be a finite number of at least 1 (got 0.99)"),
        ("load_bound = inf", "load_bound must be a finite number of at least 1 (got inf)"),
        ("load_bound = nan", "load_bound must be a finite number of at least 1 (got nan)"),
        ('load_bound = "high"', "parsing config: Expected `float`, got `str`"),
    ],
)
def test_routing_value_errors(tmp_path: Path, line: str, message: str) -> None:
    key = "routing." + line.split(" = ")[0]
    error = load_error(tmp_path, routing_with(line))
    assert (error.key, error.message) == (key, message)


def test_a_model_s_timeouts_are_durations_that_override_the_gateway_s(tmp_path: Path) -> None:
    text = gateway_with('connect_timeout = "2s"\nfirst_byte_timeout = "30s"') + (
        '[[models.available]]\nname = "big"\nfirst_byte_timeout = "2m"\nresponse_timeout = "10m"\n'
        '[[models.available]]\nname = "small"\n'
    )
    config = load_text(tmp_path, text)
    assert config.upstream_timeouts("big") == UpstreamTimeouts(connect=2.0, first_byte=120.0, response=600.0)
    assert config.upstream_timeouts("small") == UpstreamTimeouts(connect=2.0, first_byte=30.0, response=60.0)
    assert config.upstream_timeouts("listed-by-a-node") == config.upstream_timeouts("small")
    assert load_text(tmp_path, ONE_NODE).upstream_timeouts("m") == UpstreamTimeouts(connect=5.0, first_byte=10.0, response=60.0)
    summary = describe_config(config)
    assert "  big  standalone  timeouts connect 2s, first byte 2m0s, response 10m0s" in summary
    assert "  small  standalone\n" in summary
    assert "timeouts: connect 2s, first byte 30s, response 1m0s" in summary


@pytest.mark.parametrize(
    ("entry", "key", "message"),
    [
        ('first_byte_timeout = "0s"', "models.available[0].first_byte_timeout", "first_byte_timeout must be greater than zero"),
        ("response_timeout = 90", "models.available[0].response_timeout", f'parsing config: response_timeout {DURATION_FORM} (got 90)'),
        ('connect_timeout = "soon"', "models.available[0].connect_timeout", 'parsing connect_timeout: time: invalid duration "soon"'),
        (
            'target = "big"\nresponse_timeout = "1m"\n[[models.available]]\nname = "big"',
            "models.available[0].response_timeout",
            'alias "m" is routed as its target "big": set response_timeout on the target\'s entry',
        ),
    ],
)
def test_a_model_s_bad_timeout_names_the_entry_and_the_form(tmp_path: Path, entry: str, key: str, message: str) -> None:
    error = load_error(tmp_path, ONE_NODE + f'[[models.available]]\nname = "m"\n{entry}\n')
    assert (error.key, error.message) == (key, message)


def test_a_models_policy_error_names_the_model_entry(tmp_path: Path) -> None:
    text = ONE_NODE + (
        '[[models.available]]\nname = "a"\npolicy = "least_load"\n'
        '[[models.available]]\nname = "b"\npolicy = "random"\n'
    )
    error = load_error(tmp_path, text)
    assert error.key == "models.available[1].policy"
    assert error.message == f'policy must be one of {POLICY_CHOICES}, or "" for routing.policy (got "random")'


@pytest.mark.parametrize(
    ("lines", "policy", "setting", "interval"),
    [
        ("", "round_robin", None, 0.0),  # plinth's behaviour: no scrape at all
        ('policy = ""', "round_robin", None, 0.0),
        ('load_scrape_interval = ""', "round_robin", None, 0.0),
        ('load_scrape_interval = "500ms"', "round_robin", 0.5, 0.5),  # recording load for whatif
        ('policy = "least_load"', "least_load", None, DEFAULT_LOAD_SCRAPE_INTERVAL),
        ('policy = "least_load"\nload_scrape_interval = "0s"', "least_load", 0.0, 0.0),
        ('policy = "power_of_two"\nload_scrape_interval = "1m"', "power_of_two", 60.0, 60.0),
    ],
)
def test_load_scrape_interval(tmp_path: Path, lines: str, policy: str, setting: float | None, interval: float) -> None:
    config = load_text(tmp_path, routing_with(lines))
    assert (config.routing.policy, config.routing.load_scrape_interval) == (policy, setting)
    assert config.load_scrape_interval() == interval


def test_a_models_own_policy_overrides_the_clusters_and_asks_for_load(tmp_path: Path) -> None:
    text = ONE_NODE + '[[models.available]]\nname = "a"\n[[models.available]]\nname = "b"\npolicy = "prefix_affinity"\n'
    config = load_text(tmp_path, text)
    assert config.models.available[1] == ModelEntry(name="b", policy="prefix_affinity")
    policies = [config.model_policy(name) for name in ("a", "b", "unlisted")]
    assert policies == ["round_robin", "prefix_affinity", "round_robin"]
    assert config.load_scrape_interval() == DEFAULT_LOAD_SCRAPE_INTERVAL


def test_routing_values_are_kept(tmp_path: Path) -> None:
    text = routing_with(
        '[Routing]\nPolicy = "prefix_affinity"\nload_scrape_interval = "250ms"\n'
        "prefix_messages = 2\nprefix_bytes = 64\nload_bound = 1"
    ).replace("\n[routing]\n", "\n")
    assert load_text(tmp_path, text).routing == RoutingConfig(
        policy="prefix_affinity", load_scrape_interval=0.25, prefix_messages=2, prefix_bytes=64, load_bound=1.0
    )


def test_misspelt_routing_keys_are_reported(tmp_path: Path) -> None:
    text = routing_with('polcy = "least_load"\nload_scrape_intervall = "1s"')
    text += '[[models.available]]\nname = "m"\npolicies = "x"\n'
    config, unknown = load_reporting_unknown_keys(tmp_path, text)
    assert config.routing == RoutingConfig()
    assert unknown == [
        ("routing.polcy", "routing.policy"),
        ("routing.load_scrape_intervall", "routing.load_scrape_interval"),
        ("models.available[0].policies", "models.available[0].policy"),
    ]


# --- defaults ---------------------------------------------------------------------------------


def test_defaults_when_absent(tmp_path: Path) -> None:
    config = load_text(tmp_path, ONE_NODE)
    assert config.cluster.name == ""
    assert config.gateway == GatewayConfig(
        listen=":8000",
        metrics_listen=":9090",
        health_interval=3.0,
        health_fail_threshold=3,
        max_buffered_response_bytes=8388608,
        max_request_body_bytes=33554432,
        probe_timeout=5.0,
        event_log="",
        event_log_max_bytes=67108864,
        decision_log="",
        request_body_timeout=60.0,
        request_body_idle_timeout=10.0,
        response_body_timeout=60.0,
        http2=False,
        retry_unanswered=False,
    )
    assert config.nodes == (
        NodeConfig(ip="10.0.0.1", name="gpu-node-1", vllm_port=8000, metrics_port=9100, ring=""),
    )
    assert config.models == ModelsConfig(default="", available=())


def test_defaults_when_empty_or_zero(tmp_path: Path) -> None:
    text = (
        '[gateway]\nlisten = ""\nmetrics_listen = ""\nhealth_interval = ""\nhealth_fail_threshold = 0\n'
        'max_buffered_response_bytes = 0\nmax_request_body_bytes = 0\nprobe_timeout = ""\nevent_log_max_bytes = 0\n'
        "decision_log_max_bytes = 0\n"
        '[[nodes]]\nip = "10.0.0.1"\nvllm_port = 0\nmetrics_port = 0\n'
    )
    assert load_text(tmp_path, text) == load_text(tmp_path, '[[nodes]]\nip = "10.0.0.1"\n')
    assert load_text(tmp_path, text) == Config(nodes=(NodeConfig(ip="10.0.0.1"),))


def test_explicit_values_are_kept(tmp_path: Path) -> None:
    text = (
        '[gateway]\nlisten = "127.0.0.1:8100"\nmetrics_listen = ":9191"\nhealth_interval = "1m30s"\n'
        "health_fail_threshold = 7\nmax_buffered_response_bytes = -1\nmax_request_body_bytes = 1024\n"
        'probe_timeout = "250ms"\nevent_log = "/var/log/interlock/events.jsonl"\nevent_log_max_bytes = 4096\n'
        'event_log_retain_bytes = 0\nevent_log_retain_age = "168h"\n'
        'decision_log = "/var/log/interlock/decisions.jsonl"\nretry_unanswered = true\n'
        'decision_log_max_bytes = 2048\ndecision_log_retain_bytes = 8192\ndecision_log_retain_age = "1h30m"\n'
        '[[nodes]]\nip = "10.0.0.1"\nvllm_port = 8001\nmetrics_port = 9101\n'
        "[[models.available]]\nname = 'm'\npipeline_stages = 1\n"
    )
    gateway = load_text(tmp_path, text).gateway
    assert gateway == GatewayConfig(
        listen="127.0.0.1:8100",
        metrics_listen=":9191",
        health_interval=90.0,
        health_fail_threshold=7,
        max_buffered_response_bytes=-1,
        max_request_body_bytes=1024,
        probe_timeout=0.25,
        event_log="/var/log/interlock/events.jsonl",
        event_log_max_bytes=4096,
        event_log_retain_bytes=0,
        event_log_retain_age=168 * 3600.0,
        decision_log="/var/log/interlock/decisions.jsonl",
        decision_log_max_bytes=2048,
        decision_log_retain_bytes=8192,
        decision_log_retain_age=5400.0,
        retry_unanswered=True,
    )
    assert gateway.response_buffer_limit == 0
    assert gateway.request_body_limit == 1024


# --- effective limits -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "effective"),
    [(0, DEFAULT_MAX_BUFFERED_RESPONSE_BYTES), (-1, 0), (-7, 0), (1, 1), (1024, 1024)],
)
def test_response_buffer_limit(raw: int, effective: int) -> None:
    assert GatewayConfig(max_buffered_response_bytes=raw).response_buffer_limit == effective


@pytest.mark.parametrize(
    ("raw", "effective"),
    [(0, DEFAULT_MAX_REQUEST_BODY_BYTES), (-1, DEFAULT_MAX_REQUEST_BODY_BYTES), (1, 1), (4096, 4096)],
)
def test_request_body_limit(raw: int, effective: int) -> None:
    assert GatewayConfig(max_request_body_bytes=raw).request_body_limit == effective


def test_default_limits() -> None:
    assert GatewayConfig().response_buffer_limit == 8 * 1024 * 1024
    assert GatewayConfig().request_body_limit == 32 * 1024 * 1024


# --- lookups ----------------------------------------------------------------------------------


def test_model_ring_is_first_match() -> None:
    config = Config(
        models=ModelsConfig(
            available=(
                ModelEntry(name="big", ring="ring-a"),
                ModelEntry(name="small"),
                ModelEntry(name="big", ring="ring-b"),
            )
        )
    )
    assert config.model_ring("big") == "ring-a"
    assert config.model_ring("small") == ""
    assert config.model_ring("unknown") == ""
    assert config.model_ring("BIG") == ""


def test_node_lookup() -> None:
    config = Config(nodes=(NodeConfig(ip="10.0.0.1", name="a"), NodeConfig(ip="10.0.0.2", name="b")))
    assert config.node("10.0.0.2") == NodeConfig(ip="10.0.0.2", name="b")
    assert config.node("10.0.0.9") is None


# --- builtins round trip ----------------------------------------------------------------------


def test_builtins_round_trip(tmp_path: Path) -> None:
    config = load_config(REPO_ROOT / "config" / "gateway.toml")
    builtins = msgspec.to_builtins(config)
    assert builtins["gateway"]["health_interval"] == 3.0
    assert builtins["nodes"][2] == {
        "ip": "10.0.0.3",
        "name": "gpu-node-3",
        "vllm_port": 8000,
        "metrics_port": 9100,
        "ring": "ring-a",
        "api_key_file": "",
        "role": "both",
        "scheme": "http",
        "ca_file": "",
        "client_certificate": "",
        "client_key": "",
        "max_in_flight": None,
        "kv_events": "",
        "kv_events_replay": "",
        "kv_events_topic": "",
        "scheduling": "fcfs",
    }
    assert msgspec.convert(builtins, Config) == config
    assert msgspec.convert(msgspec.json.decode(msgspec.json.encode(builtins)), Config) == config


def test_round_trip_of_unusual_values(tmp_path: Path) -> None:
    text = (
        '[gateway]\nhealth_interval = "1.000000001s"\nprobe_timeout = "1ns"\nmax_buffered_response_bytes = -1\n'
        '[[nodes]]\nip = "fe80::1"\nname = "nœud ☃"\n'
    )
    config = load_text(tmp_path, text)
    encoded = msgspec.json.encode(msgspec.to_builtins(config))
    assert msgspec.convert(msgspec.json.decode(encoded), Config) == config


def test_from_builtins_names_the_field() -> None:
    builtins = msgspec.to_builtins(Config(nodes=(NodeConfig(ip="10.0.0.1"),)))
    builtins["nodes"][0]["vllm_port"] = "eighty"
    with pytest.raises(msgspec.ValidationError, match=r"\$\.nodes\[0\]\.vllm_port"):
        msgspec.convert(builtins, Config)


# --- the example config and the summary -------------------------------------------------------


def test_example_config_loads() -> None:
    config = load_config(REPO_ROOT / "config" / "gateway.toml")
    assert [(node.name, node.ring) for node in config.nodes] == [
        ("gpu-node-1", ""),
        ("gpu-node-2", ""),
        ("gpu-node-3", "ring-a"),
        ("gpu-node-4", "ring-a"),
    ]
    assert all(node.ip.startswith("10.0.0.") for node in config.nodes)
    assert config.models.default == "Qwen/Qwen2.5-7B-Instruct"
    assert config.models.available == (
        ModelEntry(name="Qwen/Qwen2.5-32B-Instruct-Q4", pipeline_stages=2, ring="ring-a", first_byte_timeout=30.0),
        ModelEntry(name="Qwen/Qwen2.5-7B-Instruct", pipeline_stages=1, ring=""),
        ModelEntry(name="chat", target="Qwen/Qwen2.5-7B-Instruct"),
    )
    assert config.model_ring("Qwen/Qwen2.5-32B-Instruct-Q4") == "ring-a"
    assert config.gateway.response_buffer_limit == 8388608
    assert config.gateway.request_body_limit == 33554432


def test_example_config_documents_the_limits() -> None:
    text = (REPO_ROOT / "config" / "gateway.toml").read_text(encoding="utf-8")
    assert "# max_buffered_response_bytes = 8388608  # 8 MiB; -1 = unlimited" in text
    assert "# max_request_body_bytes = 33554432  # 32 MiB; no unlimited setting" in text
    assert "data[].id" in text
    for key in GatewayConfig.__struct_fields__ + RoutingConfig.__struct_fields__ + FleetConfig.__struct_fields__:
        assert key in text
    assert "#   policy " in text  # a model's own
    assert "interlock whatif" in text  # why load may be scraped under round robin


def test_describe_config() -> None:
    config = load_config(REPO_ROOT / "config" / "gateway.toml")
    summary = describe_config(config)
    for expected in [
        "example-cluster",
        ":8000",
        ":9090",
        "nodes (4)",
        "gpu-node-3  10.0.0.3:8000  ring ring-a",
        "gpu-node-1  10.0.0.1:8000  standalone",
        "Qwen/Qwen2.5-32B-Instruct-Q4  ring ring-a",
        "default Qwen/Qwen2.5-7B-Instruct",
        "every 3s",
        "3 consecutive failures",
        "event log: none",
        "unanswered requests: 502, and 504 past a timeout (retry_unanswered = false)",
        "log: json lines, info and above",
        "routing: round_robin; node load scraped never",
    ]:
        assert expected in summary
    entries = (ModelEntry(name="a"), ModelEntry(name="b", policy="prefix_affinity"))
    routing = RoutingConfig(prefix_messages=2)
    routed = Config(nodes=config.nodes, models=ModelsConfig(available=entries), routing=routing)
    summary = describe_config(routed)
    assert "  b  standalone  policy prefix_affinity" in summary
    assert "routing: round_robin; node load scraped every 2s" in summary
    assert "prefix: first 2 messages, up to 512 bytes; load bound 1.25" in summary
    gateway = GatewayConfig(event_log="/tmp/events.jsonl", health_interval=90.0)
    with_log = Config(nodes=config.nodes, gateway=gateway)
    assert "event log: /tmp/events.jsonl" in describe_config(with_log)
    assert "every 1m30s" in describe_config(with_log)


# --- listen addresses -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        (":8000", ("0.0.0.0", 8000)),
        ("127.0.0.1:9090", ("127.0.0.1", 9090)),
        ("localhost:80", ("localhost", 80)),
        ("[::1]:8000", ("::1", 8000)),
        ("[::]:8000", ("::", 8000)),
        (":0", ("0.0.0.0", 0)),
        (":65535", ("0.0.0.0", 65535)),
    ],
)
def test_parse_listen_address(address: str, expected: tuple[str, int]) -> None:
    assert parse_listen_address(address) == expected


@pytest.mark.parametrize(
    ("address", "why"),
    [
        ("8000", "missing port in address"),
        ("", "missing port in address"),
        ("::1:8000", "too many colons in address"),
        ("[::1]", "missing port in address"),
        ("[::1]8000", "missing port in address"),
        ("[::1]:80:80", "too many colons in address"),
        ("[::1:8000", "missing ']' in address"),
        ("a[b:80", "unexpected '[' in address"),
        ("ab]:80", "unexpected ']' in address"),
        ("host:", 'invalid port ""'),
        ("host:http", 'invalid port "http"'),
        ("host:65536", 'invalid port "65536"'),
        ("host:-1", 'invalid port "-1"'),
    ],
)
def test_parse_listen_address_errors(address: str, why: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_listen_address(address)
    assert str(caught.value) == f"invalid listen address {go_quote(address)}: {why}"


# --- Go durations and quoting -----------------------------------------------------------------

SECOND = 1_000_000_000


@pytest.mark.parametrize(
    ("text", "nanoseconds"),
    [
        ("0", 0),
        ("-0", 0),
        ("+0", 0),
        ("0s", 0),
        ("3s", 3 * SECOND),
        ("500ms", SECOND // 2),
        ("1m30s", 90 * SECOND),
        ("1.5s", 3 * SECOND // 2),
        ("1h2m3.5s", 3723 * SECOND + SECOND // 2),
        ("-1.5h", -5400 * SECOND),
        ("+5m", 300 * SECOND),
        (".5s", SECOND // 2),
        ("1.s", SECOND),
        ("1ns", 1),
        ("1us", 1000),
        ("1\u00b5s", 1000),
        ("1\u03bcs", 1000),
        ("1ms", 1_000_000),
        ("1h", 3600 * SECOND),
        ("1s1s", 2 * SECOND),
        ("0.1ns", 0),
        ("9223372036854775807ns", 2**63 - 1),
        ("-9223372036854775808ns", -(2**63)),
        ("2562047h47m16.854775807s", 2**63 - 1),
        ("0.3333333333333333333333h", 1_200_000_000_000),
    ],
)
def test_parse_go_duration(text: str, nanoseconds: int) -> None:
    assert parse_go_duration(text) == nanoseconds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", 'time: invalid duration ""'),
        ("-", 'time: invalid duration "-"'),
        ("x", 'time: invalid duration "x"'),
        ("s", 'time: invalid duration "s"'),
        (".s", 'time: invalid duration ".s"'),
        ("-.s", 'time: invalid duration "-.s"'),
        (" 3s", 'time: invalid duration " 3s"'),
        ("3", 'time: missing unit in duration "3"'),
        ("1s3", 'time: missing unit in duration "1s3"'),
        ("00", 'time: missing unit in duration "00"'),
        ("3x", 'time: unknown unit "x" in duration "3x"'),
        ("3 s", 'time: unknown unit " s" in duration "3 s"'),
        ("1d", 'time: unknown unit "d" in duration "1d"'),
        ("1S", 'time: unknown unit "S" in duration "1S"'),
        ("1\u00b5", 'time: unknown unit "\\xc2\\xb5" in duration "1\\xc2\\xb5"'),
        ('1"', 'time: unknown unit "\\"" in duration "1\\""'),
        ("9223372036854775808ns", 'time: invalid duration "9223372036854775808ns"'),
        ("2562048h", 'time: invalid duration "2562048h"'),
        ("99999999999999999999s", 'time: invalid duration "99999999999999999999s"'),
    ],
)
def test_parse_go_duration_errors(text: str, message: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_go_duration(text)
    assert str(caught.value) == message


@pytest.mark.parametrize(
    ("nanoseconds", "text"),
    [
        (0, "0s"),
        (1, "1ns"),
        (1_500, "1.5µs"),
        (1_500_000, "1.5ms"),
        (3 * SECOND, "3s"),
        (90 * SECOND, "1m30s"),
        (3600 * SECOND, "1h0m0s"),
        (-(3723 * SECOND + SECOND // 2), "-1h2m3.5s"),
        (-(2**63), "-2562047h47m16.854775808s"),
    ],
)
def test_format_go_duration(nanoseconds: int, text: str) -> None:
    assert format_go_duration(nanoseconds) == text


@given(st.integers(min_value=-(2**63), max_value=2**63 - 1))
def test_go_duration_round_trip(nanoseconds: int) -> None:
    assert parse_go_duration(format_go_duration(nanoseconds)) == nanoseconds


@given(st.text(max_size=12))
def test_parse_go_duration_accepts_or_raises_value_error(text: str) -> None:
    try:
        parse_go_duration(text)
    except ValueError as error:
        assert str(error).startswith("time: ")


@pytest.mark.parametrize(
    ("text", "quoted"),
    [
        ("10.0.0.1", '"10.0.0.1"'),
        ('a"b', '"a\\"b"'),
        ("a\\b", '"a\\\\b"'),
        ("tab\there", '"tab\\there"'),
        ("\x00\x7f", '"\\x00\\x7f"'),
        ("nœud ☃", '"nœud ☃"'),
        ("\u00a0", '"\\u00a0"'),
        ("\U000e0001", '"\\U000e0001"'),
    ],
)
def test_go_quote(text: str, quoted: str) -> None:
    assert go_quote(text) == quoted


# --- [fleet] ---------------------------------------------------------------------------------


def test_without_a_fleet_table_there_is_no_fleet(tmp_path: Path) -> None:
    assert load_text(tmp_path, ONE_NODE).fleet is None


def test_fleet_defaults(tmp_path: Path) -> None:
    fleet = load_text(tmp_path, ONE_NODE + '[fleet]\nnats = ["nats://10.0.0.9:4222"]\n').fleet
    assert fleet == FleetConfig(
        nats=("nats://10.0.0.9:4222",),
        name="interlock",
        replica=socket.gethostname(),
        lease=3.0,
        lease_renewal=1.0,
        partition_after=3 * DEFAULT_HEALTH_INTERVAL,  # a few probe rounds
        partition_dir="partitions",
        decision_spool_bytes=32 * 1024 * 1024,
    )


def test_partition_after_defaults_to_three_health_intervals(tmp_path: Path) -> None:
    text = '[gateway]\nhealth_interval = "2s"\n' + ONE_NODE + '[fleet]\nnats = ["nats://a:1"]\n'
    assert load_text(tmp_path, text).fleet.partition_after == 6.0


def test_fleet_durations_and_names(tmp_path: Path) -> None:
    text = ONE_NODE + (
        '[fleet]\nnats = ["nats://a:4222", "tls://b:4222"]\nname = "prod-eu"\nreplica = "gw-2.example"\n'
        'lease = "10s"\nlease_renewal = "2500ms"\nstream_replicas = 5\npartition_after = "45s"\n'
        'partition_dir = "/var/lib/interlock/partitions"\ndecision_spool_bytes = 1048576\n'
    )
    assert load_text(tmp_path, text).fleet == FleetConfig(
        nats=("nats://a:4222", "tls://b:4222"),
        name="prod-eu",
        replica="gw-2.example",
        lease=10.0,
        lease_renewal=2.5,
        stream_replicas=5,
        partition_after=45.0,
        partition_dir="/var/lib/interlock/partitions",
        decision_spool_bytes=1048576,
    )


def test_serve_fleet_sets_the_servers_with_or_without_a_table(tmp_path: Path) -> None:
    urls = ("nats://a:4222", "nats://b:4222")
    path = write_config(tmp_path, ONE_NODE)
    assert load_config(path, overrides=Overrides(fleet_nats=urls)).fleet.nats == urls
    assert load_config(path, overrides=Overrides(fleet_nats=urls)).fleet.name == "interlock"
    path = write_config(tmp_path, ONE_NODE + '[fleet]\nnats = ["nats://c:4222"]\nname = "blue"\n')
    assert load_config(path, overrides=Overrides(fleet_nats=urls)).fleet.name == "blue"
    assert load_config(path, overrides=Overrides(fleet_nats=urls)).fleet.nats == urls


@pytest.mark.parametrize(
    ("lines", "key", "message"),
    [
        ("", "fleet.nats", "nats must list at least one NATS server URL"),
        ('nats = ["10.0.0.9:4222"]', "fleet.nats[0]", 'not a NATS server URL (nats://host:port): "10.0.0.9:4222"'),
        ('nats = ["nats://a:1"]\nname = "a.b"', "fleet.name", "name must be 1-64 letters, digits, - or _"),
        ('nats = ["nats://a:1"]\nreplica = "a b"', "fleet.replica", "replica must be 1-128 letters"),
        ('nats = ["nats://a:1"]\nlease = "fast"', "fleet.lease", "parsing lease"),
        (
            'nats = ["nats://a:1"]\nlease = "2s"\nlease_renewal = "1500ms"',
            "fleet.lease_renewal",
            "lease_renewal must be greater than zero and at most half the lease (1s)",
        ),
        ('nats = ["nats://a:1"]\nstream_replicas = 6', "fleet.stream_replicas", "stream_replicas must be 1 to 5"),
        ('nats = ["nats://a:1"]\npartition_after = "soon"', "fleet.partition_after", "parsing partition_after"),
        (
            'nats = ["nats://a:1"]\npartition_after = "-5s"',
            "fleet.partition_after",
            "partition_after must be a duration greater than zero",
        ),
        (
            'nats = ["nats://a:1"]\ndecision_spool_bytes = -1',
            "fleet.decision_spool_bytes",
            "decision_spool_bytes must be a number of bytes greater than zero (got -1)",
        ),
        ('nats = ["nats://a:1"]\npartition_dir = 3', "fleet.partition_dir", "Expected `str`, got `int`"),
    ],
)
def test_fleet_errors_name_the_key(tmp_path: Path, lines: str, key: str, message: str) -> None:
    error = load_error(tmp_path, ONE_NODE + "[fleet]\n" + lines + "\n")
    assert error.key == key
    assert message in error.message


def test_an_unknown_fleet_key_is_reported(tmp_path: Path) -> None:
    unknown: list[UnknownKey] = []
    path = write_config(tmp_path, ONE_NODE + '[fleet]\nnats = ["nats://a:1"]\nleases = "3s"\n')
    load_config(path, warn=unknown.append)
    assert [(item.key, item.closest) for item in unknown] == [("fleet.leases", "fleet.lease")]


def test_without_an_admission_table_the_queue_is_off(tmp_path: Path) -> None:
    config = load_text(tmp_path, ONE_NODE)
    assert config.admission == AdmissionConfig(queue=False)
    assert config.load_scrape_interval() == 0  # round robin reads no load
    assert "admission queue: off" in describe_config(config)


def test_admission_defaults_and_node_limits(tmp_path: Path) -> None:
    text = ONE_NODE + "max_in_flight = 4\n[admission]\n"
    config = load_text(tmp_path, text)
    assert config.admission == AdmissionConfig(queue=True)
    assert config.nodes[0].max_in_flight == 4
    assert config.load_scrape_interval() > 0  # admission reads the nodes' load
    summary = describe_config(config)
    assert "admission queue: requests queue while every node of a model has 5 or more waiting" in summary
    assert "at most 4 in flight" in summary


@pytest.mark.parametrize(
    ("lines", "key", "message"),
    [
        ("saturation_waiting = 0", "admission.saturation_waiting", "saturation_waiting must be at least 1 (got 0)"),
        ("saturation_kv_cache = 1.5", "admission.saturation_kv_cache", "must be a fraction above 0, at most 1"),
        ("queue_size = 0", "admission.queue_size", "queue_size must be at least 1"),
        ("queue_size = 5\ntenant_queue_size = 6", "admission.tenant_queue_size", "tenant_queue_size must be 1 to"),
        ("max_queue_seconds = -1", "admission.max_queue_seconds", "max_queue_seconds must be a finite number"),
        ('max_queue_seconds = "5s"', "admission.max_queue_seconds", "Expected `float`, got `str`"),
    ],
)
def test_admission_errors_name_the_key(tmp_path: Path, lines: str, key: str, message: str) -> None:
    error = load_error(tmp_path, ONE_NODE + "[admission]\n" + lines + "\n")
    assert error.key == key
    assert message in error.message


def test_a_queue_smaller_than_the_tenant_queue_default_loads_with_the_tenant_queue_as_large(tmp_path: Path) -> None:
    config = load_text(tmp_path, ONE_NODE + "[admission]\nqueue_size = 100\n")
    assert (config.admission.queue_size, config.admission.tenant_queue_size) == (100, 100)
    larger = load_text(tmp_path, ONE_NODE + "[admission]\nqueue_size = 2000\n")
    assert (larger.admission.queue_size, larger.admission.tenant_queue_size) == (2000, 256)


def test_an_admission_table_with_queue_false_keeps_its_other_keys_without_the_queue(tmp_path: Path) -> None:
    config = load_text(tmp_path, ONE_NODE + "[admission]\nqueue = false\ndefault_max_tokens = 64\n")
    assert config.admission == AdmissionConfig(queue=False, default_max_tokens=64)
    assert config.load_scrape_interval() == 0


def test_max_in_flight_needs_admission_and_a_positive_count(tmp_path: Path) -> None:
    error = load_error(tmp_path, ONE_NODE + "max_in_flight = 2\n")
    assert error.key == "nodes[0].max_in_flight"
    assert "needs the admission queue" in error.message
    error = load_error(tmp_path, ONE_NODE + "max_in_flight = 2\n[admission]\nqueue = false\n")
    assert "needs the admission queue" in error.message
    error = load_error(tmp_path, ONE_NODE + "max_in_flight = 0\n[admission]\n")
    assert (error.key, error.message) == ("nodes[0].max_in_flight", "max_in_flight must be at least 1 (got 0)")


def test_priority_headroom_is_kept_below_every_nodes_max_in_flight(tmp_path: Path) -> None:
    config = load_text(tmp_path, ONE_NODE + "max_in_flight = 3\n[admission]\npriority_headroom = 1\n")
    assert config.admission.priority_headroom == 1
    assert "priority_headroom 1: below the highest tenant priority a node is full 1 places" in describe_config(config)
    error = load_error(tmp_path, ONE_NODE + "max_in_flight = 2\n[admission]\npriority_headroom = 2\n")
    assert error.key == "nodes[0].max_in_flight"
    assert "max_in_flight must be above [admission] priority_headroom (2)" in error.message
    error = load_error(tmp_path, ONE_NODE + "max_in_flight = 2\n[admission]\npriority_headroom = -1\n")
    assert error.key == "admission.priority_headroom"
    assert "0 or more (got -1)" in error.message
    error = load_error(tmp_path, ONE_NODE + "[admission]\npriority_headroom = 1\n")
    assert error.key == "admission.priority_headroom"
    assert "set [[nodes]] max_in_flight" in error.message


def test_a_models_tokenizer_directory_is_checked_naming_the_entry_and_the_file(tmp_path: Path) -> None:
    directory = write_tokenizer_dir(tmp_path / "tok")
    entry = ONE_NODE + '[[models.available]]\nname = "m"\npolicy = "kv_aware"\ntokenizer = "{}"\n'
    config = load_text(tmp_path, entry.format(directory))
    assert config.models.available[0].tokenizer == str(directory)
    for name in ("tokenizer_config.json", "tokenizer.json"):
        (directory / name).unlink()
        error = load_error(tmp_path, entry.format(directory))
        assert error.key == "models.available[0].tokenizer"
        assert f"{directory / name} is missing" in error.message
    error = load_error(tmp_path, entry.format(tmp_path / "absent"))
    assert error.key == "models.available[0].tokenizer" and "is not a directory" in error.message
    summary = describe_config(config)
    assert f"  m  standalone  policy kv_aware  tokenizer {directory}\n" in summary
    assert "routing: round_robin" in summary and "load bound 1.25" in summary
    untokenized = load_text(tmp_path, ONE_NODE + '[[models.available]]\nname = "m"\npolicy = "kv_aware"\n')
    assert "  m  standalone  policy kv_aware  no tokenizer: kv_aware routes it as prefix_affinity\n" in (
        describe_config(untokenized)
    )


def test_a_tokenizer_config_that_is_not_json_is_named(tmp_path: Path) -> None:
    directory = write_tokenizer_dir(tmp_path / "tok")
    (directory / "tokenizer_config.json").write_text("{not json")
    error = load_error(tmp_path, ONE_NODE + f'[[models.available]]\nname = "m"\ntokenizer = "{directory}"\n')
    assert error.key == "models.available[0].tokenizer"
    assert f"{directory / 'tokenizer_config.json'}: not JSON" in error.message
