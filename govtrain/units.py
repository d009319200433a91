"""Real numbers as integers, rounded in the direction that favours privacy (docs/design.md §2).

Signed and hashed structures carry no floats: a value x is stored as round(x · 10⁶)
(``*_u``) or, for δ, round(x · 10¹²) (``delta_p``). Which way to round depends on
what the number means, so every conversion names its direction.
"""

from __future__ import annotations

from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal, InvalidOperation
from typing import Literal, Union

MICRO = 10**6
PICO = 10**12

Number = Union[int, float, str, Decimal]
Direction = Literal["up", "down"]


def to_decimal(value: Number) -> Decimal:
    """Exact decimal of a user-supplied number; floats go through their shortest repr."""
    if isinstance(value, bool):
        raise TypeError("a boolean is not a number here")
    if isinstance(value, Decimal):
        result = value
    elif isinstance(value, int):
        result = Decimal(value)
    elif isinstance(value, float):
        result = Decimal(repr(value))
    elif isinstance(value, str):
        try:
            result = Decimal(value.strip())
        except InvalidOperation as e:
            raise ValueError(f"{value!r} is not a number") from e
    else:
        raise TypeError(f"expected a number, got {type(value).__name__}")
    if not result.is_finite():
        raise ValueError(f"{value!r} is not a finite number")
    return result


def _scale(value: Number, factor: int, direction: Direction) -> int:
    rounding = ROUND_CEILING if direction == "up" else ROUND_FLOOR
    return int((to_decimal(value) * factor).to_integral_value(rounding=rounding))


def to_micro(value: Number, direction: Direction) -> int:
    """x → integer micro-units, rounded `direction` ("up" or "down")."""
    return _scale(value, MICRO, direction)


def to_pico(value: Number, direction: Direction) -> int:
    return _scale(value, PICO, direction)


def clip_norm_u(value: Number) -> int:
    """Clipping norms round down: a smaller bound never weakens privacy."""
    return to_micro(value, "down")


def noise_multiplier_u(value: Number) -> int:
    """Noise multipliers round up: more noise never weakens privacy."""
    return to_micro(value, "up")


def eps_budget_u(value: Number) -> int:
    """Budgets (ceilings on spend) round down."""
    return to_micro(value, "down")


def spent_eps_u(value: Number) -> int:
    """Spent epsilon rounds up."""
    return to_micro(value, "up")


def delta_p(value: Number) -> int:
    """δ rounds down: the accountant then reports ε at a smaller δ, which is larger."""
    return to_pico(value, "down")


def from_micro(value_u: int) -> Decimal:
    return Decimal(value_u) / MICRO


def format_micro(value_u: int) -> str:
    """Human form of a micro-unit integer, without trailing zeros (1500000 → '1.5')."""
    text = format(from_micro(value_u), "f")
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return text
