"""The run state on disk, `<output>/run-state.safetensors`: a format that cannot run code (issue 34, item 3).

The run state holds the sampling key and the noise state, and a resumed run trusts it; whoever can write the output
folder between a kill and the resume can put anything there. So it is read as data only, never unpickled:

- **one safetensors file**, written whole (`resume.write_whole`: 0600 from its creation, never through a link,
  renamed over the last one). Its tensors are named "0", "1", … in the order the state holds them; its metadata
  (safetensors' str → str header) holds exactly `format` (`FORMAT`), `state`: the state as canonical JSON in which
  every tensor is a reference `{"tensor": [n, dtype, shape]}` to tensor "n", and `mac`. One file, so it is replaced
  as a unit.
- **authenticated** (`state_key`): `mac` is HMAC-SHA256, under a key derived from the ledger's signing key, of the
  format, the state's text, the tensor table and the tensors' bytes (`_mac_parts`), checked before anything is
  decoded. Data only is not enough: the folder's writer could write any state this module writes, and a resumed run
  trusts its plan, step, key and consent; without the ledger key they cannot write one it accepts.
- **a small typed JSON** (`_encode`): null, booleans, text, integers and arrays as themselves; every other value as
  an object of one key naming its type: `{"float": repr}` (NaN and infinities included, exact), `{"bytes": hex}`,
  `{"tuple": [...]}`, `{"map": [[key, value], ...]}` (a dict, in its order; keys text, integers, bytes or tuples
  of them) and the tensor reference. Nothing else is written, and nothing else is read.
- **read strictly, and before reading, only our own file** (`read`): a link, anything but a regular file, a file not
  owned by this user or of a mode other than 0600 is refused (`run_state_unsafe`) before a byte is read; a header
  over safetensors' limit or a file of another length than its header declares, before the rest is read; so is a
  state of an earlier govtrain (`run-state.pt`, a pickle: `refuse_legacy`), which is never opened. A file whose JSON
  is not the canonical text of what it decodes to, with an unknown tag, a field the run state does not have
  (`FIELDS`) or one of the wrong type or range (a negative count, a plan without its keys), a tensor its reference
  does not declare (dtype, shape), or one no reference names, is refused (`run_state_invalid`).

A new field of the run state is added to `FIELDS` with its type (`ANY` for plain data checked where it is used).
"""

from __future__ import annotations

import hmac
import json
import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping

from govtrain.errors import Code, ConfigError
from govtrain.train.resume import write_whole
from govtrain.train.state_key import StateKey

if TYPE_CHECKING:
    import torch

STATE_FILE = "run-state.safetensors"
LEGACY_FILE = "run-state.pt"  # an earlier govtrain's run state: a pickle, refused unread
FORMAT = "govtrain.run-state/1"
_DEPTH = 64  # nesting the state never reaches (the optimizer's state is four deep)
_MODE = 0o600
HEADER_LIMIT = 100_000_000  # safetensors' own limit on a header's length

_Check = Callable[[Any], bool]


# -- the fields of a run state and their types ---------------------------------------------------------------------

def _exact(*types: type) -> _Check:
    return lambda value: type(value) in types


def _tensor(value: Any) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


def _list_of(item: _Check) -> _Check:
    return lambda value: type(value) is list and all(item(v) for v in value)


def _map_of(key: _Check, item: _Check) -> _Check:
    return lambda value: type(value) is dict and all(key(k) and item(v) for k, v in value.items())


def _tuple_of(*items: _Check) -> _Check:
    return lambda value: type(value) is tuple and len(value) == len(items) and all(c(v) for c, v in zip(items, value))


def _optional(inner: _Check) -> _Check:
    return lambda value: value is None or inner(value)


def _both(*checks: _Check) -> _Check:
    return lambda value: all(c(value) for c in checks)


def _record(**fields: _Check) -> _Check:
    """A map of exactly these text keys, each of its type."""
    return lambda value: type(value) is dict and set(value) == set(fields) and all(c(value[k]) for k, c in fields.items())


