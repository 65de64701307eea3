"""The bus over TLS with client certificates and credentials (EVENFLOW_NATS_TLS_*): a service
with the CA, its certificate and its credentials talks; a client without a certificate, or
one that does not trust the server's CA, is refused."""

from __future__ import annotations

import asyncio
import shutil
import subprocess

import nats
import pytest

from evenflow.proto.messages import Cancel
from evenflow.services import nats_auth
from evenflow.services.bus import Bus, NatsSecurity
from evenflow.services.launcher import find_binary, free_port, stop_process, wait_for_port

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


def openssl(*args: str, cwd) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_certificates(d) -> None:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both CA-signed."""
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=ev-ca",
            "-keyout", "ca.key", "-out", "ca.pem", cwd=d)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")
    for name in ("server", "client"):
        openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN=ev-{name}",
                "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
        openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                "-CAcreateserial", "-days", "1", "-extfile", "san.ext", "-out", f"{name}.pem",
                cwd=d)
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
            "/CN=other-ca", "-keyout", "other.key", "-out", "other.pem", cwd=d)


@pytest.fixture(scope="module")
def tls_nats(tmp_path_factory):
    d = tmp_path_factory.mktemp("tls")
    make_certificates(d)
    port = free_port()
    user = nats_auth.make_user("admin", "")
    conf = nats_auth.server_config(port, [user]) + (
        f'tls {{\n  cert_file: "{d}/server.pem"\n  key_file: "{d}/server.key"\n'
        f'  ca_file: "{d}/ca.pem"\n  verify: true\n}}\n')
    (d / "nats.conf").write_text(conf)
    creds = nats_auth.write_credentials(d, user)
    proc = subprocess.Popen([find_binary("nats-server"), "-c", str(d / "nats.conf")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for_port(port, 10, proc)
        yield f"tls://127.0.0.1:{port}", d, str(creds)
    finally:
        stop_process(proc)


def roundtrip(url: str, security: NatsSecurity) -> object:
    async def scenario():
        sender, receiver = Bus("tls-sender"), Bus("tls-receiver")
        await sender.connect(url, timeout_s=3, security=security)
        await receiver.connect(url, timeout_s=3, security=security)
        got: asyncio.Queue = asyncio.Queue()
        await receiver.subscribe("t.tls", lambda m, _ctx: got.put_nowait(m))
        await receiver.nc.flush()
        message = None
        for _ in range(20):  # a loaded machine may be slow to route the first one: ask again
            await sender.publish("t.tls", Cancel(request_id="over-tls"))
            try:
                message = await asyncio.wait_for(got.get(), 0.5)
                break
            except TimeoutError:
                continue
        await sender.close()
        await receiver.close()
        return message

    return asyncio.run(scenario())


def refused(url: str, security: NatsSecurity) -> None:
    async def attempt():  # the bus's own connect keeps retrying: one attempt is enough here
        nc = await nats.connect(url, connect_timeout=2, allow_reconnect=False,
                                max_reconnect_attempts=0, **security.connect_kwargs())
        await nc.close()

    with pytest.raises(Exception):  # noqa: B017 - ssl, auth or "no servers": any refusal
        asyncio.run(attempt())


def test_a_service_with_certificates_and_credentials_talks_over_tls(tls_nats):
    url, d, creds = tls_nats
    security = NatsSecurity(creds, str(d / "ca.pem"), str(d / "client.pem"), str(d / "client.key"))
    assert roundtrip(url, security) == Cancel(request_id="over-tls")


def test_a_client_without_a_certificate_is_refused(tls_nats):
    url, d, creds = tls_nats
    refused(url, NatsSecurity(creds, str(d / "ca.pem")))


def test_a_client_that_does_not_trust_the_server_is_refused(tls_nats):
    url, d, creds = tls_nats
    refused(url, NatsSecurity(creds, str(d / "other.pem"), str(d / "client.pem"),
                              str(d / "client.key")))
