"""eventbus.ctl.protocol: what a request may be, and the exit codes a script relies on."""

from __future__ import annotations

import orjson
import pytest

from eventbus.ctl.protocol import (
    MAX_REASON,
    BadRequest,
    Exit,
    Request,
    encode,
    parse_request,
    refusal,
)


def test_a_good_request_parses() -> None:
    line = b'{"command": "stop", "reason": "enough", "token": "t"}'
    assert parse_request(line) == Request("stop", "enough", "t")
    assert parse_request(b'{"command": "ping"}') == Request("ping", None, None)
    assert parse_request(b'{"command": "save", "wait": 60}') == Request("save", None, None, 60.0)


@pytest.mark.parametrize(
    ("line", "what"),
    [
        (b"\x00\xff garbage", "not JSON"),
        (b"", "not JSON"),
        (b"[1, 2]", "expected a JSON object, got list"),
        (b'"stop"', "expected a JSON object, got str"),
        (b'{"command": "launch"}', "command must be one of"),
        (b'{"reason": "x"}', "command must be one of"),
        (b'{"command": "stop", "reason": 5}', "reason must be a string"),
        (b'{"command": "stop", "reason": "' + b"x" * (MAX_REASON + 1) + b'"}', "at most"),
        (b'{"command": "stop", "token": 1}', "token must be a string"),
        (b'{"command": "stop", "extra": 1}', "unknown keys: extra"),
        (b"[" * 5000 + b"]" * 5000, "not JSON"),  # too deep for the parser: refused, no crash
        (b'{"command": "stop", "wait": 5}', "wait goes with save only"),
        (b'{"command": "save", "wait": 0}', "wait must be a number of seconds"),
        (b'{"command": "save", "wait": -1}', "wait must be a number of seconds"),
        (b'{"command": "save", "wait": 1e9}', "wait must be a number of seconds"),
        (b'{"command": "save", "wait": "5"}', "wait must be a number of seconds"),
        (b'{"command": "save", "wait": true}', "wait must be a number of seconds"),
    ],
)
def test_bad_requests_are_named(line: bytes, what: str) -> None:
    with pytest.raises(BadRequest, match=what):
        parse_request(line)


def test_replies_are_one_line_and_refusals_say_their_kind() -> None:
    line = encode({"ok": True, "loss": float("nan"), "step": 3})
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert orjson.loads(line) == {"ok": True, "loss": None, "step": 3}
    assert refusal("denied", "no") == {"ok": False, "kind": "denied", "error": "no"}


def test_exit_codes_are_distinct_and_stable() -> None:
    assert [int(e) for e in Exit] == [0, 1, 2, 3, 4, 5, 6, 7, 8]
    assert (Exit.NO_JOB, Exit.STALE, Exit.DENIED, Exit.REFUSED) == (3, 4, 5, 6)
