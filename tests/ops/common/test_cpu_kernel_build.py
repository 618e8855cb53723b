"""Finding, building and loading the CPU decode kernel (``attnops.ops.common.cpu_kernels``): the row layout check, one
build per key across processes, the fallback cache directory, ``CXX``/``CXXFLAGS`` splitting, the temp-dir sweep,
the CPU tag and compiler identity in the key, and ``python -m attnops build-kernels``."""
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from attnops.__main__ import main
from attnops.ops.common import cpu_kernels
from attnops.ops.common.cpu_kernels import build, layout
from attnops.ops.common.cpu_kernels.cpu_tag import cpu_tag
from attnops._core.errors import PerformanceWarning

REPO = Path(__file__).resolve().parents[2]
GXX = shutil.which("g++") or shutil.which("c++")
needs_compiler = pytest.mark.skipif(GXX is None, reason="no C++ compiler")


def _script(path: Path, text: str) -> Path:
    path.write_text("#!/bin/sh\n" + text)
    path.chmod(0o755)
    return path


def _fake_compiler(tmp_path: Path, version: str = "fakecxx 1.0", name: str = "fakecxx") -> Path:
    """A compiler that logs each compile to ``$FAKE_CXX_LOG``, takes a second and writes an empty output file."""
    return _script(tmp_path / name, f'[ "$1" = --version ] && {{ echo "{version}"; exit 0; }}\n'
                                    'echo compile >> "$FAKE_CXX_LOG"; sleep 1\n'
                                    'while [ $# -gt 1 ]; do [ "$1" = -o ] && out="$2"; shift; done\n: > "$out"\n')


@pytest.fixture
def fake_env(monkeypatch, tmp_path):
    """An empty cache directory and the fake compiler as ``CXX``; returns (cache dir, compile log)."""
    log = tmp_path / "compiles.log"
    monkeypatch.setenv("ATTNOPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", str(_fake_compiler(tmp_path)))
    monkeypatch.setenv("FAKE_CXX_LOG", str(log))
    monkeypatch.delenv("CXXFLAGS", raising=False)
    monkeypatch.delenv("ATTNOPS_CPU_ARCH", raising=False)
    return tmp_path / "cache", log


def _loaded(path: Path) -> SimpleNamespace:
    """Stands in for :func:`cpu_kernels._load` on the fake compiler's empty output."""
    return SimpleNamespace()


def _compiles(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


# ---- the row layout ----------------------------------------------------------------------------------------------

def test_run_columns_and_chunk_rows_follow_the_field_names():
    names = layout.run_columns(layout.KEY, layout.VALUE, "blocks", "length", layout.KEY_FACTORS,
                               layout.VALUE_FACTORS)
    assert names == list(layout.RUN_FIELDS) and len(set(names)) == 20
    q = torch.zeros(2, 3, 4)
    row = dict(zip(layout.CHUNK_FIELDS, layout.chunk_row(q, (11, 12), 13, (torch.float16, torch.int8), 5,
                                                         (21, 22, 23), 24), strict=True))
    assert row == dict(q=q.data_ptr(), q_bf16=0, scale=0, heads=2, rows=3, d=4, dv=5, kt=1, vt=3, runs=11,
                       nruns=12, tokens=13, m_out=21, l_out=22, o_out=23, p_out=24)
    raw = torch.zeros(2, 3, 4, dtype=torch.bfloat16)
    fields = dict(zip(layout.QUERY, layout.query_fields(q, (raw, 0.125)), strict=True))
    assert fields == dict(q=q.data_ptr(), q_bf16=raw.data_ptr(), scale=0x3E000000)  # 0.125's fp32 bits


@pytest.mark.parametrize("raw, named", [(torch.zeros(2, 3, 4), "torch.float32"),
                                        (torch.zeros(2, 4, 3, dtype=torch.bfloat16).transpose(1, 2), "False"),
                                        (torch.zeros(2, 3, 5, dtype=torch.bfloat16), "(2, 3, 5)")])
def test_an_unscaled_query_must_be_contiguous_bf16_of_the_query_shape(raw, named):
    with pytest.raises(ValueError, match="unscaled query") as caught:
        layout.query_fields(torch.zeros(2, 3, 4), (raw, 0.5))
    assert named in str(caught.value)


def test_a_paged_call_names_every_tensor_and_stride():
    q, out = torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 4, 6)
    key, value = torch.zeros(7, 8, 3, 5, dtype=torch.bfloat16), torch.zeros(7, 8, 3, 6, dtype=torch.bfloat16)
    table, lengths = torch.zeros(2, 9, dtype=torch.int32), torch.zeros(2, dtype=torch.int64)
    picks = torch.zeros(2, 3, 10, dtype=torch.int64)
    call = dict(zip(layout.PAGED_CALL_FIELDS, layout.paged_call(q, key, value, table, lengths, out, picks, 16),
                    strict=True))
    assert call == dict(q=q.data_ptr(), q_bf16=0, scale=0, batch=2, kv_heads=3, group=4, d=5, dv=6, k_addr=key.data_ptr(), k_sb=120,
                        k_sp=15, k_sn=5, kt=2, v_addr=value.data_ptr(), v_sb=144, v_sp=18, v_sn=6, vt=2, blocks=7,
                        page=8, table=table.data_ptr(), table_sb=9, table_si=1, table_len=9, table_wide=0,
                        lengths=lengths.data_ptr(), picks=picks.data_ptr(), picks_sb=30, picks_sn=10, picks_si=1,
                        count=10, picks_wide=1, unit=16, out=out.data_ptr(), probs=0)


