"""The program's heap policy (``edgetl.heap``): with it, memory a step frees is reused by the next
step without the kernel mapping it in again, which the kernel's own page-fault count shows (a
second instrument, not a clock), and the process's peak stays the same; where it is not applied
(the user's tuning, a Jetson, not glibc) it says why; the program applies it, the library does not."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import edgetl.heap
from edgetl.heap import DEFAULT, glibc_version, heap_policy, hold_freed_memory

# A lean Rep-Net training step (MobileNetV2 0.35, 64 px, batch 32: the demo's shape) run step after
# step, as finetune runs it; the child prints the page faults of steps 4-10 and its peak resident set.
CHILD = """
import json, resource, sys, torch
torch.set_num_threads(1)
from edgetl.bench import cpu_trainers
from edgetl.heap import heap_policy, hold_freed_memory
if sys.argv[1] == "held":
    hold_freed_memory()
trainer = cpu_trainers(["repnet-lean"], resolution=64, batch_size=32, num_classes=10, width=0.35)["repnet-lean"]
faults = []
for step in range(10):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    trainer.step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"faults": sorted(faults[3:]), "maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "heap": heap_policy()}))
"""

needs_glibc = pytest.mark.skipif(glibc_version() is None,
                                 reason="the policy is glibc's mallopt; this C library is not glibc")


def run_child(policy: str) -> dict:
    env = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "OMP_WAIT_POLICY": "PASSIVE"}
    out = subprocess.run([sys.executable, "-c", CHILD, policy], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_glibc
def test_held_memory_is_not_mapped_in_again_each_step():
    default, held = run_child("default"), run_child("held")
    assert default["heap"] == DEFAULT and held["heap"].startswith("freed memory held (glibc ")
    # glibc's default gives the step's large blocks back and maps them in again: thousands of
    # page faults every step (about 6,400 here); held, the next step reuses them (about 750)
    median = {k: r["faults"][len(r["faults"]) // 2] for k, r in (("default", default), ("held", held))}
    assert median["default"] > 2000 and median["held"] < median["default"] / 4, (default, held)
    # and the process's peak stays where it was (within 3 %)
    assert abs(held["maxrss_kb"] - default["maxrss_kb"]) < 0.03 * default["maxrss_kb"], (held, default)


@pytest.fixture(autouse=True)
def policy_restored(monkeypatch):
    """What this process reports is left as it was (the calls below set no malloc option)."""
    monkeypatch.setattr(edgetl.heap, "_policy", edgetl.heap._policy)


def test_a_users_own_malloc_tuning_is_kept():
    said = hold_freed_memory(environ={"MALLOC_TRIM_THRESHOLD_": "0", "PATH": "/usr/bin"})
    if glibc_version() is None:
        assert said == f"{DEFAULT} (not glibc)"
    else:
        assert said == f"{DEFAULT} (the user's MALLOC_TRIM_THRESHOLD_ kept)"
        assert hold_freed_memory(environ={"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}) == (
            f"{DEFAULT} (the user's GLIBC_TUNABLES kept)")
    assert heap_policy().startswith(f"{DEFAULT} (")  # what was said, not a policy applied


@needs_glibc
@pytest.mark.parametrize("marker", ["etc/nv_tegra_release", "proc/device-tree/model"])
def test_not_on_a_jetson(tmp_path, marker):
    # a Jetson's CPU memory is its GPU's: what the CPU side frees goes back to the shared pool
    path = tmp_path / marker
    path.parent.mkdir(parents=True)
    path.write_text("# R36 (release), REVISION: 4.0\n" if "tegra" in marker else "NVIDIA Jetson AGX Orin\x00")
    assert hold_freed_memory(environ={}, root=str(tmp_path)) == f"{DEFAULT} (a Jetson: the CPU's memory is the GPU's)"


@needs_glibc
def test_the_program_applies_it_and_the_library_does_not():
    env = {"PATH": "/usr/bin:/bin"}
    program = subprocess.run([sys.executable, "-m", "edgetl", "doctor", "--no-gpu", "--json"], env=env,
                             capture_output=True, text=True, check=True)
    assert json.loads(program.stdout)["heap"].startswith("freed memory held (glibc ")
    library = subprocess.run([sys.executable, "-c", "import edgetl.cli, edgetl.bench, edgetl.heap as h; "
                              "print(h.heap_policy())"], env=env, capture_output=True, text=True, check=True)
    assert library.stdout.strip() == DEFAULT
