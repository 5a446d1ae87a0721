"""Attach your terminal to a rank's debugger: ``python -m tutorial_impl.testing.attach PORT``.

The debugged rank (``pytest --rank-pdb N`` or ``run_ranks(fn, debug_rank=N)``, see
``debugging``) prints the port when it stops. This copies lines from your stdin to the rank's
pdb and everything it writes back to your stdout, until the rank closes the connection (``c``
to the end, or ``q``). Ctrl-D lets the rank go on: the commands typed before it run first,
their output is shown, and the rank then continues as ``c`` would.
"""

from __future__ import annotations

import argparse
import selectors
import socket
import sys


def attach(port: int, host: str = "127.0.0.1") -> int:
    with socket.create_connection((host, port)) as connection:
        selector = selectors.DefaultSelector()
        selector.register(connection, selectors.EVENT_READ)
        selector.register(sys.stdin, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is connection:
                    data = connection.recv(65536)
                    if not data:
                        return 0  # the rank went on or ended
                    sys.stdout.write(data.decode("utf-8", "replace"))
                    sys.stdout.flush()
                else:
                    line = sys.stdin.readline()
                    if line:
                        connection.sendall(line.encode())
                        continue
                    # Ctrl-D: the end of our input. The rank's pdb runs what was sent before
                    # it, then reads the end and goes on (``RemotePdb.do_EOF``); its output
                    # until then is still shown, and its closing the connection ends this.
                    connection.shutdown(socket.SHUT_WR)
                    selector.unregister(sys.stdin)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tutorial_impl.testing.attach")
    parser.add_argument("port", type=int, help="the port the debugged rank printed")
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    return attach(args.port, args.host)


if __name__ == "__main__":
    raise SystemExit(main())
