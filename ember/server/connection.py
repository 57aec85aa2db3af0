"""Deadlines for slow clients, on uvicorn's HTTP/1.1 protocol.

uvicorn waits for a request's headers and body as long as a client keeps the connection open,
so connections that send a byte now and then (slowloris) pile up without end. Here a request
line and its headers must arrive within `header_timeout_s` of the connection opening (or of the
previous response on it), and the body within `body_timeout_s` of the headers. A late body gets
408 and the route sees the client gone; a connection without headers is closed.
"""
from __future__ import annotations

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class TimedProtocol(H11Protocol):
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0

    @classmethod
    def with_timeouts(cls, header_s: float, body_s: float) -> type[TimedProtocol]:
        return type("TimedProtocol", (cls,), {"header_timeout_s": header_s, "body_timeout_s": body_s})

    def connection_made(self, transport) -> None:
        self._phase, self._timer = None, None
        super().connection_made(transport)
        self._track()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track()

    def _track(self) -> None:
        """Arm the deadline of the phase the client is in, when it changes: waiting for headers
        (IDLE), for the body (SEND_BODY), or none while the request runs."""
        phase = self.conn.their_state
        if phase is self._phase:
            return
        self._phase = phase
        self._disarm()
        if phase is h11.IDLE:
            self._timer = self.loop.call_later(self.header_timeout_s, self._late, phase)
        elif phase is h11.SEND_BODY:
            self._timer = self.loop.call_later(self.body_timeout_s, self._late, phase)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _late(self, phase) -> None:
        if self.transport.is_closing() or self.conn.their_state is not phase:
            return
        cycle = self.cycle if phase is h11.SEND_BODY else None
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the route's receive() returns http.disconnect; its sends are dropped
            cycle.message_event.set()
            if not cycle.response_started and self.conn.our_state is h11.SEND_RESPONSE:
                self._send_408()
        self.transport.close()

    def _send_408(self) -> None:
        body = b'{"error": {"message": "the request body did not arrive in time", "type": ' \
               b'"invalid_request_error", "param": null, "code": "request_timeout"}}'
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        try:
            for event in (h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"),
                          h11.Data(data=body), h11.EndOfMessage()):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:
            pass
