"""The threads jobs run on: a pool of worker threads that live as long as the
process, each running one job's groups at a time.

Why not a thread per run: a thread that exits runs torch's thread-local
destructors as it goes, and a run stopped by Ctrl-C just before the
interpreter exits had those race the process's own teardown ("terminate
called without an active exception"). A pool thread never exits: between
runs it waits, holding nothing, on a queue; at exit the process ends it
there. Reusing threads also saves starting new ones for every run.

May import: nothing of waterwave.
"""
from __future__ import annotations

import queue
import threading
from collections.abc import Callable

IDLE = "waterwave worker (idle)"


class Task:
    """One function run on a pool thread; ``wait`` for it to end."""

    def __init__(self, fn: Callable[[], None], name: str):
        self.fn, self.name = fn, name
        self.error: BaseException | None = None  # what escaped fn, for the caller
        self._done = threading.Event()

    def run(self) -> None:
        thread = threading.current_thread()
        thread.name = self.name
        try:
            self.fn()
        except BaseException as e:
            self.error = e
        finally:
            thread.name = IDLE
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    @property
    def done(self) -> bool:
        return self._done.is_set()


class WorkerPool:
    def __init__(self):
        self._tasks: queue.SimpleQueue[Task] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._busy = 0

    def submit(self, fn: Callable[[], None], name: str) -> Task:
        """Run ``fn`` on a pool thread (started if every one is busy). What
        escapes ``fn`` ends the task and waits in ``Task.error``."""
        task = Task(self._counted(fn), name)
        with self._lock:
            self._busy += 1
            if self._busy > len(self._threads):
                t = threading.Thread(target=self._serve, name=IDLE, daemon=True)
                self._threads.append(t)
                t.start()
        self._tasks.put(task)
        return task

    def _counted(self, fn: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                fn()
            finally:
                with self._lock:
                    self._busy -= 1
        return run

    def _serve(self) -> None:
        while True:
            self._tasks.get().run()

    @property
    def size(self) -> int:
        return len(self._threads)


POOL = WorkerPool()
