"""TensorBoard event files written directly: scalars, and a resumed run's purge mark.

TensorBoard reads a run's `events.out.tfevents.*` files. Each is a series of
TFRecords: the length, its masked CRC-32C, the bytes, their masked CRC-32C.
Each record holds one serialised `tensorflow.Event`. The learner writes
nothing but scalars, so the few fields it needs are written here in
protobuf's wire format, as seedrl.codec writes the hot messages. Each log
interval is one Event holding every figure.

Why not a writer library: tensorboardX imports PyTorch whenever it is
installed, which costs every learner seconds of start-up and hundreds of MB.

The field numbers come from tensorflow/core/util/event.proto and
framework/summary.proto:
- Event: wall_time 1 (double), step 2 (int64), file_version 3, summary 5,
  session_log 7;
- SessionLog: status 1 (START = 1);
- Summary: value 1;
- Summary.Value: tag 1, simple_value 2 (float).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import struct
import time

import numpy as np

from seedrl.codec import varint

logger = logging.getLogger(__name__)

FILE_VERSION = b"brain.Event:2"
"""The version whose SessionLog START tells readers to drop the steps at and after it."""


def _crc32c_table() -> tuple[int, ...]:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), one byte at a time."""
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """TFRecord's checksum: the CRC rotated right by 15 bits plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def tfrecord(data: bytes) -> bytes:
    header = struct.pack("<Q", len(data))
    return b"".join(
        (
            header,
            struct.pack("<I", masked_crc32c(header)),
            data,
            struct.pack("<I", masked_crc32c(data)),
        )
    )


def _field(tag: int, payload: bytes) -> bytes:
    """A length-delimited field (a string or a message)."""
    return bytes((tag,)) + varint(len(payload)) + payload


def scalar_summary(values: dict[str, float]) -> bytes:
    """A serialised Summary with one simple_value per tag (float32, as TensorBoard keeps;
    beyond its range, infinite)."""
    with np.errstate(over="ignore"):
        singles = np.array(list(values.values()), "<f4")
    return b"".join(
        _field(0x0A, _field(0x0A, tag.encode()) + b"\x15" + single.tobytes())
        for tag, single in zip(values, singles, strict=True)
    )


def event(
    wall_time: float,
    step: int,
    *,
    file_version: bytes | None = None,
    summary: bytes | None = None,
    session_start: bool = False,
) -> bytes:
    """A serialised Event; ValueError for a step outside int64."""
    if not -(1 << 63) <= step < 1 << 63:
        raise ValueError(f"an event's step must fit in int64, got {step}")
    parts = [b"\x09" + struct.pack("<d", wall_time)]
    if step:
        parts.append(b"\x10" + varint(step if step > 0 else step + (1 << 64)))
    if file_version is not None:
        parts.append(_field(0x1A, file_version))
    if summary is not None:
        parts.append(_field(0x2A, summary))
    if session_start:
        parts.append(_field(0x3A, b"\x08\x01"))
    return b"".join(parts)


class EventFileWriter:
    """One new event file in `log_dir`, written and flushed on every call.

    A writer made with `purge_step` (a resumed run) marks a session start there:
    TensorBoard then drops what earlier files hold at and after that step, so the
    curves go on from the checkpoint instead of forking. A failed write (disk full)
    is logged once and ends the file, never the caller; a file that cannot be made
    raises OSError (Telemetry then goes on without TensorBoard).
    """

    def __init__(self, log_dir: str, purge_step: int | None = None):
        os.makedirs(log_dir, exist_ok=True)
        base = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}.{os.getpid():07d}"
        for attempt in itertools.count():
            # A new file every time (names sort in the order they were made).
            self.path = os.path.join(log_dir, base + (f".{attempt:03d}" if attempt else ""))
            try:
                self._file = open(self.path, "xb")  # noqa: SIM115 - closed by close()
                break
            except FileExistsError:
                continue
        now = time.time()
        header = [event(now, 0, file_version=FILE_VERSION)]
        if purge_step is not None:
            header.append(event(now, purge_step, session_start=True))
        self._write(header)

    @property
    def closed(self) -> bool:
        return self._file is None

    def add_scalars(self, values: dict[str, float], step: int, wall_time: float) -> None:
        """One Event at `step` holding every value; nothing when `values` is empty."""
        if values:
            self._write([event(wall_time, step, summary=scalar_summary(values))])

    def _write(self, events: list[bytes]) -> None:
        if self._file is None:
            return
        try:
            self._file.write(b"".join(tfrecord(data) for data in events))
            self._file.flush()
        except OSError:
            logger.exception("writing %s failed; TensorBoard gets no more from this run", self.path)
            self.close()

    def close(self) -> None:
        if self._file is None:
            return
        file, self._file = self._file, None
        # What a full disk left unflushed is lost already, and was logged.
        with contextlib.suppress(OSError):
            file.close()
