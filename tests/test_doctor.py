"""edgetl doctor: facts checked against /proc/meminfo parsed here, Jetson detection on a fake root, CLI output."""

import json
import platform
import shutil

import pytest

from edgetl.cli import main as cli_main
from edgetl.doctor import CUDA_CONTEXT_BYTES, doctor, parse_l4t_release, read_meminfo, suggested_budget


def meminfo_kib(path="/proc/meminfo") -> dict[str, int]:
    out = {}
    for line in open(path):
        key, rest = line.split(":", 1)
        out[key] = int(rest.split()[0])
    return out


def test_memory_facts_match_proc_meminfo():
    # MemAvailable moves while other processes run (by more than 64 MiB between two reads
    # under a parallel test run): the report is compared where /proc/meminfo read the same
    # just before and just after it, to the byte; a window that moved (or moved and came
    # back: the report differs) is read again
    for _ in range(50):
        before = meminfo_kib()
        report = doctor(probe_gpu=False)
        ref = meminfo_kib()
        if before["MemAvailable"] * 1024 == ref["MemAvailable"] * 1024 == report.mem_available_bytes:
            break  # read still, and the report is that value to the byte
    else:  # never still with the report equal: between the lowest and highest of the last two reads
        low, high = sorted((before["MemAvailable"] * 1024, ref["MemAvailable"] * 1024))
        assert low - 64 * 2**20 <= report.mem_available_bytes <= high + 64 * 2**20
    assert report.mem_total_bytes == ref["MemTotal"] * 1024
    assert report.machine == platform.machine()
    expected = int(report.mem_available_bytes * 0.75) // 10**6 * 10**6
    assert report.suggested_budget_bytes == expected  # no integrated GPU on this machine


def test_versions_are_the_installed_ones():
    import onnx
    import onnxruntime
    import torch

    report = doctor(probe_gpu=False)
    assert report.torch == torch.__version__ and report.torch_cuda == torch.version.cuda
    assert report.onnx == onnx.__version__ and report.onnxruntime == onnxruntime.__version__
    try:
        import tensorrt
    except ImportError:
        assert report.tensorrt is None
    else:
        assert report.tensorrt == tensorrt.__version__


def test_jetson_fake_root(tmp_path):
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/nv_tegra_release").write_text(
        "# R36 (release), REVISION: 4.0, GCID: 37537400, BOARD: generic, EABI: aarch64, DATE: Fri Sep 13 04:36:44 UTC 2024\n"
    )
    (tmp_path / "proc/device-tree").mkdir(parents=True)
    (tmp_path / "proc/device-tree/model").write_bytes(b"NVIDIA Jetson Orin Nano Engineering Reference Developer Kit\x00")
    (tmp_path / "proc/meminfo").write_text("MemTotal:        7802032 kB\nMemFree:          512000 kB\nMemAvailable:    5000000 kB\n")
    report = doctor(root=tmp_path, probe_gpu=False)
    assert report.is_jetson and report.l4t_release == "36.4.0" and report.jetpack == "6.1"
    assert report.jetson_model == "NVIDIA Jetson Orin Nano Engineering Reference Developer Kit"
    assert report.gpu_is_integrated is True
    assert report.mem_available_bytes == 5000000 * 1024
    # 75 % of 5.12 GB less the 300 MB CUDA context, rounded down to whole MB.
    assert report.suggested_budget_bytes == (int(5000000 * 1024 * 0.75) - CUDA_CONTEXT_BYTES) // 10**6 * 10**6
    assert report.suggested_budget_bytes == 3_540_000_000


def test_not_jetson_and_missing_meminfo(tmp_path):
    report = doctor(root=tmp_path, probe_gpu=False)
    assert not report.is_jetson and report.l4t_release is None
    assert report.mem_available_bytes is None and report.suggested_budget_bytes is None
    assert any("MemAvailable" in note for note in report.notes)


@pytest.mark.parametrize("text, expected", [
    ("# R36 (release), REVISION: 4.3, GCID: 38968081, BOARD: generic, EABI: aarch64", "36.4.3"),
    ("# R35 (release), REVISION: 4.1, GCID: 33958178, BOARD: t186ref, EABI: aarch64", "35.4.1"),
    ("garbage", None),
])
def test_parse_l4t_release(text, expected):
    assert parse_l4t_release(text) == expected


