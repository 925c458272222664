"""gpuwait's PyTorch hook (gpuwait/pyhook/sitecustomize.py), run as a job's Python runs it: first
on PYTHONPATH, against a stand-in torch of a chosen version, and against the real one if here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpuwait.runner.budget import HOOK_DIR

#: A stand-in for torch: its version, and torch.cuda's lazy initialisation as PyTorch has it
#: (calls queued by _lazy_call run when CUDA starts; a re-entrant _lazy_init returns at once).
STAND_IN_CUDA = textwrap.dedent(
    """
    import threading
    _tls = threading.local()
    _initialized = False
    _queued = []
    calls = []

    def device_count():
        return 2

    class _Properties:
        def __init__(self, total_memory):
            self.total_memory = total_memory

    def get_device_properties(device):
        return _Properties([16 << 30, 8 << 30][device])

    def is_initialized():
        return _initialized

    def _lazy_call(fn, **kwargs):
        if _initialized:
            fn()
        else:
            _queued.append(fn)

    def _lazy_init():
        global _initialized
        if _initialized or hasattr(_tls, "is_initializing"):
            return
        _tls.is_initializing = True
        try:
            for fn in _queued:
                fn()
        finally:
            del _tls.is_initializing
        _initialized = True

    _current = 0

    def current_device():
        _lazy_init()
        return _current

    def set_device(device):
        global _current
        _lazy_init()
        _current = device

    def set_per_process_memory_fraction(fraction, device=None):
        # PyTorch's C++ side makes the device current to read its memory, and leaves it so.
        global _current
        _lazy_init()
        calls.append([fraction, device])
        _current = device
    """
)

PROBE = textwrap.dedent(
    """
    import json, os, sys
    import torch
    before = list(torch.cuda.calls)
    torch.cuda._lazy_init()
    print(json.dumps({
        "before_init": before,
        "after_init": torch.cuda.calls,
        "current_device": torch.cuda.current_device(),
        "conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
        "alloc_conf": os.environ.get("PYTORCH_ALLOC_CONF"),
    }))
    """
)


def stand_in_torch(root: Path, version: str) -> Path:
    package = root / "torch"
    (package / "cuda").mkdir(parents=True)
    (package / "__init__.py").write_text(
        "from torch import cuda\nfrom torch.version import __version__\n"
    )
    (package / "version.py").write_text(f"__version__ = '{version}'\ncuda = None\n")
    (package / "cuda" / "__init__.py").write_text(STAND_IN_CUDA)
    return root


def run_python(code: str, pythonpath: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("PYTORCH_", "GPUWAIT_"))}
    full["PYTHONPATH"] = ":".join(pythonpath)
    full.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=full, timeout=120
    )


def probe(tmp_path: Path, version: str, **env: str) -> dict[str, object]:
    torch_dir = stand_in_torch(tmp_path / "site", version)
    done = run_python(PROBE, [HOOK_DIR, str(torch_dir)], **env)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def test_an_older_torch_is_capped_when_cuda_starts_not_at_import(tmp_path: Path) -> None:
    seen = probe(tmp_path, "2.5.1+cu121", GPUWAIT_TORCH_MEMORY_FRACTION="0.25")
    # Importing torch started nothing; the cap is applied once CUDA initialises, per device.
    assert seen["before_init"] == []
    assert seen["after_init"] == [[0.25, 0], [0.25, 1]]
    assert seen["conf"] is None and seen["alloc_conf"] is None
    # Capping every device leaves the program on the device it would have had: `.cuda()` and
    # torch.device("cuda") still mean device 0, not the last one capped.
    assert seen["current_device"] == 0


def test_a_torch_with_the_allocator_key_gets_it_in_its_settings(tmp_path: Path) -> None:
    seen = probe(tmp_path, "2.13.0", GPUWAIT_TORCH_MEMORY_FRACTION="0.25")
    assert seen["conf"] == "per_process_memory_fraction:0.25"
    assert seen["alloc_conf"] is None
    assert seen["after_init"] == []  # the allocator enforces it itself


@pytest.mark.parametrize("version", ["2.5.0", "2.13.0"])
def test_each_card_of_a_mixed_gang_is_capped_at_the_reservation(
    tmp_path: Path, version: str
) -> None:
    # 6 GiB on a 16 GiB and an 8 GiB card: one fraction for both would give the smaller 3 GiB.
    seen = probe(
        tmp_path,
        version,
        GPUWAIT_TORCH_MEMORY_FRACTION="0.375",
        GPUWAIT_TORCH_MEMORY_BYTES=str(6 << 30),
    )
    assert seen["after_init"] == [[0.375, 0], [0.75, 1]]
    assert seen["conf"] is None


def test_the_key_goes_where_the_users_own_settings_are(tmp_path: Path) -> None:
    seen = probe(
        tmp_path,
        "2.10.0",
        GPUWAIT_TORCH_MEMORY_FRACTION="0.5",
        PYTORCH_ALLOC_CONF="expandable_segments:True",
    )
    # PyTorch 2.10+ reads PYTORCH_CUDA_ALLOC_CONF first: setting it would hide the user's own.
    assert seen["conf"] is None
    assert seen["alloc_conf"] == "expandable_segments:True,per_process_memory_fraction:0.5"


@pytest.mark.parametrize("version", ["2.5.0", "2.13.0"])
def test_a_users_own_cap_is_kept(tmp_path: Path, version: str) -> None:
    seen = probe(
        tmp_path,
        version,
        GPUWAIT_TORCH_MEMORY_FRACTION="0.25",
        PYTORCH_CUDA_ALLOC_CONF="per_process_memory_fraction:0.9",
    )
    assert seen["conf"] == "per_process_memory_fraction:0.9"
    assert seen["after_init"] == []


def test_without_gpuwaits_variable_the_hook_does_nothing(tmp_path: Path) -> None:
    seen = probe(tmp_path, "2.5.0")
    assert seen["after_init"] == [] and seen["conf"] is None


def test_the_users_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITECUSTOMIZE'] = 'ran'\n")
    done = run_python(
        "import os, sitecustomize; print(os.environ.get('OWN_SITECUSTOMIZE'), "
        "sitecustomize.__file__)",
        [HOOK_DIR, str(own)],
        GPUWAIT_TORCH_MEMORY_FRACTION="0.25",
    )
    assert done.returncode == 0, done.stderr
    ran, module = done.stdout.split()
    assert ran == "ran"
    assert module == str(own / "sitecustomize.py")


@pytest.mark.parametrize("other", ["another install", "a symlink"])
def test_a_hook_of_an_enclosing_job_on_pythonpath_runs_neither_twice_nor_for_ever(
    tmp_path: Path, other: str
) -> None:
    # A job started inside another gpuwait's job (another install's, or this one's reached by
    # another path) inherits that hook's directory behind its own: each hook ran the other as
    # the sitecustomize it hides, and every Python started printed "Error in sitecustomize ...
    # RecursionError", the user's own never ran, and torch was watched 200 times over.
    hook = Path(HOOK_DIR)
    if other == "a symlink":
        enclosing = tmp_path / "link"
        enclosing.symlink_to(hook)
    else:
        enclosing = tmp_path / "venv2" / "gpuwait" / "pyhook"
        enclosing.mkdir(parents=True)
        (enclosing / "sitecustomize.py").write_text((hook / "sitecustomize.py").read_text())
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['OWN_SITECUSTOMIZE'] = 'ran'\n")
    torch_dir = stand_in_torch(tmp_path / "site", "2.5.1")
    code = (
        "import os, sys, json, torch\n"
        "torch.cuda._lazy_init()\n"
        "print(json.dumps([os.environ.get('OWN_SITECUSTOMIZE'), torch.cuda.calls]))"
    )
    done = run_python(
        code,
        [HOOK_DIR, str(enclosing), str(own), str(torch_dir)],
        GPUWAIT_TORCH_MEMORY_FRACTION="0.25",
    )
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    ran, calls = json.loads(done.stdout)
    assert ran == "ran"
    assert len(calls) == 2, calls  # each of the two devices capped once


def test_a_program_without_torch_is_untouched(tmp_path: Path) -> None:
    done = run_python(
        "import json, sys; print('ok')", [HOOK_DIR], GPUWAIT_TORCH_MEMORY_FRACTION="0.25"
    )
    assert (done.returncode, done.stdout, done.stderr) == (0, "ok\n", "")


def test_a_torch_that_fails_to_import_fails_as_it_would(tmp_path: Path) -> None:
    torch_dir = stand_in_torch(tmp_path / "site", "2.5.0")
    (torch_dir / "torch" / "__init__.py").write_text("raise ImportError('broken install')\n")
    done = run_python(
        "import torch", [HOOK_DIR, str(torch_dir)], GPUWAIT_TORCH_MEMORY_FRACTION="0.25"
    )
    assert done.returncode == 1
    assert done.stderr.rstrip().endswith("ImportError: broken install")
    assert "gpuwait:" not in done.stderr  # the hook has nothing to say about it


def test_the_real_torch_imports_cleanly_with_the_hook() -> None:
    try:
        import importlib.util

        if importlib.util.find_spec("torch") is None:
            pytest.skip("torch is not installed here (CI installs its CPU build)")
    except ValueError:
        pytest.skip("torch is not importable")
    code = (
        "import os, torch; x = torch.ones(4); print(torch.__version__, "
        "os.environ.get('PYTORCH_CUDA_ALLOC_CONF'), int(x.sum()))"
    )
    bare = run_python(code, [])
    hooked = run_python(code, [HOOK_DIR], GPUWAIT_TORCH_MEMORY_FRACTION="0.25")
    assert bare.returncode == 0, bare.stderr
    assert hooked.returncode == 0, hooked.stderr
    # Whatever torch itself says on import, the hook adds nothing to it.
    assert hooked.stderr == bare.stderr
    version, conf, total = hooked.stdout.split()
    assert total == "4"
    major, minor = (int(p) for p in version.split("+")[0].split(".")[:2])
    if (major, minor) >= (2, 10):
        assert conf == "per_process_memory_fraction:0.25"
    else:
        assert conf == "None"
