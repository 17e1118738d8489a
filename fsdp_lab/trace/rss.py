"""Host memory from the outside: this process's resident set size (RSS), sampled over time.

`MemoryTracker` counts tensor storages; resident memory is what the operating system sees —
pages really touched, Python objects, the allocator's slack. ``torch.empty(n)`` alone barely
moves it, writing the tensor does. The meta-init lab draws it while a model is built the
ordinary way (a spike the size of the model) and on meta, materialised shard by shard (flat).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import threading
import time

import psutil


def anonymous_rss() -> int:
    """Resident bytes of this process's own memory: its heap and mappings, not the code pages.

    psutil's rss also counts file-backed pages — the shared libraries' code (libtorch is over
    500 MB). The kernel evicts those under memory pressure and faults them back on the next
    call, so a build measured on a busy machine "grew" by tens of MB of torch's own code (the
    meta-init lab's check failed so, in CI). rss − shared (Linux: /proc/self/statm's resident
    minus its file-backed and shmem pages) is what the process allocated; elsewhere rss.
    (Read from /proc directly: it is sampled every few ms, by forked ranks too.)
    """
    try:
        with open("/proc/self/statm", "rb") as f:  # pages: size resident shared text lib data dt
            fields = f.read().split()
        return (int(fields[1]) - int(fields[2])) * _PAGE
    except OSError:  # not Linux
        return psutil.Process().memory_info().rss


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


class RssSampler:
    """This process's anonymous resident memory (`anonymous_rss`), sampled every `interval_s`
    by a daemon thread.

    Resident memory counts pages really touched: ``torch.empty(n)`` alone barely moves it,
    writing the tensor does. It sees what no tensor tracker sees (Python objects, the
    allocator's slack) and, on meta, that nothing big was ever allocated.

        with RssSampler() as rss:
            model, s = build_on_meta(factory); rss.mark("built")
        rss.growth_bytes   # peak - start
    """

    def __init__(self, interval_s: float = 0.005) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s!r}: expected a number of seconds > 0")
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []  # (seconds since start, rss bytes)
        self.marks: list[tuple[float, str, int]] = []  # (seconds since start, label, rss bytes)
        self._lock = threading.Lock()  # the sampler thread and mark() both append
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _sample(self) -> tuple[float, int]:
        rss = anonymous_rss()
        with self._lock:
            self.samples.append((time.perf_counter() - self._t0, rss))
            return self.samples[-1]

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> RssSampler:
        if self._thread is not None:
            raise RuntimeError("this RssSampler already ran: make a new one per with-block")
        self._t0 = time.perf_counter()
        self._sample()
        self._thread = threading.Thread(target=self._run, name="RssSampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()  # also on an exception: the thread ends, the exception propagates
        if self._thread is not None:
            self._thread.join()
        self._sample()

    def mark(self, label: str) -> int:
        """Sample now and label it; returns the resident bytes."""
        t, rss = self._sample()
        self.marks.append((t, label, rss))
        return rss

    @property
    def start_bytes(self) -> int:
        return self.samples[0][1]

    @property
    def peak_bytes(self) -> int:
        return max(rss for _, rss in self.samples)

    @property
    def growth_bytes(self) -> int:
        return self.peak_bytes - self.start_bytes


def release_free_memory() -> None:
    """Collect garbage and hand the C allocator's free pages back to the OS.

    Memory freed by an earlier run stays resident in glibc's heap; a run reusing it would not
    show in the resident memory at all. Trimmed first, every run starts from a clean baseline.
    """
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # not glibc (macOS): nothing to trim
        libc = ctypes.CDLL("libc.so.6")
        # glibc raises its mmap threshold after the first large free, so later large blocks
        # come from its heap, where a freed parameter between two live shards stays resident.
        # Pinned at 1 MiB, every large tensor is its own mapping, returned when freed: the
        # resident memory then shows what the mechanism holds, not the heap's history.
        libc.mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
        libc.malloc_trim(0)


def thin_samples(samples: list[tuple[float, int]], start: int, most: int = 400) -> dict[str, list]:
    """At most `most` points, each the highest sample of its stretch: the peak survives."""
    step = max(1, -(-len(samples) // most))
    kept = [max(samples[i : i + step], key=lambda s: s[1]) for i in range(0, len(samples), step)]
    return {"t": [t for t, _ in kept], "bytes": [b - start for _, b in kept]}
