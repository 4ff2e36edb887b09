"""Jobs take dict batches as Hugging Face code does: ``model(**batch)``, the
loss the model computed from its ``labels`` (or ``loss_fn`` over the items
named ``target_keys``), with accumulation, a padded batch of another length
and keyword example inputs; each exactly as the eager loop trains."""
import copy
from dataclasses import dataclass

import pytest

torch = pytest.importorskip("torch")

import waterwave as ww  # noqa: E402

# Tests of the captured path: the CPU's session plans (conftest.PLANNING_LIMIT).
pytestmark = pytest.mark.usefixtures("cpu_session_plans")

VOCAB, WIDTH, CLASSES = 50, 16, 3


@dataclass
class Output:
    """What a Hugging Face classifier returns: the loss when given labels."""
    loss: torch.Tensor | None
    logits: torch.Tensor


class Classifier(torch.nn.Module):
    """Keyword inputs in Hugging Face's order: a second positional argument
    would be the mask, not what a caller passing (x, y) meant."""

    def __init__(self, seed):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(VOCAB, WIDTH)
        self.head = torch.nn.Linear(WIDTH, CLASSES)

    def forward(self, input_ids, attention_mask=None, labels=None):
        h = self.embed(input_ids)
        if attention_mask is not None:
            mask = attention_mask.unsqueeze(-1).float()
            h = (h * mask).sum(1) / mask.sum(1).clamp(min=1)
        else:
            h = h.mean(1)
        logits = self.head(h)
        loss = None if labels is None else torch.nn.functional.cross_entropy(logits, labels)
        return Output(loss, logits)


def batches(lengths, seed=0, size=4, with_labels=True):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in lengths:
        ids = torch.randint(1, VOCAB, (size, n), generator=g)
        mask = torch.ones(size, n, dtype=torch.long)
        mask[0, n // 2:] = 0  # one padded sequence
        batch = {"input_ids": ids, "attention_mask": mask}
        if with_labels:
            batch["labels"] = torch.randint(0, CLASSES, (size,), generator=g)
        out.append(batch)
    return out


def eager(model, data, steps, loss_of=lambda model, batch: model(**batch).loss, k=1):
    """The Hugging Face loop: ``model(**batch).loss``, accumulated over k batches."""
    opt, losses = torch.optim.AdamW(model.parameters(), lr=1e-2), []
    draw = iter(())
    while len(losses) < steps:
        step_losses = []
        for _ in range(k):
            batch = next(draw, None)
            if batch is None:
                draw = iter(data)
                batch = next(draw)
            loss = loss_of(model, batch)
            (loss / k if k > 1 else loss).backward()
            step_losses.append(loss.detach())
        opt.step()
        opt.zero_grad()
        losses.append((sum(step_losses[1:], step_losses[0]) / k).item())
    return losses, opt


def assert_same_training(job, losses, opt, reference):
    assert job.error is None
    torch.testing.assert_close(job.losses, losses, rtol=1e-5, atol=1e-6)
    for a, b in zip(job.model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(job.optimizer.state.values(), opt.state.values()):
        torch.testing.assert_close(a["exp_avg"], b["exp_avg"], rtol=1e-5, atol=1e-6)


def test_dict_batches_train_as_model_of_batch_loss_with_the_models_own_loss():
    data = batches([8, 8, 8])
    model = Classifier(0)
    reference = copy.deepcopy(model)
    losses, opt = eager(reference, data, 5)
    job = ww.Job(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), data=data)
    job.train(5)
    assert_same_training(job, losses, opt, reference)
    assert job.stats()["eager_steps"] == 0  # every batch ran from the capture
    assert job.step_fn.input_names == ("input_ids", "attention_mask", "labels")


def test_target_keys_go_to_the_loss_fn_and_the_rest_to_the_model_by_name():
    data = batches([6, 6])
    loss_fn = torch.nn.functional.cross_entropy

    def loss_of(model, batch):
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        return loss_fn(model(**inputs).logits, batch["labels"])

    model = Classifier(1)
    reference = copy.deepcopy(model)
    losses, opt = eager(reference, data, 4, loss_of)
    job = ww.Job(model, loss_fn=lambda out, y: loss_fn(out.logits, y),
                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), data=data,
                 target_keys=["labels"])
    job.train(4)
    assert_same_training(job, losses, opt, reference)


def test_dynamic_padding_dict_batches_of_other_lengths_train_as_eager():
    data = batches([8, 5, 11, 8, 3])  # longer than the first: eagerly; shorter: captured
    model = Classifier(2)
    reference = copy.deepcopy(model)
    losses, opt = eager(reference, data, 7)
    job = ww.Job(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), data=data)
    job.train(3)
    job.train(4)  # a second call, after a batch no capture could train
    assert_same_training(job, losses, opt, reference)
    assert job.stats()["eager_steps"] == 1  # the 11-long batch


def test_accumulated_dict_batches_train_as_eager():
    data = batches([6, 6, 6, 6])
    model = Classifier(3)
    reference = copy.deepcopy(model)
    losses, opt = eager(reference, data, 3, k=2)
    job = ww.Job(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), data=data,
                 accumulate_grad_batches=2)
    job.train(3)
    assert_same_training(job, losses, opt, reference)


def test_keyword_example_inputs_train_without_data():
    batch = batches([7], seed=4)[0]
    model = Classifier(4)
    reference = copy.deepcopy(model)
    losses, opt = eager(reference, [batch], 3)
    job = ww.Job(model, example_inputs=batch,
                 optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2))
    job.train(3)
    assert_same_training(job, losses, opt, reference)
    graph = ww.capture(Classifier(4), batch)  # capture takes keyword inputs too
    assert graph.meta["input_shapes"] == [[4, 7], [4, 7], [4]]


def test_sessions_train_dict_batch_jobs_beside_tuple_batch_jobs():
    data = batches([8, 8])
    model = Classifier(5)
    reference = copy.deepcopy(model)
    losses, opt = eager(reference, data, 4)
    other = torch.nn.Linear(4, 2)
    jobs = [ww.Job(model, optimizer=torch.optim.AdamW(model.parameters(), lr=1e-2), data=data),
            ww.Job(other, example_inputs=(torch.randn(3, 4),),
                   optimizer=torch.optim.SGD(other.parameters(), lr=0.1))]
    ww.ConcurrentTrainer(jobs).run(4)
    assert_same_training(jobs[0], losses, opt, reference)


@pytest.mark.parametrize("data, kwargs, message", [
    (batches([4], with_labels=False), {"target_keys": ["labels"]}, "has no 'labels'"),
    ([(torch.zeros(2, 4, dtype=torch.long),)], {"target_keys": ["labels"]},
     "target_keys name items of dict batches"),
    ([{"input ids": torch.zeros(2, 4, dtype=torch.long)}], {}, "cannot be one"),
    ([{}], {}, "holds no input"),
    (batches([4]), {"target_keys": "labels"}, "target_keys must be a list"),
])
def test_bad_dict_batches_are_clear_errors(data, kwargs, message):
    model = Classifier(6)
    with pytest.raises(ValueError, match=message):
        ww.Job(model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), data=data, **kwargs)


def test_target_keys_without_data_is_a_clear_error():
    model = Classifier(7)
    with pytest.raises(ValueError, match="target_keys name items of the data's dict batches"):
        ww.Job(model, example_inputs=batches([4])[0], target_keys=["labels"],
               optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