ANY: _Check = lambda value: True  # noqa: E731  plain data the encoding carries, checked where it is used
STR, INT, BOOL, BYTES = _exact(str), _exact(int), _exact(bool), _exact(bytes)
NUMBER = _exact(int, float)
COUNT = _both(INT, lambda value: value >= 0)  # a step, a count: never negative
POSITIVE = _both(NUMBER, lambda value: 0 < value < float("inf"))
MAP = _both(_exact(dict), lambda value: all(type(k) is str for k in value))

# The epoch planned (and maybe written ahead): `Run._plan_epoch`'s keys, then `lease.written_plan`'s values.
PENDING = _record(
    epoch=COUNT, first_step=COUNT, steps=COUNT, q_u=_both(INT, lambda value: value > 0), expected_batch=POSITIVE,
    allowed=_map_of(STR, COUNT), group_std=_map_of(_both(_exact(tuple), lambda v: all(type(c) is str for c in v)),
                                                   POSITIVE),
    noise_groups=ANY,  # written to the ledger as it is, whose spend rules check it
    spend=_list_of(_both(_exact(tuple, list), lambda v: len(v) == 4 and type(v[0]) is str
                         and all(type(n) is int and n >= 0 for n in v[1:]))),
    eps=_map_of(STR, _both(NUMBER, lambda value: value >= 0)), retiring=_list_of(STR), privatizer=MAP)

FIELDS: dict[str, _Check] = {
    "run_id": STR,
    "run_nonce": BYTES,  # the run's lease on its id
    "sampling_key": BYTES,  # secret: it fixes every step's draw
    "config_sha256": BYTES,
    "ledger": _tuple_of(STR, BYTES),  # `Ledger.identity`
    "confirmed": BOOL,
    "step": COUNT,
    "losses": _list_of(_exact(float)),  # NaN for a step that drew nothing
    "epochs": _list_of(INT),
    "eps_by_class": _map_of(STR, _list_of(NUMBER)),
    "pending": _optional(PENDING),  # the epoch planned (and maybe written ahead), checked against the ledger
    "trainable": _map_of(STR, _tensor),  # checked against the model (`resume.check_state_shapes`)
    "update": _exact(dict),  # the optimizer's (and PRISM's, Muon's) state: `Update.load_state_dict` checks it
    # the privatizer's record and state: `Privatizer.load_state` checks the state
    "noise": _optional(_record(privatizer=MAP, state=ANY)),
    "nonfinite": COUNT,  # the run's units whose gradient was not finite, (training.unsafe_stop_after_nonfinite_units)
    "corpus": _exact(dict),  # the corpus the units' identities name: `corpus.check` checks it on resume
    "schedule": _map_of(STR, _exact(str, int)),  # the learning rates' schedule: `Schedule.of_record` checks it
}

_DTYPES = ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8", "bool")


class _Invalid(Exception):
    """What is wrong with a state file's contents (`run_state_invalid`)."""


class _Unauthentic(_Invalid):
    """A state file whose MAC is not this ledger key's (`run_state_invalid`): nothing in it was decoded."""


# -- writing -----------------------------------------------------------------------------------------------------

def write(path: Path, state: Mapping[str, Any], key: StateKey) -> None:
    """Write the run `state` to `path`, whole (0600, never through a link), authenticated under `key` (the ledger's:
    `StateKey.of`). A state of other fields or types, or a value the encoding does not carry, is a programmer's
    mistake (TypeError), and nothing is written."""
    data = encode(state, key)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_whole(path, lambda handle: handle.write(data))


def encode(state: Mapping[str, Any], key: StateKey) -> bytes:
    """The bytes of the state file for `state`, its MAC under `key` in its metadata."""
    from safetensors.torch import save

    _check_fields(dict(state), TypeError)
    tensors: dict[str, "torch.Tensor"] = {}
    text = _canonical(_encode(dict(state), tensors, 0))
    body = save(tensors, metadata={"format": FORMAT, "state": text})
    size = int.from_bytes(body[:8], "little")
    header = json.loads(body[8:8 + size])
    data = body[8 + size:]
    header["__metadata__"]["mac"] = key.mac(_mac_parts(text, header, data)).hex()
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors' alignment of the data that follows
    return len(raw).to_bytes(8, "little") + raw + data


