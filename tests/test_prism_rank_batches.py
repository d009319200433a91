"""PRISM runs its small linear algebra once per rank over all its stacks: against the step it replaced.

The oracle is `Prism`'s step as it read when each stack of one shape ran its own factorizations (two eigh,
a Cholesky, two triangular solves and two SVDs per shape), kept here verbatim but for names. The pairs come
in six shapes of two ranks, two of them sharing (m, n), with peft's zero start, a τ per pair and steps
skipped, so that bias corrections and floors differ inside a stack and between stacks. In float64 the two
agree to rounding; in float32 too (both do the same products, in float64 where the oracle did).
"""

from __future__ import annotations

import io

import pytest

torch = pytest.importorskip("torch")

from govtrain.mechanisms import retraction, tangent_space  # noqa: E402
from govtrain.mechanisms.prism import Prism, _floored, _pinv_trace  # noqa: E402
from govtrain.mechanisms.stacking import shape_groups, write  # noqa: E402

F64 = torch.float64
LR, BETAS, FLOOR, MAX_CONDITION, EPS = 0.05, (0.9, 0.99), 1.0, 1e4, 1e-12

# (m, n, r): r = 3 in three shapes, r = 2 in three, (12, 9) in both ranks
SHAPES = [(12, 9, 3), (12, 9, 3), (12, 9, 3), (7, 15, 3), (7, 15, 3), (20, 6, 3),
          (12, 9, 2), (12, 9, 2), (9, 9, 2), (5, 11, 2), (5, 11, 2)]
ZERO_START = {1, 4, 7}
SKIPPED = {0: {"pair1", "pair9"}, 2: {"pair2", "pair5", "pair8"}}  # step -> pairs without a gradient


# -- the oracle: the step per stack of one shape, before the batching over ranks ------------------------------

def legacy_orthonormal(*tall):
    f64 = torch.float64
    k = tall[0].shape[-1]
    scales = [X.norm(dim=-2, keepdim=True) for X in tall]
    scales = [torch.where(d > 0, d, torch.ones_like(d)) for d in scales]
    tall = [X / d for X, d in zip(tall, scales)]
    values, vectors = torch.linalg.eigh(torch.stack([X.transpose(-1, -2) @ X for X in tall]))
    keep = values > values.amax(-1, keepdim=True) * (k * torch.finfo(f64).eps)
    root = torch.where(keep, values, torch.zeros_like(values)).sqrt()
    inverse_root = torch.where(keep, 1 / torch.where(keep, root, torch.ones_like(root)), torch.zeros_like(root))
    first = [X @ (V * w.unsqueeze(-2)) for X, V, w in zip(tall, vectors, inverse_root)]
    gram2 = torch.stack([Q.transpose(-1, -2) @ Q for Q in first]) + torch.diag_embed((~keep).to(f64))
    L, _ = torch.linalg.cholesky_ex(gram2)
    return [(torch.linalg.solve_triangular(l.transpose(-1, -2), Q, upper=True, left=False),
             l.transpose(-1, -2) @ (V * w.unsqueeze(-2)).transpose(-1, -2) * d)
            for Q, l, V, w, d in zip(first, L, vectors, root, scales)]


def legacy_retraction(A, B, dA, dB, step):
    r = A.shape[-1]
    lead = torch.broadcast_shapes(A.shape[:-2], dA.shape[:-2], B.shape[:-2], dB.shape[:-2])
    A, dA, B, dB = (t.to(torch.float64).expand(*lead, *t.shape[-2:]) for t in (A, dA, B, dB))
    (QA, RA), (QB, RB) = legacy_orthonormal(torch.cat([A, dA], -1), torch.cat([B, dB], -1))
    core = (RA[..., :r] + step * RA[..., r:]) @ RB[..., :r].transpose(-1, -2) \
        + step * (RA[..., :r] @ RB[..., r:].transpose(-1, -2))
    U, S, Vh = torch.linalg.svd(core)
    root = S[..., :r].sqrt().unsqueeze(-2)
    return QA, QB, U[..., :r] * root, Vh[..., :r, :].transpose(-1, -2) * root, RA[..., :r], RB[..., :r]


def legacy_retract_aligned(A, B, dA, dB, step):
    QA, QB, WA, WB, RA1, RB1 = legacy_retraction(A, B, dA, dB, step)
    U, _, Vh = torch.linalg.svd(WA.transpose(-1, -2) @ RA1 + WB.transpose(-1, -2) @ RB1)
    Q = U @ Vh
    return (QA @ (WA @ Q)).to(A.dtype), (QB @ (WB @ Q)).to(B.dtype)


