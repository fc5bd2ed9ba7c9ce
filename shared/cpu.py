"""This machine's CPU as Linux describes it in /proc/cpuinfo: its model's name, its vendor and its
flags (the instruction sets it has). Where there is no /proc/cpuinfo, what `platform` knows, no
vendor and no flags."""

from __future__ import annotations

import platform
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")


def cpu_name() -> str:
    """The first CPU's model name ("Intel(R) Xeon(R) Processor"), else the platform's processor."""
    return _field("model name") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """The first CPU's x86 vendor ("GenuineIntel", "AuthenticAMD", ...); "" where none is named
    (another architecture's /proc/cpuinfo, or none)."""
    return _field("vendor_id")


def cpu_flags() -> frozenset[str]:
    """The first CPU's flags ("avx2", "avx512_bf16", "amx_tile", ...); empty where unknown."""
    return frozenset(_field("flags").split())


def is_x86() -> bool:
    """Whether this is an x86-64 machine (Linux and macOS say x86_64, Windows AMD64)."""
    return platform.machine() in ("x86_64", "AMD64")


def _field(name: str) -> str:
    try:
        lines = CPUINFO.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.split(":", 1)[1].strip() for line in lines if line.split(":", 1)[0].strip() == name), "")
