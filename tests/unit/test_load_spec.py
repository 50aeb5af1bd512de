"""The load generator's request mix (`tokenmill.testing.load`)."""

from __future__ import annotations

import random

import pytest

from tokenmill.testing.load import FEATURES, LoadSpec, _plan, _route_and_body


def test_load_spec_refuses_unknown_features_and_bad_fractions() -> None:
    with pytest.raises(ValueError, match="features"):
        LoadSpec(features="chat,telepathy")
    with pytest.raises(ValueError, match="feature_fraction"):
        LoadSpec(feature_fraction=1.5)
    assert LoadSpec(features="").feature_list == []


def test_every_feature_shapes_the_request() -> None:
    """With every feature on, a planned request takes each one (echo only on a non-streamed
    completion); with none, it is a plain completion."""
    rng = random.Random(0)
    everything = LoadSpec(feature_fraction=1.0)
    routes, keys = set(), set()
    for _ in range(20):
        plan = _plan(rng, everything)
        assert plan["features"] == set(FEATURES)
        route, body = _route_and_body("m", plan)
        routes.add(route)
        keys |= set(body)
        assert "messages" in body and "echo" not in body
        assert body["response_format"] == {"type": "json_object"} and body["top_logprobs"] == 2
    assert routes == {"/v1/chat/completions"}
    assert {"seed", "temperature", "presence_penalty", "stop"} <= keys
    assert "tools" not in keys  # a tool call's grammar is not combined with JSON output
    plan = {**_plan(rng, everything), "features": {"chat", "tools"}}
    assert _route_and_body("m", plan)[1]["tools"][0]["function"]["name"] == "get_weather"
    plain = _plan(rng, LoadSpec(feature_fraction=0.0))
    route, body = _route_and_body("m", {**plain, "features": {"echo", "logprobs"}, "stream": False})
    assert route == "/v1/completions" and body["echo"] is True and body["logprobs"] == 2
    assert _route_and_body("m", plain)[1].keys() == {
        "model", "prompt", "max_tokens", "n", "ignore_eos", "stream"
    }  # fmt: skip


def test_soak_refuses_a_warm_up_as_long_as_its_run() -> None:
    """The soak's RSS baseline is taken after the warm-up: one lasting the whole run would
    leave nothing to compare (refused before any server starts)."""
    import runpy
    from pathlib import Path

    soak = runpy.run_path(str(Path(__file__).parents[2] / "scripts" / "soak.py"))
    with pytest.raises(SystemExit) as exit_info:
        soak["main"](["--minutes", "1", "--warmup-minutes", "1"])
    assert exit_info.value.code == 2
