"""The seccomp filter of the sandbox, built here as classic BPF.

See docs/security.md ("seccomp").
"""

from __future__ import annotations

import platform
import struct

# BPF opcodes (linux/filter.h, linux/seccomp.h)
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_RET_K = 0x06
RET_ALLOW = 0x7FFF0000
RET_KILL_PROCESS = 0x80000000
RET_ERRNO = 0x00050000
EPERM = 1
X32_SYSCALL_BIT = 0x40000000
_NR_OFFSET, _ARCH_OFFSET = 0, 4  # struct seccomp_data

# what is denied, and why (docs/security.md lists the same)
DENIED: dict[str, str] = {
    "ptrace": "inspect or steer another process (the sandbox's init)",
    "process_vm_readv": "read another process's memory",
    "process_vm_writev": "write another process's memory",
    "pidfd_getfd": "take a descriptor from another process",
    "kcmp": "compare other processes' kernel objects",
    "perf_event_open": "kernel and CPU profiling, a side channel",
    "bpf": "load programs into the kernel",
    "userfaultfd": "a tool of kernel exploits",
    "keyctl": "the kernel keyring (shared, not namespaced)",
    "add_key": "the kernel keyring",
    "request_key": "the kernel keyring",
    "mount": "change the sandbox's mounts",
    "umount2": "uncover what the sandbox's mounts hide",
    "pivot_root": "change the root",
    "open_tree": "the new mount API",
    "move_mount": "the new mount API",
    "fsopen": "the new mount API",
    "fsconfig": "the new mount API",
    "fsmount": "the new mount API",
    "fspick": "the new mount API",
    "mount_setattr": "the new mount API",
    "unshare": "new namespaces",
    "setns": "enter other namespaces",
    "kexec_load": "replace the kernel",
    "kexec_file_load": "replace the kernel",
    "init_module": "load kernel modules",
    "finit_module": "load kernel modules",
    "delete_module": "unload kernel modules",
    "reboot": "reboot the host",
    "swapon": "the host's swap",
    "swapoff": "the host's swap",
    "acct": "process accounting",
    "quotactl": "filesystem quotas",
    "syslog": "the kernel log",
    "settimeofday": "the host's clock",
    "clock_settime": "the host's clock",
    "clock_adjtime": "the host's clock",
    "adjtimex": "the host's clock",
    "sethostname": "the host's name",
    "setdomainname": "the host's name",
    "name_to_handle_at": "open files by handle, around the mounts",
    "open_by_handle_at": "open files by handle, around the mounts",
    "lookup_dcookie": "kernel profiling",
    "vhangup": "hang up terminals",
    "io_uring_setup": "io_uring, calls the filter does not see",
    "io_uring_enter": "io_uring",
    "io_uring_register": "io_uring",
    "move_pages": "NUMA placement of other processes' pages",
    "mbind": "NUMA policy",
    "set_mempolicy": "NUMA policy",
    "get_mempolicy": "NUMA policy",
    # x86_64 only
    "iopl": "raw I/O ports",
    "ioperm": "raw I/O ports",
    "create_module": "obsolete module calls",
    "get_kernel_syms": "obsolete module calls",
    "query_module": "obsolete module calls",
    "uselib": "obsolete loader call",
    "ustat": "obsolete",
    "sysfs": "obsolete",
    "_sysctl": "obsolete",
    "nfsservctl": "obsolete",
}

_X86_64 = {
    "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311, "pidfd_getfd": 438,
    "kcmp": 312, "perf_event_open": 298, "bpf": 321, "userfaultfd": 323, "keyctl": 250,
    "add_key": 248, "request_key": 249, "mount": 165, "umount2": 166, "pivot_root": 155,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442, "unshare": 272, "setns": 308, "kexec_load": 246,
    "kexec_file_load": 320, "init_module": 175, "finit_module": 313, "delete_module": 176,
    "reboot": 169, "swapon": 167, "swapoff": 168, "acct": 163, "quotactl": 179, "syslog": 103,
    "settimeofday": 164, "clock_settime": 227, "clock_adjtime": 305, "adjtimex": 159,
    "sethostname": 170, "setdomainname": 171, "name_to_handle_at": 303,
    "open_by_handle_at": 304, "lookup_dcookie": 212, "vhangup": 153, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "move_pages": 279, "mbind": 237,
    "set_mempolicy": 238, "get_mempolicy": 239, "iopl": 172, "ioperm": 173,
    "create_module": 174, "get_kernel_syms": 177, "query_module": 178, "uselib": 134,
    "ustat": 136, "sysfs": 139, "_sysctl": 156, "nfsservctl": 180,
}
_AARCH64 = {  # asm-generic/unistd.h
    "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271, "pidfd_getfd": 438,
    "kcmp": 272, "perf_event_open": 241, "bpf": 280, "userfaultfd": 282, "keyctl": 219,
    "add_key": 217, "request_key": 218, "mount": 40, "umount2": 39, "pivot_root": 41,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432,
    "fspick": 433, "mount_setattr": 442, "unshare": 97, "setns": 268, "kexec_load": 104,
    "kexec_file_load": 294, "init_module": 105, "finit_module": 273, "delete_module": 106,
    "reboot": 142, "swapon": 224, "swapoff": 225, "acct": 89, "quotactl": 60, "syslog": 116,
    "settimeofday": 170, "clock_settime": 112, "clock_adjtime": 266, "adjtimex": 171,
    "sethostname": 161, "setdomainname": 162, "name_to_handle_at": 264,
    "open_by_handle_at": 265, "lookup_dcookie": 18, "vhangup": 58, "io_uring_setup": 425,
    "io_uring_enter": 426, "io_uring_register": 427, "move_pages": 239, "mbind": 235,
    "set_mempolicy": 237, "get_mempolicy": 236,
}
# machine -> (AUDIT_ARCH_*, numbers, refuse x32)
ARCHES: dict[str, tuple[int, dict[str, int], bool]] = {
    "x86_64": (0xC000003E, _X86_64, True),
    "aarch64": (0xC00000B7, _AARCH64, False),
}


class UnsupportedArchError(Exception):
    """No syscall table for this machine: the filter cannot be built."""


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def program(machine: str | None = None) -> bytes:
    """The filter (struct sock_filter[]) for `machine` (default: this one's)."""
    machine = machine or platform.machine()
    if machine not in ARCHES:
        raise UnsupportedArchError(f"no seccomp syscall table for {machine!r}")
    audit_arch, table, no_x32 = ARCHES[machine]
    numbers = sorted({table[name] for name in DENIED if name in table})
    body: list[tuple[int, int, str]] = [(_JGE_K, X32_SYSCALL_BIT, "deny")] if no_x32 else []
    body += [(_JEQ_K, nr, "deny") for nr in numbers]
    head = [_insn(_LD_W_ABS, _ARCH_OFFSET), _insn(_JEQ_K, audit_arch, jt=1),
            _insn(_RET_K, RET_KILL_PROCESS), _insn(_LD_W_ABS, _NR_OFFSET)]
    out = list(head)
    deny_at = len(head) + len(body) + 1  # after the body and the allow
    for i, (code, k, _) in enumerate(body):
        out.append(_insn(code, k, jt=deny_at - (len(head) + i + 1)))
    out += [_insn(_RET_K, RET_ALLOW), _insn(_RET_K, RET_ERRNO | EPERM)]
    return b"".join(out)