def test_read_meminfo_units(tmp_path):
    (tmp_path / "m").write_text("MemTotal: 100 kB\nHugePages_Total:       0\nActive(anon):  4 kB\n")
    assert read_meminfo(tmp_path / "m") == {"MemTotal": 102400, "HugePages_Total": 0, "Active(anon)": 4096}
    assert suggested_budget(None, True) is None
    assert suggested_budget(100 * 10**6, True) == 0


def test_cli_doctor_text_and_json(capsys):
    assert cli_main(["doctor", "--no-gpu", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    ref = meminfo_kib()
    assert data["mem_total_bytes"] == ref["MemTotal"] * 1024
    assert abs(data["mem_available_bytes"] - ref["MemAvailable"] * 1024) <= 64 * 2**20
    assert cli_main(["doctor", "--no-gpu"]) == 0
    text = capsys.readouterr().out
    line = next(line for line in text.splitlines() if line.startswith("memory total"))
    assert line.split()[-2:] == [f"{ref['MemTotal'] * 1024 / 10**6:.0f}", "MB"]
    assert "suggested --budget" in text and "Jetson" in text


def _cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo"):
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def test_cpu_kernels_are_the_instructions_this_cpu_has():
    """The instructions ATen's kernels use, against the processor's own flags (/proc/cpuinfo); the
    AVX-512 note only where they are AVX-512 and nothing caps them."""
    import torch

    report = doctor(probe_gpu=False)
    assert report.cpu_capability == torch.backends.cpu.get_cpu_capability()
    flags = _cpu_flags()
    if report.cpu_capability.startswith("AVX512"):
        assert "avx512f" in flags
    elif report.cpu_capability == "AVX2":
        assert "avx2" in flags and "avx512f" not in flags or report.kernel_caps
    noted = any("AVX-512" in note for note in report.notes)
    capped = {"ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS"} & set(report.kernel_caps)
    assert noted == (report.cpu_capability.startswith("AVX512") and not capped)


def test_kernel_caps_are_the_ones_set_and_printed(monkeypatch, capsys):
    for name in ("ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY"):
        monkeypatch.delenv(name, raising=False)
    assert doctor(probe_gpu=False).kernel_caps == {}
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    report = doctor(probe_gpu=False)
    assert report.kernel_caps == {"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
    assert not any("AVX-512" in note for note in report.notes)
    assert cli_main(["doctor", "--no-gpu"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("CPU kernels"))
    assert line.split(None, 2)[2] == (f"{report.cpu_capability} (ATen); ONEDNN_MAX_CPU_ISA=AVX2, "
                                      "MKL_ENABLE_INSTRUCTIONS=AVX2")
    # ATen's own cap alone leaves oneDNN and MKL uncapped, and says so
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert cli_main(["doctor", "--no-gpu"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("CPU kernels"))
    assert line.endswith("; ATEN_CPU_CAPABILITY=default, oneDNN and MKL uncapped")


def test_the_compiler_that_builds_the_fused_kernels_is_named_or_its_absence_said(monkeypatch, capsys, tmp_path):
    cxx = tmp_path / "my-c++"
    cxx.write_text("#!/bin/sh\nexit 0\n")
    cxx.chmod(0o755)
    monkeypatch.setenv("CXX", str(cxx))
    assert doctor(probe_gpu=False).cxx == str(cxx)
    assert cli_main(["doctor", "--no-gpu"]) == 0
    ninja = shutil.which("ninja")
    out = capsys.readouterr().out
    if ninja:
        assert f"{cxx}, ninja {ninja} (build --mask-kernels fused)" in out
    else:
        assert f"{cxx}; no ninja: --mask-kernels fused is refused" in out
    monkeypatch.setenv("CXX", str(tmp_path / "missing"))
    assert doctor(probe_gpu=False).cxx is None
    assert cli_main(["doctor", "--no-gpu"]) == 0
    assert "none; no C++ compiler" in capsys.readouterr().out


def test_a_machine_without_setuptools_is_told_fused_is_refused(monkeypatch, capsys):
    """A compiler and ninja are not enough: torch's extension builder imports setuptools
    (``fused.missing``), and the doctor says so rather than that fused builds."""
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "setuptools" else find_spec(name, *a))
    report = doctor(probe_gpu=False)
    assert report.fused_missing == "setuptools (torch's extension builder imports it)"
    assert cli_main(["doctor", "--no-gpu"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("C++ compiler"))
    if report.cxx and report.ninja:
        assert line.endswith("; no setuptools (torch's extension builder imports it): --mask-kernels fused is refused")
    else:  # no compiler or no ninja here: those are named first
        assert line.endswith(": --mask-kernels fused is refused") and "setuptools" not in line
