"""The sessions quoted in README.md and docs/*.md are what dpprof prints now
(scripts/readme_numbers.py)."""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).parent.parent / "scripts" / "readme_numbers.py"


def _script() -> ModuleType:
    if "readme_numbers" in sys.modules:  # one module, so its runs are shared between tests
        return sys.modules["readme_numbers"]
    spec = importlib.util.spec_from_file_location("readme_numbers", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def _quoted_blocks() -> list[tuple[Path, str]]:
    mod = _script()
    return [(page, name) for page in mod.pages()
            for name in mod.block_names(page.read_text(encoding="utf-8"))]


def test_the_readme_and_the_pages_quote_sessions() -> None:
    blocks = {(page.name, name) for page, name in _quoted_blocks()}
    assert {("README.md", "compare"), ("README.md", "run"), ("maxbatch.md", "maxbatch"),
            ("run.md", "run-full"), ("scenarios.md", "compare-full")} <= blocks


@pytest.mark.parametrize(("page", "name"), _quoted_blocks(),
                         ids=lambda v: v.name if isinstance(v, Path) else v)
def test_each_page_quotes_what_dpprof_prints(page: Path, name: str) -> None:
    mod = _script()
    assert name in mod.SESSIONS, f"{page.name} quotes an unknown session {name!r}"
    fresh = mod.run_session(mod.SESSIONS[name])
    quoted = mod.quoted(page.read_text(encoding="utf-8"), name)
    assert mod.normalised(fresh) == mod.normalised(quoted), (
        f"{page.name}'s {name} session is stale: rerun python scripts/readme_numbers.py")


def test_a_stale_block_in_a_page_is_found_and_rewritten(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _script()
    docs = tmp_path / "docs"
    docs.mkdir()
    shutil.copy(mod.README, tmp_path / "README.md")
    text = (mod.DOCS / "maxbatch.md").read_text(encoding="utf-8")
    quoted = mod.quoted(text, "maxbatch")
    stale = docs / "maxbatch.md"
    batch = re.search(r"dp-loss-primary +(\d+) ", quoted).group(1)  # type: ignore[union-attr]
    stale.write_text(text.replace(quoted, quoted.replace(f" {batch} ", " 999 ")), encoding="utf-8")
    monkeypatch.setattr(mod, "README", tmp_path / "README.md")  # ROOT stays: the sessions' files
    monkeypatch.setattr(mod, "DOCS", docs)
    assert mod.main(["--check", "maxbatch"]) == 1
    assert mod.main(["maxbatch"]) == 0
    assert mod.quoted(stale.read_text(encoding="utf-8"), "maxbatch") == quoted
    assert mod.main(["--check"]) == 0  # the README's blocks, untouched, are current too


def test_a_block_naming_no_session_fails_the_check(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    mod = _script()
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "<!-- readme-numbers: no-such -->\n```\nx\n```\n<!-- /readme-numbers -->\n",
        encoding="utf-8")
    monkeypatch.setattr(mod, "README", tmp_path / "README.md")
    monkeypatch.setattr(mod, "DOCS", tmp_path / "docs")
    assert mod.main(["--check"]) == 1


def test_how_the_machine_sealed_a_run_is_not_a_stale_session() -> None:
    """The pages quote whichever seal the regenerating machine had; the check accepts the
    other, rewrapped, and nothing else."""
    mod = _script()
    hook = ("dpprof: running t.py; its writes go to a private overlay\n"
            "the script wrote nothing (each run was sealed by Python's file calls (no mount "
            "namespace here: an audit\nhook stops a write around them)); your files are as "
            "they were after every run (1 checked)\nstopped after 3 step(s) (the first); 0.4 s")
    kernel = ("dpprof: running t.py; its writes go to a private overlay (mount namespace)\n"
              "the script wrote nothing (each run was sealed by Python's file calls and the "
              "kernel's mount namespace); your\nfiles are as they were after every run (1 "
              "checked)\nstopped after 3 step(s) (the first); 12.5 s")
    assert mod.normalised(hook) == mod.normalised(kernel)
    assert mod.normalised(hook) != mod.normalised(hook.replace("(1 checked)", "(2 checked)"))
