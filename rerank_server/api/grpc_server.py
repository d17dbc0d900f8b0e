"""The gRPC server: the Reranker service, health, reflection and interceptors on one port.

Its health names: docs/api.md, "Health and reflection".
"""

from __future__ import annotations

import socket

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from ..errors import BindError
from ..observability.telemetry import Telemetry
from ..ranking.request import RequestRules
from ..ranking.served_models import ServedModels
from ..security.inflight_bytes import InflightBytes
from ..security.tls import CertificateFiles
from ..security.tokens import TokenSet
from ..settings import Settings, host_port
from .health_service import HealthServicer
from .interceptors import RpcInterceptor
from .pb import rerank_pb2 as pb
from .service import RerankService

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["Reranker"].full_name
BACKEND_HEALTH = f"{SERVICE_NAME}/backend"

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
HANDSHAKE_TIMEOUT_S = 10.0  # from connecting to the HTTP/2 preface (and TLS, with it)
CONNECTION_IDLE_S = 300.0  # without a call, before the connection is closed (GOAWAY)
# A connection this old gets GOAWAY (gRPC adds up to 10% of jitter): its calls go on to
# their end, and the client's next ones open a new connection, after resolving the name
# again. Without it a busy round_robin client never reaches the pods an autoscaler adds
# (grpc/grpc#12295; docs/deploy.md, "Load balancing in a fleet").
CONNECTION_AGE_S = 300.0


def backend_health_name(component: str) -> str:
    """The health name for a backend component ("" is the backend as a whole)."""
    return f"{BACKEND_HEALTH}/{component}" if component else BACKEND_HEALTH


def _handlers(service: RerankService) -> grpc.GenericRpcHandler:
    """The Reranker methods, taking raw request bytes: `service` parses them itself (so a
    message that does not decode is INVALID_ARGUMENT). All are registered as
    request-streaming, so that `service` reads the one request of `Rerank` and
    `RerankStream` itself, once the byte budget has room for it: grpc.aio reads a unary
    request whole before the handler (and any refusal) runs. On the wire a unary call
    and a request stream of one message are the same; clients see no difference."""
    return grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Rerank": grpc.stream_unary_rpc_method_handler(
                service.Rerank, response_serializer=pb.RerankResponse.SerializeToString
            ),
            "RerankStream": grpc.stream_stream_rpc_method_handler(
                service.RerankStream, response_serializer=pb.RerankStreamMessage.SerializeToString
            ),
            "RerankBatch": grpc.stream_stream_rpc_method_handler(
                service.RerankBatch, response_serializer=pb.RerankResponse.SerializeToString
            ),
        },
    )


def _interceptors(
    settings: Settings,
    telemetry: Telemetry,
    tokens: TokenSet,
) -> list[grpc.aio.ServerInterceptor]:
    """Ours: log context, the server span (with tracing on), auth, shedding, metrics."""
    return [
        RpcInterceptor(
            telemetry.metrics,
            SERVICE_NAME,
            settings.max_concurrent_rpcs,
            tokens,
            telemetry.tracer if telemetry.tracing else None,
        )
    ]


def _credentials(tls: CertificateFiles) -> grpc.ServerCredentials:
    """TLS credentials that pick up new certificate files at the next handshake."""

    def configuration() -> grpc.ServerCertificateConfiguration:
        cert, key, ca = tls.read()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # grpc calls this before each handshake: None keeps the current certificate.
        times = tls.changed()
        if times is None:
            return None
        try:
            fresh = configuration()
        except OSError:
            return None  # half-written: the next handshake tries again
        tls.loaded(times)
        return fresh

    return grpc.dynamic_ssl_server_credentials(
        configuration(), fetch, require_client_authentication=tls.mutual
    )


def check_free(host: str, port: int, setting: str = "--port / RERANK_PORT") -> None:
    """Raise BindError, naming `setting`, if `host:port` cannot be bound, before grpc
    tries: grpc would log its own multi-line error to stderr first. The probe sets no
    SO_REUSEPORT, so a port that another program holds with it (a gRPC server on
    default options does) is found taken too."""
    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise BindError("--host / RERANK_HOST", host_port(host, port), str(exc)) from None
    for family, kind, proto, _, address in infos:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as grpc does
            try:
                probe.bind(address)
            except OSError as exc:
                raise BindError(setting, host_port(host, port), exc.strerror or "") from None