def test_a_layout_difference_is_named():
    assert layout.mismatch(layout.describe()) is None
    ours, theirs = f"version {layout.VERSION}", f"version {layout.VERSION + 1}"
    other = layout.describe().replace(ours, theirs)
    assert layout.mismatch(other) == f"the library's row layout has '{theirs}' where attnops expects '{ours}'"
    swapped = layout.describe().replace("blocks:8 length:9", "length:8 blocks:9")
    assert "'Run k_addr:0" in layout.mismatch(swapped) and "length:8 blocks:9" in layout.mismatch(swapped)


@needs_compiler
def test_the_built_library_reports_the_layout_attnops_fills():
    assert cpu_kernels.library() is not None, cpu_kernels.status()
    describe = cpu_kernels.library().attnops_row_layout
    assert describe().decode() == layout.describe()


@needs_compiler
def test_a_library_with_another_layout_is_refused_and_the_pytorch_path_serves(monkeypatch):
    """As if the C++ struct had changed: attnops' field order differs from the library's (simulated here)."""
    fields = list(layout.RUN_FIELDS)
    fields[8], fields[9] = fields[9], fields[8]
    monkeypatch.setattr(layout, "RUN_FIELDS", tuple(fields))
    monkeypatch.setattr(cpu_kernels, "_state", {})
    with pytest.warns(PerformanceWarning, match="row layout has 'Run .*length:9"):
        assert cpu_kernels.library() is None
    assert cpu_kernels.status().startswith("pure PyTorch (refused: ")
    assert cpu_kernels.location() is None


# ---- one build per key across processes --------------------------------------------------------------------------

_BUILDER = """
import sys, time
from pathlib import Path
from attnops.ops.common.cpu_kernels import build
print("ready", flush=True)
while not Path(sys.argv[1]).exists():
    time.sleep(0.005)
path, built = build.find_or_build(build.recipe(openmp=False))
print(path, built)
"""


