"""A small OTLP/HTTP trace receiver: the services export real OTLP to it (`evenflow doctor`
and the tests collect their spans this way)."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


@dataclass(frozen=True)
class ReceivedSpan:
    trace_id: str
    span_id: str
    parent_span_id: str
    name: str
    service: str
    attributes: dict
    start_ns: int = 0
    end_ns: int = 0
    instance: str = ""  # the worker id (service.instance.id)

    @property
    def duration_s(self) -> float:
        return (self.end_ns - self.start_ns) / 1e9


class OTLPReceiver:
    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.spans: list[ReceivedSpan] = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                request = ExportTraceServiceRequest()
                request.ParseFromString(body)
                for rs in request.resource_spans:
                    resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                    service = resource.get("service.name", "")
                    instance = resource.get("service.instance.id", "")
                    for ss in rs.scope_spans:
                        for s in ss.spans:
                            attrs = {a.key: (a.value.string_value or a.value.int_value)
                                     for a in s.attributes}
                            receiver.spans.append(ReceivedSpan(
                                s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex(),
                                s.name, service, attrs, s.start_time_unix_nano,
                                s.end_time_unix_nano, instance))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.host = host
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
