"""The fingerprint: what it reads on the CPU, and that nothing it shells out to can fail a run."""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from factories import make_fingerprint

import suite.harness.fingerprint as fp_mod
from suite.harness.fingerprint import device_slug, fingerprint, fingerprint_class

SMI_TWO_GPUS = (
    "GPU-aaaa, 580.82.07, 345, 3201, 1980\n"
    "GPU-bbbb, 580.82.07, [N/A], 3201, 1980\n"
)


def test_cpu_fingerprint():
    fp = fingerprint(torch.device("cpu"), "none")
    assert fp.device_slug == "cpu"
    assert fp.gpu_name is None and fp.compute_capability is None and fp.sm_count is None
    assert fp.clocks == {}
    assert fp.torch == torch.__version__
    assert fp.python == ".".join(map(str, sys.version_info[:3]))
    assert fp.profile == "none"
    if (fp_mod.PROJECT_ROOT / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", fp.git_sha)
        assert isinstance(fp.git_dirty, bool)


@pytest.fixture
def checkout_without_stamp(monkeypatch, tmp_path):
    """A checkout (it has .git) with no .git-sha stamp, so a failing git leaves no sha."""
    (tmp_path / ".git").mkdir()
    monkeypatch.setattr(fp_mod, "PROJECT_ROOT", tmp_path)


def test_cpu_fingerprint_never_raises_when_every_command_fails(monkeypatch, checkout_without_stamp):
    def no_commands(*args, **kwargs):
        raise FileNotFoundError("no such program")

    monkeypatch.setattr(subprocess, "run", no_commands)
    fp = fingerprint(torch.device("cpu"), "rtx")
    assert fp.git_sha is None and fp.git_dirty is None and fp.driver is None
    assert fp.profile == "rtx"


def test_a_hanging_command_is_given_up(monkeypatch, checkout_without_stamp):
    def hangs(args, **kwargs):
        raise subprocess.TimeoutExpired(args, kwargs.get("timeout"))

    monkeypatch.setattr(subprocess, "run", hangs)
    assert fingerprint(torch.device("cpu"), "none").git_sha is None


def test_outside_a_checkout_there_is_no_sha(monkeypatch, tmp_path):
    monkeypatch.setattr(fp_mod, "PROJECT_ROOT", tmp_path)
    fp = fingerprint(torch.device("cpu"), "none")
    assert fp.git_sha is None and fp.git_dirty is None


def test_triton_version_is_read_without_importing_triton():
    code = (
        "import sys, torch\n"
        "from suite.harness.fingerprint import fingerprint\n"
        "fingerprint(torch.device('cpu'), 'none')\n"
        "print('triton' in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_triton_absent_gives_none(monkeypatch):
    def not_installed(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", not_installed)
    assert fingerprint(torch.device("cpu"), "none").triton is None


def test_nvidia_smi_row_is_matched_by_uuid(monkeypatch):
    monkeypatch.setattr(fp_mod, "_run", lambda args, cwd=None: SMI_TWO_GPUS)
    assert fp_mod._nvidia_smi("GPU-aaaa") == ("580.82.07", {"sm": 345, "mem": 3201, "max_sm": 1980})
    # an unreadable clock is left out, not guessed
    assert fp_mod._nvidia_smi("GPU-bbbb") == ("580.82.07", {"mem": 3201, "max_sm": 1980})
    # no matching row (e.g. a MIG slice): the driver is shared, the clocks are not known
    assert fp_mod._nvidia_smi("MIG-cccc") == ("580.82.07", {})


@pytest.mark.parametrize("answer", [None, "", "\n"])
def test_nvidia_smi_absent_or_failing(monkeypatch, answer):
    monkeypatch.setattr(fp_mod, "_run", lambda args, cwd=None: answer)
    assert fp_mod._nvidia_smi("GPU-aaaa") == (None, {})


def test_cuda_fingerprint_from_device_properties(monkeypatch):
    props = SimpleNamespace(name="NVIDIA GeForce RTX 5090", major=12, minor=0,
                            total_memory=16 * 2**30, multi_processor_count=170, uuid="aaaa")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    real_run = fp_mod._run
    monkeypatch.setattr(fp_mod, "_run", lambda args, cwd=None: SMI_TWO_GPUS
                        if args[0] == "nvidia-smi" else real_run(args, cwd))
    fp = fingerprint(torch.device("cuda", 0), "rtx")
    assert fp.device_slug == "nvidia-geforce-rtx-5090"
    assert fp.gpu_name == "NVIDIA GeForce RTX 5090"
    assert fp.compute_capability == "12.0"
    assert fp.gpu_memory_bytes == 16 * 2**30 and fp.sm_count == 170
    assert fp.driver == "580.82.07" and fp.clocks["sm"] == 345


@pytest.mark.parametrize("name, slug", [
    ("NVIDIA H200", "nvidia-h200"),
    ("NVIDIA GeForce RTX 5090", "nvidia-geforce-rtx-5090"),
    ("NVIDIA H100 80GB HBM3", "nvidia-h100-80gb-hbm3"),
    ("NVIDIA A100-SXM4-80GB", "nvidia-a100-sxm4-80gb"),
])
def test_device_slug(name, slug):
    assert device_slug(name) == slug


def test_fingerprint_class_keeps_what_must_match():
    fp = make_fingerprint(torch="2.13.0+cu130", triton="3.9.1", driver="999", git_sha="f" * 40)
    assert fingerprint_class(fp) == {
        "device_slug": "nvidia-h200", "compute_capability": "9.0", "torch": "2.13",
        "triton": "3.9", "profile": "none",
    }
    assert fingerprint_class(make_fingerprint(triton=None))["triton"] is None
    # patch versions, driver and clocks do not change the class
    assert fingerprint_class(make_fingerprint(torch="2.11.1", clocks={})) == fingerprint_class(make_fingerprint())


@pytest.mark.parametrize("history", ["none", "empty .git"])
def test_a_copied_tree_reports_its_stamped_sha(monkeypatch, tmp_path, history):
    if history == "empty .git":  # the GPU machine's copy: a repository with no commits
        subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".git-sha").write_text("0123456789abcdef0123456789abcdef01234567\n")
    monkeypatch.setattr(fp_mod, "PROJECT_ROOT", tmp_path)
    fp = fingerprint(torch.device("cpu"), "none")
    assert fp.git_sha == "0123456789abcdef0123456789abcdef01234567" and fp.git_dirty is None


def test_the_commit_a_copied_tree_was_taken_at_wins_over_its_git(monkeypatch):
    monkeypatch.setenv("SUITE_GIT_SHA", "f" * 40)
    fp = fingerprint(torch.device("cpu"), "none")
    assert fp.git_sha == "f" * 40 and fp.git_dirty is None
