"""The pool of worker threads jobs run on: tasks run side by side, threads
are reused from run to run (none exits), and what escapes a task reaches its
caller."""
import threading

from waterwave.exec.workers import IDLE, WorkerPool


def test_tasks_run_side_by_side_and_threads_are_reused():
    pool = WorkerPool()
    for _ in range(5):  # five runs of three jobs that must all run at once
        barrier = threading.Barrier(3, timeout=10)
        names = []
        tasks = [pool.submit(lambda: names.append((barrier.wait(),
                                                   threading.current_thread().name)), f"job {k}")
                 for k in range(3)]
        assert all(t.wait(10) for t in tasks) and all(t.error is None for t in tasks)
        assert sorted(n for _, n in names) == ["job 0", "job 1", "job 2"]
    assert pool.size == 3  # the same three threads served every run
    idle = [t.name for t in threading.enumerate() if t.name.startswith("job ")]
    assert idle == []  # each went back to IDLE


def test_an_escaping_error_reaches_the_caller_and_the_thread_serves_on():
    pool = WorkerPool()
    task = pool.submit(lambda: 1 / 0, "broken")
    assert task.wait(10) and isinstance(task.error, ZeroDivisionError)
    again = pool.submit(lambda: None, "fine")
    assert again.wait(10) and again.error is None and pool.size == 1
    assert IDLE.startswith("waterwave")
