"""`interlock timeline`: the recorded scenario drawn as an HTML page, checked in a real headless
browser (Debian's chromium) and in the written file; and the scenario's sample decision log.

The scenario (fixtures/scenarios.py) in short: 10.0.0.1 is offline at 27-33 s and from 117 s on,
10.0.0.2 goes known_empty at seq 100, 10.0.0.3 dies (degraded seq 161, dead seq 186), 10.0.0.4's
listing expires (seq 147), 10.0.0.5 is reloaded in at seq 98 and discovered at seq 111; a
reload is rejected at seq 60; the run stops at 121 s.
"""

from __future__ import annotations

import json
import struct
import subprocess
import zlib
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest

from controlplane.infrastructure.config import load_config
from controlplane.effects.replay import replay, replay_steps
from controlplane.rules.routing import filter_by_model, plan_route, ring_pool, unavailable_reason
from events.decisions import AttemptOutcome, read_decisions
from events.log import encode_event
from events.types import Checkpoint
from fixtures import scenarios
from interlock.cli import main
from interlock.render import parse_time
from interlock.timeline import reload_changes
from interlock.timeline_page import time_ticks

from harness import required_program

SCENARIO = scenarios.SCENARIO_PATH
DECISIONS = scenarios.DECISIONS_PATH
START = scenarios.START
NODES = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"]
SCREEN = (1440, 720)


class Page(HTMLParser):
    """The lanes, marks and bands of a timeline page, each with the node of the lane it is in."""

    def __init__(self, text: str):
        super().__init__()
        self.groups: list[dict[str, str]] = []
        """The open <g> elements, innermost last."""
        self.lanes: list[str] = []
        self.marks: list[dict[str, str]] = []
        self.bands: list[dict[str, str]] = []
        self.strip: dict[str, str] | None = None
        self.model_lanes: list[str] = []
        self.gateway_events: list[dict[str, str]] = []
        self.notes: list[str] = []
        """The gateway row's labels."""
        self._open_mark: dict[str, str] | None = None
        self._in_title = False
        self._in_note = False
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        element = {key: value or "" for key, value in attrs}
        classes = element.get("class", "").split()
        lane = next((group["data-node"] for group in reversed(self.groups) if "lane" in group["class"].split()), "")
        element["lane"] = lane
        model = (group for group in reversed(self.groups) if "model-lane" in group["class"].split())
        element["model"] = next((group["data-model"] for group in model), "")
        if tag == "g":
            element.setdefault("class", "")
            self.groups.append(element)
            if "lane" in classes:
                self.lanes.append(element["data-node"])
            if "mark" in classes:
                self.marks.append(element)
                self._open_mark = element
            if "strip" in classes:
                self.strip = element
            if "model-lane" in classes:
                self.model_lanes.append(element["data-model"])
            if "gateway-event" in classes:
                self.gateway_events.append(element)
        elif tag == "rect" and "band" in classes:
            self.bands.append(element)
        elif tag == "title" and self._open_mark is not None:
            self._in_title = True
        elif tag == "text" and "note" in classes:
            self._in_note = True

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.handle_starttag(tag, attrs)
        if tag == "g":
            self.handle_endtag(tag)

    def handle_endtag(self, tag: str) -> None:
        if tag == "g":
            if self.groups.pop() is self._open_mark:
                self._open_mark = None
        elif tag == "title":
            self._in_title = False
        elif tag == "text":
            self._in_note = False

    def handle_data(self, data: str) -> None:
        if self._in_note:
            self.notes.append(data)
        if self._in_title:
            self._open_mark["data-tip"] = self._open_mark.get("data-tip", "") + data

    def bands_of_model(self, model: str) -> list[tuple[str, float, float]]:
        return [
            (band["data-state"], float(band["data-start"]) - START, float(band["data-end"]) - START)
            for band in self.bands
            if band["model"] == model
        ]

    def bands_of(self, node: str, row: str) -> list[tuple[str, float, float]]:
        return [
            (band["data-state"], float(band["data-start"]) - START, float(band["data-end"]) - START)
            for band in self.bands
            if band["lane"] == node and row in band["class"].split()
        ]


def timeline(tmp_path: Path, capsys, *options: object) -> tuple[Path, str]:
    page = tmp_path / "timeline.html"
    code = main(["timeline", str(SCENARIO), *map(str, options), "-o", str(page)])
    out = capsys.readouterr().out
    assert code == 0
    return page, out


def chromium(tmp_path: Path, *arguments: str) -> subprocess.CompletedProcess:
    browser = required_program("chromium", "apt-get install chromium")
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    command += [f"--user-data-dir={tmp_path / 'chromium-profile'}", *arguments]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True)


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


# --- in a real browser -----------------------------------------------------------------------


