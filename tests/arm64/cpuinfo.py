"""Print a /proc/cpuinfo for the arm64 CPU qemu-user emulates, from its hardware capabilities (getauxval).

qemu-user before 8.2 shows an emulated process the host's /proc/cpuinfo (x86's "flags"), and torch's cpuinfo
library then fails to start ("Failed to initialize cpuinfo!"); tests/arm64/run.sh binds this text over it, so the
root reads as an arm64 Linux machine would: the engine reads its "Features" line, as on real hardware.
"""

from __future__ import annotations

import ctypes
import os

AT_HWCAP, AT_HWCAP2 = 16, 26
# Linux's names for each bit (arch/arm64/kernel/cpuinfo.c), in bit order
HWCAP = ("fp", "asimd", "evtstrm", "aes", "pmull", "sha1", "sha2", "crc32", "atomics", "fphp", "asimdhp", "cpuid",
         "asimdrdm", "jscvt", "fcma", "lrcpc", "dcpop", "sha3", "sm3", "sm4", "asimddp", "sha512", "sve", "asimdfhm",
         "dit", "uscat", "ilrcpc", "flagm", "ssbs", "sb", "paca", "pacg")
HWCAP2 = ("dcpodp", "sve2", "sveaes", "svepmull", "svebitperm", "svesha3", "svesm4", "flagm2", "frint", "svei8mm",
          "svef32mm", "svef64mm", "svebf16", "i8mm", "bf16", "dgh", "rng", "bti", "mte")


def features() -> list[str]:
    getauxval = ctypes.CDLL(None).getauxval
    getauxval.argtypes, getauxval.restype = [ctypes.c_ulong], ctypes.c_ulong
    return [name for word, names in ((AT_HWCAP, HWCAP), (AT_HWCAP2, HWCAP2))
            for bit, name in enumerate(names) if getauxval(word) >> bit & 1]


def main() -> None:
    listed = " ".join(features())
    for cpu in range(os.cpu_count() or 1):
        print(f"processor\t: {cpu}\nBogoMIPS\t: 50.00\nFeatures\t: {listed}\nCPU implementer\t: 0x00\n"
              "CPU architecture: 8\nCPU variant\t: 0x0\nCPU part\t: 0x051\nCPU revision\t: 0\n")


if __name__ == "__main__":
    main()
