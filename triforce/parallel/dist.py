"""Tensor-parallel process group: one process per rank, launched by torchrun.

The model itself knows nothing about processes (model/transformer.py); the loader gives each rank
its Megatron shard, and `attach` hands model.tensor_parallel.apply_tp the one collective tensor
parallelism needs: the sum of the row-parallel partial outputs (attention's wo, the MLP's w2).
The same `all_reduce` (with its failure handling) serves the front ends' own collectives.

Every rank then computes bit-identical logits (an all-reduce hands every rank the same sum, and
everything after it - norm, replicated LM head, sampling with a generator seeded alike - is
replicated), so ranks agree on every token without a broadcast or a barrier per token.

Failure handling: collectives carry a timeout (SPEC_TP_TIMEOUT seconds, default 60). On gloo a
dead peer surfaces at once as a connection error and a hung one after the timeout; either way
the all-reduce hook turns it into a one-line `UserError`. On NCCL a hang is caught by torch's
watchdog, which aborts the process after the same timeout.
"""
from __future__ import annotations

import atexit
import datetime
import os
import re
import sys

import torch
import torch.distributed as dist

from triforce.model.errors import PeerStopped, UserError
from triforce.model.tensor_parallel import apply_tp

DEFAULT_TIMEOUT_S = 60.0
# how long the other ranks wait for what a person types at rank 0's terminal (chat): without the
# collectives' timeout, or a question pondered for a minute ended the chat
PERSON_WAIT = datetime.timedelta(days=7)
TIMEOUT_ENV = "SPEC_TP_TIMEOUT"  # seconds a collective may wait for the other ranks
CHECK_ENV = "SPEC_TP_CHECK"  # 1: compare logits across ranks after every forward (debugging)
FAILED_EXIT_STATUS = 2  # what run_cli returns for a UserError


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's environment; None outside torchrun."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
    except ValueError:
        raise UserError("RANK, WORLD_SIZE and LOCAL_RANK must be integers (torchrun sets them)") from None
    if not 0 <= rank < world:
        raise UserError(f"RANK {rank} is outside WORLD_SIZE {world}; launch with torchrun")
    return rank, world, local


def timeout_from_env() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise UserError(f"{TIMEOUT_ENV}={raw!r} is not a positive number of seconds")
    return value


class TensorParallel:
    """This process's place in the tensor-parallel group; `group` is None for a lone process."""

    def __init__(self, rank: int, world_size: int, local_rank: int, device: str, timeout: float,
                 group=None, check: bool = False):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device, self.timeout, self.group, self.check = device, timeout, group, check
        self.failed = False
        self._input_group = None  # share_input's gloo group, made on first use
        if group is not None:
            atexit.register(self._at_exit)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over ranks in place: the model's hook after each row-parallel linear."""
        try:
            dist.all_reduce(x, group=self.group)
        except RuntimeError as e:  # DistBackendError, gloo timeouts and closed connections
            raise self._stopped(e) from None
        return x

    def all_agree(self, ok: bool) -> bool:
        """True when every rank says ok (one small all-reduce of a 0/1 flag; a lone process: ok)."""
        if self.group is None:
            return ok
        flag = torch.tensor([0.0 if ok else 1.0], device=self.device)
        return self.all_reduce(flag).item() == 0

    def follow_main(self, value: int) -> int:
        """Rank 0's value on every rank (one small all-reduce: the others add zero). An adaptive
        generator's plan: ranks time their passes differently but must run the same one."""
        if self.group is None:
            return value
        box = torch.tensor([float(value) if self.rank == 0 else 0.0], device=self.device)
        return int(self.all_reduce(box).item())

    def share(self, read, group=None):
        """read() on rank 0, its (picklable) result on every rank: under torchrun only rank 0 has the
        terminal, and the other ranks follow what it read (over `group`, default the ranks' own)."""
        if self.group is None:
            return read()
        box = [read() if self.rank == 0 else None]
        try:
            dist.broadcast_object_list(box, src=0, group=group or self.group)
        except RuntimeError as e:
            raise self._stopped(e) from None
        return box[0]

    def share_input(self, read):
        """share() for what a person types at rank 0's terminal: the other ranks wait as long as that
        takes, in a gloo group of its own without the collectives' timeout (a rank 0 that exits still
        ends their wait at once: the connection closes). Every rank calls it at the same points."""
        if self.group is not None and self._input_group is None:
            try:
                self._input_group = dist.new_group(backend="gloo", timeout=PERSON_WAIT)
            except RuntimeError as e:
                raise self._stopped(e) from None
        return self.share(read, self._input_group)

    def check_consistent(self, x: torch.Tensor, what: str = "logits") -> None:
        """Raise if ranks hold different x (one small all-reduce and a host sync: debugging only)."""
        s = x.double().sum().reshape(1)
        spread = torch.cat([s, -s]).to(x.device)
        try:
            dist.all_reduce(spread, op=dist.ReduceOp.MAX, group=self.group)
        except RuntimeError as e:
            raise self._stopped(e) from None
        high, low = spread[0].item(), -spread[1].item()
        if high != low:
            raise UserError(f"tensor-parallel workers computed different {what} (checksums {low!r} .. {high!r}); "
                            f"the ranks run different code, inputs or settings")

    def _stopped(self, e: Exception) -> PeerStopped:
        self.failed = True
        others = str(1 - self.rank) if self.world_size == 2 else f"other than {self.rank}"
        return PeerStopped(f"tensor-parallel worker {others} stopped responding ({_reason(e)}); worker {self.rank} "
                         f"gives up (collectives wait at most {self.timeout:g} s, {TIMEOUT_ENV}): check the other "
                         f"worker's output")

    # ------------------------------------------------------------------ model
    def attach(self, model):
        """Sum the row-parallel outputs of a model loaded with this world size (its local shard)
        across the group (model.tensor_parallel.apply_tp); SPEC_TP_CHECK adds the logits check."""
        if model.world_size != self.world_size:
            raise ValueError(f"model was sharded for world size {model.world_size}, the group has {self.world_size}")
        if self.group is None:
            return model  # one rank: nothing to sum
        return apply_tp(model, self.all_reduce, self.check_consistent if self.check else None)

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        if self.group is not None and not self.failed and dist.is_initialized():
            dist.destroy_process_group()
        self.group = None

    def _at_exit(self) -> None:
        if self.failed:
            # a group whose peer died can abort the interpreter while it is torn down
            # ("terminate called without an active exception"); the error line is already out
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(FAILED_EXIT_STATUS)
        self.close()


