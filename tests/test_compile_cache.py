"""The compile cache holds code that runs as us: a folder someone else could write is refused
(naming the folder and the fix), and a cached file whose content is not what its name promises
is rebuilt, never run."""
from __future__ import annotations

import os
import stat
import sys

import numpy as np
import pytest

import dtensor
from dtensor.compile import c_backend, cache, native, numpy_backend

OTHER_UID = 12345  # tests run as root: chown can hand a folder to another user


def _source(value: float) -> str:
    """A generated module of numpy_backend's shape whose run returns ``value``."""
    return f"# test module {value}\ndef run(I, S, F, K, B):\n    return ({value},)\n"


@pytest.fixture
def default_dir(monkeypatch, tmp_path):
    """The default cache folder (no DTENSOR_COMPILE_CACHE), in a temp dir of this test's."""
    monkeypatch.delenv(cache.ENV, raising=False)
    monkeypatch.setattr(cache.tempfile, "tempdir", str(tmp_path))
    return tmp_path / f"dtensor-compile-{os.getuid()}"


def _fresh(source):
    """Forget an already imported copy, so the file is read again."""
    digest = __import__("hashlib").sha256(source.encode()).hexdigest()[:16]
    sys.modules.pop(f"dtensor_dtc_{digest}", None)
    return digest


def _plant_0777(d):
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)  # mkdir's mode is cut by the umask


def _foreign(d):
    d.mkdir(mode=0o700)
    os.chown(d, OTHER_UID, OTHER_UID)


def _group_writable(d):
    d.mkdir()
    os.chmod(d, 0o770)


def _symlink(d):
    target = d.parent / "elsewhere"
    target.mkdir(mode=0o700)
    d.symlink_to(target)


def _a_file(d):
    d.write_text("not a folder")


UNSAFE = [("world-writable 0777", _plant_0777, r"writable by its group or by others \(mode 0777"),
          ("owned by another uid", _foreign, rf"owned by uid {OTHER_UID}, not by this user"),
          ("group-writable 0770", _group_writable, r"mode 0770"),
          ("a symlink", _symlink, r"a symbolic link \(to .*elsewhere"),
          ("a file", _a_file, r"not a folder")]


@pytest.mark.parametrize("name,make,why", UNSAFE, ids=[u[0] for u in UNSAFE])
def test_an_unsafe_cache_folder_is_refused_naming_it_and_the_fix(default_dir, name, make, why):
    """A folder pre-created under the predictable default name with a module planted under the
    hashed name: compiling refuses the folder, and the planted value never comes back."""
    source = _source(2.0)
    digest = _fresh(source)
    make(default_dir)
    if default_dir.is_dir():
        planted = default_dir / f"dtc_{digest}.py"
        planted.write_text(_source(999.0).replace("999.0", "999.0  # planted"))
        os.chmod(planted, 0o666)
    with pytest.raises(cache.CacheDirError, match=why) as err:
        numpy_backend.load(source)
    text = str(err.value)
    assert str(default_dir) in text and "DTENSOR_COMPILE_CACHE" in text and "rm -rf" in text
    # The same through dtensor.compile, with its own generated module planted.
    with pytest.raises(cache.CacheDirError, match=why):
        dtensor.compile(lambda x: x * 2.0)(dtensor.ones(3))


def test_a_planted_module_in_a_0777_folder_is_never_imported(default_dir, monkeypatch,
                                                             tmp_path):
    """The attack end to end: compile once in a private folder to learn the generated file's
    name, plant a module returning 999 under that name in a 0777 folder at the default path,
    and compile again."""
    def step(x):
        return x * 2.0

    monkeypatch.setenv(cache.ENV, str(tmp_path / "mine"))
    run = dtensor.compile(step)
    np.testing.assert_array_equal(run(dtensor.ones(3)).numpy(), [2.0] * 3)
    name = os.path.basename(run.last.path)
    sys.modules.pop(f"dtensor_{name[:-3]}", None)
    monkeypatch.delenv(cache.ENV)
    _plant_0777(default_dir)
    (default_dir / name).write_text("def run(I, S, F, K, B):\n    return (I[0] * 0 + 999,)\n")
    with pytest.raises(cache.CacheDirError, match=str(default_dir)):
        dtensor.compile(step)(dtensor.ones(3))


