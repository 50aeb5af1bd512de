"""The `tokenmill` console command (also `python -m tokenmill`).

`tokenmill --version` is answered here, before the command line's parser is built: building it
imports the engine's configuration and with it torch, seconds of start-up for one line of output.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from tokenmill import __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Print the version, or run the full command line (`tokenmill.entrypoints.cli`)."""
    args = sys.argv[1:] if argv is None else list(argv)
    if args == ["--version"]:
        print(f"tokenmill {__version__}")
        return 0
    from tokenmill.entrypoints import cli

    return cli.main(args)


if __name__ == "__main__":
    sys.exit(main())
