"""Split-GGUF assets: parts joined in order, sha256 checked, clear errors for what is missing."""

from __future__ import annotations

import hashlib
import sys

import pytest

from hf_triforce import assets
from hf_triforce_bench import texts


@pytest.fixture
def part_packages(tmp_path, monkeypatch):
    """Three importable fake part packages on sys.path, as the split PyPI packages lay them out."""
    blobs = [b"GGUF" + bytes(range(200)), b"middle" * 1000, b"end"]
    for index, blob in enumerate(blobs, start=1):
        package = tmp_path / "site" / f"fakepart{index}"
        (package / "data").mkdir(parents=True)
        (package / "data" / f"part{index:02d}.bin").write_bytes(blob)
        (package / "__init__.py").write_text(
            "import os\ndef get_part_path():\n"
            f"    return os.path.join(os.path.dirname(__file__), 'data', 'part{index:02d}.bin')\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("HF_TRIFORCE_CACHE", str(tmp_path / "cache"))
    yield b"".join(blobs)
    for index in range(1, 4):
        sys.modules.pop(f"fakepart{index}", None)


def test_parts_are_joined_in_order_and_checked(part_packages):
    asset = assets.GGUFAsset("fake", "fakeparts==1", hashlib.sha256(part_packages).hexdigest(),
                             parts=("fakepart1", "fakepart2", "fakepart3"))
    path = assets.gguf_path(asset)
    assert path.read_bytes() == part_packages
    assert assets.gguf_path(asset) == path  # joined once, then reused
    (path.parent / "fake.sha256").unlink()  # interrupted between the join and its marker: joined again
    assert assets.gguf_path(asset).read_bytes() == part_packages


def test_a_wrong_sha256_leaves_nothing_behind(part_packages):
    asset = assets.GGUFAsset("fake", "fakeparts==1", "0" * 64, parts=("fakepart1", "fakepart2", "fakepart3"))
    with pytest.raises(RuntimeError, match="does not match the expected 0000"):
        assets.gguf_path(asset)
    assert not list((assets.cache_root() / "gguf").glob("fake.gguf*"))
    swapped = assets.GGUFAsset("fake", "fakeparts==1", hashlib.sha256(part_packages).hexdigest(),
                               parts=("fakepart2", "fakepart1", "fakepart3"))
    with pytest.raises(RuntimeError, match="sha256"):
        assets.gguf_path(swapped)


def test_a_missing_part_package_names_the_install(part_packages):
    asset = assets.GGUFAsset("fake", "fakeparts==1", "0" * 64, parts=("fakepart1", "fakepart9"))
    with pytest.raises(FileNotFoundError, match="'fakepart9' is not installed: pip install fakeparts==1"):
        assets.gguf_path(asset)


def test_registered_models_and_texts():
    assert set(assets.MODELS) == {"smollm2-135m", "qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}
    assert len(assets.QWEN_CODER_1_5B.parts) == 22 and len(assets.QWEN_CODER_0_5B.parts) == 6
    assert all(len(a.sha256) == 64 for a in assets.MODELS.values())
    assert "def " in texts.TEXTS["python"]()[:100000]
    wikipedia = texts.TEXTS["wikipedia"]()
    assert wikipedia.startswith("Normans\n\nThe Normans (Norman: Nourmands;") and len(wikipedia) > 900_000
    with pytest.raises(FileNotFoundError, match="must be one of"):
        assets.load_model("no-such-model")
