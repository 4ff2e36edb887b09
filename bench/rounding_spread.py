"""How far a run of mixed-precision Adam moves when nothing but rounding
changes, beside how far ``job.train`` moves from the eager loop.

    python bench/rounding_spread.py [--device cpu|cuda] [--steps 6] [--quick] [--out FILE.json]

The recipe is the one the GPU test of float16 training checks
(tests/test_gpu.py): resnet18 on one batch of 8 images of 64x64, Adam at lr
1e-3, float16 autocast, a ``GradScaler`` (initial scale 2^16, growth every 2
steps), gradients clipped to norm 1. It trains that recipe

* eagerly, as written (the reference);
* eagerly with torch's other Adam implementation (``foreach`` flipped: on a
  GPU eager picks the multi-tensor kernels, on the CPU the single-tensor
  loop; their roundings differ on a GPU);
* eagerly with lr, then the clipping norm, moved by 2^-22 of itself either
  way (a change of one or two units in float32's last place);
* through ``waterwave.Job(...).train``.

and prints, per step, each run's loss relative to the reference, whether its
loss scale followed the reference's (the steps the scaler skipped and grew
on), the optimizer's step count at the end, and how far the parameters
ended from the reference's (each tensor's norm, and the largest difference
of one parameter). On the CPU ``job.train``
is bit-identical to the eager loop, and the perturbed runs show how a
one-ulp change grows over a few steps of this recipe: loss falls from 6.9
to 0.005 in six steps, and Adam's normalised updates carry a rounding
difference into every parameter. A GPU run shows the same for CUDA's
kernels, where ``job.train`` computes with other kernel forms than eager
Adam's and so is expected to move within the perturbed runs' spread, not to
be bit-identical. Writes FILE.json and FILE.md (default
bench/results/rounding_spread_<device>.*), naming the device, torch and the
date. ``--quick`` (the suite's check of this script): four steps on 2 images
of 64x64, without the perturbed runs (float16 on the CPU is slow: a step
of the full recipe takes about 4 s there); the scaler skips the first two
steps and takes the last two, so both kinds are compared.

May import: waterwave (the Job), torch, torchvision, bench/alloc_ab.py (the CPU's name).
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from alloc_ab import cpu_name  # noqa: E402

ULPS = 2.0 ** -22

PLANNING_LIMIT = 1 << 40  # a budget the run never comes near: the CPU's session plans


def train(device: str, mode: str, steps: int, lr: float = 1e-3, max_norm: float = 1.0,
          foreach: bool | None = None, batch: tuple[int, int] = (8, 64)) -> dict:
    """One run of the recipe: ``mode`` "eager" or "job"; ``batch``: (images,
    their side in pixels)."""
    import torch
    import torchvision

    import waterwave as ww

    torch.manual_seed(0)
    if device == "cuda":
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
    net = torchvision.models.resnet18().to(device)
    images, side = batch
    x = torch.randn(images, 3, side, side, device=device)
    y = torch.randint(0, 1000, (images,), device=device)
    opt = torch.optim.Adam(net.parameters(), lr=lr, foreach=foreach)
    scaler = torch.amp.GradScaler(device, init_scale=2.0 ** 16, growth_interval=2)
    losses, scales = [], []
    if mode == "job":
        job = ww.Job(net, loss_fn=torch.nn.functional.cross_entropy, optimizer=opt,
                     data=[(x, y)], autocast_dtype=torch.float16, grad_scaler=scaler,
                     clip_grad_norm=max_norm)
        # The captured step, as a GPU's session trains it: on the CPU a
        # session plans (and so captures) only under a budget.
        session = (ww.TrainingSession("cpu", memory_limit=PLANNING_LIMIT) if device == "cpu"
                   else None)
        for _ in range(steps):
            losses += job.train(1, session=session)
            scales.append(scaler.get_scale())
    else:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast(device, dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(net(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm)
            scaler.step(opt)
            scaler.update()
            losses.append(loss.item())
            scales.append(scaler.get_scale())
    counts = sorted({float(s["step"]) for s in opt.state.values()})
    norms = [p.detach().double().norm().item() for p in net.parameters()]
    return {"losses": losses, "scales": scales, "step_counts": counts, "norms": norms,
            "parameters": [p.detach().cpu() for p in net.parameters()]}


def measure(device: str, steps: int, perturbed: bool = True,
            batch: tuple[int, int] = (8, 64)) -> dict:
    flipped = device != "cuda"  # eager's own choice is foreach on CUDA, the loop on the CPU
    runs = {"eager": dict(mode="eager"),
            f"eager, foreach={flipped}": dict(mode="eager", foreach=flipped),
            "eager, lr +2^-22": dict(mode="eager", lr=1e-3 * (1 + ULPS)),
            "eager, lr -2^-22": dict(mode="eager", lr=1e-3 * (1 - ULPS)),
            "eager, max_norm +2^-22": dict(mode="eager", max_norm=1 + ULPS),
            "eager, max_norm -2^-22": dict(mode="eager", max_norm=1 - ULPS),
            "job.train": dict(mode="job")}
    if not perturbed:
        runs = {k: v for k, v in runs.items() if "2^-22" not in k}
    out, reference = {}, None
    for name, kw in runs.items():
        out[name] = train(device, steps=steps, batch=batch, **kw)
        params = out[name].pop("parameters")
        if reference is None:  # the first run, eager's
            reference = params
        out[name]["largest_parameter_difference"] = max(
            (a - b).abs().max().item() for a, b in zip(params, reference))
        print(f"rounding-spread: {name}: {out[name]['losses']}", file=sys.stderr, flush=True)
    return out


def relative(run: dict, ref: dict) -> list[float]:
    return [abs(a - b) / abs(b) if b else math.inf for a, b in zip(run["losses"], ref["losses"])]


def norm_difference(run: dict, ref: dict) -> float:
    """The largest relative difference of one parameter's norm."""
    return max(abs(a - b) / b if b else abs(a) for a, b in zip(run["norms"], ref["norms"]))