def _reason(e: Exception) -> str:
    """The first sentence of a backend error, without its source-file prefix."""
    text = " ".join(str(e).split())
    text = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*", "", text)
    return text.split(". ")[0].rstrip(".")[:200] or type(e).__name__


def resolve_device(spec: str, local_rank: int = 0, local_world: int = 1) -> str:
    """The device a process runs on, from --device: cpu, cuda, cuda:N or auto (a GPU when torch sees
    one). The one resolver of every front end: a rank of a group with several ranks on this node
    (`local_world` > 1) gets cuda:<local rank>, one GPU per rank."""
    kind = _device_kind(spec)
    if kind == "cpu":
        return "cpu" if spec == "auto" else spec
    if not torch.cuda.is_available():
        raise UserError("Settings.device cuda asked for, but torch sees no CUDA device; use Settings.device cpu")
    if local_world == 1:
        return "cuda" if spec == "auto" else spec
    count = torch.cuda.device_count()
    if count < local_world:
        raise UserError(f"{local_world} tensor-parallel ranks on this node need {local_world} GPUs but torch sees "
                        f"{count}; lower --tp / --nproc_per_node or use --device cpu")
    return f"cuda:{local_rank}"


def _device_kind(spec: str) -> str:
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(spec).type
    except RuntimeError:  # torch lists every backend it knows; only two are served here
        kind = None
    if kind not in ("cpu", "cuda"):
        raise UserError(f"Settings.device {spec} not understood: use cpu, cuda, cuda:N or auto")
    return kind


def setup_tensor_parallel(tp: int, device: str = "auto", timeout: float | None = None,
                          check: bool | None = None) -> TensorParallel:
    """Join the tensor-parallel group torchrun started (NCCL on CUDA, gloo on CPU).

    Outside torchrun only tp=1 makes sense: a lone process, no group, nothing to reduce.
    """
    timeout = timeout_from_env() if timeout is None else timeout
    check = os.environ.get(CHECK_ENV, "0") not in ("", "0") if check is None else check
    env = torchrun_env()
    if env is None:
        if tp != 1:
            raise UserError(f"--tp {tp} needs {tp} processes: launch with `torchrun --nproc_per_node={tp} -m "
                            f"triforce.cli.generate --tp {tp} ...` or `triforce-tp --nproc {tp} ...`")
        return TensorParallel(0, 1, 0, resolve_device(device), timeout)
    rank, world, local = env
    if tp != world:
        raise UserError(f"--tp {tp} but torchrun started {world} process(es) (WORLD_SIZE={world}); "
                        f"pass --tp {world} or launch with --nproc_per_node={tp}")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    where = resolve_device(device, local, local_world)
    kwargs = dict(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
    if where.startswith("cuda"):
        torch.cuda.set_device(where)
        kwargs.update(backend="nccl", device_id=torch.device(where))
    try:
        dist.init_process_group(rank=rank, world_size=world, **kwargs)
    except (RuntimeError, ValueError) as e:  # rendezvous timeout, port in use, bad MASTER_ADDR
        raise PeerStopped(f"tensor-parallel worker {rank} could not join the group of {world} "
                        f"({_reason(e)}); check MASTER_ADDR/MASTER_PORT and that every worker started") from None
    tp = TensorParallel(rank, world, local, where, timeout, group=dist.group.WORLD, check=check)
    # every rank connected before any goes on: a rank that then met an error and left at once broke
    # a peer's half-made connections (gloo's connectFullMesh), which said two more lines than its own
    tp.all_agree(True)
    return tp