def _mac_parts(text: str, header: dict, data: bytes) -> list[bytes]:
    """What the MAC covers, as the reader finds it before decoding anything: the format, the state's JSON text (its
    run id, lease and ledger among it), the tensor table (names, dtypes, shapes, offsets) and the tensors' bytes."""
    table = {name: entry for name, entry in header.items() if name != "__metadata__"}
    return [FORMAT.encode(), text.encode(), _canonical(table).encode(), data]


def _canonical(tree: Any) -> str:
    return json.dumps(tree, ensure_ascii=False, allow_nan=False, sort_keys=True, separators=(",", ":"))


def _encode(value: Any, tensors: dict, depth: int) -> Any:
    if depth > _DEPTH:
        raise TypeError("the run state nests deeper than its format allows")
    kind = type(value)
    if value is None or kind in (bool, str, int):
        return value
    if kind is float:
        return {"float": repr(value)}
    if kind is bytes:
        return {"bytes": value.hex()}
    if kind is list:
        return [_encode(v, tensors, depth + 1) for v in value]
    if kind is tuple:
        return {"tuple": [_encode(v, tensors, depth + 1) for v in value]}
    if kind is dict:
        for key in value:
            if not _is_key(key):
                raise TypeError(f"a run state's map keys are text, integers, bytes or tuples of them, not {key!r}")
        return {"map": [[_encode(k, tensors, depth + 1), _encode(v, tensors, depth + 1)] for k, v in value.items()]}
    if _tensor(value):
        import torch

        name = str(value.dtype).removeprefix("torch.")
        if name not in _DTYPES:
            raise TypeError(f"a run state holds no {value.dtype} tensor")
        held = value.detach().to("cpu")
        if not (held.is_contiguous() and held.storage_offset() == 0
                and held.untyped_storage().nbytes() == held.numel() * held.element_size()):
            held = held.clone(memory_format=torch.contiguous_format)  # a view (PRISM's moments): its own bytes only
        index = len(tensors)
        tensors[str(index)] = held
        return {"tensor": [index, name, list(held.shape)]}
    raise TypeError(f"a run state holds no {kind.__name__} (only plain data, bytes and tensors)")


def _is_key(key: Any) -> bool:
    return type(key) in (str, int, bytes) or (type(key) is tuple and all(_is_key(k) for k in key))


# -- reading -----------------------------------------------------------------------------------------------------

def present(path: Path) -> bool:
    """Whether anything is at `path`, a link that leads nowhere included (it is refused, not taken for no state)."""
    return os.path.lexists(path)


def refuse_legacy(folder: Path) -> None:
    """Refuse (`run_state_unsafe`) an output `folder` holding an earlier govtrain's run state (`run-state.pt`): a
    pickle, which can run code when it is read. It is never opened."""
    path = Path(folder) / LEGACY_FILE
    if os.path.lexists(path):
        raise ConfigError(Code.RUN_STATE_UNSAFE, f"{path} is a run state of an earlier govtrain, in a format that can "
                                                 "run code when read (pickle): govtrain no longer reads it; finish "
                                                 "that run with the govtrain that wrote it, or move the file out of "
                                                 "training.output and start afresh (with another training.run_id)")


