"""The link's security: a bearer token checked by a server interceptor, TLS credentials (mutual
TLS optional), and a throwaway certificate authority for tests and local trials.
"""

from __future__ import annotations

import datetime
import hmac
import os
from dataclasses import dataclass
from typing import Optional

import grpc

TOKEN_HEADER = "authorization"
TOKEN_ENV = "ISLANDS_LINK_TOKEN"


def read_token(token_file: Optional[str], env: str = TOKEN_ENV,
               option: str = "link.token_file") -> str:
    """The link token from ``token_file`` (stripped), else from the environment variable ``env``.
    ``option``: what the user sets the file with, for the message (a region: ``--token-file``).

    Raises:
      ValueError: neither gives a token (the message names both places).
    """
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"link token file {token_file} is empty")
        return token
    token = os.environ.get(env, "").strip()
    if not token:
        raise ValueError(f"no link token: set {option} or the {env} environment variable")
    return token


class TokenInterceptor(grpc.ServerInterceptor):
    """Refuses every call whose ``authorization`` metadata is not ``Bearer <token>``, with
    UNAUTHENTICATED and a message that says which (missing or wrong); compared in constant time."""

    def __init__(self, token: str):
        if not token:
            raise ValueError("the link token must not be empty")
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation, handler_call_details):
        metadata = dict(handler_call_details.invocation_metadata or ())
        got = metadata.get(TOKEN_HEADER)
        if got is not None and hmac.compare_digest(got.encode(), self._expected):
            return continuation(handler_call_details)
        message = ("link call without a bearer token" if got is None
                   else "link call with a wrong bearer token")
        handler = continuation(handler_call_details)
        if handler is None:
            return None

        def abort(_request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        def abort_stream(_request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # pragma: no cover - abort raises

        if handler.response_streaming:
            factory = (grpc.stream_stream_rpc_method_handler if handler.request_streaming
                       else grpc.unary_stream_rpc_method_handler)
            return factory(abort_stream, handler.request_deserializer, handler.response_serializer)
        factory = (grpc.stream_unary_rpc_method_handler if handler.request_streaming
                   else grpc.unary_unary_rpc_method_handler)
        return factory(abort, handler.request_deserializer, handler.response_serializer)


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return ((TOKEN_HEADER, f"Bearer {token}"),)


def _read(path: Optional[str]) -> Optional[bytes]:
    if not path:
        return None
    with open(path, "rb") as f:
        return f.read()


def server_credentials(cert_file: str, key_file: str,
                       client_ca_file: Optional[str] = None) -> grpc.ServerCredentials:
    """TLS for the link server; with ``client_ca_file`` clients must present a certificate
    signed by that CA (mutual TLS)."""
    return grpc.ssl_server_credentials(
        [(_read(key_file), _read(cert_file))], root_certificates=_read(client_ca_file),
        require_client_auth=client_ca_file is not None)


def channel_credentials(ca_file: Optional[str], cert_file: Optional[str] = None,
                        key_file: Optional[str] = None) -> grpc.ChannelCredentials:
    """TLS for the region's channel: trust ``ca_file`` (None: the system roots); with a client
    certificate and key for mutual TLS."""
    if (cert_file is None) != (key_file is None):
        raise ValueError("mutual TLS needs both a client certificate and its key")
    return grpc.ssl_channel_credentials(root_certificates=_read(ca_file),
                                        private_key=_read(key_file),
                                        certificate_chain=_read(cert_file))


@dataclass(frozen=True)
class Pki:
    """Paths of a throwaway CA and a server and client certificate signed by it."""

    ca_cert: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def throwaway_pki(directory: str, host: str = "localhost", days: int = 1,
                  client_expired: bool = False) -> Pki:
    """Makes a fresh CA and a server certificate for ``host`` (plus 127.0.0.1) and a client
    certificate, all valid for ``days`` (``client_expired``: the client's ended yesterday, to
    test a refusal): for tests and trying the link out, never for a real job.
    Needs the ``cryptography`` package (in the dev extra)."""
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    os.makedirs(directory, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def write(path, data):
        with open(os.path.join(directory, path), "wb") as f:
            f.write(data)
        return os.path.join(directory, path)

    def key_pem(key):
        return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                 serialization.NoEncryption())

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("islands throwaway CA"))
          .issuer_name(name("islands throwaway CA")).public_key(ca_key.public_key())
          .serial_number(x509.random_serial_number()).not_valid_before(now)
          .not_valid_after(now + datetime.timedelta(days=days))
          .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def leaf(cn, usage, sans, expired=False):
        key = ec.generate_private_key(ec.SECP256R1())
        start, end = now, now + datetime.timedelta(days=days)
        if expired:
            start, end = now - datetime.timedelta(days=2), now - datetime.timedelta(days=1)
        builder = (x509.CertificateBuilder().subject_name(name(cn)).issuer_name(ca.subject)
                   .public_key(key.public_key()).serial_number(x509.random_serial_number())
                   .not_valid_before(start).not_valid_after(end)
                   .add_extension(x509.ExtendedKeyUsage([usage]), critical=False))
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return builder.sign(ca_key, hashes.SHA256()), key

    server, server_key = leaf(host, ExtendedKeyUsageOID.SERVER_AUTH,
                              [x509.DNSName(host), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
    client, client_key = leaf("islands region agent", ExtendedKeyUsageOID.CLIENT_AUTH, [],
                              expired=client_expired)
    pem = serialization.Encoding.PEM
    return Pki(ca_cert=write("ca.pem", ca.public_bytes(pem)),
               server_cert=write("server.pem", server.public_bytes(pem)),
               server_key=write("server-key.pem", key_pem(server_key)),
               client_cert=write("client.pem", client.public_bytes(pem)),
               client_key=write("client-key.pem", key_pem(client_key)))
