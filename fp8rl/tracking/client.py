"""Reaching an MLflow store: its URI, credentials kept out of every output, a bounded probe, the client (a
new sqlite store's tables created by one process at a time), and its experiments (created or restored by the
jobs of a sweep at once)."""

from __future__ import annotations

import base64
import logging
import os
import re
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
_CREDENTIALS = re.compile(r"(?P<scheme>[a-zA-Z][a-zA-Z0-9+.-]*://)[^/\s]*@")
_QUERY_SECRETS = re.compile(
    r"(?P<key>[?&](?:access_token|token|api_key|apikey|key|password|passwd|secret|sig|signature)=)[^&\s#'\"]+",
    re.IGNORECASE,
)

# MLflow retries a dead server for minutes by default; a run (and a sweep's lookups) should learn within seconds.
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def bound_mlflow_http() -> None:
    """Cap MLflow's HTTP retries and timeout for this process (a user's own environment values win)."""
    for key, value in MLFLOW_HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


class TrackingUnavailable(RuntimeError):
    """The tracking store did not answer; the message says what to do."""


def resolve_tracking_uri(configured: str | None) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else a sqlite store in the working directory."""
    return configured or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI


SCHEMA_LOCK_SUFFIX = ".schema.lock"  # beside a sqlite store: who creates its tables holds it
SCHEMA_LOCK_TIMEOUT_S = 300.0
_SCHEMA_READY: set[str] = set()  # sqlite stores whose tables this process has seen created


def mlflow_client(uri: str) -> Any:
    """An ``MlflowClient`` for `uri`; a sqlite store's tables created first by one process at a time.

    MLflow creates (and migrates) a sqlite store's schema when a process first builds a client for it, and two
    processes doing so at once on a new file fail: measured with mlflow 3.17.2, 4 of 4 pairs started together had
    one or both die of alembic's "expected to match one row ... in 'alembic_version'" or a locked database. So the
    first client is built under a file lock beside the store (`SCHEMA_LOCK_SUFFIX`), once per process and store."""
    from mlflow.tracking import MlflowClient

    if not uri.startswith("sqlite:///") or uri in _SCHEMA_READY:
        return MlflowClient(tracking_uri=uri)
    import filelock

    path = Path(uri.removeprefix("sqlite:///"))
    try:
        with filelock.FileLock(f"{path}{SCHEMA_LOCK_SUFFIX}", timeout=SCHEMA_LOCK_TIMEOUT_S):
            client = MlflowClient(tracking_uri=uri)  # its store creates the tables (and migrates) if needed
    except filelock.Timeout:
        raise TrackingUnavailable(
            f"the sqlite store {uri}: another process has held {path.name}{SCHEMA_LOCK_SUFFIX} for "
            f"{SCHEMA_LOCK_TIMEOUT_S:.0f} s while creating its tables; end it, or delete that file if none runs"
        ) from None
    _SCHEMA_READY.add(uri)
    return client


def redact(value: str) -> str:
    """``https://user:token@host/x?token=t`` -> ``https://***@host/x?token=***``: credentials in a URI's userinfo
    (a password may hold ``@``) and secret query parameters never reach params, tags, logs or files."""
    return _QUERY_SECRETS.sub(r"\g<key>***", _CREDENTIALS.sub(r"\g<scheme>***@", value))


class RedactingFormatter(logging.Formatter):
    """A log line (message and traceback) with `redact` applied: MLflow's own exception texts name the URI they
    called, credentials included ("API request to https://user:token@host/... failed")."""

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class RedactingStream:
    """A text stream that writes through `redact` (what an uncaught exception prints to stderr: MLflow's error
    texts name the URI they called); everything else is the wrapped stream's."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(redact(text))

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def redact_stderr() -> None:
    """Route this process's stderr through `redact` (once); the entry points call it first."""
    if not isinstance(sys.stderr, RedactingStream):
        sys.stderr = RedactingStream(sys.stderr)


