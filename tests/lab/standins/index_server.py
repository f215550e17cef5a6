#!/usr/bin/python3
# Copyright: pve-gpu-recover contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""A package index served on loopback inside a lab CT: static PEP 503 pages and wheels (tests/lab/wheelhouse.py).

    index_server.py DIRECTORY --port 8900 [--break PATTERN] [--pid-file FILE]

With ``--break``, the first request whose path contains PATTERN gets its headers and half of its body, then the
connection is cut and the server exits: an index that goes down in the middle of an install, as a mirror or a
proxy does. Standard library only (it runs on the CT's python3).
"""

import argparse
import functools
import http.server
import os
import sys
import threading


class Handler(http.server.SimpleHTTPRequestHandler):
    broken = None  # PATTERN of --break, or None
    server_version = "pve-gpu-lab-index"

    def log_message(self, *_args):  # quiet: uv retries are not errors of the test
        pass

    def do_GET(self):
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


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--port", type=int, default=8900)
    parser.add_argument("--break", dest="broken")
    parser.add_argument("--pid-file")
    args = parser.parse_args()
    Handler.broken = args.broken
    handler = functools.partial(Handler, directory=args.directory)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", args.port), handler)
    if args.pid_file:
        with open(args.pid_file, "w", encoding="utf-8") as handle:
            handle.write(f"{os.getpid()}\n")
    print(f"serving {args.directory} on 127.0.0.1:{args.port}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
