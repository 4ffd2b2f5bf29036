"""A plain (non-editable) install carries the recipes and configs."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import venv
import zipfile

from tests.conftest import REPO


def test_wheel_install_lists_copies_and_validates(tmp_path):
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), str(REPO)],
        check=True, capture_output=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = wheels.glob("freetx-*.whl")
    # every package of the source tree is in the wheel (found, not listed by hand)
    inside = set(zipfile.ZipFile(wheel).namelist())
    packages = sorted((REPO / "freetx").rglob("__init__.py"))
    missing = [str(p.relative_to(REPO)) for p in packages if str(p.relative_to(REPO)) not in inside]
    assert len(packages) >= 10 and not missing, missing  # freetx and its 9 subpackages
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=False)
    python = env_dir / "bin" / "python"
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site, str(wheel)],
        check=True, capture_output=True,
    )  # fmt: skip
    # torch & co. come from this interpreter's site-packages (appended after the
    # venv's own, so the venv's freetx, from the wheel, wins over the editable one)
    ours = sysconfig.get_paths()["purelib"]
    (env_dir / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
     / "site-packages" / "deps.pth").write_text(ours + "\n")  # fmt: skip
    freetx = [str(python), "-m", "freetx"]

    where = subprocess.run(
        [str(python), "-c", "import freetx; print(freetx.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout
    assert where.startswith(site), where
    listed = subprocess.run([*freetx, "ls"], capture_output=True, text=True, cwd=tmp_path)
    assert listed.returncode == 0 and "llm/tiny" in listed.stdout, listed.stderr
    copied = subprocess.run(
        [*freetx, "cp", "full_finetune_fsdp2", "r.py"], capture_output=True, text=True, cwd=tmp_path
    )
    assert copied.returncode == 0 and (tmp_path / "r.py").stat().st_size > 1000
    subprocess.run([*freetx, "cp", "llm/tiny", "c.yaml"], check=True, cwd=tmp_path)
    assert "max_steps" in (tmp_path / "c.yaml").read_text()
    valid = subprocess.run(
        [*freetx, "validate", "llm/tiny"], capture_output=True, text=True, cwd=tmp_path
    )
    assert valid.returncode == 0, valid.stdout + valid.stderr
