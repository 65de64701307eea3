"""A minimal PNG line chart (no plotting library): series of (x, y) points drawn as lines on a
white canvas with light grid lines. Enough to see RSS grow or stay flat; the numbers
themselves are printed next to it by the benchmark."""

from __future__ import annotations

import struct
import zlib

PALETTE = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189),
           (140, 86, 75), (227, 119, 194), (127, 127, 127), (188, 189, 34), (23, 190, 207)]


def line_chart(path: str, series: list[list[tuple[float, float]]], width: int = 800,
               height: int = 400) -> None:
    pixels = bytearray([255] * (width * height * 3))
    points = [p for s in series for p in s]
    if not points:
        points = [(0.0, 0.0), (1.0, 1.0)]
    x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
    y1 = max(p[1] for p in points) * 1.1 or 1.0
    x1 = x1 if x1 > x0 else x0 + 1

    def put(x: int, y: int, color: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            i = (y * width + x) * 3
            pixels[i : i + 3] = bytes(color)

    for k in range(1, 5):  # horizontal grid at quarters of the y range
        for x in range(width):
            put(x, height - 1 - int(k * (height - 1) / 5), (225, 225, 225))
    for n, s in enumerate(series):
        color = PALETTE[n % len(PALETTE)]
        coords = [(int((x - x0) / (x1 - x0) * (width - 1)),
                   height - 1 - int(y / y1 * (height - 1))) for x, y in s]
        for (ax, ay), (bx, by) in zip(coords, coords[1:], strict=False):
            steps = max(abs(bx - ax), abs(by - ay), 1)
            for t in range(steps + 1):
                put(ax + (bx - ax) * t // steps, ay + (by - ay) * t // steps, color)
    raw = b"".join(b"\x00" + bytes(pixels[y * width * 3 : (y + 1) * width * 3])
                   for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8,
                                                                  2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
