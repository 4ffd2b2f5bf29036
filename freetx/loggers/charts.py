"""A histogram as the bytes of a PNG file, written with zlib alone (no plotting package)."""

from __future__ import annotations

import struct
import zlib


def histogram_png(counts: list[int], width: int = 480, height: int = 240) -> bytes:
    """A PNG of bars of `counts` (left to right), scaled to the tallest, on a white
    background with a grey baseline: enough to see the shape of a distribution at a glance."""
    bins = max(1, len(counts))
    top = max(max(counts, default=0), 1)
    margin = 10
    plot_w, plot_h = width - 2 * margin, height - 2 * margin
    rows = []
    for y in range(height):
        row = bytearray([0])  # PNG filter byte: none
        for x in range(width):
            color = (255, 255, 255)
            inside_x = margin <= x < margin + plot_w
            if inside_x and y == height - margin:
                color = (128, 128, 128)
            elif inside_x and margin <= y < height - margin:
                index = (x - margin) * bins // plot_w
                bar = counts[index] * plot_h // top if counts else 0
                if y >= height - margin - bar and (x - margin) % max(1, plot_w // bins) != 0:
                    color = (52, 101, 164)
            row += bytes(color)
        rows.append(bytes(row))

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header)
    png += chunk(b"IDAT", zlib.compress(b"".join(rows), 9)) + chunk(b"IEND", b"")
    return png