class GrpcEdge:
    """A started gRPC server and its health service; `aclose` drains and stops it."""

    def __init__(
        self,
        server: grpc.aio.Server,
        health_servicer: health.aio.HealthServicer,
        port: int,
        grace_s: float,
        service: RerankService | None = None,
    ) -> None:
        self.server = server
        self.service = service
        self.health = health_servicer
        self.port = port
        self.grace_s = grace_s  # in-flight calls get this long on `aclose`

    @classmethod
    async def start(
        cls,
        settings: Settings,
        models: ServedModels,
        telemetry: Telemetry,
        rules: RequestRules,
        tokens: TokenSet | None = None,
        tls: CertificateFiles | None = None,
        inflight: InflightBytes | None = None,
        reuse_port: bool = False,
    ) -> GrpcEdge:
        """Bind and start. `reuse_port`: share the port with sibling workers (the
        supervisor has checked and reserved it); otherwise a port in use is an error, not
        silently shared with whatever holds it. Called inside the running loop: grpc.aio
        objects belong to the loop that made them (grpc/grpc#32480)."""
        options = [
            ("grpc.max_receive_message_length", settings.max_message_bytes),
            ("grpc.max_send_message_length", settings.max_message_bytes),
            ("grpc.so_reuseport", int(reuse_port)),
            # Connections, bounded as on the HTTP port: gRPC's core holds any number, for
            # as long as their clients like, by default. Past the cap a new one is
            # closed at once; one that has not sent its preface (or finished TLS) by the
            # handshake timeout is closed; an idle one gets GOAWAY (a client's channel
            # reconnects on its next call).
            ("grpc.max_allowed_incoming_connections", settings.max_connections),
            ("grpc.server_handshake_timeout_ms", int(HANDSHAKE_TIMEOUT_S * 1000)),
            ("grpc.max_connection_idle_ms", int(CONNECTION_IDLE_S * 1000)),
            # No grace set: calls on an old connection (a long RerankBatch) run to their end.
            ("grpc.max_connection_age_ms", int(CONNECTION_AGE_S * 1000)),
            # A call's message not yet asked for holds at most the stream's initial
            # window (64 KiB). With the BDP probe on, gRPC raised that window to the
            # link's bandwidth-delay product, several MB on a fast link, and took in
            # whole the messages of calls waiting for room or about to be refused.
            # A message being read still gets a window of its whole length.
            ("grpc.http2.bdp_probe", 0),
        ]
        server = grpc.aio.server(
            interceptors=_interceptors(settings, telemetry, tokens or TokenSet()), options=options
        )
        service = RerankService(
            models,
            telemetry,
            rules,
            settings.batch_concurrency,
            inflight or InflightBytes(settings.max_inflight_bytes),
            settings.max_message_bytes,
        )
        server.add_generic_rpc_handlers((_handlers(service),))
        health_servicer = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        if settings.reflection:
            names = (
                SERVICE_NAME,
                health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                reflection.SERVICE_NAME,
            )
            reflection.enable_server_reflection(names, server)
        if not reuse_port:
            check_free(settings.host, settings.port)
        try:
            port = (
                server.add_secure_port(settings.address, _credentials(tls))
                if tls is not None
                else server.add_insecure_port(settings.address)
            )
        except RuntimeError:  # grpc >= 1.60 raises where older versions returned 0
            port = 0
        if port == 0:
            raise BindError("--port / RERANK_PORT", settings.address)
        await server.start()
        # NOT_SERVING: the server's other edges may not listen yet; `serving` says SERVING.
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, _NOT_SERVING)
        return cls(server, health_servicer, port, settings.grace_period_s, service)

    async def serving(self) -> None:
        """SERVING: called once every edge of the server listens, so that a readiness probe
        on this port speaks for the JSON port too."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, _SERVING)

    async def report_backend(self, component: str, up: bool) -> None:
        """The backend monitor's callback (`scoring.monitor.Report`)."""
        await self.health.set(backend_health_name(component), _SERVING if up else _NOT_SERVING)

    async def aclose(self) -> None:
        """NOT_SERVING, refuse new calls, give in-flight ones `grace_s`, then cancel them."""
        await self.health.enter_graceful_shutdown()
        if self.service is not None:
            self.service.drain()
        await self.server.stop(self.grace_s)
