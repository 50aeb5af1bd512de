"""The on-disk cache of start-up tuning decisions (`--tuning-cache-dir`): a later start on the
same machine reads what an earlier one measured instead of measuring again.

One JSON file per decision, `<dir>/<GPU>/<name>.json`, holding its key and the decision. The key
is the environment the decision was measured in (GPU, NVIDIA driver, CUDA, torch, triton and
tokenmill versions, file format) plus what the tuner names (for the GEMV: dtype, weight shape,
input kind and the candidates it chose among). A file is written whole or not at all (a
temporary file renamed over it), so processes starting side by side can share a folder. A file
that cannot be read, does not decode, or holds another key (an upgrade, a file copied from
another GPU) is ignored with a warning, measured again and overwritten: the cache never fails a
start-up, and a folder that cannot be written only costs the next start its measuring.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import tokenmill

if TYPE_CHECKING:  # imported where used: the configuration imports this module, and torch late
    import torch

logger = logging.getLogger(__name__)

T = TypeVar("T")
# What decoding a stored decision may raise on a file that is not one (a missing field, a wrong
# type, a value out of range, a number too large for a float).
DECODE_ERRORS = (KeyError, TypeError, ValueError, ArithmeticError)
# Bumped when the files' layout changes: older files are then stale.
FILE_FORMAT = 1
_NVIDIA_DRIVER_FILE = Path("/proc/driver/nvidia/version")


def default_tuning_cache_dir() -> str:
    """`$XDG_CACHE_HOME/tokenmill/tuning`, else `~/.cache/tokenmill/tuning`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "tokenmill", "tuning")


def device_environment(device: torch.device) -> dict[str, str]:
    """What a measurement on `device` depends on besides its own inputs: the device (the GPU's
    name), the NVIDIA driver, CUDA, torch, triton and tokenmill versions."""
    import torch

    environment = {
        "device": device.type,
        "torch": torch.__version__,
        "triton": _package_version("triton"),
        "tokenmill": tokenmill.__version__,
    }
    if device.type == "cuda":
        environment.update(
            device=torch.cuda.get_device_name(device),
            cuda=str(torch.version.cuda),
            driver=_nvidia_driver_version(),
        )
    return environment


def _package_version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def _nvidia_driver_version() -> str:
    """The kernel driver's version ("550.54.15"), from the file the driver writes on Linux."""
    try:
        first_line = _NVIDIA_DRIVER_FILE.read_text().splitlines()[0]
    except (OSError, IndexError):
        return "unknown"
    found = re.search(r"\s(\d+\.\d+(?:\.\d+)*)\s", first_line)
    return found.group(1) if found else "unknown"


def file_name(text: str) -> str:
    """`text` as a file name: characters other than letters, digits, '.', '_' and '-' as '_'."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "_"


class TuningCache:
    """Tuning decisions on disk, for one environment (see the module docstring): `load` what
    an earlier start measured, `store` what this one measured."""

    def __init__(self, directory: str | Path, environment: Mapping[str, str]) -> None:
        self.environment: dict[str, Any] = {"format": FILE_FORMAT, **environment}
        device = str(environment.get("device", "any"))
        self.directory = Path(directory).expanduser() / file_name(device)

    def path(self, name: str) -> Path:
        """The file of decision `name`."""
        return self.directory / f"{file_name(name)}.json"

    def load(self, name: str, key: Mapping[str, Any], decode: Callable[[Any], T]) -> T | None:
        """The decision `name` stored under `key` in this environment, through `decode` (which
        raises one of `DECODE_ERRORS` on a value it cannot take); None when there is none to
        use, with a warning when there is a file but it cannot be used."""
        path = self.path(name)
        try:
            record = json.loads(path.read_text())
        except (FileNotFoundError, NotADirectoryError):  # never written (or no folder for it)
            return None
        except (OSError, ValueError, RecursionError) as exc:  # not UTF-8, not JSON, too deep
            return self._ignore(path, f"it cannot be read ({exc})")
        if not isinstance(record, dict) or not isinstance(record.get("key"), dict):
            return self._ignore(path, "it holds no tuning record")
        stored, expected = record["key"], self._key(key)
        if stored != expected:
            changed = ", ".join(
                f"{field} {stored.get(field)!r} (now {expected.get(field)!r})"
                for field in sorted(stored.keys() | expected.keys())
                if stored.get(field) != expected.get(field)
            )
            return self._ignore(path, f"it was measured with {changed}")
        try:
            return decode(record.get("value"))
        except DECODE_ERRORS as exc:
            return self._ignore(path, f"its decision does not decode ({exc!r})")

    def store(self, name: str, key: Mapping[str, Any], value: Any) -> None:
        """Write decision `name` (JSON data) under `key`, atomically; a failure to write is a
        warning (the decision holds for this run)."""
        path = self.path(name)
        text = json.dumps({"key": self._key(key), "value": value}, indent=1)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
            try:
                with os.fdopen(fd, "w") as f:
                    f.write(text)
                os.replace(temporary, path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
        except OSError as exc:
            logger.warning("cannot write the tuning cache file %s (%s); measuring again at the "
                           "next start", path, exc)  # fmt: skip

    def _key(self, key: Mapping[str, Any]) -> dict[str, Any]:
        # Through JSON, so that it compares equal to a key read back (tuples become lists).
        return json.loads(json.dumps({**self.environment, **key}))

    @staticmethod
    def _ignore(path: Path, why: str) -> None:
        logger.warning("ignoring the tuning cache file %s: %s; measuring again", path, why)
        return None


def open_tuning_cache(directory: str, device: torch.device) -> TuningCache | None:
    """The tuning cache in `directory` for measurements on `device`; None when `directory` is
    empty (no cache)."""
    return TuningCache(directory, device_environment(device)) if directory else None
