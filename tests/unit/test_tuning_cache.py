"""The start-up tuning cache: a second start reads what the first one measured and measures
nothing; a corrupt, unreadable or stale file is ignored with a warning, measured again and
replaced; a folder that cannot be written costs only the measuring."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

import tokenmill
from tokenmill.config import EngineArgs
from tokenmill.kernels.gemv_tuning import (
    GEMV_BUCKETS,
    GEMV_CANDIDATES,
    GemvChoice,
    InputKind,
    ShippedChoices,
    choose_gemv_configs,
    export_shipped_choices,
)
from tokenmill.tuning_cache import (
    TuningCache,
    default_tuning_cache_dir,
    device_environment,
    open_tuning_cache,
)

ENV = {
    "device": "NVIDIA H200",
    "driver": "550.54.15",
    "cuda": "12.8",
    "torch": "2.13.0",
    "triton": "3.6.0",
    "tokenmill": "0.1.0",
}
Shape = tuple[int, int, InputKind]
# Weight groups as the layers hand them over: (n, k, input kind) -> the weights of that shape.
WEIGHTS: dict[Shape, list[torch.Tensor]] = {
    (32, 16, "plain"): [torch.zeros(32, 16, dtype=torch.bfloat16)] * 3,
    (16, 64, "gated"): [torch.zeros(16, 64, dtype=torch.bfloat16)] * 2,
    (48, 16, "normed"): [torch.zeros(48, 16, dtype=torch.bfloat16)] * 2,
}


class Measurer:
    """Plays `fastest_gemv` (which needs a GPU): for one row a candidate picked by the shape
    beats cuBLAS, unfused for a gated input; for more rows cuBLAS stays. Records its calls."""

    def __init__(self) -> None:
        self.calls: list[tuple[Shape, tuple[int, ...]]] = []

    def __call__(
        self, weights: list[torch.Tensor], buckets: Sequence[int], kind: InputKind
    ) -> dict[int, tuple[GemvChoice | None, float, float]]:
        n, k = weights[0].shape
        self.calls.append(((n, k, kind), tuple(buckets)))
        return {rows: (self.choice(n, kind) if rows == 1 else None, 2e-6, 3e-6) for rows in buckets}

    @staticmethod
    def choice(n: int, kind: InputKind) -> GemvChoice:
        return GemvChoice(GEMV_CANDIDATES[n % len(GEMV_CANDIDATES)], fused=kind != "gated")


EXPECTED = {(n, k, kind): {1: Measurer.choice(n, kind)} for n, k, kind in WEIGHTS}


def _start(directory: Path, environment: dict[str, str] = ENV) -> Measurer:
    """One engine start's tuning with the cache in `directory`: checks its choices and returns
    what it measured."""
    measurer = Measurer()
    assert choose_gemv_configs(WEIGHTS, TuningCache(directory, environment), measurer) == EXPECTED
    return measurer


def _measured_shapes(measurer: Measurer) -> set[Shape]:
    return {shape for shape, _ in measurer.calls}


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_second_start_reads_the_cache_and_measures_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    first = _start(tmp_path)
    assert sorted(first.calls) == sorted((s, GEMV_BUCKETS) for s in WEIGHTS)
    files = sorted(p.name for p in tmp_path.rglob("*") if p.is_file())
    # One file per shape, in the GPU's folder, and no temporary file left behind.
    assert files == [
        "gemv-bfloat16-16x64-gated.json",
        "gemv-bfloat16-32x16-plain.json",
        "gemv-bfloat16-48x16-normed.json",
    ]
    assert {p.parent.name for p in tmp_path.rglob("*.json")} == {"NVIDIA_H200"}
    caplog.clear()
    assert _start(tmp_path).calls == []
    assert _warnings(caplog) == []
    assert caplog.text.count("[tuning cache]") == len(WEIGHTS) * len(GEMV_BUCKETS)


def test_without_a_cache_every_start_measures(tmp_path: Path) -> None:
    for _ in range(2):
        measurer = Measurer()
        assert choose_gemv_configs(WEIGHTS, None, measurer) == EXPECTED
        assert len(measurer.calls) == len(WEIGHTS)


def _edit_value(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def damage(path: Path) -> None:
        record = json.loads(path.read_text())
        edit(record["value"])
        path.write_text(json.dumps(record))

    return damage


DAMAGE: dict[str, Callable[[Path], None]] = {
    "not JSON": lambda p: p.write_text("{not json"),
    "cut short": lambda p: p.write_text(p.read_text()[: len(p.read_text()) // 2]),
    "empty": lambda p: p.write_text(""),
    "not UTF-8": lambda p: p.write_bytes(b"\xff\xfe\x00garbage"),
    "not a record": lambda p: p.write_text("[1, 2, 3]"),
    "no key": lambda p: p.write_text('{"value": {}}'),
    "a bucket missing": _edit_value(lambda v: v.pop("1")),
    "a config that is no candidate": _edit_value(
        lambda v: v["1"]["choice"]["config"].update(block_k=3)
    ),
    "a config with an unknown field": _edit_value(
        lambda v: v["1"]["choice"]["config"].update(tiles=2)
    ),
    "a time that is no number": _edit_value(lambda v: v["4"].update(us="fast")),
    "a time too large for a float": _edit_value(lambda v: v["4"].update(us=10**400)),
    "nested too deep": lambda p: p.write_text("[" * 100_000 + "]" * 100_000),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_corrupt_file_is_ignored_with_a_warning_and_rewritten(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, damage: str
) -> None:
    _start(tmp_path)
    path = next(tmp_path.rglob("gemv-bfloat16-32x16-plain.json"))
    DAMAGE[damage](path)
    caplog.clear()
    again = _start(tmp_path)
    assert _measured_shapes(again) == {(32, 16, "plain")}  # only the damaged shape
    [warning] = _warnings(caplog)
    assert str(path) in warning and "ignoring the tuning cache file" in warning
    assert _start(tmp_path).calls == []  # the file was written anew


STALE: dict[str, dict[str, str]] = {
    "torch upgraded": {"torch": "2.14.0"},
    "triton upgraded": {"triton": "3.7.0"},
    "driver upgraded": {"driver": "560.35.03"},
    "CUDA upgraded": {"cuda": "13.0"},
    "tokenmill upgraded": {"tokenmill": "0.2.0"},
}


@pytest.mark.parametrize("change", list(STALE))
def test_a_stale_file_is_ignored_with_a_warning_and_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, change: str
) -> None:
    _start(tmp_path)
    upgraded = {**ENV, **STALE[change]}
    caplog.clear()
    assert _measured_shapes(_start(tmp_path, upgraded)) == set(WEIGHTS)
    warnings = _warnings(caplog)
    assert len(warnings) == len(WEIGHTS)
    [(field, now)] = STALE[change].items()
    assert all(f"{field} {ENV[field]!r} (now {now!r})" in w for w in warnings)
    assert _start(tmp_path, upgraded).calls == []  # replaced: read back under the new key
    assert _measured_shapes(_start(tmp_path)) == set(WEIGHTS)  # and the old key is stale now


def test_a_file_measured_on_another_gpu_is_stale(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _start(tmp_path)
    other = {**ENV, "device": "NVIDIA A100"}
    shutil.copytree(tmp_path / "NVIDIA_H200", tmp_path / "NVIDIA_A100")  # a copied cache
    caplog.clear()
    assert _measured_shapes(_start(tmp_path, other)) == set(WEIGHTS)
    assert all("device 'NVIDIA H200' (now 'NVIDIA A100')" in w for w in _warnings(caplog))
    assert _start(tmp_path).calls == []  # the first GPU's files are untouched


def test_a_folder_that_cannot_be_written_costs_only_the_measuring(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    caplog.clear()
    for _ in range(2):  # no start fails; each one measures
        assert len(_start(blocked).calls) == len(WEIGHTS)
    assert all("cannot write the tuning cache file" in w for w in _warnings(caplog))


def test_a_folder_in_place_of_a_file_is_unreadable_and_unwritable_but_harmless(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    _start(tmp_path)
    path = next(tmp_path.rglob("gemv-bfloat16-32x16-plain.json"))
    path.unlink()
    path.mkdir()
    caplog.clear()
    assert _measured_shapes(_start(tmp_path)) == {(32, 16, "plain")}
    read, write = _warnings(caplog)
    assert "cannot be read" in read and "cannot write" in write


def test_the_environment_names_the_versions_a_measurement_depends_on() -> None:
    environment = device_environment(torch.device("cpu"))
    assert environment["torch"] == torch.__version__
    assert environment["tokenmill"] == tokenmill.__version__
    assert environment["triton"]  # a version, or "none" where triton is not installed
    assert environment["device"] == "cpu"


def test_the_cache_folder_defaults_to_the_user_cache_and_empty_turns_it_off(
    llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_tuning_cache_dir() == str(tmp_path / "xdg" / "tokenmill" / "tuning")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    home_default = str(tmp_path / "home" / ".cache" / "tokenmill" / "tuning")
    assert default_tuning_cache_dir() == home_default

    def runner_dir(**args: str) -> str:
        config = EngineArgs(model=str(llama_dir), device="cpu", **args).create_engine_config()
        return config.runner.tuning_cache_dir

    assert runner_dir() == home_default
    assert runner_dir(tuning_cache_dir=str(tmp_path / "mine")) == str(tmp_path / "mine")
    assert runner_dir(tuning_cache_dir="") == ""
    assert open_tuning_cache("", torch.device("cpu")) is None


def _shipped(tmp_path: Path) -> ShippedChoices:
    """The choices one start measured on the H200, exported as shipped choices."""
    _start(tmp_path / "measured")
    written = export_shipped_choices(tmp_path / "measured", tmp_path / "shipped")
    assert [p.name for p in written] == ["NVIDIA_H200.json"]
    shipped = ShippedChoices.load("NVIDIA H200", tmp_path / "shipped")
    assert shipped is not None
    return shipped


def test_a_first_start_takes_the_shipped_choices_that_hold_here(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On a GPU tokenmill ships choices for, a start whose cache lacks a shape checks the
    shipped choices (building only the chosen kernels) instead of measuring; it stores them,
    so the next start reads its cache. A shape whose shipped kernels fail the check here (a
    kernel that does not build on this driver) is measured."""
    caplog.set_level(logging.INFO)
    shipped = _shipped(tmp_path)
    checked: list[Shape] = []

    def check(weights: list[torch.Tensor], timings: dict, kind: InputKind) -> bool:
        n, k = weights[0].shape
        checked.append((n, k, kind))
        assert timings == {b: t for b, t in timings.items() if b in GEMV_BUCKETS}
        return (n, k, kind) != (16, 64, "gated")  # this one's kernel fails here

    fresh = TuningCache(tmp_path / "fresh", ENV)
    measurer = Measurer()
    assert choose_gemv_configs(WEIGHTS, fresh, measurer, shipped=shipped, check=check) == EXPECTED
    assert sorted(checked) == sorted(WEIGHTS)
    assert measurer.calls == [((16, 64, "gated"), GEMV_BUCKETS)]
    assert caplog.text.count("[shipped]") == 2 * len(GEMV_BUCKETS)
    assert "shipped GEMV choices of gemv-bfloat16-16x64-gated do not hold here" in caplog.text
    again = Measurer()  # the cache has every shape now: nothing shipped is checked again
    assert choose_gemv_configs(WEIGHTS, fresh, again, shipped=shipped, check=None) == EXPECTED
    assert again.calls == []