def read(path: Path, key: StateKey) -> dict | None:
    """The run state at `path` (None: no file there). Refused before a byte is read (`run_state_unsafe`) unless it
    is a regular file of this user's, mode 0600; refused (`run_state_invalid`) unless its header's length fits
    safetensors' limit and the file is exactly as long as its header declares (checked before the rest is read),
    its MAC is `key`'s (before anything in it is decoded), and its contents are exactly a state `write` writes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a link (O_NOFOLLOW)
        kind = "a link" if os.path.islink(path) else f"not readable ({e.strerror})"
        raise ConfigError(Code.RUN_STATE_UNSAFE, f"{path} is {kind}: a run state is a file govtrain wrote itself; "
                                                 "remove it, and restore the file the run saved") from None
    try:
        st = os.fstat(fd)
        _check_file(st, path)  # of the file opened: it cannot be swapped between the check and the read
    except BaseException:
        os.close(fd)
        raise
    try:
        with os.fdopen(fd, "rb") as handle:
            data = _read_bounded(handle, st.st_size)
        return decode(data, key)
    except _Unauthentic:
        raise ConfigError(Code.RUN_STATE_INVALID, f"{path} is not a run state written by this ledger's key (an edited "
                                                  "or planted state, one of another ledger, or written before the "
                                                  "ledger's key changed): restore the file the run saved, or move it "
                                                  "away") from None
    except _Invalid as e:
        raise ConfigError(Code.RUN_STATE_INVALID, f"{path} is not a run state govtrain wrote ({e}): it was edited, "
                                                  "or is another file; restore the file the run saved, or give this "
                                                  "run another training.output") from None


def _read_bounded(handle, size: int) -> bytes:  # type: ignore[no-untyped-def]
    """The file's bytes, read only once its 8-byte header length and its header say how long it is: a header over
    safetensors' limit, or a file longer or shorter than header and tensors, is `_Invalid` unread."""
    head = handle.read(8)
    if len(head) < 8:
        raise _Invalid("not a safetensors file")
    length = int.from_bytes(head, "little")
    if length > HEADER_LIMIT or length > size - 8:
        raise _Invalid(f"its header declares {length} bytes, over safetensors' limit or the file's size")
    raw = handle.read(length)
    header = _header(raw)
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if type(entry) is dict else None
        if type(offsets) is not list or len(offsets) != 2 or not all(type(n) is int and n >= 0 for n in offsets):
            raise _Invalid(f"tensor {name!r} has no data offsets")
        end = max(end, offsets[1])
    if size != 8 + length + end:
        raise _Invalid(f"it is {size} bytes long, and its header declares {8 + length + end}")
    rest = handle.read(end)
    if len(rest) != end:
        raise _Invalid("it was cut short while read")
    return head + raw + rest


def _header(raw: bytes) -> dict:
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_unique)
    except (ValueError, RecursionError) as e:
        raise _Invalid(f"its header is no JSON: {e}") from None
    if type(header) is not dict:
        raise _Invalid("its header is not a map")
    return header


def _check_file(st: os.stat_result, path: Path) -> None:
    problem = None
    if not stat.S_ISREG(st.st_mode):
        problem = "not a regular file"
    elif st.st_uid != os.geteuid():
        problem = f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    elif stat.S_IMODE(st.st_mode) != _MODE:
        problem = f"of mode {stat.S_IMODE(st.st_mode):04o}, not 0600"
    if problem is not None:
        raise ConfigError(Code.RUN_STATE_UNSAFE, f"{path} is {problem}: govtrain writes its run state 0600 and "
                                                 "reads only such a file of its own user; if it is the run's, make "
                                                 "it so (chown, chmod 600), else remove it")


