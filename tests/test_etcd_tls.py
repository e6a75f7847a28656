"""etcd over TLS (`spotpipe.store.tls`): the job's store reached only by hosts whose certificate
etcd's CA signed; everyone else is refused at the handshake, and told why. The agents' job
over TLS runs in tests/test_agent.py (`test_agents_train_like_spotpipe_train[etcd-tls]`)."""

from __future__ import annotations

import subprocess
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest

from spotpipe.store.etcd import EtcdStore, EtcdStoreError
from spotpipe.store.tls import EtcdTLS, TLSConfError, parse_conf

REPO = Path(__file__).resolve().parents[1]


def _store(server, tls: EtcdTLS | None) -> EtcdStore:
    host, port = server.endpoint.rsplit(":", 1)
    return EtcdStore(host, int(port), "/spotpipe/jobs/t", timeout=timedelta(seconds=10),
                     reconnect_s=1.0, tls=tls)


def test_a_store_over_tls_works_as_over_plain_http(etcd_tls):
    certs = etcd_tls.tls
    store = _store(etcd_tls, EtcdTLS(certs.ca_crt, certs.client_crt, certs.client_key))
    store.reachable()
    store.set("a", b"1")
    assert store.get("a") == b"1" and store.add("n", 2) == 2 and store.add("n", 3) == 5
    assert store.compare_set("a", b"1", b"2") == b"2"
    other = _store(etcd_tls, EtcdTLS(certs.ca_crt, certs.client_crt, certs.client_key))
    writer = threading.Thread(target=other.set, args=("later", b"x"))  # a watch over TLS
    writer.start()
    store.wait(["later"], timedelta(seconds=30))
    writer.join()
    assert store.get("later") == b"x"
    assert store.delete_key("a") and not store.check(["a"])


@pytest.mark.parametrize("who", ["plain", "no-certificate", "another-ca", "wrong-server-ca"])
def test_a_client_without_the_cas_certificate_is_refused_and_told_why(etcd_tls, who):
    certs = etcd_tls.tls
    tls, said = {
        "plain": (None, "etcd there speaks TLS: connect with protocol=https"),
        "no-certificate": (EtcdTLS(certs.ca_crt),
                           "it asks for a client certificate signed by its CA"),
        "another-ca": (EtcdTLS(certs.ca_crt, certs.other_crt, certs.other_key),
                       "it did not accept this host's certificate"),
        "wrong-server-ca": (EtcdTLS(certs.other_ca_crt, certs.client_crt, certs.client_key),
                            f"does not verify against cacert={certs.other_ca_crt}"),
    }[who]
    with pytest.raises(EtcdStoreError, match="unreachable") as err:
        _store(etcd_tls, tls).reachable()
    assert said in str(err.value), str(err.value)
    # nothing it tried reached the store
    good = _store(etcd_tls, EtcdTLS(certs.ca_crt, certs.client_crt, certs.client_key))
    assert not good.check(["__ping"])


def test_rdzv_conf_is_read_as_torchruns(tmp_path):
    ca, cert, key = (tmp_path / n for n in ("ca.crt", "c.crt", "c.key"))
    for path in (ca, cert, key):
        path.write_text("-")
    assert parse_conf("", "--rdzv-conf") is None
    assert parse_conf("protocol=http", "--rdzv-conf") is None
    assert parse_conf(f" protocol=https, cacert={ca},cert={cert},key={key} ", "x") == \
        EtcdTLS(str(ca), str(cert), str(key))
    assert parse_conf(f"cacert={ca}", "x") == EtcdTLS(str(ca))  # (https when certificates)
    assert parse_conf("protocol=https", "x") == EtcdTLS()  # (the system's CAs)


@pytest.mark.parametrize("text, problem", [
    ("protocol=ftp", "protocol 'ftp': expected http or https"),
    ("user=me", "unknown key 'user'; known: protocol, cacert, cert, key"),
    ("cacert", "'cacert': expected KEY=VALUE"),
    ("cacert=", "'cacert=': expected KEY=VALUE"),
    ("cacert={f},cacert={f}", "cacert given twice"),
    ("protocol=http,cacert={f}", "cacert given with protocol=http"),
    ("cert={f}", "cert and key go together"),
    ("cacert={f}.missing", "cacert={f}.missing: no readable file there"),
])
def test_bad_rdzv_conf_is_named(tmp_path, text, problem):
    f = tmp_path / "ca.crt"
    f.write_text("-")
    with pytest.raises(TLSConfError) as err:
        parse_conf(text.format(f=f), "--rdzv-conf")
    assert str(err.value).startswith("--rdzv-conf: ")
    assert problem.format(f=f) in str(err.value)


def test_the_agent_refuses_a_bad_rdzv_conf_before_it_starts_anything(tmp_path, corpus):
    from conftest import tiny_config

    config = tmp_path / "job.yaml"
    import yaml

    config.write_text(yaml.safe_dump(tiny_config(corpus).to_dict()))
    env = {"PATH": "/usr/bin:/bin", "SPOTPIPE_JOIN_TOKEN": "t",
           "PYTHONPATH": str(REPO / "src")}

    def agent(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "spotpipe", "agent", str(config), "--rdzv-endpoint",
             "127.0.0.1:1", "--rdzv-id", "j", "--nnodes", "2", "--out", str(tmp_path / "o"),
             *flags], env=env, capture_output=True, text=True, timeout=120)

    missing = agent("--rdzv-backend", "etcd", "--rdzv-conf", f"cacert={tmp_path}/none.crt")
    assert missing.returncode == 2
    assert f"--rdzv-conf: cacert={tmp_path}/none.crt: no readable file there" in missing.stderr
    assert "Traceback" not in missing.stderr
    ca = tmp_path / "ca.crt"
    ca.write_text("-")
    c10d = agent("--rdzv-backend", "c10d", "--rdzv-conf", f"cacert={ca}")
    assert c10d.returncode == 2 and "TLS is for --rdzv-backend etcd" in c10d.stderr
    assert not (tmp_path / "o").exists()
