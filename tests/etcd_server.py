"""An etcd server on loopback for tests: free ports, a temporary data directory, stop/restart."""

from __future__ import annotations

import random
import shutil
import socket
import ssl
import subprocess
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def free_port() -> int:
    """A port free now for a server a test starts later (etcd, a c10d store), below the
    kernel's ephemeral range: a port the kernel handed out (bind to 0) goes back to that
    range when closed, and another test's process may take it meanwhile for a listener of
    its own (gloo's pairs listen on ephemeral ports), which a c10d agent then met as
    "something accepts connections there but does not answer as a store" (a CI run)."""
    low = _ephemeral_low()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(10000, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:  # taken: draw again
                continue
            return port
    raise RuntimeError(f"no free port found in 10000-{low}")


def _ephemeral_low() -> int:
    """The low end of the kernel's ephemeral port range (32768 where it cannot be read)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768
    return low if low > 11000 else 32768


@dataclass(frozen=True)
class Certificates:
    """A CA, etcd's certificate for 127.0.0.1 and a client's, each signed by the CA; and a
    second CA with a client certificate of its own (a stranger's). Paths."""

    ca_crt: str
    server_crt: str
    server_key: str
    client_crt: str
    client_key: str
    other_ca_crt: str
    other_crt: str
    other_key: str


def make_certificates(folder: Path) -> Certificates:
    """With the openssl command (Debian's openssl package), a few hundred milliseconds."""
    folder.mkdir(parents=True, exist_ok=True)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    def ca(name: str) -> None:
        run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.crt", "-days", "2", "-subj", f"/CN={name}")

    def signed(name: str, by: str, usage: str) -> None:
        (folder / f"{name}.ext").write_text(usage)
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out",
            f"{name}.csr", "-subj", f"/CN={name}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", f"{by}.crt", "-CAkey", f"{by}.key",
            "-CAcreateserial", "-out", f"{name}.crt", "-days", "2", "-extfile", f"{name}.ext")

    ca("ca")
    ca("other_ca")
    # (serverAuth and clientAuth: etcd's HTTP gateway dials its own gRPC server with it)
    signed("server", "ca",
           "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth\n")
    signed("client", "ca", "extendedKeyUsage=clientAuth\n")
    signed("other", "other_ca", "extendedKeyUsage=clientAuth\n")
    return Certificates(*(str(folder / name) for name in (
        "ca.crt", "server.crt", "server.key", "client.crt", "client.key", "other_ca.crt",
        "other.crt", "other.key")))


class EtcdServer:
    def __init__(self, data_dir: Path, tls: Certificates | None = None) -> None:
        """`tls`: serve clients over TLS only, and only those whose certificate the CA
        signed (etcd's --client-cert-auth)."""
        self.binary = shutil.which("etcd")
        self.data_dir, self.tls = data_dir, tls
        self.client_port, self.peer_port = free_port(), free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def start(self) -> None:
        assert self.binary is not None and self.proc is None
        scheme = "https" if self.tls else "http"
        client, peer = f"{scheme}://{self.endpoint}", f"http://127.0.0.1:{self.peer_port}"
        tls = self.tls
        log = open(self.data_dir.parent / f"etcd.{self.restarts}.log", "wb")
        self.proc = subprocess.Popen(
            [self.binary, "--name", "test", "--data-dir", str(self.data_dir),
             "--listen-client-urls", client, "--advertise-client-urls", client,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"test={peer}",
             *(["--cert-file", tls.server_crt, "--key-file", tls.server_key,
                "--client-cert-auth", "--trusted-ca-file", tls.ca_crt] if tls else [])],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        context = None
        if tls:
            context = ssl.create_default_context(cafile=tls.ca_crt)
            context.load_cert_chain(tls.client_crt, tls.client_key)
        deadline = time.monotonic() + 60
        while True:  # ready when /health answers (a real condition, polled)
            try:
                with urllib.request.urlopen(f"{client}/health", timeout=1,
                                            context=context) as reply:
                    if b'"true"' in reply.read():
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not start (see {log.name})")
            time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash would; the data directory stays."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def restart(self) -> None:
        self.kill()
        self.restarts += 1
        self.start()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