def legacy_corrections(optimizer, steps, device):
    beta1, beta2 = optimizer.betas
    if len(set(steps)) == 1:
        return 1 - beta1 ** steps[0], 1 - beta2 ** steps[0]
    t = torch.tensor(steps, dtype=torch.float64, device=device).view(-1, 1, 1)
    return 1 - beta1 ** t, 1 - beta2 ** t


@torch.no_grad()
def legacy_step(optimizer: Prism, noise_std) -> None:
    ready = {k: pair for k, pair in optimizer.pairs.items() if pair[0].grad is not None and pair[1].grad is not None}
    for keys in shape_groups(ready, lambda pair: (pair[0].shape, pair[1].shape, pair[1].dtype, pair[1].device)):
        legacy_stack_step(optimizer, keys, noise_std)


def legacy_stack_step(self: Prism, keys, noise_std) -> None:
    f64 = torch.float64
    beta1, beta2 = self.betas
    lora_A = [self.pairs[k][0] for k in keys]
    lora_B = [self.pairs[k][1] for k in keys]
    A = torch.stack([p.detach() for p in lora_B])
    B = torch.stack([p.detach() for p in lora_A]).transpose(-1, -2)
    work = torch.promote_types(A.dtype, torch.float32)
    gA = torch.stack([p.grad for p in lora_B]).to(work)
    gB = torch.stack([p.grad for p in lora_A]).transpose(-1, -2).to(work)
    P, m, r = A.shape
    n = B.shape[-2]
    moments, entries = self._stacked(keys, m, n, r, work, A.device)
    for entry in entries:
        entry["step"] = int(entry["step"]) + 1
    c1, c2 = legacy_corrections(self, [entry["step"] for entry in entries], A.device)
    moments["m_A"].lerp_(gA, 1 - beta1)
    moments["m_B"].lerp_(gB, 1 - beta1)
    gA64, gB64 = gA.to(f64), gB.to(f64)
    moments["v_A"].mul_(beta2).add_(gA64.transpose(-1, -2) @ gA64, alpha=(1 - beta2) / m)
    moments["v_B"].mul_(beta2).add_(gB64.transpose(-1, -2) @ gB64, alpha=(1 - beta2) / n)
    A64, B64 = A.to(f64), B.to(f64)
    square = torch.cat([A64.transpose(-1, -2) @ A64, B64.transpose(-1, -2) @ B64,
                        moments["v_A"] / c2, moments["v_B"] / c2])
    values, vectors = torch.linalg.eigh((square + square.transpose(-1, -2)) / 2)
    rtol = r * torch.finfo(A.dtype).eps
    trace_M, trace_N = _pinv_trace(values[:2 * P], rtol).split(P)
    taus = [float(noise_std.get(k, 0.0)) ** 2 for k in keys]
    tau2 = taus[0] if len(set(taus)) == 1 else torch.tensor(taus, dtype=f64, device=A.device)
    floors = torch.cat([self.floor * tau2 * (1 - 0.75 * r / m) * trace_N / r,
                        self.floor * tau2 * (1 - 0.75 * r / n) * trace_M / r])
    root_A, root_B = (_floored(values[2 * P:], vectors[2 * P:], floors, self.max_condition, self.eps)
                      / (c1 if isinstance(c1, float) else torch.cat([c1, c1]))).to(work).split(P)
    new_A, new_B = legacy_retract_aligned(A64, B64, moments["m_A"] @ root_A, moments["m_B"] @ root_B, -self.lr)
    write(lora_B, new_A)
    write(lora_A, new_B.transpose(-1, -2))
    for p in lora_A + lora_B:
        p.grad = None


# -- the comparison ------------------------------------------------------------------------------------------

def make_pairs(dtype, seed: int = 0) -> dict:
    generator = torch.Generator().manual_seed(seed)
    pairs = {}
    for i, (m, n, r) in enumerate(SHAPES):
        lora_A = torch.randn(r, n, generator=generator, dtype=F64) / n ** 0.5
        lora_B = torch.zeros(m, r, dtype=F64) if i in ZERO_START else torch.randn(m, r, generator=generator, dtype=F64)
        pairs[f"pair{i}"] = (torch.nn.Parameter(lora_A.to(dtype)), torch.nn.Parameter(lora_B.to(dtype)))
    return pairs


