"""docker/: what can be checked without a Docker daemon. The image pins the
torch the project pins, installs extras the project defines, and its
README sends users to make targets and files that exist."""
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = (ROOT / "docker" / "Dockerfile").read_text()
README = (ROOT / "docker" / "README.md").read_text()
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def arg(name: str) -> str:
    return re.search(rf"^ARG {name}=(\S+)$", DOCKERFILE, re.M).group(1)


def test_the_image_pins_the_projects_torch():
    pins = dict(re.findall(r"^(torch|torchvision)==(\S+)$",
                           (ROOT / "constraints" / "dev.txt").read_text(), re.M))
    assert arg("TORCH_VERSION") == pins["torch"]
    assert arg("TORCHVISION_VERSION") == pins["torchvision"]


def test_the_extras_it_installs_exist():
    extras = PROJECT["optional-dependencies"]
    named = arg("EXTRAS").split(",") + re.findall(r"EXTRAS=([\w,]+)", README)[0].split(",")
    assert set(named) <= set(extras), set(named) - set(extras)


def test_the_make_targets_and_files_it_names_exist():
    makefile = (ROOT / "Makefile").read_text()
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    # `make x` in prose, "... waterwave make x" on command lines, RUN make x, CMD ["make", "x"].
    named = set(re.findall(r"(?:`|waterwave |RUN )make ([\w-]+)", DOCKERFILE + README)) | set(
        re.findall(r'"make", "([\w-]+)"', DOCKERFILE))
    assert named and named <= targets, named - targets
    for path in set(re.findall(r"`((?:bench|tests|docker)/[\w/.]+\.(?:py|json|md))`", README)):
        produced = path.startswith("bench/results/")  # written by the benchmarks
        assert produced or (ROOT / path).exists(), path


def test_the_build_context_leaves_host_builds_out():
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "**/*.so", "tests/cpp/bin"} <= set(ignored)
