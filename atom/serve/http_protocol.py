"""The HTTP/1.1 implementation atom.serve runs on: uvicorn's h11 protocol, with OpenAI's error
JSON for requests that are not HTTP at all.

h11 rather than httptools: an HTTP/1.0 client (which cannot read chunked transfer coding) gets
a streamed response delimited by closing the connection, as HTTP/1.0 requires; httptools sends
it chunked. The parsing cost is no concern for a server whose requests take milliseconds to
seconds of GPU time each. A request line or header block that cannot be parsed is answered
400 with ``{"error": {...}}`` (uvicorn answers it with a text/plain line), then the
connection is closed.
"""

from __future__ import annotations

import json

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def malformed_body(msg: str) -> bytes:
    return json.dumps(
        {
            "error": {
                "message": f"malformed HTTP request ({msg.rstrip('.')}); send HTTP/1.1 or 1.0",
                "type": "invalid_request_error",
                "param": None,
                "code": 400,
            }
        }
    ).encode()


class OpenAIH11Protocol(H11Protocol):
    def send_400_response(self, msg: str) -> None:
        body = malformed_body(msg)
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        event = h11.Response(status_code=400, headers=headers, reason=b"Bad Request")
        for ev in (event, h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(ev))
        self.transport.close()
