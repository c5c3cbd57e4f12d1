"""A throwaway PostgreSQL server for tests: initdb in a temporary directory, pg_ctl to start, stop and restart
it, trust authentication on 127.0.0.1, one database per test."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from pathlib import Path


def find_bindir() -> Path | None:
    roots = sorted(Path("/usr/lib/postgresql").glob("*/bin"), key=lambda p: int(p.parent.name), reverse=True)
    for bindir in roots:
        if (bindir / "initdb").exists() and (bindir / "pg_ctl").exists():
            return bindir
    found = shutil.which("pg_ctl")
    return Path(found).parent if found and shutil.which("initdb") else None


class PostgresServer:
    def __init__(self, bindir: Path) -> None:
        self.bindir = bindir
        self.root = Path(tempfile.mkdtemp(prefix="rfopt-pg-", dir="/tmp"))
        self.data = self.root / "data"
        self.port = _free_port()
        # initdb refuses to run as root: run the server as `postgres` (or `nobody`) then.
        self.user = None
        if os.geteuid() == 0:
            self.user = "postgres" if _user_exists("postgres") else "nobody"
            uid = pwd.getpwnam(self.user).pw_uid
            os.chmod(self.root, 0o755)
            os.chown(self.root, uid, -1)
        self._as_user(["initdb", "-D", str(self.data), "-A", "trust", "-U", "rfopt", "--no-sync"])

    def url(self, database: str) -> str:
        return f"postgresql://rfopt@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database's URL."""
        name = f"t_{uuid.uuid4().hex[:12]}"
        self.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def execute(self, sql: str) -> None:
        """Run `sql` as the superuser `rfopt`, outside a transaction."""
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=self.port, user="rfopt", dbname="postgres",
                             autocommit=True) as connection:
            connection.execute(sql)

    def password_role(self, name: str, password: str) -> None:
        """A login role that must give `password` (scram-sha-256) on 127.0.0.1, where every other role is trusted."""
        self.execute(f"CREATE ROLE {name} LOGIN PASSWORD '{password}'")
        hba = self.data / "pg_hba.conf"
        hba.write_text(f"host all {name} 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
        self.execute("SELECT pg_reload_conf()")

    def database_in(self, folder: Path) -> str:
        """A fresh database whose tables live in `folder` (a tablespace there: a small file system makes a database
        whose disk fills), as its URL."""
        if self.user is not None:
            os.chown(folder, pwd.getpwnam(self.user).pw_uid, -1)
        name = f"t_{uuid.uuid4().hex[:12]}"
        self.execute(f"CREATE TABLESPACE {name} LOCATION '{folder}'")
        self.execute(f"CREATE DATABASE {name} TABLESPACE {name}")
        return self.url(name)

    def drop(self, url: str) -> None:
        """Drop the database of `url` (closing its connections) and the tablespace `database_in` made for it."""
        name = url.rsplit("/", 1)[1]
        self.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        self.execute(f"DROP TABLESPACE IF EXISTS {name}")

    def start(self) -> None:
        options = f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._as_user(["pg_ctl", "-D", str(self.data), "-o", options, "-l", str(self.root / "server.log"), "-w",
                       "start"])

    def stop(self) -> None:
        self._as_user(["pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "stop"])

    def destroy(self) -> None:
        try:
            self._as_user(["pg_ctl", "-D", str(self.data), "-m", "immediate", "-w", "stop"])
        except subprocess.CalledProcessError:
            pass
        shutil.rmtree(self.root, ignore_errors=True)

    def _as_user(self, command: list[str]) -> None:
        command = [str(self.bindir / command[0]), *command[1:]]
        if self.user is not None:
            command = ["runuser", "-u", self.user, "--", *command]
        subprocess.run(command, check=True, capture_output=True, cwd=self.root)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _user_exists(name: str) -> bool:
    try:
        pwd.getpwnam(name)
        return True
    except KeyError:
        return False
