"""The `eventbus` command: replay, summary, tail and plot for recorded JSONL logs; bench; ctl.

    eventbus replay LOG... --subscribe SPEC... [--out FILE]
    eventbus summary LOG... [--json]
    eventbus tail LOG [-n N] [--no-follow] [--timeout S] [--max-lines N]
    eventbus plot LOG... -o report.png
    eventbus bench STEP --subscribe SPEC... [--steps N] [--rounds R] [--json [FILE]] [--plot F]
    eventbus ctl RUN_DIR status|stop|abort|save|ping [REASON] [--json] [--tcp H:P]

SPEC: `jsonl:DIR`, `tensorboard:DIR`, `divergence`, `memory`, `progress` (options as
`divergence:action=warn,window=50`), or `module:factory` (imported with importlib).
Bad arguments and unreadable or corrupt files: one line on stderr and exit code 2; a bad line
is named as `file:line: what is wrong`. `ctl` has exit codes of its own (3 to 7: see its help).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from eventbus.cli import bench, ctl, plot, replay, summary, tail
from eventbus.cli._errors import UsageError, fail
from eventbus.codec import EventDecodeError
from eventbus.version import __version__

__all__ = ["main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="eventbus", description="Look at recorded eventbus JSONL logs.")
    p.add_argument("-q", "--quiet", action="store_true", help="hide warnings from the library")
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for command in (replay, summary, tail, plot, bench, ctl):
        command.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `eventbus` command; returns the exit code (2: bad arguments or input)."""
    handler = _LogHandler()
    logger = logging.getLogger("eventbus")
    logger.addHandler(handler)
    try:
        args = _parser().parse_args(argv)
        handler.setLevel(logging.ERROR if args.quiet else logging.WARNING)
        code: int = args.func(args)
        return code
    except (UsageError, EventDecodeError) as e:  # LogReadError is an EventDecodeError
        return fail(str(e), 2)
    except OSError as e:
        where = f" {e.filename}" if getattr(e, "filename", None) else ""
        return fail(f"{e.strerror or e}{where}" if e.strerror else str(e), 2)
    except KeyboardInterrupt:
        return 130
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except Exception as e:
        if os.environ.get("EVENTBUS_DEBUG"):
            raise
        return fail(
            f"unexpected {type(e).__name__}: {e} (a bug in eventbus: please report "
            "it; EVENTBUS_DEBUG=1 shows the traceback)",
            1,
        )
    finally:
        logger.removeHandler(handler)


class _LogHandler(logging.Handler):
    """The library's warnings as `eventbus: warning: ...` lines on stderr, for the CLI only."""

    def emit(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(Exception):
            msg = " ".join(record.getMessage().split())
            print(f"eventbus: {record.levelname.lower()}: {msg}", file=sys.stderr)
