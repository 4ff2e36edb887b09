"""The buffer CSV that offset-packing solvers share: one buffer per row,
``id,lower,upper,size`` with half-open lifetimes [lower, upper). MiniMalloc's
benchmark files name the columns ``buffer,start,end,size`` and read ``end``
as the last step a buffer is live (its reader, ``src/converter.cc``, adds
one): so ``a,0,5,4`` and ``b,5,9,4`` are both live at 5 there, and here too.
Both forms are read, and a packing is written back in the form and under
the names it was read with, plus an ``offset`` column."""
from __future__ import annotations

import csv
import io
from dataclasses import dataclass

from ..graph import read_bytes
from .offsets import Buffer

COLUMNS = ("id", "lower", "upper", "size")
ALIASES = {"buffer": "id", "start": "lower", "end": "upper"}


@dataclass
class BufferTable:
    buffers: list[Buffer]
    header: list[str]  # the file's names for id, lower, upper, size


def read_buffer_csv(path: str) -> BufferTable:
    """Raises OSError if the file cannot be read and ValueError, naming the
    problem and the fix, if it is not a buffer CSV."""
    raw = read_bytes(path, ValueError)
    try:
        rows = list(csv.reader(io.StringIO(raw.decode("utf-8-sig"), newline="")))
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not a text CSV ({e}): it needs columns id,lower,upper,size") from None
    except csv.Error as e:
        raise ValueError(f"{path} is not a buffer CSV ({e}): it needs columns id,lower,upper,size") from None
    if not rows:
        raise ValueError(f"{path} is empty: it needs a header with columns id,lower,upper,size")
    names = [c.strip() for c in rows[0]]
    where = {}
    for k, name in enumerate(names):
        where.setdefault(ALIASES.get(name, name), k)
    missing = [c for c in COLUMNS if c not in where]
    if missing:
        raise ValueError(f"{path} needs a header with columns id,lower,upper,size (half-open "
                         "lifetimes [lower, upper)); MiniMalloc's buffer,start,end,size also "
                         f"works. Missing: {', '.join(missing)}")
    inclusive = names[where["upper"]] == "end"  # MiniMalloc's: end is the last live step
    buffers = []
    for line, row in enumerate(rows[1:], start=2):
        if not any(cell.strip() for cell in row):
            continue
        try:
            bid, lower, upper, size = (row[where[c]].strip() for c in COLUMNS)
            buffers.append(Buffer(bid, int(lower), int(upper) + inclusive, int(size)))
        except IndexError:
            raise ValueError(f"{path}, line {line}: expected {len(names)} columns, got {len(row)}")
        except ValueError as e:
            raise ValueError(f"{path}, line {line}: lower, upper and size must be integers ({e})")
    if not buffers:
        raise ValueError(f"{path} has a header but no buffers")
    return BufferTable(buffers, [names[where[c]] for c in COLUMNS])


def write_buffer_csv(out, table: BufferTable, offsets: dict) -> None:
    w = csv.writer(out, lineterminator="\n")
    w.writerow([*table.header, "offset"])
    inclusive = table.header[2] == "end"
    for b in table.buffers:
        w.writerow([b.id, b.lower, b.upper - inclusive, b.size, offsets[b.id]])
