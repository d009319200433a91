"""The processes of one run (docs/distributed.md): who leads, and the few collectives a governed step needs.

govtrain's data parallelism is not torch's `DistributedDataParallel`: DDP all-reduces `.grad` as backward fills
it, and a summed non-private gradient is exactly what must never exist. Each rank instead clips its own share of
the step's draw, and `Router.finish` sums the ranks' clipped sums (`sum_`), has the lead rank alone draw the
noise, and hands the noised sum to every rank (`share_`), which all write the same `.grad` and take the same
update. The lead also alone draws the batch, holds the sampling key and the privatizer's state, and writes the
ledger and the run state; the other ranks (followers) read the ledger to check what it wrote.

`World.single()` is one process (every collective the identity). `World.from_env()` joins the process group
`torchrun` or `govtrain train --nproc N` describes in the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
LOCAL_RANK), with gloo for CPU tensors and NCCL for CUDA ones.

Collectives that can refuse (`together`) gather every rank's outcome, so a refusal on one rank is raised on every
rank with the same code, and no rank is left waiting in a collective the refusing rank never joins.
"""

from __future__ import annotations

import datetime
import os
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence, TypeVar

from govtrain import errors
from govtrain.errors import Code, ConfigError, GovtrainError

if TYPE_CHECKING:
    import torch

T = TypeVar("T")

__all__ = ["World", "in_launch", "LEAD"]

LEAD = 0  # the rank that draws, noises and writes
TIMEOUT_S = int(os.environ.get("GOVTRAIN_DIST_TIMEOUT_S", "1800"))  # a collective no peer joins within this fails