def decode(data: bytes, key: StateKey) -> dict:
    """The run state in `data` (a state file's bytes); `_Unauthentic` unless its MAC is `key`'s, checked before any
    of its fields is decoded; `_Invalid` for anything else `encode` would not write."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    if len(data) < 8 or int.from_bytes(data[:8], "little") > min(len(data) - 8, HEADER_LIMIT):
        raise _Invalid("not a safetensors file")
    size = int.from_bytes(data[:8], "little")
    header = _header(data[8:8 + size])
    metadata = header.get("__metadata__")
    if type(metadata) is not dict or set(metadata) != {"format", "state", "mac"} or metadata["format"] != FORMAT \
            or type(metadata["state"]) is not str or type(metadata["mac"]) is not str:
        raise _Invalid(f"its metadata is not exactly format {FORMAT!r}, state and mac")
    try:
        tag = bytes.fromhex(metadata["mac"])
    except ValueError:
        tag = b""
    # 1. authenticate the bytes as read, before any of them is decoded (safetensors' tensors included)
    if not hmac.compare_digest(key.mac(_mac_parts(metadata["state"], header, data[8 + size:])), tag):
        raise _Unauthentic()
    # 2. decode what the ledger's key vouches for, as strictly as before
    try:
        tensors = load(bytes(data))
    except (SafetensorError, ValueError, TypeError) as e:
        raise _Invalid(f"its tensors do not read: {e}") from None
    text = metadata["state"]
    try:
        tree = json.loads(text, object_pairs_hook=_unique, parse_float=_no_float, parse_constant=_no_float)
    except (ValueError, RecursionError) as e:
        raise _Invalid(f"its state is no JSON: {e}") from None
    if _canonical(tree) != text:
        raise _Invalid("its state is not in canonical JSON")
    used: list[str] = []
    state = _decode(tree, tensors, used, 0)
    if used != [str(i) for i in range(len(tensors))]:
        raise _Invalid(f"it holds {len(tensors)} tensors, and its state names {len(used)}")
    if type(state) is not dict:
        raise _Invalid("its state is not a map")
    _check_fields(state, _Invalid)
    return state


def _unique(pairs: list[tuple[str, Any]]) -> dict:
    found = dict(pairs)
    if len(found) != len(pairs):
        raise ValueError("a key appears twice")
    return found


def _no_float(text: str) -> Any:
    raise ValueError(f"a bare number {text} (a run state's floats are tagged)")


def _decode(tree: Any, tensors: Mapping[str, "torch.Tensor"], used: list[str], depth: int) -> Any:
    if depth > _DEPTH:
        raise _Invalid("its state nests too deep")
    if tree is None or type(tree) in (bool, str, int):
        return tree
    if type(tree) is list:
        return [_decode(v, tensors, used, depth + 1) for v in tree]
    if type(tree) is not dict or len(tree) != 1:
        raise _Invalid("a value of its state is not one of its types")
    (tag, body), = tree.items()
    if tag == "float" and type(body) is str:
        try:
            value = float(body)
        except ValueError:
            value = None
        if value is None or repr(value) != body:
            raise _Invalid(f"{body!r} is not a float as repr writes it")
        return value
    if tag == "bytes" and type(body) is str:
        try:
            value = bytes.fromhex(body)
        except ValueError:
            value = None
        if value is None or value.hex() != body:
            raise _Invalid("a bytes value that is not lowercase hex")
        return value
    if tag == "tuple" and type(body) is list:
        return tuple(_decode(v, tensors, used, depth + 1) for v in body)
    if tag == "map" and type(body) is list:
        found: dict = {}
        for pair in body:
            if type(pair) is not list or len(pair) != 2:
                raise _Invalid("a map entry that is not a [key, value] pair")
            key = _decode(pair[0], tensors, used, depth + 1)
            if not _is_key(key) or key in found:
                raise _Invalid(f"a map key that is not text, an integer, bytes or a tuple of them, or repeated: "
                               f"{key!r}")
            found[key] = _decode(pair[1], tensors, used, depth + 1)
        return found
    if tag == "tensor" and type(body) is list and len(body) == 3:
        return _tensor_at(body, tensors, used)
    raise _Invalid(f"an unknown tag {tag!r}, or one whose value is of the wrong type")


def _tensor_at(body: list, tensors: Mapping[str, "torch.Tensor"], used: list[str]) -> "torch.Tensor":
    index, dtype, shape = body
    name = str(index) if type(index) is int else None
    if name != str(len(used)) or name not in tensors:
        raise _Invalid(f"a tensor reference {index!r} out of order, or to no tensor")
    if type(dtype) is not str or dtype not in _DTYPES or type(shape) is not list \
            or not all(type(n) is int and n >= 0 for n in shape):
        raise _Invalid(f"tensor {name}: a declared dtype or shape that is none")
    tensor = tensors[name]
    if str(tensor.dtype) != f"torch.{dtype}" or list(tensor.shape) != shape:
        raise _Invalid(f"tensor {name} is {tensor.dtype} {list(tensor.shape)}, its reference declares {dtype} {shape}")
    used.append(name)
    return tensor


def _check_fields(state: dict, error: type[Exception]) -> None:
    unknown, missing = sorted(set(state) - set(FIELDS), key=str), sorted(set(FIELDS) - set(state))
    if unknown or missing:
        raise error(f"fields {unknown} that a run state does not have" if unknown else f"no fields {missing}")
    wrong = [name for name, check in FIELDS.items() if not check(state[name])]
    if wrong:
        raise error(f"fields {wrong} not of their types")


__all__ = ["STATE_FILE", "LEGACY_FILE", "FORMAT", "FIELDS", "write", "encode", "read", "decode", "present",
           "refuse_legacy"]
