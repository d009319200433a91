"""The package: `python -m build` makes an sdist and, from it, a wheel with complete metadata; the wheel installs
into a clean virtual environment and runs `govtrain --help`, `govtrain-verify --help` and `import govtrain`
there, from the wheel's files, never from this checkout.

The clean environment gets govtrain alone (`pip install --no-deps`): its dependencies come from the test
environment's site-packages through a `.pth` line, so nothing is downloaded. A path line in a `.pth` file adds
that folder to sys.path without running the `.pth` files in it, so this checkout's editable install stays
inactive there; the test checks that, and that every requirement the wheel declares is met.
"""

from __future__ import annotations

import email
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("build")

REPO = Path(__file__).resolve().parents[1]
EXTRAS = {"hf", "demo", "dev", "docs", "bench", "serve"}


def _source_tree(target: Path) -> Path:
    """The files a clean clone has (and new ones not yet committed, unless ignored), copied to `target`."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, text=True, check=True).stdout.split("\n")
    for name in filter(None, listed):
        if (REPO / name).is_file():
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, target / name)
    return target


def _package_files() -> set[str]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "govtrain",
                             "ledger_store"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    return {name for name in listed if (REPO / name).is_file()}


def _clean_environment() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV",
                                                              "PYTHONSTARTUP", "PYTHONUSERBASE")}


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    """sdist, then the wheel built from the sdist (what `python -m build` does), with no download."""
    source = _source_tree(tmp_path_factory.mktemp("clone"))
    out = tmp_path_factory.mktemp("dist")
    result = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(source)],
                            capture_output=True, text=True, env=_clean_environment())
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def _only(folder: Path, pattern: str) -> Path:
    found = sorted(folder.glob(pattern))
    assert len(found) == 1, found
    return found[0]


def test_the_sdist_holds_the_package_and_what_building_it_needs(dist: Path):
    import govtrain

    sdist = _only(dist, f"govtrain-{govtrain.__version__}.tar.gz")
    with tarfile.open(sdist) as archive:
        names = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    assert {"pyproject.toml", "README.md", "LICENSE", "MANIFEST.in", "mkdocs.yml", "PKG-INFO"} <= names
    assert _package_files() <= names
    assert {"docs/index.md", "docs/design.md", "schemas/ledger.cddl"} <= names  # what the README links to
    # the wheel beside it was built from this sdist alone (the fixture's `python -m build`)


def test_the_wheel_holds_every_package_and_complete_metadata(dist: Path):
    import govtrain

    wheel = _only(dist, f"govtrain-{govtrain.__version__}-py3-none-any.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        info = f"govtrain-{govtrain.__version__}.dist-info"
        metadata = email.message_from_bytes(archive.read(f"{info}/METADATA"))
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
    assert _package_files() <= names, _package_files() - names  # every module, and data files if any appear
    assert {name.split("/")[0] for name in names} == {"govtrain", "ledger_store", info}  # nothing else
    assert f"{info}/licenses/LICENSE" in names
    assert metadata["Name"] == "govtrain" and metadata["Version"] == govtrain.__version__
    assert metadata["License-Expression"] == "Apache-2.0" and metadata["Requires-Python"] == ">=3.11"
    assert metadata["Summary"] and metadata["Author"] and metadata["Keywords"]
    assert metadata["Description-Content-Type"] == "text/markdown" and "make demo" in metadata.get_payload()
    classifiers = metadata.get_all("Classifier")
    assert "Programming Language :: Python :: 3.11" in classifiers and any("Topic ::" in c for c in classifiers)
    urls = dict(url.split(", ", 1) for url in metadata.get_all("Project-URL"))
    assert {"Homepage", "Documentation", "Source", "Issues"} <= set(urls)
    assert set(metadata.get_all("Provides-Extra")) == EXTRAS
    assert "govtrain = govtrain.cli.main:main" in entry_points
    assert "govtrain-verify = govtrain.cli.verify:main" in entry_points


CHECK_REQUIREMENTS = """
import importlib.metadata as md
from packaging.requirements import Requirement
unmet = []
for line in md.requires("govtrain"):
    requirement = Requirement(line)
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue  # an extra's
    try:
        version = md.version(requirement.name)
    except md.PackageNotFoundError:
        unmet.append(f"{requirement} (not installed)")
        continue
    if not requirement.specifier.contains(version, prereleases=True):
        unmet.append(f"{requirement} ({version} installed)")
print("unmet:", unmet)
"""


def test_the_wheel_installs_into_a_clean_venv_and_runs_from_there(dist: Path, tmp_path: Path):
    wheel = _only(dist, "govtrain-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    result = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--quiet",
                             "--no-deps", "--no-index", str(wheel)], capture_output=True, text=True,
                            env=_clean_environment())
    assert result.returncode == 0, result.stderr
    site_packages = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                        capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies: this environment's site-packages, as a plain path line (its own .pth files stay inert)
    (site_packages / "zz-test-dependencies.pth").write_text(sysconfig.get_path("purelib") + "\n")

    def run(*command: str) -> subprocess.CompletedProcess:
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, env=_clean_environment())

    where = run(str(python), "-c", "import govtrain, ledger_store; print(govtrain.__file__); "
                                   "print(ledger_store.__file__); print(govtrain.__version__)")
    assert where.returncode == 0, where.stderr
    module, store, version = where.stdout.split()
    assert Path(module).is_relative_to(site_packages) and Path(store).is_relative_to(site_packages), where.stdout
    assert not Path(module).is_relative_to(REPO)
    assert wheel.name.startswith(f"govtrain-{version}-")
    for program, usage in (("govtrain", "Usage: govtrain [OPTIONS] COMMAND"), ("govtrain-verify", "Usage: govtrain-verify")):
        result = run(str(venv / "bin" / program), "--help")
        assert result.returncode == 0 and result.stdout.startswith(usage), result.stdout + result.stderr
    requirements = run(str(python), "-c", CHECK_REQUIREMENTS)
    assert requirements.stdout.strip() == "unmet: []", requirements.stdout + requirements.stderr
