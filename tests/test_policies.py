"""The routing policies (`controlplane.rules.policies`): what each picks and the scores it records."""

from __future__ import annotations

from collections import Counter

import msgspec
import pytest

from controlplane.rules.policies import (
    AT_MAX_IN_FLIGHT,
    KV_AWARE,
    LEAST_LOAD,
    NOT_DRAWN,
    OVER_LOAD_BOUND,
    POWER_OF_TWO,
    PREFIX_AFFINITY,
    ROUND_ROBIN,
    PrefixMemory,
    choose,
    node_loads,
)
from events.decisions import KvBlocks
from events.state import NodeLoad, NodeState

IPS = ("10.0.0.1", "10.0.0.2", "10.0.0.3")


def pool(*loads: tuple[float, float] | None) -> list[NodeState]:
    """Nodes in IP order with (running, waiting) from their last scrape, or None: unknown."""
    return [
        NodeState(ip=ip, load=NodeLoad() if load is None else NodeLoad(known=True, running=load[0], waiting=load[1]))
        for ip, load in zip(IPS, loads)
    ]


def test_round_robin_is_plinths_rotation_and_scores_turns():
    nodes = pool((9, 9), (0, 0), (0, 0))
    picks = [choose(ROUND_ROBIN, nodes, rotation=r, in_flight={}).node.ip for r in range(4)]
    assert picks == [IPS[0], IPS[1], IPS[2], IPS[0]]  # load is not looked at
    choice = choose(ROUND_ROBIN, nodes, rotation=4, in_flight={IPS[0]: 2})
    assert [(c.node, c.score) for c in choice.candidates] == [(IPS[1], 0.0), (IPS[2], 1.0), (IPS[0], 2.0)]
    assert choice.margin == 1.0
    assert choice.candidates[2].in_flight == 2 and choice.candidates[2].running == 9


def test_least_load_adds_in_flight_here_to_running_and_waiting_there():
    nodes = pool((3, 1), (1, 0), (0, 0))
    choice = choose(LEAST_LOAD, nodes, rotation=0, in_flight={IPS[2]: 2})
    assert [(c.node, c.score) for c in choice.candidates] == [(IPS[1], 1.0), (IPS[2], 2.0), (IPS[0], 4.0)]
    assert choice.node.ip == IPS[1] and choice.margin == 1.0


def test_least_load_breaks_ties_in_round_robin_order():
    nodes = pool((1, 0), (1, 0), (1, 0))
    assert [choose(LEAST_LOAD, nodes, rotation=r, in_flight={}).node.ip for r in range(3)] == list(IPS)
    assert choose(LEAST_LOAD, nodes, rotation=0, in_flight={}).margin == 0.0


def test_an_unknown_load_counts_as_the_mean_of_the_known_ones():
    nodes = pool((4, 0), None, (0, 2))
    assert node_loads(nodes, {IPS[1]: 1}) == [4.0, 4.0, 2.0]
    choice = choose(LEAST_LOAD, nodes, rotation=1, in_flight={})
    assert choice.node.ip == IPS[2]
    unknown = next(c for c in choice.candidates if c.node == IPS[1])
    assert (unknown.running, unknown.waiting, unknown.score) == (None, None, 3.0)
    assert node_loads(pool(None, None), {}) == [0.0, 0.0]


def test_power_of_two_draws_from_the_request_id_and_takes_the_less_loaded():
    nodes = pool((5, 0), (0, 0), (2, 0))
    first = choose(POWER_OF_TWO, nodes, rotation=0, in_flight={}, request_id="req-1")
    again = choose(POWER_OF_TWO, nodes, rotation=7, in_flight={}, request_id="req-1")
    assert first == again  # the same request id draws the same two
    drawn, other = first.candidates[:2], first.candidates[2]
    assert drawn[0].score <= drawn[1].score and other.note == NOT_DRAWN and not drawn[0].note
    assert first.margin == drawn[1].score - drawn[0].score
    # over many requests, every pair is drawn: the most loaded node never wins, the least never loses
    winners = Counter(
        choose(POWER_OF_TWO, nodes, rotation=0, in_flight={}, request_id=f"r{i}").node.ip for i in range(300)
    )
    assert winners[IPS[0]] == 0 and winners[IPS[1]] > winners[IPS[2]] > 0


def test_power_of_two_with_one_candidate_takes_it():
    choice = choose(POWER_OF_TWO, pool((1, 0)), rotation=0, in_flight={}, request_id="x")
    assert choice.node.ip == IPS[0] and choice.margin is None and len(choice.candidates) == 1