def test_the_page_shows_a_lane_per_node_and_a_mark_per_transition_in_chromium(tmp_path, capsys):
    page, out = timeline(tmp_path, capsys, "--decisions", DECISIONS)
    assert out.startswith(f"wrote {page}: 5 nodes")
    url = page.resolve().as_uri()
    screenshot = tmp_path / "timeline.png"
    chromium(tmp_path, f"--screenshot={screenshot}", f"--window-size={SCREEN[0]},{SCREEN[1]}", url)
    assert png_size(screenshot) == SCREEN
    dom = Page(chromium(tmp_path, "--dump-dom", url).stdout)  # the DOM after the page's script ran

    assert dom.lanes == NODES
    transitions = replay([SCENARIO]).transitions
    shown = [
        (int(mark["data-seq"]), mark["data-node"], mark["data-kind"], mark["data-tip"].split("\n")[1])
        for mark in dom.marks
    ]
    assert Counter(shown) == Counter((t.seq, t.node, t.kind, t.msg) for t in transitions)
    assert len(dom.marks) == len(transitions) == 30
    for mark in dom.marks:
        assert mark["lane"] == mark["data-node"]  # a node's transitions sit in its lane; the gateway's in none
        assert mark["data-tip"].startswith(f"seq {mark['data-seq']} · 03:0")  # its seq and UTC time of day
    decisions = list(read_decisions(DECISIONS))
    assert dom.strip is not None
    assert int(dom.strip["data-requests"]) == len(decisions)
    assert int(dom.strip["data-failures"]) == sum(d.status is not None and d.status >= 500 for d in decisions) > 0
    # The reload that added 10.0.0.5 says so, on its line and in its tip.
    [reload] = [event for event in dom.gateway_events if event["data-changes"]]
    assert reload["data-changes"] == "nodes: +10.0.0.5 (gpu-node-5)"
    assert reload["data-tip"].endswith("\nnodes: +10.0.0.5 (gpu-node-5)")
    assert "reload: nodes +10.0.0.5 (gpu-node-5)" in dom.notes
    assert dom.model_lanes == ["Qwen/Qwen2.5-32B-Instruct-Q4", "Qwen/Qwen2.5-7B-Instruct", "sql-lora"]


def png_pixels(path: Path) -> tuple[int, int, list[bytes]]:
    """Width, height and rows of RGB(A) bytes of an 8-bit, non-interlaced PNG (chromium's screenshots)."""
    data = path.read_bytes()
    width, height, depth, colour = struct.unpack(">IIBB", data[16:26])
    assert depth == 8 and colour in (2, 6), (depth, colour)
    channels = 3 if colour == 2 else 4
    chunks, offset = b"", 8
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset : offset + 8])
        if kind == b"IDAT":
            chunks += data[offset + 8 : offset + 8 + length]
        offset += 12 + length
    raw, stride, rows, previous = zlib.decompress(chunks), width * channels, [], bytearray(width * channels)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - channels] if i >= channels else 0
            up, up_left = previous[i], previous[i - channels] if i >= channels else 0
            if kind == 1:
                line[i] = (line[i] + left) & 255
            elif kind == 2:
                line[i] = (line[i] + up) & 255
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 255
            elif kind == 4:
                guess = left + up - up_left
                paeth = [(abs(guess - value), rank, value) for rank, value in enumerate((left, up, up_left))]
                line[i] = (line[i] + min(paeth)[2]) & 255  # the nearest; ties: left, then up
        rows.append(bytes(line))
        previous = line
    return width, height, [row[::channels] for row in rows]  # the red channel is enough for "white"


def test_the_page_fits_a_1400_px_window_in_chromium(tmp_path, capsys):
    page, _ = timeline(tmp_path, capsys, "--decisions", DECISIONS)
    screenshot = tmp_path / "timeline.png"
    chromium(tmp_path, f"--screenshot={screenshot}", "--window-size=1400,800", page.resolve().as_uri())
    width, height, reds = png_pixels(screenshot)
    assert (width, height) == (1400, 800)
    # The page's right margin stays blank all the way down: nothing of the chart is cut by the window.
    assert all(row[1400 - 20 :] == b"\xff" * 20 for row in reds)
    assert any(row[1400 - 80 : 1400 - 20] != b"\xff" * 60 for row in reds)  # and the chart reaches near it


# --- what the page says ----------------------------------------------------------------------


