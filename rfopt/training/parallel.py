"""One trial over several devices: its chunks as one data-parallel job (``torch.distributed``, DDP through TRL's
own Accelerate path), under the same worker loop.

A data-parallel worker is a group of K processes, one per device (`DataParallel`: this process's rank in it).
Rank 0, the lead, is an ordinary rfopt worker: it holds the leases, loads and saves checkpoints, evaluates,
reports and prunes, exactly as for a one-device trial (so chunking, checkpoints, pruning, clones and resume are
the one-device code). Only training a chunk is shared: before each chunk the lead broadcasts the trial's config
and state (adapter, optimizer, scheduler, RNG, counters) and the other ranks (`follow`) train the same chunk in
lockstep, each on its 1/K of every batch, their gradients averaged by DDP; they keep nothing between chunks.

The trial's config keeps its meaning: ``per_device_train_batch_size`` is the batch of the trial as if on one
device (the global batch), split evenly over the K devices, so the chunk plan, the step counts and the
checkpoints are those of the one-device trial, and a trial can resume on another K.

Exactness. GRPO samples its rollouts from the torch generator; K processes drawing for their own rows draw other
numbers than one process drawing for all. So a data-parallel trial samples each completion from a random
stream of its own (`RowSampler`), keyed by the trial's seed, the optimizer step and the row's place in the
global batch: its rollouts do not depend on how the batch is split. A trial on K devices then matches the same
trial with one device (``devices_per_trial=1``, the same global batch) up to the order of floating-point sums
(the all-reduce, a batch's matmuls); tests/training/test_parallel.py bounds it. Sampling per row differs from TRL's
sampling, so a data-parallel trial does not match a trial trained without it (`devices_per_trial` None),
though both are GRPO with the same distribution of rollouts.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rfopt.errors import Refusal
from rfopt import compat
from rfopt.chunks import ChunkPlan, TrialSchedule
from rfopt.config.trial import TrialConfig
from rfopt.storage.state import TrialSnapshot

from .models import ModelPool
from .runner import ChunkAborted, ChunkMetrics, StepDone, TrialRunner

logger = logging.getLogger("rfopt")

TIMEOUT_SECONDS = float(os.environ.get("RFOPT_DATA_PARALLEL_TIMEOUT", "600"))
"""How long a rank waits for the others in a collective before the group fails (a rank died or hangs)."""


@dataclass(frozen=True)
class DataParallel:
    """This process's place in a data-parallel group: rank `rank` of `world_size`, meeting at `address`:`port`."""

    rank: int
    world_size: int
    address: str = "127.0.0.1"
    port: int = 29500

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise Refusal(f"data parallel: rank {self.rank} of {self.world_size} devices; give 0 <= rank < "
                             "world_size")

    @property
    def lead(self) -> bool:
        return self.rank == 0

    def start(self, device: str) -> None:
        """Join the group (call before anything builds a TrainingArguments: Accelerate reads the environment
        once per process). One device: nothing to join."""
        if self.world_size == 1:
            return
        import torch
        import torch.distributed as dist

        local = device.partition(":")[2] or "0"
        os.environ.update(RANK=str(self.rank), WORLD_SIZE=str(self.world_size), LOCAL_RANK=local,
                          LOCAL_WORLD_SIZE=str(self.world_size), MASTER_ADDR=self.address, MASTER_PORT=str(self.port))
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(backend, init_method=f"tcp://{self.address}:{self.port}", rank=self.rank,
                                world_size=self.world_size, timeout=datetime.timedelta(seconds=TIMEOUT_SECONDS))

    def stop(self) -> None:
        import torch.distributed as dist

        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()

    def broadcast(self, obj: Any = None) -> Any:
        """The lead's `obj` on every rank."""
        import torch.distributed as dist

        box = [obj if self.lead else None]
        dist.broadcast_object_list(box, src=0, device=_collective_device())
        return box[0]

    def any(self, flag: bool) -> bool:
        """True on every rank if `flag` is True on any."""
        import torch
        import torch.distributed as dist

        value = torch.tensor([1.0 if flag else 0.0], device=_collective_device())
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())


def _collective_device() -> Any:
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


@dataclass
class ChunkJob:
    """What the lead sends the other ranks before each chunk: the trial as it stands."""

    number: int
    config_json: str
    plan: ChunkPlan
    schedule: TrialSchedule
    start_unit: int
    state: TrialSnapshot


