"""grpc_health's servicer, with `Watch` streams that end once the drain begins."""

from __future__ import annotations

from typing import Any

from grpc_health.v1 import health
from grpc_health.v1 import health_pb2 as pb


class HealthServicer(health.aio.HealthServicer):  # type: ignore[misc]
    """grpc_health's servicer, whose `Watch` sends NOT_SERVING when the drain begins and
    ends: `server.stop(grace)` waits for every call in progress, and grpc_health's own
    `Watch` never ends, so one watching client would hold every shutdown for its grace."""

    async def Watch(self, request: pb.HealthCheckRequest, context: Any) -> None:
        # grpc_health 1.x's own loop (its fields are declared on the class), with the
        # return once the status sent is the drain's.
        condition = self._server_watchers[request.service]
        self._watcher_count_by_service[request.service] += 1
        last_status = None
        try:
            async with condition:
                while True:
                    status = self._server_status.get(
                        request.service, pb.HealthCheckResponse.SERVICE_UNKNOWN
                    )
                    if status != last_status:
                        await context.write(pb.HealthCheckResponse(status=status))
                    last_status = status
                    if self._gracefully_shutting_down:
                        return
                    await condition.wait()
        finally:
            self._watcher_count_by_service[request.service] -= 1
            if self._watcher_count_by_service[request.service] == 0:
                del self._server_watchers[request.service]
                del self._watcher_count_by_service[request.service]

    async def enter_graceful_shutdown(self) -> None:
        await super().enter_graceful_shutdown()
        # Watchers of a service never registered wait on a condition nothing else wakes.
        for condition in list(self._server_watchers.values()):
            async with condition:
                condition.notify_all()
