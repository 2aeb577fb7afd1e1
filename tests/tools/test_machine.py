"""The machine line benches record, and the CPU facts the dtype rule and the learning bench read."""

from __future__ import annotations

import os
import subprocess
import sys

from ermedrag.tools.machine import cpu_model, describe_machine, parse_cpuinfo

X86 = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480C
flags\t\t: fpu avx512f amx_bf16 avx512_bf16

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480C
flags\t\t: fpu avx512f amx_bf16 avx512_bf16
"""
ARM = """processor\t: 0
BogoMIPS\t: 2000.00
Features\t: fp asimd bf16 sve
CPU implementer\t: 0x41

processor\t: 1
Features\t: fp asimd bf16 sve
"""


def test_the_first_processor_block_is_read_on_x86_and_arm():
    assert parse_cpuinfo(X86)["model name"] == "Intel(R) Xeon(R) Platinum 8480C"
    assert parse_cpuinfo(X86)["flags"].split() == ["fpu", "avx512f", "amx_bf16", "avx512_bf16"]
    assert parse_cpuinfo(ARM)["Features"].split() == ["fp", "asimd", "bf16", "sve"]
    assert "model name" not in parse_cpuinfo(ARM)
    assert parse_cpuinfo("") == {} and parse_cpuinfo("no colon here\n\n") == {}


def test_the_machine_line_names_the_cpu_and_cores_without_importing_torch():
    """A bench measuring memory must not have torch pulled into its parent by the machine line (a child inherits
    its parent's peak RSS)."""
    code = (
        "import sys; from ermedrag.tools.machine import describe_machine; line = describe_machine(); "
        "print(line); print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[1] == "False"
    assert out[0].startswith(cpu_model()) and f"{os.cpu_count()} CPUs" in out[0] and "load average" in out[0]
    assert "torch" not in out[0]


def test_once_torch_is_loaded_the_machine_line_names_its_threads():
    import torch

    assert f"torch {torch.__version__} with {torch.get_num_threads()} threads" in describe_machine()
