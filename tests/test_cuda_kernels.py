"""A capture on the CPU records the kernels a CUDA device runs."""
import json
import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchvision")

import torch.nn.functional as F  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from waterwave.capturing import CaptureError, capture  # noqa: E402
from waterwave.capturing.cuda_kernels import _attention_kernel, cuda_kernels  # noqa: E402
from waterwave.planner.baseline import replay  # noqa: E402
from waterwave.tools import models  # noqa: E402

CUDA_OPS = {"aten._scaled_dot_product_efficient_attention.default",
            "aten._scaled_dot_product_efficient_attention_backward.default",
            "aten.native_dropout.default", "aten.native_dropout_backward.default"}
# The CPU runs attention with dropout on the math path (a softmax it keeps).
CPU_OPS = {"aten._safe_softmax.default", "aten.bernoulli_.float"}


def encoder():
    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    return layer, (torch.randn(2, 16, 32),)


def ops(model, inputs, **kw):
    g = capture(model, inputs, None, torch.optim.SGD(model.parameters(), lr=0.1), **kw)
    return {n.op for n in g.nodes}


def test_attention_and_dropout_take_the_cuda_kernels():
    model, x = encoder()
    cuda = ops(model, x)
    assert CUDA_OPS <= cuda and not CPU_OPS & cuda
    cpu = ops(model, x, kernels="cpu")
    assert CPU_OPS <= cpu and not CUDA_OPS & cpu


def test_the_override_ends_with_the_capture():
    model, x = encoder()

    def broken_loss(out):
        raise ValueError("no loss here")

    with pytest.raises(CaptureError, match="no loss here"):
        capture(model, x, broken_loss, torch.optim.SGD(model.parameters(), lr=0.1))
    # PyTorch's own kernels are back: the CPU path, and real tensors as before.
    assert CPU_OPS <= ops(model, x, kernels="cpu")
    q = torch.randn(2, 4, 16, 8)
    ref = torch.softmax(q @ q.transpose(-1, -2) / 8 ** 0.5, -1) @ q
    torch.testing.assert_close(F.scaled_dot_product_attention(q, q, q), ref)


def test_captures_nest():
    model, x = encoder()
    with cuda_kernels():
        assert CUDA_OPS <= ops(model, x)  # the override is in place already: no deadlock
        with FakeTensorMode():
            q = torch.randn(2, 4, 16, 8, requires_grad=True)
            assert F.scaled_dot_product_attention(q, q, q).shape == q.shape
        with pytest.raises(CaptureError, match="inside cuda_kernels"):
            ops(model, x, kernels="cpu")  # the override cannot be lifted here
    assert CPU_OPS <= ops(model, x, kernels="cpu")


def test_a_cpu_capture_waits_for_another_threads_cuda_capture():
    import threading

    model, x = encoder()
    inside, release, seen = threading.Event(), threading.Event(), {}

    def emulate():
        with cuda_kernels():
            inside.set()
            release.wait(10)

    other = threading.Thread(target=emulate)
    other.start()
    inside.wait(10)
    worker = threading.Thread(target=lambda: seen.update(ops=ops(model, x, kernels="cpu")))
    worker.start()
    worker.join(0.5)
    assert worker.is_alive()  # blocked while the other thread's override is in place
    release.set()
    worker.join(30)
    other.join(10)
    assert CPU_OPS <= seen["ops"] and not CUDA_OPS & seen["ops"]


def test_real_tensors_meeting_the_override_get_the_same_results():
    q, k, v = torch.randn(3, 2, 4, 16, 8).unbind(0)
    mask = torch.rand(16, 16) > 0.3
    mask[:, 0] = True  # every row attends somewhere
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    x = torch.randn(1000)
    with cuda_kernels():
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v, attn_mask=mask), expected)
        dropped = F.dropout(x, 0.5, training=True)
        assert torch.equal(F.dropout(x, 0.5, training=False), x)
    kept = dropped != 0
    assert 300 < int(kept.sum()) < 700
    torch.testing.assert_close(dropped[kept], 2 * x[kept])


