"""The replica routing policy (`tokenmill.deploy.routing`), without Ray: prefixes, sessions,
load balance; the replica flags."""

from __future__ import annotations

import math
import re

import pytest

from tokenmill.deploy.options import MAX_COUNT, DeployOptions
from tokenmill.deploy.routing import TOKEN_BLOCK, RoutedRequest, RouterState, prefix_blocks
from tokenmill.entrypoints.cli import main

REPLICAS = ["a", "b", "c"]


def request(prompt: list[int] | str | None = None, session: str | None = None) -> RoutedRequest:
    body = {} if prompt is None else {"prompt": prompt}
    return RoutedRequest("POST", "/v1/completions", prefix=prefix_blocks(body), session=session)


def first_choice(state: RouterState, routed: RoutedRequest) -> list[str]:
    return state.rank(REPLICAS, routed)[0]


def send(state: RouterState, routed: RoutedRequest, replica: str, request_id: str) -> None:
    state.routed(routed, request_id, replica)


def test_token_prompts_hash_as_chains_of_whole_blocks() -> None:
    ids = list(range(100, 100 + 3 * TOKEN_BLOCK + 5))
    blocks = prefix_blocks({"prompt": ids})
    assert len(blocks) == 3  # the partial last block is left out
    assert prefix_blocks({"prompt": ids[: 2 * TOKEN_BLOCK]}) == blocks[:2]
    other = prefix_blocks({"prompt": [7, *ids[1:]]})
    assert not set(other) & set(blocks), "a block's hash covers every block before it"


def test_a_chat_turn_extends_the_previous_turns_prefix() -> None:
    turn1 = [{"role": "system", "content": "s" * 300}, {"role": "user", "content": "u" * 300}]
    turn2 = [*turn1, {"role": "assistant", "content": "a" * 300}, {"role": "user", "content": "q"}]
    one, two = prefix_blocks({"messages": turn1}), prefix_blocks({"messages": turn2})
    assert one and two[: len(one)] == one and len(two) > len(one)


def test_chats_with_different_images_part_at_the_image() -> None:
    def turn(url: str) -> list[dict]:
        image = {"type": "image_url", "image_url": {"url": url}}
        text = {"type": "text", "text": "t" * 600}
        return [
            {"role": "system", "content": "s" * 600},
            {"role": "user", "content": [image, text]},
        ]

    same, again = (
        prefix_blocks({"messages": turn("data:a")}),
        prefix_blocks({"messages": turn("data:a")}),
    )
    other = prefix_blocks({"messages": turn("data:b")})
    assert same == again
    shared = sum(1 for x, y in zip(same, other, strict=False) if x == y)
    assert 0 < shared < len(same)  # the system prompt's blocks only


def test_request_goes_to_the_replica_holding_the_longest_prefix() -> None:
    state = RouterState()
    shared = list(range(10, 10 + 4 * TOKEN_BLOCK))
    send(state, request(shared[: 2 * TOKEN_BLOCK]), "a", "r1")
    send(state, request(shared), "b", "r2")
    state.completed("r1"), state.completed("r2")
    assert first_choice(state, request([*shared, 1, 2, 3])) == ["b"]
    assert first_choice(state, request(shared[: 2 * TOKEN_BLOCK] + [9] * TOKEN_BLOCK)) == ["a", "b"]


def test_new_prefixes_spread_over_replicas() -> None:
    state = RouterState()
    for i in range(6):
        routed = request([1000 + i] * (2 * TOKEN_BLOCK))
        replica = first_choice(state, routed)[0]
        send(state, routed, replica, f"r{i}")
        state.completed(f"r{i}")
    assert {state.index.size(r) for r in REPLICAS} == {4}  # two prefixes of 2 blocks each


def test_a_hot_prefix_overflows_to_other_replicas_past_the_imbalance_bound() -> None:
    state = RouterState(max_imbalance=2)
    hot = list(range(50, 50 + 2 * TOKEN_BLOCK))
    chosen = []
    for i in range(9):
        replica = first_choice(state, request(hot))[0]
        send(state, request(hot), replica, f"r{i}")  # none completes
        chosen.append(replica)
    loads = sorted(state.in_flight.values())
    assert loads[-1] - loads[0] <= 3, f"in flight per replica: {state.in_flight}"
    assert chosen[:3] == [chosen[0]] * 3, "the prefix stays put while the load allows"


def test_a_sessions_turns_go_to_one_replica() -> None:
    state = RouterState()
    homes = set()
    for turn in range(4):
        routed = request(f"turn {turn} of a different prompt " * turn or None, session="alice")
        replica = first_choice(state, routed)[0]
        send(state, routed, replica, f"t{turn}")
        state.completed(f"t{turn}")
        homes.add(replica)
        send(state, request([turn] * TOKEN_BLOCK), "abc"[turn % 3], f"noise{turn}")  # others
    assert len(homes) == 1


