"""Which BLAS MLX's CPU backend multiplies with, and how to give it a fast one.

The Linux `mlx[cpu]` wheel links the reference (netlib) BLAS: its matrix
products are 20-30x slower than an optimised library's. libmlx asks the
dynamic linker for `cblas_sgemm`, and the linker searches the global scope
(LD_PRELOAD included) before libmlx's own dependencies — so a library with
the standard CBLAS symbols, preloaded, takes the reference BLAS's place.
Measured here (256 x 2048 x 6144 float32 product, one thread): reference
1454 ms, Debian's OpenBLAS 67 ms, oneMKL from PyPI (`pip install mkl`) 77 ms.

`in_use()` reads what this process really calls; the rest finds libraries
and builds the environment that preloads one. Shared by ranks (which
re-execute themselves with it), the launcher and the benchmark.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import platform
import shutil
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

CHOICES = ("auto", "openblas", "mkl", "reference")


class BlasUnavailable(RuntimeError):
    """The BLAS asked for is not installed; the message says how to install it."""


@dataclass(frozen=True)
class BlasInfo:
    name: str  # "OpenBLAS" | "oneMKL" | "BLIS" | "Accelerate" | "reference" | "unknown"
    version: str
    library: str  # the file that provides cblas_sgemm
    threads: int = 1  # the threads its products run on, as the library reports (1 where it cannot)

    @property
    def reference(self) -> bool:
        return self.name == "reference"

    @property
    def label(self) -> str:
        return " ".join(filter(None, [self.name, self.version]))


@functools.cache
def openblas_paths() -> tuple[Path, ...]:
    """Where distributions put OpenBLAS (Debian/Ubuntu, Fedora, Arch), then the linker's cache
    (asked once: find_library runs ldconfig)."""
    arch = sysconfig.get_config_var("MULTIARCH") or f"{os.uname().machine}-linux-gnu"
    paths = [Path(f"/usr/lib/{arch}/openblas-{v}/libopenblas.so.0") for v in ("pthread", "openmp", "serial")]
    paths += [Path("/usr/lib64/libopenblasp.so.0"), Path("/usr/lib64/libopenblas.so.0"),
              Path("/usr/lib/libopenblas.so.0")]
    found = ctypes.util.find_library("openblas")
    if found:
        paths.append(Path(found) if os.path.isabs(found) else Path(f"/usr/lib/{arch}") / found)
    return tuple(paths)


def mkl_paths() -> list[Path]:
    """oneMKL as `pip install mkl` puts it: in this environment's lib folder."""
    return sorted(Path(sys.prefix, "lib").glob("libmkl_rt.so.*"), reverse=True)


def find(kind: str) -> Path | None:
    paths = {"openblas": openblas_paths, "mkl": mkl_paths}[kind]()
    return next((p for p in paths if p.is_file()), None)


def install_hint() -> str:
    """The one command that gives this machine a fast BLAS."""
    for tool, command in (("apt-get", "sudo apt-get install libopenblas0-pthread"),
                          ("dnf", "sudo dnf install openblas"), ("pacman", "sudo pacman -S openblas")):
        if shutil.which(tool):
            return f"{command} (or, without root: {sys.executable} -m pip install mkl)"
    return f"{sys.executable} -m pip install mkl"


def choose(choice: str) -> tuple[str, Path | None]:
    """The library for a --blas choice: auto takes the fastest installed one."""
    if choice == "reference" or sys.platform != "linux":
        return "reference", None  # elsewhere MLX links the platform's own (Accelerate on macOS)
    if choice == "auto":
        for kind in ("openblas", "mkl"):
            if (path := find(kind)) is not None:
                return kind, path
        return "reference", None
    path = find(choice)
    if path is None:
        raise BlasUnavailable(f"--blas {choice}: no {choice} library found; install one with: "
                              f"{install_hint()}")
    return choice, path


