"""The compact answer: what ``opsd-rollout serve-teacher`` sends our client instead of vLLM's JSON, the
log-probabilities of the response positions only, as packed little-endian arrays at the host cache's own dtypes.
The server packs (``pack``), the client reads (``read``); both check log-probabilities with ``check_logprobs``, which
the JSON readers (``opsd.served_wire``) use too.

Negotiated, so a vLLM or SGLang server is never sent what it cannot read: our server lists
``"compact_answer_version": VERSION`` in its ``/v1/models`` card (no other server has the field), and only then does
the client ask, with ``Accept: application/vnd.opsd-rollout.logprobs; version=1`` on vLLM's ``POST /v1/completions``
and two fields of ours in the body: ``prompt_logprobs_start`` (per prompt, the first position answered, >= 1) and
``prompt_logprobs_dtype`` (``float32``, ``bfloat16`` or ``float16``). A client and a server of different versions
refuse each other in one line: the client at connect time (the card's version is not its own), the server with
HTTP 406 (the ``Accept`` header's version is not its own).

The body (``Content-Type: application/vnd.opsd-rollout.logprobs; version=1``), little-endian throughout:

- a 24-byte header: ``b"OPLP"``; version (uint16); the values' dtype code (uint8: 1 float32, 2 bfloat16,
  3 float16); the ids' dtype code (uint8: 0 none, with k = 0; 1 int32); k (uint32: 0 asks the given token's
  log-probability only); rows (uint32); N, the positions answered over all rows (uint64);
- a row table, per row: the positions answered (uint32, the row's length minus its start) and the CRC-32 of the
  row's token ids as sent (uint32, over them as little-endian int32), so a row answered for another is refused;
- the ids, ``[N, k]`` int32 (most likely first; absent when k = 0), rows one after another in the order sent;
- the values, ``[N, max(k, 1)]`` in the values' dtype: the top-k log-probabilities, or with k = 0 the given token's.

A position p of a row (p >= 1) holds the log-probability of its token p given tokens 0..p-1, as in vLLM's
``prompt_logprobs``. The client reads the arrays with one ``torch.frombuffer`` each, checks them whole (sizes,
versions, dtypes, rows, finite log-probabilities <= 0, ids in the vocabulary, the top-k in order; each failure a
``ValueError`` naming the field) and copies each row's slice into the host cache, no Python object per value.
"""

from __future__ import annotations

import bisect
import itertools
import struct
import sys
import zlib
from collections.abc import Callable

import numpy as np
import torch

MEDIA_TYPE = "application/vnd.opsd-rollout.logprobs"
VERSION = 1
"""The compact answer's version: a change to its layout or meaning is a new version."""
MAGIC = b"OPLP"
HEADER = struct.Struct("<4sHBBIIQ")
"""magic, version, values' dtype code, ids' dtype code, k, rows, positions."""
ROW = 8
"""Bytes a row takes in the row table: positions answered and CRC-32, uint32 each."""
VALUE_DTYPES = {1: ("float32", torch.float32), 2: ("bfloat16", torch.bfloat16), 3: ("float16", torch.float16)}
VALUE_CODES = {name: code for code, (name, _) in VALUE_DTYPES.items()}
ID_DTYPES = {0: "none", 1: "int32"}
LOGPROB_SLACK = 1e-4
"""How far above 0 a log-probability may be (rounding) before it is refused as not one."""


def check_logprobs(values: torch.Tensor, where: Callable[[int], str]) -> None:
    """Refuse what is not a log-probability in ``values`` [n, ...] (any float dtype): NaN, infinite, or above 0 past
    rounding; ``where(i)`` names the field of ``values[i]`` for the first such. One rule for every way an answer
    comes: vLLM's and SGLang's JSON (``opsd.served_wire``), the compact answer, and the server's own answer before
    it is sent."""
    bad = ~(torch.isfinite(values) & (values <= LOGPROB_SLACK))
    if bool(bad.any()):
        flat = bad.reshape(len(values), -1)
        first = int(flat.any(1).nonzero()[0])
        value = float(values[first].reshape(-1)[flat[first]][0])
        raise ValueError(f"the teacher's response has {where(first)} logprob {value!r}: expected a finite "
                         "log-probability <= 0")


