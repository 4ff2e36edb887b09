"""A trace reused across models of the same structure
(``waterwave.capturing.trace_cache``): trials that differ in their
hyperparameters take one trace, each training exactly as its eager loop;
anything the trace fixed that differs makes a trace of its own."""
import copy
import threading

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

import waterwave as ww  # noqa: E402
from waterwave.capturing import CaptureError  # noqa: E402
from waterwave.capturing.guards import SetInsideCapturedStep  # noqa: E402
from waterwave.capturing.trace_cache import TRACES, TraceCache  # noqa: E402

# Tests of the captured path: the CPU's session plans (conftest.PLANNING_LIMIT).
pytestmark = pytest.mark.usefixtures("cpu_session_plans")

DATA = [(torch.randn(16, 12, generator=torch.Generator().manual_seed(k)),
         torch.randint(0, 4, (16,), generator=torch.Generator().manual_seed(k)))
        for k in range(3)]


@pytest.fixture(autouse=True)
def fresh_cache():
    TRACES.clear()
    yield
    TRACES.clear()


class Net(torch.nn.Module):
    def __init__(self, width=24, p=0.0, scale=1.0, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b = torch.nn.Linear(12, width), torch.nn.Linear(width, 4)
        self.norm = torch.nn.BatchNorm1d(width)
        self.drop = torch.nn.Dropout(p)
        self.scale = scale

    def forward(self, x):
        return self.b(self.drop(torch.relu(self.norm(self.a(x))))) * self.scale


OPTS = {
    "sgd": lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9, weight_decay=1e-3),
    "adam": lambda p, lr: torch.optim.Adam(p, lr=lr, betas=(0.9, 0.99)),
    "adamw": lambda p, lr: torch.optim.AdamW(p, lr=lr, weight_decay=0.05),
}


def trial(model, opt_name="sgd", lr=0.1, loss=F.cross_entropy, steps=5):
    """A job and its eager twin trained ``steps`` steps: the job, and
    whether it equalled the twin bit for bit (losses, parameters, buffers,
    optimizer state)."""
    twin = copy.deepcopy(model)
    opt, twin_opt = OPTS[opt_name](model.parameters(), lr), OPTS[opt_name](twin.parameters(), lr)
    job = ww.Job(model, loss_fn=loss, optimizer=opt, data=DATA)
    torch.manual_seed(7)  # dropout draws alike
    job.train(steps)
    torch.manual_seed(7)
    expected = []
    for k in range(steps):
        x, y = DATA[k % len(DATA)]
        twin_opt.zero_grad()
        out = loss(twin(x), y)
        out.backward()
        twin_opt.step()
        expected.append(out.item())
    same = job.losses == expected and all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), twin.state_dict().values()))
    for p, q in zip(model.parameters(), twin.parameters()):
        for key, value in twin_opt.state[q].items():
            same = same and torch.equal(opt.state[p][key], value)
    return job, same


@pytest.mark.parametrize("opt_name", sorted(OPTS))
def test_trials_differing_in_hyperparameters_take_one_trace_each_exact(opt_name):
    runs = [trial(Net(seed=k), opt_name, lr) for k, lr in enumerate((0.1, 0.01, 0.3))]
    assert [job.step_fn.reused for job, _ in runs] == [False, True, True]
    assert all(same for _, same in runs)
    assert TRACES.stats() == {"entries": 1, "hits": 2, "misses": 1}


@pytest.mark.parametrize("opt_name", sorted(OPTS))
def test_a_frozen_layer_of_a_model_that_takes_a_trace_is_its_own(opt_name):
    """A frozen parameter is a constant of the traced step (make_fx holds
    the tensor itself): a fine-tuning trial that takes another trial's trace
    reads its own frozen weights there, never a copy of the other's (as it
    once did), and the cache holds none of them."""
    def frozen(seed):
        net = Net(seed=seed)
        net.a.requires_grad_(False)
        return net
    runs = [trial(frozen(k), opt_name, lr) for k, lr in enumerate((0.1, 0.01, 0.3))]
    assert [job.step_fn.reused for job, _ in runs] == [False, True, True]
    assert all(same for _, same in runs)
    for job, _ in runs:
        held = {id(getattr(job.step_fn.gm, n.target)) for n in job.step_fn.gm.graph.nodes
                if n.op == "get_attr"}
        assert {id(job.model.a.weight), id(job.model.a.bias)} <= held
    (entry,), = TRACES._entries.values()
    assert {t.device.type for t, _ in entry.own} == {"meta"} and len(entry.own) == 2


