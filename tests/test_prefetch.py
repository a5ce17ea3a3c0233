"""The prefetching thread (``training.data.prefetch``) never leaves the step waiting without
end, and the CUDA sequencing (``training.data.cuda_sequence``) in its order: a thread that
died (whatever it raised, wherever) is one RuntimeError, a loader that gives nothing within
``batch_timeout`` is a lost-data item, a stop request while waiting is a ``WaitInterrupted``
item, an out-of-memory copy to the device is a ``BatchOutOfMemory`` item and the next
batches still come; on a CPU, with a fake of the device API that records its calls. Tiny
in-memory clips, one process, no training process started."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import GradientState
from torch.utils.data import DataLoader, Dataset

from conftest import valid_config
from taehv_train.base.errors import UserError
from taehv_train.common.clips import VideoDataError
from taehv_train.common.config import TrainConfig
from taehv_train.training.data.cuda_sequence import DeviceFeed, IdleClock
from taehv_train.training.data.prefetch import BatchOutOfMemory, Fetched, Prefetcher, WaitInterrupted
from taehv_train.training.loop.progress import Progress
from taehv_train.training.loop.resilience import FaultPlan
from taehv_train.training.preflight import check
from train_runs import tiny_train_step

FRAMES, SIZE = 5, 8
BOUND_S = 20.0  # a call that takes longer is taken for a hang


class Halt(BaseException):
    """Not an Exception: what a bare ``except Exception`` lets through."""


class Clips(Dataset):
    """Tiny clips in order (frames filled with the clip's index); reading clip ``raise_at``
    raises ``error``; reading a clip from ``block_from`` on waits until ``release`` is set."""

    def __init__(self, count: int, raise_at: int = -1, error: BaseException | None = None, block_from: int = -1):
        self.count, self.raise_at, self.error, self.block_from = count, raise_at, error, block_from
        self.release = threading.Event()

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> dict:
        if index == self.raise_at:
            raise self.error
        if 0 <= self.block_from <= index:
            self.release.wait()
        return {"frames": torch.full((FRAMES, 3, SIZE, SIZE), index, dtype=torch.uint8), "failures": 0}


@pytest.fixture
def accelerator() -> Accelerator:
    return Accelerator(cpu=True)


@pytest.fixture(autouse=True)
def forget_loaders():
    yield
    GradientState._reset_state()  # a loader whose iteration failed or was left stays registered as iterating


def prefetcher(accelerator: Accelerator, dataset: Dataset, workers: int = 0, **options) -> Prefetcher:
    loader = accelerator.prepare(DataLoader(dataset, batch_size=1, num_workers=workers))
    return Prefetcher(loader, accelerator, Progress(), **options)


def bounded(call: Callable, seconds: float = BOUND_S):
    """``call()``'s result (or its exception, raised here) when it returns within ``seconds``;
    a failed test otherwise, where the code under test would hang."""
    outcome: dict = {}

    def run() -> None:
        try:
            outcome["value"] = call()
        except BaseException as err:  # noqa: BLE001 - handed to the test
            outcome["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def frames_value(item: Fetched) -> int:
    return int(item.batch["frames"].flatten()[0])


@pytest.mark.parametrize(
    "error", [Halt("the disk is on fire\nsecond line"), KeyboardInterrupt("interrupted")], ids=["custom", "keyboard"]
)
def test_a_loader_that_raises_a_base_exception_is_one_runtime_error_after_its_batches(accelerator, error):
    batches = prefetcher(accelerator, Clips(6, raise_at=3, error=error))
    try:
        # the prepared loader reads one batch ahead: clip 3 raises before clip 2 is handed out
        assert [frames_value(bounded(lambda: next(batches))) for _ in range(2)] == [0, 1]
        with pytest.raises(RuntimeError) as raised:
            bounded(lambda: next(batches))
        message = str(raised.value)
        first = str(error).splitlines()[0]
        assert message == f"the batch-prefetching thread ended without a batch: {type(error).__name__}: {first}"
        assert raised.value.__cause__ is error
        with pytest.raises(RuntimeError, match="ended without a batch"):  # again, not a hang
            bounded(lambda: next(batches))
    finally:
        batches.close()


class NoLength(DataLoader):
    def __len__(self) -> int:
        raise ValueError("this loader has no length")


def test_a_thread_that_dies_before_its_first_batch_is_one_runtime_error(accelerator):
    """``len(loader)``, the first thing the thread does, raises."""
    batches = Prefetcher(NoLength(Clips(3)), accelerator, Progress())
    try:
        with pytest.raises(RuntimeError, match="ended without a batch: ValueError: this loader has no length$"):
            bounded(lambda: next(batches))
    finally:
        batches.close()


def test_a_loader_that_gives_nothing_within_the_bound_is_lost_data(accelerator):
    clips = Clips(3, block_from=0)
    progress = Progress(epoch=2, batch_in_epoch=2)
    loader = accelerator.prepare(DataLoader(clips, batch_size=1))
    batches = Prefetcher(loader, accelerator, progress, batch_timeout=1)
    try:
        started = time.monotonic()
        item = bounded(lambda: next(batches))
        waited = time.monotonic() - started
        assert isinstance(item.batch, VideoDataError) and 1.0 <= waited < 5.0
        assert item.batch.reason == (
            "no batch came from the loader within 1 s (batch_timeout): a stalled loader worker or storage"
        )
        # the item stands for the next batch, the epoch's last; the next ones at once, through the epochs
        assert (item.epoch, item.index, item.last_in_epoch) == (2, 3, True)
        assert (progress.epoch, progress.batch_in_epoch) == (2, 3)
        started = time.monotonic()
        following = [bounded(lambda: next(batches)) for _ in range(2)]
        assert time.monotonic() - started < 0.5
        assert [(f.batch, f.epoch, f.index, f.last_in_epoch) for f in following] == [
            (item.batch, 3, 1, False),
            (item.batch, 3, 2, False),
        ]
    finally:
        clips.release.set()
        batches.close()


def test_a_stop_requested_while_waiting_for_a_batch_interrupts_the_wait(accelerator):
    clips = Clips(4, block_from=2)  # the prepared loader reads one batch ahead: clip 1 comes, clip 2 never
    requested = threading.Event()
    batches = prefetcher(accelerator, clips, stopping=requested.is_set)
    try:
        assert frames_value(bounded(lambda: next(batches))) == 0
        timer = threading.Timer(0.5, requested.set)
        timer.start()
        started = time.monotonic()
        item = bounded(lambda: next(batches))
        assert 0.4 < time.monotonic() - started < 5.0
        assert isinstance(item.batch, WaitInterrupted) and "stop was requested" in str(item.batch)
        assert (item.epoch, item.index, item.last_in_epoch) == (0, 2, False)
        started = time.monotonic()
        again = [bounded(lambda: next(batches)) for _ in range(3)]
        assert time.monotonic() - started < 0.5
        assert [(f.batch, f.epoch, f.index, f.last_in_epoch) for f in again] == [
            (item.batch, 0, 3, False),
            (item.batch, 0, 4, True),
            (item.batch, 1, 1, False),
        ]
        assert (batches.position.epoch, batches.position.batch_in_epoch) == (1, 1)
        clips.release.set()
        started = time.monotonic()
        batches.close()
        assert time.monotonic() - started < 5.0  # the run saves next: close does not wait for the loader
    finally:
        clips.release.set()
        batches.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_an_out_of_memory_copy_costs_that_batch_and_the_next_ones_come(accelerator, workers):
    """``oom_copy@N`` raises a real ``torch.OutOfMemoryError`` at this process's N-th copy;
    the one for rank 1 does not fire on rank 0."""
    faults = FaultPlan.parse("oom_copy@2,oom_copy@4:1")
    batches = prefetcher(accelerator, Clips(5), workers, faults=faults)
    try:
        items = [bounded(lambda: next(batches)) for _ in range(7)]
    finally:
        batches.close()
    failed = items[1].batch
    assert isinstance(failed, BatchOutOfMemory)
    assert str(failed) == (
        "out of memory copying batch 2 of epoch 0 to cpu (OutOfMemoryError: injected out-of-memory error in the copy "
        "of batch 2 to the device (fault_injection oom_copy@2))"
    )
    assert [(i.epoch, i.index, i.last_in_epoch) for i in items] == [
        (0, 1, False),
        (0, 2, False),
        (0, 3, False),
        (0, 4, False),
        (0, 5, True),
        (1, 1, False),
        (1, 2, False),
    ]
    assert [frames_value(i) for i in items if i is not items[1]] == [0, 2, 3, 4, 0, 1]


def test_batch_timeout_below_zero_is_refused(tmp_path):
    with pytest.raises(UserError, match="batch_timeout=-1.0 must be >= 0"):
        check(valid_config(tmp_path, batch_timeout=-1.0))
    assert TrainConfig().batch_timeout > 0  # a bound by default


class FakeCuda:
    """The device API of ``training.data.cuda_sequence``, recording its calls in ``log``:
    streams and events are named, tensors known by the id of the copy made."""

    def __init__(self, oom_at_copy: int = 0):
        self.log: list[tuple] = []
        self.events = 0
        self.copies = 0
        self.oom_at_copy = oom_at_copy
        self.consumer = FakeStream("consumer", self.log)

    def stream(self, device: torch.device) -> FakeStream:
        self.log.append(("stream", device.type))
        return FakeStream("side", self.log)

    def current_stream(self, device: torch.device) -> FakeStream:
        self.log.append(("current_stream",))
        return self.consumer

    def use_stream(self, stream: FakeStream):
        log = self.log

        class Use:
            def __enter__(self):
                log.append(("use", stream.name))

            def __exit__(self, *exc):
                log.append(("end use", stream.name))

        return Use()

    def event(self, timing: bool = False) -> FakeEvent:
        self.events += 1
        return FakeEvent(f"{'idle' if timing else 'copied'}-{self.events}", self.log)

    def copy(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        self.copies += 1
        if self.copies == self.oom_at_copy:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        copied = tensor.clone()
        self.log.append(("copy", id(copied)))
        return copied

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", id(tensor), stream.name))


class FakeStream:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))


class FakeEvent:
    def __init__(self, name: str, log: list):
        self.name, self.log = name, log

    def record(self, stream: FakeStream | None = None) -> None:
        self.log.append(("record", self.name, stream.name if stream else "current"))

    def synchronize(self) -> None:
        self.log.append(("synchronize", self.name))

    def elapsed_time(self, end: FakeEvent) -> float:
        return 250.0


def test_the_copy_is_on_the_side_stream_and_the_taking_stream_waits_for_it(accelerator):
    """The fake device API: each batch is copied on the side stream, an event is recorded
    there after its copies, and the taking thread's stream waits for that event before the
    batch is handed over; then every tensor is marked as used by that stream."""
    fake = FakeCuda()
    feed = DeviceFeed(torch.device("cuda"), fake)
    batches = prefetcher(accelerator, Clips(4), feed=feed)
    try:
        items = [bounded(lambda: next(batches)) for _ in range(3)]
    finally:
        batches.close()
    log = fake.log
    assert log[0] == ("stream", "cuda") and log.count(("stream", "cuda")) == 1  # one side stream
    for item in items:
        tensors = [id(value) for value in item.batch.values() if isinstance(value, torch.Tensor)]
        assert len(tensors) == 2  # frames and failures, as copied (not the loader's tensors)
        copies = [log.index(("copy", t)) for t in tensors]
        recorded = log.index(("record", item.ready.name, "side"))
        use = max(i for i, entry in enumerate(log[: min(copies)]) if entry == ("use", "side"))
        assert ("end use", "side") not in log[use:recorded] and log[recorded + 1] == ("end use", "side")
        waited = log.index(("wait_event", "consumer", item.ready.name))
        marked = [log.index(("record_stream", t, "consumer")) for t in tensors]
        assert max(copies) < recorded < waited < min(marked)
        assert log[waited - 1] == ("current_stream",)


def test_a_copy_out_of_memory_inside_the_device_api_is_that_batch_only(accelerator):
    """A real ``torch.OutOfMemoryError`` from the copy itself (the second tensor of the
    second batch): no event is recorded for it, and the batches after it are copied."""
    fake = FakeCuda(oom_at_copy=4)
    batches = prefetcher(accelerator, Clips(4), feed=DeviceFeed(torch.device("cuda"), fake))
    try:
        items = [bounded(lambda: next(batches)) for _ in range(4)]
    finally:
        batches.close()
    assert isinstance(items[1].batch, BatchOutOfMemory) and items[1].ready is None
    assert "batch 2 of epoch 0 to cuda (OutOfMemoryError: CUDA out of memory. Tried to allocate" in str(items[1].batch)
    assert [frames_value(i) for i in (items[0], items[2], items[3])] == [0, 2, 3]
    assert [e[2] for e in fake.log if e[0] == "wait_event"] == [items[i].ready.name for i in (0, 2, 3)]


def test_the_idle_clock_brackets_the_wait_for_a_batch():
    """In the training step (one window of one micro-batch, its loader prepared by
    ``TrainStep.build``): the idle clock's pause event is recorded before the taking stream
    waits for the batch's copy, its resume event right after; the gaps are measured once
    the last one has reached the GPU."""
    train_step, loader = tiny_train_step(FRAMES, SIZE, loader=DataLoader(Clips(3), batch_size=1))
    assert loader.device is None  # prepared without device placement: the prefetching thread copies
    fake = FakeCuda()
    cuda = torch.device("cuda")
    train_step.idle = IdleClock(cuda, fake)
    batches = Prefetcher(loader, train_step.accelerator, Progress(), feed=DeviceFeed(cuda, fake))
    try:
        result = train_step(batches, window=1)
    finally:
        batches.close()
    assert result.applied
    seconds = train_step.idle.take_seconds()
    # what the taking thread asked of the device, in order (the fetching thread's calls left out)
    taking = [
        entry
        for entry in fake.log
        if entry[0] in ("current_stream", "wait_event", "record_stream", "synchronize")
        or (entry[0] == "record" and entry[1].startswith("idle"))
    ]
    kinds = ["idle" if entry[0] == "record" else entry[0] for entry in taking]
    assert kinds[:6] == ["idle", "current_stream", "wait_event", "record_stream", "record_stream", "idle"]
    assert all(entry[2] == "current" for entry in taking if entry[0] == "record")  # on the training stream
    idle = [entry[1] for entry in taking if entry[0] == "record"]  # pause, resume, pause, ...
    gaps = len(idle) // 2
    assert seconds == pytest.approx(0.25 * gaps) and taking[-1] == ("synchronize", idle[2 * gaps - 1])
