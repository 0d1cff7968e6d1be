"""fp8rl.job.process: the job's log lines (stdout and train.log) never show a credential."""

from __future__ import annotations

import logging
from pathlib import Path

from fp8rl.job.process import close_log_file, setup_logging


def test_credentials_in_a_logged_error_are_redacted_in_the_log_file_and_on_stdout(tmp_path: Path, capsys) -> None:
    """MLflow's errors name the URI they called, credentials included; the trainer logs them as warnings."""
    setup_logging(tmp_path)
    try:
        try:
            raise ConnectionError("API request to https://alice:s3cret@mlflow.example/api failed (?token=t0k)")
        except ConnectionError:
            logging.getLogger("fp8rl.tracking").warning("lost the store: %s", "https://bob:hunter2@h", exc_info=True)
    finally:
        close_log_file(tmp_path)
    written = (tmp_path / "train.log").read_text() + capsys.readouterr().out
    assert "lost the store" in written and "mlflow.example" in written
    for secret in ("s3cret", "t0k", "hunter2"):
        assert secret not in written
