"""Read the wire: every frame on one interface, as someone watching the network would see it.

    python -m tests.support.wire_capture IFACE OUT      # inside a host: Hosts.popen(i, ...)

captures every Ethernet frame that crosses IFACE (both directions) into OUT, each as a
4-byte big-endian length and the frame, until SIGTERM. It needs a raw packet socket (root),
and run inside a network namespace of tests/support/netns.py sees that host's traffic only.
`streams(OUT)` gives the TCP payload of each direction of each connection, in capture order
(a veth drops and reorders nothing), which a test searches for secrets.
"""

from __future__ import annotations

import signal
import socket
import struct
import sys

ETH_P_ALL = 0x0003


def capture(iface: str, out: str) -> None:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.bind((iface, 0))
    s.settimeout(0.2)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    with open(out, "wb", buffering=0) as f:
        print("capturing", flush=True)
        while not stop:
            try:
                frame = s.recv(65535)
            except socket.timeout:
                continue
            f.write(struct.pack(">I", len(frame)) + frame)


def streams(path) -> dict[tuple, bytes]:
    """{(src ip, src port, dst ip, dst port): that direction's TCP payload} of a capture."""
    data = open(path, "rb").read()
    out: dict[tuple, bytearray] = {}
    i = 0
    while i + 4 <= len(data):
        (n,) = struct.unpack(">I", data[i : i + 4])
        frame, i = data[i + 4 : i + 4 + n], i + 4 + n
        if len(frame) < 34 or frame[12:14] != b"\x08\x00" or frame[23] != 6:  # IPv4, TCP
            continue
        ip = frame[14:]
        ihl, total = (ip[0] & 0x0F) * 4, struct.unpack(">H", ip[2:4])[0]
        tcp = ip[ihl:total]
        sport, dport = struct.unpack(">HH", tcp[:4])
        payload = tcp[(tcp[12] >> 4) * 4 :]
        if payload:
            key = (socket.inet_ntoa(ip[12:16]), sport, socket.inet_ntoa(ip[16:20]), dport)
            out.setdefault(key, bytearray()).extend(payload)
    return {k: bytes(v) for k, v in out.items()}


if __name__ == "__main__":
    capture(sys.argv[1], sys.argv[2])
