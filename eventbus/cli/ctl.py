"""`eventbus ctl RUN_DIR status|stop|abort|save|ping [REASON] [--wait]`: talk to a running job.

The job listens when its script subscribed `eventbus.ctl.ControlServer(RUN_DIR)`. One line
of answer (`--json`: the job's reply as one JSON object); errors are one line on stderr with
an exit code a script can test (`eventbus.ctl.Exit`):

    0 ok   1 a bug in eventbus   2 usage   3 no job running   4 stale socket
    5 permission denied   6 refused by the job   7 no answer (or, with --wait, no save) in time
    8 with --wait: the run ended or the job went away before the save was done
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import orjson

from eventbus.cli._errors import UsageError, fail
from eventbus.cli._format import g, hms
from eventbus.ctl.client import CtlError, read_token, request
from eventbus.ctl.listen import parse_address
from eventbus.ctl.protocol import COMMANDS, MAX_WAIT, TOKEN_NAME

__all__ = ["add_parser", "one_line", "run"]

ANSWER_S = 5.0  # default --timeout: for the job's answer
SAVE_S = 300.0  # default --timeout with --wait: for the checkpoint


def add_parser(sub: Any) -> None:
    """Register `eventbus ctl RUN_DIR COMMAND [REASON] [--json] [--tcp H:P --token-file F]`."""
    c = sub.add_parser(
        "ctl",
        help="ask a running job for its status, or to stop, abort or save",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    c.add_argument("run_dir", metavar="RUN_DIR", help="the directory the job's ControlServer uses")
    c.add_argument("command", choices=COMMANDS, metavar="COMMAND", help=" | ".join(COMMANDS))
    c.add_argument("reason", nargs="?", metavar="REASON", help="why (stop, abort and save)")
    c.add_argument("--json", action="store_true", help="print the job's reply as JSON")
    c.add_argument("--tcp", metavar="HOST:PORT", help="the job's TCP endpoint instead")
    c.add_argument(
        "--token-file",
        metavar="FILE",
        help=f"the bearer token for --tcp (default RUN_DIR/{TOKEN_NAME})",
    )
    c.add_argument(
        "--wait",
        action="store_true",
        help="save: wait for the checkpoint that answers it; print its step and path",
    )
    c.add_argument(
        "--timeout",
        type=float,
        metavar="SECONDS",
        help=f"wait this long for an answer ({ANSWER_S:g}); with --wait, for the save ({SAVE_S:g})",
    )
    c.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Send one command; print the answer; return the exit code."""
    if args.reason is not None and args.command in ("status", "ping"):
        raise UsageError(f"{args.command} takes no reason")
    if args.wait and args.command != "save":
        raise UsageError("--wait goes with save")
    if args.timeout is not None and args.timeout <= 0:
        raise UsageError("--timeout must be positive")
    timeout = args.timeout or (SAVE_S if args.wait else ANSWER_S)
    if args.wait and timeout > MAX_WAIT:
        raise UsageError(f"--timeout with --wait: at most {MAX_WAIT:g} s")
    if args.token_file is not None and args.tcp is None:
        raise UsageError("--token-file goes with --tcp")
    tcp = token = None
    try:
        if args.tcp is not None:
            try:
                tcp = parse_address(args.tcp)
            except ValueError as e:
                raise UsageError(f"--tcp: {e}") from None
            token = read_token(args.token_file or Path(args.run_dir) / TOKEN_NAME)
        reply = request(
            args.run_dir,
            args.command,
            args.reason,
            tcp=tcp,
            token=token,
            timeout=ANSWER_S if args.wait else timeout,
            wait=timeout if args.wait else None,
        )
    except CtlError as e:
        if args.json:
            err = {"ok": False, "error": str(e), "exit_code": int(e.exit_code)}
            print(orjson.dumps(err).decode(), flush=True)
        return fail(str(e), int(e.exit_code))
    if args.json:
        print(orjson.dumps(reply).decode(), flush=True)
    else:
        print(one_line(reply), flush=True)
    return 0


def one_line(reply: dict[str, Any]) -> str:
    """A reply as the one line `eventbus ctl` prints."""
    command = reply.get("command")
    if command == "ping":
        return (
            f"pong from pid {reply.get('pid')} (rank {reply.get('rank')} of "
            f"{reply.get('world_size')}, eventbus {reply.get('version')})"
        )
    if command == "status":
        return _status(reply)
    at = f" at step {reply['step']}" if reply.get("step") is not None else ""
    saved = reply.get("saved")
    if isinstance(saved, dict):
        return f"saved at step {saved.get('step')}: {saved.get('path')} (asked{at})"
    if reply.get("already"):
        what = "a save is already pending" if command == "save" else f"{command} already asked"
        return f"{what}{at}"
    then = {"stop": "stops", "abort": "aborts", "save": "saves"}.get(str(command), "acts")
    return f"{command} requested{at}: the loop {then} at its next check"


def _status(r: dict[str, Any]) -> str:
    step, total = r.get("step"), r.get("total_steps")
    parts = [f"step {'-' if step is None else step}" + (f"/{total}" if total else "")]
    loss = r.get("loss")
    if loss is not None:
        parts.append(f"loss {g(loss) if isinstance(loss, int | float) else loss}")
    if r.get("steps_per_s"):
        parts.append(f"{g(r['steps_per_s'])} steps/s")
    if r.get("eta_s") is not None:
        parts.append(f"ETA {hms(r['eta_s'])}")
    parts.append(str(r.get("run", "running")))
    if r.get("abort_requested"):
        parts.append(f"abort requested ({r.get('stop_reason')})")
    elif r.get("stop_requested"):
        parts.append(f"stop requested ({r.get('stop_reason')})")
    if r.get("save_pending"):
        parts.append("save pending")
    ckpt = r.get("last_checkpoint")
    if isinstance(ckpt, dict):
        parts.append(f"last checkpoint at step {ckpt.get('step')}")
    subs = r.get("subscribers")
    if isinstance(subs, dict) and subs:
        parts.append("subscribers: " + ", ".join(f"{n} {s}" for n, s in subs.items()))
    return "  ".join(parts)