def test_shipped_choices_of_other_settings_or_unreadable_are_ignored(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A shipped file never fails a start: not there, another digest of candidates, not JSON,
    nested too deep: no shipped choices (with a warning); a shape whose value does not decode
    (a bucket missing, a time too large for a float): that shape measured."""
    shipped = _shipped(tmp_path)
    folder = tmp_path / "shipped"
    assert ShippedChoices.load("NVIDIA H100", folder) is None  # none shipped: no warning
    original = json.loads(shipped.path.read_text())
    assert original["measured_with"]["driver"] == ENV["driver"]

    def write(edit: Callable[[dict], object]) -> ShippedChoices | None:
        record = json.loads(json.dumps(original))
        edit(record)
        shipped.path.write_text(json.dumps(record))
        return ShippedChoices.load("NVIDIA H200", folder)

    plain, normed = "gemv-bfloat16-32x16-plain", "gemv-bfloat16-48x16-normed"
    damaged = write(lambda r: r["shapes"][plain].pop("4"))
    assert damaged is not None and damaged.timings(plain) is None
    assert damaged.timings(normed) is not None
    measurer = Measurer()
    choose_gemv_configs(WEIGHTS, None, measurer, shipped=damaged, check=lambda *_: True)
    assert measurer.calls == [((32, 16, "plain"), GEMV_BUCKETS)]
    huge = write(lambda r: r["shapes"][normed]["1"].update(us=10**400))
    assert huge is not None and huge.timings(normed) is None
    caplog.clear()
    assert write(lambda r: r.update(settings="other candidates")) is None
    shipped.path.write_text("{not json")
    assert ShippedChoices.load("NVIDIA H200", folder) is None
    shipped.path.write_text("[" * 100_000 + "]" * 100_000)
    assert ShippedChoices.load("NVIDIA H200", folder) is None
    warnings = _warnings(caplog)
    assert len(warnings) == 3 and "other tuning settings" in warnings[0]


def test_shipped_choices_kept_in_the_cache_are_not_exported_again(tmp_path: Path) -> None:
    """A start that took shipped choices stores them marked shipped: an export of its cache
    ships only what was measured there."""
    shipped = _shipped(tmp_path)
    choose_gemv_configs(WEIGHTS, TuningCache(tmp_path / "took", ENV), Measurer(),
                        shipped=shipped, check=lambda *_: True)  # fmt: skip
    files = list((tmp_path / "took").rglob("gemv-*.json"))
    assert len(files) == len(WEIGHTS)
    assert all(json.loads(f.read_text())["value"]["shipped"] for f in files)
    assert _start(tmp_path / "took").calls == []  # read back from the cache as choices
    assert export_shipped_choices(tmp_path / "took", tmp_path / "again") == []


def test_an_export_merges_into_what_is_shipped_and_skips_stale_files(tmp_path: Path) -> None:
    shipped = _shipped(tmp_path)
    later = tmp_path / "later"
    gpu = later / "NVIDIA_H200"
    gpu.mkdir(parents=True)
    value = {str(b): {"choice": None, "us": 9.0, "cublas_us": 9.0} for b in GEMV_BUCKETS}
    current = json.loads(shipped.path.read_text())["settings"]
    for stem, settings in (
        ("gemv-bfloat16-64x64-plain", current),
        ("gemv-bfloat16-8x8-plain", "x"),
    ):
        key = {**ENV, "kernel": "gemv", "settings": settings}
        (gpu / f"{stem}.json").write_text(json.dumps({"key": key, "value": value}))
    export_shipped_choices(later, tmp_path / "shipped")
    assert export_shipped_choices(tmp_path / "no-such-folder", tmp_path / "shipped") == []
    merged = ShippedChoices.load("NVIDIA H200", tmp_path / "shipped")
    assert merged is not None
    assert set(merged.shapes) == {*shipped.shapes, "gemv-bfloat16-64x64-plain"}  # not 8x8