def test_bands_follow_the_replayed_states(tmp_path, capsys):
    dom = Page(timeline(tmp_path, capsys)[0].read_text())
    at = {t.seq: t.at - START for t in replay([SCENARIO]).transitions}
    end = scenarios.STOPPED_AT
    assert dom.bands_of("10.0.0.3", "health") == [
        ("healthy", 0.0, at[161]),
        ("degraded", at[161], at[186]),
        ("dead", at[186], end),
    ]
    assert dom.bands_of("10.0.0.1", "offline") == [
        ("offline", 27.0, scenarios.BACK_ONLINE_AT),
        ("offline", scenarios.OFFLINE_AT[1], end),
    ]
    assert [state for state, _, _ in dom.bands_of("10.0.0.4", "models")] == ["untried", "known", "degraded", "expired"]
    assert dom.bands_of("10.0.0.4", "models")[-1][1:] == (at[147], end)
    assert dom.bands_of("10.0.0.2", "models")[-1] == ("known_empty", at[100], end)
    # 10.0.0.5 exists from the reload (seq 98) on: untried until its listing (seq 111).
    assert dom.bands_of("10.0.0.5", "health") == [("healthy", at[98], end)]
    assert dom.bands_of("10.0.0.5", "models") == [("untried", at[98], at[111]), ("known", at[111], end)]
    assert dom.strip is None  # no decision log given


def test_since_and_until_draw_only_that_window(tmp_path, capsys):
    since, until = "2026-01-02T03:04:20Z", "2026-01-02T03:04:50Z"  # 15 s to 45 s: before the reload
    page, out = timeline(tmp_path, capsys, "--since", since, "--until", until)
    assert out == f"wrote {page}: 4 nodes from {since} to {until}\n"
    dom = Page(page.read_text())
    assert dom.lanes == NODES[:4]
    window = (parse_time(since), parse_time(until))
    expected = [t.seq for t in replay([SCENARIO]).transitions if window[0] <= t.at <= window[1]]
    assert sorted(int(mark["data-seq"]) for mark in dom.marks) == expected == [58, 60, 69]
    assert dom.bands_of("10.0.0.3", "health") == [("healthy", 15.0, 45.0)]  # clipped to the window
    # The state at the window's start comes from everything before it: 10.0.0.2 still known.
    assert dom.bands_of("10.0.0.2", "models") == [("known", 15.0, 45.0)]


def test_a_log_starting_at_a_checkpoint_draws_the_checkpoints_state_from_its_start(tmp_path, capsys):
    """The segments that remain of a long log may start with the state as a checkpoint."""
    steps = list(replay_steps([SCENARIO]))
    _, at_150, _ = steps[149]
    log = tmp_path / "events.jsonl"
    log.write_bytes(encode_event(Checkpoint.of(at_150)) + b"".join(encode_event(event) for event, _, _ in steps[150:]))
    page = tmp_path / "timeline.html"
    assert main(["timeline", str(log), "-o", str(page)]) == 0
    dom = Page(page.read_text())
    assert dom.lanes == NODES
    start, end = at_150.at - START, scenarios.STOPPED_AT
    assert dom.bands_of("10.0.0.4", "models") == [("expired", start, end)]
    assert dom.bands_of("10.0.0.2", "models") == [("known_empty", start, end)]
    assert dom.bands_of("10.0.0.3", "health")[0] == ("healthy", start, steps[160][0].at - START)


