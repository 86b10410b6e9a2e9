"""Shared fixtures: the repository's models and the embedder beside the checkout."""
import os
import pathlib
import time

import pytest

import picaso

ROOT = pathlib.Path(__file__).resolve().parents[3]
BUNDLED = ROOT / "models" / "picaso-mamba2"
FIXTURES = ROOT / "testdata"
EMBEDDER = pathlib.Path(os.environ.get("PICASO_EMBEDDER", ROOT.parent / "shared" / "data" / "all-MiniLM-L6-v2"))


@pytest.fixture(scope="session")
def model():
    """The bundled Mamba-2 (it has a tokenizer, so text works)."""
    return picaso.Model.load(str(BUNDLED))


@pytest.fixture(scope="session")
def tiny():
    """A tiny random Mamba-2 from the transformers fixtures (token ids only)."""
    return picaso.Model.load(str(FIXTURES / "mamba2" / "g1" / "hf"))


@pytest.fixture(scope="session")
def embedder():
    """all-MiniLM-L6-v2: $PICASO_EMBEDDER or ../shared/data beside the checkout. CI has it, and
    there its absence fails the store tests instead of skipping them."""
    if not (EMBEDDER / "model.safetensors").is_file():
        if os.environ.get("CI"):
            pytest.fail(f"no embedder at {EMBEDDER} (set PICASO_EMBEDDER)")
        pytest.skip(f"no embedder at {EMBEDDER} (set PICASO_EMBEDDER)")
    return str(EMBEDDER)


def store_locations(tmp_path):
    """A folder store, and S3 + PostgreSQL when CI's services are configured (as the Rust tests do)."""
    out = [(str(tmp_path / "db"), None)]
    pg, s3 = os.environ.get("PICASO_TEST_POSTGRES"), os.environ.get("PICASO_TEST_S3")
    if pg and s3:
        unique = f"py_{os.getpid()}_{time.time_ns()}"
        sep = "&" if "?" in pg else "?"
        out.append((f"{pg}{sep}options=-csearch_path%3D{unique}%2Cpublic", f"{s3.rstrip('/')}/{unique}"))
    elif os.environ.get("PICASO_TEST_REQUIRE_BACKENDS"):
        pytest.fail("PICASO_TEST_REQUIRE_BACKENDS is set but PICASO_TEST_POSTGRES / PICASO_TEST_S3 are not")
    return out
