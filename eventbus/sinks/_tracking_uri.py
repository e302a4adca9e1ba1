"""MLflowSink's tracking URI, checked where the sink is made, without importing mlflow.

- `http(s)://`: the server must answer (any HTTP status will do) within a few seconds;
- `sqlite:///PATH`: the database's directory must be writable (and the file, if it exists),
  and sqlalchemy (with alembic) installed;
- `file:///PATH` or a plain path: a directory this process can create and write in;
- None (no `MLFLOW_TRACKING_URI` either): MLflow's default, in the current directory;
- other databases (postgresql, mysql, mssql), databricks and plugin schemes: not probed.

Any other scheme is a ValueError that lists the ones MLflow knows.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from eventbus.sinks._files import check_writable_dir, check_writable_file

__all__ = ["PROBE_TIMEOUT_S", "check_tracking_uri"]

PROBE_TIMEOUT_S = 5.0  # an http(s) server's answer to /health
_DATABASES = ("sqlite", "postgresql", "mysql", "mssql")
_UNPROBED = ("databricks", "databricks-uc", "uc")


def check_tracking_uri(uri: str | None, who: str) -> None:
    """Raise where `uri` cannot work: ConnectionError (no server), OSError (not writable),
    ImportError (a database store without sqlalchemy), ValueError (an unknown scheme)."""
    if uri is None:
        check_writable_dir(Path.cwd(), who)  # MLflow's default store: ./mlflow.db or ./mlruns
        return
    parsed = urllib.parse.urlparse(uri)
    scheme = parsed.scheme.lower()
    if scheme in ("http", "https"):
        _probe(uri, who)
    elif scheme.split("+")[0] in _DATABASES:
        _require_sqlalchemy(who)
        if scheme == "sqlite":
            _check_sqlite(uri, who)
    elif scheme == "file":
        check_writable_dir(Path(urllib.request.url2pathname(parsed.path)), who)
    elif scheme == "":  # a path
        check_writable_dir(Path(uri), who)
    elif scheme not in _UNPROBED and scheme not in _plugin_schemes():
        known = ", ".join(("http(s)", "file", *_DATABASES, *_UNPROBED))
        raise ValueError(
            f"{who}: tracking URI {_shown(uri)!r} has a scheme MLflow does not know "
            f"({scheme!r}); use one of {known}, or a path"
        )


def _probe(uri: str, who: str) -> None:
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S):
            pass
    except urllib.error.HTTPError:
        return  # it answered: reachable (auth and paths are MLflow's to report)
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise ConnectionError(
            f"{who} cannot reach the MLflow tracking server at {_shown(uri)!r}: {reason}; "
            "start it (mlflow server --host 127.0.0.1 --port 5000) or pass a tracking_uri "
            "this machine can reach"
        ) from None


def _check_sqlite(uri: str, who: str) -> None:
    path = uri.partition(":///")[2].partition("?")[0]
    if not path or path == ":memory:":
        return
    check_writable_file(Path(path), who)


def _require_sqlalchemy(who: str) -> None:
    if any(importlib.util.find_spec(m) is None for m in ("sqlalchemy", "alembic")):
        raise ImportError(
            f"{who}: a database tracking store needs sqlalchemy and alembic: "
            "pip install 'eventbus[mlflow]'"
        )


def _plugin_schemes() -> set[str]:
    """Schemes that installed MLflow plugins register (read from metadata, nothing imported)."""
    return {ep.name for ep in importlib.metadata.entry_points(group="mlflow.tracking_store")}


def _shown(uri: str) -> str:
    """`uri` without a password, for messages."""
    p = urllib.parse.urlparse(uri)
    if p.password is None:
        return uri
    host = p.hostname or ""
    netloc = f"{p.username}:***@{host}" + (f":{p.port}" if p.port else "")
    return urllib.parse.urlunparse(p._replace(netloc=netloc))
