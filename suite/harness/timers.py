"""Timers: how one call, or a window of calls, is timed. `CudaTimer` (CUDA events, graph
replays, eager windows, the L2 flush), `WallTimer` (the host's clock, for arms that are not CUDA
kernels) and `host_us_per_call`; the bench driver (`suite.harness.timing`) takes any `Timer`,
tests a fake one."""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Protocol

import torch


class Timer(Protocol):
    """How one contender is timed: CUDA events on the GPU, a fake in tests."""

    def time_calls(
        self, fn: Callable[[], Any], n: int, *, flush_l2: bool, window: int, lead_in: bool = True
    ) -> list[float]:
        """n timings in ms; each is one call, or a window of calls divided by the window.
        lead_in: without an L2 flush, each timing starts behind one untimed call (a timer
        without a queue, the wall clock's, ignores it)."""
        ...

    def time_cold(self, fn: Callable[[], Any]) -> float:
        """ms of the first call alone (compile, autotune, capture included)."""
        ...

    def tail_ms(self, fn: Callable[[], Any]) -> float:
        """ms of device work one call still has queued when it returns to the host: the most
        that starting it on an idle device, without a lead-in call, adds to its timing. Asked in
        eager mode only (a wall timing waits for its work; the wall timer has none)."""
        ...


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside a timed window (as timeit does): a
    collection that fires there lands in whichever host-bound step it interrupts, as noise
    that belongs to no contender."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class HeldMemory:
    """What `memory_held` saw: the device's peak before it reset the counter, and the most memory
    held inside above what was allocated when it began."""

    prior_peak: int = 0
    held: int = 0


@contextlib.contextmanager
def memory_held(device: torch.device) -> Iterator[HeldMemory]:
    """The device memory the work inside holds at its peak, from a drained queue and a reset
    peak counter; the peak before the reset is in `prior_peak` at once, for a caller that
    tracks a whole run's."""
    with torch.cuda.device(device):
        torch.cuda.synchronize()
        found = HeldMemory(prior_peak=torch.cuda.max_memory_allocated())
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        yield found
        torch.cuda.synchronize()
        found.held = torch.cuda.max_memory_allocated() - before


