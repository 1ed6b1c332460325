"""TLS contexts for the tests' server and client, from a throwaway ``trustme`` CA."""

from __future__ import annotations

import ssl

import trustme


def server_context(cert: trustme.LeafCert | None, ca: trustme.CA | None = None) -> ssl.SSLContext:
    """A server context presenting ``cert`` (none if None); with ``ca`` it requires a client
    certificate signed by it."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    if cert is not None:
        cert.configure_cert(ctx)
    if ca is not None:
        ca.configure_trust(ctx)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(ca: trustme.CA, cert: trustme.LeafCert | None = None) -> ssl.SSLContext:
    """A client context that trusts ``ca`` (and presents ``cert`` if given)."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ca.configure_trust(ctx)
    if cert is not None:
        cert.configure_cert(ctx)
    return ctx


def tls_contexts(host: str = "127.0.0.1") -> tuple[ssl.SSLContext, ssl.SSLContext]:
    """A server context with a certificate for ``host`` from a throwaway CA, and a client
    context that trusts that CA."""
    ca = trustme.CA()
    return server_context(ca.issue_cert(host)), client_context(ca)
