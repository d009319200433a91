"""Attacks on the audit's extension point (docs/auditing.md): canary gradients reach the router only from
`govtrain.audit`, never from a config, a policy or the command line; they add exactly nothing to a real example's
gradient; and a canary never reaches a release, a run entry or a model card."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from govtrain.audit import world as worlds  # noqa: E402
from govtrain.audit.audit import AuditConfig, attach_canaries, close_run, open_run, prepare, run_audit  # noqa: E402
from govtrain.audit.canaries import Coordinate, DiracCanaries, units_of  # noqa: E402
from govtrain.errors import Code, GovtrainError  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SMALL = AuditConfig(mechanism="dpsgd", epsilon=4.0, m=40, steps=1, q=1.0, seed=3)


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_no_govtrain_module_imports_the_tests_or_reaches_the_injection_but_the_audit():
    for path in (REPO / "govtrain").rglob("*.py"):
        imported = _imports(path)
        assert not {n for n in imported if n == "tests" or n.startswith("tests.")}, path
        text = path.read_text()
        assert "audit_faults" not in text, path  # the broken mechanisms live only under tests/
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith("govtrain/audit/"):
            continue
        if "inject_audit_canaries" in text or "DiracCanaries" in text or "govtrain.audit" in text:
            assert relative == "govtrain/routing/router.py", relative  # the extension point's one definition
    assert (REPO / "tests" / "audit_faults.py").is_file()


def test_no_config_policy_or_command_line_option_enables_canaries(tmp_path: Path):
    from click import Group

    from govtrain.cli.main import cli
    from govtrain.policy.config import load_policy
    from govtrain.train.config import run_config

    setup = prepare(SMALL, tmp_path / "audit")
    text = setup.world.run_toml.read_text()
    for extra in ("audit_canaries = true\n", "canaries = 1000\n", "inject_audit_canaries = true\n"):
        bad = tmp_path / "bad-run.toml"
        bad.write_text(text.replace("[training]\n", "[training]\n" + extra))
        with pytest.raises(GovtrainError) as refused:
            run_config(bad)
        assert refused.value.code is Code.RUN_CONFIG_INVALID
    policy = setup.world.policy_path.with_name("bad-policy.toml")  # beside the keys it names
    policy.write_text(setup.world.policy_path.read_text().replace("[floor]", "audit_canaries = true\n\n[floor]"))
    load_policy(setup.world.policy_path)  # the audit's own policy loads
    with pytest.raises(GovtrainError) as refused:
        load_policy(policy)
    assert refused.value.code is Code.POLICY_INVALID and "audit_canaries" in str(refused.value)

    def options(command, path=()):  # every option of every command
        for param in command.params:
            yield path, param.name
        if isinstance(command, Group):
            for name, sub in command.commands.items():
                yield from options(sub, (*path, name))

    names = [(path, name) for path, name in options(cli)]
    assert names and not [n for n in names if "canar" in n[1] or "inject" in n[1]]


def test_the_router_takes_only_the_audits_own_object_on_the_audit_class_alone(tmp_path: Path):
    setup = prepare(SMALL, tmp_path / "audit")
    ledger, run = open_run(SMALL, setup.world)
    try:
        router = run.router
        assert router._canaries is None  # a run, as `govtrain train` prepares it, injects nothing

        class Lookalike(DiracCanaries):
            pass

        head = next(n for n in router.params if n.endswith("classifier.modules_to_save.default.weight"))
        real = next(n for n in router.params if ".lora_A." in n)  # reached by the real class
        for impostor in (Lookalike({"c": Coordinate(name=head, index=0)}, data_class="audit", clip_norm=1.0),
                         object()):
            with pytest.raises(TypeError):
                router.inject_audit_canaries(impostor)
        with pytest.raises(ValueError, match="alone reaches"):
            router.inject_audit_canaries(DiracCanaries({"c": Coordinate(name=real, index=0)}, data_class="audit",
                                                       clip_norm=1.0))
        with pytest.raises(ValueError, match="clipping norm"):
            DiracCanaries({"c": Coordinate(name=head, index=0)}, data_class="audit", clip_norm=1.0, scale=1.0)
        assert router._canaries is None  # every refusal left the router as it was
    finally:
        close_run(ledger, run)


def _step(run, canary_ids, dirac):  # type: ignore[no-untyped-def]
    """One logical step of `run`'s current draw on its router, the noise generator reseeded: the `.grad` it wrote."""
    router = run.router
    router.begin()
    for chunk in run._audit_chunks:
        batch = run.encode(chunk)
        with run.forward(chunk):
            output = run.model(**batch.inputs)
        losses = run.task.per_example_loss(output, batch)
        losses = losses * torch.tensor([o not in canary_ids for o in chunk.owners], dtype=losses.dtype)
        if dirac is not None:
            dirac.select(units_of(chunk.owners, chunk.units))
        router.accumulate(losses, chunk.classes, chunk.clips, units=chunk.units)
    router.generator.manual_seed(1234)
    router.finish(run._group_std, run.pending["expected_batch"])
    grads = {n: p.grad.detach().clone() for n, p in router.params.items() if p.grad is not None}
    for p in router.params.values():
        p.grad = None
    return grads