def test_a_missing_folder_is_made_private_and_a_readable_one_of_ours_is_closed(default_dir):
    numpy_backend.load(_source(1.0))
    assert stat.S_IMODE(os.lstat(default_dir).st_mode) == 0o700
    os.chmod(default_dir, 0o755)  # an older dtensor's folder: ours, only readable by others
    numpy_backend.load(_source(1.5))
    assert stat.S_IMODE(os.lstat(default_dir).st_mode) == 0o700


CORRUPT_PY = [("truncated", lambda src: src[:len(src) // 2]),
              ("other content", lambda src: _source(999.0)),
              ("empty", lambda src: "")]


@pytest.mark.parametrize("name,corrupt", CORRUPT_PY, ids=[c[0] for c in CORRUPT_PY])
def test_a_corrupt_cached_module_is_rewritten_not_run(monkeypatch, tmp_path, name, corrupt):
    monkeypatch.setenv(cache.ENV, str(tmp_path))
    source = _source(3.0 + len(name))
    digest = _fresh(source)
    path = tmp_path / f"dtc_{digest}.py"
    path.write_text(corrupt(source))
    run, got_path = numpy_backend.load(source)
    assert run(None, None, None, None, None) == (3.0 + len(name),)
    assert got_path == str(path) and path.read_text() == source


def test_a_compiled_function_is_right_after_its_cached_file_was_corrupted(monkeypatch,
                                                                         tmp_path):
    monkeypatch.setenv(cache.ENV, str(tmp_path))

    def triple(x):
        return x * 3.0

    first = dtensor.compile(triple)
    first(dtensor.ones(2))
    path = first.last.path
    sys.modules.pop(f"dtensor_{os.path.basename(path)[:-3]}", None)
    with open(path, "w") as f:
        f.write("def run(I, S, F, K, B):\n    return (I[0] * 0 + 999,)\n")
    np.testing.assert_array_equal(dtensor.compile(triple)(dtensor.ones(2)).numpy(), [3.0, 3.0])


CORRUPT_SO = [("garbage", lambda so: b"\x7fELF garbage"),
              ("truncated", lambda so: so[:len(so) // 2]),
              ("sidecar missing", None)]


@pytest.mark.parametrize("name,corrupt", CORRUPT_SO, ids=[c[0] for c in CORRUPT_SO])
def test_a_corrupt_cached_library_is_rebuilt(monkeypatch, tmp_path, name, corrupt):
    """The library is planted before this process ever loaded it (a loaded library stays
    mapped under its name), with a sidecar digest that no longer matches it."""
    monkeypatch.setenv(cache.ENV, str(tmp_path))
    answer = 40 + len(name)
    source = c_backend.PRELUDE + f"int dt_answer(void) {{ return {answer}; }}\n"
    stem = native._library_stem(source, native._compiler())
    other = tmp_path / "other"  # a real library of the same source, built elsewhere
    monkeypatch.setenv(cache.ENV, str(other))
    native.build(source)
    with open(native._library_stem(source, native._compiler()) + ".so", "rb") as f:
        good = f.read()
    monkeypatch.setenv(cache.ENV, str(tmp_path))
    with open(stem + ".so", "wb") as f:
        f.write(good if corrupt is None else corrupt(good))
    if corrupt is not None:
        with open(stem + ".so.sha256", "wb") as f:
            f.write(native._digest(good))
    assert native.build(source).dt_answer() == answer
    with open(stem + ".so", "rb") as so, open(stem + ".so.sha256", "rb") as digest:
        assert native._digest(so.read()) == digest.read()


def _parent_foreign_0777(base):
    p = base / "shared"
    p.mkdir()
    os.chmod(p, 0o777)
    os.chown(p, OTHER_UID, OTHER_UID)
    return p / "cache", p


def _parent_ours_0777(base):
    p = base / "shared"
    p.mkdir()
    os.chmod(p, 0o777)
    return p / "cache", p


def _symlinked_parent_into_foreign(base):
    _, p = _parent_foreign_0777(base)
    (base / "link").symlink_to(p)
    return base / "link" / "cache", p


def _foreign_symlink_into_ours(base):
    (base / "mine").mkdir(mode=0o700)
    link = base / "link"
    link.symlink_to(base / "mine")
    os.lchown(link, OTHER_UID, OTHER_UID)
    return link / "cache", link


def _foreign_grandparent(base):
    _, p = _parent_foreign_0777(base)
    (p / "sub").mkdir(mode=0o700)
    return p / "sub" / "cache", p


def _relative_link_through_dotdot(base):
    _, p = _parent_ours_0777(base)
    (base / "d").mkdir(mode=0o700)
    (base / "d" / "link").symlink_to("../shared")
    return base / "d" / "link" / "cache", p


def _parent_a_file(base):
    (base / "afile").write_text("x")
    return base / "afile" / "cache", base / "afile"


BAD_ANCESTORS = [
    ("parent 0777 of another uid", _parent_foreign_0777, "owned by uid 12345"),
    ("parent 0777 of ours, not sticky", _parent_ours_0777, r"without the sticky bit \(mode 0777"),
    ("symlinked parent into a foreign folder", _symlinked_parent_into_foreign, "owned by uid"),
    ("parent symlink of another uid", _foreign_symlink_into_ours, "symbolic link .* owned by"),
    ("grandparent of another uid", _foreign_grandparent, "owned by uid 12345"),
    ("relative link with ..", _relative_link_through_dotdot, "without the sticky bit"),
    ("parent is a file", _parent_a_file, "not a folder"),
]


@pytest.mark.parametrize("name,make,why", BAD_ANCESTORS, ids=[b[0] for b in BAD_ANCESTORS])
def test_a_cache_folder_under_an_unsafe_ancestor_is_refused_naming_it(monkeypatch, tmp_path,
                                                                       name, make, why):
    """Whoever can write an ancestor (or repoint a link on the way) can swap the cache folder
    for theirs after the check: refused, naming the ancestor; nothing is created under it."""
    d, culprit = make(tmp_path)
    monkeypatch.setenv(cache.ENV, str(d))
    with pytest.raises(cache.CacheDirError, match=why) as e:
        cache.cache_dir()
    assert repr(str(culprit)) in str(e.value) and cache.ENV in str(e.value)
    assert not os.path.lexists(d)


GOOD_ANCESTORS = [("sticky 1777 parent (as /tmp)", 0o1777), ("private parent", 0o700),
                  ("readable 0755 parent", 0o755)]


@pytest.mark.parametrize("name,mode", GOOD_ANCESTORS, ids=[g[0] for g in GOOD_ANCESTORS])
def test_a_cache_folder_under_safe_ancestors_is_used(monkeypatch, tmp_path, name, mode):
    p = tmp_path / "parent"
    p.mkdir()
    os.chmod(p, mode)
    (tmp_path / "link").symlink_to(p)  # a link of ours on the way is fine
    monkeypatch.setenv(cache.ENV, str(tmp_path / "link" / "deeper" / "cache"))
    d = cache.cache_dir()
    assert os.path.isdir(d) and stat.S_IMODE(os.stat(d).st_mode) == 0o700


def _planted_library(tmp_path, marker):
    """A library whose load constructor writes ``marker``."""
    import subprocess
    src = tmp_path / "evil.c"
    src.write_text('#include <stdio.h>\n__attribute__((constructor)) static void p(void)'
                   f'{{FILE*f=fopen("{marker}","w");fputs("ran",f);fclose(f);}}\n')
    subprocess.run([native._compiler(), "-shared", "-fPIC", "-o", str(tmp_path / "evil.so"),
                    str(src)], check=True)
    return (tmp_path / "evil.so").read_bytes()


PLANTS = [("owned by another uid", lambda p: os.chown(p, OTHER_UID, OTHER_UID)),
          ("group-writable", lambda p: os.chmod(p, 0o664)),
          ("a symlink", None)]


@pytest.mark.parametrize("name,spoil", PLANTS, ids=[p[0] for p in PLANTS])
def test_a_planted_library_with_a_matching_digest_never_loads(monkeypatch, tmp_path, name, spoil):
    """What a folder swapped after the check would hold: a library not private to us with the
    digest anyone can compute beside it. It is rebuilt, never loaded (its constructor would
    run), and the library loaded is the one checked (read through the same descriptor)."""
    marker = tmp_path / "PWNED"
    evil = _planted_library(tmp_path, marker)
    monkeypatch.setenv(cache.ENV, str(tmp_path / "cache"))
    answer = 50 + len(name)
    source = c_backend.PRELUDE + f"int dt_answer(void) {{ return {answer}; }}\n"
    lib = native._library_stem(source, native._compiler()) + ".so"
    if spoil is None:
        (tmp_path / "elsewhere.so").write_bytes(evil)
        os.symlink(tmp_path / "elsewhere.so", lib)
    else:
        with open(lib, "wb") as f:
            f.write(evil)
        spoil(lib)
    with open(lib + ".sha256", "wb") as f:
        f.write(native._digest(evil))
    assert native.build(source).dt_answer() == answer
    assert not marker.exists()
