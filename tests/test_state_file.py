"""The run state's file format (`govtrain/train/state_file.py`): everything a run state holds comes back exactly
(bfloat16 and float64 tensors, NaN losses, int-keyed optimizer state, tuple keys, bytes), and anything
`state_file.write` would not write is refused (`_Invalid`, `run_state_invalid`). The attacks through `govtrain train`:
tests/test_attacks_run_state.py."""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from safetensors.torch import load, save  # noqa: E402

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey  # noqa: E402

from govtrain.errors import Code, ConfigError  # noqa: E402
from govtrain.train import state_file  # noqa: E402
from govtrain.train.state_file import FORMAT, _Invalid, _mac_parts, _Unauthentic  # noqa: E402
from govtrain.train.state_key import StateKey  # noqa: E402

LEDGER = ("test.invalid/govtrain/1", b"h" * 32)
KEY = StateKey.derive(Ed25519PrivateKey.from_private_bytes(bytes(range(32))), LEDGER)  # the ledger's, in these tests


def encode(state: dict, key: StateKey = KEY) -> bytes:
    return state_file.encode(state, key)


def decode(data: bytes, key: StateKey = KEY) -> dict:
    return state_file.decode(data, key)


def _state() -> dict:
    """A run state with every kind of value a run's holds: an AdamW state after one step (int keys, a tensor step,
    tuple betas, None), a PRISM-like moment that is a view into a larger tensor, a correlated privatizer's float64
    buffers and uint8 key, a pending plan with tuple keys and tuples, a NaN loss and a negative zero."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(3, 2, dtype=torch.float64, generator=generator))
    optimizer = torch.optim.AdamW([weight], lr=0.01)
    weight.grad = torch.ones_like(weight)
    optimizer.step()
    stacked = torch.arange(12.0).view(3, 4)
    return {
        "run_id": "run-1", "run_nonce": bytes(range(16)), "sampling_key": b"\xff" * 32, "config_sha256": b"c" * 32,
        "ledger": ("test.invalid/govtrain/1", b"h" * 32), "confirmed": True, "step": 3,
        "losses": [0.5, float("nan"), -0.0, 1e-310, float("inf")], "epochs": [0, 1],
        "eps_by_class": {"public": [0.25, 1.5], "sensitive": [2]},
        "pending": {"epoch": 2, "first_step": 3, "steps": 4, "q_u": 250_000, "expected_batch": 12.5,
                    "group_std": {("public", "sensitive"): 1.25}, "spend": [("c1", 4, 2_000_000, 7)],
                    "allowed": {"c1": 4}, "noise_groups": [{"classes": ["public"], "s_pu": 10**12}],
                    "eps": {"public": 7}, "privatizer": {"name": "banded-mf", "bands": 3}, "retiring": []},
        "trainable": {"lora_A": torch.randn(2, 4, generator=generator).to(torch.bfloat16), "lora_B": torch.zeros(4, 2)},
        "update": {"mechanism": "prism", "optimizer": optimizer.state_dict(),
                   "prism": {"state": {"layer.0": {"step": 1, "m": stacked[1], "v": stacked[2]}}}, "muon": None},
        "noise": {"privatizer": {"name": "banded-mf", "bands": 3},
                  "state": {"key": torch.arange(32, dtype=torch.uint8), "step": 3,
                            "dtypes": {"w": "torch.float32"},
                            "buffers": {"w": torch.randn(3, 2, 2, dtype=torch.float64, generator=generator)}}},
        "nonfinite": 2, "schedule": {"kind": "cosine", "warmup": 2},
        "corpus": {"unit": "example", "contributions": {"c1": {"data_sha256": "ab" * 32, "rows": 4,
                                                               "rows_sha256": "cd" * 32}}},
    }


def _bytes(tensor) -> bytes:  # type: ignore[no-untyped-def]
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())


def _same(a, b) -> bool:  # type: ignore[no-untyped-def]
    """Equal values of equal types, tensors bit for bit (NaN is NaN, -0.0 is not 0.0)."""
    if type(a) is not type(b) and not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and _bytes(a) == _bytes(b)
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _parts(data: bytes) -> tuple[dict, list]:
    """A state file's tensors and its state's JSON tree."""
    size = int.from_bytes(data[:8], "little")
    metadata = json.loads(data[8:8 + size])["__metadata__"]
    return load(data), json.loads(metadata["state"])


def _file(tensors: dict, tree, *, text: str | None = None, metadata: dict | None = None,
          key: StateKey | None = KEY) -> bytes:
    """A state file of these tensors and this JSON tree (as canonical text, unless `text`), with the MAC of `key` (the
    ledger's: so a tampered file reaches the check after the MAC, as one its key's holder wrote would)."""
    if text is None:
        text = json.dumps(tree, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
    body = save(tensors, metadata=metadata if metadata is not None else {"format": FORMAT, "state": text})
    if key is None:
        return body
    return _sealed(body, key)


def _sealed(body: bytes, key: StateKey, *, edit=lambda header: None) -> bytes:  # type: ignore[no-untyped-def]
    """`body` (a safetensors file) with a "mac" in its metadata: `key`'s MAC of it after `edit(header)`."""
    size = int.from_bytes(body[:8], "little")
    header, data = json.loads(body[8:8 + size]), body[8 + size:]
    edit(header)
    header["__metadata__"]["mac"] = key.mac(_mac_parts(header["__metadata__"]["state"], header, data)).hex()
    raw = json.dumps(header).encode()
    return len(raw).to_bytes(8, "little") + raw + data


