"""docs/*/verification.md, the page that says what was checked against SGLang's own code, names every conformance test
file, so a new check against SGLang is listed where users look for it."""

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
CONFORMANCE = REPO / "tests" / "conformance"


@pytest.mark.parametrize("lang", ["en", "zh"])
def test_verification_page_names_every_conformance_test_file(lang):
    page = REPO / "docs" / lang / "verification.md"
    text = page.read_text()
    files = sorted(p.name for p in CONFORMANCE.glob("test_*.py"))
    assert files, f"no test files under {CONFORMANCE}"
    missing = [name for name in files if f"`{name}`" not in text]
    assert not missing, (f"{page.relative_to(REPO)} does not name {missing}: add each to its table "
                         "'The conformance suite, file by file' (and the capability rows it backs)")