def test_prefix_affinity_sends_a_prefix_to_the_same_node_and_spreads_prefixes():
    nodes = pool((0, 0), (0, 0), (0, 0))
    def home(prefix: str, rotation: int = 0) -> str:
        return choose(PREFIX_AFFINITY, nodes, rotation=rotation, in_flight={}, prefix=prefix).node.ip

    homes = {prefix: home(prefix) for prefix in map(str, range(60))}
    assert all(home(prefix, rotation) == homes[prefix] for rotation in range(3) for prefix in homes)
    assert set(Counter(homes.values())) == set(IPS)  # every node is home to some prefixes
    assert min(Counter(homes.values()).values()) >= 10


def test_prefix_affinity_keeps_its_home_when_another_node_goes_away():
    nodes = pool((0, 0), (0, 0), (0, 0))
    for prefix in map(str, range(30)):
        home = choose(PREFIX_AFFINITY, nodes, rotation=0, in_flight={}, prefix=prefix).node
        for gone in nodes:
            if gone is not home:
                rest = [node for node in nodes if node is not gone]
                assert choose(PREFIX_AFFINITY, rest, rotation=0, in_flight={}, prefix=prefix).node is home


def test_prefix_affinity_passes_over_a_node_above_the_load_bound():
    nodes = pool((0, 0), (0, 0), (0, 0))
    prefix = "system prompt A"
    home = choose(PREFIX_AFFINITY, nodes, rotation=0, in_flight={}, prefix=prefix).node.ip
    busy = {home: 6}  # mean with this request: 7/3; bound 1.25 × that → at most 3 with this one
    choice = choose(PREFIX_AFFINITY, nodes, rotation=0, in_flight=busy, prefix=prefix, load_bound=1.25)
    assert choice.node.ip != home
    passed = next(c for c in choice.candidates if c.node == home)
    assert (passed.note, passed.score, choice.candidates[-1].node) == (OVER_LOAD_BOUND, 0.0, home)
    assert choice.candidates[0].score == 1.0  # the next node in the prefix's order
    # a looser bound keeps the home node
    assert choose(PREFIX_AFFINITY, nodes, rotation=0, in_flight=busy, prefix=prefix, load_bound=4.0).node.ip == home


def test_prefix_affinitys_load_bound_weighs_each_node_by_its_time_between_tokens():
    def timed(*seconds_per_token: float | None) -> list[NodeState]:
        """Idle nodes (as last scraped) with these times between tokens."""
        return [
            NodeState(ip=ip, load=NodeLoad(known=True, seconds_per_token=seconds))
            for ip, seconds in zip(IPS, seconds_per_token)
        ]

    def pick(nodes: list[NodeState], prefix: str):
        return choose(PREFIX_AFFINITY, nodes, rotation=0, in_flight=dict.fromkeys(IPS, 2), prefix=prefix)

    prefix = next(p for p in map(str, range(100)) if pick(timed(None, None, None), p).node.ip == IPS[2])
    # Two requests each: in requests, the third node may take a third (3 <= ceil(1.25 × 7/3)).
    assert pick(timed(None, None, None), prefix).node.ip == IPS[2]
    assert pick(timed(0.01, 0.01, 0.01), prefix).node.ip == IPS[2]  # the same speed weighs nothing
    # 3× slower, its two requests weigh 6 of 10: with this one the work is 13, and the bound,
    # 1.25 × 13/3 = 5.4, rounds up to 2 of its requests.
    choice = pick(timed(0.01, 0.01, 0.03), prefix)
    slow = next(candidate for candidate in choice.candidates if candidate.node == IPS[2])
    assert choice.node.ip != IPS[2] and slow.note == OVER_LOAD_BOUND and slow.seconds_per_token == 0.03
    # An unknown time weighs as the mean of the known ones (2×): the work with this request is
    # 15, and the bound, 1.25 × 15/3 = 6.25, rounds up to 3 of the third node's requests.
    assert pick(timed(0.01, None, 0.03), prefix).node.ip == IPS[2]