def preload_environment(choice: str, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: ours) with the chosen BLAS preloaded and any other known one removed."""
    env = dict(os.environ if env is None else env)
    _, path = choose(choice)
    known = {str(p) for p in (*openblas_paths(), *mkl_paths())}
    kept = [p for p in env.get("LD_PRELOAD", "").split() if p not in known]
    preload = " ".join(([str(path)] if path else []) + kept)
    if preload:
        env["LD_PRELOAD"] = preload
    else:
        env.pop("LD_PRELOAD", None)
    return env


THREAD_VARIABLES = ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "OMP_NUM_THREADS")
# An idle OpenBLAS thread spins 2^28 cycles before it sleeps (0.3.21's default). A rank has two pools,
# MLX's (the preloaded library) and numpy's (its own copy, for attention tiles), that take turns
# every layer: each spins on the cores the other needs. 2^4 cycles: a 2-thread rank decoding over
# 8K keys took 110 ms a token instead of 283.
SPIN = {"OPENBLAS_THREAD_TIMEOUT": "4"}


def usable_cores() -> int:
    """The cores this process may run on (its affinity, which --cpu and taskset narrow)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def cpu_name() -> str:
    """The CPU's model name, as /proc/cpuinfo gives it (else what the platform module says)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_allowance() -> float:
    """Cores' worth of CPU time this process may use: its cores, capped by its cgroup's CPU quota
    (v2 cpu.max; v1 cpu.cfs_quota_us over cpu.cfs_period_us)."""
    cores = float(usable_cores())
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return cores
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":
            limit = _read_words(Path(f"/sys/fs/cgroup{group}/cpu.max"))
        elif "cpu" in controllers.split(","):
            root = Path("/sys/fs/cgroup") / controllers / group.lstrip("/")
            limit = _read_words(root / "cpu.cfs_quota_us") + _read_words(root / "cpu.cfs_period_us")
        else:
            continue
        if len(limit) == 2 and limit[0].isdigit() and int(limit[1]) > 0:  # "max" or -1: no quota
            cores = min(cores, int(limit[0]) / int(limit[1]))
    return cores


def _read_words(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        return []


def shared_threads(sharing: int, cores: int | None = None) -> int:
    """BLAS threads for each of `sharing` processes that share this machine's cores (its CPU allowance,
    which a quota narrows): at least one."""
    return max(1, int(cpu_allowance() if cores is None else cores) // max(1, sharing))


def thread_environment(threads: int, env: dict[str, str] | None = None) -> dict[str, str]:
    """`env` (default: ours) with every BLAS (MLX's, numpy's, OpenMP's) set to `threads` threads: the
    libraries read these once, when they load."""
    return dict(os.environ if env is None else env) | {name: str(threads) for name in THREAD_VARIABLES} | SPIN


def rerun_preloaded(args: list[str], env: dict[str, str]) -> None:
    """Re-execute `python *args` (`-m module ...` or `script ...`) in `env`, unless this process
    already has its preload and BLAS threads."""
    if any(env.get(name) != os.environ.get(name) for name in ("LD_PRELOAD", *THREAD_VARIABLES, *SPIN)):
        sys.stdout.flush()
        os.execve(sys.executable, [sys.executable, *args], env)


def in_use() -> BlasInfo:
    """The library that really serves MLX's cblas_sgemm in this process."""
    import mlx.core  # noqa: F401  (libmlx must be loaded for its own dependency to show)

    address = _address(ctypes.CDLL(None), "cblas_sgemm")  # the global scope: preloads win
    if address is None:
        libmlx = next(Path(mlx.core.__file__).parent.glob("lib/libmlx.*"), None)
        if libmlx is not None:
            address = _address(ctypes.CDLL(str(libmlx), mode=os.RTLD_NOLOAD | os.RTLD_LAZY), "cblas_sgemm")
    if address is None:
        return BlasInfo("unknown", "", "")
    return describe(_library_of(address))


def describe(library: str) -> BlasInfo:
    """Name and version of a loaded BLAS library, from its own reporting functions."""
    lib = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_LAZY) if library else None
    if lib is not None and hasattr(lib, "openblas_get_config"):
        lib.openblas_get_config.restype = ctypes.c_char_p
        lib.openblas_get_corename.restype = ctypes.c_char_p
        version = lib.openblas_get_config().decode().split()[1]
        return BlasInfo("OpenBLAS", f"{version} {lib.openblas_get_corename().decode()}", library,
                        lib.openblas_get_num_threads())
    if lib is not None and hasattr(lib, "MKL_Get_Version_String"):
        buf = ctypes.create_string_buffer(256)
        lib.MKL_Get_Version_String(buf, len(buf))
        words = buf.value.decode().split()
        version = words[words.index("Version") + 1] if "Version" in words else ""
        return BlasInfo("oneMKL", version.split("-")[0], library, lib.MKL_Get_Max_Threads())
    if lib is not None and hasattr(lib, "bli_info_get_version_str"):
        lib.bli_info_get_version_str.restype = ctypes.c_char_p
        return BlasInfo("BLIS", lib.bli_info_get_version_str().decode(), library)
    if "Accelerate" in library or "vecLib" in library:
        return BlasInfo("Accelerate", "", library)
    if Path(library).name.startswith("libblas"):  # netlib's name; the mlx[cpu] wheel bundles it
        return BlasInfo("reference", "", library)
    return BlasInfo("unknown", Path(library).name, library)


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def _address(lib: ctypes.CDLL, symbol: str) -> int | None:
    try:
        return ctypes.cast(getattr(lib, symbol), ctypes.c_void_p).value
    except AttributeError:
        return None


def _library_of(address: int) -> str:
    info = _DlInfo()
    dladdr = ctypes.CDLL(None).dladdr
    dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return ""
    return os.path.realpath(info.dli_fname.decode())


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    """Run MLX's BLAS (OpenBLAS or oneMKL, as `in_use` finds it) with `n` threads inside the block,
    then as before; nothing changes for any other library."""
    library = in_use().library
    lib = ctypes.CDLL(library, mode=os.RTLD_NOLOAD | os.RTLD_LAZY) if library else None
    get, put = None, None
    if hasattr(lib, "openblas_set_num_threads"):
        get, put = lib.openblas_get_num_threads, lib.openblas_set_num_threads
    elif hasattr(lib, "MKL_Set_Num_Threads"):
        get, put = lib.MKL_Get_Max_Threads, lib.MKL_Set_Num_Threads
    before = get() if get else 0
    if put and n != before:
        put(n)
    try:
        yield
    finally:
        if put and n != before:
            put(before)
