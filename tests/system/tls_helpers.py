"""TLS contexts for the tests' server and client."""

from __future__ import annotations

import ssl

import trustme


def server_context(cert: trustme.LeafCert | None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    if cert is not None:
        cert.configure_cert(ctx)
    return ctx


def client_context(ca: trustme.CA) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca.configure_trust(ctx)
    return ctx