def test_prefix_affinity_tries_the_node_the_prefix_last_went_to_first():
    nodes = pool((0, 0), (0, 0), (0, 0))
    prefix = "system prompt A"
    home = choose(PREFIX_AFFINITY, nodes, rotation=0, in_flight={}, prefix=prefix)
    elsewhere = next(c.node for c in home.candidates if c.node != home.node.ip)
    kept = choose(PREFIX_AFFINITY, nodes, rotation=0, in_flight={}, prefix=prefix, remembered=elsewhere)
    assert (kept.node.ip, kept.remembered, kept.candidates[0].score) == (elsewhere, elsewhere, 0.0)
    assert [c.node for c in kept.candidates[1:]] == [c.node for c in home.candidates if c.node != elsewhere]
    # Over the bound, the remembered node is passed over for the prefix's own order.
    busy = choose(PREFIX_AFFINITY, nodes, rotation=0, in_flight={elsewhere: 6}, prefix=prefix, remembered=elsewhere)
    assert busy.node.ip == home.node.ip and busy.candidates[-1].note == OVER_LOAD_BOUND
    # A remembered node no longer in the pool is nobody.
    rest = [node for node in nodes if node.ip != elsewhere]
    gone = choose(PREFIX_AFFINITY, rest, rotation=0, in_flight={}, prefix=prefix, remembered=elsewhere)
    assert (gone.node.ip, gone.remembered) == (home.node.ip, "")


def test_prefix_memory_forgets_the_least_recently_routed_prefix_first():
    memory = PrefixMemory(entries=2)
    memory.remember("a", IPS[0])
    memory.remember("b", IPS[1])
    memory.remember("a", IPS[2])  # routed again: now the most recent
    memory.remember("c", IPS[0])
    assert [memory.node_of(prefix) for prefix in "abc"] == [IPS[2], "", IPS[0]]


@pytest.mark.parametrize("policy", [ROUND_ROBIN, LEAST_LOAD, POWER_OF_TWO, PREFIX_AFFINITY, KV_AWARE])
def test_every_policy_scores_every_candidate_once_and_picks_the_first(policy):
    nodes = pool((2, 1), None, (0, 3))
    choice = choose(policy, nodes, rotation=5, in_flight={IPS[0]: 1}, request_id="abc", prefix="p")
    assert sorted(c.node for c in choice.candidates) == list(IPS)
    assert choice.node.ip == choice.candidates[0].node


@pytest.mark.parametrize("policy", [ROUND_ROBIN, LEAST_LOAD, POWER_OF_TWO, PREFIX_AFFINITY, KV_AWARE])
def test_every_policy_passes_over_a_node_without_room_while_another_has_room(policy):
    nodes = pool((0, 0), (0, 0), (0, 0))
    in_flight = {IPS[0]: 2, IPS[1]: 1}
    for rotation in range(6):
        choice = choose(
            policy, nodes, rotation=rotation, in_flight=in_flight, request_id=str(rotation), prefix="p",
            full={IPS[0], IPS[1]},
        )  # fmt: skip
        assert choice.node.ip == IPS[2]  # the only one with room
        assert {c.node for c in choice.candidates if c.note == AT_MAX_IN_FLIGHT} == set(IPS[:2])
        assert {c.node for c in choice.candidates if c.full} == set(IPS[:2])
    # When every node is full, the policy chooses among them all, as without the rule, each marked full.
    every = choose(policy, nodes, rotation=1, in_flight=in_flight, request_id="x", prefix="p", full=set(IPS))
    unbound = choose(policy, nodes, rotation=1, in_flight=in_flight, request_id="x", prefix="p")
    assert every.node == unbound.node
    assert every.candidates == tuple(msgspec.structs.replace(c, full=True) for c in unbound.candidates)


def held(matched: int, total: int = 8, flowing: bool = True, seq: int = 7) -> KvBlocks:
    return KvBlocks(matched=matched, total=total, seq=seq, flowing=flowing)


def test_kv_aware_prefers_the_node_holding_the_most_prompt_blocks_and_records_the_match():
    nodes = pool((0, 0), (0, 0), (0, 0))
    matches = {IPS[0]: held(2), IPS[1]: held(6), IPS[2]: held(0)}
    choice = choose(KV_AWARE, nodes, rotation=0, in_flight={}, prefix="p", matches=matches)
    assert [c.node for c in choice.candidates] == [IPS[1], IPS[0], IPS[2]]
    assert choice.candidates[0].kv == held(6) and not any(c.fallback for c in choice.candidates)
    assert choice.candidates[0].score == pytest.approx(0.25 + 1)  # lacks 2 of 8 blocks; all the work, sent there
    assert choice.margin == pytest.approx(0.5)