def twin(pairs: dict) -> dict:
    return {k: (torch.nn.Parameter(a.detach().clone()), torch.nn.Parameter(b.detach().clone()))
            for k, (a, b) in pairs.items()}


def feed(pairs: dict, grads: dict, skip: set[str]) -> None:
    for key, (lora_A, lora_B) in pairs.items():
        if key not in skip:
            lora_A.grad, lora_B.grad = (g.to(lora_A.dtype).clone() for g in grads[key])


def run_both(dtype, steps: int):
    """The batched step and the per-stack oracle from the same start, fed the same gradients (drawn at the
    oracle's factors, so that they stay privatized-looking as the factors move)."""
    pairs = make_pairs(dtype)
    legacy_pairs = twin(pairs)
    batched = Prism(pairs, lr=LR, betas=BETAS, floor=FLOOR, max_condition=MAX_CONDITION, eps=EPS)
    legacy = Prism(legacy_pairs, lr=LR, betas=BETAS, floor=FLOOR, max_condition=MAX_CONDITION, eps=EPS)
    generator = torch.Generator().manual_seed(5)
    taus = {k: 0.01 * (1 + i % 4) for i, k in enumerate(pairs)}  # equal in some stacks, not in others
    for t in range(steps):
        grads = {}
        for key, (lora_A, lora_B) in legacy_pairs.items():
            A, B = lora_B.detach().to(F64), lora_A.detach().to(F64).T
            G = torch.randn(A.shape[0], B.shape[0], generator=generator, dtype=F64)
            dA, dB = tangent_space.tangent_lift(A, B, G @ B, G.T @ A)
            xA, xB = tangent_space.canonical(A, B, *tangent_space.tangent_noise(A, B, 0.3, generator))
            grads[key] = ((dB + xB).T, dA + xA)
        feed(pairs, grads, SKIPPED.get(t, set()))
        feed(legacy_pairs, grads, SKIPPED.get(t, set()))
        batched.step(taus)
        legacy_step(legacy, taus)
    return batched, legacy


@pytest.mark.parametrize("dtype, tolerance", [(F64, 1e-10), (torch.float32, 1e-5)])
def test_the_step_batched_over_ranks_is_the_step_per_stack(dtype, tolerance):
    """float64: to 1e-10 of each factor's norm (2e-15 was seen after four steps). float32: to 1e-5 (the two
    differ only in float64 rounding, which the parameters' float32 hid entirely in the runs seen)."""
    batched, legacy = run_both(dtype, steps=4)
    assert len(shape_groups(batched.pairs, lambda pair: (pair[0].shape, pair[1].shape))) == 6
    for key, (lora_A, lora_B) in batched.pairs.items():
        twin_A, twin_B = legacy.pairs[key]
        assert lora_A.grad is None and lora_B.grad is None
        for got, want in ((lora_A, twin_A), (lora_B, twin_B)):
            assert got.dtype == want.dtype == dtype
            error = float((got.detach().to(F64) - want.detach().to(F64)).norm())
            assert error <= tolerance * float(want.detach().to(F64).norm()), key
        mine, theirs = batched.state[key], legacy.state[key]
        assert mine["step"] == theirs["step"] == 4 - sum(key in s for s in SKIPPED.values())
        for field in ("m_A", "m_B", "v_A", "v_B"):
            error = float((mine[field].to(F64) - theirs[field].to(F64)).norm())
            assert error <= tolerance * max(1e-3, float(theirs[field].to(F64).norm())), (key, field)


@pytest.mark.parametrize("delta", [1e-4, 1e-8, 0.0])
def test_the_retraction_of_near_dependent_columns_is_the_per_stack_one(delta):
    """[A, dA] nearly rank-deficient (a column of A and the span of dA within `delta` of A's): the bases'
    Cholesky factor applied as one batched inverse agrees with the per-stack triangular solves."""
    generator = torch.Generator().manual_seed(6)
    A, B = torch.randn(5, 40, 4, generator=generator, dtype=F64), torch.randn(5, 30, 4, generator=generator, dtype=F64)
    A[..., 3] = A[..., 2] + delta * torch.randn(5, 40, generator=generator, dtype=F64)
    dA = A @ torch.randn(4, 4, generator=generator, dtype=F64) + delta * torch.randn(5, 40, 4, generator=generator,
                                                                                    dtype=F64)
    dB = torch.randn(5, 30, 4, generator=generator, dtype=F64)
    for got, want in zip(retraction.retract_aligned(A, B, dA, dB, -0.1), legacy_retract_aligned(A, B, dA, dB, -0.1)):
        assert float((got - want).norm()) <= 1e-12 * float(want.norm())