def in_launch() -> bool:
    """This process was started as one rank of several (`torchrun`, `govtrain train --nproc N`)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


@dataclass(frozen=True, kw_only=True)
class World:
    """This process's place among the run's processes: `rank` of `size`, collectives on `device`."""

    rank: int = 0
    size: int = 1
    device: str = "cpu"  # where collectives' tensors live: "cpu" (gloo) or "cuda" (nccl)
    owned: bool = field(default=False, compare=False)  # this World initialised the process group (closes it)
    grouped: bool = False  # a process group is joined: collectives run, even among 1 rank (a bench of their cost)

    @classmethod
    def single(cls) -> "World":
        return cls()

    @classmethod
    def from_env(cls, device_type: str = "cpu") -> "World":
        """The process group the launcher's environment describes (joined if no one here has), or one process."""
        if not in_launch():
            if _env_int("RANK", 0) != 0:
                raise ConfigError(Code.RUN_CONFIG_INVALID, f"RANK={os.environ['RANK']} with WORLD_SIZE="
                                  f"{os.environ.get('WORLD_SIZE')}: one process is rank 0; start the ranks with "
                                  "torchrun or govtrain train --nproc N, or unset RANK")
            return cls.single()
        import torch
        import torch.distributed as dist

        rank, size = _env_int("RANK"), _env_int("WORLD_SIZE")
        if not 0 <= rank < size:
            raise ConfigError(Code.RUN_CONFIG_INVALID, f"RANK={rank} is not in [0, WORLD_SIZE={size}): start the "
                                                       "ranks with torchrun or govtrain train --nproc N")
        owned = False
        if not dist.is_initialized():
            backend = "nccl" if device_type == "cuda" else "gloo"
            if device_type == "cuda":
                torch.cuda.set_device(_env_int("LOCAL_RANK", rank))
            try:
                dist.init_process_group(backend, rank=rank, world_size=size,
                                        timeout=datetime.timedelta(seconds=TIMEOUT_S))
            except (RuntimeError, ValueError) as e:  # the rendezvous failed: no peer, a port in use, a bad address
                raise ConfigError(Code.RANK_LOST, f"rank {rank} of {size} could not join the run's processes ({e}); "
                                                  "start every rank with the same MASTER_ADDR and MASTER_PORT") from e
            owned = True
        elif dist.get_world_size() != size or dist.get_rank() != rank:
            raise ConfigError(Code.RUN_CONFIG_INVALID, "the process group already initialised is not the one RANK and "
                                                       "WORLD_SIZE describe")
        backend = dist.get_backend()
        return cls(rank=rank, size=size, device="cuda" if backend == "nccl" else "cpu", owned=owned, grouped=True)

    @property
    def lead(self) -> bool:
        return self.rank == LEAD

    @property
    def many(self) -> bool:
        """Collectives run: several ranks, or a process group joined on purpose by one."""
        return self.size > 1 or self.grouped

    def close(self, *, settled: bool = False) -> None:
        """Leave the process group this World joined (not one the caller set up). `settled`: every rank is closing
        after the same last collective (a saved run), so they meet in a barrier first: `destroy_process_group` is no
        barrier, and a rank that tears gloo down while its peer still does can abort at exit ("terminate called
        without an active exception"). A rank closing on an error skips it (its peers may be elsewhere)."""
        if self.owned:
            import torch.distributed as dist

            if dist.is_initialized():
                if settled and self.many:
                    try:
                        self.barrier()
                    except GovtrainError:
                        pass  # a peer already gone: nothing to wait for
                dist.destroy_process_group()

    # -- collectives ---------------------------------------------------------------------------------

    def broadcast(self, value: T | None) -> T:
        """The lead's `value` on every rank (followers pass anything: it is ignored)."""
        if not self.many:
            return value  # type: ignore[return-value]
        import torch.distributed as dist

        box = [value if self.lead else None]
        self._guarded(lambda: dist.broadcast_object_list(box, src=LEAD, device=self._object_device()))
        return box[0]  # type: ignore[return-value]

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if not self.many:
            return [value]
        import torch.distributed as dist

        out: list[Any] = [None] * self.size
        self._guarded(lambda: dist.all_gather_object(out, value))
        return out

    def together(self, work: Callable[[], T]) -> T:
        """`work()` on every rank, then every rank's outcome gathered: if any rank raised a govtrain error (or any
        other), every rank raises it, with the same code, naming the rank; else each rank's own result."""
        if not self.many:
            return work()
        try:
            result, failure = work(), None
        except GovtrainError as e:
            result, failure, raised = None, (e.code.value, e.detail, type(e).__name__), e
        except Exception as e:  # a bug on one rank must not leave the others in a collective: say it, then raise
            result, failure, raised = None, (None, f"{type(e).__name__}: {e}", type(e).__name__), e
        outcomes = self.gather(failure)
        if failure is not None:
            raise raised
        for rank, outcome in enumerate(outcomes):
            if outcome is not None:
                raise _error(rank, *outcome)
        return result  # type: ignore[return-value]

    def from_lead(self, work: Callable[[], T]) -> T:
        """`work()` on the lead alone, its result on every rank (one broadcast); if it raised, every rank raises it,
        with its code, so no follower waits on a lead that stopped."""
        if not self.many:
            return work()
        outcome: tuple | None = None
        if self.lead:
            try:
                outcome = ("ok", work())
            except GovtrainError as e:
                self.broadcast(("refused", e.code.value, e.detail, type(e).__name__))
                raise
            except BaseException as e:
                self.broadcast(("failed", None, f"{type(e).__name__}: {str(e)[:200]}", None))
                raise
        outcome = self.broadcast(outcome)
        if outcome[0] == "ok":
            return outcome[1]
        _, code, detail, kind = outcome
        raise _error(LEAD, code, detail, kind)

    def sum_(self, tensors: Sequence["torch.Tensor"]) -> None:
        """Sum `tensors` over the ranks, in place on every rank (one flat buffer per dtype and device)."""
        if self.many:
            self._flat(tensors, self._all_reduce)

    def share_(self, tensors: Sequence["torch.Tensor"]) -> None:
        """The lead's `tensors`, copied in place into every rank's (bitwise: a broadcast copies bytes)."""
        if self.many:
            self._flat(tensors, self._broadcast)

    def guarded(self, call: Callable[[], T]) -> T:
        """`call()`, a collective made outside this class (FSDP's: `distributed.fsdp`), failing as `rank_lost` when a
        peer is gone, as this class's own do."""
        return self._guarded(call)

    def barrier(self) -> None:
        if self.many:
            import torch.distributed as dist

            self._guarded(dist.barrier)

    # -- internals -----------------------------------------------------------------------------------

    def _flat(self, tensors: Sequence["torch.Tensor"], op: Callable[["torch.Tensor"], None]) -> None:
        import torch

        kinds: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            kinds.setdefault((t.dtype, t.device), []).append(t)
        for (dtype, device), same in sorted(kinds.items(), key=lambda kv: (str(kv[0][0]), str(kv[0][1]))):
            flat = torch.cat([t.reshape(-1) for t in same]) if same else torch.zeros(0, dtype=dtype, device=device)
            moved = flat.to(self._tensor_device(device))
            op(moved)
            moved = moved.to(device)
            offset = 0
            for t in same:
                t.copy_(moved[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def _all_reduce(self, flat: "torch.Tensor") -> None:
        import torch.distributed as dist

        self._guarded(lambda: dist.all_reduce(flat, op=dist.ReduceOp.SUM))

    def _broadcast(self, flat: "torch.Tensor") -> None:
        import torch.distributed as dist

        self._guarded(lambda: dist.broadcast(flat, src=LEAD))

    def _tensor_device(self, device: "torch.device") -> "torch.device":
        import torch

        return torch.device("cuda", torch.cuda.current_device()) if self.device == "cuda" else torch.device("cpu")

    def _object_device(self) -> "torch.device":
        return self._tensor_device(None)  # type: ignore[arg-type]

    def _guarded(self, call: Callable[[], Any]) -> Any:
        """A collective whose peer is gone (killed, or stopped on an error of its own) fails here as `rank_lost`."""
        try:
            return call()
        except (RuntimeError, pickle.UnpicklingError, ConnectionError) as e:  # gloo: connection closed, timeouts
            raise ConfigError(Code.RANK_LOST, f"rank {self.rank} of {self.size} lost its peers ({str(e)[:160]}): "
                                              "every rank stops; the run's state is its last checkpoint's, and "
                                              "running the same command again resumes it") from e


def _error(rank: int, code: str | None, detail: str, kind: str | None) -> GovtrainError:
    """What another rank raised, as this rank raises it: a govtrain error with its code and class, or `rank_lost`."""
    if code is None:
        return ConfigError(Code.RANK_LOST, f"rank {rank} failed ({detail}): every rank stops; the run's state is its "
                                           "last checkpoint's, and running the same command again resumes it")
    error = getattr(errors, kind or "", None)
    error = error if isinstance(error, type) and issubclass(error, GovtrainError) else ConfigError
    return error(Code(code), f"rank {rank}: {detail}")


def _env_int(name: str, default: int | None = None) -> int:
    value = os.environ.get(name)
    if value is None and default is not None:
        return default
    try:
        return int(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ConfigError(Code.RUN_CONFIG_INVALID, f"{name}={value!r} is not an integer: start the ranks with "
                                                   "torchrun or govtrain train --nproc N") from None