def check_top_order(values: torch.Tensor, where: Callable[[int], str]) -> None:
    """Refuse a top-k ``values`` [n, k] whose row is not most likely first (past rounding), naming the first such
    with ``where(i)``."""
    if values.shape[-1] < 2:
        return
    disorder = (values[:, 1:].float() > values[:, :-1].float() + LOGPROB_SLACK).any(1)
    if bool(disorder.any()):
        raise ValueError(f"the teacher's response has {where(int(disorder.nonzero()[0]))}'s top {values.shape[-1]} "
                         "out of order (most likely first)")


def content_type(version: int = VERSION) -> str:
    return f"{MEDIA_TYPE}; version={version}"


def asked_version(accept: str) -> int | None:
    """The compact answer's version an ``Accept`` header asks for; ``None`` when it does not name the compact
    answer (a vLLM client's request). A ``ValueError`` for our media type without a version number."""
    for media_range in accept.split(","):
        kind, *parameters = (part.strip() for part in media_range.split(";"))
        if kind.lower() != MEDIA_TYPE:
            continue
        named = dict(parameter.partition("=")[::2] for parameter in parameters)
        version = named.get("version", "").strip().strip('"')
        if not version.isdigit():
            raise ValueError(f"the Accept header names {MEDIA_TYPE} without a version number: {accept[:120]!r} "
                             f"(expected '{content_type()}')")
        return int(version)
    return None


def value_dtype(dtype: torch.dtype) -> str:
    """The values' dtype to ask for a cache stored in ``dtype``: its own when the wire has it, else float32 (the
    client converts as it copies)."""
    return next((name for name, kind in VALUE_DTYPES.values() if kind == dtype), "float32")


def row_crc(row: list[int]) -> int:
    return zlib.crc32(np.asarray(row, dtype="<i4").tobytes())


def _little_endian() -> None:
    if sys.byteorder != "little":  # the arrays go out and come in as this host's memory holds them
        raise RuntimeError("the compact answer is little-endian, and this host is not")


def pack(rows: list[list[int]], counts: list[int], k: int, dtype: str, values: torch.Tensor,
         ids: torch.Tensor | None) -> bytes:
    """The body answering ``rows``: ``counts[i]`` positions of row i, their ``values`` [N, max(k, 1)] (log-
    probabilities, any float dtype, on any device: cast to ``dtype`` here) and ``ids`` [N, k] (``None`` when k is
    0)."""
    _little_endian()
    positions = sum(counts)
    width = max(k, 1)
    if values.shape != (positions, width) or (ids is None) != (k == 0) or \
            (ids is not None and ids.shape != (positions, k)):
        raise ValueError(f"pack: values {tuple(values.shape)} and ids {None if ids is None else tuple(ids.shape)} "
                         f"do not hold {positions} positions x k={k}")
    table = np.asarray([[count, row_crc(row)] for count, row in zip(counts, rows)], dtype="<u4")
    parts = [HEADER.pack(MAGIC, VERSION, VALUE_CODES[dtype], 0 if k == 0 else 1, k, len(rows), positions),
             table.tobytes()]
    if ids is not None:
        parts.append(ids.to("cpu", torch.int32).contiguous().numpy().tobytes())
    wire = VALUE_DTYPES[VALUE_CODES[dtype]][1]
    values = values.to("cpu", wire).contiguous()  # numpy has no bfloat16: its bytes go out as int16
    parts.append(values.view(torch.int16 if wire.itemsize == 2 else torch.int32).numpy().tobytes())
    return b"".join(parts)


class CompactError(ValueError):
    """A compact answer refused: what is wrong with it, named."""

    def __init__(self, problem: str):
        super().__init__(f"the teacher's compact answer {problem}")


