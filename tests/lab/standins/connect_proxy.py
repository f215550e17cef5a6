#!/usr/bin/python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A tiny HTTP proxy for HTTPS: ``CONNECT host:port`` tunnels, nothing else (no plain-HTTP forwarding), on loopback.

    connect_proxy.py --port 0 [--auth-file FILE] [--access-log FILE]

The way a CT reaches an index only through its proxy: a test gives the build ``HTTPS_PROXY`` and asserts the proxy
saw the tunnel. With ``--auth-file`` (one line ``user:password``) a CONNECT without those Proxy-Authorization
credentials gets 407. ``--access-log`` appends ``<host:port> <user or ->`` per CONNECT. Standard library only; the
first line printed names the port taken. :class:`ConnectProxy` is the same in a thread of a test's own process.
"""

import argparse
import base64
import select
import socket
import socketserver
import sys
import threading


class TunnelHandler(socketserver.StreamRequestHandler):
    def handle(self):
        head = self.rfile.readline(65536).decode("latin-1").split()
        headers = {}
        while True:
            line = self.rfile.readline(65536).decode("latin-1")
            if line in ("\r\n", "\n", ""):
                break
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if len(head) != 3 or head[0] != "CONNECT":
            self.wfile.write(b"HTTP/1.1 405 Only CONNECT\r\nContent-Length: 0\r\n\r\n")
            return
        self.server.proxy.record(head[1], headers.get("proxy-authorization", ""))
        if not self.server.proxy.authorized(headers.get("proxy-authorization", "")):
            self.wfile.write(
                b'HTTP/1.1 407 Proxy Authentication Required\r\nProxy-Authenticate: Basic realm="lab proxy"\r\n'
                b"Content-Length: 0\r\n\r\n"
            )
            return
        host, _, port = head[1].rpartition(":")
        try:
            upstream = socket.create_connection((host.strip("[]"), int(port)), timeout=10)
        except (OSError, ValueError):
            self.wfile.write(b"HTTP/1.1 502 Bad Gateway\r\nContent-Length: 0\r\n\r\n")
            return
        self.wfile.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        self.wfile.flush()
        self.pipe(self.connection, upstream)

    @staticmethod
    def pipe(client, upstream):
        sockets = [client, upstream]
        try:
            while True:
                ready, _, _ = select.select(sockets, [], [], 30)
                if not ready:
                    return
                for sock in ready:
                    data = sock.recv(65536)
                    if not data:
                        return
                    (upstream if sock is client else client).sendall(data)
        except OSError:
            return
        finally:
            upstream.close()


class ConnectProxy:
    """The proxy on 127.0.0.1 in a daemon thread: ``url``, ``seen`` (``[(host:port, user or None)]``)."""

    def __init__(self, credentials=None, access_log=None):
        self.credentials = credentials
        self.access_log = access_log
        self.seen = []
        self.lock = threading.Lock()
        self.server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), TunnelHandler, bind_and_activate=True)
        self.server.daemon_threads = True
        self.server.proxy = self
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def port(self):
        return self.server.server_address[1]

    def url(self, userinfo=""):
        return f"http://{userinfo + '@' if userinfo else ''}127.0.0.1:{self.port}"

    def record(self, target, authorization):
        user = None
        if authorization.startswith("Basic "):
            try:
                user = base64.b64decode(authorization[6:]).decode().partition(":")[0]
            except ValueError:
                user = "?"
        with self.lock:
            self.seen.append((target, user))
        if self.access_log:
            with open(self.access_log, "a", encoding="utf-8") as log:
                log.write(f"{target} {user or '-'}\n")

    def authorized(self, authorization):
        if self.credentials is None:
            return True
        return authorization == "Basic " + base64.b64encode(self.credentials.encode()).decode()

    def start(self):
        self.thread.start()
        return self

    def stop(self):
        self.server.shutdown()
        self.server.server_close()


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--auth-file")
    parser.add_argument("--access-log")
    args = parser.parse_args()
    credentials = None
    if args.auth_file:
        with open(args.auth_file, encoding="utf-8") as handle:
            credentials = handle.read().strip()
    proxy = ConnectProxy(credentials, args.access_log)
    if args.port:
        proxy.server.server_close()
        proxy.server = socketserver.ThreadingTCPServer(("127.0.0.1", args.port), TunnelHandler)
        proxy.server.daemon_threads = True
        proxy.server.proxy = proxy
    print(f"proxying CONNECT on 127.0.0.1:{proxy.port}", flush=True)
    proxy.server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
