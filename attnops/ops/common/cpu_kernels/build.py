"""The decode kernel's shared library on disk: found in the cache, or built once.

A :class:`Recipe` is the compiler command (``$CXX`` split like a shell, else ``c++``/``g++``/``clang++``), the
flags (``-march=$ATTNOPS_CPU_ARCH``, default ``native``; ``$CXXFLAGS`` appended last) and what else the result
depends on: the compiler's identity (the first line of ``--version``) and, for a ``native`` build, the CPU tag
(:mod:`.cpu_tag`). The library's file name carries a digest of all of it, of the sources and of the headers they
include (:data:`HEADERS`).

:func:`find_or_build` looks in the cache directory (``$ATTNOPS_CACHE_DIR``, default ``~/.cache/attnops``); one
that cannot be written is replaced by a per-user directory under the system temp dir, with a warning naming both.
A build holds a lock file next to its output (``fcntl.flock``; without ``fcntl`` there is no lock), so processes
starting at once compile once and the others load its result; it compiles into a temporary directory and renames
the library into place, and sweeps temporary directories that killed builds left behind.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

from .cpu_tag import cpu_tag

try:
    import fcntl
except ImportError:  # not a POSIX system: builds are not serialised across processes
    fcntl = None

SOURCE = Path(__file__).with_name("decode.cpp")
HEADERS = ("threads.h", "amx.h")  # beside SOURCE, included by it: part of the key
EXTRA_SOURCES = ("softmax.cpp", "gemm_bf16.cpp")  # beside SOURCE, compiled into the same library: part of the key
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno")
TEMP_PREFIX = ".attnops-build-"  # temporary build directories in a cache directory
STALE_SECONDS = 15 * 60  # a temporary directory this old belongs to no running build (builds time out sooner)
COMPILE_TIMEOUT = 300


class BuildError(RuntimeError):
    """The library can be neither found nor built (the message says why)."""


class NoCompiler(BuildError):
    """No C++ compiler: ``$CXX`` is unset and none is on the ``PATH``."""


@dataclass(frozen=True)
class Recipe:
    """Everything a build depends on besides the source."""

    command: tuple[str, ...]
    flags: tuple[str, ...]
    compiler: str  # the first line of ``command --version``
    cpu: str  # the CPU tag of a ``-march=native`` build, else "portable (-march=...)"

    @property
    def file_name(self) -> str:
        parts = (*self.command, "\0", *self.flags, "\0", self.compiler, "\0", self.cpu)
        inputs = (*sources(), *(SOURCE.with_name(name) for name in HEADERS))
        text = b"".join(path.read_bytes() for path in inputs)
        key = hashlib.sha256(text + "\n".join(parts).encode()).hexdigest()[:16]
        return f"attnops_cpu_decode_{key}.so"


def sources() -> tuple[Path, ...]:
    """The files compiled into the library: :data:`SOURCE` and :data:`EXTRA_SOURCES`."""
    return (SOURCE, *(SOURCE.with_name(name) for name in EXTRA_SOURCES))


def compiler_command() -> tuple[str, ...]:
    """``$CXX`` split like a shell (``"ccache g++"`` is two words), else the first C++ compiler on the ``PATH``."""
    try:
        command = tuple(shlex.split(os.environ.get("CXX", "")))
    except ValueError as e:
        raise BuildError(f"CXX={os.environ['CXX']!r} cannot be split into words: {e}") from None
    if command:
        return command
    found = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if found is None:
        raise NoCompiler("no C++ compiler found (set CXX, or install g++)")
    return (found,)


def compiler_identity(command: tuple[str, ...]) -> str:
    """The first line of ``command --version`` (the compiler and its version)."""
    try:
        done = subprocess.run([*command, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise BuildError(f"{shlex.join(command)} --version failed: {e}") from None
    lines = (done.stdout or done.stderr).strip().splitlines()
    if done.returncode != 0 or not lines:
        raise BuildError(f"{shlex.join(command)} --version failed (exit {done.returncode})")
    return lines[0]


def recipe(openmp: bool) -> Recipe:
    """The recipe for this machine and environment, with ``-fopenmp`` when ``openmp``."""
    try:
        extra = tuple(shlex.split(os.environ.get("CXXFLAGS", "")))
    except ValueError as e:
        raise BuildError(f"CXXFLAGS={os.environ['CXXFLAGS']!r} cannot be split into words: {e}") from None
    arch = os.environ.get("ATTNOPS_CPU_ARCH") or "native"
    flags = _FLAGS + (f"-march={arch}",) + (("-fopenmp",) if openmp else ()) + extra
    command = compiler_command()
    return Recipe(command, flags, compiler_identity(command), cpu_tag() if arch == "native" else
                  f"portable (-march={arch})")


def cache_dir() -> Path:
    """The configured cache directory: ``$ATTNOPS_CACHE_DIR``, default ``~/.cache/attnops``."""
    return Path(os.environ.get("ATTNOPS_CACHE_DIR") or Path.home() / ".cache" / "attnops")


def fallback_dir() -> Path:
    """This user's cache directory under the system temp dir, for when :func:`cache_dir` cannot be written."""
    user = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return Path(tempfile.gettempdir()) / f"attnops-{user}"


