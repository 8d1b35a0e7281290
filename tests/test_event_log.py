"""The event log on real files: codec round trip, segments and rotation, torn and bad lines, last_seq."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from events.config import (
    POLICIES,
    ClusterConfig,
    Config,
    GatewayConfig,
    ModelEntry,
    ModelsConfig,
    NodeConfig,
    RoutingConfig,
)
from events.log import decode_event, encode_event, last_seq, read_events
from events.state import (
    AdapterLoad,
    AdapterLoadState,
    Discovery,
    GpuSample,
    Health,
    LoraInfo,
    ModelDiscovery,
    NodeLoad,
    NodeState,
)
from events.types import (
    EVENT_TYPES,
    AdapterLoaded,
    AdapterLoadFailed,
    AdapterLoadRequested,
    Checkpoint,
    ConfigReloaded,
    GpuScraped,
    HealthProbed,
    LoadScraped,
    ModelsListed,
    ModelsUnchanged,
    ProbeCrashed,
    ReloadRejected,
    RunStarted,
    RunStopped,
    UpstreamFailed,
    UpstreamRecovered,
)
from journal.reader import segment_lines, segment_lines_backwards
from journal.segments import LogFileError, expand_log_paths, list_segments
from journal.writer import SegmentedFile

from builders import T0, make_config, run_started

# --- a strategy over every event type --------------------------------------------------------

texts = st.text(max_size=20)  # any unicode (hypothesis leaves out lone surrogates)
times = st.floats(min_value=0, max_value=4e9, allow_nan=False)
latencies = st.floats(allow_nan=False, allow_infinity=False)
int64s = st.integers(min_value=-(2**63), max_value=2**63 - 1)
configs = st.builds(
    Config,
    cluster=st.builds(ClusterConfig, name=texts),
    gateway=st.builds(
        GatewayConfig, listen=texts, health_interval=latencies, health_fail_threshold=int64s, event_log=texts
    ),
    nodes=st.lists(st.builds(NodeConfig, ip=texts, name=texts, vllm_port=int64s, ring=texts), max_size=3).map(tuple),
    models=st.builds(
        ModelsConfig,
        default=texts,
        available=st.lists(
            st.builds(
                ModelEntry, name=texts, pipeline_stages=int64s, ring=texts, policy=st.sampled_from(POLICIES),
                parent=texts, lora_path=texts,
            ),
            max_size=3,
        ).map(tuple),
    ),
    routing=st.builds(
        RoutingConfig,
        policy=st.sampled_from(POLICIES),
        load_scrape_interval=st.none() | latencies,
        prefix_messages=int64s,
        prefix_bytes=int64s,
        load_bound=latencies,
    ),
)
gpus = st.builds(
    GpuSample, uuid=texts, memory_used=int64s, memory_total=int64s, utilization=int64s, temperature=int64s
)


discoveries = st.builds(
    ModelDiscovery,
    state=st.sampled_from(Discovery),
    names=st.none() | st.lists(texts, max_size=3).map(tuple),
    fetched_at=st.none() | times,
    fails=int64s,
    last_error=texts,
    parents=st.lists(st.tuples(texts, texts), max_size=2).map(tuple),
)
loras = st.builds(
    LoraInfo, max_lora=int64s, running=st.lists(texts, max_size=2).map(tuple),
    waiting=st.lists(texts, max_size=2).map(tuple), truncated=int64s,
)
node_states = st.builds(
    NodeState,
    ip=texts,
    name=texts,
    status=st.sampled_from(Health),
    consecutive_failures=int64s,
    last_check=st.none() | times,
    gpus=st.lists(gpus, max_size=2).map(tuple),
    models=discoveries,
    offline_until=st.none() | times,
    load=st.builds(
        NodeLoad,
        known=st.booleans(),
        running=latencies,
        waiting=latencies,
        kv_cache_usage=st.none() | latencies,
        scraped_at=st.none() | times,
        fails=int64s,
        last_error=texts,
        lora=st.none() | loras,
    ),
    adapter_loads=st.lists(
        st.builds(AdapterLoad, adapter=texts, state=st.sampled_from(AdapterLoadState), at=times, error=texts),
        max_size=2,
    ).map(tuple),
)


def event(cls, **fields):
    return st.builds(cls, at=times, seq=st.integers(min_value=0, max_value=2**63 - 1), **fields)


EVENTS = {
    RunStarted: event(RunStarted, version=texts, config_path=texts, config=configs),
    ConfigReloaded: event(ConfigReloaded, config_path=texts, config=configs),
    ReloadRejected: event(ReloadRejected, config_path=texts, error=texts),
    HealthProbed: event(
        HealthProbed, node=texts, ok=st.booleans(), status=st.none() | st.integers(100, 599), error=texts,
        latency=latencies,
    ),
    ProbeCrashed: event(ProbeCrashed, node=texts, error=texts),
    GpuScraped: event(GpuScraped, node=texts, gpus=st.lists(gpus, max_size=3).map(tuple), error=texts),
    ModelsListed: event(
        ModelsListed, node=texts, models=st.none() | st.lists(texts, max_size=4).map(tuple), error=texts,
        parents=st.lists(st.tuples(texts, texts), max_size=2).map(tuple),
    ),
    ModelsUnchanged: event(ModelsUnchanged, node=texts, digest=texts),
    LoadScraped: event(
        LoadScraped, node=texts, running=st.none() | latencies, waiting=st.none() | latencies,
        kv_cache_usage=st.none() | latencies, lora=st.none() | loras, error=texts,
    ),
    AdapterLoadRequested: event(AdapterLoadRequested, node=texts, adapter=texts, parent=texts, lora_path=texts),
    AdapterLoaded: event(AdapterLoaded, node=texts, adapter=texts),
    AdapterLoadFailed: event(
        AdapterLoadFailed, node=texts, adapter=texts, error=texts, status=st.none() | st.integers(100, 599)
    ),
    UpstreamFailed: event(UpstreamFailed, node=texts, error=texts),
    UpstreamRecovered: event(UpstreamRecovered, node=texts),
    RunStopped: event(RunStopped),
    Checkpoint: event(
        Checkpoint, version=texts, config_path=texts, config=st.none() | configs,
        nodes=st.lists(node_states, max_size=3).map(tuple),
    ),
}
any_event = st.one_of(*EVENTS.values())


def test_the_strategy_covers_every_event_type():
    assert set(EVENTS) == set(EVENT_TYPES)


@settings(max_examples=200)
@given(any_event)
def test_every_event_survives_encode_then_decode(original):
    line = encode_event(original)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert decode_event(line) == original


@settings(max_examples=50)
@given(st.lists(any_event, min_size=1, max_size=8))
def test_every_event_survives_write_then_read(tmp_path_factory, events):
    log = tmp_path_factory.mktemp("log") / "events.jsonl"
    writer = SegmentedFile(log, "event log", max_segment_bytes=1024)
    for original in events:
        writer.write(encode_event(original))
    writer.close()
    assert list(read_events([log])) == events


# --- segments and rotation -------------------------------------------------------------------


def probes(count: int, first_seq: int = 1) -> list[HealthProbed]:
    return [HealthProbed(at=T0 + i, seq=first_seq + i, node="10.0.0.1", ok=True, status=200) for i in range(count)]


def write(log, events, max_segment_bytes: int = 1 << 20) -> SegmentedFile:
    writer = SegmentedFile(log, "event log", max_segment_bytes=max_segment_bytes)
    for item in events:
        writer.write(encode_event(item))
    writer.close()
    return writer


def test_rotation_by_size_and_reading_back_by_the_base_name(tmp_path):
    log = tmp_path / "var" / "events.jsonl"
    started = decode_event(encode_event(run_started(make_config())))  # the config as JSON has lists
    events = [started] + probes(20, first_seq=2)
    line_size = len(encode_event(events[1]))
    write(log, events, max_segment_bytes=3 * line_size)

    segments = list_segments(log)
    assert [p.name for p in segments[:3]] == ["events.000001.jsonl", "events.000002.jsonl", "events.000003.jsonl"]
    assert len(segments) > 2
    assert all(p.parent == log.parent for p in segments)
    # A line larger than a segment still gets written, alone; no other segment overflows.
    assert segments[0].read_bytes() == encode_event(events[0])
    assert all(p.stat().st_size <= 3 * line_size for p in segments[1:])
    assert not log.exists()
    assert expand_log_paths([log]) == segments
    assert list(read_events([log])) == events
    assert list(read_events(segments[1:2])) == events[1:4]  # one segment named directly


def test_a_new_writer_starts_a_new_segment_after_the_existing_ones(tmp_path):
    log = tmp_path / "events.jsonl"
    first = write(log, probes(2))
    assert first.current_segment is None  # closed
    (tmp_path / "events.000007.jsonl").write_bytes(encode_event(probes(3)[2]))
    (tmp_path / "other.000009.jsonl").write_bytes(b"")  # another log's segment
    writer = SegmentedFile(log, "event log", max_segment_bytes=1 << 20)
    writer.write(encode_event(probes(4)[3]))
    assert writer.current_segment == tmp_path / "events.000008.jsonl"
    writer.close()
    assert [p.name for p in list_segments(log)] == ["events.000001.jsonl", "events.000007.jsonl", "events.000008.jsonl"]
    assert [e.seq for e in read_events([log])] == [1, 2, 3, 4]


def test_a_missing_log_is_an_error_naming_it(tmp_path):
    with pytest.raises(LogFileError, match="events.jsonl: no such event log or segment"):
        list(read_events([tmp_path / "events.jsonl"]))


# --- damaged logs ----------------------------------------------------------------------------


def segment_with(tmp_path, *lines: bytes):
    path = tmp_path / "events.000001.jsonl"
    path.write_bytes(b"".join(lines))
    return path


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path):
    events = probes(3)
    torn = encode_event(probes(4)[3])[:25]
    path = segment_with(tmp_path, *map(encode_event, events), torn)
    warnings = []
    assert list(read_events([tmp_path / "events.jsonl"], warn=warnings.append)) == events
    assert len(warnings) == 1 and warnings[0].startswith(f"{path}:4: skipping torn last line")
    assert list(read_events([path])) == events  # no warn callback: skipped silently


def test_a_torn_last_line_of_an_earlier_segment_is_skipped_too(tmp_path):
    log = tmp_path / "events.jsonl"
    (tmp_path / "events.000001.jsonl").write_bytes(encode_event(probes(1)[0]) + b'{"type":"health_pro')
    (tmp_path / "events.000002.jsonl").write_bytes(encode_event(probes(2)[1]))
    warnings = []
    assert [e.seq for e in read_events([log], warn=warnings.append)] == [1, 2]
    assert len(warnings) == 1 and "events.000001.jsonl:2:" in warnings[0]


def test_a_bad_line_in_the_middle_names_file_and_line(tmp_path):
    first, second = map(encode_event, probes(2))
    path = segment_with(tmp_path, first, b'{"type": "health_probe", "at": \n', second)
    reader = read_events([path])
    assert next(reader) == probes(1)[0]
    with pytest.raises(LogFileError) as caught:
        next(reader)
    assert str(caught.value).startswith(f"{path}:2: ")


@pytest.mark.parametrize("position", ["middle", "last"])
def test_an_unknown_event_type_names_the_line(tmp_path, position):
    unknown = b'{"type":"node_exploded","at":1767323045.0,"seq":2,"node":"10.0.0.1"}\n'
    lines = [encode_event(probes(1)[0]), unknown]
    if position == "middle":
        lines.append(encode_event(probes(3)[2]))
    path = segment_with(tmp_path, *lines)
    with pytest.raises(LogFileError) as caught:
        list(read_events([path], warn=pytest.fail))
    assert str(caught.value).startswith(f"{path}:2: ")
    assert "node_exploded" in str(caught.value)


# --- last_seq --------------------------------------------------------------------------------


def test_last_seq(tmp_path):
    log = tmp_path / "events.jsonl"
    assert last_seq(log) == 0
    assert last_seq(tmp_path / "missing" / "events.jsonl") == 0
    write(log, probes(5))
    assert last_seq(log) == 5
    write(log, probes(3, first_seq=6))
    assert last_seq(log) == 8


def test_last_seq_skips_a_torn_line_and_empty_segments(tmp_path):
    log = tmp_path / "events.jsonl"
    write(log, probes(4))
    (tmp_path / "events.000002.jsonl").write_bytes(encode_event(probes(6)[4]) + b'{"type":"health_probe","at":1')
    (tmp_path / "events.000003.jsonl").write_bytes(b"")
    assert last_seq(log) == 5


@settings(max_examples=300, deadline=None)
@given(
    content=st.lists(st.sampled_from([b"a", b"bc", b"\n", b"\n\n", b"defgh"])).map(b"".join),
    block=st.integers(1, 8),
)
def test_a_segment_read_backwards_in_blocks_gives_its_lines_last_first(tmp_path_factory, content, block):
    path = tmp_path_factory.mktemp("segment") / "events.000001.jsonl"
    path.write_bytes(content)
    assert list(segment_lines_backwards(path, block_size=block)) == list(reversed(list(segment_lines(path))))
    assert list(segment_lines(path)) == content.split(b"\n")[: -1 if content.endswith(b"\n") or not content else None]


def test_last_seq_of_a_damaged_segment_still_counts_its_good_lines(tmp_path):
    """Continuing from an earlier segment's seq would hand out seqs the damaged one already used."""
    log = tmp_path / "events.jsonl"
    write(log, probes(2))
    good = encode_event(probes(9)[8])
    (tmp_path / "events.000002.jsonl").write_bytes(encode_event(probes(7)[6]) + b"garbage\n" + good)
    assert last_seq(log) == 9


def test_a_config_recorded_before_a_key_existed_decodes_with_its_default():
    """Logs outlive versions: a run_started written before `gateway.workers` existed still replays."""
    line = (
        b'{"type":"run_started","version":"0.1.0","config_path":"gateway.toml","config":{"gateway":'
        b'{"listen":":8000","decision_log":""},"nodes":[{"ip":"10.0.0.1"}]},"at":1.0,"seq":1}'
    )
    event = decode_event(line)
    assert event.config.gateway.workers == 1
    assert event.config.nodes[0].vllm_port == 8000
