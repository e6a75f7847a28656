"""TLS to etcd: the one thing that keeps strangers on the network out of the job's store.

Every record in the store is sealed under the job's key (`store.sealed`), so a stranger who
reaches the store cannot steer the job; but they can still deny it service (delete keys,
hold the coordinator's office under a lease of their own, bump counters). etcd's answer is
mutual TLS: started with `--client-cert-auth --trusted-ca-file CA`, it serves only clients
whose certificate that CA signed. This module carries the client's side: which CA vouches
for etcd's own certificate, and this host's certificate and key.

Given as torchrun's etcd rendezvous takes them, in `--rdzv-conf` (`protocol=https,cacert=CA,
cert=CERT,key=KEY`; `spotpipe train` reads the same text from `cluster.etcd_conf`), and
passed to the workers an agent starts in their environment (`SPOTPIPE_ETCD_*`), with the
store's address.
"""

from __future__ import annotations

import os
import socket
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import requests
import urllib3

_SSL_ERRORS = (ssl.SSLError, requests.exceptions.SSLError, urllib3.exceptions.SSLError)

# the keys of torchrun's etcd rendezvous configuration that concern the connection
KEYS = ("protocol", "cacert", "cert", "key")
_ENV = {"cacert": "SPOTPIPE_ETCD_CACERT", "cert": "SPOTPIPE_ETCD_CERT",
        "key": "SPOTPIPE_ETCD_KEY"}


class TLSConfError(ValueError):
    """A connection setting that cannot be used; the message names the key and the file."""


@dataclass(frozen=True)
class EtcdTLS:
    """How this host speaks TLS to etcd."""

    cacert: str = ""  # the CA that signed etcd's certificate ("": the system's CAs)
    cert: str = ""  # this host's client certificate (etcd's --client-cert-auth)
    key: str = ""  # its private key

    def client_args(self) -> dict[str, Any]:
        """Keyword arguments for etcd3gw's client."""
        session = _PinnedSession() if self.cacert else requests.Session()
        if self.cacert:
            session.verify = self.cacert
        if self.cert:
            session.cert = (self.cert, self.key)
        return {"protocol": "https", "session": session}

    def env(self) -> dict[str, str]:
        return {"SPOTPIPE_ETCD_TLS": "1", **{_ENV[k]: getattr(self, k) for k in _ENV}}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> EtcdTLS | None:
        if env.get("SPOTPIPE_ETCD_TLS") != "1":
            return None
        return cls(**{k: env.get(name, "") for k, name in _ENV.items()})


class _PinnedSession(requests.Session):
    """A session that verifies with its own CA. requests lets REQUESTS_CA_BUNDLE or
    CURL_CA_BUNDLE in the environment override a session's `verify` (psf/requests#3829): on a
    machine that sets them (many images do, to the system's bundle) etcd3gw's `ca_cert` was
    ignored, and the handshake failed against etcd's certificate from a private CA."""

    def merge_environment_settings(self, url: Any, proxies: Any, stream: Any, verify: Any,
                                   cert: Any) -> dict[str, Any]:
        settings = super().merge_environment_settings(url, proxies, stream, verify, cert)
        settings["verify"] = self.verify
        return settings


def tls_problem(exc: BaseException, tls: EtcdTLS | None) -> str:
    """What a failed TLS handshake under `exc` says about the settings ("" if none failed),
    as a clause to append to the error."""
    chain = [exc]
    while (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)  # type: ignore[arg-type]
    # (requests and urllib3 wrap ssl's errors in SSLErrors of their own, not always chained)
    if not any(isinstance(e, _SSL_ERRORS) for e in chain):
        return ""
    if any(isinstance(e, ssl.SSLCertVerificationError) for e in chain):
        against = f"cacert={tls.cacert}" if tls is not None and tls.cacert else \
            "the system's CAs"
        return (f"; etcd's certificate does not verify against {against} (signed by another "
                "CA, or not for this address)")
    if tls is not None and not tls.cert:
        return ("; etcd ended the TLS handshake: it asks for a client certificate signed by "
                "its CA (cert= and key=)")
    return ("; etcd ended the TLS handshake: it did not accept this host's certificate "
            "(signed by another CA than its --trusted-ca-file?)")


def speaks_tls(host: str, port: int, timeout_s: float = 2.0) -> bool:
    """Whether what listens at host:port completes a TLS handshake (its certificate not
    checked): said to a client that spoke plain HTTP to it and saw the connection closed."""
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as raw:
            with context.wrap_socket(raw, server_hostname=host):
                return True
    except ssl.SSLError as exc:  # a TLS alert is TLS too; another protocol's bytes are not
        return "alert" in str(exc).lower()
    except OSError:
        return False


def parse_conf(text: str, where: str) -> EtcdTLS | None:
    """`protocol=https,cacert=CA,cert=CERT,key=KEY` (any order, `cacert` optional, `cert` and
    `key` together) as the connection to etcd; None for plain HTTP (`protocol=http`, or
    nothing). `where` names the setting in errors (`--rdzv-conf`, `cluster.etcd_conf`). Each
    file must be readable here: a typo is said at once, not as a failed handshake later."""
    values: dict[str, str] = {}
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or not value:
            raise TLSConfError(f"{where}: {item!r}: expected KEY=VALUE")
        if name not in KEYS:
            raise TLSConfError(f"{where}: unknown key {name!r}; known: {', '.join(KEYS)}")
        if name in values:
            raise TLSConfError(f"{where}: {name} given twice")
        values[name] = value
    protocol = values.pop("protocol", "https" if values else "http")
    if protocol not in ("http", "https"):
        raise TLSConfError(f"{where}: protocol {protocol!r}: expected http or https")
    if protocol == "http":
        if values:
            raise TLSConfError(f"{where}: {', '.join(sorted(values))} given with protocol=http;"
                               " certificates are for protocol=https")
        return None
    if ("cert" in values) != ("key" in values):
        raise TLSConfError(f"{where}: cert and key go together (this host's certificate and "
                           "its private key)")
    for name, path in values.items():
        if not os.path.isfile(path) or not os.access(path, os.R_OK):
            raise TLSConfError(f"{where}: {name}={path}: no readable file there")
    return EtcdTLS(**values)


__all__ = ["EtcdTLS", "KEYS", "TLSConfError", "parse_conf", "speaks_tls", "tls_problem"]