def _field(tree, name: str):  # type: ignore[no-untyped-def]
    """The [key, value] pair of top-level field `name` in a state's JSON tree."""
    return next(pair for pair in tree["map"] if pair[0] == name)


# -- what it holds comes back exactly ------------------------------------------------------------------------------

def test_a_run_state_comes_back_exactly_and_resumes_an_optimizer_bit_for_bit():
    state = _state()
    back = decode(encode(state))
    assert _same(back, state)
    assert back["pending"]["group_std"] == {("public", "sensitive"): 1.25} and back["ledger"][0] == state["ledger"][0]
    assert type(back["update"]["optimizer"]["param_groups"][0]["betas"]) is tuple
    assert list(back["update"]["optimizer"]["state"]) == [0]  # int keys stay ints
    # an optimizer loaded from the file steps exactly as the one that saved it
    weights = [torch.nn.Parameter(torch.randn(3, 2, dtype=torch.float64)) for _ in range(2)]
    with torch.no_grad():
        weights[1].copy_(weights[0])
    optimizers = [torch.optim.AdamW([w], lr=0.01) for w in weights]
    for w, o in zip(weights, optimizers):
        w.grad = torch.full_like(w, 0.5)
        o.step()
    optimizers[1].load_state_dict(decode(encode({**state, "update": {"optimizer": optimizers[0].state_dict()}}))
                                  ["update"]["optimizer"])
    for w, o in zip(weights, optimizers):
        w.grad = torch.full_like(w, -0.25)
        o.step()
    assert torch.equal(weights[0], weights[1])


def test_written_files_are_0600_and_read_back(tmp_path: Path):
    path = tmp_path / state_file.STATE_FILE
    state_file.write(path, _state(), KEY)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and not path.with_name(path.name + ".tmp").exists()
    assert _same(state_file.read(path, KEY), _state())
    assert state_file.read(tmp_path / "none", KEY) is None


@pytest.mark.parametrize("field, value", [("step", 3.0), ("step", True), ("losses", [1]), ("run_nonce", "00"),
                                          ("trainable", {"w": [1.0]}), ("pending", [])])
def test_a_state_of_the_wrong_types_is_not_written(tmp_path: Path, field: str, value):
    path = tmp_path / state_file.STATE_FILE
    with pytest.raises(TypeError):
        state_file.write(path, {**_state(), field: value}, KEY)
    assert not path.exists()


@pytest.mark.parametrize("value", [{1, 2}, object(), 1 + 2j, bytearray(b"x"), {1.5: "a float key"},
                                   torch.zeros(2, dtype=torch.complex64)])
def test_a_value_the_format_does_not_carry_is_not_written(value):
    with pytest.raises(TypeError):
        encode({**_state(), "pending": {"x": value}})


# -- anything else is refused ---------------------------------------------------------------------------------------

