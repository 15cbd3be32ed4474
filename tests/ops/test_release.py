"""The deploy path a user takes (issue 27, item 10): `make image` / `make image-cuda` build the
CPU and CUDA images under the tags the chart's defaults pull, `make chart` packages the chart, and
docs/operations.md's "Install from a registry" commands agree with both. The image builds
themselves are not run here (Docker, root and GBs of wheels): their command lines are checked."""

from __future__ import annotations

import os
import re
import shlex
import tarfile
import tomllib

import pytest
import yaml

from tests.ops.support import CHART, ROOT, helm, one, render, run
from tests.ops.test_dockerfile import args_of

IMAGES_SH = ROOT / "tools" / "docker" / "images.sh"
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())
VALUES = yaml.safe_load((CHART / "values.yaml").read_text())


def release_args(variant: str, **env) -> tuple[str, dict[str, str]]:
    out = run(["bash", IMAGES_SH, "release-args", variant], env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    tag, *lines = out.stdout.splitlines()
    return tag, dict(line.split("=", 1) for line in lines)


def dockerfile_default(arg: str) -> str:
    (decl,) = [a for a in args_of("ARG") if a.split("=", 1)[0] == arg]
    return decl.split("=", 1)[1]


def stage_image(values: dict) -> str:
    sts = one(render(values), "StatefulSet")
    return next(c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "stage")["image"]


def test_image_tags_are_what_the_chart_pulls_by_default():
    cpu, _ = release_args("cpu")
    cuda, _ = release_args("cuda")
    assert VERSION == CHART_META["appVersion"]  # image.tag defaults to appVersion
    assert cpu == f"{VALUES['image']['repository']}:{VERSION}" == stage_image({})
    assert cuda == f"{cpu}-cuda" == stage_image({"gpu": {"enabled": True}})


def test_cpu_and_cuda_builds_take_torch_from_the_right_index():
    _, cpu = release_args("cpu")
    _, cuda = release_args("cuda")
    # CPU: torch's CPU wheel index (the Dockerfile's default) feeds the wheelhouse, its own one;
    # CUDA: PyPI only, the wheelhouse the test image shares. The built image is checked against TORCH_CUDA.
    assert cpu["WHEELHOUSE_INDEX"] == dockerfile_default("TORCH_INDEX_URL") == "https://download.pytorch.org/whl/cpu"
    assert cuda["WHEELHOUSE_INDEX"] == ""
    assert (cpu["TORCH_CUDA"], cuda["TORCH_CUDA"]) == ("no", "yes")
    assert cpu["WHEELHOUSE"] != cuda["WHEELHOUSE"]
    # a mirror of the CPU index, and a registry name for the push
    tag, mirrored = release_args("cpu", TORCH_INDEX_URL="https://mirror.example/whl/cpu",
                                 RELEASE_REPOSITORY="registry.example.com/ml/rollout-reassembler")
    assert mirrored["WHEELHOUSE_INDEX"] == "https://mirror.example/whl/cpu"
    assert tag == f"registry.example.com/ml/rollout-reassembler:{VERSION}"
    bad = run(["bash", IMAGES_SH, "release", "gpu"])
    assert bad.returncode == 2 and "release cpu|cuda" in bad.stderr


def test_the_stage_build_passes_the_wheelhouse_index_as_torch_index_url():
    # Same build arguments would let docker reuse the CUDA build's dependency layer in the CPU build.
    text = IMAGES_SH.read_text()
    assert '--build-arg "TORCH_INDEX_URL=${WHEELHOUSE_INDEX:-}"' in text
    assert 'index=(--extra-index-url "$WHEELHOUSE_INDEX")' in text


@pytest.mark.parametrize(("target", "variant"), [("image", "cpu"), ("image-cuda", "cuda")])
def test_make_image_targets_run_the_release_build(target, variant):
    out = run(["make", "-n", "--no-print-directory", target])
    assert out.returncode == 0, out.stderr
    assert f"bash tools/docker/images.sh release {variant}" in out.stdout.splitlines()


def test_make_chart_packages_the_chart_version(tmp_path):
    helm()  # skips without helm (`make helm`)
    out = run(["make", "--no-print-directory", "chart", f"DIST={tmp_path}"], timeout=120)
    assert out.returncode == 0, out.stderr
    package = tmp_path / f"rollout-reassembler-{CHART_META['version']}.tgz"
    with tarfile.open(package) as tar:
        meta = yaml.safe_load(tar.extractfile("rollout-reassembler/Chart.yaml"))
        names = tar.getnames()
    assert (meta["version"], meta["appVersion"]) == (CHART_META["version"], VERSION)
    assert "rollout-reassembler/values.schema.json" in names
    assert "rollout-reassembler/templates/statefulset.yaml" in names


def test_make_chart_without_helm_says_how_to_get_it(tmp_path):
    env = {**os.environ, "PATH": "/usr/bin:/bin"}
    assert run(["sh", "-c", "command -v helm"], env=env).returncode != 0
    out = run(["make", "--no-print-directory", "chart", f"HELM={tmp_path}/none", f"DIST={tmp_path}"], env=env)
    assert out.returncode != 0
    assert "make helm" in out.stderr
    assert not list(tmp_path.glob("*.tgz"))


def registry_block() -> str:
    text = (ROOT / "docs" / "operations.md").read_text()
    section = text.split("## Install from a registry", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)```", section, re.S)
    return block


def test_docs_install_from_a_registry_agrees_with_the_makefile_and_chart():
    block = registry_block()
    commands = [shlex.split(c, comments=True) for c in block.replace("\\\n", " ").splitlines()]
    commands = [c for c in commands if c]
    assert ["make", "image", "image-cuda", "chart"] in commands
    package = f"dist/rollout-reassembler-{CHART_META['version']}.tgz"
    (push,) = [c for c in commands if c[:2] == ["helm", "push"]]
    assert push[2] == package and push[3].startswith("oci://")
    (install,) = [c for c in commands if c[:2] == ["helm", "install"]]
    assert install[3] == f"{push[3]}/{CHART_META['name']}"
    assert install[install.index("--version") + 1] == CHART_META["version"]
    assert f"for tag in {VERSION} {VERSION}-cuda; do" in block
    sets = dict(install[i + 1].split("=", 1) for i, a in enumerate(install) if a == "--set")
    assert sets["image.tag"] == VERSION
    # every --set is a value the chart has (the schema refuses unknown keys anyway)
    for key in sets:
        node = VALUES
        for part in re.sub(r"\[\d+\]", "", key).split("."):
            assert isinstance(node, dict) and part in node, key
            node = node[part]
            if isinstance(node, list):
                break
    # what those values give the pods
    spec = one(render({"image": {"repository": "r.example/rr", "tag": VERSION},
                       "imagePullSecrets": [{"name": "regcred"}]}), "StatefulSet")["spec"]["template"]["spec"]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["containers"][0]["image"] == f"r.example/rr:{VERSION}"


def test_released_images_build_the_compiled_module_and_test_images_do_not_download_a_toolchain():
    # released: the Dockerfile's toolchain (stage._native built, checked in the build), unless
    # RUST_TOOLCHAIN says otherwise (empty: without it). Test images (`images.sh all`, what `make
    # test` builds) get an empty one unless the environment names one: CI reaches package
    # registries, not necessarily rustup's server.
    _, cpu = release_args("cpu")
    assert dockerfile_default("RUST_TOOLCHAIN")
    assert cpu["RUST_TOOLCHAIN"] == os.environ.get("RUST_TOOLCHAIN", dockerfile_default("RUST_TOOLCHAIN"))
    _, without = release_args("cuda", RUST_TOOLCHAIN="")
    assert without["RUST_TOOLCHAIN"] == ""
    assert '--build-arg "RUST_TOOLCHAIN=${RUST_TOOLCHAIN-}"' in IMAGES_SH.read_text()