LINALG = ("eigh", "eigvalsh", "svd", "svdvals", "cholesky", "cholesky_ex", "solve_triangular", "qr", "inv",
          "inv_ex", "pinv", "solve", "lstsq", "eig")


def linalg_calls(monkeypatch) -> dict[str, int]:
    """Counts of the torch.linalg calls made while the returned dict is live."""
    counts: dict[str, int] = {}
    for name in LINALG:
        original = getattr(torch.linalg, name)

        def counted(*args, __name=name, __original=original, **kwargs):
            counts[__name] = counts.get(__name, 0) + 1
            return __original(*args, **kwargs)

        monkeypatch.setattr(torch.linalg, name, counted)
    return counts


def test_a_step_makes_six_linalg_calls_per_rank_whatever_the_number_of_shapes(monkeypatch):
    """On a GPU each linalg call is a launch and a wait, whatever its batch: the figure that matters. Two
    ranks: 2 × (eigh of the r × r matrices; eigh, Cholesky and triangular inverse of the bases; two SVDs),
    where the per-stack step made 7 per shape (two triangular solves), 42 for these six shapes."""
    pairs = make_pairs(F64)
    generator = torch.Generator().manual_seed(1)
    grads = {k: (torch.randn(a.shape, generator=generator, dtype=F64), torch.randn(b.shape, generator=generator,
                                                                                   dtype=F64))
             for k, (a, b) in pairs.items()}
    legacy_pairs = twin(pairs)
    batched = Prism(pairs, lr=LR)
    legacy = Prism(legacy_pairs, lr=LR)
    counts = linalg_calls(monkeypatch)
    feed(pairs, grads, set())
    batched.step({k: 0.01 for k in pairs})
    assert counts == {"eigh": 4, "cholesky_ex": 2, "solve_triangular": 2, "svd": 4}
    counts.clear()
    feed(legacy_pairs, grads, set())
    legacy_step(legacy, {k: 0.01 for k in pairs})
    assert counts == {"eigh": 12, "cholesky_ex": 6, "solve_triangular": 12, "svd": 12}


def test_a_step_reads_no_tensor_back_to_the_host(monkeypatch):
    """No `.item()`, `float(t)`, `int(t)`, `bool(t)` or `.tolist()` of a tensor in a step, not even with
    per-pair bias corrections and floors (pairs with different step counts and τ): on a GPU each would wait
    for the device."""
    pairs = make_pairs(F64)
    generator = torch.Generator().manual_seed(2)
    optimizer = Prism(pairs, lr=LR)
    taus = {k: 0.01 * (1 + i % 4) for i, k in enumerate(pairs)}
    for t in range(2):
        grads = {k: (torch.randn(a.shape, generator=generator, dtype=F64),
                     torch.randn(b.shape, generator=generator, dtype=F64)) for k, (a, b) in pairs.items()}
        feed(pairs, grads, SKIPPED[0] if t == 0 else set())
        if t == 1:  # the second step: different step counts inside stacks, the stacks rebuilt

            def refuse(*args, **kwargs):
                raise AssertionError("a step read a tensor back to the host")

            for name in ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "nonzero"):
                monkeypatch.setattr(torch.Tensor, name, refuse)
        optimizer.step(taus)
    monkeypatch.undo()
    assert {optimizer.state[k]["step"] for k in pairs} == {1, 2}


def test_a_state_saved_by_the_per_stack_step_resumes_in_the_batched_one():
    _, legacy = run_both(torch.float32, steps=2)
    buffer = io.BytesIO()
    torch.save(legacy.state_dict(), buffer)
    resumed = Prism(twin(legacy.pairs), lr=LR, betas=BETAS, floor=FLOOR, max_condition=MAX_CONDITION, eps=EPS)
    resumed.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    generator = torch.Generator().manual_seed(8)
    grads = {k: (torch.randn(a.shape, generator=generator, dtype=F64) * 0.1,
                 torch.randn(b.shape, generator=generator, dtype=F64) * 0.1) for k, (a, b) in legacy.pairs.items()}
    feed(legacy.pairs, grads, set())
    feed(resumed.pairs, grads, set())
    legacy_step(legacy, {})
    resumed.step({})
    for key in legacy.pairs:
        for got, want in zip(resumed.pairs[key], legacy.pairs[key]):
            assert torch.allclose(got.detach(), want.detach(), rtol=1e-5, atol=1e-6), key
