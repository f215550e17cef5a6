#!/usr/bin/python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A package index served on loopback inside a lab CT: static PEP 503 pages and wheels (tests/lab/wheelhouse.py).

    index_server.py DIRECTORY --port 8900 [--break PATTERN] [--pid-file FILE]
                    [--tls-cert CERT --tls-key KEY] [--auth-file FILE] [--access-log FILE]

With ``--break``, the first request whose path contains PATTERN gets its headers and half of its body, then the
connection is cut and the server exits: an index that goes down in the middle of an install, as a mirror or a
proxy does. With ``--tls-cert``/``--tls-key`` it serves HTTPS only (a private index whose CA the CT does not trust
by default: tests/lab/private_ca.py makes both). With ``--auth-file`` (one line ``user:password``, never on the
command line) a request without those Basic credentials gets 401. ``--access-log`` appends ``<path> <user or ->``
per request: what the index saw. ``--port 0`` takes a free port; the first line printed names the one taken.
Standard library only (it runs on the CT's python3).
"""

import argparse
import base64
import functools
import http.server
import os
import ssl
import sys
import threading


class Handler(http.server.SimpleHTTPRequestHandler):
    broken = None  # PATTERN of --break, or None
    credentials = None  # "user:password" of --auth-file, or None
    access_log = None  # path of --access-log, or None
    server_version = "pve-gpu-lab-index"

    def log_message(self, *_args):  # quiet: uv retries are not errors of the test
        pass

    def user(self):
        """The Basic user name the request sent, or None."""
        header = self.headers.get("Authorization", "")
        if not header.startswith("Basic "):
            return None
        try:
            return base64.b64decode(header[6:]).decode().partition(":")[0]
        except ValueError:
            return None

    def authorized(self):
        if self.credentials is None:
            return True
        expected = "Basic " + base64.b64encode(self.credentials.encode()).decode()
        return self.headers.get("Authorization") == expected

    def do_GET(self):
        if self.access_log:
            with open(self.access_log, "a", encoding="utf-8") as log:
                log.write(f"{self.path} {self.user() or '-'}\n")
        if not self.authorized():
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="lab index"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.broken and self.broken in self.path:
            self.die_mid_transfer()
            return
        super().do_GET()

    def die_mid_transfer(self):
        path = self.translate_path(self.path)
        with open(path, "rb") as handle:
            data = handle.read()
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data[: len(data) // 2])
        self.wfile.flush()
        self.connection.close()
        threading.Thread(target=self.server.shutdown, daemon=True).start()


def make_server(directory, port=0, *, tls_cert=None, tls_key=None):
    """The index server of ``directory`` on 127.0.0.1:``port`` (0: a free one), HTTPS when given a certificate."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), functools.partial(Handler, directory=directory))
    server.daemon_threads = True
    if tls_cert:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(tls_cert, tls_key)
        server.socket = context.wrap_socket(server.socket, server_side=True)
    return server


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--port", type=int, default=8900)
    parser.add_argument("--break", dest="broken")
    parser.add_argument("--pid-file")
    parser.add_argument("--tls-cert")
    parser.add_argument("--tls-key")
    parser.add_argument("--auth-file")
    parser.add_argument("--access-log")
    args = parser.parse_args()
    if bool(args.tls_cert) != bool(args.tls_key):
        parser.error("--tls-cert and --tls-key go together")
    Handler.broken = args.broken
    Handler.access_log = args.access_log
    if args.auth_file:
        with open(args.auth_file, encoding="utf-8") as handle:
            Handler.credentials = handle.read().strip()
    server = make_server(args.directory, args.port, tls_cert=args.tls_cert, tls_key=args.tls_key)
    if args.pid_file:
        with open(args.pid_file, "w", encoding="utf-8") as handle:
            handle.write(f"{os.getpid()}\n")
    scheme = "https" if args.tls_cert else "http"
    print(f"serving {args.directory} on {scheme}://127.0.0.1:{server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
