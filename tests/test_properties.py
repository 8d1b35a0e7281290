"""Properties of `reduce` over generated event sequences: deterministic replay and state invariants."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from controlplane.rules.health import compute_status
from controlplane.rules.reducer import INITIAL_STATE, reduce
from events.config import NodeConfig
from events.state import Discovery, GpuSample
from events.types import (
    Checkpoint,
    ConfigReloaded,
    GpuScraped,
    LoadScraped,
    HealthProbed,
    ModelsListed,
    ProbeCrashed,
    ReloadRejected,
    UpstreamFailed,
    UpstreamRecovered,
)

from builders import T0, encode_state, make_config, run_started

# 10.0.0.10 sorts before 10.0.0.2 as a string; 10.0.0.99 is never configured.
IPS = ("10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.10", "10.0.0.11", "10.0.0.12")
EVENT_IPS = IPS + ("10.0.0.99",)
MODELS = ("m1", "m2", "m3")

node_ips = st.sampled_from(EVENT_IPS)
errors = st.sampled_from(["connection refused", "timed out"])


@st.composite
def configs(draw):
    """1-5 nodes (any subset of IPS, in any order), a threshold, and maybe other listen addresses."""
    ips = draw(st.lists(st.sampled_from(IPS), min_size=1, max_size=5, unique=True))
    nodes = [NodeConfig(ip=ip, name=f"name-{draw(st.integers(0, 2))}") for ip in ips]
    listen = draw(st.sampled_from([":8000", ":8001"]))
    return make_config(nodes, threshold=draw(st.integers(1, 4)), listen=listen)


names = st.lists(st.sampled_from(MODELS), min_size=1, max_size=3, unique=True).map(tuple)
gpu_lists = st.lists(st.builds(GpuSample, uuid=st.sampled_from(["GPU-0", "GPU-1"])), max_size=2).map(tuple)

observations = st.one_of(
    st.builds(HealthProbed, at=st.just(0.0), node=node_ips, ok=st.booleans(), error=st.sampled_from(["", "refused"])),
    st.builds(ModelsListed, at=st.just(0.0), node=node_ips, models=names),
    st.builds(ModelsListed, at=st.just(0.0), node=node_ips, models=st.just(())),
    st.builds(ModelsListed, at=st.just(0.0), node=node_ips, error=errors),
    st.builds(GpuScraped, at=st.just(0.0), node=node_ips, gpus=gpu_lists),
    st.builds(LoadScraped, at=st.just(0.0), node=node_ips, running=st.just(2.0), waiting=st.just(1.0)),
    st.builds(LoadScraped, at=st.just(0.0), node=node_ips, error=errors),
    st.builds(ProbeCrashed, at=st.just(0.0), node=node_ips, error=errors),
    st.builds(UpstreamFailed, at=st.just(0.0), node=node_ips, error=errors),
    st.builds(UpstreamRecovered, at=st.just(0.0), node=node_ips),
    configs().map(lambda c: ConfigReloaded(at=0.0, config_path="gateway.toml", config=c)),
    st.builds(ReloadRejected, at=st.just(0.0), config_path=st.just("gateway.toml"), error=errors),
)
"""Any event after the run start (its `at` is set by `event_sequences`)."""


@st.composite
def event_sequences(draw):
    """A numbered run: RunStarted, then 10 to 60 observations with non-decreasing `at`."""
    events = [run_started(draw(configs()))]
    at = T0
    for delay, event in draw(st.lists(st.tuples(st.sampled_from([0.0, 0.5, 3.0, 10.0]), observations), min_size=10, max_size=60)):
        at += delay
        events.append(msgspec.structs.replace(event, at=at))
    return [msgspec.structs.replace(event, seq=seq) for seq, event in enumerate(events, start=1)]


def replay(events, state=INITIAL_STATE):
    """Each state and each step, encoded, applying `events` from `state` on."""
    encoded = []
    for event in events:
        state, step = reduce(state, event)
        encoded.append((encode_state(state), msgspec.json.encode(step)))
    return encoded


@settings(max_examples=100, deadline=None)
@given(event_sequences())
def test_replaying_a_sequence_gives_identical_states_and_transitions(events):
    assert replay(events) == replay(events)


@settings(max_examples=100, deadline=None)
@given(event_sequences())
def test_invariants_hold_after_every_event(events):
    state = INITIAL_STATE
    for event in events:
        state, _ = reduce(state, event)
        assert (state.seq, state.at) == (event.seq, event.at)
        assert list(state.nodes) == sorted(state.nodes)
        assert list(state.nodes) == sorted(node.ip for node in state.config.nodes)
        for ip, node in state.nodes.items():
            models = node.models
            assert node.ip == ip
            assert models.fails >= 0 and models.empties >= 0 and node.consecutive_failures >= 0
            if models.state == Discovery.KNOWN_EMPTY:
                assert models.names is None
            if models.state in (Discovery.KNOWN, Discovery.DEGRADED):
                assert models.names  # only a non-empty list makes a node known
            if models.state == Discovery.EXPIRED:
                assert not any(models.allows(model) for model in MODELS + ("other",))
        if isinstance(event, HealthProbed) and event.node in state.nodes:
            node = state.nodes[event.node]
            threshold = state.config.gateway.health_fail_threshold
            assert node.status == compute_status(node.consecutive_failures, threshold)
            assert node.last_check == event.at


@settings(max_examples=100, deadline=None)
@given(event_sequences(), st.data())
def test_replay_from_a_checkpoint_equals_replay_from_the_start(events, data):
    """A follower that starts from a checkpoint at any seq, and applies the events after it,
    holds the same states and gets the same transitions as one that saw every event."""
    from_start = replay(events)
    cut = data.draw(st.integers(min_value=1, max_value=len(events)))
    state = INITIAL_STATE
    for event in events[:cut]:
        state, _ = reduce(state, event)
    checkpoint = msgspec.json.decode(msgspec.json.encode(Checkpoint.of(state)), type=Checkpoint)
    followed, _ = reduce(INITIAL_STATE, checkpoint)
    assert encode_state(followed) == from_start[cut - 1][0]
    assert replay(events[cut:], followed) == from_start[cut:]