class DataParallelRunner(TrialRunner):
    """A `TrialRunner` whose chunks train on every rank of `group` (the lead's; `follow` runs the others')."""

    def __init__(self, *args: Any, group: DataParallel, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.group = group
        self.per_device = self._per_device()

    def _per_device(self) -> int:
        batch = self.config.args.per_device_train_batch_size
        per_device, rest = divmod(batch, self.group.world_size)
        if rest or per_device < 1:
            raise Refusal(f"trial {self.number}: per_device_train_batch_size {batch} (the trial's batch, split "
                             f"over its devices) cannot be split evenly over {self.group.world_size} devices; give "
                             f"a multiple of {self.group.world_size}")
        return per_device

    def chunk_args(self, report: bool = True) -> Any:
        # generation_batch_size follows (per device x devices x steps_per_generation: the trial's own).
        # DDP reduces only the adapter, which every step uses whole: no search for unused parameters.
        return dataclasses.replace(super().chunk_args(report), per_device_train_batch_size=self.per_device,
                                   generation_batch_size=None, ddp_find_unused_parameters=False)

    def train_chunk(self, should_stop: Callable[[], bool] | None = None,
                    rollout_func: Callable[[list[Any], Any], dict[str, Any]] | None = None,
                    on_step: Callable[[StepDone], None] | None = None, in_gang: bool = False,
                    on_trainer: Callable[[Any], None] | None = None) -> ChunkMetrics:
        """`TrialRunner.train_chunk`, as one data-parallel job; a trial over several devices trains alone (on the exact
        rollout backend: each rank generates its own rows), so it takes no `rollout_func`."""
        if rollout_func is not None:
            raise Refusal(f"trial {self.number}: a data-parallel trial generates on each of its devices; it cannot "
                             "share a batched decode")
        group = self.group
        if group.world_size > 1 and group.lead:
            group.broadcast(ChunkJob(self.number, self.config.to_json(), self.plan, self.schedule, self.start_unit,
                                     self.state()))
        stop = should_stop
        if group.world_size > 1:  # every rank stops at the same step, or the others wait for it forever
            stop = lambda: group.any(should_stop is not None and should_stop())  # noqa: E731
        model = self.model
        with compat.data_parallel_model(model), row_sampled_generation(model, self, group):
            return super().train_chunk(stop, on_step=on_step, in_gang=in_gang, on_trainer=on_trainer)


def follow(group: DataParallel, pool: ModelPool, train_dataset: Any, workdir: str | Path) -> int:
    """Run the chunks the lead sends until it says it is done; return how many this rank trained."""
    trained = 0
    while True:
        job: ChunkJob | None = group.broadcast()
        if job is None:
            return trained
        runner = DataParallelRunner(job.number, TrialConfig.from_json(job.config_json), job.plan, job.schedule,
                                    train_dataset, pool, workdir, job.start_unit, group=group)
        try:
            runner.load_state(job.state)
            runner.train_chunk()
            trained += 1
        except ChunkAborted:
            pass
        finally:
            runner.cleanup()


def lead_done(group: DataParallel) -> None:
    """Tell the other ranks that no chunk follows (the lead's worker loop ended)."""
    if group.world_size > 1 and group.lead:
        group.broadcast(None)


# ---------------------------------------------------------------------- sampling per row
class RowSampler:
    """A logits processor that samples every row's next token with the batched decoder's vectorized sampler
    (`rfopt.training.rollouts.sampler`) from a noise stream of its own, keyed by ``(seed, step, row)`` where `step`
    names the generation (the trial's step at the chunk's start, and which generation of the chunk) and `row` is the
    row's index in the global batch; it returns logits that leave the sampled token the only choice, so the
    generation's own sampling picks it. The temperature, top-k, top-p and min-p of `generation_config` are applied
    first, as transformers applies them."""

    def __init__(self, seed: int, step: tuple[int, int], first_row: int, generation_config: Any) -> None:
        from .rollouts.sampler import Sampling

        self.seed, self.step, self.first_row = seed, step, first_row
        config = generation_config
        self.sampling = Sampling(
            max_new_tokens=1, eos_token_ids=(), pad_token_id=0, do_sample=True,
            temperature=1.0 if config.temperature is None else float(config.temperature),
            top_k=config.top_k or None, top_p=1.0 if config.top_p is None else float(config.top_p), min_p=config.min_p)
        self.token = 0
        self._rows: tuple[Any, Any] | None = None

    def row_seed(self, row: int) -> int:
        import hashlib

        key = f"{self.seed}:{self.step[0]}:{self.step[1]}:{row}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & (2**63 - 1)

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        import torch

        from .rollouts.sampler import Features, RowSettings, row_key, sample, uniform_noise

        rows, vocab = scores.shape
        if self._rows is None:
            keys = torch.tensor([row_key(self.row_seed(self.first_row + i), 0) for i in range(rows)],
                                device=scores.device)
            self._rows = (RowSettings.of([self.sampling] * rows, rows, vocab, scores.device), keys)
        settings, keys = self._rows
        features = Features.of([self.sampling])  # the repetition penalty: generate's own processors, before this one
        picks, _ = sample(scores.float(), settings, features,
                          noise=uniform_noise(keys, torch.tensor(self.token, device=scores.device)))
        self.token += 1
        only = torch.full_like(scores, float("-inf"))
        return only.scatter_(1, picks[:, None], 0.0)


@contextmanager
def row_sampled_generation(model: Any, runner: TrialRunner, group: DataParallel) -> Iterator[None]:
    """While a chunk trains, the trainer's generations sample per row (`RowSampler`), each generation named by the
    trial's step at the chunk's start and its place among the chunk's generations (the same on every rank, and
    for every split of the trial into chunks: chunk boundaries are the plan's)."""
    seed = runner.config.args.seed
    start = runner.global_step
    calls = {"n": 0}

    def processor(generation_config: Any, rows: int) -> RowSampler:
        calls["n"] += 1
        return RowSampler(seed, (start, calls["n"]), group.rank * rows, generation_config)

    with compat.extra_logits_processor(model, processor):
        yield


__all__ = ["ChunkJob", "DataParallel", "DataParallelRunner", "RowSampler", "follow", "lead_done",
           "row_sampled_generation"]