def test_an_overloaded_session_home_is_left_and_a_gone_replica_forgotten() -> None:
    state = RouterState(max_imbalance=1)
    send(state, request(session="s"), "a", "first")
    send(state, request(), "a", "busy")
    send(state, request(), "a", "busier")
    assert first_choice(state, request(session="s")) != ["a"]
    state.forget("a")
    assert "s" not in state.sessions and state.index.size("a") == 0


def test_completed_requests_lower_the_load_and_retries_avoid_failed_replicas() -> None:
    state = RouterState()
    send(state, request(), "a", "r")
    assert state.in_flight["a"] == 1
    state.completed("r")
    state.completed("r")  # a second completion of the same request changes nothing
    assert state.in_flight["a"] == 0
    retry = RoutedRequest("POST", "/v1/completions", avoid=frozenset({"a", "b"}))
    assert state.rank(REPLICAS, retry) == [["c"]]


def test_deploy_options_refuse_inconsistent_counts() -> None:
    assert not DeployOptions().enabled
    assert DeployOptions(min_replicas=1, max_replicas=3).initial_replicas == 1
    with pytest.raises(ValueError, match="both min_replicas and max_replicas"):
        DeployOptions(max_replicas=2)
    with pytest.raises(ValueError, match="min_replicas <= max_replicas"):
        DeployOptions(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError, match="router must be one of"):
        DeployOptions(replicas=2, router="random")


@pytest.mark.parametrize(
    "bad",
    [
        {"replica_num_cpus": -1}, {"replica_num_gpus": -0.5}, {"replica_num_cpus": math.inf},
        {"upscale_delay_s": -1}, {"downscale_delay_s": math.nan},
        {"target_ongoing_requests": math.nan},
    ],
)  # fmt: skip
def test_deploy_options_refuse_negative_or_not_finite_amounts(bad: dict) -> None:
    # Ray refused some only once started, naming no flag; took others (NaN) silently.
    with pytest.raises(ValueError, match=next(iter(bad))):
        DeployOptions(replicas=1, **bad)


@pytest.mark.parametrize(
    "name", ["replicas", "min_replicas", "max_replicas", "max_ongoing_requests"]
)
def test_deploy_options_refuse_counts_past_what_ray_serve_holds(name: str) -> None:
    # Ray refused them only once started, as "Value out of range: ...", naming no flag.
    counts = {"min_replicas": 0, "max_replicas": 1, name: MAX_COUNT + 1}
    with pytest.raises(ValueError, match=f"^{name} must be <= {MAX_COUNT}, got {MAX_COUNT + 1}"):
        DeployOptions(**counts)
    DeployOptions(**{**counts, name: MAX_COUNT, "max_replicas": MAX_COUNT})


def test_serve_refuses_inconsistent_replica_flags_before_starting_anything(capsys) -> None:
    assert main(["serve", "--max-replicas", "2"]) == 2
    assert "give both min_replicas and max_replicas" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("options", "fragment"),
    [
        ({"replicas": 1, "replica_num_gpus": 1}, "replica_num_gpus 1 need 1 GPUs"),
        ({"replicas": 3}, "3 replica(s) of replica_num_cpus 1 need 3 CPUs"),
        ({"min_replicas": 2, "max_replicas": 4, "replica_num_cpus": 1.5}, "need 3 CPUs"),
    ],
)
def test_replicas_that_a_local_ray_instance_cannot_hold_are_refused_naming_the_option(
    options: dict, fragment: str
) -> None:
    # Ray Serve waited for them forever (its autoscaler logging that nothing can hold them).
    with pytest.raises(ValueError, match=re.escape(fragment)):
        DeployOptions(**options).check_fits({"CPU": 2.0})
    DeployOptions(replicas=2).check_fits({"CPU": 2.0})


@pytest.mark.parametrize(
    ("flags", "fragment"),
    [
        (["--host", "999.1.1.1"], "cannot listen on 999.1.1.1:8000"),  # was Ray's RuntimeError
        (["--ray-address", "no-such-cluster"], "ray_address 'no-such-cluster': "),
    ],
)
def test_serve_replicas_refuses_what_cannot_work_naming_the_option(
    capsys, flags: list[str], fragment: str
) -> None:
    pytest.importorskip("ray", reason="replicas need Ray Serve: pip install 'tokenmill[ray]'")
    assert main(["serve", "--replicas", "1", *flags]) == 2
    assert fragment in capsys.readouterr().err