@pytest.mark.parametrize("other", [
    {"width": 32},                  # another shape
    {"p": 0.5},                     # a value the dropout's code reads
    {"scale": 2.0},                 # a value the model's forward reads
])
def test_a_model_that_differs_in_what_the_trace_fixed_traces_itself(other):
    first, same = trial(Net())
    assert same and not first.step_fn.reused
    second, same = trial(Net(**other))
    assert same and not second.step_fn.reused


def test_another_loss_mode_or_optimizer_option_traces_itself():
    trial(Net())

    def loss(out, y):
        return F.cross_entropy(out, y, label_smoothing=0.1)

    assert not trial(Net(), loss=loss)[0].step_fn.reused  # another loss function
    model = Net()
    model.norm.eval()  # another mode
    assert not trial(model)[0].step_fn.reused
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, nesterov=True)
    assert not ww.Job(model, loss_fn=F.cross_entropy, optimizer=opt, data=DATA).step_fn.reused


def test_what_a_trace_refuses_is_refused_before_one_is_reused():
    trial(Net())
    model = Net()
    other = Net()
    opt = torch.optim.SGD(other.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    with pytest.raises(CaptureError, match="not the tensor the optimizer trains"):
        ww.Job(model, loss_fn=F.cross_entropy, optimizer=opt, data=DATA)


class ReadsAnObject(Net):
    def __init__(self, seed=0):
        super().__init__(seed=seed)
        self.act = lambda t: torch.tanh(t)  # an object: not compared, so never shared

    def forward(self, x):
        return self.b(self.act(self.a(x)))


class ReadsATensor(Net):
    def __init__(self, seed=0):
        super().__init__(seed=seed)
        self.mask = torch.ones(4)  # a plain tensor attribute, not a buffer

    def forward(self, x):
        return super().forward(x) * self.mask


@pytest.mark.parametrize("cls", [ReadsAnObject, ReadsATensor])
def test_a_model_whose_code_reads_an_object_or_a_tensor_is_never_shared(cls):
    assert not trial(cls(0))[0].step_fn.reused
    job, same = trial(cls(1))
    assert same and not job.step_fn.reused
    assert TRACES.stats()["entries"] == 0


class SetsAnAttribute(Net):
    def forward(self, x):
        self.last_hidden = self.a(x)  # set, not read: the step's own
        return self.b(torch.relu(self.last_hidden))


def test_an_attribute_set_inside_the_step_is_marked_on_the_model_that_takes_the_trace():
    trial(SetsAnAttribute(seed=0))
    model = SetsAnAttribute(seed=1)
    job, same = trial(model)
    assert same and job.step_fn.reused
    assert isinstance(model.__dict__["last_hidden"], SetInsideCapturedStep)


def test_the_cache_keeps_its_bound_and_drops_the_least_recently_used():
    cache = TraceCache(max_entries=2)
    for width in (8, 16, 24):
        model = Net(width)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        (traced, _), reused = cache.trace(model, (DATA[0][0],), F.cross_entropy, opt,
                                          (DATA[0][1],))
        assert not reused
    assert cache.stats() == {"entries": 2, "hits": 0, "misses": 3}
    model = Net(8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    assert not cache.trace(model, (DATA[0][0],), F.cross_entropy, opt, (DATA[0][1],))[1]


def test_trials_made_on_threads_at_once_each_train_exactly():
    results = [None] * 6

    def run(k):
        results[k] = trial(Net(seed=k), "adam", 0.01 * (k + 1))

    threads = [threading.Thread(target=run, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None and r[1] for r in results)
    assert sum(job.step_fn.reused for job, _ in results) == 5


class Conv(torch.nn.Module):
    def __init__(self, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.head = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.head(self.conv(x).mean((2, 3)))


def test_a_model_in_another_memory_format_traces_itself():
    x, y = torch.randn(2, 3, 8, 8), torch.randint(0, 4, (2,))
    jobs = []
    for k, fmt in enumerate((torch.contiguous_format, torch.channels_last, torch.channels_last)):
        model = Conv(k).to(memory_format=fmt)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        jobs.append(ww.Job(model, (x.contiguous(memory_format=fmt),), F.cross_entropy, opt,
                           targets=(y,)))
    assert [j.step_fn.reused for j in jobs] == [False, False, True]
