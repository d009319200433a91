"""The columns a task reads from a row, named by RUN.toml's `[data]` section.

A missing column is the one data error whose fix is usually in RUN.toml rather than in the data, so the
message names the column, the row, and the columns the row does have.
"""

from __future__ import annotations

from typing import Any, Mapping

from govtrain.errors import Code, ConfigError

_SHOWN = 8


def require_columns(row: Mapping[str, Any], columns: tuple[str, ...], where: str) -> None:
    """Raise BAD_DATA at `where` (file:row) naming the first of `columns` that `row` lacks."""
    for column in columns:
        if column not in row:
            present = sorted(map(str, row))
            shown = ", ".join(repr(c) for c in present[:_SHOWN]) + (", …" if len(present) > _SHOWN else "")
            raise ConfigError(Code.BAD_DATA, f"{where}: no column {column!r} (the row has {shown or 'none'}); "
                                             "[data] in RUN.toml names the columns to read")