def test_canary_injection_adds_exactly_nothing_to_real_examples_gradients(tmp_path: Path):
    """Oracle: the same step (same draw, same noise) with and without the extension point. Every coordinate but
    the drawn canaries' is bit-for-bit equal; each drawn canary's coordinate differs by exactly its clipped Dirac,
    -C (a hair less, `Router`'s rounding) over the expected batch size."""
    setup = prepare(SMALL, tmp_path / "audit")
    ledger, run = open_run(SMALL, setup.world)
    try:
        assert run.plan_epoch() and run.write_ahead()
        run._audit_chunks = run.draw()
        drawn = {o for chunk in run._audit_chunks for o in chunk.owners}
        canary_ids = set(setup.canaries.ids)
        assert drawn & canary_ids and drawn - canary_ids  # the step has both canaries and real examples
        without = _step(run, canary_ids, None)
        dirac = attach_canaries(run, setup.canaries, SMALL.scale)
        with_canaries = _step(run, canary_ids, dirac)
    finally:
        close_run(ledger, run)
    assert without.keys() == with_canaries.keys()
    expected = -1.0 / run.pending["expected_batch"]
    moved = 0
    for name in without:
        difference = (with_canaries[name] - without[name]).view(-1)
        at = torch.zeros_like(difference, dtype=torch.bool)
        for cid in drawn & canary_ids:
            coordinate = dirac.coordinates[cid]
            if coordinate.name == name:
                at[coordinate.index] = True
        assert torch.equal(with_canaries[name].view(-1)[~at], without[name].view(-1)[~at]), name
        if at.any():
            assert torch.allclose(difference[at], torch.full_like(difference[at], expected), rtol=1e-4, atol=0)
            moved += int(at.sum())
    assert moved == len(drawn & canary_ids)


def test_an_audit_releases_nothing_and_records_no_run(tmp_path: Path):
    """A canary never appears in a release or a model card as data: the audit never finishes its run, so no
    adapter, card or run entry exists, and the canaries live only in the audit's own ledger."""
    from govtrain.ledger.ledger import Ledger

    folder = tmp_path / "audit"
    result = run_audit(SMALL, folder)
    assert result.bound.canaries == SMALL.m
    output = folder / "run"
    assert not (output / "adapter_config.json").exists() and not (output / "README.md").exists()
    assert not list(folder.rglob("adapter_model.safetensors")) and not list(folder.rglob("*.intoto.jsonl"))
    with Ledger.open(f"sqlite:///{folder / 'ledger.db'}") as ledger:
        book = ledger.spend_book()
        assert book.finished == {} and ledger.policy.origin == "audit.invalid/govtrain/1"
        assert {c for c in book.charged if c.startswith("canary-")}  # the canaries were charged, in this ledger only
    assert worlds.AUDIT_CLASS == "audit"


