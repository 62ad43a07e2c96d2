"""What `mpmd train` shows on the console, and where the rest of the logging goes.

The console shows the progress (stdout), the summary, and log records at the console level
and up (stderr, one line per worker record): `log.level` (default warning), or $MPMD_LOG when
set (`MPMD_LOG=debug` brings everything back). Everything else is written to files under
<run_dir>/logs/:
- worker_<slot>.log: a local worker's stderr, i.e. all its logging (Orbax's, JAX's, absl's,
  at info and up, debug under debug) and its tracebacks. Its records at the console level come
  back through runtime/launchers/local.py as "worker 1 WARNING <message> (see <run_dir>/logs/worker_1.log)".
- controller.log: this process's records at info and up while `train.run` runs: the progress
  lines and messages (resumed, recovered, layout changed, stopped) with their times, mpmd's
  warnings, the workers' relayed lines, and its own Orbax, absl and JAX logging.
JAX's backend start-up notes (a GPU or TPU that it could use but has no plugin for) reach the
console only at info and below (mpmd.runtime.worker.main.STARTUP_LOGGERS).

Not covered: what C++ code (XLA, gRPC) writes straight to this process's stderr, and the
workers of a static or ray cluster, whose output is where their starter put it.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from mpmd.recipes.config import ConfigError
from mpmd.runtime.worker.main import LOG_LEVELS, on_console

ENV = "MPMD_LOG"
WORKERS = "mpmd.workers"  # the logger runtime/launchers/local.py reports worker records through
CONTROLLER_LOG = "controller.log"
PROGRESS = "mpmd.progress"  # the logger recipes/run/run_log.py's Progress logs its lines to (shown on stdout)


def level(configured: str) -> str:
    """The console level: $MPMD_LOG when set, else `configured` (the config's log.level)."""
    value = os.environ.get(ENV, "").strip().lower()
    if not value:
        return configured
    if value not in LOG_LEVELS:
        raise ConfigError(f"{ENV}={value!r} must be one of {', '.join(LOG_LEVELS)} (or unset: log.level)")
    return value


class _Console(logging.Handler):
    """Records at its level and up on stderr without breaking a progress bar: a worker's as the
    one line runtime/launchers/local.py made of it, any other as 'LEVEL logger: message'; the
    progress records not at all (Progress prints them itself)."""

    def emit(self, record: logging.LogRecord) -> None:
        if record.name == PROGRESS or not on_console(record, self.level):
            return
        try:
            tqdm_write(record.getMessage() if record.name == WORKERS else self.format(record))
        except Exception:
            self.handleError(record)


def to_console(console_level: str) -> None:
    """Route this process's logging: records at console_level and up to the console, Python
    warnings as records. Call once, from the command line, before the run starts."""
    handler = _Console(console_level.upper())
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Console)]:  # a second call replaces it
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(min(handler.level, logging.INFO))  # info records still reach controller.log
    logging.captureWarnings(True)


class _FileLog(logging.FileHandler):
    """A log file that stops, once, when it cannot be written (a full disk): the run reports
    that itself; logging's default would print a traceback on stderr for every record."""

    def handleError(self, record: logging.LogRecord) -> None:
        if isinstance(sys.exc_info()[1], OSError):
            if not getattr(self, "_failed", False):
                self._failed = True
                tqdm_write(
                    f"warning: cannot write {self.baseFilename} ({sys.exc_info()[1]}); "
                    f"its records are dropped from here on"
                )
            return
        super().handleError(record)

    def emit(self, record: logging.LogRecord) -> None:
        if not getattr(self, "_failed", False):
            super().emit(record)


def error(message) -> None:
    """'error: MESSAGE' on stderr as one write of one line. Workers share this process's
    stderr: print() writes the text and its newline apart, and a worker's line (asyncio's
    notes at exit) was seen between them, glued to the end of the error."""
    line = f"error: {message}\n"
    sys.stderr.flush()
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # a captured stream (pytest's capsys)
        sys.stderr.write(line)
        sys.stderr.flush()
        return
    os.write(fd, line.encode(errors="backslashreplace"))


def tqdm_write(text: str) -> None:
    from tqdm import tqdm  # clears the bar, writes, draws the bar again

    tqdm.write(text, file=sys.stderr)


class ControllerLog:
    """<run_dir>/logs/controller.log holds this process's records at info and up (debug under
    MPMD_LOG=debug) until close(): a handler on the root logger, removed again."""

    def __init__(self, run_dir: str | Path, console_level: str = "warning"):
        path = Path(run_dir) / "logs" / CONTROLLER_LOG
        path.parent.mkdir(parents=True, exist_ok=True)
        self._handler = _FileLog(path)
        self._handler.setLevel(logging.DEBUG if console_level == "debug" else logging.INFO)
        self._handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
        root = logging.getLogger()
        self._root_level = root.level
        root.setLevel(min(root.level or logging.WARNING, self._handler.level))
        root.addHandler(self._handler)

    def close(self) -> None:
        root = logging.getLogger()
        root.removeHandler(self._handler)
        root.setLevel(self._root_level)
        self._handler.close()