def read(body: bytearray, rows: list[list[int]], positions: list[list[int]], k: int, dtype: str,
         vocab_size: int | None) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each row's ``(values, ids)`` at its wanted ``positions`` (indices into the row sent; the first is where its
    answer starts): values [n] (k = 0) or [n, k], ids [n, k] or ``None``; views of ``body`` where the positions
    are consecutive. Everything checked first: a ``CompactError`` names what is wrong."""
    _little_endian()
    total, wire = _checked_header(body, len(rows), k, dtype)
    starts = _checked_rows(body, rows, positions, total)
    ids_at = HEADER.size + ROW * len(rows)
    values = torch.frombuffer(body, dtype=wire, count=total * max(k, 1), offset=ids_at + 4 * total * k)
    values = values.view(total, max(k, 1))  # [N, max(k, 1)]
    ids = torch.frombuffer(body, dtype=torch.int32, count=total * k, offset=ids_at).view(total, k) if k else None

    def where(array: str) -> Callable[[int], str]:
        def named(flat: int) -> str:  # an answer's flat position -> its row and its position in the row
            row = bisect.bisect_right(starts, flat) - 1
            return f"{array}[row {row}, position {positions[row][0] + flat - starts[row]}]"
        return named

    check_logprobs(values, where("values"))
    if ids is not None:
        outside = (ids < 0) | (ids >= vocab_size) if vocab_size is not None else ids < 0
        if bool(outside.any()):
            flat = int(outside.any(1).nonzero()[0])
            raise CompactError(f"has token id {int(ids[flat][outside[flat]][0])} at {where('ids')(flat)}, outside "
                               f"the vocabulary [0, {vocab_size})")
        check_top_order(values, where("values"))
    return [_pick(values, ids, start, wanted) for start, wanted in zip(starts, positions)]


def _checked_header(body: bytearray, rows: int, k: int, dtype: str) -> tuple[int, torch.dtype]:
    """The positions answered and the values' dtype, once the header is the one asked for and the body its size."""
    if len(body) < HEADER.size:
        raise CompactError(f"is {len(body)} bytes, shorter than its {HEADER.size}-byte header (truncated)")
    magic, version, value_code, id_code, got_k, got_rows, total = HEADER.unpack_from(body)
    if magic != MAGIC:
        raise CompactError(f"starts with {bytes(body[:4])!r}, not {MAGIC!r}: not a compact answer")
    if version != VERSION:
        raise CompactError(f"is version {version}, and this client reads version {VERSION}: run the same "
                           "opsd-rollout release as serve-teacher")
    if value_code not in VALUE_DTYPES:
        raise CompactError(f"has values' dtype code {value_code}: expected one of "
                           + ", ".join(f"{code} ({name})" for code, (name, _) in VALUE_DTYPES.items()))
    name, wire = VALUE_DTYPES[value_code]
    if name != dtype:
        raise CompactError(f"has values in {name}: {dtype} was asked")
    if id_code != (0 if k == 0 else 1):
        raise CompactError(f"has ids' dtype code {id_code} ({ID_DTYPES.get(id_code, 'unknown')}): expected "
                           f"{0 if k == 0 else 1} for k={k}")
    if got_k != k or got_rows != rows:
        raise CompactError(f"answers k={got_k} for {got_rows} rows: k={k} for {rows} rows were asked")
    expected = HEADER.size + ROW * rows + total * (4 * k + wire.itemsize * max(k, 1))
    if len(body) != expected:
        raise CompactError(f"is {len(body):,} bytes and its header describes {expected:,} ({total:,} positions, "
                           f"k={k}, {dtype}): {'truncated' if len(body) < expected else 'bytes past its end'}")
    return total, wire


def _checked_rows(body: bytearray, rows: list[list[int]], positions: list[list[int]], total: int) -> list[int]:
    """Where each row's positions start among the answer's, once the row table says each row is the one sent,
    answered from its first wanted position on."""
    table = np.frombuffer(body, dtype="<u4", count=2 * len(rows), offset=HEADER.size).reshape(-1, 2).tolist()
    for index, (row, wanted, (count, crc)) in enumerate(zip(rows, positions, table)):
        if count != len(row) - wanted[0]:
            raise CompactError(f"answers {count} positions of row {index}: {len(row) - wanted[0]} were asked "
                               f"(positions {wanted[0]}..{len(row) - 1})")
        if crc != row_crc(row):
            raise CompactError(f"has row {index} for other tokens than the ones sent (CRC-32 {crc:08x}, "
                               f"{row_crc(row):08x} sent): out of order or altered")
    starts = [0, *itertools.accumulate(count for count, _ in table)]
    if starts[-1] != total:
        raise CompactError(f"has {total} positions in its header and {starts[-1]} in its rows")
    return starts[:-1]


def _pick(values: torch.Tensor, ids: torch.Tensor | None, start: int,
          wanted: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One row's answer at its wanted positions: a slice when they are consecutive (a response without holes),
    else gathered."""
    first, count = wanted[0], len(wanted)
    if wanted[-1] - first + 1 == count:
        picked = slice(start, start + count)
    else:
        picked = torch.tensor(wanted) - first + start
    row_values = values[picked]
    return (row_values.squeeze(1) if ids is None else row_values), None if ids is None else ids[picked]