def test_closing_the_router_drops_the_audit_canaries(tmp_path: Path):
    """A router's canaries end with it: `close()` clears them, so a closed router never clips a Dirac again."""
    setup = prepare(SMALL, tmp_path / "audit")
    ledger, run = open_run(SMALL, setup.world)
    try:
        attach_canaries(run, setup.canaries, SMALL.scale)
        assert run.router._canaries is not None
        run.router.close()
        assert run.router._canaries is None
    finally:
        close_run(ledger, run)  # a second close is harmless


def _forward(run, chunk):  # type: ignore[no-untyped-def]
    batch = run.encode(chunk)
    with run.forward(chunk):
        output = run.model(**batch.inputs)
    return run.task.per_example_loss(output, batch)


def test_a_misused_canary_chunk_is_a_value_error_and_changes_nothing(tmp_path: Path):
    """The audit's driver must name each clipping unit's contribution before each chunk (`DiracCanaries.select`)
    and clip a canary as the canaries' class. Either misuse is a programmer's mistake: a ValueError (as the
    router's other argument checks), raised before any gradient is formed, so no sum, no `.grad`, no noise."""
    setup = prepare(SMALL, tmp_path / "audit")
    ledger, run = open_run(SMALL, setup.world)
    try:
        assert run.plan_epoch() and run.write_ahead()
        chunk = run.draw()[0]
        canary_ids = set(setup.canaries.ids)
        assert set(chunk.owners) & canary_ids
        dirac = attach_canaries(run, setup.canaries, SMALL.scale)
        router = run.router
        router.begin()
        state = router.generator.get_state()
        with pytest.raises(ValueError, match="select"):  # no select before the chunk
            router.accumulate(_forward(run, chunk), chunk.classes, chunk.clips, units=chunk.units)
        assert router._totals is None and all(p.grad is None for p in router.params.values())
        dirac.select(units_of(chunk.owners, chunk.units))
        wrong = [worlds.REAL_CLASS] * len(chunk.classes)  # every unit clipped as the real class
        with pytest.raises(ValueError, match="clipped as class"):
            router.accumulate(_forward(run, chunk), wrong, chunk.clips, units=chunk.units)
        assert router._totals is None and all(p.grad is None for p in router.params.values())
        assert torch.equal(router.generator.get_state(), state)  # no noise drawn
        # the same chunk, used rightly, still goes through: the refusals left the router as it was
        dirac.select(units_of(chunk.owners, chunk.units))
        router.accumulate(_forward(run, chunk), chunk.classes, chunk.clips, units=chunk.units)
        assert router._totals is not None
    finally:
        close_run(ledger, run)


def test_the_router_takes_the_audits_own_canary_class_and_no_look_alike_even_before_the_audit_loads():
    """Routing never imports the audit (issue 35), so the router's audit-only extension point reads the audit's
    `DiracCanaries` from the loaded module. Code of a user's loop cannot name another class to it first: a look-alike
    (same name and module, before and after the audit loads) and a subclass are refused, in a fresh interpreter."""
    import subprocess
    import sys

    script = (
        "from govtrain.routing.router import Router\n"
        "import govtrain.routing.router as router_module\n"
        "assert not hasattr(router_module, 'accept_audit_canaries')\n"
        "class DiracCanaries:\n"
        "    pass\n"
        "DiracCanaries.__module__ = 'govtrain.audit.canaries'\n"
        "def refused(obj):\n"
        "    try:\n"
        "        Router.inject_audit_canaries(object(), obj)\n"
        "    except TypeError:\n"
        "        return True\n"
        "    return False\n"
        "before = refused(DiracCanaries())\n"
        "import govtrain.audit.canaries as real\n"
        "class Sub(real.DiracCanaries):\n"
        "    pass\n"
        "print(before, refused(DiracCanaries()), refused(Sub.__new__(Sub)))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True", "True"]
