"""Random byte-level mutations of a file's bytes, aimed mostly at the fields a parser reads.

Runs in: the fuzzing parent process.

Operators (AFL's classic set): bit flips, byte replacement (random or boundary values), integer
overwrite with boundary values (u32/u64 at a field start), chunk deletion, chunk duplication,
random-byte insertion and truncation. Positions are drawn from the scanned layout: mostly the
starts of structural fields (counts, lengths, type ids, dims, offsets), sometimes array elements
(vocabulary strings, scores), sometimes anywhere in the mutable region.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable

from powerinfer.devtools.fuzz.gguf_layout import Layout

INTERESTING_U32 = (0, 1, 2, 3, 4, 5, 7, 8, 13, 16, 24, 26, 31, 32, 33, 63, 64, 255, 256, 1023, 4096, 0x7FFF, 0x8000,
                   0xFFFF, 0x10000, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF)
INTERESTING_U64 = (*INTERESTING_U32, 2**32, 2**32 + 1, 2**40, 2**48, 2**56, 2**62, 2**63 - 1, 2**63, 2**63 + 1,
                   2**64 - 2, 2**64 - 1)
INTERESTING_BYTES = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0x20, 0x0A, 0xC0, 0xED, 0xF4)

OPERATORS = ("bitflip", "byte_set", "int_set", "delete_chunk", "dup_chunk", "insert_random", "truncate")


class Mutator:
    """Applies random operators to a bytearray; ``limit`` bounds the region positions come from."""

    def __init__(self, rng: random.Random, layout: Layout, limit: int, structural_bias: float) -> None:
        self.rng = rng
        self.fields = [p for p in layout.fields if p < limit]
        self.elements = [p for p in layout.elements if p < limit]
        self.limit = limit
        self.bias = structural_bias
        self._ops: dict[str, Callable[[bytearray], None]] = {
            "bitflip": self.bitflip, "byte_set": self.byte_set, "int_set": self.int_set,
            "delete_chunk": self.delete_chunk, "dup_chunk": self.dup_chunk,
            "insert_random": self.insert_random, "truncate": self.truncate,
        }

    def position(self, buf: bytearray) -> int:
        """A position inside the buffer: a field start (often), an array element, or anywhere."""
        r = self.rng.random()
        end = min(len(buf), self.limit)
        if end <= 0:
            return 0
        if r < self.bias and self.fields:
            pos = self.rng.choice(self.fields) + self.rng.choice((0, 0, 0, 1, 2, 3, 4, 7))
        elif r < self.bias + (1 - self.bias) / 2 and self.elements:
            pos = self.rng.choice(self.elements) + self.rng.randrange(4)
        else:
            pos = self.rng.randrange(end)
        return min(pos, end - 1)

    def _chunk_len(self) -> int:
        return self.rng.choice((1, 2, 4, 8, 8, 12, 16, 24, 64, self.rng.randrange(1, 4097)))

    def bitflip(self, buf: bytearray) -> None:
        pos = self.position(buf)
        for _ in range(self.rng.choice((1, 1, 2, 4))):
            at = min(len(buf) - 1, pos + self.rng.randrange(4))
            buf[at] ^= 1 << self.rng.randrange(8)

    def byte_set(self, buf: bytearray) -> None:
        pos = self.position(buf)
        for k in range(self.rng.choice((1, 1, 2, 3, 8))):
            if pos + k < len(buf):
                buf[pos + k] = self.rng.choice(INTERESTING_BYTES) if self.rng.random() < 0.5 else self.rng.randrange(256)

    def int_set(self, buf: bytearray) -> None:
        pos = self.position(buf)
        wide = self.rng.random() < 0.5
        values = INTERESTING_U64 if wide else INTERESTING_U32
        value = self.rng.choice(values)
        if self.rng.random() < 0.2:  # near the sizes that bounds checks compare against
            value = max(0, len(buf) - pos + self.rng.randrange(-8, 9))
        fmt = "<Q" if wide else "<I"
        raw = struct.pack(fmt, value % (2**64 if wide else 2**32))
        buf[pos : pos + len(raw)] = raw[: max(0, len(buf) - pos)]

    def delete_chunk(self, buf: bytearray) -> None:
        pos = self.position(buf)
        del buf[pos : pos + self._chunk_len()]

    def dup_chunk(self, buf: bytearray) -> None:
        pos = self.position(buf)
        chunk = bytes(buf[pos : pos + self._chunk_len()])
        at = self.position(buf)
        buf[at:at] = chunk

    def insert_random(self, buf: bytearray) -> None:
        pos = self.position(buf)
        buf[pos:pos] = self.rng.randbytes(self.rng.choice((1, 4, 8, 16, 100)))

    def truncate(self, buf: bytearray) -> None:
        del buf[self.position(buf):]

    def mutate(self, buf: bytearray, n_ops: int) -> list[str]:
        """Apply ``n_ops`` random operators (truncation at most once, last); returns their names."""
        done: list[str] = []
        for i in range(n_ops):
            if not buf:
                break
            name = self.rng.choice(OPERATORS[:-1] if i < n_ops - 1 else OPERATORS)
            self._ops[name](buf)
            done.append(name)
        return done
