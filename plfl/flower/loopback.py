"""A real Flower deployment on one machine, over loopback: a SuperLink and SuperNodes as separate processes, TLS on
and SuperNode authentication on, for trying a plfl app before the devices and for testing it.

:class:`LoopbackDeployment` makes the credentials with the ``cryptography`` library (a certificate authority and the
SuperLink's certificate for 127.0.0.1 and localhost; an ECDSA P-384 key pair per SuperNode, in OpenSSH format as
Flower reads them), starts ``flower-superlink`` with ``--enable-supernode-auth``, registers each node's public key
with ``flwr supernode register``, starts the ``flower-supernode`` processes with their node configs (e.g. each its
own ``data-dir``) and runs apps with ``flwr run --stream``. Every process gets its own ``FLWR_HOME`` under the
deployment's directory; leaving the ``with`` block stops them all, their children included.

Flower's processes poll every 3 seconds and a deployed SuperNode starts a new process for each message, so a round
takes seconds even when its training takes milliseconds.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from plfl.errors import PlflError

CONNECTION = "loopback"  # the SuperLink's name in the flwr CLI's config.toml


def flower_command(name: str) -> str:
    """The path of Flower's console script ``name`` beside this Python."""
    return str(Path(sys.executable).parent / name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_credentials(directory: Path, nodes: int) -> None:
    """``ca.crt``, the SuperLink's ``server.pem`` and ``server.key``, and ``node-K`` / ``node-K.pub`` (K = 0 ..
    ``nodes`` − 1) in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "plfl loopback CA")])
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server_key = ec.generate_private_key(ec.SECP384R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]))
        .issuer_name(ca_name)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=2))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    (directory / "ca.crt").write_bytes(ca.public_bytes(pem))
    (directory / "server.pem").write_bytes(server.public_bytes(pem))
    (directory / "server.key").write_bytes(
        server_key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    for k in range(nodes):
        key = ec.generate_private_key(ec.SECP384R1())
        private = key.private_bytes(pem, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption())
        (directory / f"node-{k}").write_bytes(private)
        os.chmod(directory / f"node-{k}", 0o600)
        public = key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        (directory / f"node-{k}.pub").write_bytes(public + b"\n")


class LoopbackDeployment:
    """A SuperLink and SuperNodes on 127.0.0.1 under ``directory``, with ``keys`` node key pairs (node K's is
    registered when it is started with ``registered=True``)."""

    def __init__(self, directory: Path, keys: int):
        self.directory = directory
        self.keys = keys
        self.port = free_port()
        self.processes: dict[str, subprocess.Popen] = {}
        self.credentials = directory / "credentials"

    def __enter__(self) -> LoopbackDeployment:
        write_credentials(self.credentials, self.keys)
        cli_home = self.directory / "home" / "cli"
        cli_home.mkdir(parents=True, exist_ok=True)
        (cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\naddress = "127.0.0.1:{self.port}"\n'
            f'root-certificates = "{self.credentials / "ca.crt"}"\n'
        )
        try:
            self._start(
                "superlink",
                [
                    flower_command("flower-superlink"),
                    *("--ssl-ca-certfile", str(self.credentials / "ca.crt")),
                    *("--ssl-certfile", str(self.credentials / "server.pem")),
                    *("--ssl-keyfile", str(self.credentials / "server.key")),
                    "--enable-supernode-auth",
                    "--disable-runtime-dependency-installation",  # plfl and its dependencies are installed here
                    *("--host", "127.0.0.1", "--port", str(self.port)),
                ],
            )
            self._wait_for_port(self.port, 90)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def environment(self, home: str) -> dict[str, str]:
        """This process's environment with its own ``FLWR_HOME`` and Flower's telemetry and update check off."""
        flwr_home = self.directory / "home" / home
        flwr_home.mkdir(parents=True, exist_ok=True)
        return {
            **os.environ,
            "FLWR_HOME": str(flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "PYTHONUNBUFFERED": "1",
        }

    def flwr(self, *args: str, timeout: Optional[float] = None) -> subprocess.CompletedProcess:
        """``flwr ARGS`` (the CLI, connected to this SuperLink), its output captured."""
        return subprocess.run(
            [flower_command("flwr"), *args],
            env=self.environment("cli"),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=self.directory,
        )

    def start_node(self, k: int, node_config: dict[str, object], registered: bool = True) -> subprocess.Popen:
        """SuperNode ``k`` with key pair ``k`` and ``node_config``; its key registered first unless ``registered``
        is False (the SuperLink then refuses it). Its output goes to ``node-K.log``.

        Raises:
            PlflError: the key could not be registered.
        """
        if registered:
            done = self.flwr("supernode", "register", str(self.credentials / f"node-{k}.pub"), CONNECTION)
            if done.returncode != 0:
                raise PlflError(f"flwr supernode register of node {k} failed: {done.stdout}{done.stderr}")
        config = " ".join(
            f"{key}={value}" if not isinstance(value, str) else f"{key}='{value}'" for key, value in node_config.items()
        )
        return self._start(
            f"node-{k}",
            [
                flower_command("flower-supernode"),
                *("--superlink", f"127.0.0.1:{self.port}"),
                *("--root-certificates", str(self.credentials / "ca.crt")),
                *("--auth-supernode-private-key", str(self.credentials / f"node-{k}")),
                *("--node-config", config),
                *("--host", "127.0.0.1", "--port", str(free_port())),
                *("--max-retries", "3"),
            ],
        )

    def run(self, app: Path, run_config: str = "", timeout: Optional[float] = None) -> subprocess.CompletedProcess:
        """``flwr run APP`` on this SuperLink with ``run_config`` (``--run-config``), until the run ends."""
        extra = ["--run-config", run_config] if run_config else []
        return self.flwr("run", str(app), CONNECTION, "--stream", *extra, timeout=timeout)

    def kill(self, name: str) -> None:
        """SIGKILL process ``name`` (e.g. ``node-2``) and its children: a device that fails."""
        for pid in [*descendants(self.processes[name].pid), self.processes[name].pid]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.processes[name].wait()

    def stop(self) -> None:
        """SIGTERM every process this deployment started and their children; SIGKILL what is left after 10 s."""
        pids = [p for process in self.processes.values() for p in [process.pid, *descendants(process.pid)]]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(pid) for pid in pids):
            time.sleep(0.2)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for process in self.processes.values():
            process.wait()

    def _start(self, name: str, command: list[str]) -> subprocess.Popen:
        log = open(self.directory / f"{name}.log", "w")  # noqa: SIM115  closed by the process's end
        process = subprocess.Popen(
            command,
            env=self.environment(name),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.directory,
            start_new_session=True,
        )
        self.processes[name] = process
        return process

    def _wait_for_port(self, port: int, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                return
            except OSError:
                time.sleep(0.3)
        raise PlflError(f"the SuperLink did not listen on port {port} within {seconds} s; see superlink.log")


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (from /proc: Flower's executors start their own sessions)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, queue = [], [pid]
    while queue:
        for child in children.get(queue.pop(), []):
            found.append(child)
            queue.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return not Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
