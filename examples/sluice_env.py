"""The sluice environment protocol (docs/runtime.md, "External environments"), standard library
only: `serve(handle)` answers JSON-lines requests on stdin/stdout (kind `external`), or with
`--http HOST:PORT` POSTed JSON bodies (kind `http`; port 0 picks a free one, and the first line
printed is `listening on http://HOST:PORT/`).

`handle(msg)` gets one request (a dict: `type` is "problem", "step" or "demonstration") and
returns the reply's fields; `serve` adds the request's `id`. An exception in `handle` is
answered as `{"error": "..."}` (the environment's own failure: sluice ends that trajectory as
`environment` and never trains on it).
"""

import json
import sys


def arg(name, default=None, cast=str):
    """The value after `--name` on the command line, or `default`."""
    argv = sys.argv
    if name in argv:
        i = argv.index(name)
        if i + 1 < len(argv):
            return cast(argv[i + 1])
    return default


def _answer(handle, msg):
    try:
        reply = handle(msg)
    except Exception as e:  # the environment's own failure, reported, never a dead process
        reply = {"error": "%s: %s" % (type(e).__name__, e)}
    reply["id"] = msg.get("id")
    return reply


def serve(handle):
    addr = arg("--http")
    if addr is not None:
        _serve_http(handle, addr)
        return
    out = sys.stdout
    for line in sys.stdin:
        if not line.strip():
            continue
        reply = _answer(handle, json.loads(line))
        out.write(json.dumps(reply) + "\n")
        out.flush()


def _serve_http(handle, addr):
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    host, port = addr.rsplit(":", 1)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_POST(self):
            n = int(self.headers.get("Content-Length", "0"))
            try:
                msg = json.loads(self.rfile.read(n))
            except ValueError as e:
                self._send(400, {"error": "the body is not JSON: %s" % e})
                return
            self._send(200, _answer(handle, msg))

        def _send(self, code, obj):
            body = json.dumps(obj).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer((host, int(port)), Handler)
    print("listening on http://%s:%d/" % server.server_address[:2], flush=True)
    server.serve_forever()