def report(result: dict) -> str:
    runs, ref = result["runs"], result["runs"]["eager"]
    images, side = result.get("batch", (8, 64))
    names = [n for n in runs if n != "eager"]
    lines = [f"# Rounding spread of float16 Adam on {result['device']}", "",
             f"Measured by `bench/rounding_spread.py` on {result['date']}, torch "
             f"{result['torch']}, on a batch of {images} images of {side}x{side}. Each column "
             "is a run's loss at each step relative to the eager loop's (0 = bit-identical); "
             "the recipe and why in the script's opening.", "",
             "| step | eager loss | " + " | ".join(names) + " |",
             "|---:|---:|" + "---:|" * len(names)]
    columns = [relative(runs[n], ref) for n in names]
    for i, loss in enumerate(ref["losses"]):
        cells = [f"{column[i]:.2g}" for column in columns]
        lines.append(f"| {i + 1} | {loss:.6g} | " + " | ".join(cells) + " |")
    lines += ["", "| run | loss scale as eager's at every step | step counts at the end | "
              "a parameter tensor's norm at the end, largest relative difference | "
              "one parameter, largest difference |", "|---|---|---|---:|---:|"]
    lines += [f"| {n} | {'yes' if runs[n]['scales'] == ref['scales'] else 'no'} | "
              f"{runs[n]['step_counts']} | {norm_difference(runs[n], ref):.2g} | "
              f"{runs[n]['largest_parameter_difference']:.2g} |" for n in runs]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default=None,
                    help="default: cuda where there is one, else cpu")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--quick", action="store_true",
                    help="four steps on 2 images, no perturbed runs")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    steps = 4 if args.quick else args.steps
    batch = (2, 64) if args.quick else (8, 64)
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":
        if not torch.cuda.is_available():
            print("rounding-spread: no CUDA GPU here; run with --device cpu", file=sys.stderr)
            return 2
        import waterwave as ww
        ww.install_allocator(policy="waterwave")
        name = torch.cuda.get_device_name(0)
    else:
        name = f"the CPU ({cpu_name()}, {torch.get_num_threads()} threads)"
    out = Path(args.out or ROOT / "bench" / "results" / f"rounding_spread_{device}.json")
    result = {"device": name, "torch": torch.__version__, "date": dt.date.today().isoformat(),
              "steps": steps, "batch": list(batch),
              "runs": measure(device, steps, perturbed=not args.quick, batch=batch)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    text = report(result)
    out.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