@pytest.mark.parametrize("dtype, shape, mask, gqa, kernel", [
    (torch.float32, (2, 4, 16, 64), None, False, "efficient"),
    (torch.float32, (2, 4, 16, 64), "bool", False, "efficient"),
    (torch.float16, (2, 4, 16, 64), None, False, "flash"),
    (torch.bfloat16, (2, 4, 16, 12), None, False, "flash"),  # head padded to 16
    (torch.float16, (2, 4, 16, 64), "float", False, "efficient"),
    (torch.float32, (2, 4, 16, 6), None, False, "math"),  # head not a multiple of 4
    (torch.float32, (4, 16, 64), None, False, "math"),  # the fused kernels want 4-D
    (torch.float32, (2, 4, 16, 64), None, True, "math"),  # grouped-query heads
])
def test_attention_kernel_choice_and_shapes(dtype, shape, mask, gqa, kernel):
    with FakeTensorMode():
        q = torch.randn(shape, dtype=dtype, requires_grad=True)
        kv = torch.randn(shape[:-3] + (2,) + shape[-2:], dtype=dtype) if gqa else q
        m = None
        if mask == "bool":
            m = torch.ones(shape[-2], shape[-2], dtype=torch.bool)
        elif mask == "float":
            m = torch.zeros(shape[0], 1, shape[-2], shape[-2], dtype=dtype)
        assert _attention_kernel(q, kv, kv, m, gqa) == kernel
        with cuda_kernels():
            out = F.scaled_dot_product_attention(q, kv, kv, attn_mask=m, enable_gqa=gqa)
        assert out.shape == q.shape and out.dtype == dtype


def test_attention_follows_the_backends_left_enabled():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with FakeTensorMode():
        q = torch.randn(2, 4, 16, 64, dtype=torch.float16)
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
            assert _attention_kernel(q, q, q, None, False) == "efficient"
        with sdpa_kernel(SDPBackend.MATH):
            assert _attention_kernel(q, q, q, None, False) == "math"
        assert _attention_kernel(q, q, q, None, False) == "flash"


H100 = os.path.join(os.path.dirname(__file__), "..", "bench", "results", "gpu.json")


@pytest.mark.parametrize("name", ["mobilenet_v2", "vit_b_16", "gpt2"])
def test_cpu_capture_reproduces_the_h100_capture(name):
    """bench/gpu.py captured each model on an H100 twice, with CPU and with
    CUDA fake tensors (torch 2.11 there). Here (torch 2.14.1, no GPU) the
    CUDA capture must differ from the H100's CUDA capture exactly as the CPU
    capture differs from the H100's CPU capture: the kernels are CUDA's,
    and what is left is the torch version."""
    pytest.importorskip("transformers")
    with open(H100) as f:
        record = next(r for r in json.load(f)["rows"] if r["mode"] == "capture" and r["model"] == name)
    got = {}
    for kernels in ("cpu", "cuda"):
        torch.manual_seed(0)
        net, inputs, loss_fn = models.build(name, record["batch_size"])
        g = capture(net, inputs, loss_fn, torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9),
                    kernels=kernels)
        got[kernels] = g
        assert replay(g).peak_reserved == record[kernels]["simulated_baseline_peak"]

    def measures(g):
        return {"nodes": len(g.nodes), "tensors": len(g.tensors),
                "transient_bytes": sum(t.size for t in g.tensors if not t.persistent)}

    for key, value in measures(got["cuda"]).items():
        cpu_shift = measures(got["cpu"])[key] - record["cpu"][key]
        assert value - record["cuda"][key] == cpu_shift, key
    cpu_ops = {n.op for n in got["cpu"].nodes}
    cuda_ops = {n.op for n in got["cuda"].nodes}
    batch_norm = {"aten.native_batch_norm.default", "aten.native_batch_norm_backward.default",
                  "aten.cudnn_batch_norm.default", "aten.cudnn_batch_norm_backward.default"}
    assert sorted(cpu_ops - cuda_ops) == sorted(set(record["ops_only_cpu"]) - batch_norm)
    assert sorted(cuda_ops - cpu_ops) == sorted(set(record["ops_only_cuda"]) - batch_norm)


def test_kernels_must_name_a_device_the_model_can_use():
    model, x = encoder()
    with pytest.raises(CaptureError, match="kernels must be one of"):
        ops(model, x, kernels="tpu")
    # A model elsewhere than on the CPU cannot be captured with the CPU's kernels.
    model = model.to("meta")
    with pytest.raises(CaptureError, match="this one is on meta"):
        ops(model, (x[0].to("meta"),), kernels="cpu")
