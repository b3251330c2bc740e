"""Registers and spills of a kernel's PTX as Triton's bundled ptxas reports them for an H100 (sm_90a), no GPU
needed; shared by benchmarks/flash_compile_check.py and benchmarks/lora_compile_check.py."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile


def ptxas_report(ptx: str) -> dict[str, int]:
    """{"regs": registers per thread, "spill_bytes": spill stores + loads}; -1 where ptxas printed no figure."""
    from triton.backends.nvidia.compiler import get_ptxas

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        r = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.o")],
                           capture_output=True, text=True)
    regs = re.findall(r"Used (\d+) registers", r.stderr)
    spill = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", r.stderr)
    return {"regs": int(regs[0]) if regs else -1,
            "spill_bytes": sum(int(a) + int(b) for a, b in spill) if spill else -1}