def test_the_page_loads_nothing_from_the_network(tmp_path, capsys):
    text = timeline(tmp_path, capsys, "--decisions", DECISIONS)[0].read_text()
    for needle in ("http:", "https:", "<link", " src=", "href=", "@import"):
        assert needle not in text


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            ["--since", "2026-01-02T03:05:00Z", "--until", "2026-01-02T03:04:00Z"],
            "argument --since: must be before --until",
        ),
        (["--since", "2026-01-02T04:00:00Z"], "nothing to draw: the log ends at 2026-01-02T03:06:06Z, before --since"),
        (["--until", "2026-01-02T03:00:00Z"], "no events in the log up to --until"),
        (["--decisions", "/nonexistent/decisions.jsonl"], "/nonexistent/decisions.jsonl: no such decision log or segment"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, capsys, options, message):
    page = tmp_path / "timeline.html"
    code = main(["timeline", str(SCENARIO), *options, "-o", str(page)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("interlock timeline: error: ") and message in err and err.count("\n") == 1
    assert not page.exists()


def test_an_empty_log_is_bad_input(tmp_path, capsys):
    empty = tmp_path / "events.jsonl"
    empty.write_bytes(b"")
    assert main(["timeline", str(empty), "-o", str(tmp_path / "timeline.html")]) == 2
    assert capsys.readouterr().err == "interlock timeline: error: no events in the log\n"


def test_time_ticks_are_round_utc_times_labelled_as_precisely_as_needed():
    labels = ["03:04:15", "03:04:30", "03:04:45", "03:05:00", "03:05:15", "03:05:30", "03:05:45", "03:06:00"]
    assert time_ticks(START, START + 121) == [(START + 10 + 15 * i, label) for i, label in enumerate(labels)]
    assert [label for _, label in time_ticks(START, START + 6 * 3600)][:2] == ["04:00", "05:00"]
    across_midnight = parse_time("2026-01-02T22:00:00Z"), parse_time("2026-01-03T03:00:00Z")
    labels = [label for _, label in time_ticks(*across_midnight)]
    assert labels[:2] == ["01-02 22:00", "01-02 22:30"] and "01-03 00:00" in labels


# --- the sample decision log -----------------------------------------------------------------


def test_regenerating_the_decision_log_gives_the_committed_file():
    assert b"".join(scenarios.decision_lines()) == DECISIONS.read_bytes()


def test_each_sample_decision_is_what_routing_decides_on_the_replayed_state():
    states = {state.seq: state for _, state, _ in replay_steps([SCENARIO])}
    decisions = list(read_decisions(DECISIONS))
    for decision in decisions:
        state = states[decision.seq]
        assert state.at <= decision.at < (states[decision.seq + 1].at if decision.seq + 1 in states else float("inf"))
        pool = ring_pool(state, decision.model)
        candidates, dropped = filter_by_model(pool, decision.model)
        excluded = [(node.ip, reason) for node, reason in dropped]
        excluded += [(node.ip, reason) for node in candidates if (reason := unavailable_reason(node, decision.at))]
        assert decision.ring_pool == tuple(node.ip for node in pool)
        assert [(exclusion.node, exclusion.reason) for exclusion in decision.excluded] == excluded
        pick_pool = plan_route(state, decision.model, decision.at).pick_pool
        if not pick_pool:
            assert (decision.attempts, decision.status) == ((), 503)
        else:
            assert decision.attempts[0].node in pick_pool
            assert decision.attempts[-1].outcome == "completed" and decision.attempts[-1].status == decision.status
    statuses = Counter(decision.status for decision in decisions)
    assert set(statuses) == {200, 500, 503}
    assert sum(len(decision.attempts) == 2 for decision in decisions) == 2  # the two refused by 10.0.0.1


def test_a_lane_per_model_shows_when_no_node_would_have_served_it(tmp_path, capsys):
    dom = Page(timeline(tmp_path, capsys)[0].read_text())
    at = {t.seq: t.at - START for t in replay([SCENARIO]).transitions}
    end = scenarios.STOPPED_AT
    # ring-a's 32B model: 10.0.0.4's listing expires (seq 147), 10.0.0.3 degrades and still serves
    # (seq 161), then dies (seq 186): from then on no node would take a request for it.
    assert dom.bands_of_model("Qwen/Qwen2.5-32B-Instruct-Q4") == [("served", 0.0, at[186]), ("no node", at[186], end)]
    # The 7B model keeps a node throughout, 10.0.0.1's offline spells and 10.0.0.2's empty list included.
    assert dom.bands_of_model("Qwen/Qwen2.5-7B-Instruct") == [("served", 0.0, end)]


def test_a_stream_its_node_cut_short_counts_as_failed_in_the_strip(tmp_path, capsys):
    records = [json.loads(line) for line in DECISIONS.read_text().splitlines()]
    cut = [record for record in records if record["status"] == 200 and record["stream"]][:3]
    for record in cut:  # as the proxy records a stream its node ended early: the client had its 200
        record["attempts"][-1]["outcome"] = AttemptOutcome.TRUNCATED
    decisions = tmp_path / "decisions.jsonl"
    decisions.write_text("".join(json.dumps(record) + "\n" for record in records))
    dom = Page(timeline(tmp_path, capsys, "--decisions", decisions)[0].read_text())
    answered_5xx = sum(record["status"] is not None and record["status"] >= 500 for record in records)
    assert int(dom.strip["data-failures"]) == answered_5xx + 3


def test_a_reload_says_what_it_changed_of_nodes_models_and_policies(tmp_path):
    def config(text: str):
        path = tmp_path / "gateway.toml"
        path.write_text(text)
        return load_config(path)

    nodes = '[[nodes]]\nip = "10.0.0.1"\nname = "a"\n[[nodes]]\nip = "10.0.0.2"\n'
    before = config(nodes + '[[models.available]]\nname = "m"\n')
    after = config(
        '[routing]\npolicy = "least_load"\n[[nodes]]\nip = "10.0.0.1"\nname = "a"\n[[nodes]]\nip = "10.0.0.3"\n'
        '[[models.available]]\nname = "m"\npolicy = "prefix_affinity"\n[[models.available]]\nname = "n"\n'
    )
    assert reload_changes(before, after) == [
        "nodes: +10.0.0.3 -10.0.0.2",
        "models: +n",
        "policy: round_robin → least_load",
        "policy of m: round_robin → prefix_affinity",
    ]
    assert reload_changes(before, before) == []
