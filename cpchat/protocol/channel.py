"""The gRPC options and the cluster token that both ends of cpchat's connections share: the front
end's channels to the ranks, the ranks' links to each other, and the check every rank makes.

Hand-written, unlike the rest of cpchat/protocol (generated from proto/cpchat.proto)."""

from __future__ import annotations

import hmac
from collections.abc import Sequence

import grpc

TOKEN_HEADER = "x-cpchat-token"
Metadata = tuple[tuple[str, str], ...]
Options = Sequence[tuple[str, int]]

# A ping every second, and a link that misses its answer for two is dead: a rank that vanishes
# without closing its sockets (power, network) is noticed in seconds, not at the next send.
KEEPALIVE = [
    ("grpc.keepalive_time_ms", 1000),
    ("grpc.keepalive_timeout_ms", 2000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# A new channel does not share (and wait out) the reconnect backoff of an earlier channel to the
# same address, e.g. one whose network link was down, or one of a previous Cluster.
FRESH_CHANNEL = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_reconnect_backoff_ms", 1000)]
# What a rank's server allows, so that the pings of KEEPALIVE are never refused as abuse.
SERVER_KEEPALIVE = [
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    *KEEPALIVE,
]


def open_channel(address: str, tls_ca: bytes | None = None, options: Options = ()) -> grpc.Channel:
    """A new channel to a rank, with `options` (message sizes) before KEEPALIVE and FRESH_CHANNEL;
    TLS against `tls_ca` when given one."""
    options = [*options, *KEEPALIVE, *FRESH_CHANNEL]
    if tls_ca is not None:
        return grpc.secure_channel(address, grpc.ssl_channel_credentials(tls_ca), options)
    return grpc.insecure_channel(address, options)


def token_metadata(token: str | None) -> Metadata:
    """What every call to a rank carries: the cluster token, if the cluster has one."""
    return ((TOKEN_HEADER, token),) if token else ()


class TokenCheck(grpc.ServerInterceptor):
    """Refuse every RPC (control, ring, health and reflection) that lacks the cluster token, before
    any servicer runs; the refusal says nothing about the rank."""

    def __init__(self, token: str) -> None:
        self.token = token.encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong cluster token")

        self._deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (True, True): grpc.stream_stream_rpc_method_handler(deny),
        }

    def intercept_service(self, continuation, details):
        given = [v for k, v in details.invocation_metadata if k == TOKEN_HEADER]
        value = given[0] if len(given) == 1 and isinstance(given[0], str) else ""
        if hmac.compare_digest(value.encode(), self.token):  # constant time
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return self._deny[(False, False)]
        return self._deny[(handler.request_streaming, handler.response_streaming)]
