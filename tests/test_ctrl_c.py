"""Ctrl-C and the training sessions (waterwave/exec/ctrl_c.py): importing
waterwave touches no signal handler; the first training arranges that a
SIGINT stops every session, from the main thread or, as Optuna's n_jobs
trains, from worker threads only; a program's own handler is kept."""
import json

import pytest
from conftest import run_python

# Python leaves SIGINT ignored when it starts ignored (a background job's, as
# CI may run it): each script takes Ctrl-C as an interactive run does.
PRELUDE = """
    import json, os, signal, threading, time
    signal.signal(signal.SIGINT, signal.default_int_handler)
    watchdog = threading.Timer(60, os._exit, (3,))
    watchdog.daemon = True
    watchdog.start()
    import torch
"""

JOB = """
    def job(seed):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
        return ww.Job(net, (torch.randn(16, 32),), None, torch.optim.SGD(net.parameters(), lr=0.01))
"""


def last_json(r):
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "terminate called" not in r.stderr and "Aborted" not in r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_importing_sets_no_handler_and_training_keeps_the_programs_own():
    out = last_json(run_python(PRELUDE + """
    import waterwave as ww, waterwave.exec
    from waterwave.exec import ctrl_c
    imported = {"default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
                "mode": ctrl_c.mode(), "relayed": ww._C.sigints_relayed()}
    """ + JOB + """
    def mine(signum, frame):
        pass
    signal.signal(signal.SIGINT, mine)
    job(0).train(2)
    print(json.dumps({"imported": imported, "kept": signal.getsignal(signal.SIGINT) is mine,
                      "mode": ctrl_c.mode()}))
    """))
    assert out["imported"] == {"default": True, "mode": None, "relayed": 0}
    assert out["kept"] and out["mode"] == "not ours"


@pytest.mark.parametrize("plans", [False, True], ids=["eager", "planned"])
def test_ctrl_c_stops_trials_training_on_worker_threads_only(plans):
    """As study.optimize(n_jobs=3): the main thread waits while three
    worker threads train: job.train (its steps eager, or planned in a
    session with a budget), a ww.sharing loop and a ConcurrentTrainer's run.
    Ctrl-C: the main thread gets KeyboardInterrupt, each worker's training
    raises it within a second, and the next training works."""
    out = last_json(run_python(PRELUDE + f"""
    import waterwave as ww
    from waterwave.exec import ctrl_c
    if {plans}:
        ww.training_session("cpu", memory_limit=1 << 40)
    """ + JOB + """
    caught, started = {}, threading.Barrier(4)
    trainer = ww.ConcurrentTrainer([job(4), job(5)])

    def captured():
        j = job(1)
        started.wait()
        try:
            j.train(10**7)
        except KeyboardInterrupt:
            caught["job.train"] = time.monotonic()

    def sharing():
        torch.manual_seed(2)
        net = torch.nn.Linear(32, 8)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        started.wait()
        try:
            with ww.sharing(net):
                while True:
                    opt.zero_grad()
                    net(torch.randn(16, 32)).sum().backward()
                    opt.step()
        except KeyboardInterrupt:
            caught["sharing"] = time.monotonic()

    def together():
        started.wait()
        try:
            trainer.run(10**7)
        except KeyboardInterrupt:
            caught["ConcurrentTrainer"] = time.monotonic()

    workers = [threading.Thread(target=f) for f in (captured, sharing, together)]
    for t in workers:
        t.start()
    started.wait()
    time.sleep(0.5)
    mode = ctrl_c.mode()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        while any(t.is_alive() for t in workers):
            time.sleep(0.01)
        raise SystemExit("the workers ended without the main thread's KeyboardInterrupt")
    except KeyboardInterrupt:
        at = time.monotonic()
    for t in workers:
        t.join(10)
    after = [len(job(3).train(2)), len(trainer.step())]
    print(json.dumps({"mode": mode, "after_interrupt": {k: v - at for k, v in caught.items()},
                      "alive": [t.is_alive() for t in workers], "after": after,
                      "relayed": ww._C.sigints_relayed(),
                      "python_handler_kept": signal.getsignal(signal.SIGINT)
                      is signal.default_int_handler}))
    """))
    assert out["mode"] == "relay" and out["relayed"] == 1 and out["python_handler_kept"]
    assert sorted(out["after_interrupt"]) == ["ConcurrentTrainer", "job.train", "sharing"]
    assert all(s < 1 for s in out["after_interrupt"].values()), out
    assert out["alive"] == [False, False, False] and out["after"] == [2, 2]


def test_a_forked_child_relays_nothing_into_a_file_that_takes_the_pipes_number(tmp_path):
    """The relay armed from a worker thread, then os.fork(): the child
    closes the pipe it shares with its parent and its relay writes nowhere,
    so a SIGINT in the child neither reaches the parent's sessions nor
    writes into a file that took the pipe's number; the child's first
    training arranges Ctrl-C afresh."""
    # One OpenMP thread: in any PyTorch program, a child forked after an
    # OpenMP team worked in the parent can hang in its first parallel region
    # (GNU OpenMP is not fork-safe; seen 2 times in 25 under load, in the
    # child's first Linear). This test is about the Ctrl-C relay.
    out = last_json(run_python(PRELUDE + """
    import waterwave as ww
    from waterwave.exec import ctrl_c
    """ + JOB + """
    t = threading.Thread(target=lambda: job(0).train(2))
    t.start(); t.join()
    armed = ctrl_c.mode()
    write_fd = ctrl_c._pipe[1]
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        report = {"mode_after_fork": ctrl_c.mode()}
        path = os.path.join(os.environ["OUT"], "file")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        os.dup2(fd, write_fd)  # the file now has the number the pipe's end had
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            report["interrupted"] = True
        os.close(fd)
        os.close(write_fd)
        report["file_bytes"] = os.path.getsize(path)
        worker = threading.Thread(target=lambda: job(1).train(2))
        worker.start(); worker.join()
        report["mode_after_training"] = ctrl_c.mode()
        os.write(w, json.dumps(report).encode())
        os._exit(0)
    os.close(w)
    child = json.loads(os.read(r, 4096))
    os.waitpid(pid, 0)
    time.sleep(0.2)
    print(json.dumps({"armed": armed, "child": child, "parent_relayed": ww._C.sigints_relayed(),
                      "parent_training_after": len(job(2).train(2))}))
    """, OUT=str(tmp_path), OMP_NUM_THREADS="1"))
    assert out["armed"] == "relay"
    child = out["child"]
    assert child["mode_after_fork"] is None and child["interrupted"]
    assert child["file_bytes"] == 0 and child["mode_after_training"] == "relay"
    assert out["parent_relayed"] == 0 and out["parent_training_after"] == 2
