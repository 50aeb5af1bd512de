"""`python -m tokenmill.testing.checkpoints DIR [FAMILY]`: its --help and bad arguments write
nothing (a bare `sys.argv` read once made a directory named `--help`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenmill.testing.checkpoints import main


@pytest.mark.parametrize(("argv", "code"), [(["--help"], 0), (["x", "gpt2"], 2), ([], 2)])
def test_help_and_bad_arguments_write_nothing(
    argv: list[str], code: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == code and list(tmp_path.iterdir()) == []


def test_writes_the_family_asked_for(tmp_path: Path) -> None:
    main([str(tmp_path / "tiny"), "qwen3"])
    assert '"model_type": "qwen3"' in (tmp_path / "tiny" / "config.json").read_text()