def _health_request(uri: str) -> urllib.request.Request:
    """GET <uri>/health, with a URI's userinfo (``https://user:token@host``, which MLflow accepts) sent as HTTP
    basic authentication rather than left in the host name, where urllib would look it up as a DNS name."""
    parts = urllib.parse.urlsplit(uri.rstrip("/"))
    host = parts.netloc.rpartition("@")[2]
    url = urllib.parse.urlunsplit((parts.scheme, host, parts.path + "/health", parts.query, ""))
    request = urllib.request.Request(url)
    if "@" in parts.netloc:
        user, _, password = parts.netloc.rpartition("@")[0].partition(":")
        secret = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}".encode()
        request.add_header("Authorization", "Basic " + base64.b64encode(secret).decode())
    return request


def probe_store(uri: str, timeout_s: float) -> None:
    """Raise TrackingUnavailable when the store at `uri` cannot be reached within `timeout_s` seconds."""
    if uri.startswith(("http://", "https://")):
        request = _health_request(uri)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:  # noqa: S310 - the user's store
                if response.status == 200:
                    return
                raise TrackingUnavailable(f"MLflow server {redact(uri)} answered {response.status} on /health")
        except urllib.error.HTTPError as err:
            raise TrackingUnavailable(
                f"MLflow server {redact(uri)} answered {err.code} ({err.reason}) on /health: check the URI and "
                "its credentials"
            ) from None
        except (urllib.error.URLError, OSError) as err:
            raise TrackingUnavailable(
                f"MLflow server {redact(uri)} did not answer within {timeout_s:.0f} s ({redact(str(err))}). Start "
                "it, point tracking.tracking_uri (or $MLFLOW_TRACKING_URI) at a live store, set "
                "tracking.offline=true to train now and upload later, or tracking.enabled=false"
            ) from None
    if uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).resolve().parent
        if not folder.is_dir():
            raise TrackingUnavailable(f"the folder of the sqlite store {uri} does not exist: create it or fix the URI")


def artifact_location(uri: str, experiment: str) -> str | None:
    """Where a new experiment of a sqlite store keeps its artifacts: beside the store (`<store folder>/mlruns/<name>`),
    not in ./mlruns of whichever working directory created it (MLflow's default for a database store). Servers
    and other stores: None, their own default."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    folder = Path(uri.removeprefix(prefix)).resolve().parent
    return (folder / "mlruns" / re.sub(r"[^A-Za-z0-9_.-]+", "_", experiment)).as_uri()


def ensure_experiment(client: Any, name: str, create: bool = True) -> str | None:
    """The id of experiment `name`: restored if it was deleted, created if missing and `create` (else None). The
    jobs of a sweep start together: when another one created or restored it between our lookup and our write,
    MLflow refuses ours (RESOURCE_ALREADY_EXISTS, or no deleted experiment to restore) and we take theirs."""
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None and not create:
        return None
    try:
        if found is None:
            return client.create_experiment(name, artifact_location=artifact_location(client.tracking_uri, name))
        if found.lifecycle_stage == "deleted":
            client.restore_experiment(found.experiment_id)
        return found.experiment_id
    except MlflowException as err:
        found = client.get_experiment_by_name(name)
        if found is None or found.lifecycle_stage == "deleted":
            raise
        log.info("experiment %r was created or restored by another job at the same time (%s)", name, err.error_code)
        return found.experiment_id


def ensure_experiment_tag(client: Any, experiment_id: str, key: str, value: str) -> None:
    """Set an experiment tag unless it already holds `value`. MLflow's SQL store sets a tag by a read then
    an insert, so two jobs tagging at once can collide on the unique key (seen on a sqlite-backed server:
    `UNIQUE constraint failed: experiment_tags.key`); the loser reads the tag back and accepts the winner's
    write when it is the same value."""
    from mlflow.exceptions import MlflowException

    if client.get_experiment(experiment_id).tags.get(key) == value:
        return
    try:
        client.set_experiment_tag(experiment_id, key, value)
    except MlflowException:
        if client.get_experiment(experiment_id).tags.get(key) != value:
            raise
        log.info("experiment tag %s was set by another job at the same time", key)
