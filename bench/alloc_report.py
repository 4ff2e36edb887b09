"""Turn `waterwave bench alloc --json` output into bench/results/alloc.md,
with a section for `--gpu`'s figures inside PyTorch when the run has them.

    python bench/alloc_report.py bench/results/alloc.json bench/results/alloc.md
"""
import json
import sys

DESCRIPTIONS = {
    "same_stream": "FIFO window of 8 live blocks on one stream, log-uniform 512 B-64 KiB",
    "synced_path": "64 streams in turn, SyncAndCoalesce every 32 pairs (cost included)",
    "cross_stream": "2 streams in turn, 12 MiB blocks, each stream's kernels never finish",
    "free_blocks_1k": "best fit among 1,024 free holes",
    "free_blocks_16k": "best fit among 16,384 free holes",
    "free_blocks_64k": "best fit among 65,536 free holes",
}


def main(src: str, dst: str) -> None:
    data = json.load(open(src))
    cases = data["cases"]
    by = {(c["name"], c["policy"]): c for c in cases}
    names = list(dict.fromkeys(c["name"] for c in cases))
    where = data["where"]
    lines = [
        "# Allocator micro-benchmark",
        "",
        f"Measured {data['date']} on {where['processor']} ({where['machine']}, Python "
        f"{where['python']}), `waterwave bench alloc`: {data['pairs_per_case']:,} alloc+free "
        f"pairs per case, median of {data['repeats']} interleaved repetitions (min-max in "
        "brackets). The device is the simulator: these are the allocator's CPU costs, "
        "no GPU was involved.",
        "",
        "| case | what | waterwave ns/pair | pytorch ns/pair | glibc ns/pair | waterwave / glibc |",
        "|---|---|---|---|---|---|",
    ]
    for n in names:
        w, p, g = by[(n, "waterwave")], by[(n, "pytorch")], by[(n, "glibc")]
        cell = lambda c: f"{c['ns_per_pair']:.0f} ({c['min_ns']:.0f}-{c['max_ns']:.0f})"
        lines.append(f"| {n} | {DESCRIPTIONS.get(n, '')} | {cell(w)} | {cell(p)} | {cell(g)} | "
                     f"{w['ns_per_pair'] / g['ns_per_pair']:.2f}x |")
    lines += ["", "How the waterwave policy served each case (to show the path measured):", ""]
    for n in names:
        served = {k: v for k, v in by[(n, "waterwave")]["served"].items() if v}
        lines.append(f"- {n}: {served}")
    same = by[("same_stream", "waterwave")]["ns_per_pair"] / by[("same_stream", "glibc")]["ns_per_pair"]
    big = by[("free_blocks_64k", "waterwave")]["ns_per_pair"]
    lines += [
        "",
        "## Targets",
        "",
        f"- same-stream pair at most 1.5x glibc: measured {same:.2f}x, "
        f"{'met' if same <= 1.5 else 'not met'}.",
        f"- under 1 us with 64k free blocks: measured {big:.0f} ns, "
        f"{'met' if big < 1000 else 'not met'}.",
        "",
    ]
    if "gpu" in data:
        lines += gpu_section(data["gpu"])
    with open(dst, "w") as f:
        f.write("\n".join(lines))
    print("\n".join(lines))


def gpu_section(runs: list[dict]) -> list[str]:
    """`--gpu`: each allocator's ns per pair inside PyTorch, on the device
    each worker reported ('fake driver' is host memory, not a GPU)."""
    devices = sorted({r.get("device", "?") for r in runs if "cases" in r})
    lines = ["## Inside PyTorch (`--gpu`)", "",
             f"Device: {', '.join(devices) or 'none'}. Each allocator in its own process; host "
             "time per alloc+free pair (ns, median, min-max): `tensor` is `torch.empty(n, "
             "device=\"cuda\")` and dropping it, `raw` PyTorch's raw alloc and delete on stream "
             "0, `raw, current stream` the same on the current stream's handle, `core` "
             "Waterwave's runtime called straight from Python (`waterwave._C.cuda_malloc` and "
             "`cuda_free`; Waterwave's allocators only). A run made before the last two existed "
             "shows '-' there.", ""]
    handles = sorted({str(r["current_stream"]) for r in runs if r.get("current_stream") is not None})
    if handles:
        same = (" (0: stream 0 itself, so the two raw paths make the same call)"
                if handles == ["0"] else "")
        lines += [f"The current stream's handle: {', '.join(handles)}{same}. The paths took "
                  "turns, a run of each at a time.", ""]
    else:
        lines += ["Measured one path after another (a run made before the paths took turns).", ""]
    if any(d == "fake driver" for d in devices):
        lines += ["These figures ran over the test suite's fake driver, not a GPU.", ""]
    lines += ["| allocator | case | raw | raw, current stream | tensor | core |",
              "|---|---|---|---|---|---|"]
    for r in runs:
        if "failed" in r:
            lines.append(f"| {r['allocator']} | failed: {r['failed']} | | | | |")
            continue
        measured = set(r.get("errors", {})) | {p for paths in r["cases"].values() for p in paths}
        for case, paths in r["cases"].items():
            cells = [f"{paths[p]['ns_per_pair']:.0f} ({paths[p]['min_ns']:.0f}-"
                     f"{paths[p]['max_ns']:.0f})" if p in paths
                     else "not measured" if p in measured else "-"
                     for p in ("raw", "raw_current", "tensor", "core")]
            lines.append(f"| {r['allocator']} | {case} | " + " | ".join(cells) + " |")
    errors = [f"- {r['allocator']}, {path} path: {e}" for r in runs for path, e in
              r.get("errors", {}).items()]
    if errors:
        lines += ["", "Not measured:", "", *errors]
    return lines + [""]


if __name__ == "__main__":
    main(*sys.argv[1:3])