class CudaTimer:
    """Times with CUDA event pairs on the current stream of `device`."""

    def __init__(self, device: torch.device | str | int) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"CudaTimer needs a CUDA device, got {self.device}")
        self._flush: torch.Tensor | None = None
        # the device's peak before peak_bytes reset its counter, for a caller that tracks a run's
        self.peak_before_reset = 0

    def _flush_buffer(self) -> torch.Tensor:
        if self._flush is None:
            l2 = torch.cuda.get_device_properties(self.device).L2_cache_size
            # writing twice the L2 evicts every line the previous call left there
            self._flush = torch.empty(2 * l2, dtype=torch.int8, device=self.device)
        return self._flush

    def time_calls(
        self, fn: Callable[[], Any], n: int, *, flush_l2: bool, window: int, lead_in: bool = True
    ) -> list[float]:
        if n < 1 or window < 1:
            raise ValueError("n and window must be >= 1")
        with torch.cuda.device(self.device):
            flush = self._flush_buffer() if flush_l2 else None
            pairs = [
                (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                for _ in range(n)
            ]
            # Drain earlier work (another contender's calls) so it cannot leak into the first
            # pair. Every pair then starts behind queued work of this call's own: the L2 flush,
            # or else one untimed call (the previous window's place in a loop). A device-bound
            # call's pair then measures device time, not the launch latency of an idle device,
            # and a window of host-bound steps, whose device waits for the host, measures
            # dispatch included. A long call with a short tail (lead_in False) needs none:
            # the idle start is a negligible part of it (TimingPolicy.idle_tail_share).
            torch.cuda.synchronize()
            with _collector_paused():
                if flush is None and lead_in:
                    fn()
                for start, end in pairs:
                    if flush is not None:
                        flush.zero_()
                    start.record()
                    for _ in range(window):
                        fn()
                    end.record()
                torch.cuda.synchronize()
            return [start.elapsed_time(end) / window for start, end in pairs]

    def capture(self, fn: Callable[[], Any]) -> Callable[[], Any]:
        """One call of fn captured in a CUDA graph; returns its replay."""
        with torch.cuda.device(self.device):
            # torch's recipe: warm up on a side stream so capture sees no first-use work
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn()
            return graph.replay

    def busy_ms(self, fn: Callable[[], Any], window: int) -> float:
        """Device time per call: the kernels' own durations summed over a window (torch's
        profiler), so the gaps host dispatch leaves between kernels are not in it."""
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(window):
                    fn()
                torch.cuda.synchronize()
        kernels_us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
        return kernels_us / 1e3 / window

    def host_us(self, fn: Callable[[], Any]) -> float:
        return host_us_per_call(fn, lambda: torch.cuda.synchronize(self.device))

    def tail_ms(self, fn: Callable[[], Any], calls: int = 3) -> float:
        # the median of a few calls, each from a drained queue; it includes a synchronize's own
        # latency, so it errs towards keeping the lead-in
        tails = []
        with torch.cuda.device(self.device), _collector_paused():
            for _ in range(calls):
                torch.cuda.synchronize()
                fn()
                returned = time.perf_counter()
                torch.cuda.synchronize()
                tails.append((time.perf_counter() - returned) * 1e3)
        return statistics.median(tails)

    def peak_bytes(self, fn: Callable[[], Any]) -> int:
        """The most device memory one call held above what was allocated when it began (its
        outputs and temporaries; those of a call before it freed), from a drained queue."""
        with memory_held(self.device) as found:
            self.peak_before_reset = max(self.peak_before_reset, found.prior_peak)
            fn()
        return found.held

    def time_cold(self, fn: Callable[[], Any]) -> float:
        # wall clock, not events: compile and autotune are host work, the first call's cost
        with torch.cuda.device(self.device):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            return (time.perf_counter() - t0) * 1e3


def host_us_per_call(
    fn: Callable[[], Any], sync: Callable[[], None], calls: int = 200, batches: int = 5,
    batch_ms: float = 50.0, min_calls: int = 5,
) -> float:
    """Host time per call: back-to-back calls timed with the host's clock, synchronized before
    and after, best of `batches`. Each batch holds `calls` calls, or fewer for a slow call (as
    many as fill about batch_ms, never under min_calls), sized by a timed batch of min_calls
    after an untimed one (first-call compiles), so a reference of milliseconds a call does not
    spend seconds a case. On a shape too small to keep the device busy, what is left is
    dispatch: Python, the framework, the launches."""

    def timed(n: int) -> float:
        sync()
        with _collector_paused():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            sync()
            return (time.perf_counter() - t0) / n

    timed(min_calls)
    per_call = timed(min_calls)
    calls = max(min_calls, min(calls, int(batch_ms / 1e3 / max(per_call, 1e-9))))
    return min(timed(calls) for _ in range(batches)) * 1e6


class WallTimer:
    """Times with the host's clock, for arms that are not CUDA kernels (a checkpoint writer, a
    host-side guard): benches in "wall" mode run on any machine. On a CUDA device each window
    ends with a synchronize, so work the call left queued is counted."""

    def __init__(self, device: torch.device | str | None = None) -> None:
        self.device = torch.device(device or "cpu")

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def time_calls(
        self, fn: Callable[[], Any], n: int, *, flush_l2: bool, window: int, lead_in: bool = True
    ) -> list[float]:
        if n < 1 or window < 1:
            raise ValueError("n and window must be >= 1")
        times = []
        self._sync()
        with _collector_paused():
            for _ in range(n):
                t0 = time.perf_counter()
                for _ in range(window):
                    fn()
                self._sync()
                times.append((time.perf_counter() - t0) * 1e3 / window)
        return times

    def time_cold(self, fn: Callable[[], Any]) -> float:
        self._sync()
        t0 = time.perf_counter()
        fn()
        self._sync()
        return (time.perf_counter() - t0) * 1e3

    def host_us(self, fn: Callable[[], Any]) -> float:
        return host_us_per_call(fn, self._sync)
