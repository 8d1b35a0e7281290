"""The alert rules and the Grafana dashboard shipped in `deploy/`, checked with Prometheus itself.

The rules pass `promtool check rules` and their unit tests (`tests/prometheus/alerts_test.yml`).
Then a real Prometheus server (Debian's package, on 127.0.0.1, data in a temporary directory)
scrapes a live gateway in front of simulated nodes, each with a fault an
operator should see (a node that truncates responses, one that dies, one that lists no model, one that never answers),
under a little traffic, at two addresses (two `instance`s, as two replicas would be): every
panel's query returns data through Prometheus's HTTP API for the instance the dashboard's
variables choose, and with all of them one series per instance (never their sum); the variables
list the job and both instances; every rule evaluates, and the alerts for the dead node and the
truncated streams are raised, not those for a gateway down.
"""

from __future__ import annotations

import json
import math
import re
import socket
import subprocess
from pathlib import Path

import httpx
import trio

from harness import PROJECT_ROOT, chat, node_specs, nodes_and_gateway, required_program

ALERTS = PROJECT_ROOT / "deploy" / "prometheus" / "alerts.yml"
ALERT_TESTS = PROJECT_ROOT / "tests" / "prometheus" / "alerts_test.yml"
DASHBOARD = PROJECT_ROOT / "deploy" / "grafana" / "interlock.json"
INSTALL = "apt-get install prometheus"
RATE_INTERVAL = "10s"
"""What Grafana's `$__rate_interval` stands for here: a few of the 1 s scrapes."""


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([required_program("promtool", INSTALL), *args], capture_output=True, text=True, timeout=60)


def test_the_alert_rules_pass_promtool_check():
    checked = promtool("check", "rules", str(ALERTS))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 15 rules found" in checked.stdout


def test_the_alert_rules_pass_their_unit_tests():
    tested = promtool("test", "rules", str(ALERT_TESTS))
    assert tested.returncode == 0, tested.stdout + tested.stderr