def test_kv_aware_weighs_the_blocks_held_against_the_load():
    nodes = pool((2, 0), (1, 0), (1, 0))
    # The busy node holds one block more of eight: its share of the work outweighs it.
    matches = {IPS[0]: held(8), IPS[1]: held(7), IPS[2]: held(0)}
    assert choose(KV_AWARE, nodes, rotation=0, in_flight={}, prefix="p", matches=matches).node.ip == IPS[1]
    # Holding the whole prompt against nothing outweighs a request more.
    matches = {IPS[0]: held(8), IPS[1]: held(0), IPS[2]: held(0)}
    assert choose(KV_AWARE, nodes, rotation=0, in_flight={}, prefix="p", matches=matches).node.ip == IPS[0]


def test_kv_aware_lets_a_node_holding_the_prompt_take_one_request_over_the_load_bound():
    # One request in the pool: prefix affinity's bound (whole requests) passes its node over for the next.
    nodes = pool((1, 0), (0, 0), (0, 0))
    matches = {IPS[0]: held(8), IPS[1]: held(0), IPS[2]: held(0)}
    affinity = choose(PREFIX_AFFINITY, nodes, rotation=0, in_flight={}, prefix="p", load_bound=1.25, remembered=IPS[0])
    assert affinity.node.ip != IPS[0] and affinity.candidates[-1].note == OVER_LOAD_BOUND
    choice = choose(KV_AWARE, nodes, rotation=0, in_flight={}, prefix="p", load_bound=1.25, matches=matches)
    assert choice.node.ip == IPS[0] and not any(c.note for c in choice.candidates)
    # Two requests more on it: over the bound by more than the slack.
    choice = choose(KV_AWARE, nodes, rotation=0, in_flight={IPS[0]: 2}, prefix="p", load_bound=1.25, matches=matches)
    assert choice.node.ip != IPS[0]
    assert choice.candidates[-1].node == IPS[0] and choice.candidates[-1].note == OVER_LOAD_BOUND


def test_kv_aware_passes_over_a_node_above_the_load_bound_however_much_it_holds():
    nodes = pool((6, 0), (1, 0), (1, 0))
    matches = {IPS[0]: held(8), IPS[1]: held(0), IPS[2]: held(0)}
    choice = choose(KV_AWARE, nodes, rotation=0, in_flight={IPS[0]: 1}, prefix="p", load_bound=1.25, matches=matches)
    assert choice.node.ip != IPS[0]
    assert choice.candidates[-1].node == IPS[0] and choice.candidates[-1].note == OVER_LOAD_BOUND


def test_kv_aware_falls_back_to_prefix_affinity_when_no_nodes_events_flow():
    nodes = pool((0, 0), (0, 0), (0, 0))
    stalled = {ip: held(8, flowing=False) for ip in IPS}
    for prefix in ("a", "b", "c", "d"):
        affinity = choose(PREFIX_AFFINITY, nodes, rotation=0, in_flight={}, prefix=prefix)
        for matches in ({}, stalled):
            choice = choose(KV_AWARE, nodes, rotation=0, in_flight={}, prefix=prefix, matches=matches)
            assert [(c.node, c.score) for c in choice.candidates] == [(c.node, c.score) for c in affinity.candidates]
            assert all(c.fallback for c in choice.candidates)
            assert [c.kv for c in choice.candidates] == [matches.get(c.node) for c in choice.candidates]


def test_kv_aware_guesses_for_a_node_whose_events_stalled_as_prefix_affinity_does():
    nodes = pool((0, 0), (0, 0), (0, 0))
    prefix = "system prompt"
    first = choose(PREFIX_AFFINITY, nodes, rotation=0, in_flight={}, prefix=prefix).node.ip
    others = [ip for ip in IPS if ip != first]
    # The prefix's first node, stalled, is guessed to hold the prompt: it beats one holding half.
    matches = {first: held(0, flowing=False), others[0]: held(4), others[1]: held(0)}
    choice = choose(KV_AWARE, nodes, rotation=0, in_flight={}, prefix=prefix, matches=matches)
    assert choice.node.ip == first and choice.candidates[0].fallback
    assert [c.fallback for c in choice.candidates[1:]] == [False, False]
    # Another node, stalled, is guessed to hold nothing.
    matches = {first: held(0), others[0]: held(4), others[1]: held(8, flowing=False)}
    choice = choose(KV_AWARE, nodes, rotation=0, in_flight={}, prefix=prefix, matches=matches)
    assert choice.node.ip == others[0]
    assert {c.node for c in choice.candidates if c.fallback} == {others[1]}
