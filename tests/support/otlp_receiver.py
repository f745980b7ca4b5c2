"""A real OTLP/HTTP trace receiver for tests: ``POST /v1/traces`` with an ``ExportTraceServiceRequest``
(protobuf, as OpenTelemetry's exporters send it), decoded with the OpenTelemetry proto package."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.support.trace_checks import SpanRecord, from_otlp


class OtlpReceiver:
    """Collects the spans exported to ``url`` (a base URL, as ``--otlp-endpoint`` takes) while running."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[SpanRecord] = []
        self.refused: list[str] = []
        self.exports = 0
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, name="otlp-receiver", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def spans(self) -> list[SpanRecord]:
        with self._lock:
            return list(self._spans)

    def _received(self, path: str, content_type: str, body: bytes) -> int:
        if path != "/v1/traces" or content_type != "application/x-protobuf":
            self.refused.append(f"{path} {content_type}")
            return 404
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        with self._lock:
            self._spans.extend(from_otlp(request))
            self.exports += 1
        return 200

    def _handler(self) -> Any:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                status = receiver._received(self.path, self.headers.get("Content-Type", ""), body)
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(status)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format: str, *args: Any) -> None:  # quiet: pytest shows failures
                return None

        return Handler