def test_processes_starting_at_once_compile_once(fake_env, tmp_path):
    cache, log = fake_env
    go = tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    procs = [subprocess.Popen([sys.executable, "-c", _BUILDER, str(go)], stdout=subprocess.PIPE, text=True, env=env)
             for _ in range(2)]
    for p in procs:
        assert p.stdout.readline() == "ready\n"
    go.touch()
    results = [p.communicate(timeout=120)[0].split() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert _compiles(log) == 1
    assert results[0][0] == results[1][0] and Path(results[0][0]).parent == cache
    assert sorted(built for _, built in results) == ["False", "True"]


# ---- the cache directory -----------------------------------------------------------------------------------------

def test_a_cache_directory_that_cannot_be_written_falls_back_with_a_warning(fake_env, monkeypatch, tmp_path):
    """A directory under a regular file cannot be created, whoever runs the test (root included)."""
    (tmp_path / "file").write_text("")
    configured = tmp_path / "file" / "cache"
    monkeypatch.setenv("ATTNOPS_CACHE_DIR", str(configured))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    with pytest.warns(UserWarning, match=f"{configured} cannot be written .* built in {tmp_path / 'tmp'}/attnops-"):
        path, built = build.find_or_build(build.recipe(openmp=False))
    assert built and path.parent == build.fallback_dir() and path.parent.parent == tmp_path / "tmp"
    assert path.parent.stat().st_mode & 0o777 == 0o700
    with pytest.warns(UserWarning, match="cannot be written"):
        assert build.find_or_build(build.recipe(openmp=False)) == (path, False)  # found there next time
    assert _compiles(fake_env[1]) == 1


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root writes to read-only directories")
def test_a_read_only_cache_directory_falls_back(fake_env, monkeypatch, tmp_path):
    cache, _ = fake_env
    cache.mkdir()
    cache.chmod(0o555)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    try:
        with pytest.warns(UserWarning, match=f"{cache} cannot be written"):
            assert build.writable_dir() == build.fallback_dir()
    finally:
        cache.chmod(0o755)


def test_a_fallback_directory_others_can_write_is_not_used(fake_env, monkeypatch, tmp_path):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("ATTNOPS_CACHE_DIR", str(tmp_path / "file" / "cache"))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    build.fallback_dir().mkdir()
    build.fallback_dir().chmod(0o777)
    with pytest.raises(build.BuildError, match="is not this user's own"):
        build.writable_dir()


def test_a_library_in_the_configured_directory_is_used_without_building(fake_env):
    cache, log = fake_env
    recipe = build.recipe(openmp=False)
    cache.mkdir()
    (cache / recipe.file_name).write_text("")
    assert build.find_or_build(recipe) == (cache / recipe.file_name, False)
    assert _compiles(log) == 0


# ---- the compiler command ----------------------------------------------------------------------------------------

def test_cxx_and_cxxflags_reach_the_compiler_split_like_a_shell(fake_env, monkeypatch, tmp_path):
    """The fake compiler's twin of the real build below: ``CXX="wrapper compiler"`` runs the wrapper with the
    compiler as its first argument; ``CXXFLAGS`` come last and keep quoted words whole."""
    log = tmp_path / "wrapped.log"
    wrapper = _script(tmp_path / "wrapper", f'echo "$@" >> "{log}"\nexec "$@"\n')
    fake = os.environ["CXX"]
    monkeypatch.setenv("CXX", f"{wrapper} {fake}")
    monkeypatch.setenv("CXXFLAGS", "-O0 '-DATTNOPS_NOTE=a b'")
    recipe = build.recipe(openmp=False)
    assert recipe.command == (str(wrapper), fake) and recipe.flags[-2:] == ("-O0", "-DATTNOPS_NOTE=a b")
    path, built = build.find_or_build(recipe)
    compile_line = [line for line in log.read_text().splitlines() if "--version" not in line]
    assert built and len(compile_line) == 1 and compile_line[0].startswith(f"{fake} -O3 ")
    assert " -O0 -DATTNOPS_NOTE=a b " in compile_line[0]
    assert path.parent == fake_env[0]


@pytest.mark.slow  # a real compile; the twin above runs the fake compiler
@needs_compiler
def test_cxx_and_cxxflags_are_split_like_a_shell(monkeypatch, tmp_path):
    """``CXX="wrapper g++"`` (as ``ccache g++``) runs the wrapper with the compiler as its first argument;
    ``CXXFLAGS`` come last (here ``-O0`` overrides ``-O3``) and keep quoted words whole."""
    log = tmp_path / "wrapped.log"
    wrapper = _script(tmp_path / "wrapper", f'echo "$@" >> "{log}"\nexec "$@"\n')
    monkeypatch.setenv("CXX", f"{wrapper} {GXX}")
    monkeypatch.setenv("CXXFLAGS", "-O0 '-DATTNOPS_NOTE=a b'")
    monkeypatch.setenv("ATTNOPS_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cpu_kernels, "_state", {})
    recipe = build.recipe(openmp=False)
    assert recipe.command == (str(wrapper), GXX) and recipe.flags[-2:] == ("-O0", "-DATTNOPS_NOTE=a b")
    assert cpu_kernels.library() is not None, cpu_kernels.status()
    compile_line = [line for line in log.read_text().splitlines() if "--version" not in line]
    assert len(compile_line) == 1 and compile_line[0].startswith(f"{GXX} -O3 ")
    assert " -O0 -DATTNOPS_NOTE=a b " in compile_line[0]
    assert cpu_kernels.location().startswith(str(tmp_path / "cache"))


def test_badly_quoted_cxx_is_a_build_error(monkeypatch):
    monkeypatch.setenv("CXX", "'g++")
    with pytest.raises(build.BuildError, match="CXX=\"'g\\+\\+\" cannot be split"):
        build.recipe(openmp=False)


def test_the_compiler_identity_and_the_cpu_are_in_the_key(fake_env, monkeypatch, tmp_path):
    first = build.recipe(openmp=False)
    assert first.compiler == "fakecxx 1.0"
    _fake_compiler(tmp_path, "fakecxx 2.0")  # the same command, upgraded
    upgraded = build.recipe(openmp=False)
    assert upgraded.command == first.command and upgraded.file_name != first.file_name
    monkeypatch.setattr(build, "cpu_tag", lambda: "x86_64 avx2 #00000000")
    assert build.recipe(openmp=False).file_name != upgraded.file_name
    monkeypatch.setenv("ATTNOPS_CPU_ARCH", "haswell")
    portable = build.recipe(openmp=False)
    assert portable.cpu == "portable (-march=haswell)" and "-march=haswell" in portable.flags


def test_the_included_headers_are_in_the_key(fake_env, monkeypatch, tmp_path):
    """A change in a header the source includes gives another library (a cached one built before is not loaded)."""
    for name in (build.SOURCE.name, *build.EXTRA_SOURCES, *build.HEADERS):
        (tmp_path / name).write_bytes(build.SOURCE.with_name(name).read_bytes())
    monkeypatch.setattr(build, "SOURCE", tmp_path / build.SOURCE.name)
    recipe = build.recipe(openmp=False)
    before = recipe.file_name
    header = tmp_path / build.HEADERS[0]
    header.write_text(header.read_text() + "// changed\n")
    assert recipe.file_name != before


# ---- temporary build directories ---------------------------------------------------------------------------------

def test_a_build_sweeps_stale_build_directories_and_keeps_running_ones(fake_env):
    """A killed build's directory (old) goes, another process's build directory (fresh) and other files stay."""
    cache, _ = fake_env
    stale, running, other = cache / f"{build.TEMP_PREFIX}old", cache / f"{build.TEMP_PREFIX}new", cache / "other"
    for d in (stale, running, other):
        d.mkdir(parents=True)
        (d / "part.so").write_text("")
    old = time.time() - build.STALE_SECONDS - 60
    for d in (stale, other):
        os.utime(d, (old, old))
    path, built = build.find_or_build(build.recipe(openmp=False))
    assert built and path.is_file()
    assert not stale.exists() and running.exists() and other.exists()


def test_a_failed_build_leaves_neither_a_library_nor_a_temporary_directory(fake_env, monkeypatch, tmp_path):
    cache, _ = fake_env
    monkeypatch.setenv("CXX", str(_script(tmp_path / "broken", '[ "$1" = --version ] && { echo broken 1; exit 0; }\n'
                                                              'echo "no such option" >&2; exit 1\n')))
    with pytest.raises(build.BuildError, match="failed: no such option"):
        build.find_or_build(build.recipe(openmp=False))
    assert [p.suffix for p in cache.iterdir()] == [".lock"]


# ---- the CPU tag -------------------------------------------------------------------------------------------------

_X86 = "processor\t: {i}\nmodel name\t: Some CPU\nflags\t\t: fpu sse4_2 avx avx2 fma f16c {extra}\n\n"
_ARM = "processor\t: {i}\nFeatures\t: fp asimd evtstrm {extra}\nCPU implementer\t: 0x41\nCPU part\t: {part}\n\n"


def _cpuinfo(tmp_path: Path, text: str) -> Path:
    path = tmp_path / f"cpuinfo{len(list(tmp_path.iterdir()))}"
    path.write_text(text)
    return path


def test_x86_tags_name_the_isa_and_differ_with_it(tmp_path):
    avx2 = cpu_tag(_cpuinfo(tmp_path, _X86.format(i=0, extra="")), machine="x86_64")
    avx512 = cpu_tag(_cpuinfo(tmp_path, _X86.format(i=0, extra="avx512f avx512bw")), machine="x86_64")
    gfni = cpu_tag(_cpuinfo(tmp_path, _X86.format(i=0, extra="gfni")), machine="x86_64")
    assert avx2.startswith("x86_64 sse4_2+avx+avx2+fma+f16c #")
    assert avx512.startswith("x86_64 sse4_2+avx+avx2+fma+f16c+avx512f+avx512bw #")
    assert len({avx2, avx512, gfni}) == 3  # an unnamed feature still changes the digest


def test_aarch64_tags_are_not_empty_and_differ_by_features_and_core(tmp_path):
    n1 = cpu_tag(_cpuinfo(tmp_path, _ARM.format(i=0, extra="asimddp", part="0xd0c")), machine="aarch64")
    v1 = cpu_tag(_cpuinfo(tmp_path, _ARM.format(i=0, extra="asimddp sve bf16 i8mm", part="0xd40")), machine="aarch64")
    other_core = cpu_tag(_cpuinfo(tmp_path, _ARM.format(i=0, extra="asimddp", part="0xd4f")), machine="aarch64")
    big_little = cpu_tag(_cpuinfo(tmp_path, _ARM.format(i=0, extra="asimddp", part="0xd0c")
                                  + _ARM.format(i=1, extra="asimddp", part="0xd05")), machine="aarch64")
    assert n1.startswith("aarch64 asimd+asimddp #") and v1.startswith("aarch64 asimd+asimddp+bf16+i8mm+sve #")
    assert len({n1, v1, other_core, big_little}) == 4


def test_macos_tags_come_from_sysctl(tmp_path):
    m1 = "machdep.cpu.brand_string: Apple M1\nhw.optional.neon: 1\nhw.optional.arm.FEAT_BF16: 0\n"
    m2 = "machdep.cpu.brand_string: Apple M2\nhw.optional.neon: 1\nhw.optional.arm.FEAT_BF16: 1\n"
    intel = "machdep.cpu.features: FPU SSE4.2 AVX1.0 F16C\nmachdep.cpu.leaf7_features: AVX2 FMA AVX512F\n"
    assert cpu_tag(sysctl=m1, machine="arm64").startswith("arm64 baseline #")
    assert cpu_tag(sysctl=m2, machine="arm64").startswith("arm64 bf16 #")
    assert cpu_tag(sysctl=intel, machine="x86_64").startswith("x86_64 sse4_2+avx2+fma+f16c+avx512f #")


def test_an_unreadable_cpuinfo_still_gives_a_tag(tmp_path):
    assert cpu_tag(tmp_path / "missing", sysctl=None, machine="riscv64").startswith("riscv64 baseline #")


# ---- python -m attnops build-kernels -----------------------------------------------------------------------------

def test_build_kernels_reports_a_build_then_the_cached_library(fake_env, monkeypatch, capsys):
    """The fake compiler's twin of the real build below."""
    cache, log = fake_env
    monkeypatch.setattr(cpu_kernels, "_load", _loaded)
    assert main(["build-kernels"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"CPU decode kernel: built: {cache}/attnops_cpu_decode_")
    assert out[1] == f"CPU tag: {cpu_tag()}"
    assert main(["build-kernels"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == out[0].replace("built:", "already cached:")
    assert _compiles(log) == 1


@pytest.mark.slow  # a real compile; the twin above runs the fake compiler
@needs_compiler
def test_build_kernels_builds_then_finds_it_cached(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ATTNOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXXFLAGS", "-O0")
    assert main(["build-kernels"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith(f"CPU decode kernel: built: {tmp_path}/attnops_cpu_decode_")
    assert out[1] == f"CPU tag: {cpu_tag()}"
    assert main(["build-kernels"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == out[0].replace("built:", "already cached:")


def test_build_kernels_fails_when_it_cannot_build(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("ATTNOPS_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "false")
    assert main(["build-kernels"]) == 1
    assert capsys.readouterr().err.startswith("CPU decode kernel: cannot be built or loaded: false --version failed")