def panel_queries(job: str, instance: str) -> dict[str, str]:
    """Every query of the dashboard, named by its panel and legend, as Prometheus gets it when
    the dashboard's variables are set to the regular expressions `job` and `instance`."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = {}
    for panel in dashboard["panels"]:
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL)
            assert '{job=~"$job", instance=~"$instance"}' in expr or ', job=~"$job", instance=~"$instance"}' in expr
            queries[f"{panel['title']} / {target['legendFormat']}"] = (
                expr.replace("$job", job).replace("$instance", instance)
            )
    return queries


def dashboard_variables() -> dict[str, tuple[str, str]]:
    """The dashboard's query variables: name → (the series selector, the label) of their
    `label_values(SELECTOR, LABEL)`."""
    variables = {}
    for variable in json.loads(DASHBOARD.read_text())["templating"]["list"]:
        if variable["type"] == "query":
            selector, label = re.fullmatch(r"label_values\((.+), (\w+)\)", variable["query"]["query"]).groups()
            variables[variable["name"]] = (selector, label)
    return variables


def alert_rule_series() -> set[str]:
    """The metric names the alert rules read."""
    return set(re.findall(r"\b([a-z_]+)\{", ALERTS.read_text()))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def query(http: httpx.AsyncClient, url: str, expr: str) -> list[dict]:
    response = await http.get(url + "/api/v1/query", params={"query": expr})
    assert response.status_code == 200, f"{expr}: {response.text}"
    return response.json()["data"]["result"]


def has_a_number(result: list[dict]) -> bool:
    return any(not math.isnan(float(sample["value"][1])) for sample in result)


def instances_with_a_number(result: list[dict]) -> set[str | None]:
    """The `instance` of each series with a number (None for a series without one: summed over instances)."""
    return {sample["metric"].get("instance") for sample in result if not math.isnan(float(sample["value"][1]))}


async def label_values(http: httpx.AsyncClient, url: str, selector: str, label: str) -> list[str]:
    """What Grafana's `label_values(selector, label)` lists, from Prometheus's HTTP API."""
    response = await http.get(f"{url}/api/v1/label/{label}/values", params={"match[]": selector})
    assert response.status_code == 200, f"{selector}: {response.text}"
    return response.json()["data"]


async def test_every_dashboard_query_has_data_per_instance_from_a_real_prometheus_scraping_a_live_gateway(tmp_path):
    prometheus_program = required_program("prometheus", INSTALL)
    specs = node_specs(5)
    specs[1].behaviour.completion = "close_mid_stream"  # truncates streams
    specs[3].behaviour.models = "empty"  # excluded by the model filter
    specs[4].behaviour.completion = "hang"  # its requests time out and are retried on another node
    config = {
        "health_interval": "0.3s",
        "first_byte_timeout": "1s",
        "response_timeout": "1s",
        "retry_unanswered": True,
        "routing": {"load_scrape_interval": "0.3s"},
    }
    async with nodes_and_gateway(tmp_path, specs, **config) as (nodes, gateway):
        truncating, dying = nodes[1].host, nodes[2].host
        await gateway.discovered()
        nodes[2].behaviour.refuse = True
        metrics_port = gateway.metrics_url.rpartition(":")[2]
        # The one gateway scraped at two addresses: two instances, as two replicas would be.
        instances = [f"127.0.0.1:{metrics_port}", f"localhost:{metrics_port}"]
        port = free_port()
        prometheus_url = f"http://127.0.0.1:{port}"
        prometheus_config = tmp_path / "prometheus.yml"
        prometheus_config.write_text(
            json.dumps(
                {
                    "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                    "rule_files": [str(ALERTS)],
                    "scrape_configs": [
                        {"job_name": "interlock", "static_configs": [{"targets": instances}]}
                    ],
                }
            )
        )
        with open(tmp_path / "prometheus.log", "wb") as prometheus_log:
            process = await trio.lowlevel.open_process(
                [
                    prometheus_program,
                    f"--config.file={prometheus_config}",
                    f"--storage.tsdb.path={tmp_path / 'data'}",
                    f"--web.listen-address=127.0.0.1:{port}",
                ],
                stdout=prometheus_log,
                stderr=subprocess.STDOUT,
            )
        try:
            async with trio.open_nursery() as nursery, httpx.AsyncClient(timeout=60, trust_env=False) as http:

                async def traffic() -> None:
                    """Streamed and whole requests in pairs, so each node gets both."""
                    for count in range(100_000):
                        try:
                            await http.post(gateway.url + "/v1/chat/completions", json=chat(stream=count // 2 % 2 == 0))
                        except httpx.RemoteProtocolError:
                            pass  # a stream the truncating node cut short
                        await trio.sleep(0.02)

                nursery.start_soon(traffic)
                # The dashboard with one instance chosen: every panel has data.
                wanted = panel_queries("interlock", re.escape(instances[0]).replace("\\", "\\\\"))  # as Grafana escapes
                wanted |= {f"series {name}": f"count({name})" for name in alert_rule_series()}
                wanted["dead node alert"] = f'ALERTS{{alertname="InterlockNodeDead",node="{dying}"}}'
                wanted["truncation alert"] = (
                    f'ALERTS{{alertname="InterlockStreamsTruncated",node="{truncating}",alertstate="firing"}}'
                )
                missing = dict(wanted)
                with trio.move_on_after(60):
                    while missing:
                        await trio.sleep(1)
                        for name, expr in list(missing.items()):
                            if has_a_number(await query(http, prometheus_url, expr)):
                                del missing[name]
                assert not missing, f"no data for {sorted(missing)}; see {tmp_path / 'prometheus.log'}"
                # With All: each panel shows each instance apart, never their sum.
                apart = panel_queries(".*", ".*")
                with trio.move_on_after(30):
                    while apart:
                        await trio.sleep(1)
                        for name, expr in list(apart.items()):
                            if instances_with_a_number(await query(http, prometheus_url, expr)) == set(instances):
                                del apart[name]
                assert not apart, f"not one series per instance: {sorted(apart)}"
                variables = dashboard_variables()
                assert set(variables) == {"job", "instance"}
                assert await label_values(http, prometheus_url, *variables["job"]) == ["interlock"]
                instance_selector = variables["instance"][0].replace("$job", "interlock")
                listed = await label_values(http, prometheus_url, instance_selector, "instance")
                assert sorted(listed) == sorted(instances)
                rules = (await http.get(prometheus_url + "/api/v1/rules")).json()["data"]["groups"][0]["rules"]
                assert {rule["name"]: rule["health"] for rule in rules} == {rule["name"]: "ok" for rule in rules}
                assert len(rules) == 15
                firing = {rule["name"] for rule in rules if rule["alerts"]}
                assert not firing & {"InterlockGatewayDown", "InterlockGatewayAbsent"}
                nursery.cancel_scope.cancel()
        finally:
            process.kill()
            with trio.CancelScope(shield=True):
                await process.wait()