def _tampered(how: str) -> bytes:
    data = encode(_state())
    tensors, tree = _parts(data)
    if how == "trailing bytes":
        return data + b"\0"
    if how == "truncated":
        return data[:-1]
    if how == "not safetensors":
        return b"\x80\x04K\x01."  # a pickle
    if how == "header length past the end":
        return (10**6).to_bytes(8, "little") + data[8:]
    if how == "another format":
        text = json.dumps(tree, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        return _file(tensors, tree, metadata={"format": "govtrain.run-state/0", "state": text})
    if how == "more metadata":
        text = json.dumps(tree, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        return _file(tensors, tree, metadata={"format": FORMAT, "state": text, "extra": "x"})
    if how == "whitespace":
        return _file(tensors, tree, text=json.dumps(tree, ensure_ascii=False, sort_keys=True))
    if how == "escaped text":
        text = json.dumps(tree, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        return _file(tensors, tree, text=text.replace('"run-1"', '"\\u0072un-1"'))
    if how == "a repeated key":
        text = json.dumps(tree, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        return _file(tensors, tree, text=text.replace('{"bytes":"ffff', '{"bytes":"00","bytes":"ffff', 1))
    if how == "a bare float":
        _field(tree, "step")[1] = 3  # then written as 3.0 below
        text = json.dumps(tree, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        return _file(tensors, tree, text=text.replace('["step",3]', '["step",3.0]'))
    if how == "a NaN constant":
        text = json.dumps(tree, ensure_ascii=False, sort_keys=True, separators=(",", ":"))
        return _file(tensors, tree, text=text.replace('{"float":"nan"}', "NaN"))
    if how == "an unknown field":
        tree["map"].append(["evil", 1])
    elif how == "a missing field":
        tree["map"] = [pair for pair in tree["map"] if pair[0] != "sampling_key"]
    elif how == "a field of the wrong type":
        _field(tree, "step")[1] = {"float": "3.0"}
    elif how == "a field of the wrong inner type":
        _field(tree, "losses")[1][0] = "0.5"
    elif how == "an unknown tag":
        _field(tree, "pending")[1] = {"pickle": "80044b012e"}
    elif how == "a tag of two keys":
        _field(tree, "run_nonce")[1] = {"bytes": "00", "float": "1.0"}
    elif how == "a float not as repr writes it":
        _field(tree, "losses")[1][0] = {"float": "0.50"}
    elif how == "bytes in upper case":
        _field(tree, "run_nonce")[1] = {"bytes": bytes(range(16)).hex().upper()}
    elif how == "a repeated map key":
        pairs = _field(tree, "eps_by_class")[1]["map"]
        pairs.append(list(pairs[0]))
    elif how == "a float map key":
        _field(tree, "eps_by_class")[1]["map"][0][0] = {"float": "1.0"}
    elif how == "a tensor of another dtype than declared":
        ref = _field(tree, "trainable")[1]["map"][0][1]["tensor"]
        ref[1] = "float32"
    elif how == "a tensor of another shape than declared":
        ref = _field(tree, "trainable")[1]["map"][0][1]["tensor"]
        ref[2] = list(reversed(ref[2]))
    elif how == "a tensor named twice":
        _field(tree, "trainable")[1]["map"][1][1] = _field(tree, "trainable")[1]["map"][0][1]
    elif how == "a tensor no reference names":
        tensors[str(len(tensors))] = torch.zeros(1)
    elif how == "an undeclared dtype":
        ref = _field(tree, "trainable")[1]["map"][0][1]["tensor"]
        ref[1] = "complex64"
    elif how == "deep nesting":
        deep: object = []
        for _ in range(200):
            deep = [deep]
        _field(tree, "pending")[1] = {"map": [["x", deep]]}
    else:
        raise AssertionError(how)
    return _file(tensors, tree)


CASES = ["trailing bytes", "truncated", "not safetensors", "header length past the end", "another format",
         "more metadata", "whitespace", "escaped text", "a repeated key", "a bare float", "a NaN constant",
         "an unknown field", "a missing field", "a field of the wrong type", "a field of the wrong inner type",
         "an unknown tag", "a tag of two keys", "a float not as repr writes it", "bytes in upper case",
         "a repeated map key", "a float map key", "a tensor of another dtype than declared",
         "a tensor of another shape than declared", "a tensor named twice", "a tensor no reference names",
         "an undeclared dtype", "deep nesting"]


@pytest.mark.parametrize("how", CASES)
def test_anything_state_file_would_not_write_is_refused(how: str):
    with pytest.raises(_Invalid):
        decode(_tampered(how))


def test_the_tampering_helper_changes_nothing_by_itself():
    """The cases above build their files as `encode` does: unchanged, that file decodes (so each refusal is the
    tampering's, not the helper's)."""
    data = encode(_state())
    tensors, tree = _parts(data)
    assert _same(decode(_file(tensors, tree)), decode(data))


@pytest.mark.parametrize("how", ["a field of the wrong type", "not safetensors", "an unknown tag"])
def test_a_tampered_file_is_one_line_run_state_invalid(tmp_path: Path, how: str):
    path = tmp_path / state_file.STATE_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, _tampered(how))
    os.close(fd)
    with pytest.raises(ConfigError) as refused:
        state_file.read(path, KEY)
    assert refused.value.code is Code.RUN_STATE_INVALID and "\n" not in refused.value.line()


# -- the MAC: only a state written under this ledger's key is decoded ----------------------------------------------

def _swap_tensors(header: dict) -> None:
    """Two tensors of one dtype and shape trade places (their offsets): the bytes are the same, the state is not."""
    header["3"]["data_offsets"], header["4"]["data_offsets"] = header["4"]["data_offsets"], header["3"]["data_offsets"]


@pytest.mark.parametrize("how", ["another key", "another ledger", "no mac", "a mac not hex", "a flipped tensor byte",
                                 "an edited state", "swapped tensors", "the mac of another state"])
def test_a_state_not_written_under_this_ledgers_key_is_refused_before_it_is_decoded(how: str, monkeypatch):
    """The folder's writer holds no ledger key: whatever they write with govtrain's writer (another key), move from
    another ledger, or edit after the run wrote it is refused (`_Unauthentic`) before any field is decoded."""
    data = encode(_state())
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    if how == "another key":
        data = encode(_state(), StateKey.derive(Ed25519PrivateKey.generate(), LEDGER))
    elif how == "another ledger":
        data = encode(_state(), StateKey.derive(Ed25519PrivateKey.from_private_bytes(bytes(range(32))),
                                                (LEDGER[0], b"o" * 32)))
    elif how == "no mac":
        del header["__metadata__"]["mac"]
        raw = json.dumps(header).encode()
        data = len(raw).to_bytes(8, "little") + raw + data[8 + size:]
    elif how == "a mac not hex":
        header["__metadata__"]["mac"] = "zz" * 32
        raw = json.dumps(header).encode()
        data = len(raw).to_bytes(8, "little") + raw + data[8 + size:]
    elif how == "a flipped tensor byte":
        data = data[:-1] + bytes([data[-1] ^ 1])
    elif how == "an edited state":
        edited = header["__metadata__"]["state"].replace('["step",3]', '["step",0]')
        assert edited != header["__metadata__"]["state"]
        header["__metadata__"]["state"] = edited
        raw = json.dumps(header).encode()
        data = len(raw).to_bytes(8, "little") + raw + data[8 + size:]
    elif how == "swapped tensors":
        assert header["3"]["shape"] == header["4"]["shape"] and header["3"]["dtype"] == header["4"]["dtype"]
        _swap_tensors(header)
        raw = json.dumps(header).encode()
        data = len(raw).to_bytes(8, "little") + raw + data[8 + size:]
    elif how == "the mac of another state":
        other = encode({**_state(), "step": 0})
        other_size = int.from_bytes(other[:8], "little")
        header["__metadata__"]["mac"] = json.loads(other[8:8 + other_size])["__metadata__"]["mac"]
        raw = json.dumps(header).encode()
        data = len(raw).to_bytes(8, "little") + raw + data[8 + size:]
    decoded: list = []
    monkeypatch.setattr(state_file, "_decode", lambda *args: decoded.append(args))  # nothing may be decoded
    monkeypatch.setattr("safetensors.torch.load", lambda *args: decoded.append(args))
    with pytest.raises(_Invalid) as refused:
        state_file.decode(data, KEY)
    assert not decoded, "a field or tensor was decoded before the MAC was checked"
    if how not in ("no mac", "a mac not hex"):
        assert type(refused.value) is _Unauthentic


def test_the_mac_cases_change_only_what_they_say():
    """Control for the cases above: the same edits sealed again under the ledger's key decode (the swap), or are
    refused by the check after the MAC (none here): so each refusal above is the MAC's."""
    data = encode(_state())
    size = int.from_bytes(data[:8], "little")
    body = (size).to_bytes(8, "little") + data[8:]
    swapped = decode(_sealed(body, KEY, edit=_swap_tensors))
    assert not _same(swapped, decode(data)) and _same(decode(_sealed(body, KEY)), decode(data))


def test_a_state_read_from_a_file_is_refused_in_one_line_when_another_key_wrote_it(tmp_path: Path):
    path = tmp_path / state_file.STATE_FILE
    state_file.write(path, _state(), StateKey.derive(Ed25519PrivateKey.generate(), LEDGER))
    with pytest.raises(ConfigError) as refused:
        state_file.read(path, KEY)
    assert refused.value.code is Code.RUN_STATE_INVALID and "\n" not in refused.value.line()
    assert "not a run state written by this ledger's key" in refused.value.line()


def test_the_state_key_is_never_shown():
    assert KEY.secret.hex() not in repr(KEY) and "secret" not in repr(KEY)


# -- the file's length is known before it is read ------------------------------------------------------------------

@pytest.mark.parametrize("how", ["a header over safetensors' limit", "longer than declared", "shorter than declared"])
def test_a_file_whose_length_is_not_its_headers_is_refused_before_it_is_read(tmp_path: Path, how: str):
    data = encode(_state())
    if how == "a header over safetensors' limit":
        data = (state_file.HEADER_LIMIT + 1).to_bytes(8, "little") + data[8:] + bytes(state_file.HEADER_LIMIT)
    elif how == "longer than declared":
        data += b"\0" * 8
    else:
        data = data[:-8]
    path = tmp_path / state_file.STATE_FILE
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, data)
    os.close(fd)
    with pytest.raises(ConfigError) as refused:
        state_file.read(path, KEY)
    assert refused.value.code is Code.RUN_STATE_INVALID and "\n" not in refused.value.line()
    assert "declares" in refused.value.line(), refused.value.line()


# -- field contents: what no run saves is refused even under the ledger's key --------------------------------------

@pytest.mark.parametrize("field, value", [
    ("step", -1), ("nonfinite", -1), ("pending", {}), ("pending", {"epoch": "0"}),
    ("pending", "first_step=-1"), ("pending", "allowed=-1"), ("pending", "group_std=0"), ("pending", "group_std=nan"),
    ("pending", "q_u=0"), ("pending", "an extra key"), ("noise", {"privatizer": {"name": "gaussian"}}),
    ("noise", {"privatizer": "gaussian", "state": None})])
def test_field_contents_no_run_saves_are_refused_even_under_the_ledgers_key(field: str, value):
    """Defence in depth behind the MAC: a state whose counts are negative, whose plan lacks a key, holds one more or
    one out of range, or whose noise record is not the privatizer's map and state, is not written and not read."""
    state = _state()
    if field == "pending" and isinstance(value, str):
        pending = dict(state["pending"])
        if value == "an extra key":
            pending["evil"] = 1
        else:
            name, number = value.split("=")
            if name in ("allowed", "group_std"):
                pending[name] = {k: float(number) if name == "group_std" else int(number) for k in pending[name]}
            else:
                pending[name] = int(number)
        value = pending
    state[field] = value
    with pytest.raises(TypeError):
        encode(state)
    checked = state_file._check_fields
    state_file._check_fields = lambda state, error: None  # type: ignore[assignment]
    try:
        data = encode(state)
    finally:
        state_file._check_fields = checked  # type: ignore[assignment]
    with pytest.raises(_Invalid) as refused:
        decode(data)
    assert type(refused.value) is _Invalid and "not of their types" in str(refused.value)