def find_or_build(recipe: Recipe) -> tuple[Path, bool]:
    """The library of ``recipe`` and whether this call built it: from the configured cache directory (read-only
    is fine), else from the writable one (:func:`writable_dir`), built there under its lock when absent."""
    found = cache_dir() / recipe.file_name
    if found.is_file():
        return found, False
    target = writable_dir() / recipe.file_name
    with _locked(target.with_suffix(".lock")):
        if target.is_file():  # built meanwhile by the process that held the lock
            return target, False
        sweep(target.parent)
        _compile(recipe, target)
    return target, True


def writable_dir() -> Path:
    """:func:`cache_dir` if this process can create files there, else :func:`fallback_dir` (with a warning naming
    both); :class:`BuildError` when neither can be written."""
    configured = cache_dir()
    try:
        _probe(configured)
        return configured
    except OSError as e:
        reason = e
    fallback = fallback_dir()
    try:
        fallback.mkdir(mode=0o700, exist_ok=True)
        _probe(fallback)
    except OSError as e:
        raise BuildError(f"neither the cache directory {configured} ({reason}) nor {fallback} ({e}) can be "
                         "written; set ATTNOPS_CACHE_DIR") from None
    owner = fallback.stat()
    if hasattr(os, "getuid") and (owner.st_uid != os.getuid() or owner.st_mode & 0o022):
        raise BuildError(f"the cache directory {configured} cannot be written ({reason}) and the fallback "
                         f"{fallback} is not this user's own; set ATTNOPS_CACHE_DIR")
    warnings.warn(f"attnops: the cache directory {configured} cannot be written ({reason}); the CPU decode kernel "
                  f"is built in {fallback} instead (set ATTNOPS_CACHE_DIR to choose)", stacklevel=2)
    return fallback


def _probe(directory: Path) -> None:
    """Create ``directory`` and a temporary directory in it (removed again): OSError where that fails."""
    directory.mkdir(parents=True, exist_ok=True)
    os.rmdir(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=directory))


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an exclusive ``flock`` on ``path`` (created if absent); nothing where there is no ``fcntl``."""
    if fcntl is None:
        yield
        return
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def sweep(directory: Path) -> None:
    """Remove the temporary build directories in ``directory`` older than :data:`STALE_SECONDS` (left by killed
    builds; a running build's directory is younger)."""
    now = time.time()
    for path in directory.glob(TEMP_PREFIX + "*"):
        try:
            stale = path.is_dir() and now - path.stat().st_mtime > STALE_SECONDS
        except OSError:  # removed meanwhile
            continue
        if stale:
            shutil.rmtree(path, ignore_errors=True)


def _compile(recipe: Recipe, target: Path) -> None:
    """Compile :func:`sources` into a temporary directory beside ``target``, then rename the library onto it."""
    work = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=target.parent))
    try:
        out = work / target.name
        command = [*recipe.command, *recipe.flags, *map(str, sources()), "-o", str(out)]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT)
        except (OSError, subprocess.SubprocessError) as e:
            raise BuildError(f"{shlex.join(recipe.command)} could not run: {e}") from None
        if done.returncode != 0:
            raise BuildError(f"{shlex.join(recipe.command)} failed: {done.stderr.strip()[-2000:]}")
        os.replace(out, target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
