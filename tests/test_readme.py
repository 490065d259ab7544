"""The README's quoted sessions are what dpprof prints now (scripts/readme_numbers.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "readme_numbers.py"


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_numbers", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", ["compare", "maxbatch"])
def test_the_readme_quotes_what_dpprof_prints(name: str) -> None:
    mod = _script()
    fresh = mod.run_session(mod.SESSIONS[name])
    quoted = mod.quoted(mod.README.read_text(encoding="utf-8"), name)
    assert mod.normalised(fresh) == mod.normalised(quoted), (
        f"README.md's {name} session is stale: rerun python scripts/readme_numbers.py")


def test_a_stale_block_is_found_and_rewritten(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _script()
    text = mod.README.read_text(encoding="utf-8")
    quoted = mod.quoted(text, "maxbatch")
    stale = tmp_path / "README.md"
    stale.write_text(text.replace(quoted, quoted.replace(" 544 ", " 999 ")), encoding="utf-8")
    monkeypatch.setattr(mod, "README", stale)
    assert mod.main(["--check", "maxbatch"]) == 1
    assert mod.main(["maxbatch"]) == 0
    assert mod.quoted(stale.read_text(encoding="utf-8"), "maxbatch") == quoted
